//! One replication session: make sure the publication and the slot exist
//! (anew after a reseed), start streaming from the slot (which makes this
//! relay its only reader until the session ends), read the table once if
//! the slot is new, then publish the stream (inserted rows, and dead rows
//! an operator replayed) until shutdown or a failure; finally settle what
//! is in flight, mark it and confirm the slot. Exactly once, the session
//! takes the slot's transactional producer over once the slot streams to
//! it, and commits (or aborts) its last Kafka transaction as it ends.

use std::sync::Arc;
use std::time::Duration;

use pgwire_replication::{FeedbackObserver, Lsn, ReplicationClient, ReplicationEvent};
use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;

use super::connect::{classify, Ended, STATUS_INTERVAL};
use super::pgoutput::{Decoder, Message};
use super::pipeline::{self, Pipeline};
use super::{marker, Ctx, Isolation, Publisher};
use crate::store::CatchUp;

/// The most records in flight before the stream waits for
/// acknowledgements (the idempotent producer keeps each partition in order,
/// so this bounds memory, not order). A drain needs its rate times the
/// acknowledgement latency, a few thousand; 50,000 took the relay's peak
/// RSS past 64 MiB on a 1M-row backlog.
pub const MAX_IN_FLIGHT: usize = 16_384;

/// PostgreSQL's epoch (2000-01-01) in µs after the Unix epoch: the Begin
/// message's commit timestamp counts from it (pgwire-replication passes
/// the wire value on).
const PG_EPOCH_US: i64 = 946_684_800_000_000;

