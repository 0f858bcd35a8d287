//! Durable jobs: claims under expiring leases whose generation only goes up,
//! and fenced transitions (invariants 4–8).
//!
//! Every renew, complete, retry, fail and effect write matches
//! `state = 'leased' AND owner AND generation AND lease_expires_at > now`;
//! zero rows becomes a typed error ([`Error::LostLease`], [`Error::Cancelled`],
//! [`Error::RunTerminal`], [`Error::DeadlineExceeded`]), never a silent no-op.
//! Terminal transitions write the job, the run, the terminal event and its
//! outbox row in one transaction.

use std::time::Duration;

use rand::RngCore;
use serde_json::{json, Value};
use sqlx::types::Json;
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::retry::RetryPolicy;
use crate::runs::{get_run_in, write_event, Accepted, NewRun};
use crate::store::{on_conn, on_pool, Conn};
use crate::time::duration_ms;
use crate::Ferry;

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
    pub lease_expires_at: i64,
    /// The run's deadline.
    pub deadline_at: Option<i64>,
    /// When this claim happened.
    pub claimed_at: i64,
    /// When the run was accepted.
    pub created_at: i64,
    /// The run's operation.
    pub operation: String,
    /// The run's accepted command.
    pub request: Value,
    /// The dead run this one replays.
    pub replay_of: Option<Uuid>,
}

#[derive(sqlx::FromRow)]
struct ClaimRow {
    tenant: String,
    run_id: Uuid,
    queue: String,
    lease_owner: String,
    lease_generation: i64,
    attempts: i32,
    max_attempts: i32,
    lease_expires_at: i64,
    deadline_at: Option<i64>,
    created_at: i64,
    claimed_at: i64,
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
    fn as_str(self) -> &'static str {
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

/// What [`Ferry::fail`] did with the attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FailOutcome {
    /// Requeued, claimable again at `available_at`.
    Retried {
        /// Persisted instant of the next attempt.
        available_at: i64,
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
    pub claimed_at: i64,
    /// Finished at (`None` while running or when the worker vanished).
    pub finished_at: Option<i64>,
    /// `succeeded`, `retried`, `dead`, `cancelled`, `released`.
    pub outcome: Option<String>,
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
    /// `queued`, `leased`, `succeeded`, `dead` or `cancelled`.
    pub state: String,
    /// Attempts spent.
    pub attempts: i32,
    /// Attempt budget.
    pub max_attempts: i32,
    /// Current lease holder.
    pub lease_owner: Option<String>,
    /// Last safe error code.
    pub last_error_code: Option<String>,
    /// Last change.
    pub updated_at: i64,
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
    pub died_at: i64,
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
    updated_at: i64,
    operation: String,
}

/// Facts read to explain why a fenced statement matched nothing.
#[derive(sqlx::FromRow)]
struct JobStatus {
    state: String,
    lease_owner: Option<String>,
    lease_generation: i64,
    lease_expires_at: Option<i64>,
    deadline_at: Option<i64>,
    run_state: String,
    now: i64,
}

/// Which transition was refused, to name the right error.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Transition {
    Renew,
    Finish,
}

impl Ferry {
    /// Claims up to `limit` eligible jobs of `queue` for `owner`, each under a
    /// lease of `lease`, never past the run's deadline (like [`Ferry::renew`]). Eligible: due, under the attempt budget, not
    /// cancelled, and queued or leased past expiry. On PostgreSQL this is one
    /// `FOR UPDATE SKIP LOCKED` statement that also writes the attempt rows.
    pub async fn claim(&self, queue: &str, owner: &str, lease: Duration, limit: u32) -> Result<Vec<Claimed>> {
        self.limits().name("queue", queue)?;
        self.limits().name("owner", owner)?;
        let lease_ms = positive_ms("lease", lease)?;
        if limit == 0 {
            return Ok(Vec::new());
        }
        let mut tx = self.begin().await?;
        let result = self.claim_in(tx.conn(), queue, owner, lease_ms, limit).await;
        tx.finish(result).await
    }

