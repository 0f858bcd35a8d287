//! The worker runtime: serves named queues with `concurrency` slots, renews
//! leases every ~lease/3, cancels a handler whose lease is lost (it publishes
//! nothing more), and shuts down gracefully from a shutdown future.
//!
//! A worker also stops a handler on its own once the lease expiry it last
//! learned has passed by its clock, even while renewals only fail
//! transiently: the handler's future is dropped, and its [`JobContext`]
//! refuses every later effect write with [`Error::LostLease`].
//!
//! No transaction is ever held open while a handler runs: a claim, each
//! renewal and the final transition are separate short transactions.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder, Retryable};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;
use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::effects::{EffectRecord, Reservation, Resolution};
use crate::error::{Error, Result};
use crate::jobs::{Claimed, ErrorClass, FailOutcome, JobError, Lease};
use crate::retry::RetryPolicy;
use crate::{Clock, Ferry};

/// A job handler: an async function of the claimed job and its context.
/// Closures `Fn(Claimed, JobContext) -> impl Future<Output = Result<Value, JobError>>` are handlers.
pub trait Handler: Send + Sync + 'static {
    /// Works one attempt. `Ok(result)` completes the run with `result`.
    fn handle(
        &self,
        job: Claimed,
        ctx: JobContext,
    ) -> impl Future<Output = std::result::Result<Value, JobError>> + Send;
}

