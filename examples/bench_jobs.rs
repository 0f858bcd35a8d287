//! Job benchmarks on PostgreSQL, each beside a raw-SQL baseline of the same
//! statements run in the same process and the same run:
//! enqueue (single and batched), outbox enqueue with and without the
//! per-key advisory lock, claim+complete with 1/4/16 workers (single
//! and batch claims), and claim latency over a 10k and a 1M backlog.
//! `bulk` compares bulk acceptance (`create_runs_idempotent`, batches of
//! 1000) with per-run acceptance at 1000 per transaction and with plain
//! multi-row INSERTs of the same five rows per run. `limits` compares the
//! claim with and without queue limits, in the same run. `pooler` runs
//! acceptance and the worker directly and through PgBouncer in transaction
//! pooling (`FERRY_PGBOUNCER_URL`, default the test one on port 6433), in
//! the same run.
//!
//!     cargo run --release --example bench_jobs -- [--quick] [worker | keylock | bulk | limits | notify | pooler]
#![allow(clippy::print_stdout)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry::store::queries::QUERIES;
use ferry::{Ferry, NewRun};
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[tokio::main]
async fn main() -> Res<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    // `--only worker` runs just the worker-runtime rows.
    let only_worker = std::env::args().any(|a| a == "worker");
    let base = std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let n = if quick { 2_000 } else { 20_000 };
    println!("ferry job benchmarks (PostgreSQL, 16 connections, n = {n})\n");
    println!("{:<44} {:>12} {:>12}", "measure", "ferry", "raw SQL");

    // `keylock` runs just the outbox key-lock rows.
    if std::env::args().any(|a| a == "keylock") {
        return key_lock_cost(&base, n).await;
    }
    // `limits` runs just the queue-limits rows.
    if std::env::args().any(|a| a == "limits") {
        return limits_cost(&base, quick).await;
    }
    // `notify` runs just the NOTIFY cost rows.
    if std::env::args().any(|a| a == "notify") {
        return notify_cost(&base, n).await;
    }
    // `pooler` runs just the direct-vs-PgBouncer rows.
    if std::env::args().any(|a| a == "pooler") {
        return pooler_cost(&base, n, quick).await;
    }
    // `bulk` runs just the bulk acceptance rows.
    if std::env::args().any(|a| a == "bulk") {
        return bulk_accept(&base, quick).await;
    }
    if !only_worker {
        enqueue_and_claim(&base, n).await?;
    }
    worker_runtime(&base, quick).await?;
    if !only_worker {
        claim_latency(&base, quick).await?;
    }
    Ok(())
}

/// The cost of wake-up notifications: none, coalesced at 10 ms (the
/// default) and at 50 ms, and one per transaction.
async fn notify_cost(base: &str, n: usize) -> Res<()> {
    let mut rates = Vec::new();
    for interval in [
        Duration::from_secs(3600),
        Duration::from_millis(10),
        Duration::from_millis(50),
        Duration::ZERO,
    ] {
        let (_, pool) = fresh(base, "notify").await?;
        let f = Ferry::builder(url_of(base, "notify"))
            .notify_interval(interval)
            .build(pool.into())
            .await?;
        rates.push(accept_rate(f, n).await?);
    }
    row("enqueue, NOTIFY coalesced 10 ms (jobs/s) vs none", rates[1], rates[0]);
    row("enqueue, NOTIFY coalesced 50 ms (jobs/s) vs none", rates[2], rates[0]);
    row("enqueue, NOTIFY every tx (jobs/s) vs none", rates[3], rates[0]);
    for (name, r) in [("10 ms", rates[1]), ("50 ms", rates[2]), ("every tx", rates[3])] {
        println!(
            "{:<44} {:>11.1}%",
            format!("NOTIFY cost, {name}"),
            (1.0 - r / rates[0]) * 100.0
        );
    }
    Ok(())
}

