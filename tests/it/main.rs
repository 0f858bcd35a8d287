//! Ferry's integration tests, in one binary: the conformance scenarios run on
//! PostgreSQL and SQLite, plus PostgreSQL-only concurrency and chaos tests.

mod accept;
mod bulk;

mod fingerprint;
mod input;
mod inspect;
mod jobs;
mod outbox;
mod pg;
mod queues;
mod scheduled;
mod schedules;
mod support;
mod worker;
