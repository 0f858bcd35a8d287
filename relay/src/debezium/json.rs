//! The JSON of Kafka Connect's `JsonConverter` (`schemas.enable=false`),
//! written as Jackson writes it, and the reading of a JSON payload as the
//! EventRouter's `table.expand.json.payload` reads it (Jackson's number
//! kinds, the schema it infers, the fields that schema drops).

use super::{Unsupported, Value};

/// `value` as `JsonConverter` (schemas off) writes it: objects in their
/// schema's field order, strings escaped as Jackson escapes them (control
/// characters only; other characters as UTF-8), doubles as Java's
/// `Double.toString`, bytes in base64.
pub fn write(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(b) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
        Value::Int(i) => out.extend_from_slice(i.to_string().as_bytes()),
        // Jackson quotes what is not a JSON number (QUOTE_NON_NUMERIC_NUMBERS).
        Value::Double(d) if !d.is_finite() => string(&java_double(*d), out),
        Value::Double(d) => out.extend_from_slice(java_double(*d).as_bytes()),
        Value::Text(s) => string(s, out),
        Value::Bytes(b) => {
            out.push(b'"');
            out.extend_from_slice(base64(b).as_bytes());
            out.push(b'"');
        }
        Value::Struct(fields) => {
            out.push(b'{');
            for (i, (name, v)) in fields.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                string(name, out);
                out.push(b':');
                write(v, out);
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write(v, out);
            }
            out.push(b']');
        }
    }
}

/// A JSON string as Jackson's UTF-8 generator writes it.
fn string(s: &str, out: &mut Vec<u8>) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    out.push(b'"');
    for &b in s.as_bytes() {
        match b {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            0x08 => out.extend_from_slice(b"\\b"),
            0x09 => out.extend_from_slice(b"\\t"),
            0x0A => out.extend_from_slice(b"\\n"),
            0x0C => out.extend_from_slice(b"\\f"),
            0x0D => out.extend_from_slice(b"\\r"),
            0x00..=0x1F => out.extend_from_slice(&[
                b'\\',
                b'u',
                b'0',
                b'0',
                HEX[usize::from(b >> 4)],
                HEX[usize::from(b & 15)],
            ]),
            _ => out.push(b),
        }
    }
    out.push(b'"');
}

/// Standard base64 with padding (Jackson's default variant, no line feeds).
pub fn base64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut s = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                s.push(char::from(A[(n >> (18 - 6 * i) & 63) as usize]));
            } else {
                s.push('=');
            }
        }
    }
    s
}

