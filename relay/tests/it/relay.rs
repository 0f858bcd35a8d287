//! Invariant 9 against PostgreSQL and Apache Kafka: every committed row published at
//! least once, same-key rows in id order, marks only after acks and only under
//! the lane generation, and nothing lost to crashes, outages or shutdown.
//! Every scenario whose promise holds in both capture modes runs in both
//! (`in_every_capture_mode!`, `in_both_capture_modes!`); the ones about
//! polled lanes poll only.

use std::collections::{HashMap, HashSet};
use std::process::Command;
use std::time::{Duration, Instant};

use ferry::{Clock, Ferry, Millis, NewRun, OutboxMessage};
use ferry_relay::Capture;
use serde_json::json;

use crate::support::*;
use ferry_testkit::Kafka;

const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// Kafka's Java `Utils.murmur2`, transcribed with Java's signed 32-bit ints.
fn java_murmur2(data: &[u8]) -> i32 {
    let length = data.len() as i32;
    let seed: i32 = 0x9747b28c_u32 as i32;
    let m: i32 = 0x5bd1e995;
    let r = 24;
    let mut h: i32 = seed ^ length;
    let length4 = length / 4;
    for i in 0..length4 {
        let i4 = (i * 4) as usize;
        let mut k: i32 = (data[i4] as i32 & 0xff)
            + ((data[i4 + 1] as i32 & 0xff) << 8)
            + ((data[i4 + 2] as i32 & 0xff) << 16)
            + ((data[i4 + 3] as i32 & 0xff) << 24);
        k = k.wrapping_mul(m);
        k ^= ((k as u32) >> r) as i32;
        k = k.wrapping_mul(m);
        h = h.wrapping_mul(m);
        h ^= k;
    }
    let tail = (length & !3) as usize;
    let rest = length % 4;
    if rest >= 3 {
        h ^= (data[tail + 2] as i32 & 0xff) << 16;
    }
    if rest >= 2 {
        h ^= (data[tail + 1] as i32 & 0xff) << 8;
    }
    if rest >= 1 {
        h ^= data[tail] as i32 & 0xff;
        h = h.wrapping_mul(m);
    }
    h ^= ((h as u32) >> 13) as i32;
    h = h.wrapping_mul(m);
    h ^= ((h as u32) >> 15) as i32;
    h
}

