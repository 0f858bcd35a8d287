//! Exactly once in WAL capture (`--exactly-once --capture wal`), after
//! Kafka Connect's exactly-once sources (KIP-618):
//!
//! - **One producer per slot**, `transactional.id = <prefix>-wal-<slot>`,
//!   made by each session once the slot streams to it (the slot has one
//!   reader at a time): its `init_transactions` fences every earlier
//!   session's producer and settles its last transaction.
//! - **Whole PostgreSQL transactions** go into a Kafka transaction together
//!   with a progress record ([`WalProgress`]): the end of the last one's
//!   commit record. Several are batched into one Kafka transaction (it
//!   commits when the stream pauses between transactions, after
//!   [`COMMIT_EVERY`], or past [`COMMIT_ROWS`] records or [`COMMIT_BYTES`]);
//!   one is never split, however large (its bound is the producer's
//!   `transaction.timeout.ms`).
//! - **Commit, then mark.** Only after the commit are the transactions'
//!   rows handed to the marker, which marks them and then lets the slot's
//!   confirmed position move past them, as at least once does.
//! - **Session start.** After `init_transactions` the slot's last committed
//!   progress record is read `read_committed` (waiting out other producers'
//!   open transactions below the high watermark, as a lane's takeover does);
//!   every streamed transaction it covers is in Kafka already, so it is not
//!   produced again: its rows are marked and the slot moves past it. A new
//!   slot's table read commits one page per transaction with the page's
//!   exact ids, marked before the next page, and a session that finds the
//!   read unfinished marks the last page's ids first. A row committed just
//!   after the slot was made is both read and streamed: a streamed row at
//!   or below the highest id the read published is produced only while it
//!   is pending.
//! - **Any failure** aborts the Kafka transaction and ends the session: the
//!   next one resumes from the slot's confirmed position and the progress
//!   record. A row refused alone is marked dead (`--on-poison=dead`) and
//!   its transaction aborted; the next session streams it again without
//!   the dead row, so its other rows are re-sent in order and nothing
//!   overtakes them.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use tokio::sync::oneshot;

use super::super::connect::Ended;
use super::super::ledger::IdSet;
use super::super::marker::{self, Mark};
use super::super::Ctx;
use super::Pipeline;
use crate::exactly_once::{self, ProgressReader, WalProgress, TXN_TIMEOUT, WAL_PARTITION};
use crate::publish::{self, Outcome};
use crate::store::PendingRow;

/// A Kafka transaction commits once it carries this many records...
pub const COMMIT_ROWS: usize = 5_000;
/// ...or this many payload and key bytes...
pub const COMMIT_BYTES: usize = 8 << 20;
/// ...or has been open this long (at the next commit of a PostgreSQL
/// transaction, or at once while none is open).
pub const COMMIT_EVERY: Duration = Duration::from_millis(100);

/// One session's Kafka transactions.
pub(in crate::wal) struct Transactional {
    /// The progress topic.
    topic: String,
    /// The slot's progress record key ([`WalProgress::key`]).
    key: String,
    /// The last committed progress record: the stream skips what it covers.
    committed: WalProgress,
    /// Since when a Kafka transaction is open.
    open_since: Option<Instant>,
    /// How long a Kafka transaction may stay open: 90 % of
    /// `transaction.timeout.ms`, past which the broker would abort it.
    open_limit: Duration,
    /// Records and bytes in the open Kafka transaction.
    rows: usize,
    bytes: usize,
    /// The settled PostgreSQL transactions (or table pages) of the open
    /// Kafka transaction, in commit order, for the marker once it commits.
    staged: Vec<Mark>,
    /// Rows marked dead by this relay, left out when streamed again.
    pub(in crate::wal) dead: HashSet<i64>,
    /// A new slot's table read forgot the progress record's position (see
    /// [`Pipeline::forget_old_slot_position`]), and no record says so yet.
    forgotten: bool,
    /// The streamed rows of this session's committed Kafka transactions
    /// whose marks are not known to be committed, oldest first: told when
    /// they are; until then every progress record carries their runs.
    unconfirmed: VecDeque<Unconfirmed>,
}

/// A committed Kafka transaction's streamed rows (runs of ids), and the
/// marker's word once they are marked.
type Unconfirmed = (oneshot::Receiver<()>, Vec<(i64, i64)>);

