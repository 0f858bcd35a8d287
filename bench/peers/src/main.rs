//! Ferry beside awa, a peer job queue from crates.io, in one process and
//! one run on the same PostgreSQL (issue #12's "a peer in the same run").
//!
//! Rows, each on a fresh database, alternating Ferry and awa so that load
//! drift hits both:
//! - work N no-op jobs at concurrency 16 (Ferry `WorkerConfig { concurrency:
//!   16, ..Default::default() }`; awa `QueueConfig { max_workers: 16, ..Default::default() }`);
//! - the best mode of each (Ferry 100 slots, batch 50, with one and two
//!   completion statements in flight, and 200 slots, batch 100; awa 100 and
//!   200 workers, claim batch as configured by default);
//! - bulk enqueue, 1000 per call (Ferry `create_runs_idempotent`: run,
//!   event, job, idempotency key and outbox row each; awa `insert_many`:
//!   one job row each).
//!
//! The time of a worker row runs from start to the moment the database
//! holds every job completed (not when the last handler returned).
//!
//!     cd bench/peers && cargo run --release -- [--jobs N] [--rounds R]
#![allow(clippy::print_stdout)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use awa::{JobArgs, JobResult, QueueConfig};
use ferry::worker::{Worker, WorkerConfig};
use ferry::{Ferry, NewRun};
use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::PgPool;

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// The no-op awa job.
#[derive(Serialize, Deserialize, JobArgs)]
struct NoOp {
    i: i64,
}

const BULK_BATCH: usize = 1000;

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
    println!(
        "Ferry beside awa 0.6.9 (PostgreSQL, {jobs} no-op jobs per worker row, 16 pool connections unless noted)\n"
    );
    for round in 1..=rounds {
        println!("round {round}");
        println!("{:<52} {:>10}", "measure", "per s");
        let cfg = |concurrency, batch| WorkerConfig {
            concurrency,
            batch,
            ..Default::default()
        };
        let defaults = WorkerConfig::default();
        ferry_worker(&base, jobs, "Ferry Worker, 16 slots, defaults", cfg(16, defaults.batch)).await?;
        awa_worker(&base, jobs, "awa Client, 16 workers, defaults", 16).await?;
        ferry_worker(&base, jobs, "Ferry Worker, 100 slots, batch 50", cfg(100, 50)).await?;
        awa_worker(&base, jobs, "awa Client, 100 workers", 100).await?;
        ferry_worker(&base, jobs, "Ferry Worker, 200 slots, batch 100", cfg(200, 100)).await?;
        let two = WorkerConfig {
            completions_in_flight: 2,
            ..cfg(100, 50)
        };
        ferry_worker(&base, jobs, "Ferry Worker, 100 slots, batch 50, 2 in flight", two).await?;
        awa_worker(&base, jobs, "awa Client, 200 workers", 200).await?;
        ferry_bulk(&base, jobs).await?;
        awa_bulk(&base, jobs).await?;
        println!();
    }
    Ok(())
}

/// A fresh database `name`, as a URL and a pool of `conns`.
async fn fresh_db(base: &str, name: &str, conns: u32) -> Res<(String, PgPool)> {
    let admin = PgPool::connect(base).await?;
    sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        .execute(&admin)
        .await?;
    sqlx::query(&format!("CREATE DATABASE {name}")).execute(&admin).await?;
    admin.close().await;
    let (head, query) = base.split_once('?').map_or((base, None), |(h, q)| (h, Some(q)));
    let root = head.rsplit_once('/').map_or(head, |(r, _)| r);
    let url = match query {
        Some(q) => format!("{root}/{name}?{q}"),
        None => format!("{root}/{name}"),
    };
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(conns)
        .connect(&url)
        .await?;
    Ok((url, pool))
}

