//! Lane leases: heartbeat, renew what is held, take a fair share of the free
//! lanes, give back extras. Generations only go up, so a relay that lost a
//! lane can never mark its rows.

use std::collections::BTreeMap;

use ferry::relay::LaneLease;
use ferry::Ferry;

use crate::config::RelayConfig;
use crate::error::RelayError;

/// What one lane-management tick decided.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct LanePlan {
    /// Lanes still held after renewal, with their generation.
    pub kept: Vec<LaneLease>,
    /// Lanes lost since the last tick (expired or taken over).
    pub lost: Vec<LaneLease>,
    /// Lanes newly acquired.
    pub acquired: Vec<LaneLease>,
    /// Lanes to give back (held beyond the fair share).
    pub surplus: Vec<LaneLease>,
}

/// The fair share of `lanes` among `live` relays, capped by `max`.
pub fn fair_share(lanes: i32, live: i64, max: u32) -> usize {
    let live = live.max(1) as usize;
    (lanes.max(0) as usize).div_ceil(live).min(max as usize)
}

/// One tick: heartbeat, renew, then acquire up to or release down to the fair share.
pub async fn tick(
    ferry: &Ferry,
    cfg: &RelayConfig,
    owner: &str,
    held: &BTreeMap<i32, LaneLease>,
) -> Result<LanePlan, RelayError> {
    let live = ferry.relay_heartbeat(owner, cfg.lease).await?;
    let renewed = ferry.renew_lanes(owner, cfg.lease).await?;
    let mut plan = LanePlan::default();
    for lease in held.values() {
        if !renewed.iter().any(|r| r == lease) {
            plan.lost.push(*lease);
        }
    }
    plan.kept = renewed.into_iter().filter(|r| held.get(&r.lane) == Some(r)).collect();
    let share = fair_share(ferry.lanes(), live, cfg.max_lanes);
    if plan.kept.len() < share {
        plan.acquired = ferry
            .acquire_lanes(owner, cfg.lease, (share - plan.kept.len()) as u32)
            .await?;
    } else if plan.kept.len() > share {
        plan.surplus = plan.kept.split_off(share);
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cover_every_lane() {
        assert_eq!(fair_share(64, 1, 1024), 64);
        assert_eq!(fair_share(64, 2, 1024), 32);
        assert_eq!(fair_share(64, 3, 1024), 22);
        assert_eq!(fair_share(64, 0, 1024), 64);
        assert_eq!(fair_share(64, 1, 10), 10);
    }
}
