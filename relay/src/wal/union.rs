//! `--streams N`: the marks of a relay's streams written together.
//!
//! A stream carries only the rows of its lanes, so the ids it acknowledges
//! interleave with the other streams' ids: written alone, as the marker of
//! one stream writes them, its marks are runs of about N ids, and the
//! ledger's cost is per run (each costs the marking statement a probe, an
//! insert and an index entry under the ledger's single-writer lock: 425,918
//! ranges for 1,000,000 rows at N = 2, where one stream wrote 13;
//! BENCHMARKS.md "Several streams"). Here the streams' markers hand their
//! acknowledged ids to one writer per relay process, which unites what
//! they handed and writes:
//!
//! - every run of the union at least [`MIN_RUN`] ids long, at once;
//! - a shorter run once it is [`HOLD`] old (counted from the oldest mark it
//!   holds ids of), or at once when fewer than two of this relay's streams
//!   are marking (no other stream of this process would lengthen it).
//!
//! A mark is done when the last of its ids is written, and its slot's
//! marked position is recorded in that transaction, so a slot is never
//! recorded past a row that is not covered. Holding costs marks up to
//! [`HOLD`] of latency (a SIGKILL then republishes up to that much more),
//! never a row: held ids are acknowledged and not yet marked, which a new
//! session publishes again. A failed write fails every mark held (each
//! stream's session ends, as after its own marker's failure).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use super::ledger::IdSet;
use crate::state::RelayState;

/// Runs of the union at least this long are written at once.
pub const MIN_RUN: i64 = 32;

/// How long a shorter run waits for the other streams' ids.
pub const HOLD: Duration = Duration::from_secs(1);

/// The shared write failed (logged by the writer, with its code): the
/// marks it held are not written.
#[derive(Debug, Clone, Copy)]
pub(super) struct UnionFailed;

/// One stream's mark waiting in the writer.
struct Held {
    /// Its ids not written yet.
    ids: IdSet,
    /// The slot and position to record once every id is written.
    marked: Option<(String, u64)>,
    since: Instant,
    done: oneshot::Sender<Result<(), UnionFailed>>,
}

/// The writer of a relay's streams' marks (see the module); cheap to clone.
#[derive(Clone, Debug)]
pub(crate) struct Union {
    tx: mpsc::UnboundedSender<Held>,
    marking: Arc<AtomicUsize>,
    /// How many marks the writer holds, as of its last turn.
    #[cfg(test)]
    holding: Arc<AtomicUsize>,
}

/// A stream's marker counted as marking until dropped.
pub(super) struct Marking(Arc<AtomicUsize>);

impl Drop for Marking {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Union {
    /// Starts the writer on `tasks`' runtime; it ends when every [`Union`]
    /// is dropped and nothing is held. `hold` is [`HOLD`] but in tests.
    pub(crate) fn spawn(state: Arc<RelayState>, hold: Duration) -> Union {
        let (tx, rx) = mpsc::unbounded_channel();
        let marking = Arc::new(AtomicUsize::new(0));
        let holding = Arc::new(AtomicUsize::new(0));
        tokio::spawn(write_loop(state, rx, marking.clone(), holding.clone(), hold));
        Union {
            tx,
            marking,
            #[cfg(test)]
            holding,
        }
    }

    /// How many marks the writer holds, as of its last turn.
    #[cfg(test)]
    pub(super) fn holding(&self) -> usize {
        self.holding.load(Ordering::Relaxed)
    }

    /// Counts a stream's marker as marking while the guard lives.
    pub(super) fn join(&self) -> Marking {
        self.marking.fetch_add(1, Ordering::Relaxed);
        Marking(self.marking.clone())
    }

