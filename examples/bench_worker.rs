//! Worker throughput on PostgreSQL: no-op jobs worked by the
//! `Worker`, each mode beside raw-SQL loops of the same statements run in
//! the same process and the same run:
//!
//! - raw two-commit loop: 16 tasks, each `claim_jobs` (one autocommitted
//!   statement) then `complete_batch` (another), like the library's claim
//!   and batch completion without it;
//! - raw one-statement loop: 16 tasks, each `complete_and_claim`
//!   (completes the previous claim and claims the next, one commit).
//!
//! Rows: `WorkerConfig { concurrency: 16, ..Default::default() }`; the best
//! mode (200 slots, batch 100; 100 slots, batch 50); one claim per job at 16
//! slots (16 loops of `claim(1)` + `complete`, 16 loops of
//! `complete_and_claim(1)`, and the `Worker` with batch 1); batch handlers
//! (`Router::batch_route`) at 200 slots (100 per call) and 16
//! slots (16 per call). Each row prints
//! the worker's counters (statements, jobs per statement, idle waits).
//!
//! `--batch-handlers` runs only the worker rows up to the batch handlers'.
//!
//!     cargo run --release --example bench_worker -- [--jobs N] [--rounds R] [--batch-handlers]
#![allow(clippy::print_stdout)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ferry::store::queries::{POSTGRES_ONLY, QUERIES};
use ferry::worker::{Handler, JobContext, Router, Worker, WorkerConfig, WorkerStats};
use ferry::Ferry;
use serde_json::json;
use sqlx::types::Json;
use sqlx::{PgPool, Row};
use uuid::Uuid;

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const TOPIC: &str = "ferry.run-events";

#[tokio::main]
async fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str, default: usize| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let jobs = arg("--jobs", 20_000);
    let rounds = arg("--rounds", 1);
    let base = std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    println!("ferry worker benchmarks (PostgreSQL, {jobs} no-op jobs per row, 16 pool connections)\n");
    for round in 1..=rounds {
        println!("round {round}");
        println!("{:<58} {:>10}  counters", "measure", "jobs/s");
        let defaults16 = WorkerConfig {
            concurrency: 16,
            ..Default::default()
        };
        worker_row(&base, jobs, "Worker, 16 slots, library defaults", defaults16.clone()).await?;
        if !args.iter().any(|a| a == "--batch-handlers") {
            raw_rows(&base, jobs, 16, 16).await?;
        }
        for (slots, batch) in [(200usize, 100u32), (100, 50)] {
            let cfg = WorkerConfig {
                concurrency: slots,
                batch,
                ..Default::default()
            };
            worker_row(&base, jobs, &format!("Worker, {slots} slots, batch {batch}"), cfg).await?;
        }
        for (slots, batch) in [(200usize, 100u32), (16, 16)] {
            let cfg = WorkerConfig {
                concurrency: slots,
                batch,
                ..Default::default()
            };
            batch_row(
                &base,
                jobs,
                &format!("Worker, {slots} slots, batch handler ({batch} per call)"),
                cfg,
            )
            .await?;
        }
        if args.iter().any(|a| a == "--batch-handlers") {
            println!();
            continue;
        }
        raw_rows(&base, jobs, 16, 100).await?;
        one_claim_per_job(&base, jobs).await?;
        let one = WorkerConfig {
            concurrency: 16,
            batch: 1,
            ..Default::default()
        };
        worker_row(&base, jobs, "Worker, 16 slots, batch 1", one).await?;
        raw_rows(&base, jobs, 16, 1).await?;
        println!();
    }
    Ok(())
}

/// The `Worker` with `cfg` and a no-op handler until all `jobs` are done.
async fn worker_row(base: &str, jobs: usize, name: &str, cfg: WorkerConfig) -> Res<()> {
    let noop = |_job: ferry::Claimed, _ctx: JobContext| async { Ok::<_, ferry::JobError>(json!({})) };
    handler_row(base, jobs, name, cfg, noop).await
}

/// The `Worker` with `cfg` and a no-op batch handler (`Router::batch_route`,
/// up to `cfg.batch` jobs per call) until all `jobs` are done.
async fn batch_row(base: &str, jobs: usize, name: &str, cfg: WorkerConfig) -> Res<()> {
    let size = cfg.batch as usize;
    let router = Router::new().batch_route("op", size, |jobs: Vec<(serde_json::Value, JobContext)>| {
        std::future::ready(jobs.iter().map(|_| Ok(json!({}))).collect())
    });
    handler_row(base, jobs, name, cfg, router).await
}

