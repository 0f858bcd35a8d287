//! The acceptance transaction: the idempotency key first, then the run,
//! `run_queued`, the job and the outbox row; a replay reads the first run
//! and writes nothing.

use serde_json::Value;
use sqlx::types::Json;
use uuid::Uuid;

use super::*;
use crate::error::{violated_constraint, Error, Result};
use crate::fingerprint::{fingerprint, redact};
use crate::store::{on_conn, Conn};
use crate::time::Millis;
use crate::Ferry;

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
    pub async fn create_run_idempotent_in<'c>(&self, conn: impl Into<Conn<'c>>, run: NewRun) -> Result<Accepted> {
        self.accept_one_in(conn.into().routed(self.db()), run, true).await
    }

    /// Accepts a follow-up run from a handler, inside the handler's
    /// transaction: workflows as chains. The run's parent is the leased run
    /// (`parent_run_id`), its tenant must be the lease's, and the lease is
    /// checked and the job row held for the rest of the transaction (the
    /// fence [`Jobs::complete_in`](crate::Jobs::complete_in) takes), so a stale handler creates
    /// nothing: [`Error::LostLease`], [`Error::RunTerminal`] and the caller
    /// rolls back. Commit it with [`Jobs::complete_in`](crate::Jobs::complete_in) in the same
    /// transaction and the child exists if and only if the parent's job
    /// completed. The child's idempotency key makes a retried handler replay
    /// the child instead of creating a second one. The parent is not part
    /// of the request's fingerprint: a key whose run is not this lease's
    /// child (another parent's child, or a run accepted without a parent) is
    /// [`Error::IdempotencyConflict`], not a replay of that run, so keys of
    /// follow-ups should name their parent (e.g. `ship:<order id>`).
    pub async fn enqueue_run_in<'c>(
        &self,
        conn: impl Into<Conn<'c>>,
        lease: &crate::Lease,
        run: NewRun,
    ) -> Result<Accepted> {
        let mut conn: Conn<'c> = conn.into().routed(self.db());
        if run.tenant != lease.tenant {
            return Err(Error::invalid(
                "tenant",
                "a follow-up run belongs to its parent's tenant",
            ));
        }
        if run.parent_run_id.is_some_and(|p| p != lease.run_id) {
            return Err(Error::invalid(
                "parent_run_id",
                "a follow-up run's parent is the leased run",
            ));
        }
        run.validate(self)?;
        self.jobs().lock_fence(conn.reborrow(), lease).await?;
        let key_hash = redact(&run.idempotency_key);
        let operation = run.operation.clone();
        let accepted = self.create_run_idempotent_in(conn, run.parent(lease.run_id)).await?;
        if accepted.replay && accepted.run.parent_run_id != Some(lease.run_id) {
            // A replay writes nothing, so refusing it leaves nothing behind.
            tracing::info!(tenant = %lease.tenant, %operation, key = %key_hash, "follow-up key held by another parent's run");
            return Err(Error::IdempotencyConflict {
                operation,
                key_hash,
                existing_run: accepted.run.run_id,
            });
        }
        Ok(accepted)
    }

    /// Accepts many runs in one transaction of their own; see
    /// [`Ferry::create_runs_idempotent_in`] for what each item's result
    /// means. The outer `Err` is a failure of the whole batch (the database,
    /// a race to retry): then nothing was written. Items refused on their
    /// own (invalid input, an idempotency conflict, a duplicate run id) do
    /// not stop the others from committing.
    pub async fn create_runs_idempotent(&self, runs: Vec<NewRun>) -> Result<Vec<Result<Accepted>>> {
        if runs.is_empty() {
            return Ok(Vec::new());
        }
        let mut tx = self.begin().await?;
        let result = self.create_runs_idempotent_in(tx.conn(), runs).await;
        tx.finish(result).await
    }

    /// Accepts many runs inside the caller's transaction, one result per
    /// input in input order, each exactly what [`Ferry::create_run_idempotent_in`]
    /// would have answered had the items been accepted one after another:
    ///
    /// - invalid input is `Err(Error::InvalidInput)` for that item, which
    ///   writes nothing, and the rest proceed;
    /// - a key seen before with an equivalent request is a replay
    ///   (`Accepted { replay: true, run }` with the original run), writing nothing;
    /// - a key seen before with another request is
    ///   `Err(Error::IdempotencyConflict)` for that item;
    /// - a live key wins over a proposed run id that exists; a new key whose
    ///   proposed run id exists is `Err(Error::DuplicateRun)` for that item,
    ///   which writes nothing (the single call fails the whole transaction);
    /// - two items with one `(tenant, operation, key)`: the first accepted
    ///   one wins, a later one is its replay when equivalent and a conflict
    ///   otherwise;
    /// - an expired key is taken over, as by the single call.
    ///
    /// On PostgreSQL the batch is set-based: one statement claims every key
    /// (in key order, so concurrent batches cannot deadlock on each other's
    /// keys), one reads the records of keys that were not claimed (only when
    /// there are any), one writes the runs, their `run_queued` events, jobs
    /// and outbox rows, and at most one sends the wake-up NOTIFY (coalesced
    /// like the single call's). A batch whose items propose one run id twice
    /// is accepted item by item under savepoints instead. On SQLite, which
    /// has a single writer, items are accepted one by one, each under a
    /// savepoint so a refused item leaves nothing behind.
    ///
    /// Nothing is visible until the caller commits. The outer `Err` fails
    /// the whole batch: the database's errors, and [`Error::Raced`] when a
    /// concurrent acceptance took a proposed run id after the batch checked
    /// it (retrying the batch then answers that item `DuplicateRun`). After
    /// an outer `Err` the caller must roll back.
    pub async fn create_runs_idempotent_in<'c>(
        &self,
        conn: impl Into<Conn<'c>>,
        runs: Vec<NewRun>,
    ) -> Result<Vec<Result<Accepted>>> {
        self.accept_batch_in(conn.into().routed(self.db()), runs).await
    }

    /// The items of a batch one by one, each under a savepoint, without
    /// wake-ups (the caller sends them once for the batch): the SQLite
    /// path, and PostgreSQL's for batches the set-based path cannot decide.
    /// An item's own refusal is its result; anything else fails the batch.
    pub(crate) async fn accept_each_in(&self, mut conn: Conn<'_>, runs: Vec<NewRun>) -> Result<Vec<Result<Accepted>>> {
        let mut out = Vec::with_capacity(runs.len());
        for run in runs {
            // Validation is the single call's own, before it writes anything.
            let one = conn
                .in_savepoint(async |c| self.accept_one_in(c, run, false).await)
                .await?;
            match one {
                Err(e) if !refuses_only_its_item(&e) => return Err(e),
                one => out.push(one),
            }
        }
        Ok(out)
    }

    /// The single acceptance; `wake` sends the queue's wake-up for a new run.
    async fn accept_one_in<'c>(&self, conn: impl Into<Conn<'c>>, run: NewRun, wake: bool) -> Result<Accepted> {
        let mut conn: Conn<'c> = conn.into().routed(self.db());
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
        let (scheduled_at, available_at, deadline_at) = run.instants(now)?;
        if let Some(parent) = run.parent_run_id {
            // Runs are never deleted, so the parent cannot vanish before commit.
            get_run_in(conn.reborrow(), &run.tenant, parent)
                .await
                .map_err(|e| match e {
                    Error::NotFound { .. } => Error::NotFound { what: "parent run" },
                    e => e,
                })?;
        }
        let inserted = on_conn!(conn.reborrow(), |c, q| {
            sqlx::query(q.insert_run)
                .bind(&run.tenant)
                .bind(run_id)
                .bind(&run.operation)
                .bind(Json(&run.command))
                .bind(deadline_at)
                .bind(run.replay_of)
                .bind(now)
                .bind(scheduled_at)
                .bind(run.parent_run_id)
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
        on_conn!(conn.reborrow(), |c, q| {
            sqlx::query(q.insert_job)
                .bind(&run.tenant)
                .bind(run_id)
                .bind(&run.queue)
                .bind(available_at)
                .bind(run.max_attempts as i32)
                .bind(deadline_at)
                .bind(now)
                .bind(run.priority)
                .bind(run.priority_lead(self))
                .execute(&mut *c)
                .await?;
        });
        // After the job: the event's outbox row follows the job's queue.
        let body = queued_body(&run, scheduled_at);
        let event = Event {
            tenant: &run.tenant,
            run_id,
            seq: 1,
            kind: "run_queued",
            body: &body,
            at: now,
            traceparent: run.traceparent.clone().or_else(crate::telemetry::current_traceparent),
        };
        write_event(self, conn.reborrow(), event).await?;
        if wake {
            self.inner.notifier.wake(conn, &run.queue).await?;
        }
        tracing::debug!(tenant = %run.tenant, %run_id, key = %redact(&run.idempotency_key), "run accepted");
        Ok(Accepted {
            run: Run {
                tenant: run.tenant,
                run_id,
                operation: run.operation,
                state: RunState::Queued,
                version: 1,
                request: run.command,
                deadline_at: deadline_at.map(Millis::new).transpose()?,
                replay_of: run.replay_of,
                scheduled_at: scheduled_at.map(Millis::new).transpose()?,
                parent_run_id: run.parent_run_id,
                created_at: Millis::new(now)?,
                updated_at: Millis::new(now)?,
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
        let key_hash = check_equivalent(run, fp, version, &stored_fp, stored_version, run_id)?;
        let original = get_run_in(conn, &run.tenant, run_id).await?;
        tracing::debug!(tenant = %run.tenant, %run_id, key = %key_hash, "idempotent replay");
        Ok(Accepted {
            run: original,
            replay: true,
        })
    }
}

/// Compares a request with the idempotency record its key holds: the key's
/// redacted hash when they are equivalent (a replay), the
/// [`Error::IdempotencyConflict`] otherwise.
pub(crate) fn check_equivalent(
    run: &NewRun,
    fp: &str,
    version: i32,
    stored_fp: &str,
    stored_version: i32,
    existing_run: Uuid,
) -> Result<String> {
    let key_hash = redact(&run.idempotency_key);
    if stored_fp != fp || stored_version != version {
        tracing::info!(tenant = %run.tenant, operation = %run.operation, key = %key_hash, "idempotency conflict");
        return Err(Error::IdempotencyConflict {
            operation: run.operation.clone(),
            key_hash,
            existing_run,
        });
    }
    Ok(key_hash)
}

/// Whether `e` refuses one item of a batch and leaves the others to
/// proceed (anything else fails the whole batch).
pub(crate) fn refuses_only_its_item(e: &Error) -> bool {
    matches!(
        e,
        Error::InvalidInput { .. }
            | Error::IdempotencyConflict { .. }
            | Error::DuplicateRun { .. }
            | Error::Raced(_)
            | Error::NotFound { .. }
    )
}

/// The body of `run_queued`: the largest wrapper Ferry puts around a
/// caller's document (sized in [`crate::Limits::run_event_overhead`]).
/// Fields are declared in byte order of their names, as a JSON object map
/// serializes them by default; it borrows the command instead of copying it.
/// `parent_run_id` and `scheduled_at` appear only when set (the bulk
/// acceptance's SQL strips them the same way).
#[derive(serde::Serialize)]
pub(crate) struct QueuedBody<'a> {
    operation: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    parent_run_id: Option<Uuid>,
    queue: &'a str,
    replay_of: Option<Uuid>,
    request: &'a Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    scheduled_at: Option<i64>,
    schema_version: u32,
}

/// The `run_queued` body of `run`, scheduled at `scheduled_at`.
pub(crate) fn queued_body(run: &NewRun, scheduled_at: Option<i64>) -> QueuedBody<'_> {
    QueuedBody {
        operation: &run.operation,
        parent_run_id: run.parent_run_id,
        queue: &run.queue,
        replay_of: run.replay_of,
        request: &run.command,
        scheduled_at,
        schema_version: run.schema_version,
    }
}
