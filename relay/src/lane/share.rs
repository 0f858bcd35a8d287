//! Lane leases (the share of the lanes this relay publishes): heartbeat, renew what is held, take a fair share of the free
//! lanes, give back extras. Generations only go up, so a relay that lost a
//! lane can never mark its rows.

use std::collections::BTreeMap;

use crate::store::LaneLease;
use crate::store::RelayStore;
use ferry::operator::LiveRelay;

use crate::config::RelayConfig;
use crate::error::RelayError;

/// What one lane-management tick decided.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct LanePlan {
    /// Lanes still held after renewal, with their generation.
    pub kept: Vec<LaneLease>,
    /// Lanes lost since the last tick (taken over by another relay: a lease
    /// that lapsed while no one took the lane is renewed, not lost).
    pub lost: Vec<LaneLease>,
    /// Lanes newly acquired.
    pub acquired: Vec<LaneLease>,
    /// Lanes to give back (held beyond the fair share).
    pub surplus: Vec<LaneLease>,
    /// Lanes the database says this relay holds that it has no task for (a
    /// restart with the same `--relay-id` before another relay took them, a
    /// lost acquire reply, a failed release). They are released at once, so they are
    /// taken again at a new generation, by this relay or another, and
    /// published; renewing them without publishing would strand their rows.
    pub orphans: Vec<LaneLease>,
}

/// This relay's share of `lanes` when the live relays have these caps
/// (`--max-lanes`), water-filled: relays are taken by ascending cap (then
/// owner), each gets the smaller of its cap and an even split (rounded up)
/// of what is left, so capped relays take their cap and the others share
/// the rest. Every relay computes the same assignment from the same
/// membership.
pub fn fair_share(lanes: i32, live: &[LiveRelay], me: &str, my_cap: u32) -> usize {
    let mut members: Vec<(i64, &str)> = live.iter().map(|r| (r.max_lanes.max(0), r.owner.as_str())).collect();
    if !members.iter().any(|(_, o)| *o == me) {
        members.push((i64::from(my_cap), me));
    }
    members.sort_unstable();
    let mut left = i64::from(lanes.max(0));
    for (i, (cap, owner)) in members.iter().enumerate() {
        let rest = (members.len() - i) as i64;
        let share = (*cap).min((left + rest - 1) / rest);
        if *owner == me {
            return share.min(i64::from(my_cap)) as usize;
        }
        left -= share;
    }
    0
}

/// One tick: heartbeat, renew, release orphans, then acquire up to or
/// release down to the fair share. `held` are the lanes with a publishing
/// task; `draining` the surplus lanes still finishing their last batch before
/// their release (ours, but neither kept nor orphaned).
pub async fn tick(
    store: &RelayStore,
    cfg: &RelayConfig,
    owner: &str,
    held: &BTreeMap<i32, LaneLease>,
    draining: &BTreeMap<i32, LaneLease>,
) -> Result<LanePlan, RelayError> {
    let live = store.relay_heartbeat(owner, cfg.lease, cfg.max_lanes).await?;
    let renewed = store.renew_lanes(owner, cfg.lease).await?;
    let mut plan = LanePlan::default();
    for lease in &renewed {
        if held.get(&lease.lane) != Some(lease) && draining.get(&lease.lane) != Some(lease) {
            // Fenced by the generation: a newer holder is never disturbed.
            store.release_lane(owner, *lease).await?;
            plan.orphans.push(*lease);
        }
    }
    for lease in held.values() {
        if !renewed.iter().any(|r| r == lease) {
            plan.lost.push(*lease);
        }
    }
    plan.kept = renewed.into_iter().filter(|r| held.get(&r.lane) == Some(r)).collect();
    let share = fair_share(store.ferry().lanes(), &live, owner, cfg.max_lanes);
    if plan.kept.len() < share {
        plan.acquired = store
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

    fn live(caps: &[(&str, i64)]) -> Vec<LiveRelay> {
        caps.iter()
            .map(|(o, c)| LiveRelay {
                owner: (*o).into(),
                max_lanes: *c,
            })
            .collect()
    }

    #[test]
    fn shares_cover_every_lane() {
        assert_eq!(fair_share(64, &live(&[("a", 1024)]), "a", 1024), 64);
        assert_eq!(fair_share(64, &live(&[("a", 1024), ("b", 1024)]), "a", 1024), 32);
        let three = live(&[("a", 1024), ("b", 1024), ("c", 1024)]);
        let total: usize = ["a", "b", "c"].iter().map(|o| fair_share(64, &three, o, 1024)).sum();
        assert_eq!(total, 64);
        assert_eq!(fair_share(64, &[], "a", 1024), 64, "not yet in the membership");
        assert_eq!(fair_share(64, &live(&[("a", 10)]), "a", 10), 10);
    }

    #[test]
    fn a_capped_relay_beside_an_uncapped_one_leaves_no_lane_unowned() {
        let m = live(&[("small", 10), ("big", 1024)]);
        assert_eq!(fair_share(64, &m, "small", 10), 10);
        assert_eq!(fair_share(64, &m, "big", 1024), 54);
        let m = live(&[("a", 5), ("b", 20), ("c", 1024), ("d", 1024)]);
        let shares: Vec<usize> = [("a", 5), ("b", 20), ("c", 1024), ("d", 1024)]
            .iter()
            .map(|(o, c)| fair_share(64, &m, o, *c as u32))
            .collect();
        assert_eq!(shares, [5, 20, 20, 19]);
        assert_eq!(shares.iter().sum::<usize>(), 64);
    }
}