async fn enqueue_and_claim(base: &str, n: usize) -> Res<()> {
    // Enqueue, single acceptance per transaction, 16 concurrent clients.
    let (f, pool) = fresh(base, "enq").await?;
    let ferry_rate = accept_rate(f, n).await?;
    let raw = rate(n, 16, move |i| raw_accept(pool.clone(), i, 1)).await?;
    row("enqueue, 1 per tx (jobs/s)", ferry_rate, raw);

    notify_cost(base, n).await?;

    key_lock_cost(base, n).await?;

    // Enqueue, 100 acceptances per transaction.
    let (f, pool) = fresh(base, "enqb").await?;
    let ferry_rate = rate(n / 100, 16, move |i| {
        let f = f.clone();
        async move {
            let mut tx = f.begin().await?;
            for j in 0..100 {
                let run = NewRun::new("bench", "op", format!("k{i}-{j}"), json!({"i": i, "j": j}));
                f.create_run_idempotent_in(tx.conn(), run).await?;
            }
            tx.commit().await?;
            Ok(100)
        }
    })
    .await?;
    let raw = rate(n / 100, 16, move |i| raw_accept(pool.clone(), i, 100)).await?;
    row("enqueue, 100 per tx (jobs/s)", ferry_rate, raw);

    // Claim + complete.
    for (workers, batch) in [(1, 1), (4, 1), (16, 1), (1, 100), (4, 100), (16, 100)] {
        let jobs = if batch == 1 { n / 2 } else { n * 2 };
        let (f, pool) = fresh(base, "cc").await?;
        seed(&pool, jobs).await?;
        let ferry_rate = drain(workers, move |_| {
            let f = f.clone();
            async move {
                let claimed = f
                    .jobs()
                    .claim("default", "bench", Duration::from_secs(60), batch)
                    .await?;
                for c in &claimed {
                    f.jobs().complete(&c.lease, &json!({})).await?;
                }
                Ok(claimed.len() as u64)
            }
        })
        .await?;
        let (_f, pool) = fresh(base, "ccraw").await?;
        seed(&pool, jobs).await?;
        let raw = drain(workers, move |_| raw_claim_complete(pool.clone(), batch)).await?;
        row(
            &format!("claim+complete, {workers} workers, claim {batch} (jobs/s)"),
            ferry_rate,
            raw,
        );
    }

    Ok(())
}

/// The worker runtime end to end: batch claims, handler, batched completions.
async fn worker_runtime(base: &str, quick: bool) -> Res<()> {
    for (concurrency, batch) in [(16usize, 16u32), (200, 100)] {
        let jobs = if quick { 5_000 } else { 50_000 };
        let (f, pool) = fresh(base, "worker").await?;
        seed(&pool, jobs).await?;
        let ferry_rate = run_worker(f, &pool, jobs, concurrency, batch).await?;
        let (_f, pool) = fresh(base, "workerraw").await?;
        seed(&pool, jobs).await?;
        let raw = drain(16, move |_| raw_claim_complete(pool.clone(), batch)).await?;
        row(
            &format!("Worker, {concurrency} slots, claim {batch} (jobs/s)"),
            ferry_rate,
            raw,
        );
    }

    Ok(())
}

/// Acceptance (1 per transaction, 16 clients) and the `Worker` (16 slots,
/// claim 16) directly and through a transaction pooler (`pgbouncer=true`:
/// every statement unnamed and in a transaction, wake-ups by polling),
/// each on a database of its own (PgBouncer passes no `options`, so no
/// schema per row), migrated and seeded directly. The pooler's server
/// sessions per database are its `default_pool_size` (10 in the test
/// PgBouncer), against the direct rows' 16 connections.
async fn pooler_cost(base: &str, n: usize, quick: bool) -> Res<()> {
    let pooler =
        std::env::var("FERRY_PGBOUNCER_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:6433/postgres".into());
    let jobs = if quick { 5_000 } else { 50_000 };
    let mut accepted = Vec::new();
    let mut worked = Vec::new();
    for through in [false, true] {
        let route = if through { "pooled" } else { "direct" };
        let (f, _) = routed(base, &pooler, &format!("ferry_bench_acc_{route}"), through).await?;
        accepted.push(accept_rate(f, n).await?);
        let (f, direct) = routed(base, &pooler, &format!("ferry_bench_work_{route}"), through).await?;
        let pool = PgPool::connect(&direct).await?;
        seed(&pool, jobs).await?;
        worked.push(run_worker(f, &pool, jobs, 16, 16).await?);
    }
    println!("\n{:<44} {:>12} {:>12}", "", "direct", "PgBouncer");
    row("enqueue, 1 per tx, 16 clients (jobs/s)", accepted[0], accepted[1]);
    row("Worker, 16 slots, claim 16 (jobs/s)", worked[0], worked[1]);
    Ok(())
}