    async fn claim_in(
        &self,
        conn: Conn<'_>,
        queue: &str,
        owner: &str,
        lease_ms: i64,
        limit: u32,
    ) -> Result<Vec<Claimed>> {
        match conn {
            Conn::Postgres(c) => {
                let q = &crate::store::queries::QUERIES.postgres;
                let rows = sqlx::query(q.claim_jobs)
                    .bind(queue)
                    .bind(self.now())
                    .bind(i64::from(limit))
                    .bind(owner)
                    .bind(lease_ms)
                    .fetch_all(&mut *c)
                    .await?;
                rows.iter()
                    .map(|row| {
                        use sqlx::{FromRow, Row};
                        let base = ClaimRow::from_row(row)?;
                        let request: Json<Value> = row.try_get("request")?;
                        Ok(base.into_claimed(row.try_get("operation")?, request.0, row.try_get("replay_of")?))
                    })
                    .collect()
            }
            Conn::Sqlite(c) => {
                let q = &crate::store::queries::QUERIES.sqlite;
                let rows: Vec<ClaimRow> = sqlx::query_as(q.claim_jobs)
                    .bind(queue)
                    .bind(self.now())
                    .bind(i64::from(limit))
                    .bind(owner)
                    .bind(lease_ms)
                    .fetch_all(&mut *c)
                    .await?;
                let mut out = Vec::with_capacity(rows.len());
                for row in rows {
                    sqlx::query(q.close_lost_attempts)
                        .bind(&row.tenant)
                        .bind(row.run_id)
                        .bind(row.lease_generation)
                        .bind(row.claimed_at)
                        .execute(&mut *c)
                        .await?;
                    sqlx::query(q.insert_attempt)
                        .bind(&row.tenant)
                        .bind(row.run_id)
                        .bind(row.attempts)
                        .bind(row.lease_generation)
                        .bind(&row.lease_owner)
                        .bind(row.claimed_at)
                        .execute(&mut *c)
                        .await?;
                    let run = get_run_in(Conn::Sqlite(&mut *c), &row.tenant, row.run_id).await?;
                    out.push(row.into_claimed(run.operation, run.request, run.replay_of));
                }
                Ok(out)
            }
        }
    }

    /// Extends the lease by `lease` from now, never past the run's deadline.
    /// Reports cancellation ([`Error::Cancelled`]) so the worker stops.
    /// Returns the new expiry.
    pub async fn renew(&self, lease: &Lease, duration: Duration) -> Result<i64> {
        Ok(self.renew_at(lease, duration).await?.0)
    }

    /// [`Ferry::renew`], also returning the instant the new expiry was
    /// computed from: `(expires_at, now)`.
    pub(crate) async fn renew_at(&self, lease: &Lease, duration: Duration) -> Result<(i64, i64)> {
        let ms = positive_ms("lease", duration)?;
        let renewed: Option<(i64, i64)> = on_pool!(self.db(), |p, q| {
            sqlx::query_as(q.renew_lease)
                .bind(&lease.tenant)
                .bind(lease.run_id)
                .bind(&lease.owner)
                .bind(lease.generation)
                .bind(self.now())
                .bind(ms)
                .fetch_optional(p)
                .await?
        });
        match renewed {
            Some(at) => Ok(at),
            None => {
                let mut tx = self.begin().await?;
                let err = self.refusal(tx.conn(), lease, Transition::Renew).await;
                let _ = tx.rollback().await;
                Err(err)
            }
        }
    }

    /// Completes the job: job `succeeded`, run `succeeded`, the
    /// `run_succeeded` event carrying `result` and its outbox row, and the
    /// attempt closed, in one transaction.
    pub async fn complete(&self, lease: &Lease, result: &Value) -> Result<()> {
        self.limits().json("result", result)?;
        let mut tx = self.begin().await?;
        let r = self.complete_in(tx.conn(), lease, result).await;
        tx.finish(r).await
    }

    /// Completes many leases in one transaction (one commit): each is fenced
    /// and terminalized exactly like [`Ferry::complete`]. Returns one result
    /// per lease, in order; a refused lease does not affect the others.
    pub async fn complete_batch(&self, items: &[(Lease, Value)]) -> Result<Vec<Result<()>>> {
        for (_, result) in items {
            self.limits().json("result", result)?;
        }
        let mut tx = self.begin().await?;
        let r = match tx.conn() {
            Conn::Postgres(c) => self.complete_batch_pg(c, items).await,
            Conn::Sqlite(c) => {
                let mut out = Vec::with_capacity(items.len());
                for (lease, result) in items {
                    // A savepoint per lease keeps a refused one from leaving half its writes.
                    let mut sp = sqlx::Connection::begin(&mut *c).await?;
                    let one = self.complete_in(Conn::Sqlite(&mut sp), lease, result).await;
                    if one.is_ok() {
                        sp.commit().await?;
                    } else {
                        sp.rollback().await?;
                    }
                    out.push(one);
                }
                Ok(out)
            }
        };
        tx.finish(r).await
    }

