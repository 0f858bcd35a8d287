//! ferry-relay against PostgreSQL and Apache Kafka.

mod alerts;
mod capture;
mod debezium;
mod effect_keys;
mod exactly_once;
mod job_gauges;
mod lanes;
mod outage;
mod poison;
mod queries;
mod relay;
mod support;
mod trace;
mod wal_exactly_once;
mod wal_failover;
mod wal_faults;
mod wal_network;
mod wal_streams;
mod writers;
