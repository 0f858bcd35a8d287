//! Periodic runs: [`Ferry::schedule`] registers a run template under a cron
//! expression or an interval ([`Every`]), and [`Ferry::fire_due_ticks`]
//! (driven by [`Ferry::run_scheduler`] in any number of processes) accepts
//! one run per tick.
//!
//! A tick is accepted through the normal acceptance transaction under the
//! idempotency key `schedule:<name>:<tick ms>`, in the same transaction as a
//! compare-and-set that moves the schedule's `next_tick` from the value the
//! firer read. Of several processes firing one tick, one moves it and the
//! others match nothing; and were a cursor ever moved back (a schedule
//! dropped and registered again), the key would still make the tick's
//! second acceptance a replay. No leader is needed.
//!
//! Ticks are computed in UTC from the schedule's spec, the same in every
//! process: a cron expression's occurrences, or the multiples of an
//! interval since the Unix epoch. Ticks missed while nothing fired follow
//! the schedule's [`Missed`] policy.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::time::Duration;

use serde_json::Value;
use sqlx::types::Json;

use crate::error::{Error, Result};
use crate::runs::{Accepted, NewRun};
use crate::store::{on_conn, on_pool, Conn};
use crate::time::{duration_ms, Millis};
use crate::{Ferry, Operator, Role};

/// When a schedule ticks.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Every {
    /// A cron expression in UTC: five fields (minute to weekday) or six
    /// (with seconds first), as `croner` parses them. Build with [`Every::cron`].
    Cron(String),
    /// A fixed interval of whole seconds, ticking at its multiples since the
    /// Unix epoch (every hour ticks on the hour). Build with [`Every::interval`].
    Interval(Duration),
}

impl Every {
    /// A cron schedule; an expression `croner` refuses is
    /// [`Error::InvalidInput`].
    pub fn cron(expr: impl Into<String>) -> Result<Every> {
        let every = Every::Cron(expr.into());
        every.check()?;
        Ok(every)
    }

    /// An interval schedule: whole seconds, at least one, at most
    /// [`crate::time::MAX_DURATION`].
    pub fn interval(d: Duration) -> Result<Every> {
        let every = Every::Interval(d);
        every.check()?;
        Ok(every)
    }

    fn check(&self) -> Result<()> {
        match self {
            Every::Cron(expr) => cron(expr).map(drop),
            Every::Interval(d) => interval_ms(*d).map(drop),
        }
    }

    /// The stored text: `cron:<expression>` or `every:<milliseconds>`.
    fn spec(&self) -> Result<String> {
        Ok(match self {
            Every::Cron(expr) => format!("cron:{expr}"),
            Every::Interval(d) => format!("every:{}", interval_ms(*d)?),
        })
    }

    fn parse_spec(spec: &str) -> Result<Every> {
        let corrupt = || Error::CorruptRow {
            what: "ferry_schedules.spec",
            value: spec.into(),
        };
        if let Some(expr) = spec.strip_prefix("cron:") {
            return Every::cron(expr).map_err(|_| corrupt());
        }
        let ms: u64 = spec
            .strip_prefix("every:")
            .and_then(|ms| ms.parse().ok())
            .ok_or_else(corrupt)?;
        Every::interval(Duration::from_millis(ms)).map_err(|_| corrupt())
    }

    /// The first tick strictly after `t`.
    fn next_after(&self, t: i64) -> Result<i64> {
        match self {
            Every::Interval(d) => {
                let step = interval_ms(*d)?;
                (t.div_euclid(step) + 1)
                    .checked_mul(step)
                    .ok_or_else(|| Error::invalid("every", "the next tick overflows"))
            }
            Every::Cron(expr) => {
                let cron = cron(expr)?;
                // Ticks are whole seconds: the first after `t` is the first
                // after `t` rounded down to its second.
                let from = utc(t.div_euclid(1000) * 1000)?;
                let next = cron
                    .find_next_occurrence(&from, false)
                    .map_err(|e| Error::invalid("every", format!("no next occurrence: {e}")))?;
                Ok(next.timestamp() * 1000)
            }
        }
    }

