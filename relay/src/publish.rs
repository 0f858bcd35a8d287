//! Producing a lane's batch to Kafka and classifying every failure
//! explicitly: transient errors back off and retry from the first
//! unacknowledged row; a record Kafka will never accept is poison.

use crate::store::PendingRow;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;

use crate::config::RelayConfig;
use crate::error::RelayError;

/// How one row's publish ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Acknowledged (`acks=all`) at this partition and offset.
    Acked {
        /// The partition of the topic the record was written to.
        partition: i32,
        /// The record's offset in that partition.
        offset: i64,
    },
    /// Kafka will never accept this record.
    Poison(&'static str),
    /// Worth retrying later (broker down, timeout, queue full, ...).
    Transient(&'static str),
    /// The producer is unusable (librdkafka raised a fatal error, e.g. an
    /// idempotence guarantee could not be kept): every later produce fails.
    Fatal,
}

/// Builds the idempotent producer: `acks=all`, Java-compatible partitioning,
/// then the operator's `--kafka` overrides.
pub fn producer(cfg: &RelayConfig) -> Result<FutureProducer, RelayError> {
    Ok(producer_config(cfg).create()?)
}

/// The client's own record limit: just under the broker's default
/// `socket.request.max.bytes` (104,857,600), above which no broker with
/// default settings can take the request at all, so a row refused for it is
/// refused for its own size.
pub const CLIENT_MAX_MESSAGE_BYTES: &str = "100000000";

/// The settings of every relay producer (idempotent, `acks=all`,
/// `murmur2_random`), with the operator's overrides applied last.
///
/// Nagle's algorithm is off on the broker sockets (librdkafka leaves it
/// on): at a low rate a produce request sent while the previous one is
/// unacknowledged at the TCP level would otherwise wait for that ACK, which
/// the broker may delay by up to 40 ms, in the commit → ack tail.
///
/// At least once, a record is retried until Kafka acknowledges it
/// (`message.timeout.ms=0`, as Kafka Connect sets `delivery.timeout.ms` to
/// its maximum for source tasks): with a finite timeout, librdkafka drops a
/// record that timed out in its queue and delivers the ones behind it (its
/// INTRODUCTION, "Message timeout considerations"), so after a broker
/// outage longer than the timeout a key's later row would reach the topic
/// before its earlier one is produced again. A broker outage stalls the
/// relay instead; its lag shows it. Exactly once, an aborted transaction
/// hides such a gap from `read_committed` readers, and librdkafka needs the
/// timeout within `transaction.timeout.ms`, so it stays at 30 s.
///
/// `message.max.bytes` is raised from librdkafka's 1,000,000 to
/// [`CLIENT_MAX_MESSAGE_BYTES`], so the topic's own `max.message.bytes` (which
/// may be larger than the client's default) is what refuses a big row, and
/// the refusal is evidence the lone re-send can take about that row: a row
/// is never marked dead for the relay's default setting alone.
pub fn producer_config(cfg: &RelayConfig) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &cfg.brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("partitioner", "murmur2_random")
        .set("compression.type", &cfg.compression)
        .set("linger.ms", "5")
        .set("socket.nagle.disable", "true")
        .set("message.timeout.ms", if cfg.exactly_once { "30000" } else { "0" })
        .set("message.max.bytes", CLIENT_MAX_MESSAGE_BYTES);
    for (k, v) in &cfg.kafka {
        c.set(canonical_key(k), v);
    }
    c
}

/// librdkafka's own name for a property the relay sets under it, so an
/// override under the other name replaces the relay's value: with both in
/// the [`ClientConfig`] (a hash map), which one librdkafka applies last is
/// chance (`delivery.timeout.ms=10000` beside the relay's
/// `message.timeout.ms=30000`, exactly once with `transaction.timeout.ms`
/// 20000: a transactional producer refused, or not, at random).
fn canonical_key(key: &str) -> &str {
    match key.trim() {
        "delivery.timeout.ms" => "message.timeout.ms",
        "request.required.acks" => "acks",
        "queue.buffering.max.ms" => "linger.ms",
        "compression.codec" => "compression.type",
        k => k,
    }
}

