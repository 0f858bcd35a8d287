//! `--capture wal`: the relay reads the outbox's inserts from PostgreSQL's
//! write-ahead log by logical replication (`pgoutput`, a publication on
//! `outbox` with inserts only, one named slot per relay group) instead of
//! polling lanes.
//!
//! - **Order.** Logical decoding hands transactions over in commit order,
//!   so a key's records are produced in commit order whoever wrote them (a
//!   plain SQL `INSERT` included), without the per-key advisory lock.
//! - **At least once.** Records stream through the shared idempotent
//!   producer with many transactions in flight; the slot's confirmed
//!   position moves only past transactions whose every record Kafka
//!   acknowledged and whose rows are marked delivered, so a restart (or a
//!   standby taking over) resumes from the slot and loses nothing.
//! - **Delivered state** is written by a marker task off the publishing
//!   path (`marker`): ranges of acknowledged ids in the ledger
//!   `outbox_delivered` (`ledger`), never a rewrite of the outbox rows.
//! - **Fencing.** PostgreSQL lets one session stream from a slot; a standby
//!   relay finds it in use, waits and retries, and takes over when the
//!   active relay's session ends.
//! - **Exactly once** (`--exactly-once`): one transactional producer per
//!   slot; whole PostgreSQL transactions go into Kafka transactions with a
//!   progress record holding the last one's end position, and a session
//!   skips what that record covers (`transactional`).
//! - **The table is the source of truth.** A new slot (the first start, or
//!   one made anew after it was dropped, invalidated or lost its
//!   publication) streams only what commits after it, so the pending rows
//!   are first published from the table, in id order.
//!
//! The parts: `connect` (the replication settings from the database URL and
//! the classification of how a session ends), `pgoutput` (decoding rows),
//! `ledger` (the ranges one mark writes), `pipeline` (produce, count acknowledgements per transaction, hand
//! settled transactions on in commit order; its `transactional` part is
//! exactly once), `marker`, and `session` (one session, start to end). [`run`] is
//! the loop over sessions.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rdkafka::producer::FutureProducer;
use tokio_util::sync::CancellationToken;

use crate::config::{Capture, RelayConfig};
use crate::debezium::EventRouter;
use crate::error::RelayError;
use crate::exactly_once::ProgressReader;
use crate::state::RelayState;
use crate::store::{PublishedTable, RelayStore, Stream};

mod connect;
pub(crate) mod ledger;
mod marker;
mod pgoutput;
mod pipeline;
mod session;
pub(crate) mod streams;
mod union;

use connect::Ended;
pub(crate) use pgoutput::unhex;

/// What `--capture wal` streams from, settled at start.
#[derive(Debug, Clone)]
pub struct WalCapture {
    /// The replication slot (one per relay group).
    pub slot: String,
    /// The publication on `outbox`.
    pub publication: String,
    /// The schema whose `outbox` is published (the connection's
    /// `current_schema()`).
    pub schema: String,
    /// The replication connection's settings.
    pub replication: pgwire_replication::ReplicationConfig,
    /// Slots are made failover slots (PostgreSQL 17+).
    pub failover: bool,
    /// The replication connection's `application_name` (`ferry-relay
    /// <relay id>`): how the relay finds its own earlier walsender.
    pub application_name: String,
    /// With `--debezium-config`: the Debezium-layout table streamed
    /// instead of `outbox`, and how its rows become records.
    pub router: Option<Arc<EventRouter>>,
    /// The relay group's base slot (`--slot`, or the default): its stream
    /// layout is recorded under it, and the streams' slots are named after
    /// it.
    pub group: String,
    /// Which of the group's streams this is ([`Stream::WHOLE`] without
    /// `--streams`).
    pub stream: Stream,
}

