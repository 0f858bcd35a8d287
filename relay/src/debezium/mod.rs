//! Debezium outbox compatibility (`--debezium-config`): WAL capture of an
//! existing table in Debezium's outbox layout (`id`, `aggregatetype`,
//! `aggregateid`, `type`, `payload`, …), each insert turned into the record
//! Debezium 3.6.1's outbox `EventRouter` makes of it, with the converters
//! the connector names: the same topic, key, value bytes and headers, so a
//! consumer cannot tell which of the two published it.
//!
//! The settings are read from the connector's own configuration file
//! (`config`): the `EventRouter` transform's options, the table, the
//! converters. What Ferry does not reproduce byte for byte is refused when
//! the relay starts (a typed configuration error naming the option), and a
//! row it cannot render (`Unsupported`) stops WAL capture at that row with
//! the reason in the log, `ferry_relay_wal_sessions_ended_total{code=
//! "unsupported_event"}` and the relay unready, as a Kafka Connect task
//! fails on a record its converter refuses: nothing is skipped, no other
//! bytes are published, and nothing is retried until an operator changes
//! the configuration and restarts the relay.
//!
//! A row's columns arrive as `pgoutput` text with their type ids; each
//! becomes the value Debezium's PostgreSQL connector gives it ([`Value`]:
//! `uuid`, text, `json`/`jsonb` and `timestamptz` as strings, integers,
//! `bool`, `bytea` as bytes, `timestamp` as microseconds).

use std::fmt;

mod config;
pub(crate) mod json;

pub use config::{EventRouter, Layout};

/// Why a row cannot be rendered as Debezium would render it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unsupported(pub String);

impl fmt::Display for Unsupported {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "not rendered as Debezium would render it: {}", self.0)
    }
}

/// A column's value as the EventRouter sees it (a Kafka Connect value).
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// SQL `NULL` (an optional field without a value).
    Null,
    /// `STRING`.
    Text(String),
    /// `INT16`/`INT32`/`INT64` (and `MicroTimestamp`).
    Int(i64),
    /// `FLOAT64` (an expanded JSON payload's fractions).
    Double(f64),
    /// `BOOLEAN`.
    Bool(bool),
    /// `BYTES`.
    Bytes(Vec<u8>),
    /// `STRUCT`: fields in schema order.
    Struct(Vec<(String, Value)>),
    /// `ARRAY`.
    Array(Vec<Value>),
}

/// One record as the EventRouter and the converters make it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The routed topic.
    pub topic: String,
    /// The key converter's bytes (`None`: a null key).
    pub key: Option<Vec<u8>>,
    /// The value converter's bytes (`None`: a tombstone).
    pub value: Option<Vec<u8>>,
    /// Headers in order: name and the header converter's bytes.
    pub headers: Vec<(String, Option<Vec<u8>>)>,
    /// The record's timestamp (ms), from `table.field.event.timestamp`;
    /// `None`: the producer's clock (Debezium's is its processing time).
    pub timestamp: Option<i64>,
}

/// PostgreSQL type ids the decoder reads (`pg_type.oid`, fixed for
/// built-in types).
pub(crate) mod oid {
    pub const BOOL: u32 = 16;
    pub const BYTEA: u32 = 17;
    pub const INT8: u32 = 20;
    pub const INT2: u32 = 21;
    pub const INT4: u32 = 23;
    pub const TEXT: u32 = 25;
    pub const JSON: u32 = 114;
    pub const BPCHAR: u32 = 1042;
    pub const VARCHAR: u32 = 1043;
    pub const TIMESTAMP: u32 = 1114;
    pub const TIMESTAMPTZ: u32 = 1184;
    pub const UUID: u32 = 2950;
    pub const JSONB: u32 = 3802;
}

/// A column of a Debezium-layout table as a `Relation` message lists it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ColumnType {
    /// `pg_type.oid`.
    pub oid: u32,
    /// `atttypmod` (-1: none): a `timestamptz`'s fractional digits.
    pub modifier: i32,
}

/// A column's `pgoutput` text as the value Debezium's PostgreSQL connector
/// gives it (default `time.precision.mode` and `binary.handling.mode`).
pub fn column(ty: ColumnType, text: Option<&[u8]>) -> Result<Value, Unsupported> {
    let type_oid = ty.oid;
    let Some(raw) = text else { return Ok(Value::Null) };
    let s = std::str::from_utf8(raw).map_err(|_| Unsupported("a column that is not UTF-8".into()))?;
    let bad = |what: &str| Unsupported(format!("a {what} column whose text is {s:?}"));
    Ok(match type_oid {
        oid::BOOL => Value::Bool(match s {
            "t" => true,
            "f" => false,
            _ => return Err(bad("bool")),
        }),
        oid::INT2 | oid::INT4 | oid::INT8 => Value::Int(s.parse().map_err(|_| bad("integer"))?),
        oid::TEXT | oid::VARCHAR | oid::BPCHAR | oid::UUID | oid::JSON | oid::JSONB => Value::Text(s.to_owned()),
        oid::BYTEA => Value::Bytes(
            s.strip_prefix("\\x")
                .and_then(|h| crate::wal::unhex(h.as_bytes()))
                .ok_or_else(|| bad("bytea"))?,
        ),
        // `Timestamp` (ms) for up to 3 fractional digits, else
        // `MicroTimestamp` (adaptive precision).
        oid::TIMESTAMP => {
            let us = timestamp_us(s, false).ok_or_else(|| bad("timestamp"))?;
            Value::Int(if (0..=3).contains(&ty.modifier) {
                us.div_euclid(1000)
            } else {
                us
            })
        }
        oid::TIMESTAMPTZ => {
            let digits = if ty.modifier >= 0 { ty.modifier } else { 6 };
            Value::Text(zoned(timestamp_us(s, true).ok_or_else(|| bad("timestamptz"))?, digits))
        }
        other => return Err(Unsupported(format!("a column of type id {other}"))),
    })
}

