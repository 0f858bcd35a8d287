//! Graceful shutdown: signal running attempts, wait out the grace period,
//! then drop the rest and give back only the jobs still owned.

use std::sync::atomic::Ordering;

use tokio::task::JoinHandle;

use super::attempt::Attempt;
use super::claim::ClaimLoop;
use super::Handler;
use crate::jobs::Lease;

impl<H: Handler> ClaimLoop<H> {
    /// Stops the worker once it no longer claims: signals running attempts,
    /// waits up to the grace period, then cancels the rest (each releases
    /// its job), and lets the completer finish what it was handed.
    pub(super) async fn shut_down(mut self, completer: JoinHandle<()>) {
        self.soft.cancel();
        let grace = self.cfg.grace;
        let drained = tokio::time::timeout(grace, self.drain()).await;
        if drained.is_err() {
            self.hard.cancel();
            self.drain().await;
        }
        drop(self.completions);
        let _ = completer.await;
    }
}

impl<H: Handler> ClaimLoop<H> {
    /// Waits for every attempt, spawning the jobs the completer still hands
    /// over (claimed just before shutdown; they see it at once). The
    /// completer hands jobs over before it replies to the attempts whose
    /// completions claimed them, so once no attempt is left, none can come.
    async fn drain(&mut self) {
        loop {
            tokio::select! {
                biased;
                Some((jobs, permits, sent)) = self.handoff.recv() => self.spawn(jobs, permits, sent),
                joined = self.tasks.join_next() => {
                    if joined.is_none() && self.handoff.is_empty() {
                        return;
                    }
                }
            }
        }
    }
}

impl Attempt {
    /// Gives the job back without spending its attempt (compare-and-set on
    /// the lease).
    pub(super) async fn release(&self, lease: &Lease) {
        match self.ferry.jobs().release(lease).await {
            Ok(()) => {
                self.stats.released.fetch_add(1, Ordering::Relaxed);
            }
            // Never "release" a lease that is already gone: expiry recovers it.
            Err(e) => tracing::info!(run_id = %lease.run_id, code = e.code(), "job not released"),
        }
    }
}