impl WalCapture {
    /// The `count` streams of this group (`--streams`): stream k streams
    /// from slot `<slot>_<k>of<N>` and publication `<publication>_<k>of<N>`
    /// (filtered on `lane % N = k`); one stream is this capture itself.
    /// Refused when a name would pass PostgreSQL's 63 bytes.
    pub fn streams(&self, database_url: &str, count: u32) -> Result<Vec<WalCapture>, RelayError> {
        (0..count)
            .map(|index| {
                let stream = Stream { index, count };
                let (slot, publication) = (stream.name(&self.group), stream.name(&self.publication_base()));
                for (what, name) in [("--slot", &slot), ("--publication", &publication)] {
                    crate::config::check_identifier(what, name).map_err(|_| {
                        RelayError::Config(format!(
                            "--streams {count}: stream {index}'s {what} name {name} is over 63 bytes; choose a shorter {what}"
                        ))
                    })?;
                }
                let replication =
                    connect::replication_config(database_url, &slot, &publication, &self.application_name)?;
                Ok(WalCapture {
                    slot,
                    publication,
                    replication,
                    stream,
                    ..self.clone()
                })
            })
            .collect()
    }

    /// The publication name the streams' are made from (this capture's,
    /// before any stream suffix).
    pub(crate) fn publication_base(&self) -> String {
        match self.stream.count {
            1 => self.publication.clone(),
            _ => self
                .publication
                .strip_suffix(&format!("_{}of{}", self.stream.index, self.stream.count))
                .unwrap_or(&self.publication)
                .to_string(),
        }
    }

    /// The row filter a stream's publication must have, or `None` when it
    /// is not checked (one stream: the publication an operator may have
    /// made, as before `--streams`).
    pub fn row_filter(&self) -> Option<Option<String>> {
        (self.stream.count > 1).then(|| self.stream.row_filter())
    }

    /// The table the publication must publish: this schema's `outbox`, or
    /// the Debezium-layout table.
    pub fn table(&self) -> PublishedTable {
        match &self.router {
            Some(r) => PublishedTable {
                schema: Some(r.schema.clone()),
                name: r.table.clone(),
            },
            None => PublishedTable {
                schema: None,
                name: "outbox".into(),
            },
        }
    }
}

/// The default slot (and publication) name: `ferry_` and the first 12 hex
/// digits of the database id, so databases (and schemas) sharing one
/// PostgreSQL cluster never share a slot.
pub fn default_slot(database_id: &str) -> String {
    let hex: String = database_id
        .chars()
        .filter(char::is_ascii_hexdigit)
        .take(12)
        .collect::<String>()
        .to_ascii_lowercase();
    format!("ferry_{hex}")
}