/// Runs one session; how it ended decides what the relay does next.
pub(super) async fn run(ctx: &Ctx, iso: &mut Isolation, reseed: &mut bool, finish: &CancellationToken) -> Ended {
    if !ctx.share.may_take(ctx.capture.stream.index) {
        return Ended::Yielded;
    }
    if let Err(end) = prepare(ctx, reseed, finish).await {
        return end;
    }
    // The table read this slot still needs, read before streaming starts:
    // a making of the slot after this (the slot invalidated under the
    // session, and made anew by another relay) changes the generation, so
    // this read records nothing for it. Read later, it could take a new
    // slot's generation before that slot's consistent point and record a
    // read that missed rows committed before it. A Debezium-layout table
    // is not read: its rows are usually deleted in the transaction that
    // wrote them, and the slot, made before the cut-over, streams what
    // commits after it.
    let read = match ctx.capture.router {
        Some(_) => None,
        None => match ctx.state.store.wal_catch_up(&ctx.capture.slot).await {
            // Read without its bound, the table would publish rows committed
            // after the slot in id order: the next session's `prepare` makes
            // the slot anew.
            Ok(Some(read)) if read.unbound => {
                // Streamed by someone who takes no making lock (an older
                // relay, an operator's client): standing by, as for any
                // slot in use.
                if matches!(ctx.state.store.wal_slot(&ctx.capture.slot).await, Ok(Some(s)) if s.active) {
                    return Ended::SlotInUse;
                }
                tracing::warn!(slot = %ctx.capture.slot, "the slot's table-read bound was never recorded (its maker stopped, or the slot was made without the making lock); making it anew");
                return Ended::Retry("slot_unbound");
            }
            Ok(read) => read,
            Err(e) => {
                tracing::warn!(error = %e, "reading the slot's catch-up flag failed");
                return Ended::Retry("database");
            }
        },
    };
    let sent = Arc::new(Notify::new());
    let observed = sent.clone();
    let repl = ctx
        .capture
        .replication
        .clone()
        .with_feedback_observer(FeedbackObserver::new(move |_| observed.notify_waiters()));
    // Bounded: a half-open network accepts the connection and answers
    // nothing.
    let started = tokio::time::timeout(CONNECT_BOUND, async {
        let mut client = ReplicationClient::connect(repl).await?;
        client.wait_started().await?;
        Ok::<_, pgwire_replication::PgWireError>(client)
    });
    let mut client = match started.await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return classify(&e),
        Err(_) => {
            tracing::warn!(bound = ?CONNECT_BOUND, "the replication connection did not start streaming in time");
            return Ended::Retry("replication_connect_timeout");
        }
    };
    ctx.state.ready.store(true, std::sync::atomic::Ordering::Relaxed);
    ctx.streamed.store(true, std::sync::atomic::Ordering::Relaxed);
    let _held = ctx.share.hold(ctx.capture.stream.index);
    tracing::info!(slot = %ctx.capture.slot, "streaming from the replication slot");
    // Exactly once: only now, with the slot ours, fence earlier producers.
    let (producer, eo) = match &ctx.publisher {
        Publisher::Shared(p) => (p.clone(), None),
        Publisher::Transactional(reader) => match pipeline::take_over(ctx, reader, iso.dead.clone(), finish).await {
            Ok((p, eo)) => (p, Some(eo)),
            Err(end) => {
                let _ = tokio::time::timeout(Duration::from_secs(5), client.shutdown()).await;
                return end;
            }
        },
    };
    let (confirmed_tx, mut confirmed) = watch::channel(0u64);
    // What earlier sessions marked of the stream is skipped, not produced
    // again (read once the slot streams to this session: no other session
    // marks more of it after that, but a frozen one's late marks, which
    // only repeat what it produced).
    let marked = match ctx.state.store.wal_marked(&ctx.capture.slot).await {
        Ok(m) => m,
        Err(e) => {
            tracing::warn!(error = %e, "reading the slot's marked position failed");
            let _ = tokio::time::timeout(Duration::from_secs(5), client.shutdown()).await;
            return Ended::Retry("database");
        }
    };
    let (marks, marker_task) = marker::spawn(
        ctx.state.clone(),
        ctx.capture.slot.clone(),
        ctx.cfg.delete_on_delivery,
        ctx.share.union.clone(),
        confirmed_tx,
    );
    let mut pipeline = Pipeline::new(&ctx.state, &ctx.cfg, &producer, &ctx.database_id, marks, eo, marked);
    // Exactly once: what the progress record holds and may be unmarked is
    // marked first, so neither a table read nor the stream publishes it again.
    let end = if !pipeline.mark_committed().await {
        pipeline.failed().cloned().unwrap_or(Ended::Retry("marker_stopped"))
    } else {
        let ended = match read {
            Some(read) => match while_answering(ctx, catch_up(ctx, &mut pipeline, read, iso, finish)).await {
                Ok(ended) => ended,
                Err(end) => Some(end),
            },
            None => None,
        };
        match ended {
            Some(end) => end,
            None => stream(ctx, &mut pipeline, &mut client, &mut confirmed, iso, finish).await,
        }
    };
    // Wind down: settle what is in flight, mark the acknowledged prefix,
    // confirm it, and only then let the slot go.
    pipeline.settle_all().await;
    let clean = matches!(end, Ended::Shutdown | Ended::Yielded) && pipeline.failed().is_none();
    iso.dead.extend(pipeline.close_kafka(clean).await);
    iso.extend(pipeline.refused());
    drop(pipeline);
    // The marker's last statement may be stuck on a dead connection (its
    // bound is longer): what it did not commit stays unmarked and the slot
    // before it (the next session produces it again), so it is given a
    // while and then dropped; less when the session ended on a failure.
    // After a connection was found dead (or the database not answering)
    // nothing is waited for on it.
    let dead = matches!(end, Ended::Retry("replication_silent" | "database"));
    let (marker_wait, client_wait) = match (&end, dead) {
        (Ended::Shutdown | Ended::Yielded, _) => (PING_WAIT, Duration::from_secs(5)),
        (_, false) => (Duration::from_secs(2), Duration::from_secs(5)),
        (_, true) => (Duration::from_secs(2), Duration::from_secs(1)),
    };
    let mut marker_task = marker_task;
    if tokio::time::timeout(marker_wait, &mut marker_task).await.is_err() {
        tracing::warn!("the marker's last mark did not finish in time; dropped (its rows stay unmarked)");
        marker_task.abort();
    }
    let last = *confirmed.borrow_and_update();
    if last > 0 && confirms() {
        client.update_applied_lsn(Lsn::from_u64(last));
    }
    let deadline = tokio::time::Instant::now() + STATUS_INTERVAL * 3;
    while !dead && client.feedback_pending_since().is_some() && client.is_running() {
        if tokio::time::timeout_at(deadline, sent.notified()).await.is_err() {
            break;
        }
    }
    let _ = tokio::time::timeout(client_wait, client.shutdown()).await;
    end
}

/// The publication and the slot, created when missing; after a reseed (or
/// when PostgreSQL invalidated it) the slot is dropped and made anew, which
/// flags the table for one catch-up read. Creating the slot waits for the
/// transactions running then, however long: `finish` ends the wait (and
/// the creation).
///
/// `reseed` is cleared once the slot is gone (dropped here, or missing):
/// a reseed that meets the slot still in use waits for it, and one that
/// another relay already carried out is not done twice.
async fn prepare(ctx: &Ctx, reseed: &mut bool, finish: &CancellationToken) -> Result<(), Ended> {
    let mut checked = None;
    prepare_slot(ctx, reseed, finish, &mut checked).await?;
    // What the next `prepare` and the stream's checks compare with: the
    // oid the reseed decision was taken on (a publication made again
    // after it differs, so it is caught), and the slot's making now that
    // the slot is there (made by this `prepare` or before).
    let slot_made = ctx
        .state
        .store
        .wal_slot_generation(&ctx.capture.slot)
        .await
        .map_err(|e| {
            tracing::warn!(error = %e, code = e.code(), "reading the slot's making failed");
            Ended::Retry("database")
        })?;
    if let Some(oid) = checked {
        *ctx.publication_seen.lock().unwrap_or_else(|e| e.into_inner()) = Some(super::Seen { oid, slot_made });
    }
    Ok(())
}

