//! Runs, their events, and the acceptance transaction (atomic: run, first
//! event, job, idempotency record and outbox row commit together).
//!
//! [`Ferry::create_run_idempotent`] commits the run, `run_queued` at seq 1,
//! the claimable job, the idempotency record and the event's outbox row
//! together. The idempotency key is claimed first, through the primary key
//! (`ON CONFLICT`), so two racing requests produce one run and the loser
//! reads the winner's record once it commits.
//!
//! [`Ferry::create_runs_idempotent`] accepts many runs in one transaction,
//! answering each as the single call would (set-based on PostgreSQL, in
//! `runs/bulk.rs`).
//!
//! The types are here; `accept` holds the acceptance transaction,
//! `events` reading runs and appending events, and `inspect` listing runs
//! and a run's lineage.

mod accept;
mod bulk;
mod document;
mod events;
mod inspect;

pub(crate) use accept::{check_equivalent, queued_body, refuses_only_its_item};
pub(crate) use events::{event_payload, get_run_in, run_event_message, write_event, Event};
pub use inspect::{OutboxRow, RunCursor, RunFilter, RunLineage, RunPage, RunSummary, MAX_PAGE};

use std::time::Duration;

use serde_json::Value;
use sqlx::types::Json;
use uuid::Uuid;

use crate::time::Millis;

use crate::error::{Error, Result};
use crate::outbox::{self};
use crate::time::duration_ms;
use crate::Ferry;

/// Event kinds that end a run; exactly one of them per run.
pub const TERMINAL_KINDS: [&str; 3] = ["run_succeeded", "run_failed", "run_cancelled"];

/// The lowest (and default) claim priority of a run.
pub const MIN_PRIORITY: i16 = 0;
/// The highest claim priority of a run.
pub const MAX_PRIORITY: i16 = 100;

/// A request to accept a run. Build with [`NewRun::new`] and the setters.
#[derive(Debug, Clone)]
pub struct NewRun {
    /// Tenant of the authenticated caller.
    pub tenant: String,
    /// The operation, which also scopes the idempotency key.
    pub operation: String,
    /// Version of the command's schema, part of the fingerprint.
    pub schema_version: u32,
    /// The client's idempotency key.
    pub idempotency_key: String,
    /// The validated command, defaults applied.
    pub command: Value,
    /// A proposed run id (a fresh UUIDv7 when `None`). Never fingerprinted.
    pub run_id: Option<Uuid>,
    /// Queue the job goes to (default `default`).
    pub queue: String,
    /// Attempt budget (default 5).
    pub max_attempts: u32,
    /// Time the run has to finish, from acceptance. Leases never extend past it.
    pub deadline: Option<Duration>,
    /// Claim priority, [`MIN_PRIORITY`] (the default) to [`MAX_PRIORITY`],
    /// higher first. Aging keeps low priorities from starving: a job of
    /// priority `p` is claimed as if it had become available `p` aging
    /// steps earlier ([`crate::FerryBuilder::priority_aging`]), so a lower
    /// one that has waited longer than the difference goes first.
    pub priority: i16,
    /// W3C trace context of the accepting request.
    pub traceparent: Option<String>,
    /// When the job may first be claimed ([`NewRun::run_at`], [`NewRun::delay`]);
    /// `None`: at once. Not part of the fingerprint: a retried request with
    /// another start is a replay of the first (see [`Start`]).
    pub start: Option<Start>,
    /// The run (same tenant) this one follows in a workflow: recorded as
    /// `parent_run_id`, and it must exist ([`Error::NotFound`] otherwise).
    pub parent_run_id: Option<Uuid>,
    pub(crate) replay_of: Option<Uuid>,
}

/// When a scheduled run's job may first be claimed.
///
/// A start is not part of the request fingerprint: a client retrying a POST
/// with `.delay(60s)` computes no absolute instant, and a client computing
/// `now + 60s` on each retry sends a different one every time, so both must
/// replay the first acceptance rather than conflict with it. The replay
/// answers with the original run, whose `scheduled_at` is the first one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// At this instant. One in the past is allowed: the job is claimable at
    /// once, and the run keeps the instant asked for as its `scheduled_at`.
    At(Millis),
    /// This long after acceptance (the acceptance transaction's clock).
    After(Duration),
}

impl NewRun {
    /// A run of `operation` for `tenant` with `command`, under `idempotency_key`.
    pub fn new(
        tenant: impl Into<String>,
        operation: impl Into<String>,
        idempotency_key: impl Into<String>,
        command: Value,
    ) -> Self {
        NewRun {
            tenant: tenant.into(),
            operation: operation.into(),
            schema_version: 1,
            idempotency_key: idempotency_key.into(),
            command,
            run_id: None,
            queue: "default".into(),
            max_attempts: 5,
            deadline: None,
            priority: MIN_PRIORITY,
            traceparent: None,
            start: None,
            parent_run_id: None,
            replay_of: None,
        }
    }