/// Java's `Double.toString`: the shortest digits that read back as `d`, in
/// plain notation from 10^-3 to 10^7 (at least one digit after the point),
/// else as `d.dddE<n>`.
pub fn java_double(d: f64) -> String {
    if d.is_nan() {
        return "NaN".into();
    }
    if d.is_infinite() {
        return if d > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    if d == 0.0 {
        return if d.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    // Rust's `{:e}` is the shortest round-trip form: "1.2345e-5".
    let sci = format!("{:e}", d.abs());
    let (mantissa, exp) = sci.split_once('e').expect("{:e} has an exponent");
    let exp: i32 = exp.parse().expect("{:e}'s exponent is a number");
    let mut digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let mut exp = exp;
    if digits.len() == 1 {
        // Java prints at least two digits, the pair closest to the value
        // (`4.9E-324` for the least subnormal, `1.0E-5` for 1e-5).
        let two = format!("{:.1e}", d.abs());
        let (m, e) = two.split_once('e').expect("{:e} has an exponent");
        digits = m.chars().filter(char::is_ascii_digit).collect();
        exp = e.parse().expect("{:e}'s exponent is a number");
        if digits.ends_with('0') {
            digits.pop();
        }
    }
    let sign = if d < 0.0 { "-" } else { "" };
    if (-3..7).contains(&exp) {
        let (int, frac) = if exp >= 0 {
            let point = usize::try_from(exp + 1).expect("non-negative");
            let padded = format!("{digits:0<point$}");
            let (i, f) = padded.split_at(point);
            (i.to_owned(), f.to_owned())
        } else {
            let zeros = usize::try_from(-exp - 1).expect("positive");
            ("0".to_owned(), format!("{}{digits}", "0".repeat(zeros)))
        };
        let frac = if frac.is_empty() { "0".to_owned() } else { frac };
        format!("{sign}{int}.{frac}")
    } else {
        let (first, rest) = digits.split_at(1);
        let rest = if rest.is_empty() { "0" } else { rest };
        format!("{sign}{first}.{rest}E{exp}")
    }
}

/// A JSON document as Jackson's tree reads it, fields in document order.
#[derive(Debug, Clone, PartialEq)]
enum Node {
    Null,
    Bool(bool),
    /// An integer literal that fits in 32 bits (Jackson's `IntNode`).
    Int(i32),
    /// One that fits in 64 bits (`LongNode`).
    Long(i64),
    /// A literal with a fraction or an exponent (`DoubleNode`).
    Double(f64),
    Text(String),
    Array(Vec<Node>),
    Object(Vec<(String, Node)>),
}

/// What the EventRouter makes of a JSON payload with
/// `table.expand.json.payload` (Debezium 3.6.1, observed on its records):
/// a struct of the fields whose values are neither null nor an empty array,
/// nested likewise.
///
/// `Ok(None)`: the EventRouter leaves the payload a string. It does when the
/// text does not start with `{` or `[` or does not parse, and when it
/// cannot infer an array's schema: only nulls, different kinds, integers
/// mixed with fractions, or an array holding an empty array.
///
/// `Err`: a document whose record Ferry does not reproduce: a top-level
/// array or an integer beyond 64 bits (Debezium's task fails on both), an
/// array of several objects with more than one field between them (the
/// union of their fields comes in an order Debezium does not fix), or 32-
/// and 64-bit integers in one array. The stream stops at it rather than
/// publish other bytes.
pub fn expand(payload: &str) -> Result<Option<Value>, Unsupported> {
    if !(payload.starts_with('{') || payload.starts_with('[')) {
        return Ok(None);
    }
    let mut p = Parser {
        s: payload.as_bytes(),
        at: 0,
    };
    let node = match p.document() {
        Ok(n) => n,
        Err(Parse::Invalid) => return Ok(None),
        Err(Parse::Unsupported(what)) => return Err(Unsupported(what)),
    };
    match node {
        Node::Object(fields) => match object(fields) {
            Ok(v) => Ok(Some(v)),
            Err(Expand::StaysText) => Ok(None),
            Err(Expand::Unsupported(what)) => Err(Unsupported(what)),
        },
        _ => Err(Unsupported("a JSON payload that is an array".into())),
    }
}

/// Why a document is not expanded.
enum Expand {
    /// The EventRouter keeps the payload's text.
    StaysText,
    /// Ferry does not reproduce what the EventRouter does.
    Unsupported(String),
}

fn unsupported(what: &str) -> Expand {
    Expand::Unsupported(format!("a JSON payload with {what}"))
}

fn object(fields: Vec<(String, Node)>) -> Result<Value, Expand> {
    let mut out = Vec::with_capacity(fields.len());
    for (name, node) in fields {
        match &node {
            Node::Null => continue,
            Node::Array(items) if items.is_empty() => continue,
            _ => {}
        }
        // Kafka's SchemaBuilder refuses an empty field name.
        if name.is_empty() {
            return Err(Expand::StaysText);
        }
        out.push((name, value(node)?));
    }
    Ok(Value::Struct(out))
}

/// A scalar's exact kind (Jackson's node class): 0 for anything else.
fn scalar_kind(n: &Node) -> u8 {
    match n {
        Node::Bool(_) => 1,
        Node::Int(_) => 2,
        Node::Long(_) => 3,
        Node::Double(_) => 4,
        Node::Text(_) => 5,
        _ => 0,
    }
}

/// Jackson's node type, as the EventRouter compares array members.
fn kind(n: &Node) -> u8 {
    match n {
        Node::Null => 0,
        Node::Bool(_) => 1,
        Node::Int(_) | Node::Long(_) | Node::Double(_) => 2,
        Node::Text(_) => 3,
        Node::Array(_) => 4,
        Node::Object(_) => 5,
    }
}

fn value(node: Node) -> Result<Value, Expand> {
    Ok(match node {
        Node::Null => Value::Null,
        Node::Bool(b) => Value::Bool(b),
        Node::Int(i) => Value::Int(i64::from(i)),
        Node::Long(l) => Value::Int(l),
        Node::Double(d) => Value::Double(d),
        Node::Text(s) => Value::Text(s),
        Node::Object(fields) => object(fields)?,
        Node::Array(items) => {
            let present: Vec<&Node> = items.iter().filter(|n| **n != Node::Null).collect();
            let Some(first) = present.first() else {
                return Err(Expand::StaysText);
            };
            if present.iter().any(|n| kind(n) != kind(first)) {
                return Err(Expand::StaysText);
            }
            let ints = present.iter().filter(|n| matches!(n, Node::Int(_))).count();
            let longs = present.iter().filter(|n| matches!(n, Node::Long(_))).count();
            let doubles = present.iter().filter(|n| matches!(n, Node::Double(_))).count();
            if doubles > 0 && ints + longs > 0 {
                return Err(Expand::StaysText);
            }
            if ints > 0 && longs > 0 {
                return Err(unsupported("32- and 64-bit integers in one array"));
            }
            if matches!(first, Node::Array(a) if a.is_empty()) {
                return Err(Expand::StaysText);
            }
            // Arrays of arrays: the first member's schema is every
            // member's, so each must be alike (one kind of scalars).
            if let Node::Array(_) = first {
                let shape = |n: &Node| match n {
                    Node::Array(inner) => {
                        let kinds: Vec<u8> = inner.iter().filter(|i| **i != Node::Null).map(scalar_kind).collect();
                        match kinds.first() {
                            Some(k) if *k != 0 && kinds.iter().all(|x| x == k) => Some(*k),
                            _ => None,
                        }
                    }
                    _ => None,
                };
                let first_shape = shape(first);
                if first_shape.is_none() || present.iter().any(|n| shape(n) != first_shape) {
                    return Err(unsupported("an array of arrays that are not all alike"));
                }
            }
            if present.len() > 1 {
                let mut names: Vec<&str> = Vec::new();
                let mut field_kind = 0;
                for n in &present {
                    if let Node::Object(fields) = n {
                        for (name, v) in fields {
                            // Kafka's SchemaBuilder refuses an empty name.
                            if name.is_empty() {
                                return Err(Expand::StaysText);
                            }
                            if matches!(v, Node::Object(_) | Node::Array(_)) {
                                return Err(unsupported("an array of objects holding objects or arrays"));
                            }
                            if *v != Node::Null {
                                let k = scalar_kind(v);
                                if field_kind != 0 && k != field_kind {
                                    return Err(unsupported("an array of objects whose field changes kind"));
                                }
                                field_kind = k;
                            }
                            if !names.contains(&name.as_str()) {
                                names.push(name);
                            }
                        }
                    }
                }
                if names.len() > 1 {
                    return Err(unsupported("an array of objects with more than one field between them"));
                }
                // One field: each object is written with it, null where
                // it is missing or null.
                if let [name] = names.as_slice() {
                    let name = (*name).to_owned();
                    let mut out = Vec::with_capacity(items.len());
                    for item in items {
                        out.push(match item {
                            Node::Object(mut fields) => {
                                let v = match fields.iter().position(|(n, _)| *n == name) {
                                    Some(at) => value(fields.swap_remove(at).1)?,
                                    None => Value::Null,
                                };
                                Value::Struct(vec![(name.clone(), v)])
                            }
                            other => value(other)?,
                        });
                    }
                    return Ok(Value::Array(out));
                }
            }
            Value::Array(items.into_iter().map(value).collect::<Result<_, _>>()?)
        }
    })
}

enum Parse {
    Invalid,
    Unsupported(String),
}

struct Parser<'a> {
    s: &'a [u8],
    at: usize,
}

impl Parser<'_> {
    fn document(&mut self) -> Result<Node, Parse> {
        let n = self.node(0)?;
        self.ws();
        if self.at != self.s.len() {
            // Jackson's readTree stops after the first value; trailing
            // content is not read. Ferry refuses to guess.
            return Err(Parse::Unsupported("content after a JSON payload's document".into()));
        }
        Ok(n)
    }

    fn ws(&mut self) {
        while self.at < self.s.len() && matches!(self.s[self.at], b' ' | b'\t' | b'\n' | b'\r') {
            self.at += 1;
        }
    }

    fn peek(&self) -> Option<u8> {
        self.s.get(self.at).copied()
    }

    fn eat(&mut self, lit: &[u8]) -> Result<(), Parse> {
        if self.s[self.at..].starts_with(lit) {
            self.at += lit.len();
            Ok(())
        } else {
            Err(Parse::Invalid)
        }
    }

    fn node(&mut self, depth: usize) -> Result<Node, Parse> {
        if depth > 500 {
            return Err(Parse::Unsupported("a JSON payload nested deeper than 500".into()));
        }
        self.ws();
        match self.peek().ok_or(Parse::Invalid)? {
            b'{' => {
                self.at += 1;
                let mut fields: Vec<(String, Node)> = Vec::new();
                self.ws();
                if self.peek() == Some(b'}') {
                    self.at += 1;
                    return Ok(Node::Object(fields));
                }
                loop {
                    self.ws();
                    let name = self.string()?;
                    self.ws();
                    self.eat(b":")?;
                    let v = self.node(depth + 1)?;
                    // Jackson keeps a repeated name's first place, last value.
                    match fields.iter_mut().find(|(n, _)| *n == name) {
                        Some(f) => f.1 = v,
                        None => fields.push((name, v)),
                    }
                    self.ws();
                    match self.peek() {
                        Some(b',') => self.at += 1,
                        Some(b'}') => {
                            self.at += 1;
                            return Ok(Node::Object(fields));
                        }
                        _ => return Err(Parse::Invalid),
                    }
                }
            }
            b'[' => {
                self.at += 1;
                let mut items = Vec::new();
                self.ws();
                if self.peek() == Some(b']') {
                    self.at += 1;
                    return Ok(Node::Array(items));
                }
                loop {
                    items.push(self.node(depth + 1)?);
                    self.ws();
                    match self.peek() {
                        Some(b',') => self.at += 1,
                        Some(b']') => {
                            self.at += 1;
                            return Ok(Node::Array(items));
                        }
                        _ => return Err(Parse::Invalid),
                    }
                }
            }
            b'"' => Ok(Node::Text(self.string()?)),
            b't' => self.eat(b"true").map(|()| Node::Bool(true)),
            b'f' => self.eat(b"false").map(|()| Node::Bool(false)),
            b'n' => self.eat(b"null").map(|()| Node::Null),
            b'-' | b'0'..=b'9' => self.number(),
            _ => Err(Parse::Invalid),
        }
    }

    /// A number in JSON's grammar, as strict as Jackson's defaults (no
    /// leading zeros, digits on both sides of the point).
    fn number(&mut self) -> Result<Node, Parse> {
        let start = self.at;
        let digits = |p: &mut Self| {
            let from = p.at;
            while p.peek().is_some_and(|c| c.is_ascii_digit()) {
                p.at += 1;
            }
            p.at - from
        };
        if self.peek() == Some(b'-') {
            self.at += 1;
        }
        let int_start = self.at;
        let n = digits(self);
        if n == 0 || (n > 1 && self.s[int_start] == b'0') {
            return Err(Parse::Invalid);
        }
        let mut float = false;
        if self.peek() == Some(b'.') {
            self.at += 1;
            float = true;
            if digits(self) == 0 {
                return Err(Parse::Invalid);
            }
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.at += 1;
            float = true;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.at += 1;
            }
            if digits(self) == 0 {
                return Err(Parse::Invalid);
            }
        }
        let text = std::str::from_utf8(&self.s[start..self.at]).map_err(|_| Parse::Invalid)?;
        if float {
            return text.parse().map(Node::Double).map_err(|_| Parse::Invalid);
        }
        if let Ok(i) = text.parse::<i32>() {
            return Ok(Node::Int(i));
        }
        match text.parse::<i64>() {
            Ok(l) => Ok(Node::Long(l)),
            Err(_) if text.trim_start_matches('-').bytes().all(|b| b.is_ascii_digit()) => Err(Parse::Unsupported(
                "a JSON payload with an integer beyond 64 bits".into(),
            )),
            Err(_) => Err(Parse::Invalid),
        }
    }

    fn string(&mut self) -> Result<String, Parse> {
        self.eat(b"\"")?;
        let mut out = String::new();
        loop {
            let rest = &self.s[self.at..];
            let end = rest
                .iter()
                .position(|b| *b == b'"' || *b == b'\\')
                .ok_or(Parse::Invalid)?;
            // Jackson refuses unescaped control characters.
            if rest[..end].iter().any(|b| *b < 0x20) {
                return Err(Parse::Invalid);
            }
            out.push_str(std::str::from_utf8(&rest[..end]).map_err(|_| Parse::Invalid)?);
            self.at += end;
            if self.s[self.at] == b'"' {
                self.at += 1;
                return Ok(out);
            }
            self.at += 1;
            let c = self.peek().ok_or(Parse::Invalid)?;
            self.at += 1;
            match c {
                b'"' => out.push('"'),
                b'\\' => out.push('\\'),
                b'/' => out.push('/'),
                b'b' => out.push('\u{8}'),
                b'f' => out.push('\u{c}'),
                b'n' => out.push('\n'),
                b'r' => out.push('\r'),
                b't' => out.push('\t'),
                b'u' => {
                    let unit = self.hex4()?;
                    let ch = if (0xD800..0xDC00).contains(&unit) {
                        self.eat(b"\\u")?;
                        let low = self.hex4()?;
                        if !(0xDC00..0xE000).contains(&low) {
                            return Err(Parse::Invalid);
                        }
                        char::from_u32(0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00))
                    } else {
                        char::from_u32(unit)
                    };
                    out.push(ch.ok_or(Parse::Invalid)?);
                }
                _ => return Err(Parse::Invalid),
            }
        }
    }

    fn hex4(&mut self) -> Result<u32, Parse> {
        let h = self.s.get(self.at..self.at + 4).ok_or(Parse::Invalid)?;
        if !h.iter().all(u8::is_ascii_hexdigit) {
            return Err(Parse::Invalid);
        }
        let h = std::str::from_utf8(h).map_err(|_| Parse::Invalid)?;
        let v = u32::from_str_radix(h, 16).map_err(|_| Parse::Invalid)?;
        self.at += 4;
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(v: &Value) -> String {
        let mut out = Vec::new();
        write(v, &mut out);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn doubles_print_as_java_prints_them() {
        for (d, s) in [
            (1.5, "1.5"),
            (100.0, "100.0"),
            (0.001, "0.001"),
            (0.0001, "1.0E-4"),
            (1e7, "1.0E7"),
            (9_999_999.0, "9999999.0"),
            (1.2345e20, "1.2345E20"),
            (-2.5e-5, "-2.5E-5"),
            (0.0, "0.0"),
            (123.456, "123.456"),
            (5e-324, "4.9E-324"),
            (0.002, "0.002"),
            (12_345_678.9, "1.23456789E7"),
        ] {
            assert_eq!(java_double(d), s, "{d}");
        }
    }

    #[test]
    fn strings_escape_as_jackson_escapes_them() {
        assert_eq!(
            json(&Value::Text("a\"b\\c\n\u{1}é/".into())),
            "\"a\\\"b\\\\c\\n\\u0001é/\""
        );
        assert_eq!(base64(b"hi\n"), "aGkK");
        assert_eq!(base64(b"ab"), "YWI=");
        assert_eq!(base64(b""), "");
    }

    #[test]
    fn an_expanded_payload_drops_null_fields_and_keeps_the_order() {
        let v = expand(r#"{"b": 1, "a": null, "c": {"x": [1, 2], "y": 2.50, "z": 3000000000}, "d": "é"}"#)
            .unwrap()
            .unwrap();
        assert_eq!(json(&v), r#"{"b":1,"c":{"x":[1,2],"y":2.5,"z":3000000000},"d":"é"}"#);
        assert_eq!(expand("not json").unwrap(), None);
        assert_eq!(expand("{broken").unwrap(), None);
        // As Debezium 3.6.1 did with each (bench/debezium/golden's harness).
        let expanded = |s: &str| json(&expand(s).unwrap().unwrap());
        assert_eq!(expanded(r#"{"e": [], "f": 1}"#), r#"{"f":1}"#);
        assert_eq!(expanded(r#"{"a": [null, {"x": 1}]}"#), r#"{"a":[null,{"x":1}]}"#);
        assert_eq!(
            expanded(r#"{"a": [{"x": null}, {"x": 2}, {}]}"#),
            r#"{"a":[{"x":null},{"x":2},{"x":null}]}"#
        );
        assert_eq!(expanded(r#"{"a": [[1], [2]]}"#), r#"{"a":[[1],[2]]}"#);
        for stays_text in [
            r#"{"a": [null]}"#,
            r#"{"a": [1, "s"]}"#,
            r#"{"a": [1, 2.5]}"#,
            r#"{"a": [2.5, 1]}"#,
            r#"{"a": [[]]}"#,
        ] {
            assert_eq!(expand(stays_text).unwrap(), None, "{stays_text}");
        }
        assert_eq!(expand(r#"{"": 1}"#).unwrap(), None, "an empty field name");
        assert_eq!(expand("{\"a\": \"x\u{1}\"}").unwrap(), None, "a raw control character");
        for loose in [r#"{"a": 01}"#, r#"{"a": 1.}"#, r#"{"a": 1.e5}"#, r#"{"a": .5}"#] {
            assert_eq!(expand(loose).unwrap(), None, "{loose}");
        }
        assert_eq!(expanded(r#"{"a": 1e400}"#), r#"{"a":"Infinity"}"#);
        for refused in [
            r#"{"a": [[1], [2.5]]}"#,
            r#"{"a": [[1], []]}"#,
            r#"{"a": [{"x": 1}, {"x": "s"}]}"#,
            "[1]",
            r#"{"a": 123456789012345678901234}"#,
            r#"{"a": [{"x": 1}, {"y": 2}]}"#,
            r#"{"a": [1, 3000000000]}"#,
        ] {
            assert!(expand(refused).is_err(), "{refused}");
        }
    }
}
