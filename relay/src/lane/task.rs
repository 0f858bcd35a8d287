//! The lane loop: take the lane over (exactly once), read its next batch,
//! publish it in a `ferry.relay.batch` span, and act on how it ended (back
//! off, isolate a refused row, retry smaller, give the lane up).

use std::sync::Arc;
use std::time::Instant;

use backon::ExponentialBackoff;
use rdkafka::producer::FutureProducer;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::at_least_once::{at_least_once, lone};
use super::take_over::take_over;
use super::transactional::transactional_batch;
use super::{pause, retry_backoff, BatchEnd, LoneProducer, Sink, Wakes, RESCAN_EVERY};
use crate::config::RelayConfig;
use crate::exactly_once::ProgressReader;
use crate::metrics::Timings;
use crate::state::RelayState;
use crate::store::{LaneLease, PendingRow};

/// Publishes one lane until told to finish (after its in-flight batch) or
/// abort (lease lost: publish and mark nothing more). In exactly-once mode
/// the lane's transactional producer is created here, fencing its
/// predecessors, before anything is published. Each batch runs in a
/// `ferry.relay.batch` span (lane, generation, first and last outbox id,
/// row count, mode, outcome; never keys or payloads). When the task ends,
/// however it ends, `abort` is cancelled.
#[allow(clippy::too_many_arguments)] // one lane task's whole context, spawned once
pub async fn run(
    state: Arc<RelayState>,
    cfg: Arc<RelayConfig>,
    sink: Sink,
    database_id: Arc<str>,
    wake: Arc<Wakes>,
    lease: LaneLease,
    finish: CancellationToken,
    abort: CancellationToken,
) {
    // However the task ends (including a panic), tell whoever waits to
    // release this lane, and the main loop, that nothing is in flight.
    let _done = abort.clone().drop_guard();
    let (producer, reader) = match sink {
        Sink::Shared(p, lone) => (Some((p, lone)), None),
        Sink::Transactional(r) => (None, Some(r)),
    };
    let mut lane = Lane {
        backoff: retry_backoff(),
        producer,
        reader,
        txn: None,
        isolate_through: 0,
        batch_size: cfg.batch_size,
        state,
        cfg,
        database_id,
        wake,
        lease,
        finish,
        abort,
    };
    lane.publish().await;
}

/// What the lane loop does after a step.
enum Flow {
    /// Go on with the next step.
    Next,
    /// Start over from the top of the loop.
    Retry,
    /// End the lane task.
    Stop,
}

/// One lane task's context and the state its loop carries between batches.
struct Lane {
    state: Arc<RelayState>,
    cfg: Arc<RelayConfig>,
    database_id: Arc<str>,
    wake: Arc<Wakes>,
    lease: LaneLease,
    finish: CancellationToken,
    abort: CancellationToken,
    backoff: ExponentialBackoff,
    /// The shared producer and the relay's lone producer (at least once).
    producer: Option<(FutureProducer, LoneProducer)>,
    /// The progress reader (exactly once).
    reader: Option<Arc<ProgressReader>>,
    /// The lane's transactional producer, once taken over.
    txn: Option<FutureProducer>,
    /// Rows up to this id are published one at a time, each alone in its
    /// produce request (see BatchEnd::Isolate).
    isolate_through: i64,
    /// Halved when the producer queue cannot hold a batch, reset on success.
    batch_size: u32,
}

