//! The relay's side of `ferry doctor`: dead outbox rows, the oldest pending
//! row's age, pending rows with no live relay, lanes with pending rows and
//! no live owner (poll capture), and each WAL capture slot that is inactive,
//! lags or was invalidated. Every check is named like the alert that
//! watches the same fault in `deploy/prometheus/ferry-rules.yaml` and links
//! that alert's `docs/runbook.md` section. Checks that cannot apply (WAL
//! capture on SQLite, lanes where the relays stream from a slot) are
//! skipped, never reported `ok`.

use std::time::Duration;

use ferry::operator::{Backlog, CaptureState};
use ferry::store::on_pool;
use ferry::time::duration_ms;
use ferry::{Ferry, Result};

use super::queries::QUERIES;
use super::{Finding, Severity};

/// How far behind the relay side may fall before `ferry doctor` warns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelayThresholds {
    /// How long the oldest pending outbox row may wait before
    /// `outbox_backlog_old` warns. The default, 60 s, is far above a live
    /// relay's commit → ack latency (milliseconds) and below the alert's 5
    /// minutes, so an operator who runs the doctor is told first.
    pub pending_age: Duration,
    /// WAL a capture slot may hold back, in bytes, before `wal_slot_lag`
    /// warns; the default, 1 GiB, is `FerryWalSlotLagBytes`' bound.
    pub slot_lag_bytes: i64,
    /// How long the oldest row not yet delivered through a slot may wait
    /// before `wal_slot_lag` warns; the default, 5 minutes, is
    /// `FerryWalSlotLagSeconds`' bound.
    pub slot_lag: Duration,
}

impl Default for RelayThresholds {
    fn default() -> Self {
        RelayThresholds {
            pending_age: Duration::from_secs(60),
            slot_lag_bytes: 1 << 30,
            slot_lag: Duration::from_secs(300),
        }
    }
}

/// One relay-side check: its stable name, severity, action and runbook
/// section, whether it found something or was skipped.
struct RelayCheck {
    name: &'static str,
    severity: Severity,
    action: &'static str,
    runbook: &'static str,
}

impl RelayCheck {
    fn found(&self, items: Vec<String>) -> Finding {
        Finding {
            check: self.name,
            severity: self.severity,
            items,
            action: self.action,
            runbook: Some(self.runbook),
            skipped: None,
        }
    }

    fn skip(&self, why: &'static str) -> Finding {
        Finding {
            skipped: Some(why),
            ..self.found(Vec::new())
        }
    }
}

const DEAD_ROWS: RelayCheck = RelayCheck {
    name: "outbox_dead_rows",
    severity: Severity::Warning,
    action: "rows the broker refused for good (a message too large, a missing topic, a denied ACL); nothing else in their lane waits for them. `ferry dead list` shows each one's id, tenant, topic, key and last error; fix the cause (create the topic, grant the relay's principal, raise max.message.bytes), then `ferry dead replay --reason \"<why>\"` puts them back to pending (`--id <outbox id>` for one)",
    runbook: "docs/runbook.md#outbox-dead-rows",
};

const BACKLOG_OLD: RelayCheck = RelayCheck {
    name: "outbox_backlog_old",
    severity: Severity::Warning,
    action: "committed events are not reaching Kafka: is any relay live (`no_live_relay`, `ferry status`)? Then the relay's publish errors by code (a broker that does not answer is waited for), and a lane blocked on one row (the relay's logs name the row and its error code)",
    runbook: "docs/runbook.md#outbox-backlog-old",
};

const NO_LIVE_RELAY: RelayCheck = RelayCheck {
    name: "no_live_relay",
    severity: Severity::Warning,
    action: "nothing is published: start the relays (`ferry-relay run`) and check that they are ready (`/readyz`); their logs say why they hold nothing (database unreachable, migrations missing: `ferry migrate`)",
    runbook: "docs/runbook.md#no-live-relay",
};

const LANES_UNOWNED: RelayCheck = RelayCheck {
    name: "lanes_unowned",
    severity: Severity::Warning,
    action: "rows of a lane nobody holds wait: with no live relay see `no_live_relay`; a dead relay's lanes are taken over after `--lease`; if lanes stay unowned, every live relay is at its `--max-lanes` cap (raise it or add relays), or the relays cannot renew their leases",
    runbook: "docs/runbook.md#lanes-unowned",
};

const SLOT_INACTIVE: RelayCheck = RelayCheck {
    name: "wal_slot_inactive",
    severity: Severity::Warning,
    action: "no relay streams from this slot and it holds WAL back: start a relay of its group (`ferry-relay run --capture wal --slot <slot>`), or, if the group is gone for good, drop the slot (`SELECT pg_drop_replication_slot('<slot>')`): the next relay makes it anew and publishes the pending rows from the table",
    runbook: "docs/runbook.md#wal-slot-inactive",
};

const SLOT_LAG: RelayCheck = RelayCheck {
    name: "wal_slot_lag",
    severity: Severity::Warning,
    action: "the slot holds WAL back, or rows wait behind it: if it is inactive see `wal_slot_inactive`; if it streams, the relay is slow to publish (see `outbox_backlog_old`); bound the WAL a slot may hold (`wal_keep_size_unbounded`)",
    runbook: "docs/runbook.md#wal-slot-lag",
};

