//! Request fingerprints: SHA-256 over a versioned canonical form of the
//! validated command, which decides whether a key's replay is the same
//! request or a conflict.
//!
//! The canonical form is JSON with object keys sorted by their UTF-8 bytes,
//! no insignificant whitespace, and numbers normalized (`1`, `1.0` and `1e0`
//! are the same number). It covers the operation, the schema version, the
//! tenant and the command after defaults, never a server-generated id. The
//! version of this scheme, [`FINGERPRINT_VERSION`], is stored beside every
//! fingerprint.

use serde_json::Value;
use sha2::{Digest, Sha256};

/// Version of the canonical form; bump it when the form changes.
pub const FINGERPRINT_VERSION: i32 = 1;

/// A computed request fingerprint (lowercase hex SHA-256).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint {
    /// The hex digest.
    pub hex: String,
    /// The canonical-form version that produced it.
    pub version: i32,
}

/// Fingerprints `command` for `(operation, schema_version, tenant)`.
pub fn fingerprint(operation: &str, schema_version: u32, tenant: &str, command: &Value) -> Fingerprint {
    // The canonical form of the envelope {command, fingerprint_version,
    // operation, schema_version, tenant}, written directly (its keys are
    // already in byte order) instead of cloning the command into a Value.
    let mut canonical = Vec::with_capacity(128);
    canonical.extend_from_slice(b"{\"command\":");
    write_canonical(command, &mut canonical);
    canonical.extend_from_slice(b",\"fingerprint_version\":");
    write_int(i64::from(FINGERPRINT_VERSION), &mut canonical);
    canonical.extend_from_slice(b",\"operation\":");
    write_str(operation, &mut canonical);
    canonical.extend_from_slice(b",\"schema_version\":");
    write_int(i64::from(schema_version), &mut canonical);
    canonical.extend_from_slice(b",\"tenant\":");
    write_str(tenant, &mut canonical);
    canonical.push(b'}');
    Fingerprint {
        hex: hex::encode(Sha256::digest(&canonical)),
        version: FINGERPRINT_VERSION,
    }
}

/// The canonical text of `value`: sorted keys, no whitespace, normalized numbers.
pub fn canonical_json(value: &Value) -> String {
    let mut out = Vec::new();
    write_canonical(value, &mut out);
    // Only JSON text and whole UTF-8 strings were written.
    String::from_utf8_lossy(&out).into_owned()
}

fn write_canonical(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(b) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
        Value::Number(n) => write_number(n, out),
        Value::String(s) => write_str(s, out),
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(item, out);
            }
            out.push(b']');
        }
        Value::Object(map) => {
            // Sorted here, by the UTF-8 bytes of the key, whatever order the
            // map iterates in: serde_json's `preserve_order` feature (which any
            // crate in the build can switch on) makes it insertion order. Byte
            // order is the order of the default BTreeMap, so it is what v1
            // fingerprints were computed with. Keys are unique: the sort is total.
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_unstable_by(|(a, _), (b, _)| a.as_bytes().cmp(b.as_bytes()));
            out.push(b'{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_str(k, out);
                out.push(b':');
                write_canonical(v, out);
            }
            out.push(b'}');
        }
    }
}

/// A string as serde_json writes it (quoted, with its escapes).
fn write_str(s: &str, out: &mut Vec<u8>) {
    // Writing a str into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, s);
}

fn write_int(i: i64, out: &mut Vec<u8>) {
    use std::io::Write;
    let _ = write!(out, "{i}");
}

/// Integers print as integers; a float with an integral value of magnitude at
/// most 2^53 prints as that integer; other floats print in Rust's shortest
/// round-trip exponent form (`5e-1`, `1.5e0`, `1e16`). `-0`, `-0.0` and `0.0`
/// are `0`.
///
/// So `1`, `1.0`, `1e0` and `10e-1` agree, and integers beyond 2^53 keep every
/// digit (`18446744073709551615` and `18446744073709551614` differ). A float
/// with an integral value above 2^53 stays in exponent form even when it is
/// exact: `1e16` and `1.0e16` are `1e16`, while the integer `10000000000000000`
/// is itself. That is the v1 form; changing it changes fingerprints and needs a
/// new [`FINGERPRINT_VERSION`].
///
/// The form is defined on the parsed [`Value`]: a float is whatever `f64` the
/// caller's JSON parser produced from the text.
fn write_number(n: &serde_json::Number, out: &mut Vec<u8>) {
    use std::io::Write;
    if let Some(i) = n.as_i64() {
        let _ = write!(out, "{i}");
    } else if let Some(u) = n.as_u64() {
        let _ = write!(out, "{u}");
    } else if let Some(f) = n.as_f64() {
        const EXACT: f64 = 9_007_199_254_740_992.0; // 2^53
        if f.fract() == 0.0 && f.abs() <= EXACT {
            let _ = write!(out, "{}", f as i64);
        } else {
            let _ = write!(out, "{f:e}");
        }
    }
}

/// A short, non-reversible label for a secret-ish string (an idempotency key),
/// safe for logs and error text: the first 12 hex digits of its SHA-256.
pub fn redact(secret: &str) -> String {
    let digest = Sha256::digest(secret.as_bytes());
    hex::encode(&digest[..6])
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn numbers_are_normalized() {
        let a: Value = serde_json::from_str(r#"{"n": 1.0, "m": 1e2, "z": -0.0}"#).unwrap();
        let b: Value = serde_json::from_str(r#"{"z":0,"m":100,"n":1}"#).unwrap();
        assert_eq!(canonical_json(&a), canonical_json(&b));
        assert_eq!(canonical_json(&b), r#"{"m":100,"n":1,"z":0}"#);
        assert_ne!(canonical_json(&json!(0.5)), canonical_json(&json!(0.25)));
    }

    #[test]
    fn envelope_fields_all_count() {
        let c = json!({"amount": 5});
        let base = fingerprint("charge", 1, "t1", &c);
        assert_ne!(base, fingerprint("refund", 1, "t1", &c));
        assert_ne!(base, fingerprint("charge", 2, "t1", &c));
        assert_ne!(base, fingerprint("charge", 1, "t2", &c));
        assert_eq!(base.hex.len(), 64);
    }

    #[test]
    fn redact_hides_the_key() {
        let r = redact("customer-secret-key-123");
        assert_eq!(r.len(), 12);
        assert!(!r.contains("secret"));
    }
}
