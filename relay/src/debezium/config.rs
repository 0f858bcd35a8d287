//! A Debezium connector's configuration (Kafka Connect's JSON, as posted to
//! its REST API, or a `.properties` file, as Debezium Server and the
//! embedded engine read it), reduced to what the outbox `EventRouter` and
//! the converters do to a row. Options that would change the bytes in a
//! way Ferry does not reproduce are refused by name.

use std::collections::BTreeMap;

use regex::Regex;

use super::json;
use super::{ColumnType, Event, Unsupported, Value};
use crate::error::RelayError;

const ROUTER: &str = "io.debezium.transforms.outbox.EventRouter";

/// Where an additional field goes (`table.fields.additional.placement`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Placement {
    Header,
    Envelope,
}

/// One entry of `table.fields.additional.placement`.
#[derive(Debug, Clone)]
struct Additional {
    column: String,
    placement: Placement,
    alias: String,
}

/// A Kafka Connect converter Ferry reproduces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Converter {
    /// `org.apache.kafka.connect.storage.StringConverter`.
    String,
    /// `org.apache.kafka.connect.json.JsonConverter` with
    /// `schemas.enable=false`.
    Json,
    /// `org.apache.kafka.connect.converters.ByteArrayConverter` (and
    /// Debezium's `BinaryDataConverter`): bytes as they are.
    Bytes,
}

/// The outbox `EventRouter` of one connector, with its table and converters.
#[derive(Debug, Clone)]
pub struct EventRouter {
    /// The outbox table's schema.
    pub schema: String,
    /// The outbox table.
    pub table: String,
    /// The connector's replication slot (`slot.name`, Debezium's default
    /// `debezium`): the relay's default, so it takes over where the
    /// connector stopped.
    pub slot: String,
    /// The connector's publication (`publication.name`, default
    /// `dbz_publication`).
    pub publication: String,
    /// The table's columns with a default (read from the database): where
    /// one of the router's holds NULL, Debezium publishes the default (its
    /// field schema carries it), which Ferry does not reproduce.
    pub defaulted: Vec<String>,
    id: String,
    key: String,
    payload: String,
    route_by: String,
    /// `route.topic.regex`, matched whole (RegexRouter's `matches()`)...
    route: Regex,
    /// ...and as it is, for the replacement (`replaceFirst()`: the first
    /// match, which may be shorter than the whole).
    route_first: Regex,
    /// The replacement, in the `regex` crate's syntax.
    replacement: String,
    additional: Vec<Additional>,
    expand_json: bool,
    /// `table.field.event.timestamp`: the record's timestamp.
    timestamp: Option<String>,
    tombstone_on_empty: bool,
    key_converter: Converter,
    value_converter: Converter,
    /// The connector's context headers (`extended.headers.enabled`), which
    /// every record of the connector carries before the router's own.
    context: Vec<(String, Vec<u8>)>,
}

/// Where each column the router reads sits in a row of the table, and its
/// type: resolved once per `Relation` message.
#[derive(Debug, Clone)]
pub struct Layout {
    width: usize,
    id: (usize, ColumnType),
    key: (usize, ColumnType),
    payload: (usize, ColumnType),
    route_by: (usize, ColumnType),
    additional: Vec<(usize, ColumnType)>,
    timestamp: Option<(usize, ColumnType)>,
    /// Positions of the columns with a default.
    defaulted: Vec<usize>,
    /// `aggregateid`, when it is not the key column: the EventRouter's
    /// fallback key (`table.field.event.payload.id`) for a NULL key.
    fallback_key: Option<usize>,
}

fn config_err(what: impl Into<String>) -> RelayError {
    RelayError::Config(format!("--debezium-config: {}", what.into()))
}

/// A connector configuration's keys and values: `{"name": …, "config":
/// {…}}`, a flat JSON object, or `.properties` lines.
fn entries(text: &str) -> Result<BTreeMap<String, String>, RelayError> {
    if text.trim_start().starts_with('{') {
        let v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| config_err(format!("not a JSON object: {e}")))?;
        let obj = v.get("config").unwrap_or(&v);
        let obj = obj
            .as_object()
            .ok_or_else(|| config_err("the JSON has no object of settings"))?;
        return obj
            .iter()
            .map(|(k, v)| match v {
                serde_json::Value::String(s) => Ok((k.clone(), s.clone())),
                serde_json::Value::Number(n) => Ok((k.clone(), n.to_string())),
                serde_json::Value::Bool(b) => Ok((k.clone(), b.to_string())),
                _ => Err(config_err(format!("{k} is not a string, number or boolean"))),
            })
            .collect();
    }
    let mut out = BTreeMap::new();
    let mut pending = String::new();
    // Java's line ends: \n, \r\n and a lone \r.
    for line in text.split(['\n', '\r']) {
        let line = line.trim_start_matches([' ', '\t', '\x0c']);
        if pending.is_empty() && (line.is_empty() || line.starts_with('#') || line.starts_with('!')) {
            continue;
        }
        // An odd number of trailing backslashes continues the entry on the
        // next line (an even number is escaped backslashes).
        let trailing = line.bytes().rev().take_while(|b| *b == b'\\').count();
        if trailing % 2 == 1 {
            pending.push_str(&line[..line.len() - 1]);
            continue;
        }
        pending.push_str(line);
        property(&std::mem::take(&mut pending), &mut out)?;
    }
    // A continuation on the last line ends the entry there.
    if !pending.is_empty() {
        property(&pending, &mut out)?;
    }
    Ok(out)
}

