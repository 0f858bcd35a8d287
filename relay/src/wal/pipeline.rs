//! The WAL publishing pipeline: records are produced as their rows arrive
//! (many transactions in flight through the shared idempotent producer,
//! which keeps each partition in order), acknowledgements are counted per
//! transaction, and the transactions whose every record is acknowledged are
//! handed, in commit order, to the marker (see `marker`), which marks their
//! rows and then lets the slot's confirmed position move past them.
//!
//! At the first record that fails nothing more is produced: what is in
//! flight is awaited, the acknowledged prefix of transactions is still
//! handed over, and the session ends with the failure's classification.
//!
//! Exactly once (`transactional`), the records go through the slot's
//! transactional producer, and transactions reach the marker only once
//! their Kafka transaction committed.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::stream::{FuturesUnordered, StreamExt};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{DeliveryFuture, FutureProducer};
use tokio::sync::oneshot;

use super::connect::Ended;
use super::ledger::{IdSet, Known, KNOWN_LOAD};
use super::marker::{Mark, Marks};
use crate::config::{OnPoison, RelayConfig};
use crate::publish::{self, Outcome};
use crate::state::RelayState;
use crate::store::PendingRow;

mod transactional;

pub(super) use transactional::{take_over, Transactional};

/// One transaction of the stream (or one page of the catch-up read), until
/// the marker has it.
#[derive(Debug)]
struct Txn {
    /// Its place in the pipeline (strictly increasing).
    seq: u64,
    /// The commit record's position (`None` for a catch-up page).
    final_lsn: Option<u64>,
    /// Where the slot may be confirmed once it is marked: the end of its
    /// commit record; `None` for a catch-up page.
    end_lsn: Option<u64>,
    /// Its Commit arrived (a catch-up page: its last row was produced).
    committed: bool,
    /// Records produced and not yet settled.
    outstanding: usize,
    /// Its acknowledged rows, to be marked delivered.
    acked: IdSet,
    /// The lowest id of its rows that failed (a catch-up page's
    /// acknowledged rows below it are marked when the session fails).
    failed_from: Option<i64>,
    /// Delivered already, so its rows are never produced: an earlier
    /// session marked it (the slot's marked position), or, exactly once,
    /// the progress record says it is in Kafka.
    skip: bool,
    /// A skipped transaction's rows are marked as they stream again: only
    /// exactly once, from a progress record that does not list what may be
    /// unmarked. Otherwise they were marked already (or by
    /// `mark_committed`), and marking them again could cover a row that
    /// died in it and an operator replayed since, which would then never be
    /// published.
    mark_skipped: bool,
    /// Its commit timestamp and when the session handled its Begin (µs
    /// since the Unix epoch), for the latency; `None` for a catch-up page.
    stamps: Option<(i64, i64)>,
}

/// A delivery in flight: the future and what it is about.
struct Delivery {
    seq: u64,
    /// The outbox row's id (`None`: a Debezium-layout row, which has no
    /// place in the ledger).
    id: Option<i64>,
    created_at: i64,
    stamps: Option<(i64, i64)>,
    fut: DeliveryFuture,
}

/// A settled delivery: transaction, row id, row creation time, outcome.
pub(super) struct Settled {
    seq: u64,
    id: Option<i64>,
    created_at: i64,
    stamps: Option<(i64, i64)>,
    outcome: Outcome,
}

impl Future for Delivery {
    type Output = Settled;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Settled> {
        let this = self.get_mut();
        Pin::new(&mut this.fut).poll(cx).map(|r| Settled {
            seq: this.seq,
            id: this.id,
            created_at: this.created_at,
            stamps: this.stamps,
            outcome: publish::delivered(r),
        })
    }
}

/// The pipeline of one replication session.
pub(super) struct Pipeline<'a> {
    state: &'a RelayState,
    cfg: &'a RelayConfig,
    producer: &'a FutureProducer,
    database_id: &'a str,
    /// Transactions not yet handed to the marker, in commit order.
    txns: VecDeque<Txn>,
    next_seq: u64,
    inflight: FuturesUnordered<Delivery>,
    marks: Marks,
    /// The highest position handed to the marker.
    handed: u64,
    /// How the session must end, set at the first failed record.
    failed: Option<Ended>,
    /// Isolating a poison row: one record in flight at a time, so a
    /// refusal is evidence about that row alone.
    pub(super) one_at_a_time: bool,
    /// The latest streamed transaction (its commit position) and catch-up
    /// row holding a record refused as poison that this session did not get
    /// past (refused with others, or blocking): the sessions after it
    /// isolate through them, so nothing behind a blocked row is produced
    /// again on a retry, whichever failure ended the session.
    refused: (Option<u64>, Option<i64>),
    /// Exactly once: the session's Kafka transactions (`None`: at least once).
    eo: Option<Transactional>,
    /// The slot's marked position when the session began: a streamed
    /// transaction ending at or before it is skipped.
    marked: u64,
    /// The ledger as this session found it: a row it covered is skipped in
    /// any transaction, above the marked position too (rows another slot's
    /// relay delivered, or the table read while the slot was being made).
    known: Known,
}