/// Session start, once the slot streams to this session: the slot's
/// transactional producer (which fences every earlier one) and its last
/// committed progress. The read may wait for another producer's open
/// transaction on the progress partition; it stops at shutdown.
pub(in crate::wal) async fn take_over(
    ctx: &Ctx,
    reader: &Arc<ProgressReader>,
    dead: HashSet<i64>,
    finish: &tokio_util::sync::CancellationToken,
) -> Result<(FutureProducer, Transactional), Ended> {
    let started = Instant::now();
    let slot = ctx.capture.slot.clone();
    let (done, taken) = tokio::sync::oneshot::channel();
    let (cfg, r, db, s) = (ctx.cfg.clone(), reader.clone(), ctx.database_id.clone(), slot.clone());
    tokio::task::spawn_blocking(move || {
        let result = match exactly_once::transactional_producer(&cfg, &cfg.wal_transactional_id(&s)) {
            Ok(p) => r
                .read_wal(&db, &s, || done.is_closed())
                .map(|progress| (p, progress))
                .map_err(|e| ("progress_read", e.to_string())),
            Err(e) => Err(("init_transactions", e.to_string())),
        };
        let _ = done.send(result);
    });
    let (producer, progress) = tokio::select! {
        r = taken => match r {
            Ok(Ok(v)) => v,
            Ok(Err((code, error))) => {
                tracing::warn!(%slot, code, error, "taking the slot's transactional producer over failed");
                return Err(Ended::Retry(code));
            }
            Err(_) => return Err(Ended::Retry("init_transactions")),
        },
        _ = finish.cancelled() => return Err(Ended::Shutdown),
    };
    let committed = progress.unwrap_or_else(|| WalProgress {
        database: ctx.database_id.to_string(),
        slot: slot.clone(),
        end_lsn: 0,
        catch_up: Vec::new(),
        catch_up_through: 0,
        unmarked: Some(Vec::new()),
    });
    tracing::info!(
        %slot,
        transactional_id = %ctx.cfg.wal_transactional_id(&slot),
        end_lsn = committed.end_lsn,
        took_ms = started.elapsed().as_millis() as u64,
        "the slot's producer fenced its predecessors; streamed transactions up to the progress record are skipped"
    );
    Ok((
        producer,
        Transactional {
            topic: ctx.cfg.progress_topic(),
            key: WalProgress::key(&ctx.database_id, &slot),
            committed,
            open_since: None,
            open_limit: exactly_once::transaction_timeout(&ctx.cfg) * 9 / 10,
            rows: 0,
            bytes: 0,
            staged: Vec::new(),
            dead,
            forgotten: false,
            unconfirmed: VecDeque::new(),
        },
    ))
}

impl Transactional {
    /// Whether the rows of a streamed transaction the progress record
    /// covers must be marked as it streams again: only when the record
    /// does not list what may be unmarked ([`WalProgress::unmarked`] is
    /// `None`); otherwise they were marked, or [`Pipeline::mark_committed`]
    /// marked them, and marking them again could cover a row that died in
    /// it and was replayed since.
    pub(super) fn marks_covered(&self) -> bool {
        self.committed.unmarked.is_none()
    }

    /// Whether a streamed transaction committing at `final_lsn` is in Kafka
    /// already (see [`Pipeline::begin`]).
    pub(super) fn covers(&self, final_lsn: u64) -> bool {
        final_lsn < self.committed.end_lsn
    }

    /// Stages a settled transaction for the marker, unless it may go at
    /// once: nothing is staged before it, and it is in Kafka already
    /// (`skipped`) or has nothing in the open Kafka transaction (none is
    /// open: its rows were all left out as dead).
    pub(super) fn stage(&mut self, mark: Mark, skipped: bool) -> Option<Mark> {
        if (skipped || self.open_since.is_none()) && self.staged.is_empty() {
            return Some(mark);
        }
        self.staged.push(mark);
        None
    }

    /// Whether a Kafka transaction is open.
    pub(super) fn is_open(&self) -> bool {
        self.open_since.is_some()
    }
}

