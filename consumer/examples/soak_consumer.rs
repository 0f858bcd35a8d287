//! Consumer-group soak against Apache Kafka and PostgreSQL (not part of the
//! test command): three `ferry-projection` member processes, one SIGKILLed and
//! restarted every 2–5 s for a while, as records flow into the topic. A run
//! passes when, within the convergence limit after the last kill, every
//! record's effect is applied exactly once (checked in the database) and the
//! offsets stored with the effects and the group's Kafka committed offsets
//! reach the log end of every partition.
//!
//!     cargo build --release -p ferry-consumer --bins --examples
//!     target/release/examples/soak_consumer [--runs 5] [--strategy eager|cooperative|both]
//!         [--records 100000] [--kills-for 60] [--converge 30] [--partitions 6]
#![allow(clippy::print_stdout, clippy::print_stderr, missing_docs)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ferry::{Engine, Ferry};
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::ClientConfig;

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

struct Args {
    runs: usize,
    strategies: Vec<&'static str>,
    records: usize,
    kills_for: Duration,
    converge: Duration,
    partitions: i32,
}

fn args() -> Args {
    let mut a = Args {
        runs: 5,
        strategies: vec!["eager", "cooperative"],
        records: 100_000,
        kills_for: Duration::from_secs(60),
        converge: Duration::from_secs(30),
        partitions: 6,
    };
    let v: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i + 1 < v.len() {
        let val = v[i + 1].as_str();
        match v[i].as_str() {
            "--runs" => a.runs = val.parse().expect("--runs"),
            "--strategy" => {
                a.strategies = match val {
                    "eager" => vec!["eager"],
                    "cooperative" => vec!["cooperative"],
                    _ => vec!["eager", "cooperative"],
                }
            }
            "--records" => a.records = val.parse().expect("--records"),
            "--kills-for" => a.kills_for = Duration::from_secs(val.parse().expect("--kills-for")),
            "--converge" => a.converge = Duration::from_secs(val.parse().expect("--converge")),
            "--partitions" => a.partitions = val.parse().expect("--partitions"),
            other => panic!("unknown flag {other}"),
        }
        i += 2;
    }
    a
}

/// xorshift64*, seeded from the clock: kill timing and victims.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