/// Acceptances per second, 1 per transaction, 16 clients, `n` in all.
async fn accept_rate(f: Ferry, n: usize) -> Res<f64> {
    rate(n, 16, move |i| {
        let f = f.clone();
        async move {
            f.create_run_idempotent(NewRun::new("bench", "op", format!("k{i}"), json!({"i": i})))
                .await?;
            Ok(1)
        }
    })
    .await
}

/// A handle (16 connections) on a new database `name`, migrated over its
/// direct URL, reached through `pooler` when `through`; and the direct URL.
async fn routed(base: &str, pooler: &str, name: &str, through: bool) -> Res<(Ferry, String)> {
    let (direct, url) = fresh_database(base, pooler, name, through).await?;
    let f = Ferry::builder(&url)
        .max_connections(16)
        .direct_url(&direct)
        .migrate(true)
        .connect()
        .await?;
    Ok((f, direct))
}

/// A new, empty database `name` on `base`'s server: its direct URL, and
/// the URL Ferry uses (through `pooler` with `pgbouncer=true` when
/// `through`, else the direct one).
async fn fresh_database(base: &str, pooler: &str, name: &str, through: bool) -> Res<(String, String)> {
    let admin = PgPool::connect(base).await?;
    sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        .execute(&admin)
        .await?;
    sqlx::query(&format!("CREATE DATABASE {name}")).execute(&admin).await?;
    admin.close().await;
    let with_db = |url: &str| {
        let base = url.split('?').next().unwrap_or(url);
        let server = base.rsplit_once('/').map_or(base, |(s, _)| s);
        format!("{server}/{name}")
    };
    let direct = with_db(base);
    let url = if through {
        format!("{}?pgbouncer=true", with_db(pooler))
    } else {
        direct.clone()
    };
    Ok((direct, url))
}