/// Rows written before the relay starts (the backlog; in WAL capture, read
/// from the table once for the new slot) and while it runs (streamed):
/// every one reaches Kafka once, on the Java client's partition, with its
/// headers, tenant, effect key and trace context; every row ends
/// delivered, the metrics count them, and no lane stays owned.
async fn end_to_end_every_row_once_with_the_right_partition(capture: Capture) {
    let broker = Kafka::start();
    broker.create_topic("ferry.run-events", 6);
    broker.create_topic("orders", 6);
    let (ferry, url) = pg_ferry().await;
    let tenants = ["acme", "globex", "initech"];
    let write = |from: usize, to: usize| {
        let ferry = ferry.clone();
        async move {
            for i in from..to {
                let tenant = tenants[i % 3];
                let mut tx = ferry.begin().await.unwrap();
                let run = NewRun::new(tenant, "charge", format!("k{i}"), json!({"i": i})).traceparent(TP);
                ferry.create_run_idempotent_in(tx.conn(), run).await.unwrap();
                let msg = OutboxMessage::json(tenant, "orders", format!("order-{i}"), &json!({"i": i}))
                    .unwrap()
                    .header("source", "test")
                    .traceparent(TP);
                ferry.enqueue_in(tx.conn(), &msg).await.unwrap();
                tx.commit().await.unwrap();
            }
        }
    };
    write(0, 75).await;
    let database_id = ferry.database_id().await.unwrap();
    let (cfg, guard) = config_for(capture, &url, &broker.brokers()).await;
    let relay = guard.start(cfg, ferry.clone()).await;
    let delivered = &format!("SELECT count(*) FROM {OUTBOX} WHERE state = 'delivered'");
    // After the backlog is out, so that no later row commits while a new
    // slot is being made (such a row may be published twice).
    wait_for_count(&ferry, delivered, 150, Duration::from_secs(60)).await;
    write(75, 150).await;
    let total = scalar(&ferry, "SELECT count(*) FROM outbox").await as usize;
    assert_eq!(total, 300);
    let c = consumer(&broker.brokers(), &["ferry.run-events", "orders"]);
    let recs = read_until(&c, Duration::from_secs(60), |r| distinct(r) >= total).await;
    assert_eq!(recs.len(), total, "exactly once in the normal case");
    for r in &recs {
        let expected = (java_murmur2(r.key.as_bytes()) & 0x7fffffff) % 6;
        assert_eq!(r.partition, expected, "key {} on the Java client's partition", r.key);
        let body: serde_json::Value = serde_json::from_slice(&r.payload).unwrap();
        assert!(tenants.contains(&r.headers["ferry-tenant"].as_str()));
        assert_eq!(r.headers["traceparent"], TP);
        match r.topic.as_str() {
            "orders" => {
                assert_eq!(r.headers["source"], "test");
                // The default key: `<database id>:<outbox id>`.
                assert_eq!(
                    r.headers["ferry-effect-key"],
                    format!("{database_id}:{}", r.headers["ferry-outbox-id"])
                );
                assert!(r.key.starts_with("order-"));
            }
            "ferry.run-events" => {
                assert_eq!(body["kind"], "run_queued");
                assert_eq!(body["run_id"].as_str().unwrap(), r.key);
                // The writer's key (`<tenant>/<run>/<seq>`), scoped by tenant.
                let tenant = &r.headers["ferry-tenant"];
                assert_eq!(r.headers["ferry-effect-key"], format!("{tenant}/{tenant}/{}/1", r.key));
            }
            other => panic!("unexpected topic {other}"),
        }
    }
    wait_for_count(&ferry, delivered, 300, Duration::from_secs(30)).await;
    // The counter follows the marks' commits by an instant.
    let deadline = Instant::now() + Duration::from_secs(10);
    while relay.state.metrics.published.get() < 300 {
        assert!(Instant::now() < deadline, "the published counter never reached 300");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (status, _) = http_get(relay.addr, "/healthz").await;
    assert!(status.contains("200"));
    let (status, _) = http_get(relay.addr, "/readyz").await;
    assert!(status.contains("200"));
    let (_, metrics) = http_get(relay.addr, "/metrics").await;
    assert!(metrics.contains("ferry_relay_published_total 300"), "{metrics}");
    assert!(metrics.contains("ferry_relay_backlog_rows 0"), "{metrics}");
    assert!(
        metrics.contains("ferry_relay_publish_latency_seconds_count 300"),
        "{metrics}"
    );
    let status = ferry.operator().status_report().await.unwrap();
    if let Some(slot) = guard.slot() {
        for name in slot.slots() {
            assert!(
                status.contains(&format!("wal slot {name}")) && status.contains("streaming"),
                "{status}"
            );
        }
    }
    relay.shutdown().await;
    assert_eq!(scalar(&ferry, delivered).await, 300);
    assert_eq!(
        scalar(&ferry, "SELECT count(*) FROM relay_lanes WHERE owner IS NOT NULL").await,
        0,
        "lanes released (WAL capture holds none)"
    );
    if let Some(slot) = guard.slot() {
        let pool = ferry.db().as_postgres().unwrap();
        for name in slot.slots() {
            assert!(confirmed_flush(pool, &name).await > 0, "slot {name} was confirmed");
        }
    }
}

/// Four writers append to twelve runs at once while two relays run: each
/// run's events reach Kafka in order. Polling, the relays share the lanes;
/// in WAL capture, one streams from the slot and the other stands by.
async fn same_key_rows_arrive_in_id_order_with_concurrent_writers_and_two_relays(capture: Capture) {
    let broker = Kafka::start();
    broker.create_topic("ferry.run-events", 6);
    let (ferry, url) = pg_ferry().await;
    let (cfg, guard) = config_for(capture, &url, &broker.brokers()).await;
    let a = guard.start(cfg.clone(), ferry.clone()).await;
    let b = guard.start(cfg, Ferry::builder(&url).connect().await.unwrap()).await;
    if capture == Capture::Poll {
        // The lanes are shared before the writers start: otherwise the first
        // relay can publish everything before the second takes its share.
        let owners = "SELECT count(DISTINCT owner) FROM relay_lanes WHERE owner IS NOT NULL";
        wait_for_count(&ferry, owners, 2, Duration::from_secs(60)).await;
    }
    let mut runs = Vec::new();
    for i in 0..12 {
        runs.push(
            ferry
                .create_run_idempotent(NewRun::new("acme", "op", format!("k{i}"), json!({})))
                .await
                .unwrap()
                .run
                .run_id,
        );
    }
    // Four writers append to every run at once; the run row serializes them.
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let (f, runs) = (ferry.clone(), runs.clone());
            tokio::spawn(async move {
                for n in 0..15 {
                    for id in &runs {
                        f.append_event("acme", *id, "progress", &json!({"w": w, "n": n}))
                            .await
                            .unwrap();
                    }
                }
            })
        })
        .collect();
    for w in writers {
        w.await.unwrap();
    }
    let total = scalar(&ferry, "SELECT count(*) FROM outbox").await as usize;
    assert_eq!(total, 12 * 61);
    let c = consumer(&broker.brokers(), &["ferry.run-events"]);
    let recs = read_until(&c, Duration::from_secs(90), |r| distinct(r) >= total).await;
    let mut per_key: HashMap<String, Vec<i64>> = HashMap::new();
    let mut seen = HashSet::new();
    for r in &recs {
        let body: serde_json::Value = serde_json::from_slice(&r.payload).unwrap();
        if seen.insert(r.outbox_id()) {
            per_key
                .entry(r.key.clone())
                .or_default()
                .push(body["seq"].as_i64().unwrap());
        }
    }
    for (key, seqs) in &per_key {
        assert_eq!(seqs, &(1..=61).collect::<Vec<_>>(), "key {key} out of order");
    }
    // The metrics count rows once marked, which follows Kafka's
    // acknowledgement: read them once every row is marked and both relays
    // have stopped (their last marks are counted by then).
    let delivered = &format!("SELECT count(*) FROM {OUTBOX} WHERE state = 'delivered'");
    wait_for_count(&ferry, delivered, total as i64, Duration::from_secs(60)).await;
    let (sa, sb) = (a.state.clone(), b.state.clone());
    a.shutdown().await;
    b.shutdown().await;
    let (pa, pb) = (sa.metrics.published.get(), sb.metrics.published.get());
    match capture {
        Capture::Poll => assert!(pa > 0 && pb > 0, "both relays published (a: {pa}, b: {pb})"),
        // Several streams: each streamed by one relay at a time, which
        // the slot fences (where they stream is the streams' own test's).
        Capture::Wal if streams() > 1 => assert!(pa + pb >= total as u64, "a: {pa}, b: {pb}"),
        Capture::Wal => assert!(
            pa == 0 || pb == 0,
            "one relay streams from the slot, the other stands by (a: {pa}, b: {pb})"
        ),
    }
}

