//! Ferry: "a durable job was committed with the request" as an executable
//! contract, for Rust services on PostgreSQL (production) or SQLite (embedded).
//!
//! One transaction commits the run, its first event, a claimable job, the
//! idempotency record and an outbox row ([`Ferry::create_run_idempotent`]).
//! Workers claim jobs under expiring, generation-fenced leases
//! ([`Jobs::claim`], [`worker::Worker`]); every later transition is a
//! compare-and-set on the lease. `ferry-relay` carries the outbox to Kafka.
//!
//! Each role has its own handle: [`Ferry`] holds what a service calls
//! (acceptance, the outbox, runs and events, cancel, schedules),
//! [`Ferry::jobs`] the lease protocol and maintenance a worker runs, and
//! [`Ferry::operator`] the audited operator calls the command line and the
//! console make.
//!
//! ```no_run
//! # async fn demo() -> ferry::Result<()> {
//! use ferry::{Ferry, NewRun};
//! let ferry = Ferry::builder("sqlite://ferry.db").migrate(true).connect().await?;
//! let accepted = ferry
//!     .create_run_idempotent(NewRun::new("acme", "charge", "key-1", serde_json::json!({"amount": 5})))
//!     .await?;
//! assert!(!accepted.replay);
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]
#![deny(clippy::print_stdout)]

mod audit;
pub mod effects;
mod engine;
pub mod error;
pub mod fingerprint;
pub mod jobs;
pub mod limits;
mod notify;
pub mod operator;
pub mod outbox;
pub mod queues;
pub mod retry;
pub mod runs;
pub mod schedules;
pub mod signal;
pub mod store;
pub mod telemetry;
pub mod time;
pub mod worker;

use std::sync::Arc;
use std::time::Duration;

pub use effects::{EffectRecord, EffectState, Reservation, Resolution};
pub use engine::Engine;
pub use error::{Error, Result};
pub use fingerprint::{fingerprint, redact, Fingerprint, FINGERPRINT_VERSION};
pub use jobs::{
    AttemptOutcome, Claimed, DeadJob, ErrorClass, JobAttempt, JobError, JobState, Jobs, Lease, QueueGauges,
};
pub use limits::Limits;
pub use notify::CHANNEL as NOTIFY_CHANNEL;
pub use operator::Operator;
pub use outbox::OutboxMessage;
pub use queues::{QueueInfo, QueueLimits, RateLimit};
pub use retry::RetryPolicy;
pub use runs::{
    Accepted, NewRun, OutboxRow, Run, RunCursor, RunEvent, RunFilter, RunLineage, RunPage, RunState, RunSummary, Start,
    MAX_PRIORITY, MIN_PRIORITY,
};
pub use schedules::{Every, FiredTick, Missed, Schedule, ScheduleChange};
pub use store::{connect, connect_with, migrate, Conn, ConnectOptions, Db, Tx};
pub use time::{Clock, Millis};

/// Default topic for run events (`run_queued`, `run_succeeded`, ...).
pub const DEFAULT_EVENTS_TOPIC: &str = "ferry.run-events";

/// The handle a service keeps: a pool, the clock, the limits and the outbox
/// settings. Cheap to clone. Its methods are the service API; the worker's
/// lease protocol is on [`Ferry::jobs`] and the operator's calls on
/// [`Ferry::operator`].
#[derive(Debug, Clone)]
pub struct Ferry {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    db: Db,
    clock: Clock,
    limits: Limits,
    /// `limits.max_document_bytes()`, computed once: it serializes an envelope.
    max_document_bytes: usize,
    lanes: i32,
    events_topic: String,
    notifier: notify::Notifier,
    /// Whether `enqueue_in` serializes same-key writers (see `outbox_key_locks`).
    outbox_key_locks: bool,
    /// What one priority level is worth in waiting, in ms (see `priority_aging`).
    priority_aging_ms: i64,
    /// Queues this process last found limited: their claims go to the
    /// limited claim first. Only a hint (a stale entry costs one statement).
    limited_queues: std::sync::Mutex<std::collections::HashSet<String>>,
}

