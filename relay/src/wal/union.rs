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
//! - a shorter run once no other stream of this relay would lengthen it:
//!   none that marks (handed ids within [`IDLE`], or waits for a mark of
//!   its own) has not yet handed ids past the run's end while being at
//!   most [`WINDOW`] ids behind its start, but the streams whose waiting
//!   mark has ids in the run (they hand nothing more until it is
//!   written). A stream a little behind the others is waited for, so the
//!   streams' marks come out as runs; a gap no stream of this relay fills
//!   (another relay's stream, a transaction in flight or rolled back)
//!   waits only until the slowest of them passed it; a stream far behind
//!   (republishing a backlog after a restart) is not waited for, so it
//!   does not slow the others' marks;
//! - any run once a mark it holds ids of is [`HOLD`] old, whatever it waits
//!   for, and at once a run with ids of a session's last mark (its marker
//!   marks no more, and its session waits for it to end).
//!
//! A mark is done when the last of its ids is written, and its slot's
//! marked position is recorded in that transaction, so a slot is never
//! recorded past a row that is not covered. Holding costs marks latency (a
//! SIGKILL then republishes more), never a row: held ids are acknowledged
//! and not yet marked, which a new session publishes again. A failed write
//! fails every mark held (each stream's session ends, as after its own
//! marker's failure).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use super::ledger::IdSet;
use crate::state::RelayState;

/// Runs of the union at least this long are written at once.
pub const MIN_RUN: i64 = 32;

/// The longest a run waits for the other streams' ids.
pub const HOLD: Duration = Duration::from_secs(5);

/// A stream that handed nothing for this long is not waited for (it has
/// no rows, or is stalled).
pub const IDLE: Duration = Duration::from_millis(500);

/// A stream more than this many ids behind a run is not waited for.
pub const WINDOW: i64 = 1_000_000;

/// A write that has not committed after this long is given up (its
/// connection dropped) and its marks failed, so a statement stuck on a
/// dead connection does not stall every stream's marks.
pub const WRITE_BOUND: Duration = Duration::from_secs(60);

/// The shared write failed (logged by the writer, with its code): the
/// marks it held are not written.
#[derive(Debug, Clone, Copy)]
pub(super) struct UnionFailed;

/// One stream's mark waiting in the writer.
struct Held {
    /// The stream's marker ([`Marking`]), while it marks.
    stream: Option<u64>,
    /// Its ids not written yet.
    ids: IdSet,
    /// The slot and position to record once every id is written.
    marked: Option<(String, u64)>,
    since: Instant,
    done: oneshot::Sender<Result<(), UnionFailed>>,
}

/// What the writer knows of a stream that marks.
#[derive(Debug, Clone, Copy)]
struct Seen {
    /// The highest id it handed (`i64::MIN`: none yet).
    frontier: i64,
    /// When it last handed ids (or joined).
    last: Instant,
}

/// The streams that mark, by marker.
type Streams = Arc<Mutex<HashMap<u64, Seen>>>;

fn lock(streams: &Streams) -> std::sync::MutexGuard<'_, HashMap<u64, Seen>> {
    streams.lock().unwrap_or_else(|e| e.into_inner())
}

/// The writer of a relay's streams' marks (see the module); cheap to clone.
#[derive(Clone, Debug)]
pub(crate) struct Union {
    tx: mpsc::UnboundedSender<Held>,
    streams: Streams,
    next: Arc<std::sync::atomic::AtomicU64>,
    /// How many marks the writer holds, as of its last turn.
    #[cfg(test)]
    holding: Arc<std::sync::atomic::AtomicUsize>,
}

/// A stream's marker, waited for as marking until dropped.
pub(super) struct Marking {
    id: u64,
    streams: Streams,
}

impl Drop for Marking {
    fn drop(&mut self) {
        lock(&self.streams).remove(&self.id);
    }
}

/// How long runs wait: [`HOLD`] and [`IDLE`], shorter or longer in tests.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Waits {
    /// The longest a run waits.
    pub hold: Duration,
    /// When a stream that handed nothing stops being waited for.
    pub idle: Duration,
}

impl Waits {
    /// [`HOLD`] and [`IDLE`].
    pub(crate) const DEFAULT: Waits = Waits { hold: HOLD, idle: IDLE };
}

