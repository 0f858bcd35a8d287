//! Exactly-once into Kafka (`--exactly-once`), after Kafka Connect's
//! exactly-once source support (KIP-618).
//!
//! - Each lane publishes through its own transactional producer,
//!   `transactional.id = <prefix>-lane-<n>`. A new owner's
//!   `init_transactions` fences the previous owner's producer (a zombie relay
//!   can no longer commit) and aborts its open transaction, whose rows stay
//!   pending and are published again.
//! - Every transaction also writes one progress record to the compacted
//!   progress topic (key = database id and lane, partition = lane): **the exact ids published
//!   in that transaction**, never "everything up to X", because a lower id
//!   that commits late in the database would be skipped by such a rule.
//! - Rows are marked delivered right after their transaction commits and
//!   before the next one begins, so a crash leaves at most the last committed
//!   transaction unmarked. On taking a lane, after `init_transactions`, the
//!   relay reads the lane's last progress record (`read_committed`) and marks
//!   exactly those ids before it publishes anything.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::Message;
use rdkafka::producer::{FutureProducer, Producer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::ClientConfig;
use serde::{Deserialize, Serialize};

use crate::config::RelayConfig;
use crate::error::RelayError;

/// How long the transactional calls (init, commit, abort) may block.
pub const TXN_TIMEOUT: Duration = Duration::from_secs(30);

/// One lane's progress record: the ids one committed transaction published.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Progress {
    /// The database the rows belong to ([`ferry::Ferry::database_id`]):
    /// another database's records in a shared topic are never taken.
    pub database: String,
    /// Lane number.
    pub lane: i32,
    /// The lane generation of the relay that committed it (diagnostics).
    pub generation: i64,
    /// Exactly the outbox ids published in that transaction.
    pub ids: Vec<i64>,
}

impl Progress {
    /// The record key: `<database id>:<lane>`, so compaction keeps one
    /// record per lane and database even in a shared topic.
    pub fn key(database_id: &str, lane: i32) -> String {
        format!("{database_id}:{lane}")
    }
}

/// Makes sure the progress topic exists with at least one partition per
/// lane (compacted, the cluster's default replication), creating it when
/// missing, and returns the relay's reader of it. Fewer partitions than
/// lanes is refused: a lane sharing a partition could read a stale record
/// past another lane's open transaction.
pub async fn ensure_progress_topic(cfg: &RelayConfig, lanes: i32) -> Result<ProgressReader, RelayError> {
    let progress_topic = cfg.progress_topic();
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &cfg.brokers);
    apply_security(&mut c, cfg);
    let admin: AdminClient<DefaultClientContext> = c.create()?;
    let topic = NewTopic::new(&progress_topic, lanes, TopicReplication::Fixed(-1))
        .set("cleanup.policy", "compact")
        .set("min.compaction.lag.ms", "60000");
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    for r in admin.create_topics([&topic], &opts).await? {
        match r {
            Ok(_) => tracing::info!(topic = %progress_topic, partitions = lanes, "created the progress topic"),
            Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((t, code)) => {
                return Err(RelayError::Config(format!(
                    "cannot create the progress topic {t} ({code}); create it (compacted, {lanes} partitions) or grant CreateTopics"
                )))
            }
        }
    }
    // A new topic's metadata reaches the broker's cache shortly after the
    // create call returns: ask until it shows, within a bound.
    let reader = ProgressReader {
        consumer: std::sync::Mutex::new(progress_reader(cfg)?),
        topic: progress_topic.clone(),
    };
    let (reader, partitions) = tokio::task::spawn_blocking(move || {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let n = reader
                .consumer
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .fetch_metadata(Some(&reader.topic), Duration::from_secs(10))?
                .topics()
                .first()
                .filter(|t| t.error().is_none())
                .map(|t| t.partitions().len())
                .unwrap_or(0);
            if n > 0 || std::time::Instant::now() > deadline {
                return Ok::<_, KafkaError>((reader, n));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    })
    .await
    .map_err(|e| RelayError::Config(format!("progress topic check: {e}")))??;
    if (partitions as i32) < lanes {
        return Err(RelayError::Config(format!(
            "the progress topic {} has {partitions} partitions and the outbox has {lanes} lanes: it needs one partition per lane",
            progress_topic
        )));
    }
    Ok(reader)
}

/// Only the client settings a producer override may carry that the admin
/// and reader clients need too (security, client id).
fn apply_security(c: &mut ClientConfig, cfg: &RelayConfig) {
    for (k, v) in &cfg.kafka {
        if k.starts_with("security.") || k.starts_with("sasl.") || k.starts_with("ssl.") || k == "client.id" {
            c.set(k, v);
        }
    }
}

/// A lane's transactional producer, initialised: this call fences every
/// earlier producer of the same `transactional.id` and waits until the
/// coordinator finished (committed or aborted) their last transaction.
/// Blocking; run it off the async threads.
pub fn lane_producer(cfg: &RelayConfig, lane: i32) -> Result<FutureProducer, KafkaError> {
    let mut c = crate::publish::producer_config(cfg);
    c.set("transactional.id", cfg.transactional_id(lane))
        .set("transaction.timeout.ms", "60000");
    let p: FutureProducer = c.create()?;
    p.init_transactions(TXN_TIMEOUT)?;
    Ok(p)
}

