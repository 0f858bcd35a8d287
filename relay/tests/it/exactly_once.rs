//! `--exactly-once` against Apache Kafka: relays SIGKILLed mid-transaction,
//! crashed right after a Kafka commit and before marking, and paused into
//! zombies while another relay takes their lanes. A `read_committed` reader
//! must see every row exactly once, each key in id order. Also how fast a
//! restarted relay takes its lanes, and a takeover beside another
//! producer's open transaction on the progress topic.

use std::collections::HashMap;
use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::time::{Duration, Instant};

use ferry::{Ferry, OutboxMessage};
use ferry_relay::exactly_once::Progress;
use rdkafka::consumer::BaseConsumer;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::ClientConfig;
use serde_json::json;

use crate::support::*;
use ferry_testkit::Kafka;

const EOS: &[&str] = &["--exactly-once", "--transactional-id-prefix", "t-eos"];

pub(crate) fn committed_reader(brokers: &str, topic: &str) -> BaseConsumer {
    let c: BaseConsumer = reader_config(brokers)
        .set("isolation.level", "read_committed")
        .create()
        .unwrap();
    assign_from_start(&c, &[topic]);
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
    let unmarked_but_published = scalar(
        &ferry,
        &format!("SELECT count(*) FROM {OUTBOX} WHERE state = 'pending'"),
    )
    .await;
    assert!(unmarked_but_published > 0, "the crash left rows pending");

    // 2. SIGKILL mid-stream, five times, while rows are being written.
    //    (Bounds, not waits: each new relay takes the lanes once the killed
    //    one's leases expire and then aborts its open transactions, which
    //    hold the readers back; a loaded 2-core run once took over 90 s.)
    for round in 1..=5 {
        let mut child = spawn_relay_process(&url, &broker.brokers(), EOS, &[]);
        let want = round * 400;
        let more = read_until(&reader, Duration::from_secs(180), |r| {
            distinct(recs.iter().chain(r)) >= want
        })
        .await;
        recs.extend(more);
        child.kill().unwrap();
        child.wait().unwrap();
    }

    // 3. A zombie: relay A is paused (SIGSTOP) until relay B holds every lane
    //    (B's init_transactions fenced A's producers), then resumed. A still
    //    believes it holds its lanes; its commits must fail.
    let mut a = spawn_relay_process(&url, &broker.brokers(), EOS, &[]);
    let more = read_until(&reader, Duration::from_secs(180), |r| {
        distinct(recs.iter().chain(r)) >= 2200
    })
    .await;
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
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Command::new("kill")
        .args(["-CONT", &a.id().to_string()])
        .status()
        .unwrap();

    writes.await.unwrap();
    let more = read_until(&reader, Duration::from_secs(120), |r| {
        distinct(recs.iter().chain(r)) >= total
    })
    .await;
    recs.extend(more);
    // Drain until every row is marked, then read what is left in Kafka.
    let start = Instant::now();
    while scalar(
        &ferry,
        &format!("SELECT count(*) FROM {OUTBOX} WHERE state = 'pending'"),
    )
    .await
        > 0
    {
        assert!(start.elapsed() < Duration::from_secs(60), "rows stay pending");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for p in [&mut a, &mut b] {
        let _ = Command::new("kill").args(["-TERM", &p.id().to_string()]).status();
        p.wait().unwrap();
    }
    // Everything a read_committed reader can see, from the beginning: a
    // duplicate from a crash or a zombie would be here.
    let recs = read_all(&broker.brokers(), "orders", true, Duration::from_secs(60)).await;

    assert_once_in_commit_order(&recs, total);
}

/// One key per lane, in lane order.
fn one_key_per_lane(lanes: i32) -> Vec<String> {
    let mut keys: Vec<Option<String>> = vec![None; lanes as usize];
    let mut left = keys.len();
    for i in 0.. {
        let k = format!("key-{i}");
        let slot = &mut keys[ferry::outbox::lane_for(&k, lanes) as usize];
        if slot.is_none() {
            *slot = Some(k);
            left -= 1;
            if left == 0 {
                break;
            }
        }
    }
    keys.into_iter().flatten().collect()
}

/// How long a restarted relay may take from its start until every one of
/// its 64 lanes has published: far below the lanes taken one after another
/// (about 0.5 s to 2.5 s each, so 30 s to 160 s), with room for a loaded
/// two-core machine.
const ALL_LANES_WITHIN: Duration = Duration::from_secs(20);

/// A restarted relay took its lanes one at a time, each
/// progress read waiting behind one shared consumer for an end-of-partition
/// event, so the row of the lane taken last waited about a minute; and each
/// of those expected ends was logged as an ERROR.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_exactly_once_relay_publishes_every_lane_within_seconds() {
    let broker = Kafka::start();
    broker.create_topic("orders", 6);
    let (ferry, url) = pg_ferry().await;
    let keys = one_key_per_lane(ferry.lanes());
    let enqueue_one_per_lane = || async {
        for k in &keys {
            let msg = OutboxMessage::json("acme", "orders", k.clone(), &json!({})).unwrap();
            ferry.enqueue(&msg).await.unwrap();
        }
    };
    let reader = committed_reader(&broker.brokers(), "orders");

    // A first relay leaves a progress record in every lane's partition.
    enqueue_one_per_lane().await;
    let mut first = spawn_relay_process(&url, &broker.brokers(), EOS, &[]);
    read_until(&reader, Duration::from_secs(120), |r| distinct(r) >= keys.len()).await;
    Command::new("kill")
        .args(["-TERM", &first.id().to_string()])
        .status()
        .unwrap();
    let status = first.wait().unwrap();
    assert!(status.success(), "the first relay exits cleanly ({status})");

    // The restart, with a row pending on every lane.
    enqueue_one_per_lane().await;
    let log = std::env::temp_dir().join(format!("ferry-relay-{}.log", uuid::Uuid::now_v7().simple()));
    let started = Instant::now();
    let mut second = spawn_relay_process_logging(&url, &broker.brokers(), EOS, &log);
    read_until(&reader, Duration::from_secs(180), |r| distinct(r) >= keys.len()).await;
    let took = started.elapsed();
    Command::new("kill")
        .args(["-TERM", &second.id().to_string()])
        .status()
        .unwrap();
    let status = second.wait().unwrap();
    assert!(status.success(), "the second relay exits cleanly ({status})");
    let logged = std::fs::read_to_string(&log).unwrap();
    let _ = std::fs::remove_file(&log);

    assert!(
        took < ALL_LANES_WITHIN,
        "the restarted relay published its {} lanes in {took:?}, more than {ALL_LANES_WITHIN:?}",
        keys.len()
    );
    let errors: Vec<&str> = logged.lines().filter(|l| l.contains(r#""level":"ERROR""#)).collect();
    assert!(
        errors.is_empty(),
        "a clean restart logged {} errors, the first: {:?}",
        errors.len(),
        &errors[..errors.len().min(3)]
    );
}

/// A transactional producer, initialised.
fn transactional_producer(brokers: &str, transactional_id: &str) -> BaseProducer {
    let p: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("transactional.id", transactional_id)
        .create()
        .unwrap();
    p.init_transactions(Duration::from_secs(30)).unwrap();
    p
}

/// The takeover read the lane's progress only up to the
/// last stable offset, so another database's open transaction on the same
/// progress partition hid the previous owner's last progress record, and
/// the rows that record names, published and committed, were published
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_producers_open_transaction_never_makes_a_takeover_publish_again() {
    let broker = Kafka::start();
    broker.create_topic("orders", 6);
    let (ferry, url) = pg_ferry().await;
    let brokers = broker.brokers();
    let progress_topic = "shared.progress";
    broker.create_topic_with(progress_topic, ferry.lanes(), &[("cleanup.policy", "compact")]);
    let mut cfg = relay_config(&url, &brokers);
    cfg.exactly_once = true;
    cfg.progress_topic = Some(progress_topic.into());
    let key = "the-key";
    let lane = ferry::outbox::lane_for(key, ferry.lanes());
    for i in 0..3 {
        let msg = OutboxMessage::json("acme", "orders", key, &json!({ "i": i })).unwrap();
        ferry.enqueue(&msg).await.unwrap();
    }
    let ids: Vec<i64> = sqlx::query_scalar("SELECT id FROM outbox ORDER BY id")
        .fetch_all(ferry.db().as_postgres().unwrap())
        .await
        .unwrap();
    let database = ferry.database_id().await.unwrap();

    // Another database's relay opens a transaction on the lane's progress
    // partition and keeps it open.
    let other = tokio::task::block_in_place(|| {
        let other = transactional_producer(&brokers, "other-database-lane");
        other.begin_transaction().unwrap();
        let value = serde_json::to_vec(&Progress {
            database: "other-database".into(),
            lane,
            generation: 1,
            ids: vec![1],
        })
        .unwrap();
        let other_key = Progress::key("other-database", lane);
        other
            .send(
                BaseRecord::to(progress_topic)
                    .partition(lane)
                    .key(&other_key)
                    .payload(&value),
            )
            .map_err(|(e, _)| e)
            .unwrap();
        other.flush(Duration::from_secs(30)).unwrap();
        other
    });
    // Then the lane's previous owner (its transactional.id) publishes the
    // rows with their progress record, commits, and dies before marking
    // them: the rows stay pending.
    tokio::task::block_in_place(|| {
        let previous = transactional_producer(&brokers, &cfg.transactional_id(lane));
        previous.begin_transaction().unwrap();
        for id in &ids {
            let id = id.to_string();
            previous
                .send(
                    BaseRecord::to("orders")
                        .key(key)
                        .payload("{}")
                        .headers(OwnedHeaders::new().insert(Header {
                            key: "ferry-outbox-id",
                            value: Some(&id),
                        })),
                )
                .map_err(|(e, _)| e)
                .unwrap();
        }
        let value = serde_json::to_vec(&Progress {
            database: database.clone(),
            lane,
            generation: 1,
            ids: ids.clone(),
        })
        .unwrap();
        let progress_key = Progress::key(&database, lane);
        previous
            .send(
                BaseRecord::to(progress_topic)
                    .partition(lane)
                    .key(&progress_key)
                    .payload(&value),
            )
            .map_err(|(e, _)| e)
            .unwrap();
        previous.commit_transaction(Duration::from_secs(30)).unwrap();
    });
    // And a third database has since put more records in the partition
    // than the takeover's first look back covers.
    tokio::task::block_in_place(|| {
        let third: BaseProducer = ClientConfig::new().set("bootstrap.servers", &brokers).create().unwrap();
        let third_key = Progress::key("third-database", lane);
        for _ in 0..40 {
            third
                .send(
                    BaseRecord::to(progress_topic)
                        .partition(lane)
                        .key(&third_key)
                        .payload("{}"),
                )
                .map_err(|(e, _)| e)
                .unwrap();
        }
        third.flush(Duration::from_secs(30)).unwrap();
    });

    // The new owner takes the lane while the other transaction is open: it
    // waits for it, and says so; it must not publish the rows again.
    let relay = start_relay(cfg, ferry.clone()).await;
    let pending = &format!("SELECT count(*) FROM {OUTBOX} WHERE state = 'pending'");
    let start = Instant::now();
    while relay.state.metrics.takeover_waits.get() == 0 && scalar(&ferry, pending).await > 0 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the takeover neither waited nor went on"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        scalar(&ferry, pending).await,
        3,
        "the rows stay pending while the other transaction hides their progress record"
    );
    tokio::task::block_in_place(|| other.commit_transaction(Duration::from_secs(30)).unwrap());

    // Once it commits, the takeover reads the record and marks its rows.
    let start = Instant::now();
    while scalar(&ferry, pending).await > 0 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the takeover never marked the previous owner's rows"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let msg = OutboxMessage::json("acme", "orders", key, &json!({ "i": 3 })).unwrap();
    ferry.enqueue(&msg).await.unwrap();
    let start = Instant::now();
    while scalar(&ferry, pending).await > 0 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the lane never published after its takeover"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let waits = relay.state.metrics.takeover_waits.get();
    relay.shutdown().await;

    let recs = read_all(&brokers, "orders", true, Duration::from_secs(60)).await;
    let mut count: HashMap<i64, usize> = HashMap::new();
    for r in &recs {
        *count.entry(r.outbox_id()).or_default() += 1;
    }
    let again: Vec<_> = count.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        again.is_empty(),
        "rows the previous owner committed were published again: {again:?}"
    );
    assert_eq!(count.len(), 4, "every row once");
    assert_eq!(waits, 1, "the wait is counted once");
}
