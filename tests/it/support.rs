//! Test databases come from `ferry-testkit`: a fresh PostgreSQL schema or
//! SQLite file per test, migrated, so tests run in parallel. PostgreSQL must
//! be reachable: a test that needs it fails with a message naming what is
//! missing.

pub use ferry::Engine as Kind;
pub use ferry_testkit::{manual_clock, TestDb, T0};
pub use ferry_testkit::{on_both_engines, on_every_route};

use ferry::NewRun;
use serde_json::json;

/// A run of operation `charge` for tenant `acme` under `key`.
pub fn charge(key: &str, amount: i64) -> NewRun {
    NewRun::new("acme", "charge", key, json!({"amount": amount, "currency": "EUR"}))
}

/// Rows in runs, run_events, jobs, idempotency_keys and outbox: what one
/// acceptance writes (one each).
pub async fn counts(t: &TestDb) -> [i64; 5] {
    [
        t.scalar("SELECT count(*) FROM runs").await,
        t.scalar("SELECT count(*) FROM run_events").await,
        t.scalar("SELECT count(*) FROM jobs").await,
        t.scalar("SELECT count(*) FROM idempotency_keys").await,
        t.scalar("SELECT count(*) FROM outbox").await,
    ]
}