    async fn complete_batch_pg(&self, c: &mut sqlx::PgConnection, items: &[(Lease, Value)]) -> Result<Vec<Result<()>>> {
        let rows: Vec<(Uuid, bool)> = sqlx::query_as(crate::store::queries::POSTGRES_ONLY.complete_batch)
            .bind(items.iter().map(|(l, _)| l.tenant.as_str()).collect::<Vec<_>>())
            .bind(items.iter().map(|(l, _)| l.run_id).collect::<Vec<_>>())
            .bind(items.iter().map(|(l, _)| l.owner.as_str()).collect::<Vec<_>>())
            .bind(items.iter().map(|(l, _)| l.generation).collect::<Vec<_>>())
            .bind(items.iter().map(|(_, v)| Json(v)).collect::<Vec<_>>())
            .bind(
                items
                    .iter()
                    .map(|(l, _)| crate::outbox::lane_for(&l.run_id.to_string(), self.lanes()))
                    .collect::<Vec<_>>(),
            )
            .bind(self.now())
            .bind(&self.inner.events_topic)
            .fetch_all(&mut *c)
            .await?;
        if rows.iter().any(|(_, moved)| !moved) {
            return Err(Error::Invariant(
                "a leased job's run was already terminal; the batch was rolled back".into(),
            ));
        }
        let done: std::collections::HashSet<Uuid> = rows.into_iter().map(|(id, _)| id).collect();
        let mut out = Vec::with_capacity(items.len());
        for (lease, _) in items {
            out.push(if done.contains(&lease.run_id) {
                Ok(())
            } else {
                Err(self.refusal(Conn::Postgres(&mut *c), lease, Transition::Finish).await)
            });
        }
        Ok(out)
    }

    async fn complete_in(&self, mut conn: Conn<'_>, lease: &Lease, result: &Value) -> Result<()> {
        let (_attempt, _max, _created, now) = self.finish_job(conn.reborrow(), lease, "succeeded", None, None).await?;
        self.terminate(
            conn.reborrow(),
            &lease.tenant,
            lease.run_id,
            "succeeded",
            None,
            "run_succeeded",
            &json!({ "result": result }),
            now,
        )
        .await?;
        close_attempt(conn, lease, now, "succeeded", None, None).await
    }

    /// Records a failed attempt. Retryable and ambiguous errors requeue the
    /// job at `now + policy.delay(..)` (persisted), unless the attempt budget,
    /// the run's deadline or the policy's total retry time is spent; terminal
    /// errors and spent budgets make the job dead and the run failed, with the
    /// `run_failed` event and its outbox row, atomically. Ambiguous errors
    /// also mark the attempt's reserved effects `unknown`.
    pub async fn fail(
        &self,
        lease: &Lease,
        error: &JobError,
        policy: &RetryPolicy,
        rng: &mut (dyn RngCore + Send),
    ) -> Result<FailOutcome> {
        self.limits().name("error code", &error.code)?;
        let mut tx = self.begin().await?;
        let r = self.fail_in(tx.conn(), lease, error, policy, rng).await;
        tx.finish(r).await
    }

