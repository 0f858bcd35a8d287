//! Publishing one held lane, in `id` order, in one of two modes:
//!
//! - **at least once** (default): rows stream through the shared idempotent
//!   producer; acknowledged rows are marked as acknowledgements arrive (every
//!   [`MARK_EVERY`] or [`MARK_ROWS`] acknowledgements), so a crash republishes
//!   little. At the first failed row nothing more of the lane is produced:
//!   what is in flight is awaited, only the acknowledged prefix is marked, and
//!   the lane backs off and resumes from the failed row.
//! - **exactly once** (`--exactly-once`): one Kafka transaction per batch
//!   through the lane's transactional producer, carrying the rows and a
//!   progress record with their exact ids; the rows are marked right after
//!   the commit and before the next transaction (see [`crate::exactly_once`]).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::store::{LaneLease, PendingRow};
use backon::{BackoffBuilder, ExponentialBuilder};
use futures::FutureExt;
use rdkafka::error::KafkaError;
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};
use rdkafka::types::RDKafkaErrorCode;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::config::{OnPoison, RelayConfig};
use crate::exactly_once::{self, Progress, ProgressReader, TxnFailure, TXN_TIMEOUT};
use crate::publish::{self, Outcome};
use crate::service::RelayState;

/// Mark the acknowledged rows at least this often while a batch is in flight.
pub const MARK_EVERY: Duration = Duration::from_millis(100);
/// ... or after this many acknowledgements, whichever comes first.
pub const MARK_ROWS: usize = 200;

