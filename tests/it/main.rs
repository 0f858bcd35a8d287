//! Ferry's integration tests, in one binary: the conformance scenarios run on
//! PostgreSQL and SQLite, plus PostgreSQL-only concurrency and chaos tests
//! and a database outage under a worker (on a cluster of its own).

mod accept;
mod architecture;
mod batch;
mod bulk;

mod fingerprint;
mod input;
mod inspect;
mod jobs;
mod ledger;
mod outage;
mod outbox;
mod pg;
mod queue_events;
mod queues;
mod scheduled;
mod schedules;
mod sql_writers;
mod support;
mod worker;