    /// The latest `max` ticks in `(after, now]`, oldest first.
    fn ticks(&self, after: i64, now: i64, max: usize) -> Result<Vec<i64>> {
        if let Every::Interval(d) = self {
            let step = interval_ms(*d)?;
            let last = now.div_euclid(step);
            let first = after.div_euclid(step) + 1;
            let from = first.max(last - max as i64 + 1);
            return Ok((from..=last).map(|k| k * step).collect());
        }
        // Look back over a window that grows until it holds `max` ticks or
        // reaches `after`, so a long downtime costs the ticks of the window,
        // not every tick missed.
        let mut window: i64 = 3_600_000;
        loop {
            let start = after.max(now.saturating_sub(window));
            let mut latest = VecDeque::with_capacity(max);
            let mut t = start;
            loop {
                let tick = self.next_after(t)?;
                if tick > now {
                    break;
                }
                if latest.len() == max {
                    latest.pop_front();
                }
                latest.push_back(tick);
                t = tick;
            }
            if latest.len() == max || start == after {
                return Ok(latest.into());
            }
            window = window.saturating_mul(8);
        }
    }
}

impl fmt::Display for Every {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Every::Cron(expr) => write!(f, "cron {expr}"),
            Every::Interval(d) => write!(f, "every {}s", d.as_secs()),
        }
    }
}

fn cron(expr: &str) -> Result<croner::Cron> {
    croner::Cron::new(expr)
        .with_seconds_optional()
        .parse()
        .map_err(|e| Error::invalid("every", format!("not a cron expression: {e}")))
}

fn interval_ms(d: Duration) -> Result<i64> {
    let ms = duration_ms(d)?;
    // Whole seconds: a fraction is refused, never rounded away.
    if ms < 1000 || d.subsec_nanos() != 0 {
        return Err(Error::invalid("every", "an interval is whole seconds, at least one"));
    }
    Ok(ms)
}

fn utc(ms: i64) -> Result<chrono::DateTime<chrono::Utc>> {
    chrono::DateTime::from_timestamp_millis(ms).ok_or_else(|| Error::invalid("instant", "out of range"))
}

/// What happens to ticks missed while no process fired (downtime), stated
/// per schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Missed {
    /// Only the latest missed tick runs; the earlier ones are skipped.
    Skip,
    /// The latest `max` missed ticks run (1 to 1000), oldest first; any
    /// earlier ones are skipped, so a long downtime never floods a queue.
    CatchUp {
        /// Most ticks one firing accepts.
        max: u32,
    },
}

impl Missed {
    fn stored(self) -> Result<(&'static str, i32)> {
        match self {
            Missed::Skip => Ok(("skip", 1)),
            Missed::CatchUp { max } if (1..=1000).contains(&max) => Ok(("catch_up", max as i32)),
            Missed::CatchUp { .. } => Err(Error::invalid("missed", "catch-up max must be 1 to 1000")),
        }
    }

    fn parse(missed: &str, max: i32) -> Result<Missed> {
        match (missed, u32::try_from(max)) {
            ("skip", _) => Ok(Missed::Skip),
            ("catch_up", Ok(max)) => Ok(Missed::CatchUp { max }),
            _ => Err(Error::CorruptRow {
                what: "ferry_schedules.missed",
                value: format!("{missed} {max}"),
            }),
        }
    }

    fn max(self) -> usize {
        match self {
            Missed::Skip => 1,
            Missed::CatchUp { max } => max as usize,
        }
    }
}

/// The run a tick accepts, as stored: a [`NewRun`] without its key, id,
/// start or parent.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct Template {
    operation: String,
    schema_version: u32,
    command: Value,
    queue: String,
    max_attempts: u32,
    deadline_ms: Option<i64>,
    /// Absent from templates stored before priorities: 0, the default.
    #[serde(default)]
    priority: i16,
}

