//! The fingerprint's canonical form, on raw JSON text: hand-written inputs with
//! their exact canonical text, digests pinned from before the canonical form
//! sorted keys by bytes itself, and properties over generated JSON (floats
//! included) spelled out in different but equivalent ways.
//!
//! Every input is parsed from text, as a caller's command would be. Key order,
//! whitespace and string escapes do not survive serde_json's parse, so equal
//! fingerprints for them prove little on their own: the exact canonical text
//! (hand-written cases and `canonical_text_is_the_spec`) is what pins the key
//! order. Number spellings do survive the parse (`1` is an integer, `1.0` a
//! float), and only Ferry's normalization makes them one.
//!
//! serde_json's default `Map` is a BTreeMap that already iterates in byte
//! order, so a `write_canonical` that forgot to sort would pass here; run
//! `cargo test -p ferry --test it --features serde_json/preserve_order
//! fingerprint` to test the sort itself on insertion-ordered maps.

use std::collections::BTreeMap;

use ferry::fingerprint;
use ferry::fingerprint::canonical_json;
use proptest::prelude::*;
use serde_json::Value;

fn parse(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"))
}

fn canon(text: &str) -> String {
    canonical_json(&parse(text))
}

fn fp(text: &str) -> String {
    fingerprint("charge", 1, "acme", &parse(text)).hex
}

