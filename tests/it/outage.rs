//! PostgreSQL stopped for 45 s (a fast shutdown) under a running `Worker`,
//! on a cluster of the test's own (`PgCluster`), so the shared one is never
//! restarted: nothing completes under a lease that expired meanwhile, and
//! the work resumes by itself once the database is back.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use ferry::worker::{JobContext, Worker, WorkerConfig};
use ferry::{Claimed, Ferry, NewRun};
use ferry_testkit::PgCluster;
use serde_json::json;
use tokio::sync::{mpsc, Semaphore};
use uuid::Uuid;

/// What a handler reports: it started under a generation, it finished, or
/// its future was dropped unfinished (the worker gave the attempt up).
#[derive(Debug)]
enum Handled {
    Started(Uuid, i64),
    Finished(Uuid),
    Dropped(Uuid),
}

/// Sends `Dropped` unless the handler finished.
struct Unfinished(Option<(Uuid, mpsc::UnboundedSender<Handled>)>);

impl Drop for Unfinished {
    fn drop(&mut self) {
        if let Some((id, tx)) = self.0.take() {
            let _ = tx.send(Handled::Dropped(id));
        }
    }
}

/// The next handler event, failing after `limit`.
async fn next(rx: &mut mpsc::UnboundedReceiver<Handled>, limit: Duration, what: &str) -> Handled {
    match tokio::time::timeout(limit, rx.recv()).await {
        Ok(Some(h)) => h,
        _ => panic!("waiting for {what}: no handler event within {limit:?}"),
    }
}