    async fn fail_in(
        &self,
        mut conn: Conn<'_>,
        lease: &Lease,
        error: &JobError,
        policy: &RetryPolicy,
        rng: &mut (dyn RngCore + Send),
    ) -> Result<FailOutcome> {
        // Lock the lease first: the decision below depends on its attempt count.
        let (now, attempt) = self.lock_fence(conn.reborrow(), lease).await?;
        let job: (String, String, i32, i32, i64, Option<String>) = on_conn!(conn.reborrow(), |c, q| {
            sqlx::query_as(q.get_job)
                .bind(&lease.tenant)
                .bind(lease.run_id)
                .fetch_one(&mut *c)
                .await?
        });
        let max_attempts = job.2;
        let run = get_run_in(conn.reborrow(), &lease.tenant, lease.run_id).await?;
        let class = error.class;
        let mut dead_code = match class {
            ErrorClass::Terminal => Some(error.code.clone()),
            _ if attempt >= max_attempts => Some(error.code.clone()),
            _ => None,
        };
        let mut available_at = None;
        if dead_code.is_none() {
            let delay = policy.delay(attempt as u32, error.retry_after, rng);
            let at = crate::Millis::new(now)?.checked_add(delay)?.get();
            let past_total = match policy.max_elapsed {
                Some(max) => at > crate::Millis::new(run.created_at)?.checked_add(max)?.get(),
                None => false,
            };
            if past_total {
                dead_code = Some("retry_deadline_exceeded".into());
            } else if run.deadline_at.is_some_and(|d| at >= d) {
                dead_code = Some("deadline_exceeded".into());
            } else {
                available_at = Some(at);
            }
        }
        if class == ErrorClass::Ambiguous {
            on_conn!(conn.reborrow(), |c, q| {
                sqlx::query(q.mark_effects_unknown)
                    .bind(&lease.tenant)
                    .bind(lease.run_id)
                    .bind(lease.generation)
                    .bind(now)
                    .execute(&mut *c)
                    .await?;
            });
        }
        match dead_code {
            None => {
                self.finish_job(conn.reborrow(), lease, "queued", available_at, Some(&error.code))
                    .await?;
                close_attempt(conn, lease, now, "retried", Some(class), Some(&error.code)).await?;
                Ok(FailOutcome::Retried {
                    available_at: available_at.unwrap_or(now),
                })
            }
            Some(code) => {
                self.finish_job(conn.reborrow(), lease, "dead", None, Some(&code))
                    .await?;
                let body = json!({ "error_code": code, "error_class": class, "attempts": attempt });
                self.terminate(
                    conn.reborrow(),
                    &lease.tenant,
                    lease.run_id,
                    "failed",
                    None,
                    "run_failed",
                    &body,
                    now,
                )
                .await?;
                close_attempt(conn, lease, now, "dead", Some(class), Some(&code)).await?;
                Ok(FailOutcome::Dead { code })
            }
        }
    }

    /// Gives a job back without spending its attempt (graceful shutdown).
    /// Fenced: a lease already lost is never "released".
    pub async fn release(&self, lease: &Lease) -> Result<()> {
        let mut tx = self.begin().await?;
        let r = async {
            let now: Option<i64> = on_conn!(tx.conn(), |c, q| {
                sqlx::query_scalar(q.release_job)
                    .bind(&lease.tenant)
                    .bind(lease.run_id)
                    .bind(&lease.owner)
                    .bind(lease.generation)
                    .bind(self.now())
                    .fetch_optional(&mut *c)
                    .await?
            });
            match now {
                Some(now) => close_attempt(tx.conn(), lease, now, "released", None, None).await,
                None => Err(self.refusal(tx.conn(), lease, Transition::Finish).await),
            }
        }
        .await;
        tx.finish(r).await
    }

    /// Cancels a run: the job becomes unclaimable, the run `cancelled`, and
    /// `run_cancelled` (with who asked and why) is appended with its outbox
    /// row, atomically. With `expected_version` it is a compare-and-set on the
    /// run version. Losing to a completion gives [`Error::RunTerminal`]. A
    /// worker holding the lease learns of it at its next renew.
    pub async fn cancel(
        &self,
        tenant: &str,
        run_id: Uuid,
        expected_version: Option<i64>,
        actor: &str,
        reason: &str,
    ) -> Result<()> {
        let mut tx = self.begin().await?;
        let r = self
            .cancel_in(tx.conn(), tenant, run_id, expected_version, actor, reason)
            .await;
        tx.finish(r).await
    }

    /// [`Ferry::cancel`] inside the caller's transaction.
    pub async fn cancel_in(
        &self,
        mut conn: Conn<'_>,
        tenant: &str,
        run_id: Uuid,
        expected_version: Option<i64>,
        actor: &str,
        reason: &str,
    ) -> Result<()> {
        self.limits().tenant(tenant)?;
        self.limits().text("actor", actor, 255)?;
        self.limits().text("reason", reason, 4096)?;
        let job: Option<(i64, i64)> = on_conn!(conn.reborrow(), |c, q| {
            sqlx::query_as(q.cancel_job)
                .bind(tenant)
                .bind(run_id)
                .bind(self.now())
                .fetch_optional(&mut *c)
                .await?
        });
        let Some((generation, now)) = job else {
            let run = get_run_in(conn, tenant, run_id).await?;
            return Err(Error::RunTerminal {
                run_id,
                state: run.state.as_str().into(),
            });
        };
        let body = json!({ "actor": actor, "reason": reason });
        self.terminate(
            conn.reborrow(),
            tenant,
            run_id,
            "cancelled",
            expected_version,
            "run_cancelled",
            &body,
            now,
        )
        .await?;
        on_conn!(conn, |c, q| {
            sqlx::query(q.close_attempt)
                .bind(tenant)
                .bind(run_id)
                .bind(generation)
                .bind(now)
                .bind("cancelled")
                .bind(None::<&str>)
                .bind(Some("cancelled"))
                .execute(&mut *c)
                .await?;
        });
        Ok(())
    }

