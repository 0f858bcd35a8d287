//! PostgreSQL-only: concurrent claimers, a many-worker soak, and
//! `pg_terminate_backend` on a running worker. (The SIGKILLed worker process
//! is in `ferry-testkit`, beside its binary.)

use std::collections::HashSet;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ferry::worker::{JobContext, Worker, WorkerConfig};
use ferry::{Claimed, Ferry, NewRun};
use serde_json::json;
use tokio::sync::mpsc;

use crate::support::{Kind, TestDb};

async fn accept_many(ferry: &Ferry, n: usize, queue: &str) {
    let chunks: Vec<_> = (0..n)
        .collect::<Vec<_>>()
        .chunks(n.div_ceil(16))
        .map(|c| c.to_vec())
        .collect();
    let tasks = chunks.into_iter().map(|chunk| {
        let f = ferry.clone();
        let queue = queue.to_owned();
        tokio::spawn(async move {
            for i in chunk {
                let run = NewRun::new("acme", "work", format!("k-{i}"), json!({"i": i})).queue(&queue);
                f.create_run_idempotent(run).await.unwrap();
            }
        })
    });
    for t in futures::future::join_all(tasks).await {
        t.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_claimers_never_share_a_job() {
    let t = TestDb::new(Kind::Postgres).await;
    accept_many(&t.ferry, 600, "q").await;
    let other = t.reopen().await;
    let claimer = |f: Ferry, name: &'static str| async move {
        let mut got = Vec::new();
        loop {
            let batch = f.jobs().claim("q", name, Duration::from_secs(60), 7).await.unwrap();
            if batch.is_empty() {
                return got;
            }
            got.extend(batch.into_iter().map(|c| c.lease.run_id));
        }
    };
    let (a, b) = tokio::join!(claimer(t.ferry.clone(), "a"), claimer(other, "b"));
    assert!(!a.is_empty() && !b.is_empty(), "both claimers got work");
    let all: HashSet<_> = a.iter().chain(b.iter()).collect();
    assert_eq!(all.len(), a.len() + b.len(), "no job was claimed twice");
    assert_eq!(all.len(), 600);
}

/// Eight loops of `complete_and_claim` (each completing what it claimed and
/// claiming the next batch in the same statement) never claim a job twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_complete_and_claim_loops_never_share_a_job() {
    const N: usize = 1200;
    let t = TestDb::new(Kind::Postgres).await;
    accept_many(&t.ferry, N, "cc").await;
    let lease = Duration::from_secs(60);
    let mut loops = Vec::new();
    for w in 0..8 {
        let f = if w % 2 == 0 { t.ferry.clone() } else { t.reopen().await };
        loops.push(tokio::spawn(async move {
            let owner = format!("cc-{w}");
            let mut got = Vec::new();
            let mut held = f.jobs().claim("cc", &owner, lease, 5).await.unwrap();
            while !held.is_empty() {
                got.extend(held.iter().map(|c| c.lease.run_id));
                let items: Vec<_> = held.iter().map(|c| (c.lease.clone(), json!({}))).collect();
                let (done, next) = f
                    .jobs()
                    .complete_and_claim(&items, "cc", &owner, lease, 5)
                    .await
                    .unwrap();
                assert!(done.iter().all(|r| r.is_ok()), "every own lease completes");
                held = next;
            }
            got
        }));
    }
    let mut all = Vec::new();
    let mut busy = 0;
    for l in loops {
        let got = l.await.unwrap();
        busy += usize::from(!got.is_empty());
        all.extend(got);
    }
    let distinct: HashSet<_> = all.iter().collect();
    assert_eq!(distinct.len(), all.len(), "no job was claimed twice");
    assert_eq!(all.len(), N);
    assert!(busy >= 2, "the work was shared");
    assert_eq!(
        t.scalar("SELECT count(*) FROM jobs WHERE state = 'succeeded'").await,
        N as i64
    );
    assert_eq!(t.scalar("SELECT count(*) FROM job_attempts").await, N as i64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_workers_complete_five_thousand_jobs_exactly_once() {
    const N: usize = 5000;
    let t = TestDb::new(Kind::Postgres).await;
    accept_many(&t.ferry, N, "soak").await;
    let calls = Arc::new(AtomicUsize::new(0));
    let (done_tx, mut done_rx) = mpsc::channel::<()>(1);
    let mut stops = Vec::new();
    let mut running = Vec::new();
    for w in 0..8 {
        let calls = calls.clone();
        let done_tx = done_tx.clone();
        let config = WorkerConfig {
            queues: vec!["soak".into()],
            concurrency: 4,
            batch: 16,
            poll_interval: Duration::from_millis(50),
            owner: format!("soak-{w}"),
            ..WorkerConfig::default()
        };
        let worker = Worker::new(t.ferry.clone(), config, move |job: Claimed, _ctx: JobContext| {
            let calls = calls.clone();
            let done_tx = done_tx.clone();
            async move {
                if calls.fetch_add(1, Ordering::SeqCst) + 1 == N {
                    let _ = done_tx.try_send(());
                }
                Ok(json!({"i": job.request["i"]}))
            }
        });
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        stops.push(stop_tx);
        running.push(tokio::spawn(worker.run(async move {
            let _ = stop_rx.await;
        })));
    }
    done_rx.recv().await.unwrap();
    for s in stops {
        let _ = s.send(());
    }
    for r in running {
        r.await.unwrap().unwrap();
    }
    assert_eq!(calls.load(Ordering::SeqCst), N, "every handler ran once");
    assert_eq!(
        t.scalar("SELECT count(*) FROM jobs WHERE state = 'succeeded'").await,
        N as i64
    );
    assert_eq!(
        t.scalar("SELECT count(*) FROM jobs WHERE state = 'leased'").await,
        0,
        "nothing left leased"
    );
    assert_eq!(
        t.scalar("SELECT count(*) FROM run_events WHERE kind = 'run_succeeded'")
            .await,
        N as i64
    );
    assert_eq!(
        t.scalar("SELECT count(*) FROM (SELECT run_id FROM run_events WHERE kind LIKE 'run\\_%' AND kind <> 'run_queued' GROUP BY tenant, run_id HAVING count(*) > 1) d").await,
        0,
        "no duplicate terminal events"
    );
    assert_eq!(
        t.scalar("SELECT count(*) FROM job_attempts WHERE outcome = 'succeeded'")
            .await,
        N as i64
    );
    assert!(
        t.scalar("SELECT count(DISTINCT worker) FROM job_attempts").await >= 2,
        "the work was shared"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_survives_pg_terminate_backend() {
    const N: usize = 200;
    let t = TestDb::new(Kind::Postgres).await;
    accept_many(&t.ferry, N, "term").await;
    let app = format!("ferry-term-{}", std::process::id());
    let url = format!("{}&application_name={app}", t.url);
    let worker_ferry = Ferry::builder(&url).max_connections(4).connect().await.unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let (half_tx, mut half_rx) = mpsc::channel::<()>(1);
    let (go_tx, go_rx) = tokio::sync::watch::channel(false);
    let (done_tx, mut done_rx) = mpsc::channel::<()>(1);
    let config = WorkerConfig {
        queues: vec!["term".into()],
        concurrency: 4,
        batch: 4,
        poll_interval: Duration::from_millis(50),
        owner: "survivor".into(),
        ..WorkerConfig::default()
    };
    let c2 = calls.clone();
    let worker = Worker::new(worker_ferry, config, move |_job: Claimed, _ctx: JobContext| {
        let calls = c2.clone();
        let (half_tx, done_tx) = (half_tx.clone(), done_tx.clone());
        let mut go = go_rx.clone();
        async move {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            if n == N / 2 {
                let _ = half_tx.try_send(());
            }
            if n >= N / 2 {
                // Hold the second half until the backends have been killed.
                let _ = go.wait_for(|v| *v).await;
            }
            if n >= N {
                let _ = done_tx.try_send(());
            }
            Ok(json!({}))
        }
    });
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(worker.run(async move {
        let _ = stop_rx.await;
    }));
    half_rx.recv().await.unwrap();
    let killed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1) k",
    )
    .bind(&app)
    .fetch_one(t.ferry.db().as_postgres().unwrap())
    .await
    .unwrap();
    assert!(killed >= 1, "the worker's connections were terminated");
    go_tx.send(true).unwrap();
    // Every handler has run; graceful shutdown waits for their completions,
    // which retry on fresh connections where the old ones were killed.
    done_rx.recv().await.unwrap();
    stop_tx.send(()).unwrap();
    running.await.unwrap().unwrap();
    assert_eq!(
        t.scalar("SELECT count(*) FROM run_events WHERE kind = 'run_succeeded'")
            .await,
        N as i64
    );
    assert_eq!(
        t.scalar("SELECT count(*) FROM jobs WHERE state <> 'succeeded'").await,
        0,
        "nothing lost"
    );
    assert_eq!(calls.load(Ordering::SeqCst), N, "no job needed a second attempt");
}

/// A handler that holds the job's row inside its own transaction while the
/// worker renews the lease: the renewal waits for that row lock, so it must
/// run beside the handler, not instead of it. Renewing inline (the handler
/// not polled while the renewal waits) deadlocks: the job never completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_never_stalls_a_handler_holding_the_job_row() {
    let t = TestDb::new(Kind::Postgres).await;
    let run = NewRun::new("acme", "work", "k-lock", json!({})).queue("q");
    let run_id = t.ferry.create_run_idempotent(run).await.unwrap().run.run_id;
    let cfg = WorkerConfig {
        queues: vec!["q".into()],
        concurrency: 1,
        batch: 1,
        lease: Duration::from_secs(30),
        renew_every: Some(Duration::from_millis(10)),
        poll_interval: Duration::from_millis(20),
        owner: "row-holder".into(),
        ..WorkerConfig::default()
    };
    let probe = t.ferry.clone();
    let handler_db = t.ferry.clone();
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<()>();
    let worker = Worker::new(t.reopen().await, cfg, move |job: Claimed, _ctx: JobContext| {
        let (probe, db, done_tx) = (probe.clone(), handler_db.clone(), done_tx.clone());
        async move {
            let pool = db.db().as_postgres().unwrap().clone();
            let mut tx = pool.begin().await.unwrap();
            sqlx::query("SELECT 1 FROM jobs WHERE run_id = $1 FOR UPDATE")
                .bind(job.lease.run_id)
                .execute(&mut *tx)
                .await
                .unwrap();
            // Hold the row until a renewal is waiting for it.
            let probe = probe.db().as_postgres().unwrap().clone();
            loop {
                let waiting: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
                     WHERE NOT l.granted AND a.query LIKE '%Extends the lease%'",
                )
                .fetch_one(&probe)
                .await
                .unwrap();
                if waiting > 0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            tx.commit().await.unwrap();
            let _ = done_tx.send(());
            Ok(json!({"held": true}))
        }
    });
    let stats = worker.stats();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(worker.run(async move {
        let _ = stop_rx.await;
    }));
    // Bounded, so a deadlocked worker fails the test instead of hanging it.
    let done = tokio::time::timeout(Duration::from_secs(30), done_rx.recv()).await;
    assert!(
        matches!(done, Ok(Some(()))),
        "the handler never got past the renewal waiting for its row"
    );
    let start = std::time::Instant::now();
    while stats.completed.load(Ordering::SeqCst) == 0 {
        assert!(start.elapsed() < Duration::from_secs(30), "the job never completed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    stop_tx.send(()).unwrap();
    running.await.unwrap().unwrap();
    assert_eq!(
        t.ferry.get_run("acme", run_id).await.unwrap().state,
        ferry::RunState::Succeeded
    );
}

/// A service passes its own `sqlx::Transaction` (as `&mut PgConnection`) to
/// the `*_in` calls: acceptance and completion commit or roll back together
/// with its domain writes, and completion stays fenced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_passes_its_own_sqlx_transaction() {
    let t = TestDb::new(Kind::Postgres).await;
    let pool = t.ferry.db().as_postgres().unwrap().clone();
    sqlx::query("CREATE TABLE orders (id TEXT PRIMARY KEY, paid BOOLEAN NOT NULL DEFAULT false)")
        .execute(&pool)
        .await
        .unwrap();
    let order = || NewRun::new("acme", "charge", "order-1", json!({"order": "o-1"}));

    // Rolled back: neither the order nor the run.
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO orders (id) VALUES ('o-1')")
        .execute(&mut *tx)
        .await
        .unwrap();
    t.ferry.create_run_idempotent_in(&mut *tx, order()).await.unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(t.scalar("SELECT count(*) FROM orders").await, 0);
    assert_eq!(t.scalar("SELECT count(*) FROM runs").await, 0);

    // Committed: both.
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO orders (id) VALUES ('o-1')")
        .execute(&mut *tx)
        .await
        .unwrap();
    let accepted = t.ferry.create_run_idempotent_in(&mut *tx, order()).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(t.scalar("SELECT count(*) FROM runs").await, 1);

    // The handler's domain write and the completion: a rollback undoes both...
    let c = t
        .ferry
        .jobs()
        .claim("default", "w1", Duration::from_secs(30), 1)
        .await
        .unwrap()
        .pop()
        .unwrap();
    assert_eq!(c.lease.run_id, accepted.run.run_id);
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("UPDATE orders SET paid = true")
        .execute(&mut *tx)
        .await
        .unwrap();
    t.ferry
        .jobs()
        .complete_in(&mut *tx, &c.lease, &json!({"paid": true}))
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(t.scalar("SELECT count(*) FROM orders WHERE paid").await, 0);
    assert_eq!(t.scalar("SELECT count(*) FROM runs WHERE state = 'queued'").await, 1);

    // ...a commit keeps both...
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("UPDATE orders SET paid = true")
        .execute(&mut *tx)
        .await
        .unwrap();
    t.ferry
        .jobs()
        .complete_in(&mut *tx, &c.lease, &json!({"paid": true}))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(t.scalar("SELECT count(*) FROM orders WHERE paid").await, 1);
    assert_eq!(t.scalar("SELECT count(*) FROM runs WHERE state = 'succeeded'").await, 1);

    // ...and a stale lease is refused inside the caller's transaction too.
    let mut tx = pool.begin().await.unwrap();
    let stale = t
        .ferry
        .jobs()
        .complete_in(&mut *tx, &c.lease, &json!({}))
        .await
        .unwrap_err();
    assert!(matches!(stale, ferry::Error::RunTerminal { .. }), "{stale:?}");
    tx.rollback().await.unwrap();
}

/// In-flight handlers of one group (a whole queue, or one tenant) in the
/// limit tests below.
#[derive(Debug, Default, Clone, Copy)]
struct Flight {
    /// Handlers running now, and the most at once.
    now: usize,
    max: usize,
    /// The most leases of the group the database held when a handler started.
    max_leased: i64,
    started: usize,
    total: usize,
}

/// Runs eight workers (4 slots each, so 32 slots) on queue `lim` holding
/// `jobs_per_tenant` jobs of each of `tenants`, under `limits`. Each handler
/// holds its slot until its group (`group_of(tenant)`) has `cap` handlers in
/// flight, or every job of the group has started: so the groups sit at
/// their cap while the other workers keep claiming, and a claim past the
/// limit would show as a maximum above `cap`. Each handler also counts its
/// group's live leases in the database as it starts (a claim of several
/// jobs past the limit shows there even when their handlers happen to run
/// one after another). Returns each group's flight.
async fn eight_workers_under(
    limits: ferry::QueueLimits,
    tenants: &[&str],
    jobs_per_tenant: usize,
    group_of: fn(&str) -> String,
    cap: usize,
) -> std::collections::BTreeMap<String, Flight> {
    use std::collections::BTreeMap;
    use std::sync::Mutex;
    let t = TestDb::new(Kind::Postgres).await;
    let mut flights: BTreeMap<String, Flight> = BTreeMap::new();
    for tenant in tenants {
        let runs = (0..jobs_per_tenant)
            .map(|i| NewRun::new(*tenant, "work", format!("k-{i}"), json!({"i": i})).queue("lim"))
            .collect();
        for r in t.ferry.create_runs_idempotent(runs).await.unwrap() {
            r.unwrap();
        }
        flights.entry(group_of(tenant)).or_default().total += jobs_per_tenant;
    }
    t.ferry
        .operator()
        .set_queue_limits("lim", limits, "test", "limits under load")
        .await
        .unwrap();
    let total = tenants.len() * jobs_per_tenant;
    let state = Arc::new((Mutex::new(flights), tokio::sync::Notify::new()));
    let finished = Arc::new(AtomicUsize::new(0));
    let (done_tx, mut done_rx) = mpsc::channel::<()>(1);
    let mut stops = Vec::new();
    let mut running = Vec::new();
    let mut stats = Vec::new();
    for w in 0..8 {
        let (state, finished, done_tx) = (state.clone(), finished.clone(), done_tx.clone());
        let pool = t.ferry.db().as_postgres().unwrap().clone();
        let ferry = if w % 2 == 0 { t.ferry.clone() } else { t.reopen().await };
        let config = WorkerConfig {
            queues: vec!["lim".into()],
            concurrency: 4,
            batch: 4,
            poll_interval: Duration::from_millis(20),
            owner: format!("lim-{w}"),
            ..WorkerConfig::default()
        };
        let worker = Worker::new(ferry, config, move |job: Claimed, _ctx: JobContext| {
            let (state, finished, done_tx, pool) = (state.clone(), finished.clone(), done_tx.clone(), pool.clone());
            async move {
                let group = group_of(&job.lease.tenant);
                let leased: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM jobs WHERE queue = 'lim' AND state = 'leased' AND lease_expires_at > \
                     (extract(epoch FROM now()) * 1000)::bigint AND ($1::text IS NULL OR tenant = $1)",
                )
                .bind((group != "all").then_some(job.lease.tenant.as_str()))
                .fetch_one(&pool)
                .await
                .unwrap();
                {
                    let mut flights = state.0.lock().unwrap();
                    let f = flights.get_mut(&group).unwrap();
                    f.now += 1;
                    f.started += 1;
                    f.max = f.max.max(f.now);
                    f.max_leased = f.max_leased.max(leased);
                }
                state.1.notify_waiters();
                loop {
                    let changed = state.1.notified();
                    tokio::pin!(changed);
                    changed.as_mut().enable();
                    let f = state.0.lock().unwrap()[&group];
                    if f.now >= cap || f.started == f.total {
                        break;
                    }
                    changed.await;
                }
                state.0.lock().unwrap().get_mut(&group).unwrap().now -= 1;
                state.1.notify_waiters();
                if finished.fetch_add(1, Ordering::SeqCst) + 1 == total {
                    let _ = done_tx.try_send(());
                }
                Ok(json!({}))
            }
        });
        stats.push(worker.stats());
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        stops.push(stop_tx);
        running.push(tokio::spawn(worker.run(async move {
            let _ = stop_rx.await;
        })));
    }
    tokio::time::timeout(Duration::from_secs(120), done_rx.recv())
        .await
        .expect("every job of the limited queue ran");
    for s in stops {
        let _ = s.send(());
    }
    for r in running {
        r.await.unwrap().unwrap();
    }
    assert_eq!(
        t.scalar("SELECT count(*) FROM jobs WHERE state = 'succeeded'").await,
        total as i64,
        "every job finished"
    );
    // Every worker claimed against the limit (a worker holding the limit
    // keeps it by claiming with its completions, so others may get nothing).
    assert!(
        stats.iter().all(|s| s.claim_statements.load(Ordering::SeqCst) >= 1),
        "every worker tried to claim"
    );
    let flights = state.0.lock().unwrap().clone();
    flights
}

/// Eight workers on a queue limited to 3 leases: never more than 3
/// handlers run at once, and the limit is reached (so the test exercised it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_workers_never_exceed_the_queue_limit() {
    let limits = ferry::QueueLimits {
        max_leased: Some(3),
        ..ferry::QueueLimits::default()
    };
    let flights = eight_workers_under(limits, &["a", "b", "c"], 40, |_| "all".into(), 3).await;
    let all = flights["all"];
    assert_eq!((all.max, all.max_leased, all.started), (3, 3, 120), "{flights:?}");
}