/// The publication's oid and the slot's making, now.
async fn seen(ctx: &Ctx) -> ferry::Result<super::Seen> {
    let store = &ctx.state.store;
    let p = store
        .wal_publication(&ctx.capture.publication, &ctx.capture.table(), ctx.capture.row_filter())
        .await?;
    Ok(super::Seen {
        oid: p.oid,
        slot_made: store.wal_slot_generation(&ctx.capture.slot).await?,
    })
}

/// [`prepare`]'s work: the publication and the slot; `checked` gets the
/// publication's oid the reseed decision was taken on.
async fn prepare_slot(
    ctx: &Ctx,
    reseed: &mut bool,
    finish: &CancellationToken,
    checked: &mut Option<Option<i64>>,
) -> Result<(), Ended> {
    let store = &ctx.state.store;
    let (slot, publication) = (&ctx.capture.slot, &ctx.capture.publication);
    let db = |e: ferry::Error| {
        tracing::warn!(error = %e, code = e.code(), "preparing the replication slot failed");
        Ended::Retry("database")
    };
    super::streams::retire_other_layouts(ctx).await?;
    let table = ctx.capture.table();
    let filter = ctx.capture.row_filter();
    let found_as = store
        .wal_publication(publication, &table, filter.clone())
        .await
        .map_err(db)?;
    let (found, covers) = (found_as.found, found_as.covers);
    let mut existing = store.wal_slot(slot).await.map_err(db)?;
    // A Debezium-layout table is never read, so its slot is never dropped
    // or made anew behind an operator's back: each would skip rows.
    let debezium = ctx.capture.router.is_some();
    if !found && debezium && existing.is_some() {
        tracing::error!(%publication, %slot, "the slot exists but its publication does not (publication.name, or --publication, names another?): nothing is published until it exists");
        return Err(Ended::Retry("publication_missing"));
    }
    if !found {
        tracing::info!(%publication, table = %table.name, "creating the publication (inserts only)");
        store
            .create_wal_publication(publication, &table, ctx.capture.stream)
            .await
            .map_err(db)?;
    } else if !covers && debezium {
        // A Debezium-layout table has no table read to cover a slot made
        // anew: the slot is kept and the relay waits for an operator.
        tracing::error!(%publication, table = %table.name, "the publication does not publish the table's inserts; add it (ALTER PUBLICATION … ADD TABLE …): the slot is kept, nothing is published until then");
        return Err(Ended::Retry("publication_mismatch"));
    } else if !covers {
        // The outbox was replaced (a copy has a new relation id, which the
        // publication does not follow) or the publication altered: rows
        // written since are in no stream. The slot goes first (so a crash
        // in between finds the publication still wrong and comes back
        // here), then the outbox is added, and the new slot's table read
        // publishes what is pending.
        tracing::warn!(%publication, %slot, "the publication does not publish this schema's outbox; adding it and making the slot anew (the table is read once)");
        if let Some(s) = existing.filter(|s| s.usable) {
            if s.active || !store.drop_wal_slot(slot).await.map_err(db)? {
                return Err(Ended::SlotInUse);
            }
            existing = None;
        }
        store
            .add_table_to_wal_publication(publication, &table, ctx.capture.stream)
            .await
            .map_err(db)?;
        if !store
            .wal_publication(publication, &table, filter)
            .await
            .map_err(db)?
            .covers
        {
            tracing::error!(%publication, "the publication does not publish this schema's outbox inserts, even with outbox added (publish = 'insert' is off?)");
            return Err(Ended::Retry("publication_mismatch"));
        }
    }
    // A publication made again since this process's sessions streamed with
    // it (dropped and created, by an operator or by `!found` above):
    // pgoutput may go on deciding from the old one's membership, cached,
    // for rows of transactions that straddled the change, and skip them
    // without an error (minor releases before PostgreSQL's 2025 fix that
    // hands catalog invalidations to transactions in progress). The slot is
    // made anew and the table read once, as for a missing publication;
    // unless the slot was made again since this relay saw the old
    // publication (another relay of the group, or this one, did it).
    let seen = seen(ctx).await.map_err(db)?;
    *checked = Some(seen.oid);
    let before = *ctx.publication_seen.lock().unwrap_or_else(|e| e.into_inner());
    let made_again = before.is_some_and(|b| b.oid != seen.oid && b.slot_made == seen.slot_made);
    if !debezium && made_again && existing.is_some() {
        tracing::warn!(%publication, %slot, "the publication was made again since this relay streamed with it; making the slot anew (the table is read once)");
        *reseed = true;
    }
    if let Some(s) = existing {
        if !s.usable {
            tracing::error!(%slot, "the slot exists but is not a pgoutput slot of this database");
            return Err(Ended::Retry("slot_unusable"));
        }
        if !(s.lost || *reseed) {
            // A slot whose maker died before recording the table read's
            // bound is made anew (under the making lock, when no relay is
            // making it): read without a bound, the table would publish
            // rows committed after the slot in id order, while the stream
            // carries them in commit order.
            // One a session streams from (someone who takes no making lock)
            // is left to it: this relay stands by (`run`).
            if debezium || s.active || !store.wal_slot_unbound(slot).await.map_err(db)? {
                return Ok(());
            }
            return match store
                .remake_unbound_wal_slot(slot, ctx.capture.failover, finish.cancelled())
                .await
                .map_err(db)?
            {
                true => Ok(()),
                false => Err(Ended::Shutdown),
            };
        }
        if debezium {
            tracing::error!(%slot, lost = s.lost, "the slot cannot go on and is not made anew (the Debezium-layout table is not read): drop it and restart the relay to start from now, accepting what it skips");
            *reseed = false;
            return Err(Ended::Retry(if s.lost {
                "slot_invalidated"
            } else {
                "slot_unreadable"
            }));
        }
        if s.active || !store.drop_wal_slot(slot).await.map_err(db)? {
            return Err(Ended::SlotInUse);
        }
        tracing::warn!(%slot, lost = s.lost, "dropped the replication slot; the table will be read once");
    }
    // A slot marked before (by this relay or another of its group, before
    // a restart) is gone: making it anew would skip what committed since.
    let marked_before = debezium && store.wal_marked(slot).await.map_err(db)? > 0;
    if debezium && (*reseed || marked_before || ctx.streamed.load(std::sync::atomic::Ordering::Relaxed)) {
        tracing::error!(%slot, "the slot this relay group streamed from is gone and is not made anew (the Debezium-layout table is not read): to start over from now, accepting what it skips, delete its row (DELETE FROM relay_wal_slots WHERE slot = '…') and restart the relay");
        *reseed = false;
        return Err(Ended::Retry("slot_missing"));
    }
    *reseed = false;
    tracing::info!(%slot, "creating the replication slot");
    match store
        .create_wal_slot(slot, ctx.capture.failover, finish.cancelled())
        .await
        .map_err(db)?
    {
        true => Ok(()),
        false => {
            tracing::info!(%slot, "shut down while the slot waited for running transactions; it was not made");
            Err(Ended::Shutdown)
        }
    }
}