impl<'a> Pipeline<'a> {
    /// An empty pipeline handing settled transactions to `marks`.
    pub(super) fn new(
        state: &'a RelayState,
        cfg: &'a RelayConfig,
        producer: &'a FutureProducer,
        database_id: &'a str,
        marks: Marks,
        eo: Option<Transactional>,
        marked: u64,
    ) -> Self {
        Pipeline {
            state,
            cfg,
            producer,
            database_id,
            txns: VecDeque::new(),
            next_seq: 0,
            inflight: FuturesUnordered::new(),
            marks,
            handed: 0,
            failed: None,
            one_at_a_time: false,
            refused: (None, None),
            eo,
            marked,
            known: Known::default(),
        }
    }

    /// The marker's queue, for a session to see the marker gone
    /// ([`Marks::closed`]) while nothing is handed to it.
    pub(super) fn marker(&self) -> Marks {
        self.marks.clone()
    }

    /// Whether the ledger covered row `id` when this session loaded the
    /// part of it around `id` (then the row is not produced again). A
    /// failed load ends the session as the database's (`true`: nothing
    /// more is produced).
    async fn covered(&mut self, id: i64) -> bool {
        if let Some(covered) = self.known.covers(id) {
            return covered;
        }
        let limit = i64::try_from(KNOWN_LOAD).expect("KNOWN_LOAD fits in i64");
        match self.state.store.wal_ledger_from(id, limit).await {
            Ok(ranges) => {
                self.known.learn(id, ranges, KNOWN_LOAD);
                self.known.covers(id) == Some(true)
            }
            Err(e) => {
                tracing::warn!(error = %e, "reading the delivered-ranges ledger failed");
                self.fail(Ended::Retry("database"));
                true
            }
        }
    }

    /// Whether the open transaction is skipped (marked already).
    pub(super) fn skipping(&self) -> bool {
        self.txns.back().is_some_and(|t| t.skip)
    }

    /// Records in flight.
    pub(super) fn in_flight(&self) -> usize {
        self.inflight.len()
    }

    /// How the session must end, once a record failed.
    pub(super) fn failed(&self) -> Option<&Ended> {
        self.failed.as_ref()
    }

    /// Where the next sessions isolate: the latest transaction's commit
    /// position and catch-up row with a poison record this session did not
    /// get past.
    pub(super) fn refused(&self) -> (Option<u64>, Option<i64>) {
        self.refused
    }

    /// Whether more may be produced: nothing failed, and while isolating,
    /// nothing is in flight.
    pub(super) fn may_produce(&self) -> bool {
        self.failed.is_none() && (!self.one_at_a_time || self.inflight.is_empty())
    }

    /// A transaction begins (its commit record at `final_lsn`, committed at
    /// `commit_us` µs since the Unix epoch), or a page of the catch-up read
    /// (`None`, `None`).
    ///
    /// A streamed transaction is skipped when the slot's marked position or
    /// the exactly-once progress record covers it: it ends after
    /// `final_lsn`, and every transaction that commits later starts its
    /// commit record at or after the end of this one's, so
    /// `final_lsn < marked` is `end ≤ marked`.
    pub(super) fn begin(&mut self, final_lsn: Option<u64>, commit_us: Option<i64>) {
        let marked = final_lsn.is_some_and(|f| f < self.marked);
        let in_kafka = final_lsn.is_some_and(|f| self.eo.as_ref().is_some_and(|eo| eo.covers(f)));
        let mark_skipped = !marked && in_kafka && self.eo.as_ref().is_some_and(Transactional::marks_covered);
        self.txns.push_back(Txn {
            seq: self.next_seq,
            final_lsn,
            end_lsn: None,
            committed: false,
            outstanding: 0,
            acked: IdSet::default(),
            failed_from: None,
            skip: marked || in_kafka,
            mark_skipped,
            stamps: commit_us.map(|c| (c, super::now_us())),
        });
        self.next_seq += 1;
    }