    /// Makes dead the due jobs of `queue` nobody may work any more: the last
    /// allowed attempt's lease expired (`lease_expired`: the worker vanished),
    /// or the run's deadline passed (`deadline_exceeded`). The run fails with
    /// its `run_failed` event. Returns how many were terminalized.
    pub async fn reap_exhausted(&self, queue: &str, limit: u32) -> Result<u64> {
        let mut tx = self.begin().await?;
        let r = async {
            let found: Vec<(String, Uuid, i64, i32)> = on_conn!(tx.conn(), |c, q| {
                sqlx::query_as(q.exhausted_jobs)
                    .bind(queue)
                    .bind(self.now())
                    .bind(i64::from(limit))
                    .fetch_all(&mut *c)
                    .await?
            });
            let mut n = 0;
            for (tenant, run_id, generation, _) in found {
                let expired: Option<(i32, i64, String)> = on_conn!(tx.conn(), |c, q| {
                    sqlx::query_as(q.expire_job)
                        .bind(&tenant)
                        .bind(run_id)
                        .bind(generation)
                        .bind(self.now())
                        .fetch_optional(&mut *c)
                        .await?
                });
                let Some((attempt, now, code)) = expired else {
                    continue;
                };
                let body = json!({ "error_code": code, "error_class": "retryable", "attempts": attempt });
                self.terminate(tx.conn(), &tenant, run_id, "failed", None, "run_failed", &body, now)
                    .await?;
                let lease = Lease {
                    tenant,
                    run_id,
                    owner: String::new(),
                    generation,
                };
                close_attempt(tx.conn(), &lease, now, "dead", Some(ErrorClass::Retryable), Some(&code)).await?;
                n += 1;
            }
            Ok(n)
        }
        .await;
        tx.finish(r).await
    }

    /// Dead jobs of `tenant`, optionally only those with `error_code`, with
    /// their attempt history.
    pub async fn list_dead(&self, tenant: &str, error_code: Option<&str>, limit: u32) -> Result<Vec<DeadJob>> {
        let rows: Vec<DeadRow> = on_pool!(self.db(), |p, q| {
            sqlx::query_as(q.list_dead)
                .bind(tenant)
                .bind(error_code)
                .bind(i64::from(limit))
                .fetch_all(p)
                .await?
        });
        let mut out = Vec::with_capacity(rows.len());
        for row in rows {
            let history = self.list_attempts(&row.tenant, row.run_id).await?;
            out.push(DeadJob {
                tenant: row.tenant,
                run_id: row.run_id,
                queue: row.queue,
                operation: row.operation,
                error_code: row.last_error_code,
                attempts: row.attempts,
                died_at: row.updated_at,
                history,
            });
        }
        Ok(out)
    }

    /// The attempt history of a run's job, one row per claim, in claim
    /// (generation) order.
    pub async fn list_attempts(&self, tenant: &str, run_id: Uuid) -> Result<Vec<JobAttempt>> {
        Ok(on_pool!(self.db(), |p, q| {
            sqlx::query_as(q.list_attempts)
                .bind(tenant)
                .bind(run_id)
                .fetch_all(p)
                .await?
        }))
    }

    /// Deletes up to `batch` finished attempt rows older than `before`
    /// (retention of attempt history). Returns how many.
    pub async fn sweep_attempts(&self, before: crate::Millis, batch: u32) -> Result<u64> {
        let done = on_pool!(self.db(), |p, q| {
            sqlx::query(q.sweep_attempts)
                .bind(before.get())
                .bind(i64::from(batch))
                .execute(p)
                .await?
                .rows_affected()
        });
        Ok(done)
    }

