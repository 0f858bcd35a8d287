//! Run inspection for operators and consoles: [`Operator::list_runs`] (by
//! tenant, state, queue, operation and time, newest first, with keyset
//! pagination) and [`Operator::run_lineage`] (one run with its events,
//! attempts, effects, outbox rows and child runs).
//!
//! Pages are keyset pages on `(created_at, run_id)`: each page is one index
//! range scan strictly below the previous page's last row, so a page costs
//! the same at any depth, and runs accepted while a caller pages (which are
//! newer than every page already read, or land below the cursor only when
//! their clock is behind) never shift rows between pages.

use std::fmt;
use std::str::FromStr;

use uuid::Uuid;

use super::*;
use crate::effects::{list_effects_in, EffectRecord};
use crate::error::{Error, Result};
use crate::jobs::{JobAttempt, JobState};
use crate::store::queries::Queries;
use crate::store::{on_conn, Conn};
use crate::{Operator, Role};

/// Which runs [`Operator::list_runs`] returns. Every field narrows the list;
/// the default is every run of every tenant.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunFilter {
    /// Only this tenant's runs. `None` lists every tenant's, for operators:
    /// a service answering its own users must always set it.
    pub tenant: Option<String>,
    /// Only runs in this state.
    pub state: Option<RunState>,
    /// Only runs whose job is on this queue.
    pub queue: Option<String>,
    /// Only runs of this operation.
    pub operation: Option<String>,
    /// Only runs accepted at or after this instant.
    pub created_from: Option<Millis>,
    /// Only runs accepted before this instant.
    pub created_before: Option<Millis>,
}

impl RunFilter {
    /// Every run of `tenant`.
    pub fn tenant(tenant: impl Into<String>) -> Self {
        RunFilter {
            tenant: Some(tenant.into()),
            ..Default::default()
        }
    }

    /// Narrows to runs in `state`.
    pub fn state(mut self, state: RunState) -> Self {
        self.state = Some(state);
        self
    }

    /// Narrows to runs on `queue`.
    pub fn queue(mut self, queue: impl Into<String>) -> Self {
        self.queue = Some(queue.into());
        self
    }

    /// Narrows to runs of `operation`.
    pub fn operation(mut self, operation: impl Into<String>) -> Self {
        self.operation = Some(operation.into());
        self
    }

    /// Narrows to runs accepted in `[from, before)`.
    pub fn created(mut self, from: Option<Millis>, before: Option<Millis>) -> Self {
        self.created_from = from;
        self.created_before = before;
        self
    }
}

/// Where the next page of [`Operator::list_runs`] starts: opaque to callers,
/// carried as a string (a query parameter, a CLI flag) through
/// [`fmt::Display`] and [`FromStr`]. A cursor only means "below this row",
/// so it stays valid while runs are accepted. It holds the row's tenant
/// too: run ids are unique per tenant only, so across tenants
/// `(created_at, run_id)` does not identify a row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunCursor {
    created_at: i64,
    run_id: Uuid,
    tenant: String,
}

impl fmt::Display for RunCursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The tenant last: it may hold dots.
        write!(f, "r2.{}.{}.{}", self.created_at, self.run_id.simple(), self.tenant)
    }
}

impl FromStr for RunCursor {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let bad = || Error::invalid("cursor", "is not a cursor list_runs returned");
        let mut parts = s.splitn(4, '.');
        if parts.next() != Some("r2") {
            return Err(bad());
        }
        let created_at: i64 = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
        let run_id = parts.next().and_then(|p| Uuid::try_parse(p).ok()).ok_or_else(bad)?;
        let tenant = parts.next().ok_or_else(bad)?.to_owned();
        if created_at < 0 || tenant.is_empty() {
            return Err(bad());
        }
        Ok(RunCursor {
            created_at,
            run_id,
            tenant,
        })
    }
}

impl serde::Serialize for RunCursor {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// One run as lists show it: the run with its job's queue, state and
/// attempts, without the request.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RunSummary {
    /// Owner.
    pub tenant: String,
    /// Id.
    pub run_id: Uuid,
    /// Operation.
    pub operation: String,
    /// Queue of its job.
    pub queue: String,
    /// The run's state.
    pub state: RunState,
    /// Its job's state (`queued` also covers a scheduled or retrying job).
    pub job_state: JobState,
    /// Attempts spent.
    pub attempts: i32,
    /// Attempt budget.
    pub max_attempts: i32,
    /// The last attempt's safe error code.
    pub last_error_code: Option<String>,
    /// The start asked for, when scheduled.
    pub scheduled_at: Option<Millis>,
    /// The run whose handler created it.
    pub parent_run_id: Option<Uuid>,
    /// The dead run it replays.
    pub replay_of: Option<Uuid>,
    /// Accepted at.
    pub created_at: Millis,
    /// Last changed at.
    pub updated_at: Millis,
}