    /// The open transaction committed (ending at `end_lsn`).
    pub(super) async fn commit(&mut self, end_lsn: Option<u64>) {
        if let Some(t) = self.txns.back_mut() {
            t.committed = true;
            t.end_lsn = end_lsn;
        }
        self.advance().await;
    }

    /// Hands `row` to the producer as part of the open transaction; while
    /// the producer's queue is full, waits for the oldest deliveries.
    /// Exactly once, a row of a transaction already in Kafka is only
    /// marked, and a row this relay marked dead is left out.
    pub(super) async fn produce(&mut self, row: &PendingRow) {
        self.produce_row(row, false).await;
    }

    /// [`Self::produce`] for a dead row an operator put back to pending,
    /// read from the table at its replay's announcement: exactly once, it
    /// is produced even though this relay marked it dead (and left it out
    /// of its insert's transaction).
    pub(super) async fn produce_replayed(&mut self, row: &PendingRow) {
        self.produce_row(row, true).await;
    }

    async fn produce_row(&mut self, row: &PendingRow, replayed: bool) {
        if let Some(t) = self.txns.back_mut().filter(|t| t.skip) {
            if t.mark_skipped {
                t.acked.insert(row.id);
            }
            self.state.metrics.wal_marked_skipped.inc();
            return;
        }
        // Streamed rows only: a catch-up page reads uncovered rows, and the
        // view, loaded after the table read's marks, covers them when the
        // stream carries them too (committed while the slot was made). A
        // replay's row was uncovered in the replay's transaction, after the
        // view was loaded: it is produced.
        let streamed = self.txns.back().is_some_and(|t| t.final_lsn.is_some());
        if streamed && !replayed && self.covered(row.id).await {
            if self.failed.is_none() {
                self.state.metrics.wal_marked_skipped.inc();
            }
            return;
        }
        if self.eo.is_some() && !self.exactly_once_produces(row, replayed).await {
            return;
        }
        let topic = self.cfg.route(&row.topic, &row.tenant);
        // A replayed row's `created_at` is its first insert's, long before
        // the replay's commit: timed from `created_at`, as before.
        let database_id = self.database_id;
        let record = || publish::record(&topic, row, database_id);
        self.send(Some(row.id), row.created_at.get(), !replayed, record).await;
    }

    /// Hands the record of a Debezium-layout row to the producer as part of
    /// the open transaction (at least once: exactly once is refused with
    /// `--debezium-config`). A transaction the slot's marked position
    /// covers is skipped; there is no ledger to consult.
    pub(super) async fn produce_event(&mut self, event: &crate::debezium::Event) {
        if self.txns.back().is_some_and(|t| t.skip) {
            self.state.metrics.wal_marked_skipped.inc();
            return;
        }
        let commit_ms = self
            .txns
            .back()
            .and_then(|t| t.stamps)
            .map_or(0, |(commit, _)| commit / 1000);
        let record = || publish::event_record(event);
        self.send(None, commit_ms, true, record).await;
    }

