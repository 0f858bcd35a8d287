//! `--exactly-once` against Apache Kafka: relays SIGKILLed mid-transaction,
//! crashed right after a Kafka commit and before marking, and paused into
//! zombies while another relay takes their lanes. A `read_committed` reader
//! must see every row exactly once, each key in id order.

use std::collections::{HashMap, HashSet};
use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::time::{Duration, Instant};

use ferry::{Ferry, OutboxMessage};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::ClientConfig;
use serde_json::json;

use crate::support::*;
use ferry_testkit::Kafka;

const EOS: &[&str] = &["--exactly-once", "--transactional-id-prefix", "t-eos"];

fn committed_reader(brokers: &str, topic: &str) -> BaseConsumer {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("eos-{}", uuid::Uuid::now_v7().simple()))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed")
        .create()
        .unwrap();
    c.subscribe(&[topic]).unwrap();
    c
}

/// Writes `n` rows over `keys` keys, a few at a time, while relays come and go.
async fn writer(ferry: Ferry, n: usize, keys: usize) {
    for i in 0..n {
        let msg = OutboxMessage::json("acme", "orders", format!("key-{}", i % keys), &json!({"i": i})).unwrap();
        ferry.enqueue(&msg).await.unwrap();
        if i % 20 == 0 {
            tokio::task::yield_now().await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_survives_sigkill_crash_after_commit_and_zombies() {
    let broker = Kafka::start();
    broker.create_topic("orders", 6);
    let (ferry, url) = pg_ferry().await;
    let total = 4000;
    let writes = tokio::spawn(writer(ferry.clone(), total, 40));
    let reader = committed_reader(&broker.brokers(), "orders");
    let mut recs: Vec<Record> = Vec::new();
    let seen = |recs: &[Record], more: &[Record]| -> usize {
        recs.iter()
            .chain(more)
            .map(Record::outbox_id)
            .collect::<HashSet<_>>()
            .len()
    };

    // 1. Crash right after a Kafka commit, before the rows are marked: only
    //    the progress topic knows that transaction was published.
    let mut child = spawn_relay_process(
        &url,
        &broker.brokers(),
        EOS,
        &[("FERRY_RELAY_FAILPOINT", "crash-after-commit:3")],
    );
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(6), "the failpoint aborted the relay ({status})");
    let unmarked_but_published = scalar(&ferry, "SELECT count(*) FROM outbox WHERE state = 'pending'").await;
    assert!(unmarked_but_published > 0, "the crash left rows pending");

    // 2. SIGKILL mid-stream, five times, while rows are being written.
    for round in 1..=5 {
        let mut child = spawn_relay_process(&url, &broker.brokers(), EOS, &[]);
        let want = round * 400;
        let more = read_until(&reader, Duration::from_secs(90), |r| seen(&recs, r) >= want).await;
        recs.extend(more);
        child.kill().unwrap();
        child.wait().unwrap();
    }

    // 3. A zombie: relay A is paused (SIGSTOP) until relay B holds every lane
    //    (B's init_transactions fenced A's producers), then resumed. A still
    //    believes it holds its lanes; its commits must fail.
    let mut a = spawn_relay_process(&url, &broker.brokers(), EOS, &[]);
    let more = read_until(&reader, Duration::from_secs(90), |r| seen(&recs, r) >= 2200).await;
    recs.extend(more);
    Command::new("kill")
        .args(["-STOP", &a.id().to_string()])
        .status()
        .unwrap();
    let mut b = spawn_relay_process(
        &url,
        &broker.brokers(),
        &[EOS, &["--relay-id", "relay-b"]].concat(),
        &[],
    );
    let start = Instant::now();
    while scalar(&ferry, "SELECT count(*) FROM relay_lanes WHERE owner = 'relay-b'").await < 64 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "relay B never took every lane"
        );
        tokio::task::yield_now().await;
    }
    Command::new("kill")
        .args(["-CONT", &a.id().to_string()])
        .status()
        .unwrap();

    writes.await.unwrap();
    let more = read_until(&reader, Duration::from_secs(120), |r| seen(&recs, r) >= total).await;
    recs.extend(more);
    // Drain until every row is marked, then read what is left in Kafka.
    let start = Instant::now();
    while scalar(&ferry, "SELECT count(*) FROM outbox WHERE state = 'pending'").await > 0 {
        assert!(start.elapsed() < Duration::from_secs(60), "rows stay pending");
        tokio::task::yield_now().await;
    }
    for p in [&mut a, &mut b] {
        let _ = Command::new("kill").args(["-TERM", &p.id().to_string()]).status();
        p.wait().unwrap();
    }
    // Everything a read_committed reader can see, from the beginning: a
    // duplicate from a crash or a zombie would be here.
    let recs = read_all(&broker.brokers(), "orders", true, Duration::from_secs(60)).await;

    let mut count: HashMap<i64, usize> = HashMap::new();
    for r in &recs {
        *count.entry(r.outbox_id()).or_default() += 1;
    }
    let dups: Vec<_> = count.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        dups.is_empty(),
        "{} rows duplicated for a read_committed reader: {:?}",
        dups.len(),
        &dups[..dups.len().min(10)]
    );
    assert_eq!(count.len(), total, "every row exactly once");
    let mut last: HashMap<&str, i64> = HashMap::new();
    for r in &recs {
        let id = r.outbox_id();
        if let Some(prev) = last.insert(&r.key, id) {
            assert!(prev < id, "key {} out of order: {prev} then {id}", r.key);
        }
    }
}
