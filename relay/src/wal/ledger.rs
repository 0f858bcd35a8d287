//! The arithmetic of the delivered-ranges ledger (`outbox_delivered`),
//! without the database: which ranges one mark deletes and
//! inserts so that the ledger covers the acknowledged ids and nothing else.
//! An outbox id is *covered* when a range has `lo <= id <= hi`; ranges never
//! overlap, an id that was not acknowledged (in flight, rolled back, dead)
//! is never covered, and a new run joins a range it touches only when both
//! were acknowledged in the same second of the clock, so a range's
//! `delivered_at` (the latest acknowledgement in it) is less than a second
//! after each of its ids' and the ledger holds about one range per second
//! of delivery. The marker runs this under the ledger's advisory lock
//! (`RelayStore::wal_cover_delivered`).

/// A set of outbox ids, kept as roaring bitmaps: what the pipeline holds
/// of a transaction until the marker has it. A transaction's consecutive
/// ids take a few bytes per 65,536, and ids interleaved with another
/// writer's about a bit each, so a transaction of millions of rows costs
/// kilobytes, not 8 bytes a row (a `Vec<i64>` of 5M acknowledged ids, and
/// its sorted copy for the runs, took the relay past 64 MiB).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct IdSet(roaring::RoaringTreemap);

/// The order-preserving map of an id onto the bitmap's `u64` (its sign bit
/// flipped: `i64::MIN` is 0).
fn key(id: i64) -> u64 {
    (id as u64) ^ (1 << 63)
}

fn id(key: u64) -> i64 {
    (key ^ (1 << 63)) as i64
}

impl IdSet {
    /// Adds `id`.
    pub fn insert(&mut self, id: i64) {
        self.0.insert(key(id));
    }

    /// How many ids.
    pub fn len(&self) -> u64 {
        self.0.len()
    }

    /// Whether it holds no id.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Adds every id of `other`.
    pub fn extend_with(&mut self, other: IdSet) {
        self.0 |= other.0;
    }

    /// The ids of `runs` (each `(lo, hi)` inclusive).
    pub fn from_runs(runs: &[(i64, i64)]) -> IdSet {
        let mut set = IdSet::default();
        for &(lo, hi) in runs {
            set.0.insert_range(key(lo)..=key(hi));
        }
        set
    }

    /// The ids not in `other`.
    pub fn minus(mut self, other: &IdSet) -> IdSet {
        self.0 -= &other.0;
        self
    }

    /// Whether it holds an id from `lo` to `hi` (inclusive).
    pub fn any_within(&self, lo: i64, hi: i64) -> bool {
        lo <= hi && self.0.range_cardinality(key(lo)..=key(hi)) > 0
    }

    /// The highest id.
    pub fn max(&self) -> Option<i64> {
        self.0.max().map(id)
    }

    /// The ids below `bound`.
    pub fn below(mut self, bound: i64) -> IdSet {
        self.0.remove_range(key(bound)..);
        self
    }

    /// The ids in increasing order.
    pub fn iter(&self) -> impl Iterator<Item = i64> + '_ {
        self.0.iter().map(id)
    }

    /// The ids as runs of consecutive integers `(lo, hi)`, in order.
    pub fn runs(&self) -> Vec<(i64, i64)> {
        let mut out: Vec<(i64, i64)> = Vec::new();
        for i in self.iter() {
            match out.last_mut() {
                Some((_, hi)) if hi.checked_add(1) == Some(i) => *hi = i,
                _ => out.push((i, i)),
            }
        }
        out
    }
}

impl FromIterator<i64> for IdSet {
    fn from_iter<T: IntoIterator<Item = i64>>(ids: T) -> Self {
        let mut set = IdSet::default();
        for i in ids {
            set.insert(i);
        }
        set
    }
}

/// One ledger row: ids `lo..=hi`, acknowledged by `delivered_at` (ms).
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::FromRow)]
pub struct Range {
    /// First id covered.
    pub lo: i64,
    /// Last id covered (`>= lo`).
    pub hi: i64,
    /// When the last of its ids was acknowledged (ms), what retention and
    /// the readers' `delivered_at` go by.
    pub delivered_at: i64,
}

