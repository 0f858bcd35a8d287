//! Relay benchmarks against PostgreSQL and Apache Kafka (a single-node KRaft
//! broker started by `ferry-testkit`), each beside a raw rdkafka produce of
//! the same records to the same broker, measured in the same run:
//! drain throughput with 1 and 2 relays at 100 B and 1 KiB (marking
//! delivered, deleting on delivery, and `--exactly-once`), commit-to-ack
//! latency at a steady 1k rows/s, and a large pending backlog.
//!
//!     scripts/install-kafka && cargo run --release -p ferry-relay --example bench_relay -- [--quick]
//!
//! Modes for the performance issue, each instead of the default run (and
//! each shorter with `--quick`):
//! - `--warm`: drain with 1 relay beside a raw produce on a warm broker (the
//!   raw run is repeated, the first only warms it), twice, with where the
//!   relay's time went (reads, batches, marks);
//! - `--latency`: commit → ack p50/p99 at a steady 1k and 10k rows/s, after a
//!   3 s warm-up;
//! - `--scaling`: 1, 2 and 4 `ferry-relay` processes (the release binary,
//!   `cargo build --release -p ferry-relay` first) on one backlog;
//! - `--memory`: a relay process's peak RSS (VmHWM) and throughput from a 10k
//!   to a 1M backlog;
//! - `--bloat`: dead tuples and table size after 1M rows, marking and
//!   deleting, and a drain while another session holds a snapshot open.
#![allow(clippy::print_stdout, missing_docs)]

use std::time::{Duration, Instant};

use ferry::{Engine, Ferry, OutboxMessage};
use ferry_relay::{Relay, RelayConfig};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;
use tokio_util::sync::CancellationToken;

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[tokio::main]
async fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    let has = |f: &str| args.iter().any(|a| a == f);
    let quick = has("--quick");
    let n: usize = if quick { 20_000 } else { 100_000 };
    let broker = ferry_testkit::Kafka::start();
    let brokers = broker.brokers();
    let modes = ["--warm", "--latency", "--scaling", "--memory", "--bloat"];
    if modes.iter().any(|m| has(m)) {
        println!(
            "ferry-relay benchmarks (PostgreSQL → Apache Kafka), {}\n",
            args[1..].join(" ")
        );
        println!("{:<52} {:>12} {:>14}", "measure", "ferry-relay", "baseline");
        if has("--warm") {
            warm_drain(&brokers, &broker, if quick { 100_000 } else { 200_000 }).await?;
        }
        if has("--latency") {
            latency(&brokers, &broker, quick).await?;
        }
        if has("--scaling") {
            scaling(&brokers, &broker, quick).await?;
        }
        if has("--memory") {
            memory(&brokers, &broker, quick).await?;
        }
        if has("--bloat") {
            bloat(&brokers, &broker, quick).await?;
        }
        return Ok(());
    }
    println!("ferry-relay benchmarks (PostgreSQL → Apache Kafka, n = {n})\n");
    println!("{:<52} {:>12} {:>14}", "measure", "ferry-relay", "raw produce");
    for size in [100usize, 1024] {
        let topic = format!("bench-{size}");
        broker.create_topic(&topic, 6);
        let raw = raw_produce(&brokers, &topic, n, size).await?;
        for (relays, mode) in [
            (1, Mode::Mark),
            (2, Mode::Mark),
            (1, Mode::Delete),
            (1, Mode::ExactlyOnce),
        ] {
            let rate = drain(&brokers, &topic, n, size, relays, mode).await?;
            let mode = match mode {
                Mode::Mark => "mark delivered",
                Mode::Delete => "delete on delivery",
                Mode::ExactlyOnce => "--exactly-once",
            };
            println!(
                "{:<52} {rate:>12.0} {raw:>14.0}",
                format!("drain msgs/s, {size} B, {relays} relay(s), {mode}")
            );
        }
    }
    // Latency from commit to acknowledgement at a steady 1k rows/s.
    broker.create_topic("bench-latency", 6);
    let (ferry, url) = fresh().await?;
    let (stop, handle, state) = start(&url, &brokers, ferry.clone(), Mode::Mark)?;
    let secs = if quick { 5 } else { 15 };
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    for i in 0..secs * 1000 {
        tick.tick().await;
        ferry
            .enqueue(&OutboxMessage::bytes(
                "bench",
                "bench-latency",
                format!("k{}", i % 500),
                vec![0u8; 100],
            ))
            .await?;
    }
    wait_delivered(&ferry).await?;
    stop.cancel();
    handle.await??;
    let (p50, p99) = (
        state.metrics.latency_quantile(0.5).unwrap_or(0),
        state.metrics.latency_quantile(0.99).unwrap_or(0),
    );
    println!("{:<52} {:>9} ms {:>14}", "commit → ack p50 at 1k rows/s", p50, "-");
    println!("{:<52} {:>9} ms {:>14}", "commit → ack p99 at 1k rows/s", p99, "-");
    // A large backlog.
    let big = if quick { 100_000 } else { 1_000_000 };
    broker.create_topic("bench-backlog", 6);
    let raw = raw_produce(&brokers, "bench-backlog", big.min(200_000), 100).await?;
    let rate = drain(&brokers, "bench-backlog", big, 100, 1, Mode::Mark).await?;
    println!(
        "{:<52} {rate:>12.0} {raw:>14.0}",
        format!("drain msgs/s with {big} pending, 100 B, 1 relay")
    );
    Ok(())
}

