//! Relay benchmarks against PostgreSQL and Apache Kafka (a single-node KRaft
//! broker started by `ferry-testkit`), each beside a raw rdkafka produce of
//! the same records to the same broker, measured in the same run:
//! drain throughput with 1 and 2 relays at 100 B and 1 KiB (marking
//! delivered, deleting on delivery, and `--exactly-once`), commit-to-ack
//! latency at a steady 1k rows/s, and a large pending backlog.
//!
//!     scripts/install-kafka && cargo run --release -p ferry-relay --example bench_relay -- [--quick]
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
    let quick = std::env::args().any(|a| a == "--quick");
    let n: usize = if quick { 20_000 } else { 100_000 };
    let broker = ferry_testkit::Kafka::start();
    let brokers = broker.brokers();
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
