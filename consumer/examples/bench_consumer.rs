//! Consumer benchmark against PostgreSQL and Apache Kafka (ferry-testkit):
//! effects per second through `ferry-consumer` (ledger, partition lease,
//! offset stored with the effect) with 1 and 3 members, beside a raw loop in
//! the same run that consumes the same records and writes the same effect
//! with no ledger and no lease.
//!
//!     scripts/install-kafka && cargo run --release -p ferry-consumer --example bench_consumer -- [--quick] [--micro-batch N]
#![allow(clippy::print_stdout, missing_docs)]

use std::time::{Duration, Instant};

use ferry::{Engine, Ferry};
use ferry_consumer::{Consumer, Handler, HandlerError, Record};
use futures::future::BoxFuture;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::message::{Header, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const EFFECT: &str =
    "INSERT INTO bench_effects (k, n) VALUES ($1, 1) ON CONFLICT (k) DO UPDATE SET n = bench_effects.n + 1";

struct Apply;
impl Handler for Apply {
    fn handle<'a>(&'a self, r: &'a Record, tx: &'a mut ferry::Tx) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            let key = String::from_utf8_lossy(r.key.as_deref().unwrap_or_default()).into_owned();
            tx.execute(EFFECT, &[ferry::store::Arg::from(&key)]).await?;
            Ok(())
        })
    }
}

#[tokio::main]
async fn main() -> Res<()> {
    let _telemetry = ferry::telemetry::init("bench_consumer", "warn");
    let n: usize = if std::env::args().any(|a| a == "--quick") {
        5_000
    } else {
        30_000
    };
    let broker = ferry_testkit::Kafka::start();
    let brokers = broker.brokers();
    broker.create_topic("bench", 6);
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("linger.ms", "5")
        .create()?;
    let mut acks = Vec::with_capacity(n);
    for i in 0..n {
        let id = i.to_string();
        let key = format!("k{}", i % 1000);
        let h = OwnedHeaders::new().insert(Header {
            key: "ferry-outbox-id",
            value: Some(&id),
        });
        acks.push(
            producer
                .send_result(FutureRecord::to("bench").key(&key).payload("{}").headers(h))
                .map_err(|(e, _)| e)?,
        );
    }
    for a in acks {
        a.await?.map_err(|(e, _)| e)?;
    }
    println!("ferry-consumer benchmark (PostgreSQL, Apache Kafka, {n} records, 6 partitions)\n");
    println!("{:<40} {:>14} {:>14}", "measure", "ferry-consumer", "raw loop");
    let raw = raw_loop(&brokers, n).await?;
    for members in [1usize, 3] {
        let rate = ferry_members(&brokers, n, members).await?;
        println!(
            "{:<40} {rate:>14.0} {raw:>14.0}",
            format!("effects/s, {members} member(s)")
        );
    }
    Ok(())
}

async fn fresh() -> Res<Ferry> {
    let url = ferry_testkit::fresh_database_url(Engine::Postgres).await?;
    let ferry = Ferry::builder(&url).migrate(true).connect().await?;
    sqlx::query("CREATE TABLE bench_effects (k TEXT PRIMARY KEY, n BIGINT NOT NULL)")
        .execute(ferry.db().as_postgres().ok_or("pg")?)
        .await?;
    Ok(ferry)
}

/// Consume and write the effect, autocommit, no ledger, no lease.
async fn raw_loop(brokers: &str, n: usize) -> Res<f64> {
    let ferry = fresh().await?;
    let pool = ferry.db().as_postgres().ok_or("pg")?.clone();
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("raw-{}", uuid::Uuid::now_v7().simple()))
        .set("auto.offset.reset", "earliest")
        .create()?;
    c.subscribe(&["bench"])?;
    let mut done = 0;
    let mut start = None;
    while done < n {
        let m = tokio::task::block_in_place(|| {
            c.poll(Duration::from_millis(100))
                .map(|m| m.map(|m| m.key().map(<[u8]>::to_vec)))
        });
        if let Some(Ok(key)) = m {
            start.get_or_insert_with(Instant::now);
            sqlx::query(EFFECT)
                .bind(String::from_utf8_lossy(&key.unwrap_or_default()).into_owned())
                .execute(&pool)
                .await?;
            done += 1;
        }
    }
    Ok(n as f64 / start.map(|s| s.elapsed().as_secs_f64()).unwrap_or(1.0))
}

async fn ferry_members(brokers: &str, n: usize, members: usize) -> Res<f64> {
    let ferry = fresh().await?;
    let group = format!("bench-{}", uuid::Uuid::now_v7().simple());
    let stop = tokio_util::sync::CancellationToken::new();
    let mut metrics = Vec::new();
    let mut running = Vec::new();
    let start = Instant::now();
    for _ in 0..members {
        let c = Consumer::builder(ferry.clone(), brokers, &group, &["bench"])
            .handler(Apply)
            .kafka("session.timeout.ms", "6000")
            .micro_batch(micro_batch())
            .build()?;
        metrics.push(c.metrics());
        let s = stop.clone();
        running.push(tokio::spawn(c.run(async move { s.cancelled().await })));
    }
    let mut last = Instant::now();
    while metrics
        .iter()
        .map(|m| m.processed.get() + m.duplicates.get())
        .sum::<u64>()
        < n as u64
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
        if std::env::var("BENCH_DEBUG").is_ok() && last.elapsed() > Duration::from_secs(2) {
            last = Instant::now();
            eprintln!("{:?}", metrics.iter().map(|m| m.processed.get()).collect::<Vec<_>>());
            let rows: Vec<(i32, Option<i64>, Option<String>, i64)> = sqlx::query_as(
                "SELECT partition, next_offset, owner, generation FROM consumer_partitions WHERE group_id = $1 ORDER BY partition",
            )
            .bind(&group)
            .fetch_all(ferry.db().as_postgres().ok_or("pg")?)
            .await?;
            eprintln!("  {rows:?}");
        }
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    stop.cancel();
    for r in running {
        r.await??;
    }
    Ok(rate)
}

/// `--micro-batch N`, else the library's default.
fn micro_batch() -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == "--micro-batch")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(ferry_consumer::DEFAULT_MICRO_BATCH)
}
