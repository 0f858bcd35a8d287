//! Input limits and validation. Everything a caller passes is checked here
//! before a single statement runs, so invalid input writes nothing.

use std::time::Duration;

use crate::error::{Error, Result};

/// Configurable bounds on caller input.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Longest idempotency key, in bytes (keys are visible ASCII). Default 255.
    pub max_key_bytes: usize,
    /// Longest tenant name. Default 128.
    pub max_tenant_bytes: usize,
    /// Longest operation, queue, step or kind name. Default 128.
    pub max_name_bytes: usize,
    /// Largest request or outbox payload stored, in bytes. Default 1 MiB.
    /// Anything Ferry publishes is also held to [`Limits::max_publish_bytes`]:
    /// a JSON document (command, result, event body) to
    /// [`Limits::max_document_bytes`], an outbox message to its whole record.
    pub max_payload_bytes: usize,
    /// Largest Kafka record the relay may have to publish, in bytes, counted
    /// as librdkafka counts a message against the producer's
    /// `message.max.bytes`: key + value + headers (each with two length
    /// varints) + 36 bytes of record framing, headers the relay adds
    /// included. Default 1,000,000, librdkafka's default (brokers and topics
    /// accept 1,048,588 by default). A row larger than this could never be
    /// published, so it is refused as `invalid_input` before anything is
    /// written. Raise it only together with the relay's
    /// `--kafka message.max.bytes=…` and the topics' `max.message.bytes`.
    pub max_publish_bytes: usize,
    /// Most headers on one outbox message. Default 64.
    pub max_headers: usize,
    /// How long an idempotency record lives. Default 24 hours.
    pub idempotency_ttl: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_key_bytes: 255,
            max_tenant_bytes: 128,
            max_name_bytes: 128,
            max_payload_bytes: 1024 * 1024,
            max_publish_bytes: 1_000_000,
            max_headers: 64,
            idempotency_ttl: Duration::from_secs(24 * 3600),
        }
    }
}

impl Limits {
    /// A tenant: 1..=max bytes of `[A-Za-z0-9._:-]`.
    pub fn tenant(&self, v: &str) -> Result<()> {
        name("tenant", v, self.max_tenant_bytes)
    }

    /// An operation, queue, step or event kind: 1..=max bytes of `[A-Za-z0-9._:-]`.
    pub fn name(&self, field: &'static str, v: &str) -> Result<()> {
        name(field, v, self.max_name_bytes)
    }