    /// Jobs of `tenant` waiting to be claimed (for backpressure).
    pub async fn queued_depth(&self, tenant: &str) -> Result<i64> {
        Ok(on_pool!(self.db(), |p, q| {
            sqlx::query_scalar(q.queued_depth).bind(tenant).fetch_one(p).await?
        }))
    }

    /// Replays a dead run as a **new** run under a new operation identity
    /// (`<operation>.replay`, keyed by the dead run id), linked through
    /// `replay_of`. The dead run gets a `replay_requested` audit event naming
    /// `actor` and `reason`. A second replay of the same run is refused with
    /// [`Error::AlreadyReplayed`] unless `force`.
    pub async fn replay_dead(
        &self,
        tenant: &str,
        run_id: Uuid,
        actor: &str,
        reason: &str,
        force: bool,
    ) -> Result<Accepted> {
        let mut tx = self.begin().await?;
        let r = self
            .replay_dead_in(tx.conn(), tenant, run_id, actor, reason, force)
            .await;
        tx.finish(r).await
    }

    /// [`Ferry::replay_dead`] inside the caller's transaction.
    pub async fn replay_dead_in(
        &self,
        mut conn: Conn<'_>,
        tenant: &str,
        run_id: Uuid,
        actor: &str,
        reason: &str,
        force: bool,
    ) -> Result<Accepted> {
        self.limits().tenant(tenant)?;
        self.limits().text("actor", actor, 255)?;
        self.limits().text("reason", reason, 4096)?;
        let locked: Option<(String, i64)> = on_conn!(conn.reborrow(), |c, q| {
            sqlx::query_as(q.lock_run)
                .bind(tenant)
                .bind(run_id)
                .fetch_optional(&mut *c)
                .await?
        });
        let (state, _) = locked.ok_or(Error::NotFound { what: "run" })?;
        if state != "failed" {
            return Err(Error::InvalidState {
                run_id,
                state,
                reason: "only failed runs can be replayed",
            });
        }
        let earlier: Option<Uuid> = on_conn!(conn.reborrow(), |c, q| {
            sqlx::query_scalar(q.find_replay)
                .bind(tenant)
                .bind(run_id)
                .fetch_optional(&mut *c)
                .await?
        });
        if let (Some(replayed_as), false) = (earlier, force) {
            return Err(Error::AlreadyReplayed { run_id, replayed_as });
        }
        let dead = get_run_in(conn.reborrow(), tenant, run_id).await?;
        let job: (String, String, i32, i32, i64, Option<String>) = on_conn!(conn.reborrow(), |c, q| {
            sqlx::query_as(q.get_job)
                .bind(tenant)
                .bind(run_id)
                .fetch_one(&mut *c)
                .await?
        });
        let nth = dead.last_event_seq; // distinct per replay: every replay appends an event
        let mut new = NewRun::new(
            tenant,
            format!("{}.replay", dead.operation),
            format!("{run_id}.{nth}"),
            dead.request.clone(),
        )
        .queue(job.0)
        .max_attempts(job.2 as u32);
        new.replay_of = Some(run_id);
        let accepted = self.create_run_idempotent_in(conn.reborrow(), new).await?;
        let body = json!({ "actor": actor, "reason": reason, "new_run_id": accepted.run.run_id });
        self.append_event_in(conn, tenant, run_id, "replay_requested", &body)
            .await?;
        Ok(accepted)
    }

    /// Jobs of `tenant`, newest first, optionally only in `state`.
    pub async fn list_jobs(&self, tenant: &str, state: Option<&str>, limit: u32) -> Result<Vec<JobSummary>> {
        Ok(on_pool!(self.db(), |p, q| {
            sqlx::query_as(q.list_jobs)
                .bind(tenant)
                .bind(state)
                .bind(i64::from(limit))
                .fetch_all(p)
                .await?
        }))
    }

    /// Locks the leased job row if `lease` is current; returns `(now, attempt)`.
    pub(crate) async fn lock_fence(&self, mut conn: Conn<'_>, lease: &Lease) -> Result<(i64, i32)> {
        let row: Option<(i64, i32)> = on_conn!(conn.reborrow(), |c, q| {
            sqlx::query_as(q.lock_fence)
                .bind(&lease.tenant)
                .bind(lease.run_id)
                .bind(&lease.owner)
                .bind(lease.generation)
                .bind(self.now())
                .fetch_optional(&mut *c)
                .await?
        });
        match row {
            Some(r) => Ok(r),
            None => Err(self.refusal(conn, lease, Transition::Finish).await),
        }
    }