/// How a batch ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BatchEnd {
    /// Every row was acknowledged and marked (or marked dead).
    Done,
    /// Stopped at row `id`: back off, then resume from the lane's first
    /// pending row.
    Stalled { id: i64, code: &'static str },
    /// The broker refused a produce request holding several rows as too
    /// large (or otherwise poison): it refuses the whole request, so which
    /// row is poison is unknown. Publish rows one at a time through `through`
    /// to find it; nothing is marked dead on a guess.
    Isolate { through: i64, code: &'static str },
    /// The lane is no longer ours (taken over, or its producer fenced):
    /// publish nothing more.
    Lost,
    /// The shared producer failed fatally: stop; the relay drains and exits
    /// non-zero to be restarted with a new producer.
    Fatal,
    /// A transactional call (commit, abort) did not end cleanly: the
    /// producer's transaction state is unknown, so it is dropped and the lane
    /// is taken over again (`init_transactions` settles the open
    /// transaction, the progress read marks what it committed).
    Reinit { id: i64, code: &'static str },
}

/// Where a lane's records go.
#[derive(Clone)]
pub enum Sink {
    /// The relay's shared idempotent producer (at least once).
    Shared(FutureProducer),
    /// The lane's own transactional producer, created on the lane task, and
    /// the relay's reader of the progress topic.
    Transactional(Arc<ProgressReader>),
}

/// Publishes one lane until told to finish (after its in-flight batch) or
/// abort (lease lost: publish and mark nothing more).
#[allow(clippy::too_many_arguments)] // one lane task's whole context, spawned once
pub async fn run(
    state: Arc<RelayState>,
    cfg: Arc<RelayConfig>,
    sink: Sink,
    database_id: Arc<str>,
    wake: Arc<Notify>,
    lease: LaneLease,
    finish: CancellationToken,
    abort: CancellationToken,
) {
    // However the task ends (including a panic), tell whoever waits to
    // release this lane, and the main loop, that nothing is in flight.
    let _done = abort.clone().drop_guard();
    let mut backoff = retry_backoff();
    let (producer, reader) = match sink {
        Sink::Shared(p) => (Some(p), None),
        Sink::Transactional(r) => (None, Some(r)),
    };
    let mut txn: Option<FutureProducer> = None;
    // Rows up to this id are published one at a time (see BatchEnd::Isolate).
    let mut isolate_through = 0_i64;
    // Halved when the producer queue cannot hold a batch, reset on success.
    let mut batch_size = cfg.batch_size;
    loop {
        if finish.is_cancelled() || abort.is_cancelled() {
            break;
        }
        if let (Some(reader), None) = (&reader, &txn) {
            match take_over(&state, &cfg, reader, &database_id, lease, &abort).await {
                Ok(p) => txn = Some(p),
                Err(BatchEnd::Lost) => break,
                Err(_) => {
                    if pause(&mut backoff, &finish, &abort).await {
                        break;
                    }
                    continue;
                }
            }
        }
        let rows = match state.store.pending_batch(lease.lane, batch_size).await {
            Ok(mut r) => {
                if r.first().is_some_and(|f| f.id <= isolate_through) {
                    r.truncate(1);
                }
                r
            }
            Err(e) => {
                tracing::warn!(lane = lease.lane, error = %e, "reading the lane failed");
                if pause(&mut backoff, &finish, &abort).await {
                    break;
                }
                continue;
            }
        };
        if rows.is_empty() {
            let notified = wake.notified();
            tokio::select! {
                _ = notified => {}
                _ = tokio::time::sleep(cfg.poll_interval) => {}
                _ = finish.cancelled() => break,
                _ = abort.cancelled() => break,
            }
            continue;
        }
        let batch = async {
            match (&producer, &txn) {
                (Some(p), _) => at_least_once(&state, &cfg, p, &database_id, lease, &rows).await,
                (None, Some(p)) => transactional_batch(&state, &cfg, p, &database_id, lease, &rows, &abort).await,
                (None, None) => BatchEnd::Stalled {
                    id: rows[0].id,
                    code: "no_producer",
                },
            }
        };
        let end = tokio::select! {
            end = batch => end,
            // Lost mid-batch: whatever was acknowledged is republished by the
            // new owner (at least once), or fenced by it (exactly once).
            _ = abort.cancelled() => break,
        };
        match end {
            BatchEnd::Done => {
                backoff = retry_backoff();
                batch_size = cfg.batch_size;
            }
            // Taken over, or the producer fenced: the relay's next tick
            // releases the lane (fenced by its generation), so it is taken
            // again with a new task and producer if it is still free.
            BatchEnd::Lost => break,
            BatchEnd::Fatal => {
                tracing::error!(
                    lane = lease.lane,
                    "fatal producer error; the relay stops and exits to be restarted"
                );
                state.fatal.cancel();
                break;
            }
            BatchEnd::Reinit { id, code } => {
                tracing::warn!(
                    lane = lease.lane,
                    id,
                    code,
                    "transaction state unknown; taking the lane over again"
                );
                txn = None;
                if pause(&mut backoff, &finish, &abort).await {
                    break;
                }
            }
            BatchEnd::Isolate { through, code } => {
                tracing::warn!(
                    lane = lease.lane,
                    through,
                    code,
                    "a produce request was refused whole; publishing one row at a time to find the poison row"
                );
                isolate_through = through;
            }
            BatchEnd::Stalled { id, code } => {
                if code == "queue_full" {
                    // The producer queue cannot hold a whole batch (a
                    // transaction cannot wait for room): retry smaller.
                    batch_size = (batch_size / 2).max(1);
                }
                if let Err(ferry::Error::LostLane { .. }) =
                    state.store.note_publish_error(&state.owner, lease, id, code).await
                {
                    break;
                }
                tracing::warn!(lane = lease.lane, id, code, "publish failed; backing off");
                if pause(&mut backoff, &finish, &abort).await {
                    break;
                }
            }
        }
    }
}

/// At least once: streams the batch, marks acknowledged rows progressively,
/// and stops producing at the first failed row.
async fn at_least_once(
    state: &RelayState,
    cfg: &RelayConfig,
    producer: &FutureProducer,
    database_id: &str,
    lease: LaneLease,
    rows: &[PendingRow],
) -> BatchEnd {
    let mut marker = Marker::new(lease);
    let mut inflight: VecDeque<(usize, DeliveryFuture)> = VecDeque::new();
    let mut end = BatchEnd::Done;
    'send: for (i, row) in rows.iter().enumerate() {
        // Settle acknowledgements that already arrived, so a failure stops
        // the lane before anything more is produced.
        while let Some(Some(r)) = inflight.front_mut().map(|(_, f)| f.now_or_never()) {
            let (j, _) = inflight.pop_front().expect("front exists");
            if let Some(stop) = settle(
                state,
                cfg,
                &mut marker,
                &rows[j],
                publish::delivered(r),
                rows.len() == 1,
            )
            .await
            {
                end = stop;
                break 'send;
            }
        }
        let topic = cfg.route(&row.topic, &row.tenant);
        loop {
            match producer.send_result(publish::record(&topic, row, database_id)) {
                Ok(fut) => {
                    inflight.push_back((i, fut));
                    break;
                }
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) => {
                    let Some((j, fut)) = inflight.pop_front() else {
                        end = BatchEnd::Stalled {
                            id: row.id,
                            code: "queue_full",
                        };
                        break 'send;
                    };
                    // Make room by waiting for the oldest delivery.
                    if let Some(stop) = settle(
                        state,
                        cfg,
                        &mut marker,
                        &rows[j],
                        publish::delivered(fut.await),
                        rows.len() == 1,
                    )
                    .await
                    {
                        end = stop;
                        break 'send;
                    }
                }
                Err((e, _)) => {
                    if let Some(stop) = settle(state, cfg, &mut marker, row, publish::classify(&e), true).await {
                        end = stop;
                        break 'send;
                    }
                    break;
                }
            }
        }
    }
    for (j, fut) in inflight {
        let outcome = publish::delivered(fut.await);
        // After a stop, what was still in flight is awaited but not marked:
        // only the acknowledged prefix counts.
        if end == BatchEnd::Done {
            if let Some(stop) = settle(state, cfg, &mut marker, &rows[j], outcome, rows.len() == 1).await {
                end = stop;
            }
        }
    }
    let end = match end {
        BatchEnd::Isolate { code, .. } => BatchEnd::Isolate {
            through: rows.last().map(|r| r.id).unwrap_or(0),
            code,
        },
        other => other,
    };
    match marker.flush(state, cfg).await {
        Some(BatchEnd::Lost) => BatchEnd::Lost,
        Some(stop) if end == BatchEnd::Done => stop,
        _ => end,
    }
}

