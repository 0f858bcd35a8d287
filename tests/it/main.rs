//! Ferry's integration tests, in one binary: the conformance scenarios run on
//! PostgreSQL and SQLite, plus PostgreSQL-only concurrency and chaos tests
//! and a database outage under a worker (on a cluster of its own); the
//! conformance scenarios of acceptance, jobs, the worker, queues and
//! schedules also run through PgBouncer in transaction pooling (modules
//! `pgbouncer`), and `pooler` holds what only that route needs.

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
mod pooler;
mod queue_events;
mod queues;
mod scheduled;
mod schedules;
mod sql_writers;
mod support;
mod worker;