/// What one mark changes in the ledger.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Change {
    /// The `lo` of each existing range to delete (absorbed into a merged one).
    pub delete: Vec<i64>,
    /// The ranges to insert, in `lo` order.
    pub insert: Vec<Range>,
    /// How many acknowledged ids were not covered before.
    pub newly_covered: u64,
}

/// `ids` as runs of consecutive integers `(lo, hi)`, sorted and without
/// duplicates: an id missing between two splits them.
pub fn runs(ids: &[i64]) -> Vec<(i64, i64)> {
    ids.iter().copied().collect::<IdSet>().runs()
}

/// Whether a range acknowledged at `then` may take in ids acknowledged at
/// `now`: only within the same second of the clock (so within 1,000 ms, and
/// a range that keeps growing cannot push its first ids' `delivered_at`
/// later and later, out of retention's reach).
fn same_second(then: i64, now: i64) -> bool {
    then.div_euclid(1000) == now.div_euclid(1000)
}

/// A stretch of ids in the walk of [`cover`]: an existing range (`old`) or
/// a run's part that no range covers yet.
struct Piece {
    lo: i64,
    hi: i64,
    at: i64,
    old: bool,
}

/// The change that covers `runs` (from [`runs`], acknowledged at `now`)
/// given `existing`, every ledger range that overlaps or touches one of
/// them, sorted by `lo`. Each run is trimmed to what no range covers (a
/// republished duplicate adds nothing); each new part joins a range it
/// touches when [`same_second`], the merged range keeping the later
/// `delivered_at`; the ranges a merge absorbs are deleted.
pub fn cover(runs: &[(i64, i64)], existing: &[Range], now: i64) -> Change {
    let mut fresh: Vec<Piece> = Vec::new();
    let mut first = 0;
    for &(lo, hi) in runs {
        while first < existing.len() && existing[first].hi < lo {
            first += 1;
        }
        let mut next = lo;
        for e in existing[first..].iter().take_while(|e| e.lo <= hi) {
            if e.lo > next {
                fresh.push(Piece {
                    lo: next,
                    hi: e.lo - 1,
                    at: now,
                    old: false,
                });
            }
            next = next.max(e.hi.saturating_add(1));
        }
        if next <= hi {
            fresh.push(Piece {
                lo: next,
                hi,
                at: now,
                old: false,
            });
        }
    }
    let mut change = Change {
        newly_covered: fresh.iter().map(|p| (p.hi - p.lo + 1) as u64).sum(),
        ..Change::default()
    };
    let mut pieces: Vec<Piece> = existing
        .iter()
        .map(|e| Piece {
            lo: e.lo,
            hi: e.hi,
            at: e.delivered_at,
            old: true,
        })
        .chain(fresh)
        .collect();
    pieces.sort_by_key(|p| p.lo);
    // Groups of touching pieces that merge; a group with a new piece is
    // written, one of a single existing range is left alone.
    let mut group: Vec<Piece> = Vec::new();
    for p in pieces {
        let joins = group.last().is_some_and(|last: &Piece| {
            last.hi + 1 == p.lo && last.old != p.old && same_second(if last.old { last.at } else { p.at }, now)
        });
        if !joins {
            flush(&mut group, &mut change);
        }
        group.push(p);
    }
    flush(&mut group, &mut change);
    change
}

/// Writes `group` (touching pieces that merge) into `change` and empties it.
fn flush(group: &mut Vec<Piece>, change: &mut Change) {
    if group.iter().any(|p| !p.old) {
        change.delete.extend(group.iter().filter(|p| p.old).map(|p| p.lo));
        change.insert.push(Range {
            lo: group[0].lo,
            hi: group[group.len() - 1].hi,
            delivered_at: group.iter().map(|p| p.at).max().expect("a group is never empty"),
        });
    }
    group.clear();
}

/// How many ranges one load of [`Known`] reads (`wal_ledger_from`).
pub const KNOWN_LOAD: usize = 1_024;