impl<F, Fut> Handler for F
where
    F: Fn(Claimed, JobContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = std::result::Result<Value, JobError>> + Send,
{
    fn handle(
        &self,
        job: Claimed,
        ctx: JobContext,
    ) -> impl Future<Output = std::result::Result<Value, JobError>> + Send {
        self(job, ctx)
    }
}

/// What a handler gets beside the job: its lease, the effect ledger under
/// that lease, and a token cancelled on shutdown, cancellation or lease loss.
/// Once the worker gives the attempt up (lease lost, or the expiry it last
/// learned has passed), the effect methods refuse with [`Error::LostLease`]
/// without writing, in clones held by spawned tasks too.
#[derive(Debug, Clone)]
pub struct JobContext {
    ferry: Ferry,
    lease: Lease,
    cancel: CancellationToken,
    watch: Arc<LeaseWatch>,
}

impl JobContext {
    /// The lease this attempt holds.
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// Cancelled when the handler should stop: shutdown, run cancelled, or lease lost.
    pub fn cancellation(&self) -> &CancellationToken {
        &self.cancel
    }

    /// [`Ferry::reserve_effect`] under this lease.
    pub async fn reserve_effect(&self, step: &str, operation: &str) -> Result<Reservation> {
        self.live()?;
        self.ferry.reserve_effect(&self.lease, step, operation).await
    }

    /// [`Ferry::record_effect_success`] under this lease.
    pub async fn record_effect_success(&self, step: &str, operation: &str, provider_ref: &str) -> Result<EffectRecord> {
        self.live()?;
        self.ferry
            .record_effect_success(&self.lease, step, operation, provider_ref)
            .await
    }

    /// [`Ferry::record_effect_failure`] under this lease.
    pub async fn record_effect_failure(
        &self,
        step: &str,
        operation: &str,
        code: &str,
        ambiguous: bool,
    ) -> Result<EffectRecord> {
        self.live()?;
        self.ferry
            .record_effect_failure(&self.lease, step, operation, code, ambiguous)
            .await
    }

    /// [`Ferry::reconcile_effect`] under this lease.
    pub async fn reconcile_effect(&self, step: &str, operation: &str, resolution: Resolution) -> Result<Reservation> {
        self.live()?;
        self.ferry
            .reconcile_effect(&self.lease, step, operation, resolution)
            .await
    }

    /// Refuses locally once the worker has given the attempt up or the
    /// known expiry has passed; the database fence still checks the rest.
    fn live(&self) -> Result<()> {
        if self.watch.expired() {
            return Err(Error::LostLease {
                run_id: self.lease.run_id,
                generation: self.lease.generation,
            });
        }
        Ok(())
    }
}

/// What a worker knows of one lease: the expiry the database last reported
/// and, for the database clock, the same instant on the worker's monotonic
/// clock (measured from when the claim or renewal was sent, so it is never
/// later than the database's). With an injected clock the expiry is compared
/// with that clock, the one the database is told.
#[derive(Debug)]
struct LeaseWatch {
    clock: Clock,
    known: Mutex<KnownExpiry>,
    revoked: AtomicBool,
}

#[derive(Debug, Clone, Copy)]
struct KnownExpiry {
    expires_at: i64,
    local: tokio::time::Instant,
}

impl LeaseWatch {
    fn new(clock: Clock, expires_at: i64, now: i64, sent: tokio::time::Instant) -> Self {
        LeaseWatch {
            clock,
            known: Mutex::new(KnownExpiry::new(expires_at, now, sent)),
            revoked: AtomicBool::new(false),
        }
    }

    /// Records a successful renewal: `expires_at` computed at database time
    /// `now`, for a request sent at `sent`.
    fn learn(&self, expires_at: i64, now: i64, sent: tokio::time::Instant) {
        *self.known.lock().unwrap_or_else(|p| p.into_inner()) = KnownExpiry::new(expires_at, now, sent);
    }

    fn known(&self) -> KnownExpiry {
        *self.known.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The attempt was given up: nothing more may be written under it.
    fn revoke(&self) {
        self.revoked.store(true, Ordering::SeqCst);
    }

    /// Revoked, or past the known expiry by the worker's clock.
    fn expired(&self) -> bool {
        if self.revoked.load(Ordering::SeqCst) {
            return true;
        }
        let known = self.known();
        match self.clock.param() {
            Some(now) => now >= known.expires_at,
            None => tokio::time::Instant::now() >= known.local,
        }
    }

    /// When the known expiry passes on the worker's monotonic clock; `None`
    /// with an injected clock, which is checked at every renewal tick.
    fn local_deadline(&self) -> Option<tokio::time::Instant> {
        match self.clock {
            Clock::Database => Some(self.known().local),
            Clock::Manual(_) => None,
        }
    }
}

impl KnownExpiry {
    fn new(expires_at: i64, now: i64, sent: tokio::time::Instant) -> Self {
        let left = Duration::from_millis(u64::try_from(expires_at.saturating_sub(now)).unwrap_or(0));
        KnownExpiry {
            expires_at,
            local: sent + left,
        }
    }
}

/// Resolves at `at`, or never.
async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Worker settings.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Queues served, claimed round-robin.
    pub queues: Vec<String>,
    /// Handlers running at once.
    pub concurrency: usize,
    /// Most jobs taken per claim statement.
    pub batch: u32,
    /// How long the loop waits for more free slots before a claim, so claims
    /// and completions batch under load (default 2 ms).
    pub claim_window: Duration,
    /// Lease duration.
    pub lease: Duration,
    /// Renewal period (default lease/3).
    pub renew_every: Option<Duration>,
    /// Longest idle wait before polling again (a lost NOTIFY costs at most this).
    pub poll_interval: Duration,
    /// How long shutdown waits for running handlers before releasing their jobs.
    pub grace: Duration,
    /// Retry schedule.
    pub retry: RetryPolicy,
    /// This worker's identity in leases and attempt history.
    pub owner: String,
    /// Seed of the jitter RNG (random when `None`).
    pub rng_seed: Option<u64>,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            queues: vec!["default".into()],
            concurrency: 100,
            batch: 50,
            claim_window: Duration::from_millis(2),
            lease: Duration::from_secs(30),
            renew_every: None,
            poll_interval: Duration::from_millis(500),
            grace: Duration::from_secs(10),
            retry: RetryPolicy::default(),
            owner: format!("worker-{}", uuid::Uuid::now_v7().simple()),
            rng_seed: None,
        }
    }
}

/// Counts of what a worker did, read after [`Worker::run`] returns.
#[derive(Debug, Default)]
pub struct WorkerStats {
    /// Completed runs.
    pub completed: AtomicU64,
    /// Attempts requeued for retry.
    pub retried: AtomicU64,
    /// Jobs made dead.
    pub dead: AtomicU64,
    /// Attempts abandoned because the lease was lost, the run cancelled, or
    /// the lease expiry the worker last learned passed without a renewal.
    pub lost: AtomicU64,
    /// Jobs given back at shutdown.
    pub released: AtomicU64,
}

/// Serves queues with a [`Handler`].
pub struct Worker<H> {
    ferry: Ferry,
    config: WorkerConfig,
    handler: Arc<H>,
    stats: Arc<WorkerStats>,
}