/// `work` (the table read: its pages' statements, whose bound is long, the
/// marks it waits for, Kafka), or `Err` ending the session when PostgreSQL
/// stops answering meanwhile: after each [`SILENCE`] of waiting, a trivial
/// statement on a new connection must be answered within [`PING_WAIT`]. The stream's silence
/// check does this while streaming; without it, a half-open connection
/// under the table read held the session for the page's bound (10 min).
/// Dropping `work` there is a crash of the read at that await: what it
/// published and did not mark is published again (exactly once, the
/// progress record knows what Kafka committed).
async fn while_answering<T>(ctx: &Ctx, work: impl std::future::Future<Output = T>) -> Result<T, Ended> {
    tokio::pin!(work);
    loop {
        tokio::select! {
            out = &mut work => return Ok(out),
            () = tokio::time::sleep(SILENCE) => {
                let probe = tokio::time::timeout(PING_WAIT, ctx.state.store.wal_answers());
                tokio::pin!(probe);
                tokio::select! {
                    out = &mut work => return Ok(out),
                    answered = &mut probe => match answered {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => {
                            tracing::warn!(error = %e, code = e.code(), "PostgreSQL failed a probe during the table read; ending the session");
                            return Err(Ended::Retry("database"));
                        }
                        Err(_) => {
                            tracing::warn!(bound = ?PING_WAIT, "PostgreSQL did not answer a probe during the table read; ending the session");
                            return Err(Ended::Retry("database"));
                        }
                    },
                }
            }
        }
    }
}

