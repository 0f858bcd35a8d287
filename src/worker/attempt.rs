//! One attempt: the handler runs beside its lease renewals, is stopped once
//! the lease is lost or its known expiry passes, and its outcome is recorded.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use backon::{ExponentialBuilder, Retryable};
use rand::rngs::StdRng;
use serde_json::Value;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::completer::{Completion, Slot};
use super::lease_watch::{sleep_until_some, LeaseWatch};
use super::{Handler, JobContext, WorkerConfig, WorkerStats};
use crate::error::{Error, Result};
use crate::jobs::{Claimed, ErrorClass, FailOutcome, JobError, Lease};
use crate::Ferry;

/// Everything one attempt's task needs.
pub(super) struct Attempt {
    pub(super) completions: mpsc::Sender<Completion>,
    pub(super) ferry: Ferry,
    pub(super) cfg: Arc<WorkerConfig>,
    pub(super) stats: Arc<WorkerStats>,
    pub(super) rng: Arc<Mutex<StdRng>>,
    pub(super) soft: CancellationToken,
    pub(super) hard: CancellationToken,
    /// When the claim was sent: the start of the lease on the worker's clock.
    pub(super) claim_sent: tokio::time::Instant,
}

/// How the handler's run under the lease (or, for a batch, the leases)
/// ended, with its answer `T`.
pub(super) enum Ended<T> {
    /// The handler returned; `signalled` if shutdown had been signalled.
    Done { outcome: T, signalled: bool },
    /// The grace period ran out: the handler is to be dropped and the job released.
    Stopped,
    /// The attempt was given up ([`Attempt::abandon`]); nothing more is published.
    Abandoned,
}

/// A renewal's answer (`None`: it outlived the known expiry) and when it was sent.
type Renewed = (Option<Result<(i64, i64)>>, tokio::time::Instant);

impl Attempt {
    /// Works one attempt. When the handler succeeds, its slot travels with
    /// the completion, and the next job for it is claimed in the same
    /// commit; otherwise the slot is given back as soon as the handler is done.
    pub(super) async fn run<H: Handler>(self, handler: Arc<H>, job: Claimed, slot: Slot) {
        let lease = job.lease.clone();
        let watch = Arc::new(LeaseWatch::new(
            self.ferry.clock().clone(),
            job.lease_expires_at.get(),
            job.claimed_at.get(),
            self.claim_sent,
        ));
        let ctx = JobContext::new(self.ferry.clone(), &job, watch.clone());
        let cancel = ctx.cancel.clone();
        // Boxed so it can be dropped before a hard release: a handler stopped
        // inside a transaction gives its connection back, and the pool rolls
        // it back (in the background) so the release gets the job row.
        let mut work = Box::pin(handler.handle(job, ctx));
        let (outcome, signalled) = match self.supervise(&mut work, &watch, &cancel, &lease).await {
            Ended::Done { outcome, signalled } => (outcome, signalled),
            Ended::Stopped => {
                drop(work);
                // It will not answer: no completion waits for it.
                drop(slot);
                self.release(&lease).await;
                return;
            }
            // Returning drops the handler's future.
            Ended::Abandoned => return,
        };
        self.answer(&lease, outcome, signalled, slot, &watch).await
    }

    /// Records the handler's answer for `lease`: completed (the slot goes
    /// with the completion: the completer claims the next job for it in the
    /// same commit, or gives it back), released (a retryable error after
    /// shutdown was signalled) or failed; otherwise the slot is given back
    /// at once.
    pub(super) async fn answer(
        &self,
        lease: &Lease,
        outcome: std::result::Result<Value, JobError>,
        signalled: bool,
        slot: Slot,
        watch: &LeaseWatch,
    ) {
        match outcome {
            Ok(result) => self.complete(lease, result, slot, watch.local_deadline()).await,
            Err(err) if signalled && err.class == ErrorClass::Retryable => {
                drop(slot);
                self.release(lease).await
            }
            Err(err) => {
                drop(slot);
                self.record_failure(lease, &err).await
            }
        }
    }

