//! The table-wide gauges the relay refreshes every `GAUGES_EVERY`: per WAL
//! slot (what a slot holds back) and per job queue (workers behind or gone,
//! jobs that died). Every relay reports the same values.

use std::sync::atomic::AtomicU64;

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

use super::{QueueLabel, SlotLabel, SlotStatusLabel};

/// Per-slot gauges of WAL capture, the signals that a slot holds WAL back:
/// a dead relay's slot keeps every WAL segment since its confirmed position
/// until `max_slot_wal_keep_size` (if set) invalidates it.
#[derive(Debug, Default)]
pub struct WalSlotGauges {
    /// WAL held back: the current position minus the confirmed one.
    pub lag_bytes: Family<SlotLabel, Gauge>,
    /// Time lag: how long the oldest row not yet delivered has waited.
    pub lag_seconds: Family<SlotLabel, Gauge<f64, AtomicU64>>,
    /// 1 while a relay streams from the slot.
    pub active: Family<SlotLabel, Gauge>,
    /// Bytes of WAL that may still be written before PostgreSQL invalidates
    /// the slot; absent when unbounded (`max_slot_wal_keep_size = -1`).
    pub safe_wal_size: Family<SlotLabel, Gauge>,
    /// 1 for the slot's current `wal_status`.
    pub status: Family<SlotStatusLabel, Gauge>,
    /// The latest samples, for the OpenTelemetry callbacks.
    pub(super) latest: std::sync::Arc<std::sync::Mutex<Vec<ferry::operator::WalSlot>>>,
}

impl WalSlotGauges {
    /// Sets every gauge from `slots` (what `Operator::wal_slots` read).
    pub fn set(&self, slots: &[ferry::operator::WalSlot]) {
        self.status.clear();
        for s in slots {
            let l = SlotLabel { slot: s.slot.clone() };
            self.lag_bytes.get_or_create(&l).set(s.lag_bytes);
            self.lag_seconds.get_or_create(&l).set(s.lag_ms as f64 / 1000.0);
            self.active.get_or_create(&l).set(i64::from(s.active));
            match s.safe_wal_size {
                Some(n) => {
                    self.safe_wal_size.get_or_create(&l).set(n);
                }
                None => {
                    self.safe_wal_size.remove(&l);
                }
            }
            let wal_status = status_label(s);
            self.status
                .get_or_create(&SlotStatusLabel {
                    slot: s.slot.clone(),
                    wal_status,
                })
                .set(1);
        }
        *self.latest.lock().unwrap_or_else(|p| p.into_inner()) = slots.to_vec();
    }
}

/// Per-queue job gauges, table-wide (every relay reports the same values):
/// the signals of workers that fall behind or are gone, and of jobs that
/// died, exported by the relay because no other Ferry process serves
/// `/metrics` in every deployment.
#[derive(Debug, Default)]
pub struct JobGauges {
    /// How long the queue's oldest due queued job has waited, in seconds.
    pub oldest_due_age: Family<QueueLabel, Gauge<f64, AtomicU64>>,
    /// Expired leases not reclaimed yet.
    pub expired_leases: Family<QueueLabel, Gauge>,
    /// Dead jobs.
    pub dead: Family<QueueLabel, Gauge>,
    /// The latest samples: the queues to drop when they go quiet, and what
    /// the OpenTelemetry callbacks observe.
    pub(super) latest: std::sync::Arc<std::sync::Mutex<Vec<ferry::QueueGauges>>>,
}

impl JobGauges {
    /// Sets every gauge from `queues` (what `Operator::queue_gauges` read)
    /// and drops the queues no longer in it, series by series, so that a
    /// scrape never sees a queue that still reports vanish for a moment.
    pub fn set(&self, queues: &[ferry::QueueGauges]) {
        let mut latest = self.latest.lock().unwrap_or_else(|p| p.into_inner());
        for q in queues {
            let l = QueueLabel { queue: q.queue.clone() };
            self.oldest_due_age
                .get_or_create(&l)
                .set(q.oldest_due_age_ms as f64 / 1000.0);
            self.expired_leases.get_or_create(&l).set(q.expired_leases);
            self.dead.get_or_create(&l).set(q.dead);
        }
        for gone in latest.iter().filter(|old| queues.iter().all(|q| q.queue != old.queue)) {
            let l = QueueLabel {
                queue: gone.queue.clone(),
            };
            self.oldest_due_age.remove(&l);
            self.expired_leases.remove(&l);
            self.dead.remove(&l);
        }
        *latest = queues.to_vec();
    }
}

/// A slot's `wal_status` label: PostgreSQL's, or `dropped` when the slot no
/// longer exists.
pub(super) fn status_label(s: &ferry::operator::WalSlot) -> String {
    s.wal_status.clone().unwrap_or_else(|| "dropped".into())
}
