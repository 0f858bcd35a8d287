//! How large a caller's JSON document may be: the run event that carries it
//! to Kafka must fit the publish limit, so the bound is the limit minus the
//! largest envelope Ferry builds around a document. It lives beside the
//! events because it is measured with the code that builds them; the other
//! input limits know nothing of runs.

use crate::error::Result;
use crate::limits::Limits;

impl Limits {
    /// A JSON document stored as JSON (a command, a result, an event body):
    /// at most [`Limits::max_document_bytes`] when serialized, and no NUL in
    /// any string or object key at any depth (see [`Limits::no_nul`]).
    pub fn json(&self, field: &'static str, v: &serde_json::Value) -> Result<()> {
        self.json_within(field, v, self.max_document_bytes())
    }

    /// The largest JSON document (command, result or event body) accepted:
    /// the smaller of [`Limits::max_payload_bytes`] and
    /// [`Limits::max_publish_bytes`] minus [`Limits::run_event_overhead`].
    /// With the default limits this is 998,272 bytes (an overhead of 1,728).
    pub fn max_document_bytes(&self) -> usize {
        self.max_payload_bytes
            .min(self.max_publish_bytes.saturating_sub(self.run_event_overhead()))
    }

    /// An upper bound on the bytes a run event's Kafka record adds around the
    /// caller's JSON document, computed from these limits rather than
    /// measured on one event, so it holds for every event:
    /// the 36 bytes of record framing; the key (a run id, 36 bytes); the
    /// largest value with an empty document, built by the same code that
    /// builds events (the envelope with the longest tenant and kind, 20-digit
    /// seq and instant, and the largest wrapper Ferry puts around a caller's
    /// document, `run_queued`'s, with the longest operation and queue, a
    /// `replay_of`, a `parent_run_id` and a `scheduled_at`); and every header with its two length varints counted at
    /// 5 bytes each (`content-type`, `ferry-event-kind`, and the relay's
    /// `ferry-outbox-id`, `ferry-tenant`, `ferry-effect-key`, `traceparent`
    /// at their longest). Names are `[A-Za-z0-9._:-]`, which JSON never
    /// escapes, and a document serializes to the same bytes inside the
    /// envelope as alone.
    pub fn run_event_overhead(&self) -> usize {
        let tenant = "t".repeat(self.max_tenant_bytes);
        let name = "n".repeat(self.max_name_bytes);
        let run_id = uuid::Uuid::max();
        let mut largest = super::NewRun::new(&*tenant, &*name, "k", serde_json::Value::Null)
            .queue(&*name)
            .schema_version(u32::MAX)
            .parent(run_id);
        largest.replay_of = Some(run_id);
        let body = super::queued_body(&largest, Some(i64::MIN));
        let value_len = super::event_payload(&tenant, run_id, i64::MIN, &name, i64::MIN, &body).map_or(0, |v| v.len())
            - "null".len();
        let effect_key = tenant.len() + 1 + 36 + 1 + 20;
        crate::limits::RECORD_FRAMING
            + 36
            + value_len
            + crate::limits::header_bytes("content-type", "application/json".len())
            + crate::limits::header_bytes("ferry-event-kind", self.max_name_bytes)
            + crate::limits::relay_header_bytes(self.max_tenant_bytes, Some(effect_key), true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_leave_room_for_the_run_event_around_them() {
        let l = Limits::default();
        assert_eq!(l.max_document_bytes(), 1_000_000 - l.run_event_overhead());
        assert!(l.run_event_overhead() < 2_000, "{}", l.run_event_overhead());
        let doc = |len: usize| serde_json::json!({ "b": "x".repeat(len - 8) });
        assert!(l.json("command", &doc(l.max_document_bytes())).is_ok());
        assert_eq!(
            l.json("command", &doc(l.max_document_bytes() + 1)).unwrap_err().code(),
            "invalid_input"
        );
        let small = Limits {
            max_payload_bytes: 1000,
            ..Limits::default()
        };
        assert_eq!(small.max_document_bytes(), 1000, "the stored limit still applies");
    }
}