/// One logical line of a `.properties` file into `out`: the key ends at the
/// first unescaped '=', ':' or whitespace, and one '=' or ':' may follow the
/// whitespace (Java's `Properties.load`).
fn property(entry: &str, out: &mut BTreeMap<String, String>) -> Result<(), RelayError> {
    let bytes = entry.as_bytes();
    let mut at = 0;
    while at < bytes.len() && !matches!(bytes[at], b'=' | b':' | b' ' | b'\t' | b'\x0c') {
        at += if bytes[at] == b'\\' { 2 } else { 1 };
    }
    let at = at.min(bytes.len());
    let (k, rest) = entry.split_at(at);
    let rest = rest.trim_start_matches([' ', '\t', '\x0c']);
    let v = rest.strip_prefix(['=', ':']).unwrap_or(rest);
    out.insert(unescape(k)?, unescape(v.trim_start_matches([' ', '\t', '\x0c']))?);
    Ok(())
}

/// A `.properties` key or value with Java's escapes read: `\t`, `\n`,
/// `\r`, `\f`, `\uXXXX`, and `\` before any other character is that
/// character (`public\.outbox` is `public.outbox`).
fn unescape(s: &str) -> Result<String, RelayError> {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('t') => out.push('\t'),
            Some('n') => out.push('\n'),
            Some('r') => out.push('\r'),
            Some('f') => out.push('\u{c}'),
            Some('u') => {
                let hex: String = chars.by_ref().take(4).collect();
                let unit = Some(&hex)
                    .filter(|h| h.len() == 4 && h.bytes().all(|b| b.is_ascii_hexdigit()))
                    .and_then(|h| u32::from_str_radix(h, 16).ok())
                    .ok_or_else(|| config_err(format!("a malformed \\u escape: \\u{hex}")))?;
                match char::from_u32(unit) {
                    Some(ch) => out.push(ch),
                    // A surrogate pair, escaped as two `\\u`s.
                    None if (0xD800..0xDC00).contains(&unit) => {
                        let rest: String = chars.clone().take(6).collect();
                        let low = rest.strip_prefix("\\u").and_then(|h| u32::from_str_radix(h, 16).ok());
                        if let Some(low) = low.filter(|l| (0xDC00..0xE000).contains(l)) {
                            chars.by_ref().take(6).for_each(drop);
                            out.extend(char::from_u32(0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00)));
                        }
                    }
                    None => {}
                }
            }
            Some(other) => out.push(other),
            None => {}
        }
    }
    Ok(out)
}

/// A Java replacement string (`$1`, `${name}`, `\$`) in the `regex` crate's
/// syntax (`${1}`, `${name}`, `$$`), checked against `route`'s groups as
/// Java's `Matcher` checks it on every record (a group that does not exist
/// fails each one: refused here). After `$`, the first digit is the group
/// number, and each next digit joins it while the number stays a group.
fn replacement(java: &str, route: &Regex) -> Result<String, RelayError> {
    let groups = route.captures_len() - 1;
    let mut out = String::new();
    let mut chars = java.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some('$') => out.push_str("$$"),
                Some(c) => out.push(c),
                None => return Err(config_err("route.topic.replacement ends with a backslash")),
            },
            '$' => match chars.peek() {
                Some('{') => {
                    let name: String = chars.by_ref().skip(1).take_while(|c| *c != '}').collect();
                    if !route.capture_names().flatten().any(|n| n == name) {
                        return Err(config_err(format!(
                            "route.topic.replacement names group {name:?}, which route.topic.regex does not have"
                        )));
                    }
                    out.push_str(&format!("${{{name}}}"));
                }
                Some(d) if d.is_ascii_digit() => {
                    let mut n = d.to_digit(10).expect("a digit") as usize;
                    chars.next();
                    while let Some(next) = chars.peek().and_then(|c| c.to_digit(10)) {
                        let joined = n * 10 + next as usize;
                        if joined > groups {
                            break;
                        }
                        n = joined;
                        chars.next();
                    }
                    if n > groups {
                        return Err(config_err(format!(
                            "route.topic.replacement names group {n}; route.topic.regex has {groups}"
                        )));
                    }
                    out.push_str(&format!("${{{n}}}"));
                }
                _ => return Err(config_err("route.topic.replacement has a '$' without a group")),
            },
            c => out.push(c),
        }
    }
    Ok(out)
}