#[derive(sqlx::FromRow)]
struct SummaryRow {
    tenant: String,
    run_id: Uuid,
    operation: String,
    queue: String,
    state: String,
    job_state: JobState,
    attempts: i32,
    max_attempts: i32,
    last_error_code: Option<String>,
    scheduled_at: Option<Millis>,
    parent_run_id: Option<Uuid>,
    replay_of: Option<Uuid>,
    created_at: Millis,
    updated_at: Millis,
}

impl TryFrom<SummaryRow> for RunSummary {
    type Error = Error;
    fn try_from(r: SummaryRow) -> Result<RunSummary> {
        Ok(RunSummary {
            tenant: r.tenant,
            run_id: r.run_id,
            operation: r.operation,
            queue: r.queue,
            state: RunState::parse(&r.state)?,
            job_state: r.job_state,
            attempts: r.attempts,
            max_attempts: r.max_attempts,
            last_error_code: r.last_error_code,
            scheduled_at: r.scheduled_at,
            parent_run_id: r.parent_run_id,
            replay_of: r.replay_of,
            created_at: r.created_at,
            updated_at: r.updated_at,
        })
    }
}

/// A page of [`Operator::list_runs`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RunPage {
    /// The runs, newest first.
    pub runs: Vec<RunSummary>,
    /// Pass it back for the next page; `None` after the last page.
    pub next: Option<RunCursor>,
}

/// An outbox row as lineage shows it: where it goes and whether it got
/// there, without its payload.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, sqlx::FromRow)]
pub struct OutboxRow {
    /// Outbox id (the relay publishes in id order per lane).
    pub id: i64,
    /// Topic.
    pub topic: String,
    /// Record key.
    pub key: String,
    /// The writer's effect key. Consumers dedupe on it scoped by tenant,
    /// `<tenant>/<key>`, as the relay publishes it (`None`: on
    /// `<database id>:<outbox id>`).
    pub effect_key: Option<String>,
    /// `pending`, `delivered` or `dead`.
    pub state: String,
    /// Failed publish attempts so far.
    pub publish_attempts: i32,
    /// The last publish error's code.
    pub last_error: Option<String>,
    /// Written at.
    pub created_at: Millis,
    /// Acknowledged by Kafka at.
    pub delivered_at: Option<Millis>,
}

/// Everything Ferry holds about one run ([`Operator::run_lineage`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RunLineage {
    /// The run, with its parent (`parent_run_id`) and replayed run (`replay_of`).
    pub run: Run,
    /// Its job as lists show it.
    pub summary: RunSummary,
    /// Its events in seq order.
    pub events: Vec<RunEvent>,
    /// Its job's attempts (generation, worker, outcome) in claim order.
    pub attempts: Vec<JobAttempt>,
    /// Its effect-ledger entries.
    pub effects: Vec<EffectRecord>,
    /// The outbox rows keyed by its id (its events' rows and a service's own
    /// rows keyed by it) with their delivery state, in id order. Rows the
    /// relay's retention deleted are gone.
    pub outbox: Vec<OutboxRow>,
    /// The runs created with it as their parent, oldest first.
    pub children: Vec<RunSummary>,
}

/// Most runs one page may hold.
pub const MAX_PAGE: u32 = 1000;