impl Template {
    fn of(run: &NewRun) -> Result<Template> {
        if run.run_id.is_some() || run.start.is_some() || run.parent_run_id.is_some() || run.traceparent.is_some() {
            return Err(Error::invalid(
                "template",
                "a schedule's template sets no run id, start, parent or trace context",
            ));
        }
        Ok(Template {
            operation: run.operation.clone(),
            schema_version: run.schema_version,
            command: run.command.clone(),
            queue: run.queue.clone(),
            max_attempts: run.max_attempts,
            deadline_ms: run.deadline.map(duration_ms).transpose()?,
            priority: run.priority,
        })
    }

    /// The run of tick `tick` of schedule `(tenant, name)`.
    fn run(&self, tenant: &str, name: &str, tick: i64) -> Result<NewRun> {
        let mut run = NewRun::new(tenant, &self.operation, tick_key(name, tick), self.command.clone())
            .schema_version(self.schema_version)
            .queue(&self.queue)
            .max_attempts(self.max_attempts)
            .priority(self.priority)
            .run_at(Millis::new(tick)?);
        if let Some(ms) = self.deadline_ms {
            run = run.deadline(Duration::from_millis(u64::try_from(ms).unwrap_or(0)));
        }
        Ok(run)
    }
}

/// The idempotency key of tick `tick` of schedule `name`.
pub fn tick_key(name: &str, tick: i64) -> String {
    format!("schedule:{name}:{tick}")
}

/// A registered schedule ([`Operator::list_schedules`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Schedule {
    /// Tenant of its runs.
    pub tenant: String,
    /// Name, unique per tenant.
    pub name: String,
    /// When it ticks.
    pub every: Every,
    /// Its runs' operation.
    pub operation: String,
    /// Its runs' queue.
    pub queue: String,
    /// Its runs' command.
    pub command: Value,
    /// Its runs' priority ([`NewRun::priority`]).
    pub priority: i16,
    /// What happens to missed ticks.
    pub missed: Missed,
    /// The last tick fired.
    pub last_tick: Option<Millis>,
    /// The next tick due.
    pub next_tick: Millis,
    /// Bumped by every change of the definition.
    pub version: i64,
    /// Last changed (or fired) at.
    pub updated_at: Millis,
}

/// A due schedule's place in the firing order.
struct DueKey {
    next_tick: i64,
    tenant: String,
    name: String,
}

#[derive(sqlx::FromRow)]
struct ScheduleRow {
    tenant: String,
    name: String,
    spec: String,
    template: Json<Template>,
    missed: String,
    catch_up_max: i32,
    anchor_at: i64,
    last_tick: Option<i64>,
    next_tick: i64,
    version: i64,
    updated_at: Millis,
}

impl ScheduleRow {
    fn public(&self) -> Result<Schedule> {
        Ok(Schedule {
            tenant: self.tenant.clone(),
            name: self.name.clone(),
            every: Every::parse_spec(&self.spec)?,
            operation: self.template.operation.clone(),
            queue: self.template.queue.clone(),
            command: self.template.command.clone(),
            priority: self.template.priority,
            missed: Missed::parse(&self.missed, self.catch_up_max)?,
            last_tick: self.last_tick.map(Millis::new).transpose()?,
            next_tick: Millis::new(self.next_tick)?,
            version: self.version,
            updated_at: self.updated_at,
        })
    }
}

/// What [`Ferry::schedule`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ScheduleChange {
    /// The schedule is new (audited as `schedule.create`).
    Created,
    /// Its definition changed (audited as `schedule.update`).
    Updated,
    /// It was already registered as given: nothing was written, so every
    /// process may register its schedules at startup.
    Unchanged,
}

/// One tick a firing accepted.
#[derive(Debug, Clone, PartialEq)]
pub struct FiredTick {
    /// The schedule's tenant.
    pub tenant: String,
    /// The schedule.
    pub name: String,
    /// The tick (the run's `scheduled_at`).
    pub tick: Millis,
    /// The tick's run (`replay` when it existed already).
    pub accepted: Accepted,
}