/// Refuses what Java's and the `regex` crate's patterns read differently:
/// shorthand classes and `\b` (ASCII in Java, Unicode here), `\v`, `\h`,
/// `\p{…}` classes, nested classes and inline flags.
fn check_regex(regex: &str) -> Result<(), RelayError> {
    let mut chars = regex.chars().peekable();
    while let Some(c) = chars.next() {
        let bad = match c {
            '\\' => chars
                .next()
                .filter(|n| "wWdDsSbBpPvVhH".contains(*n))
                .map(|n| format!("\\{n}")),
            // `[[:alpha:]]` is a POSIX class here, literal characters in Java.
            '[' if chars.peek() == Some(&'[') => Some("a nested class".to_owned()),
            '(' if chars.peek() == Some(&'?') => {
                chars.next();
                chars
                    .peek()
                    .filter(|n| !matches!(n, '<' | ':'))
                    .map(|_| "an inline flag".to_owned())
            }
            _ => None,
        };
        if let Some(bad) = bad {
            return Err(config_err(format!(
                "route.topic.regex {regex:?}: {bad} is not supported (Java reads it otherwise)"
            )));
        }
    }
    Ok(())
}

/// Connector settings that change values before the EventRouter sees them
/// (masking, truncation, column filters, custom converters, skipped
/// inserts), or use keys Ferry does not read (Debezium Server's
/// `debezium.*` form): refused rather than published otherwise.
fn check_connector(c: &BTreeMap<String, String>) -> Result<(), RelayError> {
    for (k, v) in c {
        let refused = k.starts_with("column.mask.")
            || k.starts_with("column.truncate.to.")
            || k.starts_with("debezium.")
            || matches!(k.as_str(), "column.exclude.list" | "column.include.list" | "converters")
            || (k == "skipped.operations" && v.split(',').any(|o| o.trim() == "c"))
            || (k.ends_with(".converter.encoding")
                && !matches!(v.trim().to_ascii_uppercase().as_str(), "UTF-8" | "UTF8"));
        if refused {
            return Err(config_err(format!(
                "{k} is not supported (Ferry would publish other records)"
            )));
        }
    }
    match c.get("plugin.name").map(|s| s.trim()) {
        Some("pgoutput") => Ok(()),
        other => Err(config_err(format!(
            "plugin.name must be pgoutput (found {other:?}; Debezium's default is decoderbufs), the plugin the relay reads"
        ))),
    }
}

fn boolean(v: Option<&String>, name: &str) -> Result<bool, RelayError> {
    match v.map(|s| s.trim().to_ascii_lowercase()).as_deref() {
        None => Ok(false),
        Some("true") => Ok(true),
        Some("false") => Ok(false),
        Some(other) => Err(config_err(format!("{name} is {other:?}, not true or false"))),
    }
}

