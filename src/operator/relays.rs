//! The operator's view of the relays: which relay instances are alive, who
//! holds each outbox lane, the WAL capture slots (active or not, their lag
//! in bytes and time, PostgreSQL's `wal_status`), and the status report
//! `ferry status` and `ferry-relay status` print from them; `ferry doctor`
//! shows the same capture facts. Read only: the relays write these rows.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::error::{Error, Result};
use crate::store::on_pool;
use crate::store::queries::POSTGRES_ONLY;
use crate::time::Millis;
use crate::{Operator, Role};

/// A live relay instance and its `--max-lanes`.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct LiveRelay {
    /// Its lease identity.
    pub owner: String,
    /// The most lanes it takes.
    pub max_lanes: i64,
}

/// Who holds a lane.
#[derive(Debug, Clone, PartialEq, serde::Serialize, sqlx::FromRow)]
pub struct LaneOwner {
    /// Lane.
    pub lane: i32,
    /// Relay holding it, if any.
    pub owner: Option<String>,
    /// Current generation.
    pub generation: i64,
    /// Lease expiry.
    pub lease_expires_at: Option<Millis>,
}

/// Whether WAL capture's slots survive a failover (PostgreSQL only), for
/// `ferry doctor`: on PostgreSQL 17+ a failover slot that a standby
/// synchronises continues after a promotion; otherwise the relay makes the
/// slot anew on the new primary and reads the pending rows from the table.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct WalFailover {
    /// `server_version_num` (150000 for 15.0).
    pub version: i32,
    /// `synchronized_standby_slots` when set (PostgreSQL 17+): the standbys
    /// that must have WAL before a logical slot's reader gets it.
    pub synchronized_standby_slots: Option<String>,
    /// The present slots WAL capture made that are not failover slots.
    pub not_failover: Vec<String>,
    /// How many slots WAL capture made are present.
    pub present: i64,
}

/// A slot WAL capture made, as `status`, `doctor` and the relay's gauges
/// show it.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct WalSlot {
    /// Its name.
    pub slot: String,
    /// A relay streams from it now.
    pub active: bool,
    /// The replication connection streaming from it
    /// (`application_name`: a relay's is `ferry-relay <relay id>`); `None`
    /// when none does.
    pub streamed_by: Option<String>,
    /// It still exists (a dropped one is made anew by the next relay).
    pub present: bool,
    /// WAL it holds back: the current position minus its confirmed one
    /// (all of the cluster's WAL since, other databases' included).
    pub lag_bytes: i64,
    /// Its time lag in ms: how long the oldest outbox row not yet delivered
    /// has waited since it was written (the confirmed position has passed no
    /// pending row); 0 when none waits.
    pub lag_ms: i64,
    /// PostgreSQL's `wal_status`: `reserved`, `extended`, `unreserved`
    /// (past `max_slot_wal_keep_size`, lost at the next checkpoint) or
    /// `lost` (it can never stream again); `None` when dropped.
    pub wal_status: Option<String>,
    /// Bytes of WAL that may still be written before it is lost; `None`
    /// when unbounded or lost.
    pub safe_wal_size: Option<i64>,
}

impl WalSlot {
    /// Its state (`active (streaming to <application_name>)`, `inactive`,
    /// `dropped`), its lag in
    /// bytes and time, its `wal_status` and `safe_wal_size` when PostgreSQL
    /// reports them, on one line.
    pub fn describe(&self) -> String {
        let mut line = format!(
            "{}, lag {} bytes, {:.1}s",
            self.state(),
            self.lag_bytes,
            self.lag_ms as f64 / 1000.0
        );
        if let Some(w) = &self.wal_status {
            let _ = write!(line, ", wal_status {w}");
        }
        if let Some(n) = self.safe_wal_size {
            let _ = write!(line, ", safe_wal_size {n} bytes");
        }
        line
    }
}

impl WalSlot {
    /// `active (streaming to <application_name>)`, `active (streaming)`,
    /// `inactive` (no relay streams from it: its WAL is held) or `dropped`
    /// (the next relay makes it anew).
    pub fn state(&self) -> String {
        match (self.present, self.active, &self.streamed_by) {
            (false, _, _) => "dropped".to_string(),
            (true, true, Some(by)) => format!("active (streaming to {by})"),
            (true, true, None) => "active (streaming)".to_string(),
            (true, false, _) => "inactive".to_string(),
        }
    }
}

/// How the relays on one database capture the outbox now.
#[derive(Debug, Clone)]
pub struct CaptureState {
    /// `wal`, `poll`, both, or none (see [`Operator::capture_state`]).
    pub mode: &'static str,
    /// The lanes each live lease owner holds (`(unowned)` for the rest).
    pub lanes: BTreeMap<String, Vec<i32>>,
    /// The WAL capture slots made in this schema.
    pub slots: Vec<WalSlot>,
}

/// The key of [`CaptureState::lanes`] for lanes no live lease holds.
const UNOWNED: &str = "(unowned)";