/// Runs one `Worker` with `concurrency` slots claiming `batch` at a time
/// until it has completed `jobs` jobs (each handler returns at once);
/// checks they all succeeded and returns jobs per second.
async fn run_worker(f: Ferry, pool: &PgPool, jobs: usize, concurrency: usize, batch: u32) -> Res<f64> {
    let start = Instant::now();
    let count = Arc::new(AtomicU64::new(0));
    let (tx, mut rx) = tokio::sync::mpsc::channel::<()>(1);
    let c = count.clone();
    let worker = ferry::worker::Worker::new(
        f,
        ferry::worker::WorkerConfig {
            concurrency,
            batch,
            poll_interval: Duration::from_millis(10),
            ..Default::default()
        },
        move |_job: ferry::Claimed, _ctx| {
            let (c, tx) = (c.clone(), tx.clone());
            async move {
                if c.fetch_add(1, Ordering::Relaxed) + 1 == jobs as u64 {
                    let _ = tx.try_send(());
                }
                Ok(json!({}))
            }
        },
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(worker.run(async move {
        let _ = stopped.await;
    }));
    rx.recv().await;
    let _ = stop.send(());
    running.await??;
    let rate = jobs as f64 / start.elapsed().as_secs_f64();
    let succeeded: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE state = 'succeeded'")
        .fetch_one(pool)
        .await?;
    assert_eq!(succeeded, jobs as i64);
    Ok(rate)
}

/// The cost of queue limits enforced in the claim, with and without, in one
/// run: the Worker end to end (16 slots, claim 16) over jobs of 10 tenants,
/// with no limits (the plain claim), with all three limits set too high to
/// bind (the limited claim: row lock, lease counts, per-tenant window,
/// tokens), and with a binding `max_leased`; then the latency of single
/// claims over a 100k backlog, without and with the non-binding limits.
async fn limits_cost(base: &str, quick: bool) -> Res<()> {
    use ferry::{QueueLimits, RateLimit};
    let jobs = if quick { 2_000 } else { 5_000 };
    let loose = QueueLimits {
        max_leased: Some(1_000_000),
        max_leased_per_tenant: Some(1_000_000),
        rate: Some(RateLimit {
            burst: 1_000_000,
            every: Duration::from_millis(1),
        }),
    };
    let tight = QueueLimits {
        max_leased: Some(8),
        ..QueueLimits::default()
    };
    let mut rates = Vec::new();
    for (label, limits) in [
        ("no limits", None),
        ("3 limits, not binding", Some(loose)),
        ("max_leased 8 (binding)", Some(tight)),
    ] {
        let (f, pool) = fresh(base, "limits").await?;
        seed_tenants(&pool, jobs, 10).await?;
        if let Some(l) = limits {
            f.operator().set_queue_limits("default", l, "bench", "bench").await?;
        }
        let r = run_worker(f, &pool, jobs, 16, 16).await?;
        println!(
            "{:<44} {r:>12.0}",
            format!("Worker 16 slots, claim 16, {label} (jobs/s)")
        );
        rates.push(r);
    }
    println!(
        "{:<44} {:>11.1}%",
        "limited claim cost (not binding)",
        (1.0 - rates[1] / rates[0]) * 100.0
    );
    let backlog = 100_000;
    let (f, pool) = fresh(base, "limitslat").await?;
    seed_tenants(&pool, backlog, 10).await?;
    sqlx::query("VACUUM ANALYZE jobs").execute(&pool).await?;
    let mut lat = [Vec::new(), Vec::new()];
    // 1000 claims without limits, then 1000 with (the backlog shrinks by 1 %).
    for (limited, limits) in [QueueLimits::default(), loose].into_iter().enumerate() {
        f.operator()
            .set_queue_limits("default", limits, "bench", "bench")
            .await?;
        for _ in 0..1000 {
            let t = Instant::now();
            f.jobs().claim("default", "bench", Duration::from_secs(600), 1).await?;
            lat[limited].push(t.elapsed());
        }
    }
    for (name, p) in [("p50", 0.50), ("p99", 0.99)] {
        println!(
            "{:<44} {:>10.2}ms {:>10.2}ms",
            format!("claim 1, backlog {backlog}, {name}: none | limits"),
            pct(&mut lat[0], p),
            pct(&mut lat[1], p)
        );
    }
    Ok(())
}

/// Claim latency over a backlog.
async fn claim_latency(base: &str, quick: bool) -> Res<()> {
    for backlog in [10_000usize, if quick { 100_000 } else { 1_000_000 }] {
        let (f, pool) = fresh(base, "lat").await?;
        seed(&pool, backlog).await?;
        sqlx::query("VACUUM ANALYZE jobs").execute(&pool).await?;
        let mut ferry_lat = Vec::new();
        let mut raw_lat = Vec::new();
        for _ in 0..1000 {
            let t = Instant::now();
            f.jobs().claim("default", "bench", Duration::from_secs(60), 1).await?;
            ferry_lat.push(t.elapsed());
            let t = Instant::now();
            raw_claim(&pool, 1).await?;
            raw_lat.push(t.elapsed());
        }
        for (name, p) in [("p50", 0.50), ("p99", 0.99)] {
            println!(
                "{:<44} {:>10.2}ms {:>10.2}ms",
                format!("claim latency, backlog {backlog}, {name}"),
                pct(&mut ferry_lat, p),
                pct(&mut raw_lat, p)
            );
        }
    }
    Ok(())
}

/// The per-key advisory lock of `enqueue` (`.outbox_key_locks`, default on)
/// against none: distinct keys (the statement's own cost), then 16 clients
/// on 8 hot keys (where same-key writers wait for each other's commit).
async fn key_lock_cost(base: &str, n: usize) -> Res<()> {
    for (label, hot_keys) in [("distinct keys", usize::MAX), ("8 hot keys", 8)] {
        let mut rates = Vec::new();
        for locks in [true, false] {
            let (_, pool) = fresh(base, "keylock").await?;
            let f = Ferry::builder(url_of(base, "keylock"))
                .outbox_key_locks(locks)
                .build(pool.into())
                .await?;
            rates.push(
                rate(n, 16, move |i| {
                    let f = f.clone();
                    async move {
                        let key = format!("o-{}", i % hot_keys);
                        f.enqueue(&ferry::OutboxMessage::bytes("bench", "orders", key, b"{}".to_vec()))
                            .await?;
                        Ok(1)
                    }
                })
                .await?,
            );
        }
        row(
            &format!("outbox enqueue, key lock vs none, {label}"),
            rates[0],
            rates[1],
        );
    }
    Ok(())
}

/// Bulk acceptance against per-run acceptance and plain multi-row INSERTs,
/// all in batches of 1000 runs per transaction on `BULK_CLIENTS` clients.
async fn bulk_accept(base: &str, quick: bool) -> Res<()> {
    const BATCH: usize = 1000;
    let clients: usize = std::env::var("BULK_CLIENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    let (bulk_n, single_n) = if quick { (20_000, 4_000) } else { (100_000, 20_000) };

    let (f, _) = fresh(base, "bulk").await?;
    let cpu = cpu_seconds();
    let bulk = rate(bulk_n / BATCH, clients, move |i| {
        let f = f.clone();
        async move {
            let runs = (0..BATCH)
                .map(|j| NewRun::new("bench", "op", format!("k{i}-{j}"), json!({"i": i, "j": j})))
                .collect();
            let out = f.create_runs_idempotent(runs).await?;
            assert!(out.iter().all(|r| matches!(r, Ok(a) if !a.replay)));
            Ok(out.len() as u64)
        }
    })
    .await?;
    let bulk_cpu = (cpu_seconds() - cpu) / bulk_n as f64;

    let (f, _) = fresh(base, "bulksingle").await?;
    let cpu = cpu_seconds();
    let single = rate(single_n / BATCH, clients, move |i| {
        let f = f.clone();
        async move {
            let mut tx = f.begin().await?;
            for j in 0..BATCH {
                let run = NewRun::new("bench", "op", format!("k{i}-{j}"), json!({"i": i, "j": j}));
                f.create_run_idempotent_in(tx.conn(), run).await?;
            }
            tx.commit().await?;
            Ok(BATCH as u64)
        }
    })
    .await?;
    let single_cpu = (cpu_seconds() - cpu) / single_n as f64;

    let (_, pool) = fresh(base, "bulkraw").await?;
    let cpu = cpu_seconds();
    let raw = rate(bulk_n / BATCH, clients, move |i| {
        raw_bulk_accept(pool.clone(), i, BATCH)
    })
    .await?;
    let raw_cpu = (cpu_seconds() - cpu) / bulk_n as f64;

    row(
        &format!("accept, batches of {BATCH}, {clients} clients (runs/s)"),
        bulk,
        raw,
    );
    row(
        &format!("accept one by one, {BATCH} per tx, {clients} clients"),
        single,
        raw,
    );
    println!(
        "{:<44} {:>11.1}x {:>11.0}%",
        "bulk vs one by one; bulk as % of raw",
        bulk / single,
        bulk / raw * 100.0
    );
    println!(
        "{:<44} {:>10.1}us {:>10.1}us   (one by one: {:.1}us)",
        "client CPU per run (this process)",
        bulk_cpu * 1e6,
        raw_cpu * 1e6,
        single_cpu * 1e6
    );
    Ok(())
}

/// CPU time this process has used (user + system), from /proc; NaN elsewhere.
fn cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return f64::NAN;
    };
    // Fields after the parenthesized command name; utime and stime are the
    // 14th and 15th fields overall, in clock ticks (100 per second on Linux).
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    match (
        f.get(11).and_then(|u| u.parse::<f64>().ok()),
        f.get(12).and_then(|s| s.parse::<f64>().ok()),
    ) {
        (Some(u), Some(s)) => (u + s) / 100.0,
        _ => f64::NAN,
    }
}

