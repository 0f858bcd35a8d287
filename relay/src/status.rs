//! `status`: the outbox backlog, its oldest pending age, dead rows, the
//! capture mode the running relays use, which relay holds how many lanes,
//! and the WAL capture's slots (active or not, their lag in bytes and time,
//! PostgreSQL's `wal_status`), as printed by `ferry-relay status` and
//! `ferry status`; `ferry doctor` shows the same capture facts.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::error::RelayError;
use crate::store::{RelayStore, WalSlot};

/// How the relays on one database capture the outbox now.
#[derive(Debug, Clone)]
pub struct CaptureState {
    /// `wal`, `poll`, both, or none (see [`CaptureState::mode`]).
    pub mode: &'static str,
    /// The lanes each live lease owner holds (`(unowned)` for the rest).
    pub lanes: BTreeMap<String, Vec<i32>>,
    /// The WAL capture slots made in this schema.
    pub slots: Vec<WalSlot>,
}

impl CaptureState {
    /// Reads who holds the lanes (a lease live at `now`, the database
    /// clock's, e.g. [`crate::store::Backlog::now`]) and the slots' state.
    pub async fn read(store: &RelayStore, now: ferry::Millis) -> ferry::Result<CaptureState> {
        let mut lanes = BTreeMap::<String, Vec<i32>>::new();
        for l in store.lane_owners().await? {
            let live = l.lease_expires_at.is_some_and(|e| e > now);
            let who = match (&l.owner, live) {
                (Some(o), true) => o.clone(),
                _ => "(unowned)".into(),
            };
            lanes.entry(who).or_default().push(l.lane);
        }
        let slots = store.wal_slots().await?;
        let mode = Self::mode(&slots, &lanes);
        Ok(CaptureState { mode, lanes, slots })
    }

    /// `wal` while a relay streams from a slot, `poll` while relays hold
    /// lanes, both when both (two relay groups on one database), else none.
    fn mode(slots: &[WalSlot], lanes: &BTreeMap<String, Vec<i32>>) -> &'static str {
        let wal = slots.iter().any(|s| s.active);
        let poll = lanes.keys().any(|o| o != "(unowned)");
        match (wal, poll) {
            (true, true) => "wal and poll (relays of both modes run on this database)",
            (true, false) => "wal",
            (false, true) => "poll",
            (false, false) => "none (no relay streams from a slot or holds a lane)",
        }
    }
}

/// The status report as text, one fact per line.
pub async fn report(store: &RelayStore) -> Result<String, RelayError> {
    let b = store.outbox_backlog().await?;
    let mut out = String::new();
    let _ = writeln!(out, "pending rows        {}", b.pending);
    let _ = writeln!(out, "oldest pending age  {:.1}s", b.oldest_age_ms() as f64 / 1000.0);
    let _ = writeln!(out, "dead rows           {}", store.outbox_dead_count().await?);
    let capture = CaptureState::read(store, b.now).await?;
    let _ = writeln!(out, "capture             {}", capture.mode);
    for (owner, lanes) in &capture.lanes {
        let _ = writeln!(out, "{owner:<40} {} lanes", lanes.len());
    }
    for s in &capture.slots {
        let _ = writeln!(out, "wal slot {:<31} {}", s.slot, describe_slot(s));
    }
    Ok(out)
}

/// One slot's state (`active (streaming)`, `inactive`, `dropped`), its lag
/// in bytes and time, its `wal_status` and `safe_wal_size` when PostgreSQL
/// reports them.
pub fn describe_slot(s: &WalSlot) -> String {
    let state = match (s.present, s.active) {
        (false, _) => "dropped",
        (true, true) => "active (streaming)",
        (true, false) => "inactive",
    };
    let mut line = format!("{state}, lag {} bytes, {:.1}s", s.lag_bytes, s.lag_ms as f64 / 1000.0);
    if let Some(w) = &s.wal_status {
        let _ = write!(line, ", wal_status {w}");
    }
    if let Some(n) = s.safe_wal_size {
        let _ = write!(line, ", safe_wal_size {n} bytes");
    }
    line
}