/// Whether the decoder reads columns of this type.
pub fn readable(type_oid: u32) -> bool {
    matches!(
        type_oid,
        oid::BOOL
            | oid::BYTEA
            | oid::INT2
            | oid::INT4
            | oid::INT8
            | oid::TEXT
            | oid::VARCHAR
            | oid::BPCHAR
            | oid::UUID
            | oid::JSON
            | oid::JSONB
            | oid::TIMESTAMP
            | oid::TIMESTAMPTZ
    )
}

/// µs since the Unix epoch of PostgreSQL's ISO output (`DateStyle=ISO`,
/// `TimeZone=UTC` on the replication session): `2026-12-05
/// 07:54:07.123456` and, with a zone, `+00` (or `+05:30`).
fn timestamp_us(s: &str, zoned: bool) -> Option<i64> {
    let (date, rest) = s.split_once(' ')?;
    let (time, offset_s) = if zoned {
        let at = rest.rfind(['+', '-'])?;
        let (t, o) = rest.split_at(at);
        let sign = if o.starts_with('-') { -1 } else { 1 };
        let mut parts = o[1..].split(':').map(|p| p.parse::<i64>().ok());
        let h = parts.next()??;
        let m = parts.next().unwrap_or(Some(0))?;
        let sec = parts.next().unwrap_or(Some(0))?;
        (t, sign * (h * 3600 + m * 60 + sec))
    } else {
        (rest, 0)
    };
    let mut d = date.split('-');
    let (y, mo, da) = (
        d.next()?.parse::<i64>().ok()?,
        d.next()?.parse::<i64>().ok()?,
        d.next()?.parse::<i64>().ok()?,
    );
    let (hms, frac) = time.split_once('.').unwrap_or((time, ""));
    let mut t = hms.split(':');
    let (h, mi, se) = (
        t.next()?.parse::<i64>().ok()?,
        t.next()?.parse::<i64>().ok()?,
        t.next()?.parse::<i64>().ok()?,
    );
    if frac.len() > 6 || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let micros: i64 = if frac.is_empty() {
        0
    } else {
        format!("{frac:0<6}").parse().ok()?
    };
    let days = days_from_civil(y, mo, da);
    Some(((days * 86_400 + h * 3600 + mi * 60 + se) - offset_s) * 1_000_000 + micros)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's
/// algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The civil date of a day count since 1970-01-01.
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (if m <= 2 { yoe + era * 400 + 1 } else { yoe + era * 400 }, m, d)
}

/// Debezium's `ZonedTimestamp` of a `timestamptz`: ISO-8601 in UTC with as
/// many fractional digits as the column has (`timestamptz` is 6:
/// `2026-12-05T07:54:07.120000Z`; `timestamptz(0)` none).
fn zoned(us: i64, digits: i32) -> String {
    let (days, rem) = (us.div_euclid(86_400_000_000), us.rem_euclid(86_400_000_000));
    let (y, m, d) = civil_from_days(days);
    let secs = rem / 1_000_000;
    let micros = rem % 1_000_000;
    let mut s = format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    );
    if digits > 0 {
        let frac = format!("{micros:06}");
        s.push('.');
        s.push_str(&frac[..usize::try_from(digits.min(6)).unwrap_or(6)]);
    }
    s.push('Z');
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_read_as_debezium_reads_them() {
        let column = |oid: u32, text: Option<&[u8]>| column(ColumnType { oid, modifier: -1 }, text);
        assert_eq!(column(oid::UUID, Some(b"3f1c")).unwrap(), Value::Text("3f1c".into()));
        assert_eq!(column(oid::INT4, Some(b"-7")).unwrap(), Value::Int(-7));
        assert_eq!(column(oid::BOOL, Some(b"t")).unwrap(), Value::Bool(true));
        assert_eq!(
            column(oid::BYTEA, Some(b"\\x6869")).unwrap(),
            Value::Bytes(b"hi".to_vec())
        );
        assert_eq!(column(oid::TEXT, None).unwrap(), Value::Null);
        assert_eq!(
            column(oid::TIMESTAMP, Some(b"1970-01-02 00:00:01.5")).unwrap(),
            Value::Int(86_401_500_000)
        );
        assert_eq!(
            column(oid::TIMESTAMPTZ, Some(b"2026-12-05 09:54:07.120000+02")).unwrap(),
            Value::Text("2026-12-05T07:54:07.120000Z".into())
        );
        assert_eq!(
            column(oid::TIMESTAMPTZ, Some(b"2024-02-29 00:00:00+00")).unwrap(),
            Value::Text("2024-02-29T00:00:00.000000Z".into())
        );
        let precise = |m: i32| {
            super::column(
                ColumnType {
                    oid: oid::TIMESTAMPTZ,
                    modifier: m,
                },
                Some(b"2024-02-29 00:00:00.5+00"),
            )
        };
        assert_eq!(precise(3).unwrap(), Value::Text("2024-02-29T00:00:00.500Z".into()));
        assert_eq!(precise(0).unwrap(), Value::Text("2024-02-29T00:00:00Z".into()));
        assert!(column(1700, Some(b"1.5")).is_err(), "numeric is not read");
    }
}
