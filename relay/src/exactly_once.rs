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
}

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
    transactional_producer(cfg, &cfg.transactional_id(lane))
}

/// A transactional producer of `transactional_id`, initialised (see
/// [`lane_producer`]). Blocking.
pub fn transactional_producer(cfg: &RelayConfig, transactional_id: &str) -> Result<FutureProducer, KafkaError> {
    let p: FutureProducer = transactional_config(cfg, transactional_id).create()?;
    p.init_transactions(TXN_TIMEOUT)?;
    Ok(p)
}

/// The settings of a transactional producer of `transactional_id`:
/// `transaction.timeout.ms` is 60 s unless the operator's `--kafka` sets
/// it (WAL capture never splits a PostgreSQL transaction, so only a longer
/// timeout lets one pass that takes longer to publish).
fn transactional_config(cfg: &RelayConfig, transactional_id: &str) -> ClientConfig {
    let mut c = crate::publish::producer_config(cfg);
    c.set("transactional.id", transactional_id);
    if !cfg.kafka.iter().any(|(k, _)| k.trim() == "transaction.timeout.ms") {
        c.set("transaction.timeout.ms", "60000");
    }
    c
}

/// How long the reader's metadata and offset requests may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// One poll of a progress read; also how often the read checks that its
/// lane task still waits for it.
const READ_POLL: Duration = Duration::from_millis(100);
/// A read not done after this long asks for the partition's last stable
/// offset, to tell a wait on an open transaction from a slow read.
const WAIT_CHECK: Duration = Duration::from_secs(1);
/// While a read waits on an open transaction, it says so again this often.
const WAIT_REPORT_EVERY: Duration = Duration::from_secs(30);
/// How much one progress read's consumer may prefetch, in KiB: a relay
/// runs one read per lane at once (64 by default), so librdkafka's default
/// of 64 MiB each would be 4 GiB for a restart beside a busy shared topic.
const READ_PREFETCH_KBYTES: &str = "1024";
/// How far back from the high watermark a read looks first; the window
/// grows fourfold until a record of the lane turns up or the partition's
/// start is reached.
const FIRST_WINDOW: i64 = 16;

/// Reads lanes' last committed progress records on takeover. Each read has
/// its own `read_committed` consumer, created for it and dropped after it,
/// so lanes are taken concurrently and a read that waits for another
/// producer's transaction delays no other lane.
pub struct ProgressReader {
    /// A `read_uncommitted` client without a group, for the high watermark
    /// (a `read_committed` client's offset request answers the last stable
    /// offset instead) and the topic's metadata.
    watermarks: BaseConsumer,
    /// The settings of each read's `read_committed` consumer.
    consumer: ClientConfig,
    /// The progress topic.
    topic: String,
    /// Reads that found another producer's transaction open below the high
    /// watermark and waited for it.
    waits: Counter,
}

impl ProgressReader {
    fn new(cfg: &RelayConfig, waits: Counter) -> Result<ProgressReader, KafkaError> {
        let mut watermarks = ClientConfig::new();
        watermarks
            .set("bootstrap.servers", &cfg.brokers)
            .set("isolation.level", "read_uncommitted");
        apply_security(&mut watermarks, cfg);
        let mut consumer = ClientConfig::new();
        consumer
            .set("bootstrap.servers", &cfg.brokers)
            .set("group.id", format!("{}-progress-reader", cfg.transactional_id_prefix))
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("isolation.level", "read_committed")
            // The read ends on its position, never on an end-of-partition
            // event, and a start below the log start is an error, never a
            // silent jump to the end.
            .set("enable.partition.eof", "false")
            .set("auto.offset.reset", "error")
            // The broker answers an empty fetch after this long: the wait
            // between an open transaction's end and the read seeing it.
            .set("fetch.wait.max.ms", "100")
            // A read that widens its window over a large partition (a
            // shared topic) prefetches at most this much, not librdkafka's
            // 64 MiB: every lane reads at once.
            .set("queued.max.messages.kbytes", READ_PREFETCH_KBYTES);
        apply_security(&mut consumer, cfg);
        Ok(ProgressReader {
            watermarks: watermarks.create()?,
            consumer,
            topic: cfg.progress_topic(),
            waits,
        })
    }