/// Eight workers on a queue with a cap of 2 leases per tenant: each tenant
/// runs at most 2 at once, and each reaches 2 while the others run too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_workers_never_exceed_the_tenant_cap() {
    let limits = ferry::QueueLimits {
        max_leased_per_tenant: Some(2),
        ..ferry::QueueLimits::default()
    };
    let flights = eight_workers_under(limits, &["a", "b", "c"], 30, |t| t.to_string(), 2).await;
    for (tenant, f) in &flights {
        assert_eq!(
            (f.max, f.max_leased, f.started),
            (2, 2, 30),
            "tenant {tenant}: {flights:?}"
        );
    }
}

/// Unexpired leases of a high priority stay out of the claim's index range
/// (PostgreSQL-only: the test reads the plan). 200 leased priority-100 jobs
/// (a 100-minute lead at the default aging step, far longer than their
/// lease) and 5 due priority-0 jobs: the claim's scan of `jobs_claim_idx`
/// yields only the due jobs, with no leased row fetched and filtered out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unexpired_leases_stay_out_of_the_claim_index_range() {
    let t = TestDb::with_clock(Kind::Postgres, crate::support::manual_clock()).await;
    let high = (0..200)
        .map(|i| {
            NewRun::new("acme", "work", format!("h-{i}"), json!({}))
                .queue("q")
                .priority(100)
        })
        .collect();
    for r in t.ferry.create_runs_idempotent(high).await.unwrap() {
        r.unwrap();
    }
    let held = t
        .ferry
        .jobs()
        .claim("q", "w", Duration::from_secs(30), 200)
        .await
        .unwrap();
    assert_eq!(held.len(), 200);
    let low = (0..5)
        .map(|i| NewRun::new("acme", "work", format!("l-{i}"), json!({})).queue("q"))
        .collect();
    for r in t.ferry.create_runs_idempotent(low).await.unwrap() {
        r.unwrap();
    }
    let mut c = t.ferry.db().as_postgres().unwrap().acquire().await.unwrap();
    // The table is small: make the planner use the index it uses at scale.
    for set in ["SET enable_seqscan = off", "SET enable_bitmapscan = off"] {
        sqlx::query(set).execute(&mut *c).await.unwrap();
    }
    sqlx::query("ANALYZE jobs").execute(&mut *c).await.unwrap();
    // The claim's scan (the claim_due fragment) at the test clock's instant.
    let plan: serde_json::Value = sqlx::query_scalar(&format!(
        "EXPLAIN (ANALYZE, FORMAT JSON) SELECT j.tenant, j.run_id FROM jobs j \
         WHERE j.queue = 'q' AND j.state IN ('queued', 'leased') AND j.claim_key <= {now} \
           AND j.available_at <= {now} AND j.attempts < j.max_attempts \
           AND (j.deadline_at IS NULL OR j.deadline_at > {now}) \
         ORDER BY j.claim_key LIMIT 10 FOR UPDATE OF j SKIP LOCKED",
        now = crate::support::T0
    ))
    .fetch_one(&mut *c)
    .await
    .unwrap();
    fn walk(node: &serde_json::Value, out: &mut Vec<(String, String, i64, i64)>) {
        if let Some(rel) = node.get("Index Name").or(node.get("Relation Name")) {
            out.push((
                node["Node Type"].as_str().unwrap_or_default().to_owned(),
                rel.as_str().unwrap_or_default().to_owned(),
                node["Actual Rows"].as_i64().unwrap_or_default(),
                node.get("Rows Removed by Filter").and_then(|v| v.as_i64()).unwrap_or(0),
            ));
        }
        for child in node.get("Plans").and_then(|p| p.as_array()).into_iter().flatten() {
            walk(child, out);
        }
    }
    let mut scans = Vec::new();
    walk(&plan[0]["Plan"], &mut scans);
    assert_eq!(
        scans,
        [("Index Scan".to_owned(), "jobs_claim_idx".to_owned(), 5, 0)],
        "{plan:#}"
    );
}

