//! The consumer loop: a `BaseConsumer` whose rebalance callback drives the
//! partition leases (take on assign and seek to the offset stored with the
//! effects; give back on revoke only if still ours), one transaction per
//! record, retries that pause only their partition, a dead-letter topic, and
//! asynchronous Kafka offset commits so standard lag tools keep working.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use backon::{BackoffBuilder, ExponentialBuilder};
use ferry::consumer::PartitionLease;
use ferry::Ferry;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer as _, ConsumerContext, RebalanceProtocol};
use rdkafka::error::KafkaResult;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{ClientConfig, ClientContext};
use tracing::Instrument;

use crate::error::{ConsumerError, HandlerClass, HandlerError};
use crate::metrics::Metrics;
use crate::process::{process_batch, process_record, record_dead_letter, ProcessError, Processed};
use crate::record::{Handler, Record};

/// Partition assignment strategy of the group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Assignment {
    /// Eager (`range`): every rebalance revokes everything.
    Eager,
    /// `cooperative-sticky`: only moved partitions are revoked.
    CooperativeSticky,
}

/// Derives an effect key for records without Ferry's headers.
pub type EffectKeyFn = Arc<dyn Fn(&Record) -> Option<String> + Send + Sync>;

type TopicPartition = (String, i32);
type Leases = Arc<Mutex<HashMap<TopicPartition, PartitionLease>>>;
/// Stored offsets to commit to Kafka once a partition is (re)leased.
type Commits = Arc<Mutex<Vec<(TopicPartition, i64)>>>;

/// Builds a [`Consumer`]: `Consumer::builder(ferry, brokers, group, topics).handler(h).run(shutdown)`.
pub struct ConsumerBuilder {
    ferry: Ferry,
    brokers: String,
    group: String,
    topics: Vec<String>,
    handler: Option<Arc<dyn Handler>>,
    dead_letter_topic: Option<String>,
    assignment: Assignment,
    retry_budget: u32,
    retry_base: Duration,
    retry_cap: Duration,
    effect_key_fn: Option<EffectKeyFn>,
    kafka: Vec<(String, String)>,
    lease: Duration,
    ledger_retention: Duration,
    max_redelivery_window: Duration,
    owner: String,
    batch: usize,
}

/// A consumer-group member whose effects commit at most once per group.
pub struct Consumer {
    b: ConsumerBuilder,
    handler: Arc<dyn Handler>,
    metrics: Arc<Metrics>,
    /// Partitions whose lease was lost while Kafka still had them assigned
    /// here, and when to check again.
    reclaims: Mutex<HashMap<TopicPartition, Instant>>,
    /// Seeks that must happen before a paused partition resumes (records
    /// were passed over), with the lease generation they belong to. A seek
    /// that fails stays here, its partition paused, and is tried again.
    seeks: Mutex<HashMap<TopicPartition, (i64, Offset)>>,
}

impl Consumer {
    /// Starts building a consumer of `topics` in `group`.
    pub fn builder(
        ferry: Ferry,
        brokers: impl Into<String>,
        group: impl Into<String>,
        topics: &[&str],
    ) -> ConsumerBuilder {
        ConsumerBuilder {
            ferry,
            brokers: brokers.into(),
            group: group.into(),
            topics: topics.iter().map(|t| (*t).to_owned()).collect(),
            handler: None,
            dead_letter_topic: None,
            assignment: Assignment::CooperativeSticky,
            retry_budget: 5,
            retry_base: Duration::from_millis(100),
            retry_cap: Duration::from_secs(10),
            effect_key_fn: None,
            kafka: Vec::new(),
            lease: Duration::from_secs(30),
            ledger_retention: Duration::from_secs(7 * 24 * 3600),
            max_redelivery_window: Duration::from_secs(24 * 3600),
            owner: format!("consumer-{}", uuid::Uuid::now_v7().simple()),
            batch: 50,
        }
    }

    /// Live metrics.
    pub fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }
}

impl ConsumerBuilder {
    /// The record handler (required).
    pub fn handler(mut self, h: impl Handler) -> Self {
        self.handler = Some(Arc::new(h));
        self
    }