    /// The lane's last committed progress record: the last record of
    /// `database_id`'s lane below the partition's high watermark as it
    /// stands now. Call it after [`lane_producer`], so the previous owner's
    /// last transaction is settled and below that watermark. The read
    /// covers everything below it: while another producer's open
    /// transaction holds the committed end lower, it waits (the broker
    /// aborts a transaction at its `transaction.timeout.ms`), logs a
    /// warning and counts the wait. Blocking; it gives up with
    /// [`KafkaError::Canceled`] once `given_up()` says nobody waits for it.
    pub fn read(
        &self,
        database_id: &str,
        lane: i32,
        given_up: impl Fn() -> bool,
    ) -> Result<Option<Progress>, RelayError> {
        self.read_last(lane, Progress::key(database_id, lane), given_up)
    }

    /// The slot's last committed [`WalProgress`], read as [`Self::read`]
    /// reads a lane's, from [`WAL_PARTITION`]. Call it after the slot's
    /// transactional producer was initialised.
    pub fn read_wal(
        &self,
        database_id: &str,
        slot: &str,
        given_up: impl Fn() -> bool,
    ) -> Result<Option<WalProgress>, RelayError> {
        self.read_last(WAL_PARTITION, WalProgress::key(database_id, slot), given_up)
    }

    /// The last record of `key` in `partition` below its high watermark as
    /// it stands now, decoded.
    fn read_last<T: serde::de::DeserializeOwned>(
        &self,
        partition: i32,
        key: String,
        given_up: impl Fn() -> bool,
    ) -> Result<Option<T>, RelayError> {
        // The client is never assigned anything: its queue holds only the
        // errors of its connections since the last read (a broker restart,
        // say), which its requests below retry past.
        while let Some(Err(e)) = self.watermarks.poll(Duration::ZERO) {
            tracing::debug!(error = %e, "progress watermark client");
        }
        let (low, high) = self
            .watermarks
            .fetch_watermarks(&self.topic, partition, REQUEST_TIMEOUT)?;
        if high <= low {
            return Ok(None);
        }
        let consumer: BaseConsumer = self.consumer.create()?;
        let mut read = LaneRead {
            reader: self,
            consumer: &consumer,
            lane: partition,
            key,
            high,
            waited: None,
        };
        let mut window = FIRST_WINDOW;
        let mut start = (high - window).max(low);
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&self.topic, partition, Offset::Offset(start))?;
        consumer.assign(&tpl)?;
        loop {
            let last = read.read_past_high(&given_up)?;
            if let Some((offset, payload)) = last {
                return serde_json::from_slice(&payload).map(Some).map_err(|e| {
                    RelayError::Config(format!(
                        "corrupt progress record at {}/{partition}@{offset}: {e}",
                        self.topic
                    ))
                });
            }
            if start == low {
                return Ok(None);
            }
            window *= 4;
            start = (high - window).max(low);
            consumer.seek(&self.topic, partition, Offset::Offset(start), REQUEST_TIMEOUT)?;
        }
    }
}

/// One takeover's read of its lane's partition (or WAL capture's).
struct LaneRead<'a> {
    reader: &'a ProgressReader,
    consumer: &'a BaseConsumer,
    /// The partition read.
    lane: i32,
    /// The record key ([`Progress::key`], [`WalProgress::key`]).
    key: String,
    /// The high watermark seen after `init_transactions`: the read is done
    /// only once it has read past it.
    high: i64,
    /// Since when, and when last said, the read waits for an open
    /// transaction below `high`.
    waited: Option<Wait>,
}

/// A progress read's wait for an open transaction.
struct Wait {
    since: Instant,
    reported: Instant,
}