    /// Sets the command schema version.
    pub fn schema_version(mut self, v: u32) -> Self {
        self.schema_version = v;
        self
    }

    /// Proposes the run id.
    pub fn run_id(mut self, id: Uuid) -> Self {
        self.run_id = Some(id);
        self
    }

    /// Sets the queue.
    pub fn queue(mut self, q: impl Into<String>) -> Self {
        self.queue = q.into();
        self
    }

    /// Sets the attempt budget.
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n;
        self
    }

    /// Sets the deadline, relative to acceptance.
    pub fn deadline(mut self, d: Duration) -> Self {
        self.deadline = Some(d);
        self
    }

    /// Schedules the run: its job is not claimable before `at` (an instant in
    /// the past means at once). The run is `queued` meanwhile, with
    /// `scheduled_at` set, and can be cancelled like any queued run. Replaces
    /// an earlier [`NewRun::delay`].
    pub fn run_at(mut self, at: Millis) -> Self {
        self.start = Some(Start::At(at));
        self
    }

    /// Schedules the run `d` after acceptance, by the acceptance's clock (the
    /// database's in production). Replaces an earlier [`NewRun::run_at`].
    pub fn delay(mut self, d: Duration) -> Self {
        self.start = Some(Start::After(d));
        self
    }

    /// Records `run_id` (a run of the same tenant, which must exist) as this
    /// run's parent: the run a workflow step follows. Inside a handler prefer
    /// [`Ferry::enqueue_run_in`], which also checks the handler's lease.
    pub fn parent(mut self, run_id: Uuid) -> Self {
        self.parent_run_id = Some(run_id);
        self
    }

    /// Sets the claim priority (see the `priority` field: higher first,
    /// aged by waiting); outside [`MIN_PRIORITY`]..=[`MAX_PRIORITY`]
    /// acceptance refuses it with `invalid_input` and writes nothing.
    pub fn priority(mut self, p: i16) -> Self {
        self.priority = p;
        self
    }

    /// Carries a W3C trace context into the outbox.
    pub fn traceparent(mut self, tp: impl Into<String>) -> Self {
        self.traceparent = Some(tp.into());
        self
    }

    /// How far ahead of its `available_at` the job sorts in the claim:
    /// its priority times `ferry`'s aging step (stored as `priority_lead`).
    pub(crate) fn priority_lead(&self, ferry: &Ferry) -> i64 {
        i64::from(self.priority.max(0)) * ferry.inner.priority_aging_ms
    }

    pub(crate) fn validate(&self, ferry: &Ferry) -> Result<()> {
        let l = ferry.limits();
        l.tenant(&self.tenant)?;
        l.name("operation", &self.operation)?;
        l.name("queue", &self.queue)?;
        l.idempotency_key(&self.idempotency_key)?;
        if !(1..=1000).contains(&self.max_attempts) {
            return Err(Error::invalid("max_attempts", "must be 1 to 1000"));
        }
        if !(MIN_PRIORITY..=MAX_PRIORITY).contains(&self.priority) {
            return Err(Error::invalid(
                "priority",
                format!("must be {MIN_PRIORITY} to {MAX_PRIORITY}"),
            ));
        }
        if !self.command.is_object() {
            return Err(Error::invalid("command", "must be a JSON object"));
        }
        l.json_within("command", &self.command, ferry.inner.max_document_bytes)?;
        if let Some(d) = self.deadline {
            if duration_ms(d)? <= 0 {
                return Err(Error::invalid("deadline", "must be positive"));
            }
        }
        if let Some(tp) = &self.traceparent {
            outbox::validate_traceparent(tp)?;
        }
        if let Some(Start::After(d)) = self.start {
            duration_ms(d)?;
        }
        // The deadline counts from the start (see `instants`): refuse a start
        // so late that it overflows here, before anything is written, so a
        // batch refuses this item only. A delay and a deadline are at most
        // 100 years each, so from any real `now` they cannot overflow.
        if let (Some(Start::At(at)), Some(d)) = (self.start, self.deadline) {
            at.checked_add(d)
                .map_err(|_| Error::invalid("run_at", "plus the deadline is past the last instant"))?;
        }
        Ok(())
    }

    /// The instants of a run accepted at `now`: `(scheduled_at, available_at,
    /// deadline_at)`. The job is available at the later of `now` and the
    /// start, and the deadline counts from then (a run scheduled for tomorrow
    /// with a one-hour deadline has until an hour after it starts).
    pub(crate) fn instants(&self, now: i64) -> Result<(Option<i64>, i64, Option<i64>)> {
        let now_ms = Millis::new(now)?;
        let scheduled_at = match self.start {
            None => None,
            Some(Start::At(at)) => Some(at),
            Some(Start::After(d)) => Some(now_ms.checked_add(d)?),
        };
        let available = scheduled_at.map_or(now_ms, |s| s.max(now_ms));
        let deadline_at = match self.deadline {
            Some(d) => Some(available.checked_add(d)?.get()),
            None => None,
        };
        Ok((scheduled_at.map(Millis::get), available.get(), deadline_at))
    }
}