/// A limited claim on a PostgreSQL connection outside a transaction is
/// refused before it leases anything (PostgreSQL-only: there each statement
/// would autocommit, dropping the queue's row lock before the claim that
/// counts under it; SQLite's path is documented as needing a transaction).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limited_claim_outside_a_transaction_is_refused() {
    let t = TestDb::new(Kind::Postgres).await;
    let runs = (0..6)
        .map(|i| NewRun::new("acme", "work", format!("k-{i}"), json!({})).queue("q"))
        .collect();
    for r in t.ferry.create_runs_idempotent(runs).await.unwrap() {
        r.unwrap();
    }
    let limits = ferry::QueueLimits {
        max_leased: Some(4),
        ..ferry::QueueLimits::default()
    };
    t.ferry
        .operator()
        .set_queue_limits("q", limits, "ops", "cap")
        .await
        .unwrap();
    // A claim finds the queue limited (and this process remembers it).
    let held = t
        .ferry
        .jobs()
        .claim("q", "w", Duration::from_secs(30), 1)
        .await
        .unwrap();
    assert_eq!(held.len(), 1);
    let mut c = t.ferry.db().as_postgres().unwrap().acquire().await.unwrap();
    let err = t
        .ferry
        .jobs()
        .complete_and_claim_in(&mut *c, &[], "q", "w", Duration::from_secs(30), 3)
        .await
        .unwrap_err();
    assert_eq!(err.code(), "unsupported", "{err}");
    assert_eq!(
        t.scalar("SELECT count(*) FROM jobs WHERE state = 'leased'").await,
        1,
        "nothing more leased"
    );
    // The same call in a transaction claims within the limit.
    let mut tx = t.ferry.begin().await.unwrap();
    let (_, got) = t
        .ferry
        .jobs()
        .complete_and_claim_in(&mut tx, &[], "q", "w", Duration::from_secs(30), 10)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(got.len(), 3);
}