    /// Hands `ids` over and resolves once they are all covered in the
    /// ledger, with `marked` recorded in the transaction that wrote the last
    /// of them.
    pub(super) async fn mark(&self, ids: IdSet, marked: Option<(&str, u64)>) -> Result<(), UnionFailed> {
        if ids.is_empty() {
            return Ok(()); // nothing to cover, and a mark without rows records no position
        }
        let (done, result) = oneshot::channel();
        let held = Held {
            ids,
            marked: marked.map(|(s, l)| (s.to_owned(), l)),
            since: Instant::now(),
            done,
        };
        self.tx.send(held).map_err(|_| UnionFailed)?;
        result.await.unwrap_or(Err(UnionFailed))
    }
}

/// The writer: takes what the streams hand over, writes what is due (see
/// the module), and waits for more or for the oldest short run's hold.
async fn write_loop(
    state: Arc<RelayState>,
    mut rx: mpsc::UnboundedReceiver<Held>,
    marking: Arc<AtomicUsize>,
    holding: Arc<AtomicUsize>,
    hold: Duration,
) {
    let mut held: Vec<Held> = Vec::new();
    let mut open = true;
    loop {
        holding.store(held.len(), Ordering::Relaxed);
        if open {
            let due = held.iter().map(|h| h.since + hold).min();
            tokio::select! {
                got = rx.recv() => match got {
                    Some(h) => held.push(h),
                    None => open = false,
                },
                () = sleep_until(due) => {}
            }
            while let Ok(h) = rx.try_recv() {
                held.push(h);
            }
        }
        if !open && held.is_empty() {
            return;
        }
        // Nothing more can lengthen a run when the senders are gone, or
        // when no other stream of this process marks.
        let now = Instant::now();
        let all_due = !open || marking.load(Ordering::Relaxed) < 2;
        let runs = due_runs(&held, now, hold, all_due);
        if runs.is_empty() {
            continue;
        }
        let written = IdSet::from_runs(&runs);
        let mut finished = Vec::new();
        let mut rest = Vec::new();
        for mut h in held.drain(..) {
            h.ids = h.ids.minus(&written);
            match h.ids.is_empty() {
                true => finished.push(h),
                false => rest.push(h),
            }
        }
        held = rest;
        let marked: Vec<(&str, u64)> = finished
            .iter()
            .filter_map(|h| h.marked.as_ref().map(|(s, l)| (s.as_str(), *l)))
            .collect();
        let started = Instant::now();
        match state.store.wal_cover_runs(&runs, &marked).await {
            Ok(covered) => {
                let t = &state.metrics.timings;
                crate::metrics::Timings::add(&t.marks, &t.mark_ns, started.elapsed());
                state.metrics.published.inc_by(covered);
                for h in finished {
                    let _ = h.done.send(Ok(()));
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, code = e.code(), marks = finished.len() + held.len(), "marking the streams' acknowledged rows delivered failed; ending their sessions (their slots are not confirmed past these rows, so the next sessions publish them again)");
                for h in finished.into_iter().chain(held.drain(..)) {
                    let _ = h.done.send(Err(UnionFailed));
                }
            }
        }
    }
}

/// The runs of the union of `held` to write now: those at least
/// [`MIN_RUN`] long, and those holding an id of a mark older than `hold`
/// (every run with `all`).
fn due_runs(held: &[Held], now: Instant, hold: Duration, all: bool) -> Vec<(i64, i64)> {
    let mut union = IdSet::default();
    let mut overdue = IdSet::default();
    for h in held {
        union.extend_with(h.ids.clone());
        if all || now >= h.since + hold {
            overdue.extend_with(h.ids.clone());
        }
    }
    union
        .runs()
        .into_iter()
        .filter(|&(lo, hi)| hi - lo + 1 >= MIN_RUN || overdue.any_within(lo, hi))
        .collect()
}

/// Sleeps until `at`, or for ever without one.
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wal::marker::tests::{ranges, test_state};

    fn held(ids: &[i64], age: Duration, now: Instant) -> Held {
        Held {
            ids: ids.iter().copied().collect(),
            marked: None,
            since: now - age,
            done: oneshot::channel().0,
        }
    }

