//! The whole pipeline at a steady offered rate: library
//! acceptance (`create_runs_idempotent`) → a `Worker` with a no-op handler →
//! an in-process relay (WAL capture from a slot of its own, dropped at the
//! end) → Apache Kafka (a single-node broker started by `ferry-testkit`) →
//! a `ferry-consumer` whose handler writes one effect row per
//! `run_succeeded` event, through the effect ledger.
//!
//! Each rate step offers `rate` runs/s for `--secs` seconds (one acceptance
//! call every 10 ms with `rate / 100` runs, not waiting for the previous
//! call), then waits until every accepted run has its effect. It reports
//! the acceptance rate achieved, the effects/s during the offer (from its
//! 5th second on, or its second half if shorter), the backlog when the
//! offer ended and how long it took to drain, and p50/p99/max from acceptance (the run's `created_at`, database
//! clock) to the effect (`clock_timestamp()` in the consumer's effect
//! statement, just before its commit). CPU per component is read from
//! `/proc`: each component runs on a tokio runtime of its own whose threads
//! carry its name (librdkafka's threads, shared by relay and consumer, are
//! one group), the PostgreSQL backends by `application_name` and the
//! replication slot, and the broker as this process's child.
//!
//!     scripts/install-kafka && cargo run --release -p ferry-relay --example bench_pipeline -- [--warm 20] [--secs 20] [--rates 1000,2000,5000]
#![allow(clippy::print_stdout, missing_docs)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ferry::store::Arg;
use ferry::worker::{JobContext, Worker, WorkerConfig};
use ferry::{Engine, Ferry, NewRun, DEFAULT_EVENTS_TOPIC};
use ferry_consumer::{Consumer, Handler, HandlerError, Record};
use ferry_relay::{Capture, Relay, RelayConfig};
use futures::future::BoxFuture;
use serde_json::json;
use sqlx::PgPool;
use tokio::runtime::{Handle, Runtime};
use tokio_util::sync::CancellationToken;

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// The components, each on a runtime of its own (thread names ≤ 15 bytes).
const COMPONENTS: [&str; 3] = ["worker", "relay", "consumer"];

fn main() -> Res<()> {
    // Components' logs on stderr, by `RUST_LOG` (nothing by default).
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1));
    let secs: u64 = arg("--secs").and_then(|v| v.parse().ok()).unwrap_or(20);
    // A freshly started broker's JIT compiles for its first ~20 s (its C2
    // thread took 10 CPU-s of a 60 s run): the warm-up offers 500 runs/s
    // for this long before anything is measured.
    let warm: u64 = arg("--warm").and_then(|v| v.parse().ok()).unwrap_or(20);
    let micro_batch: usize = arg("--micro-batch")
        .and_then(|v| v.parse().ok())
        .unwrap_or(ferry_consumer::DEFAULT_MICRO_BATCH);
    // The worker's slots and claim size.
    let slots: usize = arg("--slots").and_then(|v| v.parse().ok()).unwrap_or(200);
    let batch: u32 = arg("--batch").and_then(|v| v.parse().ok()).unwrap_or(100);
    let rates: Vec<u64> = arg("--rates")
        .map(|v| v.split(',').filter_map(|r| r.parse().ok()).collect())
        .unwrap_or_else(|| vec![1000, 2000, 5000]);
    let runtime = |name: &str| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name(name)
            .enable_all()
            .build()
    };
    let accept = runtime("accept")?;
    let parts: Vec<Runtime> = COMPONENTS.iter().map(|c| runtime(c)).collect::<Result<_, _>>()?;
    let handles: Vec<Handle> = parts.iter().map(|r| r.handle().clone()).collect();
    let broker = ferry_testkit::Kafka::start();
    broker.create_topic(DEFAULT_EVENTS_TOPIC, 6);
    let result = accept.block_on(bench(
        &broker.brokers(),
        &handles,
        warm,
        secs,
        &rates,
        micro_batch,
        (slots, batch),
    ));
    for r in parts {
        r.shutdown_timeout(Duration::from_secs(5));
    }
    result
}

