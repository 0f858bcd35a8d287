//! Dead letters: terminal and poison records go to the dead-letter topic and
//! into the ledger with the offset after them; a dead letter that fails is
//! retried, its partition paused, and never passed over.

use std::time::Duration;

use crate::store::PartitionLease;
use rdkafka::consumer::BaseConsumer;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;

use super::rebalance::LeaseContext;
use super::retry::{PendingDeadLetter, Retry, Step};
use super::{Consumer, Leases};
use crate::error::{classify, ConsumerError, Fault};
use crate::process::{record_dead_letter, ProcessError};
use crate::record::Record;

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

/// How long a dead-letter publish may take before it counts as failed and
/// is retried (the consumer loop waits for it, so it is kept well under the
/// lease renewal period).
const DLQ_DELIVERY_TIMEOUT: Duration = Duration::from_secs(5);

impl Consumer {
    /// The producer of the dead-letter topic, when one is configured.
    pub(super) fn dead_letter_producer(&self) -> Result<Option<FutureProducer>, ConsumerError> {
        let b = &self.b;
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
        Ok(dlq)
    }

    /// Dead-letters `record`; when the publish or the ledger write fails, a
    /// retry of the dead letter alone (the record is never passed over).
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn try_dead_letter(
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
            if let Err(e) = publish_dead_letter(producer, topic, record, code).await {
                tracing::error!(topic = %record.topic, partition = record.partition, offset = record.offset, code, error = %e, "dead-letter publish failed; the partition stays paused and it is retried");
                return Err(DeadLetterFailure::Failed { published: false });
            }
        } else {
            tracing::error!(topic = %record.topic, partition = record.partition, offset = record.offset, code, "no dead-letter topic configured; recording and skipping");
        }
        let published = dlq.is_some() && b.dead_letter_topic.is_some();
        let mut recorded = record_dead_letter(&b.store, lease, record, effect_key).await;
        if let Err(ProcessError::Database(e)) = &recorded {
            if let Fault::Record(refused) = classify(e) {
                // The database refuses the effect key itself (a NUL byte, a
                // key too long for the ledger's index): the record's own
                // data, never accepted under that key. It goes into the
                // ledger under its position, as a record without a key does.
                tracing::warn!(topic = %record.topic, partition = record.partition, offset = record.offset, code = refused, "the database refuses the record's effect key; recording its dead letter under its position");
                recorded = record_dead_letter(&b.store, lease, record, &unkeyed_ledger_key(record)).await;
            }
        }
        match recorded {
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
}

/// Publishes `record` (key, payload and headers) to the dead-letter `topic`
/// with the error code and its source position as extra headers.
async fn publish_dead_letter(
    producer: &FutureProducer,
    topic: &str,
    record: &Record,
    code: &str,
) -> Result<(), KafkaError> {
    let mut fr = FutureRecord::<[u8], [u8]>::to(topic).headers(dead_letter_headers(record, code));
    if let Some(k) = &record.key {
        fr = fr.key(k.as_slice());
    }
    if let Some(p) = &record.payload {
        fr = fr.payload(p.as_slice());
    }
    producer
        .send(fr, DLQ_DELIVERY_TIMEOUT)
        .await
        .map(|_| ())
        .map_err(|(e, _)| e)
}

/// The record's headers, then `ferry-error-code` and the
/// `ferry-source-{topic,partition,offset}` it came from.
fn dead_letter_headers(record: &Record, code: &str) -> OwnedHeaders {
    let mut headers = OwnedHeaders::new();
    for (k, v) in &record.headers {
        headers = headers.insert(Header { key: k, value: Some(v) });
    }
    let offset = record.offset.to_string();
    let partition = record.partition.to_string();
    headers
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
        })
}

/// The ledger key of a record that has no effect key (it is dead-lettered as
/// `missing_effect_key`), or whose effect key the database refuses (its dead
/// letter is recorded under this one): `!unkeyed/<topic>/<partition>/<offset>`. The `!`
/// is outside every key the relay publishes (`<tenant>/<key>`, where tenants
/// are `[A-Za-z0-9._:-]`, and `<database uuid>:<id>`), so it never shadows a
/// real effect.
pub(super) fn unkeyed_ledger_key(record: &Record) -> String {
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
            timestamp: None,
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