const SLOT_WAL_STATUS: RelayCheck = RelayCheck {
    name: "wal_slot_wal_status",
    severity: Severity::Warning,
    action: "PostgreSQL removed (lost) or will remove at the next checkpoint (unreserved) WAL this slot needs: a relay drops a lost slot and makes it anew, publishing the pending rows from the table (nothing is lost, some rows may be published twice); find why its relay fell that far behind (stopped, or blocked on a poison row)",
    runbook: "docs/runbook.md#wal-slot-wal-status",
};

const SLOT_FAILOVER: RelayCheck = RelayCheck {
    name: "wal_slot_not_synchronized",
    severity: Severity::Warning,
    action: "on PostgreSQL 17+, let standbys carry the slot: set sync_replication_slots = on and hot_standby_feedback = on on the standby, synchronized_standby_slots = '<the standby's physical slot>' on the primary, and drop the slot so the next relay makes it a failover slot; otherwise a failover makes the slot anew and reads the pending rows from the table (nothing is lost; rows in flight may be published twice at least once)",
    runbook: "docs/runbook.md#wal-slot-failover",
};

const KEEP_SIZE_UNBOUNDED: RelayCheck = RelayCheck {
    name: "wal_keep_size_unbounded",
    severity: Severity::Warning,
    action: "bound the WAL a slot may hold: ALTER SYSTEM SET max_slot_wal_keep_size = '10GB'; SELECT pg_reload_conf(); (size it to the outage the relay must survive; past it the slot is invalidated and recovered from the table)",
    runbook: "docs/runbook.md#wal-slot-lag",
};

/// How many tenant/topic groups `outbox_dead_rows` lists.
const DEAD_GROUPS: i64 = 5;

/// Runs the relay-side checks, listing at most `limit` lanes: on both
/// engines `outbox_dead_rows`, `outbox_backlog_old`, `no_live_relay` and
/// `lanes_unowned`; then on PostgreSQL the WAL capture ones (an info
/// finding `wal_capture` with the capture mode and each slot's state, where
/// a relay ever made a slot; `wal_slot_inactive`, `wal_slot_lag`,
/// `wal_slot_wal_status`, `wal_slot_not_synchronized`,
/// `wal_keep_size_unbounded`), skipped on SQLite.
pub async fn relay(ferry: &Ferry, thresholds: &RelayThresholds, limit: u32) -> Result<Vec<Finding>> {
    let operator = ferry.operator();
    let backlog = operator.outbox_backlog().await?;
    let capture = operator.capture_state(backlog.now).await?;
    let heartbeats = operator.live_relays().await?.len();
    let mut out = vec![
        dead_rows(ferry).await?,
        backlog_old(&backlog, thresholds.pending_age)?,
        no_live_relay(&backlog, heartbeats, &capture),
        lanes_unowned(ferry, &capture, &backlog, limit).await?,
    ];
    out.extend(wal_capture(ferry, &capture, thresholds).await?);
    Ok(out)
}

/// `outbox_dead_rows`: how many, then the largest tenant/topic groups with
/// their error codes.
async fn dead_rows(ferry: &Ferry) -> Result<Finding> {
    let dead = ferry.operator().outbox_dead_count().await?;
    if dead == 0 {
        return Ok(DEAD_ROWS.found(Vec::new()));
    }
    let groups: Vec<(String, String)> = on_pool!(ferry.db(), QUERIES, |p, q| {
        sqlx::query_as(q.doctor_outbox_dead_groups)
            .bind(DEAD_GROUPS)
            .fetch_all(p)
            .await?
    });
    let mut items = vec![format!("outbox: {dead} dead rows (the broker refused them for good)")];
    items.extend(groups.into_iter().map(|(s, d)| format!("{s}: {d}")));
    Ok(DEAD_ROWS.found(items))
}

/// `outbox_backlog_old`: the oldest pending row waited more than `limit`.
fn backlog_old(backlog: &Backlog, limit: Duration) -> Result<Finding> {
    let limit_ms = duration_ms(limit)?;
    let age = backlog.oldest_age_ms();
    let items = if age > limit_ms {
        vec![format!(
            "outbox: the oldest pending row has waited {:.1}s (more than {:.1}s); {} rows pending",
            age as f64 / 1000.0,
            limit_ms as f64 / 1000.0,
            backlog.pending
        )]
    } else {
        Vec::new()
    };
    Ok(BACKLOG_OLD.found(items))
}

/// `no_live_relay`: rows are pending, no relay's heartbeat is live, no
/// live lease holds a lane and no relay streams from a slot.
fn no_live_relay(backlog: &Backlog, heartbeats: usize, capture: &CaptureState) -> Finding {
    let live = heartbeats > 0 || capture.polling() || capture.streaming();
    let items = if backlog.pending > 0 && !live {
        vec![format!(
            "outbox: {} pending rows and no live relay (no relay heartbeat, no lane held, no WAL slot streaming)",
            backlog.pending
        )]
    } else {
        Vec::new()
    };
    NO_LIVE_RELAY.found(items)
}