impl EventRouter {
    /// Reads the connector configuration in `text` (JSON or properties).
    pub fn parse(text: &str) -> Result<Self, RelayError> {
        let c = entries(text)?;
        check_connector(&c)?;
        let names: Vec<&str> = c
            .get("transforms")
            .map(|t| t.split(',').map(str::trim).filter(|s| !s.is_empty()).collect())
            .unwrap_or_default();
        let routers: Vec<&str> = names
            .iter()
            .copied()
            .filter(|n| c.get(&format!("transforms.{n}.type")).map(|s| s.trim()) == Some(ROUTER))
            .collect();
        let name = match (routers.as_slice(), names.len()) {
            ([one], 1) => *one,
            ([], _) => return Err(config_err(format!("no transform of type {ROUTER}"))),
            _ => {
                return Err(config_err(format!(
                    "the transforms must be one {ROUTER} alone (found: {})",
                    names.join(", ")
                )))
            }
        };
        let prefix = format!("transforms.{name}.");
        let mut opts: BTreeMap<&str, &String> = BTreeMap::new();
        for (k, v) in &c {
            if let Some(opt) = k.strip_prefix(&prefix) {
                opts.insert(opt, v);
            } else if k.starts_with("predicates") {
                return Err(config_err(format!("{k}: predicates are not supported")));
            }
        }
        const KNOWN: &[&str] = &[
            "type",
            "table.field.event.id",
            "table.field.event.key",
            "table.field.event.payload",
            "table.field.event.timestamp",
            "table.field.event.type",
            "table.field.event.schema.version",
            "table.fields.additional.placement",
            "table.expand.json.payload",
            "table.op.invalid.behavior",
            "debezium.op.invalid.behavior",
            "route.by.field",
            "route.topic.regex",
            "route.topic.replacement",
            "route.tombstone.on.empty.payload",
        ];
        if let Some(unknown) = opts.keys().find(|k| !KNOWN.contains(k)) {
            return Err(config_err(format!(
                "{prefix}{unknown} is not supported (Ferry would publish other records)"
            )));
        }
        for k in ["table.op.invalid.behavior", "debezium.op.invalid.behavior"] {
            if opts.get(k).is_some_and(|v| v.trim().eq_ignore_ascii_case("fatal")) {
                return Err(config_err(format!(
                    "{prefix}{k}=fatal is not supported: the relay's publication carries inserts only, so it never sees the update Debezium would fail on"
                )));
            }
        }
        let opt = |k: &str, default: &str| opts.get(k).map_or_else(|| default.to_owned(), |v| v.trim().to_owned());
        let table = c
            .get("table.include.list")
            .ok_or_else(|| config_err("table.include.list must name the outbox table (schema.table)"))?;
        let table = table.trim().replace("\\.", ".");
        let ident = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        let (schema, table) = match table.split_once('.') {
            Some((s, t)) if ident(s) && ident(t) => (s.to_owned(), t.to_owned()),
            _ => {
                return Err(config_err(format!(
                    "table.include.list must be one table as schema.table, not {table:?}"
                )))
            }
        };
        let converter = |role: &str| -> Result<Converter, RelayError> {
            let class = c.get(&format!("{role}.converter")).map(|s| s.trim()).ok_or_else(|| {
                config_err(format!(
                    "{role}.converter must be set (the worker's default is not in the connector's file)"
                ))
            })?;
            let schemas = c
                .get(&format!("{role}.converter.schemas.enable"))
                .map_or("true", |s| s.trim());
            match class {
                "org.apache.kafka.connect.storage.StringConverter" => Ok(Converter::String),
                "org.apache.kafka.connect.converters.ByteArrayConverter" | "io.debezium.converters.BinaryDataConverter" => {
                    Ok(Converter::Bytes)
                }
                "org.apache.kafka.connect.json.JsonConverter" if schemas.eq_ignore_ascii_case("false") => {
                    Ok(Converter::Json)
                }
                "org.apache.kafka.connect.json.JsonConverter" => Err(config_err(format!(
                    "{role}.converter JsonConverter needs {role}.converter.schemas.enable=false (records with schemas are not supported)"
                ))),
                other => Err(config_err(format!("{role}.converter {other} is not supported"))),
            }
        };
        let key_converter = converter("key")?;
        let value_converter = converter("value")?;
        if let Some(h) = c.get("header.converter").map(|s| s.trim()) {
            if h != "org.apache.kafka.connect.storage.SimpleHeaderConverter" {
                return Err(config_err(format!("header.converter {h} is not supported")));
            }
        }
        for (k, ok) in [("binary.handling.mode", "bytes"), ("time.precision.mode", "adaptive")] {
            if let Some(v) = c.get(k).map(|s| s.trim()).filter(|v| *v != ok) {
                return Err(config_err(format!("{k}={v} is not supported (only {ok})")));
            }
        }
        let mut additional = Vec::new();
        for entry in opt("table.fields.additional.placement", "").split(',') {
            let entry = entry.trim();
            if entry.is_empty() {
                continue;
            }
            let parts: Vec<&str> = entry.split(':').map(str::trim).collect();
            let (column, placement, alias) = match parts.as_slice() {
                [c, p] => (*c, *p, *c),
                [c, p, a] => (*c, *p, *a),
                _ => return Err(config_err(format!("table.fields.additional.placement entry {entry:?}"))),
            };
            let placement = match placement {
                "header" => Placement::Header,
                "envelope" => Placement::Envelope,
                other => {
                    return Err(config_err(format!(
                        "table.fields.additional.placement {other:?} is not supported (header or envelope)"
                    )))
                }
            };
            additional.push(Additional {
                column: column.to_owned(),
                placement,
                alias: alias.to_owned(),
            });
        }
        let expand_json = boolean(
            opts.get("table.expand.json.payload").copied(),
            "table.expand.json.payload",
        )?;
        if expand_json && additional.iter().any(|a| a.placement == Placement::Envelope) {
            // Debezium fails such a record: the envelope's payload field
            // keeps the column's string schema.
            return Err(config_err(
                "table.expand.json.payload with envelope fields is not supported (the EventRouter refuses such records)",
            ));
        }
        let regex = opt("route.topic.regex", "(?<routedByValue>.*)");
        check_regex(&regex)?;
        let compile = |r: &str| {
            Regex::new(r).map_err(|e| config_err(format!("route.topic.regex {regex:?} is not supported: {e}")))
        };
        let route = compile(&format!("^(?:{regex})$"))?;
        let route_first = compile(&regex)?;
        if value_converter == Converter::String
            && (expand_json || additional.iter().any(|a| a.placement == Placement::Envelope))
        {
            return Err(config_err(
                "value.converter StringConverter with an expanded payload or envelope fields is not supported (it writes a Struct's toString)",
            ));
        }
        let context = if boolean(
            c.get("extended.headers.enabled").or(Some(&"true".to_owned())),
            "extended.headers.enabled",
        )? {
            let prefix = c
                .get("topic.prefix")
                .ok_or_else(|| config_err("topic.prefix must be set (the connector's context headers name it)"))?;
            // The connector's type, its task, and a run id per start (of
            // the engine there, of the relay here).
            vec![
                (
                    "__debezium.context.connectorLogicalName".to_owned(),
                    prefix.trim().as_bytes().to_vec(),
                ),
                ("__debezium.context.taskId".to_owned(), b"0".to_vec()),
                ("__debezium.context.connectorName".to_owned(), b"postgresql".to_vec()),
                (
                    "__debezium.context.runId".to_owned(),
                    uuid::Uuid::now_v7().to_string().into_bytes(),
                ),
            ]
        } else {
            Vec::new()
        };
        let name_of = |key: &str, default: &str| -> Result<String, RelayError> {
            let v = c.get(key).map_or(default, |s| s.trim()).to_owned();
            crate::config::check_identifier(key, &v)?;
            Ok(v)
        };
        Ok(EventRouter {
            schema,
            table,
            slot: name_of("slot.name", "debezium")?,
            defaulted: Vec::new(),
            publication: name_of("publication.name", "dbz_publication")?,
            id: opt("table.field.event.id", "id"),
            key: opt("table.field.event.key", "aggregateid"),
            payload: opt("table.field.event.payload", "payload"),
            route_by: opt("route.by.field", "aggregatetype"),
            route,
            replacement: replacement(
                &opt("route.topic.replacement", "outbox.event.${routedByValue}"),
                &route_first,
            )?,
            route_first,
            timestamp: opts.get("table.field.event.timestamp").map(|s| s.trim().to_owned()),
            additional,
            expand_json,
            tombstone_on_empty: boolean(
                opts.get("route.tombstone.on.empty.payload").copied(),
                "route.tombstone.on.empty.payload",
            )?,
            key_converter,
            value_converter,
            context,
        })
    }

