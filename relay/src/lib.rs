//! `ferry-relay`: the sidecar that publishes Ferry's transactional outbox to
//! Kafka (`run`, with `migrate` and `status` for the deployment files).
//!
//! Outbox rows carry `lane = murmur2(key) mod lanes`. Relay instances lease
//! lanes with generations that only go up and split them fairly; each held
//! lane is published in `id` order through an idempotent producer
//! (`acks=all`), and rows are marked delivered only after acknowledgement,
//! under the lane generation. On PostgreSQL the relay can instead read the
//! outbox's inserts from the write-ahead log (`--capture wal`, [`wal`]),
//! in commit order, through one replication slot per relay group.
#![forbid(unsafe_code)]
#![deny(clippy::print_stdout)]

pub mod cli;
pub mod config;
pub mod debezium;
pub mod error;
pub mod exactly_once;
pub mod http;
pub mod lane;
pub mod metrics;
pub mod publish;
pub mod service;
pub mod state;
pub mod store;
pub mod wal;

pub use config::{Capture, OnPoison, RelayConfig};
pub use error::RelayError;
pub use service::{run, Relay};