impl Operator<'_> {
    /// One page of runs matching `filter`, newest first (by acceptance
    /// instant, then run id), starting below `after` (the previous page's
    /// [`RunPage::next`]; `None` for the first page). `limit` is 1 to
    /// [`MAX_PAGE`]. Paging to the end returns every run that matched when
    /// the first page was read exactly once, in order, whatever is accepted
    /// meanwhile. Each page is one statement on an index ordered like the
    /// list (see `ARCHITECTURE.md`); a queue or operation filter is applied
    /// while the index is walked, so a rare queue or operation walks further.
    pub async fn list_runs(&self, filter: &RunFilter, after: Option<&RunCursor>, limit: u32) -> Result<RunPage> {
        if !(1..=MAX_PAGE).contains(&limit) {
            return Err(Error::invalid("limit", format!("must be 1 to {MAX_PAGE}")));
        }
        if let Some(t) = &filter.tenant {
            self.limits().tenant(t)?;
        }
        if let Some(q) = &filter.queue {
            self.limits().name("queue", q)?;
        }
        if let Some(o) = &filter.operation {
            self.limits().name("operation", o)?;
        }
        // The exclusive upper bound: the cursor, or created_before with the
        // smallest run id and tenant (nothing is below them), or the end of
        // time.
        let before = filter.created_before.map_or(i64::MAX, Millis::get);
        let (below_at, below_id, below_tenant) = match after {
            Some(c) if c.created_at < before => (c.created_at, c.run_id, c.tenant.as_str()),
            _ => (before, Uuid::nil(), ""),
        };
        let from = filter.created_from.map_or(0, Millis::get);
        let state = filter.state.map(RunState::as_str);
        let mut c = self.db().acquire().await?;
        let rows: Vec<SummaryRow> = on_conn!(c.conn(), |c, q| {
            let sql = match (&filter.tenant, state) {
                (Some(_), Some(_)) => q.list_runs_of_tenant_in_state,
                (Some(_), None) => q.list_runs_of_tenant,
                (None, _) => q.list_runs_of_all_tenants,
            };
            sqlx::query_as(sql)
                .bind(filter.tenant.as_deref())
                .bind(below_at)
                .bind(below_id)
                .bind(from)
                .bind(filter.operation.as_deref())
                .bind(filter.queue.as_deref())
                .bind(i64::from(limit))
                .bind(state)
                .bind(below_tenant)
                .fetch_all(&mut *c)
                .await?
        });
        let runs = rows.into_iter().map(RunSummary::try_from).collect::<Result<Vec<_>>>()?;
        let next = match runs.last() {
            Some(last) if runs.len() == limit as usize => Some(RunCursor {
                created_at: last.created_at.get(),
                run_id: last.run_id,
                tenant: last.tenant.clone(),
            }),
            _ => None,
        };
        Ok(RunPage { runs, next })
    }

    /// Everything about one run of `tenant`: the run, its events, its job's
    /// attempts, its effects, its outbox rows with their delivery state, and
    /// its child runs. [`Error::NotFound`] for another tenant's run.
    pub async fn run_lineage(&self, tenant: &str, run_id: Uuid) -> Result<RunLineage> {
        self.limits().tenant(tenant)?;
        let mut c = self.db().acquire().await?;
        let mut conn = c.conn();
        let run = get_run_in(conn.reborrow(), tenant, run_id).await?;
        let summary = summaries(conn.reborrow(), |q| q.get_run_summary, tenant, run_id)
            .await?
            .pop()
            .ok_or(Error::NotFound { what: "job" })?;
        let children = summaries(conn.reborrow(), |q| q.list_child_runs, tenant, run_id).await?;
        let key = run_id.to_string();
        let (events, attempts, outbox): (Vec<RunEvent>, Vec<JobAttempt>, Vec<OutboxRow>) =
            on_conn!(conn.reborrow(), |c, q| {
                let events = sqlx::query_as(q.list_events)
                    .bind(tenant)
                    .bind(run_id)
                    .fetch_all(&mut *c)
                    .await?;
                let attempts = sqlx::query_as(q.list_attempts)
                    .bind(tenant)
                    .bind(run_id)
                    .fetch_all(&mut *c)
                    .await?;
                let outbox = sqlx::query_as(q.list_outbox_of_key)
                    .bind(tenant)
                    .bind(&key)
                    .fetch_all(&mut *c)
                    .await?;
                (events, attempts, outbox)
            });
        let effects = list_effects_in(conn, tenant, run_id).await?;
        Ok(RunLineage {
            run,
            summary,
            events,
            attempts,
            effects,
            outbox,
            children,
        })
    }
}

/// The summaries a one-run query picks (`get_run_summary` or
/// `list_child_runs`, both bound to `(tenant, run_id)`).
async fn summaries(
    conn: Conn<'_>,
    pick: fn(&Queries) -> &'static str,
    tenant: &str,
    run_id: Uuid,
) -> Result<Vec<RunSummary>> {
    let rows: Vec<SummaryRow> = on_conn!(conn, |c, q| {
        sqlx::query_as(pick(q))
            .bind(tenant)
            .bind(run_id)
            .fetch_all(&mut *c)
            .await?
    });
    rows.into_iter().map(RunSummary::try_from).collect()
}