fn progress_reader(cfg: &RelayConfig) -> Result<BaseConsumer, KafkaError> {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &cfg.brokers)
        .set("group.id", format!("{}-progress-reader", cfg.transactional_id_prefix))
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("isolation.level", "read_committed")
        .set("enable.partition.eof", "true");
    apply_security(&mut c, cfg);
    c.create()
}

/// Reads lanes' last progress records through one `read_committed` consumer
/// per relay (assigned one partition at a time), so taking many lanes does
/// not open a connection per lane.
pub struct ProgressReader {
    consumer: std::sync::Mutex<BaseConsumer>,
    topic: String,
}

impl ProgressReader {
    /// The lane's last committed progress record, read from the lane's
    /// partition. Call it after [`lane_producer`], so the previous owner's
    /// last transaction is settled. Blocking.
    pub fn read(&self, database_id: &str, lane: i32) -> Result<Option<Progress>, RelayError> {
        let c = self.consumer.lock().unwrap_or_else(|p| p.into_inner());
        read_progress(&c, &self.topic, database_id, lane)
    }
}

fn read_progress(c: &BaseConsumer, topic: &str, database_id: &str, lane: i32) -> Result<Option<Progress>, RelayError> {
    let (low, high) = c.fetch_watermarks(topic, lane, Duration::from_secs(30))?;
    if high <= low {
        return Ok(None);
    }
    let key = Progress::key(database_id, lane);
    // Each transaction leaves one record and one marker in the partition;
    // look back a growing window until a record of this lane turns up.
    let mut window = 16;
    loop {
        let start = (high - window).max(low);
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(topic, lane, Offset::Offset(start))?;
        c.assign(&tpl)?;
        let mut last = None;
        loop {
            match c.poll(Duration::from_secs(30)) {
                Some(Ok(m)) => {
                    if m.key() == Some(key.as_bytes()) {
                        let value = m.payload().unwrap_or_default();
                        let p: Progress = serde_json::from_slice(value).map_err(|e| {
                            RelayError::Config(format!("corrupt progress record at {topic}/{lane}@{}: {e}", m.offset()))
                        })?;
                        last = Some(p);
                    }
                }
                Some(Err(KafkaError::PartitionEOF(_))) => break,
                Some(Err(e)) => return Err(e.into()),
                None => {
                    return Err(RelayError::Config(format!(
                        "reading the progress of lane {lane} from {topic} timed out"
                    )))
                }
            }
        }
        if last.is_some() || start == low {
            return Ok(last);
        }
        window *= 4;
    }
}

/// A test seam for the crash tests: with
/// `FERRY_RELAY_FAILPOINT=crash-after-commit:<n>`, the process aborts right
/// after its n-th Kafka commit, before marking that transaction's rows: the
/// one window where only the progress topic knows what was published.
pub fn failpoint_after_commit() {
    static COMMITS: AtomicU64 = AtomicU64::new(0);
    let n = COMMITS.fetch_add(1, Ordering::Relaxed) + 1;
    if let Ok(v) = std::env::var("FERRY_RELAY_FAILPOINT") {
        if v.strip_prefix("crash-after-commit:")
            .and_then(|s| s.parse::<u64>().ok())
            == Some(n)
        {
            tracing::error!(commit = n, "failpoint: crashing after a Kafka commit, before marking");
            std::process::abort();
        }
    }
}

/// What a failed transactional call means for the lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxnFailure {
    /// The producer is unusable (fenced by a newer owner, or another fatal
    /// error): give the lane up; a new producer is made if it comes back.
    Fatal,
    /// Abort the transaction and publish the rows again.
    Abort,
}

/// Classifies an error of `begin`/`commit`/`abort`: librdkafka flags every
/// transactional error as fatal or abortable; errors outside a transaction
/// are fatal when they name fencing, and otherwise abort and retry (the rows
/// stay pending, so retrying never loses or duplicates anything).
pub fn classify_txn(e: &KafkaError) -> TxnFailure {
    match e {
        KafkaError::Transaction(t) if t.is_fatal() => TxnFailure::Fatal,
        KafkaError::Transaction(_) => TxnFailure::Abort,
        other => match other.rdkafka_error_code() {
            Some(
                RDKafkaErrorCode::Fatal
                | RDKafkaErrorCode::ProducerFenced
                | RDKafkaErrorCode::InvalidProducerEpoch
                | RDKafkaErrorCode::TransactionalIdAuthorizationFailed
                | RDKafkaErrorCode::Fenced,
            ) => TxnFailure::Fatal,
            _ => TxnFailure::Abort,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_records_carry_the_exact_ids() {
        let p = Progress {
            database: "db-1".into(),
            lane: 3,
            generation: 7,
            ids: vec![10, 12, 11],
        };
        let json = serde_json::to_string(&p).unwrap();
        assert_eq!(json, r#"{"database":"db-1","lane":3,"generation":7,"ids":[10,12,11]}"#);
        assert_eq!(serde_json::from_str::<Progress>(&json).unwrap(), p);
        assert_eq!(Progress::key("db-1", 3), "db-1:3");
    }

    #[test]
    fn fencing_is_fatal_for_the_lane() {
        assert_eq!(
            classify_txn(&KafkaError::MessageProduction(RDKafkaErrorCode::ProducerFenced)),
            TxnFailure::Fatal
        );
        assert_eq!(
            classify_txn(&KafkaError::MessageProduction(RDKafkaErrorCode::RequestTimedOut)),
            TxnFailure::Abort
        );
    }
}