/// 200 runs, a worker with 8 slots and 10 s leases. 60 handlers finish, the
/// next 8 hold their slots at a gate; PostgreSQL stops. 4 of them are let
/// through, so their completions go out while the database is down and
/// reach it only after their leases expired; the other 4 outlive their
/// known lease expiry and are dropped. After 45 s the cluster restarts and
/// the gate opens: every run succeeds, exactly once, under the generation
/// of the attempt that completed it, none under a generation that was live
/// during the outage, and no job is dead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_outage_mid_load_completes_nothing_under_a_stale_lease_and_the_worker_resumes() {
    const RUNS: usize = 200;
    const SLOTS: usize = 8;
    let mut pg = PgCluster::start();
    let ferry = Ferry::builder(pg.url()).migrate(true).connect().await.unwrap();
    for i in 0..RUNS {
        let run = NewRun::new("acme", "work", format!("k-{i}"), json!({"i": i})).queue("outage");
        ferry.create_run_idempotent(run).await.unwrap();
    }
    let gate = Arc::new(Semaphore::new(60));
    let (tx, mut rx) = mpsc::unbounded_channel();
    let handler = {
        let gate = gate.clone();
        move |_job: Claimed, ctx: JobContext| {
            let (gate, tx) = (gate.clone(), tx.clone());
            async move {
                let (run_id, generation) = (ctx.run_id(), ctx.lease().generation);
                let _ = tx.send(Handled::Started(run_id, generation));
                let mut unfinished = Unfinished(Some((run_id, tx.clone())));
                gate.acquire().await.expect("the gate stays open").forget();
                unfinished.0 = None;
                let _ = tx.send(Handled::Finished(run_id));
                Ok(json!({ "generation": generation }))
            }
        }
    };
    let worker = Worker::new(
        ferry.clone(),
        WorkerConfig {
            queues: vec!["outage".into()],
            concurrency: SLOTS,
            batch: SLOTS as u32,
            lease: Duration::from_secs(10),
            poll_interval: Duration::from_millis(100),
            grace: Duration::from_secs(5),
            owner: "outage-worker".into(),
            ..WorkerConfig::default()
        },
        handler,
    );
    let stats = worker.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(worker.run(async move {
        let _ = stopped.await;
    }));

    // Mid-load: 60 finished, every slot held at the gate.
    let mut at_gate: HashMap<Uuid, i64> = HashMap::new();
    let mut finished = 0;
    while finished < 60 || at_gate.len() < SLOTS {
        match next(
            &mut rx,
            Duration::from_secs(60),
            "60 finished and every slot at the gate",
        )
        .await
        {
            Handled::Started(id, g) => {
                at_gate.insert(id, g);
            }
            Handled::Finished(id) => {
                at_gate.remove(&id);
                finished += 1;
            }
            Handled::Dropped(id) => panic!("{id} dropped before the outage"),
        }
    }

    tokio::task::block_in_place(|| pg.stop());
    let down = tokio::time::Instant::now();
    gate.add_permits(SLOTS / 2);
    let (mut through, mut dropped) = (0, 0);
    while through + dropped < SLOTS {
        match next(
            &mut rx,
            Duration::from_secs(30),
            "the gated handlers through or dropped",
        )
        .await
        {
            Handled::Finished(id) if at_gate.contains_key(&id) => through += 1,
            Handled::Dropped(id) if at_gate.contains_key(&id) => dropped += 1,
            other => panic!("nothing else runs while the database is down: {other:?}"),
        }
    }
    assert_eq!(
        (through, dropped),
        (SLOTS / 2, SLOTS / 2),
        "4 let through before their leases expired, 4 dropped at their expiry"
    );
    // The outage lasts 45 s: the fault injected, not a synchronization.
    tokio::time::sleep_until(down + Duration::from_secs(45)).await;
    tokio::task::block_in_place(|| pg.restart());
    gate.add_permits(Semaphore::MAX_PERMITS / 2);

    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while stats.completed.load(Ordering::SeqCst) < RUNS as u64 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the worker did not finish by itself after the outage: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.send(()).unwrap();
    running.await.unwrap().unwrap();

    let scalar = |sql: String| {
        let ferry = ferry.clone();
        async move {
            ferry
                .db()
                .fetch_i64(&sql)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"))
        }
    };
    assert_eq!(
        scalar("SELECT count(*) FROM jobs WHERE state = 'succeeded'".into()).await,
        RUNS as i64,
        "every job succeeded, none dead: {stats:?}"
    );
    assert_eq!(
        scalar("SELECT count(*) FROM run_events WHERE kind = 'run_succeeded'".into()).await,
        RUNS as i64
    );
    assert_eq!(
        scalar("SELECT count(*) FROM job_attempts WHERE outcome = 'succeeded'".into()).await,
        RUNS as i64,
        "one successful attempt per run"
    );
    let result_generation = "CAST(CAST(e.body AS jsonb) -> 'result' ->> 'generation' AS BIGINT)";
    assert_eq!(
        scalar(format!(
            "SELECT count(*) FROM run_events e JOIN jobs j ON j.tenant = e.tenant AND j.run_id = e.run_id
             JOIN job_attempts a ON a.tenant = e.tenant AND a.run_id = e.run_id AND a.outcome = 'succeeded'
             WHERE e.kind = 'run_succeeded'
               AND ({result_generation} <> j.lease_generation OR a.generation <> j.lease_generation)"
        ))
        .await,
        0,
        "each run completed under its last lease, by the attempt that held it"
    );
    let stale: Vec<String> = at_gate.iter().map(|(id, g)| format!("('{id}', {g})")).collect();
    assert_eq!(
        scalar(format!(
            "SELECT count(*) FROM run_events e WHERE e.kind = 'run_succeeded'
               AND (CAST(e.run_id AS TEXT), {result_generation}) IN (VALUES {})",
            stale.join(", ")
        ))
        .await,
        0,
        "no run completed under a lease that was live when the database stopped"
    );
    let attempts = scalar("SELECT COALESCE(sum(attempts), 0) FROM jobs".into()).await;
    eprintln!(
        "worker outage: {RUNS} runs, {attempts} attempts, {} given up or refused",
        stats.lost.load(Ordering::SeqCst)
    );
    assert!(
        stats.lost.load(Ordering::SeqCst) >= SLOTS as u64,
        "the 8 attempts at the gate were given up or refused: {stats:?}"
    );
}
