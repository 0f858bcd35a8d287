//! The worker runtime on both engines: retries, lease loss, cancellation at
//! renew, and graceful shutdown that releases only jobs it still owns.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ferry::worker::{JobContext, Worker, WorkerConfig};
use ferry::{Claimed, JobError, NewRun, RetryPolicy};
use serde_json::json;
use tokio::sync::mpsc;

use crate::support::{manual_clock, on_both_engines, Kind, TestDb};

fn fast_config(owner: &str) -> WorkerConfig {
    WorkerConfig {
        queues: vec!["q".into()],
        concurrency: 4,
        batch: 4,
        lease: Duration::from_secs(30),
        poll_interval: Duration::from_millis(20),
        grace: Duration::from_secs(5),
        retry: RetryPolicy {
            base: Duration::from_millis(1),
            max_jitter: Duration::ZERO,
            ..RetryPolicy::default()
        },
        owner: owner.into(),
        rng_seed: Some(9),
        ..WorkerConfig::default()
    }
}

async fn accept(t: &TestDb, n: usize) -> Vec<uuid::Uuid> {
    let mut ids = Vec::new();
    for i in 0..n {
        let run = NewRun::new("acme", "work", format!("k-{i}"), json!({"i": i})).queue("q");
        ids.push(t.ferry.create_run_idempotent(run).await.unwrap().run.run_id);
    }
    ids
}

async fn worker_completes_and_retries(kind: Kind) {
    let t = TestDb::new(kind).await;
    let ids = accept(&t, 30).await;
    let succeeded = Arc::new(AtomicUsize::new(0));
    let (all_done, mut done_rx) = mpsc::channel::<()>(1);
    let s = succeeded.clone();
    let worker = Worker::new(
        t.ferry.clone(),
        fast_config("w1"),
        move |job: Claimed, _ctx: JobContext| {
            let s = s.clone();
            let all_done = all_done.clone();
            async move {
                let i = job.request["i"].as_i64().unwrap();
                if i % 3 == 0 && job.attempt == 1 {
                    return Err(JobError::retryable("flaky"));
                }
                if s.fetch_add(1, Ordering::SeqCst) + 1 == 30 {
                    let _ = all_done.try_send(());
                }
                Ok(json!({"i": i}))
            }
        },
    );
    let stats = worker.stats();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(worker.run(async move {
        let _ = stop_rx.await;
    }));
    done_rx.recv().await.unwrap();
    stop_tx.send(()).unwrap();
    running.await.unwrap().unwrap();
    assert_eq!(stats.completed.load(Ordering::SeqCst), 30);
    assert_eq!(stats.retried.load(Ordering::SeqCst), 10);
    for (i, id) in ids.iter().enumerate() {
        let run = t.ferry.get_run("acme", *id).await.unwrap();
        assert_eq!(run.state, ferry::RunState::Succeeded);
        let attempts = t.ferry.list_attempts("acme", *id).await.unwrap();
        assert_eq!(attempts.len(), if i % 3 == 0 { 2 } else { 1 });
    }
    assert_eq!(
        t.scalar("SELECT count(*) FROM jobs WHERE state <> 'succeeded'").await,
        0
    );
}

/// Sends on drop: proves the worker dropped (cancelled) the handler future.
struct DropSignal(mpsc::UnboundedSender<&'static str>);
impl Drop for DropSignal {
    fn drop(&mut self) {
        let _ = self.0.send("dropped");
    }
}

async fn lost_lease_and_cancellation_stop_the_handler(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    let ids = accept(&t, 1).await;
    let (tx, mut rx) = mpsc::unbounded_channel::<&'static str>();
    let mut cfg = fast_config("victim");
    cfg.renew_every = Some(Duration::from_millis(10));
    cfg.concurrency = 1;
    cfg.batch = 1;
    let worker = Worker::new(t.ferry.clone(), cfg, move |_job: Claimed, _ctx: JobContext| {
        let tx = tx.clone();
        async move {
            let _guard = DropSignal(tx.clone());
            let _ = tx.send("started");
            std::future::pending::<()>().await;
            Ok(json!({}))
        }
    });
    let stats = worker.stats();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(worker.run(async move {
        let _ = stop_rx.await;
    }));
    assert_eq!(rx.recv().await, Some("started"));
    // Another worker takes the job over once the (injected) clock passes expiry.
    clock.advance(Duration::from_secs(31)).unwrap();
    let thief = t
        .ferry
        .claim("q", "thief", Duration::from_secs(600), 1)
        .await
        .unwrap()
        .pop()
        .unwrap();
    assert_eq!(thief.lease.generation, 2);
    assert_eq!(
        rx.recv().await,
        Some("dropped"),
        "the stale handler is cancelled at its next renew"
    );
    t.ferry.complete(&thief.lease, &json!({"by": "thief"})).await.unwrap();

    // Cancellation reaches a running handler through renew.
    let run = NewRun::new("acme", "work", "k-cancel", json!({"i": 99})).queue("q");
    let id = t.ferry.create_run_idempotent(run).await.unwrap().run.run_id;
    assert_eq!(rx.recv().await, Some("started"));
    t.ferry.cancel("acme", id, None, "ops", "stop it").await.unwrap();
    assert_eq!(rx.recv().await, Some("dropped"));
    stop_tx.send(()).unwrap();
    running.await.unwrap().unwrap();
    assert_eq!(stats.lost.load(Ordering::SeqCst), 2);
    assert_eq!(stats.completed.load(Ordering::SeqCst), 0);
    let kinds: Vec<_> = t
        .ferry
        .list_events("acme", ids[0])
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.kind)
        .collect();
    assert_eq!(kinds, ["run_queued", "run_succeeded"]);
}

