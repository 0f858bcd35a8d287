//! Investigations an operator runs when something looks wrong, as queries:
//! duplicate paid generations, two workers completing one run, jobs leased
//! forever, and WAL capture slots that hold WAL back (a dead relay's slot
//! keeps every WAL segment since its confirmed position). Each finding comes
//! with a suggested action. Read-only: repairs go through the ordinary
//! fenced transitions (cancel, replay).

use std::time::Duration;

use ferry::store::on_pool;
use ferry::time::duration_ms;
use ferry::{Ferry, Result};

mod queries {
    include!(concat!(env!("OUT_DIR"), "/queries.rs"));
}
use queries::{Queries, QUERIES};

/// How bad a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    /// Context, not a fault.
    Info,
    /// Needs a look.
    Warning,
    /// An invariant was broken.
    Critical,
}

/// One check's result.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Finding {
    /// Stable name of the check.
    pub check: &'static str,
    /// Severity when `items` is not empty.
    pub severity: Severity,
    /// What was found: `subject: detail` lines (bounded).
    pub items: Vec<String>,
    /// What to do about it.
    pub action: &'static str,
}

struct Check {
    name: &'static str,
    query: fn(&Queries) -> &'static str,
    severity: Severity,
    action: &'static str,
}

const CHECKS: [Check; 4] = [
    Check {
        name: "duplicate_acceptances",
        query: |q| q.doctor_duplicate_acceptances,
        severity: Severity::Warning,
        action: "the same request was accepted as several runs: check that clients reuse one Idempotency-Key per operation and that the key TTL covers their retry window; cancel the extra runs (`ferry jobs cancel`)",
    },
    Check {
        name: "effect_provider_refs",
        query: |q| q.doctor_effect_provider_refs,
        severity: Severity::Critical,
        action: "an external effect happened more than once: refund or void the extra provider refs, and make the handler reserve_effect/reconcile before calling the provider",
    },
    Check {
        name: "multiple_terminal_events",
        query: |q| q.doctor_multiple_terminal_events,
        severity: Severity::Critical,
        action: "a run ended twice: restore the run_events_one_terminal_idx index and check for writers bypassing Ferry",
    },
    Check {
        name: "stale_completions",
        query: |q| q.doctor_stale_completions,
        severity: Severity::Critical,
        action: "a worker completed with an old lease generation: look for writers bypassing the fenced complete and for clock skew",
    },
];

/// Prepares every doctor query on `ferry`'s database (the conformance check).
pub async fn check_queries(ferry: &Ferry) -> Result<()> {
    ferry::store::check_queries(ferry.db(), QUERIES.get(ferry.db().engine()).all()).await
}

/// Runs every investigation, listing at most `limit` items each;
/// `stuck_after` is how long past expiry a lease may sit before it counts as
/// not being reclaimed.
pub async fn run(ferry: &Ferry, stuck_after: Duration, limit: u32) -> Result<Vec<Finding>> {
    let now = ferry.clock().param();
    {
        let limit = i64::from(limit);
        let mut out = Vec::new();
        for c in &CHECKS {
            let rows: Vec<(String, String)> = on_pool!(ferry.db(), QUERIES, |p, q| {
                sqlx::query_as((c.query)(q)).bind(limit).fetch_all(p).await?
            });
            out.push(finding(c.name, c.severity, rows, c.action));
        }
        let expiry: Vec<(String, String)> = on_pool!(ferry.db(), QUERIES, |p, q| {
            sqlx::query_as(q.doctor_lease_expiry).bind(now).fetch_all(p).await?
        });
        out.push(finding(
            "lease_expiry",
            Severity::Info,
            expiry,
            "leases far in the future point at clock skew between workers and the database",
        ));
        let stuck_ms = duration_ms(stuck_after)?;
        let stuck: Vec<(String, String)> = on_pool!(ferry.db(), QUERIES, |p, q| {
            sqlx::query_as(q.doctor_unreclaimed_leases)
                .bind(now)
                .bind(stuck_ms)
                .bind(limit)
                .fetch_all(p)
                .await?
        });
        out.push(finding(
            "unreclaimed_leases",
            Severity::Warning,
            stuck,
            "expired leases nobody reclaims: start workers for these queues, or check that they can reach the database",
        ));
        let exhausted: Vec<(String, String)> = on_pool!(ferry.db(), QUERIES, |p, q| {
            sqlx::query_as(q.doctor_exhausted_unterminated)
                .bind(now)
                .bind(limit)
                .fetch_all(p)
                .await?
        });
        out.push(finding(
            "exhausted_unterminated",
            Severity::Warning,
            exhausted,
            "attempts exhausted but not terminalized: run a worker on the queue (it reaps them) or ferry.jobs().reap_exhausted",
        ));
        Ok(out)
    }
}

