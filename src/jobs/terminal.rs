//! Terminal transitions, each fenced and atomic: complete (one or a batch,
//! or inside the caller's transaction), fail (retry or dead), cancel, and
//! reaping jobs nobody may work any more.

use serde_json::{json, Value};
use uuid::Uuid;

use super::*;
use crate::error::{Error, Result};
use crate::runs::{get_run_in, write_event, Event};
use crate::store::{on_conn, Conn};
use crate::{Ferry, Role};

impl Jobs<'_> {
    /// Completes many leases in one transaction (one commit): each is fenced
    /// and terminalized exactly like [`Jobs::complete`]. Returns one result
    /// per lease, in order; a refused lease does not affect the others.
    #[tracing::instrument(name = "ferry.complete_batch", skip_all, fields(count = items.len()))]
    pub async fn complete_batch(&self, items: &[(Lease, Value)]) -> Result<Vec<Result<()>>> {
        for (_, result) in items {
            self.limits().json("result", result)?;
        }
        let mut tx = self.begin().await?;
        let r = self.ferry.complete_batch_in(tx.conn(), items).await;
        tx.finish(r).await
    }

    /// Completes `items` and claims the next jobs for the freed slots, in one
    /// commit: each lease is fenced and terminalized exactly like
    /// [`Jobs::complete`] (one result per lease, in order; a refused lease
    /// affects neither the others nor the claim), and up to `limit` jobs of
    /// `queue` are claimed for `owner` exactly like [`Jobs::claim`]. On
    /// PostgreSQL it is ONE statement, autocommitted: one round trip (a
    /// refused lease costs one more read to name the refusal, after the
    /// commit). On SQLite it is one transaction. Either both halves commit
    /// or neither does.
    #[tracing::instrument(name = "ferry.complete_and_claim", skip_all, fields(count = items.len(), queue, limit, claimed))]
    pub async fn complete_and_claim(
        &self,
        items: &[(Lease, Value)],
        queue: &str,
        owner: &str,
        lease: std::time::Duration,
        limit: u32,
    ) -> Result<(Vec<Result<()>>, Vec<Claimed>)> {
        let args = self.check_complete_and_claim(items, queue, owner, lease, limit)?;
        let span = tracing::Span::current();
        span.record("queue", queue).record("limit", limit);
        let limited = self.limited_hint(queue);
        let out = if self.db().writes_in_one_statement() && !limited {
            let mut c = self.db().acquire().await?;
            self.ferry.complete_and_claim_on(c.conn(), items, args, false).await?
        } else {
            // SQLite, and a queue this process found limited on PostgreSQL:
            // the limited claim takes the queue's row lock, which needs a
            // transaction.
            let mut tx = self.begin().await?;
            let r = self.ferry.complete_and_claim_on(tx.conn(), items, args, limited).await;
            tx.finish(r).await?
        };
        span.record("claimed", out.1.len());
        Ok(out)
    }

    /// [`Jobs::complete_and_claim`] inside the caller's transaction: both
    /// halves commit or roll back with it. `conn` must be in a transaction:
    /// in a limited queue the claim holds the queue's settings row until
    /// commit, which is what keeps concurrent claims within the limits. On
    /// PostgreSQL a limited queue's claim on a connection outside a
    /// transaction is refused (`unsupported`) before it leases anything;
    /// the completions, each then its own autocommitted statement, have
    /// already committed by then.
    pub async fn complete_and_claim_in<'c>(
        &self,
        conn: impl Into<Conn<'c>>,
        items: &[(Lease, Value)],
        queue: &str,
        owner: &str,
        lease: std::time::Duration,
        limit: u32,
    ) -> Result<(Vec<Result<()>>, Vec<Claimed>)> {
        let args = self.check_complete_and_claim(items, queue, owner, lease, limit)?;
        self.ferry
            .complete_and_claim_on(conn.into().routed(self.db()), items, args, self.limited_hint(queue))
            .await
    }

    fn check_complete_and_claim<'a>(
        &self,
        items: &[(Lease, Value)],
        queue: &'a str,
        owner: &'a str,
        lease: std::time::Duration,
        limit: u32,
    ) -> Result<(&'a str, &'a str, i64, u32)> {
        for (_, result) in items {
            self.limits().json("result", result)?;
        }
        self.limits().name("queue", queue)?;
        self.limits().name("owner", owner)?;
        Ok((queue, owner, positive_ms("lease", lease)?, limit))
    }

    /// Completes the job: job `succeeded`, run `succeeded`, the
    /// `run_succeeded` event carrying `result` and its outbox row, and the
    /// attempt closed, in one transaction.
    #[tracing::instrument(name = "ferry.complete", skip_all, fields(tenant = %lease.tenant, run_id = %lease.run_id, generation = lease.generation))]
    pub async fn complete(&self, lease: &Lease, result: &Value) -> Result<()> {
        // Refused input touches no database (complete_in checks again for
        // callers that come straight to it).
        self.limits().json("result", result)?;
        let mut tx = self.begin().await?;
        let r = self.complete_in(tx.conn(), lease, result).await;
        tx.finish(r).await
    }

    /// [`Jobs::complete`] inside the caller's transaction, so a handler
    /// commits its own domain writes and the job's completion atomically.
    /// Fenced exactly like `complete`: a lost lease is [`Error::LostLease`]
    /// and the caller must roll back. `conn` is a [`Conn`], a `&mut Tx`, or
    /// the caller's own `&mut sqlx::PgConnection` / `&mut SqliteConnection`.
    pub async fn complete_in<'c>(&self, conn: impl Into<Conn<'c>>, lease: &Lease, result: &Value) -> Result<()> {
        self.limits().json("result", result)?;
        let mut conn: Conn<'c> = conn.into().routed(self.db());
        let Finished { now } = self
            .finish_job(conn.reborrow(), lease, JobState::Succeeded, None, None)
            .await?;
        self.terminate(
            conn.reborrow(),
            (&lease.tenant, lease.run_id),
            Terminal::Succeeded,
            None,
            &json!({ "result": result }),
            now,
        )
        .await?;
        close_attempt(conn, lease, now, AttemptOutcome::Succeeded, None, None).await
    }

    /// Records a failed attempt. Retryable and ambiguous errors requeue the
    /// job at `now + policy.delay(..)` (persisted), unless the attempt budget,
    /// the run's deadline or the policy's total retry time is spent; terminal
    /// errors and spent budgets make the job dead and the run failed, with the
    /// `run_failed` event and its outbox row, atomically. Ambiguous errors
    /// also mark the attempt's reserved effects `unknown`.
    #[tracing::instrument(
        name = "ferry.fail",
        skip_all,
        fields(tenant = %lease.tenant, run_id = %lease.run_id, generation = lease.generation, error_code = %error.code, error_class = error.class.as_str(), outcome)
    )]
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
        let outcome = tx.finish(r).await?;
        tracing::Span::current().record(
            "outcome",
            match &outcome {
                FailOutcome::Retried { .. } => "retried",
                FailOutcome::Dead { .. } => "dead",
            },
        );
        Ok(outcome)
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
        let job: JobRow = on_conn!(conn.reborrow(), |c, q| {
            sqlx::query_as(q.get_job)
                .bind(&lease.tenant)
                .bind(lease.run_id)
                .fetch_one(&mut *c)
                .await?
        });
        let max_attempts = job.max_attempts;
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
                Some(max) => at > run.created_at.checked_add(max)?.get(),
                None => false,
            };
            if past_total {
                dead_code = Some("retry_deadline_exceeded".into());
            } else if run.deadline_at.is_some_and(|d| at >= d.get()) {
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
                self.finish_job(
                    conn.reborrow(),
                    lease,
                    JobState::Queued,
                    available_at,
                    Some(&error.code),
                )
                .await?;
                close_attempt(
                    conn,
                    lease,
                    now,
                    AttemptOutcome::Retried,
                    Some(class),
                    Some(&error.code),
                )
                .await?;
                Ok(FailOutcome::Retried {
                    available_at: crate::Millis::new(available_at.unwrap_or(now))?,
                })
            }
            Some(code) => {
                self.finish_job(conn.reborrow(), lease, JobState::Dead, None, Some(&code))
                    .await?;
                let body = json!({ "error_code": code, "error_class": class, "attempts": attempt });
                self.terminate(
                    conn.reborrow(),
                    (&lease.tenant, lease.run_id),
                    Terminal::Failed,
                    None,
                    &body,
                    now,
                )
                .await?;
                close_attempt(conn, lease, now, AttemptOutcome::Dead, Some(class), Some(&code)).await?;
                Ok(FailOutcome::Dead { code })
            }
        }
    }
}