    #[test]
    fn long_runs_go_at_once_and_short_ones_when_their_hold_is_over() {
        let now = Instant::now();
        let hold = Duration::from_secs(1);
        let odd: Vec<i64> = (1..=99).step_by(2).collect();
        let even: Vec<i64> = (2..=40).step_by(2).collect();
        // Alone, a stream's interleaved ids wait for the other stream's.
        assert!(due_runs(&[held(&odd, Duration::ZERO, now)], now, hold, false).is_empty());
        // United with them: the long run goes, the short rest waits.
        let both = [held(&odd, Duration::ZERO, now), held(&even, Duration::ZERO, now)];
        assert_eq!(due_runs(&both, now, hold, false), vec![(1, 41)]);
        // Once the odd ids' hold is over, their short runs go too.
        let late = [held(&odd, hold, now), held(&even, Duration::ZERO, now)];
        let runs = due_runs(&late, now, hold, false);
        assert_eq!(runs.first(), Some(&(1, 41)));
        assert_eq!(runs.len(), 1 + (99 - 43) / 2 + 1);
        // With nothing to wait for, everything goes.
        assert_eq!(
            due_runs(&[held(&[5, 9], Duration::ZERO, now)], now, hold, true),
            vec![(5, 5), (9, 9)]
        );
    }

    /// Two streams' interleaved ids, acknowledged two seconds apart (on an
    /// injected clock): written apart, as each stream's marker wrote them,
    /// they were 2,000 ranges (neighbours acknowledged in another second
    /// never merge); through the union, one range, written once the second
    /// stream's ids came, with both slots' marked positions.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_streams_interleaved_ids_are_written_as_one_range() {
        let t = ferry_testkit::TestDb::with_clock(ferry::Engine::Postgres, ferry_testkit::manual_clock()).await;
        let state = test_state(&t.ferry);
        let pool = t.ferry.db().as_postgres().unwrap().clone();
        let union = Union::spawn(state.clone(), Duration::from_secs(600));
        let (_a, _b) = (union.join(), union.join());
        let odd: IdSet = (1..=2000).step_by(2).collect();
        let even: IdSet = (2..=2000).step_by(2).collect();
        let first = {
            let union = union.clone();
            tokio::spawn(async move { union.mark(odd, Some(("s_0of2", 10))).await })
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while union.holding() < 1 {
            assert!(
                Instant::now() < deadline,
                "the writer never held the first stream's mark"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert!(ranges(&pool).await.is_empty(), "held, not written");
        t.ferry.clock().advance(Duration::from_secs(2)).unwrap();
        union.mark(even, Some(("s_1of2", 20))).await.unwrap();
        first.await.unwrap().unwrap();
        assert_eq!(ranges(&pool).await, vec![(1, 2000, ferry_testkit::T0 + 2000)]);
        assert_eq!(state.store.wal_marked("s_0of2").await.unwrap(), 10);
        assert_eq!(state.store.wal_marked("s_1of2").await.unwrap(), 20);
        assert_eq!(state.metrics.published.get(), 2000);
    }

    /// A stream's short runs that no other stream lengthens are written
    /// once their hold is over, and at once when it is the only stream
    /// marking: a mark is held, never lost.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_short_run_is_written_when_its_hold_is_over() {
        let t = ferry_testkit::TestDb::new(ferry::Engine::Postgres).await;
        let state = test_state(&t.ferry);
        let pool = t.ferry.db().as_postgres().unwrap().clone();
        let union = Union::spawn(state.clone(), Duration::from_millis(50));
        let (_a, _b) = (union.join(), union.join());
        union.mark([1, 3, 5].into_iter().collect(), None).await.unwrap();
        assert_eq!(ranges(&pool).await.len(), 3);
        // Alone, nothing waits for the hold (ten minutes here).
        let alone = Union::spawn(state.clone(), Duration::from_secs(600));
        let _c = alone.join();
        tokio::time::timeout(Duration::from_secs(30), alone.mark([9].into_iter().collect(), None))
            .await
            .expect("written at once")
            .unwrap();
        assert_eq!(ranges(&pool).await.len(), 4);
    }
}
