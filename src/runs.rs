//! Runs, their events, and the acceptance transaction (invariants 1–3).
//!
//! [`Ferry::create_run_idempotent`] commits the run, `run_queued` at seq 1,
//! the claimable job, the idempotency record and the event's outbox row
//! together. The idempotency key is claimed first, through the primary key
//! (`ON CONFLICT`), so two racing requests produce one run and the loser
//! reads the winner's record once it commits.

use std::time::Duration;

use serde_json::{json, Value};
use sqlx::types::Json;
use uuid::Uuid;

use crate::error::{violated_constraint, Error, Result};
use crate::fingerprint::{fingerprint, redact};
use crate::outbox::{self, OutboxMessage};
use crate::store::{on_conn, on_pool, Conn};
use crate::time::duration_ms;
use crate::Ferry;

/// Event kinds that end a run; exactly one of them per run (invariant 6).
pub const TERMINAL_KINDS: [&str; 3] = ["run_succeeded", "run_failed", "run_cancelled"];

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
    /// W3C trace context of the accepting request.
    pub traceparent: Option<String>,
    pub(crate) replay_of: Option<Uuid>,
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
            traceparent: None,
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

    /// Carries a W3C trace context into the outbox.
    pub fn traceparent(mut self, tp: impl Into<String>) -> Self {
        self.traceparent = Some(tp.into());
        self
    }

    fn validate(&self, ferry: &Ferry) -> Result<()> {
        let l = ferry.limits();
        l.tenant(&self.tenant)?;
        l.name("operation", &self.operation)?;
        l.name("queue", &self.queue)?;
        l.idempotency_key(&self.idempotency_key)?;
        if !(1..=1000).contains(&self.max_attempts) {
            return Err(Error::invalid("max_attempts", "must be 1 to 1000"));
        }
        if !self.command.is_object() {
            return Err(Error::invalid("command", "must be a JSON object"));
        }
        l.json("command", &self.command)?;
        if let Some(d) = self.deadline {
            if duration_ms(d)? <= 0 {
                return Err(Error::invalid("deadline", "must be positive"));
            }
        }
        if let Some(tp) = &self.traceparent {
            outbox::validate_traceparent(tp)?;
        }
        Ok(())
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

    /// True for succeeded, failed and cancelled.
    pub fn is_terminal(self) -> bool {
        self != RunState::Queued
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
    pub deadline_at: Option<i64>,
    /// The dead run this one replays.
    pub replay_of: Option<Uuid>,
    /// Accepted at.
    pub created_at: i64,
    /// Last changed at.
    pub updated_at: i64,
    /// Seq of the newest event.
    pub last_event_seq: i64,
}

#[derive(sqlx::FromRow)]
struct RunRow {
    tenant: String,
    run_id: Uuid,
    operation: String,
    state: String,
    version: i64,
    request: Json<Value>,
    deadline_at: Option<i64>,
    replay_of: Option<Uuid>,
    created_at: i64,
    updated_at: i64,
    last_event_seq: i64,
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
    pub created_at: i64,
}

/// The answer to an acceptance.
#[derive(Debug, Clone, PartialEq)]
pub struct Accepted {
    /// The run: new, or the original one for a replay.
    pub run: Run,
    /// True when the key was seen before with an equivalent request: nothing was written.
    pub replay: bool,
}

impl Ferry {
    /// Accepts a run in its own transaction. A replay writes nothing; a
    /// conflict is [`Error::IdempotencyConflict`].
    pub async fn create_run_idempotent(&self, run: NewRun) -> Result<Accepted> {
        run.validate(self)?;
        let mut tx = self.begin().await?;
        let result = self.create_run_idempotent_in(tx.conn(), run).await;
        tx.finish(result).await
    }

    /// Accepts a run inside the caller's transaction, beside its own domain
    /// writes: nothing is visible until the caller commits, and a rollback
    /// undoes all of it. After an error the caller must roll back.
    pub async fn create_run_idempotent_in(&self, mut conn: Conn<'_>, run: NewRun) -> Result<Accepted> {
        run.validate(self)?;
        let fp = fingerprint(&run.operation, run.schema_version, &run.tenant, &run.command);
        let run_id = run.run_id.unwrap_or_else(Uuid::now_v7);
        let ttl = duration_ms(self.limits().idempotency_ttl)?;
        let claimed: Option<i64> = on_conn!(conn.reborrow(), |c, q| {
            sqlx::query_scalar(q.claim_idempotency_key)
                .bind(&run.tenant)
                .bind(&run.operation)
                .bind(&run.idempotency_key)
                .bind(&fp.hex)
                .bind(fp.version)
                .bind(run_id)
                .bind(self.now())
                .bind(ttl)
                .fetch_optional(&mut *c)
                .await?
        });
        let Some(now) = claimed else {
            return self.replay_or_conflict(conn, &run, &fp.hex, fp.version).await;
        };
        let deadline_at = match run.deadline {
            Some(d) => Some(crate::Millis::new(now)?.checked_add(d)?.get()),
            None => None,
        };
        let inserted = on_conn!(conn.reborrow(), |c, q| {
            sqlx::query(q.insert_run)
                .bind(&run.tenant)
                .bind(run_id)
                .bind(&run.operation)
                .bind(Json(&run.command))
                .bind(deadline_at)
                .bind(run.replay_of)
                .bind(now)
                .execute(&mut *c)
                .await
                .map(|_| ())
        });
        if let Err(e) = inserted {
            return Err(match violated_constraint(&e).as_deref() {
                Some("runs_pkey") => Error::DuplicateRun { run_id },
                _ => e.into(),
            });
        }
        let body = queued_body(
            &run.operation,
            &run.queue,
            run.schema_version,
            &run.command,
            run.replay_of,
        );
        write_event(
            self,
            conn.reborrow(),
            &run.tenant,
            run_id,
            1,
            "run_queued",
            &body,
            now,
            run.traceparent.clone().or_else(crate::telemetry::current_traceparent),
        )
        .await?;
        on_conn!(conn.reborrow(), |c, q| {
            sqlx::query(q.insert_job)
                .bind(&run.tenant)
                .bind(run_id)
                .bind(&run.queue)
                .bind(now)
                .bind(run.max_attempts as i32)
                .bind(deadline_at)
                .bind(now)
                .execute(&mut *c)
                .await?;
        });
        self.inner.notifier.wake(conn, &run.queue).await?;
        tracing::debug!(tenant = %run.tenant, %run_id, key = %redact(&run.idempotency_key), "run accepted");
        Ok(Accepted {
            run: Run {
                tenant: run.tenant,
                run_id,
                operation: run.operation,
                state: RunState::Queued,
                version: 1,
                request: run.command,
                deadline_at,
                replay_of: run.replay_of,
                created_at: now,
                updated_at: now,
                last_event_seq: 1,
            },
            replay: false,
        })
    }

    async fn replay_or_conflict(&self, mut conn: Conn<'_>, run: &NewRun, fp: &str, version: i32) -> Result<Accepted> {
        let existing: Option<(String, i32, Uuid)> = on_conn!(conn.reborrow(), |c, q| {
            sqlx::query_as(q.find_idempotency_key)
                .bind(&run.tenant)
                .bind(&run.operation)
                .bind(&run.idempotency_key)
                .fetch_optional(&mut *c)
                .await?
        });
        // The record was swept between our insert and this read: a retry of
        // the whole acceptance will claim the key afresh.
        let (stored_fp, stored_version, run_id) = existing.ok_or(Error::Raced("the idempotency record was swept"))?;
        let key_hash = redact(&run.idempotency_key);
        if stored_fp != fp || stored_version != version {
            tracing::info!(tenant = %run.tenant, operation = %run.operation, key = %key_hash, "idempotency conflict");
            return Err(Error::IdempotencyConflict {
                operation: run.operation.clone(),
                key_hash,
                existing_run: run_id,
            });
        }
        let original = get_run_in(conn, &run.tenant, run_id).await?;
        tracing::debug!(tenant = %run.tenant, %run_id, key = %key_hash, "idempotent replay");
        Ok(Accepted {
            run: original,
            replay: true,
        })
    }

    /// The run, if it belongs to `tenant`.
    pub async fn get_run(&self, tenant: &str, run_id: Uuid) -> Result<Run> {
        let row: Option<RunRow> = on_pool!(self.db(), |p, q| {
            sqlx::query_as(q.get_run)
                .bind(tenant)
                .bind(run_id)
                .fetch_optional(p)
                .await?
        });
        row.ok_or(Error::NotFound { what: "run" })?.try_into()
    }

    /// The run's events in seq order (empty for another tenant's run).
    pub async fn list_events(&self, tenant: &str, run_id: Uuid) -> Result<Vec<RunEvent>> {
        Ok(on_pool!(self.db(), |p, q| {
            sqlx::query_as(q.list_events)
                .bind(tenant)
                .bind(run_id)
                .fetch_all(p)
                .await?
        }))
    }

    /// Appends a service's own event to a run, with its outbox row, inside the
    /// caller's transaction. Seqs stay unique and gap-free under concurrent
    /// appends (the run row is locked while the seq is allocated). Terminal
    /// kinds are reserved for Ferry's transitions.
    pub async fn append_event_in(
        &self,
        mut conn: Conn<'_>,
        tenant: &str,
        run_id: Uuid,
        kind: &str,
        body: &Value,
    ) -> Result<i64> {
        self.limits().tenant(tenant)?;
        self.limits().name("kind", kind)?;
        if TERMINAL_KINDS.contains(&kind) || kind == "run_queued" {
            return Err(Error::invalid("kind", "run_* kinds are reserved for Ferry"));
        }
        self.limits().json("body", body)?;
        let next: Option<(i64, i64)> = on_conn!(conn.reborrow(), |c, q| {
            sqlx::query_as(q.next_event_seq)
                .bind(tenant)
                .bind(run_id)
                .bind(self.now())
                .fetch_optional(&mut *c)
                .await?
        });
        let (seq, now) = next.ok_or(Error::NotFound { what: "run" })?;
        write_event(self, conn, tenant, run_id, seq, kind, body, now, None).await?;
        Ok(seq)
    }

    /// Appends an event in its own transaction.
    pub async fn append_event(&self, tenant: &str, run_id: Uuid, kind: &str, body: &Value) -> Result<i64> {
        let mut tx = self.begin().await?;
        let result = self.append_event_in(tx.conn(), tenant, run_id, kind, body).await;
        tx.finish(result).await
    }

    /// Deletes up to `batch` expired idempotency records; returns how many.
    /// Call it until it returns less than `batch`.
    pub async fn sweep_idempotency_keys(&self, batch: u32) -> Result<u64> {
        let done = on_pool!(self.db(), |p, q| {
            sqlx::query(q.sweep_idempotency_keys)
                .bind(self.now())
                .bind(i64::from(batch))
                .execute(p)
                .await?
                .rows_affected()
        });
        Ok(done)
    }
}

pub(crate) async fn get_run_in(conn: Conn<'_>, tenant: &str, run_id: Uuid) -> Result<Run> {
    let row: Option<RunRow> = on_conn!(conn, |c, q| {
        sqlx::query_as(q.get_run)
            .bind(tenant)
            .bind(run_id)
            .fetch_optional(&mut *c)
            .await?
    });
    row.ok_or(Error::NotFound { what: "run" })?.try_into()
}

/// The body of `run_queued`: the largest wrapper Ferry puts around a
/// caller's document (sized in [`crate::Limits::run_event_overhead`]).
pub(crate) fn queued_body(
    operation: &str,
    queue: &str,
    schema_version: u32,
    command: &Value,
    replay_of: Option<Uuid>,
) -> Value {
    json!({
        "operation": operation,
        "queue": queue,
        "schema_version": schema_version,
        "request": command,
        "replay_of": replay_of,
    })
}

/// The value of a run event's Kafka record: the event's envelope around its
/// body (sized in [`crate::Limits::run_event_overhead`]).
pub(crate) fn event_payload(tenant: &str, run_id: Uuid, seq: i64, kind: &str, at: i64, body: &Value) -> Value {
    json!({
        "tenant": tenant,
        "run_id": run_id,
        "seq": seq,
        "kind": kind,
        "at": at,
        "body": body,
    })
}

/// Writes event `seq` of a run and the outbox row that carries it. The
/// effect key `tenant/run_id/seq` lets consumers dedupe re-published events.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn write_event(
    ferry: &Ferry,
    mut conn: Conn<'_>,
    tenant: &str,
    run_id: Uuid,
    seq: i64,
    kind: &str,
    body: &Value,
    now: i64,
    traceparent: Option<String>,
) -> Result<()> {
    let inserted = on_conn!(conn.reborrow(), |c, q| {
        sqlx::query(q.insert_event)
            .bind(tenant)
            .bind(run_id)
            .bind(seq)
            .bind(kind)
            .bind(Json(body))
            .bind(now)
            .execute(&mut *c)
            .await
            .map(|_| ())
    });
    if let Err(e) = inserted {
        return Err(match violated_constraint(&e).as_deref() {
            Some("run_events_one_terminal_idx") => Error::RunTerminal {
                run_id,
                state: "terminal".into(),
            },
            _ => e.into(),
        });
    }
    let payload = event_payload(tenant, run_id, seq, kind, now, body);
    let msg = OutboxMessage {
        tenant: tenant.to_owned(),
        topic: ferry.inner.events_topic.clone(),
        key: run_id.to_string(),
        payload: serde_json::to_vec(&payload).map_err(|e| Error::invalid("body", e.to_string()))?,
        headers: [
            ("content-type".to_owned(), "application/json".to_owned()),
            ("ferry-event-kind".to_owned(), kind.to_owned()),
        ]
        .into(),
        effect_key: Some(format!("{tenant}/{run_id}/{seq}")),
        traceparent,
    };
    // No key lock: every writer of a run's events holds the run's row.
    outbox::insert(ferry, conn, &msg, Some(now), false).await?;
    Ok(())
}