    /// Where the router's columns sit among `columns` (names and types,
    /// as a `Relation` message lists them); `Err` names what is missing or
    /// unreadable.
    pub fn layout(&self, columns: &[(String, ColumnType)]) -> Result<Layout, Unsupported> {
        let at = |name: &str| -> Result<(usize, ColumnType), Unsupported> {
            let i = columns
                .iter()
                .position(|(c, _)| c == name)
                .ok_or_else(|| Unsupported(format!("the table has no column {name}")))?;
            let ty = columns[i].1;
            if !super::readable(ty.oid) {
                return Err(Unsupported(format!("column {name} has type id {}", ty.oid)));
            }
            Ok((i, ty))
        };
        let layout = Layout {
            width: columns.len(),
            id: at(&self.id)?,
            key: at(&self.key)?,
            payload: at(&self.payload)?,
            route_by: at(&self.route_by)?,
            additional: self
                .additional
                .iter()
                .map(|a| at(&a.column))
                .collect::<Result<_, _>>()?,
            timestamp: self.timestamp.as_deref().map(at).transpose()?,
            fallback_key: columns
                .iter()
                .position(|(c, _)| c == "aggregateid")
                .filter(|_| self.key != "aggregateid"),
            defaulted: columns
                .iter()
                .enumerate()
                .filter(|(_, (c, _))| self.defaulted.contains(c))
                .map(|(i, _)| i)
                .collect(),
        };
        // What Kafka Connect fails on every record of: refused at the
        // table's first row.
        if let Some((_, ty)) = layout.timestamp {
            if ty.oid != super::oid::TIMESTAMP {
                return Err(Unsupported(
                    "table.field.event.timestamp on a column that is not a timestamp (Debezium fails every record)"
                        .into(),
                ));
            }
        }
        let bytea = |(_, ty): (usize, ColumnType)| ty.oid == super::oid::BYTEA;
        let envelope = self.additional.iter().any(|a| a.placement == Placement::Envelope);
        if self.value_converter == Converter::Bytes && (envelope || !bytea(layout.payload)) {
            return Err(Unsupported(
                "a bytes value converter on a payload that is not bytea, or with envelope fields".into(),
            ));
        }
        if self.key_converter == Converter::Bytes && !bytea(layout.key) {
            return Err(Unsupported(
                "a bytes key converter on a key column that is not bytea".into(),
            ));
        }
        Ok(layout)
    }