impl CaptureState {
    /// A relay streams from one of the slots now (WAL capture runs).
    pub fn streaming(&self) -> bool {
        streams(&self.slots)
    }

    /// A live lease holds some lane (polling relays run).
    pub fn polling(&self) -> bool {
        polls(&self.lanes)
    }

    /// `wal` while a relay streams from a slot, `poll` while relays hold
    /// lanes, both when both (two relay groups on one database), else none.
    fn mode(slots: &[WalSlot], lanes: &BTreeMap<String, Vec<i32>>) -> &'static str {
        match (streams(slots), polls(lanes)) {
            (true, true) => "wal and poll (relays of both modes run on this database)",
            (true, false) => "wal",
            (false, true) => "poll",
            (false, false) => "none (no relay streams from a slot or holds a lane)",
        }
    }
}

fn streams(slots: &[WalSlot]) -> bool {
    slots.iter().any(|s| s.active)
}

fn polls(lanes: &BTreeMap<String, Vec<i32>>) -> bool {
    lanes.keys().any(|o| o != UNOWNED)
}

impl Operator<'_> {
    /// The relays whose heartbeat has not expired, with their lane caps,
    /// ordered by owner (read only: nothing is swept).
    pub async fn live_relays(&self) -> Result<Vec<LiveRelay>> {
        Ok(on_pool!(self.db(), |p, q| {
            sqlx::query_as(q.live_relays).bind(self.now()).fetch_all(p).await?
        }))
    }

    /// Who holds each lane.
    pub async fn lane_owners(&self) -> Result<Vec<LaneOwner>> {
        Ok(on_pool!(self.db(), |p, q| {
            sqlx::query_as(q.lane_owners).fetch_all(p).await?
        }))
    }

    /// The slots WAL capture made here; empty on SQLite (it always polls).
    pub async fn wal_slots(&self) -> Result<Vec<WalSlot>> {
        let Some(pool) = self.db().as_postgres() else {
            return Ok(Vec::new());
        };
        Ok(sqlx::query_as(POSTGRES_ONLY.wal_slots)
            .bind(self.now())
            .fetch_all(pool)
            .await?)
    }

    /// Whether WAL capture's slots survive a failover: the server's
    /// version, `synchronized_standby_slots`, and the slots that are not
    /// failover slots.
    pub async fn wal_failover(&self) -> Result<WalFailover> {
        let pool = self
            .db()
            .as_postgres()
            .ok_or(Error::Unsupported("WAL capture needs PostgreSQL"))?;
        Ok(sqlx::query_as(POSTGRES_ONLY.wal_failover).fetch_one(pool).await?)
    }

    /// `max_slot_wal_keep_size` in bytes; `None` when unbounded (-1), where
    /// a slot whose relay is gone holds WAL for ever.
    pub async fn wal_keep_size(&self) -> Result<Option<i64>> {
        let pool = self
            .db()
            .as_postgres()
            .ok_or(Error::Unsupported("WAL capture needs PostgreSQL"))?;
        let bytes: i64 = sqlx::query_scalar(POSTGRES_ONLY.wal_keep_size).fetch_one(pool).await?;
        Ok((bytes >= 0).then_some(bytes))
    }

    /// Reads who holds the lanes (a lease live at `now`, the database
    /// clock's, e.g. [`super::Backlog::now`]) and the slots' state.
    pub async fn capture_state(&self, now: Millis) -> Result<CaptureState> {
        let mut lanes = BTreeMap::<String, Vec<i32>>::new();
        for l in self.lane_owners().await? {
            let live = l.lease_expires_at.is_some_and(|e| e > now);
            let who = match (&l.owner, live) {
                (Some(o), true) => o.clone(),
                _ => UNOWNED.into(),
            };
            lanes.entry(who).or_default().push(l.lane);
        }
        let slots = self.wal_slots().await?;
        let mode = CaptureState::mode(&slots, &lanes);
        Ok(CaptureState { mode, lanes, slots })
    }

    /// The status report as text, one fact per line: the outbox backlog,
    /// its oldest pending age, dead rows, the capture mode, which relay
    /// holds how many lanes, and each WAL capture slot.
    pub async fn status_report(&self) -> Result<String> {
        let b = self.outbox_backlog().await?;
        let mut out = String::new();
        let _ = writeln!(out, "pending rows        {}", b.pending);
        let _ = writeln!(out, "oldest pending age  {:.1}s", b.oldest_age_ms() as f64 / 1000.0);
        let _ = writeln!(out, "dead rows           {}", self.outbox_dead_count().await?);
        let capture = self.capture_state(b.now).await?;
        let _ = writeln!(out, "capture             {}", capture.mode);
        for (owner, lanes) in &capture.lanes {
            let _ = writeln!(out, "{owner:<40} {} lanes", lanes.len());
        }
        for s in &capture.slots {
            let _ = writeln!(out, "wal slot {:<31} {}", s.slot, s.describe());
        }
        Ok(out)
    }
}
