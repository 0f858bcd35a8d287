//! The claim loop: gathers free slots, claims a batch from the next queue,
//! backs off on errors, waits for wake-ups when idle, and spawns one task
//! per claimed job.

use std::future::Future;
use std::ops::ControlFlow;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;

use super::attempt::Attempt;
use super::completer::{Claim, Completer, Completion, Handoff, Slot};
use super::{Handler, WorkerConfig, WorkerStats};
use crate::error::{Error, Result};
use crate::jobs::Claimed;
use crate::store::Wakeup;
use crate::Ferry;

/// A running worker's state between claims. Shutdown (`shut_down`) consumes it.
pub(super) struct ClaimLoop<H> {
    pub(super) ferry: Ferry,
    pub(super) cfg: Arc<WorkerConfig>,
    handler: Arc<H>,
    stats: Arc<WorkerStats>,
    /// Cancelled at shutdown: handlers are signalled and may finish.
    pub(super) soft: CancellationToken,
    /// Cancelled after the grace period: handlers are dropped and released.
    pub(super) hard: CancellationToken,
    slots: Arc<Semaphore>,
    rng: Arc<Mutex<StdRng>>,
    wake: Wakeup,
    pub(super) completions: mpsc::Sender<Completion>,
    /// Jobs the completer claimed with completions, to spawn on their slots.
    pub(super) handoff: mpsc::UnboundedReceiver<Handoff>,
    /// Notified when a completion's claim came back full (the queue is not empty).
    more_work: Arc<tokio::sync::Notify>,
    /// Signalled whenever an attempt answers or ends (see [`Claim`]).
    answered: Arc<tokio::sync::Notify>,
    pub(super) tasks: JoinSet<()>,
    backoff: ExponentialBackoff,
    next_queue: usize,
    idle_queues: usize,
    claims_since_reap: u32,
}