impl<H: Handler> Worker<H> {
    /// A worker with `config` running `handler`.
    pub fn new(ferry: Ferry, config: WorkerConfig, handler: H) -> Self {
        Worker {
            ferry,
            config,
            handler: Arc::new(handler),
            stats: Arc::new(WorkerStats::default()),
        }
    }

    /// Live counters (shared with the running worker).
    pub fn stats(&self) -> Arc<WorkerStats> {
        self.stats.clone()
    }

    /// Runs until `shutdown` resolves, then stops claiming, signals running
    /// attempts, waits up to the grace period, and releases (compare-and-set)
    /// only the jobs it still owns. Anything else is recovered by lease expiry.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<()> {
        let cfg = Arc::new(self.config);
        if cfg.queues.is_empty() || cfg.concurrency == 0 {
            return Err(Error::Config("a worker needs at least one queue and one slot".into()));
        }
        for q in &cfg.queues {
            self.ferry.limits().name("queue", q)?;
        }
        let soft = CancellationToken::new();
        let hard = CancellationToken::new();
        let slots = Arc::new(Semaphore::new(cfg.concurrency));
        let rng = Arc::new(Mutex::new(match cfg.rng_seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_os_rng(),
        }));
        let mut wake = crate::store::Wakeup::connect(self.ferry.db()).await;
        let (completions, completed) = mpsc::channel(cfg.concurrency.max(1));
        let completer = tokio::spawn(completer(self.ferry.clone(), completed, cfg.concurrency.clamp(1, 500)));
        let mut tasks = JoinSet::new();
        let mut backoff = reconnect_backoff();
        let mut next_queue = 0usize;
        let mut idle_queues = 0usize;
        let mut claims_since_reap = 0u32;
        tokio::pin!(shutdown);
        loop {
            while tasks.try_join_next().is_some() {}
            let permit = tokio::select! {
                _ = &mut shutdown => break,
                p = slots.clone().acquire_owned() => p.map_err(|_| Error::ShuttingDown("worker slots closed"))?,
            };
            let queue = cfg.queues[next_queue % cfg.queues.len()].clone();
            next_queue = next_queue.wrapping_add(1);
            if claims_since_reap == 0 {
                if let Err(e) = self.ferry.reap_exhausted(&queue, 100).await {
                    tracing::warn!(error = %e, code = e.code(), "reaping exhausted jobs failed");
                }
            }
            claims_since_reap = (claims_since_reap + 1) % 64;
            // Gather free slots for a moment, so claims (and the completions
            // that follow) come in batches instead of one job per transaction.
            let mut permits = vec![permit];
            let target = (cfg.batch.max(1) as usize).min(cfg.concurrency);
            let deadline = tokio::time::Instant::now() + cfg.claim_window;
            while permits.len() < target {
                match slots.clone().try_acquire_owned() {
                    Ok(p) => permits.push(p),
                    Err(_) => match tokio::time::timeout_at(deadline, slots.clone().acquire_owned()).await {
                        Ok(Ok(p)) => permits.push(p),
                        _ => break,
                    },
                }
            }
            let want = permits.len() as u32;
            let claim_sent = tokio::time::Instant::now();
            let claimed = match self.ferry.claim(&queue, &cfg.owner, cfg.lease, want).await {
                Ok(c) => {
                    backoff = reconnect_backoff();
                    c
                }
                Err(e) => {
                    drop(permits);
                    let delay = backoff.next().unwrap_or(Duration::from_secs(5));
                    tracing::warn!(error = %e, code = e.code(), ?delay, "claim failed; backing off");
                    tokio::select! {
                        _ = &mut shutdown => break,
                        _ = tokio::time::sleep(delay) => continue,
                    }
                }
            };
            if claimed.is_empty() {
                drop(permits);
                idle_queues += 1;
                if idle_queues >= cfg.queues.len() {
                    idle_queues = 0;
                    let jitter = rng.lock().unwrap_or_else(|p| p.into_inner()).random_range(0.8..1.2);
                    let wait = cfg.poll_interval.mul_f64(jitter);
                    tokio::select! {
                        _ = &mut shutdown => break,
                        _ = wake.wait(wait) => {}
                    }
                }
                continue;
            }
            idle_queues = 0;
            // Fewer jobs than slots: the extra permits drop here.
            for (job, slot) in claimed.into_iter().zip(permits) {
                let attempt = Attempt {
                    completions: completions.clone(),
                    ferry: self.ferry.clone(),
                    cfg: cfg.clone(),
                    stats: self.stats.clone(),
                    rng: rng.clone(),
                    soft: soft.clone(),
                    hard: hard.clone(),
                    claim_sent,
                };
                let handler = self.handler.clone();
                tasks.spawn(async move {
                    attempt.run(handler, job, slot).await;
                });
            }
        }
        soft.cancel();
        let drained = tokio::time::timeout(cfg.grace, async { while tasks.join_next().await.is_some() {} }).await;
        if drained.is_err() {
            hard.cancel();
            while tasks.join_next().await.is_some() {}
        }
        drop(completions);
        let _ = completer.await;
        Ok(())
    }
}

