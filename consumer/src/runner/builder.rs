//! [`Consumer::builder`] and the [`ConsumerBuilder`] settings.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry::Ferry;

use super::{Assignment, Consumer, ConsumerBuilder, DEFAULT_MICRO_BATCH};
use crate::error::ConsumerError;
use crate::metrics::Metrics;
use crate::record::{Handler, Record};

impl Consumer {
    /// Starts building a consumer of `topics` in `group`, reaching Kafka at
    /// `brokers` (librdkafka's `bootstrap.servers`). Defaults: cooperative-sticky
    /// assignment, 5 attempts with backoff from 100 ms up to 10 s, a 30 s
    /// partition lease, ledger rows kept 7 days for a 24 h redelivery window,
    /// micro-batches of up to [`DEFAULT_MICRO_BATCH`] records, no dead-letter topic, and a fresh
    /// `consumer-<uuid>` owner.
    pub fn builder(
        ferry: Ferry,
        brokers: impl Into<String>,
        group: impl Into<String>,
        topics: &[&str],
    ) -> ConsumerBuilder {
        ConsumerBuilder {
            store: crate::store::ConsumerStore::new(ferry),
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
            batch: DEFAULT_MICRO_BATCH,
        }
    }

    /// Live metrics (processed, duplicates, dead letters, lease losses, lag,
    /// handler latency), shared with the running consumer: take the handle
    /// before [`Consumer::run`] consumes the consumer.
    pub fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }
}

impl ConsumerBuilder {
    /// The record handler (required: [`ConsumerBuilder::build`] fails
    /// without one). It runs inside each record's transaction.
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

    /// Attempts of a record whose handler fails retryably before it is
    /// dead-lettered (default 5), with exponential backoff from `base` up to
    /// `cap`. Infrastructure errors (the database unreachable, a connection
    /// cut, a pool timeout, a serialization failure: see
    /// [`classify`](crate::error::classify)) are retried with the same
    /// backoff, their partition paused, without spending this budget.
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

    /// Any librdkafka consumer property. It is set after Ferry's own
    /// settings, so it overrides them; the dead-letter producer does not get it.
    pub fn kafka(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.kafka.push((key.into(), value.into()));
        self
    }

    /// Partition lease duration (renewed every third of it; zero is refused
    /// by [`ConsumerBuilder::build`]).
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

    /// The most records taken per poll turn (default [`DEFAULT_MICRO_BATCH`];
    /// 1 is one transaction per record). They are grouped by partition and
    /// each partition's group is committed in one transaction, the groups
    /// of different partitions at once. Only records already fetched are
    /// batched, so a batch never waits for more to arrive.
    pub fn micro_batch(mut self, records: usize) -> Self {
        self.batch = records.max(1);
        self
    }

    /// This member's identity in partition leases (default a fresh
    /// `consumer-<uuid>`).
    pub fn owner(mut self, owner: impl Into<String>) -> Self {
        self.owner = owner.into();
        self
    }

    /// Validates and builds: [`ConsumerError::Config`] when the ledger
    /// retention is shorter than the maximum redelivery window, when there
    /// are no topics, or when no handler was set.
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
        if self.lease.is_zero() {
            return Err(ConsumerError::Config(
                "the partition lease must be longer than zero (it is renewed every third of it)".into(),
            ));
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
            per_record_us: Default::default(),
        })
    }

    /// Builds and runs until `shutdown` resolves (see [`Consumer::run`]).
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), ConsumerError> {
        self.build()?.run(shutdown).await
    }
}
