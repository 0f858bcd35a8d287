//! Property tests: the fingerprint ignores key order and whitespace, and any
//! change to a field value changes it.

use ferry::fingerprint;
use proptest::prelude::*;
use serde_json::{Map, Value};

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        "[a-z0-9 ]{0,12}".prop_map(Value::from),
        Just(Value::Null),
    ]
}

fn command() -> impl Strategy<Value = Map<String, Value>> {
    prop::collection::btree_map("[a-z]{1,8}", leaf(), 1..8).prop_map(|m| m.into_iter().collect())
}

/// Serializes `map` with its keys in the given order and optional spacing.
fn render(map: &Map<String, Value>, order: &[usize], spaced: bool) -> String {
    let keys: Vec<&String> = map.keys().collect();
    let sep = if spaced { " ,\n  " } else { "," };
    let colon = if spaced { " : " } else { ":" };
    let body: Vec<String> = order
        .iter()
        .map(|&i| format!("{}{colon}{}", Value::from(keys[i].as_str()), map[keys[i]]))
        .collect();
    format!("{{{}{}}}", if spaced { "\n " } else { "" }, body.join(sep))
}

proptest! {
    #[test]
    fn key_order_and_whitespace_never_change_it(cmd in command(), seed in any::<u64>(), spaced in any::<bool>()) {
        let mut order: Vec<usize> = (0..cmd.len()).collect();
        // A deterministic shuffle from the seed.
        let mut s = seed;
        for i in (1..order.len()).rev() {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            order.swap(i, (s >> 33) as usize % (i + 1));
        }
        let a: Value = serde_json::from_str(&render(&cmd, &(0..cmd.len()).collect::<Vec<_>>(), false)).unwrap();
        let b: Value = serde_json::from_str(&render(&cmd, &order, spaced)).unwrap();
        prop_assert_eq!(fingerprint("charge", 1, "acme", &a), fingerprint("charge", 1, "acme", &b));
    }

    #[test]
    fn any_field_change_changes_it(cmd in command(), pick in any::<prop::sample::Index>(), new in leaf()) {
        let key = pick.get(&cmd.keys().cloned().collect::<Vec<_>>()).clone();
        prop_assume!(cmd[&key] != new);
        let mut changed = cmd.clone();
        changed.insert(key, new);
        let a = fingerprint("charge", 1, "acme", &Value::Object(cmd));
        let b = fingerprint("charge", 1, "acme", &Value::Object(changed));
        prop_assert_ne!(a, b);
    }

    #[test]
    fn adding_a_field_changes_it(cmd in command(), extra in "[A-Z]{1,4}", v in leaf()) {
        let mut changed = cmd.clone();
        changed.insert(extra, v);
        prop_assert_ne!(
            fingerprint("charge", 1, "acme", &Value::Object(cmd)),
            fingerprint("charge", 1, "acme", &Value::Object(changed))
        );
    }
}