    /// Topic for terminal and poison records.
    pub fn dead_letter_topic(mut self, t: impl Into<String>) -> Self {
        self.dead_letter_topic = Some(t.into());
        self
    }

    /// Assignment strategy (default cooperative-sticky).
    pub fn assignment(mut self, a: Assignment) -> Self {
        self.assignment = a;
        self
    }

    /// Attempts of a retryable record before it is dead-lettered (default 5),
    /// with exponential backoff from `base` up to `cap`.
    pub fn retry(mut self, budget: u32, base: Duration, cap: Duration) -> Self {
        self.retry_budget = budget.max(1);
        self.retry_base = base;
        self.retry_cap = cap;
        self
    }

    /// Effect keys for records without `ferry-effect-key`/`ferry-outbox-id`
    /// (otherwise they are poison).
    pub fn effect_key_fn(mut self, f: impl Fn(&Record) -> Option<String> + Send + Sync + 'static) -> Self {
        self.effect_key_fn = Some(Arc::new(f));
        self
    }

    /// Any librdkafka consumer property.
    pub fn kafka(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.kafka.push((key.into(), value.into()));
        self
    }

    /// Partition lease duration (renewed every third of it).
    pub fn lease(mut self, d: Duration) -> Self {
        self.lease = d;
        self
    }

    /// How long ledger rows are kept, and the longest time after which a
    /// record may still be redelivered (a relay backlog, a replay). Startup
    /// refuses a retention shorter than the window.
    pub fn ledger_retention(mut self, retention: Duration, max_redelivery_window: Duration) -> Self {
        self.ledger_retention = retention;
        self.max_redelivery_window = max_redelivery_window;
        self
    }

    /// Records of one partition committed per transaction (default 50; 1 is
    /// one transaction per record). Only records already fetched are
    /// batched, so a batch never waits for more to arrive.
    pub fn micro_batch(mut self, records: usize) -> Self {
        self.batch = records.max(1);
        self
    }

    /// This member's identity in partition leases.
    pub fn owner(mut self, owner: impl Into<String>) -> Self {
        self.owner = owner.into();
        self
    }

    /// Validates and builds.
    pub fn build(self) -> Result<Consumer, ConsumerError> {
        if self.ledger_retention < self.max_redelivery_window {
            return Err(ConsumerError::Config(format!(
                "ledger retention {:?} is shorter than the maximum redelivery window {:?}: duplicates could slip through",
                self.ledger_retention, self.max_redelivery_window
            )));
        }
        if self.topics.is_empty() {
            return Err(ConsumerError::Config("no topics".into()));
        }
        let handler = self
            .handler
            .clone()
            .ok_or_else(|| ConsumerError::Config("a handler is required".into()))?;
        Ok(Consumer {
            b: self,
            handler,
            metrics: Arc::new(Metrics::new()),
            reclaims: Mutex::default(),
            seeks: Mutex::default(),
        })
    }

    /// Builds and runs until `shutdown` resolves.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), ConsumerError> {
        self.build()?.run(shutdown).await
    }
}

/// Drives the leases from rebalance callbacks. Callbacks run inside
/// `poll`, which the loop calls from `block_in_place`, so they may block on
/// the database.
struct LeaseContext {
    ferry: Ferry,
    group: String,
    owner: String,
    lease: Duration,
    leases: Leases,
    commits: Commits,
    handle: tokio::runtime::Handle,
}

impl ClientContext for LeaseContext {}

