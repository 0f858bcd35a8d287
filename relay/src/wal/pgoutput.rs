//! Decoding the `pgoutput` messages (protocol version 1) that carry outbox
//! rows: `Relation` (the columns of a table, sent before its first row and
//! after any change to it) and `Insert` (one row, as text): Ferry's
//! `outbox`, or with `--debezium-config` a table in Debezium's outbox
//! layout, whose rows become the EventRouter's records (`crate::debezium`). Begin and Commit
//! are decoded by the replication client; `Type` and `Origin` carry nothing
//! the relay needs; the publication publishes inserts only, so `Update`,
//! `Delete` and `Truncate` are skipped should an operator widen it. Any
//! other tag is an error: the relay never guesses at a message it does not
//! know.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::debezium::{self, EventRouter};
use crate::store::PendingRow;

/// A message the relay cannot read: the stream is restarted (and the
/// failure logged), never skipped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("pgoutput: {0}")]
pub struct DecodeError(pub String);

fn err<T>(what: impl Into<String>) -> Result<T, DecodeError> {
    Err(DecodeError(what.into()))
}

/// One decoded message.
#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    /// A pending outbox row, inserted by a committed transaction.
    Row(Box<PendingRow>),
    /// A row of a Debezium-layout outbox, as the EventRouter's record.
    Event(Box<debezium::Event>),
    /// A row of a Debezium-layout outbox that cannot be rendered as
    /// Debezium would render it, and why.
    Unrenderable(String),
    /// An insert the relay does not publish: a row of another table, or one
    /// inserted in a state other than `pending`.
    Ignored,
    /// A relation (table layout) was recorded.
    Relation,
}

/// A table announced on the stream, by relation id: for this schema's
/// `outbox`, where each column the relay reads sits in a tuple, resolved
/// once per `Relation` message instead of by name for every row (or why
/// it cannot be read, reported at its first insert).
#[derive(Debug, Clone)]
enum Relation {
    Outbox(Result<Layout, DecodeError>),
    Debezium(Arc<EventRouter>, Result<debezium::Layout, debezium::Unsupported>),
    Other,
}

/// Positions of the columns the relay reads in an outbox tuple, and the
/// tuple's width.
#[derive(Debug, Clone, Copy)]
struct Layout {
    width: usize,
    id: usize,
    tenant: usize,
    topic: usize,
    key: usize,
    payload: usize,
    headers: usize,
    effect_key: usize,
    traceparent: usize,
    created_at: usize,
    state: usize,
}

impl Layout {
    fn of(columns: &[String]) -> Result<Layout, DecodeError> {
        let at = |name: &str| {
            columns
                .iter()
                .position(|c| c == name)
                .ok_or_else(|| DecodeError(format!("outbox has no column {name}")))
        };
        Ok(Layout {
            width: columns.len(),
            id: at("id")?,
            tenant: at("tenant")?,
            topic: at("topic")?,
            key: at("key")?,
            payload: at("payload")?,
            headers: at("headers")?,
            effect_key: at("effect_key")?,
            traceparent: at("traceparent")?,
            created_at: at("created_at")?,
            state: at("state")?,
        })
    }
}

/// The decoder's state: the relations announced on this stream.
#[derive(Debug, Default)]
pub struct Decoder {
    relations: HashMap<u32, Relation>,
    /// The schema whose `outbox` is ours.
    schema: String,
    /// With `--debezium-config`: the table and router whose rows are
    /// decoded instead.
    router: Option<Arc<EventRouter>>,
}

impl Decoder {
    /// A decoder for the `outbox` table of `schema`, or with `router`, for
    /// the router's table.
    pub fn new(schema: impl Into<String>, router: Option<Arc<EventRouter>>) -> Self {
        Decoder {
            relations: HashMap::new(),
            schema: schema.into(),
            router,
        }
    }

