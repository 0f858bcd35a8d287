//! [`Consumer::run`]: the poll loop. Each turn takes partitions back,
//! performs pending seeks and Kafka commits, runs the retries that are due,
//! polls a batch, processes its partitions' groups at once (each in order), and, now and then,
//! renews the leases and measures lag.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::store::PartitionLease;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::producer::FutureProducer;
use rdkafka::ClientConfig;

use super::leases::{commit_stored, generation};
use super::rebalance::LeaseContext;
use super::retry::Retry;
use super::{Assignment, Commits, Consumer, Leases, TopicPartition, LAG_EVERY};
use crate::error::ConsumerError;
use crate::record::Record;

/// A partition's records from one poll, with the lease generation they were
/// delivered under.
type PartitionRecords = (TopicPartition, i64, Vec<Record>);

impl Consumer {
    /// Consumes until `shutdown` resolves, then leaves the group (revoking,
    /// and so releasing, its partitions). Fails only at startup (the Kafka
    /// clients cannot be created, or the subscription fails); errors while
    /// consuming do not end it. Needs Tokio's multi-threaded runtime: polls
    /// and rebalance callbacks run in `block_in_place`.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), ConsumerError> {
        let b = &self.b;
        let leases: Leases = Arc::default();
        let commits: Commits = Arc::default();
        let consumer = self.subscribe(&leases, &commits)?;
        let dlq = self.dead_letter_producer()?;
        let mut retries: HashMap<TopicPartition, Retry> = HashMap::new();
        let mut housekeeping = Instant::now();
        let mut lag_at = Instant::now();
        tokio::pin!(shutdown);
        loop {
            if futures::poll!(&mut shutdown).is_ready() {
                break;
            }
            self.reclaim_due(&consumer, &leases, &commits).await;
            self.apply_seeks(&consumer, &leases);
            commit_stored(&consumer, &leases, &commits);
            self.run_due_retries(&consumer, &leases, dlq.as_ref(), &mut retries)
                .await;
            let polled = self.poll_batch(&consumer, &leases);
            let groups = self.group_by_partition(polled, &leases, &mut retries);
            self.handle_groups(&consumer, &leases, dlq.as_ref(), groups, &mut retries)
                .await;
            if housekeeping.elapsed() >= b.lease / 3 {
                housekeeping = Instant::now();
                self.housekeeping(&consumer, &leases).await;
                self.watch_unleased(&consumer, &leases);
            }
            if lag_at.elapsed() >= LAG_EVERY {
                lag_at = Instant::now();
                self.measure_lag(&consumer, &leases).await;
            }
        }
        self.leave_group(&consumer, &leases).await;
        Ok(())
    }

    /// Handles one poll's groups. Partitions are independent (each its own
    /// lease, offsets and transactions, and a partition's records stay in
    /// order within its group), so the groups run at once, up to
    /// [`ConsumerStore::parallel_transactions`](crate::store::ConsumerStore::parallel_transactions)
    /// of them: their commits share the database's WAL flushes instead of
    /// queueing one after another. A group that stopped at a record keeps
    /// its retry.
    async fn handle_groups(
        &self,
        consumer: &BaseConsumer<LeaseContext>,
        leases: &Leases,
        dlq: Option<&FutureProducer>,
        groups: Vec<PartitionRecords>,
        retries: &mut HashMap<TopicPartition, Retry>,
    ) {
        use futures::stream::{self, StreamExt};
        let handled: Vec<_> = stream::iter(groups)
            .map(|(tp, gen, records)| async move {
                // The whole group is timed, whichever way it went (one
                // batch, a batch rolled back and redone around the record
                // it stopped at, dead letters), so every turn feeds `turn_cap`.
                let (started, n) = (Instant::now(), records.len());
                let pending = self.handle_group(consumer, leases, dlq, gen, records).await;
                self.note_record_time(started.elapsed(), n);
                (tp, pending)
            })
            .buffer_unordered(self.b.store.parallel_transactions())
            .collect()
            .await;
        for (tp, pending) in handled {
            if let Some(retry) = pending {
                retries.insert(tp, retry);
            }
        }
    }

    /// Creates the Kafka consumer, its rebalance callback sharing `leases`
    /// and `commits` with the loop, and subscribes it to the topics.
    fn subscribe(&self, leases: &Leases, commits: &Commits) -> Result<BaseConsumer<LeaseContext>, ConsumerError> {
        let b = &self.b;
        let ctx = LeaseContext {
            commits: commits.clone(),
            store: b.store.clone(),
            group: b.group.clone(),
            owner: b.owner.clone(),
            lease: b.lease,
            leases: leases.clone(),
            handle: tokio::runtime::Handle::current(),
        };
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &b.brokers)
            .set("group.id", &b.group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            .set(
                "partition.assignment.strategy",
                match b.assignment {
                    Assignment::Eager => "range",
                    Assignment::CooperativeSticky => "cooperative-sticky",
                },
            );
        for (k, v) in &b.kafka {
            config.set(k, v);
        }
        let consumer: BaseConsumer<LeaseContext> = config.create_with_context(ctx)?;
        let topics: Vec<&str> = b.topics.iter().map(String::as_str).collect();
        consumer.subscribe(&topics)?;
        Ok(consumer)
    }

    /// Retries that are due, each on its own paused partition.
    async fn run_due_retries(
        &self,
        consumer: &BaseConsumer<LeaseContext>,
        leases: &Leases,
        dlq: Option<&FutureProducer>,
        retries: &mut HashMap<TopicPartition, Retry>,
    ) {
        let due: Vec<TopicPartition> = retries
            .iter()
            .filter(|(_, r)| r.due <= Instant::now())
            .map(|(tp, _)| tp.clone())
            .collect();
        for tp in due {
            if let Some(retry) = retries.remove(&tp) {
                if generation(leases, &tp) != Some(retry.generation) {
                    // The partition was revoked, or assigned here again
                    // (which resumed it from the stored offset): the
                    // retry belongs to a lease that is gone.
                    continue;
                }
                if let Some(again) = self
                    .handle(
                        consumer,
                        leases,
                        dlq,
                        retry.generation,
                        retry.record.clone(),
                        Some(retry),
                    )
                    .await
                {
                    retries.insert(tp, again);
                }
            }
        }
    }

    /// The most records this turn takes: the micro-batch, or fewer when the
    /// time records have taken so far would make the turn outlast a third
    /// of the lease (leases are renewed between turns, and rebalances and
    /// shutdown are served there); one until a record was timed.
    fn turn_cap(&self) -> usize {
        let per = self.per_record_us.load(std::sync::atomic::Ordering::Relaxed);
        if per == 0 {
            return 1;
        }
        let budget = u64::try_from(self.b.lease.as_micros() / 3).unwrap_or(u64::MAX);
        usize::try_from(budget / per)
            .unwrap_or(usize::MAX)
            .clamp(1, self.b.batch)
    }

    /// Folds the time `records` records took into the per-record
    /// average that [`Self::turn_cap`] reads (groups running at once may
    /// race here; the average stays approximate, never unbounded).
    fn note_record_time(&self, took: Duration, records: usize) {
        use std::sync::atomic::Ordering::Relaxed;
        let per = u64::try_from(took.as_micros()).unwrap_or(u64::MAX) / records.max(1) as u64;
        let old = self.per_record_us.load(Relaxed);
        let new = if old == 0 { per } else { old / 8 * 7 + per / 8 };
        self.per_record_us.store(new.max(1), Relaxed);
    }

    /// Polls one record, then whatever else is already fetched, up to
    /// [`Self::turn_cap`].
    fn poll_batch(&self, consumer: &BaseConsumer<LeaseContext>, leases: &Leases) -> Vec<(Record, Option<i64>)> {
        // Each record is tagged with the lease generation current when it
        // was delivered: a rebalance callback served by a later poll of
        // the same batch may revoke or re-lease its partition.
        tokio::task::block_in_place(|| {
            let mut out = Vec::new();
            let mut timeout = Duration::from_millis(100);
            let cap = self.turn_cap();
            while out.len() < cap {
                match consumer.poll(timeout) {
                    Some(Ok(m)) => {
                        let record = Record::from_message(&m);
                        let tp = (record.topic.clone(), record.partition);
                        out.push((record, generation(leases, &tp)));
                    }
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, "consumer error");
                        break;
                    }
                    None => break,
                }
                timeout = Duration::ZERO;
            }
            out
        })
    }

    /// Groups the polled records by partition, in poll order, keeping only
    /// those to process now. A retry of an earlier lease of a partition
    /// whose records come under a newer one is dropped from `retries`.
    fn group_by_partition(
        &self,
        polled: Vec<(Record, Option<i64>)>,
        leases: &Leases,
        retries: &mut HashMap<TopicPartition, Retry>,
    ) -> Vec<PartitionRecords> {
        // Records are passed over only when they are fetched again later:
        // - no lease, or a lease that changed since delivery: the callback
        //   or reclaim that changes a lease positions the partition at the
        //   stored offset (or it is no longer ours);
        // - a pending retry or seek: they reposition the partition.
        let pending_seeks: Vec<TopicPartition> = self
            .seeks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect();
        let mut groups: Vec<PartitionRecords> = Vec::new();
        for (record, polled_at) in polled {
            let tp = (record.topic.clone(), record.partition);
            let Some(gen) = polled_at.filter(|g| generation(leases, &tp) == Some(*g)) else {
                continue;
            };
            if pending_seeks.contains(&tp) {
                continue;
            }
            if let Some(r) = retries.get(&tp) {
                if r.generation == gen {
                    // Prefetched before the pause: they come again after the retry.
                    continue;
                }
                // A retry of an earlier lease of this partition is void.
                retries.remove(&tp);
            }
            match groups.iter_mut().find(|(g, _, _)| *g == tp) {
                Some((_, _, rs)) => rs.push(record),
                None => groups.push((tp, gen, vec![record])),
            }
        }
        groups
    }

    /// Leaves the group: unsubscribing revokes the partitions, whose
    /// callback releases their leases; any lease still held is released here.
    async fn leave_group(&self, consumer: &BaseConsumer<LeaseContext>, leases: &Leases) {
        tokio::task::block_in_place(|| {
            consumer.unsubscribe();
            // Serve the revocation callback, which releases the leases.
            let _ = consumer.poll(Duration::from_millis(500));
        });
        let remaining: Vec<PartitionLease> = leases
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain()
            .map(|(_, l)| l)
            .collect();
        for lease in remaining {
            let _ = self.b.store.release_partition(&lease).await;
        }
    }
}