/// Decides the capture mode: `Some` to stream the WAL, `None` to poll.
/// SQLite always polls (and refuses `--capture wal`); on PostgreSQL the
/// default is `wal` when `wal_level = logical`, the role may replicate and
/// the URL is direct (not through a transaction pooler), else `poll`, said
/// in one log line. `--exactly-once` polls unless
/// `--capture wal` asks for WAL capture: an exactly-once deployment's
/// capture changes only when an operator says so (the lanes' last progress
/// records are not read by WAL capture).
pub async fn plan(cfg: &RelayConfig, store: &RelayStore, owner: &str) -> Result<Option<WalCapture>, RelayError> {
    let refuse = |why: &str| RelayError::Config(format!("--capture wal: {why}"));
    // `--debezium-config` reads the WAL or nothing, and `--streams` splits it.
    let wal_asked = cfg.capture == Some(Capture::Wal) || cfg.debezium_config.is_some() || cfg.streams > 1;
    if store.ferry().db().as_postgres().is_none() {
        return match wal_asked {
            true => Err(refuse("needs PostgreSQL; SQLite always polls")),
            false => Ok(None),
        };
    }
    if cfg.capture == Some(Capture::Poll) {
        tracing::info!("capture: poll (--capture poll)");
        return Ok(None);
    }
    let setting = store.wal_setting().await?;
    let why_not = if cfg.exactly_once && cfg.capture.is_none() {
        Some("--exactly-once without --capture wal")
    } else if store.ferry().behind_transaction_pooler() {
        // A replication connection and the slot maker's session lock need
        // a session of their own; PgBouncer refuses the first and would
        // hand the second to other clients.
        Some("the database URL goes through a transaction pooler (pgbouncer=true): WAL capture needs a direct connection to PostgreSQL")
    } else if !setting.logical {
        Some("wal_level is not logical")
    } else if !setting.may_replicate {
        Some("the role has no REPLICATION attribute")
    } else {
        None
    };
    if let Some(why) = why_not {
        if wal_asked {
            return Err(refuse(why));
        }
        tracing::info!("capture: poll ({why})");
        return Ok(None);
    }
    if cfg.streams > 1 && setting.version < 150_000 {
        return Err(RelayError::Config(format!(
            "--streams {} needs PostgreSQL 15 or later (publication row filters); this server is {}",
            cfg.streams, setting.version
        )));
    }
    let lanes = store.ferry().lanes();
    if i64::from(cfg.streams) > i64::from(lanes) {
        return Err(RelayError::Config(format!(
            "--streams {} splits the outbox by lane, and the database has {lanes} lanes: at most {lanes} streams",
            cfg.streams
        )));
    }
    let router = match &cfg.debezium_config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| RelayError::Config(format!("--debezium-config {}: {e}", path.display())))?;
            let mut router = EventRouter::parse(&text)?;
            router.defaulted = store.wal_defaulted_columns(&router.schema, &router.table).await?;
            Some(Arc::new(router))
        }
        None => None,
    };
    // With a Debezium connector's file, its slot and publication: the
    // relay stands by while the connector streams, and resumes where it
    // stopped.
    let slot = match (&cfg.slot, &router) {
        (Some(s), _) => s.clone(),
        (None, Some(r)) => r.slot.clone(),
        (None, None) => default_slot(&store.ferry().database_id().await?),
    };
    let publication = match (&cfg.publication, &router) {
        (Some(p), _) => p.clone(),
        (None, Some(r)) if cfg.slot.is_none() => r.publication.clone(),
        (None, _) => slot.clone(),
    };
    // PostgreSQL keeps 63 bytes of it: what it shows is what is compared.
    let mut application_name = format!("ferry-relay {owner}");
    while application_name.len() > 63 {
        application_name.pop();
    }
    let replication = connect::replication_config(&cfg.database_url, &slot, &publication, &application_name)?;
    tracing::info!(%slot, %publication, failover_slot = setting.failover_slots(), streams = cfg.streams, "capture: wal");
    Ok(Some(WalCapture {
        group: slot.clone(),
        stream: Stream::WHOLE,
        slot,
        publication,
        failover: setting.failover_slots(),
        schema: setting.schema,
        replication,
        application_name,
        router,
    }))
}

/// Where a poison row is being isolated (one record in flight at a time):
/// the stream's transactions up to a commit position, the catch-up read's
/// rows up to an id. It lasts across sessions until passed.
#[derive(Debug, Default)]
struct Isolation {
    through_lsn: Option<u64>,
    through_id: Option<i64>,
    /// Exactly once: rows this relay marked dead, which a later session
    /// streams again (their Kafka transaction was aborted) and leaves out.
    dead: HashSet<i64>,
}

impl Isolation {
    /// Whether the transaction committing at `final_lsn` is isolated; the
    /// isolation ends at the first transaction past it.
    fn covers_lsn(&mut self, final_lsn: u64) -> bool {
        match self.through_lsn {
            Some(t) if final_lsn <= t => true,
            _ => {
                self.through_lsn = None;
                false
            }
        }
    }

    /// Whether catch-up row `id` is isolated.
    fn covers_id(&self, id: i64) -> bool {
        self.through_id.is_some_and(|t| id <= t)
    }

    /// Isolates through what a session left refused as poison
    /// ([`pipeline::Pipeline::refused`]) too.
    fn extend(&mut self, (lsn, id): (Option<u64>, Option<i64>)) {
        self.through_lsn = self.through_lsn.max(lsn);
        self.through_id = self.through_id.max(id);
    }
}

/// What WAL capture publishes through.
#[derive(Clone)]
pub enum Publisher {
    /// At least once: the relay's shared idempotent producer.
    Shared(FutureProducer),
    /// Exactly once: each session makes the slot's transactional producer;
    /// this reads the slot's progress on the progress topic.
    Transactional(Arc<ProgressReader>),
}