    /// Sends the record `build` makes as part of the open transaction (row
    /// `id`, created at `created_at` ms; `stamped`: timed from the
    /// transaction's commit); while the producer's queue is full, waits for
    /// the oldest deliveries.
    async fn send<'r>(
        &mut self,
        id: Option<i64>,
        created_at: i64,
        stamped: bool,
        build: impl Fn() -> rdkafka::producer::FutureRecord<'r, [u8], [u8]>,
    ) {
        while self.failed.is_none() {
            let Some((seq, stamps)) = self.txns.back().map(|t| (t.seq, t.stamps.filter(|_| stamped))) else {
                self.failed = Some(Ended::Retry("row_outside_transaction"));
                return;
            };
            match self.producer.send_result(build()) {
                Ok(fut) => {
                    self.inflight.push(Delivery {
                        seq,
                        id,
                        created_at,
                        stamps,
                        fut,
                    });
                    if let Some(t) = self.txns.back_mut() {
                        t.outstanding += 1;
                    }
                    return;
                }
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) => {
                    let t = &self.state.metrics.timings;
                    t.wal_queue_full.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    match self.next().await {
                        Some(settled) => self.settle(settled).await,
                        None => {
                            self.failed = Some(Ended::Retry("queue_full"));
                            return;
                        }
                    }
                }
                // Refused by the client before sending: certainly this row's.
                Err((e, _)) => {
                    if let Some(t) = self.txns.back_mut() {
                        t.outstanding += 1;
                    }
                    let settled = Settled {
                        seq,
                        id,
                        created_at,
                        stamps,
                        outcome: publish::classify(&e),
                    };
                    self.apply(settled, true).await;
                    return;
                }
            }
        }
    }

    /// The next settled delivery (cancel-safe: nothing is lost when the
    /// future is dropped); `None` when nothing is in flight.
    pub(super) async fn next(&mut self) -> Option<Settled> {
        self.inflight.next().await
    }

    /// Applies a delivery's outcome.
    pub(super) async fn settle(&mut self, settled: Settled) {
        let alone = self.one_at_a_time;
        self.apply(settled, alone).await;
    }

    /// Awaits everything in flight (after a failure or at the end).
    pub(super) async fn settle_all(&mut self) {
        while let Some(s) = self.next().await {
            self.settle(s).await;
        }
    }

    /// A keepalive at `wal_end` while nothing is open or in flight: every
    /// transaction before it was handled, so the slot may move there too
    /// (WAL of other tables is released while the outbox is quiet).
    pub(super) async fn idle(&mut self, wal_end: u64) {
        let kafka_open = self.eo.as_ref().is_some_and(Transactional::is_open);
        if self.txns.is_empty()
            && self.inflight.is_empty()
            && self.failed.is_none()
            && !kafka_open
            && wal_end > self.handed
        {
            self.hand(Mark {
                ids: IdSet::default(),
                lsn: Some(wal_end),
                done: None,
            })
            .await;
        }
    }

    /// After a failure, with nothing in flight: hands the leading catch-up
    /// pages' acknowledged rows below their first failed row to the marker.
    /// A page confirms no slot position and the next catch-up reads only
    /// the rows still pending, so marking them is safe, and they are not
    /// published again on every retry of the failed row (a blocked poison
    /// row). A streamed transaction is never handed in part: the slot would
    /// move past its failed row. Exactly once, nothing is handed: the
    /// failure aborted the Kafka transaction, so no acknowledgement counts.
    pub(super) async fn hand_acked_pages(&mut self) {
        if self.eo.is_some() {
            return;
        }
        while self.inflight.is_empty() && self.txns.front().is_some_and(|t| t.final_lsn.is_none()) {
            let t = self.txns.pop_front().expect("front exists");
            let ids = match t.failed_from {
                Some(from) => t.acked.below(from),
                None => t.acked,
            };
            self.hand(Mark {
                ids,
                lsn: None,
                done: None,
            })
            .await;
        }
    }

    /// Waits until the marker has marked everything handed to it so far.
    pub(super) async fn flush_marks(&mut self) -> bool {
        let (tx, rx) = oneshot::channel();
        self.hand(Mark {
            ids: IdSet::default(),
            lsn: None,
            done: Some(tx),
        })
        .await;
        rx.await.is_ok()
    }

    /// One row's outcome. `alone`: the outcome is certainly this row's
    /// (refused by the client, or the only record in flight), not its
    /// produce request's.
    async fn apply(&mut self, s: Settled, alone: bool) {
        let m = &self.state.metrics;
        match s.outcome {
            Outcome::Acked { .. } => {
                // From the transaction's commit timestamp where the stream
                // gave one (a catch-up page's rows: from `created_at`).
                let now = super::now_us();
                let from = s
                    .stamps
                    .map_or_else(|| s.created_at.saturating_mul(1000), |(commit, _)| commit);
                m.observe_latency((now - from) / 1000);
                if let Some((commit, received)) = s.stamps {
                    m.timings.wal_stages.observe([
                        commit - s.created_at.saturating_mul(1000),
                        received - commit,
                        now - received,
                    ]);
                }
                m.timings.wal_acked.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.settled(s.seq, s.id);
                self.advance().await;
            }
            Outcome::Poison(code) => {
                m.publish_error(code);
                // A Debezium-layout row has no state to mark dead: it
                // blocks the stream, as a Kafka Connect task fails.
                let dead = self.cfg.on_poison == OnPoison::Dead && s.id.is_some();
                if !(alone && dead) {
                    self.failed_row(s.seq, s.id);
                }
                if !alone {
                    self.poison_in_request(s.seq, s.id);
                } else if let (true, Some(id)) = (dead, s.id) {
                    let marked = self.dead(s.seq, id, code).await;
                    // Exactly once, the refusal dooms the Kafka transaction:
                    // it is aborted and streamed again without the row.
                    if let (true, Some(eo)) = (marked, self.eo.as_mut()) {
                        eo.dead.insert(id);
                        self.fail(Ended::Aborted);
                    }
                } else {
                    tracing::error!(
                        id = s.id,
                        code,
                        "poison record blocks the stream (--on-poison=block, or a Debezium-layout row)"
                    );
                    self.refuse(s.seq, s.id);
                    self.note(s.id, code).await;
                    self.fail(Ended::Retry(code));
                }
            }
            Outcome::Transient(code) => {
                m.publish_error(code);
                self.failed_row(s.seq, s.id);
                self.note(s.id, code).await;
                self.fail(Ended::Retry(code));
            }
            Outcome::Fatal => {
                m.publish_error("fatal");
                self.failed_row(s.seq, s.id);
                self.failed = Some(Ended::Fatal);
            }
        }
    }

    /// Row `id` of transaction `seq` failed (it stays pending).
    fn failed_row(&mut self, seq: u64, id: Option<i64>) {
        let Some(id) = id else { return };
        if let Some(t) = self.txn(seq) {
            t.failed_from = Some(t.failed_from.map_or(id, |f| f.min(id)));
        }
    }

    /// A record refused with others: isolate up to the latest transaction
    /// (or catch-up row) refused so far.
    fn poison_in_request(&mut self, seq: u64, id: Option<i64>) {
        self.refuse(seq, id);
        if matches!(self.failed, None | Some(Ended::Isolate { .. })) {
            let (through_lsn, through_id) = self.refused;
            self.failed = Some(Ended::Isolate {
                through_lsn,
                through_id,
            });
        }
    }

    /// Row `id` of transaction `seq` was refused as poison and not got past.
    fn refuse(&mut self, seq: u64, id: Option<i64>) {
        match (self.txn(seq).and_then(|t| t.final_lsn), id) {
            (Some(l), _) => self.refused.0 = Some(self.refused.0.map_or(l, |x| x.max(l))),
            (None, Some(id)) => self.refused.1 = Some(self.refused.1.map_or(id, |x| x.max(id))),
            (None, None) => {}
        }
    }

    /// Marks a row Kafka refused alone dead (`--on-poison=dead`): settled;
    /// whether it was marked.
    async fn dead(&mut self, seq: u64, id: i64, code: &'static str) -> bool {
        tracing::error!(id, code, "record refused by Kafka; marked dead");
        match self.state.store.wal_mark_dead(id, code).await {
            Ok(()) => {
                self.state.metrics.dead.inc();
                self.settled(seq, None);
                self.advance().await;
                true
            }
            Err(e) => {
                tracing::warn!(id, error = %e, "marking a poison row dead failed");
                // Not got past: the next session isolates it again.
                self.refuse(seq, Some(id));
                self.fail(Ended::Retry("mark_dead"));
                false
            }
        }
    }

    /// Counts a failed attempt on the row (best effort: the failure is
    /// handled whether or not this is written).
    async fn note(&self, id: Option<i64>, code: &str) {
        let Some(id) = id else { return };
        if let Err(e) = self.state.store.wal_note_publish_error(id, code).await {
            tracing::debug!(id, error = %e, "recording a publish error failed");
        }
    }

    /// The first failure decides how the session ends; a fatal one wins.
    fn fail(&mut self, how: Ended) {
        if self.failed.is_none() {
            self.failed = Some(how);
        }
    }

    fn txn(&mut self, seq: u64) -> Option<&mut Txn> {
        let front = self.txns.front()?.seq;
        self.txns.get_mut(usize::try_from(seq.checked_sub(front)?).ok()?)
    }

    /// One record of transaction `seq` settled (acknowledged: its id, if
    /// it is an outbox row).
    fn settled(&mut self, seq: u64, acked: Option<i64>) {
        if let Some(t) = self.txn(seq) {
            t.outstanding -= 1;
            if let Some(id) = acked {
                t.acked.insert(id);
            }
        }
    }

    /// Hands every leading transaction whose records all settled to the
    /// marker, in commit order.
    async fn advance(&mut self) {
        while self.txns.front().is_some_and(|t| t.committed && t.outstanding == 0) {
            let t = self.txns.pop_front().expect("front exists");
            let mark = Mark {
                ids: t.acked,
                lsn: t.end_lsn,
                done: None,
            };
            // Exactly once, the marker has it after its Kafka commit.
            let now = match self.eo.as_mut() {
                Some(eo) => eo.stage(mark, t.skip),
                None => Some(mark),
            };
            if let Some(mark) = now {
                self.hand(mark).await;
            }
        }
    }

    async fn hand(&mut self, mark: Mark) {
        if let Some(l) = mark.lsn {
            self.handed = self.handed.max(l);
        }
        if self.marks.send(self.state, mark).await.is_err() {
            self.fail(Ended::Retry("marker_stopped"));
        }
    }
}