impl ConsumerContext for LeaseContext {
    fn rebalance(&self, base: &BaseConsumer<Self>, err: RDKafkaRespErr, tpl: &mut TopicPartitionList) {
        let cooperative = matches!(base.rebalance_protocol(), RebalanceProtocol::Cooperative);
        match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                let parts: Vec<TopicPartition> = tpl
                    .elements()
                    .iter()
                    .map(|e| (e.topic().to_owned(), e.partition()))
                    .collect();
                let mut unleased = TopicPartitionList::new();
                for (topic, partition) in parts {
                    let acquired = self.handle.block_on(self.ferry.acquire_partition(
                        &self.group,
                        &topic,
                        partition,
                        &self.owner,
                        self.lease,
                    ));
                    match acquired {
                        Ok((lease, next)) => {
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
                        Err(e) => {
                            // Paused until the reclaim path leases it and
                            // seeks to the stored offset.
                            tracing::error!(%topic, partition, error = %e, "cannot lease an assigned partition; paused until it can");
                            unleased.add_partition(&topic, partition);
                        }
                    }
                }
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
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => {
                let parts: Vec<TopicPartition> = tpl
                    .elements()
                    .iter()
                    .map(|e| (e.topic().to_owned(), e.partition()))
                    .collect();
                for tp in parts {
                    let lease = self.leases.lock().unwrap_or_else(|p| p.into_inner()).remove(&tp);
                    if let Some(lease) = lease {
                        // Only if still ours: a newer generation is left alone.
                        let _ = self.handle.block_on(self.ferry.release_partition(&lease));
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
            other => {
                tracing::error!(error = ?other, "rebalance error");
                if !cooperative {
                    let _ = base.unassign();
                }
            }
        }
    }
}

/// How long a member waits after losing a partition lease before checking
/// whether Kafka still assigns the partition to it.
const RECLAIM_AFTER: Duration = Duration::from_secs(3);

/// How often lag is measured (it costs a broker round trip per partition).
const LAG_EVERY: Duration = Duration::from_secs(15);

/// A record waiting for its next attempt while its partition is paused.
struct Retry {
    /// Generation of the lease the record was fetched under.
    generation: i64,
    record: Record,
    effect_key: String,
    attempts: u32,
    due: Instant,
    backoff: Box<dyn Iterator<Item = Duration> + Send>,
    /// Set when the record is being dead-lettered and that failed: the next
    /// attempt only finishes the dead letter.
    dead_letter: Option<PendingDeadLetter>,
}

/// A dead letter not yet finished.
#[derive(Debug, Clone)]
struct PendingDeadLetter {
    /// The `ferry-error-code` header.
    code: String,
    /// The dead-letter topic already has the record: only the ledger write
    /// is left (a retry does not publish it twice).
    published: bool,
}

/// Why a dead letter did not finish.
enum DeadLetterFailure {
    /// The publish or the ledger write failed: retry it, paused.
    Failed {
        /// Whether the publish had succeeded.
        published: bool,
    },
    /// The lease is gone: the new owner reprocesses the record.
    LostLease(ferry::Error),
}

/// What follows a record's attempt (short-lived, so the retry is not boxed).
#[allow(clippy::large_enum_variant)]
enum Step {
    /// Done (applied, duplicate or dead-lettered): the offset moved.
    Done,
    /// Try again later with the partition paused; nothing moved.
    Retry(Retry),
    /// The lease is gone; leave the partition alone.
    Stop,
}

/// How long a dead-letter publish may take before it counts as failed and
/// is retried (the consumer loop waits for it, so it is kept well under the
/// lease renewal period).
const DLQ_DELIVERY_TIMEOUT: Duration = Duration::from_secs(5);

impl Consumer {
    /// Consumes until `shutdown` resolves, then leaves the group (revoking,
    /// and so releasing, its partitions).
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), ConsumerError> {
        let b = &self.b;
        let leases: Leases = Arc::default();
        let commits: Commits = Arc::default();
        let ctx = LeaseContext {
            commits: commits.clone(),
            ferry: b.ferry.clone(),
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
        let dlq: Option<FutureProducer> = match &b.dead_letter_topic {
            Some(_) => Some(
                ClientConfig::new()
                    .set("bootstrap.servers", &b.brokers)
                    .set("enable.idempotence", "true")
                    .set("acks", "all")
                    // A publish that cannot finish (the topic is missing, the
                    // broker is down) fails and is retried, partition paused.
                    .set("message.timeout.ms", DLQ_DELIVERY_TIMEOUT.as_millis().to_string())
                    .create()?,
            ),
            None => None,
        };
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
            // Retries that are due, each on its own paused partition.
            let due: Vec<TopicPartition> = retries
                .iter()
                .filter(|(_, r)| r.due <= Instant::now())
                .map(|(tp, _)| tp.clone())
                .collect();
            for tp in due {
                if let Some(mut retry) = retries.remove(&tp) {
                    if generation(&leases, &tp) != Some(retry.generation) {
                        // The partition was revoked, or assigned here again
                        // (which resumed it from the stored offset): the
                        // retry belongs to a lease that is gone.
                        continue;
                    }
                    retry.attempts += 1;
                    if let Some(again) = self
                        .handle(
                            &consumer,
                            &leases,
                            dlq.as_ref(),
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
            // Poll one record, then whatever else is already fetched, up to the
            // micro-batch size.
            // Each record is tagged with the lease generation current when it
            // was delivered: a rebalance callback served by a later poll of
            // the same batch may revoke or re-lease its partition.
            let polled: Vec<(Record, Option<i64>)> = tokio::task::block_in_place(|| {
                let mut out = Vec::new();
                let mut timeout = Duration::from_millis(100);
                while out.len() < b.batch {
                    match consumer.poll(timeout) {
                        Some(Ok(m)) => {
                            let record = Record::from_message(&m);
                            let tp = (record.topic.clone(), record.partition);
                            out.push((record, generation(&leases, &tp)));
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
            });
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
            let mut groups: Vec<(TopicPartition, i64, Vec<Record>)> = Vec::new();
            for (record, polled_at) in polled {
                let tp = (record.topic.clone(), record.partition);
                let Some(gen) = polled_at.filter(|g| generation(&leases, &tp) == Some(*g)) else {
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
            for (tp, gen, records) in groups {
                let pending = self.handle_group(&consumer, &leases, dlq.as_ref(), gen, records).await;
                if let Some(retry) = pending {
                    retries.insert(tp, retry);
                }
            }
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
            let _ = b.ferry.release_partition(&lease).await;
        }
        Ok(())
    }

    /// Processes a partition's records: as one micro-batch transaction when
    /// they all carry effect keys and it commits, otherwise one by one.
    /// Returns a retry to schedule if a record must wait.
    async fn handle_group(
        &self,
        consumer: &BaseConsumer<LeaseContext>,
        leases: &Leases,
        dlq: Option<&FutureProducer>,
        generation: i64,
        records: Vec<Record>,
    ) -> Option<Retry> {
        let tp = (records[0].topic.clone(), records[0].partition);
        let lease = current_lease(leases, &tp, generation);
        if let (Some(lease), true) = (lease, records.len() > 1) {
            let keyed: Option<Vec<(Record, String)>> = records
                .iter()
                .map(|r| {
                    r.effect_key()
                        .or_else(|| self.b.effect_key_fn.as_ref().and_then(|f| f(r)))
                        .map(|k| (r.clone(), k))
                })
                .collect();
            if let Some(keyed) = keyed {
                let started = Instant::now();
                if let Ok(done) = process_batch(&self.b.ferry, &lease, &keyed, self.handler.as_ref()).await {
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
                    return None;
                }
            }
        }
        for record in records {
            if let Some(retry) = self.handle(consumer, leases, dlq, generation, record, None).await {
                // Later records of this partition are fetched again after the retry.
                return Some(retry);
            }
        }
        None
    }

    /// Processes one record (first attempt or retry). Returns a retry to
    /// schedule when a retryable failure leaves budget, or when the record
    /// must be dead-lettered and that failed (its partition stays paused and
    /// nothing moves past it, neither the stored offset nor Kafka's).
    async fn handle(
        &self,
        consumer: &BaseConsumer<LeaseContext>,
        leases: &Leases,
        dlq: Option<&FutureProducer>,
        generation: i64,
        record: Record,
        retry: Option<Retry>,
    ) -> Option<Retry> {
        let b = &self.b;
        let tp = (record.topic.clone(), record.partition);
        let Some(lease) = current_lease(leases, &tp, generation) else {
            // Not ours any more (revoked or lost: its new owner processes it),
            // or leased again since (positioned at the stored offset then).
            return None;
        };
        let was_paused = retry.is_some();
        let step = if let Some(pending) = retry.as_ref().and_then(|r| r.dead_letter.clone()) {
            // A dead letter that failed before: finish it, never run the handler again.
            let key = retry.as_ref().map(|r| r.effect_key.clone()).unwrap_or_default();
            self.try_dead_letter(consumer, leases, dlq, &lease, &record, &key, &pending, retry)
                .await
        } else {
            let effect_key = match &retry {
                Some(r) => Some(r.effect_key.clone()),
                None => record
                    .effect_key()
                    .or_else(|| b.effect_key_fn.as_ref().and_then(|f| f(&record))),
            };
            match effect_key {
                None => {
                    let key = unkeyed_ledger_key(&record);
                    let pending = PendingDeadLetter {
                        code: "missing_effect_key".into(),
                        published: false,
                    };
                    self.try_dead_letter(consumer, leases, dlq, &lease, &record, &key, &pending, retry)
                        .await
                }
                Some(effect_key) => {
                    self.process(consumer, leases, dlq, &lease, &record, effect_key, retry)
                        .await
                }
            }
        };
        match step {
            Step::Stop => None,
            Step::Retry(mut r) => {
                let delay = r.backoff.next().unwrap_or(b.retry_cap);
                r.due = Instant::now() + delay;
                if !was_paused {
                    let _ = pause(consumer, &tp, true);
                }
                Some(r)
            }
            Step::Done => {
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
                None
            }
        }
    }

    /// Runs the record's transaction and decides what follows: done, a
    /// retry, a dead letter (itself retried if it fails), or stop.
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
        let b = &self.b;
        let m = &self.metrics;
        let tp = (record.topic.clone(), record.partition);
        let span = tracing::info_span!("ferry.consume", topic = %record.topic, partition = record.partition, offset = record.offset);
        // Continue the producer's trace: child of its context, linked to its span.
        ferry::telemetry::continue_trace(&span, record.traceparent());
        let started = Instant::now();
        let outcome = process_record(&b.ferry, lease, record, &effect_key, self.handler.as_ref())
            .instrument(span)
            .await;
        m.observe_handler(started.elapsed().as_secs_f64());
        match outcome {
            Ok(Processed::Applied) => {
                m.processed.inc();
                Step::Done
            }
            Ok(_) => {
                m.duplicates.inc();
                Step::Done
            }
            Err(ProcessError::LostLease(e)) => {
                tracing::warn!(topic = %tp.0, partition = tp.1, error = %e, "partition lease lost; pausing it");
                self.lost(consumer, leases, lease);
                Step::Stop
            }
            Err(ProcessError::Handler(HandlerError {
                class: HandlerClass::Terminal,
                code,
            })) => {
                let pending = PendingDeadLetter { code, published: false };
                self.try_dead_letter(consumer, leases, dlq, lease, record, &effect_key, &pending, retry)
                    .await
            }
            Err(e) => {
                let code = match &e {
                    ProcessError::Handler(h) => h.code.clone(),
                    other => other.to_string(),
                };
                let r = retry.unwrap_or_else(|| self.new_retry(lease, record, &effect_key));
                if r.attempts >= b.retry_budget {
                    tracing::warn!(topic = %tp.0, partition = tp.1, offset = record.offset, %code, "retry budget spent; dead-lettering");
                    let pending = PendingDeadLetter { code, published: false };
                    self.try_dead_letter(consumer, leases, dlq, lease, record, &effect_key, &pending, Some(r))
                        .await
                } else {
                    tracing::info!(topic = %tp.0, partition = tp.1, offset = record.offset, %code, "retrying in place");
                    Step::Retry(r)
                }
            }
        }
    }

    /// A first retry of `record`: exponential backoff with jitter from the
    /// retry base up to its cap, without an end (the budget bounds handler
    /// retries; a dead letter is retried until it succeeds).
    fn new_retry(&self, lease: &PartitionLease, record: &Record, effect_key: &str) -> Retry {
        let b = &self.b;
        Retry {
            generation: lease.generation,
            record: record.clone(),
            effect_key: effect_key.to_owned(),
            attempts: 1,
            due: Instant::now(),
            backoff: Box::new(
                ExponentialBuilder::default()
                    .with_min_delay(b.retry_base)
                    .with_max_delay(b.retry_cap)
                    .with_jitter()
                    .without_max_times()
                    .build(),
            ),
            dead_letter: None,
        }
    }

    /// Dead-letters `record`; when the publish or the ledger write fails, a
    /// retry of the dead letter alone (the record is never passed over).
    #[allow(clippy::too_many_arguments)]
    async fn try_dead_letter(
        &self,
        consumer: &BaseConsumer<LeaseContext>,
        leases: &Leases,
        dlq: Option<&FutureProducer>,
        lease: &PartitionLease,
        record: &Record,
        effect_key: &str,
        pending: &PendingDeadLetter,
        retry: Option<Retry>,
    ) -> Step {
        match self.dead_letter(dlq, lease, record, effect_key, pending).await {
            Ok(()) => Step::Done,
            Err(DeadLetterFailure::LostLease(e)) => {
                tracing::warn!(topic = %lease.topic, partition = lease.partition, error = %e, "partition lease lost while dead-lettering; pausing it");
                self.lost(consumer, leases, lease);
                Step::Stop
            }
            Err(DeadLetterFailure::Failed { published }) => {
                self.metrics.dead_letter_failures.inc();
                let mut r = retry.unwrap_or_else(|| self.new_retry(lease, record, effect_key));
                r.dead_letter = Some(PendingDeadLetter {
                    code: pending.code.clone(),
                    published,
                });
                Step::Retry(r)
            }
        }
    }

    /// Publishes `record` to the dead-letter topic (unless `pending` says it
    /// already is there) and records it in the ledger with the offset after
    /// it. An error leaves the stored offset where it was.
    async fn dead_letter(
        &self,
        dlq: Option<&FutureProducer>,
        lease: &PartitionLease,
        record: &Record,
        effect_key: &str,
        pending: &PendingDeadLetter,
    ) -> Result<(), DeadLetterFailure> {
        let b = &self.b;
        let code = pending.code.as_str();
        if pending.published {
            // Only the ledger write is left.
        } else if let (Some(producer), Some(topic)) = (dlq, &b.dead_letter_topic) {
            let mut headers = OwnedHeaders::new();
            for (k, v) in &record.headers {
                headers = headers.insert(Header { key: k, value: Some(v) });
            }
            let offset = record.offset.to_string();
            let partition = record.partition.to_string();
            headers = headers
                .insert(Header {
                    key: "ferry-error-code",
                    value: Some(code.as_bytes()),
                })
                .insert(Header {
                    key: "ferry-source-topic",
                    value: Some(record.topic.as_bytes()),
                })
                .insert(Header {
                    key: "ferry-source-partition",
                    value: Some(partition.as_bytes()),
                })
                .insert(Header {
                    key: "ferry-source-offset",
                    value: Some(offset.as_bytes()),
                });
            let mut fr = FutureRecord::<[u8], [u8]>::to(topic).headers(headers);
            if let Some(k) = &record.key {
                fr = fr.key(k.as_slice());
            }
            if let Some(p) = &record.payload {
                fr = fr.payload(p.as_slice());
            }
            if let Err((e, _)) = producer.send(fr, DLQ_DELIVERY_TIMEOUT).await {
                tracing::error!(topic = %record.topic, partition = record.partition, offset = record.offset, code, error = %e, "dead-letter publish failed; the partition stays paused and it is retried");
                return Err(DeadLetterFailure::Failed { published: false });
            }
        } else {
            tracing::error!(topic = %record.topic, partition = record.partition, offset = record.offset, code, "no dead-letter topic configured; recording and skipping");
        }
        let published = dlq.is_some() && b.dead_letter_topic.is_some();
        match record_dead_letter(&b.ferry, lease, record, effect_key).await {
            Ok(_) => {
                self.metrics.dead_lettered.inc();
                Ok(())
            }
            Err(ProcessError::LostLease(e)) => Err(DeadLetterFailure::LostLease(e)),
            Err(e) => {
                tracing::warn!(topic = %record.topic, partition = record.partition, offset = record.offset, error = %e, "recording the dead letter failed; the partition stays paused and it is retried");
                Err(DeadLetterFailure::Failed { published })
            }
        }
    }

    /// Stops processing a partition whose lease is no longer current: drops
    /// the lease (if still this one), pauses the partition and schedules a
    /// reclaim in case Kafka keeps assigning it here.
    fn lost(&self, consumer: &BaseConsumer<LeaseContext>, leases: &Leases, lease: &PartitionLease) {
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
    async fn reclaim_due(&self, consumer: &BaseConsumer<LeaseContext>, leases: &Leases, commits: &Commits) {
        let due: Vec<TopicPartition> = {
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
        };
        if due.is_empty() {
            return;
        }
        let assigned = consumer.assignment().unwrap_or_default();
        let b = &self.b;
        for tp in due {
            if leases.lock().unwrap_or_else(|p| p.into_inner()).contains_key(&tp) {
                // Assigned here again meanwhile: the callback leased it,
                // positioned it and resumed it.
                continue;
            }
            if assigned.find_partition(&tp.0, tp.1).is_none() {
                continue;
            }
            let again = || {
                self.reclaims
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(tp.clone(), Instant::now() + RECLAIM_AFTER);
            };
            match b
                .ferry
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
        self.apply_seeks(consumer, leases);
    }

    /// Performs the pending seeks of partitions still leased at the seek's
    /// generation, resuming each partition once its seek succeeded. A failed
    /// seek leaves its partition paused and is tried again on the next turn
    /// of the loop, so records are never passed over for good.
    fn apply_seeks(&self, consumer: &BaseConsumer<LeaseContext>, leases: &Leases) {
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
    fn watch_unleased(&self, consumer: &BaseConsumer<LeaseContext>, leases: &Leases) {
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
    async fn housekeeping(&self, consumer: &BaseConsumer<LeaseContext>, leases: &Leases) {
        let b = &self.b;
        let held: Vec<PartitionLease> = leases
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect();
        for lease in held {
            match b.ferry.renew_partition(&lease, b.lease).await {
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
        if let Ok(stored) = b.ferry.stored_offsets(&b.group).await {
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
        let _ = b.ferry.sweep_ledger(&b.group, b.ledger_retention, 1000).await;
    }

    /// Lag per held partition: high watermark minus the offset stored with
    /// the effects. Asks the broker, so it runs only every [`LAG_EVERY`].
    async fn measure_lag(&self, consumer: &BaseConsumer<LeaseContext>, leases: &Leases) {
        let b = &self.b;
        let held: Vec<TopicPartition> = leases
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect();
        let stored: HashMap<TopicPartition, i64> = b
            .ferry
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
fn commit_stored(consumer: &BaseConsumer<LeaseContext>, leases: &Leases, commits: &Commits) {
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
fn generation(leases: &Leases, tp: &TopicPartition) -> Option<i64> {
    leases
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(tp)
        .map(|l| l.generation)
}

/// The lease held on `tp` if it is still at `generation`.
fn current_lease(leases: &Leases, tp: &TopicPartition, generation: i64) -> Option<PartitionLease> {
    leases
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(tp)
        .filter(|l| l.generation == generation)
        .cloned()
}

fn pause(consumer: &BaseConsumer<LeaseContext>, tp: &TopicPartition, yes: bool) -> KafkaResult<()> {
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition(&tp.0, tp.1);
    if yes {
        consumer.pause(&tpl)
    } else {
        consumer.resume(&tpl)
    }
}

/// The ledger key of a record that has no effect key (it is dead-lettered as
/// `missing_effect_key`): `!unkeyed/<topic>/<partition>/<offset>`. The `!`
/// is outside every key the relay publishes (`<tenant>/<key>`, where tenants
/// are `[A-Za-z0-9._:-]`, and `<database uuid>:<id>`), so it never shadows a
/// real effect.
fn unkeyed_ledger_key(record: &Record) -> String {
    format!("!unkeyed/{}/{}/{}", record.topic, record.partition, record.offset)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unkeyed_record_never_shares_a_ledger_key_with_a_published_one() {
        let record = Record {
            topic: "orders".into(),
            partition: 0,
            offset: 42,
            key: None,
            payload: None,
            headers: Default::default(),
        };
        let key = unkeyed_ledger_key(&record);
        assert_eq!(key, "!unkeyed/orders/0/42");
        // A tenant named like the topic cannot produce it: '!' is refused.
        assert!(ferry::Limits::default().name("tenant", "!unkeyed").is_err());
        assert_ne!(
            key, "orders/0/42",
            "the old form a tenant `orders` with key `0/42` would publish"
        );
    }
}
