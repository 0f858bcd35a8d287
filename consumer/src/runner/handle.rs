//! Processing a partition's polled records: a micro-batch transaction when it
//! can, else one record at a time (first attempt or retry), and what follows
//! each attempt (done, a retry with the partition paused, a dead letter, or
//! stop on a lost lease). Only the handler's retryable errors spend a
//! record's retry budget; an infrastructure error (see
//! [`classify`](crate::error::classify)) is retried without one and never
//! leads to a dead letter.

use std::time::Instant;

use crate::store::PartitionLease;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer as _};
use rdkafka::producer::FutureProducer;
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use tracing::Instrument;

use super::dead_letter::unkeyed_ledger_key;
use super::leases::{current_lease, pause};
use super::rebalance::LeaseContext;
use super::retry::{PendingDeadLetter, Retry, Step};
use super::{Consumer, Leases, TopicPartition};
use crate::error::{classify, Fault, HandlerClass};
use crate::process::{batchable_key, process_batch, process_record, ProcessError, Processed};
use crate::record::Record;

impl Consumer {
    /// Processes a partition's records, in order: as one micro-batch
    /// transaction when it commits. When a batch stops at a record (its
    /// handler failed; or, seen before any transaction, it has no effect
    /// key or one the batch's ledger statement may refuse), the records
    /// before it (which ran without an error, or never ran) are batched
    /// again, that record goes alone (done, retried or dead-lettered), and
    /// the rest is batched again. Records go one by one instead: all of them
    /// after a failure outside any handler (the connection, the lock, the
    /// ledger rows, the offset, the commit); those up to the stopping record
    /// when the batch before it fails too; and, while failed batches keep
    /// stopping at their first or second record (failing records close
    /// together), a window of records that doubles from two each time,
    /// until a batch commits: within one poll, a run of `r` failing records
    /// costs at most `ceil(log2 r) + 1` failed batches, not one per record,
    /// and the good records after it are batched again. Returns a retry to
    /// schedule if a record must wait.
    pub(super) async fn handle_group(
        &self,
        consumer: &BaseConsumer<LeaseContext>,
        leases: &Leases,
        dlq: Option<&FutureProducer>,
        generation: i64,
        mut records: Vec<Record>,
    ) -> Option<Retry> {
        let tp = (records[0].topic.clone(), records[0].partition);
        // Failed batches in a row that stopped at their first or second record.
        let mut short_stops = 0u32;
        // How many records go one by one from the second such stop on.
        let mut window = 2usize;
        while !records.is_empty() {
            // How many of `records` go one by one before a batch is tried again.
            let mut singles = records.len();
            let lease = current_lease(leases, &tp, generation);
            if let (Some(lease), true) = (lease, records.len() > 1) {
                let (at, rolled_back) = match self.try_batch(consumer, &lease, &tp, &records).await {
                    BatchOutcome::Committed => return None,
                    BatchOutcome::Isolated(at) => (Some(at), false),
                    BatchOutcome::RolledBack(Some(at)) => {
                        short_stops = if at < 2 { short_stops + 1 } else { 0 };
                        (Some(at), true)
                    }
                    BatchOutcome::RolledBack(None) => (None, true),
                };
                if let Some(at) = at {
                    // `window` is at least 2, so it holds the stopping record.
                    singles = if rolled_back && short_stops >= 2 && at < 2 {
                        window = window.saturating_mul(2);
                        (window / 2).min(records.len())
                    } else {
                        at + 1
                    };
                    if at > 1 && self.try_batch(consumer, &lease, &tp, &records[..at]).await == BatchOutcome::Committed
                    {
                        records.drain(..at);
                        singles = 1;
                        (short_stops, window) = (0, 2);
                    }
                }
            }
            for record in records.drain(..singles).collect::<Vec<_>>() {
                if let Some(retry) = self.handle(consumer, leases, dlq, generation, record, None).await {
                    // Later records of this partition are fetched again after the retry.
                    return Some(retry);
                }
            }
        }
        None
    }