    /// Polls the handler until it returns, renewing the lease beside it;
    /// signals it at shutdown, and gives the attempt up when the lease is
    /// lost or its known expiry passes.
    async fn supervise<F>(
        &self,
        work: &mut Pin<Box<F>>,
        watch: &LeaseWatch,
        cancel: &CancellationToken,
        lease: &Lease,
    ) -> Ended<std::result::Result<Value, JobError>>
    where
        F: Future<Output = std::result::Result<Value, JobError>>,
    {
        let every = self.cfg.renew_period();
        let mut renew = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        // The renewal in flight runs beside the handler, never instead of it:
        // a handler paused inside a transaction that holds the job row would
        // otherwise block the very renewal that waits for it.
        let mut renewing = None;
        let mut signalled = false;
        let outcome = loop {
            tokio::select! {
                out = work.as_mut() => break Some(out),
                // The known expiry passed on the worker's clock while no
                // renewal succeeded: the lease may already be someone else's.
                _ = sleep_until_some(watch.local_deadline()) => {
                    return self.abandon(watch, cancel, lease, "lease_expired");
                }
                _ = renew.tick(), if renewing.is_none() => {
                    if watch.expired() {
                        return self.abandon(watch, cancel, lease, "lease_expired");
                    }
                    renewing = Some(Box::pin(self.renewal(lease, watch)));
                }
                (renewed, sent) = async { renewing.as_mut().expect("guarded by is_some").await }, if renewing.is_some() => {
                    renewing = None;
                    match renewed {
                        Some(Ok((expires_at, now))) => watch.learn(expires_at, now, sent),
                        Some(Err(e)) if e.is_transient() => {
                            if watch.expired() {
                                return self.abandon(watch, cancel, lease, "lease_expired");
                            }
                            tracing::warn!(error = %e, "lease renewal failed; retrying at the next tick");
                        }
                        // Lost, cancelled or past the deadline: stop the
                        // handler and publish nothing more for this attempt.
                        Some(Err(e)) => return self.abandon(watch, cancel, lease, e.code()),
                        None => return self.abandon(watch, cancel, lease, "lease_expired"),
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
        match outcome {
            Some(outcome) => Ended::Done { outcome, signalled },
            None => Ended::Stopped,
        }
    }

    /// One renewal of `lease`, sent now; it resolves to `None` if it is
    /// still pending when the known expiry passes.
    pub(super) fn renewal<'a>(&'a self, lease: &'a Lease, watch: &LeaseWatch) -> impl Future<Output = Renewed> + 'a {
        let sent = tokio::time::Instant::now();
        let deadline = watch.local_deadline();
        async move {
            let jobs = self.ferry.jobs();
            let renewal = jobs.renew_at(lease, self.cfg.lease);
            // A renewal that hangs past the known expiry is as good as failed.
            let renewed = match deadline {
                Some(at) => tokio::time::timeout_at(at, renewal).await.ok(),
                None => Some(renewal.await),
            };
            (renewed, sent)
        }
    }

    /// Hands the handler's result and its slot to the completer and counts
    /// the answer. The attempt counts as answered once the result is queued
    /// (not before: a completer waiting for it must find it there).
    async fn complete(&self, lease: &Lease, result: Value, slot: Slot, deadline: Option<tokio::time::Instant>) {
        let Slot { permit, answering } = slot;
        let (reply, answer) = oneshot::channel();
        let completion = Completion {
            lease: lease.clone(),
            result,
            reply,
            slot: Some(permit),
            claim: answering.claim(),
            deadline,
        };
        let sent = self.completions.send(completion).await;
        drop(answering);
        let done = match sent {
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
            Err(Error::RunTerminal { state, .. }) if state == crate::RunState::Succeeded.as_str() => {
                self.stats.completed.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                self.stats.lost.fetch_add(1, Ordering::Relaxed);
                tracing::info!(run_id = %lease.run_id, code = e.code(), "completion refused");
            }
        }
    }

    /// Records the handler's error: requeued or dead, by its class and the
    /// attempt budget.
    async fn record_failure(&self, lease: &Lease, err: &JobError) {
        let failed = (|| async {
            let mut rng = self.rng.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let out = self.ferry.jobs().fail(lease, err, &self.cfg.retry, &mut rng).await;
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

    /// Gives the attempt up: the handler's token is cancelled, its context
    /// refuses further writes, and returning drops its future.
    fn abandon<T>(&self, watch: &LeaseWatch, cancel: &CancellationToken, lease: &Lease, code: &str) -> Ended<T> {
        self.give_up(watch, cancel, lease, code);
        Ended::Abandoned
    }

    /// Gives one lease up: its handler's token is cancelled and its context
    /// refuses further writes; counted as lost.
    pub(super) fn give_up(&self, watch: &LeaseWatch, cancel: &CancellationToken, lease: &Lease, code: &str) {
        watch.revoke();
        cancel.cancel();
        self.stats.lost.fetch_add(1, Ordering::Relaxed);
        tracing::info!(run_id = %lease.run_id, code, "attempt abandoned");
    }
}
