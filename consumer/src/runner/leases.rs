//! The poll loop's lease bookkeeping: losing a lease, taking a partition
//! back, the seeks that position it again, renewals, Kafka commits of the
//! stored offsets, and lag.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::store::PartitionLease;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer as _};
use rdkafka::error::KafkaResult;
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};

use super::rebalance::LeaseContext;
use super::{Commits, Consumer, Leases, TopicPartition};

/// How long a member waits after losing a partition lease before checking
/// whether Kafka still assigns the partition to it.
const RECLAIM_AFTER: Duration = Duration::from_secs(3);

impl Consumer {
    /// Stops processing a partition whose lease is no longer current: drops
    /// the lease (if still this one), pauses the partition and schedules a
    /// reclaim in case Kafka keeps assigning it here.
    pub(super) fn lost(&self, consumer: &BaseConsumer<LeaseContext>, leases: &Leases, lease: &PartitionLease) {
        let tp = (lease.topic.clone(), lease.partition);
        {
            let mut held = leases.lock().unwrap_or_else(|p| p.into_inner());
            if held.get(&tp).map(|l| l.generation) != Some(lease.generation) {
                return; // already replaced or dropped
            }
            held.remove(&tp);
        }
        self.metrics.lease_losses.inc();
        let _ = pause(consumer, &tp, true);
        self.reclaims
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(tp, Instant::now() + RECLAIM_AFTER);
    }

    /// Takes back partitions whose lease was lost (or never taken) but which
    /// Kafka still assigns here, only if no other member holds a live lease
    /// on them: the local assignment may be stale (the group may have moved
    /// the partition and not told this member yet), and the member Kafka
    /// assigned it to took it in its rebalance callback. While another lease
    /// is live, the partition stays paused and the check is repeated; the
    /// lease frees up when its holder releases it on revoke or stops renewing
    /// it. A reclaimed partition resumes from the offset stored with the
    /// effects.
    pub(super) async fn reclaim_due(&self, consumer: &BaseConsumer<LeaseContext>, leases: &Leases, commits: &Commits) {
        let due = self.take_due_reclaims();
        if due.is_empty() {
            return;
        }
        let assigned = consumer.assignment().unwrap_or_default();
        for tp in due {
            if leases.lock().unwrap_or_else(|p| p.into_inner()).contains_key(&tp) {
                // Assigned here again meanwhile: the callback leased it,
                // positioned it and resumed it.
                continue;
            }
            if assigned.find_partition(&tp.0, tp.1).is_none() {
                continue;
            }
            self.reclaim(leases, commits, tp).await;
        }
        self.apply_seeks(consumer, leases);
    }

    /// Removes and returns the reclaims whose time has come.
    fn take_due_reclaims(&self) -> Vec<TopicPartition> {
        let mut r = self.reclaims.lock().unwrap_or_else(|p| p.into_inner());
        let due: Vec<_> = r
            .iter()
            .filter(|(_, at)| **at <= Instant::now())
            .map(|(tp, _)| tp.clone())
            .collect();
        for tp in &due {
            r.remove(tp);
        }
        due
    }

    /// Tries to take `tp`'s lease back if it is free; on success, queues the
    /// seek to its stored offset (and that offset's Kafka commit), otherwise
    /// schedules the check again.
    async fn reclaim(&self, leases: &Leases, commits: &Commits, tp: TopicPartition) {
        let b = &self.b;
        let again = || {
            self.reclaims
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(tp.clone(), Instant::now() + RECLAIM_AFTER);
        };
        match b
            .store
            .acquire_free_partition(&b.group, &tp.0, tp.1, &b.owner, b.lease)
            .await
        {
            Ok(Some((lease, next))) => {
                tracing::info!(topic = %tp.0, partition = tp.1, generation = lease.generation, "partition lease taken back");
                let generation = lease.generation;
                leases
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(tp.clone(), lease);
                // Records fetched while the partition had no lease were
                // passed over: go back to the offset stored with the
                // effects (or the beginning, when nothing was ever
                // processed) before resuming.
                let at = next.map(Offset::Offset).unwrap_or(Offset::Beginning);
                if let Some(n) = next {
                    commits.lock().unwrap_or_else(|p| p.into_inner()).push((tp.clone(), n));
                }
                self.seeks
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(tp.clone(), (generation, at));
            }
            Ok(None) => {
                self.metrics.reclaims_deferred.inc();
                tracing::info!(topic = %tp.0, partition = tp.1, "another member holds the partition's lease; checking again later");
                again();
            }
            Err(e) => {
                tracing::warn!(error = %e, "taking a partition back failed; retrying later");
                again();
            }
        }
    }

