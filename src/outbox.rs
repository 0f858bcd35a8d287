//! The transactional outbox: messages written in the caller's transaction and
//! published to Kafka by `ferry-relay` after commit.
//!
//! Each row carries `lane = murmur2(key) mod lanes`; rows of one key share a
//! lane and are published in `id` order. The lane count is fixed per database
//! (`ferry_settings.outbox_lanes`, default 64).
//!
//! Ids of one `(topic, key)` follow commit order for any writer: on
//! PostgreSQL [`Ferry::enqueue_in`] takes a transaction-scoped advisory lock
//! on the pair before the row draws its id (unless turned off with
//! `FerryBuilder::outbox_key_locks(false)`); SQLite serializes writers
//! already. Run events need no such lock: their writers hold the run's row.

use std::collections::BTreeMap;

use sqlx::types::Json;

use crate::error::{Error, Result};
use crate::limits::Limits;
use crate::notify::OUTBOX_PAYLOAD;
use crate::store::{on_conn, on_pool, Conn, Db};
use crate::Ferry;

/// A message for Kafka, committed with the caller's transaction.
#[derive(Debug, Clone, PartialEq)]
pub struct OutboxMessage {
    /// Tenant that owns the message.
    pub tenant: String,
    /// Kafka topic (the relay's routing rule may rewrite it).
    pub topic: String,
    /// Kafka key: the aggregate id. Orders the messages of one key.
    pub key: String,
    /// The record value.
    pub payload: Vec<u8>,
    /// Extra Kafka headers.
    pub headers: BTreeMap<String, String>,
    /// What consumers dedupe on; `None` means the outbox id.
    pub effect_key: Option<String>,
    /// W3C `traceparent` of the enqueuing request, continued by consumers.
    pub traceparent: Option<String>,
}

impl OutboxMessage {
    /// A message with raw bytes as its value.
    pub fn bytes(
        tenant: impl Into<String>,
        topic: impl Into<String>,
        key: impl Into<String>,
        payload: Vec<u8>,
    ) -> Self {
        OutboxMessage {
            tenant: tenant.into(),
            topic: topic.into(),
            key: key.into(),
            payload,
            headers: BTreeMap::new(),
            effect_key: None,
            traceparent: None,
        }
    }

    /// A message whose value is `value` as JSON.
    pub fn json<T: serde::Serialize>(
        tenant: impl Into<String>,
        topic: impl Into<String>,
        key: impl Into<String>,
        value: &T,
    ) -> Result<Self> {
        let payload = serde_json::to_vec(value).map_err(|e| Error::invalid("payload", e.to_string()))?;
        let mut msg = Self::bytes(tenant, topic, key, payload);
        msg.headers.insert("content-type".into(), "application/json".into());
        Ok(msg)
    }

    /// Adds a header.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// Sets the key consumers dedupe on.
    pub fn effect_key(mut self, key: impl Into<String>) -> Self {
        self.effect_key = Some(key.into());
        self
    }

    /// Sets the W3C trace context to carry to consumers.
    pub fn traceparent(mut self, tp: impl Into<String>) -> Self {
        self.traceparent = Some(tp.into());
        self
    }

    fn validate(&self, limits: &Limits) -> Result<()> {
        limits.tenant(&self.tenant)?;
        limits.topic(&self.topic)?;
        if self.key.is_empty() || self.key.len() > limits.max_key_bytes {
            return Err(Error::invalid(
                "key",
                format!("must be 1 to {} bytes", limits.max_key_bytes),
            ));
        }
        limits.no_nul("key", &self.key)?;
        limits.payload("payload", self.payload.len())?;
        if self.headers.len() > limits.max_headers {
            return Err(Error::invalid(
                "headers",
                format!("at most {} headers", limits.max_headers),
            ));
        }
        if self.headers.keys().any(|k| k.is_empty() || k.starts_with("ferry-")) {
            return Err(Error::invalid(
                "headers",
                "names must be non-empty and not start with ferry-",
            ));
        }
        for (name, value) in &self.headers {
            limits.no_nul("headers", name)?;
            limits.no_nul("headers", value)?;
        }
        if let Some(k) = &self.effect_key {
            if k.is_empty() || k.len() > limits.max_key_bytes {
                return Err(Error::invalid(
                    "effect_key",
                    format!("must be 1 to {} bytes", limits.max_key_bytes),
                ));
            }
            limits.no_nul("effect_key", k)?;
        }
        if let Some(tp) = &self.traceparent {
            validate_traceparent(tp)?;
        }
        self.fits_a_record(limits)
    }