/// Applies one row's outcome in order; `Some` stops the batch. `alone`:
/// the outcome is certainly this row's (refused by the client before
/// sending, or the only row in flight), not its produce request's.
async fn settle(
    state: &RelayState,
    cfg: &RelayConfig,
    marker: &mut Marker,
    row: &PendingRow,
    outcome: Outcome,
    alone: bool,
) -> Option<BatchEnd> {
    let m = &state.metrics;
    match outcome {
        Outcome::Acked { .. } => {
            m.observe_latency(now_ms() - row.created_at);
            marker.push(row.id);
            if marker.due() {
                return marker.flush(state, cfg).await;
            }
            None
        }
        Outcome::Poison(code) => {
            m.publish_error(code);
            if !alone {
                return Some(BatchEnd::Isolate {
                    through: i64::MAX,
                    code,
                });
            }
            if cfg.on_poison == OnPoison::Block {
                tracing::error!(
                    lane = marker.lease.lane,
                    id = row.id,
                    code,
                    "poison record blocks the lane (--on-poison=block)"
                );
                return Some(BatchEnd::Stalled { id: row.id, code });
            }
            poison_dead(state, marker.lease, row, code).await
        }
        Outcome::Transient(code) => {
            m.publish_error(code);
            Some(BatchEnd::Stalled { id: row.id, code })
        }
        Outcome::Fatal => {
            m.publish_error("fatal");
            Some(BatchEnd::Fatal)
        }
    }
}