pub async fn write_orders(ferry: &Ferry, n: usize, keys: usize) {
    for i in 0..n {
        let msg = OutboxMessage::json("acme", "orders", format!("key-{}", i % keys), &json!({"i": i})).unwrap();
        ferry.enqueue(&msg).await.unwrap();
    }
}

/// A relay process SIGKILLed three times mid-stream and restarted: every
/// committed row reaches Kafka, and a duplicate is the same row.
async fn a_sigkilled_relay_loses_nothing(capture: Capture) {
    let broker = Kafka::start();
    broker.create_topic("orders", 6);
    let (ferry, url) = pg_ferry().await;
    let guard = CaptureGuard::new(capture).await;
    write_orders(&ferry, 1500, 40).await;
    let c = consumer(&broker.brokers(), &["orders"]);
    let mut recs = Vec::new();
    for round in 1..=3 {
        let mut child = spawn_relay_process(&url, &broker.brokers(), &guard.args(), &[]);
        let want = round * 300;
        let more = read_until(&c, Duration::from_secs(60), |r| distinct(recs.iter().chain(r)) >= want).await;
        recs.extend(more);
        child.kill().unwrap(); // SIGKILL mid-stream
        child.wait().unwrap();
    }
    let mut child = spawn_relay_process(&url, &broker.brokers(), &guard.args(), &[]);
    let more = read_until(&c, Duration::from_secs(90), |r| distinct(recs.iter().chain(r)) >= 1500).await;
    recs.extend(more);
    let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
    child.wait().unwrap();
    let ids: HashSet<i64> = recs.iter().map(Record::outbox_id).collect();
    let all: Vec<i64> = sqlx::query_scalar("SELECT id FROM outbox")
        .fetch_all(ferry.db().as_postgres().unwrap())
        .await
        .unwrap();
    assert!(
        all.iter().all(|id| ids.contains(id)),
        "every committed row reached Kafka"
    );
    let mut by_id: HashMap<i64, &Record> = HashMap::new();
    for r in &recs {
        if let Some(first) = by_id.insert(r.outbox_id(), r) {
            assert_eq!(
                (&first.key, &first.payload),
                (&r.key, &r.payload),
                "a duplicate is the same row"
            );
        }
    }
    // A measurement, not a promise (BENCHMARKS.md): progressive marking keeps
    // what a kill republishes to the last mark interval plus what was in flight.
    let duplicates = recs.len() - by_id.len();
    eprintln!(
        "at least once, {capture:?}: {duplicates} duplicates over 3 SIGKILLs ({} per kill) for {} rows",
        duplicates / 3,
        by_id.len()
    );
}