    /// Decodes one `XLogData` payload (not Begin or Commit).
    pub fn decode(&mut self, data: &[u8]) -> Result<Message, DecodeError> {
        let mut r = Reader(data);
        match r.u8()? {
            b'R' => {
                let id = r.u32()?;
                let namespace = r.cstr()?;
                let name = r.cstr()?;
                let _replica_identity = r.u8()?;
                let n = r.u16()?;
                let mut columns = Vec::with_capacity(usize::from(n));
                for _ in 0..n {
                    let _flags = r.u8()?;
                    let column = r.cstr()?;
                    let oid = r.u32()?;
                    let modifier = r.u32()? as i32;
                    columns.push((column, debezium::ColumnType { oid, modifier }));
                }
                let relation = match &self.router {
                    Some(router) if name == router.table && namespace == router.schema => {
                        Relation::Debezium(router.clone(), router.layout(&columns))
                    }
                    Some(_) => Relation::Other,
                    None if name == "outbox" && namespace == self.schema => {
                        let names: Vec<String> = columns.into_iter().map(|(c, _)| c).collect();
                        Relation::Outbox(Layout::of(&names))
                    }
                    None => Relation::Other,
                };
                self.relations.insert(id, relation);
                Ok(Message::Relation)
            }
            b'I' => {
                let id = r.u32()?;
                if r.u8()? != b'N' {
                    return err("insert without a new tuple");
                }
                let layout = match self.relations.get(&id) {
                    None => return err(format!("insert into relation {id} before its Relation message")),
                    Some(Relation::Other) => return Ok(Message::Ignored),
                    Some(Relation::Outbox(layout)) => layout.clone()?,
                    Some(Relation::Debezium(router, layout)) => {
                        let layout = match layout {
                            Ok(l) => l,
                            Err(e) => return Ok(Message::Unrenderable(e.to_string())),
                        };
                        let values = r.tuple()?;
                        return Ok(match router.event(layout, &values) {
                            Ok(e) => Message::Event(Box::new(e)),
                            Err(e) => Message::Unrenderable(e.to_string()),
                        });
                    }
                };
                let values = r.tuple()?;
                if values.len() != layout.width {
                    return err("tuple and relation disagree on the column count");
                }
                outbox_row(&layout, &values)
            }
            // A type's name (sent before a row of a non-built-in type) and a
            // replication origin: nothing the relay publishes.
            b'Y' | b'O' => Ok(Message::Ignored),
            // The publication is inserts only: these appear only if an
            // operator widened it, and are never published.
            b'U' | b'D' | b'T' => Ok(Message::Ignored),
            other => err(format!("unknown message {:?}", char::from(other))),
        }
    }
}

/// An outbox row from its text-format columns, found by `layout`.
fn outbox_row(layout: &Layout, row: &[Option<&[u8]>]) -> Result<Message, DecodeError> {
    let text = |at: usize, name: &str| -> Result<Option<&str>, DecodeError> {
        row[at]
            .map(|v| std::str::from_utf8(v).map_err(|_| DecodeError(format!("column {name} is not UTF-8"))))
            .transpose()
    };
    let required = |at: usize, name: &str| -> Result<&str, DecodeError> {
        text(at, name)?.ok_or_else(|| DecodeError(format!("column {name} is NULL")))
    };
    if required(layout.state, "state")? != "pending" {
        return Ok(Message::Ignored);
    }
    let number = |at: usize, name: &str| -> Result<i64, DecodeError> {
        required(at, name)?
            .parse()
            .map_err(|_| DecodeError(format!("column {name} is not a number")))
    };
    let headers: BTreeMap<String, String> = serde_json::from_str(required(layout.headers, "headers")?)
        .map_err(|_| DecodeError("column headers is not a JSON object of strings".into()))?;
    let created_at = ferry::Millis::new(number(layout.created_at, "created_at")?)
        .map_err(|_| DecodeError("column created_at is negative".into()))?;
    Ok(Message::Row(Box::new(PendingRow {
        id: number(layout.id, "id")?,
        tenant: required(layout.tenant, "tenant")?.to_owned(),
        topic: required(layout.topic, "topic")?.to_owned(),
        key: required(layout.key, "key")?.to_owned(),
        payload: bytea(required(layout.payload, "payload")?)?,
        headers,
        effect_key: text(layout.effect_key, "effect_key")?.map(str::to_owned),
        traceparent: text(layout.traceparent, "traceparent")?.map(str::to_owned),
        created_at,
    })))
}