async fn fresh() -> Res<(Ferry, String)> {
    let url = ferry_testkit::fresh_database_url(Engine::Postgres).await?;
    let ferry = Ferry::builder(&url).migrate(true).connect().await?;
    Ok((ferry, url))
}

type Started = (
    CancellationToken,
    tokio::task::JoinHandle<Result<(), ferry_relay::RelayError>>,
    std::sync::Arc<ferry_relay::service::RelayState>,
);

/// How the relay under test publishes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Mark,
    Delete,
    ExactlyOnce,
}

fn start(url: &str, brokers: &str, ferry: Ferry, mode: Mode) -> Res<Started> {
    let mut cfg = RelayConfig::new(url, brokers);
    // The lane relay these figures measure (WAL capture is measured later).
    cfg.capture = Some(ferry_relay::Capture::Poll);
    cfg.poll_interval = Duration::from_millis(20);
    cfg.lease = Duration::from_secs(5);
    cfg.delete_on_delivery = mode == Mode::Delete;
    if mode == Mode::ExactlyOnce {
        // A fresh database per drain: a prefix and progress topic of its own.
        let id = uuid::Uuid::now_v7().simple().to_string();
        cfg.exactly_once = true;
        cfg.transactional_id_prefix = format!("bench-{id}");
        cfg.progress_topic = Some(format!("bench-progress-{id}"));
    }
    let relay = Relay::new(cfg, ferry)?;
    let state = relay.state();
    let stop = CancellationToken::new();
    let s = stop.clone();
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    listener.set_nonblocking(true)?;
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let handle = tokio::spawn(relay.run(listener, async move { s.cancelled().await }));
    Ok((stop, handle, state))
}

/// Bulk-inserts `n` pending rows (keys spread over 1000 aggregates).
async fn seed(ferry: &Ferry, topic: &str, n: usize, size: usize) -> Res<()> {
    let pool = ferry.db().as_postgres().ok_or("PostgreSQL only")?;
    let payload = vec![b'x'; size];
    for chunk in (0..n).collect::<Vec<_>>().chunks(10_000) {
        let keys: Vec<String> = chunk.iter().map(|i| format!("k{}", i % 1000)).collect();
        let lanes: Vec<i32> = keys.iter().map(|k| ferry::outbox::lane_for(k, ferry.lanes())).collect();
        sqlx::query(
            "INSERT INTO outbox (tenant, topic, key, lane, payload, headers, created_at)
             SELECT 'bench', $1, k, l, $4, '{}'::jsonb, (extract(epoch FROM now()) * 1000)::bigint
             FROM UNNEST($2::text[], $3::int[]) AS u(k, l)",
        )
        .bind(topic)
        .bind(&keys)
        .bind(&lanes)
        .bind(&payload)
        .execute(pool)
        .await?;
    }
    Ok(())
}