impl Ferry {
    /// Registers (or changes) the periodic schedule `name` of the template's
    /// tenant: every tick of `every` accepts a run like `template` (its
    /// idempotency key is replaced by `schedule:<name>:<tick ms>`, and it
    /// may set no run id, start, parent or trace context), and ticks missed
    /// while no process fired follow `missed`. The first tick is the first
    /// after now. Registering what is already registered writes nothing; a
    /// creation or change is audited in `ferry_audit` under `actor`, in the
    /// same transaction. A new `every` takes effect from now (its earlier
    /// ticks never fire); a new template or policy from the next tick.
    pub async fn schedule(
        &self,
        name: &str,
        every: Every,
        template: NewRun,
        missed: Missed,
        actor: &str,
    ) -> Result<ScheduleChange> {
        let mut tx = self.begin().await?;
        let r = self.schedule_in(tx.conn(), name, every, template, missed, actor).await;
        tx.finish(r).await
    }

    /// [`Ferry::schedule`] inside the caller's transaction.
    pub async fn schedule_in<'c>(
        &self,
        conn: impl Into<Conn<'c>>,
        name: &str,
        every: Every,
        template: NewRun,
        missed: Missed,
        actor: &str,
    ) -> Result<ScheduleChange> {
        let mut conn: Conn<'c> = conn.into();
        self.limits().name("schedule", name)?;
        self.limits().text("actor", actor, 255)?;
        every.check()?;
        let (missed_text, catch_up_max) = missed.stored()?;
        let stored = Template::of(&template)?;
        // The template as a tick's run: limits, queue, command; and the
        // longest key a tick can have (tick 0's is 12 bytes shorter than
        // today's), so no tick is refused for its key.
        stored.run(&template.tenant, name, 0)?.validate(self)?;
        self.limits().idempotency_key(&tick_key(name, i64::MAX))?;
        let tenant = template.tenant.as_str();
        let spec = every.spec()?;
        let now = clock_now(self, conn.reborrow()).await?;
        let next = every.next_after(now)?;
        let subject = format!("{tenant}/{name}");
        let described = format!(
            "{every}, missed {missed:?}, operation {} on queue {} at priority {}",
            stored.operation, stored.queue, stored.priority
        );
        let created: Option<i64> = on_conn!(conn.reborrow(), |c, q| {
            sqlx::query_scalar(q.insert_schedule)
                .bind(tenant)
                .bind(name)
                .bind(&spec)
                .bind(Json(&stored))
                .bind(missed_text)
                .bind(catch_up_max)
                .bind(now)
                .bind(next)
                .fetch_optional(&mut *c)
                .await?
        });
        if created.is_some() {
            self.operator()
                .audit_in(conn, actor, "schedule.create", &subject, &described)
                .await?;
            return Ok(ScheduleChange::Created);
        }
        let row: Option<ScheduleRow> = on_conn!(conn.reborrow(), |c, q| {
            sqlx::query_as(q.lock_schedule)
                .bind(tenant)
                .bind(name)
                .fetch_optional(&mut *c)
                .await?
        });
        let row = row.ok_or(Error::Raced("the schedule was dropped while it was registered"))?;
        let same_every = row.spec == spec;
        if same_every && row.template.0 == stored && row.missed == missed_text && row.catch_up_max == catch_up_max {
            return Ok(ScheduleChange::Unchanged);
        }
        let (anchor, next_tick) = if same_every {
            (row.anchor_at, row.next_tick)
        } else {
            (now, next)
        };
        on_conn!(conn.reborrow(), |c, q| {
            sqlx::query(q.update_schedule)
                .bind(tenant)
                .bind(name)
                .bind(&spec)
                .bind(Json(&stored))
                .bind(missed_text)
                .bind(catch_up_max)
                .bind(anchor)
                .bind(next_tick)
                .bind(now.max(row.updated_at.get()))
                .execute(&mut *c)
                .await?;
        });
        self.operator()
            .audit_in(conn, actor, "schedule.update", &subject, &described)
            .await?;
        Ok(ScheduleChange::Updated)
    }
}

