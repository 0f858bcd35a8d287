//! Delivered state without a per-row update on the publishing path: the
//! marker task takes the acknowledged transactions in commit order,
//! coalesces whatever has queued up (up to [`MARK_MAX`] ids) into one
//! transaction that records them as ranges in the ledger `outbox_delivered`
//! (no outbox row is written; `--delete-on-delivery` deletes the rows
//! instead), and only after it committed lets the slot's confirmed
//! position move to the last transaction it covered. Publishing never
//! waits for it, but for the room between them, counted in rows
//! ([`MARK_ROOM`]), not transactions: a stream of one-row transactions
//! runs on while one large statement commits, and a marker that falls
//! behind for good slows the stream instead of piling up ids.
//!
//! A database error ends the marker, and with it the session: a session
//! that cannot mark cannot confirm, and PostgreSQL's fast shutdown waits
//! for every replication client to confirm the end of the WAL, so a
//! session that held on while its marks were refused ("the database
//! system is shutting down") would hold the shutdown up for ever. The
//! slot stays before the unmarked rows; the next session publishes them
//! again.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot, watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;

use super::ledger::IdSet;
use super::union::{Marking, Union};
use crate::state::RelayState;

/// How often, [`VISIBLE_WAIT`] apart, a statement looks again for rows the
/// stream carried but it did not see yet (`--delete-on-delivery`'s deletes,
/// a replay's rows; covering needs no look).
pub const VISIBLE_TRIES: u32 = 50;
/// See [`VISIBLE_TRIES`].
pub const VISIBLE_WAIT: Duration = Duration::from_millis(10);

/// The most ids one mark statement carries.
pub const MARK_MAX: usize = 10_000;

/// Rows handed to the marker and not yet marked before the stream waits
/// (a transaction or page without rows counts as one; one larger than this
/// waits until the marker has nothing else). About 10 MB at most, with
/// one-row transactions.
pub const MARK_ROOM: usize = 100_000;

/// Acknowledged rows of one transaction, in commit order.
#[derive(Debug)]
pub(super) struct Mark {
    /// Rows to mark delivered (poison rows marked dead are not here).
    pub ids: IdSet,
    /// Where the slot may be confirmed once these are marked.
    pub lsn: Option<u64>,
    /// Told once this and everything before it is marked.
    pub done: Option<oneshot::Sender<()>>,
}

/// The session's side of the marker: hands marks over in commit order,
/// within [`MARK_ROOM`].
#[derive(Clone)]
pub(super) struct Marks {
    tx: mpsc::UnboundedSender<(Mark, OwnedSemaphorePermit)>,
    room: Arc<Semaphore>,
}

/// The marker ended (a database error); nothing more is marked.
#[derive(Debug)]
pub(super) struct MarkerStopped;

impl Marks {
    /// Hands `mark` over once there is room for its rows; the time spent
    /// waiting for room is counted in the benchmarks' timings.
    pub(super) async fn send(&self, state: &RelayState, mark: Mark) -> Result<(), MarkerStopped> {
        let rows = u32::try_from(mark.ids.len().clamp(1, MARK_ROOM as u64)).expect("MARK_ROOM fits in u32");
        let permit = match self.room.clone().try_acquire_many_owned(rows) {
            Ok(p) => p,
            Err(_) => {
                let started = Instant::now();
                let p = self
                    .room
                    .clone()
                    .acquire_many_owned(rows)
                    .await
                    .map_err(|_| MarkerStopped)?;
                let t = &state.metrics.timings;
                crate::metrics::Timings::add(&t.wal_hand_waits, &t.wal_hand_wait_ns, started.elapsed());
                p
            }
        };
        self.tx.send((mark, permit)).map_err(|_| MarkerStopped)
    }

    /// Resolves once the marker has ended.
    pub(super) async fn closed(&self) {
        self.tx.closed().await
    }
}