impl Ferry {
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
    pub async fn cancel_in<'c>(
        &self,
        conn: impl Into<Conn<'c>>,
        tenant: &str,
        run_id: Uuid,
        expected_version: Option<i64>,
        actor: &str,
        reason: &str,
    ) -> Result<()> {
        let mut conn: Conn<'c> = conn.into().routed(self.db());
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
        self.jobs()
            .terminate(
                conn.reborrow(),
                (tenant, run_id),
                Terminal::Cancelled,
                expected_version,
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
                .bind(AttemptOutcome::Cancelled)
                .bind(None::<&str>)
                .bind(Some("cancelled"))
                .execute(&mut *c)
                .await?;
        });
        Ok(())
    }
}

impl Jobs<'_> {
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
                self.terminate(tx.conn(), (&tenant, run_id), Terminal::Failed, None, &body, now)
                    .await?;
                let lease = Lease {
                    tenant,
                    run_id,
                    owner: String::new(),
                    generation,
                };
                close_attempt(
                    tx.conn(),
                    &lease,
                    now,
                    AttemptOutcome::Dead,
                    Some(ErrorClass::Retryable),
                    Some(&code),
                )
                .await?;
                n += 1;
            }
            Ok(n)
        }
        .await;
        tx.finish(r).await
    }

    /// Fenced end of a lease into `state`; returns the statement's now.
    async fn finish_job(
        &self,
        mut conn: Conn<'_>,
        lease: &Lease,
        state: JobState,
        available_at: Option<i64>,
        code: Option<&str>,
    ) -> Result<Finished> {
        let row: Option<Finished> = on_conn!(conn.reborrow(), |c, q| {
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

    /// Compare-and-set of the run `(tenant, run_id)` to a terminal state plus
    /// the terminal event.
    async fn terminate(
        &self,
        mut conn: Conn<'_>,
        (tenant, run_id): (&str, Uuid),
        to: Terminal,
        expected_version: Option<i64>,
        body: &Value,
        now: i64,
    ) -> Result<()> {
        let row: Option<(i64, i64, i64)> = on_conn!(conn.reborrow(), |c, q| {
            sqlx::query_as(q.terminate_run)
                .bind(tenant)
                .bind(run_id)
                .bind(to.run_state().as_str())
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
        let event = Event {
            tenant,
            run_id,
            seq,
            kind: to.event_kind(),
            body,
            at,
            traceparent: None,
        };
        write_event(self.ferry, conn, event).await
    }
}