impl<H: Handler> ClaimLoop<H> {
    /// Sets up the slots, the jitter RNG, the wake-up listener and the
    /// completer task.
    pub(super) async fn start(
        ferry: Ferry,
        cfg: Arc<WorkerConfig>,
        handler: Arc<H>,
        stats: Arc<WorkerStats>,
    ) -> (Self, JoinHandle<()>) {
        let soft = CancellationToken::new();
        let hard = CancellationToken::new();
        let slots = Arc::new(Semaphore::new(cfg.concurrency));
        let rng = Arc::new(Mutex::new(match cfg.rng_seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_os_rng(),
        }));
        let wake = ferry.wakeup(cfg.poll_interval).await;
        let (completions, completed) = mpsc::channel(cfg.concurrency.max(1));
        let (handoff_tx, handoff) = mpsc::unbounded_channel();
        let more_work = Arc::new(tokio::sync::Notify::new());
        let answered = Arc::new(tokio::sync::Notify::new());
        let completer = Completer {
            ferry: ferry.clone(),
            cfg: cfg.clone(),
            stats: stats.clone(),
            soft: soft.clone(),
            handoff: handoff_tx,
            more_work: more_work.clone(),
            answered: answered.clone(),
        };
        let completer =
            tokio::spawn(completer.run(completed, cfg.concurrency.clamp(1, 500), cfg.completions_in_flight));
        let claims = ClaimLoop {
            ferry,
            cfg,
            handler,
            stats,
            soft,
            hard,
            slots,
            rng,
            wake,
            completions,
            handoff,
            more_work,
            answered,
            tasks: JoinSet::new(),
            backoff: reconnect_backoff(),
            next_queue: 0,
            idle_queues: 0,
            claims_since_reap: 0,
        };
        (claims, completer)
    }

    /// Claims and spawns until `shutdown` resolves. Fails only if the slots
    /// are closed.
    pub(super) async fn serve<S: Future<Output = ()>>(&mut self, mut shutdown: Pin<&mut S>) -> Result<()> {
        loop {
            while self.tasks.try_join_next().is_some() {}
            let permit = tokio::select! {
                _ = &mut shutdown => return Ok(()),
                Some((jobs, permits, sent)) = self.handoff.recv() => {
                    self.spawn(jobs, permits, sent);
                    continue;
                }
                p = self.slots.clone().acquire_owned() => p.map_err(|_| Error::ShuttingDown("worker slots closed"))?,
            };
            let queue = self.next_queue();
            self.reap_now_and_then(&queue).await;
            let permits = self.gather(permit).await;
            let want = permits.len() as u32;
            let claim_sent = tokio::time::Instant::now();
            self.stats.claim_statements.fetch_add(1, Ordering::Relaxed);
            let claimed = match self
                .ferry
                .jobs()
                .claim(&queue, &self.cfg.owner, self.cfg.lease, want)
                .await
            {
                Ok(c) => {
                    self.stats
                        .claimed_by_claim_loop
                        .fetch_add(c.len() as u64, Ordering::Relaxed);
                    self.backoff = reconnect_backoff();
                    c
                }
                Err(e) => {
                    drop(permits);
                    match self.back_off(e, shutdown.as_mut()).await {
                        ControlFlow::Break(()) => return Ok(()),
                        ControlFlow::Continue(()) => continue,
                    }
                }
            };
            if claimed.is_empty() {
                drop(permits);
                if self.idle(shutdown.as_mut()).await.is_break() {
                    return Ok(());
                }
                continue;
            }
            self.idle_queues = 0;
            self.spawn(claimed, permits, claim_sent);
        }
    }

    /// The next queue, round-robin.
    fn next_queue(&mut self) -> String {
        let queue = self.cfg.queues[self.next_queue % self.cfg.queues.len()].clone();
        self.next_queue = self.next_queue.wrapping_add(1);
        queue
    }

    /// Terminalizes `queue`'s exhausted jobs before every 64th claim.
    async fn reap_now_and_then(&mut self, queue: &str) {
        if self.claims_since_reap == 0 {
            if let Err(e) = self.ferry.jobs().reap_exhausted(queue, 100).await {
                tracing::warn!(error = %e, code = e.code(), "reaping exhausted jobs failed");
            }
        }
        self.claims_since_reap = (self.claims_since_reap + 1) % 64;
    }

    /// Gathers free slots for a moment, so claims (and the completions
    /// that follow) come in batches instead of one job per transaction.
    async fn gather(&self, permit: OwnedSemaphorePermit) -> Vec<OwnedSemaphorePermit> {
        let mut permits = vec![permit];
        let target = (self.cfg.batch.max(1) as usize).min(self.cfg.concurrency);
        let deadline = tokio::time::Instant::now() + self.cfg.claim_window;
        while permits.len() < target {
            match self.slots.clone().try_acquire_owned() {
                Ok(p) => permits.push(p),
                Err(_) => match tokio::time::timeout_at(deadline, self.slots.clone().acquire_owned()).await {
                    Ok(Ok(p)) => permits.push(p),
                    _ => break,
                },
            }
        }
        permits
    }

    /// Waits out a failed claim; breaks when `shutdown` resolves first.
    /// Jobs the completer claims meanwhile are spawned at once: their leases
    /// run while they wait, and nothing renews a job that has not started.
    async fn back_off<S: Future<Output = ()>>(&mut self, e: Error, mut shutdown: Pin<&mut S>) -> ControlFlow<()> {
        let delay = self.backoff.next().unwrap_or(Duration::from_secs(5));
        tracing::warn!(error = %e, code = e.code(), ?delay, "claim failed; backing off");
        let until = tokio::time::Instant::now() + delay;
        loop {
            tokio::select! {
                _ = shutdown.as_mut() => return ControlFlow::Break(()),
                _ = tokio::time::sleep_until(until) => return ControlFlow::Continue(()),
                Some((jobs, permits, sent)) = self.handoff.recv() => self.spawn(jobs, permits, sent),
            }
        }
    }

    /// After an empty claim: once every queue came back empty in a row,
    /// waits for a wake-up or the jittered poll interval; breaks when
    /// `shutdown` resolves first.
    async fn idle<S: Future<Output = ()>>(&mut self, shutdown: Pin<&mut S>) -> ControlFlow<()> {
        self.idle_queues += 1;
        if self.idle_queues >= self.cfg.queues.len() {
            self.idle_queues = 0;
            let jitter = self
                .rng
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .random_range(0.8..1.2);
            let wait = self.cfg.poll_interval.mul_f64(jitter);
            self.stats.idle_waits.fetch_add(1, Ordering::Relaxed);
            tokio::select! {
                _ = shutdown => return ControlFlow::Break(()),
                _ = self.wake.wait(wait) => {}
                // Jobs claimed with completions meanwhile are spawned at once.
                Some((jobs, permits, sent)) = self.handoff.recv() => self.spawn(jobs, permits, sent),
                // An empty claim can race with a full one (rows it skipped):
                // poll again as soon as a completion found more work.
                _ = self.more_work.notified() => {}
            }
        }
        ControlFlow::Continue(())
    }

    /// Spawns one task per claimed job, each holding one slot; the jobs of
    /// an operation the handler batches ([`Handler::batch_size`]) go in
    /// calls of at most that many, one task per call, each job still
    /// holding its slot.
    pub(super) fn spawn(
        &mut self,
        claimed: Vec<Claimed>,
        permits: Vec<OwnedSemaphorePermit>,
        claim_sent: tokio::time::Instant,
    ) {
        let mut batches: Vec<(usize, Vec<Claimed>, Vec<Slot>)> = Vec::new();
        // Every job of the claim counts before any of them runs (one that
        // answered at once would otherwise find its claim complete). Fewer
        // jobs than slots: the extra permits drop here.
        let claim = Claim::new(&self.answered);
        let slots: Vec<Slot> = permits
            .into_iter()
            .take(claimed.len())
            .map(|permit| Slot::new(permit, &claim))
            .collect();
        for (job, slot) in claimed.into_iter().zip(slots) {
            let attempt = self.attempt(claim_sent);
            let handler = self.handler.clone();
            let Some(size) = handler.batch_size(&job.operation) else {
                self.tasks.spawn(async move {
                    attempt.run(handler, job, slot).await;
                });
                continue;
            };
            let open = batches
                .iter_mut()
                .find(|(size, jobs, _)| jobs.len() < *size && jobs[0].operation == job.operation);
            match open {
                Some((_, jobs, slots)) => {
                    jobs.push(job);
                    slots.push(slot);
                }
                None => batches.push((size.max(1), vec![job], vec![slot])),
            }
        }
        for (_, jobs, slots) in batches {
            let attempt = self.attempt(claim_sent);
            let handler = self.handler.clone();
            self.tasks.spawn(async move {
                attempt.run_batch(handler, jobs, slots).await;
            });
        }
    }

    /// What an attempt (or a batch call) of jobs claimed at `claim_sent` needs.
    fn attempt(&self, claim_sent: tokio::time::Instant) -> Attempt {
        Attempt {
            completions: self.completions.clone(),
            ferry: self.ferry.clone(),
            cfg: self.cfg.clone(),
            stats: self.stats.clone(),
            rng: self.rng.clone(),
            soft: self.soft.clone(),
            hard: self.hard.clone(),
            claim_sent,
        }
    }
}

fn reconnect_backoff() -> ExponentialBackoff {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(50))
        .with_max_delay(Duration::from_secs(5))
        .with_jitter()
        .without_max_times()
        .build()
}