impl Operator<'_> {
    /// Drops schedule `name` of `tenant` (its runs stay), audited under
    /// `actor` with `reason`. False when there was none (nothing audited).
    pub async fn unschedule(&self, tenant: &str, name: &str, actor: &str, reason: &str) -> Result<bool> {
        self.limits().tenant(tenant)?;
        self.limits().name("schedule", name)?;
        self.limits().text("actor", actor, 255)?;
        self.limits().text("reason", reason, 4096)?;
        let mut tx = self.begin().await?;
        let r = async {
            let gone = on_conn!(tx.conn(), |c, q| {
                sqlx::query(q.delete_schedule)
                    .bind(tenant)
                    .bind(name)
                    .execute(&mut *c)
                    .await?
                    .rows_affected()
            });
            if gone > 0 {
                self.audit_in(tx.conn(), actor, "schedule.delete", &format!("{tenant}/{name}"), reason)
                    .await?;
            }
            Ok(gone > 0)
        }
        .await;
        tx.finish(r).await
    }

    /// The schedules of `tenant` (every tenant's with `None`), by tenant and name.
    pub async fn list_schedules(&self, tenant: Option<&str>) -> Result<Vec<Schedule>> {
        if let Some(t) = tenant {
            self.limits().tenant(t)?;
        }
        let rows: Vec<ScheduleRow> = on_pool!(self.db(), |p, q| {
            sqlx::query_as(q.list_schedules).bind(tenant).fetch_all(p).await?
        });
        rows.iter().map(ScheduleRow::public).collect()
    }
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
        use sqlx::{FromRow, Row};
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
                let key = DueKey {
                    next_tick: r.try_get("next_tick")?,
                    tenant: r.try_get("tenant")?,
                    name: r.try_get("name")?,
                };
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

async fn clock_now(ferry: &Ferry, conn: Conn<'_>) -> Result<i64> {
    Ok(on_conn!(conn, |c, q| {
        sqlx::query_scalar(q.clock_now)
            .bind(ferry.now())
            .fetch_one(&mut *c)
            .await?
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: i64 = 1_800_000_000_000; // a multiple of one minute and five

    #[test]
    fn interval_ticks_are_epoch_multiples_and_bounded() {
        let every = Every::interval(Duration::from_secs(60)).unwrap();
        assert_eq!(every.next_after(T0).unwrap(), T0 + 60_000);
        assert_eq!(every.next_after(T0 - 1).unwrap(), T0);
        assert_eq!(
            every.ticks(T0, T0 + 600_000, 3).unwrap(),
            [T0 + 480_000, T0 + 540_000, T0 + 600_000]
        );
        assert_eq!(every.ticks(T0, T0 + 59_999, 3).unwrap(), Vec::<i64>::new());
        assert_eq!(every.ticks(T0, T0 + 120_000, 5).unwrap(), [T0 + 60_000, T0 + 120_000]);
        assert!(Every::interval(Duration::from_millis(1500)).is_err());
        assert!(Every::interval(Duration::ZERO).is_err());
    }

    #[test]
    fn cron_ticks_look_back_only_as_far_as_needed() {
        let every = Every::cron("*/5 * * * *").unwrap();
        assert_eq!(every.next_after(T0).unwrap(), T0 + 300_000);
        assert_eq!(every.next_after(T0 + 1).unwrap(), T0 + 300_000);
        assert_eq!(every.next_after(T0 - 1).unwrap(), T0);
        // Thirty days down, catch up 2: the latest two only.
        let month = 30 * 86_400_000;
        assert_eq!(
            every.ticks(T0, T0 + month, 2).unwrap(),
            [T0 + month - 300_000, T0 + month]
        );
        // A yearly tick found across a long look-back.
        let yearly = Every::cron("0 0 1 1 *").unwrap();
        let ticks = yearly.ticks(0, T0, 1).unwrap();
        assert_eq!(ticks.len(), 1);
        assert_eq!(utc(ticks[0]).unwrap().to_rfc3339(), "2027-01-01T00:00:00+00:00");
        assert!(Every::cron("not cron").is_err());
        assert_eq!(Every::parse_spec(&every.spec().unwrap()).unwrap(), every);
    }
}