/// Closing an attempt writes finished_at and the outcome, neither indexed,
/// on a page with room (job_attempts' fillfactor): a HOT update, with no new
/// index entry. Counted in the completion's own transaction
/// (`pg_stat_get_xact_*`), so no statistics flush is waited for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_an_attempt_is_a_hot_update() {
    let t = TestDb::with_clock(Kind::Postgres, crate::support::manual_clock()).await;
    let runs = (0..200)
        .map(|i| NewRun::new("acme", "work", format!("k-{i}"), json!({})).queue("q"))
        .collect();
    for r in t.ferry.create_runs_idempotent(runs).await.unwrap() {
        r.unwrap();
    }
    let lease = Duration::from_secs(30);
    let held = t.ferry.jobs().claim("q", "w", lease, 200).await.unwrap();
    assert_eq!(held.len(), 200);
    let items: Vec<_> = held.iter().map(|c| (c.lease.clone(), json!({}))).collect();
    let mut tx = t.ferry.db().as_postgres().unwrap().begin().await.unwrap();
    let (done, _) = t
        .ferry
        .jobs()
        .complete_and_claim_in(&mut *tx, &items, "q", "w", lease, 1)
        .await
        .unwrap();
    assert!(done.iter().all(Result::is_ok));
    let (updated, hot): (i64, i64) = sqlx::query_as(
        "SELECT pg_stat_get_xact_tuples_updated('job_attempts'::regclass),
                pg_stat_get_xact_tuples_hot_updated('job_attempts'::regclass)",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert_eq!((updated, hot), (200, 200), "every attempt closed by a HOT update");
}