    /// Commits `records` in one micro-batch transaction when they all carry
    /// effect keys, then tells Kafka. Returns how it ended (unless it
    /// committed, nothing of it was written, but for a commit whose outcome
    /// is unknown: the ledger then makes its records duplicates). Runs in a
    /// `ferry.consume.batch` span (group, topic, partition, lease generation,
    /// first and last offset, count, outcome; never keys or payloads).
    async fn try_batch(
        &self,
        consumer: &BaseConsumer<LeaseContext>,
        lease: &PartitionLease,
        tp: &TopicPartition,
        records: &[Record],
    ) -> BatchOutcome {
        let span = tracing::info_span!(
            "ferry.consume.batch",
            group = %lease.group,
            topic = %tp.0,
            partition = tp.1,
            generation = lease.generation,
            first_offset = records.first().map(|r| r.offset).unwrap_or_default(),
            last_offset = records.last().map(|r| r.offset).unwrap_or_default(),
            count = records.len(),
            outcome = tracing::field::Empty,
        );
        let outcome = self
            .commit_batch(consumer, lease, tp, records)
            .instrument(span.clone())
            .await;
        span.record("outcome", outcome.as_str());
        outcome
    }

    /// The micro-batch itself: effect keys, the transaction, the metrics and
    /// the Kafka commit.
    async fn commit_batch(
        &self,
        consumer: &BaseConsumer<LeaseContext>,
        lease: &PartitionLease,
        tp: &TopicPartition,
        records: &[Record],
    ) -> BatchOutcome {
        let mut keyed = Vec::with_capacity(records.len());
        for (i, r) in records.iter().enumerate() {
            let key = r
                .effect_key()
                .or_else(|| self.b.effect_key_fn.as_ref().and_then(|f| f(r)));
            match key {
                Some(k) if batchable_key(&lease.group, &k) => keyed.push((r, k)),
                _ => return BatchOutcome::Isolated(i),
            }
        }
        let started = Instant::now();
        let done = match process_batch(&self.b.store, lease, &keyed, self.handler.as_ref()).await {
            Ok(done) => done,
            Err(e) => {
                self.metrics.batches_rolled_back.inc();
                tracing::debug!(topic = %tp.0, partition = tp.1, at = ?e.at, error = %e, "micro-batch rolled back");
                return BatchOutcome::RolledBack(e.at);
            }
        };
        self.metrics.observe_handler(started.elapsed().as_secs_f64());
        for p in done {
            match p {
                Processed::Applied => self.metrics.processed.inc(),
                _ => self.metrics.duplicates.inc(),
            };
        }
        let last = records.last().map(|r| r.offset).unwrap_or_default();
        let mut tpl = TopicPartitionList::new();
        let _ = tpl.add_partition_offset(&tp.0, tp.1, Offset::Offset(last + 1));
        let _ = consumer.commit(&tpl, CommitMode::Async);
        BatchOutcome::Committed
    }

    /// Processes one record (first attempt or retry). Returns a retry to
    /// schedule when a retryable failure leaves budget, on any
    /// infrastructure error, or when the record must be dead-lettered and
    /// that failed (its partition stays paused and nothing moves past it,
    /// neither the stored offset nor Kafka's).
    pub(super) async fn handle(
        &self,
        consumer: &BaseConsumer<LeaseContext>,
        leases: &Leases,
        dlq: Option<&FutureProducer>,
        generation: i64,
        record: Record,
        retry: Option<Retry>,
    ) -> Option<Retry> {
        let tp = (record.topic.clone(), record.partition);
        let Some(lease) = current_lease(leases, &tp, generation) else {
            // Not ours any more (revoked or lost: its new owner processes it),
            // or leased again since (positioned at the stored offset then).
            return None;
        };
        let was_paused = retry.is_some();
        let step = self.attempt(consumer, leases, dlq, &lease, &record, retry).await;
        match step {
            Step::Stop => None,
            Step::Retry(r) => Some(self.schedule_retry(consumer, &tp, was_paused, r)),
            Step::Done => {
                self.record_progress(consumer, leases, &lease, &record, was_paused);
                None
            }
        }
    }

