//! The schedules' API: registering, changing, removing and listing
//! schedules, each change audited in its own transaction, with the rows
//! they are stored as (the run template, the `ferry_schedules` row).

use std::time::Duration;

use serde_json::Value;
use sqlx::types::Json;

use super::tick::{tick_key, Every, Missed};
use crate::error::{Error, Result};
use crate::runs::{Accepted, NewRun};
use crate::store::{on_conn, on_pool, Conn};
use crate::time::{duration_ms, Millis};
use crate::{Ferry, Operator, Role};

/// The run a tick accepts, as stored: a [`NewRun`] without its key, id,
/// start or parent.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub(super) struct Template {
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
    pub(super) fn of(run: &NewRun) -> Result<Template> {
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
    pub(super) fn run(&self, tenant: &str, name: &str, tick: i64) -> Result<NewRun> {
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

#[derive(sqlx::FromRow)]
pub(super) struct ScheduleRow {
    pub(super) tenant: String,
    pub(super) name: String,
    pub(super) spec: String,
    pub(super) template: Json<Template>,
    pub(super) missed: String,
    pub(super) catch_up_max: i32,
    pub(super) anchor_at: i64,
    pub(super) last_tick: Option<i64>,
    pub(super) next_tick: i64,
    pub(super) version: i64,
    pub(super) updated_at: Millis,
}

impl ScheduleRow {
    pub(super) fn public(&self) -> Result<Schedule> {
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
        let mut conn: Conn<'c> = conn.into().routed(self.db());
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

/// The database's clock, or the injected one ([`Ferry::now`]).
pub(super) async fn clock_now(ferry: &Ferry, conn: Conn<'_>) -> Result<i64> {
    Ok(on_conn!(conn, |c, q| {
        sqlx::query_scalar(q.clock_now)
            .bind(ferry.now())
            .fetch_one(&mut *c)
            .await?
    }))
}