/// Waits until no row is pending (every row was written before the call).
async fn wait_delivered(ferry: &Ferry) -> Res<()> {
    let pool = ferry.db().as_postgres().ok_or("PostgreSQL only")?;
    loop {
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE state = 'pending'")
            .fetch_one(pool)
            .await?;
        if left == 0 {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn drain(brokers: &str, topic: &str, n: usize, size: usize, relays: usize, mode: Mode) -> Res<f64> {
    let (ferry, url) = fresh().await?;
    seed(&ferry, topic, n, size).await?;
    let started = Instant::now();
    let mut running = Vec::new();
    for _ in 0..relays {
        let f = Ferry::builder(&url).connect().await?;
        running.push(start(&url, brokers, f, mode)?);
    }
    wait_delivered(&ferry).await?;
    let rate = n as f64 / started.elapsed().as_secs_f64();
    for (stop, handle, _) in running {
        stop.cancel();
        handle.await??;
    }
    Ok(rate)
}

async fn raw_produce(brokers: &str, topic: &str, n: usize, size: usize) -> Res<f64> {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("partitioner", "murmur2_random")
        .set("compression.type", "lz4")
        .set("linger.ms", "5")
        .create()?;
    let payload = vec![b'x'; size];
    let started = Instant::now();
    let mut futures = Vec::with_capacity(n);
    for i in 0..n {
        let key = format!("k{}", i % 1000);
        loop {
            match producer.send_result(FutureRecord::to(topic).key(&key).payload(&payload)) {
                Ok(f) => {
                    futures.push(f);
                    break;
                }
                Err((_, _)) => tokio::time::sleep(Duration::from_millis(1)).await,
            }
        }
    }
    for f in futures {
        f.await?.map_err(|(e, _)| e)?;
    }
    Ok(n as f64 / started.elapsed().as_secs_f64())
}

// ---- Modes added for the performance issue (#12). ----

/// Drain with 1 relay against a WARM raw produce (the raw run is done twice,
/// the first only warms the broker), with where the relay's time went.
async fn warm_drain(brokers: &str, broker: &ferry_testkit::Kafka, n: usize) -> Res<()> {
    broker.create_topic("bench-warm", 6);
    let cold = raw_produce(brokers, "bench-warm", n, 100).await?;
    for run in 1..=2 {
        let raw = raw_produce(brokers, "bench-warm", n, 100).await?;
        let (rate, timings) = drain_timed(brokers, "bench-warm", n, 100, Mode::Mark).await?;
        println!(
            "{:<52} {rate:>12.0} {raw:>14.0}   ratio {:.2} (run {run}; raw cold {cold:.0})",
            format!("drain msgs/s, 100 B, 1 relay, warm broker"),
            rate / raw
        );
        println!("    where the time went: {timings}");
    }
    Ok(())
}

async fn drain_timed(brokers: &str, topic: &str, n: usize, size: usize, mode: Mode) -> Res<(f64, String)> {
    let (ferry, url) = fresh().await?;
    seed(&ferry, topic, n, size).await?;
    let started = Instant::now();
    let (stop, handle, state) = start(&url, brokers, ferry.clone(), mode)?;
    wait_delivered(&ferry).await?;
    let rate = n as f64 / started.elapsed().as_secs_f64();
    stop.cancel();
    handle.await??;
    Ok((rate, state.metrics.timings.summary()))
}

/// Commit → ack latency at a steady rate, after a warm-up, with the writers'
/// NOTIFY coalescing at its default (10 ms), at 50 ms and off (one NOTIFY per
/// transaction): the coalescing's cost in latency, beside its cost in
/// acceptance throughput (`bench_jobs`).
async fn latency(brokers: &str, broker: &ferry_testkit::Kafka, quick: bool) -> Res<()> {
    broker.create_topic("bench-latency", 6);
    for rate in [1_000u64, 10_000] {
        for notify in [10u64, 50, 0] {
            let (ferry, url) = fresh().await?;
            let (stop, handle, state) = start(&url, brokers, ferry.clone(), Mode::Mark)?;
            let writers = Ferry::builder(&url)
                .max_connections(WRITERS as u32)
                .notify_interval(Duration::from_millis(notify))
                .connect()
                .await?;
            // Warm-up: 3 s at the rate, then forget the samples.
            steady(&writers, rate, Duration::from_secs(3)).await?;
            wait_delivered(&ferry).await?;
            state.metrics.reset_latency();
            let secs = if quick { 5 } else { 10 };
            let (sent, took) = steady(&writers, rate, Duration::from_secs(secs)).await?;
            wait_delivered(&ferry).await?;
            stop.cancel();
            handle.await??;
            let q = |x| state.metrics.latency_quantile(x).unwrap_or(0);
            println!(
                "{:<64} {:>6} / {:>3} ms {:>14}",
                format!(
                    "commit → ack p50 / p99, {rate} rows/s offered ({:.0} achieved), NOTIFY every {notify} ms",
                    sent as f64 / took
                ),
                q(0.5),
                q(0.99),
                "goal ≤10 / ≤25"
            );
        }
    }
    Ok(())
}

/// Concurrent writers in the latency runs, each one row per transaction on
/// its own pooled connection: enough that commit latency does not cap the
/// offered rate.
const WRITERS: u64 = 48;

/// Enqueues at `rate` rows/s for `d` from [`WRITERS`] tasks sharing `f`'s
/// pool, one row per transaction; returns rows sent and seconds taken.
async fn steady(f: &Ferry, rate: u64, d: Duration) -> Res<(u64, f64)> {
    let per = Duration::from_nanos(1_000_000_000 * WRITERS / rate);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..WRITERS {
        let f = f.clone();
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(per);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut sent = 0u64;
            let mut i = w;
            while started.elapsed() < d {
                tick.tick().await;
                let m = OutboxMessage::bytes("bench", "bench-latency", format!("k{}", i % 500), vec![0u8; 100]);
                if f.enqueue(&m).await.is_ok() {
                    sent += 1;
                }
                i += WRITERS;
            }
            sent
        }));
    }
    let mut sent = 0;
    for t in tasks {
        sent += t.await?;
    }
    Ok((sent, started.elapsed().as_secs_f64()))
}

