//! The relay service: lane management, one publishing task per held lane
//! (or one WAL capture task, `--capture wal`), wake-ups, retention, the HTTP
//! endpoints, and graceful shutdown.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::store::{LaneLease, RelayStore};
use ferry::Ferry;
use rdkafka::producer::{FutureProducer, Producer};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::config::RelayConfig;
use crate::error::RelayError;
use crate::lane;
use crate::metrics::Metrics;
use crate::publish;
use crate::state::RelayState;

struct LaneTask {
    lease: LaneLease,
    /// Stop after the in-flight batch (surplus, shutdown).
    finish: CancellationToken,
    /// Stop at once (the lease is lost): publish nothing more.
    abort: CancellationToken,
}

impl RelayState {
    /// Refreshes the gauges that come from the database (backlog, oldest
    /// pending age, dead rows, the WAL capture slots, the job queues' oldest
    /// due job, expired leases and dead jobs); done every [`GAUGES_EVERY`]
    /// off the lane path, and at each scrape.
    pub async fn refresh_gauges(&self) {
        let operator = self.store.ferry().operator();
        match operator.outbox_backlog().await {
            Ok(b) => {
                self.metrics.backlog.set(b.pending);
                self.metrics.oldest_pending_age.set(b.oldest_age_ms() as f64 / 1000.0);
            }
            Err(e) => not_refreshed("outbox backlog", &e),
        }
        match operator.outbox_dead_count().await {
            Ok(n) => {
                self.metrics.dead_rows.set(n);
            }
            Err(e) => not_refreshed("dead rows", &e),
        }
        match operator.wal_slots().await {
            Ok(slots) => self.metrics.wal_slots.set(&slots),
            Err(e) => not_refreshed("WAL slots", &e),
        }
        match operator.queue_gauges().await {
            Ok(queues) => self.metrics.jobs.set(&queues),
            Err(e) => not_refreshed("job queues", &e),
        }
    }
}

/// A table gauge keeps its last value when its query fails (a role without
/// the grant after an upgrade, an overloaded database); the log says so, once
/// per refresh, with the error's code.
fn not_refreshed(what: &str, e: &ferry::Error) {
    tracing::warn!(gauges = what, code = e.code(), error = %e, "table gauges not refreshed; they keep their last values");
}

/// How often the relay refreshes its table gauges (a count over the pending
/// index and one over dead rows, index probes per job queue), whatever the
/// lane tick.
pub const GAUGES_EVERY: Duration = Duration::from_secs(5);

/// How often the producers' fatal error state is read (the shared one, the
/// lone re-send's and each further `--streams` stream's; see `Relay::run`):
/// a fatal error fails readiness within this, plus the time librdkafka takes
/// to raise it.
const FATAL_CHECK_EVERY: Duration = Duration::from_millis(250);

/// Ledger ranges a poll relay folds into row states per transaction at its
/// start (`RelayStore::fold_delivered`): a range holds about a second of
/// WAL capture's deliveries, so a transaction rewrites about this many
/// seconds' worth of rows.
pub const FOLD_BATCH: u32 = 16;

