//! The checks behind `RelayConfig::validate`: topic
//! names (the injective escaping of a topic's parts, the `{tenant}`
//! template), slot and publication names, and the `--kafka` overrides that
//! would weaken delivery.

use crate::error::RelayError;

/// Kafka's longest topic name.
pub(super) const MAX_TOPIC_NAME: usize = 249;

/// The injective escaping of a topic-name part (see `RelayConfig::route`).
pub(super) fn escape_part(part: &str) -> String {
    let mut out = String::with_capacity(part.len());
    for b in part.bytes() {
        match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' => out.push(b as char),
            b'-' => out.push_str("--"),
            b'.' => out.push_str("-d"),
            b'_' => out.push_str("-u"),
            b':' => out.push_str("-c"),
            other => out.push_str(&format!("-x{other:02x}")),
        }
    }
    out
}

/// A `{tenant}` template must separate its placeholders with text holding a
/// `.` (which escaped parts never contain), and use only characters Kafka
/// allows in topic names.
pub(super) fn check_template(t: &str) -> Result<(), RelayError> {
    let literal = t.replace("{topic}", "\u{0}").replace("{tenant}", "\u{0}");
    if literal.contains('{') || literal.contains('}') {
        return Err(RelayError::Config(
            "topic template may only use {topic} and {tenant}".into(),
        ));
    }
    if literal
        .chars()
        .any(|c| c != '\u{0}' && !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(RelayError::Config(format!(
            "topic template {t:?} has characters Kafka refuses in topic names (allowed: letters, digits, '.', '_', '-')"
        )));
    }
    if t.contains("{tenant}") {
        let between: Vec<&str> = literal.split('\u{0}').collect();
        let inner = &between[1..between.len() - 1];
        if inner.iter().any(|sep| !sep.contains('.')) {
            return Err(RelayError::Config(format!(
                "topic template {t:?}: with {{tenant}}, placeholders must be separated by text containing '.', or two (topic, tenant) pairs could share a topic"
            )));
        }
    }
    Ok(())
}

/// A slot or publication name: what PostgreSQL allows in a slot name
/// (lowercase letters, digits, `_`, at most 63 bytes), which also makes it
/// an identifier that needs no quoting in the publication's DDL.
pub fn check_identifier(what: &str, name: &str) -> Result<(), RelayError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(RelayError::Config(format!(
            "{what} {name:?}: use 1 to 63 lowercase letters, digits and '_'"
        )))
    }
}

/// Refuses an override that would let Kafka lose or reorder acknowledged
/// records: the relay marks a row delivered on acknowledgement, so the
/// acknowledgement must mean "on every in-sync replica, in order, once".
/// At least once, a finite message timeout is refused too: a record that
/// times out lets the ones behind it overtake it (see
/// [`crate::publish::producer_config`]).
pub(super) fn weakens_delivery(key: &str, value: &str, exactly_once: bool) -> Result<(), RelayError> {
    let v = value.trim().to_ascii_lowercase();
    let refused = match key.trim() {
        "acks" | "request.required.acks" => !matches!(v.as_str(), "all" | "-1"),
        "enable.idempotence" => v != "true",
        "max.in.flight" | "max.in.flight.requests.per.connection" => v.parse::<u32>().map_or(true, |n| n > 5),
        "transactional.id" => true,
        "message.timeout.ms" | "delivery.timeout.ms" => !exactly_once && v != "0",
        // Per-key order needs keys where Java clients put them.
        "partitioner" => v != "murmur2_random",
        _ => false,
    };
    if refused {
        return Err(RelayError::Config(format!(
            "--kafka {key}={value} would weaken delivery: the relay needs acks=all, enable.idempotence=true, at most 5 in-flight requests, the murmur2_random partitioner and (at least once) message.timeout.ms=0, so a record is retried until acknowledged and never overtaken, and sets transactional.id itself (--exactly-once)"
        )));
    }
    Ok(())
}