/// The release `ferry-relay` binary next to this example.
fn relay_binary() -> Res<std::path::PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe.parent().and_then(|p| p.parent()).ok_or("no target dir")?;
    let bin = dir.join("ferry-relay");
    if !bin.exists() {
        return Err(format!("{} missing: cargo build --release -p ferry-relay first", bin.display()).into());
    }
    Ok(bin)
}

/// `k` relay processes on one database; returns the children.
fn spawn_relays(url: &str, brokers: &str, k: usize, extra: &[&str]) -> Res<Vec<std::process::Child>> {
    let bin = relay_binary()?;
    let mut out = Vec::new();
    for _ in 0..k {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let child = std::process::Command::new(&bin)
            .args(["run", "--database-url", url, "--brokers", brokers])
            .args(["--poll-interval", "20ms", "--lease", "5s", "--capture", "poll"])
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()?;
        out.push(child);
    }
    Ok(out)
}

fn stop_relays(children: Vec<std::process::Child>) {
    for mut c in children {
        // SIGTERM: a clean shutdown (lanes released).
        let _ = std::process::Command::new("kill").arg(c.id().to_string()).status();
        let _ = c.wait();
    }
}

fn vm_hwm_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

/// Drains `n` seeded rows with `k` relay processes; (rows/s, VmHWM KiB of the first).
async fn drain_processes(brokers: &str, topic: &str, n: usize, k: usize) -> Res<(f64, u64)> {
    let (ferry, url) = fresh().await?;
    seed(&ferry, topic, n, 100).await?;
    let started = Instant::now();
    let children = spawn_relays(&url, brokers, k, &[])?;
    wait_delivered(&ferry).await?;
    let rate = n as f64 / started.elapsed().as_secs_f64();
    let hwm = vm_hwm_kib(children[0].id());
    stop_relays(children);
    Ok((rate, hwm))
}

/// 1, 2, 4 relay processes on one backlog.
async fn scaling(brokers: &str, broker: &ferry_testkit::Kafka, quick: bool) -> Res<()> {
    broker.create_topic("bench-scaling", 6);
    let n = if quick { 100_000 } else { 200_000 };
    let raw = raw_produce(brokers, "bench-scaling", n, 100).await?;
    let raw = raw.max(raw_produce(brokers, "bench-scaling", n, 100).await?);
    let mut one = 0.0;
    for k in [1usize, 2, 4] {
        let (rate, _) = drain_processes(brokers, "bench-scaling", n, k).await?;
        if k == 1 {
            one = rate;
        }
        println!(
            "{:<52} {rate:>12.0} {raw:>14.0}   ×{:.2} vs 1 relay",
            format!("drain {n}, 100 B, {k} relay process(es)"),
            rate / one
        );
    }
    Ok(())
}

