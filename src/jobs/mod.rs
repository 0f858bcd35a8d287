//! Durable jobs: claims under expiring leases whose generation only goes up,
//! and fenced transitions.
//!
//! Every renew, complete, retry, fail and effect write matches
//! `state = 'leased' AND owner AND generation AND lease_expires_at > now`;
//! zero rows becomes a typed error ([`Error::LostLease`], [`Error::Cancelled`],
//! [`Error::RunTerminal`], [`Error::DeadlineExceeded`]), never a silent no-op.
//! Terminal transitions write the job, the run, the terminal event and its
//! outbox row in one transaction.
//!
//! The module is split by role: the types and the [`Jobs`] handle here,
//! `lease` (claim, renew, release, the fence), `terminal` (complete, fail,
//! cancel, reap) and `admin` (the queue depth a service's admission reads,
//! the attempt sweep, and the operator's queries and replay). The claim and batch completion,
//! which differ per engine, are in `claim` (`jobs/claim.rs`).

mod admin;
mod claim;
mod lease;
mod terminal;

pub use admin::QueueGauges;

use std::time::Duration;

use rand::RngCore;
use serde_json::Value;
use uuid::Uuid;

use crate::time::Millis;

use crate::error::{Error, Result};
use crate::retry::RetryPolicy;
use crate::store::{on_conn, Conn};
use crate::time::duration_ms;
use crate::Ferry;

/// The lease protocol and maintenance, from [`Ferry::jobs`]: claim, renew,
/// release, complete, fail and the effect writes, each fenced by the lease
/// generation, plus reaping and the sweeps. [`crate::worker::Worker`] and
/// [`crate::worker::JobContext`] call it; a service rarely needs to. It
/// borrows the `Ferry`, so it costs nothing to make.
#[derive(Debug, Clone, Copy)]
pub struct Jobs<'a> {
    pub(crate) ferry: &'a Ferry,
}

/// Proof of a claim: `(tenant, run_id, owner, generation)`. Every later
/// transition of the job is a compare-and-set on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// Tenant.
    pub tenant: String,
    /// Run (one job per run).
    pub run_id: Uuid,
    /// The worker that claimed it.
    pub owner: String,
    /// The claim's generation.
    pub generation: i64,
}

/// A claimed job with its lease and the run's immutable data.
#[derive(Debug, Clone)]
pub struct Claimed {
    /// The lease token.
    pub lease: Lease,
    /// Queue.
    pub queue: String,
    /// This attempt's number, from 1.
    pub attempt: i32,
    /// Attempt budget.
    pub max_attempts: i32,
    /// When the lease expires unless renewed.
    pub lease_expires_at: Millis,
    /// The run's deadline.
    pub deadline_at: Option<Millis>,
    /// When this claim happened.
    pub claimed_at: Millis,
    /// When the run was accepted.
    pub created_at: Millis,
    /// The run's operation.
    pub operation: String,
    /// The run's accepted command.
    pub request: Value,
    /// The dead run this one replays.
    pub replay_of: Option<Uuid>,
}

/// A claimed job row as the claim statement returns it, before the run data.
#[derive(sqlx::FromRow)]
pub(crate) struct ClaimRow {
    pub(crate) tenant: String,
    pub(crate) run_id: Uuid,
    pub(crate) queue: String,
    pub(crate) lease_owner: String,
    pub(crate) lease_generation: i64,
    pub(crate) attempts: i32,
    pub(crate) max_attempts: i32,
    pub(crate) lease_expires_at: Millis,
    pub(crate) deadline_at: Option<Millis>,
    pub(crate) created_at: Millis,
    pub(crate) claimed_at: Millis,
}

crate::store::text_enum! {
    /// A job's state (`jobs.state`). `queued` and `leased` are claimable
    /// (a leased job only past its expiry); the other three are terminal.
    pub enum JobState ("jobs.state") {
        /// Waiting for its `available_at`.
        Queued = "queued",
        /// Held by a worker under a lease.
        Leased = "leased",
        /// Completed; the run succeeded.
        Succeeded = "succeeded",
        /// Terminal error or budget spent; the run failed.
        Dead = "dead",
        /// The run was cancelled.
        Cancelled = "cancelled",
    }
}

crate::store::text_enum! {
    /// How one claim of a job ended (`job_attempts.outcome`).
    pub enum AttemptOutcome ("job_attempts.outcome") {
        /// The worker completed it.
        Succeeded = "succeeded",
        /// It failed and was requeued.
        Retried = "retried",
        /// It failed for good: the job is dead.
        Dead = "dead",
        /// The run was cancelled while it ran.
        Cancelled = "cancelled",
        /// Its lease expired and another claim took over.
        Lost = "lost",
        /// The worker gave it back without spending the attempt.
        Released = "released",
    }
}

/// A run's terminal transition: the run state it sets and the event it appends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Terminal {
    Succeeded,
    Failed,
    Cancelled,
}

