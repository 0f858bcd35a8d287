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
//!   exactly those ids before it publishes anything. That read covers the
//!   partition's high watermark as it stood after `init_transactions`: while
//!   another producer's open transaction (another database sharing the
//!   topic) holds the committed end below it, the read waits, and says so,
//!   rather than miss the lane's last record and publish its rows again.
//! - Lanes are taken concurrently: each read has its own short-lived
//!   consumer, so no lane waits for another lane's read.
//! - WAL capture (`--capture wal`) has no lanes: one transactional producer
//!   per slot (`<prefix>-wal-<slot>`), whose progress record
//!   ([`WalProgress`]) is a WAL position, read by the same reader under the
//!   same rules (`wal::transactional`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::Consumer;
use rdkafka::error::KafkaError;
use rdkafka::producer::{FutureProducer, Producer};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::ClientConfig;
use serde::{Deserialize, Serialize};

use crate::config::RelayConfig;
use crate::error::RelayError;

mod reader;

pub use reader::ProgressReader;
use reader::REQUEST_TIMEOUT;

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

/// The progress topic's partition WAL capture writes and reads: a relay in
/// WAL capture has no lanes, and one slot's records need one partition.
pub const WAL_PARTITION: i32 = 0;

/// WAL capture's progress record, written in every Kafka transaction of a
/// slot's transactional producer (KIP-618's source offset).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WalProgress {
    /// The database the rows belong to.
    pub database: String,
    /// The replication slot.
    pub slot: String,
    /// The end of the commit record of the last PostgreSQL transaction the
    /// Kafka transaction carried (or an earlier one carried): every streamed
    /// transaction ending at or before it is in Kafka already.
    pub end_lsn: u64,
    /// A new slot's table read: exactly the ids this Kafka transaction
    /// published from the table (empty for the stream). Exact ids, not "up
    /// to": a lower id that commits late is streamed, not read.
    pub catch_up: Vec<i64>,
    /// The highest id the slot's table reads published, carried from one
    /// record to the next: a streamed row at or below it may have been
    /// published by the read, so it is produced only while still pending.
    pub catch_up_through: i64,
    /// Streamed rows in Kafka (this Kafka transaction's and earlier ones')
    /// whose marks the session had not seen committed when it wrote this
    /// record, as runs of ids `(lo, hi)`. A session marks those still
    /// pending before anything else: the stream's positions mean nothing to
    /// a slot made anew (a failover to a standby, a restore), whose table
    /// read would otherwise publish them again; and a streamed transaction
    /// the record covers then needs no mark of its own (its rows were
    /// marked, or are here). `None` in records written before it existed,
    /// and when the runs would pass [`MAX_UNMARKED_RUNS`] (ids interleaved
    /// with other writers'): then a covered streamed transaction's rows
    /// are marked as it streams again, and a slot made anew may publish
    /// them twice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unmarked: Option<Vec<(i64, i64)>>,
}

/// The most runs [`WalProgress::unmarked`] carries (about 20 bytes each: a
/// record stays well below Kafka's default 1 MB limit).
pub const MAX_UNMARKED_RUNS: usize = 20_000;

impl WalProgress {
    /// The record key: `<database id>:wal:<slot>` (never a lane's key).
    pub fn key(database_id: &str, slot: &str) -> String {
        format!("{database_id}:wal:{slot}")
    }
}

