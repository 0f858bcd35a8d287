//! What a handler gets beside the job: its lease, the job's facts, and the
//! effect ledger under that lease.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::lease_watch::LeaseWatch;
use crate::effects::{EffectRecord, Reservation, Resolution};
use crate::error::{Error, Result};
use crate::jobs::{Claimed, Lease};
use crate::Ferry;

/// What a handler gets beside the job: its lease, the effect ledger under
/// that lease, and a token cancelled on shutdown, cancellation or lease loss.
/// Once the worker gives the attempt up (lease lost, or the expiry it last
/// learned has passed), the effect methods refuse with [`Error::LostLease`]
/// without writing, in clones held by spawned tasks too.
///
/// It also carries the claimed job's facts (run, attempt, queue,
/// operation, deadline), so a [`Router`](super::Router) handler, which gets
/// a typed command instead of the [`Claimed`] job, still knows them.
#[derive(Debug, Clone)]
pub struct JobContext {
    ferry: Ferry,
    lease: Lease,
    pub(super) cancel: CancellationToken,
    watch: Arc<LeaseWatch>,
    job: Arc<JobFacts>,
}

/// The claimed job's facts, without its request.
#[derive(Debug)]
struct JobFacts {
    queue: String,
    attempt: i32,
    max_attempts: i32,
    deadline_at: Option<crate::Millis>,
    operation: String,
    replay_of: Option<Uuid>,
}

impl JobContext {
    /// The context of the attempt `job`, with a fresh cancellation token.
    pub(super) fn new(ferry: Ferry, job: &Claimed, watch: Arc<LeaseWatch>) -> Self {
        JobContext {
            ferry,
            lease: job.lease.clone(),
            cancel: CancellationToken::new(),
            watch,
            job: Arc::new(JobFacts {
                queue: job.queue.clone(),
                attempt: job.attempt,
                max_attempts: job.max_attempts,
                deadline_at: job.deadline_at,
                operation: job.operation.clone(),
                replay_of: job.replay_of,
            }),
        }
    }

    /// The lease this attempt holds.
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// The run this job works (`lease().run_id`).
    pub fn run_id(&self) -> Uuid {
        self.lease.run_id
    }

    /// This attempt's number, from 1 ([`Claimed::attempt`]).
    pub fn attempt(&self) -> i32 {
        self.job.attempt
    }

    /// The job's attempt budget: the attempt numbered this is the last one.
    pub fn max_attempts(&self) -> i32 {
        self.job.max_attempts
    }

    /// The queue the job was claimed from.
    pub fn queue(&self) -> &str {
        &self.job.queue
    }

    /// The run's operation, the name a [`Router`](super::Router) dispatches on.
    pub fn operation(&self) -> &str {
        &self.job.operation
    }

    /// The instant (clock milliseconds) the run must finish by: no lease
    /// of it is renewed past this.
    pub fn deadline_at(&self) -> Option<crate::Millis> {
        self.job.deadline_at
    }

    /// The dead run this one replays, when an operator replayed it.
    pub fn replay_of(&self) -> Option<Uuid> {
        self.job.replay_of
    }

    /// Cancelled when the handler should stop: shutdown, run cancelled, or lease lost.
    pub fn cancellation(&self) -> &CancellationToken {
        &self.cancel
    }

    /// [`Jobs::reserve_effect`](crate::Jobs::reserve_effect) under this lease.
    pub async fn reserve_effect(&self, step: &str, operation: &str) -> Result<Reservation> {
        self.live()?;
        self.ferry.jobs().reserve_effect(&self.lease, step, operation).await
    }

    /// [`Jobs::record_effect_success`](crate::Jobs::record_effect_success) under this lease.
    pub async fn record_effect_success(&self, step: &str, operation: &str, provider_ref: &str) -> Result<EffectRecord> {
        self.live()?;
        self.ferry
            .jobs()
            .record_effect_success(&self.lease, step, operation, provider_ref)
            .await
    }

    /// [`Jobs::record_effect_failure`](crate::Jobs::record_effect_failure) under this lease.
    pub async fn record_effect_failure(
        &self,
        step: &str,
        operation: &str,
        code: &str,
        ambiguous: bool,
    ) -> Result<EffectRecord> {
        self.live()?;
        self.ferry
            .jobs()
            .record_effect_failure(&self.lease, step, operation, code, ambiguous)
            .await
    }

    /// [`Jobs::reconcile_effect`](crate::Jobs::reconcile_effect) under this lease.
    pub async fn reconcile_effect(&self, step: &str, operation: &str, resolution: Resolution) -> Result<Reservation> {
        self.live()?;
        self.ferry
            .jobs()
            .reconcile_effect(&self.lease, step, operation, resolution)
            .await
    }

    /// Accepts a follow-up run with this run as its parent, in a
    /// transaction of its own fenced by this lease ([`Ferry::enqueue_run_in`]).
    /// The worker completes the job after the handler returns, so the child
    /// commits first: give it an idempotency key derived from this run, and
    /// a retried attempt replays it instead of creating another. For a child
    /// that commits with the completion, claim and [`Jobs::complete_in`](crate::Jobs::complete_in)
    /// outside the worker.
    pub async fn enqueue_run(&self, run: crate::NewRun) -> Result<crate::Accepted> {
        self.live()?;
        let mut tx = self.ferry.begin().await?;
        let r = self.ferry.enqueue_run_in(tx.conn(), &self.lease, run).await;
        tx.finish(r).await
    }

    /// Refuses locally once the worker has given the attempt up or the
    /// known expiry has passed; the database fence still checks the rest.
    fn live(&self) -> Result<()> {
        if self.watch.expired() {
            return Err(Error::LostLease {
                run_id: self.lease.run_id,
                generation: self.lease.generation,
            });
        }
        Ok(())
    }
}
