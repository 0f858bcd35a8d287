//! Test support for Ferry and for services built on it, never linked into a
//! production binary: a real Apache Kafka broker per test, reused reset by
//! the next test of the process, or of the run's other test processes
//! ([`Kafka`]), a
//! fresh PostgreSQL schema or SQLite file per test
//! ([`fresh_database_url`]), a PostgreSQL cluster of a test's own that the
//! test can stop and restart ([`PgCluster`], for database outages, with a
//! synchronous standby to promote), a TCP fault proxy between a client and
//! its services ([`Toxiproxy`]: half-open connections, latency, resets), and the
//! `ferry-test-worker` binary the chaos tests SIGKILL mid-job, and the
//! outbox's states as its readers see them with the delivered-ranges ledger
//! ([`OUTBOX`]). Every helper
//! fails with a message naming what is missing; none lets a test pass
//! without its service.

mod db;
mod harness;
mod kafka;
mod outbox;
mod pg;
mod ports;
mod toxiproxy;
mod watchdog;

pub use db::{fresh_database_behind_pgbouncer, fresh_database_url, pgbouncer_url, postgres_url, TestDbError};
pub use harness::{fresh_postgres, fresh_url, manual_clock, through_pooler, TestDb, T0};
pub use kafka::*;
pub use outbox::{assert_delivered_unwritten, outbox_states, OUTBOX};
pub use pg::PgCluster;
pub use toxiproxy::{Proxy, Toxiproxy};