/// Starts the marker of one session. `confirmed` receives each position
/// the slot may be confirmed at, after the rows before it are marked. The
/// task ends when the session drops every [`Marks`], or at the first
/// database error (the rows stay acknowledged and unmarked; the session
/// sees the marker gone and ends).
///
/// Each mark that carries a streamed transaction's position also records
/// it as the slot's marked position (`RelayStore::wal_marked`), in the
/// ledger's transaction: a later session (after a SIGKILL, or a standby's)
/// skips what is marked instead of producing it again, since the slot's
/// confirmed position follows only at the client's next status update.
///
/// With `union` (`--streams`), the ids are covered by the relay's shared
/// writer of its streams' marks instead of a statement of this marker's
/// own (`union`), so that the streams' interleaved ids are written as runs.
pub(super) fn spawn(
    state: Arc<RelayState>,
    slot: String,
    delete: bool,
    union: Option<Union>,
    confirmed: watch::Sender<u64>,
) -> (Marks, JoinHandle<()>) {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Mark, OwnedSemaphorePermit)>();
    let room = Arc::new(Semaphore::new(MARK_ROOM));
    let ended = room.clone();
    let task = tokio::spawn(async move {
        let mut marking = union.as_ref().map(Union::join);
        while let Some((first, permit)) = rx.recv().await {
            let mut ids = first.ids;
            let mut lsn = first.lsn;
            let mut done: Vec<oneshot::Sender<()>> = first.done.into_iter().collect();
            let mut room = vec![permit];
            while ids.len() < MARK_MAX as u64 {
                let Ok((more, permit)) = rx.try_recv() else { break };
                ids.extend_with(more.ids);
                lsn = more.lsn.or(lsn);
                done.extend(more.done);
                room.push(permit);
            }
            let marked = lsn.filter(|_| !ids.is_empty()).map(|l| (slot.as_str(), l));
            if rx.is_closed() && rx.is_empty() {
                // The session's last mark: no more ids of this stream will
                // lengthen the others' runs, and nothing waits for it.
                drop(marking.take());
            }
            if let Err(e) = mark(
                &state,
                union.as_ref().map(|u| (u, marking.as_ref())),
                ids,
                marked,
                delete,
            )
            .await
            {
                match e {
                    MarkError::Db(e) => {
                        tracing::warn!(error = %e, code = e.code(), "marking delivered failed; ending the session (the slot is not confirmed past these rows, so the next session publishes them again)")
                    }
                    MarkError::Union => {
                        tracing::warn!("the streams' shared marking failed (its error is logged apart); ending the session (the slot is not confirmed past these rows, so the next session publishes them again)")
                    }
                }
                // Before the batch's room comes back: a stream waiting for
                // it is told the marker stopped, not handed a mark that
                // nothing will take.
                ended.close();
                return;
            }
            if let Some(l) = lsn {
                confirmed.send_if_modified(|c| {
                    let moved = l > *c;
                    *c = (*c).max(l);
                    moved
                });
            }
            for d in done {
                let _ = d.send(());
            }
            drop(room);
        }
    });
    (Marks { tx, room }, task)
}

/// Why a mark failed.
#[derive(Debug)]
enum MarkError {
    /// This marker's statement failed.
    Db(ferry::Error),
    /// The streams' shared write failed (its writer logged why).
    Union,
}

impl From<ferry::Error> for MarkError {
    fn from(e: ferry::Error) -> Self {
        MarkError::Db(e)
    }
}

/// Marks `ids` delivered: covers them in the ledger (one transaction, no
/// outbox row written; through `union` with `--streams`, as the stream's
/// marker, or as one that marks no more), or deletes them
/// with `delete`; then the slot's stream is marked through `marked`'s
/// position (in the ledger's transaction; after the deletes). A database
/// error is returned at once.
async fn mark(
    state: &RelayState,
    union: Option<(&Union, Option<&Marking>)>,
    ids: IdSet,
    marked: Option<(&str, u64)>,
    delete: bool,
) -> Result<(), MarkError> {
    if delete {
        delete_delivered(state, ids.iter().collect()).await?;
        if let Some((slot, lsn)) = marked {
            state.store.wal_set_marked(slot, lsn).await?;
        }
        return Ok(());
    }
    if let Some((union, stream)) = union {
        return union.mark(stream, ids, marked).await.map_err(|_| MarkError::Union);
    }
    let started = Instant::now();
    let covered = state.store.wal_cover_runs(&ids.runs(), marked.as_slice()).await?;
    let t = &state.metrics.timings;
    crate::metrics::Timings::add(&t.marks, &t.mark_ns, started.elapsed());
    state.metrics.published.inc_by(covered);
    Ok(())
}

