//! One call of a batch handler: many claimed jobs of one operation, each
//! under its own lease, renewed beside the call; a job whose lease is lost
//! meanwhile is given up alone (its answer is dropped), and the answers of
//! the others are recorded as single attempts' answers are, the successes
//! meeting in the completer's set-based completion statement.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use futures::future::join_all;
use tokio_util::sync::CancellationToken;

use super::attempt::{Attempt, Ended};
use super::completer::Slot;
use super::lease_watch::{sleep_until_some, LeaseWatch};
use super::router::{one_answer_per_job, Answers};
use super::{Handler, JobContext};
use crate::jobs::{Claimed, Lease};

/// One job of a batch call: its lease, what the worker knows of it, and
/// its slot while the job is still worked.
struct Member {
    lease: Lease,
    watch: Arc<LeaseWatch>,
    cancel: CancellationToken,
    /// Taken (given back) when the job is given up.
    slot: Option<Slot>,
}

impl Member {
    fn live(&self) -> bool {
        self.slot.is_some()
    }
}

impl Attempt {
    /// Works one batch call: `jobs` (all of one batched operation), each
    /// holding its slot of `slots`, go to [`Handler::handle_batch`] in one
    /// call. Every answer whose job is still held is recorded exactly as a
    /// single attempt's answer, all at once, so the successes share one
    /// completion statement (each fenced by its own lease there too).
    pub(super) async fn run_batch<H: Handler>(self, handler: Arc<H>, jobs: Vec<Claimed>, slots: Vec<Slot>) {
        let mut members = Vec::with_capacity(jobs.len());
        let mut calls = Vec::with_capacity(jobs.len());
        for (job, slot) in jobs.into_iter().zip(slots) {
            let watch = Arc::new(LeaseWatch::new(
                self.ferry.clock().clone(),
                job.lease_expires_at.get(),
                job.claimed_at.get(),
                self.claim_sent,
            ));
            let ctx = JobContext::new(self.ferry.clone(), &job, watch.clone());
            members.push(Member {
                lease: job.lease.clone(),
                watch,
                cancel: ctx.cancel.clone(),
                slot: Some(slot),
            });
            calls.push((job, ctx));
        }
        // Boxed so it can be dropped before the releases (see `Attempt::run`).
        let mut work = Box::pin(handler.handle_batch(calls));
        let (answers, signalled) = match self.supervise_batch(&mut work, &mut members).await {
            Ended::Done { outcome, signalled } => (outcome, signalled),
            Ended::Stopped => {
                drop(work);
                let live: Vec<Lease> = members.iter().filter(|m| m.live()).map(|m| m.lease.clone()).collect();
                // They will not answer: no completion waits for them.
                drop(members);
                join_all(live.iter().map(|lease| self.release(lease))).await;
                return;
            }
            // Returning drops the handler's future.
            Ended::Abandoned => return,
        };
        let answers = one_answer_per_job(answers, members.len());
        // A job given up meanwhile has no slot: its answer is dropped.
        let held = members
            .into_iter()
            .zip(answers)
            .filter_map(|(m, answer)| m.slot.map(|slot| (m.lease, answer, slot, m.watch)));
        let this = &self;
        join_all(held.map(|(lease, answer, slot, watch)| async move {
            this.answer(&lease, answer, signalled, slot, &watch).await
        }))
        .await;
    }

    /// Polls the batch call until it returns, renewing every held lease
    /// beside it; signals it at shutdown; gives up each job whose lease is
    /// lost or whose known expiry passes, and the whole call once none is
    /// held.
    async fn supervise_batch<F>(&self, work: &mut Pin<Box<F>>, members: &mut [Member]) -> Ended<Answers>
    where
        F: Future<Output = Answers>,
    {
        let every = self.cfg.renew_period();
        let mut renew = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        let mut renewing = None;
        let mut signalled = false;
        let outcome = loop {
            let deadline = members
                .iter()
                .filter(|m| m.live())
                .filter_map(|m| m.watch.local_deadline())
                .min();
            tokio::select! {
                out = work.as_mut() => break Some(out),
                _ = sleep_until_some(deadline) => self.give_up_expired(members),
                _ = renew.tick(), if renewing.is_none() => {
                    self.give_up_expired(members);
                    let held: Vec<(usize, Lease, Arc<LeaseWatch>)> = members
                        .iter()
                        .enumerate()
                        .filter(|(_, m)| m.live())
                        .map(|(i, m)| (i, m.lease.clone(), m.watch.clone()))
                        .collect();
                    renewing = Some(Box::pin(join_all(held.into_iter().map(|(i, lease, watch)| async move {
                        (i, self.renewal(&lease, &watch).await)
                    }))));
                }
                renewed = async { renewing.as_mut().expect("guarded by is_some").await }, if renewing.is_some() => {
                    renewing = None;
                    for (i, (renewed, sent)) in renewed {
                        let m = &mut members[i];
                        if !m.live() {
                            continue;
                        }
                        match renewed {
                            Some(Ok((expires_at, now))) => m.watch.learn(expires_at, now, sent),
                            Some(Err(e)) if e.is_transient() => {
                                if m.watch.expired() {
                                    self.give_up_member(m, "lease_expired");
                                } else {
                                    tracing::warn!(error = %e, run_id = %m.lease.run_id, "lease renewal failed; retrying at the next tick");
                                }
                            }
                            // Lost, cancelled or past the deadline: this job
                            // publishes nothing more; the others go on.
                            Some(Err(e)) => self.give_up_member(m, e.code()),
                            None => self.give_up_member(m, "lease_expired"),
                        }
                    }
                }
                _ = self.soft.cancelled(), if !signalled => {
                    signalled = true;
                    members.iter().for_each(|m| m.cancel.cancel());
                }
                _ = self.hard.cancelled() => {
                    members.iter().for_each(|m| m.cancel.cancel());
                    break None;
                }
            }
            if !members.iter().any(Member::live) {
                return Ended::Abandoned;
            }
        };
        // Renewals still in flight give their connections back first.
        drop(renewing);
        match outcome {
            Some(outcome) => Ended::Done { outcome, signalled },
            None => Ended::Stopped,
        }
    }

    /// Gives up every held job whose known expiry has passed.
    fn give_up_expired(&self, members: &mut [Member]) {
        for m in members.iter_mut().filter(|m| m.live() && m.watch.expired()) {
            self.give_up_member(m, "lease_expired");
        }
    }

    /// Gives one job of the call up: its context refuses further writes, its
    /// answer will be dropped, and its slot is free at once.
    fn give_up_member(&self, m: &mut Member, code: &str) {
        m.slot = None;
        self.give_up(&m.watch, &m.cancel, &m.lease, code);
    }
}
