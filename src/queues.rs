//! Queue settings (`ferry_queues`): those the claim enforces (pausing, a
//! global concurrency limit, a per-tenant concurrency limit (fair share) and
//! a token-bucket rate limit), and whether the queue's run events go to
//! Kafka (`publish_events`, read where each event is written). Each change
//! is an operator action, written with its `ferry_audit` row (actor,
//! reason) in one transaction.
//!
//! The claim reads the settings itself, so they hold across processes with
//! no coordinator: an open, unlimited queue (no row, or a row without
//! limits) is claimed by the plain `FOR UPDATE SKIP LOCKED` statement; a
//! paused one claims nothing; a limited one is claimed under a lock on its
//! row, so its claimers take turns and count the live leases exactly (see
//! `Ferry::claim_in` in `jobs/claim.rs`).

use std::time::Duration;

use crate::error::{Error, Result};
use crate::store::queries::Queries;
use crate::store::{on_conn, on_pool, Conn};
use crate::time::{duration_ms, Millis};
use crate::{Operator, Role};

/// A token bucket: one claim per `every`, with up to `burst` saved up (a
/// queue starts full). Each claimed job takes one token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct RateLimit {
    /// How many claims may come at once after a quiet spell (the bucket's size).
    pub burst: u32,
    /// How long one token takes to come back.
    pub every: Duration,
}

/// The limits a queue's claims obey; `None` is no limit. Leases count while
/// unexpired, so a crashed worker's jobs stop counting at their expiry.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct QueueLimits {
    /// At most this many jobs of the queue leased at once, across processes.
    pub max_leased: Option<u32>,
    /// At most this many jobs of one tenant leased at once: a tenant at its
    /// cap is skipped, so its flood cannot starve the others.
    pub max_leased_per_tenant: Option<u32>,
    /// A rate limit on claims.
    pub rate: Option<RateLimit>,
}

impl QueueLimits {
    /// Whether any limit is set.
    pub fn is_limited(&self) -> bool {
        self.max_leased.is_some() || self.max_leased_per_tenant.is_some() || self.rate.is_some()
    }

    fn validate(&self) -> Result<Option<(i32, i64)>> {
        let positive = |field, n: Option<u32>| match n {
            Some(0) => Err(Error::invalid(field, "must be at least 1 (or no limit)")),
            Some(n) if n > i32::MAX as u32 => Err(Error::invalid(field, "too large")),
            _ => Ok(()),
        };
        positive("max_leased", self.max_leased)?;
        positive("max_leased_per_tenant", self.max_leased_per_tenant)?;
        match self.rate {
            None => Ok(None),
            Some(r) => {
                positive("rate.burst", Some(r.burst))?;
                let ms = duration_ms(r.every)?;
                if !(1..=86_400_000).contains(&ms) {
                    return Err(Error::invalid("rate.every", "must be 1 ms to 1 day"));
                }
                Ok(Some((r.burst as i32, ms)))
            }
        }
    }

    /// The limits as one line for the audit trail and the CLI.
    pub fn describe(&self) -> String {
        let n = |v: Option<u32>| v.map_or("none".to_string(), |v| v.to_string());
        let rate = self.rate.map_or("none".to_string(), |r| {
            format!("{} per {} ms", r.burst, r.every.as_millis())
        });
        format!(
            "max_leased={} max_leased_per_tenant={} rate={rate}",
            n(self.max_leased),
            n(self.max_leased_per_tenant)
        )
    }
}

/// A queue with settings, as [`Operator::list_queues`] reports it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct QueueInfo {
    /// The queue.
    pub queue: String,
    /// Paused queues' jobs are not claimed.
    pub paused: bool,
    /// Whether its runs' events get outbox rows (and so reach Kafka); see
    /// [`Operator::set_queue_publish_events`].
    pub publish_events: bool,
    /// Its limits.
    pub limits: QueueLimits,
    /// Tokens in the bucket at its last claim or change (rate-limited queues).
    pub tokens: i64,
    /// Unexpired leases now.
    pub leased: i64,
    /// When the settings last changed (or a limited claim last refilled the bucket).
    pub updated_at: Millis,
}

