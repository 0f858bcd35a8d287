//! Reading a lane's (or a WAL slot's) last committed progress record on
//! takeover: its own short-lived `read_committed` consumer per read, up to
//! the high watermark seen after `init_transactions`, waiting out another
//! producer's open transaction below it rather than reading past it; and
//! the classification of the read's consumer errors.

use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::Message;
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::ClientConfig;

use super::{apply_security, Progress, WalProgress, WAL_PARTITION};
use crate::config::RelayConfig;
use crate::error::RelayError;

/// How long the reader's metadata and offset requests may take.
pub(super) const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
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
    pub(super) watermarks: BaseConsumer,
    /// The settings of each read's `read_committed` consumer.
    consumer: ClientConfig,
    /// The progress topic.
    pub(super) topic: String,
    /// Reads that found another producer's transaction open below the high
    /// watermark and waited for it.
    waits: Counter,
}

impl ProgressReader {
    pub(super) fn new(cfg: &RelayConfig, waits: Counter) -> Result<ProgressReader, KafkaError> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