fn reconnect_backoff() -> impl Iterator<Item = Duration> {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(50))
        .with_max_delay(Duration::from_secs(5))
        .with_jitter()
        .without_max_times()
        .build()
}

/// A finished handler's result on its way to the completer, and where to
/// send the outcome.
type Completion = (Lease, Value, oneshot::Sender<Result<()>>);

/// Completes finished jobs in batches: whatever queued up while the previous
/// commit ran goes into the next one, so completions share commits under load
/// without delaying a lone job.
async fn completer(ferry: Ferry, mut rx: mpsc::Receiver<Completion>, max_batch: usize) {
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        while batch.len() < max_batch {
            match rx.try_recv() {
                Ok(item) => batch.push(item),
                Err(_) => break,
            }
        }
        let items: Vec<(Lease, Value)> = batch.iter().map(|(l, v, _)| (l.clone(), v.clone())).collect();
        let outcome = (|| async { ferry.complete_batch(&items).await })
            .retry(ExponentialBuilder::default().with_max_times(5))
            .when(Error::is_transient)
            .await;
        match outcome {
            Ok(results) => {
                for ((_, _, reply), r) in batch.into_iter().zip(results) {
                    let _ = reply.send(r);
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, code = e.code(), size = items.len(), "batch completion failed; completing one by one");
                for (lease, value, reply) in batch {
                    let one = (|| async { ferry.complete(&lease, &value).await })
                        .retry(ExponentialBuilder::default().with_max_times(5))
                        .when(Error::is_transient)
                        .await;
                    let _ = reply.send(one);
                }
            }
        }
    }
}

/// Everything one attempt's task needs.
struct Attempt {
    completions: mpsc::Sender<Completion>,
    ferry: Ferry,
    cfg: Arc<WorkerConfig>,
    stats: Arc<WorkerStats>,
    rng: Arc<Mutex<StdRng>>,
    soft: CancellationToken,
    hard: CancellationToken,
    /// When the claim was sent: the start of the lease on the worker's clock.
    claim_sent: tokio::time::Instant,
}