#[derive(sqlx::FromRow)]
struct QueueRow {
    queue: String,
    paused: bool,
    publish_events: bool,
    max_leased: Option<i32>,
    max_leased_per_tenant: Option<i32>,
    rate_burst: Option<i32>,
    rate_interval_ms: Option<i64>,
    tokens: i64,
    updated_at: i64,
    leased: i64,
}

impl QueueRow {
    fn into_info(self) -> Result<QueueInfo> {
        let count = |v: Option<i32>| v.map(|n| n.max(0) as u32);
        let rate = match (self.rate_burst, self.rate_interval_ms) {
            (Some(burst), Some(ms)) => Some(RateLimit {
                burst: burst.max(0) as u32,
                every: Duration::from_millis(ms.max(0) as u64),
            }),
            _ => None,
        };
        Ok(QueueInfo {
            queue: self.queue,
            paused: self.paused,
            publish_events: self.publish_events,
            limits: QueueLimits {
                max_leased: count(self.max_leased),
                max_leased_per_tenant: count(self.max_leased_per_tenant),
                rate,
            },
            tokens: self.tokens,
            leased: self.leased,
            updated_at: Millis::new(self.updated_at)?,
        })
    }
}

impl Operator<'_> {
    /// Pauses `queue`: from the next claim on, its jobs are not claimed
    /// (a claim already running may still commit its batch). Leases already
    /// taken are untouched: their handlers renew, complete and fail as
    /// usual. Audited as `queue.pause` with `actor` and `reason`.
    pub async fn pause_queue(&self, queue: &str, actor: &str, reason: &str) -> Result<()> {
        self.set_paused(queue, true, actor, reason).await
    }

    /// Resumes a paused `queue` (a queue never paused is left as it is).
    /// Audited as `queue.resume` with `actor` and `reason`.
    pub async fn resume_queue(&self, queue: &str, actor: &str, reason: &str) -> Result<()> {
        self.set_paused(queue, false, actor, reason).await
    }

    /// [`Operator::pause_queue`] (`paused`) or [`Operator::resume_queue`] inside
    /// the caller's transaction, with its audit row.
    pub async fn set_queue_paused_in<'c>(
        &self,
        conn: impl Into<Conn<'c>>,
        queue: &str,
        paused: bool,
        actor: &str,
        reason: &str,
    ) -> Result<()> {
        self.check_operator_input(queue, actor, reason)?;
        let action = if paused { "queue.pause" } else { "queue.resume" };
        self.set_queue_flag_in(
            conn.into().routed(self.db()),
            |q| q.set_queue_paused,
            queue,
            paused,
            actor,
            action,
            reason,
        )
        .await
    }

    /// Writes one of `queue`'s flags (`pick` names the statement, bound to
    /// queue, value and now) and its audit row (`action`, `reason`), in the
    /// caller's transaction. The caller has checked its input.
    #[allow(clippy::too_many_arguments)]
    async fn set_queue_flag_in(
        &self,
        mut conn: Conn<'_>,
        pick: fn(&Queries) -> &'static str,
        queue: &str,
        value: bool,
        actor: &str,
        action: &str,
        reason: &str,
    ) -> Result<()> {
        on_conn!(conn.reborrow(), |c, q| {
            sqlx::query(pick(q))
                .bind(queue)
                .bind(value)
                .bind(self.now())
                .execute(&mut *c)
                .await?;
        });
        self.audit_in(conn, actor, action, queue, reason).await
    }

    async fn set_paused(&self, queue: &str, paused: bool, actor: &str, reason: &str) -> Result<()> {
        let mut tx = self.begin().await?;
        let r = self.set_queue_paused_in(tx.conn(), queue, paused, actor, reason).await;
        tx.finish(r).await
    }

    /// Sets whether `queue`'s runs publish their run events to Kafka (the
    /// default, `true`). With `false`, every later event of a run of the
    /// queue (acceptance, completion, failure, cancellation, expiry, a
    /// service's own `append_event`) is still written to `run_events` but
    /// gets no outbox row: consumers see no record of it, a run's lineage
    /// shows no outbox row for it, and the relay's backlog never counts it.
    /// The setting is read at each event's write, so a run accepted while
    /// it was on and finished after it was turned off published its
    /// `run_queued` event and not its terminal one. Audited as
    /// `queue.publish_events`, the reason followed by the new value; an
    /// invalid queue name, actor or reason is `invalid_input` and writes
    /// nothing.
    pub async fn set_queue_publish_events(&self, queue: &str, publish: bool, actor: &str, reason: &str) -> Result<()> {
        let mut tx = self.begin().await?;
        let r = self
            .set_queue_publish_events_in(tx.conn(), queue, publish, actor, reason)
            .await;
        tx.finish(r).await
    }

    /// [`Operator::set_queue_publish_events`] inside the caller's transaction.
    pub async fn set_queue_publish_events_in<'c>(
        &self,
        conn: impl Into<Conn<'c>>,
        queue: &str,
        publish: bool,
        actor: &str,
        reason: &str,
    ) -> Result<()> {
        self.check_operator_input(queue, actor, reason)?;
        let reason = format!("{reason} (publish_events={publish})");
        self.set_queue_flag_in(
            conn.into().routed(self.db()),
            |q| q.set_queue_publish_events,
            queue,
            publish,
            actor,
            "queue.publish_events",
            &reason,
        )
        .await
    }

    /// Replaces `queue`'s limits (all three at once; `QueueLimits::default()`
    /// lifts them). A queue getting a rate starts with a full token bucket;
    /// an unchanged rate keeps the bucket as it is, and a changed one keeps
    /// the tokens left, at most the new burst. They hold from the next
    /// claim on, in every process. Audited as `queue.limits`, the reason
    /// followed by the new limits; limits identical to the queue's current
    /// ones write nothing and audit nothing (so every process may apply its
    /// limits at startup). Invalid limits (a zero, an interval
    /// over a day) are `invalid_input` and write nothing.
    pub async fn set_queue_limits(&self, queue: &str, limits: QueueLimits, actor: &str, reason: &str) -> Result<()> {
        let mut tx = self.begin().await?;
        let r = self.set_queue_limits_in(tx.conn(), queue, limits, actor, reason).await;
        tx.finish(r).await
    }

    /// [`Operator::set_queue_limits`] inside the caller's transaction.
    pub async fn set_queue_limits_in<'c>(
        &self,
        conn: impl Into<Conn<'c>>,
        queue: &str,
        limits: QueueLimits,
        actor: &str,
        reason: &str,
    ) -> Result<()> {
        let mut conn: Conn<'c> = conn.into().routed(self.db());
        let rate = limits.validate()?;
        self.check_operator_input(queue, actor, reason)?;
        let as_i32 = |v: Option<u32>| v.map(|n| n as i32);
        let changed = on_conn!(conn.reborrow(), |c, q| {
            sqlx::query(q.set_queue_limits)
                .bind(queue)
                .bind(as_i32(limits.max_leased))
                .bind(as_i32(limits.max_leased_per_tenant))
                .bind(rate.map(|r| r.0))
                .bind(rate.map(|r| r.1))
                .bind(self.now())
                .fetch_optional(&mut *c)
                .await?
                .is_some()
        });
        if !changed {
            // The same limits again (every instance applying its settings
            // at startup): nothing written, nothing to audit.
            return Ok(());
        }
        let reason = format!("{reason} ({})", limits.describe());
        self.audit_in(conn, actor, "queue.limits", queue, &reason).await
    }

    /// Every queue with settings (paused, limited or not publishing its
    /// events, now or before), with its live leases, by name.
    pub async fn list_queues(&self) -> Result<Vec<QueueInfo>> {
        let rows: Vec<QueueRow> = on_pool!(self.db(), |p, q| {
            sqlx::query_as(q.list_queues).bind(self.now()).fetch_all(p).await?
        });
        rows.into_iter().map(QueueRow::into_info).collect()
    }

    fn check_operator_input(&self, queue: &str, actor: &str, reason: &str) -> Result<()> {
        self.limits().name("queue", queue)?;
        // As cancel and replay check theirs.
        self.limits().text("actor", actor, 255)?;
        self.limits().text("reason", reason, 4096)
    }
}