impl LaneRead<'_> {
    /// Reads from the assigned position until the consumer's position
    /// reaches the high watermark, and returns the last record of the key
    /// below it (its offset and payload). The position passes committed records and transaction
    /// markers alike, and only what lies below the last stable offset is
    /// ever delivered, so reaching `high` means every transaction below it
    /// was settled and read.
    fn read_past_high(&mut self, given_up: &impl Fn() -> bool) -> Result<Option<(i64, Vec<u8>)>, RelayError> {
        let mut last = None;
        let mut checked = Instant::now();
        loop {
            if self.position()? >= self.high {
                if let Some(wait) = self.waited.take() {
                    tracing::info!(
                        lane = self.lane,
                        waited_ms = wait.since.elapsed().as_millis() as u64,
                        "the open transaction on the progress topic ended; the lane's progress is read"
                    );
                }
                return Ok(last);
            }
            if given_up() {
                return Err(KafkaError::Canceled.into());
            }
            match self.consumer.poll(READ_POLL) {
                Some(Ok(m)) if m.offset() < self.high && m.key() == Some(self.key.as_bytes()) => {
                    last = Some((m.offset(), m.payload().unwrap_or_default().to_vec()));
                }
                // Another lane's or database's record, or one written after
                // the takeover began.
                Some(Ok(_)) => {}
                Some(Err(e)) => match classify_read(&e) {
                    ReadFailure::Transient(code) => {
                        tracing::debug!(lane = self.lane, code, error = %e, "reading progress: the client retries")
                    }
                    ReadFailure::Fail(code) => {
                        tracing::warn!(lane = self.lane, code, error = %e, "reading the lane's progress failed");
                        return Err(e.into());
                    }
                },
                None => {}
            }
            if checked.elapsed() >= WAIT_CHECK {
                checked = Instant::now();
                self.check_open_transaction()?;
            }
        }
    }

    /// The consumer's position in the lane's partition (the offset after
    /// the last record or transaction marker it passed), or -1 before any.
    fn position(&self) -> Result<i64, KafkaError> {
        let positions = self.consumer.position()?;
        Ok(
            match positions
                .find_partition(&self.reader.topic, self.lane)
                .map(|p| p.offset())
            {
                Some(Offset::Offset(o)) => o,
                _ => -1,
            },
        )
    }

    /// A slow read: when the partition's last stable offset is below the
    /// high watermark, an open transaction (another database's relay, or a
    /// producer that is not Ferry's) hides what lies above it. Says so once
    /// and counts it, then again every [`WAIT_REPORT_EVERY`] while it lasts.
    fn check_open_transaction(&mut self) -> Result<(), KafkaError> {
        let (_, stable) = self
            .consumer
            .fetch_watermarks(&self.reader.topic, self.lane, REQUEST_TIMEOUT)?;
        if stable >= self.high {
            return Ok(());
        }
        let now = Instant::now();
        let first = self.waited.is_none();
        let wait = self.waited.get_or_insert(Wait {
            since: now,
            reported: now,
        });
        if first {
            self.reader.waits.inc();
        } else if now.duration_since(wait.reported) < WAIT_REPORT_EVERY {
            return Ok(());
        }
        wait.reported = now;
        tracing::warn!(
            lane = self.lane,
            topic = %self.reader.topic,
            last_stable_offset = stable,
            high_watermark = self.high,
            waited_s = now.duration_since(wait.since).as_secs(),
            "an open transaction on the lane's progress partition holds its committed end below the high watermark: \
             waiting for it to commit or abort (at most its transaction.timeout.ms) before publishing the lane"
        );
        Ok(())
    }
}

