//! Worker settings and counters.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use crate::retry::RetryPolicy;

/// How a [`Worker`](super::Worker) claims, leases, polls and shuts down.
/// [`WorkerConfig::default`] serves queue `default` with 100 slots, 30 s
/// leases and a random owner name.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Queues served, claimed round-robin.
    pub queues: Vec<String>,
    /// Handlers running at once.
    pub concurrency: usize,
    /// Most jobs taken per claim statement.
    pub batch: u32,
    /// How long the loop waits for more free slots before a claim, so claims
    /// and completions batch under load (default 2 ms).
    pub claim_window: Duration,
    /// How long the completer may wait, before it commits a batch of
    /// completions, for the answers of jobs claimed together with the
    /// batch's jobs (default 1 ms), so that jobs claimed together and
    /// finishing together can share one statement. It never waits once no
    /// claim of the batch's jobs has a job still to answer (a batch of lone
    /// jobs is not delayed), once the batch holds `batch` completions (the
    /// most one statement claims again), once shutdown is signalled, or once
    /// a batch member's lease has less than a renewal period left (nothing
    /// renews it while it waits); zero turns the wait off. A job of another
    /// claim holds a batch only if a completion of its claim is in that
    /// batch. A non-zero window must be shorter than
    /// `(lease - renew period) / 2` (10 s with the defaults).
    pub completion_window: Duration,
    /// Complete-and-claim statements the worker runs at once (default 1;
    /// more made small batches that competed for the CPU in the measurements):
    /// finished jobs are completed, and the next jobs for their slots claimed,
    /// in batches, each one commit.
    pub completions_in_flight: usize,
    /// Lease duration: how long a claim (and each renewal) holds the job
    /// before another worker may take it over.
    pub lease: Duration,
    /// Renewal period (default lease/3).
    pub renew_every: Option<Duration>,
    /// Longest idle wait before polling again (a lost NOTIFY costs at most this).
    pub poll_interval: Duration,
    /// How long shutdown waits for running handlers before releasing their jobs.
    pub grace: Duration,
    /// Retry schedule for retryable and ambiguous failures (backoff, jitter,
    /// `Retry-After` bound).
    pub retry: RetryPolicy,
    /// This worker's identity in leases and attempt history.
    pub owner: String,
    /// Seed of the jitter RNG (random when `None`).
    pub rng_seed: Option<u64>,
}

impl WorkerConfig {
    /// The renewal period in use: `renew_every`, else a third of the lease,
    /// and at least 1 ms.
    pub(crate) fn renew_period(&self) -> Duration {
        self.renew_every.unwrap_or(self.lease / 3).max(Duration::from_millis(1))
    }
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            queues: vec!["default".into()],
            concurrency: 100,
            batch: 50,
            claim_window: Duration::from_millis(2),
            completion_window: Duration::from_millis(1),
            completions_in_flight: 1,
            lease: Duration::from_secs(30),
            renew_every: None,
            poll_interval: Duration::from_millis(500),
            grace: Duration::from_secs(10),
            retry: RetryPolicy::default(),
            owner: format!("worker-{}", uuid::Uuid::now_v7().simple()),
            rng_seed: None,
        }
    }
}

/// Counts of what a worker did, live while it runs and final after
/// [`Worker::run`](super::Worker::run) returns.
#[derive(Debug, Default)]
pub struct WorkerStats {
    /// Attempts whose completion committed: their runs succeeded.
    pub completed: AtomicU64,
    /// Attempts requeued for retry.
    pub retried: AtomicU64,
    /// Jobs made dead (terminal error or attempt budget spent).
    pub dead: AtomicU64,
    /// Attempts abandoned because the lease was lost, the run cancelled, or
    /// the lease expiry the worker last learned passed without a renewal;
    /// also attempts whose completion or failure the database refused.
    pub lost: AtomicU64,
    /// Jobs given back at shutdown without spending an attempt.
    pub released: AtomicU64,
    /// Claim statements the claim loop sent (for free slots no completion
    /// claimed for: at start, after an idle wait, or a short claim).
    pub claim_statements: AtomicU64,
    /// Jobs those claim statements returned.
    pub claimed_by_claim_loop: AtomicU64,
    /// Complete-and-claim statements the completer sent.
    pub completion_statements: AtomicU64,
    /// Jobs claimed by complete-and-claim statements, with the completions
    /// of the jobs whose slots they took.
    pub claimed_with_completions: AtomicU64,
    /// Times the claim loop found every queue empty and waited for a
    /// wake-up or the poll interval.
    pub idle_waits: AtomicU64,
}