impl Lane {
    /// The loop: one batch per turn until finished, aborted or lost. While
    /// a batch is in flight the next one is read: the lane's first pending
    /// rows other than the batch's, so a row that drew a lower id but
    /// committed late is read before every later row of its key. The
    /// read-ahead is used only if the batch ended `Done` (every row
    /// acknowledged and marked). When it comes back empty, at least every
    /// [`RESCAN_EVERY`], and after anything but `Done`, the lane reads in
    /// full instead.
    async fn publish(&mut self) {
        let mut ahead: Option<Vec<PendingRow>> = None;
        let mut rescanned = Instant::now();
        loop {
            if self.finish.is_cancelled() || self.abort.is_cancelled() {
                break;
            }
            match self.ensure_producer().await {
                Flow::Next => {}
                Flow::Retry => continue,
                Flow::Stop => break,
            }
            let rows = match ahead.take() {
                Some(rows) => {
                    self.state
                        .metrics
                        .timings
                        .prefetched
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    rows
                }
                None => {
                    rescanned = Instant::now();
                    match self.next_rows().await {
                        Ok(rows) => rows,
                        Err(Flow::Stop) => break,
                        Err(_) => continue,
                    }
                }
            };
            if rows.is_empty() {
                match self.idle().await {
                    Flow::Stop => break,
                    _ => continue,
                }
            }
            // Read ahead only outside isolation (one row at a time) and
            // until the next full read is due.
            let last = rows.last().map(|r| r.id).unwrap_or(0);
            let read_ahead = last > self.isolate_through && rescanned.elapsed() < RESCAN_EVERY;
            let (end, next) = if read_ahead {
                let in_flight: Vec<i64> = rows.iter().map(|r| r.id).collect();
                let (end, next) = tokio::join!(self.batch(&rows), self.read_besides(&in_flight));
                (end, next)
            } else {
                (self.batch(&rows).await, None)
            };
            let Some(end) = end else {
                // Lost mid-batch: whatever was acknowledged is republished by
                // the new owner (at least once), or fenced by it (exactly once).
                break;
            };
            if end == BatchEnd::Done {
                ahead = next.filter(|r| !r.is_empty());
            }
            if let Flow::Stop = self.after(end).await {
                break;
            }
        }
    }

    /// The lane's pending rows besides `in_flight` (read ahead while that
    /// batch is in flight); `None` when the read failed (the lane then reads
    /// in full).
    async fn read_besides(&self, in_flight: &[i64]) -> Option<Vec<PendingRow>> {
        match self
            .state
            .store
            .pending_besides(self.lease.lane, self.batch_size, in_flight)
            .await
        {
            Ok(r) => {
                let t = &self.state.metrics.timings;
                t.rows_read
                    .fetch_add(r.len() as u64, std::sync::atomic::Ordering::Relaxed);
                Some(r)
            }
            Err(e) => {
                tracing::debug!(lane = self.lease.lane, error = %e, "reading ahead failed");
                None
            }
        }
    }

    /// Exactly once, without a producer yet: takes the lane over (`Stop`
    /// when the lane is lost or the relay shuts down meanwhile).
    async fn ensure_producer(&mut self) -> Flow {
        let (Some(reader), None) = (&self.reader, &self.txn) else {
            return Flow::Next;
        };
        match take_over(
            &self.state,
            &self.cfg,
            reader,
            &self.database_id,
            self.lease,
            &self.finish,
            &self.abort,
        )
        .await
        {
            Ok(p) => {
                self.txn = Some(p);
                Flow::Next
            }
            Err(BatchEnd::Lost) => Flow::Stop,
            Err(_) => self.back_off().await,
        }
    }

    /// The lane's next pending rows: only the first while a poison row is
    /// being isolated. `Err` when reading failed (after backing off).
    async fn next_rows(&mut self) -> Result<Vec<PendingRow>, Flow> {
        let started = Instant::now();
        let read = self.state.store.pending_batch(self.lease.lane, self.batch_size).await;
        let t = &self.state.metrics.timings;
        Timings::add(&t.reads, &t.read_ns, started.elapsed());
        t.full_reads.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        match read {
            Ok(mut r) => {
                t.rows_read
                    .fetch_add(r.len() as u64, std::sync::atomic::Ordering::Relaxed);
                if r.first().is_some_and(|f| f.id <= self.isolate_through) {
                    r.truncate(1);
                }
                Ok(r)
            }
            Err(e) => {
                tracing::warn!(lane = self.lease.lane, error = %e, "reading the lane failed");
                Err(self.back_off().await)
            }
        }
    }

    /// Nothing pending: waits for this lane's wake-up (sent by the relay's
    /// probe, on `NOTIFY` and every poll interval), or ten poll intervals
    /// should the probe be failing.
    async fn idle(&self) -> Flow {
        let started = Instant::now();
        let notified = self.wake.lane(self.lease.lane).notified();
        let flow = tokio::select! {
            _ = notified => Flow::Retry,
            _ = tokio::time::sleep(self.cfg.poll_interval * 10) => Flow::Retry,
            _ = self.finish.cancelled() => Flow::Stop,
            _ = self.abort.cancelled() => Flow::Stop,
        };
        let t = &self.state.metrics.timings;
        Timings::add(&t.idles, &t.idle_ns, started.elapsed());
        flow
    }

