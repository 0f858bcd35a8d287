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
//!   deleting, and a drain while another session holds a snapshot open;
//! - `--wal`: WAL capture beside its baselines: a 1M-row drain
//!   at 100 B and 1 KiB by `--capture wal`, `--capture poll`, a raw produce
//!   and `pg_recvlogical` (with `--debezium`, Debezium's embedded outbox
//!   EventRouter too, `bench/debezium/run`), where the CPU went, commit → ack
//!   latency at 1k and 10k rows/s, and a `ferry-relay` process's VmHWM over
//!   the 1M backlog in WAL capture. Every replication slot it makes is
//!   dropped at the end, whatever the outcome;
//! - `--wal-latency`: the commit → ack runs of `--wal` alone;
//! - `--wal-process`: that last `ferry-relay` process drain alone (to
//!   profile the process: it runs after the seed, as the second
//!   `ferry-relay` the run starts);
//! - `--wal-big`: the same drain of 5M rows (500k with `--quick`) committed
//!   in one PostgreSQL transaction, and the process's VmHWM (the
//!   goal: ≤ 64 MiB);
//! - `--wal-streams`: one backlog of 1M rows of 100 B (200k with `--quick`)
//!   drained by one relay with `--streams` 1, 2 and 4, each beside its
//!   ceilings from the same run: a raw produce, and as many
//!   `pg_recvlogical` at once as streams, on the same row-filtered
//!   publications; with the CPU of the relay, the walsenders and the broker.
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
    let modes = [
        "--warm",
        "--latency",
        "--scaling",
        "--memory",
        "--bloat",
        "--wal",
        "--wal-process",
        "--wal-big",
        "--wal-latency",
        "--wal-streams",
    ];
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
        if has("--wal") {
            let ran = wal(&brokers, &broker, quick, has("--debezium")).await;
            // Whatever happened: a leftover slot holds WAL for ever.
            drop_bench_slots(&format!("ferry_bench_{}_", std::process::id())).await?;
            ran?;
        }
        if has("--wal-latency") {
            drop_orphan_slots().await?;
            let ran = wal_latency(&brokers, &broker, quick, has("--debezium")).await;
            drop_bench_slots(&format!("ferry_bench_{}_", std::process::id())).await?;
            ran?;
        }
        if has("--wal-streams") {
            drop_orphan_slots().await?;
            let ran = wal_streams(&brokers, &broker, quick).await;
            drop_bench_slots(&format!("ferry_bench_{}_", std::process::id())).await?;
            ran?;
        }
        if has("--wal-process") || has("--wal-big") {
            drop_orphan_slots().await?;
            let n = match (has("--wal-big"), quick) {
                (true, true) => 500_000,
                (true, false) => 5_000_000,
                (false, true) => 100_000,
                (false, false) => 1_000_000,
            };
            let ran = wal_process(&brokers, &broker, n, has("--wal-big")).await;
            drop_bench_slots(&format!("ferry_bench_{}_", std::process::id())).await?;
            ran?;
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
    std::sync::Arc<ferry_relay::state::RelayState>,
);

/// How the relay under test publishes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Mark,
    Delete,
    ExactlyOnce,
}

fn start(url: &str, brokers: &str, ferry: Ferry, mode: Mode) -> Res<Started> {
    start_with(poll_config(url, brokers, mode), ferry)
}

/// The polling relay's configuration in `mode`.
fn poll_config(url: &str, brokers: &str, mode: Mode) -> RelayConfig {
    let mut cfg = RelayConfig::new(url, brokers);
    // The lane relay these figures measure (WAL capture is measured later).
    cfg.capture = Some(ferry_relay::Capture::Poll);
    cfg.poll_interval = Duration::from_millis(20);
    cfg.lease = Duration::from_secs(5);
    cfg.delete_on_delivery = mode == Mode::Delete;
    // Producer settings to try (`BENCH_KAFKA=linger.ms=1,batch.size=…`),
    // as `--kafka` would give them.
    cfg.kafka.extend(bench_kafka());
    if mode == Mode::ExactlyOnce {
        // A fresh database per drain: a prefix and progress topic of its own.
        let id = uuid::Uuid::now_v7().simple().to_string();
        cfg.exactly_once = true;
        cfg.transactional_id_prefix = format!("bench-{id}");
        cfg.progress_topic = Some(format!("bench-progress-{id}"));
    }
    cfg
}