/// The settings of the relay's lone producer (`lane::LoneProducer`): the
/// shared producer's, with batching off (`linger.ms=0`, one record per
/// batch) set after the operator's overrides, so a lone re-send is never
/// held back to wait for company.
///
/// At least once, a lone re-send times out after [`LONE_MESSAGE_TIMEOUT_MS`]
/// (a transient outcome; its lane retries from it later): it is the only
/// record in flight, so nothing can overtake it, and its gate is shared by
/// every lane, so one unavailable partition must not stall the poison
/// handling of every other lane until it returns.
pub fn lone_producer_config(cfg: &RelayConfig) -> ClientConfig {
    let mut c = producer_config(cfg);
    c.set("linger.ms", "0").set("batch.num.messages", "1");
    if !cfg.exactly_once {
        c.remove("delivery.timeout.ms")
            .set("message.timeout.ms", LONE_MESSAGE_TIMEOUT_MS);
    }
    c
}

/// At least once, the lone producer's `message.timeout.ms`.
pub const LONE_MESSAGE_TIMEOUT_MS: &str = "30000";

/// The record of a row, routed by the topic template, with its headers
/// ([`headers_for`]) scoped by `database_id`.
pub fn record<'a>(topic: &'a str, row: &'a PendingRow, database_id: &str) -> FutureRecord<'a, [u8], [u8]> {
    FutureRecord::to(topic)
        .key(row.key.as_bytes())
        .payload(&row.payload[..])
        .headers(headers_for(row, Some(database_id)))
}

/// The record of a Debezium-layout row: the EventRouter's topic, key, value
/// and headers as they are (partitioned by the key's murmur2, as Kafka
/// Connect's producer partitions it).
pub fn event_record(event: &crate::debezium::Event) -> FutureRecord<'_, [u8], [u8]> {
    let mut headers = OwnedHeaders::new_with_capacity(event.headers.len());
    for (key, value) in &event.headers {
        headers = headers.insert(Header {
            key,
            value: value.as_deref(),
        });
    }
    let mut r = FutureRecord::to(&event.topic).headers(headers);
    if let Some(key) = &event.key {
        r = r.key(&key[..]);
    }
    if let Some(value) = &event.value {
        r = r.payload(&value[..]);
    }
    if let Some(ms) = event.timestamp {
        r = r.timestamp(ms);
    }
    r
}

/// The outcome of a delivery future.
pub fn delivered(
    r: Result<rdkafka::producer::future_producer::OwnedDeliveryResult, futures::channel::oneshot::Canceled>,
) -> Outcome {
    match r {
        Ok(Ok(d)) => Outcome::Acked {
            partition: d.partition,
            offset: d.offset,
        },
        Ok(Err((e, _))) => classify(&e),
        Err(_) => Outcome::Transient("canceled"),
    }
}

/// The `ferry-effect-key` of a row ([`ferry::outbox::effect_key_of`]),
/// unambiguous across databases and tenants; `None` without a database id.
pub fn effect_key(row: &PendingRow, database_id: Option<&str>) -> Option<String> {
    ferry::outbox::effect_key_of(&row.tenant, row.effect_key.as_deref(), row.id, database_id)
}

/// The headers of a row's record: the row's own, plus `ferry-outbox-id`,
/// `ferry-tenant`, `ferry-effect-key` ([`effect_key`], scoped by this
/// database's id) and `traceparent`. Without a database id (tests of old
/// relays), a row without a writer's effect key gets no `ferry-effect-key`
/// and consumers fall back to `ferry-outbox-id`, which is not unique across
/// databases.
pub fn headers_for(row: &PendingRow, database_id: Option<&str>) -> OwnedHeaders {
    let id = row.id.to_string();
    let effect_key = effect_key(row, database_id);
    let mut h = OwnedHeaders::new_with_capacity(row.headers.len() + 4);
    for (k, v) in &row.headers {
        h = h.insert(Header {
            key: k,
            value: Some(v.as_bytes()),
        });
    }
    h = h.insert(Header {
        key: "ferry-outbox-id",
        value: Some(id.as_bytes()),
    });
    h = h.insert(Header {
        key: "ferry-tenant",
        value: Some(row.tenant.as_bytes()),
    });
    if let Some(effect_key) = &effect_key {
        h = h.insert(Header {
            key: "ferry-effect-key",
            value: Some(effect_key.as_bytes()),
        });
    }
    if let Some(tp) = &row.traceparent {
        h = h.insert(Header {
            key: "traceparent",
            value: Some(tp.as_bytes()),
        });
    }
    h
}