/// The five rows of `per_tx` acceptances (key, run, `run_queued`, job,
/// outbox row) as five multi-row INSERTs, with no idempotency logic: no
/// conflict handling, no read-back, no fingerprint.
async fn raw_bulk_accept(pool: PgPool, i: usize, per_tx: usize) -> Res<u64> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis() as i64;
    let ids: Vec<Uuid> = (0..per_tx).map(|_| Uuid::now_v7()).collect();
    let keys: Vec<String> = (0..per_tx).map(|j| format!("r{i}-{j}")).collect();
    let requests: Vec<serde_json::Value> = (0..per_tx).map(|j| json!({"i": i, "j": j})).collect();
    let bodies: Vec<serde_json::Value> = requests
        .iter()
        .map(|r| json!({"operation": "op", "queue": "default", "schema_version": 1, "request": r, "replay_of": null}))
        .collect();
    let payloads: Vec<Vec<u8>> = ids
        .iter()
        .zip(&bodies)
        .map(|(id, b)| {
            serde_json::to_vec(
                &json!({"tenant": "bench", "run_id": id, "seq": 1, "kind": "run_queued", "at": now, "body": b}),
            )
        })
        .collect::<Result<_, _>>()?;
    let effect_keys: Vec<String> = ids.iter().map(|id| format!("bench/{id}/1")).collect();
    let run_keys: Vec<String> = ids.iter().map(|id| id.to_string()).collect();
    let lanes: Vec<i32> = run_keys.iter().map(|k| ferry::outbox::lane_for(k, 64)).collect();
    let fp = "0".repeat(64);
    let mut tx = pool.begin().await?;
    sqlx::query(
        "INSERT INTO idempotency_keys (tenant, operation, key, request_fingerprint, fingerprint_version, run_id, created_at, expires_at)
         SELECT 'bench', 'op', k, $2, 1, id, $3, $3 + 86400000 FROM UNNEST($1::text[], $4::uuid[]) AS i(k, id)",
    )
    .bind(&keys)
    .bind(&fp)
    .bind(now)
    .bind(&ids)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "INSERT INTO runs (tenant, run_id, operation, state, version, request, created_at, updated_at, last_event_seq)
         SELECT 'bench', id, 'op', 'queued', 1, r, $3, $3, 1 FROM UNNEST($1::uuid[], $2::jsonb[]) AS i(id, r)",
    )
    .bind(&ids)
    .bind(requests.iter().map(sqlx::types::Json).collect::<Vec<_>>())
    .bind(now)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "INSERT INTO run_events (tenant, run_id, seq, kind, body, created_at)
         SELECT 'bench', id, 1, 'run_queued', b, $3 FROM UNNEST($1::uuid[], $2::jsonb[]) AS i(id, b)",
    )
    .bind(&ids)
    .bind(bodies.iter().map(sqlx::types::Json).collect::<Vec<_>>())
    .bind(now)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "INSERT INTO jobs (tenant, run_id, queue, state, available_at, max_attempts, created_at, updated_at)
         SELECT 'bench', id, 'default', 'queued', $2, 5, $2, $2 FROM UNNEST($1::uuid[]) AS i(id)",
    )
    .bind(&ids)
    .bind(now)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "INSERT INTO outbox (tenant, topic, key, lane, payload, headers, effect_key, created_at)
         SELECT 'bench', 'ferry.run-events', k, l, p,
                '{\"content-type\": \"application/json\", \"ferry-event-kind\": \"run_queued\"}', e, $5
         FROM UNNEST($1::text[], $2::int[], $3::bytea[], $4::text[]) AS i(k, l, p, e)",
    )
    .bind(&run_keys)
    .bind(&lanes)
    .bind(&payloads)
    .bind(&effect_keys)
    .bind(now)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(per_tx as u64)
}

