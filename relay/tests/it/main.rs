//! ferry-relay against PostgreSQL and a real Kafka-protocol broker.

mod relay;
mod support;
mod trace;