    /// The record of one inserted row (text columns, as `pgoutput` sends
    /// them, placed by `layout`).
    pub fn event(&self, layout: &Layout, row: &[Option<&[u8]>]) -> Result<Event, Unsupported> {
        if row.len() != layout.width {
            return Err(Unsupported(
                "a row and its relation disagree on the column count".into(),
            ));
        }
        // Only JsonConverter writes a column's default for its NULL.
        let json = |at: (usize, ColumnType), converter: Converter| {
            converter == Converter::Json && row[at.0].is_none() && layout.defaulted.contains(&at.0)
        };
        let envelope_json = self
            .additional
            .iter()
            .zip(&layout.additional)
            .any(|(a, at)| a.placement == Placement::Envelope && json(*at, self.value_converter));
        if json(layout.key, self.key_converter) || json(layout.payload, self.value_converter) || envelope_json {
            return Err(Unsupported(
                "NULL in a column with a constant default (Debezium's JsonConverter publishes the default)".into(),
            ));
        }
        let get = |(i, ty): (usize, ColumnType)| super::column(ty, row[i]);
        let routed = match get(layout.route_by)? {
            Value::Text(s) => s,
            other => {
                return Err(Unsupported(format!(
                    "route.by.field {} is {other:?}, not a string",
                    self.route_by
                )))
            }
        };
        // Java's `.` stops at these line terminators too; Rust's only at
        // `\n`.
        if routed.contains(['\r', '\u{85}', '\u{2028}', '\u{2029}']) {
            return Err(Unsupported(format!(
                "route.by.field {} holds a line terminator",
                self.route_by
            )));
        }
        let topic = if self.route.is_match(&routed) {
            self.route_first
                .replacen(&routed, 1, self.replacement.as_str())
                .into_owned()
        } else {
            routed
        };
        let mut headers: Vec<(String, Option<Vec<u8>>)> =
            self.context.iter().map(|(k, v)| (k.clone(), Some(v.clone()))).collect();
        headers.push(("id".to_owned(), header(&get(layout.id)?)?));
        let mut payload = get(layout.payload)?;
        if self.expand_json {
            if let Value::Text(s) = &payload {
                if let Some(expanded) = json::expand(s)? {
                    payload = expanded;
                }
            }
        }
        let mut envelope = Vec::new();
        for (a, at) in self.additional.iter().zip(&layout.additional) {
            let v = get(*at)?;
            match a.placement {
                Placement::Header => headers.push((a.alias.clone(), header(&v)?)),
                Placement::Envelope => envelope.push((a.alias.clone(), v)),
            }
        }
        let empty = match &payload {
            Value::Null => true,
            // Java's `String.trim`: characters up to U+0020.
            Value::Text(s) => s.trim_matches(|c| c <= '\u{20}').is_empty(),
            _ => false,
        };
        let value = if empty && self.tombstone_on_empty {
            None
        } else if envelope.is_empty() {
            encode(self.value_converter, &payload)?
        } else {
            let mut fields = vec![("payload".to_owned(), payload)];
            fields.extend(envelope);
            encode(self.value_converter, &Value::Struct(fields))?
        };
        let key_value = get(layout.key)?;
        if key_value == Value::Null && layout.fallback_key.is_some() {
            return Err(Unsupported(
                "a NULL key where the table has aggregateid (the EventRouter's fallback key)".into(),
            ));
        }
        let key = encode(self.key_converter, &key_value)?;
        let timestamp = match layout.timestamp {
            Some(at) => match get(at)? {
                // `Timestamp` (ms) up to 3 fractional digits, else
                // `MicroTimestamp` (the EventRouter divides by 1,000).
                Value::Int(t) => {
                    let ms = if (0..=3).contains(&at.1.modifier) { t } else { t / 1000 };
                    // Kafka's producer refuses a negative timestamp (the
                    // task fails), and librdkafka reads 0 as "now".
                    if ms <= 0 {
                        return Err(Unsupported(format!("an event timestamp of {ms} ms")));
                    }
                    Some(ms)
                }
                _ => None,
            },
            None => None,
        };
        Ok(Event {
            topic,
            key,
            value,
            headers,
            timestamp,
        })
    }
}

/// A value through `converter`. A null is no bytes, but through
/// `JsonConverter`, which writes a null with a schema (a column's) as the
/// JSON `null`.
fn encode(converter: Converter, v: &Value) -> Result<Option<Vec<u8>>, Unsupported> {
    if *v == Value::Null && converter != Converter::Json {
        return Ok(None);
    }
    Ok(Some(match (converter, v) {
        (Converter::Json, v) => {
            let mut out = Vec::new();
            json::write(v, &mut out);
            out
        }
        (Converter::String, Value::Text(s)) => s.as_bytes().to_vec(),
        (Converter::String, Value::Int(i)) => i.to_string().into_bytes(),
        (Converter::String, Value::Bool(b)) => b.to_string().into_bytes(),
        (Converter::Bytes, Value::Bytes(b)) => b.clone(),
        (c, v) => return Err(Unsupported(format!("{v:?} through the {c:?} converter"))),
    }))
}