/// Makes sure the progress topic exists with at least one partition per
/// lane (compacted, the cluster's default replication), creating it when
/// missing, and returns the relay's reader of it, which counts the reads
/// that waited for another producer's transaction in `waits`. Fewer
/// partitions than lanes is refused: each lane writes and reads the
/// partition of its number, and lanes sharing one would hold each other's
/// takeovers back with their open transactions.
pub async fn ensure_progress_topic(
    cfg: &RelayConfig,
    lanes: i32,
    waits: Counter,
) -> Result<ProgressReader, RelayError> {
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
    let reader = ProgressReader::new(cfg, waits)?;
    // A new topic's metadata reaches the broker's cache shortly after the
    // create call returns: ask until it shows, within a bound.
    let (reader, partitions) = tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let n = reader
                .watermarks
                .fetch_metadata(Some(&reader.topic), REQUEST_TIMEOUT)?
                .topics()
                .first()
                .filter(|t| t.error().is_none())
                .map(|t| t.partitions().len())
                .unwrap_or(0);
            if n > 0 || Instant::now() > deadline {
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
pub(super) fn apply_security(c: &mut ClientConfig, cfg: &RelayConfig) {
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
    transactional_producer(cfg, &cfg.transactional_id(lane))
}

/// A transactional producer of `transactional_id`, initialised (see
/// [`lane_producer`]). Blocking.
pub fn transactional_producer(cfg: &RelayConfig, transactional_id: &str) -> Result<FutureProducer, KafkaError> {
    let p: FutureProducer = transactional_config(cfg, transactional_id).create()?;
    p.init_transactions(TXN_TIMEOUT)?;
    Ok(p)
}

/// The transactional producers' `transaction.timeout.ms`: the operator's
/// `--kafka` setting, else 60 s. The broker aborts a Kafka transaction
/// open longer than this.
pub fn transaction_timeout(cfg: &RelayConfig) -> Duration {
    cfg.kafka
        .iter()
        .rev()
        .find(|(k, _)| k.trim() == "transaction.timeout.ms")
        .and_then(|(_, v)| v.trim().parse::<u64>().ok())
        .map_or(DEFAULT_TRANSACTION_TIMEOUT, Duration::from_millis)
}

/// `transaction.timeout.ms` unless the operator sets it.
const DEFAULT_TRANSACTION_TIMEOUT: Duration = Duration::from_secs(60);

/// The settings of a transactional producer of `transactional_id`:
/// `transaction.timeout.ms` is 60 s unless the operator's `--kafka` sets
/// it (WAL capture never splits a PostgreSQL transaction, so only a longer
/// timeout lets one pass that takes longer to publish).
fn transactional_config(cfg: &RelayConfig, transactional_id: &str) -> ClientConfig {
    let mut c = crate::publish::producer_config(cfg);
    c.set("transactional.id", transactional_id);
    if !cfg.kafka.iter().any(|(k, _)| k.trim() == "transaction.timeout.ms") {
        c.set(
            "transaction.timeout.ms",
            DEFAULT_TRANSACTION_TIMEOUT.as_millis().to_string(),
        );
    }
    c
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

    /// A PostgreSQL transaction in WAL capture is never split, so one that
    /// takes longer than `transaction.timeout.ms` to publish can only pass
    /// with a longer timeout: the operator's `--kafka` value is kept.
    #[test]
    fn an_operator_s_transaction_timeout_is_kept() {
        let mut cfg = RelayConfig::new("postgres://unused", "127.0.0.1:9");
        cfg.exactly_once = true;
        let timeout = |cfg: &RelayConfig| {
            transactional_config(cfg, "t-wal-s")
                .get("transaction.timeout.ms")
                .map(str::to_string)
        };
        assert_eq!(timeout(&cfg).as_deref(), Some("60000"));
        cfg.kafka.push(("transaction.timeout.ms".into(), "600000".into()));
        assert_eq!(timeout(&cfg).as_deref(), Some("600000"));
    }

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
    fn wal_progress_records_carry_the_position_and_never_a_lane_s_key() {
        let p = WalProgress {
            database: "db-1".into(),
            slot: "ferry_ab".into(),
            end_lsn: 42,
            catch_up: vec![7, 9],
            catch_up_through: 9,
            unmarked: Some(vec![(11, 20)]),
        };
        let json = serde_json::to_string(&p).unwrap();
        assert_eq!(
            json,
            r#"{"database":"db-1","slot":"ferry_ab","end_lsn":42,"catch_up":[7,9],"catch_up_through":9,"unmarked":[[11,20]]}"#
        );
        assert_eq!(serde_json::from_str::<WalProgress>(&json).unwrap(), p);
        // A record written before `unmarked` existed reads as none.
        let old = r#"{"database":"db-1","slot":"ferry_ab","end_lsn":42,"catch_up":[],"catch_up_through":9}"#;
        assert_eq!(serde_json::from_str::<WalProgress>(old).unwrap().unmarked, None);
        assert_eq!(WalProgress::key("db-1", "ferry_ab"), "db-1:wal:ferry_ab");
        assert_ne!(WalProgress::key("db-1", "0"), Progress::key("db-1", 0));
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