/// Starts WAL capture on `tasks`: records the group's stream layout (this
/// relay's `--streams`), then one session loop per stream ([`run`]) and,
/// with several, the membership that spreads them ([`streams::coordinate`]).
pub(crate) async fn start(
    tasks: &mut tokio::task::JoinSet<()>,
    state: Arc<RelayState>,
    cfg: Arc<RelayConfig>,
    publisher: Publisher,
    database_id: Arc<str>,
    capture: WalCapture,
    finish: CancellationToken,
) -> Result<(), RelayError> {
    let count = cfg.streams;
    let captures = capture.streams(&cfg.database_url, count)?;
    match state.store.set_wal_layout(&capture.group, count).await {
        Ok(before) if before != count => {
            tracing::warn!(group = %capture.group, before, now = count, "the relay group's stream layout changes: relays of the old one stop streaming; the new streams start once the old slots are idle (their pending rows are read from the table)");
        }
        Ok(_) => {}
        // One stream needs no layout: a deployment whose role lacks the
        // table's grants (deploy/sql/roles.sql) streams as it did.
        Err(e) if count == 1 => {
            tracing::warn!(error = %e, code = e.code(), "recording the stream layout failed; streaming as one stream")
        }
        Err(e) => return Err(e.into()),
    }
    let share = match count {
        1 => streams::Share::whole(),
        _ => {
            // The streams' marks are written together, so that their
            // interleaved ids make runs (`union`).
            let share = streams::Share::split(Some(union::Union::spawn(state.clone(), union::Waits::DEFAULT)));
            tasks.spawn(streams::coordinate(
                state.clone(),
                capture.group.clone(),
                state.owner.clone(),
                count,
                cfg.lease,
                share.clone(),
                finish.clone(),
            ));
            share
        }
    };
    for capture in captures {
        // At least once, each further stream has a producer of its own: a
        // stream isolating a poison row publishes one record per produce
        // request, which a producer shared with another stream would batch
        // with that stream's records (a valid row then refused with
        // another's poison row, taken for poison itself). Each stream's
        // producer is also its own librdkafka threads.
        let publisher = match (&publisher, capture.stream.index) {
            (Publisher::Shared(_), 1..) => {
                let producer = crate::publish::producer(&cfg)?;
                state.stream_producers.add(producer.clone());
                Publisher::Shared(producer)
            }
            _ => publisher.clone(),
        };
        tasks.spawn(run(
            state.clone(),
            cfg.clone(),
            publisher,
            database_id.clone(),
            capture,
            share.clone(),
            finish.clone(),
        ));
    }
    Ok(())
}