/// Polls `sql` (a count) every millisecond until it reaches `n`.
async fn until_count(pool: &PgPool, sql: &str, n: i64) -> Res<()> {
    loop {
        let c: i64 = sqlx::query_scalar(sql).fetch_one(pool).await?;
        if c >= n {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

async fn ferry_worker(base: &str, jobs: usize, name: &str, cfg: WorkerConfig) -> Res<()> {
    let (url, pool) = fresh_db(base, "ferry_peer_bench", 2).await?;
    let f = Ferry::builder(&url).max_connections(16).migrate(true).connect().await?;
    enqueue_ferry(&f, jobs, 4).await?;
    sqlx::query("VACUUM ANALYZE jobs").execute(&pool).await?;
    let done = Arc::new(AtomicU64::new(0));
    let d = done.clone();
    let worker = Worker::new(f.clone(), cfg, move |_job: ferry::Claimed, _ctx| {
        d.fetch_add(1, Ordering::Relaxed);
        async move { Ok(json!({})) }
    });
    let stats = worker.stats();
    let start = Instant::now();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(worker.run(async move {
        let _ = stopped.await;
    }));
    while stats.completed.load(Ordering::Relaxed) < jobs as u64 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let elapsed = start.elapsed();
    let _ = stop.send(());
    running.await??;
    until_count(
        &pool,
        "SELECT count(*) FROM jobs WHERE state = 'succeeded'",
        jobs as i64,
    )
    .await?;
    println!("{name:<52} {:>10.0}", jobs as f64 / elapsed.as_secs_f64());
    Ok(())
}

async fn awa_worker(base: &str, jobs: usize, name: &str, workers: u32) -> Res<()> {
    let (_url, pool) = fresh_db(base, "awa_peer_bench", 16).await?;
    awa::model::migrations::run(&pool).await?;
    enqueue_awa(&pool, jobs).await?;
    let client = awa::Client::builder(pool.clone())
        .queue(
            "default",
            QueueConfig {
                max_workers: workers,
                ..QueueConfig::default()
            },
        )
        .register::<NoOp, _, _>(|_args, _ctx| async move { Ok(JobResult::Completed) })
        .build()?;
    let start = Instant::now();
    client.start().await?;
    until_count(
        &pool,
        "SELECT count(*) FROM awa.jobs WHERE queue = 'default' AND state = 'completed'",
        jobs as i64,
    )
    .await?;
    let elapsed = start.elapsed();
    client.shutdown(Duration::from_secs(5)).await;
    println!("{name:<52} {:>10.0}", jobs as f64 / elapsed.as_secs_f64());
    Ok(())
}

/// Accepts `n` runs through the bulk call from `clients` tasks.
async fn enqueue_ferry(f: &Ferry, n: usize, clients: usize) -> Res<f64> {
    let start = Instant::now();
    let batches = n.div_ceil(BULK_BATCH);
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let f = f.clone();
            tokio::spawn(async move {
                for b in (c..batches).step_by(clients) {
                    let runs = (0..BULK_BATCH.min(n - b * BULK_BATCH))
                        .map(|j| NewRun::new("bench", "op", format!("k{b}-{j}"), json!({"b": b, "j": j})))
                        .collect();
                    for r in f.create_runs_idempotent(runs).await? {
                        r?;
                    }
                }
                Ok::<_, ferry::Error>(())
            })
        })
        .collect();
    for t in tasks {
        t.await??;
    }
    Ok(n as f64 / start.elapsed().as_secs_f64())
}

/// Inserts `n` awa jobs with `insert_many`, 1000 per call, from 4 tasks.
async fn enqueue_awa(pool: &PgPool, n: usize) -> Res<f64> {
    let start = Instant::now();
    let clients = 4;
    let batches = n.div_ceil(BULK_BATCH);
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let pool = pool.clone();
            tokio::spawn(async move {
                for b in (c..batches).step_by(clients) {
                    let params = (0..BULK_BATCH.min(n - b * BULK_BATCH))
                        .map(|j| {
                            awa::model::insert::params(&NoOp {
                                i: (b * BULK_BATCH + j) as i64,
                            })
                        })
                        .collect::<Result<Vec<_>, _>>()?;
                    awa::model::insert_many(&pool, &params).await?;
                }
                Ok::<_, awa::model::AwaError>(())
            })
        })
        .collect();
    for t in tasks {
        t.await??;
    }
    Ok(n as f64 / start.elapsed().as_secs_f64())
}

async fn ferry_bulk(base: &str, n: usize) -> Res<()> {
    let (url, _pool) = fresh_db(base, "ferry_peer_bench", 2).await?;
    let f = Ferry::builder(&url).max_connections(16).migrate(true).connect().await?;
    let rate = enqueue_ferry(&f, n, 4).await?;
    println!(
        "{:<52} {:>10.0}",
        "Ferry create_runs_idempotent, 1000 per call, 4 tasks", rate
    );
    Ok(())
}

async fn awa_bulk(base: &str, n: usize) -> Res<()> {
    let (_url, pool) = fresh_db(base, "awa_peer_bench", 16).await?;
    awa::model::migrations::run(&pool).await?;
    let rate = enqueue_awa(&pool, n).await?;
    println!("{:<52} {:>10.0}", "awa insert_many, 1000 per call, 4 tasks", rate);
    Ok(())
}
