//! The scheduler: firing due ticks (each schedule's cursor moved by
//! compare-and-set, its runs accepted in the same transaction), page by
//! page through the due list, and the loop that fires them every poll in
//! any number of processes.

use std::future::Future;
use std::time::Duration;

use super::api::{clock_now, FiredTick, ScheduleRow};
use super::tick::{Every, Missed};
use crate::error::{Error, Result};
use crate::store::{on_conn, Conn};
use crate::time::Millis;
use crate::Ferry;

/// A due schedule's place in the firing order.
#[derive(sqlx::FromRow)]
struct DueKey {
    next_tick: i64,
    tenant: String,
    name: String,
}

impl Ferry {
    /// Fires the ticks due now of up to `limit` schedules, most overdue
    /// first: for each, in one transaction, moves its tick cursor by
    /// compare-and-set and accepts one run per tick its [`Missed`] policy
    /// keeps. A schedule another process fired meanwhile is left alone (and
    /// counts toward `limit`). A schedule whose run is refused (its template
    /// no longer fits the limits, an idempotency conflict) or whose row this
    /// version cannot read is logged, does not count toward `limit`, and
    /// stays due: it is retried at every call (which walks past it to the
    /// others), so the others are never starved by it. Safe to call from any
    /// number of processes.
    pub async fn fire_due_ticks(&self, limit: u32) -> Result<Vec<FiredTick>> {
        let mut c = self.db().acquire().await?;
        let now = clock_now(self, c.conn()).await?;
        drop(c);
        let mut fired = Vec::new();
        let mut done = 0;
        // The due list in (next_tick, tenant, name) order, a page at a time
        // past the last row seen, until `limit` schedules were fired.
        let mut after = DueKey {
            next_tick: i64::MIN,
            tenant: String::new(),
            name: String::new(),
        };
        while done < limit {
            let want = limit - done;
            let page = self.due_page(now, &after, want).await?;
            let full = page.len() == want as usize;
            for (key, row) in page {
                let fire = match row {
                    Ok(row) => {
                        let mut tx = self.begin().await?;
                        let r = self.fire_one_in(tx.conn(), &row, now).await;
                        tx.finish(r).await
                    }
                    Err(e) => Err(e),
                };
                match fire {
                    Ok(ticks) => {
                        fired.extend(ticks);
                        done += 1;
                    }
                    Err(e) if crate::runs::refuses_only_its_item(&e) || matches!(e, Error::CorruptRow { .. }) => {
                        tracing::warn!(tenant = %key.tenant, schedule = %key.name, code = e.code(), "schedule tick refused: {e}");
                    }
                    Err(e) => return Err(e),
                }
                after = key;
            }
            if !full {
                break;
            }
        }
        Ok(fired)
    }

    /// Up to `limit` due schedules after `after`, each with its key and its
    /// row, or [`Error::CorruptRow`] for a row this version cannot read (so
    /// one unreadable row does not fail the others).
    async fn due_page(&self, now: i64, after: &DueKey, limit: u32) -> Result<Vec<(DueKey, Result<ScheduleRow>)>> {
        use sqlx::FromRow;
        let mut c = self.db().acquire().await?;
        Ok(on_conn!(c.conn(), |c, q| {
            let rows = sqlx::query(q.list_due_schedules)
                .bind(now)
                .bind(after.next_tick)
                .bind(&after.tenant)
                .bind(&after.name)
                .bind(i64::from(limit))
                .fetch_all(&mut *c)
                .await?;
            let mut page = Vec::with_capacity(rows.len());
            for r in &rows {
                let key = DueKey::from_row(r)?;
                let row = ScheduleRow::from_row(r).map_err(|e| Error::CorruptRow {
                    what: "ferry_schedules row",
                    value: format!("{}/{}: {e}", key.tenant, key.name),
                });
                page.push((key, row));
            }
            page
        }))
    }

    async fn fire_one_in(&self, mut conn: Conn<'_>, row: &ScheduleRow, now: i64) -> Result<Vec<FiredTick>> {
        let every = Every::parse_spec(&row.spec)?;
        let missed = Missed::parse(&row.missed, row.catch_up_max)?;
        let after = row.last_tick.unwrap_or(row.anchor_at).max(row.anchor_at);
        let ticks = every.ticks(after, now, missed.max())?;
        let next = every.next_after(now)?;
        let last = ticks.last().copied().or(row.last_tick);
        let moved = on_conn!(conn.reborrow(), |c, q| {
            sqlx::query(q.advance_schedule)
                .bind(&row.tenant)
                .bind(&row.name)
                .bind(last)
                .bind(next)
                .bind(row.version)
                .bind(row.next_tick)
                .bind(now)
                .execute(&mut *c)
                .await?
                .rows_affected()
        });
        if moved == 0 {
            return Ok(Vec::new());
        }
        let mut fired = Vec::with_capacity(ticks.len());
        for tick in ticks {
            let run = row.template.0.run(&row.tenant, &row.name, tick)?;
            let accepted = self.create_run_idempotent_in(conn.reborrow(), run).await?;
            fired.push(FiredTick {
                tenant: row.tenant.clone(),
                name: row.name.clone(),
                tick: Millis::new(tick)?,
                accepted,
            });
        }
        if !fired.is_empty() {
            tracing::info!(tenant = %row.tenant, schedule = %row.name, ticks = fired.len(), "schedule fired");
        }
        Ok(fired)
    }

    /// Fires due ticks ([`Ferry::fire_due_ticks`]) now and then every `poll`
    /// until `shutdown` completes; run it in every process that should keep
    /// schedules going (they need no leader). A failed round is logged and
    /// retried at the next one.
    pub async fn run_scheduler(&self, poll: Duration, shutdown: impl Future<Output = ()>) -> Result<()> {
        if poll.is_zero() {
            return Err(Error::invalid("poll", "must be positive"));
        }
        tokio::pin!(shutdown);
        loop {
            if let Err(e) = self.fire_due_ticks(100).await {
                tracing::warn!(code = e.code(), "firing schedules failed: {e}");
            }
            tokio::select! {
                _ = &mut shutdown => return Ok(()),
                _ = tokio::time::sleep(poll) => {}
            }
        }
    }
}
