//! Operator queries and actions on jobs: dead jobs with their history,
//! attempts, depth, the per-queue gauges the relay exports, replaying a
//! dead run, listing.

use serde_json::json;
use uuid::Uuid;

use super::*;
use crate::error::{Error, Result};
use crate::runs::{get_run_in, Accepted, NewRun, RunState};
use crate::store::{on_conn, on_pool, Conn};
use crate::{Ferry, Operator, Role};

impl Operator<'_> {
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
}

/// One queue's job signals, as the relay exports them
/// (`ferry_jobs_*{queue}`) for the job alerts: each is read on an index
/// range, never by walking the backlog (see `queue_gauges` in
/// `sql/jobs.sql`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueGauges {
    /// The queue.
    pub queue: String,
    /// How long its oldest due queued job has waited since its
    /// `available_at`, in ms (0 when none is due): workers that fall behind
    /// or serve no more this queue show here first.
    pub oldest_due_age_ms: i64,
    /// Leases that expired and were neither reclaimed nor reaped yet (under
    /// the attempt budget the next claim in the queue takes them back; on
    /// their last attempt it makes them dead); more than zero for long
    /// means nobody claims in this queue.
    pub expired_leases: i64,
    /// Dead jobs (attempts spent or a terminal error), waiting for an
    /// operator's replay or cancel.
    pub dead: i64,
}

impl Operator<'_> {
    /// Every queue's [`QueueGauges`], by queue name: the queues with a
    /// queued, leased or dead job (a queue with none of them has nothing to
    /// report, whether or not it has a `ferry_queues` row).
    pub async fn queue_gauges(&self) -> Result<Vec<QueueGauges>> {
        let now = self.now();
        let live: Vec<(String, Option<i64>, i64, i64)> = on_pool!(self.db(), |p, q| {
            sqlx::query_as(q.queue_gauges).bind(now).fetch_all(p).await?
        });
        let dead: Vec<(String, i64)> = on_pool!(self.db(), |p, q| {
            sqlx::query_as(q.dead_by_queue).fetch_all(p).await?
        });
        let mut out: std::collections::BTreeMap<String, QueueGauges> = std::collections::BTreeMap::new();
        let blank = |queue: &str| QueueGauges {
            queue: queue.to_owned(),
            oldest_due_age_ms: 0,
            expired_leases: 0,
            dead: 0,
        };
        for (queue, oldest_due, expired_leases, now) in live {
            let g = out.entry(queue.clone()).or_insert_with(|| blank(&queue));
            g.oldest_due_age_ms = oldest_due.map_or(0, |at| (now - at).max(0));
            g.expired_leases = expired_leases;
        }
        for (queue, dead) in dead {
            out.entry(queue.clone()).or_insert_with(|| blank(&queue)).dead = dead;
        }
        Ok(out.into_values().collect())
    }
}

impl Jobs<'_> {
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
}

impl Ferry {
    /// Jobs of `tenant` waiting to be claimed (for backpressure).
    pub async fn queued_depth(&self, tenant: &str) -> Result<i64> {
        let mut c = self.db().acquire().await?;
        self.queued_depth_in(c.conn(), tenant).await
    }

    /// [`Ferry::queued_depth`] inside the caller's transaction, counting the
    /// runs it accepted and has not committed yet: a service can accept a
    /// run first, so that a retried request is answered as the replay it is
    /// whatever the backlog, and then check its limit before committing.
    pub async fn queued_depth_in<'c>(&self, conn: impl Into<Conn<'c>>, tenant: &str) -> Result<i64> {
        let conn: Conn<'c> = conn.into().routed(self.db());
        Ok(on_conn!(conn, |c, q| {
            sqlx::query_scalar(q.queued_depth)
                .bind(tenant)
                .fetch_one(&mut *c)
                .await?
        }))
    }
}

impl Operator<'_> {
    /// Replays a dead run as a **new** run of the same operation (so the
    /// worker or [`crate::worker::Router`] that serves the operation serves
    /// the replay), with the dead run's request, queue, attempt budget and
    /// priority, linked through `replay_of`. The replay is told apart by its
    /// idempotency key, `replay:<dead run id>:<the dead run's event count>`
    /// (under 60 bytes whatever the operation), and by `replay_of`: should a
    /// run that does not replay this one hold that key, the replay is
    /// [`Error::IdempotencyConflict`] and nothing is written. The dead run
    /// gets a `replay_requested` audit event naming `actor` and `reason`. A second
    /// replay of the same run is refused with [`Error::AlreadyReplayed`]
    /// unless `force`.
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

    /// [`Operator::replay_dead`] inside the caller's transaction.
    pub async fn replay_dead_in<'c>(
        &self,
        conn: impl Into<Conn<'c>>,
        tenant: &str,
        run_id: Uuid,
        actor: &str,
        reason: &str,
        force: bool,
    ) -> Result<Accepted> {
        let mut conn: Conn<'c> = conn.into().routed(self.db());
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
        if RunState::parse(&state)? != RunState::Failed {
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
        let job: JobRow = on_conn!(conn.reborrow(), |c, q| {
            sqlx::query_as(q.get_job)
                .bind(tenant)
                .bind(run_id)
                .fetch_one(&mut *c)
                .await?
        });
        // Distinct per replay: every replay appends an event to the dead run.
        let key = replay_key(run_id, dead.last_event_seq);
        let mut new = NewRun::new(tenant, dead.operation, key.clone(), dead.request)
            .queue(job.queue)
            .max_attempts(job.max_attempts as u32)
            .priority(job.priority);
        new.replay_of = Some(run_id);
        let accepted = self.ferry.create_run_idempotent_in(conn.reborrow(), new).await?;
        if accepted.replay {
            // The key was taken, and nothing was written. By this run's
            // replay: it is the answer again. By any other run (a client
            // that chose such a key): refused.
            if accepted.run.replay_of == Some(run_id) {
                return Ok(accepted);
            }
            return Err(Error::IdempotencyConflict {
                operation: accepted.run.operation,
                key_hash: crate::fingerprint::redact(&key),
                existing_run: accepted.run.run_id,
            });
        }
        let body = json!({ "actor": actor, "reason": reason, "new_run_id": accepted.run.run_id });
        self.ferry
            .append_event_in(conn, tenant, run_id, "replay_requested", &body)
            .await?;
        Ok(accepted)
    }

    /// Jobs of `tenant`, newest first, optionally only in `state`.
    pub async fn list_jobs(&self, tenant: &str, state: Option<JobState>, limit: u32) -> Result<Vec<JobSummary>> {
        Ok(on_pool!(self.db(), |p, q| {
            sqlx::query_as(q.list_jobs)
                .bind(tenant)
                .bind(state)
                .bind(i64::from(limit))
                .fetch_all(p)
                .await?
        }))
    }
}

/// The idempotency key of the replay of dead run `run_id` made when the
/// dead run's newest event was `seq`: `replay:<run id>:<seq>`, under 60
/// bytes whatever the operation, so a replay of a replay is keyed alike.
fn replay_key(run_id: Uuid, seq: i64) -> String {
    format!("replay:{}:{seq}", run_id.simple())
}