    /// Fenced end of a lease; returns `(attempt, max_attempts, created_at, now)`.
    async fn finish_job(
        &self,
        mut conn: Conn<'_>,
        lease: &Lease,
        state: &str,
        available_at: Option<i64>,
        code: Option<&str>,
    ) -> Result<(i32, i32, i64, i64)> {
        let row: Option<(i32, i32, i64, i64)> = on_conn!(conn.reborrow(), |c, q| {
            sqlx::query_as(q.finish_job)
                .bind(&lease.tenant)
                .bind(lease.run_id)
                .bind(&lease.owner)
                .bind(lease.generation)
                .bind(self.now())
                .bind(state)
                .bind(available_at)
                .bind(code)
                .fetch_optional(&mut *c)
                .await?
        });
        match row {
            Some(r) => Ok(r),
            None => Err(self.refusal(conn, lease, Transition::Finish).await),
        }
    }

    /// Compare-and-set of the run to a terminal state plus the terminal event.
    #[allow(clippy::too_many_arguments)]
    async fn terminate(
        &self,
        mut conn: Conn<'_>,
        tenant: &str,
        run_id: Uuid,
        state: &str,
        expected_version: Option<i64>,
        kind: &str,
        body: &Value,
        now: i64,
    ) -> Result<()> {
        let row: Option<(i64, i64, i64)> = on_conn!(conn.reborrow(), |c, q| {
            sqlx::query_as(q.terminate_run)
                .bind(tenant)
                .bind(run_id)
                .bind(state)
                .bind(now)
                .bind(expected_version)
                .fetch_optional(&mut *c)
                .await?
        });
        let Some((seq, _version, at)) = row else {
            let run = get_run_in(conn, tenant, run_id).await?;
            return Err(if run.state.is_terminal() {
                Error::RunTerminal {
                    run_id,
                    state: run.state.as_str().into(),
                }
            } else {
                Error::InvalidState {
                    run_id,
                    state: format!("at version {}", run.version),
                    reason: "the run version changed",
                }
            });
        };
        write_event(self, conn, tenant, run_id, seq, kind, body, at, None).await
    }

    /// Names the reason a fenced statement matched nothing.
    async fn refusal(&self, conn: Conn<'_>, lease: &Lease, transition: Transition) -> Error {
        let status: std::result::Result<Option<JobStatus>, sqlx::Error> = on_conn!(conn, |c, q| {
            sqlx::query_as(q.job_status)
                .bind(&lease.tenant)
                .bind(lease.run_id)
                .bind(self.now())
                .fetch_optional(&mut *c)
                .await
        });
        let lost = Error::LostLease {
            run_id: lease.run_id,
            generation: lease.generation,
        };
        let status = match status {
            Ok(Some(s)) => s,
            Ok(None) => return Error::NotFound { what: "job" },
            Err(e) => return e.into(),
        };
        let ours =
            status.lease_owner.as_deref() == Some(lease.owner.as_str()) && status.lease_generation == lease.generation;
        match status.state.as_str() {
            "cancelled" if transition == Transition::Renew => Error::Cancelled { run_id: lease.run_id },
            "cancelled" | "succeeded" | "dead" if status.lease_generation == lease.generation => Error::RunTerminal {
                run_id: lease.run_id,
                state: status.run_state,
            },
            "leased"
                if ours && status.deadline_at.is_some_and(|d| d <= status.now) && transition == Transition::Renew =>
            {
                Error::DeadlineExceeded { run_id: lease.run_id }
            }
            _ => {
                tracing::warn!(run_id = %lease.run_id, generation = lease.generation, current = status.lease_generation,
                    expired = status.lease_expires_at.is_some_and(|e| e <= status.now), "lease lost");
                lost
            }
        }
    }
}

impl ClaimRow {
    fn into_claimed(self, operation: String, request: Value, replay_of: Option<Uuid>) -> Claimed {
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
async fn close_attempt(
    conn: Conn<'_>,
    lease: &Lease,
    now: i64,
    outcome: &str,
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

fn positive_ms(field: &'static str, d: Duration) -> Result<i64> {
    let ms = duration_ms(d)?;
    if ms <= 0 {
        return Err(Error::invalid(field, "must be at least 1 ms"));
    }
    Ok(ms)
}
