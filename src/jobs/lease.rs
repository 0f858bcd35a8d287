//! Lease transitions: claim, renew, release, and the fence every terminal
//! transition takes first; a refused fence is named by [`Jobs::refusal`].

use std::time::Duration;

use super::*;
use crate::error::{Error, Result};
use crate::store::{on_conn, on_pool, Conn};
use crate::Role;

impl Jobs<'_> {
    /// Claims up to `limit` eligible jobs of `queue` for `owner`, each under a
    /// lease of `lease`, never past the run's deadline (like [`Jobs::renew`]). Eligible: due, under the attempt budget, not
    /// cancelled, and queued or leased past expiry. Higher priorities first,
    /// aged by waiting ([`NewRun::priority`](crate::NewRun)). On PostgreSQL this is one
    /// `FOR UPDATE SKIP LOCKED` statement that also writes the attempt rows.
    /// A paused queue claims nothing; a limited one claims at most what its
    /// limits allow, under a lock on its settings row ([`crate::QueueLimits`]).
    #[tracing::instrument(name = "ferry.claim", skip_all, fields(queue, owner, limit, claimed))]
    pub async fn claim(&self, queue: &str, owner: &str, lease: Duration, limit: u32) -> Result<Vec<Claimed>> {
        self.limits().name("queue", queue)?;
        self.limits().name("owner", owner)?;
        let lease_ms = positive_ms("lease", lease)?;
        if limit == 0 {
            return Ok(Vec::new());
        }
        let span = tracing::Span::current();
        span.record("queue", queue)
            .record("owner", owner)
            .record("limit", limit);
        let mut tx = self.begin().await?;
        let result = self.ferry.claim_in(tx.conn(), queue, owner, lease_ms, limit).await;
        let claimed = tx.finish(result).await?;
        span.record("claimed", claimed.len());
        Ok(claimed)
    }

    /// Extends the lease by `lease` from now, never past the run's deadline.
    /// Reports cancellation ([`Error::Cancelled`]) so the worker stops.
    /// Returns the new expiry.
    pub async fn renew(&self, lease: &Lease, duration: Duration) -> Result<crate::Millis> {
        crate::Millis::new(self.renew_at(lease, duration).await?.0)
    }

    /// [`Jobs::renew`], also returning the instant the new expiry was
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
                Some(now) => close_attempt(tx.conn(), lease, now, AttemptOutcome::Released, None, None).await,
                None => Err(self.refusal(tx.conn(), lease, Transition::Finish).await),
            }
        }
        .await;
        tx.finish(r).await
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

    /// Names the reason a fenced statement matched nothing.
    pub(crate) async fn refusal(&self, conn: Conn<'_>, lease: &Lease, transition: Transition) -> Error {
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
        match status.state {
            JobState::Cancelled if transition == Transition::Renew => Error::Cancelled { run_id: lease.run_id },
            JobState::Cancelled | JobState::Succeeded | JobState::Dead
                if status.lease_generation == lease.generation =>
            {
                Error::RunTerminal {
                    run_id: lease.run_id,
                    state: status.run_state,
                }
            }
            JobState::Leased
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