/// Builds a [`Ferry`]: `Ferry::builder(url).migrate(true).connect()`.
#[derive(Debug, Clone)]
pub struct FerryBuilder {
    url: String,
    connect: ConnectOptions,
    clock: Clock,
    limits: Limits,
    events_topic: String,
    migrate: bool,
    /// Where migrations run when `url` goes through a transaction pooler.
    direct_url: Option<String>,
    notify_interval: Duration,
    outbox_key_locks: bool,
    priority_aging: Duration,
}

impl FerryBuilder {
    /// Pool size (default 16; SQLite caps it at 4).
    pub fn max_connections(mut self, n: u32) -> Self {
        self.connect.max_connections = n;
        self
    }

    /// PostgreSQL ends a session of this pool that holds a transaction
    /// open and idle longer than `limit` (see
    /// [`ConnectOptions::idle_in_transaction_timeout`]); default: the
    /// server's setting. For processes whose transactions never wait on
    /// anything but the database, such as `ferry-relay`.
    pub fn idle_in_transaction_timeout(mut self, limit: Duration) -> Self {
        self.connect.idle_in_transaction_timeout = Some(limit);
        self
    }

    /// The URL reaches PostgreSQL through a pooler in transaction mode
    /// (PgBouncer's `pool_mode = transaction`; default false; the URL
    /// parameter `pgbouncer=true` says the same). Everything that needs a
    /// session then does without one, visibly:
    ///
    /// - every statement is unnamed (planned on each call, never kept
    ///   prepared: PgBouncer 1.18 has no protocol-level prepared
    ///   statements) and runs inside a transaction, a transaction of its
    ///   own when it is outside one (see [`store::Route`]; the cost is in
    ///   `BENCHMARKS.md`);
    /// - no session `SET` ([`FerryBuilder::idle_in_transaction_timeout`]
    ///   is not applied: set it on the role);
    /// - [`FerryBuilder::migrate`] needs [`FerryBuilder::direct_url`]: the
    ///   migrator holds a session lock and prepares statements by name;
    /// - workers and relays wake up by polling instead of `LISTEN`, which
    ///   a transaction pooler never delivers to (a log line says so and
    ///   names the interval: the worker's `poll_interval`, the relay's
    ///   `--poll-interval`).
    ///
    /// Transactions, `NOTIFY` and transaction-scoped advisory locks work
    /// as they do directly. Transactions of your own that you pass to the
    /// `*_in` calls must be begun with sqlx (`begin`), not a `BEGIN`
    /// statement: a statement Ferry runs outside a transaction sqlx knows
    /// of gets one of its own. WAL capture's replication connection and
    /// slot making need a direct URL (the relay refuses a pooled one).
    pub fn transaction_pooler(mut self, yes: bool) -> Self {
        self.connect.transaction_pooler = yes;
        self
    }

    /// A URL that reaches the same database directly, for what needs a
    /// session of its own while the main URL goes through a transaction
    /// pooler: [`FerryBuilder::migrate`] runs there (one connection, closed
    /// after), as Prisma's `directUrl`. Unused when the main URL is direct.
    pub fn direct_url(mut self, url: impl Into<String>) -> Self {
        self.direct_url = Some(url.into());
        self
    }

    /// The clock every operation uses (default: the database clock).
    pub fn clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    /// Input limits (default [`Limits::default`]).
    pub fn limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Topic for run events (default [`DEFAULT_EVENTS_TOPIC`]).
    pub fn events_topic(mut self, topic: impl Into<String>) -> Self {
        self.events_topic = topic.into();
        self
    }

    /// Apply the embedded migrations on connect (default false: production
    /// runs `ferry-relay migrate` or [`migrate`] from a deploy job).
    pub fn migrate(mut self, yes: bool) -> Self {
        self.migrate = yes;
        self
    }

