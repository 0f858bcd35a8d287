//! Producing a lane's batch to Kafka and classifying every failure
//! explicitly: transient errors back off and retry from the first
//! unacknowledged row; a record Kafka will never accept is poison.

use ferry::relay::PendingRow;
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
        /// Partition.
        partition: i32,
        /// Offset.
        offset: i64,
    },
    /// Kafka will never accept this record.
    Poison(&'static str),
    /// Worth retrying later (broker down, timeout, queue full, ...).
    Transient(&'static str),
}

/// Builds the idempotent producer: `acks=all`, Java-compatible partitioning,
/// then the operator's `--kafka` overrides.
pub fn producer(cfg: &RelayConfig) -> Result<FutureProducer, RelayError> {
    Ok(producer_config(cfg).create()?)
}

/// The settings of every relay producer (idempotent, `acks=all`,
/// `murmur2_random`), with the operator's overrides applied last.
pub fn producer_config(cfg: &RelayConfig) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &cfg.brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("partitioner", "murmur2_random")
        .set("compression.type", &cfg.compression)
        .set("linger.ms", "5")
        .set("message.timeout.ms", "30000");
    for (k, v) in &cfg.kafka {
        c.set(k, v);
    }
    c
}

/// The record of a row, routed by the topic template.
pub fn record<'a>(topic: &'a str, row: &'a PendingRow) -> FutureRecord<'a, [u8], [u8]> {
    FutureRecord::to(topic)
        .key(row.key.as_bytes())
        .payload(&row.payload[..])
        .headers(headers(row))
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

/// The headers of a row's record: the row's own, plus `ferry-outbox-id`,
/// `ferry-tenant`, `ferry-effect-key` and `traceparent`.
pub fn headers(row: &PendingRow) -> OwnedHeaders {
    let id = row.id.to_string();
    let effect_key = row.effect_key.clone().unwrap_or_else(|| id.clone());
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
    h = h.insert(Header {
        key: "ferry-effect-key",
        value: Some(effect_key.as_bytes()),
    });
    if let Some(tp) = &row.traceparent {
        h = h.insert(Header {
            key: "traceparent",
            value: Some(tp.as_bytes()),
        });
    }
    h
}

/// The explicit classification: a named list is fatal for the record; every
/// other code backs off. Nothing unknown is silently dropped.
pub fn classify(e: &KafkaError) -> Outcome {
    let code = match e {
        KafkaError::MessageProduction(code) => *code,
        _ => return Outcome::Transient("client"),
    };
    use RDKafkaErrorCode as C;
    match code {
        C::MessageSizeTooLarge | C::InvalidMessageSize => Outcome::Poison("message_too_large"),
        C::MessageBatchTooLarge => Outcome::Poison("message_batch_too_large"),
        C::InvalidMessage | C::InvalidRecord => Outcome::Poison("invalid_record"),
        C::TopicAuthorizationFailed => Outcome::Poison("topic_authorization_failed"),
        C::InvalidTopic => Outcome::Poison("invalid_topic"),
        C::PolicyViolation => Outcome::Poison("policy_violation"),
        C::UnsupportedForMessageFormat => Outcome::Poison("unsupported_message_format"),
        C::QueueFull => Outcome::Transient("queue_full"),
        C::MessageTimedOut | C::RequestTimedOut => Outcome::Transient("timeout"),
        C::UnknownTopicOrPartition | C::UnknownTopic | C::UnknownPartition => Outcome::Transient("unknown_topic"),
        C::NotEnoughReplicas | C::NotEnoughReplicasAfterAppend => Outcome::Transient("not_enough_replicas"),
        C::NotLeaderForPartition | C::LeaderNotAvailable => Outcome::Transient("leader_moved"),
        C::AllBrokersDown | C::BrokerTransportFailure | C::NetworkException | C::BrokerNotAvailable => {
            Outcome::Transient("broker_unreachable")
        }
        C::ClusterAuthorizationFailed | C::SaslAuthenticationFailed => Outcome::Transient("authentication"),
        _ => Outcome::Transient("other"),
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
        assert_eq!(
            p(RDKafkaErrorCode::TopicAuthorizationFailed),
            Outcome::Poison("topic_authorization_failed")
        );
        assert_eq!(p(RDKafkaErrorCode::QueueFull), Outcome::Transient("queue_full"));
        assert_eq!(
            p(RDKafkaErrorCode::AllBrokersDown),
            Outcome::Transient("broker_unreachable")
        );
        assert_eq!(classify(&KafkaError::Canceled), Outcome::Transient("client"));
    }
}