/// The broker stopped while rows are written, then restarted: the backlog
/// drains.
async fn a_broker_outage_drains_after_restart(capture: Capture) {
    let mut broker = Kafka::start_own();
    broker.create_topic("orders", 6);
    let (ferry, url) = pg_ferry().await;
    let (cfg, guard) = config_for(capture, &url, &broker.brokers()).await;
    let relay = guard.start(cfg, ferry.clone()).await;
    write_orders(&ferry, 100, 10).await;
    wait_for_count(&ferry, &DELIVERED, 100, Duration::from_secs(60)).await;
    broker.stop();
    write_orders(&ferry, 200, 10).await;
    broker.restart();
    // The relay marks a row delivered only once Kafka acknowledged it; the
    // topic is then read whole, without a consumer group (whose coordinator
    // the restart moves, which this test is not about).
    wait_for_count(&ferry, &DELIVERED, 300, Duration::from_secs(120)).await;
    relay.shutdown().await;
    let recs = read_all(&broker.brokers(), "orders", false, Duration::from_secs(30)).await;
    assert_eq!(distinct(&recs), 300);
    assert_eq!(
        scalar(
            &ferry,
            &format!("SELECT count(*) FROM {OUTBOX} WHERE state = 'pending'")
        )
        .await,
        0,
        "the backlog drained"
    );
}

/// The broker is SIGKILLed while a writer keeps the relay busy (batches,
/// or streamed transactions, in flight) and stays down until a row written
/// after it has waited 12 s (longer than the 10 s message timeout these
/// tests once set), then restarts: no record fails (each is retried until
/// acknowledged), nothing is lost, and the first occurrence of each row on
/// the topic keeps per-key id order (never `i+1, i, i+1`; with a finite
/// timeout, the records queued behind a timed-out one overtook it).
async fn a_broker_crash_mid_stream_loses_nothing_and_keeps_first_occurrences_in_order(capture: Capture) {
    let mut broker = Kafka::start_own();
    broker.create_topic("orders", 6);
    let (ferry, url) = pg_ferry().await;
    let (cfg, guard) = config_for(capture, &url, &broker.brokers()).await;
    let relay = guard.start(cfg, ferry.clone()).await;
    // Capturing (in WAL capture, the slot made) before the writer starts.
    write_orders(&ferry, 1, 1).await;
    let delivered = &format!("SELECT count(*) FROM {OUTBOX} WHERE state = 'delivered'");
    wait_for_count(&ferry, delivered, 1, Duration::from_secs(60)).await;
    let writer = {
        let ferry = ferry.clone();
        tokio::spawn(async move { write_orders(&ferry, 2000, 20).await })
    };
    let c = consumer(&broker.brokers(), &["orders"]);
    let mut recs = read_until(&c, Duration::from_secs(60), |r| distinct(r) >= 300).await;
    let before = scalar(&ferry, "SELECT coalesce(max(id), 0) FROM outbox").await;
    broker.kill();
    write_orders(&ferry, 100, 20).await;
    wait_for_a_row_pending_for(&ferry, before, Duration::from_secs(12)).await;
    broker.restart();
    writer.await.unwrap();
    let more = read_until(&c, Duration::from_secs(120), |r| distinct(recs.iter().chain(r)) >= 2101).await;
    recs.extend(more);
    wait_for_count(&ferry, delivered, 2101, Duration::from_secs(60)).await;
    assert_no_record_timed_out(relay.addr).await;
    relay.shutdown().await;
    first_occurrences(&recs);
}