async fn bench(
    brokers: &str,
    rt: &[Handle],
    warm: u64,
    secs: u64,
    rates: &[u64],
    micro_batch: usize,
    (slots, batch): (usize, u32),
) -> Res<()> {
    let base = ferry_testkit::fresh_database_url(Engine::Postgres).await?;
    let url = |component: &str| format!("{base}&application_name=ferry_bench_pipeline_{component}");
    let ferry = Ferry::builder(url("accept"))
        .max_connections(8)
        .migrate(true)
        .connect()
        .await?;
    let pool = ferry.db().as_postgres().ok_or("PostgreSQL only")?.clone();
    // The run's `created_at` is copied into the effect row, so the
    // measurements read this table alone: a join with `runs` on `run_id`
    // alone (not its key) polled every 20 ms during the drains took 11-16 s
    // per query and was itself most of the database's load.
    sqlx::query(
        "CREATE TABLE bench_effects (run_id UUID PRIMARY KEY, created_ms BIGINT NOT NULL, completed_ms BIGINT NOT NULL, produced_ms BIGINT NOT NULL, effect_ms BIGINT NOT NULL)",
    )
    .execute(&pool)
    .await?;
    sqlx::query("CREATE INDEX bench_effects_created_idx ON bench_effects (created_ms, effect_ms)")
        .execute(&pool)
        .await?;
    let slot = format!("ferry_bench_pipeline_{}", std::process::id());
    let stop = CancellationToken::new();

    let (s, u) = (stop.clone(), url("worker"));
    let worker = rt[0].spawn(async move {
        let f = Ferry::builder(u).max_connections(16).connect().await?;
        let cfg = WorkerConfig {
            concurrency: slots,
            batch,
            ..Default::default()
        };
        let noop = |_job: ferry::Claimed, _ctx: JobContext| async { Ok::<_, ferry::JobError>(json!({})) };
        Worker::new(f, cfg, noop).run(s.cancelled_owned()).await?;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    });
    let mut cfg = RelayConfig::new(url("relay"), brokers);
    cfg.capture = Some(Capture::Wal);
    cfg.slot = Some(slot.clone());
    cfg.publication = Some(slot.clone());
    let (s, u) = (stop.clone(), url("relay"));
    let relay = rt[1].spawn(async move {
        let f = Ferry::builder(u).connect().await?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        Relay::new(cfg, f)?.run(listener, s.cancelled_owned()).await?;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    });
    let (s, u, b) = (stop.clone(), url("consumer"), brokers.to_owned());
    let consumer = rt[2].spawn(async move {
        let f = Ferry::builder(u).connect().await?;
        Consumer::builder(f, b, "bench-pipeline", &[DEFAULT_EVENTS_TOPIC])
            .handler(Effect)
            .micro_batch(micro_batch)
            .build()?
            .run(s.cancelled_owned())
            .await?;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    });

    let measured = async {
        let clk_tck = clock_ticks()?;
        println!("pipeline: acceptance → worker ({slots} slots, batch {batch}, no-op) → relay (WAL) → Kafka (6 partitions) → ferry-consumer (effect ledger), {secs} s per rate\n");
        // Warm-up: the consumer group joins, the slot is made, the broker warms.
        step(&ferry, &pool, &slot, clk_tck, 500, warm, "warm-up").await?;
        // Statistics, as autovacuum keeps them on a running database (the
        // tables were empty when the warm-up's statements were planned).
        sqlx::query("ANALYZE runs, run_events, jobs, job_attempts, idempotency_keys, outbox, consumer_ledger, bench_effects")
            .execute(&pool)
            .await?;
        for &rate in rates {
            step(&ferry, &pool, &slot, clk_tck, rate, secs, &format!("{rate}/s")).await?;
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    }
    .await;
    stop.cancel();
    for (name, task) in [("worker", worker), ("relay", relay), ("consumer", consumer)] {
        if let Err(e) = task.await? {
            println!("{name} ended with {e}");
        }
    }
    drop_slot(&pool, &slot).await?;
    measured
}

/// Writes one effect row per `run_succeeded` event, in the consumer's
/// transaction (ledger row and offset commit with it).
struct Effect;

impl Handler for Effect {
    fn handle<'a>(&'a self, r: &'a Record, tx: &'a mut ferry::Tx) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            if r.headers.get("ferry-event-kind").map(Vec::as_slice) != Some(b"run_succeeded".as_slice()) {
                return Ok(());
            }
            let event: serde_json::Value = serde_json::from_slice(r.payload.as_deref().unwrap_or_default())
                .map_err(|_| HandlerError::terminal("bad_event_payload"))?;
            let run_id = event["run_id"].as_str().unwrap_or_default().to_owned();
            tx.execute(
                "INSERT INTO bench_effects (run_id, created_ms, completed_ms, produced_ms, effect_ms) \
                 SELECT r.run_id, r.created_at, r.updated_at, $2, (extract(epoch FROM clock_timestamp()) * 1000)::bigint \
                 FROM runs r WHERE r.tenant = 'bench' AND r.run_id = $1::uuid ON CONFLICT DO NOTHING",
                &[Arg::from(&run_id), Arg::from(r.timestamp.unwrap_or(0))],
            )
            .await?;
            Ok(())
        })
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// One rate step: offer `rate` runs/s for `secs`, wait for every effect,
/// print the figures.
async fn step(ferry: &Ferry, pool: &PgPool, slot: &str, clk_tck: f64, rate: u64, secs: u64, name: &str) -> Res<()> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let cpu0 = cpu(pool, slot).await?;
    let wall = Instant::now();
    let t0 = now_ms();
    let per_tick = (rate / 100).max(1) as usize;
    let ticks = secs * 100;
    let accepted = Arc::new(AtomicU64::new(0));
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    let mut calls = Vec::with_capacity(ticks as usize);
    for _ in 0..ticks {
        tick.tick().await;
        let runs: Vec<NewRun> = (0..per_tick)
            .map(|_| {
                let n = SEQ.fetch_add(1, Ordering::Relaxed);
                NewRun::new("bench", "op", format!("p{n}"), json!({ "n": n }))
            })
            .collect();
        let (f, a) = (ferry.clone(), accepted.clone());
        calls.push(tokio::spawn(async move {
            for r in f.create_runs_idempotent(runs).await? {
                r?;
                a.fetch_add(1, Ordering::Relaxed);
            }
            Ok::<_, ferry::Error>(())
        }));
    }
    for c in calls {
        c.await??;
    }
    let offered_s = wall.elapsed().as_secs_f64();
    let t1 = now_ms();
    let n = accepted.load(Ordering::Relaxed) as i64;
    let effects_in = |from: i64, to: i64| {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM bench_effects WHERE created_ms >= $1 AND effect_ms >= $2 AND effect_ms < $3",
        )
        .bind(t0)
        .bind(from)
        .bind(to)
    };
    let backlog = n - effects_in(t0, t1).fetch_one(pool).await?;
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let done = effects_in(t0, i64::MAX).fetch_one(pool).await?;
        if done >= n {
            break;
        }
        if Instant::now() > deadline {
            return Err(format!("{name}: {done} of {n} effects after 300 s").into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let drain_s = (now_ms() - t1) as f64 / 1000.0;
    let total_s = wall.elapsed().as_secs_f64();
    let cpu1 = cpu(pool, slot).await?;
    let steady_from = t0 + 5000.min((t1 - t0) / 2);
    let steady = effects_in(steady_from, t1).fetch_one(pool).await? as f64 / ((t1 - steady_from) as f64 / 1000.0);
    // p50, p99 and max of each span, from the effect rows' timestamps.
    let spans: Vec<(String, i64, i64, i64)> = sqlx::query_as(
        "SELECT s.span, percentile_disc(0.5) WITHIN GROUP (ORDER BY s.ms)::bigint, \
                percentile_disc(0.99) WITHIN GROUP (ORDER BY s.ms)::bigint, max(s.ms) \
         FROM bench_effects e CROSS JOIN LATERAL (VALUES \
             ('accepted_effect', e.effect_ms - e.created_ms), \
             ('accepted_completed', e.completed_ms - e.created_ms), \
             ('completed_effect', e.effect_ms - e.completed_ms), \
             ('completed_produced', e.produced_ms - e.completed_ms), \
             ('produced_effect', e.effect_ms - e.produced_ms)) AS s (span, ms) \
         WHERE e.created_ms >= $1 GROUP BY s.span",
    )
    .bind(t0)
    .fetch_all(pool)
    .await?;
    let span = |name: &str| {
        spans
            .iter()
            .find(|s| s.0 == name)
            .map_or((0, 0, 0), |s| (s.1, s.2, s.3))
    };
    let (p50, p99, max) = span("accepted_effect");
    let [(c50, c99, _), (e50, e99, _), (k50, k99, _), (f50, f99, _)] = [
        "accepted_completed",
        "completed_effect",
        "completed_produced",
        "produced_effect",
    ]
    .map(span);
    println!(
        "{name}: {n} runs, accepted {:.0}/s, effects {steady:.0}/s in the offer's steady part, \
         backlog {backlog} when it ended, drained in {drain_s:.1} s; acceptance → effect p50 {p50} ms, p99 {p99} ms, max {max} ms",
        n as f64 / offered_s
    );
    println!("  acceptance → completion p50 {c50} ms, p99 {c99} ms; completion → effect p50 {e50} ms, p99 {e99} ms");
    println!("  of which completion → produced (the record's Kafka timestamp) p50 {k50} ms, p99 {k99} ms; produced → effect p50 {f50} ms, p99 {f99} ms");
    println!("  {}", uptime());
    let mut line = String::from("  CPU, % of one core over the step:");
    for (group, ticks) in &cpu1 {
        let used = ticks - cpu0.get(group).copied().unwrap_or(0);
        line.push_str(&format!(" {group} {:.0} %,", used as f64 / clk_tck / total_s * 100.0));
    }
    println!("{}\n", line.trim_end_matches(','));
    Ok(())
}

/// CPU ticks (user + system) so far, by group: this process's threads by
/// name (component runtimes, `librdkafka`, `other`), the PostgreSQL backends
/// of this benchmark, the broker (child processes), and the machine.
async fn cpu(pool: &PgPool, slot: &str) -> Res<BTreeMap<String, u64>> {
    let mut groups = BTreeMap::new();
    for task in std::fs::read_dir("/proc/self/task")? {
        let dir = task?.path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        let group = if comm.starts_with("rdk:") {
            "librdkafka"
        } else if let Some(c) = ["accept"]
            .iter()
            .chain(COMPONENTS.iter())
            .find(|c| comm.starts_with(**c))
        {
            c
        } else {
            "other"
        };
        *groups.entry(group.to_owned()).or_insert(0) += proc_ticks(&dir.join("stat"));
    }
    let backends: Vec<i32> = sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity WHERE application_name LIKE 'ferry\\_bench\\_pipeline\\_%' \
         UNION SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1 AND active_pid IS NOT NULL",
    )
    .bind(slot)
    .fetch_all(pool)
    .await?;
    let pg = backends
        .iter()
        .map(|p| proc_ticks(std::path::Path::new(&format!("/proc/{p}/stat"))))
        .sum();
    groups.insert("postgres backends".into(), pg);
    groups.insert("kafka broker".into(), descendants_ticks()?);
    let stat = std::fs::read_to_string("/proc/stat")?;
    let all: u64 = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .take(3) // user, nice, system
        .filter_map(|v| v.parse::<u64>().ok())
        .sum();
    groups.insert("machine (all processes)".into(), all);
    Ok(groups)
}