/// `--delete-on-delivery`: deletes `ids`. Logical decoding can hand a
/// commit over a moment before the transaction is visible to new
/// snapshots, so rows the statement did not find are looked for again,
/// [`VISIBLE_WAIT`] apart, until each is visible and no longer pending, or
/// [`VISIBLE_TRIES`] pass (a row an earlier mark of a republished duplicate
/// deleted never shows up again).
async fn delete_delivered(state: &RelayState, mut ids: Vec<i64>) -> ferry::Result<()> {
    let mut tries = 0;
    while !ids.is_empty() {
        let started = Instant::now();
        let marked = state.store.wal_delete_delivered(&ids).await?;
        let t = &state.metrics.timings;
        crate::metrics::Timings::add(&t.marks, &t.mark_ns, started.elapsed());
        state.metrics.published.inc_by(marked.len() as u64);
        if marked.len() == ids.len() {
            return Ok(());
        }
        let marked: HashSet<i64> = marked.into_iter().collect();
        ids.retain(|id| !marked.contains(id));
        // Which of the rest are still to be marked: visible and pending, or
        // not visible at all.
        let settled: HashSet<i64> = state
            .store
            .wal_states(&ids)
            .await?
            .into_iter()
            .filter(|(_, s)| s != "pending")
            .map(|(id, _)| id)
            .collect();
        ids.retain(|id| !settled.contains(id));
        tries += 1;
        if ids.is_empty() {
            return Ok(());
        }
        if tries >= VISIBLE_TRIES {
            tracing::warn!(
                rows = ids.len(),
                "acknowledged rows never became visible to mark; left pending"
            );
            return Ok(());
        }
        t.mark_retries.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tokio::time::sleep(VISIBLE_WAIT).await;
    }
    Ok(())
}