/// A batch completion looks each run up by its primary key however stale
/// the statistics are (PostgreSQL-only: the test reads the transaction's
/// index counters). Statistics taken while no run was queued, then a
/// backlog they do not know of: with `r.state = 'queued'` in the
/// completion's join, the planner looked runs up through
/// `runs_tenant_state_created_idx`, reading the tenant's whole backlog per
/// statement (0.4-2 s per 100 completions in the pipeline benchmark).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_completion_reads_runs_by_key_under_stale_statistics() {
    let t = TestDb::new(Kind::Postgres).await;
    let lease = Duration::from_secs(30);
    let create = |prefix: &'static str, n: usize| {
        (0..n)
            .map(move |i| NewRun::new("acme", "work", format!("{prefix}-{i}"), json!({})).queue("q"))
            .collect::<Vec<_>>()
    };
    let done_before: Vec<_> = {
        for r in t.ferry.create_runs_idempotent(create("old", 300)).await.unwrap() {
            r.unwrap();
        }
        let held = t.ferry.jobs().claim("q", "w", lease, 300).await.unwrap();
        held.into_iter().map(|c| (c.lease, json!({}))).collect()
    };
    for r in t.ferry.jobs().complete_batch(&done_before).await.unwrap() {
        r.unwrap();
    }
    let pool = t.ferry.db().as_postgres().unwrap().clone();
    sqlx::query("ANALYZE runs").execute(&pool).await.unwrap();
    for r in t.ferry.create_runs_idempotent(create("new", 3000)).await.unwrap() {
        r.unwrap();
    }
    let items: Vec<_> = t
        .ferry
        .jobs()
        .claim("q", "w", lease, 100)
        .await
        .unwrap()
        .into_iter()
        .map(|c| (c.lease, json!({})))
        .collect();
    // The backend's counters also hold its earlier statements' scans until
    // they are reported (after a transaction, when idle): read them before
    // and after, inside one transaction, where nothing is reported.
    let counters = "SELECT pg_stat_get_xact_numscans('runs_tenant_state_created_idx'::regclass),
                           pg_stat_get_xact_numscans('runs_pkey'::regclass)";
    let mut c = pool.begin().await.unwrap();
    let before: (i64, i64) = sqlx::query_as(counters).fetch_one(&mut *c).await.unwrap();
    let (results, _) = t
        .ferry
        .jobs()
        .complete_and_claim_in(&mut *c, &items, "q", "w", lease, 1)
        .await
        .unwrap();
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    let after: (i64, i64) = sqlx::query_as(counters).fetch_one(&mut *c).await.unwrap();
    c.commit().await.unwrap();
    let scans = (after.0 - before.0, after.1 - before.1);
    assert_eq!(scans.0, 0, "runs looked up through the state index: {scans:?}");
    assert!(scans.1 >= 100, "each completed run read by its key: {scans:?}");
}