/// The `Worker` with `cfg` and `handler` until all `jobs` are done.
async fn handler_row<H: Handler>(base: &str, jobs: usize, name: &str, cfg: WorkerConfig, handler: H) -> Res<()> {
    let (f, pool) = fresh(base, "worker").await?;
    seed(&pool, jobs).await?;
    let worker = Worker::new(f.clone(), cfg, handler);
    let stats = worker.stats();
    let start = Instant::now();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(worker.run(async move {
        let _ = stopped.await;
    }));
    // Every completion committed, not only every handler returned.
    while stats.completed.load(Ordering::Relaxed) < jobs as u64 {
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    let elapsed = start.elapsed();
    let _ = stop.send(());
    running.await??;
    let succeeded: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE state = 'succeeded'")
        .fetch_one(&pool)
        .await?;
    assert_eq!(succeeded, jobs as i64);
    println!(
        "{name:<58} {:>10.0}  {}",
        jobs as f64 / elapsed.as_secs_f64(),
        counters(&stats)
    );
    Ok(())
}

fn counters(s: &WorkerStats) -> String {
    let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let (cs, cl, ps, pc) = (
        l(&s.claim_statements),
        l(&s.claimed_by_claim_loop),
        l(&s.completion_statements),
        l(&s.claimed_with_completions),
    );
    format!(
        "claims {cs} ({:.1} jobs each), complete+claim {ps} ({:.1} done, {:.1} claimed each), idle waits {}",
        cl as f64 / cs.max(1) as f64,
        l(&s.completed) as f64 / ps.max(1) as f64,
        pc as f64 / ps.max(1) as f64,
        l(&s.idle_waits)
    )
}

/// One claim per job, 16 loops through the library: claim(1) then
/// complete (two commits), and complete_and_claim (one commit per job).
async fn one_claim_per_job(base: &str, jobs: usize) -> Res<()> {
    let (f, pool) = fresh(base, "one").await?;
    seed(&pool, jobs).await?;
    let rate = drain(16, move || {
        let f = f.clone();
        async move {
            let lease = Duration::from_secs(60);
            let mut n = 0;
            loop {
                let claimed = f.jobs().claim("default", "bench", lease, 1).await?;
                let Some(c) = claimed.first() else { return Ok(n) };
                f.jobs().complete(&c.lease, &json!({})).await?;
                n += 1;
            }
        }
    })
    .await?;
    println!("{:<58} {:>10.0}", "16 loops, claim(1) + complete (two commits)", rate);
    let (f, pool) = fresh(base, "one").await?;
    seed(&pool, jobs).await?;
    let rate = drain(16, move || {
        let f = f.clone();
        async move {
            let lease = Duration::from_secs(60);
            let mut n = 0;
            let mut held = f.jobs().claim("default", "bench", lease, 1).await?;
            while let Some(c) = held.pop() {
                let (done, next) = f
                    .jobs()
                    .complete_and_claim(&[(c.lease, json!({}))], "default", "bench", lease, 1)
                    .await?;
                done.into_iter().collect::<Result<Vec<()>, _>>()?;
                n += 1;
                held = next;
            }
            Ok(n)
        }
    })
    .await?;
    println!("{:<58} {:>10.0}", "16 loops, complete_and_claim(1) (one commit)", rate);
    Ok(())
}

/// The raw loops at `batch`: two commits (claim_jobs, complete_batch) and
/// one (complete_and_claim), `loops` tasks each.
async fn raw_rows(base: &str, jobs: usize, loops: usize, batch: u32) -> Res<()> {
    let (_f, pool) = fresh(base, "raw").await?;
    seed(&pool, jobs).await?;
    let p = pool.clone();
    let rate = drain(loops, move || raw_two_commits(p.clone(), batch)).await?;
    println!(
        "{:<58} {:>10.0}",
        format!("  raw: {loops} loops, claim {batch} + complete_batch (2 commits)"),
        rate
    );
    let (_f, pool) = fresh(base, "raw").await?;
    seed(&pool, jobs).await?;
    let p = pool.clone();
    let rate = drain(loops, move || raw_one_commit(p.clone(), batch)).await?;
    println!(
        "{:<58} {:>10.0}",
        format!("  raw: {loops} loops, complete_and_claim {batch} (1 commit)"),
        rate
    );
    Ok(())
}

type Held = Vec<(String, Uuid, String, i64)>;

async fn raw_claim(pool: &PgPool, batch: u32) -> Res<Held> {
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
                r.get("lease_owner"),
                r.get("lease_generation"),
            )
        })
        .collect())
}