    /// One attempt at `record`: finishes a dead letter that failed before
    /// (never running the handler again), dead-letters a record without an
    /// effect key, or runs the record's transaction.
    async fn attempt(
        &self,
        consumer: &BaseConsumer<LeaseContext>,
        leases: &Leases,
        dlq: Option<&FutureProducer>,
        lease: &PartitionLease,
        record: &Record,
        retry: Option<Retry>,
    ) -> Step {
        let b = &self.b;
        if let Some(pending) = retry.as_ref().and_then(|r| r.dead_letter.clone()) {
            // A dead letter that failed before: finish it, never run the handler again.
            let key = retry.as_ref().map(|r| r.effect_key.clone()).unwrap_or_default();
            self.try_dead_letter(consumer, leases, dlq, lease, record, &key, &pending, retry)
                .await
        } else {
            let effect_key = match &retry {
                Some(r) => Some(r.effect_key.clone()),
                None => record
                    .effect_key()
                    .or_else(|| b.effect_key_fn.as_ref().and_then(|f| f(record))),
            };
            match effect_key {
                None => {
                    let key = unkeyed_ledger_key(record);
                    let pending = PendingDeadLetter {
                        code: "missing_effect_key".into(),
                        published: false,
                    };
                    self.try_dead_letter(consumer, leases, dlq, lease, record, &key, &pending, retry)
                        .await
                }
                Some(effect_key) => {
                    self.process(consumer, leases, dlq, lease, record, effect_key, retry)
                        .await
                }
            }
        }
    }

    /// Sets when `r` is next due and pauses its partition unless it already
    /// is (a retry of a retry).
    fn schedule_retry(
        &self,
        consumer: &BaseConsumer<LeaseContext>,
        tp: &TopicPartition,
        was_paused: bool,
        mut r: Retry,
    ) -> Retry {
        let delay = r.backoff.next().unwrap_or(self.b.retry_cap);
        r.due = Instant::now() + delay;
        if !was_paused {
            let _ = pause(consumer, tp, true);
        }
        r
    }

    /// After `record` is done: commits the offset after it to Kafka and, if
    /// its partition was paused for a retry, seeks to that offset and resumes.
    fn record_progress(
        &self,
        consumer: &BaseConsumer<LeaseContext>,
        leases: &Leases,
        lease: &PartitionLease,
        record: &Record,
        was_paused: bool,
    ) {
        let tp = (record.topic.clone(), record.partition);
        // Progress: tell Kafka too, so standard lag tools see it.
        let mut tpl = TopicPartitionList::new();
        let _ = tpl.add_partition_offset(&tp.0, tp.1, Offset::Offset(record.offset + 1));
        let _ = consumer.commit(&tpl, CommitMode::Async);
        if was_paused {
            // Fetch again from the next record, then resume the partition.
            self.seeks
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(tp, (lease.generation, Offset::Offset(record.offset + 1)));
            self.apply_seeks(consumer, leases);
        }
    }

    /// Runs the record's transaction and decides what follows: done, a
    /// retry (charged to the record's budget only for the handler's
    /// retryable errors), a dead letter (itself retried if it fails; only
    /// for the record's own faults), or stop.
    #[allow(clippy::too_many_arguments)]
    async fn process(
        &self,
        consumer: &BaseConsumer<LeaseContext>,
        leases: &Leases,
        dlq: Option<&FutureProducer>,
        lease: &PartitionLease,
        record: &Record,
        effect_key: String,
        retry: Option<Retry>,
    ) -> Step {
        let m = &self.metrics;
        let tp = (record.topic.clone(), record.partition);
        let e = match self.transact(lease, record, &effect_key).await {
            Ok(Processed::Applied) => {
                m.processed.inc();
                return Step::Done;
            }
            Ok(_) => {
                m.duplicates.inc();
                return Step::Done;
            }
            Err(e) => e,
        };
        let (class, code) = match &e {
            ProcessError::LostLease(e) => {
                tracing::warn!(topic = %tp.0, partition = tp.1, error = %e, "partition lease lost; pausing it");
                self.lost(consumer, leases, lease);
                return Step::Stop;
            }
            ProcessError::Handler(h) => (h.class, h.code.clone()),
            ProcessError::Database(db) => match classify(db) {
                Fault::Infrastructure(code) => (HandlerClass::Infrastructure, code.to_owned()),
                Fault::Record(code) => (HandlerClass::Terminal, code.to_owned()),
            },
        };
        match class {
            HandlerClass::Infrastructure => self.wait_for_infrastructure(lease, record, &effect_key, retry, &code, &e),
            HandlerClass::Retryable => {
                self.retry_or_dead_letter(consumer, leases, dlq, lease, record, &effect_key, retry, code)
                    .await
            }
            HandlerClass::Terminal => {
                let pending = PendingDeadLetter { code, published: false };
                self.try_dead_letter(consumer, leases, dlq, lease, record, &effect_key, &pending, retry)
                    .await
            }
        }
    }

