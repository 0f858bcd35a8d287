//! Debezium 3.6.1 and `ferry-relay --debezium-config` side by side on one
//! table in Debezium's outbox layout (`relay/tests/debezium/tables.sql`,
//! the connector file `outbox_event.properties`: the EventRouter's
//! defaults, the JSON payload expanded, four columns as headers): the same
//! backlog of rows, committed after both slots were made, drained by each
//! to a broker of its own (a single-node KRaft broker from `ferry-testkit`),
//! one after the other; then every record of both is read back and
//! compared, topic, partition, key, value and headers, byte for byte (the
//! connector's per-start run id header aside).
//!
//!     scripts/install-kafka && cargo run --release -p ferry-relay --example bench_debezium -- [rows]
//!
//! Then the latency from commit to a consumer's receipt (the same consumer
//! for both) at a steady 1,000 rows/s, 100 commits of 10 rows a second, for
//! 10 s after a 3 s warm-up, each side on a slot of its own, one after the
//! other.
//!
//! Debezium runs embedded with the EventRouter and the file's converters,
//! producing as Kafka Connect's worker does (`bench/debezium`'s
//! `EventRouterGolden` with `BENCH_BROKERS`; `mvn` builds it). Each side's
//! rate is rows acknowledged per second from its first acknowledgement to
//! its last (each one's start, a JVM and an engine or a slot's connection,
//! left out).
#![allow(clippy::print_stdout, missing_docs)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ferry::{Engine, Ferry};
use ferry_relay::{Capture, Relay, RelayConfig};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::ClientConfig;
use tokio_util::sync::CancellationToken;

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const TOPIC: &str = "outbox.event.Order";
const PARTITIONS: i32 = 6;
/// Rows per writer transaction.
const PER_COMMIT: usize = 500;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/debezium")
}

fn bench_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/debezium")
}

fn admin_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// Debezium's side (`EventRouterGolden` with `BENCH_BROKERS`): `records`
/// rows of `slot`, through the connector file's router and converters, to
/// `brokers`.
fn debezium(connector: &Path, records: usize, slot: &str, brokers: &str) -> std::process::Command {
    let mut c = std::process::Command::new("java");
    c.arg("-Xmx1g")
        .arg("-cp")
        .arg(format!(
            "{}:{}/*",
            bench_dir().join("target/debezium-outbox-bench-1.jar").display(),
            bench_dir().join("target/lib").display()
        ))
        .arg("ferry.bench.EventRouterGolden")
        .arg(connector)
        .arg(records.to_string())
        .arg("-")
        .env("BENCH_DATABASE_URL", admin_url())
        .env("BENCH_SLOT", slot)
        .env("BENCH_BROKERS", brokers);
    c
}

type Running = tokio::task::JoinHandle<Result<(), ferry_relay::RelayError>>;

/// `ferry-relay --debezium-config` in this process on `slot`: its state,
/// the token that stops it, and its task.
async fn start_relay(
    url: &str,
    ferry: &Ferry,
    brokers: &str,
    slot: &str,
    connector: &Path,
) -> Res<(
    std::sync::Arc<ferry_relay::state::RelayState>,
    CancellationToken,
    Running,
)> {
    let mut cfg = RelayConfig::new(url, brokers);
    cfg.capture = Some(Capture::Wal);
    cfg.slot = Some(slot.to_owned());
    cfg.publication = Some(slot.to_owned());
    cfg.debezium_config = Some(connector.to_owned());
    let relay = Relay::new(cfg, ferry.clone())?;
    let state = relay.state();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let stop = CancellationToken::new();
    let s = stop.clone();
    let handle = tokio::spawn(relay.run(listener, async move { s.cancelled().await }));
    Ok((state, stop, handle))
}

/// A record as read back: topic, partition, key, value, headers.
type Rec = (
    String,
    i32,
    Option<Vec<u8>>,
    Option<Vec<u8>>,
    Vec<(String, Option<Vec<u8>>)>,
);