/// A pool built with `idle_in_transaction_timeout` has its session ended
/// by the server (FATAL 25P03) when a transaction stays idle past the
/// limit (a process frozen, a handler awaiting something else): the
/// session is gone and the transaction changed nothing, an infrastructure
/// failure like a terminated backend (57P01), so it is transient: a job
/// handler's `?` retries the job instead of killing it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_ended_idle_in_a_transaction_is_transient() {
    let t = TestDb::new(Kind::Postgres).await;
    let ferry = Ferry::builder(&t.url)
        .idle_in_transaction_timeout(Duration::from_millis(200))
        .connect()
        .await
        .unwrap();
    let mut tx = ferry.db().as_postgres().unwrap().begin().await.unwrap();
    sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let ended = ferry::Error::from(sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap_err());
    assert!(ended.is_transient(), "{ended:?}");
    assert_eq!(
        ferry::JobError::from(ended).class,
        ferry::ErrorClass::Retryable,
        "a job would die of its session's end"
    );
}

/// An idle-in-transaction limit beyond PostgreSQL's range (its setting is
/// an `int` of milliseconds, about 24.8 days) is the longest it takes, not
/// a SET that fails on every new connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_in_transaction_limit_beyond_postgres_range_is_its_longest() {
    let t = TestDb::new(Kind::Postgres).await;
    let ferry = Ferry::builder(&t.url)
        .idle_in_transaction_timeout(Duration::from_secs(30 * 86_400))
        .connect()
        .await
        .expect("a 30-day limit refused every connection");
    let set: String = sqlx::query_scalar("SHOW idle_in_transaction_session_timeout")
        .fetch_one(ferry.db().as_postgres().unwrap())
        .await
        .unwrap();
    assert_eq!(set, "2147483647ms");
}