/// Marks a poison row dead (logged without its payload); `Some` stops.
async fn poison_dead(state: &RelayState, lease: LaneLease, row: &PendingRow, code: &'static str) -> Option<BatchEnd> {
    tracing::error!(lane = lease.lane, id = row.id, tenant = %row.tenant, topic = %row.topic, code, "record refused by Kafka; marked dead");
    match state.store.mark_dead(&state.owner, lease, row.id, code).await {
        Ok(()) => {
            state.metrics.dead.inc();
            None
        }
        Err(ferry::Error::LostLane { .. }) => Some(BatchEnd::Lost),
        Err(e) => {
            tracing::warn!(error = %e, "marking a poison row dead failed");
            Some(BatchEnd::Stalled {
                id: row.id,
                code: "mark_dead",
            })
        }
    }
}

/// Acknowledged ids not yet marked, flushed in one fenced statement.
struct Marker {
    lease: LaneLease,
    ids: Vec<i64>,
    since: Instant,
}

impl Marker {
    fn new(lease: LaneLease) -> Self {
        Marker {
            lease,
            ids: Vec::new(),
            since: Instant::now(),
        }
    }

    fn push(&mut self, id: i64) {
        if self.ids.is_empty() {
            self.since = Instant::now();
        }
        self.ids.push(id);
    }

    fn due(&self) -> bool {
        self.ids.len() >= MARK_ROWS || self.since.elapsed() >= MARK_EVERY
    }

    /// Marks what is buffered; `Some` stops the batch (lane lost, or the
    /// database refused: the rows stay pending and are republished).
    async fn flush(&mut self, state: &RelayState, cfg: &RelayConfig) -> Option<BatchEnd> {
        if self.ids.is_empty() {
            return None;
        }
        let first = self.ids[0];
        match state
            .store
            .mark_delivered(&state.owner, self.lease, &self.ids, cfg.delete_on_delivery)
            .await
        {
            Ok(n) => {
                state.metrics.published.inc_by(n);
                self.ids.clear();
                None
            }
            Err(ferry::Error::LostLane { .. }) => {
                tracing::warn!(lane = self.lease.lane, "lane taken over; its marks were refused");
                Some(BatchEnd::Lost)
            }
            Err(e) => {
                tracing::warn!(lane = self.lease.lane, error = %e, "marking delivered failed; rows will be republished");
                Some(BatchEnd::Stalled {
                    id: first,
                    code: "mark_delivered",
                })
            }
        }
    }
}

/// Exactly once, on taking the lane: fence earlier producers of the lane's
/// `transactional.id`, then mark the ids of the lane's last committed
/// transaction before anything is published.
async fn take_over(
    state: &RelayState,
    cfg: &Arc<RelayConfig>,
    reader: &Arc<ProgressReader>,
    database_id: &Arc<str>,
    lease: LaneLease,
    abort: &CancellationToken,
) -> Result<FutureProducer, BatchEnd> {
    let (c, r, db) = (cfg.clone(), reader.clone(), database_id.clone());
    let lane = lease.lane;
    let init = tokio::task::spawn_blocking(move || {
        let p = exactly_once::lane_producer(&c, lane).map_err(crate::error::RelayError::from)?;
        let progress = r.read(&db, lane)?;
        Ok::<_, crate::error::RelayError>((p, progress))
    });
    let (producer, progress) = tokio::select! {
        r = init => match r {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => {
                tracing::warn!(lane, error = %e, "taking the lane's transactional producer failed");
                return Err(BatchEnd::Stalled { id: 0, code: "init_transactions" });
            }
            Err(e) => {
                tracing::warn!(lane, error = %e, "taking the lane's transactional producer panicked");
                return Err(BatchEnd::Stalled { id: 0, code: "init_transactions" });
            }
        },
        _ = abort.cancelled() => return Err(BatchEnd::Lost),
    };
    if let Some(p) = progress {
        match state
            .store
            .mark_delivered(&state.owner, lease, &p.ids, cfg.delete_on_delivery)
            .await
        {
            Ok(n) => {
                if n > 0 {
                    tracing::info!(
                        lane,
                        marked = n,
                        "marked the last committed transaction of the previous owner"
                    );
                }
            }
            Err(ferry::Error::LostLane { .. }) => return Err(BatchEnd::Lost),
            Err(e) => {
                tracing::warn!(lane, error = %e, "marking the lane's last transaction failed");
                return Err(BatchEnd::Stalled {
                    id: 0,
                    code: "mark_delivered",
                });
            }
        }
    }
    tracing::info!(lane, transactional_id = %cfg.transactional_id(lane), "lane producer fenced its predecessors");
    Ok(producer)
}

