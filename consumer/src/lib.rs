//! `ferry-consumer`: consumer-group library with effect-ledger dedupe. This
//! crate is a skeleton until the consumer lands.
#![forbid(unsafe_code)]

pub use ferry;