async fn shutdown_releases_only_owned_jobs(kind: Kind) {
    let t = TestDb::new(kind).await;
    let ids = accept(&t, 2).await;
    let (tx, mut rx) = mpsc::unbounded_channel::<bool>();
    let mut cfg = fast_config("shy");
    cfg.grace = Duration::from_millis(200);
    let worker = Worker::new(t.ferry.clone(), cfg, move |job: Claimed, ctx: JobContext| {
        let tx = tx.clone();
        async move {
            let polite = job.request["i"] == 0;
            let _ = tx.send(polite);
            if polite {
                // Observes the shutdown signal and gives up cleanly.
                ctx.cancellation().cancelled().await;
                return Err(JobError::retryable("shutting_down"));
            }
            // Ignores it: released after the grace period.
            std::future::pending::<()>().await;
            Ok(json!({}))
        }
    });
    let stats = worker.stats();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(worker.run(async move {
        let _ = stop_rx.await;
    }));
    rx.recv().await.unwrap();
    rx.recv().await.unwrap();
    stop_tx.send(()).unwrap();
    running.await.unwrap().unwrap();
    assert_eq!(stats.released.load(Ordering::SeqCst), 2);
    for id in ids {
        let attempts = t.ferry.list_attempts("acme", id).await.unwrap();
        assert_eq!(attempts[0].outcome.as_deref(), Some("released"));
    }
    assert_eq!(
        t.scalar("SELECT count(*) FROM jobs WHERE state = 'queued' AND attempts = 0")
            .await,
        2,
        "no attempt was spent"
    );
}

async fn released_jobs_are_drained_by_the_next_worker(kind: Kind) {
    const N: usize = 3;
    let t = TestDb::new(kind).await;
    let ids = accept(&t, N).await;
    // The first worker takes every job, then shuts down: all are released.
    let (tx, mut rx) = mpsc::unbounded_channel::<()>();
    let worker = Worker::new(
        t.ferry.clone(),
        fast_config("leaving"),
        move |_job: Claimed, ctx: JobContext| {
            let tx = tx.clone();
            async move {
                let _ = tx.send(());
                ctx.cancellation().cancelled().await;
                Err(JobError::retryable("shutting_down"))
            }
        },
    );
    let stats = worker.stats();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(worker.run(async move {
        let _ = stop_rx.await;
    }));
    for _ in 0..N {
        rx.recv().await.unwrap();
    }
    stop_tx.send(()).unwrap();
    running.await.unwrap().unwrap();
    assert_eq!(stats.released.load(Ordering::SeqCst), N as u64);

    // A new worker drains the queue.
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<()>();
    let worker = Worker::new(
        t.ferry.clone(),
        fast_config("next"),
        move |job: Claimed, _ctx: JobContext| {
            let done_tx = done_tx.clone();
            async move {
                let _ = done_tx.send(());
                Ok(json!({"attempt": job.attempt}))
            }
        },
    );
    let stats = worker.stats();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(worker.run(async move {
        let _ = stop_rx.await;
    }));
    // Bounded, so a wedged queue fails the test instead of hanging it.
    tokio::time::timeout(Duration::from_secs(60), async {
        for _ in 0..N {
            done_rx.recv().await.unwrap();
        }
    })
    .await
    .expect("the new worker drains the released jobs (the queue is wedged)");
    stop_tx.send(()).unwrap();
    running.await.unwrap().unwrap();
    assert_eq!(stats.completed.load(Ordering::SeqCst), N as u64);
    for id in ids {
        assert_eq!(
            t.ferry.get_run("acme", id).await.unwrap().state,
            ferry::RunState::Succeeded
        );
        let history: Vec<_> = t
            .ferry
            .list_attempts("acme", id)
            .await
            .unwrap()
            .into_iter()
            .map(|a| (a.attempt, a.generation, a.outcome.unwrap()))
            .collect();
        assert_eq!(history, [(1, 1, "released".to_owned()), (1, 2, "succeeded".to_owned())]);
    }
}

on_both_engines!(
    worker_completes_and_retries,
    lost_lease_and_cancellation_stop_the_handler,
    shutdown_releases_only_owned_jobs,
    released_jobs_are_drained_by_the_next_worker,
);