    /// Publishes `rows` (non-empty) in the mode of the sink, in a
    /// `ferry.relay.batch` span; `None` when the lane was aborted mid-batch.
    /// At least once, a row being isolated (read alone, see
    /// [`Lane::next_rows`]) goes through the lone producer.
    async fn batch(&self, rows: &[PendingRow]) -> Option<BatchEnd> {
        let span = batch_span(self.lease, rows, self.producer.is_some());
        let started = Instant::now();
        let isolating = rows.len() == 1 && rows[0].id <= self.isolate_through;
        let batch = async {
            match (&self.producer, &self.txn) {
                (Some((_, l)), _) if isolating => {
                    lone(&self.state, &self.cfg, l, &self.database_id, self.lease, &rows[0]).await
                }
                (Some((p, _)), _) => {
                    at_least_once(&self.state, &self.cfg, p, &self.database_id, self.lease, rows).await
                }
                (None, Some(p)) => {
                    transactional_batch(
                        &self.state,
                        &self.cfg,
                        p,
                        &self.database_id,
                        self.lease,
                        rows,
                        &self.abort,
                    )
                    .await
                }
                (None, None) => BatchEnd::Stalled {
                    id: rows[0].id,
                    code: "no_producer",
                },
            }
        }
        .instrument(span.clone());
        let end = tokio::select! {
            end = batch => end,
            _ = self.abort.cancelled() => {
                span.record("outcome", "aborted");
                return None;
            }
        };
        let t = &self.state.metrics.timings;
        Timings::add(&t.batches, &t.batch_ns, started.elapsed());
        span.record("outcome", end.outcome());
        if let Some(code) = end.code() {
            span.record("code", code);
        }
        Some(end)
    }

    /// Acts on how a batch ended.
    async fn after(&mut self, end: BatchEnd) -> Flow {
        let lane = self.lease.lane;
        match end {
            BatchEnd::Done => {
                self.backoff = retry_backoff();
                self.batch_size = self.cfg.batch_size;
                Flow::Next
            }
            // The rest of the batch is read again, in full.
            BatchEnd::Unfinished => Flow::Next,
            // Taken over, or the producer fenced: the relay's next tick
            // releases the lane (fenced by its generation), so it is taken
            // again with a new task and producer if it is still free.
            BatchEnd::Lost => Flow::Stop,
            BatchEnd::Fatal => {
                tracing::error!(lane, "fatal producer error; the relay stops and exits to be restarted");
                self.state.fatal.cancel();
                Flow::Stop
            }
            BatchEnd::Reinit { id, code } => {
                tracing::warn!(lane, id, code, "transaction state unknown; taking the lane over again");
                self.txn = None;
                self.back_off().await
            }
            BatchEnd::Isolate { through, code } => {
                tracing::warn!(
                    lane,
                    through,
                    code,
                    "a produce request was refused whole; publishing one row at a time, alone, to find whether it is poison"
                );
                self.isolate_through = through;
                Flow::Next
            }
            BatchEnd::Stalled { id, code } => self.stalled(id, code).await,
        }
    }

    /// Stopped at row `id`: notes the error on the lane (fenced by its
    /// generation), then backs off.
    async fn stalled(&mut self, id: i64, code: &'static str) -> Flow {
        if code == "queue_full" {
            // The producer queue cannot hold a whole batch (a
            // transaction cannot wait for room): retry smaller.
            self.batch_size = (self.batch_size / 2).max(1);
        }
        if let Err(ferry::Error::LostLane { .. }) = self
            .state
            .store
            .note_publish_error(&self.state.owner, self.lease, id, code)
            .await
        {
            return Flow::Stop;
        }
        tracing::warn!(lane = self.lease.lane, id, code, "publish failed; backing off");
        self.back_off().await
    }

    /// Sleeps the next backoff step: `Stop` when told to stop meanwhile.
    async fn back_off(&mut self) -> Flow {
        if pause(&mut self.backoff, &self.finish, &self.abort).await {
            Flow::Stop
        } else {
            Flow::Retry
        }
    }
}

/// The span of one batch: which rows of which lane lease, in which mode.
/// `outcome` (and `code`, when it stopped on one) are recorded when it ends.
/// Never a key or a payload.
fn batch_span(lease: LaneLease, rows: &[PendingRow], at_least_once: bool) -> tracing::Span {
    tracing::info_span!(
        "ferry.relay.batch",
        lane = lease.lane,
        generation = lease.generation,
        first_id = rows.first().map(|r| r.id).unwrap_or(0),
        last_id = rows.last().map(|r| r.id).unwrap_or(0),
        count = rows.len(),
        mode = if at_least_once { "at_least_once" } else { "exactly_once" },
        outcome = tracing::field::Empty,
        code = tracing::field::Empty,
    )
}