    /// Shortest gap between two wake-up NOTIFYs for one queue from this
    /// process (default 10 ms: commit → ack p50 43 ms against 171 ms at 50 ms,
    /// for 13–15 % of acceptance throughput at 16 clients; see BENCHMARKS.md).
    /// NOTIFY serializes commits, so it is coalesced;
    /// a wake-up skipped inside the interval is sent at its end (a trailing
    /// notification), so a row committed by then waits at most this long for
    /// its wake-up (one committed later falls back to the listener's poll).
    pub fn notify_interval(mut self, d: Duration) -> Self {
        self.notify_interval = d;
        self
    }

    /// Whether [`Ferry::enqueue_in`] keeps per-key commit order for any
    /// writer (default true). On PostgreSQL it takes a transaction-scoped
    /// advisory lock on a hash of `(topic, key)` before the row draws its id,
    /// so two transactions enqueueing one key commit in id order, the order
    /// the relay publishes in; without it, a later id can commit first and
    /// be published before an earlier one. Turn it off only when every
    /// writer of a key already serializes on a common row (the cost is in
    /// `BENCHMARKS.md`). SQLite serializes writers anyway; the setting
    /// changes nothing there.
    pub fn outbox_key_locks(mut self, yes: bool) -> Self {
        self.outbox_key_locks = yes;
        self
    }

    /// What one priority level is worth in waiting (default 1 minute, at
    /// most 1 day): a job of priority `p` is claimed as if it had become
    /// available `p` steps earlier, so it goes ahead of lower priorities
    /// unless they have waited longer than the difference (linear aging).
    /// Stored per job at acceptance, so a change applies to new jobs.
    pub fn priority_aging(mut self, step: Duration) -> Self {
        self.priority_aging = step;
        self
    }

    /// Connects (and migrates, if asked).
    pub async fn connect(self) -> Result<Ferry> {
        let db = connect_with(&self.url, &self.connect).await?;
        if self.migrate {
            match (db.route(), &self.direct_url) {
                (store::Route::TransactionPooler, Some(direct)) => {
                    let one = ConnectOptions {
                        max_connections: 1,
                        ..ConnectOptions::default()
                    };
                    let direct = connect_with(direct, &one).await?;
                    let migrated = migrate(&direct).await;
                    direct.close().await;
                    migrated?;
                }
                _ => migrate(&db).await?,
            }
        }
        self.build(db).await
    }

    /// Uses an existing pool instead of connecting.
    pub async fn build(self, db: Db) -> Result<Ferry> {
        self.limits.topic(&self.events_topic)?;
        let priority_aging_ms = time::duration_ms(self.priority_aging)?;
        if !(1..=86_400_000).contains(&priority_aging_ms) {
            return Err(Error::invalid("priority_aging", "must be 1 ms to 1 day"));
        }
        // An existing pool is taken as reaching its server directly unless
        // the builder says otherwise.
        let db = match db {
            Db::Postgres(p) if self.connect.transaction_pooler => {
                Db::Postgres(store::PgDb::new(p.pool().clone(), store::Route::TransactionPooler))
            }
            db => db,
        };
        let lanes = outbox::load_lanes(&db).await?;
        let notifier = notify::Notifier::new(self.notify_interval, &db);
        Ok(Ferry {
            inner: Arc::new(Inner {
                db,
                clock: self.clock,
                max_document_bytes: self.limits.max_document_bytes(),
                limits: self.limits,
                lanes,
                events_topic: self.events_topic,
                notifier,
                outbox_key_locks: self.outbox_key_locks,
                priority_aging_ms,
                limited_queues: Default::default(),
            }),
        })
    }
}

impl Ferry {
    /// Starts building a handle for `postgres://…` or `sqlite://…`.
    pub fn builder(url: impl Into<String>) -> FerryBuilder {
        FerryBuilder {
            url: url.into(),
            connect: ConnectOptions::default(),
            clock: Clock::Database,
            limits: Limits::default(),
            events_topic: DEFAULT_EVENTS_TOPIC.into(),
            migrate: false,
            direct_url: None,
            notify_interval: Duration::from_millis(10),
            outbox_key_locks: true,
            priority_aging: Duration::from_secs(60),
        }
    }