/// Where a run is. `queued` covers waiting, leased and retrying; the job row
/// has the detail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RunState {
    /// Accepted and not finished.
    Queued,
    /// Completed by a worker.
    Succeeded,
    /// Dead: terminal error or attempt budget spent.
    Failed,
    /// Cancelled before completion.
    Cancelled,
}

impl RunState {
    /// The stored text.
    pub fn as_str(self) -> &'static str {
        match self {
            RunState::Queued => "queued",
            RunState::Succeeded => "succeeded",
            RunState::Failed => "failed",
            RunState::Cancelled => "cancelled",
        }
    }

    pub(crate) fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "queued" => RunState::Queued,
            "succeeded" => RunState::Succeeded,
            "failed" => RunState::Failed,
            "cancelled" => RunState::Cancelled,
            other => {
                return Err(Error::CorruptRow {
                    what: "runs.state",
                    value: other.into(),
                })
            }
        })
    }

    /// Every state, in lifecycle order.
    pub const ALL: [RunState; 4] = [
        RunState::Queued,
        RunState::Succeeded,
        RunState::Failed,
        RunState::Cancelled,
    ];

    /// True for succeeded, failed and cancelled.
    pub fn is_terminal(self) -> bool {
        self != RunState::Queued
    }
}

impl std::str::FromStr for RunState {
    type Err = Error;
    /// Parses the stored text; anything else is [`Error::InvalidInput`].
    fn from_str(s: &str) -> Result<Self> {
        RunState::parse(s).map_err(|_| Error::invalid("state", "must be queued, succeeded, failed or cancelled"))
    }
}

impl std::fmt::Display for RunState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A run as stored.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Run {
    /// Owner.
    pub tenant: String,
    /// Id.
    pub run_id: Uuid,
    /// Operation.
    pub operation: String,
    /// State.
    pub state: RunState,
    /// Bumped by every state change; cancel can compare-and-set on it.
    pub version: i64,
    /// The accepted command.
    pub request: Value,
    /// Instant the run must finish by.
    pub deadline_at: Option<Millis>,
    /// The dead run this one replays.
    pub replay_of: Option<Uuid>,
    /// The instant the run was asked to start at ([`NewRun::run_at`] or
    /// [`NewRun::delay`]); its job is claimable from the later of this and
    /// `created_at`. `None`: at once.
    pub scheduled_at: Option<Millis>,
    /// The run whose handler created this one ([`NewRun::parent`]).
    pub parent_run_id: Option<Uuid>,
    /// Accepted at.
    pub created_at: Millis,
    /// Last changed at.
    pub updated_at: Millis,
    /// Seq of the newest event.
    pub last_event_seq: i64,
}

/// A `runs` row as read, before its state is parsed.
#[derive(sqlx::FromRow)]
pub(crate) struct RunRow {
    pub(crate) tenant: String,
    pub(crate) run_id: Uuid,
    pub(crate) operation: String,
    pub(crate) state: String,
    pub(crate) version: i64,
    pub(crate) request: Json<Value>,
    pub(crate) deadline_at: Option<Millis>,
    pub(crate) replay_of: Option<Uuid>,
    pub(crate) scheduled_at: Option<Millis>,
    pub(crate) parent_run_id: Option<Uuid>,
    pub(crate) created_at: Millis,
    pub(crate) updated_at: Millis,
    pub(crate) last_event_seq: i64,
}

impl TryFrom<RunRow> for Run {
    type Error = Error;
    fn try_from(r: RunRow) -> Result<Run> {
        Ok(Run {
            tenant: r.tenant,
            run_id: r.run_id,
            operation: r.operation,
            state: RunState::parse(&r.state)?,
            version: r.version,
            request: r.request.0,
            deadline_at: r.deadline_at,
            replay_of: r.replay_of,
            scheduled_at: r.scheduled_at,
            parent_run_id: r.parent_run_id,
            created_at: r.created_at,
            updated_at: r.updated_at,
            last_event_seq: r.last_event_seq,
        })
    }
}

/// One entry of a run's history.
#[derive(Debug, Clone, PartialEq, serde::Serialize, sqlx::FromRow)]
pub struct RunEvent {
    /// Position in the run's history, from 1, without gaps.
    pub seq: i64,
    /// `run_queued`, `run_succeeded`, `run_failed`, `run_cancelled`, or a service's own kind.
    pub kind: String,
    /// Event data.
    #[sqlx(json)]
    pub body: Value,
    /// Written at.
    pub created_at: Millis,
}

/// The answer to an acceptance.
#[derive(Debug, Clone, PartialEq)]
pub struct Accepted {
    /// The run: new, or the original one for a replay.
    pub run: Run,
    /// True when the key was seen before with an equivalent request: nothing was written.
    pub replay: bool,
}