/// `lanes_unowned`: lanes holding pending rows that no live lease holds.
/// Skipped where the relays capture from the WAL (a Ferry slot exists and
/// no lane is held): lanes are then not used.
async fn lanes_unowned(ferry: &Ferry, capture: &CaptureState, backlog: &Backlog, limit: u32) -> Result<Finding> {
    if !capture.polling() && capture.slots.iter().any(|s| s.present) {
        return Ok(LANES_UNOWNED.skip("WAL capture: the relays stream from a slot and hold no lanes"));
    }
    let rows: Vec<(String, String)> = on_pool!(ferry.db(), QUERIES, |p, q| {
        sqlx::query_as(q.doctor_unowned_lanes)
            .bind(backlog.now.get())
            .bind(i64::from(limit))
            .fetch_all(p)
            .await?
    });
    Ok(LANES_UNOWNED.found(rows.into_iter().map(|(s, d)| format!("{s}: {d}")).collect()))
}

/// The WAL capture checks: skipped on SQLite; on PostgreSQL `wal_capture`
/// (context, where a relay ever made a slot) and the four warnings over the
/// slots that exist.
async fn wal_capture(ferry: &Ferry, capture: &CaptureState, thresholds: &RelayThresholds) -> Result<Vec<Finding>> {
    let warnings = [
        SLOT_INACTIVE,
        SLOT_LAG,
        SLOT_WAL_STATUS,
        SLOT_FAILOVER,
        KEEP_SIZE_UNBOUNDED,
    ];
    if ferry.db().as_postgres().is_none() {
        return Ok(warnings
            .iter()
            .map(|c| c.skip("SQLite has no WAL capture: its relays poll lanes"))
            .collect());
    }
    let lag_ms = duration_ms(thresholds.slot_lag)?;
    let (mut inactive, mut lagging, mut at_risk) = (Vec::new(), Vec::new(), Vec::new());
    for s in capture.slots.iter().filter(|s| s.present) {
        if !s.active {
            inactive.push(format!("{}: {}", s.slot, s.describe()));
        }
        let mut over = Vec::new();
        if s.lag_bytes > thresholds.slot_lag_bytes {
            over.push(format!(
                "lag {} bytes (more than {})",
                s.lag_bytes, thresholds.slot_lag_bytes
            ));
        }
        if s.lag_ms > lag_ms {
            over.push(format!(
                "the oldest row not yet delivered has waited {:.1}s (more than {:.1}s)",
                s.lag_ms as f64 / 1000.0,
                lag_ms as f64 / 1000.0
            ));
        }
        if !over.is_empty() {
            lagging.push(format!("{}: {}", s.slot, over.join(", ")));
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
    let unbounded = if !present.is_empty() && ferry.operator().wal_keep_size().await?.is_none() {
        vec![format!(
            "max_slot_wal_keep_size: -1 (unbounded) with slots {}",
            present.join(", ")
        )]
    } else {
        Vec::new()
    };
    let mut out = Vec::new();
    if !capture.slots.is_empty() {
        let mut state = vec![format!("capture: {}", capture.mode)];
        state.extend(capture.slots.iter().map(|s| format!("{}: {}", s.slot, s.describe())));
        out.push(Finding {
            check: "wal_capture",
            severity: Severity::Info,
            items: state,
            action: "",
            runbook: None,
            skipped: None,
        });
    }
    out.extend([
        SLOT_INACTIVE.found(inactive),
        SLOT_LAG.found(lagging),
        SLOT_WAL_STATUS.found(at_risk),
        not_synchronized(ferry).await?,
        KEEP_SIZE_UNBOUNDED.found(unbounded),
    ]);
    Ok(out)
}

/// `wal_slot_not_synchronized`: a slot a promoted standby would not have.
/// Before PostgreSQL 17 no slot can be synchronised (skipped, saying what
/// a failover costs); on 17+ a slot made without `failover`, or a primary
/// whose `synchronized_standby_slots` is empty (a standby may then lack
/// what the slot's reader was sent), warns.
async fn not_synchronized(ferry: &Ferry) -> Result<Finding> {
    let f = ferry.operator().wal_failover().await?;
    if f.present == 0 {
        return Ok(SLOT_FAILOVER.found(Vec::new()));
    }
    if f.version < 170_000 {
        return Ok(SLOT_FAILOVER.skip(
            "PostgreSQL before 17 has no failover slots: after a failover the relay makes the slot anew on the new primary and reads the pending rows from the table",
        ));
    }
    let mut items: Vec<String> = f
        .not_failover
        .iter()
        .map(|s| format!("{s}: not a failover slot (a standby does not carry it)"))
        .collect();
    if f.synchronized_standby_slots.is_none() {
        items.push(
            "synchronized_standby_slots is empty: no standby is known to have the WAL the slot's reader was sent"
                .into(),
        );
    }
    Ok(SLOT_FAILOVER.found(items))
}