/// utime + stime of one `/proc/…/stat` (0 when it is gone).
fn proc_ticks(path: &std::path::Path) -> u64 {
    let stat = std::fs::read_to_string(path).unwrap_or_default();
    // The fields after the `(comm)`: state is the 3rd field, utime the 14th.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
    let f: Vec<&str> = rest.split_whitespace().collect();
    let get = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    get(11) + get(12)
}

/// CPU ticks of every process descended from this one (the broker's JVM).
fn descendants_ticks() -> Res<u64> {
    let mut parent = BTreeMap::new();
    for e in std::fs::read_dir("/proc")? {
        let e = e?;
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
        if let Some(ppid) = rest.split_whitespace().nth(1).and_then(|v| v.parse::<u32>().ok()) {
            parent.insert(pid, ppid);
        }
    }
    let me = std::process::id();
    let ours = |mut p: u32| {
        while let Some(&pp) = parent.get(&p) {
            if pp == me {
                return true;
            }
            p = pp;
        }
        false
    };
    Ok(parent
        .keys()
        .filter(|p| **p != me && ours(**p))
        .map(|p| proc_ticks(std::path::Path::new(&format!("/proc/{p}/stat"))))
        .sum())
}

fn clock_ticks() -> Res<f64> {
    let out = std::process::Command::new("getconf").arg("CLK_TCK").output()?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().parse()?)
}

fn uptime() -> String {
    std::process::Command::new("uptime")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

/// Drops the benchmark's replication slot and publication (a slot left
/// behind would hold WAL on the shared cluster).
async fn drop_slot(pool: &PgPool, slot: &str) -> Res<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        sqlx::query(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1 AND active",
        )
        .bind(slot)
        .execute(pool)
        .await?;
        let dropped = sqlx::query(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1 AND NOT active",
        )
        .bind(slot)
        .execute(pool)
        .await;
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1")
            .bind(slot)
            .fetch_one(pool)
            .await?;
        if left == 0 {
            break;
        }
        if Instant::now() > deadline {
            return Err(format!("slot {slot} still there ({dropped:?})").into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    sqlx::query(&format!("DROP PUBLICATION IF EXISTS {slot}"))
        .execute(pool)
        .await?;
    Ok(())
}