/// A replay (`ferry dead replay`, the console) takes the delivered ledger's
/// lock, as the WAL marker does, from a pool with no idle-in-transaction
/// limit of its own: a process frozen inside that transaction (Ctrl-Z, a
/// paused container) kept every WAL relay's marks waiting for as long as
/// it stayed frozen. Whoever takes the ledger's lock has its session ended
/// after 5 s idle in that transaction, so the next writer goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_holder_of_the_ledger_lock_does_not_stop_other_writers() {
    let t = TestDb::new(Kind::Postgres).await;
    let pool = t.ferry.db().as_postgres().unwrap();
    let lock = ferry::store::queries::POSTGRES_ONLY.replay_ledger_lock;
    let mut frozen = pool.begin().await.unwrap();
    sqlx::query(lock).execute(&mut *frozen).await.unwrap();

    let mut next = pool.begin().await.unwrap();
    tokio::time::timeout(Duration::from_secs(20), sqlx::query(lock).execute(&mut *next))
        .await
        .expect("a writer waited on a frozen holder of the ledger's lock")
        .unwrap();
    next.commit().await.unwrap();
    assert!(
        sqlx::query("SELECT 1").execute(&mut *frozen).await.is_err(),
        "the frozen holder's transaction outlived the limit"
    );
}