impl Terminal {
    pub(crate) fn run_state(self) -> crate::RunState {
        match self {
            Terminal::Succeeded => crate::RunState::Succeeded,
            Terminal::Failed => crate::RunState::Failed,
            Terminal::Cancelled => crate::RunState::Cancelled,
        }
    }

    pub(crate) fn event_kind(self) -> &'static str {
        match self {
            Terminal::Succeeded => "run_succeeded",
            Terminal::Failed => "run_failed",
            Terminal::Cancelled => "run_cancelled",
        }
    }
}

/// A job row's scheduling facts, as `get_job` reads them.
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct JobRow {
    pub(crate) queue: String,
    pub(crate) max_attempts: i32,
    /// Kept by a replay.
    pub(crate) priority: i16,
}

/// What a fenced end of a lease returns.
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct Finished {
    /// The clock's now, as the statement saw it.
    pub(crate) now: i64,
}

/// How a failed attempt should be treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorClass {
    /// Try again after a backoff.
    Retryable,
    /// Never retry: the job goes dead at once.
    Terminal,
    /// An external effect may or may not have happened: the attempt's
    /// reserved effects become `unknown` and must be reconciled before the
    /// step repeats; the job is retried.
    Ambiguous,
}

impl ErrorClass {
    /// The stored text: `retryable`, `terminal` or `ambiguous`.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorClass::Retryable => "retryable",
            ErrorClass::Terminal => "terminal",
            ErrorClass::Ambiguous => "ambiguous",
        }
    }
}

/// A handler's failure: its class, a safe machine code (stored and
/// published), and an optional `Retry-After` hint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobError {
    /// Retry classification.
    pub class: ErrorClass,
    /// Safe error code, `[A-Za-z0-9._:-]`, stored in the attempt history and
    /// the `run_failed` event. Never put secrets or payloads here.
    pub code: String,
    /// A provider's `Retry-After`, honoured up to the policy's bound.
    pub retry_after: Option<Duration>,
}

impl JobError {
    /// A retryable failure.
    pub fn retryable(code: impl Into<String>) -> Self {
        Self::new(ErrorClass::Retryable, code)
    }

    /// A terminal failure.
    pub fn terminal(code: impl Into<String>) -> Self {
        Self::new(ErrorClass::Terminal, code)
    }

    /// An ambiguous failure (an external call's outcome is unknown).
    pub fn ambiguous(code: impl Into<String>) -> Self {
        Self::new(ErrorClass::Ambiguous, code)
    }

    fn new(class: ErrorClass, code: impl Into<String>) -> Self {
        JobError {
            class,
            code: code.into(),
            retry_after: None,
        }
    }

    /// Adds a `Retry-After` hint.
    pub fn retry_after(mut self, d: Duration) -> Self {
        self.retry_after = Some(d);
        self
    }
}

impl std::fmt::Display for JobError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} error {}", self.class.as_str(), self.code)
    }
}

impl std::error::Error for JobError {}

/// A library error inside a handler keeps its retry classification, so `?`
/// works on Ferry calls in a handler. Transient errors (database
/// unreachable, timeouts, serialization failure, a part shutting down) are
/// retryable, and so is a lost lease: the worker's own clock can see the
/// lease end before the database does, and whether the attempt may still be
/// recorded is the fence's decision, not the handler's (a retry requeues the
/// job if the lease still holds; otherwise the fence refuses and the new
/// holder goes on). Every other refusal (a cancelled or finished run, a
/// passed deadline, invalid input) is terminal: the job dies with the
/// error's stable code.
impl From<crate::Error> for JobError {
    fn from(e: crate::Error) -> Self {
        if e.is_transient() || matches!(e, crate::Error::LostLease { .. }) {
            JobError::retryable(e.code())
        } else {
            JobError::terminal(e.code())
        }
    }
}

/// What [`crate::Jobs::fail`] did with the attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FailOutcome {
    /// Requeued, claimable again at `available_at`.
    Retried {
        /// Persisted instant of the next attempt.
        available_at: Millis,
    },
    /// The job is dead and the run failed with `code`.
    Dead {
        /// The safe code in the `run_failed` event.
        code: String,
    },
}

/// One claim's history entry.
#[derive(Debug, Clone, PartialEq, serde::Serialize, sqlx::FromRow)]
pub struct JobAttempt {
    /// Attempt number. A released claim gives its number back, so the claim
    /// after a release repeats it.
    pub attempt: i32,
    /// Lease generation of the claim: unique per claim, the row's key, and
    /// the history's order.
    pub generation: i64,
    /// Worker that claimed it.
    pub worker: String,
    /// Claimed at.
    pub claimed_at: Millis,
    /// Finished at (`None` while running or when the worker vanished).
    pub finished_at: Option<Millis>,
    /// How it ended; `None` while it runs.
    pub outcome: Option<AttemptOutcome>,
    /// `retryable`, `terminal` or `ambiguous`.
    pub error_class: Option<String>,
    /// The safe error code.
    pub error_code: Option<String>,
}