impl Attempt {
    /// Works one attempt. The slot is given back as soon as the handler is
    /// done, so the next claim overlaps this attempt's completion commit.
    async fn run<H: Handler>(self, handler: Arc<H>, job: Claimed, slot: tokio::sync::OwnedSemaphorePermit) {
        let lease = job.lease.clone();
        let watch = Arc::new(LeaseWatch::new(
            self.ferry.clock().clone(),
            job.lease_expires_at,
            job.claimed_at,
            self.claim_sent,
        ));
        let ctx = JobContext {
            ferry: self.ferry.clone(),
            lease: lease.clone(),
            cancel: CancellationToken::new(),
            watch: watch.clone(),
        };
        let cancel = ctx.cancel.clone();
        // Boxed so it can be dropped before a hard release: a handler stopped
        // inside a transaction gives its connection back, and the pool rolls
        // it back (in the background) so the release gets the job row.
        let mut work = Box::pin(handler.handle(job, ctx));
        let every = self
            .cfg
            .renew_every
            .unwrap_or(self.cfg.lease / 3)
            .max(Duration::from_millis(1));
        let mut renew = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        // The renewal in flight runs beside the handler, never instead of it:
        // a handler paused inside a transaction that holds the job row would
        // otherwise block the very renewal that waits for it.
        let mut renewing = None;
        let mut signalled = false;
        let outcome = loop {
            tokio::select! {
                out = &mut work => break Some(out),
                // The known expiry passed on the worker's clock while no
                // renewal succeeded: the lease may already be someone else's.
                _ = sleep_until_some(watch.local_deadline()) => {
                    return self.abandon(&watch, &cancel, &lease, "lease_expired");
                }
                _ = renew.tick(), if renewing.is_none() => {
                    if watch.expired() {
                        return self.abandon(&watch, &cancel, &lease, "lease_expired");
                    }
                    let sent = tokio::time::Instant::now();
                    let renewal = self.ferry.renew_at(&lease, self.cfg.lease);
                    let deadline = watch.local_deadline();
                    renewing = Some(Box::pin(async move {
                        // A renewal that hangs past the known expiry is as good as failed.
                        let renewed = match deadline {
                            Some(at) => tokio::time::timeout_at(at, renewal).await.ok(),
                            None => Some(renewal.await),
                        };
                        (renewed, sent)
                    }));
                }
                (renewed, sent) = async { renewing.as_mut().expect("guarded by is_some").await }, if renewing.is_some() => {
                    renewing = None;
                    match renewed {
                        Some(Ok((expires_at, now))) => watch.learn(expires_at, now, sent),
                        Some(Err(e)) if e.is_transient() => {
                            if watch.expired() {
                                return self.abandon(&watch, &cancel, &lease, "lease_expired");
                            }
                            tracing::warn!(error = %e, "lease renewal failed; retrying at the next tick");
                        }
                        // Lost, cancelled or past the deadline: stop the
                        // handler and publish nothing more for this attempt.
                        Some(Err(e)) => return self.abandon(&watch, &cancel, &lease, e.code()),
                        None => return self.abandon(&watch, &cancel, &lease, "lease_expired"),
                    }
                }
                _ = self.soft.cancelled(), if !signalled => {
                    signalled = true;
                    cancel.cancel();
                }
                _ = self.hard.cancelled() => {
                    cancel.cancel();
                    break None;
                }
            }
        };
        // A renewal still in flight is abandoned with the loop, so its
        // connection goes back to the pool before the completion needs one.
        drop(renewing);
        let Some(outcome) = outcome else {
            drop(work);
            self.release(&lease).await;
            return;
        };
        drop(slot);
        match outcome {
            Ok(result) => {
                let (reply, answer) = oneshot::channel();
                let done = match self.completions.send((lease.clone(), result, reply)).await {
                    Ok(()) => answer
                        .await
                        .unwrap_or_else(|_| Err(Error::ShuttingDown("completer stopped"))),
                    Err(_) => Err(Error::ShuttingDown("completer stopped")),
                };
                match done {
                    Ok(()) => {
                        self.stats.completed.fetch_add(1, Ordering::Relaxed);
                    }
                    // A retried complete whose first commit landed.
                    Err(Error::RunTerminal { state, .. }) if state == "succeeded" => {
                        self.stats.completed.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        self.stats.lost.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(run_id = %lease.run_id, code = e.code(), "completion refused");
                    }
                }
            }
            Err(err) if signalled && err.class == ErrorClass::Retryable => self.release(&lease).await,
            Err(err) => {
                let failed = (|| async {
                    let mut rng = self.rng.lock().unwrap_or_else(|p| p.into_inner()).clone();
                    let out = self.ferry.fail(&lease, &err, &self.cfg.retry, &mut rng).await;
                    *self.rng.lock().unwrap_or_else(|p| p.into_inner()) = rng;
                    out
                })
                .retry(ExponentialBuilder::default().with_max_times(5))
                .when(Error::is_transient)
                .await;
                match failed {
                    Ok(FailOutcome::Retried { .. }) => {
                        self.stats.retried.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(FailOutcome::Dead { .. }) => {
                        self.stats.dead.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        self.stats.lost.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(run_id = %lease.run_id, code = e.code(), "failure not recorded");
                    }
                }
            }
        }
    }

    /// Gives the attempt up: the handler's token is cancelled, its context
    /// refuses further writes, and returning drops its future.
    fn abandon(&self, watch: &LeaseWatch, cancel: &CancellationToken, lease: &Lease, code: &str) {
        watch.revoke();
        cancel.cancel();
        self.stats.lost.fetch_add(1, Ordering::Relaxed);
        tracing::info!(run_id = %lease.run_id, code, "attempt abandoned");
    }

    async fn release(&self, lease: &Lease) {
        match self.ferry.release(lease).await {
            Ok(()) => {
                self.stats.released.fetch_add(1, Ordering::Relaxed);
            }
            // Never "release" a lease that is already gone: expiry recovers it.
            Err(e) => tracing::info!(run_id = %lease.run_id, code = e.code(), "job not released"),
        }
    }
}
