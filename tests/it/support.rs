//! Test databases come from `ferry-testkit`: a fresh PostgreSQL schema or
//! SQLite file per test, migrated, so tests run in parallel. PostgreSQL must
//! be reachable: a test that needs it fails with a message naming what is
//! missing.

pub use ferry::Engine as Kind;
pub use ferry_testkit::on_both_engines;
pub use ferry_testkit::{manual_clock, TestDb, T0};