/// Producer settings to try, from `BENCH_KAFKA=linger.ms=1,batch.size=…`.
fn bench_kafka() -> Vec<(String, String)> {
    std::env::var("BENCH_KAFKA")
        .unwrap_or_default()
        .split(',')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// Starts an in-process relay with `cfg`.
fn start_with(cfg: RelayConfig, ferry: Ferry) -> Res<Started> {
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

/// Seeds `n` pending rows of `size` bytes on `topic` in one PostgreSQL
/// transaction (one statement): WAL capture never splits it.
async fn seed_one_transaction(ferry: &Ferry, topic: &str, n: usize, size: usize) -> Res<()> {
    let pool = ferry.db().as_postgres().ok_or("PostgreSQL only")?;
    let lanes: Vec<i32> = (0..1000)
        .map(|i| ferry::outbox::lane_for(&format!("k{i}"), ferry.lanes()))
        .collect();
    sqlx::query(
        "INSERT INTO outbox (tenant, topic, key, lane, payload, headers, created_at)
         SELECT 'bench', $1, 'k' || (g % 1000), ($3::int[])[g % 1000 + 1], $4, '{}'::jsonb,
                (extract(epoch FROM now()) * 1000)::bigint
         FROM generate_series(0, $2 - 1) g",
    )
    .bind(topic)
    .bind(n as i64)
    .bind(&lanes)
    .bind(vec![b'x'; size])
    .execute(pool)
    .await?;
    Ok(())
}

/// Waits until no row is pending (every row was written before the call),
/// by the readers' meaning: a row WAL capture covered is delivered.
/// Waits until no row is pending: none left in the pending state outside
/// the ledger's ranges. Cheap whatever the capture, so the wait does not
/// load the database it measures: one probe per gap of the ledger (a few
/// ranges in a drain) that stops at its first pending row, where counting
/// the pending rows through the per-row ledger predicate read all 1M rows
/// every 50 ms (a core of PostgreSQL during a WAL drain, whose rows keep
/// the pending state).
async fn wait_delivered(ferry: &Ferry) -> Res<()> {
    let pool = ferry.db().as_postgres().ok_or("PostgreSQL only")?;
    loop {
        let left: bool = sqlx::query_scalar(
            "WITH r AS (SELECT lo, hi, lead(lo) OVER (ORDER BY lo) AS next FROM outbox_delivered),
             gaps AS (SELECT hi AS after, next AS before FROM r WHERE next IS NULL OR next > hi + 1
                      UNION ALL SELECT -1, (SELECT min(lo) FROM outbox_delivered))
             SELECT EXISTS (SELECT 1 FROM gaps g CROSS JOIN LATERAL (
                 SELECT 1 FROM outbox o WHERE o.state = 'pending' AND o.id > g.after
                   AND (g.before IS NULL OR o.id < g.before) LIMIT 1) x)",
        )
        .fetch_one(pool)
        .await?;
        if !left {
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

/// The floor under commit → ack: raw rdkafka produce → ack of 100 B
/// records at `rate` records/s (the relay's producer settings, 48 senders
/// each awaiting its record, `rows_per_commit` records per tick) for
/// `d`, to the same topic; its p50 / p99 in ms. `producer` is made by
/// [`raw_latency_producer`] and warmed up by a first call.
async fn raw_latency(producer: &FutureProducer, rate: u64, d: Duration) -> Res<(f64, f64)> {
    let rows = rows_per_commit(rate);
    let per = Duration::from_nanos(1_000_000_000 * WRITERS * rows / rate);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..WRITERS {
        let producer = producer.clone();
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(per);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut samples = Vec::new();
            let mut i = w;
            while started.elapsed() < d {
                tick.tick().await;
                let sent = Instant::now();
                let mut acks = Vec::new();
                for _ in 0..rows {
                    let key = format!("k{}", i % 500);
                    i += WRITERS;
                    if let Ok(f) =
                        producer.send_result(FutureRecord::to("bench-latency").key(&key).payload(&[0u8; 100][..]))
                    {
                        acks.push(f);
                    }
                }
                for f in acks {
                    if matches!(f.await, Ok(Ok(_))) {
                        samples.push(sent.elapsed().as_micros() as i64);
                    }
                }
            }
            samples
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await?);
    }
    Ok(p50_p99_ms(all))
}

/// The p50 and p99 of µs samples, in ms (0 without samples).
fn p50_p99_ms(mut us: Vec<i64>) -> (f64, f64) {
    us.sort_unstable();
    let q = |q: f64| {
        us.get(((us.len().max(1) - 1) as f64 * q) as usize)
            .copied()
            .unwrap_or(0) as f64
            / 1000.0
    };
    (q(0.5), q(0.99))
}

/// A producer with the relay's settings, for [`raw_latency`].
fn raw_latency_producer(brokers: &str) -> Res<FutureProducer> {
    Ok(ferry_relay::publish::producer_config(&poll_config("postgres://x", brokers, Mode::Mark)).create()?)
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
            let (sent, took, _) = steady(&writers, rate, Duration::from_secs(secs)).await?;
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

/// Concurrent writers in the latency runs, each on its own pooled
/// connection: enough that commit latency does not cap the offered rate.
const WRITERS: u64 = 48;

/// Rows per writer transaction at `rate` rows/s: one up to 1k rows/s; above
/// it, as many as keep the transactions at 1k/s (48 one-row writers commit
/// only ~3.3k transactions/s here, short of 10k rows/s offered).
fn rows_per_commit(rate: u64) -> u64 {
    rate.div_ceil(1_000).max(1)
}

/// Enqueues at `rate` rows/s for `d` from [`WRITERS`] tasks sharing `f`'s
/// pool, [`rows_per_commit`] rows per transaction; returns rows sent,
/// seconds taken, and the p50 / p99 (ms) of the writers' `COMMIT`s.
async fn steady(f: &Ferry, rate: u64, d: Duration) -> Res<(u64, f64, (f64, f64))> {
    let rows = rows_per_commit(rate);
    let per = Duration::from_nanos(1_000_000_000 * WRITERS * rows / rate);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..WRITERS {
        let f = f.clone();
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(per);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut sent = 0u64;
            let mut commits = Vec::new();
            let mut i = w;
            while started.elapsed() < d {
                tick.tick().await;
                let Ok(mut tx) = f.begin().await else { continue };
                let mut ok = true;
                for _ in 0..rows {
                    let m = OutboxMessage::bytes("bench", "bench-latency", format!("k{}", i % 500), vec![0u8; 100]);
                    ok &= f.enqueue_in(tx.conn(), &m).await.is_ok();
                    i += WRITERS;
                }
                let at = Instant::now();
                if ok && tx.commit().await.is_ok() {
                    commits.push(at.elapsed().as_micros() as i64);
                    sent += rows;
                }
            }
            (sent, commits)
        }));
    }
    let mut sent = 0;
    let mut commits = Vec::new();
    for t in tasks {
        let (n, c) = t.await?;
        sent += n;
        commits.extend(c);
    }
    Ok((sent, started.elapsed().as_secs_f64(), p50_p99_ms(commits)))
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

/// `k` relay processes on one database, capturing as `capture` says
/// (`--capture …` and its flags); returns the children.
fn spawn_relays(url: &str, brokers: &str, k: usize, capture: &[&str]) -> Res<Vec<std::process::Child>> {
    let bin = relay_binary()?;
    let mut out = Vec::new();
    for _ in 0..k {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let child = std::process::Command::new(&bin)
            .args(["run", "--database-url", url, "--brokers", brokers])
            .args(["--poll-interval", "20ms", "--lease", "5s"])
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(capture)
            .args(
                bench_kafka()
                    .into_iter()
                    .flat_map(|(k, v)| ["--kafka".to_owned(), format!("{k}={v}")]),
            )
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
    let children = spawn_relays(&url, brokers, k, &["--capture", "poll"])?;
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
            left = sqlx::query_scalar(&format!(
                "SELECT count(*) FROM {} WHERE state = 'pending'",
                ferry_testkit::OUTBOX
            ))
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

// ---- WAL capture beside its baselines (issue #20). ----

/// The admin connection (the cluster's `postgres` database, where the
/// testkit's schemas live): slots, publications and `pg_recvlogical`.
fn admin_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// A slot (and publication) name of this run: `ferry_bench_<pid>_<n>`.
fn slot_name() -> String {
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("ferry_bench_{}_{n}", std::process::id())
}

/// Drops every slot and publication whose name starts with `prefix`, ending
/// the session streaming from a slot first; retries while a relay still
/// holds one, and fails if one is left.
async fn drop_bench_slots(prefix: &str) -> Res<()> {
    let admin = sqlx::PgPool::connect(&admin_url()).await?;
    let like = format!("{}%", prefix.replace('_', "\\_"));
    for _ in 0..100 {
        sqlx::query(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name LIKE $1 AND active",
        )
        .bind(&like)
        .execute(&admin)
        .await?;
        let slots: Vec<String> = sqlx::query_scalar(
            "SELECT slot_name::text FROM pg_replication_slots WHERE slot_name LIKE $1 AND NOT active",
        )
        .bind(&like)
        .fetch_all(&admin)
        .await?;
        for slot in slots {
            // It may have become active again in between: the next round.
            let _ = sqlx::query("SELECT pg_drop_replication_slot($1)")
                .bind(&slot)
                .execute(&admin)
                .await;
        }
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE $1")
            .bind(&like)
            .fetch_one(&admin)
            .await?;
        if left == 0 {
            let pubs: Vec<String> =
                sqlx::query_scalar("SELECT pubname::text FROM pg_publication WHERE pubname LIKE $1")
                    .bind(&like)
                    .fetch_all(&admin)
                    .await?;
            for p in pubs {
                sqlx::query(&format!("DROP PUBLICATION IF EXISTS {p}"))
                    .execute(&admin)
                    .await?;
            }
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(format!("replication slots {prefix}* still there: drop them by hand").into())
}

/// Drops the slots a killed earlier run of this benchmark left (its
/// process gone).
async fn drop_orphan_slots() -> Res<()> {
    let admin = sqlx::PgPool::connect(&admin_url()).await?;
    let names: Vec<String> =
        sqlx::query_scalar("SELECT slot_name::text FROM pg_replication_slots WHERE slot_name LIKE 'ferry\\_bench\\_%'")
            .fetch_all(&admin)
            .await?;
    for name in names {
        let pid = name.split('_').nth(2).unwrap_or("");
        if !pid.is_empty() && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            drop_bench_slots(&format!("ferry_bench_{pid}_")).await?;
        }
    }
    Ok(())
}

/// A WAL-capturing relay's configuration on `slot` (also its publication).
fn wal_config(url: &str, brokers: &str, slot: &str) -> RelayConfig {
    let mut cfg = poll_config(url, brokers, Mode::Mark);
    cfg.capture = Some(ferry_relay::Capture::Wal);
    cfg.slot = Some(slot.into());
    cfg.publication = Some(slot.into());
    cfg
}

/// CPU seconds (user + system) of process `pid` so far; 0 once it is gone.
fn cpu_secs(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            // The fields after the command name, which may hold spaces.
            let rest = s.rsplit_once(')')?.1.to_owned();
            let f: Vec<&str> = rest.split_whitespace().collect();
            let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
            Some(ticks / 100.0)
        })
        .unwrap_or(0.0)
}

/// The Kafka broker this process started: the `kafka.Kafka` JVM (under the
/// testkit's watchdog) whose directory is `ferry-kafka-<this pid>-…`.
fn broker_pid() -> Option<u32> {
    let mine = format!("ferry-kafka-{}-", std::process::id());
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let cmd = String::from_utf8_lossy(&cmd);
        // The JVM itself, not the `sh` watchdog whose arguments name it too.
        let java = cmd.split('\0').next().is_some_and(|a| a.ends_with("java"));
        (java && cmd.contains("kafka.Kafka") && cmd.contains(&mine)).then_some(pid)
    })
}

/// CPU seconds spent during a drain by the relay (this process or a relay
/// process), PostgreSQL's walsender (or all of PostgreSQL's backends when
/// polling) and the broker: which part bounds the drain.
struct CpuSplit {
    pids: Vec<(&'static str, u32)>,
    before: Vec<f64>,
    /// Every PostgreSQL process's CPU at the start, when asked for.
    postgres: Option<std::collections::HashMap<u32, f64>>,
    started: Instant,
}

impl CpuSplit {
    fn start(pids: Vec<(&'static str, u32)>) -> CpuSplit {
        let before = pids.iter().map(|(_, p)| cpu_secs(*p)).collect();
        CpuSplit {
            pids,
            before,
            postgres: None,
            started: Instant::now(),
        }
    }

    /// Also every PostgreSQL process's CPU (walsenders, the relay's own
    /// backends, which mark, and the rest): what the database as a whole
    /// spent.
    fn with_postgres(mut self) -> CpuSplit {
        self.postgres = Some(postgres_cpu());
        self
    }

    /// Each part's CPU as a share of one core over the wall time.
    fn finish(self) -> String {
        let wall = self.started.elapsed().as_secs_f64();
        let mut parts: Vec<String> = self
            .pids
            .iter()
            .zip(&self.before)
            .map(|((name, p), b)| format!("{name} {:.0}%", 100.0 * (cpu_secs(*p) - b) / wall))
            .collect();
        if let Some(before) = &self.postgres {
            let spent: f64 = postgres_cpu()
                .iter()
                .map(|(pid, now)| now - before.get(pid).copied().unwrap_or(0.0))
                .sum();
            parts.push(format!("all PostgreSQL processes {:.0}%", 100.0 * spent / wall));
        }
        format!("CPU over {wall:.1} s (100% = one core): {}", parts.join(", "))
    }
}

/// The CPU seconds of every running `postgres` process, by pid.
fn postgres_cpu() -> std::collections::HashMap<u32, f64> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
            (comm.trim() == "postgres").then(|| (pid, cpu_secs(pid)))
        })
        .collect()
}

/// The pid of the walsender streaming from `slot`, once it is active (a
/// minute at most: Debezium's JVM takes a while to start).
async fn walsender_pid(admin: &sqlx::PgPool, slot: &str) -> Res<u32> {
    for _ in 0..3000 {
        let pid: Option<i32> = sqlx::query_scalar(
            "SELECT s.active_pid FROM pg_replication_slots s JOIN pg_stat_replication r ON r.pid = s.active_pid
                 WHERE s.slot_name = $1",
        )
        .bind(slot)
        .fetch_optional(admin)
        .await?
        .flatten();
        if let Some(pid) = pid {
            return Ok(pid as u32);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Err(format!("nothing streams from {slot}").into())
}

/// Everything `--wal` measures, in one run.
async fn wal(brokers: &str, broker: &ferry_testkit::Kafka, quick: bool, debezium: bool) -> Res<()> {
    drop_orphan_slots().await?;
    let debezium = debezium && debezium_available();
    let n = if quick { 100_000 } else { 1_000_000 };
    println!("load before: {}", uptime());
    for size in [100usize, 1024] {
        let topic = format!("bench-wal-{size}");
        broker.create_topic(&topic, 6);
        // The broker warmed first, as the relays find it.
        raw_produce(brokers, &topic, n.min(100_000), size).await?;
        let raw = raw_produce(brokers, &topic, n, size).await?;
        let (recv, recv_cpu) = recvlogical_drain(n, size).await?;
        let ceiling = raw.min(recv);
        let (wal_rate, wal_cpu) = wal_drain(brokers, &topic, n, size, false).await?;
        let (del_rate, del_cpu) = wal_drain(brokers, &topic, n, size, true).await?;
        let (poll_rate, poll_cpu) = poll_drain(brokers, &topic, n, size).await?;
        let dbz = if debezium {
            Some(debezium_drain(brokers, &topic, n, size).await?)
        } else {
            None
        };
        let line = |what: &str, rate: f64| {
            println!(
                "{:<52} {rate:>12.0} {:>14}",
                format!("{what}, drain {n} × {size} B (rows/s)"),
                format!("{:.2}× ceiling", rate / ceiling)
            )
        };
        line("--capture wal", wal_rate);
        println!("    {wal_cpu}");
        line("--capture wal --delete-on-delivery", del_rate);
        println!("    {del_cpu}");
        line("--capture poll", poll_rate);
        println!("    {poll_cpu}");
        if let Some((rate, cpu)) = &dbz {
            line("Debezium 3.6.1 embedded, outbox EventRouter", *rate);
            println!("    {cpu}");
        }
        line("raw rdkafka produce (ceiling)", raw);
        line("pg_recvlogical → /dev/null (ceiling)", recv);
        println!("    {recv_cpu}");
        println!(
            "    goal: wal ≥ 0.7 × the slower ceiling ({ceiling:.0}): {:.2}, {}; load after: {}",
            wal_rate / ceiling,
            if wal_rate >= 0.7 * ceiling { "met" } else { "missed" },
            uptime()
        );
    }
    wal_latency(brokers, broker, quick, debezium).await?;
    wal_process(brokers, broker, n, false).await
}

/// A `ferry-relay` process's drain of `n` rows in WAL capture: its rate,
/// where the CPU went and its VmHWM (alone: `--wal-process`).
async fn wal_process(brokers: &str, broker: &ferry_testkit::Kafka, n: usize, one_transaction: bool) -> Res<()> {
    let (rate, hwm, cpu) = wal_process_drain(brokers, broker, n, one_transaction).await?;
    let how = if one_transaction {
        "in one transaction"
    } else {
        "in transactions of 10,000"
    };
    println!(
        "{:<52} {rate:>12.0} {:>14}",
        format!("ferry-relay process, --capture wal, drain {n} × 100 B {how}"),
        "-"
    );
    println!("    {cpu}");
    println!(
        "{:<52} {:>9.1} MiB {:>14}   {}",
        "  its VmHWM",
        hwm as f64 / 1024.0,
        "goal ≤ 64 MiB",
        if hwm <= 64 * 1024 { "met" } else { "missed" }
    );
    println!("load after: {}", uptime());
    Ok(())
}

/// `uptime`'s load averages.
fn uptime() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// Starts a WAL relay on `slot` and lets one row through it, so the slot
/// and publication exist and the (empty) catch-up read is done; stops it.
async fn make_slot(brokers: &str, url: &str, ferry: &Ferry, slot: &str, topic: &str) -> Res<()> {
    let (stop, handle, _) = start_with(wal_config(url, brokers, slot), ferry.clone())?;
    ferry
        .enqueue(&OutboxMessage::bytes("bench", topic, "first", vec![b'x'; 8]))
        .await?;
    wait_delivered(ferry).await?;
    stop.cancel();
    handle.await??;
    Ok(())
}

/// `--capture wal` drains `n` rows committed after its slot was made (so
/// they come from the WAL, not the one-time table read).
async fn wal_drain(brokers: &str, topic: &str, n: usize, size: usize, delete: bool) -> Res<(f64, String)> {
    let (ferry, url) = fresh().await?;
    let slot = slot_name();
    make_slot(brokers, &url, &ferry, &slot, topic).await?;
    seed(&ferry, topic, n, size).await?;
    let admin = sqlx::PgPool::connect(&admin_url()).await?;
    let started = Instant::now();
    let mut cfg = wal_config(&url, brokers, &slot);
    cfg.delete_on_delivery = delete;
    let (stop, handle, state) = start_with(cfg, ferry.clone())?;
    let walsender = walsender_pid(&admin, &slot).await?;
    let cpu = CpuSplit::start(vec![
        ("relay (bench process)", std::process::id()),
        ("walsender", walsender),
        ("broker", broker_pid().unwrap_or(0)),
    ]);
    // When the broker had acknowledged every row (the marks follow).
    let acked = {
        let state = state.clone();
        tokio::spawn(async move {
            while state
                .metrics
                .timings
                .wal_acked
                .load(std::sync::atomic::Ordering::Relaxed)
                < n as u64
            {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            started.elapsed()
        })
    };
    wait_delivered(&ferry).await?;
    let took = started.elapsed();
    let rate = n as f64 / took.as_secs_f64();
    let cpu = format!(
        "{}\n    all acknowledged after {:.2} s, all marked after {:.2} s; stages: {}",
        cpu.finish(),
        acked.await?.as_secs_f64(),
        took.as_secs_f64(),
        state.metrics.timings.summary()
    );
    stop.cancel();
    handle.await??;
    drop_bench_slots(&slot).await?;
    Ok((rate, cpu))
}

/// `--wal-streams`: the drain of one backlog with `--streams` 1, 2 and 4,
/// each beside a raw produce and as many `pg_recvlogical` at once on the
/// same row-filtered publications (the ceiling of N streams).
async fn wal_streams(brokers: &str, broker: &ferry_testkit::Kafka, quick: bool) -> Res<()> {
    let n = if quick { 200_000 } else { 1_000_000 };
    let topic = "bench-streams";
    broker.create_topic(topic, 6);
    println!("load before: {}", uptime());
    // The broker warmed first, as the relays find it.
    raw_produce(brokers, topic, n.min(100_000), 100).await?;
    let raw = raw_produce(brokers, topic, n, 100).await?;
    println!(
        "{:<52} {raw:>12.0} {:>14}",
        format!("raw rdkafka produce, {n} × 100 B (rows/s)"),
        "ceiling"
    );
    for count in [1u32, 2, 4] {
        let (recv, recv_cpu) = recvlogical_streams(n, count).await?;
        let (rate, cpu) = streams_drain(brokers, topic, n, count).await?;
        let ceiling = raw.min(recv);
        println!(
            "{:<52} {rate:>12.0} {:>14}",
            format!("--capture wal --streams {count}, drain {n} × 100 B"),
            format!("{:.2}× ceiling", rate / ceiling)
        );
        println!("    {cpu}");
        println!(
            "{:<52} {recv:>12.0} {:>14}",
            format!("{count} × pg_recvlogical → /dev/null at once"),
            "ceiling"
        );
        println!("    {recv_cpu}");
    }
    println!("load after: {}", uptime());
    Ok(())
}

/// The slot names of `count` streams of group `slot`.
fn stream_slots(slot: &str, count: u32) -> Vec<String> {
    (0..count)
        .map(|index| ferry_relay::store::Stream { index, count }.name(slot))
        .collect()
}

/// Labels for the CPU split of up to 4 walsenders.
const WALSENDERS: [&str; 4] = ["walsender 0", "walsender 1", "walsender 2", "walsender 3"];

/// One relay (this process) with `--streams count` drains `n` rows
/// committed after its slots were made.
async fn streams_drain(brokers: &str, topic: &str, n: usize, count: u32) -> Res<(f64, String)> {
    let (ferry, url) = fresh().await?;
    let admin = sqlx::PgPool::connect(&admin_url()).await?;
    let slot = slot_name();
    let mut cfg = wal_config(&url, brokers, &slot);
    cfg.streams = count;
    let slots = stream_slots(&slot, count);
    // Every stream's slot made (and streaming) before the rows are written.
    let (stop, handle, _) = start_with(cfg.clone(), ferry.clone())?;
    for s in &slots {
        walsender_pid(&admin, s).await?;
    }
    stop.cancel();
    handle.await??;
    seed(&ferry, topic, n, 100).await?;
    let started = Instant::now();
    let (stop, handle, state) = start_with(cfg, ferry.clone())?;
    let mut pids = vec![
        ("relay (bench process)", std::process::id()),
        ("broker", broker_pid().unwrap_or(0)),
    ];
    for (k, s) in slots.iter().enumerate() {
        pids.push((WALSENDERS[k], walsender_pid(&admin, s).await?));
    }
    let cpu = CpuSplit::start(pids).with_postgres();
    let busy = ActiveStatements::start(admin.clone());
    // The relay's count of rows marked delivered, not a query: a fragmented
    // ledger makes every reader of pending rows walk its gaps, and polling
    // one would measure this program's own queries.
    while state.metrics.published.get() < n as u64 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();
    let cpu = format!("{}\n    {}", cpu.finish(), busy.finish().await);
    wait_delivered(&ferry).await?;
    let ranges: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_delivered")
        .fetch_one(ferry.db().as_postgres().ok_or("PostgreSQL only")?)
        .await?;
    stop.cancel();
    handle.await??;
    drop_bench_slots(&slot).await?;
    Ok((rate, format!("{cpu}; {ranges} delivered ranges in the ledger")))
}

/// Where PostgreSQL's backends spend their time: the statements running
/// and what each waits on, if anything (`pg_stat_activity`, replication
/// excluded), sampled every 100 ms.
struct ActiveStatements {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<(usize, std::collections::HashMap<String, usize>)>,
}

impl ActiveStatements {
    fn start(admin: sqlx::PgPool) -> ActiveStatements {
        let stop = CancellationToken::new();
        let until = stop.clone();
        let task = tokio::spawn(async move {
            let (mut samples, mut seen) = (0, std::collections::HashMap::<String, usize>::new());
            while !until.is_cancelled() {
                let running: Vec<String> = sqlx::query_scalar(
                    "SELECT COALESCE(wait_event, 'on CPU') || ': ' || left(regexp_replace(query, '\\s+', ' ', 'g'), 70)
                     FROM pg_stat_activity
                     WHERE state = 'active' AND backend_type = 'client backend'
                       AND pid <> pg_backend_pid() AND query NOT LIKE 'START_REPLICATION%'",
                )
                .fetch_all(&admin)
                .await
                .unwrap_or_default();
                samples += 1;
                for q in running {
                    *seen.entry(q).or_default() += 1;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            (samples, seen)
        });
        ActiveStatements { stop, task }
    }

    /// The statements seen running most often, each with the share of
    /// samples it was seen in.
    async fn finish(self) -> String {
        self.stop.cancel();
        let (samples, seen) = self.task.await.unwrap_or_default();
        let mut top: Vec<(String, usize)> = seen.into_iter().collect();
        top.sort_by_key(|t| std::cmp::Reverse(t.1));
        let parts: Vec<String> = top
            .iter()
            .take(4)
            .map(|(q, k)| format!("{:.0}% {q}", 100.0 * *k as f64 / samples.max(1) as f64))
            .collect();
        format!("running in PostgreSQL ({samples} samples): {}", parts.join(" | "))
    }
}

/// `count` `pg_recvlogical` at once, each streaming the rows of one lane
/// stream (a publication filtered on `lane % count`) of `n` rows to
/// `/dev/null`: what PostgreSQL's decoding and sending alone allows N
/// streams.
async fn recvlogical_streams(n: usize, count: u32) -> Res<(f64, String)> {
    let (ferry, _) = fresh().await?;
    let admin = sqlx::PgPool::connect(&admin_url()).await?;
    let pool = ferry.db().as_postgres().ok_or("PostgreSQL only")?;
    let schema: String = sqlx::query_scalar("SELECT current_schema()::text")
        .fetch_one(pool)
        .await?;
    let slots = stream_slots(&slot_name(), count);
    for (k, s) in slots.iter().enumerate() {
        let filter = match count {
            1 => String::new(),
            _ => format!(" WHERE (lane % {count} = {k})"),
        };
        sqlx::query(&format!(
            "CREATE PUBLICATION {s} FOR TABLE \"{schema}\".outbox{filter} WITH (publish = 'insert')"
        ))
        .execute(&admin)
        .await?;
        sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
            .bind(s)
            .execute(&admin)
            .await?;
    }
    seed(&ferry, "bench-recvlogical", n, 100).await?;
    let end: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&admin)
        .await?;
    let started = Instant::now();
    let mut children = Vec::new();
    for s in &slots {
        children.push(
            tokio::process::Command::new("pg_recvlogical")
                .args([
                    "-d",
                    &admin_url(),
                    "--slot",
                    s,
                    "--start",
                    "--no-loop",
                    "--endpos",
                    &end,
                ])
                .args(["-o", "proto_version=1", "-o", &format!("publication_names={s}")])
                .args(["-f", "/dev/null"])
                .spawn()?,
        );
    }
    let mut pids = Vec::new();
    for (k, s) in slots.iter().enumerate() {
        pids.push((WALSENDERS[k], walsender_pid(&admin, s).await?));
    }
    let cpu = CpuSplit::start(pids);
    let mut failed = None;
    for mut child in children {
        let status = child.wait().await?;
        if !status.success() {
            failed = Some(status);
        }
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();
    let cpu = cpu.finish();
    for s in &slots {
        drop_bench_slots(s).await?;
    }
    if let Some(status) = failed {
        return Err(format!("pg_recvlogical: {status}").into());
    }
    Ok((rate, cpu))
}

/// `--capture poll` drains `n` rows (1 relay, marking delivered).
async fn poll_drain(brokers: &str, topic: &str, n: usize, size: usize) -> Res<(f64, String)> {
    let (ferry, url) = fresh().await?;
    seed(&ferry, topic, n, size).await?;
    let started = Instant::now();
    let cpu = CpuSplit::start(vec![
        ("relay (bench process)", std::process::id()),
        ("broker", broker_pid().unwrap_or(0)),
    ]);
    let (stop, handle, _) = start(&url, brokers, ferry.clone(), Mode::Mark)?;
    wait_delivered(&ferry).await?;
    let rate = n as f64 / started.elapsed().as_secs_f64();
    let cpu = cpu.finish();
    stop.cancel();
    handle.await??;
    Ok((rate, cpu))
}

/// A publication of `url`'s outbox (inserts only) and a pgoutput slot, both
/// named `slot`, made before any row; returns the schema.
async fn slot_before_rows(admin: &sqlx::PgPool, ferry: &Ferry, slot: &str) -> Res<String> {
    let pool = ferry.db().as_postgres().ok_or("PostgreSQL only")?;
    let schema: String = sqlx::query_scalar("SELECT current_schema()::text")
        .fetch_one(pool)
        .await?;
    sqlx::query(&format!(
        "CREATE PUBLICATION {slot} FOR TABLE \"{schema}\".outbox WITH (publish = 'insert')"
    ))
    .execute(admin)
    .await?;
    sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
        .bind(slot)
        .execute(admin)
        .await?;
    Ok(schema)
}

/// `pg_recvlogical` streams `n` rows through a fresh pgoutput slot to
/// `/dev/null`, up to the WAL position after the last of them: what
/// decoding and sending the rows costs PostgreSQL alone.
async fn recvlogical_drain(n: usize, size: usize) -> Res<(f64, String)> {
    let (ferry, _) = fresh().await?;
    let admin = sqlx::PgPool::connect(&admin_url()).await?;
    let slot = slot_name();
    slot_before_rows(&admin, &ferry, &slot).await?;
    seed(&ferry, "bench-recvlogical", n, size).await?;
    let end: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&admin)
        .await?;
    let started = Instant::now();
    let mut child = tokio::process::Command::new("pg_recvlogical")
        .args([
            "-d",
            &admin_url(),
            "--slot",
            &slot,
            "--start",
            "--no-loop",
            "--endpos",
            &end,
        ])
        .args(["-o", "proto_version=1", "-o", &format!("publication_names={slot}")])
        .args(["-f", "/dev/null"])
        .spawn()?;
    let walsender = walsender_pid(&admin, &slot).await?;
    // pg_recvlogical itself has exited when the split is read: its
    // walsender's share is the one that says something.
    let cpu = CpuSplit::start(vec![("walsender", walsender)]);
    let status = child.wait().await?;
    let rate = n as f64 / started.elapsed().as_secs_f64();
    let cpu = cpu.finish();
    drop_bench_slots(&slot).await?;
    if !status.success() {
        return Err(format!("pg_recvlogical: {status}").into());
    }
    Ok((rate, cpu))
}

/// Commit → ack p50/p99 at 1k and 10k rows/s offered, `--capture wal`
/// against `--capture poll` (writers' NOTIFY coalescing at its default),
/// with Debezium at 1k rows/s beside them when asked.
async fn wal_latency(brokers: &str, broker: &ferry_testkit::Kafka, quick: bool, debezium: bool) -> Res<()> {
    broker.create_topic("bench-latency", 6);
    let secs = if quick { 5 } else { 10 };
    for rate in [1_000u64, 10_000] {
        let goal = if rate == 1_000 { "≤10 / ≤25" } else { "- / ≤50" };
        // The floor under the relay's figure: raw produce → ack at the same
        // rate, alone and while the same writers commit the same rows (no
        // relay reads them), which shows what the machine's load alone
        // adds to the broker's tail.
        let producer = raw_latency_producer(brokers)?;
        raw_latency(&producer, rate, Duration::from_secs(3)).await?;
        let (p50, p99) = raw_latency(&producer, rate, Duration::from_secs(secs)).await?;
        let (_ferry, url) = fresh().await?;
        let writers = Ferry::builder(&url)
            .max_connections(WRITERS as u32)
            .outbox_key_locks(false)
            .connect()
            .await?;
        let span = Duration::from_secs(secs);
        let ((written, took, _), (l50, l99)) =
            tokio::try_join!(steady(&writers, rate, span), raw_latency(&producer, rate, span))?;
        drop(producer);
        println!(
            "{:<64} {p50:>6.1} / {p99:>5.1} ms   (load {})",
            format!("raw rdkafka produce → ack, {rate} records/s, the relay's producer settings"),
            uptime()
        );
        println!(
            "{:<64} {l50:>6.1} / {l99:>5.1} ms   (load {})",
            format!(
                "  the same while the writers commit {:.0} rows/s (no relay)",
                written as f64 / took
            ),
            uptime()
        );
        for wal in [true, false] {
            let (ferry, url) = fresh().await?;
            let slot = slot_name();
            let cfg = if wal {
                wal_config(&url, brokers, &slot)
            } else {
                poll_config(&url, brokers, Mode::Mark)
            };
            let (stop, handle, state) = start_with(cfg, ferry.clone())?;
            // WAL capture keeps commit order without the per-key lock
            // (README, "WAL capture"), so its writers go without it.
            let writers = Ferry::builder(&url)
                .max_connections(WRITERS as u32)
                .outbox_key_locks(!wal)
                .connect()
                .await?;
            steady(&writers, rate, Duration::from_secs(3)).await?;
            wait_delivered(&ferry).await?;
            state.metrics.reset_latency();
            state.metrics.timings.reset();
            let (sent, took, commits) = steady(&writers, rate, Duration::from_secs(secs)).await?;
            wait_delivered(&ferry).await?;
            stop.cancel();
            handle.await??;
            if wal {
                drop_bench_slots(&slot).await?;
            }
            let q = |x| state.metrics.latency_quantile(x).unwrap_or(0);
            println!(
                "{:<64} {:>6} / {:>3} ms {:>14}   (load {})",
                format!(
                    "{} → ack p50 / p99, --capture {}, {rate} rows/s offered, {} per commit ({:.0} achieved)",
                    if wal { "commit" } else { "created_at" },
                    if wal { "wal" } else { "poll" },
                    rows_per_commit(rate),
                    sent as f64 / took
                ),
                q(0.5),
                q(0.99),
                goal,
                uptime()
            );
            if wal {
                println!("    stages: {}", state.metrics.timings.summary());
                println!("    commit → ack: {}", state.metrics.timings.wal_stages.summary());
            }
            println!(
                "    the writers' COMMIT p50 / p99: {:.1} / {:.1} ms",
                commits.0, commits.1
            );
        }
        if debezium && rate == 1_000 {
            for poll_ms in [None, Some(10u64)] {
                let (p50, p99, achieved) = debezium_latency(brokers, rate, secs, poll_ms).await?;
                println!(
                    "{:<64} {p50:>6} / {p99:>3} ms {goal:>14}   (load {})",
                    format!(
                        "commit → ack p50 / p99, Debezium, poll.interval.ms {}, {rate} rows/s offered ({achieved:.0} achieved)",
                        poll_ms.map_or("default".into(), |m| m.to_string())
                    ),
                    uptime()
                );
            }
        }
    }
    Ok(())
}

/// A release `ferry-relay` process in WAL capture drains `n` rows committed
/// after its slot was made; (rows/s, its VmHWM KiB, the CPU split).
async fn wal_process_drain(
    brokers: &str,
    broker: &ferry_testkit::Kafka,
    n: usize,
    one_transaction: bool,
) -> Res<(f64, u64, String)> {
    broker.create_topic("bench-wal-memory", 6);
    let (ferry, url) = fresh().await?;
    let admin = sqlx::PgPool::connect(&admin_url()).await?;
    let slot = slot_name();
    let capture = ["--capture", "wal", "--slot", &slot, "--publication", &slot];
    let first = spawn_relays(&url, brokers, 1, &capture)?;
    ferry
        .enqueue(&OutboxMessage::bytes(
            "bench",
            "bench-wal-memory",
            "first",
            vec![b'x'; 8],
        ))
        .await?;
    wait_delivered(&ferry).await?;
    stop_relays(first);
    if one_transaction {
        seed_one_transaction(&ferry, "bench-wal-memory", n, 100).await?;
    } else {
        seed(&ferry, "bench-wal-memory", n, 100).await?;
    }
    let started = Instant::now();
    let children = spawn_relays(&url, brokers, 1, &capture)?;
    let walsender = walsender_pid(&admin, &slot).await?;
    let cpu = CpuSplit::start(vec![
        ("ferry-relay", children[0].id()),
        ("walsender", walsender),
        ("broker", broker_pid().unwrap_or(0)),
    ]);
    wait_delivered(&ferry).await?;
    let rate = n as f64 / started.elapsed().as_secs_f64();
    let cpu = cpu.finish();
    let hwm = vm_hwm_kib(children[0].id());
    stop_relays(children);
    drop_bench_slots(&slot).await?;
    Ok((rate, hwm, cpu))
}

/// `bench/debezium/run`, present and with `mvn` to build it.
fn debezium_script() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/debezium/run")
}

fn debezium_available() -> bool {
    let mvn = std::process::Command::new("mvn")
        .arg("-v")
        .stdout(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !mvn {
        println!("--debezium: no mvn on PATH, Debezium skipped");
    }
    mvn && debezium_script().exists()
}

/// `bench/debezium/run <mode>` against this run's database and broker.
fn debezium_command(brokers: &str, schema: &str, slot: &str, mode: &str) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(debezium_script());
    cmd.arg(mode)
        .env("BENCH_BROKERS", brokers)
        .env("BENCH_DATABASE_URL", admin_url())
        .env("BENCH_SCHEMA", schema)
        .env("BENCH_SLOT", slot)
        .stdout(std::process::Stdio::piped());
    cmd
}

/// Debezium drains `n` rows committed after its slot (snapshot.mode
/// no_data) to `topic`; (rows/s it printed, the CPU split).
async fn debezium_drain(brokers: &str, topic: &str, n: usize, size: usize) -> Res<(f64, String)> {
    let (ferry, _) = fresh().await?;
    let admin = sqlx::PgPool::connect(&admin_url()).await?;
    let slot = slot_name();
    let schema = slot_before_rows(&admin, &ferry, &slot).await?;
    seed(&ferry, topic, n, size).await?;
    let mut child = debezium_command(brokers, &schema, &slot, "drain")
        .env("BENCH_ROWS", n.to_string())
        .spawn()?;
    let walsender = walsender_pid(&admin, &slot).await?;
    let cpu = CpuSplit::start(vec![
        ("Debezium JVM", child.id().unwrap_or(0)),
        ("walsender", walsender),
        ("broker", broker_pid().unwrap_or(0)),
    ]);
    let out = read_lines(&mut child).await?;
    let cpu = cpu.finish();
    let status = child.wait().await?;
    drop_bench_slots(&slot).await?;
    let rate = out
        .iter()
        .find_map(|l| l.strip_prefix("rows/s "))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| format!("Debezium ({status}) printed no rate: {out:?}"))?;
    Ok((rate, cpu))
}

/// The child's stdout lines until it closes.
async fn read_lines(child: &mut tokio::process::Child) -> Res<Vec<String>> {
    use tokio::io::AsyncBufReadExt;
    let out = child.stdout.take().ok_or("no stdout")?;
    let mut lines = tokio::io::BufReader::new(out).lines();
    let mut all = Vec::new();
    while let Some(l) = lines.next_line().await? {
        all.push(l);
    }
    Ok(all)
}

/// Debezium's commit → ack p50/p99 at `rate` rows/s: it prints `ready` once
/// its task streams; a 3 s warm-up ends with a row keyed `__warm` (it forgets
/// the samples before it), the measured `secs` with one keyed `__end`.
async fn debezium_latency(brokers: &str, rate: u64, secs: u64, poll_ms: Option<u64>) -> Res<(i64, i64, f64)> {
    use tokio::io::AsyncBufReadExt;
    let (ferry, url) = fresh().await?;
    let admin = sqlx::PgPool::connect(&admin_url()).await?;
    let slot = slot_name();
    let schema = slot_before_rows(&admin, &ferry, &slot).await?;
    let mut cmd = debezium_command(brokers, &schema, &slot, "latency");
    if let Some(ms) = poll_ms {
        cmd.env("BENCH_POLL_INTERVAL_MS", ms.to_string());
    }
    let mut child = cmd.spawn()?;
    let mut lines = tokio::io::BufReader::new(child.stdout.take().ok_or("no stdout")?).lines();
    while let Some(l) = lines.next_line().await? {
        if l == "ready" {
            break;
        }
    }
    let writers = Ferry::builder(&url).max_connections(WRITERS as u32).connect().await?;
    let mark = |key: &str| OutboxMessage::bytes("bench", "bench-latency", key, vec![0u8; 100]);
    steady(&writers, rate, Duration::from_secs(3)).await?;
    writers.enqueue(&mark("__warm")).await?;
    let (sent, took, _) = steady(&writers, rate, Duration::from_secs(secs)).await?;
    writers.enqueue(&mark("__end")).await?;
    let mut q = (None, None);
    while let Some(l) = lines.next_line().await? {
        if let Some(v) = l.strip_prefix("p50 ") {
            q.0 = v.trim().parse().ok();
        }
        if let Some(v) = l.strip_prefix("p99 ") {
            q.1 = v.trim().parse().ok();
        }
    }
    let status = child.wait().await?;
    drop_bench_slots(&slot).await?;
    match q {
        (Some(p50), Some(p99)) => Ok((p50, p99, sent as f64 / took)),
        _ => Err(format!("Debezium ({status}) printed no latency").into()),
    }
}
