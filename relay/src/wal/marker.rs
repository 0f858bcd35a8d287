//! Delivered state without a per-row update on the publishing path: the
//! marker task takes the acknowledged transactions in commit order,
//! coalesces whatever has queued up into one set-based statement (up to
//! [`MARK_MAX`] ids), and only after it committed lets the slot's confirmed
//! position move to the last transaction it covered. Publishing never
//! waits for it, but for the bounded queue between them: a marker that
//! falls behind slows the stream instead of piling up ids.
//!
//! A database error ends the marker, and with it the session: a session
//! that cannot mark cannot confirm, and PostgreSQL's fast shutdown waits
//! for every replication client to confirm the end of the WAL, so a
//! session that held on while its marks were refused ("the database
//! system is shutting down") would hold the shutdown up for ever. The
//! slot stays before the unmarked rows; the next session publishes them
//! again.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

use crate::state::RelayState;

/// How often, [`VISIBLE_WAIT`] apart, the marker looks again for rows the
/// stream carried but its statement did not see yet.
pub const VISIBLE_TRIES: u32 = 50;
/// See [`VISIBLE_TRIES`].
pub const VISIBLE_WAIT: Duration = Duration::from_millis(10);

/// The most ids one mark statement carries.
pub const MARK_MAX: usize = 10_000;

/// Transactions (or catch-up pages) queued for the marker before the
/// stream waits.
pub const MARK_QUEUE: usize = 4096;

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

/// Starts the marker of one session. `confirmed` receives each position
/// the slot may be confirmed at, after the rows before it are marked. The
/// task ends when the session drops the sender, or at the first database
/// error (the rows stay acknowledged and unmarked; the session sees the
/// marker gone and ends).
pub(super) fn spawn(
    state: std::sync::Arc<RelayState>,
    delete: bool,
    confirmed: watch::Sender<u64>,
) -> (mpsc::Sender<Mark>, JoinHandle<()>) {
    let (tx, mut rx) = mpsc::channel::<Mark>(MARK_QUEUE);
    let task = tokio::spawn(async move {
        while let Some(first) = rx.recv().await {
            let mut ids = first.ids;
            let mut lsn = first.lsn;
            let mut done: Vec<oneshot::Sender<()>> = first.done.into_iter().collect();
            while ids.len() < MARK_MAX {
                let Ok(more) = rx.try_recv() else { break };
                ids.extend(more.ids);
                lsn = more.lsn.or(lsn);
                done.extend(more.done);
            }
            if let Err(e) = mark(&state, ids, delete).await {
                tracing::warn!(error = %e, code = e.code(), "marking delivered failed; ending the session (the slot is not confirmed past these rows, so the next session publishes them again)");
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
        }
    });
    (tx, task)
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
        if tries >= VISIBLE_TRIES {
            if !ids.is_empty() {
                tracing::warn!(
                    rows = ids.len(),
                    "acknowledged rows never became visible to mark; left pending"
                );
            }
            return Ok(());
        }
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

    /// Logical decoding can hand a commit over a moment before the
    /// transaction is visible, and Kafka's acknowledgement can come back
    /// inside that moment: a mark that found no pending row must look again
    /// rather than take the row for marked (it would stay pending forever).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_row_visible_only_after_the_first_mark_is_still_marked() {
        let t = ferry_testkit::TestDb::new(ferry::Engine::Postgres).await;
        let state = Arc::new(RelayState {
            store: RelayStore::new(t.ferry.clone()),
            metrics: Metrics::new(),
            owner: "relay-test".into(),
            ready: AtomicBool::new(false),
            fatal: CancellationToken::new(),
        });
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
}