    /// Performs the pending seeks of partitions still leased at the seek's
    /// generation, resuming each partition once its seek succeeded. A failed
    /// seek leaves its partition paused and is tried again on the next turn
    /// of the loop, so records are never passed over for good.
    pub(super) fn apply_seeks(&self, consumer: &BaseConsumer<LeaseContext>, leases: &Leases) {
        let pending: Vec<(TopicPartition, (i64, Offset))> = self
            .seeks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(tp, s)| (tp.clone(), *s))
            .collect();
        for (tp, (gen, at)) in pending {
            if generation(leases, &tp) != Some(gen) {
                // Revoked or leased again since: whoever changed the lease
                // positioned the partition.
                self.seeks.lock().unwrap_or_else(|p| p.into_inner()).remove(&tp);
                continue;
            }
            let r = tokio::task::block_in_place(|| consumer.seek(&tp.0, tp.1, at, Duration::from_secs(5)));
            match r {
                Ok(()) => {
                    self.seeks.lock().unwrap_or_else(|p| p.into_inner()).remove(&tp);
                    if let Err(e) = pause(consumer, &tp, false) {
                        tracing::warn!(topic = %tp.0, partition = tp.1, error = %e, "resuming a partition failed");
                    }
                }
                Err(e) => {
                    tracing::warn!(topic = %tp.0, partition = tp.1, offset = ?at, error = %e, "seek failed; the partition stays paused and the seek is retried");
                    let _ = pause(consumer, &tp, true);
                }
            }
        }
    }

    /// Partitions Kafka assigns here that have no lease (the lease could not
    /// be taken in the rebalance callback) get one through the reclaim path.
    pub(super) fn watch_unleased(&self, consumer: &BaseConsumer<LeaseContext>, leases: &Leases) {
        let assigned = consumer.assignment().unwrap_or_default();
        let held = leases.lock().unwrap_or_else(|p| p.into_inner());
        let mut reclaims = self.reclaims.lock().unwrap_or_else(|p| p.into_inner());
        for e in assigned.elements() {
            let tp = (e.topic().to_owned(), e.partition());
            if !held.contains_key(&tp) && !reclaims.contains_key(&tp) {
                reclaims.insert(tp, Instant::now() + RECLAIM_AFTER);
            }
        }
    }

    /// Renews each lease this member holds, at its generation (never a row
    /// it released or lost: that would keep a stale lease alive and the
    /// partition's assignee waiting). A renewal that matches nothing is a
    /// lost lease.
    pub(super) async fn housekeeping(&self, consumer: &BaseConsumer<LeaseContext>, leases: &Leases) {
        let b = &self.b;
        let held: Vec<PartitionLease> = leases
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect();
        for lease in held {
            match b.store.renew_partition(&lease, b.lease).await {
                Ok(true) => {}
                Ok(false) => {
                    tracing::warn!(topic = %lease.topic, partition = lease.partition, "partition lease lost at renewal; pausing it");
                    self.lost(consumer, leases, &lease);
                }
                Err(e) => tracing::warn!(error = %e, "renewing a partition lease failed"),
            }
        }
        // Re-commit the stored offsets of held partitions to Kafka: an
        // asynchronous commit can be lost (a rebalance in progress, a member
        // killed before it reached the broker), and a partition with nothing
        // left to process would otherwise never be committed again.
        if let Ok(stored) = b.store.stored_offsets(&b.group).await {
            let mut tpl = TopicPartitionList::new();
            for s in stored {
                if let Some(next) = s.next_offset {
                    let tp = (s.topic, s.partition);
                    if generation(leases, &tp).is_some() {
                        let _ = tpl.add_partition_offset(&tp.0, tp.1, Offset::Offset(next));
                    }
                }
            }
            if tpl.count() > 0 {
                let _ = consumer.commit(&tpl, CommitMode::Async);
            }
        }
        let _ = b.store.sweep_ledger(&b.group, b.ledger_retention, 1000).await;
    }

    /// Lag per held partition: high watermark minus the offset stored with
    /// the effects. Asks the broker, so it runs only every
    /// [`LAG_EVERY`](super::LAG_EVERY).
    pub(super) async fn measure_lag(&self, consumer: &BaseConsumer<LeaseContext>, leases: &Leases) {
        let b = &self.b;
        let held: Vec<TopicPartition> = leases
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect();
        let stored: HashMap<TopicPartition, i64> = b
            .store
            .stored_offsets(&b.group)
            .await
            .unwrap_or_default()
            .into_iter()
            .filter_map(|s| s.next_offset.map(|n| ((s.topic, s.partition), n)))
            .collect();
        for tp in held {
            let wm = tokio::task::block_in_place(|| consumer.fetch_watermarks(&tp.0, tp.1, Duration::from_millis(200)));
            if let Ok((_, high)) = wm {
                let at = stored.get(&tp).copied().unwrap_or(0);
                self.metrics.set_lag(&tp.0, tp.1, (high - at).max(0));
            }
        }
    }
}

/// Commits to Kafka the stored offsets of partitions just leased (and still
/// held): advisory, for lag tools, like every Kafka commit here.
pub(super) fn commit_stored(consumer: &BaseConsumer<LeaseContext>, leases: &Leases, commits: &Commits) {
    let due: Vec<(TopicPartition, i64)> = std::mem::take(&mut *commits.lock().unwrap_or_else(|p| p.into_inner()));
    if due.is_empty() {
        return;
    }
    let mut tpl = TopicPartitionList::new();
    for ((topic, partition), next) in due {
        if generation(leases, &(topic.clone(), partition)).is_some() {
            let _ = tpl.add_partition_offset(&topic, partition, Offset::Offset(next));
        }
    }
    if tpl.count() > 0 {
        let _ = consumer.commit(&tpl, CommitMode::Async);
    }
}

/// The generation of the lease held on `tp`, if any.
pub(super) fn generation(leases: &Leases, tp: &TopicPartition) -> Option<i64> {
    leases
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(tp)
        .map(|l| l.generation)
}

/// The lease held on `tp` if it is still at `generation`.
pub(super) fn current_lease(leases: &Leases, tp: &TopicPartition, generation: i64) -> Option<PartitionLease> {
    leases
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(tp)
        .filter(|l| l.generation == generation)
        .cloned()
}

/// Pauses (`yes`) or resumes one partition.
pub(super) fn pause(consumer: &BaseConsumer<LeaseContext>, tp: &TopicPartition, yes: bool) -> KafkaResult<()> {
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition(&tp.0, tp.1);
    if yes {
        consumer.pause(&tpl)
    } else {
        consumer.resume(&tpl)
    }
}
