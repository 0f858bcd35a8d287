//! A record waiting, its partition paused, for its next attempt (with the
//! dead letter it may still owe), and what follows an attempt.

use std::time::{Duration, Instant};

use crate::store::PartitionLease;
use backon::{BackoffBuilder, ExponentialBuilder};

use super::Consumer;
use crate::record::Record;

/// A record waiting for its next attempt while its partition is paused.
pub(super) struct Retry {
    /// Generation of the lease the record was fetched under.
    pub(super) generation: i64,
    pub(super) record: Record,
    pub(super) effect_key: String,
    /// Failed attempts charged to the record's retry budget: the handler's
    /// retryable errors only, never an infrastructure error.
    pub(super) attempts: u32,
    pub(super) due: Instant,
    pub(super) backoff: Box<dyn Iterator<Item = Duration> + Send>,
    /// Set when the record is being dead-lettered and that failed: the next
    /// attempt only finishes the dead letter.
    pub(super) dead_letter: Option<PendingDeadLetter>,
}

/// A dead letter not yet finished.
#[derive(Debug, Clone)]
pub(super) struct PendingDeadLetter {
    /// The `ferry-error-code` header.
    pub(super) code: String,
    /// The dead-letter topic already has the record: only the ledger write
    /// is left (a retry does not publish it twice).
    pub(super) published: bool,
}

/// What follows a record's attempt (short-lived, so the retry is not boxed).
#[allow(clippy::large_enum_variant)]
pub(super) enum Step {
    /// Done (applied, duplicate or dead-lettered): the offset moved.
    Done,
    /// Try again later with the partition paused; nothing moved.
    Retry(Retry),
    /// The lease is gone; leave the partition alone.
    Stop,
}

impl Consumer {
    /// A first retry of `record`, nothing charged to its budget yet:
    /// exponential backoff with jitter from the retry base up to its cap,
    /// without an end (the budget bounds the handler's retryable errors;
    /// infrastructure errors and dead letters are retried until they pass).
    pub(super) fn new_retry(&self, lease: &PartitionLease, record: &Record, effect_key: &str) -> Retry {
        let b = &self.b;
        Retry {
            generation: lease.generation,
            record: record.clone(),
            effect_key: effect_key.to_owned(),
            attempts: 0,
            due: Instant::now(),
            backoff: Box::new(
                ExponentialBuilder::default()
                    .with_min_delay(b.retry_base)
                    .with_max_delay(b.retry_cap)
                    .with_jitter()
                    .without_max_times()
                    .build(),
            ),
            dead_letter: None,
        }
    }
}