    /// The bytes librdkafka will count for this message's record against
    /// `message.max.bytes`, at most: framing, key, payload, its headers and
    /// the relay's (a `traceparent` always counted: `enqueue_in` may add the
    /// current span's).
    pub fn record_bytes(&self) -> usize {
        crate::limits::RECORD_FRAMING
            + self.key.len()
            + self.payload.len()
            + self
                .headers
                .iter()
                .map(|(k, v)| crate::limits::header_bytes(k, v.len()))
                .sum::<usize>()
            + crate::limits::relay_header_bytes(self.tenant.len(), self.effect_key.as_ref().map(String::len), true)
    }

    /// Refuses a message whose record Kafka would refuse (see
    /// [`Limits::max_publish_bytes`]).
    pub(crate) fn fits_a_record(&self, limits: &Limits) -> Result<()> {
        let size = self.record_bytes();
        if size > limits.max_publish_bytes {
            return Err(Error::invalid(
                "payload",
                format!(
                    "makes a {size}-byte Kafka record with its key and headers; the limit is {}",
                    limits.max_publish_bytes
                ),
            ));
        }
        Ok(())
    }
}

/// Checks the W3C `traceparent` shape: `00-<32 hex>-<16 hex>-<2 hex>`.
pub fn validate_traceparent(tp: &str) -> Result<()> {
    let parts: Vec<&str> = tp.split('-').collect();
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    if parts.len() == 4 && hex(parts[0], 2) && hex(parts[1], 32) && hex(parts[2], 16) && hex(parts[3], 2) {
        Ok(())
    } else {
        Err(Error::invalid("traceparent", "must be a W3C traceparent"))
    }
}

