//! Poison rows: records Kafka will never accept. A row is marked dead (or
//! blocks its lane) only on evidence about that row alone: the client
//! refused it before sending, or the broker refused it while it was the only
//! record of its produce request. A refusal through the shared producer is
//! never such evidence: librdkafka puts records of every lane bound for one
//! partition into one request and the broker refuses the request whole (a
//! poison row of another lane, or valid rows whose sum exceeds the topic's
//! `max.message.bytes`). So the batch stops with [`BatchEnd::Isolate`] and
//! the lane re-sends the refused row through the relay's
//! [`LoneProducer`], alone; exactly once, a refused transaction of several
//! rows is retried one row per transaction (the lane's own producer carries
//! nothing else). A row known to be poison is marked dead
//! (`--on-poison=dead`, the default) or blocks the lane
//! (`--on-poison=block`).

use std::sync::{Arc, OnceLock};

use rdkafka::producer::{FutureProducer, Producer};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::ClientConfig;

use super::BatchEnd;
use crate::config::{OnPoison, RelayConfig};
use crate::publish::{self, Outcome};
use crate::state::RelayState;
use crate::store::{LaneLease, PendingRow};

/// The relay's producer for lone re-sends (at least once): one record in
/// flight at a time across all lanes, each in a batch and a request of its
/// own, so the broker's answer is about that record alone. Created on first
/// use (a relay that never isolates a row opens no second connection and
/// asks for no second producer id); clones share it.
#[derive(Clone)]
pub struct LoneProducer {
    /// [`publish::lone_producer_config`], for the first use.
    config: ClientConfig,
    /// The producer, once the first lone re-send created it (shared by the
    /// clones, so the relay has one).
    producer: Arc<OnceLock<FutureProducer>>,
    /// Held from a record's send until its delivery settles, by a task of
    /// its own: a lane aborted meanwhile drops only its wait, so no record is
    /// ever left in flight beside the next lone re-send.
    gate: Arc<tokio::sync::Mutex<()>>,
}

impl LoneProducer {
    /// A lone producer with the relay's producer settings; nothing connects
    /// until the first [`LoneProducer::send`].
    pub fn new(cfg: &RelayConfig) -> Self {
        LoneProducer {
            config: publish::lone_producer_config(cfg),
            producer: Arc::new(OnceLock::new()),
            gate: Arc::new(tokio::sync::Mutex::new(())),
        }
    }

    /// Publishes `row` to `topic` as the only record in flight, waiting for
    /// the other lanes' lone re-sends to settle first; its outcome.
    pub(super) async fn send(&self, topic: String, row: PendingRow, database_id: Arc<str>) -> Outcome {
        let gate = self.gate.clone().lock_owned().await;
        let producer = match self.producer() {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(error = %e, "creating the lone producer failed");
                return Outcome::Transient("lone_producer");
            }
        };
        let sent = tokio::spawn(async move {
            let _gate = gate;
            match producer.send_result(publish::record(&topic, &row, &database_id)) {
                Ok(delivery) => publish::delivered(delivery.await),
                Err((e, _)) => publish::classify(&e),
            }
        });
        match sent.await {
            Ok(outcome) => outcome,
            // The task panicked or the runtime is shutting down.
            Err(_) => Outcome::Transient("canceled"),
        }
    }

    /// The lone producer's fatal error, if it was created and failed fatally.
    pub fn fatal_error(&self) -> Option<(RDKafkaErrorCode, String)> {
        self.producer.get().and_then(|p| p.client().fatal_error())
    }

    /// The producer, created by the first caller (callers hold the gate).
    fn producer(&self) -> Result<FutureProducer, rdkafka::error::KafkaError> {
        if let Some(p) = self.producer.get() {
            return Ok(p.clone());
        }
        let created: FutureProducer = self.config.create()?;
        Ok(self.producer.get_or_init(|| created).clone())
    }
}

/// At least once: `row`'s record was refused as poison with `code` (already
/// counted). `alone`: the refusal is certainly this row's (refused by the
/// client before sending, or sent through the [`LoneProducer`]); otherwise
/// the row is isolated first. `Some` stops the batch.
pub(super) async fn refused(
    state: &RelayState,
    cfg: &RelayConfig,
    lease: LaneLease,
    row: &PendingRow,
    code: &'static str,
    alone: bool,
) -> Option<BatchEnd> {
    if !alone {
        return Some(BatchEnd::Isolate { through: row.id, code });
    }
    if cfg.on_poison == OnPoison::Block {
        tracing::error!(
            lane = lease.lane,
            id = row.id,
            code,
            "poison record blocks the lane (--on-poison=block)"
        );
        return Some(BatchEnd::Stalled { id: row.id, code });
    }
    poison_dead(state, lease, row, code).await
}

/// Exactly once, after the transaction was aborted: the `i`th of `rows` was
/// refused as poison with `code`. `sync_failure`: the client refused it
/// before sending, so the refusal is certainly this row's. The aborted
/// transaction's other rows are still pending, so a batch of several rows
/// ends [`BatchEnd::Unfinished`], never `Done`.
pub(super) async fn refused_in_txn(
    state: &RelayState,
    cfg: &RelayConfig,
    lease: LaneLease,
    rows: &[PendingRow],
    i: usize,
    code: &'static str,
    sync_failure: bool,
) -> BatchEnd {
    // Refused with the rest of its request: find the row first.
    if rows.len() > 1 && !sync_failure {
        return BatchEnd::Isolate {
            through: rows.last().map(|r| r.id).unwrap_or(0),
            code,
        };
    }
    state.metrics.publish_error(code);
    if cfg.on_poison == OnPoison::Block {
        // The rows before it are valid: publish them one per transaction,
        // then block on this one alone, never holding them back with it.
        if i > 0 {
            return BatchEnd::Isolate {
                through: rows[i].id,
                code,
            };
        }
        return BatchEnd::Stalled { id: rows[i].id, code };
    }
    match poison_dead(state, lease, &rows[i], code).await {
        Some(stop) => stop,
        None if rows.len() == 1 => BatchEnd::Done,
        None => BatchEnd::Unfinished,
    }
}

/// Marks a poison row dead (logged without its payload); `Some` stops.
pub(super) async fn poison_dead(
    state: &RelayState,
    lease: LaneLease,
    row: &PendingRow,
    code: &'static str,
) -> Option<BatchEnd> {
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
