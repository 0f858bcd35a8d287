//! The completer: one task that commits finished attempts' completions in
//! batches and, in the same statement, claims the next jobs for the slots
//! those attempts free ([`Jobs::complete_and_claim`](crate::Jobs::complete_and_claim)); the claimed jobs are
//! handed to the claim loop, which spawns them on the slots.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use backon::{ExponentialBuilder, Retryable};
use serde_json::Value;
use tokio::sync::{mpsc, oneshot, Notify, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use super::{WorkerConfig, WorkerStats};
use crate::error::{Error, Result};
use crate::jobs::{Claimed, Lease};
use crate::Ferry;

/// The jobs of one claim (one hand-off to the slots) whose attempts have
/// not answered yet. A batch of completions waits, up to the completion
/// window, while a job claimed with one of its members is still to answer:
/// jobs claimed together tend to finish together, and then share one
/// statement. Jobs of other claims never hold a batch.
#[derive(Debug)]
pub(super) struct Claim {
    unanswered: AtomicUsize,
    /// The worker's one signal that some attempt answered or ended.
    answered: Arc<Notify>,
}

impl Claim {
    /// A claim of no jobs yet, signalling `answered` as its jobs answer.
    pub(super) fn new(answered: &Arc<Notify>) -> Arc<Claim> {
        Arc::new(Claim {
            unanswered: AtomicUsize::new(0),
            answered: answered.clone(),
        })
    }

    fn waiting(&self) -> bool {
        self.unanswered.load(Ordering::SeqCst) > 0
    }
}

/// One attempt's place among its claim's unanswered jobs, given up when
/// dropped: right after its success is queued for the completer; before a
/// failure or a release after shutdown's signal is recorded; at a stop
/// after the grace period, before the release; and whenever the attempt
/// ends otherwise (a lost lease, a batch member given up, a panic).
#[derive(Debug)]
pub(super) struct Answering(Arc<Claim>);

impl Drop for Answering {
    fn drop(&mut self) {
        self.0.unanswered.fetch_sub(1, Ordering::SeqCst);
        self.0.answered.notify_one();
    }
}

/// A worker slot held by an attempt: its permit, which travels with a
/// successful answer to the completer (the next job claimed there takes
/// it), and the attempt's place among its claim's unanswered jobs.
#[derive(Debug)]
pub(super) struct Slot {
    pub(super) permit: OwnedSemaphorePermit,
    pub(super) answering: Answering,
}

impl Slot {
    /// The slot of `permit`, for a job of `claim` that has not answered yet.
    pub(super) fn new(permit: OwnedSemaphorePermit, claim: &Arc<Claim>) -> Slot {
        claim.unanswered.fetch_add(1, Ordering::SeqCst);
        Slot {
            permit,
            answering: Answering(claim.clone()),
        }
    }
}

impl Answering {
    /// The claim this attempt's job came with.
    pub(super) fn claim(&self) -> Arc<Claim> {
        self.0.clone()
    }
}

/// A finished handler's result on its way to the completer.
pub(super) struct Completion {
    pub(super) lease: Lease,
    pub(super) result: Value,
    /// Where the outcome goes.
    pub(super) reply: oneshot::Sender<Result<()>>,
    /// The attempt's slot: given to the next job claimed with this
    /// completion, or back to the claim loop.
    pub(super) slot: Option<OwnedSemaphorePermit>,
    /// The claim the job came with (its other jobs may still answer).
    pub(super) claim: Arc<Claim>,
    /// When the job's lease, as last renewed, runs out on the worker's
    /// clock (`None` with an injected clock).
    pub(super) deadline: Option<tokio::time::Instant>,
}

/// Jobs claimed with a batch of completions, each with its slot, and when
/// the claim was sent.
pub(super) type Handoff = (Vec<Claimed>, Vec<OwnedSemaphorePermit>, tokio::time::Instant);

/// What the completer needs besides the channels.
pub(super) struct Completer {
    pub(super) ferry: Ferry,
    pub(super) cfg: Arc<WorkerConfig>,
    pub(super) stats: Arc<WorkerStats>,
    /// Cancelled at shutdown: nothing more is claimed.
    pub(super) soft: CancellationToken,
    pub(super) handoff: mpsc::UnboundedSender<Handoff>,
    /// Told when a completion's claim came back full (there is more work)
    /// or empty (the queue may be limited), so an idle claim loop polls
    /// again at once.
    pub(super) more_work: Arc<Notify>,
    /// Signalled whenever an attempt answers or ends: a batch waiting for
    /// the rest of its claims looks again.
    pub(super) answered: Arc<Notify>,
}

impl Completer {
    /// Completes finished jobs in batches: whatever queued up while the
    /// previous commit ran goes into the next one, and jobs claimed together
    /// with the batch's jobs that are still running are waited for up to the
    /// completion window (`gather`), so completions share commits; a batch
    /// none of whose claims has a job left to answer is not delayed. Each
    /// batch claims up to one job per slot it frees, in the same commit.
    ///
    /// Up to `in_flight` statements run at once: a batch starts as soon as
    /// one is free, so a worker with few slots does not wait for one commit
    /// at a time, and one with many gathers larger batches meanwhile.
    pub(super) async fn run(self, mut rx: mpsc::Receiver<Completion>, max_batch: usize, in_flight: usize) {
        let this = Arc::new(self);
        let in_flight = in_flight.max(1);
        let free = Arc::new(Semaphore::new(in_flight));
        let mut next_queue = 0usize;
        loop {
            let Ok(statement) = free.clone().acquire_owned().await else {
                break;
            };
            let Some(first) = rx.recv().await else { break };
            let mut batch = vec![first];
            this.gather(&mut rx, &mut batch, max_batch).await;
            let queue = this.cfg.queues[next_queue % this.cfg.queues.len()].clone();
            next_queue = next_queue.wrapping_add(1);
            let this = this.clone();
            tokio::spawn(async move {
                this.commit(batch, &queue).await;
                drop(statement);
            });
        }
        // Every batch handed out commits before the completer ends.
        let _ = free.acquire_many(in_flight as u32).await;
    }

    /// Adds to `batch` what is queued (up to `max_batch`), then, while a job
    /// claimed with one of its members is still to answer and the batch is
    /// smaller than the claim size `cfg.batch`, what is answered within the
    /// completion window. Never waits once shutdown is signalled, nor once
    /// a member's lease has less than a renewal period left (nothing renews
    /// it while it waits).
    async fn gather(&self, rx: &mut mpsc::Receiver<Completion>, batch: &mut Vec<Completion>, max_batch: usize) {
        let window = self.cfg.completion_window;
        let started = tokio::time::Instant::now();
        loop {
            while batch.len() < max_batch {
                match rx.try_recv() {
                    Ok(item) => batch.push(item),
                    Err(_) => break,
                }
            }
            // A statement claims at most `batch` jobs again: waiting for
            // more completions than that only idles the database.
            let until = wait_until(
                started,
                window,
                self.cfg.renew_period(),
                batch.iter().filter_map(|c| c.deadline),
            );
            if window.is_zero()
                || tokio::time::Instant::now() >= until
                || batch.len() >= max_batch.min(self.cfg.batch.max(1) as usize)
                || self.soft.is_cancelled()
                || !batch.iter().any(|c| c.claim.waiting())
            {
                return;
            }
            tokio::select! {
                item = rx.recv() => match item {
                    Some(item) => batch.push(item),
                    None => return,
                },
                // An attempt answered or ended: look again.
                () = self.answered.notified() => {}
                () = self.soft.cancelled() => return,
                () = tokio::time::sleep_until(until) => return,
            }
        }
    }

    /// Completes one batch and claims for its slots; replies to each attempt.
    async fn commit(&self, mut batch: Vec<Completion>, queue: &str) {
        {
            let mut slots: Vec<OwnedSemaphorePermit> = batch.iter_mut().filter_map(|c| c.slot.take()).collect();
            let items: Vec<(Lease, Value)> = batch.iter().map(|c| (c.lease.clone(), c.result.clone())).collect();
            let want = if self.soft.is_cancelled() {
                0
            } else {
                slots.len().min(self.cfg.batch.max(1) as usize) as u32
            };
            let sent = tokio::time::Instant::now();
            // A retry after a commit whose answer was lost completes nothing
            // twice (the lease is gone: `run_terminal`). It claims nothing:
            // jobs that lost commit claimed would sit leased to this worker,
            // never started, until their lease expired (an attempt spent, a
            // run dead at `max_attempts` 1 without having run).
            let tries = std::sync::atomic::AtomicU32::new(0);
            let outcome = (|| async {
                let want = if tries.fetch_add(1, Ordering::Relaxed) == 0 {
                    want
                } else {
                    0
                };
                self.ferry
                    .jobs()
                    .complete_and_claim(&items, queue, &self.cfg.owner, self.cfg.lease, want)
                    .await
            })
            .retry(ExponentialBuilder::default().with_max_times(5))
            .when(Error::is_transient)
            .await;
            self.stats.completion_statements.fetch_add(1, Ordering::Relaxed);
            match outcome {
                Ok((results, claimed)) => {
                    self.stats
                        .claimed_with_completions
                        .fetch_add(claimed.len() as u64, Ordering::Relaxed);
                    // Full: there is more work. Empty: the queue may be
                    // limited or paused, which this statement never claims
                    // from; the claim loop's claim does (a limited queue's
                    // freed room is taken at once instead of at the next poll).
                    if want > 0 && (claimed.len() == want as usize || claimed.is_empty()) {
                        self.more_work.notify_one();
                    }
                    if !claimed.is_empty() {
                        let rest = slots.split_off(claimed.len().min(slots.len()));
                        // Handed off before any reply: shutdown waits for
                        // the attempts that wait for these replies.
                        if let Err(mpsc::error::SendError((jobs, _, _))) = self.handoff.send((claimed, slots, sent)) {
                            tracing::warn!(
                                count = jobs.len(),
                                "worker stopped; claimed jobs come back by lease expiry"
                            );
                        }
                        slots = rest;
                    }
                    drop(slots);
                    for (c, r) in batch.into_iter().zip(results) {
                        let _ = c.reply.send(r);
                    }
                }
                Err(e) => {
                    drop(slots);
                    tracing::warn!(error = %e, code = e.code(), size = items.len(), "batch completion failed; completing one by one");
                    for Completion {
                        lease, result, reply, ..
                    } in batch
                    {
                        let one = (|| async { self.ferry.jobs().complete(&lease, &result).await })
                            .retry(ExponentialBuilder::default().with_max_times(5))
                            .when(Error::is_transient)
                            .await;
                        let _ = reply.send(one);
                    }
                }
            }
        }
    }
}

/// When a batch's wait for more answers ends: `window` after `started`, or a
/// renewal period (`renew`) before the first of its members' lease
/// `deadlines`, whichever comes first (nothing renews a finished job's
/// lease while its completion waits).
fn wait_until(
    started: tokio::time::Instant,
    window: std::time::Duration,
    renew: std::time::Duration,
    deadlines: impl Iterator<Item = tokio::time::Instant>,
) -> tokio::time::Instant {
    deadlines.fold(started + window, |until, deadline| {
        until.min(deadline.checked_sub(renew).unwrap_or(started))
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::time::Instant;

    use super::wait_until;

    #[test]
    fn a_wait_ends_a_renewal_period_before_the_first_lease_runs_out() {
        let now = Instant::now();
        let (window, renew) = (Duration::from_millis(1), Duration::from_secs(10));
        let far = now + Duration::from_secs(30);
        assert_eq!(wait_until(now, window, renew, [far].into_iter()), now + window);
        assert_eq!(wait_until(now, window, renew, std::iter::empty()), now + window);
        // A lease with less than a renewal period left: no wait at all.
        let near = now + Duration::from_secs(5);
        assert!(wait_until(now, window, renew, [far, near].into_iter()) <= now);
        // A long window is cut at the first lease's last renewal period.
        let long = Duration::from_secs(20);
        let until = wait_until(now, long, renew, [far, now + Duration::from_secs(15)].into_iter());
        assert_eq!(until, now + Duration::from_secs(5));
    }
}