/// Streams the outbox from the WAL until `finish`: one session after
/// another, waiting as a standby while another relay holds the slot,
/// making the slot anew when it cannot go on, backing off after failures.
/// Cancels `state.fatal` when the producer failed fatally.
///
/// With `--streams`, one such loop runs per stream, all sharing `share`
/// (see [`streams`]).
pub(crate) async fn run(
    state: Arc<RelayState>,
    cfg: Arc<RelayConfig>,
    publisher: Publisher,
    database_id: Arc<str>,
    capture: WalCapture,
    share: Arc<streams::Share>,
    finish: CancellationToken,
) {
    let mut share_changed = share.subscribe();
    let ctx = Ctx {
        state,
        cfg,
        publisher,
        database_id,
        capture,
        streamed: std::sync::atomic::AtomicBool::new(false),
        publication_seen: std::sync::Mutex::new(None),
        share,
    };
    let mut backoff = crate::lane::retry_backoff();
    let mut iso = Isolation::default();
    let mut reseed = false;
    while !finish.is_cancelled() {
        let ended = session::run(&ctx, &mut iso, &mut reseed, &finish).await;
        ctx.state.metrics.wal_session_ended(ended.code());
        let mut on_share = false;
        let wait = match ended {
            Ended::Shutdown => break,
            Ended::Yielded => {
                // Another relay's stream (or given to one): healthy, waiting
                // for this relay's share to change.
                ctx.state.ready.store(true, std::sync::atomic::Ordering::Relaxed);
                backoff = crate::lane::retry_backoff();
                on_share = true;
                ctx.cfg.lease / 3
            }
            Ended::Fatal => {
                tracing::error!("fatal producer error; the relay stops and exits to be restarted");
                ctx.state.fatal.cancel();
                break;
            }
            Ended::Stopped(code) => {
                tracing::error!(code, "WAL capture stopped at a row it cannot publish; change the configuration and restart the relay (it resumes from the slot)");
                ctx.state.ready.store(false, std::sync::atomic::Ordering::Relaxed);
                break;
            }
            Ended::SlotInUse => {
                // A standby: healthy, waiting for the slot; unless the
                // session holding it is this relay's own earlier one, whose
                // connection died without the server noticing yet.
                ctx.state.ready.store(true, std::sync::atomic::Ordering::Relaxed);
                backoff = crate::lane::retry_backoff();
                let capture = &ctx.capture;
                match ctx
                    .state
                    .store
                    .wal_end_own_walsender(&capture.slot, &capture.application_name)
                    .await
                {
                    Ok(true) => {
                        tracing::warn!(slot = %capture.slot, "ended this relay's own earlier walsender, which still held the slot");
                        // A moment for it to exit (two relays given one
                        // --relay-id would end each other's sessions: the
                        // id must be unique).
                        Duration::from_millis(200)
                    }
                    Ok(false) => {
                        tracing::debug!(slot = %capture.slot, "the slot is in use; standing by");
                        ctx.cfg.lease / 3
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "looking for this relay's own earlier walsender failed");
                        ctx.cfg.lease / 3
                    }
                }
            }
            Ended::Reseed(why) => {
                tracing::warn!(slot = %ctx.capture.slot, why, "the slot cannot go on; making it anew");
                reseed = true;
                Duration::ZERO
            }
            Ended::Isolate {
                through_lsn,
                through_id,
            } => {
                tracing::warn!(
                    through_lsn,
                    through_id,
                    "a produce request was refused whole; publishing one record at a time to find the poison row"
                );
                Duration::ZERO
            }
            Ended::Aborted => {
                tracing::info!("the Kafka transaction was aborted to leave a dead row out; resuming from the slot");
                Duration::ZERO
            }
            Ended::Retry(code) => {
                // A Debezium-layout relay waiting for an operator (its slot
                // or publication) is not ready.
                if ctx.capture.router.is_some() && (code.starts_with("slot_") || code.starts_with("publication_")) {
                    ctx.state.ready.store(false, std::sync::atomic::Ordering::Relaxed);
                }
                tracing::warn!(code, "WAL capture stopped; resuming from the slot after a backoff");
                backoff.next().unwrap_or(Duration::from_secs(10))
            }
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = share_changed.changed(), if on_share => {}
            _ = finish.cancelled() => break,
        }
    }
}

/// Microseconds since the Unix epoch (0 before it).
fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

/// What a session's `prepare` saw (see [`Ctx::publication_seen`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Seen {
    /// The publication's oid (`None`: it did not exist).
    pub oid: Option<i64>,
    /// The slot's generation in `relay_wal_slots` (`None`: never made).
    pub slot_made: Option<i64>,
}

/// What a session works with (its tasks and its exactly-once pipeline
/// read it).
pub(super) struct Ctx {
    pub state: Arc<RelayState>,
    pub cfg: Arc<RelayConfig>,
    pub publisher: Publisher,
    pub database_id: Arc<str>,
    pub capture: WalCapture,
    /// A session of this process has streamed from the slot: a slot
    /// missing since was dropped, not yet made.
    pub streamed: std::sync::atomic::AtomicBool,
    /// The publication's oid and the slot's making when this process last
    /// prepared a session of the stream (`None` before the first): a
    /// publication made again since, with the slot not made anew since,
    /// means the slot is made anew.
    pub publication_seen: std::sync::Mutex<Option<Seen>>,
    /// This relay's share of the group's streams (`--streams`).
    pub share: Arc<streams::Share>,
}