#[test]
fn canonical_text_of_hand_written_inputs() {
    let cases: &[(&str, &str)] = &[
        // Key order, whitespace, nesting.
        (
            " { \"b\" : 1 ,\"a\":[ 1 ,\t2 ] ,\r\n \"c\" : { \"y\" : null , \"x\" : true } } ",
            r#"{"a":[1,2],"b":1,"c":{"x":true,"y":null}}"#,
        ),
        (
            r#"{"b":{"d":[{"f":[],"e":{}}],"c":0},"a":[[[]],[{}]]}"#,
            r#"{"a":[[[]],[{}]],"b":{"c":0,"d":[{"e":{},"f":[]}]}}"#,
        ),
        // Keys sort by UTF-8 bytes: a prefix first, upper before lower case,
        // U+FF61 before U+1F600 (UTF-16 code units would swap those two).
        (
            r#"{"😀":6,"｡":5,"é":4,"b":3,"ab":2,"a":1,"B":0,"":-1}"#,
            r#"{"":-1,"B":0,"a":1,"ab":2,"b":3,"é":4,"｡":5,"😀":6}"#,
        ),
        // An escaped key is the same key.
        (r#"{"\u0062":1,"\u0061":2}"#, r#"{"a":2,"b":1}"#),
        // Integers written as floats are integers.
        (
            r#"[1, 1.0, 1e0, 1E+0, 10e-1, 0.1e1, 100e-2, 1.000, 1e00]"#,
            "[1,1,1,1,1,1,1,1,1]",
        ),
        (r#"[-7, -7.0, -0.7e1, -700e-2]"#, "[-7,-7,-7,-7]"),
        (
            r#"[1e15, 1000000000000000.0, 9007199254740992.0, -9007199254740992e0]"#,
            "[1000000000000000,1000000000000000,9007199254740992,-9007199254740992]",
        ),
        // Other floats: Rust's shortest round-trip exponent form.
        (
            r#"[0.5, 5e-1, 1.5, 0.1, -2.5e-7, 123.456, 1e300, 0.30000000000000004]"#,
            "[5e-1,5e-1,1.5e0,1e-1,-2.5e-7,1.23456e2,1e300,3.0000000000000004e-1]",
        ),
        // An integral float above 2^53 keeps the exponent form, even where the
        // integer is exact: 1e16 and the integer 10000000000000000 differ (v1).
        (
            r#"[1e16, 1.0e16, 10000000000000000, 9007199254740994e0]"#,
            "[1e16,1e16,10000000000000000,9.007199254740994e15]",
        ),
        // Negative zero is zero.
        (r#"[0, -0, 0.0, -0.0, 0e5, -0E-3]"#, "[0,0,0,0,0,0]"),
        // Integers beyond f64 precision keep every digit.
        (
            r#"[18446744073709551615, 18446744073709551614, -9223372036854775808, 9223372036854775807, 9007199254740993]"#,
            "[18446744073709551615,18446744073709551614,-9223372036854775808,9223372036854775807,9007199254740993]",
        ),
        // Past u64 and i64 the parser makes them floats.
        (
            r#"[18446744073709551616, -9223372036854775809]"#,
            "[1.8446744073709552e19,-9.223372036854776e18]",
        ),
        // An escape and the literal character are one string.
        (
            r#"["\u00e9", "é", "\u00E9", "\/", "/", "\ud83d\ude00", "😀", "\uD83D\uDE00", "\u0041"]"#,
            r#"["é","é","é","/","/","😀","😀","😀","A"]"#,
        ),
        // What must be escaped is, the short way where there is one.
        (
            r#"["\"\\", "\n\t\r\b\f", "\u0001\u001F"]"#,
            r#"["\"\\","\n\t\r\b\f","\u0001\u001f"]"#,
        ),
        ("[\"\\u007f\u{7f}\"]", "[\"\u{7f}\u{7f}\"]"),
        // No Unicode normalization: é precomposed and e + combining acute differ.
        (r#"["\u00e9", "e\u0301"]"#, "[\"\u{e9}\",\"e\u{301}\"]"),
        (r#"[null,true,false,"",[],{}]"#, r#"[null,true,false,"",[],{}]"#),
    ];
    for (input, expected) in cases {
        assert_eq!(canon(input), *expected, "canonical text of {input}");
    }
}

#[test]
fn equivalent_texts_have_one_fingerprint() {
    let groups: &[&[&str]] = &[
        &[
            r#"{"a":1,"b":[1.5,"é"]}"#,
            r#" { "b" : [ 15e-1 , "\u00e9" ] , "a" : 1.0 } "#,
            "{\n\t\"b\":[0.15E+1,\"\\u00E9\"],\r\n\"a\":1e0}",
            r#"{"b":[150e-2,"é"],"a":10e-1}"#,
        ],
        &["0", "-0", "0.0", "-0.0e-0", "0E+7"],
        &[r#"["😀/"]"#, r#"["\ud83d\ude00\/"]"#],
        &[
            r#"{"x":{"z":[1,{"q":null,"p":[]}],"y":2.5}}"#,
            r#"{"x":{"y":25e-1,"z":[1.0,{"p":[ ],"q":null}]}}"#,
        ],
    ];
    for group in groups {
        let first = fp(group[0]);
        for text in &group[1..] {
            assert_eq!(fp(text), first, "{text} vs {}", group[0]);
        }
    }
}

#[test]
fn different_values_differ() {
    let pairs = [
        ("1", r#""1""#),
        ("[1,2]", "[2,1]"),
        (r#"{"a":null}"#, "{}"),
        ("null", r#""null""#),
        ("true", r#""true""#),
        ("0", "false"),
        ("[]", "{}"),
        ("[]", "[[]]"),
        (r#""""#, "null"),
        ("1", "1.5"),
        ("0.1", "0.10000000000000002"),
        ("18446744073709551615", "18446744073709551614"),
        ("18446744073709551615", "18446744073709551616"),
        ("-9223372036854775808", "-9223372036854775807"),
        ("-9223372036854775808", "-9223372036854775809"),
        ("9007199254740993", "9007199254740992"),
        ("10000000000000000", "1e16"),
        (r#"{"a":1,"b":2}"#, r#"{"a":2,"b":1}"#),
        (r#"{"a":{"b":1}}"#, r#"{"a":{"c":1}}"#),
        (r#"{"a":[1]}"#, r#"{"a":1}"#),
        (r#""\u00e9""#, r#""e\u0301""#),
    ];
    for (a, b) in pairs {
        assert_ne!(fp(a), fp(b), "{a} vs {b}");
    }
}

/// Digests computed before `write_canonical` sorted keys by bytes itself
/// (commit a5f14b9). Version 1 fingerprints never change.
#[test]
fn known_digests_do_not_change() {
    let cases = [
        (
            ("charge", 1, "acme"),
            r#"{"amount": 5, "currency": "EUR"}"#,
            r#"{"amount":5,"currency":"EUR"}"#,
            "38f785e5167337df9855bf95b4ea75cab08fad6ccdac6c107d7e73f052ff687e",
        ),
        // serde_json's default parser reads 9007199254740993.0 as 2^53 + 2
        // (correct rounding gives 2^53): a parser change here changes the digest.
        (
            ("charge", 2, "t1"),
            r#"{"z": -0.0, "n": 1.0, "f": 0.1, "big": 18446744073709551615, "neg": -9223372036854775808, "s": "\u00e9\ud83d\ude00\n\/\"", "arr": [1e300, 2.5e-7, 1e20, 9007199254740993, 9007199254740993.0, [], {}], "nested": {"b": null, "a": true}}"#,
            r#"{"arr":[1e300,2.5e-7,1e20,9007199254740993,9.007199254740994e15,[],{}],"big":18446744073709551615,"f":1e-1,"n":1,"neg":-9223372036854775808,"nested":{"a":true,"b":null},"s":"é😀\n/\"","z":0}"#,
            "10eb51ccc3ab334b8656f7486327b7f2a814c8e7dddac3a828f08b66665d81e1",
        ),
        (
            ("refund", 1, "t\u{e9}"),
            r#"{"é":1,"z":2,"｡":3,"😀":4,"A":5,"":[-1.5,0.5]}"#,
            r#"{"":[-1.5e0,5e-1],"A":5,"z":2,"é":1,"｡":3,"😀":4}"#,
            "2e7be6f403178a78f1c17fc19e59ac046e59da0ec9122e1829a397e50ddb68ec",
        ),
    ];
    for ((operation, schema, tenant), input, canonical, digest) in cases {
        let command = parse(input);
        assert_eq!(canonical_json(&command), canonical, "canonical text of {input}");
        let f = fingerprint(operation, schema, tenant, &command);
        assert_eq!(f.hex, digest, "digest of {input}");
        assert_eq!(f.version, 1);
    }
}

// ---------------------------------------------------------------------------
// Generated JSON, and a renderer that spells it out in random equivalent ways.

/// 2^53: up to here every integer is exact in an `f64`.
const EXACT: i64 = 1 << 53;

/// A JSON value as the test generates it, before any text exists.
#[derive(Debug, Clone)]
enum Json {
    Null,
    Bool(bool),
    Int(i64),
    UInt(u64),
    Float(f64),
    Str(String),
    Arr(Vec<Json>),
    /// Unique keys.
    Obj(Vec<(String, Json)>),
}

fn int() -> impl Strategy<Value = Json> {
    prop_oneof![
        1 => Just(Json::Int(0)),
        3 => (-1000i64..1000).prop_map(Json::Int),
        2 => (-EXACT..=EXACT).prop_map(Json::Int),
        1 => any::<i64>().prop_map(Json::Int),
        1 => any::<u64>().prop_map(Json::UInt),
        1 => prop::sample::select(vec![0, EXACT, -EXACT, EXACT + 1, -EXACT - 1, i64::MAX, i64::MIN]).prop_map(Json::Int),
        1 => Just(Json::UInt(u64::MAX)),
    ]
}

/// Whether serde_json's default parser (Ferry builds it without
/// `float_roundtrip`) reads `f`'s shortest form back as `f`. It misreads some
/// 16- and 17-digit and far-exponent floats by an ulp; those are left out, as
/// the canonical form is defined on the value the parser produced.
fn reads_back(f: f64) -> bool {
    serde_json::from_str::<f64>(&format!("{f:e}")).is_ok_and(|g| g.to_bits() == f.to_bits())
}

fn float() -> impl Strategy<Value = Json> {
    prop_oneof![
        // Any bits: mostly huge or tiny magnitudes, some subnormal.
        2 => any::<f64>(),
        // Everyday decimals such as 12.5 or -0.003.
        3 => (-1_000_000i64..1_000_000, -12i32..12).prop_map(|(m, e)| format!("{m}e{e}").parse::<f64>().unwrap()),
        // Integral floats, which must equal the integers.
        2 => (-EXACT..=EXACT).prop_map(|i| i as f64),
        1 => prop::sample::select(vec![0.0, -0.0, 1e16, -1e300, 5e-324, f64::MAX, f64::MIN_POSITIVE]),
    ]
    .prop_filter("finite and read back exactly", |f| f.is_finite() && reads_back(*f))
    .prop_map(Json::Float)
}

fn text() -> impl Strategy<Value = String> {
    let special = vec![
        '"',
        '\\',
        '/',
        '\n',
        '\t',
        '\u{8}',
        '\0',
        '\u{1f}',
        '\u{7f}',
        'é',
        '\u{ff61}',
        '😀',
        '\u{10ffff}',
    ];
    prop::collection::vec(
        prop_oneof![3 => prop::char::range('a', 'z'), 1 => any::<char>(), 1 => prop::sample::select(special)],
        0..8,
    )
    .prop_map(|chars| chars.into_iter().collect())
}

/// Keys from a small alphabet, so objects share prefixes and mix byte orders.
fn key() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop::sample::select(vec!['a', 'b', 'B', 'é', '\u{ff61}', '😀', '"']),
        0..4,
    )
    .prop_map(|chars| chars.into_iter().collect())
}

fn json() -> impl Strategy<Value = Json> {
    let leaf = prop_oneof![
        Just(Json::Null),
        any::<bool>().prop_map(Json::Bool),
        int(),
        float(),
        text().prop_map(Json::Str),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Json::Arr),
            prop::collection::btree_map(key(), inner, 0..6).prop_map(|m| Json::Obj(m.into_iter().collect())),
        ]
    })
}

/// A small deterministic generator (splitmix64) driving the spelling choices.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) % n as u64) as usize
    }

    fn coin(&mut self) -> bool {
        self.below(2) == 0
    }
}

/// `v` as JSON text: keys shuffled, random whitespace, numbers and strings in
/// a random one of their equivalent spellings.
fn render(v: &Json, seed: u64) -> String {
    let mut out = String::new();
    let mut rng = Rng(seed);
    write(v, &mut rng, &mut out);
    out
}

fn ws(rng: &mut Rng, out: &mut String) {
    for _ in 0..rng.below(3) {
        out.push_str([" ", "\n", "\t", "\r\n", "  "][rng.below(5)]);
    }
}

fn write(v: &Json, rng: &mut Rng, out: &mut String) {
    ws(rng, out);
    match v {
        Json::Null => out.push_str("null"),
        Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Json::Int(i) => out.push_str(&int_text(i128::from(*i), rng)),
        Json::UInt(u) => out.push_str(&int_text(i128::from(*u), rng)),
        Json::Float(f) => out.push_str(&float_text(*f, rng)),
        Json::Str(s) => out.push_str(&string_text(s, rng)),
        Json::Arr(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write(item, rng, out);
            }
            ws(rng, out);
            out.push(']');
        }
        Json::Obj(entries) => {
            let mut order: Vec<&(String, Json)> = entries.iter().collect();
            for i in (1..order.len()).rev() {
                order.swap(i, rng.below(i + 1));
            }
            out.push('{');
            for (i, (k, v)) in order.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                ws(rng, out);
                out.push_str(&string_text(k, rng));
                ws(rng, out);
                out.push(':');
                write(v, rng, out);
            }
            ws(rng, out);
            out.push('}');
        }
    }
    ws(rng, out);
}

/// An exponent suffix: `e`/`E`, an optional `+`, maybe leading zeros.
fn exponent(e: i32, rng: &mut Rng) -> String {
    let mark = if rng.coin() { "e" } else { "E" };
    let sign = if e < 0 { "-" } else { ["", "+"][rng.below(2)] };
    format!("{mark}{sign}{}{}", "0".repeat(rng.below(3)), e.unsigned_abs())
}

/// `i` as an integer, or, up to 2^53, as a float of the same value the parser
/// reads exactly: `12.0`, `120e-1`, `12e0`, `1.2e1`, and `-0` for 0.
fn int_text(i: i128, rng: &mut Rng) -> String {
    let plain = i.to_string();
    let magnitude = i.unsigned_abs();
    if magnitude > EXACT as u128 {
        // Past 2^53 only the integer spelling is this integer (see the v1 note
        // on write_number).
        return plain;
    }
    let sign = if i < 0 || (i == 0 && rng.coin()) { "-" } else { "" };
    let digits = magnitude.to_string();
    // Appending zeros multiplies the significand serde_json accumulates; keep
    // it exact in an f64.
    let room = magnitude * 100 <= EXACT as u128;
    match rng.below(5) {
        0 => format!("{sign}{digits}"),
        1 if room => format!("{sign}{digits}.{}", "0".repeat(1 + rng.below(2))),
        2 if room && magnitude > 0 => format!("{sign}{digits}0{}", exponent(-1, rng)),
        3 => {
            let trimmed = digits.trim_end_matches('0');
            if trimmed.is_empty() {
                format!("{sign}0.0{}", exponent(rng.below(5) as i32, rng))
            } else {
                let e = (digits.len() - 1) as i32;
                let frac = &trimmed[1..];
                let point = if frac.is_empty() {
                    String::new()
                } else {
                    format!(".{frac}")
                };
                format!("{sign}{}{point}{}", &trimmed[..1], exponent(e, rng))
            }
        }
        _ => format!("{sign}{digits}{}", exponent(0, rng)),
    }
}

/// `f` with the digits of its shortest form, the decimal point and the
/// exponent moved together (`1.25e2`, `12.5e1`, `125e0`, `0.00125e5`, `125.`
/// never): serde_json then sees the same significand and power of ten in every
/// spelling and reads the same `f64`. (Appending zeros to the digits would
/// change the significand it rounds, and with it, at 16 digits and more, the
/// `f64` it reads.)
fn float_text(f: f64, rng: &mut Rng) -> String {
    let shortest = format!("{:e}", f.abs());
    let (mantissa, exp) = shortest.split_once('e').unwrap();
    let exp: i32 = exp.parse().unwrap();
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    // -0.0 and 0.0 are one number in the canonical form: either sign will do.
    let sign = if f.is_sign_negative() || (f == 0.0 && rng.coin()) {
        "-"
    } else {
        ""
    };
    let before = rng.below(digits.len() + 1);
    let (int, frac, e) = if before == 0 {
        let zeros = rng.below(3);
        (
            "0".to_string(),
            format!("{}{digits}", "0".repeat(zeros)),
            exp + 1 + zeros as i32,
        )
    } else {
        (
            digits[..before].to_string(),
            digits[before..].to_string(),
            exp - (before as i32 - 1),
        )
    };
    let mut s = format!("{sign}{int}");
    if !frac.is_empty() {
        s.push('.');
        s.push_str(&frac);
    }
    // Without a fraction or an exponent the text would be an integer.
    if e != 0 || frac.is_empty() || rng.coin() {
        s.push_str(&exponent(e, rng));
    }
    s
}

/// `s` as a JSON string, each character literal or escaped (short escape,
/// `\u` in either case, surrogate pair) at random.
fn string_text(s: &str, rng: &mut Rng) -> String {
    let mut out = String::from('"');
    for c in s.chars() {
        let short = match c {
            '"' => Some("\\\""),
            '\\' => Some("\\\\"),
            '/' => Some("\\/"),
            '\n' => Some("\\n"),
            '\t' => Some("\\t"),
            '\r' => Some("\\r"),
            '\u{8}' => Some("\\b"),
            '\u{c}' => Some("\\f"),
            _ => None,
        };
        let literal = c >= ' ' && c != '"' && c != '\\';
        match (rng.below(3), short) {
            (0, _) if literal => out.push(c),
            (1, Some(escape)) => out.push_str(escape),
            _ => {
                let upper = rng.coin();
                for unit in c.encode_utf16(&mut [0; 2]) {
                    out.push_str(&if upper {
                        format!("\\u{unit:04X}")
                    } else {
                        format!("\\u{unit:04x}")
                    });
                }
            }
        }
    }
    out.push('"');
    out
}

/// The canonical text of `v`, written from the documented form and not from
/// Ferry's code: keys sorted by UTF-8 bytes, no whitespace, integers as
/// integers, integral floats up to 2^53 as integers (`-0` as `0`), other
/// floats in Rust's shortest exponent form, strings with serde_json's escapes.
fn spec(v: &Json) -> String {
    match v {
        Json::Null => "null".into(),
        Json::Bool(b) => b.to_string(),
        Json::Int(i) => i.to_string(),
        Json::UInt(u) => u.to_string(),
        Json::Float(f) if f.fract() == 0.0 && f.abs() <= EXACT as f64 => format!("{}", *f as i64),
        Json::Float(f) => format!("{f:e}"),
        Json::Str(s) => spec_string(s),
        Json::Arr(items) => format!("[{}]", items.iter().map(spec).collect::<Vec<_>>().join(",")),
        Json::Obj(entries) => {
            let mut sorted: Vec<&(String, Json)> = entries.iter().collect();
            sorted.sort_by(|(a, _), (b, _)| a.as_bytes().cmp(b.as_bytes()));
            let body: Vec<String> = sorted
                .iter()
                .map(|(k, v)| format!("{}:{}", spec_string(k), spec(v)))
                .collect();
            format!("{{{}}}", body.join(","))
        }
    }
}

fn spec_string(s: &str) -> String {
    let mut out = String::from('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if c < ' ' => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn fingerprint_of(text: &str) -> String {
    fingerprint("charge", 1, "acme", &parse(text)).hex
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Two random spellings of one value (key order, whitespace, number and
    /// string spellings) have one fingerprint.
    #[test]
    fn spellings_of_one_value_have_one_fingerprint(v in json(), a in any::<u64>(), b in any::<u64>()) {
        let (ta, tb) = (render(&v, a), render(&v, b));
        prop_assert_eq!(fingerprint_of(&ta), fingerprint_of(&tb), "{} vs {}", ta, tb);
    }

    /// Whatever the spelling, the canonical text is the documented form.
    #[test]
    fn canonical_text_is_the_spec(v in json(), seed in any::<u64>()) {
        let text = render(&v, seed);
        prop_assert_eq!(canonical_json(&parse(&text)), spec(&v), "canonical text of {}", text);
    }

    /// The canonical text, parsed and canonicalized again, is itself.
    #[test]
    fn canonical_text_is_a_fixed_point(v in json(), seed in any::<u64>()) {
        let once = canonical_json(&parse(&render(&v, seed)));
        prop_assert_eq!(canonical_json(&parse(&once)), once.clone());
    }

    /// Changing one field's value to a different value changes the fingerprint.
    #[test]
    fn changing_a_field_changes_it(
        fields in prop::collection::btree_map(key(), json(), 1..6),
        pick in any::<prop::sample::Index>(),
        new in json(),
        seed in any::<u64>(),
    ) {
        let key = pick.get(&fields.keys().cloned().collect::<Vec<_>>()).clone();
        // A value equal to the old one becomes a different one.
        let new = if spec(&fields[&key]) == spec(&new) { Json::Arr(vec![new]) } else { new };
        let mut changed = fields.clone();
        changed.insert(key, new);
        prop_assert_ne!(fingerprint_of(&render(&object(fields), seed)), fingerprint_of(&render(&object(changed), seed)));
    }

    /// Adding a field changes the fingerprint, even a null one.
    #[test]
    fn adding_a_field_changes_it(
        fields in prop::collection::btree_map(key(), json(), 0..6),
        extra in key(),
        value in prop_oneof![Just(Json::Null), json()],
        seed in any::<u64>(),
    ) {
        let mut extra = extra;
        while fields.contains_key(&extra) {
            extra.push('a');
        }
        let mut changed = fields.clone();
        changed.insert(extra, value);
        prop_assert_ne!(fingerprint_of(&render(&object(fields), seed)), fingerprint_of(&render(&object(changed), seed)));
    }
}

fn object(fields: BTreeMap<String, Json>) -> Json {
    Json::Obj(fields.into_iter().collect())
}