/// A lane is lost when another relay takes it, not when its lease lapses:
/// a lapsed lease nobody took is renewed and marks; once another relay
/// took the lane, the first can neither mark, delete, mark dead, release
/// nor renew it. Poll capture only: lane leases and their generations are
/// what polled lanes are fenced by (WAL capture holds no lanes; its fence is the slot,
/// `capture::wal_a_sigkilled_relay_loses_nothing_and_its_standby_takes_over`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_lost_its_lane_cannot_mark() {
    let (_, url) = pg_ferry().await;
    let clock = Clock::manual(Millis::new(1_800_000_000_000).unwrap());
    let ferry = Ferry::builder(&url).clock(clock.clone()).connect().await.unwrap();
    let lease = Duration::from_secs(10);
    let held_a = ferry_relay::store::RelayStore::new(ferry.clone())
        .acquire_lanes("relay-a", lease, 64)
        .await
        .unwrap();
    assert_eq!(held_a.len(), 64);
    for i in 0..5 {
        ferry
            .enqueue(&OutboxMessage::bytes("acme", "orders", "one-key", vec![i]))
            .await
            .unwrap();
    }
    let lane = ferry::outbox::lane_for("one-key", ferry.lanes());
    let a = *held_a.iter().find(|l| l.lane == lane).unwrap();
    let batch = ferry_relay::store::RelayStore::new(ferry.clone())
        .pending_batch(lane, 100)
        .await
        .unwrap();
    assert_eq!(batch.len(), 5);
    assert!(
        ferry_relay::store::RelayStore::new(ferry.clone())
            .acquire_lanes("relay-b", lease, 64)
            .await
            .unwrap()
            .is_empty(),
        "live leases are not taken"
    );
    // A's lease lapses while no relay takes the lane (A starved, or cut off
    // from the database): renewed late, the lane is still A's at its
    // generation, and A's marks are taken.
    clock.advance(lease + Duration::from_millis(1)).unwrap();
    let renewed = ferry_relay::store::RelayStore::new(ferry.clone())
        .renew_lanes("relay-a", lease)
        .await
        .unwrap();
    assert!(
        renewed.contains(&a),
        "a lapsed lease nobody took is renewed at its generation"
    );
    assert_eq!(
        ferry_relay::store::RelayStore::new(ferry.clone())
            .mark_delivered("relay-a", a, &[batch[0].id], false)
            .await
            .unwrap(),
        1,
        "a lapsed lease nobody took still marks"
    );
    let batch = &batch[1..];
    // A pauses past its lease again; B takes the lane at a higher generation.
    clock.advance(lease + Duration::from_millis(1)).unwrap();
    let held_b = ferry_relay::store::RelayStore::new(ferry.clone())
        .acquire_lanes("relay-b", lease, 64)
        .await
        .unwrap();
    let b = *held_b.iter().find(|l| l.lane == lane).unwrap();
    assert!(b.generation > a.generation);
    let ids: Vec<i64> = batch.iter().map(|r| r.id).collect();
    for delete in [false, true] {
        let err = ferry_relay::store::RelayStore::new(ferry.clone())
            .mark_delivered("relay-a", a, &ids, delete)
            .await
            .unwrap_err();
        assert_eq!(err.code(), "lost_lease", "delete on delivery: {delete}");
    }
    assert_eq!(
        ferry_relay::store::RelayStore::new(ferry.clone())
            .mark_dead("relay-a", a, ids[0], "x")
            .await
            .unwrap_err()
            .code(),
        "lost_lease"
    );
    assert!(
        !ferry_relay::store::RelayStore::new(ferry.clone())
            .release_lane("relay-a", a)
            .await
            .unwrap(),
        "never releases a lane it lost"
    );
    assert!(ferry_relay::store::RelayStore::new(ferry.clone())
        .renew_lanes("relay-a", lease)
        .await
        .unwrap()
        .is_empty());
    assert_eq!(
        ferry_relay::store::RelayStore::new(ferry.clone())
            .ferry()
            .operator()
            .outbox_backlog()
            .await
            .unwrap()
            .pending,
        4,
        "A changed nothing after B took the lane"
    );
    assert_eq!(
        ferry_relay::store::RelayStore::new(ferry.clone())
            .mark_delivered("relay-b", b, &ids, false)
            .await
            .unwrap(),
        4
    );
}

