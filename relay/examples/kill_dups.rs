//! Duplicates per SIGKILL, at least once, in both captures in one run:
//! for `--capture poll` and then `--capture wal` (a fresh schema and topic
//! each, one broker), a 20,000-row backlog, then rows written at a steady
//! 400/s while a `ferry-relay run` process (default batch size) is
//! SIGKILLed and restarted every 3 s, five times; then the backlog drains
//! and every record on the topic is counted. Prints lost rows (must be 0)
//! and duplicates per kill for each. Pass another relay binary to compare
//! builds:
//!
//!     scripts/install-kafka && cargo run --release -p ferry-relay --example kill_dups -- [path/to/ferry-relay]
#![allow(clippy::print_stdout, missing_docs)]

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ferry::{Engine, Ferry, OutboxMessage};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::ClientConfig;

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

fn relay(bin: &str, url: &str, brokers: &str, capture: &[&str]) -> Res<Child> {
    Ok(Command::new(bin)
        .args(["run", "--database-url", url, "--brokers", brokers, "--lease", "2s"])
        .args(["--poll-interval", "50ms", "--listen", "127.0.0.1:0"])
        .args(capture)
        .env("RUST_LOG", "off")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?)
}

#[tokio::main]
async fn main() -> Res<()> {
    // Default: the ferry-relay binary of the same build (target/<profile>/).
    let bin = match std::env::args().nth(1) {
        Some(b) => b,
        None => {
            let exe = std::env::current_exe()?;
            let dir = exe.parent().and_then(|d| d.parent()).ok_or("no target dir")?;
            dir.join("ferry-relay").display().to_string()
        }
    };
    let broker = ferry_testkit::Kafka::start();
    println!("relay {bin}");
    let slot = format!("ferry_kill_dups_{}", std::process::id());
    for (name, capture) in [
        ("poll", vec!["--capture", "poll"]),
        ("wal", vec!["--capture", "wal", "--slot", &slot, "--publication", &slot]),
    ] {
        let ran = kills(&bin, &broker, name, &capture).await;
        if name == "wal" {
            let admin = sqlx::PgPool::connect(&ferry_testkit::postgres_url()).await?;
            sqlx::query("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1")
                .bind(&slot)
                .execute(&admin)
                .await?;
            sqlx::query(&format!("DROP PUBLICATION IF EXISTS {slot}"))
                .execute(&admin)
                .await?;
        }
        ran?;
    }
    Ok(())
}

/// One capture's run on a fresh schema and topic `orders-<name>`.
async fn kills(bin: &str, broker: &ferry_testkit::Kafka, name: &str, capture: &[&str]) -> Res<()> {
    let topic = format!("orders-{name}");
    broker.create_topic(&topic, 6);
    let url = ferry_testkit::fresh_database_url(Engine::Postgres).await?;
    let ferry = Ferry::builder(&url).migrate(true).connect().await?;
    // A backlog first, so every restarted relay has full batches in flight
    // when it is killed; then a steady 400 rows/s.
    let backlog = 20_000usize;
    for i in 0..backlog {
        let msg = OutboxMessage::json("acme", &topic, format!("k{}", i % 50), &serde_json::json!({ "b": i }))?;
        ferry.enqueue(&msg).await?;
    }
    let steady = 6000usize;
    let rows = backlog + steady;
    let writer = {
        let (ferry, topic) = (ferry.clone(), topic.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_micros(2500));
            for i in 0..steady {
                tick.tick().await;
                let msg = OutboxMessage::json("acme", &topic, format!("k{}", i % 50), &serde_json::json!({ "i": i }))?;
                ferry.enqueue(&msg).await?;
            }
            Ok::<_, ferry::Error>(())
        })
    };
    let kills = 5;
    for _ in 0..kills {
        let mut child = relay(bin, &url, &broker.brokers(), capture)?;
        tokio::time::sleep(Duration::from_secs(3)).await;
        child.kill()?;
        child.wait()?;
    }
    writer.await??;
    let mut child = relay(bin, &url, &broker.brokers(), capture)?;
    let pool = ferry.db().as_postgres().ok_or("PostgreSQL only")?;
    let started = Instant::now();
    loop {
        let left: i64 = sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {} WHERE state = 'pending'",
            ferry_testkit::OUTBOX
        ))
        .fetch_one(pool)
        .await?;
        if left == 0 {
            break;
        }
        if started.elapsed() > Duration::from_secs(120) {
            return Err(format!("{left} rows still pending after 120 s").into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
    child.wait()?;
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", broker.brokers())
        .set("group.id", format!("kill-dups-{name}"))
        .set("auto.offset.reset", "earliest")
        .set("enable.partition.eof", "true")
        .create()?;
    let mut tpl = rdkafka::TopicPartitionList::new();
    for p in 0..6 {
        tpl.add_partition_offset(&topic, p, rdkafka::Offset::Beginning)?;
    }
    c.assign(&tpl)?;
    let mut count: HashMap<i64, usize> = HashMap::new();
    let mut eof = 0;
    while eof < 6 {
        match c.poll(Duration::from_secs(10)) {
            Some(Ok(m)) => {
                let id = m
                    .headers()
                    .and_then(|h| h.iter().find(|h| h.key == "ferry-outbox-id").and_then(|h| h.value))
                    .map(|v| String::from_utf8_lossy(v).parse::<i64>())
                    .ok_or("record without ferry-outbox-id")??;
                *count.entry(id).or_default() += 1;
            }
            Some(Err(rdkafka::error::KafkaError::PartitionEOF(_))) => eof += 1,
            Some(Err(e)) => return Err(e.into()),
            None => return Err("the topic did not reach its end".into()),
        }
    }
    let total: usize = count.values().sum();
    let dups = total - count.len();
    println!(
        "--capture {name}: {rows} rows ({backlog} backlog, then 400/s), {kills} SIGKILLs every 3 s: lost {}, duplicates {dups} ({} per kill)",
        rows - count.len(),
        dups / kills
    );
    Ok(())
}
