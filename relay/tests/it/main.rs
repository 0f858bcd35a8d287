//! ferry-relay against PostgreSQL and Apache Kafka.

mod exactly_once;
mod relay;
mod support;
mod trace;