/// SIGTERM mid-drain: the relay process exits cleanly within its grace,
/// and every row it saw acknowledged is marked delivered.
async fn sigterm_marks_everything_acknowledged_within_the_grace(capture: Capture) {
    let broker = Kafka::start();
    broker.create_topic("orders", 6);
    let (ferry, url) = pg_ferry().await;
    let guard = CaptureGuard::new(capture).await;
    write_orders(&ferry, 3000, 50).await;
    let c = consumer(&broker.brokers(), &["orders"]);
    let mut child = spawn_relay_process(&url, &broker.brokers(), &guard.args(), &[]);
    // Publishing, a part of the rows out.
    read_until(&c, Duration::from_secs(60), |r| distinct(r) >= 300).await;
    let asked = Instant::now();
    let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
    let status = child.wait().unwrap();
    assert!(status.success(), "clean exit: {status:?}");
    assert!(
        asked.elapsed() < Duration::from_secs(7),
        "exited within the grace ({:?})",
        asked.elapsed()
    );
    // The topic read whole by a fresh reader (the relay has exited): a
    // group consumer moved by a rebalance under load could miss records.
    drop(c);
    let recs = read_all(&broker.brokers(), "orders", false, Duration::from_secs(60)).await;
    let in_kafka: HashSet<i64> = recs.iter().map(Record::outbox_id).collect();
    let delivered: Vec<i64> = sqlx::query_scalar(&format!("SELECT id FROM {OUTBOX} WHERE state = 'delivered'"))
        .fetch_all(ferry.db().as_postgres().unwrap())
        .await
        .unwrap();
    let marked_not_in_kafka: Vec<_> = delivered.iter().filter(|id| !in_kafka.contains(id)).collect();
    assert!(
        marked_not_in_kafka.is_empty(),
        "rows marked delivered that Kafka does not hold: {marked_not_in_kafka:?}"
    );
    let pending: HashSet<i64> = sqlx::query_scalar(&format!("SELECT id FROM {OUTBOX} WHERE state = 'pending'"))
        .fetch_all(ferry.db().as_postgres().unwrap())
        .await
        .unwrap()
        .into_iter()
        .collect();
    let acked_but_pending: Vec<_> = recs
        .iter()
        .map(Record::outbox_id)
        .filter(|id| pending.contains(id))
        .collect();
    assert!(
        acked_but_pending.is_empty(),
        "acknowledged rows left unmarked: {acked_but_pending:?}"
    );
    assert_eq!(
        scalar(&ferry, "SELECT count(*) FROM relay_lanes WHERE owner IS NOT NULL").await,
        0,
        "lanes released"
    );
}