impl Pipeline<'_> {
    /// Exactly once, before `row` is produced (a skipped transaction's rows
    /// never reach this): whether it is. A row this relay
    /// marked dead is left out of its insert's transaction, but not out of
    /// an operator's replay of it (`replayed`: it is pending again, and the
    /// replay is where it belongs now); a streamed row the table read may have
    /// published (its id at or below the read's highest) is produced only
    /// while it is pending (a row that commits just after the slot is made
    /// is both streamed and read). Otherwise the Kafka transaction opens
    /// (unless open) and counts the row. False after a failure too.
    pub(super) async fn exactly_once_produces(&mut self, row: &PendingRow, replayed: bool) -> bool {
        let Some(eo) = self.eo.as_ref() else { return true };
        if !replayed && eo.dead.contains(&row.id) {
            return false;
        }
        let streamed = self.txns.back().is_some_and(|t| t.final_lsn.is_some());
        if streamed && row.id <= eo.committed.catch_up_through && !self.still_pending(row.id).await {
            return false;
        }
        if self.too_large(false) {
            return false;
        }
        let Some(eo) = self.eo.as_mut() else { return true };
        if eo.open_since.is_none() {
            if let Err(e) = self.producer.begin_transaction() {
                tracing::warn!(error = %e, "begin_transaction failed; ending the session");
                self.fail(Ended::Retry("begin_transaction"));
                return false;
            }
            eo.open_since = Some(Instant::now());
        }
        eo.rows += 1;
        eo.bytes += row.payload.len() + row.key.len();
        true
    }

    /// Whether the open Kafka transaction has been open past its limit: 90 %
    /// of `transaction.timeout.ms` while rows are still produced, all of it
    /// at the `commit` (the broker has aborted it then). One PostgreSQL
    /// transaction is never split, so it cannot be published within the
    /// broker's bound. Says so, counts it and fails the session, rather
    /// than have the broker abort it at the commit, session after session,
    /// with nothing said.
    fn too_large(&mut self, commit: bool) -> bool {
        let Some(eo) = self.eo.as_ref() else { return false };
        let limit = if commit {
            exactly_once::transaction_timeout(self.cfg)
        } else {
            eo.open_limit
        };
        let Some(since) = eo.open_since.filter(|s| s.elapsed() > limit) else {
            return false;
        };
        tracing::error!(
            rows = eo.rows,
            open_for = ?since.elapsed(),
            transaction_timeout = ?exactly_once::transaction_timeout(self.cfg),
            "a PostgreSQL transaction is too large to publish within the Kafka transaction's timeout: raise transaction.timeout.ms (--kafka transaction.timeout.ms=<ms>, up to the brokers' transaction.max.timeout.ms) or split the transaction; retrying after a backoff"
        );
        self.state.metrics.wal_transactions_too_large.inc();
        self.fail(Ended::Retry("transaction_too_large"));
        true
    }

    /// Whether row `id` is pending, waiting (a bounded while) for a commit
    /// the stream carried before it is visible; a row never seen is gone
    /// (delivered and deleted). A database error ends the session.
    async fn still_pending(&mut self, id: i64) -> bool {
        for _ in 0..marker::VISIBLE_TRIES {
            match self.state.store.wal_states(&[id]).await {
                Ok(states) => match states.first() {
                    Some((_, state)) => return state == "pending",
                    None => tokio::time::sleep(marker::VISIBLE_WAIT).await,
                },
                Err(e) => {
                    tracing::warn!(id, error = %e, "reading a row's state failed");
                    self.fail(Ended::Retry("database"));
                    return false;
                }
            }
        }
        false
    }

    /// Exactly once, as a session starts: marks what the last progress
    /// record says is in Kafka and may be unmarked, before anything is
    /// read: the ids of a table read's last committed page (each page is
    /// marked before the next is published, so only that one may be
    /// unmarked) and the streamed rows whose marks were not known to be
    /// committed. Of the streamed rows, only those still pending here are
    /// marked: after a failover, a row the old primary streamed may never
    /// have reached this database, and its id is not this database's to
    /// cover. False when the marker stopped or a read failed.
    pub(in crate::wal) async fn mark_committed(&mut self) -> bool {
        let Some(eo) = self.eo.as_mut() else { return true };
        let page = std::mem::take(&mut eo.committed.catch_up);
        let unmarked = eo.committed.unmarked.clone().unwrap_or_default();
        if !page.is_empty() {
            tracing::info!(rows = page.len(), "marking the table read's last committed page");
            self.hand(Mark {
                ids: page.into_iter().collect(),
                lsn: None,
                done: None,
            })
            .await;
        }
        let mut marked = 0;
        for (lo, hi) in unmarked {
            let mut from = lo;
            loop {
                let to = hi.min(from.saturating_add(marker::MARK_MAX as i64 - 1));
                let ids: Vec<i64> = (from..=to).collect();
                let pending: Vec<i64> = match self.state.store.wal_states(&ids).await {
                    Ok(states) => states
                        .into_iter()
                        .filter(|(_, s)| s == "pending")
                        .map(|(id, _)| id)
                        .collect(),
                    Err(e) => {
                        tracing::warn!(error = %e, "reading the state of rows in Kafka failed");
                        self.fail(Ended::Retry("database"));
                        return false;
                    }
                };
                marked += pending.len();
                if !pending.is_empty() {
                    self.hand(Mark {
                        ids: pending.into_iter().collect(),
                        lsn: None,
                        done: None,
                    })
                    .await;
                }
                if to >= hi {
                    break;
                }
                from = to + 1;
            }
        }
        if marked > 0 {
            tracing::info!(
                rows = marked,
                "marking streamed rows a committed Kafka transaction holds"
            );
        }
        self.flush_marks().await
    }

    /// Exactly once, as a new slot's table read begins: the progress
    /// record's position is the old slot's, and the new slot streams only
    /// what commits after it was made, so the position says nothing about
    /// its stream; after a failover or a restore (a new primary's WAL may
    /// sit below it) it would have the stream's transactions taken for ones
    /// in Kafka already and marked unpublished. It is forgotten (the
    /// rows from before the slot are the read's, by their state), and
    /// [`Self::record_forgotten_position`] commits that before the read is
    /// recorded as done: no stream of this slot commits in Kafka before then.
    pub(in crate::wal) fn forget_old_slot_position(&mut self) {
        if let Some(eo) = self.eo.as_mut().filter(|eo| eo.committed.end_lsn != 0) {
            tracing::info!(
                end_lsn = eo.committed.end_lsn,
                "a new slot: the progress record's position is the old slot's and is forgotten"
            );
            eo.committed.end_lsn = 0;
            eo.forgotten = true;
        }
    }

    /// Exactly once, at the end of a new slot's table read: commits a
    /// progress record without the old slot's position, unless a page's
    /// did; false when that failed (the session ends).
    pub(in crate::wal) async fn record_forgotten_position(&mut self) -> bool {
        let Some(eo) = self.eo.as_mut().filter(|eo| eo.forgotten) else {
            return true;
        };
        if eo.open_since.is_none() {
            if let Err(e) = self.producer.begin_transaction() {
                tracing::warn!(error = %e, "begin_transaction failed; ending the session");
                self.fail(Ended::Retry("begin_transaction"));
                return false;
            }
            eo.open_since = Some(Instant::now());
        }
        self.commit_kafka().await;
        self.failed.is_none()
    }

    /// When the open Kafka transaction is due to commit, if it may commit
    /// now (no PostgreSQL transaction is half in it).
    pub(in crate::wal) fn commit_due(&self) -> Option<tokio::time::Instant> {
        let eo = self.eo.as_ref()?;
        let since = eo.open_since?;
        self.txns
            .back()
            .is_none_or(|t| t.committed)
            .then(|| tokio::time::Instant::from_std(since + COMMIT_EVERY))
    }

    /// Whether the open Kafka transaction should commit now: it may, and
    /// it is full, old enough, or a poison row is being isolated (each
    /// PostgreSQL transaction alone, so a blocked one holds no other back).
    pub(in crate::wal) fn wants_commit(&self) -> bool {
        let (Some(eo), Some(due)) = (self.eo.as_ref(), self.commit_due()) else {
            return false;
        };
        self.one_at_a_time || eo.rows >= COMMIT_ROWS || eo.bytes >= COMMIT_BYTES || tokio::time::Instant::now() >= due
    }

    /// Commits the open Kafka transaction with its progress record, once
    /// every record of it is acknowledged, then hands its transactions to
    /// the marker. A failure ends the session (the transaction is aborted
    /// as the session winds down); nothing of it is marked.
    pub(in crate::wal) async fn commit_kafka(&mut self) {
        if self.commit_due().is_none() {
            return;
        }
        self.settle_all().await;
        if self.failed.is_some() || self.too_large(true) {
            return;
        }
        let Some(eo) = self.eo.as_ref() else { return };
        let progress = WalProgress {
            database: eo.committed.database.clone(),
            slot: eo.committed.slot.clone(),
            end_lsn: eo
                .staged
                .iter()
                .filter_map(|m| m.lsn)
                .fold(eo.committed.end_lsn, u64::max),
            catch_up: eo
                .staged
                .iter()
                .filter(|m| m.lsn.is_none())
                .flat_map(|m| m.ids.iter())
                .collect(),
            catch_up_through: 0,
            unmarked: None,
        };
        let progress = WalProgress {
            catch_up_through: progress
                .catch_up
                .iter()
                .copied()
                .fold(eo.committed.catch_up_through, i64::max),
            ..progress
        };
        // The streamed rows this commit puts in Kafka, and those of earlier
        // commits whose marks are not known to be committed yet.
        let mut streamed = IdSet::default();
        for m in eo.staged.iter().filter(|m| m.lsn.is_some()) {
            streamed.extend_with(m.ids.clone());
        }
        let streamed = streamed.runs();
        let eo = self.eo.as_mut().expect("exactly once");
        while eo
            .unconfirmed
            .front_mut()
            .is_some_and(|(done, _)| done.try_recv().is_ok())
        {
            eo.unconfirmed.pop_front();
        }
        let mut unmarked: Vec<(i64, i64)> = eo.unconfirmed.iter().flat_map(|(_, r)| r.iter().copied()).collect();
        unmarked.extend(streamed.iter().copied());
        let unmarked = (unmarked.len() <= exactly_once::MAX_UNMARKED_RUNS).then_some(unmarked);
        let progress = WalProgress { unmarked, ..progress };
        let eo = self.eo.as_ref().expect("exactly once");
        let value = serde_json::to_vec(&progress).expect("progress serializes");
        let record = FutureRecord::to(&eo.topic)
            .partition(WAL_PARTITION)
            .key(eo.key.as_bytes())
            .payload(&value[..]);
        let outcome = match self.producer.send_result(record) {
            Ok(delivery) => publish::delivered(delivery.await),
            Err((e, _)) => publish::classify(&e),
        };
        match outcome {
            Outcome::Acked { .. } => {}
            // A refused progress record says nothing about the rows.
            Outcome::Poison(_) => return self.fail(Ended::Retry("progress_record_refused")),
            Outcome::Transient(code) => return self.fail(Ended::Retry(code)),
            Outcome::Fatal => return self.fail(Ended::Fatal),
        }
        let p = self.producer.clone();
        match tokio::task::spawn_blocking(move || p.commit_transaction(TXN_TIMEOUT)).await {
            Ok(Ok(())) => {}
            // Committed or not, the next session's progress read says which.
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "commit_transaction failed; ending the session");
                return self.fail(Ended::Retry("commit_transaction"));
            }
            Err(_) => return self.fail(Ended::Retry("commit_transaction")),
        }
        exactly_once::failpoint_after_commit();
        let Some(eo) = self.eo.as_mut() else { return };
        eo.committed = progress;
        eo.forgotten = false;
        eo.open_since = None;
        eo.rows = 0;
        eo.bytes = 0;
        let mut staged = std::mem::take(&mut eo.staged);
        if !streamed.is_empty() {
            let (tx, rx) = oneshot::channel();
            if let Some(last) = staged.last_mut() {
                last.done = Some(tx);
            }
            eo.unconfirmed.push_back((rx, streamed));
        }
        for mark in staged {
            self.hand(mark).await;
        }
    }

    /// As the session ends: commits the open Kafka transaction when the
    /// session ends cleanly (shutdown, nothing failed, no PostgreSQL
    /// transaction half in it), else aborts it, so nothing of it becomes
    /// visible; the rows stay pending and the slot before them. The rows
    /// this session marked dead are returned.
    pub(in crate::wal) async fn close_kafka(&mut self, clean: bool) -> HashSet<i64> {
        if clean {
            self.commit_kafka().await;
        }
        let Some(eo) = self.eo.as_mut() else {
            return HashSet::new();
        };
        if eo.open_since.take().is_some() {
            let p = self.producer.clone();
            match tokio::task::spawn_blocking(move || p.abort_transaction(TXN_TIMEOUT)).await {
                Ok(Ok(())) => tracing::debug!("aborted the open Kafka transaction"),
                // The next session's init_transactions aborts it.
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "abort_transaction failed; the next session's producer aborts it")
                }
                Err(_) => tracing::warn!("abort_transaction did not finish; the next session's producer aborts it"),
            }
        }
        std::mem::take(&mut eo.dead)
    }
}