/// Kafka's murmur2 (the Java client's `Utils.murmur2`), used for lanes and to
/// check partitions: `(murmur2(key) & 0x7fffffff) % partitions`.
pub fn murmur2(data: &[u8]) -> i32 {
    const SEED: u32 = 0x9747_b28c;
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;
    let len = data.len();
    let mut h: u32 = SEED ^ (len as u32);
    let mut chunks = data.chunks_exact(4);
    for chunk in &mut chunks {
        let mut k = u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let rest = chunks.remainder();
    if rest.len() >= 3 {
        h ^= u32::from(rest[2]) << 16;
    }
    if rest.len() >= 2 {
        h ^= u32::from(rest[1]) << 8;
    }
    if !rest.is_empty() {
        h ^= u32::from(rest[0]);
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h as i32
}

/// The lane of `key` when the database has `lanes` lanes.
pub fn lane_for(key: &str, lanes: i32) -> i32 {
    (murmur2(key.as_bytes()) & 0x7fff_ffff) % lanes.max(1)
}

pub(crate) async fn load_lanes(db: &Db) -> Result<i32> {
    let value: Option<String> = on_pool!(db, |p, q| {
        sqlx::query_scalar(q.outbox_lanes).fetch_optional(p).await
    })
    .map_err(|e| Error::NotMigrated(format!("cannot read ferry_settings ({e})")))?;
    value
        .and_then(|v| v.parse::<i32>().ok())
        .filter(|n| *n > 0)
        .ok_or_else(|| Error::NotMigrated("ferry_settings.outbox_lanes is missing or not a positive integer".into()))
}

/// Writes one validated outbox row; returns its id. With `key_lock`, same
/// `(topic, key)` writers wait for each other from before the id is drawn
/// until commit (`insert_outbox_key_locked`).
pub(crate) async fn insert(
    ferry: &Ferry,
    conn: Conn<'_>,
    msg: &OutboxMessage,
    now: Option<i64>,
    key_lock: bool,
) -> Result<i64> {
    // The last guard for rows Ferry builds itself (run events): nothing is
    // written that the relay could never publish.
    msg.fits_a_record(ferry.limits())?;
    let lane = lane_for(&msg.key, ferry.lanes());
    let id = on_conn!(conn, |c, q| {
        sqlx::query_scalar(if key_lock {
            q.insert_outbox_key_locked
        } else {
            q.insert_outbox
        })
        .bind(&msg.tenant)
        .bind(&msg.topic)
        .bind(&msg.key)
        .bind(lane)
        .bind(&msg.payload)
        .bind(Json(&msg.headers))
        .bind(&msg.effect_key)
        .bind(&msg.traceparent)
        .bind(now)
        .fetch_one(&mut *c)
        .await?
    });
    Ok(id)
}

/// The effect key a row is published under (`ferry-effect-key`), from the
/// parts of an outbox row: its tenant, the writer's effect key and its id.
/// Unambiguous across databases and tenants:
/// - the writer's key, scoped by tenant: `<tenant>/<effect_key>` (a tenant
///   never contains `/`, so the first `/` ends it);
/// - otherwise `<database_id>:<outbox id>` (no `/`, so it never equals a
///   writer's key); `None` without a database id.
///
/// The relay stamps it on every record; the console shows it in a run's
/// lineage.
pub fn effect_key_of(tenant: &str, writer_key: Option<&str>, id: i64, database_id: Option<&str>) -> Option<String> {
    match (writer_key, database_id) {
        (Some(key), _) => Some(format!("{tenant}/{key}")),
        (None, Some(db)) => Some(format!("{db}:{id}")),
        (None, None) => None,
    }
}

impl Ferry {
    /// Enqueues `msg` inside the caller's transaction; it is published only if
    /// that transaction commits. Returns the outbox id.
    ///
    /// Messages of one `(topic, key)` are published in commit order whoever
    /// writes them: on PostgreSQL this takes a transaction-scoped advisory
    /// lock on the pair before the row gets its id, so a second transaction
    /// enqueueing the same key waits until this one commits or rolls back
    /// (turn it off with `FerryBuilder::outbox_key_locks(false)` only when
    /// your writers already serialize per key). A transaction that enqueues
    /// several keys while another enqueues them in another order can
    /// deadlock (PostgreSQL aborts one with `40P01`): enqueue keys in a
    /// consistent order, or retry.
    pub async fn enqueue_in<'c>(&self, conn: impl Into<Conn<'c>>, msg: &OutboxMessage) -> Result<i64> {
        let mut conn: Conn<'c> = conn.into().routed(self.db());
        msg.validate(self.limits())?;
        // Carry the caller's trace to consumers unless the message has its own.
        let traced;
        let msg = match (&msg.traceparent, crate::telemetry::current_traceparent()) {
            (None, Some(tp)) => {
                traced = OutboxMessage {
                    traceparent: Some(tp),
                    ..msg.clone()
                };
                &traced
            }
            _ => msg,
        };
        let id = insert(self, conn.reborrow(), msg, self.now(), self.inner.outbox_key_locks).await?;
        self.inner.notifier.wake(conn, OUTBOX_PAYLOAD).await?;
        Ok(id)
    }

    /// Enqueues `msg` in its own transaction.
    pub async fn enqueue(&self, msg: &OutboxMessage) -> Result<i64> {
        msg.validate(self.limits())?;
        let mut tx = self.begin().await?;
        let result = self.enqueue_in(tx.conn(), msg).await;
        tx.finish(result).await
    }
}

impl Ferry {
    /// This database's identity: a UUID generated once by the migration
    /// (`ferry_settings.database_id`). The relay loads it at startup and
    /// publishes default effect keys as `<database_id>:<outbox id>`, so
    /// outbox ids reused by another database never collide in a consumer
    /// group's ledger. [`Error::NotMigrated`] when the migration that creates it
    /// has not run.
    pub async fn database_id(&self) -> Result<String> {
        let value: Option<String> = on_pool!(self.db(), |p, q| {
            sqlx::query_scalar(q.database_id).fetch_optional(p).await?
        });
        value
            .filter(|v| !v.is_empty())
            .ok_or_else(|| Error::NotMigrated("ferry_settings.database_id is missing".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn murmur2_matches_the_java_client() {
        // Reference values from Kafka's `Utils.murmur2` (clients UtilsTest).
        assert_eq!(murmur2(b"21"), -973_932_308);
        assert_eq!(murmur2(b"foobar"), -790_332_482);
        assert_eq!(murmur2(b"a-little-bit-long-string"), -985_981_536);
        assert_eq!(murmur2(b"a-little-bit-longer-string"), -1_486_304_829);
        assert_eq!(
            murmur2(b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8"),
            -58_897_971
        );
        assert_eq!(murmur2(b"abc"), 479_470_107);
    }

    #[test]
    fn lanes_are_in_range_and_stable() {
        for k in ["a", "order-1", "order-2", ""] {
            let l = lane_for(k, 64);
            assert!((0..64).contains(&l));
            assert_eq!(l, lane_for(k, 64));
        }
    }

    #[test]
    fn traceparent_shape() {
        assert!(validate_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").is_ok());
        assert!(validate_traceparent("00-xyz-00f067aa0ba902b7-01").is_err());
    }
}