fn row(name: &str, ferry: f64, raw: f64) {
    println!("{name:<44} {ferry:>12.0} {raw:>12.0}");
}

fn pct(v: &mut [Duration], p: f64) -> f64 {
    v.sort_unstable();
    v[((v.len() - 1) as f64 * p) as usize].as_secs_f64() * 1000.0
}

/// A fresh schema with the Ferry tables, as a `Ferry` and a raw pool.
async fn fresh(base: &str, name: &str) -> Res<(Ferry, PgPool)> {
    let schema = format!("ferry_bench_{name}");
    let admin = PgPool::connect(base).await?;
    sqlx::query(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
        .execute(&admin)
        .await?;
    sqlx::query(&format!("CREATE SCHEMA {schema}")).execute(&admin).await?;
    admin.close().await;
    let url = url_of(base, name);
    let f = Ferry::builder(&url).max_connections(16).migrate(true).connect().await?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(16)
        .connect(&url)
        .await?;
    Ok((f, pool))
}

fn url_of(base: &str, name: &str) -> String {
    let sep = if base.contains('?') { '&' } else { '?' };
    format!("{base}{sep}options=-csearch_path%3Dferry_bench_{name}")
}

/// Runs `count` operations on `conc` tasks; returns units per second.
async fn rate<F, Fut>(count: usize, conc: usize, op: F) -> Res<f64>
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Res<u64>> + Send,
{
    let op = Arc::new(op);
    let next = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = (0..conc)
        .map(|_| {
            let (op, next, done) = (op.clone(), next.clone(), done.clone());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                    if i >= count {
                        return Ok::<_, Box<dyn std::error::Error + Send + Sync>>(());
                    }
                    done.fetch_add(op(i).await?, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for t in tasks {
        t.await??;
    }
    Ok(done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64())
}

/// Runs `workers` loops of `op` until each sees an empty claim; jobs per second.
async fn drain<F, Fut>(workers: usize, op: F) -> Res<f64>
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Res<u64>> + Send,
{
    let op = Arc::new(op);
    let done = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = (0..workers)
        .map(|w| {
            let (op, done) = (op.clone(), done.clone());
            tokio::spawn(async move {
                loop {
                    let n = op(w).await?;
                    if n == 0 {
                        return Ok::<_, Box<dyn std::error::Error + Send + Sync>>(());
                    }
                    done.fetch_add(n, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for t in tasks {
        t.await??;
    }
    Ok(done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64())
}

/// Seeds `n` queued jobs with their runs in bulk, all of tenant `bench`.
async fn seed(pool: &PgPool, n: usize) -> Res<()> {
    seed_tenants(pool, n, 1).await
}

/// Seeds `n` queued jobs with their runs in bulk, spread round-robin over
/// `tenants` tenants (`bench` alone when there is one).
async fn seed_tenants(pool: &PgPool, n: usize, tenants: i64) -> Res<()> {
    sqlx::query(
        "INSERT INTO runs (tenant, run_id, operation, state, version, request, created_at, updated_at, last_event_seq)
         SELECT CASE WHEN $2 = 1 THEN 'bench' ELSE 'bench-' || (g % $2) END, gen_random_uuid(), 'op', 'queued', 1,
                jsonb_build_object('i', g), g, g, 1
         FROM generate_series(1, $1) g",
    )
    .bind(n as i64)
    .bind(tenants)
    .execute(pool)
    .await?;
    sqlx::query(
        "INSERT INTO jobs (tenant, run_id, queue, state, available_at, max_attempts, created_at, updated_at)
         SELECT tenant, run_id, 'default', 'queued', created_at, 5, created_at, created_at FROM runs",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// The acceptance statements, `per_tx` acceptances per transaction.
async fn raw_accept(pool: PgPool, i: usize, per_tx: usize) -> Res<u64> {
    let mut tx = pool.begin().await?;
    for j in 0..per_tx {
        let id = Uuid::now_v7();
        let now: i64 = sqlx::query_scalar(QUERIES.postgres.claim_idempotency_key)
            .bind("bench")
            .bind("op")
            .bind(format!("r{i}-{j}"))
            .bind("fp")
            .bind(1)
            .bind(id)
            .bind(None::<i64>)
            .bind(86_400_000i64)
            .fetch_one(&mut *tx)
            .await?;
        let req = json!({"i": i});
        sqlx::query(QUERIES.postgres.insert_run)
            .bind("bench")
            .bind(id)
            .bind("op")
            .bind(sqlx::types::Json(&req))
            .bind(None::<i64>)
            .bind(None::<Uuid>)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        sqlx::query(QUERIES.postgres.insert_event)
            .bind("bench")
            .bind(id)
            .bind(1i64)
            .bind("run_queued")
            .bind(sqlx::types::Json(&req))
            .bind(now)
            .execute(&mut *tx)
            .await?;
        sqlx::query(QUERIES.postgres.insert_job)
            .bind("bench")
            .bind(id)
            .bind("default")
            .bind(now)
            .bind(5)
            .bind(None::<i64>)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        raw_outbox(&mut tx, id, now).await?;
    }
    tx.commit().await?;
    Ok(per_tx as u64)
}

async fn raw_outbox(tx: &mut sqlx::PgConnection, id: Uuid, now: i64) -> Res<()> {
    sqlx::query(QUERIES.postgres.insert_outbox)
        .bind("bench")
        .bind("ferry.run-events")
        .bind(id.to_string())
        .bind(0)
        .bind(b"{}".to_vec())
        .bind(sqlx::types::Json(json!({})))
        .bind(None::<String>)
        .bind(None::<String>)
        .bind(now)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

async fn raw_claim(pool: &PgPool, batch: u32) -> Res<Vec<(String, Uuid, i64, i32)>> {
    use sqlx::Row;
    let rows = sqlx::query(QUERIES.postgres.claim_jobs)
        .bind("default")
        .bind(None::<i64>)
        .bind(i64::from(batch))
        .bind("raw")
        .bind(60_000i64)
        .fetch_all(pool)
        .await?;
    Ok(rows
        .iter()
        .map(|r| {
            (
                r.get("tenant"),
                r.get("run_id"),
                r.get("lease_generation"),
                r.get("attempts"),
            )
        })
        .collect())
}

/// The same claim and the same fenced completion statements, without the library.
async fn raw_claim_complete(pool: PgPool, batch: u32) -> Res<u64> {
    let claimed = raw_claim(&pool, batch).await?;
    for (tenant, id, generation, attempt) in &claimed {
        let mut tx = pool.begin().await?;
        let (_, _, _, now): (i32, i32, i64, i64) = sqlx::query_as(QUERIES.postgres.finish_job)
            .bind(tenant)
            .bind(id)
            .bind("raw")
            .bind(generation)
            .bind(None::<i64>)
            .bind("succeeded")
            .bind(None::<i64>)
            .bind(None::<String>)
            .fetch_one(&mut *tx)
            .await?;
        let (seq, _, _): (i64, i64, i64) = sqlx::query_as(QUERIES.postgres.terminate_run)
            .bind(tenant)
            .bind(id)
            .bind("succeeded")
            .bind(now)
            .bind(None::<i64>)
            .fetch_one(&mut *tx)
            .await?;
        sqlx::query(QUERIES.postgres.insert_event)
            .bind(tenant)
            .bind(id)
            .bind(seq)
            .bind("run_succeeded")
            .bind(sqlx::types::Json(json!({})))
            .bind(now)
            .execute(&mut *tx)
            .await?;
        raw_outbox(&mut tx, *id, now).await?;
        sqlx::query(QUERIES.postgres.close_attempt)
            .bind(tenant)
            .bind(id)
            .bind(attempt)
            .bind(now)
            .bind("succeeded")
            .bind(None::<String>)
            .bind(None::<String>)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
    }
    Ok(claimed.len() as u64)
}
