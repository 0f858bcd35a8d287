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
//!
//! The module is split by role: settings and counters (`config`), the
//! handler's context (`context`) and what it knows of its lease
//! (`lease_watch`), the claim loop (`claim`), one attempt with its renewals
//! (`attempt`), batched completions (`completer`), shutdown and release
//! (`shutdown`), dispatch by operation ([`Router`]), and batch handlers
//! that take many jobs of one operation in one call (`batch`).

mod attempt;
mod batch;
mod claim;
mod completer;
mod config;
mod context;
mod lease_watch;
mod router;
mod shutdown;

use std::future::Future;
use std::sync::Arc;

use serde_json::Value;

use crate::error::{Error, Result};
use crate::jobs::{Claimed, JobError};
use crate::Ferry;

pub use config::{WorkerConfig, WorkerStats};
pub use context::JobContext;
pub use router::{Router, BATCH_ANSWER_COUNT, INVALID_COMMAND, UNKNOWN_OPERATION};

/// A job handler: an async function of the claimed job and its context.
/// Closures `Fn(Claimed, JobContext) -> impl Future<Output = Result<Value, JobError>>` are handlers,
/// and so is a [`Router`], which dispatches on [`Claimed::operation`] to
/// handlers of typed commands.
pub trait Handler: Send + Sync + 'static {
    /// Works one attempt. `Ok(result)` completes the run with `result`;
    /// `Err` is recorded by its [`ErrorClass`](crate::ErrorClass) (retried,
    /// dead, or reconciled first when ambiguous).
    fn handle(
        &self,
        job: Claimed,
        ctx: JobContext,
    ) -> impl Future<Output = std::result::Result<Value, JobError>> + Send;

    /// The most jobs of `operation` one [`Handler::handle_batch`] call
    /// takes, or `None` (the default) when its jobs are handled one by one.
    /// The worker groups the jobs of each claim by operation and hands a
    /// batched operation's jobs over in calls of at most this many.
    fn batch_size(&self, operation: &str) -> Option<usize> {
        let _ = operation;
        None
    }

    /// Works one attempt of each job (all of one operation that
    /// [`Handler::batch_size`] batches), each with its own context and
    /// lease, and answers per job, in order: `Ok` completes that run,
    /// `Err` is recorded for that job alone, exactly as [`Handler::handle`]'s
    /// answer. The default handles each job with [`Handler::handle`],
    /// concurrently.
    fn handle_batch(
        &self,
        jobs: Vec<(Claimed, JobContext)>,
    ) -> impl Future<Output = Vec<std::result::Result<Value, JobError>>> + Send {
        futures::future::join_all(jobs.into_iter().map(|(job, ctx)| self.handle(job, ctx)))
    }
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

/// Serves queues with a [`Handler`]: claims jobs under fenced leases, runs
/// each attempt beside its lease renewals, and records the outcome.
/// Build it with [`Worker::new`], read its counters with [`Worker::stats`],
/// and run it with [`Worker::run`].
pub struct Worker<H> {
    ferry: Ferry,
    config: WorkerConfig,
    handler: Arc<H>,
    stats: Arc<WorkerStats>,
}

impl<H: Handler> Worker<H> {
    /// A worker with `config` running `handler`: a closure of
    /// `(Claimed, JobContext)` or a [`Router`]. Nothing is claimed until
    /// [`Worker::run`].
    pub fn new(ferry: Ferry, config: WorkerConfig, handler: H) -> Self {
        Worker {
            ferry,
            config,
            handler: Arc::new(handler),
            stats: Arc::new(WorkerStats::default()),
        }
    }

    /// Live counters, shared with the running worker: clone the `Arc` before
    /// [`Worker::run`] consumes the worker, and read it any time.
    pub fn stats(&self) -> Arc<WorkerStats> {
        self.stats.clone()
    }

    /// Runs until `shutdown` resolves, then stops claiming, signals running
    /// attempts, waits up to the grace period, and releases (compare-and-set)
    /// only the jobs it still owns. Anything else is recovered by lease expiry.
    ///
    /// Fails at once with [`Error::Config`] without a queue or a slot, when
    /// the renewal period is not shorter than the lease (every lease would
    /// run out before its renewal), when a non-zero completion window is not
    /// shorter than half of the lease left after a renewal period (10 s with
    /// the defaults), or when a queue name breaks the limits.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<()> {
        let cfg = Arc::new(self.config);
        if cfg.queues.is_empty() || cfg.concurrency == 0 {
            return Err(Error::Config("a worker needs at least one queue and one slot".into()));
        }
        if cfg.renew_period() >= cfg.lease {
            return Err(Error::Config(format!(
                "renew_every ({:?}) must be shorter than the lease ({:?})",
                cfg.renew_period(),
                cfg.lease
            )));
        }
        // A bound on the window, not the safety margin: each completion's
        // wait also ends a renewal period before its own lease runs out
        // (`Completer::gather`).
        let room = cfg.lease.saturating_sub(cfg.renew_period()) / 2;
        if !cfg.completion_window.is_zero() && cfg.completion_window >= room {
            return Err(Error::Config(format!(
                "completion_window ({:?}) must be shorter than half of the lease left after a renewal period ({:?})",
                cfg.completion_window, room
            )));
        }
        for q in &cfg.queues {
            self.ferry.limits().name("queue", q)?;
        }
        let (mut claims, completer) = claim::ClaimLoop::start(self.ferry, cfg, self.handler, self.stats).await;
        tokio::pin!(shutdown);
        claims.serve(shutdown.as_mut()).await?;
        claims.shut_down(completer).await;
        Ok(())
    }
}