/// A header value as `SimpleHeaderConverter` writes it.
fn header(v: &Value) -> Result<Option<Vec<u8>>, Unsupported> {
    match v {
        Value::Null => Ok(None),
        Value::Text(s) => Ok(Some(s.as_bytes().to_vec())),
        Value::Int(i) => Ok(Some(i.to_string().into_bytes())),
        Value::Bool(b) => Ok(Some(b.to_string().into_bytes())),
        other => Err(Unsupported(format!("a header of {other:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEFAULTS: &str = "
name=orders-outbox
plugin.name=pgoutput
topic.prefix=dbserver1
table.include.list=inventory.outbox
transforms=outbox
transforms.outbox.type=io.debezium.transforms.outbox.EventRouter
key.converter=org.apache.kafka.connect.storage.StringConverter
value.converter=org.apache.kafka.connect.storage.StringConverter
";

    fn columns() -> Vec<(String, ColumnType)> {
        [
            ("id", 2950),
            ("aggregatetype", 1043),
            ("aggregateid", 1043),
            ("type", 1043),
            ("payload", 3802),
        ]
        .into_iter()
        .map(|(n, oid)| (n.to_owned(), ColumnType { oid, modifier: -1 }))
        .collect()
    }

    #[test]
    fn the_defaults_route_to_outbox_event_with_the_id_header() {
        let r = EventRouter::parse(DEFAULTS).unwrap();
        assert_eq!((r.schema.as_str(), r.table.as_str()), ("inventory", "outbox"));
        let l = r.layout(&columns()).unwrap();
        let row: Vec<Option<&[u8]>> = vec![
            Some(b"5d1c"),
            Some(b"Order"),
            Some(b"42"),
            Some(b"OrderCreated"),
            Some(br#"{"a": 1}"#),
        ];
        let e = r.event(&l, &row).unwrap();
        assert_eq!(e.topic, "outbox.event.Order");
        assert_eq!(e.key.as_deref(), Some(&b"42"[..]));
        assert_eq!(e.value.as_deref(), Some(&br#"{"a": 1}"#[..]));
        let names: Vec<&str> = e.headers.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            names,
            [
                "__debezium.context.connectorLogicalName",
                "__debezium.context.taskId",
                "__debezium.context.connectorName",
                "__debezium.context.runId",
                "id"
            ]
        );
        assert_eq!(e.headers[4].1.as_deref(), Some(&b"5d1c"[..]));
    }

    #[test]
    fn what_would_change_the_bytes_is_refused_by_name() {
        for (extra, needle) in [
            ("transforms.outbox.route.topic.regex=(?=x)", "route.topic.regex"),
            (
                "transforms.outbox.table.fields.additional.placement=type:partition",
                "partition",
            ),
            (
                "transforms.outbox.tracing.span.context.field=x",
                "tracing.span.context.field",
            ),
            (
                "value.converter.schemas.enable=true\nvalue.converter=org.apache.kafka.connect.json.JsonConverter",
                "schemas",
            ),
            ("binary.handling.mode=base64", "binary.handling.mode"),
            ("plugin.name=decoderbufs", "plugin.name"),
            ("column.mask.with.12.chars=inventory.outbox.payload", "column.mask"),
            ("skipped.operations=c,u", "skipped.operations"),
            ("transforms.outbox.route.topic.replacement=${nope}", "nope"),
            ("transforms.outbox.route.topic.replacement=$2", "group 2"),
            ("transforms.outbox.route.topic.regex=(?<routedByValue>\\\\w+)", "\\w"),
            ("transforms.outbox.route.topic.regex=(?i)(.*)", "inline flag"),
        ] {
            let e = EventRouter::parse(&format!("{DEFAULTS}\n{extra}\n"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(needle), "{extra}: {e}");
        }
        let e = EventRouter::parse(&DEFAULTS.replace(
            "table.include.list=inventory.outbox",
            "table.include.list=inventory.outbox,x.y",
        ))
        .unwrap_err()
        .to_string();
        assert!(e.contains("one table"), "{e}");
    }

    #[test]
    fn properties_read_as_java_reads_them() {
        let c = entries("a b\nc : d\ne=f\\\n  g\nh\\ i=\\uD83D\\uDE00 \\u00e9\n# no\nj=k\\\\\\\nl\n").unwrap();
        assert_eq!(c["a"], "b");
        assert_eq!(c["c"], "d");
        assert_eq!(c["e"], "fg");
        assert_eq!(c["h i"], "\u{1F600} é");
        assert_eq!(c["j"], "k\\l", "an escaped backslash, then a continuation");
        assert_eq!(c.len(), 5);
    }

    #[test]
    fn json_configs_and_java_replacements_read() {
        let json = r#"{"name": "c", "config": {
            "topic.prefix": "p", "extended.headers.enabled": "false",
            "table.include.list": "public\\.events",
            "transforms": "router",
            "transforms.router.type": "io.debezium.transforms.outbox.EventRouter",
            "transforms.router.route.topic.regex": "(?<routedByValue>[a-z]+)-([0-9]+)",
            "plugin.name": "pgoutput",
            "transforms.router.route.topic.replacement": "t.${routedByValue}.$2\\$",
            "key.converter": "org.apache.kafka.connect.json.JsonConverter",
            "key.converter.schemas.enable": false,
            "value.converter": "org.apache.kafka.connect.json.JsonConverter",
            "value.converter.schemas.enable": "false"}}"#;
        let r = EventRouter::parse(json).unwrap();
        assert_eq!(r.table, "events");
        let l = r.layout(&columns()).unwrap();
        let row: Vec<Option<&[u8]>> = vec![Some(b"i"), Some(b"order-7"), Some(b"k\""), None, None];
        let e = r.event(&l, &row).unwrap();
        assert_eq!(e.topic, "t.order.7$");
        assert_eq!(e.key.as_deref(), Some(&br#""k\"""#[..]));
        assert_eq!(
            e.value.as_deref(),
            Some(&b"null"[..]),
            "JsonConverter writes a null column as null"
        );
        assert_eq!(e.headers.len(), 1);
        let row: Vec<Option<&[u8]>> = vec![Some(b"i"), Some(b"Order"), Some(b"k"), None, None];
        assert_eq!(
            r.event(&l, &row).unwrap().topic,
            "Order",
            "no match: the topic as it is"
        );
    }

    /// RegexRouter checks the whole topic (`matches()`) but replaces the
    /// first match (`replaceFirst()`); Java's `.` stops at `\r` too.
    #[test]
    fn routing_follows_java_s_matcher() {
        let r = EventRouter::parse(&format!(
            "{DEFAULTS}transforms.outbox.route.topic.regex=(?<routedByValue>.*?)\ntransforms.outbox.route.topic.replacement=${{routedByValue}}.x\n"
        ))
        .unwrap();
        let l = r.layout(&columns()).unwrap();
        let row = |t: &'static [u8]| -> Vec<Option<&'static [u8]>> {
            vec![Some(b"i"), Some(t), Some(b"k"), Some(b"T"), None]
        };
        assert_eq!(r.event(&l, &row(b"Order")).unwrap().topic, ".xOrder");
        assert!(r.event(&l, &row(b"Or\rder")).is_err(), "a line terminator");
    }

    #[test]
    fn timestamps_and_empty_payloads_follow_java() {
        let r = EventRouter::parse(&format!(
            "{DEFAULTS}transforms.outbox.table.field.event.timestamp=at\ntransforms.outbox.route.tombstone.on.empty.payload=true\n"
        ))
        .unwrap();
        let mut cols = columns();
        cols[4].1 = ColumnType { oid: 25, modifier: -1 };
        cols.push(("at".into(), ColumnType { oid: 1114, modifier: 3 }));
        let l = r.layout(&cols).unwrap();
        let e = r
            .event(
                &l,
                &[
                    Some(b"i"),
                    Some(b"O"),
                    Some(b"k"),
                    Some(b"T"),
                    Some(b" \t"),
                    Some(b"1970-01-01 00:00:01.5"),
                ],
            )
            .unwrap();
        assert_eq!(
            (e.timestamp, e.value),
            (Some(1_500), None),
            "ms, and a blank payload is a tombstone"
        );
        let nbsp = "\u{a0}".as_bytes();
        let e = r
            .event(&l, &[Some(b"i"), Some(b"O"), Some(b"k"), Some(b"T"), Some(nbsp), None])
            .unwrap();
        assert_eq!(
            (e.timestamp, e.value.as_deref()),
            (None, Some(nbsp)),
            "Java's trim keeps U+00A0"
        );
        cols[5].1 = ColumnType {
            oid: 1184,
            modifier: -1,
        };
        assert!(
            r.layout(&cols).is_err(),
            "a timestamptz event timestamp fails every record in Debezium"
        );
    }

    #[test]
    fn a_null_where_the_column_has_a_default_is_not_rendered() {
        let json = DEFAULTS.replace(
            "value.converter=org.apache.kafka.connect.storage.StringConverter",
            "value.converter=org.apache.kafka.connect.json.JsonConverter\nvalue.converter.schemas.enable=false",
        );
        let mut strings = EventRouter::parse(DEFAULTS).unwrap();
        strings.defaulted = vec!["payload".into()];
        let l = strings.layout(&columns()).unwrap();
        let row: [Option<&[u8]>; 5] = [Some(b"i"), Some(b"O"), Some(b"k"), Some(b"T"), None];
        assert_eq!(
            strings.event(&l, &row).unwrap().value,
            None,
            "StringConverter writes null"
        );
        let mut r = EventRouter::parse(&json).unwrap();
        r.defaulted = vec!["payload".into()];
        let l = r.layout(&columns()).unwrap();
        let e = r
            .event(&l, &[Some(b"i"), Some(b"O"), Some(b"k"), Some(b"T"), None])
            .unwrap_err();
        assert!(e.0.contains("default"), "{e}");
        assert!(r
            .event(&l, &[Some(b"i"), Some(b"O"), Some(b"k"), Some(b"T"), Some(b"{}")])
            .is_ok());
    }

    #[test]
    fn edges_java_refuses_or_reads_otherwise() {
        let c = entries("a=b\\").unwrap();
        assert_eq!(c["a"], "b", "a continuation on the last line");
        assert!(entries("a=\\u12x4").is_err(), "a malformed \\u escape");
        let r = EventRouter::parse(&format!("{DEFAULTS}transforms.outbox.table.field.event.key=type\n")).unwrap();
        let l = r.layout(&columns()).unwrap();
        let e = r
            .event(&l, &[Some(b"i"), Some(b"O"), Some(b"k"), None, Some(b"{}")])
            .unwrap_err();
        assert!(e.0.contains("aggregateid"), "{e}");
        let r = EventRouter::parse(&format!("{DEFAULTS}transforms.outbox.table.field.event.timestamp=at\n")).unwrap();
        let mut cols = columns();
        cols.push((
            "at".into(),
            ColumnType {
                oid: 1114,
                modifier: -1,
            },
        ));
        let l = r.layout(&cols).unwrap();
        let row: [Option<&[u8]>; 6] = [
            Some(b"i"),
            Some(b"O"),
            Some(b"k"),
            Some(b"T"),
            None,
            Some(b"1969-12-31 23:59:59"),
        ];
        assert!(r.event(&l, &row).is_err(), "a negative timestamp");
    }
}