/// A streaming session's view of the ledger, loaded as its rows need it:
/// every range that meets `span` as a load found it. A row the stream
/// carries that the ledger covered when the session looked is never
/// produced again, whatever the slot's marked and confirmed positions
/// say (a restart, a second relay, a failover's new slot). Ids arrive
/// mostly rising, so after the first load from the lowest id the view
/// answers from memory; an id below the span loads again from it.
#[derive(Debug, Default)]
pub struct Known {
    /// The ranges a load returned, in `lo` order.
    ranges: Vec<Range>,
    /// The ids the view answers for: `(from, to)`, inclusive.
    span: Option<(i64, i64)>,
}

impl Known {
    /// Whether the ledger covered `id` when it was loaded; `None` when `id`
    /// lies outside what was loaded ([`Known::learn`] from it first).
    pub fn covers(&self, id: i64) -> Option<bool> {
        let (from, to) = self.span?;
        if id < from || id > to {
            return None;
        }
        let after = self.ranges.partition_point(|r| r.lo <= id);
        Some(after > 0 && self.ranges[after - 1].hi >= id)
    }

    /// Replaces the view with one load from `id` (what `wal_ledger_from`
    /// returned for it with `limit`): a load shorter than `limit` holds
    /// every range above `id`; a full one, those up to its last range's `hi`.
    pub fn learn(&mut self, id: i64, loaded: Vec<Range>, limit: usize) {
        let to = match loaded.last() {
            Some(last) if loaded.len() >= limit => last.hi.max(id),
            _ => i64::MAX,
        };
        self.ranges = loaded;
        self.span = Some((id, to));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: i64 = 1_000_000_500;

    fn range(lo: i64, hi: i64, delivered_at: i64) -> Range {
        Range { lo, hi, delivered_at }
    }

    #[test]
    fn consecutive_ids_are_one_range() {
        let c = cover(&runs(&[3, 1, 2, 4, 2]), &[], NOW);
        assert_eq!(c.insert, vec![range(1, 4, NOW)]);
        assert!(c.delete.is_empty());
        assert_eq!(c.newly_covered, 4);
    }

    /// An id that was not acknowledged (in flight, rolled back, dead) is
    /// never covered: it splits the run.
    #[test]
    fn a_hole_splits_the_ranges() {
        assert_eq!(runs(&[1, 2, 4, 5, 9]), vec![(1, 2), (4, 5), (9, 9)]);
        // Signs, extremes and a cut below an id keep the order.
        assert_eq!(
            runs(&[-1, 0, 1, i64::MAX, i64::MIN]),
            vec![(i64::MIN, i64::MIN), (-1, 1), (i64::MAX, i64::MAX)]
        );
        let set: IdSet = (1..=1_000_000).chain([2_000_000]).collect();
        assert_eq!(
            (set.len(), set.clone().below(500_001).runs()),
            (1_000_001, vec![(1, 500_000)])
        );
        assert_eq!(set.runs(), vec![(1, 1_000_000), (2_000_000, 2_000_000)]);
        let c = cover(&runs(&[1, 2, 4, 5, 9]), &[], NOW);
        assert_eq!(c.insert, vec![range(1, 2, NOW), range(4, 5, NOW), range(9, 9, NOW)]);
        assert_eq!(c.newly_covered, 5);
    }

    /// A republished set (a restart publishes again what the slot was not
    /// confirmed past) is already covered: no write, nothing counted.
    #[test]
    fn a_republished_set_adds_nothing() {
        let earlier = NOW - 5_000;
        let existing = [range(1, 10, earlier), range(12, 20, earlier)];
        let c = cover(&runs(&[1, 2, 3, 14, 15]), &existing, NOW);
        assert_eq!(c, Change::default());
    }

    /// Partly covered: only the ids not covered are inserted, and nothing
    /// overlaps a range acknowledged in another second.
    #[test]
    fn a_partly_republished_run_is_trimmed_to_what_is_not_covered() {
        let earlier = NOW - 5_000;
        let existing = [range(5, 10, earlier), range(14, 15, earlier)];
        let c = cover(&runs(&(1..=20).collect::<Vec<_>>()), &existing, NOW);
        assert!(c.delete.is_empty());
        assert_eq!(c.insert, vec![range(1, 4, NOW), range(11, 13, NOW), range(16, 20, NOW)]);
        assert_eq!(c.newly_covered, 12);
    }

    /// Within the same second a new run joins the ranges it touches, on
    /// both sides, and the merged range keeps the later delivered_at.
    #[test]
    fn touching_ranges_of_the_same_second_merge() {
        let second = NOW - NOW % 1000;
        let existing = [range(1, 10, second), range(21, 30, second + 1)];
        let c = cover(&runs(&(8..=22).collect::<Vec<_>>()), &existing, NOW);
        assert_eq!(c.delete, vec![1, 21]);
        assert_eq!(c.insert, vec![range(1, 30, NOW)]);
        assert_eq!(c.newly_covered, 10);
    }

    /// Merging only within 1,000 ms (and within one second of the clock):
    /// a run touching a range acknowledged earlier is a range of its own.
    #[test]
    fn ranges_of_different_seconds_do_not_merge() {
        let second = NOW - NOW % 1000;
        let existing = [range(1, 10, NOW - 1000), range(21, 30, second - 1)];
        let c = cover(&runs(&(11..=20).collect::<Vec<_>>()), &existing, NOW);
        assert!(c.delete.is_empty());
        assert_eq!(c.insert, vec![range(11, 20, NOW)]);
        // The same second on one side only: it merges on that side.
        let existing = [range(1, 10, second), range(21, 30, second - 1)];
        let c = cover(&runs(&(11..=20).collect::<Vec<_>>()), &existing, NOW);
        assert_eq!(c.delete, vec![1]);
        assert_eq!(c.insert, vec![range(1, 20, NOW)]);
    }

    /// Two existing ranges that touch each other are left alone when no
    /// new id lies between them.
    #[test]
    fn existing_ranges_are_not_merged_with_each_other() {
        let existing = [range(1, 10, NOW), range(11, 20, NOW)];
        let c = cover(&runs(&[5, 25]), &existing, NOW);
        assert!(c.delete.is_empty());
        assert_eq!(c.insert, vec![range(25, 25, NOW)]);
        assert_eq!(c.newly_covered, 1);
    }

    /// The view answers only inside what it loaded: below the id it was
    /// loaded from, and past a full load's last range, it does not know.
    #[test]
    fn the_known_view_answers_only_inside_its_load() {
        let mut k = Known::default();
        assert_eq!(k.covers(5), None);
        // The range before the id (covering it or not) comes with the load.
        k.learn(
            5,
            vec![range(1, 6, NOW), range(9, 9, NOW), range(12, 20, NOW)],
            KNOWN_LOAD,
        );
        let seen: Vec<_> = [4, 5, 6, 7, 9, 10, 12, 20, 21, i64::MAX].map(|i| k.covers(i)).to_vec();
        let t = Some(true);
        let f = Some(false);
        assert_eq!(seen, vec![None, t, t, f, t, f, t, t, f, f]);
        // A full load knows up to its last range only.
        k.learn(7, vec![range(1, 6, NOW), range(9, 9, NOW)], 2);
        assert_eq!([6, 7, 8, 9, 10].map(|i| k.covers(i)), [None, f, f, t, None]);
        // An empty load: nothing from the id on is covered.
        k.learn(3, Vec::new(), 2);
        assert_eq!([2, 3, i64::MAX].map(|i| k.covers(i)), [None, f, f]);
    }

    /// One existing range spanning several runs is consulted for each.
    #[test]
    fn a_range_spanning_several_runs_covers_each() {
        let existing = [range(1, 100, NOW - 5_000)];
        let c = cover(&runs(&[3, 50, 99, 100, 101]), &existing, NOW);
        assert_eq!(c.insert, vec![range(101, 101, NOW)]);
        assert_eq!(c.newly_covered, 1);
    }
}