impl Union {
    /// Starts the writer; it ends when every [`Union`] is dropped and
    /// nothing is held.
    pub(crate) fn spawn(state: Arc<RelayState>, waits: Waits) -> Union {
        let (tx, rx) = mpsc::unbounded_channel();
        let streams = Streams::default();
        let holding = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        tokio::spawn(write_loop(state, rx, streams.clone(), holding.clone(), waits));
        Union {
            tx,
            streams,
            next: Arc::default(),
            #[cfg(test)]
            holding,
        }
    }

    /// How many marks the writer holds, as of its last turn.
    #[cfg(test)]
    pub(super) fn holding(&self) -> usize {
        self.holding.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A stream's marker joins: waited for while the guard lives.
    pub(super) fn join(&self) -> Marking {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let seen = Seen {
            frontier: i64::MIN,
            last: Instant::now(),
        };
        lock(&self.streams).insert(id, seen);
        Marking {
            id,
            streams: self.streams.clone(),
        }
    }

    /// Hands `ids` over (from `stream`'s marker, or from a marker that
    /// marks no more) and resolves once they are all covered in the
    /// ledger, with `marked` recorded in the transaction that wrote the
    /// last of them.
    pub(super) async fn mark(
        &self,
        stream: Option<&Marking>,
        ids: IdSet,
        marked: Option<(&str, u64)>,
    ) -> Result<(), UnionFailed> {
        if ids.is_empty() {
            return Ok(()); // nothing to cover, and a mark without rows records no position
        }
        let (done, result) = oneshot::channel();
        let held = Held {
            stream: stream.map(|m| m.id),
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
/// the module), and waits for more, for the oldest mark's hold, or (while
/// it holds any) for a stream to go idle.
async fn write_loop(
    state: Arc<RelayState>,
    mut rx: mpsc::UnboundedReceiver<Held>,
    streams: Streams,
    holding: Arc<std::sync::atomic::AtomicUsize>,
    waits: Waits,
) {
    let mut held: Vec<Held> = Vec::new();
    let mut open = true;
    loop {
        holding.store(held.len(), std::sync::atomic::Ordering::Relaxed);
        if open {
            let now = Instant::now();
            let due = held.iter().map(|h| (h.since + waits.hold).min(now + waits.idle)).min();
            tokio::select! {
                got = rx.recv() => match got {
                    Some(h) => arrive(h, &mut held, &streams),
                    None => open = false,
                },
                () = sleep_until(due) => {}
            }
            while let Ok(h) = rx.try_recv() {
                arrive(h, &mut held, &streams);
            }
        }
        if !open && held.is_empty() {
            return;
        }
        // Nothing more can lengthen a run once the senders are gone.
        let others = match open {
            true => lock(&streams).iter().map(|(id, s)| (*id, *s)).collect(),
            false => Vec::new(),
        };
        let runs = due_runs(&held, &others, Instant::now(), waits);
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
        let wrote = match tokio::time::timeout(WRITE_BOUND, state.store.wal_cover_runs(&runs, &marked)).await {
            Ok(wrote) => wrote.map_err(|e| format!("{} ({})", e, e.code())),
            Err(_) => Err(format!("not committed within {WRITE_BOUND:?}; given up")),
        };
        match wrote {
            Ok(covered) => {
                let t = &state.metrics.timings;
                crate::metrics::Timings::add(&t.marks, &t.mark_ns, started.elapsed());
                state.metrics.published.inc_by(covered);
                // A stream whose mark is done hands its next one now: it
                // is marking, however long the mark waited.
                let now = Instant::now();
                let mut seen = lock(&streams);
                for h in finished {
                    if let Some(s) = h.stream.and_then(|id| seen.get_mut(&id)) {
                        s.last = now;
                    }
                    let _ = h.done.send(Ok(()));
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, marks = finished.len() + held.len(), "marking the streams' acknowledged rows delivered failed; ending their sessions (their slots are not confirmed past these rows, so the next sessions publish them again)");
                for h in finished.into_iter().chain(held.drain(..)) {
                    let _ = h.done.send(Err(UnionFailed));
                }
            }
        }
    }
}

/// Takes mark `h` in: its stream has handed ids up to its highest.
fn arrive(h: Held, held: &mut Vec<Held>, streams: &Streams) {
    if let (Some(id), Some(max)) = (h.stream, h.ids.max()) {
        if let Some(s) = lock(streams).get_mut(&id) {
            s.frontier = s.frontier.max(max);
            s.last = s.last.max(h.since);
        }
    }
    held.push(h);
}

/// The runs of the union of `held` to write now (see the module), given
/// the `streams` that mark: those at least [`MIN_RUN`] long, those holding
/// an id of a mark older than the hold, and those no live stream would
/// lengthen.
fn due_runs(held: &[Held], streams: &[(u64, Seen)], now: Instant, waits: Waits) -> Vec<(i64, i64)> {
    let mut union = IdSet::default();
    // Ids whose run goes whatever it waits for: marks past their hold, and
    // sessions' last marks.
    let mut overdue = IdSet::default();
    let mut waiting: HashMap<u64, IdSet> = HashMap::new();
    for h in held {
        union.extend_with(h.ids.clone());
        if now >= h.since + waits.hold || h.stream.is_none() {
            overdue.extend_with(h.ids.clone());
        }
        if let Some(id) = h.stream {
            waiting.entry(id).or_default().extend_with(h.ids.clone());
        }
    }
    // The streams worth waiting for: those that handed ids lately, or wait
    // for a mark of their own; with the ids they wait for.
    let live: Vec<(i64, Option<&IdSet>)> = streams
        .iter()
        .filter(|(id, s)| waiting.contains_key(id) || now.saturating_duration_since(s.last) < waits.idle)
        .map(|(id, s)| (s.frontier, waiting.get(id)))
        .collect();
    union
        .runs()
        .into_iter()
        .filter(|&(lo, hi)| {
            hi - lo + 1 >= MIN_RUN
                || overdue.any_within(lo, hi)
                || !live.iter().any(|(frontier, own)| {
                    *frontier <= hi
                        && *frontier >= lo.saturating_sub(WINDOW)
                        && !own.is_some_and(|o| o.any_within(lo, hi))
                })
        })
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

    const WAITS: Waits = Waits {
        hold: Duration::from_secs(1),
        idle: Duration::from_millis(500),
    };

    fn held(stream: u64, ids: &[i64], age: Duration, now: Instant) -> Held {
        Held {
            stream: Some(stream),
            ids: ids.iter().copied().collect(),
            marked: None,
            since: now - age,
            done: oneshot::channel().0,
        }
    }

    fn seen(stream: u64, frontier: i64, last: Instant) -> (u64, Seen) {
        (stream, Seen { frontier, last })
    }

    #[test]
    fn short_runs_wait_for_the_streams_that_would_lengthen_them() {
        let now = Instant::now();
        let odd: Vec<i64> = (1..=99).step_by(2).collect();
        let even: Vec<i64> = (2..=40).step_by(2).collect();
        // Stream 0's interleaved ids wait for stream 1, behind them and
        // marking.
        let behind = [seen(0, 99, now), seen(1, 0, now)];
        assert!(due_runs(&[held(0, &odd, Duration::ZERO, now)], &behind, now, WAITS).is_empty());
        // United with stream 1's: the long run goes; the short rest waits
        // for stream 1, still behind it.
        let both = [held(0, &odd, Duration::ZERO, now), held(1, &even, Duration::ZERO, now)];
        let at_40 = [seen(0, 99, now), seen(1, 40, now)];
        assert_eq!(due_runs(&both, &at_40, now, WAITS), vec![(1, 41)]);
        // A stream whose own mark is in a short run is not waited for (it
        // hands nothing more until that mark is written): the slowest
        // stream's marks always go.
        let slow = [held(1, &[10, 12], Duration::ZERO, now)];
        assert_eq!(
            due_runs(&slow, &[seen(0, 99, now), seen(1, 12, now)], now, WAITS),
            vec![(10, 10), (12, 12)]
        );
        // Stream 1 waits for its mark, written with the long run: then it
        // hands more. Once it is idle, or past them, or the hold is over,
        // stream 0's short runs go.
        let alone = [held(0, &odd, Duration::ZERO, now)];
        let idle = [seen(0, 99, now), seen(1, 40, now - WAITS.idle)];
        assert_eq!(due_runs(&alone, &idle, now, WAITS).len(), odd.len());
        let past = [seen(0, 99, now), seen(1, 200, now)];
        assert_eq!(due_runs(&alone, &past, now, WAITS).len(), odd.len());
        let late = [held(0, &odd, WAITS.hold, now)];
        assert_eq!(due_runs(&late, &at_40, now, WAITS).len(), odd.len());
        // A stream waiting for a mark of its own counts however long ago it
        // handed it; one far behind, or that handed nothing yet, does not.
        let waiting = [held(0, &odd, Duration::ZERO, now), held(1, &[5], Duration::ZERO, now)];
        let stale = [seen(0, 99, now), seen(1, 5, now - WAITS.idle)];
        assert_eq!(due_runs(&waiting, &stale, now, WAITS), vec![(1, 1), (3, 3), (5, 5)]);
        let far = [seen(0, 99, now), seen(1, 1 - WINDOW - 1, now)];
        assert_eq!(due_runs(&alone, &far, now, WAITS).len(), odd.len());
        let none_yet = [seen(0, 99, now), seen(1, i64::MIN, now)];
        assert_eq!(due_runs(&alone, &none_yet, now, WAITS).len(), odd.len());
        // A session's last mark (no stream) waits for nobody.
        let last = [Held {
            stream: None,
            ..held(0, &odd, Duration::ZERO, now)
        }];
        assert_eq!(due_runs(&last, &behind, now, WAITS).len(), odd.len());
        // With no stream marking (the senders gone), everything goes.
        assert_eq!(
            due_runs(&[held(0, &[5, 9], Duration::ZERO, now)], &[], now, WAITS),
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
        let forever = Duration::from_secs(600);
        let union = Union::spawn(
            state.clone(),
            Waits {
                hold: forever,
                idle: forever,
            },
        );
        let (a, b) = (union.join(), union.join());
        // Stream b marks first (no stream is behind it: written at once).
        union.mark(Some(&b), [0].into_iter().collect(), None).await.unwrap();
        let t0 = ferry_testkit::T0;
        assert_eq!(ranges(&pool).await, vec![(0, 0, t0)]);
        let odd: IdSet = (1..=2000).step_by(2).collect();
        let even: IdSet = (2..=2000).step_by(2).collect();
        let first = {
            let union = union.clone();
            tokio::spawn(async move { union.mark(Some(&a), odd, Some(("s_0of2", 10))).await })
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while union.holding() < 1 {
            assert!(
                Instant::now() < deadline,
                "the writer never held the first stream's mark"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(ranges(&pool).await, vec![(0, 0, t0)], "held for b, not written");
        t.ferry.clock().advance(Duration::from_secs(2)).unwrap();
        union.mark(Some(&b), even, Some(("s_1of2", 20))).await.unwrap();
        first.await.unwrap().unwrap();
        assert_eq!(ranges(&pool).await, vec![(0, 0, t0), (1, 2000, t0 + 2000)]);
        assert_eq!(state.store.wal_marked("s_0of2").await.unwrap(), 10);
        assert_eq!(state.store.wal_marked("s_1of2").await.unwrap(), 20);
        assert_eq!(state.metrics.published.get(), 2001);
    }

    /// Short runs that the other stream, marking, never lengthens are
    /// written once their hold is over; with no other stream marking, at
    /// once: a mark is held, never lost.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_short_run_is_written_when_its_hold_is_over() {
        let t = ferry_testkit::TestDb::new(ferry::Engine::Postgres).await;
        let state = test_state(&t.ferry);
        let pool = t.ferry.db().as_postgres().unwrap().clone();
        let forever = Duration::from_secs(600);
        let hold = Duration::from_millis(50);
        let union = Union::spawn(state.clone(), Waits { hold, idle: forever });
        let (a, b) = (union.join(), union.join());
        // Stream b behind them, marking.
        union.mark(Some(&b), [0].into_iter().collect(), None).await.unwrap();
        let started = Instant::now();
        union
            .mark(Some(&a), [2, 4, 6].into_iter().collect(), None)
            .await
            .unwrap();
        assert!(started.elapsed() >= hold, "held for b until the hold was over");
        assert_eq!(ranges(&pool).await.len(), 4);
        // Alone, nothing waits for the hold (ten minutes here).
        let alone = Union::spawn(
            state.clone(),
            Waits {
                hold: forever,
                idle: forever,
            },
        );
        let c = alone.join();
        tokio::time::timeout(
            Duration::from_secs(30),
            alone.mark(Some(&c), [9].into_iter().collect(), None),
        )
        .await
        .expect("written at once")
        .unwrap();
        assert_eq!(ranges(&pool).await.len(), 5);
    }
}