    /// An infrastructure error `e` (the database, not the record): the
    /// record is retried with backoff, its partition paused, for as long as
    /// it takes, and its budget is not touched. Counted in
    /// `infrastructure_retries` and logged (`code`, never keys or payloads).
    fn wait_for_infrastructure(
        &self,
        lease: &PartitionLease,
        record: &Record,
        effect_key: &str,
        retry: Option<Retry>,
        code: &str,
        e: &ProcessError,
    ) -> Step {
        self.metrics.infrastructure_retries.inc();
        tracing::warn!(
            topic = %record.topic,
            partition = record.partition,
            offset = record.offset,
            code,
            error = %e,
            "infrastructure error; the partition waits and the record is retried without spending its budget"
        );
        Step::Retry(retry.unwrap_or_else(|| self.new_retry(lease, record, effect_key)))
    }

    /// The record's transaction, in a span continuing the producer's trace,
    /// timed into the handler latency.
    async fn transact(
        &self,
        lease: &PartitionLease,
        record: &Record,
        effect_key: &str,
    ) -> Result<Processed, ProcessError> {
        let span = tracing::info_span!("ferry.consume", topic = %record.topic, partition = record.partition, offset = record.offset);
        // Continue the producer's trace: child of its context, linked to its span.
        ferry::telemetry::continue_trace(&span, record.traceparent());
        let started = Instant::now();
        let outcome = process_record(&self.b.store, lease, record, effect_key, self.handler.as_ref())
            .instrument(span)
            .await;
        self.metrics.observe_handler(started.elapsed().as_secs_f64());
        outcome
    }

    /// A retryable failure of the handler (`code`): charges it to the
    /// record's budget and retries in place while the budget lasts, then
    /// dead-letters the record.
    #[allow(clippy::too_many_arguments)]
    async fn retry_or_dead_letter(
        &self,
        consumer: &BaseConsumer<LeaseContext>,
        leases: &Leases,
        dlq: Option<&FutureProducer>,
        lease: &PartitionLease,
        record: &Record,
        effect_key: &str,
        retry: Option<Retry>,
        code: String,
    ) -> Step {
        let tp = (record.topic.clone(), record.partition);
        let mut r = retry.unwrap_or_else(|| self.new_retry(lease, record, effect_key));
        r.attempts += 1;
        if r.attempts >= self.b.retry_budget {
            tracing::warn!(topic = %tp.0, partition = tp.1, offset = record.offset, %code, "retry budget spent; dead-lettering");
            let pending = PendingDeadLetter { code, published: false };
            self.try_dead_letter(consumer, leases, dlq, lease, record, effect_key, &pending, Some(r))
                .await
        } else {
            tracing::info!(topic = %tp.0, partition = tp.1, offset = record.offset, %code, attempts = r.attempts, "retrying in place");
            Step::Retry(r)
        }
    }
}

/// How a micro-batch attempt ended (the `outcome` of its span), and the
/// record it stopped at, by index, if it stopped at one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BatchOutcome {
    /// Committed, and the offset after it sent to Kafka.
    Committed,
    /// The first record the batch cannot hold: one without an effect key,
    /// or with a key the batch's ledger statement may refuse (see
    /// [`batchable_key`]). Nothing was tried; the record goes alone.
    Isolated(usize),
    /// The transaction failed and was rolled back: nothing was written
    /// ([`BatchError::at`](crate::process::BatchError::at)).
    RolledBack(Option<usize>),
}

impl BatchOutcome {
    fn as_str(self) -> &'static str {
        match self {
            BatchOutcome::Committed => "committed",
            BatchOutcome::Isolated(_) => "isolated",
            BatchOutcome::RolledBack(_) => "rolled_back",
        }
    }
}