    /// The pool.
    pub fn db(&self) -> &Db {
        &self.inner.db
    }

    /// Whether this handle reaches PostgreSQL through a transaction pooler
    /// (see [`FerryBuilder::transaction_pooler`]).
    pub fn behind_transaction_pooler(&self) -> bool {
        self.inner.db.route() == store::Route::TransactionPooler
    }

    /// A wake-up listener for a loop that polls every `poll` otherwise:
    /// `LISTEN` on PostgreSQL, or, behind a transaction pooler (which
    /// never delivers notifications to a client), plain polling, said once
    /// in the log with the interval.
    pub async fn wakeup(&self, poll: Duration) -> store::Wakeup {
        if self.behind_transaction_pooler() {
            tracing::info!(
                poll_ms = poll.as_millis() as u64,
                "behind a transaction pooler: no LISTEN (a pooler never delivers notifications); polling instead"
            );
            return store::Wakeup::polling();
        }
        store::Wakeup::connect(&self.inner.db).await
    }

    /// The clock.
    pub fn clock(&self) -> &Clock {
        &self.inner.clock
    }

    /// The input limits.
    pub fn limits(&self) -> &Limits {
        &self.inner.limits
    }

    /// The number of outbox lanes fixed for this database.
    pub fn lanes(&self) -> i32 {
        self.inner.lanes
    }

    /// Starts a write transaction for use with the `*_in` calls.
    pub async fn begin(&self) -> Result<Tx> {
        self.inner.db.begin().await
    }

    /// The lease protocol (claim, renew, complete, fail, effect writes, all
    /// fenced by the lease generation) and maintenance (reaping, sweeps):
    /// what [`worker::Worker`] and [`worker::JobContext`] call.
    pub fn jobs(&self) -> Jobs<'_> {
        Jobs { ferry: self }
    }

    /// The operator calls (dead jobs and rows, replay and cancel with their
    /// audit entry, queue pauses and limits, run listing and lineage,
    /// schedule administration): what the `ferry` command line and the
    /// console call.
    pub fn operator(&self) -> Operator<'_> {
        Operator { ferry: self }
    }

    pub(crate) fn now(&self) -> Option<i64> {
        self.inner.clock.param()
    }

    /// Whether this process last found `queue` limited (a hint).
    pub(crate) fn limited_hint(&self, queue: &str) -> bool {
        self.inner
            .limited_queues
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(queue)
    }

    /// Records whether `queue` was found limited.
    pub(crate) fn set_limited_hint(&self, queue: &str, limited: bool) {
        let mut set = self.inner.limited_queues.lock().unwrap_or_else(|p| p.into_inner());
        if limited {
            if !set.contains(queue) {
                set.insert(queue.to_owned());
            }
        } else {
            set.remove(queue);
        }
    }
}

/// What a role handle ([`Jobs`], [`Operator`]) reaches through the [`Ferry`]
/// it borrows: the pool, the clock, the limits and the claim hint. Private to
/// the crate, so a handle's public surface is its role's calls alone.
pub(crate) trait Role {
    /// The handle this role borrows.
    fn ferry(&self) -> &Ferry;

    /// [`Ferry::db`].
    fn db(&self) -> &Db {
        self.ferry().db()
    }

    /// [`Ferry::limits`].
    fn limits(&self) -> &Limits {
        self.ferry().limits()
    }

    /// The instant the clock injects into statements (`None`: the database's).
    fn now(&self) -> Option<i64> {
        self.ferry().now()
    }

    /// [`Ferry::begin`].
    fn begin(&self) -> impl std::future::Future<Output = Result<Tx>> + Send {
        self.ferry().begin()
    }

    /// Whether this process last found `queue` limited (a hint).
    fn limited_hint(&self, queue: &str) -> bool {
        self.ferry().limited_hint(queue)
    }
}

impl Role for Jobs<'_> {
    fn ferry(&self) -> &Ferry {
        self.ferry
    }
}

impl Role for Operator<'_> {
    fn ferry(&self) -> &Ferry {
        self.ferry
    }
}
