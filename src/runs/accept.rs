//! The acceptance transaction: the idempotency key first, then the run,
//! `run_queued`, the job and the outbox row; a replay reads the first run
//! and writes nothing.

use serde_json::{json, Value};
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
        let mut conn: Conn<'c> = conn.into();
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
                deadline_at: deadline_at.map(Millis::new).transpose()?,
                replay_of: run.replay_of,
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
