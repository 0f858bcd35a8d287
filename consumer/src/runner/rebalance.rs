//! The rebalance callback: the rdkafka `ConsumerContext` that takes a
//! partition lease on assign (and positions the partition at the offset
//! stored with the effects) and gives it back on revoke, only if still ours.

use std::time::Duration;

use crate::store::ConsumerStore;
use crate::store::PartitionLease;
use rdkafka::consumer::{BaseConsumer, Consumer as _, ConsumerContext, RebalanceProtocol};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::types::RDKafkaRespErr;
use rdkafka::ClientContext;

use super::{Commits, Leases, TopicPartition};

/// Drives the leases from rebalance callbacks. Callbacks run inside
/// `poll`, which the loop calls from `block_in_place`, so they may block on
/// the database.
pub(super) struct LeaseContext {
    pub(super) store: ConsumerStore,
    pub(super) group: String,
    pub(super) owner: String,
    pub(super) lease: Duration,
    pub(super) leases: Leases,
    pub(super) commits: Commits,
    pub(super) handle: tokio::runtime::Handle,
}

impl ClientContext for LeaseContext {}

impl ConsumerContext for LeaseContext {
    fn rebalance(&self, base: &BaseConsumer<Self>, err: RDKafkaRespErr, tpl: &mut TopicPartitionList) {
        let cooperative = matches!(base.rebalance_protocol(), RebalanceProtocol::Cooperative);
        match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => self.on_assign(base, tpl, cooperative),
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => self.on_revoke(base, tpl, cooperative),
            other => {
                tracing::error!(error = ?other, "rebalance error");
                if !cooperative {
                    let _ = base.unassign();
                }
            }
        }
    }
}

impl LeaseContext {
    /// Leases the assigned partitions (positioning each at its stored
    /// offset), hands the assignment to librdkafka, resumes it, and pauses
    /// the partitions whose lease could not be taken.
    fn on_assign(&self, base: &BaseConsumer<Self>, tpl: &mut TopicPartitionList, cooperative: bool) {
        let unleased = self.lease_assigned(tpl);
        let r = if cooperative {
            base.incremental_assign(tpl)
        } else {
            base.assign(tpl)
        };
        if let Err(e) = r {
            tracing::error!(error = %e, "assign failed");
        }
        // A partition paused by an earlier owner-ship of ours (a retry,
        // a lost lease) must not stay paused when it comes back.
        let _ = base.resume(tpl);
        if unleased.count() > 0 {
            if let Err(e) = base.pause(&unleased) {
                tracing::error!(error = %e, "pausing unleased partitions failed");
            }
        }
    }

    /// Takes the lease of each partition in `tpl`, one after the other, and
    /// sets the offset stored with the effects as its start. Returns the
    /// partitions whose lease could not be taken.
    fn lease_assigned(&self, tpl: &mut TopicPartitionList) -> TopicPartitionList {
        let mut unleased = TopicPartitionList::new();
        for (topic, partition) in partitions(tpl) {
            let acquired = self.handle.block_on(self.store.acquire_partition(
                &self.group,
                &topic,
                partition,
                &self.owner,
                self.lease,
            ));
            match acquired {
                Ok((lease, next)) => self.leased(tpl, topic, partition, lease, next),
                Err(e) => {
                    // Paused until the reclaim path leases it and
                    // seeks to the stored offset.
                    tracing::error!(%topic, partition, error = %e, "cannot lease an assigned partition; paused until it can");
                    unleased.add_partition(&topic, partition);
                }
            }
        }
        unleased
    }

    /// Records a lease just taken in the rebalance callback; with a stored
    /// offset, starts the partition there and queues its Kafka commit.
    fn leased(
        &self,
        tpl: &mut TopicPartitionList,
        topic: String,
        partition: i32,
        lease: PartitionLease,
        next: Option<i64>,
    ) {
        if let Some(n) = next {
            // Resume from the offset stored with the effects.
            let _ = tpl.set_partition_offset(&topic, partition, Offset::Offset(n));
            // And tell Kafka: the previous owner may have died
            // before its last commit reached the broker, and
            // with nothing left to process none would follow.
            self.commits
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(((topic.clone(), partition), n));
        }
        tracing::info!(%topic, partition, generation = lease.generation, next_offset = ?next, "partition assigned");
        self.leases
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert((topic, partition), lease);
    }

    /// Gives back the lease of each revoked partition this member holds,
    /// then lets librdkafka unassign them.
    fn on_revoke(&self, base: &BaseConsumer<Self>, tpl: &TopicPartitionList, cooperative: bool) {
        for tp in partitions(tpl) {
            let lease = self.leases.lock().unwrap_or_else(|p| p.into_inner()).remove(&tp);
            if let Some(lease) = lease {
                // Only if still ours: a newer generation is left alone.
                let _ = self.handle.block_on(self.store.release_partition(&lease));
                tracing::info!(topic = %tp.0, partition = tp.1, "partition revoked");
            }
        }
        let r = if cooperative {
            base.incremental_unassign(tpl)
        } else {
            base.unassign()
        };
        if let Err(e) = r {
            tracing::error!(error = %e, "unassign failed");
        }
    }
}

/// The partitions of `tpl`.
fn partitions(tpl: &TopicPartitionList) -> Vec<TopicPartition> {
    tpl.elements()
        .iter()
        .map(|e| (e.topic().to_owned(), e.partition()))
        .collect()
}