/// What a consumer error means for a progress read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReadFailure {
    /// The client recovers by itself (reconnects, a new leader): keep reading.
    Transient(&'static str),
    /// The read fails; the lane backs off and takes itself over again.
    Fail(&'static str),
}

/// Classifies a consumer error of a progress read. A code not listed here
/// fails the read as `unclassified` (logged with the error by the read):
/// the lane retries its takeover, and nothing is marked on a guess.
fn classify_read(e: &KafkaError) -> ReadFailure {
    use RDKafkaErrorCode as C;
    let Some(code) = e.rdkafka_error_code() else {
        return ReadFailure::Fail("unclassified");
    };
    match code {
        C::AllBrokersDown | C::BrokerTransportFailure | C::NetworkException | C::BrokerNotAvailable | C::Resolve => {
            ReadFailure::Transient("broker_unreachable")
        }
        C::NotLeaderForPartition
        | C::LeaderNotAvailable
        | C::FencedLeaderEpoch
        | C::UnknownLeaderEpoch
        | C::KafkaStorageError
        | C::PreferredLeaderNotAvailable => ReadFailure::Transient("leader_moved"),
        C::RequestTimedOut | C::OperationTimedOut => ReadFailure::Transient("timeout"),
        C::ThrottlingQuotaExceeded => ReadFailure::Transient("throttled"),
        C::AutoOffsetReset | C::OffsetOutOfRange => ReadFailure::Fail("offset_out_of_range"),
        C::TopicAuthorizationFailed | C::GroupAuthorizationFailed => ReadFailure::Fail("authorization"),
        C::SaslAuthenticationFailed | C::Authentication => ReadFailure::Fail("authentication"),
        C::UnknownTopicOrPartition | C::UnknownTopic | C::UnknownPartition => ReadFailure::Fail("unknown_topic"),
        C::Fatal => ReadFailure::Fail("fatal"),
        _ => ReadFailure::Fail("unclassified"),
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
        };
        let json = serde_json::to_string(&p).unwrap();
        assert_eq!(
            json,
            r#"{"database":"db-1","slot":"ferry_ab","end_lsn":42,"catch_up":[7,9],"catch_up_through":9}"#
        );
        assert_eq!(serde_json::from_str::<WalProgress>(&json).unwrap(), p);
        assert_eq!(WalProgress::key("db-1", "ferry_ab"), "db-1:wal:ferry_ab");
        assert_ne!(WalProgress::key("db-1", "0"), Progress::key("db-1", 0));
    }

    #[test]
    fn a_progress_read_prefetches_little() {
        let cfg = RelayConfig::new("postgres://unused", "127.0.0.1:9");
        let reader = ProgressReader::new(&cfg, Counter::default()).unwrap();
        let kbytes: u64 = reader
            .consumer
            .get("queued.max.messages.kbytes")
            .unwrap_or("65536")
            .parse()
            .unwrap();
        // librdkafka accepts it (its fetch size follows it down).
        let _: BaseConsumer = reader.consumer.create().unwrap();
        let lanes = 64;
        assert!(
            kbytes * lanes <= 128 * 1024,
            "{lanes} concurrent progress reads may prefetch {} MiB",
            kbytes * lanes / 1024
        );
    }

    #[test]
    fn progress_read_errors_are_classified() {
        let c = |code| classify_read(&KafkaError::MessageConsumption(code));
        // The client reconnects or finds the new leader by itself.
        assert_eq!(
            c(RDKafkaErrorCode::BrokerTransportFailure),
            ReadFailure::Transient("broker_unreachable")
        );
        assert_eq!(
            c(RDKafkaErrorCode::NotLeaderForPartition),
            ReadFailure::Transient("leader_moved")
        );
        // A start below the log start is never a jump to its end.
        assert_eq!(
            c(RDKafkaErrorCode::AutoOffsetReset),
            ReadFailure::Fail("offset_out_of_range")
        );
        assert_eq!(
            c(RDKafkaErrorCode::TopicAuthorizationFailed),
            ReadFailure::Fail("authorization")
        );
        // Unknown codes fail the read (the lane retries), visibly.
        assert_eq!(c(RDKafkaErrorCode::InvalidRecord), ReadFailure::Fail("unclassified"));
        assert_eq!(classify_read(&KafkaError::Canceled), ReadFailure::Fail("unclassified"));
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