#[tokio::main]
async fn main() -> Res<()> {
    let n: usize = std::env::args().nth(1).map_or(Ok(100_000), |a| a.parse())?;
    let url = ferry_testkit::fresh_database_url(Engine::Postgres).await?;
    let ferry = Ferry::builder(&url).migrate(true).connect().await?;
    let pool = ferry.db().as_postgres().ok_or("PostgreSQL")?.clone();
    sqlx::raw_sql(&std::fs::read_to_string(fixtures().join("tables.sql"))?)
        .execute(&pool)
        .await?;
    let schema: String = sqlx::query_scalar("SELECT current_schema()::text")
        .fetch_one(&pool)
        .await?;
    let connector = std::env::temp_dir().join(format!("{schema}-outbox_event.properties"));
    std::fs::write(
        &connector,
        std::fs::read_to_string(fixtures().join("outbox_event.properties"))?
            .replace("inventory.", &format!("{schema}.")),
    )?;
    let (dbz_slot, ferry_slot) = (
        format!("bench_dbz_{}", std::process::id()),
        format!("bench_fr_{}", std::process::id()),
    );
    for slot in [&dbz_slot, &ferry_slot] {
        sqlx::query(&format!(
            "CREATE PUBLICATION {slot} FOR TABLE outbox_event WITH (publish = 'insert')"
        ))
        .execute(&pool)
        .await?;
        sqlx::query("SELECT 1 FROM pg_create_logical_replication_slot($1, 'pgoutput')")
            .bind(slot)
            .execute(&pool)
            .await?;
    }
    let result = run(n, &url, &ferry, &pool, &connector, &dbz_slot, &ferry_slot).await;
    for slot in [&dbz_slot, &ferry_slot] {
        let _ = sqlx::query("SELECT pg_drop_replication_slot($1)")
            .bind(slot)
            .execute(&pool)
            .await;
        let _ = sqlx::query(&format!("DROP PUBLICATION IF EXISTS {slot}"))
            .execute(&pool)
            .await;
    }
    result
}