/// A new slot streams only what commits after it: the rows already pending
/// are published once from the table, in id order, before the stream, up to
/// the highest id committed when the slot was made (a row both read here
/// and streamed, committed just after the slot with an id below that, is
/// published twice, never lost). `Some` ends the session.
async fn catch_up(
    ctx: &Ctx,
    pipeline: &mut Pipeline<'_>,
    read: CatchUp,
    iso: &mut Isolation,
    finish: &CancellationToken,
) -> Option<Ended> {
    let store = &ctx.state.store;
    let slot = &ctx.capture.slot;
    let CatchUp {
        through, generation, ..
    } = read;
    tracing::info!(%slot, through, "publishing the rows committed before the slot from the table");
    pipeline.forget_old_slot_position();
    let exactly_once = matches!(ctx.publisher, Publisher::Transactional(_));
    let mut after = 0;
    loop {
        if finish.is_cancelled() {
            return Some(Ended::Shutdown);
        }
        // Exactly once, a row being isolated is a page (and a Kafka
        // transaction) of its own, so a blocked row holds no other back.
        let limit = if exactly_once && iso.covers_id(after + 1) {
            1
        } else {
            ctx.cfg.batch_size
        };
        let rows = match store.pending_after_in(ctx.capture.stream, after, through, limit).await {
            Ok(rows) => rows,
            Err(e) => {
                tracing::warn!(error = %e, "the catch-up read failed");
                return Some(Ended::Retry("database"));
            }
        };
        let Some(last) = rows.last().map(|r| r.id) else { break };
        pipeline.begin(None, None);
        for row in &rows {
            pipeline.one_at_a_time = iso.covers_id(row.id);
            while pipeline.in_flight() > 0 && !pipeline.may_produce() {
                if let Some(s) = pipeline.next().await {
                    pipeline.settle(s).await;
                }
            }
            if pipeline.failed().is_some() {
                break;
            }
            pipeline.produce(row).await;
        }
        pipeline.commit(None).await;
        pipeline.settle_all().await;
        pipeline.commit_kafka().await;
        if let Some(end) = pipeline.failed().cloned() {
            pipeline.hand_acked_pages().await;
            return Some(end);
        }
        if exactly_once && !pipeline.flush_marks().await {
            return Some(Ended::Retry("marker_stopped"));
        }
        after = last;
    }
    pipeline.one_at_a_time = false;
    iso.through_id = None;
    if !pipeline.flush_marks().await {
        return Some(Ended::Retry("marker_stopped"));
    }
    if !pipeline.record_forgotten_position().await {
        return Some(pipeline.failed().cloned().unwrap_or(Ended::Retry("progress_record")));
    }
    match store.set_wal_slot_caught_up(slot, generation).await {
        Ok(true) => None,
        // Invalidated under this read (its session ended by the server)
        // and made anew by another relay: that slot's read is its own.
        Ok(false) => {
            tracing::warn!(%slot, "the slot was made anew while its table was read; this read records nothing, the new slot's session reads the table");
            Some(Ended::Retry("slot_made_anew"))
        }
        Err(e) => {
            tracing::warn!(error = %e, "recording the catch-up failed; it will be read again");
            Some(Ended::Retry("database"))
        }
    }
}

/// Publishes the stream until shutdown or a failure, the marker's
/// included: a session that cannot mark lets the slot go at once (see
/// `marker`), whether or not anything more is handed to the marker.
async fn stream(
    ctx: &Ctx,
    pipeline: &mut Pipeline<'_>,
    client: &mut ReplicationClient,
    confirmed: &mut watch::Receiver<u64>,
    iso: &mut Isolation,
    finish: &CancellationToken,
) -> Ended {
    let mut events = Events {
        decoder: Decoder::new(ctx.capture.schema.clone(), ctx.capture.router.clone()),
        // A Debezium-layout table's relay publishes none of Ferry's own
        // outbox, replays included.
        replay: ctx
            .capture
            .router
            .is_none()
            .then(|| format!("ferry.replay.{}", ctx.database_id)),
        forwarded: client.metrics(),
        received: 0,
    };
    let marker = pipeline.marker();
    let mut check_at = tokio::time::Instant::now() + PUBLICATION_CHECK;
    let mut silence = Silence::new(ctx);
    loop {
        if let Some(end) = pipeline.failed() {
            return end.clone();
        }
        let read = reading(pipeline);
        if !read {
            // Not reading is this side's wait (Kafka, the marker), not
            // the connection's silence.
            silence.heard();
        }
        let commit_due = pipeline.commit_due();
        let waiting = std::time::Instant::now();
        tokio::select! {
            biased;
            _ = finish.cancelled() => return Ended::Shutdown,
            _ = marker.closed() => return Ended::Retry("marker_stopped"),
            Ok(()) = confirmed.changed() => {
                let position = *confirmed.borrow_and_update();
                if confirms() {
                    client.update_applied_lsn(Lsn::from_u64(position));
                }
            }
            Some(settled) = pipeline.next(), if pipeline.in_flight() > 0 => pipeline.settle(settled).await,
            _ = tokio::time::sleep_until(silence.at), if read => {
                if let Some(end) = silence.check().await {
                    return end;
                }
            }
            _ = tokio::time::sleep_until(check_at) => {
                check_at = tokio::time::Instant::now() + PUBLICATION_CHECK;
                if periodic_publication_check() {
                    if let Some(end) = publication_lost(ctx, Check::Periodic).await {
                        return end;
                    }
                }
                if ctx.share.must_yield(ctx.capture.stream.index) {
                    tracing::info!(slot = %ctx.capture.slot, "this relay streams more than its share: giving this stream to another relay");
                    return Ended::Yielded;
                }
                if let Some(end) = super::streams::layout_changed(ctx).await {
                    return end;
                }
            }
            // Exactly once: the stream paused between transactions.
            _ = tokio::time::sleep_until(commit_due.unwrap_or_else(far_future)), if commit_due.is_some() => {
                pipeline.commit_kafka().await;
            }
            event = client.recv(), if read => {
                silence.heard();
                if let Err(end) = events.handle(ctx, pipeline, iso, event, Some(waiting)).await {
                    return end;
                }
                // The events already queued behind it, without a turn of
                // the loop each (its timers and wake-ups cost more than a
                // row's decoding).
                let mut batched = 1;
                while batched < EVENT_BATCH && reading(pipeline) && events.queued() {
                    let Some(event) = futures::FutureExt::now_or_never(client.recv()) else {
                        break;
                    };
                    batched += 1;
                    if let Err(end) = events.handle(ctx, pipeline, iso, event, None).await {
                        return end;
                    }
                }
            }
        }
    }
}

