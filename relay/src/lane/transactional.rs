//! Exactly once: one Kafka transaction per batch through the lane's
//! transactional producer, carrying the rows and a progress record with
//! their exact ids; the rows are marked right after the commit and before
//! the next transaction.

use std::sync::Arc;
use std::time::Duration;

use rdkafka::error::KafkaError;
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};
use tokio_util::sync::CancellationToken;

use super::{now_ms, poison, retry_backoff, BatchEnd};
use crate::config::RelayConfig;
use crate::exactly_once::{self, Progress, TxnFailure, TXN_TIMEOUT};
use crate::publish::{self, Outcome};
use crate::state::RelayState;
use crate::store::{LaneLease, PendingRow};

/// Exactly once: one transaction with the rows and the progress record,
/// committed, then the rows marked before anything else happens.
pub(super) async fn transactional_batch(
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
    let txn = Txn {
        state,
        cfg,
        producer,
        database_id,
        lease,
        rows,
    };
    let mut sent = txn.send_rows();
    let ids: Vec<i64> = sent.inflight.iter().map(|(i, _)| rows[*i].id).collect();
    let progress_fut = txn.send_progress(&ids, &mut sent.failed);
    let created: Vec<i64> = sent.inflight.iter().map(|(i, _)| rows[*i].created_at.get()).collect();
    await_deliveries(sent.inflight, progress_fut, &mut sent.failed, &mut sent.sync_failure).await;
    if let Some((i, outcome)) = sent.failed {
        return txn.abort_failed(i, outcome, sent.sync_failure).await;
    }
    if let Err(end) = txn.commit().await {
        return end;
    }
    exactly_once::failpoint_after_commit();
    let acked_at = now_ms();
    for c in created {
        state.metrics.observe_latency(acked_at - c);
    }
    mark_committed(state, cfg, lease, &ids, abort).await
}

/// One batch's transaction and what it needs.
struct Txn<'a> {
    state: &'a RelayState,
    cfg: &'a RelayConfig,
    producer: &'a FutureProducer,
    database_id: &'a str,
    lease: LaneLease,
    rows: &'a [PendingRow],
}

/// The rows handed to the producer: their deliveries (by row index), the
/// first failure (row index and outcome; index 0 for the progress record),
/// and whether it was refused by the client before sending.
struct Sent {
    inflight: Vec<(usize, DeliveryFuture)>,
    failed: Option<(usize, Outcome)>,
    sync_failure: bool,
}

impl Txn<'_> {
    /// Hands the rows to the producer in order until one is refused.
    fn send_rows(&self) -> Sent {
        let mut sent = Sent {
            inflight: Vec::with_capacity(self.rows.len()),
            failed: None,
            sync_failure: false,
        };
        for (i, row) in self.rows.iter().enumerate() {
            let topic = self.cfg.route(&row.topic, &row.tenant);
            match self
                .producer
                .send_result(publish::record(&topic, row, self.database_id))
            {
                Ok(fut) => sent.inflight.push((i, fut)),
                Err((e, _)) => {
                    // Queue full included: the transaction is retried smaller.
                    sent.failed = Some((i, publish::classify(&e)));
                    sent.sync_failure = true;
                    break;
                }
            }
        }
        sent
    }

    /// Hands the progress record (these exact `ids`, under the lane
    /// generation) to the producer, unless a row already failed.
    fn send_progress(&self, ids: &[i64], failed: &mut Option<(usize, Outcome)>) -> Option<DeliveryFuture> {
        let progress = Progress {
            database: self.database_id.to_owned(),
            lane: self.lease.lane,
            generation: self.lease.generation,
            ids: ids.to_vec(),
        };
        let value = serde_json::to_vec(&progress).expect("progress serializes");
        let key = Progress::key(self.database_id, self.lease.lane);
        let progress_topic = self.cfg.progress_topic();
        if failed.is_some() {
            return None;
        }
        let rec = FutureRecord::to(&progress_topic)
            .partition(self.lease.lane)
            .key(key.as_bytes())
            .payload(&value[..]);
        match self.producer.send_result(rec) {
            Ok(f) => Some(f),
            Err((e, _)) => {
                *failed = Some((0, progress_failure(publish::classify(&e))));
                None
            }
        }
    }

    /// A row or the progress record failed: aborts the transaction, so
    /// nothing of it becomes visible, then decides what follows.
    async fn abort_failed(&self, i: usize, outcome: Outcome, sync_failure: bool) -> BatchEnd {
        // Nothing of this transaction becomes visible to read_committed readers.
        if let Err(e) = abort_txn(self.producer).await {
            return txn_failed(self.producer, "abort_transaction", &e, self.rows[i].id).await;
        }
        match outcome {
            Outcome::Poison(code) => {
                poison::refused_in_txn(self.state, self.cfg, self.lease, self.rows, i, code, sync_failure).await
            }
            Outcome::Transient(code) => {
                self.state.metrics.publish_error(code);
                BatchEnd::Stalled {
                    id: self.rows[i].id,
                    code,
                }
            }
            // A transactional producer's fatal error: a new one is made.
            Outcome::Fatal => BatchEnd::Lost,
            Outcome::Acked { .. } => unreachable!("only failures are recorded"),
        }
    }

    /// Commits the transaction (blocking, off the runtime); `Err` is the
    /// batch's end when it did not commit cleanly.
    async fn commit(&self) -> Result<(), BatchEnd> {
        let p = self.producer.clone();
        let commit = tokio::task::spawn_blocking(move || p.commit_transaction(TXN_TIMEOUT));
        match commit.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(txn_failed(self.producer, "commit_transaction", &e, self.rows[0].id).await),
            Err(_) => Err(BatchEnd::Reinit {
                id: self.rows[0].id,
                code: "commit_transaction",
            }),
        }
    }
}

/// Awaits every row's delivery, then the progress record's, keeping the
/// first failure in row order in `failed`. A row in flight comes before the
/// row refused before sending (`sync_failure`), so its failure outranks
/// that refusal, which it may have caused: once a row of the transaction
/// failed, the client refuses every later one (`__STATE`).
async fn await_deliveries(
    inflight: Vec<(usize, DeliveryFuture)>,
    progress_fut: Option<DeliveryFuture>,
    failed: &mut Option<(usize, Outcome)>,
    sync_failure: &mut bool,
) {
    for (i, fut) in inflight {
        match publish::delivered(fut.await) {
            Outcome::Acked { .. } => {}
            other => {
                if failed.is_none() || *sync_failure {
                    *failed = Some((i, other));
                    *sync_failure = false;
                }
            }
        }
    }
    if let Some(f) = progress_fut {
        if let o @ (Outcome::Poison(_) | Outcome::Transient(_) | Outcome::Fatal) = publish::delivered(f.await) {
            if failed.is_none() {
                *failed = Some((0, progress_failure(o)));
            }
        }
    }
}

/// Mark before the next transaction; retry until it lands or the lane is
/// lost (the next owner then marks these ids from the progress record).
async fn mark_committed(
    state: &RelayState,
    cfg: &RelayConfig,
    lease: LaneLease,
    ids: &[i64],
    abort: &CancellationToken,
) -> BatchEnd {
    let mut backoff = retry_backoff();
    loop {
        match state
            .store
            .mark_delivered(&state.owner, lease, ids, cfg.delete_on_delivery)
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