/// Waits (on the event, never a clock) until `n` sessions wait for the
/// advisory lock `pg_locks` shows as (`classid`, `objid`, `objsubid`);
/// panics if `task` ends first or after 60 s.
async fn until_waiting<T: std::fmt::Debug>(
    conn: &mut sqlx::PgConnection,
    lock: (i64, i64, i32),
    n: i64,
    task: &tokio::task::JoinHandle<T>,
) {
    let seen = std::time::Instant::now();
    loop {
        let waiters: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
             AND classid = $1::oid AND objid = $2::oid AND objsubid = $3",
        )
        .bind(lock.0)
        .bind(lock.1)
        .bind(lock.2 as i16)
        .fetch_one(&mut *conn)
        .await
        .unwrap();
        if waiters >= n {
            return;
        }
        assert!(
            !task.is_finished(),
            "the migrator ended instead of waiting for its lock"
        );
        assert!(
            seen.elapsed() < Duration::from_secs(60),
            "{n} migrators never waited for {lock:?}"
        );
        // A poll every 5 ms, not a busy loop beside the migrator it waits for.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Whether `schema` of the database at `url` holds Ferry's `runs` table.
async fn migrated(url: &str, schema: &str) -> bool {
    use sqlx::Connection as _;
    let mut c = sqlx::PgConnection::connect(url).await.unwrap();
    sqlx::query_scalar("SELECT to_regclass(quote_ident($1) || '.runs') IS NOT NULL")
        .bind(schema)
        .fetch_one(&mut c)
        .await
        .unwrap()
}

/// Migrations lock the schema they migrate, not the database: a migrator
/// of a schema whose lock another session holds waits (nothing of it
/// applied meanwhile), and one of another schema in the same database goes
/// on and finishes (with sqlx's own exclusive lock, one per database, it
/// would wait for the waiting one: every test's migrations waited for every
/// other's). A migrator whose caller gave up leaves no lock behind: the
/// next one finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_wait_for_their_own_schema_only() {
    use sqlx::Connection as _;
    let (a, b) = (
        ferry_testkit::fresh_database_url(Kind::Postgres).await.unwrap(),
        ferry_testkit::fresh_database_url(Kind::Postgres).await.unwrap(),
    );
    let schema_b = b.rsplit("search_path%3D").next().unwrap().to_owned();
    // Another migrator of this version, mid-way through schema `a`.
    let mut holder = sqlx::PgConnection::connect(&a).await.unwrap();
    let (schema_a, key): (String, i32) = sqlx::query_as("SELECT current_schema()::text, hashtext(current_schema())")
        .fetch_one(&mut holder)
        .await
        .unwrap();
    sqlx::query("SELECT pg_advisory_lock(x'46657272'::int, $1)")
        .bind(key)
        .execute(&mut holder)
        .await
        .unwrap();
    let schema_lock = (0x4665_7272, i64::from(key as u32), 2);

    let db_a = ferry::connect(&a).await.unwrap();
    let waiting = tokio::spawn({
        let db = db_a.clone();
        async move { ferry::migrate(&db).await }
    });
    until_waiting(&mut holder, schema_lock, 1, &waiting).await;
    // A second migrator of `a`, whose caller gives up while it waits.
    let abandoned = tokio::spawn({
        let db = db_a.clone();
        async move { ferry::migrate(&db).await }
    });
    until_waiting(&mut holder, schema_lock, 2, &abandoned).await;
    abandoned.abort();

    // Schema `b` migrates meanwhile.
    let db_b = ferry::connect(&b).await.unwrap();
    tokio::time::timeout(Duration::from_secs(60), ferry::migrate(&db_b))
        .await
        .expect("schema b's migrations waited for schema a's lock")
        .unwrap();
    assert!(migrated(&b, &schema_b).await, "schema b has no runs table");
    assert!(
        !migrated(&a, &schema_a).await,
        "schema a was migrated under another's lock"
    );

    // The lock released, `a` migrates; the abandoned migrator holds nothing
    // for long, so a later one finishes too.
    holder.close().await.unwrap();
    tokio::time::timeout(Duration::from_secs(60), waiting)
        .await
        .expect("schema a's migrator still waits after the lock was released")
        .unwrap()
        .unwrap();
    assert!(migrated(&a, &schema_a).await, "schema a has no runs table");
    tokio::time::timeout(Duration::from_secs(60), ferry::migrate(&db_a))
        .await
        .expect("a lock was left behind by a finished or abandoned migrator")
        .unwrap();
}

/// An older Ferry (sqlx's migrator, which takes its lock on the database
/// exclusively: sqlx's own `Migrate::lock`, so its key is sqlx's) and this
/// one exclude each other: while that lock is held, this version's
/// migrator waits and applies nothing. In a database of its own: the lock
/// held stops every migrator of the database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_wait_for_an_older_migrator_of_the_database() {
    use sqlx::migrate::Migrate as _;
    use sqlx::Connection as _;
    let (url, _) = ferry_testkit::fresh_database_behind_pgbouncer().await.unwrap();
    let mut older = sqlx::PgConnection::connect(&url).await.unwrap();
    let schema: String = sqlx::query_scalar("SELECT current_schema()::text")
        .fetch_one(&mut older)
        .await
        .unwrap();
    older.lock().await.unwrap();
    let (classid, objid): (i64, i64) = sqlx::query_as(
        "SELECT classid::bigint, objid::bigint FROM pg_locks \
         WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND objsubid = 1",
    )
    .fetch_one(&mut older)
    .await
    .unwrap();
    let db = ferry::connect(&url).await.unwrap();
    let waiting = tokio::spawn(async move { ferry::migrate(&db).await });
    until_waiting(&mut older, (classid, objid, 1), 1, &waiting).await;
    assert!(
        !migrated(&url, &schema).await,
        "migrated while an older migrator held the database"
    );
    older.close().await.unwrap();
    tokio::time::timeout(Duration::from_secs(60), waiting)
        .await
        .expect("still waiting after the older migrator ended")
        .unwrap()
        .unwrap();
    assert!(migrated(&url, &schema).await, "no runs table");
}