/// A job as operators list it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, sqlx::FromRow)]
pub struct JobSummary {
    /// Tenant.
    pub tenant: String,
    /// Run.
    pub run_id: Uuid,
    /// Queue.
    pub queue: String,
    /// Its state.
    pub state: JobState,
    /// Attempts spent.
    pub attempts: i32,
    /// Attempt budget.
    pub max_attempts: i32,
    /// Current lease holder.
    pub lease_owner: Option<String>,
    /// Last safe error code.
    pub last_error_code: Option<String>,
    /// Last change.
    pub updated_at: Millis,
}

/// A dead job with its preserved evidence.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DeadJob {
    /// Tenant.
    pub tenant: String,
    /// Run.
    pub run_id: Uuid,
    /// Queue.
    pub queue: String,
    /// Operation.
    pub operation: String,
    /// The code it died with.
    pub error_code: Option<String>,
    /// Attempts spent.
    pub attempts: i32,
    /// When it died.
    pub died_at: Millis,
    /// Every recorded attempt.
    pub history: Vec<JobAttempt>,
}

#[derive(sqlx::FromRow)]
struct DeadRow {
    tenant: String,
    run_id: Uuid,
    queue: String,
    last_error_code: Option<String>,
    attempts: i32,
    updated_at: Millis,
    operation: String,
}

/// Facts read to explain why a fenced statement matched nothing.
#[derive(sqlx::FromRow)]
struct JobStatus {
    state: JobState,
    lease_owner: Option<String>,
    lease_generation: i64,
    lease_expires_at: Option<i64>,
    deadline_at: Option<i64>,
    run_state: String,
    now: i64,
}

/// Which transition was refused, to name the right error.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Transition {
    Renew,
    Finish,
}

impl ClaimRow {
    pub(crate) fn into_claimed(self, operation: String, request: Value, replay_of: Option<Uuid>) -> Claimed {
        Claimed {
            lease: Lease {
                tenant: self.tenant,
                run_id: self.run_id,
                owner: self.lease_owner,
                generation: self.lease_generation,
            },
            queue: self.queue,
            attempt: self.attempts,
            max_attempts: self.max_attempts,
            lease_expires_at: self.lease_expires_at,
            deadline_at: self.deadline_at,
            claimed_at: self.claimed_at,
            created_at: self.created_at,
            operation,
            request,
            replay_of,
        }
    }
}

/// Closes the attempt row of `lease`'s claim, found by its generation.
pub(crate) async fn close_attempt(
    conn: Conn<'_>,
    lease: &Lease,
    now: i64,
    outcome: AttemptOutcome,
    class: Option<ErrorClass>,
    code: Option<&str>,
) -> Result<()> {
    on_conn!(conn, |c, q| {
        sqlx::query(q.close_attempt)
            .bind(&lease.tenant)
            .bind(lease.run_id)
            .bind(lease.generation)
            .bind(now)
            .bind(outcome)
            .bind(class.map(ErrorClass::as_str))
            .bind(code)
            .execute(&mut *c)
            .await?;
    });
    Ok(())
}

pub(crate) fn positive_ms(field: &'static str, d: Duration) -> Result<i64> {
    let ms = duration_ms(d)?;
    if ms <= 0 {
        return Err(Error::invalid(field, "must be at least 1 ms"));
    }
    Ok(ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn library_errors_keep_their_retry_classification_in_a_handler() {
        let retried = [
            crate::Error::Database(sqlx::Error::PoolTimedOut),
            crate::Error::ShuttingDown("completer stopped"),
            crate::Error::Raced("the idempotency record was swept"),
            crate::Error::LostLease {
                run_id: Uuid::nil(),
                generation: 1,
            },
        ];
        for e in retried {
            let code = e.code();
            let j = JobError::from(e);
            assert_eq!((j.class, j.code.as_str()), (ErrorClass::Retryable, code));
        }
        let terminal = [
            crate::Error::Cancelled { run_id: Uuid::nil() },
            crate::Error::DeadlineExceeded { run_id: Uuid::nil() },
            crate::Error::invalid("result", "too large"),
        ];
        for e in terminal {
            let code = e.code();
            let j = JobError::from(e);
            assert_eq!((j.class, j.code.as_str()), (ErrorClass::Terminal, code));
        }
    }

    #[test]
    fn states_pad_like_strings_in_tables() {
        assert_eq!(format!("[{:<8}]", JobState::Dead), "[dead    ]");
        assert_eq!("leased".parse::<JobState>().unwrap(), JobState::Leased);
        assert_eq!("nope".parse::<JobState>().unwrap_err().code(), "invalid_input");
    }
}