/// A `bytea` in PostgreSQL's hex output (`\x0a1b…`; the replication
/// session sets `bytea_output = hex`).
fn bytea(text: &str) -> Result<Vec<u8>, DecodeError> {
    let Some(hex) = text.strip_prefix("\\x") else {
        return err("payload is not in bytea hex format");
    };
    unhex(hex.as_bytes()).ok_or_else(|| DecodeError("payload has invalid hex".into()))
}

/// Hex digits to bytes in one pass (the `hex` crate's iterator-based
/// decoding cost ~8 % of the relay's CPU on 100 B rows); `None` for an odd
/// length or a character that is not a hex digit.
pub(crate) fn unhex(hex: &[u8]) -> Option<Vec<u8>> {
    fn digit(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            b'A'..=b'F' => Some(c - b'A' + 10),
            _ => None,
        }
    }
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    let mut out = Vec::with_capacity(hex.len() / 2);
    for pair in hex.chunks_exact(2) {
        out.push(digit(pair[0])? << 4 | digit(pair[1])?);
    }
    Some(out)
}

/// A cursor over one message.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.0.len() < n {
            return err("message truncated");
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, DecodeError> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn cstr(&mut self) -> Result<String, DecodeError> {
        let Some(end) = self.0.iter().position(|b| *b == 0) else {
            return err("string without its terminator");
        };
        let s = String::from_utf8(self.take(end)?.to_vec()).map_err(|_| DecodeError("name is not UTF-8".into()))?;
        self.take(1)?;
        Ok(s)
    }

    /// TupleData: each column NULL, unchanged TOAST (never in an insert)
    /// or a length-prefixed value.
    fn tuple(&mut self) -> Result<Vec<Option<&'a [u8]>>, DecodeError> {
        let n = self.u16()?;
        let mut values = Vec::with_capacity(usize::from(n));
        for _ in 0..n {
            match self.u8()? {
                b'n' => values.push(None),
                b't' | b'b' => {
                    let len = self.u32()? as usize;
                    values.push(Some(self.take(len)?));
                }
                b'u' => return err("an insert with an unchanged TOAST value"),
                other => return err(format!("unknown column kind {:?}", char::from(other))),
            }
        }
        Ok(values)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn relation(id: u32, schema: &str, name: &str, columns: &[&str]) -> Vec<u8> {
        let mut m = vec![b'R'];
        m.extend(id.to_be_bytes());
        for s in [schema, name] {
            m.extend(s.as_bytes());
            m.push(0);
        }
        m.push(b'd');
        m.extend((columns.len() as u16).to_be_bytes());
        for c in columns {
            m.push(0);
            m.extend(c.as_bytes());
            m.push(0);
            m.extend(25u32.to_be_bytes());
            m.extend((-1i32).to_be_bytes());
        }
        m
    }

    fn insert(id: u32, values: &[Option<&str>]) -> Vec<u8> {
        let mut m = vec![b'I'];
        m.extend(id.to_be_bytes());
        m.push(b'N');
        m.extend((values.len() as u16).to_be_bytes());
        for v in values {
            match v {
                None => m.push(b'n'),
                Some(v) => {
                    m.push(b't');
                    m.extend((v.len() as u32).to_be_bytes());
                    m.extend(v.as_bytes());
                }
            }
        }
        m
    }

    const COLUMNS: &[&str] = &[
        "id",
        "tenant",
        "topic",
        "key",
        "lane",
        "payload",
        "headers",
        "effect_key",
        "traceparent",
        "created_at",
        "state",
        "publish_attempts",
        "last_error",
        "delivered_at",
    ];

    fn values<'a>(state: &'a str, payload: &'a str) -> Vec<Option<&'a str>> {
        vec![
            Some("42"),
            Some("acme"),
            Some("orders"),
            Some("k-1"),
            Some("7"),
            Some(payload),
            Some(r#"{"source": "test"}"#),
            None,
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
            Some("1800000000000"),
            Some(state),
            Some("0"),
            None,
            None,
        ]
    }

    #[test]
    fn an_outbox_insert_becomes_a_pending_row() {
        let mut d = Decoder::new("app", None);
        assert_eq!(
            d.decode(&relation(16385, "app", "outbox", COLUMNS)).unwrap(),
            Message::Relation
        );
        let Message::Row(row) = d.decode(&insert(16385, &values("pending", "\\x68690a"))).unwrap() else {
            panic!("not a row");
        };
        assert_eq!((row.id, row.tenant.as_str(), row.key.as_str()), (42, "acme", "k-1"));
        assert_eq!(row.payload, b"hi\n");
        assert_eq!(row.headers["source"], "test");
        assert_eq!(row.effect_key, None);
        assert_eq!(row.created_at.get(), 1_800_000_000_000);
    }

    #[test]
    fn other_tables_schemas_and_states_are_not_published() {
        let mut d = Decoder::new("app", None);
        d.decode(&relation(1, "other", "outbox", COLUMNS)).unwrap();
        d.decode(&relation(2, "app", "outbox", COLUMNS)).unwrap();
        assert_eq!(
            d.decode(&insert(1, &values("pending", "\\x00"))).unwrap(),
            Message::Ignored
        );
        assert_eq!(
            d.decode(&insert(2, &values("dead", "\\x00"))).unwrap(),
            Message::Ignored
        );
        assert_eq!(d.decode(b"U\0\0\0\x02").unwrap(), Message::Ignored);
    }

    #[test]
    fn what_cannot_be_read_is_an_error_never_a_skip() {
        let mut d = Decoder::new("app", None);
        assert!(
            d.decode(&insert(9, &values("pending", "\\x00"))).is_err(),
            "unknown relation"
        );
        d.decode(&relation(9, "app", "outbox", COLUMNS)).unwrap();
        assert!(d.decode(&insert(9, &values("pending", "not hex"))).is_err());
        let mut short = insert(9, &values("pending", "\\x00"));
        short.truncate(short.len() - 3);
        assert!(d.decode(&short).is_err(), "truncated");
        assert!(d.decode(b"Z").is_err(), "unknown tag");
    }

    /// Columns are found by name once per Relation message: a table whose
    /// columns come in another order (a restored dump, a later migration)
    /// decodes the same, and an outbox without a column the relay reads is
    /// an error at its first insert.
    #[test]
    fn columns_are_found_by_name_in_any_order() {
        let mut d = Decoder::new("app", None);
        let reversed: Vec<&str> = COLUMNS.iter().rev().copied().collect();
        d.decode(&relation(3, "app", "outbox", &reversed)).unwrap();
        let backwards: Vec<Option<&str>> = values("pending", "\\x6869").into_iter().rev().collect();
        let Message::Row(row) = d.decode(&insert(3, &backwards)).unwrap() else {
            panic!("not a row");
        };
        assert_eq!(
            (row.id, row.topic.as_str(), row.payload.as_slice()),
            (42, "orders", &b"hi"[..])
        );

        d.decode(&relation(4, "app", "outbox", &COLUMNS[1..])).unwrap();
        let e = d.decode(&insert(4, &values("pending", "\\x00")[1..])).unwrap_err();
        assert_eq!(e.0, "outbox has no column id");
    }

    #[test]
    fn hex_payloads_decode_and_bad_hex_is_refused() {
        assert_eq!(unhex(b"00ff7fA0").unwrap(), vec![0, 255, 127, 160]);
        assert_eq!(unhex(b"").unwrap(), Vec::<u8>::new());
        assert_eq!(unhex(b"abc"), None, "odd length");
        assert_eq!(unhex(b"0g"), None, "not a digit");
    }
}