/// WAL capture on PostgreSQL (nothing on SQLite, or where no relay ever
/// made a slot): an info finding `wal_capture` with the capture mode and
/// each slot's state and lag in bytes and time, and three warnings:
/// `wal_slot_inactive_lag` (no relay streams from a slot that holds back
/// more than `inactive_lag_bytes` of WAL), `wal_slot_wal_status` (PostgreSQL
/// is about to remove, `unreserved`, or removed, `lost`, WAL a slot needs)
/// and `wal_keep_size_unbounded` (`max_slot_wal_keep_size = -1` while a
/// Ferry slot exists: a dead relay's slot can fill the disk).
pub async fn wal_capture(ferry: &Ferry, inactive_lag_bytes: i64) -> Result<Vec<Finding>> {
    if ferry.db().as_postgres().is_none() {
        return Ok(Vec::new());
    }
    let operator = ferry.operator();
    let now = operator.outbox_backlog().await?.now;
    let capture = operator.capture_state(now).await?;
    if capture.slots.is_empty() {
        return Ok(Vec::new());
    }
    let mut state = vec![format!("capture: {}", capture.mode)];
    let (mut lagging, mut at_risk) = (Vec::new(), Vec::new());
    for s in &capture.slots {
        state.push(format!("{}: {}", s.slot, s.describe()));
        if s.present && !s.active && s.lag_bytes > inactive_lag_bytes {
            lagging.push(format!(
                "{}: inactive, lag {} bytes (more than {inactive_lag_bytes})",
                s.slot, s.lag_bytes
            ));
        }
        if let Some(w @ ("unreserved" | "lost")) = s.wal_status.as_deref() {
            at_risk.push(format!("{}: wal_status {w}", s.slot));
        }
    }
    let present: Vec<&str> = capture
        .slots
        .iter()
        .filter(|s| s.present)
        .map(|s| s.slot.as_str())
        .collect();
    let unbounded = if !present.is_empty() && operator.wal_keep_size().await?.is_none() {
        vec![format!(
            "max_slot_wal_keep_size: -1 (unbounded) with slots {}",
            present.join(", ")
        )]
    } else {
        Vec::new()
    };
    Ok(vec![
        Finding {
            check: "wal_capture",
            severity: Severity::Info,
            items: state,
            action: "",
        },
        Finding {
            check: "wal_slot_inactive_lag",
            severity: Severity::Warning,
            items: lagging,
            action: "no relay streams from this slot and it holds WAL back: start a relay of its group (`ferry-relay run --capture wal --slot <slot>`), or, if the group is gone for good, drop the slot (`SELECT pg_drop_replication_slot('<slot>')`): the next relay makes it anew and publishes the pending rows from the table",
        },
        Finding {
            check: "wal_slot_wal_status",
            severity: Severity::Warning,
            items: at_risk,
            action: "PostgreSQL removed (lost) or will remove at the next checkpoint (unreserved) WAL this slot needs: a relay drops a lost slot and makes it anew, publishing the pending rows from the table (nothing is lost, some rows may be published twice); find why its relay fell that far behind (stopped, or blocked on a poison row)",
        },
        Finding {
            check: "wal_keep_size_unbounded",
            severity: Severity::Warning,
            items: unbounded,
            action: "bound the WAL a slot may hold: ALTER SYSTEM SET max_slot_wal_keep_size = '10GB'; SELECT pg_reload_conf(); (size it to the outage the relay must survive; past it the slot is invalidated and recovered from the table)",
        },
    ])
}

fn finding(check: &'static str, severity: Severity, rows: Vec<(String, String)>, action: &'static str) -> Finding {
    Finding {
        check,
        severity,
        items: rows.into_iter().map(|(s, d)| format!("{s}: {d}")).collect(),
        action,
    }
}