#[cfg(test)]
pub(super) mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::metrics::Metrics;
    use crate::store::RelayStore;

    /// A relay's state on `ferry`, for the marker alone.
    pub(in crate::wal) fn test_state(ferry: &ferry::Ferry) -> Arc<RelayState> {
        Arc::new(RelayState {
            store: RelayStore::new(ferry.clone()),
            metrics: Metrics::new(),
            owner: "relay-test".into(),
            ready: AtomicBool::new(false),
            fatal: CancellationToken::new(),
            stream_producers: Default::default(),
        })
    }

    /// Inserts one pending outbox row in `c` (committed or not by the
    /// caller) and returns its id.
    async fn insert_row(c: &mut sqlx::PgConnection) -> i64 {
        sqlx::query_scalar(
            "INSERT INTO outbox (tenant, topic, key, lane, payload, headers, created_at)
             VALUES ('acme', 'orders', 'k', 0, 'x', '{}'::jsonb, 0) RETURNING id",
        )
        .fetch_one(c)
        .await
        .unwrap()
    }

    /// The ledger's ranges, in order.
    pub(in crate::wal) async fn ranges(pool: &sqlx::PgPool) -> Vec<(i64, i64, i64)> {
        sqlx::query_as("SELECT lo, hi, delivered_at FROM outbox_delivered ORDER BY lo")
            .fetch_all(pool)
            .await
            .unwrap()
    }

    /// `--delete-on-delivery`: logical decoding can hand a commit over a
    /// moment before the transaction is visible, and Kafka's
    /// acknowledgement can come back inside that moment: a delete that
    /// found no pending row must look again rather than take the row for
    /// deleted (it would stay pending forever).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_row_visible_only_after_the_first_delete_is_still_deleted() {
        let t = ferry_testkit::TestDb::new(ferry::Engine::Postgres).await;
        let state = test_state(&t.ferry);
        let pool = t.ferry.db().as_postgres().unwrap().clone();
        let mut late = pool.begin().await.unwrap();
        let id = insert_row(&mut late).await;
        let marking = {
            let state = state.clone();
            tokio::spawn(async move { mark(&state, None, [id].into_iter().collect(), None, true).await })
        };
        // The first statement ran without seeing the row...
        let deadline = Instant::now() + Duration::from_secs(10);
        while state.metrics.timings.marks.load(Ordering::Relaxed) == 0 {
            assert!(Instant::now() < deadline, "the marker never ran");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // ...then its transaction becomes visible.
        late.commit().await.unwrap();
        marking.await.unwrap().unwrap();
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE id = $1")
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(left, 0);
    }

    /// Covering needs no second look: a row whose transaction is not
    /// visible yet is covered by the one transaction, and reads delivered
    /// once visible, its own row never written.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_row_not_visible_yet_is_covered_at_once() {
        let t = ferry_testkit::TestDb::new(ferry::Engine::Postgres).await;
        let state = test_state(&t.ferry);
        let pool = t.ferry.db().as_postgres().unwrap().clone();
        let mut late = pool.begin().await.unwrap();
        let id = insert_row(&mut late).await;
        mark(&state, None, [id].into_iter().collect(), None, false)
            .await
            .unwrap();
        let timings = &state.metrics.timings;
        assert_eq!(timings.marks.load(Ordering::Relaxed), 1);
        assert_eq!(timings.mark_retries.load(Ordering::Relaxed), 0);
        late.commit().await.unwrap();
        assert_eq!(
            ferry_testkit::outbox_states(&pool).await,
            vec![(id, "delivered".to_string())]
        );
        let raw: String = sqlx::query_scalar("SELECT state FROM outbox WHERE id = $1")
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(raw, "pending", "the outbox row is not rewritten");
    }

    /// The ledger through real marks, on an injected clock: consecutive
    /// ids are one range, an id not acknowledged splits them, a republished
    /// set adds nothing, and a run touching a range merges with it only in
    /// the same second.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn marks_write_ranges_that_never_cover_an_unacknowledged_id() {
        let t = ferry_testkit::TestDb::with_clock(ferry::Engine::Postgres, ferry_testkit::manual_clock()).await;
        let state = test_state(&t.ferry);
        let pool = t.ferry.db().as_postgres().unwrap().clone();
        let store = &state.store;
        let t0 = ferry_testkit::T0;
        assert_eq!(store.wal_cover_delivered(&[3, 1, 2, 5, 6], None).await.unwrap(), 5);
        assert_eq!(ranges(&pool).await, vec![(1, 3, t0), (5, 6, t0)]);
        // Republished: nothing new, nothing written.
        assert_eq!(store.wal_cover_delivered(&[1, 2, 5], None).await.unwrap(), 0);
        assert_eq!(ranges(&pool).await, vec![(1, 3, t0), (5, 6, t0)]);
        // 999 ms later, the same second: 4 fills the hole and 7 extends.
        t.ferry.clock().advance(Duration::from_millis(999)).unwrap();
        assert_eq!(store.wal_cover_delivered(&[4, 7, 2], None).await.unwrap(), 2);
        assert_eq!(ranges(&pool).await, vec![(1, 7, t0 + 999)]);
        // The next second: a range of its own beside it.
        t.ferry.clock().advance(Duration::from_millis(1)).unwrap();
        assert_eq!(store.wal_cover_delivered(&[8, 9, 11], None).await.unwrap(), 3);
        assert_eq!(
            ranges(&pool).await,
            vec![(1, 7, t0 + 999), (8, 9, t0 + 1000), (11, 11, t0 + 1000)]
        );
    }

    /// A row the ledger covers was delivered: Kafka refusing it alone when
    /// a restart republishes it (the slot was not confirmed past it) must
    /// not make it dead, as a row marked delivered never became dead. Dead
    /// and covered, it read dead to the operator, and a replay put it back
    /// to pending, where it read delivered again and was never published.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_covered_row_refused_on_a_republish_stays_delivered() {
        let t = ferry_testkit::TestDb::new(ferry::Engine::Postgres).await;
        let state = test_state(&t.ferry);
        let pool = t.ferry.db().as_postgres().unwrap().clone();
        let id = insert_row(&mut pool.acquire().await.unwrap()).await;
        assert_eq!(state.store.wal_cover_delivered(&[id], None).await.unwrap(), 1);
        state
            .store
            .wal_note_publish_error(id, "message_too_large")
            .await
            .unwrap();
        state.store.wal_mark_dead(id, "message_too_large").await.unwrap();
        ferry_testkit::assert_delivered_unwritten(&pool, id).await;
    }

    /// Markers of several sessions at once (a republished set racing its
    /// first mark) serialize on the ledger's lock: no error, no range
    /// overlapping another, every id covered once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_marks_never_overlap() {
        let t = ferry_testkit::TestDb::new(ferry::Engine::Postgres).await;
        let state = test_state(&t.ferry);
        let pool = t.ferry.db().as_postgres().unwrap().clone();
        let marks: Vec<_> = (0..8)
            .map(|k| {
                let state = state.clone();
                let ids: Vec<i64> = (1..=400).filter(|i| i % 4 != k % 4 || k >= 4).collect();
                tokio::spawn(async move { state.store.wal_cover_delivered(&ids, None).await })
            })
            .collect();
        let mut covered = 0;
        for m in marks {
            covered += m.await.unwrap().unwrap();
        }
        assert_eq!(covered, 400, "each id counted once");
        let ranges = ranges(&pool).await;
        for w in ranges.windows(2) {
            assert!(w[0].1 < w[1].0, "{:?} overlaps {:?}", w[0], w[1]);
        }
        let total: i64 = ranges.iter().map(|r| r.1 - r.0 + 1).sum();
        assert_eq!((ranges[0].0, ranges[ranges.len() - 1].1, total), (1, 400, 400));
    }

    /// The marker ends at a database error while the stream waits for room
    /// (a mark as large as the room ahead of it): the stream is told the
    /// marker stopped instead of waiting for room for ever, and a session
    /// waiting on `done` sees it dropped.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stream_waiting_for_room_sees_the_marker_stop() {
        let t = ferry_testkit::TestDb::new(ferry::Engine::Postgres).await;
        let state = test_state(&t.ferry);
        t.ferry.db().as_postgres().unwrap().close().await;
        let (confirmed, _) = watch::channel(0);
        let (marks, task) = spawn(state.clone(), "ferry_test".into(), false, None, confirmed);
        let all = Mark {
            ids: (1..=MARK_ROOM as i64 + 1).collect(),
            lsn: Some(1),
            done: None,
        };
        marks.send(&state, all).await.unwrap();
        let (tx, rx) = oneshot::channel();
        let next = Mark {
            ids: [0].into_iter().collect(),
            lsn: Some(2),
            done: Some(tx),
        };
        let sent = tokio::time::timeout(Duration::from_secs(30), marks.send(&state, next)).await;
        assert!(matches!(sent, Ok(Err(MarkerStopped))), "{sent:?}");
        assert!(rx.await.is_err(), "done was dropped");
        tokio::time::timeout(Duration::from_secs(30), marks.closed())
            .await
            .unwrap();
        task.await.unwrap();
    }

    /// `--delete-on-delivery`: a republished duplicate (its row settled
    /// before) is found settled after the first statement: no statement runs again,
    /// so none is counted as one for rows not yet visible, and the marker
    /// does not wait [`VISIBLE_WAIT`] for nothing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_row_marked_before_is_not_counted_as_a_retry() {
        let t = ferry_testkit::TestDb::new(ferry::Engine::Postgres).await;
        let state = test_state(&t.ferry);
        let pool = t.ferry.db().as_postgres().unwrap().clone();
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO outbox (tenant, topic, key, lane, payload, headers, created_at, state)
             VALUES ('acme', 'orders', 'k', 0, 'x', '{}'::jsonb, 0, 'delivered') RETURNING id",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        let started = Instant::now();
        mark(&state, None, [id].into_iter().collect(), None, true)
            .await
            .unwrap();
        let t = &state.metrics.timings;
        assert_eq!(t.marks.load(Ordering::Relaxed), 1, "one statement ran");
        assert_eq!(
            t.mark_retries.load(Ordering::Relaxed),
            0,
            "no statement ran again, after {:?}",
            started.elapsed()
        );
    }
}