async fn run(
    n: usize,
    url: &str,
    ferry: &Ferry,
    pool: &sqlx::PgPool,
    connector: &Path,
    dbz_slot: &str,
    ferry_slot: &str,
) -> Res<()> {
    let seeded = Instant::now();
    let mut i = 0;
    while i < n {
        let to = (i + PER_COMMIT).min(n);
        sqlx::query(
            "INSERT INTO outbox_event (id, aggregatetype, aggregateid, type, payload, tenant, version, occurred_at)
             SELECT gen_random_uuid(), 'Order', 'o-' || (g % 1000), 'OrderCreated',
                    jsonb_build_object('order', g, 'lines', jsonb_build_array(1, 2, 3), 'total', g * 1.5,
                                       'customer', jsonb_build_object('name', 'c' || (g % 97), 'vip', g % 2 = 0)),
                    'acme', 1, clock_timestamp()
             FROM generate_series($1::bigint, $2::bigint) g",
        )
        .bind(i as i64 + 1)
        .bind(to as i64)
        .execute(pool)
        .await?;
        i = to;
    }
    println!(
        "{n} rows committed in transactions of {PER_COMMIT} ({:.1} s)",
        seeded.elapsed().as_secs_f64()
    );

    // Debezium: its own broker, its own slot.
    let dbz_broker = ferry_testkit::Kafka::start();
    dbz_broker.create_topic(TOPIC, PARTITIONS);
    dbz_broker.create_topic(LATENCY_TOPIC, PARTITIONS);
    let mvn = std::process::Command::new("mvn")
        .args(["-q", "-B", "-f"])
        .arg(bench_dir().join("pom.xml"))
        .arg("package")
        .stdout(std::process::Stdio::null())
        .status()?;
    if !mvn.success() {
        return Err("mvn package of bench/debezium failed".into());
    }
    let out = debezium(connector, n, dbz_slot, &dbz_broker.brokers())
        .stderr(std::process::Stdio::null())
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let dbz_rate: f64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("rows/s "))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| format!("Debezium ({}) printed no rate: {stdout}", out.status))?;

    // ferry-relay: its own broker, its own slot, in this process.
    let ferry_broker = ferry_testkit::Kafka::start();
    ferry_broker.create_topic(TOPIC, PARTITIONS);
    ferry_broker.create_topic(LATENCY_TOPIC, PARTITIONS);
    let (state, stop, handle) = start_relay(url, ferry, &ferry_broker.brokers(), ferry_slot, connector).await?;
    let acked = || {
        state
            .metrics
            .timings
            .wal_acked
            .load(std::sync::atomic::Ordering::Relaxed) as usize
    };
    let begun = Instant::now();
    while acked() == 0 {
        if begun.elapsed() > Duration::from_secs(120) {
            return Err("ferry-relay acknowledged nothing in 120 s".into());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let started = Instant::now();
    while acked() < n {
        if started.elapsed() > Duration::from_secs(600) {
            return Err(format!("ferry-relay acknowledged {} of {n} in 600 s", acked()).into());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let ferry_rate = (n - 1) as f64 / started.elapsed().as_secs_f64();
    stop.cancel();
    handle.await??;

    println!("drain of {n} rows (expanded JSON, 4 header columns), rows/s:");
    println!("  ferry-relay --debezium-config  {ferry_rate:>9.0}");
    println!(
        "  Debezium 3.6.1 embedded        {dbz_rate:>9.0}  ({:.2}x)",
        ferry_rate / dbz_rate
    );

    let theirs = read_all(&dbz_broker.brokers(), n)?;
    let ours = read_all(&ferry_broker.brokers(), n)?;
    let same = theirs == ours;
    let count = ours.values().map(Vec::len).sum::<usize>();
    println!(
        "records compared byte for byte (topic, partition, key, value, headers): {} of {n} ferry, {} Debezium, {}",
        count,
        theirs.values().map(Vec::len).sum::<usize>(),
        if same { "identical" } else { "DIFFERENT" }
    );
    if !same {
        return Err("the records differ".into());
    }

    let ours = latency(Side::Ferry, url, ferry, pool, connector, &ferry_broker).await?;
    let theirs = latency(Side::Debezium, url, ferry, pool, connector, &dbz_broker).await?;
    println!("commit -> consumer at 1,000 rows/s for 10 s, ms (p50 / p99):");
    println!("  ferry-relay --debezium-config  {:>6.1} / {:>6.1}", ours.0, ours.1);
    println!(
        "  Debezium 3.6.1 embedded        {:>6.1} / {:>6.1}  (its default poll.interval.ms, 500)",
        theirs.0, theirs.1
    );
    Ok(())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Ferry,
    Debezium,
}

const LATENCY_TOPIC: &str = "outbox.event.Lat";

/// p50 and p99 (ms) from commit to receipt by a consumer of `broker`, with
/// `side` streaming a slot made for it.
async fn latency(
    side: Side,
    url: &str,
    ferry: &Ferry,
    pool: &sqlx::PgPool,
    connector: &Path,
    broker: &ferry_testkit::Kafka,
) -> Res<(f64, f64)> {
    let who = if side == Side::Ferry { "fr" } else { "dbz" };
    let slot = format!("bench_lat_{who}_{}", std::process::id());
    sqlx::query(&format!(
        "CREATE PUBLICATION {slot} FOR TABLE outbox_event WITH (publish = 'insert')"
    ))
    .execute(pool)
    .await?;
    sqlx::query("SELECT 1 FROM pg_create_logical_replication_slot($1, 'pgoutput')")
        .bind(&slot)
        .execute(pool)
        .await?;
    let result = measure(side, url, ferry, pool, connector, broker, &slot).await;
    let _ = sqlx::query(
        "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1 AND active_pid IS NOT NULL",
    )
    .bind(&slot)
    .execute(pool)
    .await;
    for _ in 0..100 {
        if sqlx::query("SELECT pg_drop_replication_slot($1)")
            .bind(&slot)
            .execute(pool)
            .await
            .is_ok()
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = sqlx::query(&format!("DROP PUBLICATION IF EXISTS {slot}"))
        .execute(pool)
        .await;
    result
}

async fn measure(
    side: Side,
    url: &str,
    ferry: &Ferry,
    pool: &sqlx::PgPool,
    connector: &Path,
    broker: &ferry_testkit::Kafka,
    slot: &str,
) -> Res<(f64, f64)> {
    // The side streaming.
    let mut java = None;
    let mut relay = None;
    match side {
        Side::Debezium => {
            java = Some(
                debezium(connector, i32::MAX as usize, slot, &broker.brokers())
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .spawn()?,
            );
        }
        Side::Ferry => {
            let (_, stop, handle) = start_relay(url, ferry, &broker.brokers(), slot, connector).await?;
            relay = Some((stop, handle));
        }
    }
    let begun = Instant::now();
    loop {
        let active: bool = sqlx::query_scalar("SELECT active FROM pg_replication_slots WHERE slot_name = $1")
            .bind(slot)
            .fetch_one(pool)
            .await?;
        if active {
            break;
        }
        if begun.elapsed() > Duration::from_secs(120) {
            return Err(format!("{side:?} did not stream from {slot} in 120 s").into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The consumer, on a thread of its own.
    let brokers = broker.brokers();
    let reader = std::thread::spawn(move || -> Res<Vec<i64>> {
        let c: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("group.id", format!("lat-{}", uuid::Uuid::now_v7().simple()))
            .set("auto.offset.reset", "earliest")
            .set("enable.auto.commit", "false")
            .set("fetch.wait.max.ms", "10")
            .create()?;
        c.subscribe(&[LATENCY_TOPIC])?;
        let mut samples = Vec::new();
        let start = Instant::now();
        loop {
            if start.elapsed() > Duration::from_secs(180) {
                return Err("the latency run's end never arrived".into());
            }
            let Some(m) = c.poll(Duration::from_millis(100)) else {
                continue;
            };
            let m = m?;
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)?
                .as_micros() as i64;
            let v: serde_json::Value = serde_json::from_slice(m.payload().unwrap_or_default())?;
            if v["end"].as_bool() == Some(true) {
                return Ok(samples);
            }
            if v["warm"].as_bool() == Some(false) {
                samples.push(now - v["t"].as_i64().unwrap_or(now));
            }
        }
    });
    let write = |warm: bool, end: bool| {
        sqlx::query(
            "INSERT INTO outbox_event (id, aggregatetype, aggregateid, type, payload, tenant, version, occurred_at)
             SELECT gen_random_uuid(), 'Lat', 'l-' || g, 'Tick',
                    jsonb_build_object('t', (extract(epoch FROM clock_timestamp()) * 1000000)::bigint,
                                       'warm', $1::boolean, 'end', $2::boolean),
                    'acme', 1, clock_timestamp()
             FROM generate_series(1, $3::int) g",
        )
        .bind(warm)
        .bind(end)
        .bind(if end { 1 } else { 10 })
        .execute(pool)
    };
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    for i in 0..1_300 {
        tick.tick().await;
        write(i < 300, false).await?;
    }
    write(false, true).await?;
    let mut samples = tokio::task::spawn_blocking(move || reader.join())
        .await?
        .map_err(|_| "the consumer thread panicked")??;
    if let Some(mut j) = java {
        let _ = j.kill();
        let _ = j.wait();
    }
    if let Some((stop, handle)) = relay {
        stop.cancel();
        handle.await??;
    }
    if samples.is_empty() {
        return Err("no latency samples".into());
    }
    samples.sort_unstable();
    let q = |p: f64| samples[((samples.len() as f64 * p) as usize).min(samples.len() - 1)] as f64 / 1000.0;
    Ok((q(0.5), q(0.99)))
}

/// Every record of the topic per partition, in offset order (the run id
/// header blanked), reading until `n` arrived.
fn read_all(brokers: &str, n: usize) -> Res<BTreeMap<i32, Vec<Rec>>> {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("bench-{}", uuid::Uuid::now_v7().simple()))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .create()?;
    c.subscribe(&[TOPIC])?;
    let mut out: BTreeMap<i32, Vec<Rec>> = BTreeMap::new();
    let mut got = 0;
    let start = Instant::now();
    while got < n {
        if start.elapsed() > Duration::from_secs(300) {
            return Err(format!("read {got} of {n} records").into());
        }
        let Some(m) = c.poll(Duration::from_millis(100)) else {
            continue;
        };
        let m = m?;
        let headers = m
            .headers()
            .map(|h| {
                h.iter()
                    .map(|h| {
                        let v = (h.key != "__debezium.context.runId")
                            .then(|| h.value.map(<[u8]>::to_vec))
                            .flatten();
                        (h.key.to_owned(), v)
                    })
                    .collect()
            })
            .unwrap_or_default();
        out.entry(m.partition()).or_default().push((
            m.topic().to_owned(),
            m.partition(),
            m.key().map(<[u8]>::to_vec),
            m.payload().map(<[u8]>::to_vec),
            headers,
        ));
        got += 1;
    }
    Ok(out)
}
