//! The consumer loop: a `BaseConsumer` whose rebalance callback drives the
//! partition leases (take on assign and seek to the offset stored with the
//! effects; give back on revoke only if still ours), one transaction per
//! micro-batch of a partition's records (or per record), retries that pause
//! only their partition, a dead-letter topic, and asynchronous Kafka offset
//! commits so standard lag tools keep working.
//!
//! The parts, each in its own file:
//! - `builder`: [`Consumer::builder`] and the [`ConsumerBuilder`] settings;
//! - `rebalance`: the rdkafka `ConsumerContext` whose callbacks take and give
//!   back partition leases;
//! - `run`: [`Consumer::run`], the poll loop, step by step;
//! - `handle`: what happens to one partition's records (a micro-batch, or one
//!   record's attempt) and what follows it;
//! - `retry`: the state of a record waiting, its partition paused, for its
//!   next attempt;
//! - `dead_letter`: the dead-letter topic and its ledger rows;
//! - `leases`: the lease bookkeeping of the loop (losses, reclaims, seeks,
//!   renewals, Kafka commits of the stored offsets, lag).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::store::ConsumerStore;
use crate::store::PartitionLease;
use rdkafka::topic_partition_list::Offset;

use crate::metrics::Metrics;
use crate::record::{Handler, Record};

mod builder;
mod dead_letter;
mod handle;
mod leases;
mod rebalance;
mod retry;
mod run;

/// Partition assignment strategy of the group (the librdkafka
/// `partition.assignment.strategy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Assignment {
    /// Eager (`range`): every rebalance revokes everything.
    Eager,
    /// `cooperative-sticky`: only moved partitions are revoked.
    CooperativeSticky,
}

/// Derives an effect key for records without Ferry's headers
/// (`ferry-effect-key`, `ferry-outbox-id`); a record it returns `None` for is
/// dead-lettered as `missing_effect_key`.
pub type EffectKeyFn = Arc<dyn Fn(&Record) -> Option<String> + Send + Sync>;

type TopicPartition = (String, i32);
type Leases = Arc<Mutex<HashMap<TopicPartition, PartitionLease>>>;
/// Stored offsets to commit to Kafka once a partition is (re)leased.
type Commits = Arc<Mutex<Vec<(TopicPartition, i64)>>>;

/// How often lag is measured (it costs a broker round trip per partition).
const LAG_EVERY: Duration = Duration::from_secs(15);

/// The most records one poll turn takes, by default (Kafka's Java
/// consumer's `max.poll.records` is the same): grouped by partition, each
/// group one transaction. At 50 a pipeline of six partitions committed ~8
/// records per transaction and the consumer fell behind a 1,000 runs/s
/// worker (BENCHMARKS, "The pipeline").
pub const DEFAULT_MICRO_BATCH: usize = 500;

/// Builds a [`Consumer`]: `Consumer::builder(store, brokers, group, topics).handler(h).run(shutdown)`.
pub struct ConsumerBuilder {
    store: ConsumerStore,
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
    /// A moving average of the time one record of a poll's group takes
    /// (µs; 0 until measured), which sizes a poll turn (`turn_cap` in
    /// `run.rs`).
    per_record_us: std::sync::atomic::AtomicU64,
}