/// The explicit classification of a produce error. Poison is a record
/// Kafka will never accept as it is; transient is anything a wait can heal
/// (outages, leader moves, quotas, and authorization, which an operator
/// fixes: marking every row of a topic dead on an ACL mistake would break
/// per-key order when they are replayed). A code not listed here is logged
/// and counted as `unclassified`, and treated as transient: the lane waits
/// rather than guessing that a record is poison.
pub fn classify(e: &KafkaError) -> Outcome {
    let code = match e {
        KafkaError::MessageProduction(code) => *code,
        KafkaError::Canceled => return Outcome::Transient("canceled"),
        other => {
            tracing::warn!(error = %other, "unclassified Kafka client error; treated as transient");
            return Outcome::Transient("unclassified");
        }
    };
    use RDKafkaErrorCode as C;
    match code {
        C::MessageSizeTooLarge | C::InvalidMessageSize => Outcome::Poison("message_too_large"),
        C::MessageBatchTooLarge => Outcome::Poison("message_batch_too_large"),
        C::InvalidMessage | C::InvalidRecord => Outcome::Poison("invalid_record"),
        C::InvalidTopic => Outcome::Poison("invalid_topic"),
        C::PolicyViolation => Outcome::Poison("policy_violation"),
        C::UnsupportedForMessageFormat | C::UnsupportedCompressionType => Outcome::Poison("unsupported_message_format"),
        C::InvalidTimestamp => Outcome::Poison("invalid_timestamp"),
        C::Fatal => Outcome::Fatal,
        C::TopicAuthorizationFailed => Outcome::Transient("topic_authorization_failed"),
        C::ClusterAuthorizationFailed
        | C::SaslAuthenticationFailed
        | C::Authentication
        | C::TransactionalIdAuthorizationFailed => Outcome::Transient("authentication"),
        C::QueueFull => Outcome::Transient("queue_full"),
        C::MessageTimedOut | C::RequestTimedOut | C::OperationTimedOut => Outcome::Transient("timeout"),
        C::UnknownTopicOrPartition | C::UnknownTopic | C::UnknownPartition => Outcome::Transient("unknown_topic"),
        C::NotEnoughReplicas | C::NotEnoughReplicasAfterAppend => Outcome::Transient("not_enough_replicas"),
        C::NotLeaderForPartition
        | C::LeaderNotAvailable
        | C::FencedLeaderEpoch
        | C::UnknownLeaderEpoch
        | C::KafkaStorageError
        | C::PreferredLeaderNotAvailable => Outcome::Transient("leader_moved"),
        C::AllBrokersDown | C::BrokerTransportFailure | C::NetworkException | C::BrokerNotAvailable | C::Resolve => {
            Outcome::Transient("broker_unreachable")
        }
        C::ThrottlingQuotaExceeded => Outcome::Transient("throttled"),
        C::OutOfOrderSequenceNumber
        | C::DuplicateSequenceNumber
        | C::UnknownProducerId
        | C::InvalidProducerEpoch
        | C::InvalidProducerIdMapping
        | C::ProducerFenced
        | C::Inconsistent => Outcome::Transient("idempotence"),
        C::PurgeQueue | C::PurgeInflight => Outcome::Transient("purged"),
        other => {
            tracing::warn!(code = ?other, "unclassified Kafka error code; treated as transient");
            Outcome::Transient("unclassified")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classification_is_explicit() {
        let p = |c| classify(&KafkaError::MessageProduction(c));
        assert_eq!(
            p(RDKafkaErrorCode::MessageSizeTooLarge),
            Outcome::Poison("message_too_large")
        );
        // An ACL mistake waits; it never marks rows dead.
        assert_eq!(
            p(RDKafkaErrorCode::TopicAuthorizationFailed),
            Outcome::Transient("topic_authorization_failed")
        );
        assert_eq!(p(RDKafkaErrorCode::Fatal), Outcome::Fatal);
        // Unknown codes are visible, and never poison.
        assert_eq!(
            p(RDKafkaErrorCode::GroupAuthorizationFailed),
            Outcome::Transient("unclassified")
        );
        assert_eq!(p(RDKafkaErrorCode::QueueFull), Outcome::Transient("queue_full"));
        assert_eq!(
            p(RDKafkaErrorCode::AllBrokersDown),
            Outcome::Transient("broker_unreachable")
        );
        assert_eq!(classify(&KafkaError::Canceled), Outcome::Transient("canceled"));
    }

    #[test]
    fn an_override_under_another_name_replaces_the_relay_s_setting() {
        let mut cfg = RelayConfig::new("sqlite://x", "b");
        cfg.exactly_once = true;
        cfg.kafka = vec![
            ("delivery.timeout.ms".into(), "10000".into()),
            ("transaction.timeout.ms".into(), "20000".into()),
        ];
        let c = producer_config(&cfg);
        assert_eq!(c.get("message.timeout.ms"), Some("10000"));
        assert_eq!(c.get("delivery.timeout.ms"), None);
    }

    #[test]
    fn a_lone_re_send_times_out_at_least_once() {
        let mut cfg = RelayConfig::new("sqlite://x", "b");
        cfg.kafka = vec![("delivery.timeout.ms".into(), "0".into())];
        let c = lone_producer_config(&cfg);
        assert_eq!(c.get("message.timeout.ms"), Some(LONE_MESSAGE_TIMEOUT_MS));
        assert_eq!(c.get("delivery.timeout.ms"), None);
        assert_eq!(producer_config(&cfg).get("message.timeout.ms"), Some("0"));
    }

    /// This thread's CPU time and its voluntary context switches (the times
    /// it blocked), from `/proc/thread-self`.
    #[cfg(target_os = "linux")]
    fn thread_cpu_and_waits() -> (std::time::Duration, u64) {
        let schedstat = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap();
        let cpu = std::time::Duration::from_nanos(schedstat.split_whitespace().next().unwrap().parse().unwrap());
        let status = std::fs::read_to_string("/proc/thread-self/status").unwrap();
        let waits = status
            .lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        (cpu, waits)
    }

    /// rdkafka's `BaseProducer::poll` loops until its deadline passes, and
    /// rdkafka 0.39.0 handed librdkafka the time left truncated to whole
    /// milliseconds: with less than one left, a non-blocking poll, again
    /// and again until the deadline. Every producer's polling thread ends
    /// each of its 100 ms polls that way, so an idle producer spun about
    /// 1 % of a core. The vendored rdkafka (vendor/rdkafka/FERRY-PATCH.md)
    /// rounds up. 300 polls of 0.9 ms each on this thread: without the
    /// spin each one blocks (a voluntary context switch, whatever the
    /// machine's load) and costs microseconds of CPU; with it the thread
    /// never blocks and is on the CPU whenever it runs (268 ms in 270 ms
    /// here).
    #[cfg(target_os = "linux")]
    #[test]
    fn a_producer_s_poll_under_a_millisecond_blocks_instead_of_spinning() {
        let cfg = RelayConfig::new("sqlite://x", "127.0.0.1:1");
        let producer: rdkafka::producer::BaseProducer = producer_config(&cfg).create().unwrap();
        let (cpu, waits) = thread_cpu_and_waits();
        let wall = std::time::Instant::now();
        for _ in 0..300 {
            producer.poll(std::time::Duration::from_micros(900));
        }
        let (wall, (cpu_after, waits_after)) = (wall.elapsed(), thread_cpu_and_waits());
        let (cpu, waits) = (cpu_after - cpu, waits_after - waits);
        assert!(
            waits >= 150 && cpu < std::time::Duration::from_millis(60),
            "300 polls of 0.9 ms blocked {waits} times and spent {cpu:?} on the CPU in {wall:?}: they spin"
        );
    }

    #[test]
    fn effect_keys_are_scoped() {
        let mut row = PendingRow {
            id: 7,
            tenant: "acme:eu".into(),
            topic: "orders".into(),
            key: "k".into(),
            payload: Vec::new(),
            headers: Default::default(),
            effect_key: None,
            traceparent: None,
            created_at: ferry::Millis::new(0).unwrap(),
        };
        assert_eq!(effect_key(&row, Some("db-1")).as_deref(), Some("db-1:7"));
        assert_eq!(effect_key(&row, None), None);
        row.effect_key = Some("charge/1".into());
        assert_eq!(effect_key(&row, Some("db-1")).as_deref(), Some("acme:eu/charge/1"));
    }
}