/// Folds the WAL capture's ledger into row states at a poll relay's start
/// ([`FOLD_BATCH`] ranges per transaction, `RelayStore::fold_delivered`)
/// until it is folded or `shutdown` comes; `false` when it came first (a
/// step cut short rolls back: the next start folds the rest). A transient
/// database error (unreachable, terminated, a lock or statement timeout) is
/// retried after the relay's backoff, as the lanes and WAL capture do; any
/// other is returned, as for the relay's other reads at start.
async fn fold_ledger<S: Future<Output = ()>>(
    store: &RelayStore,
    mut shutdown: std::pin::Pin<&mut S>,
) -> Result<bool, RelayError> {
    let mut backoff = lane::retry_backoff();
    let mut folded = 0;
    loop {
        let step = tokio::select! {
            step = store.fold_delivered(FOLD_BATCH) => step,
            _ = shutdown.as_mut() => return Ok(false),
        };
        match step {
            Ok(n) => {
                folded += n;
                backoff = lane::retry_backoff();
                if n < u64::from(FOLD_BATCH) {
                    if folded > 0 {
                        tracing::info!(
                            ranges = folded,
                            "folded the WAL capture's delivered ranges into the outbox rows"
                        );
                    }
                    return Ok(true);
                }
            }
            Err(e) if e.is_transient() => {
                tracing::warn!(error = %e, code = e.code(), "folding the delivered ranges failed; retrying after a backoff");
                tokio::select! {
                    _ = tokio::time::sleep(backoff.next().unwrap_or(Duration::from_secs(10))) => {}
                    _ = shutdown.as_mut() => return Ok(false),
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// How long the relay's database sessions may hold a transaction open and
/// idle before PostgreSQL ends them. Every relay transaction (a lane claim,
/// a fenced mark, the delivered ledger's mark under its advisory lock, the
/// ledger's fold) sends its statements back to back and takes
/// milliseconds; a relay frozen inside one (SIGSTOP, a paused VM) would
/// otherwise keep its locks, and every other relay of the group would wait
/// on them, for as long as it stays frozen. When it thaws, its session is
/// gone: the transaction rolled back, changed nothing, and the relay
/// reconnects.
pub const IDLE_IN_TRANSACTION_LIMIT: Duration = Duration::from_secs(5);

/// Connects the relay's handle to `url`: sessions are ended after
/// [`IDLE_IN_TRANSACTION_LIMIT`] idle in a transaction.
pub async fn connect(url: &str) -> ferry::Result<Ferry> {
    Ferry::builder(url)
        .idle_in_transaction_timeout(IDLE_IN_TRANSACTION_LIMIT)
        .connect()
        .await
}

/// A configured relay, not yet running: [`Relay::state`] gives tests and the
/// demo its metrics before [`Relay::run`] starts it.
pub struct Relay {
    cfg: RelayConfig,
    state: Arc<RelayState>,
    /// The shared idempotent producer (at least once); `None` with
    /// `--exactly-once`, where each lane has its own.
    producer: Option<FutureProducer>,
}

/// Binds `cfg.listen`, then runs a relay until `shutdown` resolves.
pub async fn run(cfg: RelayConfig, ferry: Ferry, shutdown: impl Future<Output = ()>) -> Result<(), RelayError> {
    let listener = tokio::net::TcpListener::bind(cfg.listen).await?;
    Relay::new(cfg, ferry)?.run(listener, shutdown).await
}

impl Relay {
    /// Validates `cfg` and creates the producer.
    pub fn new(cfg: RelayConfig, ferry: Ferry) -> Result<Relay, RelayError> {
        cfg.validate()?;
        // Exactly once: every lane makes its own transactional producer.
        let producer = if cfg.exactly_once {
            None
        } else {
            Some(publish::producer(&cfg)?)
        };
        let owner = cfg
            .relay_id
            .clone()
            .unwrap_or_else(|| format!("relay-{}", uuid::Uuid::now_v7().simple()));
        let state = Arc::new(RelayState {
            store: RelayStore::new(ferry),
            metrics: Metrics::new(),
            owner,
            ready: AtomicBool::new(false),
            fatal: CancellationToken::new(),
            stream_producers: Default::default(),
        });
        Ok(Relay { cfg, state, producer })
    }

    /// The shared state (metrics, owner).
    pub fn state(&self) -> Arc<RelayState> {
        self.state.clone()
    }

    /// Runs until `shutdown` resolves, then stops taking batches, finishes and
    /// marks the in-flight ones, releases the lanes it still holds and returns
    /// within the grace period.
    pub async fn run(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), RelayError> {
        let Relay { cfg, state, producer } = self;
        tokio::pin!(shutdown);
        let store = state.store.clone();
        // Loaded once: it scopes the default effect key of every record.
        let database_id: Arc<str> = store.ferry().database_id().await?.into();
        let owner = state.owner.clone();
        let lone = lane::LoneProducer::new(&cfg);
        let sink = match &producer {
            Some(p) => lane::Sink::Shared(p.clone(), lone.clone()),
            None => {
                let reader = crate::exactly_once::ensure_progress_topic(
                    &cfg,
                    store.ferry().lanes(),
                    state.metrics.takeover_waits.clone(),
                )
                .await?;
                lane::Sink::Transactional(Arc::new(reader))
            }
        };
        // WAL capture replaces the lanes (and their wake-ups) by one task.
        let wal = crate::wal::plan(&cfg, &store, &owner).await?;
        let cfg = Arc::new(cfg);
        let http_stop = CancellationToken::new();
        let http = tokio::spawn(crate::http::serve(listener, state.clone(), http_stop.clone()));
        let wake = Arc::new(lane::Wakes::new(store.ferry().lanes()));
        let listen_stop = CancellationToken::new();
        let polling = wal.is_none();
        // Shutdown came during the start-up fold: the loop below is skipped.
        let mut stopped = false;
        if polling {
            // After `--capture wal`: what its ledger covers becomes row
            // states before the lanes start (they skip covered rows anyway).
            stopped = !fold_ledger(&store, shutdown.as_mut()).await?;
            tokio::spawn(listen_for_wakeups(
                store.clone(),
                owner.clone(),
                wake.clone(),
                cfg.poll_interval,
                listen_stop.clone(),
            ));
        }
        // The table gauges, on their own task at a fixed low rate.
        {
            let (state, stop) = (state.clone(), listen_stop.clone());
            tokio::spawn(async move {
                let mut every = tokio::time::interval(GAUGES_EVERY);
                loop {
                    tokio::select! {
                        _ = every.tick() => state.refresh_gauges().await,
                        _ = stop.cancelled() => return,
                    }
                }
            });
        }

        let mut held: BTreeMap<i32, LaneTask> = BTreeMap::new();
        // Surplus lanes finishing their in-flight batch before release: still
        // ours in the database, so never mistaken for orphans meanwhile.
        let mut draining: BTreeMap<i32, (LaneLease, CancellationToken)> = BTreeMap::new();
        let mut tasks = JoinSet::new();
        let mut tick = tokio::time::interval(cfg.lease / 3);
        // Retention runs on its own task, so a large sweep never delays the
        // lane ticks that renew the leases.
        let sweep_stop = CancellationToken::new();
        if !cfg.delete_on_delivery {
            tokio::spawn(sweep_delivered(store.clone(), cfg.retention, sweep_stop.clone()));
        }
        let wal_finish = CancellationToken::new();
        if let Some(capture) = wal {
            let publisher = match &sink {
                lane::Sink::Shared(p, _) => crate::wal::Publisher::Shared(p.clone()),
                lane::Sink::Transactional(reader) => crate::wal::Publisher::Transactional(reader.clone()),
            };
            crate::wal::start(
                &mut tasks,
                state.clone(),
                cfg.clone(),
                publisher,
                database_id.clone(),
                capture,
                wal_finish.clone(),
            )
            .await?;
        }
        // librdkafka raises a fatal error on its own threads (a refused
        // producer id, a fenced idempotent producer) whether or not a row is
        // in flight: watched here, so readiness fails and the relay exits
        // even while its capture waits (WAL capture making its slot waits
        // for every transaction running in the cluster).
        let fatal_error = || {
            producer
                .as_ref()
                .and_then(|p| p.client().fatal_error())
                .or_else(|| lone.fatal_error())
                .or_else(|| state.stream_producers.fatal_error())
        };
        // When the lanes were last renewed (a tick that reached the database).
        let mut renewed_at: Option<tokio::time::Instant> = None;
        let mut fatal_check = tokio::time::interval(FATAL_CHECK_EVERY);
        fatal_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            if stopped {
                break;
            }
            tokio::select! {
                _ = &mut shutdown => break,
                _ = fatal_check.tick(), if !state.fatal.is_cancelled() => {
                    if let Some((code, reason)) = fatal_error() {
                        tracing::error!(?code, %reason, "the producer failed fatally");
                        state.fatal.cancel();
                    }
                }
                _ = state.fatal.cancelled() => {
                    state.metrics.producer_fatal.inc();
                    tracing::error!("fatal producer error: draining and exiting so the producer is rebuilt");
                    break;
                }
                _ = tick.tick(), if polling => {
                    let leases: BTreeMap<i32, LaneLease> = held.iter().map(|(l, t)| (*l, t.lease)).collect();
                    draining.retain(|_, (_, done)| !done.is_cancelled());
                    // A lane task that ended on its own (lane lost while
                    // marking, producer fenced, a panic) no longer publishes:
                    // give the lane back so it is retaken with a new task.
                    let ended: Vec<i32> = held.iter().filter(|(_, t)| t.abort.is_cancelled()).map(|(l, _)| *l).collect();
                    for lane in ended {
                        if let Some(t) = held.remove(&lane) {
                            let _ = store.release_lane(&owner, t.lease).await;
                        }
                    }
                    let busy: BTreeMap<i32, LaneLease> = draining.iter().map(|(l, (lease, _))| (*l, *lease)).collect();
                    let plan = match lane::tick(&store, &cfg, &owner, &leases, &busy).await {
                        Ok(p) => p,
                        Err(e) => {
                            tracing::warn!(error = %e, code = e.code(), "lane tick failed");
                            continue;
                        }
                    };
                    // Leases kept after longer than the lease without a
                    // renewal: they lapsed, and no other relay took them.
                    let since = renewed_at.replace(tokio::time::Instant::now()).map(|t| t.elapsed());
                    if let Some(since) = since.filter(|s| *s > cfg.lease && !plan.kept.is_empty()) {
                        state.metrics.lease_lapses.inc();
                        tracing::warn!(?since, lease = ?cfg.lease, lanes = plan.kept.len(), "the lane leases lapsed before this renewal (starved, or the database unreachable); no other relay took them, so they are kept");
                    }
                    state.ready.store(true, Ordering::Relaxed);
                    for lost in plan.lost {
                        if let Some(t) = held.remove(&lost.lane) {
                            t.abort.cancel();
                            state.metrics.lease_losses.inc();
                            tracing::warn!(lane = lost.lane, generation = lost.generation, "lane lease lost; stopped publishing it");
                        }
                    }
                    for extra in plan.surplus {
                        if let Some(t) = held.remove(&extra.lane) {
                            t.finish.cancel();
                            let (store, owner) = (store.clone(), owner.clone());
                            // Release after the lane's in-flight batch is marked.
                            let done = t.abort.clone();
                            draining.insert(extra.lane, (extra, done.clone()));
                            tasks.spawn(async move {
                                done.cancelled().await;
                                let _ = store.release_lane(&owner, extra).await;
                            });
                        }
                    }
                    for lease in plan.acquired {
                        let task = LaneTask { lease, finish: CancellationToken::new(), abort: CancellationToken::new() };
                        tasks.spawn(lane::run(state.clone(), cfg.clone(), sink.clone(), database_id.clone(), wake.clone(), lease, task.finish.clone(), task.abort.clone()));
                        held.insert(lease.lane, task);
                    }
                    state.metrics.lanes_owned.set(held.len() as i64);
                }
                Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            }
        }
        tracing::info!(owner = %owner, "shutting down: finishing in-flight batches");
        for t in held.values() {
            t.finish.cancel();
        }
        wal_finish.cancel();
        wake.all();
        // Keep the leases alive while the last batches are published and
        // marked, or another relay could take the lanes and fence their marks.
        let deadline = tokio::time::sleep(cfg.grace);
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                joined = tasks.join_next() => if joined.is_none() { break },
                _ = tick.tick() => {
                    if let Err(e) = store.renew_lanes(&owner, cfg.lease).await {
                        tracing::warn!(error = %e, "renewing lanes during shutdown failed");
                    }
                }
                _ = &mut deadline => {
                    tracing::warn!("grace period over; abandoning unfinished batches (their rows stay pending)");
                    tasks.abort_all();
                    break;
                }
            }
        }
        for t in held.values() {
            let _ = store.release_lane(&owner, t.lease).await;
        }
        let _ = store.relay_leave(&owner).await;
        if let Some(p) = &producer {
            let _ = p.flush(Duration::from_secs(1));
        }
        listen_stop.cancel();
        sweep_stop.cancel();
        http_stop.cancel();
        let _ = http.await;
        if state.fatal.is_cancelled() {
            return Err(RelayError::ProducerFatal(
                fatal_error()
                    .map(|(code, reason)| format!("{code:?}: {reason}"))
                    .unwrap_or_else(|| "fatal producer error".into()),
            ));
        }
        Ok(())
    }
}

/// Deletes delivered rows older than `retention` (marked, or covered by
/// the ledger), then the ledger ranges left covering none, 1000 per
/// statement, every 30 s until `stop`. A failed statement ends that round.
async fn sweep_delivered(store: RelayStore, retention: Duration, stop: CancellationToken) {
    let mut every = tokio::time::interval(Duration::from_secs(30));
    loop {
        tokio::select! {
            _ = every.tick() => {}
            _ = stop.cancelled() => return,
        }
        let rows_done = sweep_all(&stop, || store.sweep_delivered(retention, 1000)).await;
        if rows_done {
            sweep_all(&stop, || store.sweep_delivered_ranges(retention, 1000)).await;
        }
    }
}

/// Runs `sweep` (1000 per statement) until a statement deletes fewer or
/// `stop`; `false` when it failed (logged) or was stopped.
async fn sweep_all<F, Fut>(stop: &CancellationToken, mut sweep: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ferry::Result<u64>>,
{
    loop {
        match sweep().await {
            Ok(1000) if !stop.is_cancelled() => continue,
            Ok(1000) => return false,
            Ok(_) => return true,
            Err(e) => {
                tracing::warn!(error = %e, "retention sweep failed");
                return false;
            }
        }
    }
}

/// The relay's probe: on each `NOTIFY ferry_wakeup` (PostgreSQL) and every
/// `poll` (SQLite, a lost listener, a skipped coalesced notification), one
/// query finds which of this relay's lanes have pending rows, and only those
/// are woken. Idle lanes do not poll the table themselves (64 lanes polling
/// would be 64 queries per interval).
async fn listen_for_wakeups(
    store: RelayStore,
    owner: String,
    wake: Arc<lane::Wakes>,
    poll: Duration,
    stop: CancellationToken,
) {
    let mut wakeup = store.ferry().wakeup(poll).await;
    let mut next_poll = Instant::now() + poll;
    loop {
        let wait = next_poll.saturating_duration_since(Instant::now());
        tokio::select! {
            _ = wakeup.wait(wait) => {}
            _ = stop.cancelled() => return,
        }
        next_poll = Instant::now() + poll;
        match store.lanes_with_pending(&owner).await {
            Ok(lanes) => {
                for l in lanes {
                    wake.lane(l).notify_one();
                }
            }
            Err(e) => tracing::debug!(error = %e, "probing lanes for pending rows failed"),
        }
    }
}
