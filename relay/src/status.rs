//! `status`: the outbox backlog, its oldest pending age, dead rows, which
//! relay holds how many lanes, and the WAL capture's slots (streaming or
//! not, WAL held back), as printed by `ferry-relay status` and `ferry status`.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::error::RelayError;
use crate::store::RelayStore;

/// The status report as text, one fact per line.
pub async fn report(store: &RelayStore) -> Result<String, RelayError> {
    let b = store.outbox_backlog().await?;
    let mut out = String::new();
    let _ = writeln!(out, "pending rows        {}", b.pending);
    let _ = writeln!(out, "oldest pending age  {:.1}s", b.oldest_age_ms() as f64 / 1000.0);
    let _ = writeln!(out, "dead rows           {}", store.outbox_dead_count().await?);
    let mut by_owner = BTreeMap::<String, Vec<i32>>::new();
    for l in store.lane_owners().await? {
        let live = l.lease_expires_at.is_some_and(|e| e > b.now);
        let who = match (&l.owner, live) {
            (Some(o), true) => o.clone(),
            _ => "(unowned)".into(),
        };
        by_owner.entry(who).or_default().push(l.lane);
    }
    for (owner, lanes) in by_owner {
        let _ = writeln!(out, "{owner:<40} {} lanes", lanes.len());
    }
    for s in store.wal_slots().await? {
        let state = match (s.present, s.active) {
            (false, _) => "dropped",
            (true, true) => "streaming",
            (true, false) => "idle",
        };
        let _ = writeln!(out, "wal slot {:<31} {state}, {} bytes behind", s.slot, s.lag_bytes);
    }
    Ok(out)
}
