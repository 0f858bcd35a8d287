//! At least once: a batch streams through the shared idempotent producer,
//! acknowledged rows are marked progressively (see [`Marker`]), and at the
//! first failed row nothing more is produced: what is in flight is awaited,
//! only the acknowledged prefix is marked. A row being isolated is published
//! alone through the [`LoneProducer`] instead ([`lone`]).

use std::collections::VecDeque;
use std::sync::Arc;

use futures::FutureExt;
use rdkafka::error::KafkaError;
use rdkafka::producer::{DeliveryFuture, FutureProducer};
use rdkafka::types::RDKafkaErrorCode;

use super::marker::Marker;
use super::{now_ms, poison, BatchEnd, LoneProducer};
use crate::config::RelayConfig;
use crate::publish::{self, Outcome};
use crate::state::RelayState;
use crate::store::{LaneLease, PendingRow};

/// At least once: streams the batch, marks acknowledged rows progressively,
/// and stops producing at the first failed row.
pub(super) async fn at_least_once(
    state: &RelayState,
    cfg: &RelayConfig,
    producer: &FutureProducer,
    database_id: &str,
    lease: LaneLease,
    rows: &[PendingRow],
) -> BatchEnd {
    let mut stream = Stream {
        state,
        cfg,
        rows,
        marker: Marker::new(lease),
        inflight: VecDeque::new(),
    };
    let end = stream.produce(producer, database_id).await;
    let end = stream.drain(end).await;
    finish(state, cfg, &mut stream.marker, end).await
}

/// Isolation: publishes `row` as the only record in flight through the
/// relay's lone producer, so its outcome, a refusal included, is this row's
/// own.
pub(super) async fn lone(
    state: &RelayState,
    cfg: &RelayConfig,
    producer: &LoneProducer,
    database_id: &Arc<str>,
    lease: LaneLease,
    row: &PendingRow,
) -> BatchEnd {
    let topic = cfg.route(&row.topic, &row.tenant);
    let outcome = producer.send(topic, row.clone(), database_id.clone()).await;
    let mut marker = Marker::new(lease);
    let end = settle(state, cfg, &mut marker, row, outcome, true)
        .await
        .unwrap_or(BatchEnd::Done);
    finish(state, cfg, &mut marker, end).await
}

/// Marks what is still buffered; the batch's end (a failed mark stops a
/// batch that was otherwise done, and a lost lane stops any).
async fn finish(state: &RelayState, cfg: &RelayConfig, marker: &mut Marker, end: BatchEnd) -> BatchEnd {
    match marker.flush(state, cfg).await {
        Some(BatchEnd::Lost) => BatchEnd::Lost,
        Some(stop) if end == BatchEnd::Done => stop,
        _ => end,
    }
}

/// One batch being streamed: its rows, the deliveries in flight (by row
/// index, oldest first) and the acknowledged ids not yet marked.
struct Stream<'a> {
    state: &'a RelayState,
    cfg: &'a RelayConfig,
    rows: &'a [PendingRow],
    marker: Marker,
    inflight: VecDeque<(usize, DeliveryFuture)>,
}

impl Stream<'_> {
    /// Produces the rows in order until one fails; the end so far.
    async fn produce(&mut self, producer: &FutureProducer, database_id: &str) -> BatchEnd {
        let rows = self.rows;
        for (i, row) in rows.iter().enumerate() {
            if let Some(stop) = self.settle_arrived().await {
                return stop;
            }
            if let Some(stop) = self.send(producer, database_id, i, row).await {
                return stop;
            }
        }
        BatchEnd::Done
    }

    /// Settles acknowledgements that already arrived, so a failure stops the
    /// lane before anything more is produced.
    async fn settle_arrived(&mut self) -> Option<BatchEnd> {
        while let Some(Some(r)) = self.inflight.front_mut().map(|(_, f)| f.now_or_never()) {
            let (j, _) = self.inflight.pop_front().expect("front exists");
            if let Some(stop) = self.settle_delivery(j, publish::delivered(r)).await {
                return Some(stop);
            }
        }
        None
    }

    /// Hands row `i` to the producer, waiting for the oldest delivery while
    /// its queue is full. `Some` stops the batch.
    async fn send(
        &mut self,
        producer: &FutureProducer,
        database_id: &str,
        i: usize,
        row: &PendingRow,
    ) -> Option<BatchEnd> {
        let topic = self.cfg.route(&row.topic, &row.tenant);
        loop {
            match producer.send_result(publish::record(&topic, row, database_id)) {
                Ok(fut) => {
                    self.inflight.push_back((i, fut));
                    return None;
                }
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) => {
                    let Some((j, fut)) = self.inflight.pop_front() else {
                        return Some(BatchEnd::Stalled {
                            id: row.id,
                            code: "queue_full",
                        });
                    };
                    // Make room by waiting for the oldest delivery.
                    let outcome = publish::delivered(fut.await);
                    if let Some(stop) = self.settle_delivery(j, outcome).await {
                        return Some(stop);
                    }
                }
                // Refused by the client before sending: certainly this row's.
                // The rows before it are settled first, in order: a stop here
                // must not leave them acknowledged but unmarked, republished
                // on every retry (forever, when the row blocks the lane).
                Err((e, _)) => {
                    if let Some(stop) = self.settle_inflight().await {
                        return Some(stop);
                    }
                    return settle(self.state, self.cfg, &mut self.marker, row, publish::classify(&e), true).await;
                }
            }
        }
    }

    /// Awaits and settles, in order, every delivery in flight. `Some` stops
    /// the batch (what is still in flight is then left to [`Stream::drain`]).
    async fn settle_inflight(&mut self) -> Option<BatchEnd> {
        while let Some((j, fut)) = self.inflight.pop_front() {
            let outcome = publish::delivered(fut.await);
            if let Some(stop) = self.settle_delivery(j, outcome).await {
                return Some(stop);
            }
        }
        None
    }

    /// Awaits what is still in flight, settling it only while the batch has
    /// not stopped; the batch's end.
    async fn drain(&mut self, mut end: BatchEnd) -> BatchEnd {
        for (j, fut) in std::mem::take(&mut self.inflight) {
            let outcome = publish::delivered(fut.await);
            // After a stop, what was still in flight is awaited but not marked:
            // only the acknowledged prefix counts.
            if end == BatchEnd::Done {
                if let Some(stop) = self.settle_delivery(j, outcome).await {
                    end = stop;
                }
            }
        }
        end
    }

    /// Settles the delivery of row `j`. Its outcome is never the row's own
    /// alone: the shared producer's request may have held other records, of
    /// this lane or any other, bound for the same partition.
    async fn settle_delivery(&mut self, j: usize, outcome: Outcome) -> Option<BatchEnd> {
        settle(self.state, self.cfg, &mut self.marker, &self.rows[j], outcome, false).await
    }
}

/// Applies one row's outcome in order; `Some` stops the batch. `alone`:
/// the outcome is certainly this row's (refused by the client before
/// sending, or sent through the lone producer), not its produce request's.
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
            m.observe_latency(now_ms() - row.created_at.get());
            marker.push(row.id);
            if marker.due() {
                return marker.flush(state, cfg).await;
            }
            None
        }
        Outcome::Poison(code) => {
            m.publish_error(code);
            poison::refused(state, cfg, marker.lease, row, code, alone).await
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