/// A streaming session's watch on its replication connection: nothing
/// heard for [`SILENCE`] (while reading) sends a ping through the WAL; then
/// every [`PING_WAIT`] without an event asks the server how far this
/// relay's walsender has read. The connection is taken for dead
/// (`replication_silent`) when the server has no such walsender, when it
/// read past the ping (so sent it) and nothing arrived, or when it did not
/// move (stuck); a walsender still reading WAL before the ping (decoding a
/// backlog of other tables' changes, which it sends nothing of) is waited
/// for.
struct Silence<'a> {
    ctx: &'a Ctx,
    prefix: String,
    /// When to act next.
    at: tokio::time::Instant,
    /// The ping in flight: its position, and how far the walsender had
    /// read at the last look.
    ping: Option<(i64, Option<i64>)>,
}

impl<'a> Silence<'a> {
    fn new(ctx: &'a Ctx) -> Self {
        Silence {
            ctx,
            prefix: format!("ferry.ping.{}", ctx.database_id),
            at: tokio::time::Instant::now() + SILENCE,
            ping: None,
        }
    }

    /// Something arrived (or the session is not reading): no silence.
    fn heard(&mut self) {
        self.at = tokio::time::Instant::now() + SILENCE;
        self.ping = None;
    }

    /// The next step at [`Silence::at`]; `Some` ends the session. A
    /// statement that fails or is not answered within [`PING_WAIT`] ends it
    /// as the database's.
    async fn check(&mut self) -> Option<Ended> {
        let store = &self.ctx.state.store;
        let capture = &self.ctx.capture;
        let db = |what: &str, r: Result<ferry::Result<Option<i64>>, tokio::time::error::Elapsed>| match r {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "{what} failed");
                Err(Ended::Retry("database"))
            }
            Err(_) => {
                tracing::warn!(bound = ?PING_WAIT, "{what}: PostgreSQL did not answer in time");
                Err(Ended::Retry("database"))
            }
        };
        let sent = tokio::time::timeout(PING_WAIT, store.wal_own_sent(&capture.slot, &capture.application_name)).await;
        let sent = match db("reading the walsender's position", sent) {
            Ok(v) => v,
            Err(end) => return Some(end),
        };
        let dead = |why: &str| {
            tracing::warn!(
                why,
                "the replication connection carried nothing, not even a ping through the WAL; taking it for dead"
            );
            Some(Ended::Retry("replication_silent"))
        };
        match (self.ping, sent) {
            (_, None) => return dead("the server has no walsender of this session"),
            // Its position is not shown to this role: the ping alone tells.
            (Some(_), Some(-1)) => return dead("the ping never arrived"),
            (Some((ping, _)), Some(s)) if s >= ping => return dead("the walsender sent the ping, which never arrived"),
            (Some((_, before)), Some(s)) if before == Some(s) => return dead("the walsender did not move"),
            (Some((ping, _)), now) => self.ping = Some((ping, now)),
            (None, now) => {
                let ping = tokio::time::timeout(PING_WAIT, store.wal_ping(&self.prefix)).await;
                match db("sending a ping through the WAL", ping.map(|r| r.map(Some))) {
                    Ok(p) => self.ping = Some((p.unwrap_or(0), now)),
                    Err(end) => return Some(end),
                }
            }
        }
        self.at = tokio::time::Instant::now() + PING_WAIT;
        None
    }
}

/// How long a streaming session may hear nothing from its replication
/// connection (no row, no keepalive) before it sends a ping through the WAL
/// (`pg_logical_emit_message`, one small record while the database is
/// quiet)...
pub const SILENCE: Duration = Duration::from_secs(10);
/// ...and how long the ping may take to come back before the server is
/// asked whether its walsender sent it: a half-open connection (packets
/// dropped, no reset) or a stuck walsender is noticed within
/// `SILENCE + PING_WAIT`, 20 s (see [`Silence`]).
pub const PING_WAIT: Duration = Duration::from_secs(10);
/// How long connecting and starting to stream may take.
pub const CONNECT_BOUND: Duration = Duration::from_secs(30);

