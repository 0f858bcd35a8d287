//! Delivered state without a per-row update on the publishing path: the
//! marker task takes the acknowledged transactions in commit order,
//! coalesces whatever has queued up into one set-based statement (up to
//! [`MARK_MAX`] ids), and only after it committed lets the slot's confirmed
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

use crate::state::RelayState;

/// How often, [`VISIBLE_WAIT`] apart, the marker looks again for rows the
/// stream carried but its statement did not see yet.
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
    pub ids: Vec<i64>,
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
        let rows = u32::try_from(mark.ids.len().clamp(1, MARK_ROOM)).expect("MARK_ROOM fits in u32");
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
pub(super) fn spawn(state: Arc<RelayState>, delete: bool, confirmed: watch::Sender<u64>) -> (Marks, JoinHandle<()>) {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Mark, OwnedSemaphorePermit)>();
    let room = Arc::new(Semaphore::new(MARK_ROOM));
    let ended = room.clone();
    let task = tokio::spawn(async move {
        while let Some((first, permit)) = rx.recv().await {
            let mut ids = first.ids;
            let mut lsn = first.lsn;
            let mut done: Vec<oneshot::Sender<()>> = first.done.into_iter().collect();
            let mut room = vec![permit];
            while ids.len() < MARK_MAX {
                let Ok((more, permit)) = rx.try_recv() else { break };
                ids.extend(more.ids);
                lsn = more.lsn.or(lsn);
                done.extend(more.done);
                room.push(permit);
            }
            if let Err(e) = mark(&state, ids, delete).await {
                tracing::warn!(error = %e, code = e.code(), "marking delivered failed; ending the session (the slot is not confirmed past these rows, so the next session publishes them again)");
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

/// Marks `ids` delivered (deleted, with `delete`); a database error is
/// returned at once. Logical decoding can hand a commit over a moment
/// before the transaction is visible to new snapshots, so rows the
/// statement did not find are looked for again, [`VISIBLE_WAIT`] apart,
/// until each is visible and no longer pending, or [`VISIBLE_TRIES`] pass (a
/// row an earlier mark of a republished duplicate deleted never shows up
/// again).
async fn mark(state: &RelayState, mut ids: Vec<i64>, delete: bool) -> ferry::Result<()> {
    let mut tries = 0;
    while !ids.is_empty() {
        let started = Instant::now();
        let marked = state.store.wal_mark_delivered(&ids, delete).await?;
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
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::metrics::Metrics;
    use crate::store::RelayStore;

    /// A relay's state on `ferry`, for the marker alone.
    fn test_state(ferry: &ferry::Ferry) -> Arc<RelayState> {
        Arc::new(RelayState {
            store: RelayStore::new(ferry.clone()),
            metrics: Metrics::new(),
            owner: "relay-test".into(),
            ready: AtomicBool::new(false),
            fatal: CancellationToken::new(),
        })
    }

    /// Logical decoding can hand a commit over a moment before the
    /// transaction is visible, and Kafka's acknowledgement can come back
    /// inside that moment: a mark that found no pending row must look again
    /// rather than take the row for marked (it would stay pending forever).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_row_visible_only_after_the_first_mark_is_still_marked() {
        let t = ferry_testkit::TestDb::new(ferry::Engine::Postgres).await;
        let state = test_state(&t.ferry);
        let pool = t.ferry.db().as_postgres().unwrap().clone();
        let mut late = pool.begin().await.unwrap();
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO outbox (tenant, topic, key, lane, payload, headers, created_at)
             VALUES ('acme', 'orders', 'k', 0, 'x', '{}'::jsonb, 0) RETURNING id",
        )
        .fetch_one(&mut *late)
        .await
        .unwrap();
        let marking = {
            let state = state.clone();
            tokio::spawn(async move { mark(&state, vec![id], false).await })
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
        let row: String = sqlx::query_scalar("SELECT state FROM outbox WHERE id = $1")
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(row, "delivered");
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
        let (marks, task) = spawn(state.clone(), false, confirmed);
        let all = Mark {
            ids: (1..=MARK_ROOM as i64 + 1).collect(),
            lsn: Some(1),
            done: None,
        };
        marks.send(&state, all).await.unwrap();
        let (tx, rx) = oneshot::channel();
        let next = Mark {
            ids: vec![0],
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

    /// A republished duplicate (its row marked by an earlier session) is
    /// found settled after the first statement: no statement runs again,
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
        mark(&state, vec![id], false).await.unwrap();
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