/// Exactly once: one transaction with the rows and the progress record,
/// committed, then the rows marked before anything else happens.
async fn transactional_batch(
    state: &RelayState,
    cfg: &Arc<RelayConfig>,
    producer: &FutureProducer,
    database_id: &str,
    lease: LaneLease,
    rows: &[PendingRow],
    abort: &CancellationToken,
) -> BatchEnd {
    if let Err(e) = producer.begin_transaction() {
        return txn_failed(producer, "begin_transaction", &e, rows[0].id).await;
    }
    let mut inflight: Vec<(usize, DeliveryFuture)> = Vec::with_capacity(rows.len());
    let mut failed: Option<(usize, Outcome)> = None;
    let mut sync_failure = false;
    for (i, row) in rows.iter().enumerate() {
        let topic = cfg.route(&row.topic, &row.tenant);
        match producer.send_result(publish::record(&topic, row, database_id)) {
            Ok(fut) => inflight.push((i, fut)),
            Err((e, _)) => {
                // Queue full included: the transaction is retried smaller.
                failed = Some((i, publish::classify(&e)));
                sync_failure = true;
                break;
            }
        }
    }
    let ids: Vec<i64> = inflight.iter().map(|(i, _)| rows[*i].id).collect();
    let progress = Progress {
        database: database_id.to_owned(),
        lane: lease.lane,
        generation: lease.generation,
        ids: ids.clone(),
    };
    let value = serde_json::to_vec(&progress).expect("progress serializes");
    let key = Progress::key(database_id, lease.lane);
    let progress_topic = cfg.progress_topic();
    let progress_fut = if failed.is_none() {
        let rec = FutureRecord::to(&progress_topic)
            .partition(lease.lane)
            .key(key.as_bytes())
            .payload(&value[..]);
        match producer.send_result(rec) {
            Ok(f) => Some(f),
            Err((e, _)) => {
                failed = Some((0, progress_failure(publish::classify(&e))));
                None
            }
        }
    } else {
        None
    };
    let created: Vec<i64> = inflight.iter().map(|(i, _)| rows[*i].created_at).collect();
    for (i, fut) in inflight {
        match publish::delivered(fut.await) {
            Outcome::Acked { .. } => {}
            other => {
                if failed.is_none() {
                    failed = Some((i, other));
                }
            }
        }
    }
    if let Some(f) = progress_fut {
        if let o @ (Outcome::Poison(_) | Outcome::Transient(_) | Outcome::Fatal) = publish::delivered(f.await) {
            if failed.is_none() {
                failed = Some((0, progress_failure(o)));
            }
        }
    }
    if let Some((i, outcome)) = failed {
        // Nothing of this transaction becomes visible to read_committed readers.
        if let Err(e) = abort_txn(producer).await {
            return txn_failed(producer, "abort_transaction", &e, rows[i].id).await;
        }
        return match outcome {
            // Refused with the rest of its request: find the row first.
            Outcome::Poison(code) if rows.len() > 1 && !sync_failure => BatchEnd::Isolate {
                through: rows.last().map(|r| r.id).unwrap_or(0),
                code,
            },
            Outcome::Poison(code) if cfg.on_poison == OnPoison::Dead => {
                state.metrics.publish_error(code);
                poison_dead(state, lease, &rows[i], code)
                    .await
                    .unwrap_or(BatchEnd::Done)
            }
            Outcome::Poison(code) | Outcome::Transient(code) => {
                state.metrics.publish_error(code);
                BatchEnd::Stalled { id: rows[i].id, code }
            }
            // A transactional producer's fatal error: a new one is made.
            Outcome::Fatal => BatchEnd::Lost,
            Outcome::Acked { .. } => unreachable!("only failures are recorded"),
        };
    }
    let p = producer.clone();
    let commit = tokio::task::spawn_blocking(move || p.commit_transaction(TXN_TIMEOUT));
    match commit.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return txn_failed(producer, "commit_transaction", &e, rows[0].id).await,
        Err(_) => {
            return BatchEnd::Reinit {
                id: rows[0].id,
                code: "commit_transaction",
            }
        }
    }
    exactly_once::failpoint_after_commit();
    let acked_at = now_ms();
    for c in created {
        state.metrics.observe_latency(acked_at - c);
    }
    // Mark before the next transaction; retry until it lands or the lane is
    // lost (the next owner then marks these ids from the progress record).
    let mut backoff = retry_backoff();
    loop {
        match state
            .store
            .mark_delivered(&state.owner, lease, &ids, cfg.delete_on_delivery)
            .await
        {
            Ok(n) => {
                state.metrics.published.inc_by(n);
                return BatchEnd::Done;
            }
            Err(ferry::Error::LostLane { .. }) => return BatchEnd::Lost,
            Err(e) => {
                tracing::warn!(lane = lease.lane, error = %e, "marking a committed transaction failed; retrying");
                let d = backoff.next().unwrap_or(Duration::from_secs(10));
                tokio::select! {
                    _ = tokio::time::sleep(d) => {}
                    _ = abort.cancelled() => return BatchEnd::Lost,
                }
            }
        }
    }
}