/// How often a streaming session checks that its publication still
/// publishes this schema's outbox: a table replaced by a copy (a new
/// relation id) leaves the publication on the old one, and the stream
/// would carry none of the new table's rows, with no error.
pub const PUBLICATION_CHECK: Duration = Duration::from_secs(5);

/// What a publication check was started by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Check {
    /// The [`PUBLICATION_CHECK`] timer: a failed check is tried again at
    /// the next one, the stream going on meanwhile.
    Periodic,
    /// A `Relation` message: pgoutput rebuilt its entry for the table
    /// (from PostgreSQL 15, every rebuild sends the schema again before the
    /// next row; 13 and 14 only after a relation's own invalidation), which
    /// is also how it resumes after skipping rows on a stale membership of
    /// a publication made again. No row after it may be published until
    /// the check passes, so a failed check ends the session.
    Relation,
}

/// `Some` when the publication no longer publishes this schema's outbox,
/// or was made again: the session ends and the next one's `prepare`
/// repairs it. A failed check is logged; a periodic one is tried again at
/// the next, one made for a `Relation` message ends the session (see
/// [`Check`]). One unanswered for [`PING_WAIT`] ends the session as the
/// database's (the stream waits for it meanwhile).
async fn publication_lost(ctx: &Ctx, check: Check) -> Option<Ended> {
    let table = ctx.capture.table();
    match tokio::time::timeout(
        PING_WAIT,
        ctx.state
            .store
            .wal_publication(&ctx.capture.publication, &table, ctx.capture.row_filter()),
    )
    .await
    {
        Ok(Ok(p)) if !p.found || !p.covers => {
            tracing::warn!(publication = %ctx.capture.publication, found = p.found, "the publication no longer publishes this schema's outbox; ending the session");
            Some(Ended::Retry("publication_lost"))
        }
        // Made again (a new oid): see `prepare`, which makes the slot anew.
        Ok(Ok(p))
            if ctx.capture.router.is_none()
                && ctx
                    .publication_seen
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .map(|s| s.oid)
                    != Some(p.oid) =>
        {
            tracing::warn!(publication = %ctx.capture.publication, "the publication was made again while streaming; ending the session");
            Some(Ended::Retry("publication_made_again"))
        }
        Ok(Ok(_)) => None,
        Ok(Err(e)) if check == Check::Periodic => {
            tracing::warn!(error = %e, "checking the publication failed; checking again later");
            None
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %e, code = e.code(), "checking the publication at a new relation schema failed");
            Some(Ended::Retry("database"))
        }
        Err(_) => {
            tracing::warn!(bound = ?PING_WAIT, "PostgreSQL did not answer the publication check in time");
            Some(Ended::Retry("database"))
        }
    }
}

/// Whether the session confirms positions to the slot: always, but for the
/// crash tests' seam `FERRY_RELAY_FAILPOINT=never-confirm`, with which the
/// slot never moves, so the next session streams everything again (what a
/// relay killed between its marks and the client's next status update
/// leaves behind, without the race).
fn confirms() -> bool {
    static NEVER: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    !*NEVER.get_or_init(|| std::env::var("FERRY_RELAY_FAILPOINT").is_ok_and(|v| v == "never-confirm"))
}

/// Whether the [`PUBLICATION_CHECK`] timer checks the publication: always,
/// but for the tests' seam `FERRY_RELAY_FAILPOINT=no-periodic-publication-check`,
/// with which only a `Relation` message does ([`Check::Relation`]), so a
/// test shows that the check at the next row is what catches a publication
/// made again, not the timer racing it.
fn periodic_publication_check() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    !*OFF.get_or_init(|| std::env::var("FERRY_RELAY_FAILPOINT").is_ok_and(|v| v == "no-periodic-publication-check"))
}

/// Replication events handled in one turn of the session's loop at most,
/// when more are queued: shutdown, acknowledgements and the slot's
/// confirmation are looked at between turns.
const EVENT_BATCH: usize = 256;

/// Whether the session reads the next event: the pipeline may produce
/// (nothing failed, nothing in flight while isolating) and there is room in
/// flight.
fn reading(pipeline: &Pipeline<'_>) -> bool {
    pipeline.may_produce() && pipeline.in_flight() < MAX_IN_FLIGHT
}

/// The stream's events, as the session reads them.
struct Events {
    decoder: Decoder,
    /// The prefix of this database's replay announcements (`None`: they
    /// are not this relay's).
    replay: Option<String>,
    /// The replication client's count of events it queued for the session.
    forwarded: Arc<pgwire_replication::ReplicationMetrics>,
    /// Events the session took from the queue.
    received: u64,
}