/// Binds the completion arrays ($1..$8) of complete_batch / complete_and_claim.
fn bind_items<'q>(
    q: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    held: &Held,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    q.bind(held.iter().map(|h| h.0.clone()).collect::<Vec<_>>())
        .bind(held.iter().map(|h| h.1).collect::<Vec<_>>())
        .bind(held.iter().map(|h| h.2.clone()).collect::<Vec<_>>())
        .bind(held.iter().map(|h| h.3).collect::<Vec<_>>())
        .bind(held.iter().map(|_| Json(json!({}))).collect::<Vec<_>>())
        .bind(held.iter().map(|_| 0i32).collect::<Vec<_>>())
        .bind(None::<i64>)
        .bind(TOPIC)
}

async fn raw_two_commits(pool: PgPool, batch: u32) -> Res<u64> {
    let mut n = 0;
    loop {
        let held = raw_claim(&pool, batch).await?;
        if held.is_empty() {
            return Ok(n);
        }
        let done = bind_items(sqlx::query(POSTGRES_ONLY.complete_batch), &held)
            .fetch_all(&pool)
            .await?;
        assert_eq!(done.len(), held.len());
        n += held.len() as u64;
    }
}

async fn raw_one_commit(pool: PgPool, batch: u32) -> Res<u64> {
    let mut n = 0;
    let mut held = raw_claim(&pool, batch).await?;
    while !held.is_empty() {
        let rows = bind_items(sqlx::query(POSTGRES_ONLY.complete_and_claim), &held)
            .bind("default")
            .bind(i64::from(batch))
            .bind("raw")
            .bind(60_000i64)
            .fetch_all(&pool)
            .await?;
        n += held.len() as u64;
        held = rows
            .iter()
            .filter(|r| r.get::<&str, _>("kind") == "claimed")
            .map(|r| {
                (
                    r.get("tenant"),
                    r.get("run_id"),
                    r.get("lease_owner"),
                    r.get("lease_generation"),
                )
            })
            .collect();
    }
    Ok(n)
}

/// Runs `workers` loops of `op` (each returns how many jobs it worked);
/// jobs per second.
async fn drain<F, Fut>(workers: usize, op: F) -> Res<f64>
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Res<u64>> + Send + 'static,
{
    let start = Instant::now();
    let tasks: Vec<_> = (0..workers).map(|_| tokio::spawn(op())).collect();
    let mut total = 0;
    for t in tasks {
        total += t.await??;
    }
    Ok(total as f64 / start.elapsed().as_secs_f64())
}

/// A fresh schema with the Ferry tables, as a `Ferry` and a raw pool.
async fn fresh(base: &str, name: &str) -> Res<(Ferry, PgPool)> {
    let schema = format!("ferry_benchw_{name}");
    let admin = PgPool::connect(base).await?;
    sqlx::query(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
        .execute(&admin)
        .await?;
    sqlx::query(&format!("CREATE SCHEMA {schema}")).execute(&admin).await?;
    admin.close().await;
    let sep = if base.contains('?') { '&' } else { '?' };
    let url = format!("{base}{sep}options=-csearch_path%3D{schema}");
    let f = Ferry::builder(&url).max_connections(16).migrate(true).connect().await?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(16)
        .connect(&url)
        .await?;
    Ok((f, pool))
}

/// Seeds `n` queued jobs with their runs in bulk.
async fn seed(pool: &PgPool, n: usize) -> Res<()> {
    sqlx::query(
        "INSERT INTO runs (tenant, run_id, operation, state, version, request, created_at, updated_at, last_event_seq)
         SELECT 'bench', gen_random_uuid(), 'op', 'queued', 1, jsonb_build_object('i', g), g, g, 1 FROM generate_series(1, $1) g",
    )
    .bind(n as i64)
    .execute(pool)
    .await?;
    sqlx::query(
        "INSERT INTO jobs (tenant, run_id, queue, state, available_at, max_attempts, created_at, updated_at)
         SELECT tenant, run_id, 'default', 'queued', created_at, 5, created_at, created_at FROM runs",
    )
    .execute(pool)
    .await?;
    sqlx::query("VACUUM ANALYZE jobs").execute(pool).await?;
    Ok(())
}
