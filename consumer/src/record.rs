//! A consumed record, detached from librdkafka's buffers, and the handler trait.

use std::collections::BTreeMap;

use futures::future::BoxFuture;
use rdkafka::message::{BorrowedMessage, Headers, Message};

use crate::error::HandlerError;

/// One Kafka record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// Offset.
    pub offset: i64,
    /// Key bytes.
    pub key: Option<Vec<u8>>,
    /// Value bytes.
    pub payload: Option<Vec<u8>>,
    /// Headers (the last value wins for a repeated name).
    pub headers: BTreeMap<String, Vec<u8>>,
    /// The record's Kafka timestamp in milliseconds since the Unix epoch:
    /// when the producer made it (`CreateTime`, the default; for the relay's
    /// records, when it handed the row to its producer) or when the broker
    /// appended it (`LogAppendTime`, a topic setting). `None` when the record
    /// carries none.
    pub timestamp: Option<i64>,
}

impl Record {
    /// Copies a borrowed message.
    pub fn from_message(m: &BorrowedMessage<'_>) -> Record {
        let headers = m
            .headers()
            .map(|h| {
                h.iter()
                    .map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec()))
                    .collect()
            })
            .unwrap_or_default();
        Record {
            topic: m.topic().to_owned(),
            partition: m.partition(),
            offset: m.offset(),
            key: m.key().map(<[u8]>::to_vec),
            payload: m.payload().map(<[u8]>::to_vec),
            headers,
            timestamp: m.timestamp().to_millis(),
        }
    }

    /// A header as UTF-8.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| std::str::from_utf8(v).ok())
    }

    /// The key consumers dedupe on: `ferry-effect-key` (the relay publishes
    /// `<database_id>:<outbox id>`, or `<tenant>/<key>` for a writer's key),
    /// else `ferry-outbox-id`. That fallback, for records of relays that set
    /// no `ferry-effect-key`, is not unique across databases.
    pub fn effect_key(&self) -> Option<String> {
        self.header("ferry-effect-key")
            .or_else(|| self.header("ferry-outbox-id"))
            .filter(|k| !k.is_empty())
            .map(str::to_owned)
    }

    /// The W3C trace context the producer carried.
    pub fn traceparent(&self) -> Option<&str> {
        self.header("traceparent")
    }
}

/// Applies a record's effects inside the transaction Ferry opened; they commit
/// together with the ledger row and the stored offset, or not at all.
pub trait Handler: Send + Sync + 'static {
    /// Writes the record's effects with `tx`. Never commit or roll back `tx`,
    /// and never read or write `consumer_ledger`: in a micro-batch, the
    /// ledger rows of all its records are inserted before its first handler
    /// runs, so a row there does not mean its record's effects are done.
    fn handle<'a>(&'a self, record: &'a Record, tx: &'a mut ferry::Tx) -> BoxFuture<'a, Result<(), HandlerError>>;
}