struct Member(Child);
impl Drop for Member {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn projection_bin() -> Res<PathBuf> {
    let exe = std::env::current_exe()?;
    // target/<profile>/examples/soak_consumer -> target/<profile>/ferry-projection
    let bin = exe
        .parent()
        .and_then(|p| p.parent())
        .ok_or("no target dir")?
        .join("ferry-projection");
    if !bin.exists() {
        return Err(format!(
            "{} missing: cargo build -p ferry-consumer --bins --examples (same profile)",
            bin.display()
        )
        .into());
    }
    Ok(bin)
}

fn spawn(bin: &PathBuf, url: &str, brokers: &str, group: &str, strategy: &str, log: &std::path::Path) -> Res<Member> {
    let log = std::fs::OpenOptions::new().create(true).append(true).open(log)?;
    Ok(Member(
        Command::new(bin)
            .env("DATABASE_URL", url)
            .env("FERRY_BROKERS", brokers)
            .env("FERRY_GROUP", group)
            .env("FERRY_TOPICS", "soak")
            .env("FERRY_ASSIGNMENT", strategy)
            .env(
                "RUST_LOG",
                std::env::var("SOAK_MEMBER_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()?,
    ))
}

struct Outcome {
    pass: bool,
    converge: Option<Duration>,
    kills: usize,
    detail: String,
}

#[tokio::main]
async fn main() -> Res<()> {
    let a = args();
    let bin = projection_bin()?;
    println!(
        "soak: 3 ferry-projection members, {} records, one SIGKILLed every 2–5 s for {:?}, convergence limit {:?}",
        a.records, a.kills_for, a.converge
    );
    println!(
        "{:<4} {:<12} {:<5} {:>6} {:>12}  detail",
        "run", "strategy", "pass", "kills", "converge_s"
    );
    let mut n = 0;
    let mut failed = 0;
    for strategy in &a.strategies {
        for _ in 0..a.runs {
            n += 1;
            let o = run(&a, &bin, strategy, n).await?;
            if !o.pass {
                failed += 1;
            }
            println!(
                "{:<4} {:<12} {:<5} {:>6} {:>12}  {}",
                n,
                strategy,
                if o.pass { "PASS" } else { "FAIL" },
                o.kills,
                o.converge
                    .map(|d| format!("{:.1}", d.as_secs_f64()))
                    .unwrap_or_else(|| "-".into()),
                o.detail
            );
        }
    }
    println!("{} run(s), {} failed", n, failed);
    if failed > 0 {
        std::process::exit(1);
    }
    Ok(())
}

async fn run(a: &Args, bin: &PathBuf, strategy: &str, n: usize) -> Res<Outcome> {
    let broker = ferry_testkit::Kafka::start();
    let brokers = broker.brokers();
    broker.create_topic("soak", a.partitions);
    let url = ferry_testkit::fresh_database_url(Engine::Postgres).await?;
    let ferry = Ferry::builder(&url).migrate(true).connect().await?;
    let group = format!("soak-{n}");
    let log = std::env::temp_dir().join(format!("ferry-soak-{}-{n}.log", std::process::id()));
    let _ = std::fs::remove_file(&log);
    let mut members: Vec<Member> = (0..3)
        .map(|_| spawn(bin, &url, &brokers, &group, strategy, &log))
        .collect::<Res<_>>()?;
    // Records flow during the kills: produced evenly over 80% of the window.
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "5")
        .create()?;
    let records = a.records;
    let pace = a.kills_for.mul_f64(0.8);
    let produced = tokio::spawn(async move {
        let start = Instant::now();
        let chunk = 500;
        let mut i = 0;
        while i < records {
            let mut acks = Vec::with_capacity(chunk);
            for j in i..(i + chunk).min(records) {
                let id = j.to_string();
                let key = format!("k{}", j % 100);
                let h = OwnedHeaders::new().insert(Header {
                    key: "ferry-outbox-id",
                    value: Some(&id),
                });
                acks.push(
                    producer
                        .send_result(FutureRecord::to("soak").key(&key).payload("{}").headers(h))
                        .map_err(|(e, _)| e.to_string())?,
                );
            }
            for ack in acks {
                ack.await.map_err(|e| e.to_string())?.map_err(|(e, _)| e.to_string())?;
            }
            i += chunk;
            let due = pace.mul_f64(i as f64 / records as f64);
            if let Some(wait) = due.checked_sub(start.elapsed()) {
                tokio::time::sleep(wait).await;
            }
        }
        Ok::<(), String>(())
    });
    let mut rng = Rng(std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos() as u64
        | 1);
    let start = Instant::now();
    let mut kills = 0;
    loop {
        let wait = Duration::from_millis(2000 + rng.below(3001));
        if start.elapsed() + wait > a.kills_for {
            break;
        }
        tokio::time::sleep(wait).await;
        let victim = rng.below(3) as usize;
        // SIGKILL (Child::kill), then a new member in its place.
        drop(members.remove(victim));
        kills += 1;
        members.push(spawn(bin, &url, &brokers, &group, strategy, &log)?);
    }
    let last_kill = Instant::now();
    produced.await?.map_err(|e| format!("produce: {e}"))?;
    let probe: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("group.id", &group)
        .set("enable.auto.commit", "false")
        .create()?;
    let mut high: HashMap<i32, i64> = HashMap::new();
    for p in 0..a.partitions {
        let (_, h) = tokio::task::block_in_place(|| probe.fetch_watermarks("soak", p, Duration::from_secs(10)))?;
        high.insert(p, h);
    }
    let total: i64 = high.values().sum();
    let pg = ferry.db().as_postgres().ok_or("pg")?.clone();
    let mut state = String::new();
    let converged = loop {
        let elapsed = last_kill.elapsed();
        let (count, max_applied): (i64, Option<i64>) =
            sqlx::query_as("SELECT count(*), max(applied) FROM ferry_projection_applied")
                .fetch_one(&pg)
                .await
                .unwrap_or((0, None));
        let stored: Vec<(i32, Option<i64>)> =
            sqlx::query_as("SELECT partition, next_offset FROM consumer_partitions WHERE group_id = $1")
                .bind(&group)
                .fetch_all(&pg)
                .await
                .unwrap_or_default();
        let stored: HashMap<i32, i64> = stored.into_iter().filter_map(|(p, o)| Some((p, o?))).collect();
        let mut tpl = TopicPartitionList::new();
        for p in 0..a.partitions {
            tpl.add_partition("soak", p);
        }
        let committed: HashMap<i32, i64> =
            tokio::task::block_in_place(|| probe.committed_offsets(tpl, Duration::from_secs(5)))
                .map(|t| {
                    t.elements()
                        .iter()
                        .filter_map(|e| match e.offset() {
                            Offset::Offset(o) => Some((e.partition(), o)),
                            _ => None,
                        })
                        .collect()
                })
                .unwrap_or_default();
        let stored_done = high.iter().all(|(p, h)| stored.get(p) == Some(h));
        let committed_done = high.iter().all(|(p, h)| committed.get(p) == Some(h));
        if max_applied.unwrap_or(0) > 1 {
            break Err(format!("an effect applied {} times", max_applied.unwrap_or(0)));
        }
        if count == total && stored_done && committed_done {
            break Ok(elapsed);
        }
        state = format!(
            "effects {count}/{total}, stored {:?}, committed {:?}, high {:?}",
            sorted(&stored),
            sorted(&committed),
            sorted(&high)
        );
        if elapsed > a.converge {
            break Err(format!("not converged after {:?}: {state}", a.converge));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    drop(members);
    let _ = state;
    Ok(match converged {
        Ok(d) => {
            let _ = std::fs::remove_file(&log);
            Outcome {
                pass: true,
                converge: Some(d),
                kills,
                detail: format!("{total} effects once each, offsets at log end"),
            }
        }
        Err(detail) => Outcome {
            pass: false,
            converge: None,
            kills,
            detail: format!("{detail} (member logs: {})", log.display()),
        },
    })
}

fn sorted(m: &HashMap<i32, i64>) -> Vec<(i32, i64)> {
    let mut v: Vec<_> = m.iter().map(|(p, o)| (*p, *o)).collect();
    v.sort();
    v
}