/// A relay process's peak RSS and throughput from a 10k to a 1M backlog.
async fn memory(brokers: &str, broker: &ferry_testkit::Kafka, quick: bool) -> Res<()> {
    broker.create_topic("bench-memory", 6);
    let sizes: &[usize] = if quick {
        &[10_000, 200_000]
    } else {
        &[10_000, 100_000, 1_000_000]
    };
    for &n in sizes {
        let (rate, hwm) = drain_processes(brokers, "bench-memory", n, 1).await?;
        println!(
            "{:<52} {rate:>12.0} {:>14}",
            format!("drain with {n} pending, 1 relay process (msgs/s)"),
            "-"
        );
        println!(
            "{:<52} {:>9.1} MiB {:>14}",
            format!("  relay VmHWM with {n} pending"),
            hwm as f64 / 1024.0,
            "goal ≤ 64 MiB"
        );
    }
    Ok(())
}

/// Dead tuples and table size after `n` rows published, marking or
/// deleting; then a drain while another session holds a snapshot open.
async fn bloat(brokers: &str, broker: &ferry_testkit::Kafka, quick: bool) -> Res<()> {
    broker.create_topic("bench-bloat", 6);
    let n = if quick { 200_000 } else { 1_000_000 };
    for mode in [Mode::Mark, Mode::Delete] {
        let (ferry, url) = fresh().await?;
        seed(&ferry, "bench-bloat", n, 100).await?;
        let pool = ferry.db().as_postgres().ok_or("PostgreSQL only")?.clone();
        sqlx::query("ANALYZE outbox").execute(&pool).await?;
        let before = table_stats(&pool).await?;
        let started = Instant::now();
        let (stop, handle, _) = start(&url, brokers, ferry.clone(), mode)?;
        wait_delivered(&ferry).await?;
        let rate = n as f64 / started.elapsed().as_secs_f64();
        stop.cancel();
        handle.await??;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let after = table_stats(&pool).await?;
        let name = if mode == Mode::Mark { "mark" } else { "delete" };
        println!(
            "{:<52} {rate:>12.0}   before: {} / after: {}",
            format!("{n} rows, {name} mode: msgs/s; dead tuples, size"),
            before,
            after
        );
    }
    // A snapshot held open (REPEATABLE READ) during the drain, vs none.
    let hold = Duration::from_secs(60);
    let m = if quick { 200_000 } else { 1_000_000 };
    for held in [false, true] {
        let (ferry, url) = fresh().await?;
        let pool = ferry.db().as_postgres().ok_or("PostgreSQL only")?.clone();
        let mut snap = pool.acquire().await?;
        if held {
            sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ")
                .execute(&mut *snap)
                .await?;
            sqlx::query("SELECT 1").execute(&mut *snap).await?;
        }
        seed(&ferry, "bench-bloat", m, 100).await?;
        let started = Instant::now();
        let (stop, handle, _) = start(&url, brokers, ferry.clone(), Mode::Mark)?;
        // Rows delivered within the hold time (or all of them).
        let mut left: i64 = m as i64;
        while started.elapsed() < hold && left > 0 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            left = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE state = 'pending'")
                .fetch_one(&pool)
                .await?;
        }
        let done = m as i64 - left;
        let rate = done as f64 / started.elapsed().as_secs_f64();
        let stats = table_stats(&pool).await?;
        if held {
            sqlx::query("ROLLBACK").execute(&mut *snap).await?;
        }
        drop(snap);
        stop.cancel();
        handle.await??;
        println!(
            "{:<52} {rate:>12.0}   ({done} of {m} in {:.0} s; {stats})",
            format!("drain, snapshot held open: {held}"),
            started.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

async fn table_stats(pool: &sqlx::PgPool) -> Res<String> {
    // Statistics reach pg_stat_user_tables when each backend flushes them
    // (at most once a second, and at exit): flush ours, wait, read afresh.
    let mut c = pool.acquire().await?;
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(&mut *c)
        .await?;
    drop(c);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut c = pool.acquire().await?;
    sqlx::query("SELECT pg_stat_clear_snapshot()").execute(&mut *c).await?;
    let (dead, live, size): (i64, i64, i64) = sqlx::query_as(
        "SELECT n_dead_tup, n_live_tup, pg_total_relation_size('outbox')
         FROM pg_stat_user_tables WHERE relid = 'outbox'::regclass",
    )
    .fetch_one(&mut *c)
    .await?;
    Ok(format!(
        "n_dead_tup {dead}, n_live_tup {live}, size {:.1} MiB",
        size as f64 / 1048576.0
    ))
}
