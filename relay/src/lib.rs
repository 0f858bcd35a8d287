//! `ferry-relay`: publishes the outbox to Kafka. This crate is a skeleton
//! until the relay lands; it links the `ferry` library to keep the workspace
//! honest.
#![forbid(unsafe_code)]

pub use ferry;