impl Events {
    /// Whether an event waits in the client's queue. A receive then
    /// returns it at once (or yields to the runtime's budget), never the
    /// stream's end: only then is it polled once, outside `select!`
    /// (polling the end once could drop the client's worker error).
    fn queued(&self) -> bool {
        self.forwarded.events_forwarded() > self.received
    }

    /// Counts one event taken from the queue (waited for since `since`,
    /// `None`: it was queued already) and applies it; `Err` ends the
    /// session.
    async fn handle(
        &mut self,
        ctx: &Ctx,
        pipeline: &mut Pipeline<'_>,
        iso: &mut Isolation,
        event: pgwire_replication::Result<Option<ReplicationEvent>>,
        since: Option<std::time::Instant>,
    ) -> Result<(), Ended> {
        let t = &ctx.state.metrics.timings;
        let wait = since.map_or(Duration::ZERO, |s| s.elapsed());
        crate::metrics::Timings::add(&t.wal_events, &t.wal_wait_ns, wait);
        self.received += 1;
        match event {
            Ok(Some(ReplicationEvent::Begin {
                final_lsn,
                commit_time_micros,
                ..
            })) => {
                pipeline.one_at_a_time = iso.covers_lsn(final_lsn.as_u64());
                pipeline.begin(Some(final_lsn.as_u64()), Some(commit_time_micros + PG_EPOCH_US));
            }
            Ok(Some(ReplicationEvent::XLogData { data, .. })) => match self.decoder.decode(&data) {
                Ok(Message::Row(row)) => pipeline.produce(&row).await,
                Ok(Message::Event(event)) => pipeline.produce_event(&event).await,
                // A transaction marked already (streamed again) is skipped
                // whatever it holds.
                Ok(Message::Unrenderable(_)) if pipeline.skipping() => {}
                Ok(Message::Unrenderable(why)) => {
                    tracing::error!(%why, "a row of the Debezium-layout table cannot be published as Debezium would publish it");
                    return Err(Ended::Stopped("unsupported_event"));
                }
                Ok(Message::Relation) => {
                    if let Some(end) = publication_lost(ctx, Check::Relation).await {
                        return Err(end);
                    }
                }
                Ok(Message::Ignored) => {}
                Err(e) => {
                    tracing::error!(error = %e, "a replication message could not be decoded");
                    return Err(Ended::Retry("decode"));
                }
            },
            Ok(Some(ReplicationEvent::Commit { end_lsn, .. })) => {
                pipeline.commit(Some(end_lsn.as_u64())).await;
                if pipeline.wants_commit() {
                    pipeline.commit_kafka().await;
                }
            }
            Ok(Some(ReplicationEvent::KeepAlive { wal_end, .. })) => {
                pipeline.commit_kafka().await;
                pipeline.idle(wal_end.as_u64()).await;
            }
            Ok(Some(ReplicationEvent::Message {
                transactional: true,
                prefix,
                content,
                ..
            })) if self.replay.as_ref() == Some(&prefix) => replayed(ctx, pipeline, &content).await?,
            // Another application's pg_logical_emit_message: not ours.
            Ok(Some(ReplicationEvent::Message { .. })) => {}
            Ok(Some(ReplicationEvent::StoppedAt { .. }) | None) => return Err(Ended::Retry("stream_ended")),
            Err(e) => return Err(classify(&e)),
        }
        Ok(())
    }
}

/// A deadline that never comes (for a disabled timer branch).
fn far_future() -> tokio::time::Instant {
    tokio::time::Instant::now() + Duration::from_secs(86_400)
}

/// Dead rows put back to pending, announced in the transaction that did it
/// (`Operator::replay_dead_outbox_where`): published at that
/// transaction's place in commit order, read from the table (the update
/// itself is not streamed: the publication is inserts only).
async fn replayed(ctx: &Ctx, pipeline: &mut Pipeline<'_>, content: &[u8]) -> Result<(), Ended> {
    let ids: Vec<i64> = serde_json::from_slice(content).map_err(|_| {
        tracing::error!("a replay announcement could not be read");
        Ended::Retry("decode")
    })?;
    let db = |e: ferry::Error| {
        tracing::warn!(error = %e, "reading replayed rows failed");
        Ended::Retry("database")
    };
    // The replay's commit may reach the stream a moment before it is
    // visible: wait (a bounded while) until no announced row still reads
    // as dead. One that does after that died again after an earlier
    // reading of this announcement (a session that ended before confirming
    // it), and stays dead.
    for _ in 0..marker::VISIBLE_TRIES {
        let states = ctx.state.store.wal_states(&ids).await.map_err(db)?;
        if !states.iter().any(|(_, s)| s == "dead") {
            break;
        }
        tokio::time::sleep(marker::VISIBLE_WAIT).await;
    }
    let rows = ctx
        .state
        .store
        .pending_ids_in(ctx.capture.stream, &ids)
        .await
        .map_err(db)?;
    for row in &rows {
        pipeline.produce_replayed(row).await;
    }
    Ok(())
}