/// A refused progress record says nothing about the rows: it stalls the
/// lane (and is counted) but never marks a row dead.
fn progress_failure(o: Outcome) -> Outcome {
    match o {
        Outcome::Poison(_) => Outcome::Transient("progress_record_refused"),
        other => other,
    }
}

async fn abort_txn(producer: &FutureProducer) -> Result<(), KafkaError> {
    let p = producer.clone();
    tokio::task::spawn_blocking(move || p.abort_transaction(TXN_TIMEOUT))
        .await
        .unwrap_or(Err(KafkaError::Canceled))
}

/// A transactional call failed: fatal gives the lane up; otherwise abort
/// (when needed) and retry the rows later.
async fn txn_failed(producer: &FutureProducer, call: &'static str, e: &KafkaError, id: i64) -> BatchEnd {
    match exactly_once::classify_txn(e) {
        TxnFailure::Fatal => {
            tracing::error!(error = %e, call, "transactional producer fenced or failed fatally; giving the lane up");
            BatchEnd::Lost
        }
        TxnFailure::Abort => {
            tracing::warn!(error = %e, call, "transaction failed; aborting and retrying");
            if let KafkaError::Transaction(t) = e {
                if t.txn_requires_abort() {
                    return match abort_txn(producer).await {
                        Ok(()) => BatchEnd::Stalled { id, code: call },
                        Err(e2) if exactly_once::classify_txn(&e2) == TxnFailure::Fatal => BatchEnd::Lost,
                        Err(_) => BatchEnd::Reinit { id, code: call },
                    };
                }
            }
            // A commit or abort that failed without asking for an abort (a
            // timeout, say) leaves the transaction in an unknown state.
            BatchEnd::Reinit { id, code: call }
        }
    }
}

/// The relay's retry delays: exponential from 100 ms to 10 s, with jitter,
/// never giving up.
pub(crate) fn retry_backoff() -> impl Iterator<Item = Duration> {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(10))
        .with_jitter()
        .without_max_times()
        .build()
}

/// Sleeps the next backoff step; true when the lane should stop instead.
async fn pause(
    backoff: &mut impl Iterator<Item = Duration>,
    finish: &CancellationToken,
    abort: &CancellationToken,
) -> bool {
    let d = backoff.next().unwrap_or(Duration::from_secs(10));
    tokio::select! {
        _ = tokio::time::sleep(d) => false,
        _ = finish.cancelled() => true,
        _ = abort.cancelled() => true,
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