    /// An idempotency key: 1..=max bytes of visible ASCII (0x21..=0x7e).
    /// The message never echoes the key.
    pub fn idempotency_key(&self, v: &str) -> Result<()> {
        if v.is_empty() || v.len() > self.max_key_bytes {
            return Err(Error::invalid(
                "idempotency_key",
                format!("must be 1 to {} bytes", self.max_key_bytes),
            ));
        }
        if !v.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
            return Err(Error::invalid("idempotency_key", "must be visible ASCII"));
        }
        Ok(())
    }

    /// Free text such as an operator's identity or a reason: 1..=`max`
    /// bytes, no control characters.
    pub fn text(&self, field: &'static str, v: &str, max: usize) -> Result<()> {
        if v.is_empty() || v.len() > max || v.chars().any(char::is_control) {
            return Err(Error::invalid(
                field,
                format!("must be 1 to {max} bytes without control characters"),
            ));
        }
        Ok(())
    }

    /// Text stored as is (an outbox key or header, an effect key, a
    /// provider reference): no NUL (`\u{0}`), which PostgreSQL cannot store
    /// in text or JSON. Refused on every engine, so both behave alike and the
    /// caller gets `invalid_input` instead of a database error.
    pub fn no_nul(&self, field: &'static str, v: &str) -> Result<()> {
        if v.contains('\0') {
            return Err(Error::invalid(field, "must not contain NUL (\\u0000)"));
        }
        Ok(())
    }

    /// [`Limits::json`] with [`Limits::max_document_bytes`] computed once by
    /// the caller (it serializes a whole envelope).
    pub(crate) fn json_within(&self, field: &'static str, v: &serde_json::Value, max: usize) -> Result<()> {
        // Counted as it is written, without keeping the bytes.
        struct Count(usize);
        impl std::io::Write for Count {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0 += b.len();
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let mut count = Count(0);
        let size = serde_json::to_writer(&mut count, v).map_or(usize::MAX, |()| count.0);
        if size > max {
            return Err(Error::invalid(
                field,
                format!(
                    "is {size} bytes; the limit is {max} (its run event must fit a {}-byte Kafka record)",
                    self.max_publish_bytes
                ),
            ));
        }
        // Iterative, so a deeply nested document cannot overflow the stack.
        let mut pending = vec![v];
        while let Some(v) = pending.pop() {
            match v {
                serde_json::Value::String(s) => self.no_nul(field, s)?,
                serde_json::Value::Array(items) => pending.extend(items),
                serde_json::Value::Object(map) => {
                    for (k, item) in map {
                        self.no_nul(field, k)?;
                        pending.push(item);
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// A payload size.
    pub fn payload(&self, field: &'static str, len: usize) -> Result<()> {
        if len > self.max_payload_bytes {
            return Err(Error::invalid(
                field,
                format!("is {len} bytes; the limit is {}", self.max_payload_bytes),
            ));
        }
        Ok(())
    }

    /// A Kafka topic name: 1..=249 bytes of `[A-Za-z0-9._-]`, not `.` or `..`.
    pub fn topic(&self, v: &str) -> Result<()> {
        let ok = !v.is_empty()
            && v.len() <= 249
            && v != "."
            && v != ".."
            && v.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-');
        if ok {
            Ok(())
        } else {
            Err(Error::invalid("topic", "must be 1 to 249 bytes of [A-Za-z0-9._-]"))
        }
    }
}

/// librdkafka's largest per-record framing (`RD_KAFKAP_MESSAGE_V2_MAX_OVERHEAD`):
/// length, attributes, timestamp delta, offset delta, key length, value
/// length and header count, each varint at its widest.
pub(crate) const RECORD_FRAMING: usize = 36;

/// One record header as librdkafka counts it: name, value, and a length
/// varint for each, counted at their widest (5 bytes).
pub(crate) fn header_bytes(name: &str, value_len: usize) -> usize {
    10 + name.len() + value_len
}

/// The headers the relay adds to every record (`relay/src/publish.rs`):
/// `ferry-outbox-id` (an i64, at most 20 digits), `ferry-tenant`,
/// `ferry-effect-key` (the row's scoped by tenant, `<tenant>/<key>`, else
/// `<database id>:<outbox id>`, a 36-byte UUID, `:` and up to 20 digits)
/// and, when the row has one, `traceparent` (55 bytes).
pub(crate) fn relay_header_bytes(tenant_len: usize, effect_key_len: Option<usize>, traceparent: bool) -> usize {
    let effect_key = match effect_key_len {
        Some(n) => tenant_len + 1 + n,
        None => 36 + 1 + 20,
    };
    header_bytes("ferry-outbox-id", 20)
        + header_bytes("ferry-tenant", tenant_len)
        + header_bytes("ferry-effect-key", effect_key)
        + if traceparent {
            header_bytes("traceparent", 55)
        } else {
            0
        }
}

fn name(field: &'static str, v: &str, max: usize) -> Result<()> {
    if v.is_empty() || v.len() > max {
        return Err(Error::invalid(field, format!("must be 1 to {max} bytes")));
    }
    if !v
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
    {
        return Err(Error::invalid(field, "may only contain [A-Za-z0-9._:-]"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_visible_ascii_and_bounded() {
        let l = Limits::default();
        assert!(l.idempotency_key("abc-123_~").is_ok());
        for bad in ["", "has space", "tab\t", "é", &"k".repeat(256)] {
            let e = l.idempotency_key(bad).unwrap_err();
            assert_eq!(e.code(), "invalid_input");
            if !bad.is_empty() {
                assert!(!e.to_string().contains(bad), "error text must not echo the key");
            }
        }
        assert!(l.idempotency_key(&"k".repeat(255)).is_ok());
    }

    #[test]
    fn names_and_topics() {
        let l = Limits::default();
        assert!(l.tenant("acme-eu.1").is_ok());
        assert!(l.tenant("acme eu").is_err());
        assert!(l.name("queue", "").is_err());
        assert!(l.topic("ferry.run-events").is_ok());
        assert!(l.topic("bad/topic").is_err());
        assert!(l.payload("payload", 1024 * 1024 + 1).is_err());
    }

    #[test]
    fn nul_is_refused_in_text_and_at_any_json_depth() {
        let l = Limits::default();
        assert!(l.no_nul("key", "plain").is_ok());
        assert_eq!(l.no_nul("key", "a\0b").unwrap_err().code(), "invalid_input");
        assert!(l
            .json("command", &serde_json::json!({"a": [1, "x", {"b": null}]}))
            .is_ok());
        for bad in [
            serde_json::json!({"a": "x\u{0}"}),
            serde_json::json!({"a\u{0}": 1}),
            serde_json::json!([[[{"deep": ["\u{0}"]}]]]),
        ] {
            assert_eq!(l.json("command", &bad).unwrap_err().code(), "invalid_input");
        }
    }
}