/// rdkafka's mock cluster refuses the idempotent producer's id
/// (ClusterAuthorizationFailed on InitProducerId), which librdkafka raises as
/// a fatal error: the relay must fail readiness, count it, drain without
/// losing a row and exit with an error, and a restarted relay publishes.
/// A transaction holding an xid stays open until the relay exited, so WAL
/// capture is still waiting to make its slot: the fatal error is noticed
/// without a row in flight (before, the relay waited for the slot first,
/// and on a busy shared cluster that outlived the test's bound).
async fn a_fatal_producer_error_fails_readiness_and_exits_to_be_restarted(capture: Capture) {
    use rdkafka::mocking::MockCluster;
    use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
    let mock = MockCluster::new(1).unwrap();
    mock.create_topic("orders", 3, 1).unwrap();
    // Every producer's first request for its id (one per stream).
    mock.request_errors(
        RDKafkaApiKey::InitProducerId,
        &vec![RDKafkaRespErr::RD_KAFKA_RESP_ERR_CLUSTER_AUTHORIZATION_FAILED; streams() as usize],
    );
    let (ferry, url) = pg_ferry().await;
    write_orders(&ferry, 20, 5).await;
    let mut running = ferry.db().as_postgres().unwrap().begin().await.unwrap();
    sqlx::query("SELECT txid_current()")
        .execute(&mut *running)
        .await
        .unwrap();
    let (cfg, guard) = config_for(capture, &url, &mock.bootstrap_servers()).await;
    let relay = guard.start(cfg.clone(), ferry.clone()).await;
    let state = relay.state.clone();
    let err = tokio::time::timeout(Duration::from_secs(60), relay.handle)
        .await
        .expect("the relay exits after a fatal producer error")
        .unwrap()
        .unwrap_err();
    running.commit().await.unwrap();
    assert_eq!(err.code(), "kafka_fatal", "{err}");
    assert!(state.fatal.is_cancelled(), "/readyz fails from the fatal error on");
    assert_eq!(state.metrics.producer_fatal.get(), 1);
    assert!(state.metrics.render().contains("ferry_relay_producer_fatal_total 1"));
    assert_eq!(
        scalar(
            &ferry,
            &format!("SELECT count(*) FROM {OUTBOX} WHERE state = 'pending'")
        )
        .await,
        20,
        "nothing was marked past the fatal error"
    );
    // The orchestrator restarts it: a new producer publishes everything.
    // WAL capture makes its slot first, which waits for every transaction
    // running in the cluster (other tests' on the shared one): the bound
    // covers that wait, and a miss names the transactions still running.
    mock.clear_request_errors(RDKafkaApiKey::InitProducerId);
    let relay = guard.start(cfg, ferry.clone()).await;
    let start = Instant::now();
    while scalar(
        &ferry,
        &format!("SELECT count(*) FROM {OUTBOX} WHERE state = 'delivered'"),
    )
    .await
        < 20
    {
        if start.elapsed() > Duration::from_secs(180) {
            panic!(
                "the restarted relay did not publish; transactions running: {}",
                running_xacts(&ferry).await
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    relay.shutdown().await;
}

/// A row whose id is lower than rows already read commits late (a writer's
/// transaction took its id, then others committed higher ids of the same
/// lane and the relay moved past them). It must still be published. A
/// writer keeps the lane busy meanwhile, so the lane stays on its read-ahead
/// path (a read-ahead "after the last id read" would pass over it).
///
/// Poll capture only: it is about a lane's read-ahead, and its late
/// transaction is open when the relay starts, which a new WAL slot waits
/// for (WAL capture's late commits:
/// `capture::a_plain_writer_and_the_library_keep_commit_order`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lower_id_that_commits_late_is_still_published_while_the_lane_streams() {
    let broker = Kafka::start();
    broker.create_topic("late", 3);
    let (ferry, url) = pg_ferry().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    let lane = ferry::outbox::lane_for("late-key", ferry.lanes());
    // The late row takes its id now and commits later.
    let mut late = pool.begin().await.unwrap();
    let late_id: i64 = sqlx::query_scalar(
        "INSERT INTO outbox (tenant, topic, key, lane, payload, headers, created_at)
         VALUES ('acme', 'late', 'late-key', $1, 'late', '{}'::jsonb, 0) RETURNING id",
    )
    .bind(lane)
    .fetch_one(&mut *late)
    .await
    .unwrap();
    let a = start_relay(relay_config(&url, &broker.brokers()), ferry.clone()).await;
    // Rows of the same lane (same key) with higher ids, committed, published.
    for i in 0..50 {
        let m = OutboxMessage::json("acme", "late", "late-key", &json!({"i": i})).unwrap();
        ferry.enqueue(&m).await.unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while scalar(
        &ferry,
        &format!("SELECT count(*) FROM {OUTBOX} WHERE state = 'delivered'"),
    )
    .await
        < 50
    {
        assert!(Instant::now() < deadline, "the committed rows were not published");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Keep the lane streaming while the late row commits.
    let busy = tokio_util::sync::CancellationToken::new();
    let writer = {
        let (f, busy) = (ferry.clone(), busy.clone());
        tokio::spawn(async move {
            let mut i = 0;
            while !busy.is_cancelled() {
                let m = OutboxMessage::json("acme", "late", "late-key", &json!({"busy": i})).unwrap();
                f.enqueue(&m).await.unwrap();
                i += 1;
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    late.commit().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let state: String = sqlx::query_scalar(&format!("SELECT state FROM {OUTBOX} WHERE id = $1"))
            .bind(late_id)
            .fetch_one(&pool)
            .await
            .unwrap();
        if state == "delivered" {
            break;
        }
        assert!(Instant::now() < deadline, "the late row (id {late_id}) was passed over");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    busy.cancel();
    writer.await.unwrap();
    a.shutdown().await;
    let recs = read_all(&broker.brokers(), "late", false, Duration::from_secs(10)).await;
    assert!(
        recs.iter().any(|r| r.outbox_id() == late_id),
        "the late row reached Kafka"
    );
}

/// Per-key order across a late commit (PostgreSQL: ids are drawn before
/// commit). Key K's first row takes its id inside a transaction that commits
/// only after the relay has published higher ids of the same lane (key J,
/// written continuously so the lane keeps reading ahead). K's second row is
/// written right after that commit, so its id is higher still. K's rows must
/// reach Kafka in id order: a read-ahead that reads "after the last id read"
/// finds the second row and publishes it before the first. Five rounds.
/// (In WAL capture the first row commits first, so commit order is id
/// order too.)
async fn a_late_commit_keeps_its_place_before_the_same_key_s_next_row(capture: Capture) {
    let broker = Kafka::start();
    broker.create_topic("order", 3);
    let (ferry, url) = pg_ferry().await;
    let k = "k-late";
    let lane = ferry::outbox::lane_for(k, ferry.lanes());
    let j = (0..)
        .map(|i| format!("j-{i}"))
        .find(|j| ferry::outbox::lane_for(j, ferry.lanes()) == lane)
        .unwrap();
    let (cfg, guard) = config_for(capture, &url, &broker.brokers()).await;
    let a = guard.start(cfg, ferry.clone()).await;
    let busy = tokio_util::sync::CancellationToken::new();
    let writer = {
        let (f, busy, j) = (ferry.clone(), busy.clone(), j.clone());
        tokio::spawn(async move {
            let mut i = 0;
            while !busy.is_cancelled() {
                let m = OutboxMessage::json("acme", "order", &j, &json!({"busy": i})).unwrap();
                f.enqueue(&m).await.unwrap();
                i += 1;
            }
        })
    };
    // Capturing (in WAL capture, the slot made: making it waits for the
    // transactions in progress) before the first late transaction opens.
    wait_for_count(
        &ferry,
        &format!("SELECT count(*) FROM {OUTBOX} WHERE state = 'delivered'"),
        1,
        Duration::from_secs(60),
    )
    .await;
    let mut pairs = Vec::new();
    for round in 0..5 {
        let mut tx = ferry.begin().await.unwrap();
        let first = OutboxMessage::json("acme", "order", k, &json!({"round": round, "n": 1})).unwrap();
        let first_id = ferry.enqueue_in(tx.conn(), &first).await.unwrap();
        // Wait until the relay has published a higher id of this lane.
        let deadline = Instant::now() + Duration::from_secs(30);
        while scalar(
            &ferry,
            &format!("SELECT count(*) FROM {OUTBOX} WHERE state = 'delivered' AND id > {first_id}"),
        )
        .await
            < 3
        {
            assert!(Instant::now() < deadline, "the lane did not move past id {first_id}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tx.commit().await.unwrap();
        let second = OutboxMessage::json("acme", "order", k, &json!({"round": round, "n": 2})).unwrap();
        let second_id = ferry.enqueue(&second).await.unwrap();
        assert!(second_id > first_id);
        pairs.push((first_id, second_id));
    }
    let want: HashSet<i64> = pairs.iter().flat_map(|(x, y)| [*x, *y]).collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    while scalar(
        &ferry,
        &format!("SELECT count(*) FROM {OUTBOX} WHERE state = 'delivered' AND key = '{k}'"),
    )
    .await
        < want.len() as i64
    {
        assert!(Instant::now() < deadline, "K's rows were not all published");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    busy.cancel();
    writer.await.unwrap();
    a.shutdown().await;
    let recs = read_all(&broker.brokers(), "order", false, Duration::from_secs(10)).await;
    let order = order_of(&recs, k);
    let mut sorted = order.clone();
    sorted.sort();
    assert_eq!(order, sorted, "key {k} published out of id order (pairs {pairs:?})");
    assert_eq!(order.len(), want.len());
}

/// `--delete-on-delivery`: every row reaches Kafka and its outbox row is
/// deleted instead of marked (the backlog and the rows written while the
/// relay runs), and nothing is left pending.
async fn delete_on_delivery_deletes_every_published_row(capture: Capture) {
    const EMPTY: &str = "SELECT (count(*) = 0)::int::bigint FROM outbox";
    let broker = Kafka::start();
    broker.create_topic("orders", 4);
    let (ferry, url) = pg_ferry().await;
    write_orders(&ferry, 100, 10).await;
    let ids: HashSet<i64> = sqlx::query_scalar("SELECT id FROM outbox")
        .fetch_all(ferry.db().as_postgres().unwrap())
        .await
        .unwrap()
        .into_iter()
        .collect();
    let (mut cfg, guard) = config_for(capture, &url, &broker.brokers()).await;
    cfg.delete_on_delivery = true;
    let relay = guard.start(cfg, ferry.clone()).await;
    wait_for_count(&ferry, EMPTY, 1, Duration::from_secs(60)).await;
    write_orders(&ferry, 100, 10).await;
    let c = consumer(&broker.brokers(), &["orders"]);
    let recs = read_until(&c, Duration::from_secs(60), |r| distinct(r) >= 200).await;
    wait_for_count(&ferry, EMPTY, 1, Duration::from_secs(60)).await;
    relay.shutdown().await;
    let published: HashSet<i64> = recs.iter().map(Record::outbox_id).collect();
    assert_eq!(published.len(), 200, "every row published");
    assert!(ids.is_subset(&published), "the backlog published");
}

in_every_capture_mode!(
    same_key_rows_arrive_in_id_order_with_concurrent_writers_and_two_relays,
    a_sigkilled_relay_loses_nothing,
    a_broker_crash_mid_stream_loses_nothing_and_keeps_first_occurrences_in_order,
);
in_both_capture_modes!(
    end_to_end_every_row_once_with_the_right_partition,
    delete_on_delivery_deletes_every_published_row,
    a_broker_outage_drains_after_restart,
    sigterm_marks_everything_acknowledged_within_the_grace,
    a_fatal_producer_error_fails_readiness_and_exits_to_be_restarted,
    a_late_commit_keeps_its_place_before_the_same_key_s_next_row,
);
