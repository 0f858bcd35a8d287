//! Invariant 9 in both capture modes (`--capture poll` and `--capture wal`),
//! plus what only WAL capture has: commit order for any writer, resuming
//! from the slot, and recovery when the slot or its publication is gone
//! (the table is the source of truth). Every WAL test streams from a slot
//! of its own, dropped at the end by [`SlotGuard`].

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use ferry::{NewRun, OutboxMessage};
use ferry_relay::{Capture, RelayConfig};
use serde_json::json;

use crate::support::*;
use ferry_testkit::Kafka;

const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

fn distinct(r: &[Record]) -> usize {
    r.iter().map(Record::outbox_id).collect::<HashSet<_>>().len()
}

/// The relay of `capture` (WAL on `slot`).
fn config(capture: Capture, slot: &SlotGuard, url: &str, brokers: &str) -> RelayConfig {
    match capture {
        Capture::Wal => slot.config(url, brokers),
        Capture::Poll => relay_config(url, brokers),
    }
}

/// A plain SQL insert of one outbox row (no per-key lock), as a service in
/// another language would write it; returns its id.
async fn plain_insert<'c>(conn: impl sqlx::PgExecutor<'c>, lane: i32, key: &str, body: &str) -> i64 {
    sqlx::query_scalar(
        "INSERT INTO outbox (tenant, topic, key, lane, payload, headers, created_at)
         VALUES ('acme', 'orders', $1, $2, convert_to($3, 'UTF8'), '{}'::jsonb, 0) RETURNING id",
    )
    .bind(key)
    .bind(lane)
    .bind(body)
    .fetch_one(conn)
    .await
    .unwrap()
}

/// Rows written before the relay starts and while it runs: every one
/// reaches Kafka once (no failure, no duplicate), on the Java client's
/// partition, with its headers, effect key and trace context; every row
/// ends delivered.
async fn every_row_once_with_its_headers(capture: Capture) {
    let broker = Kafka::start();
    broker.create_topic("ferry.run-events", 6);
    broker.create_topic("orders", 6);
    let (ferry, url) = pg_ferry().await;
    let slot = SlotGuard::new().await;
    let write = |from: usize, to: usize| {
        let ferry = ferry.clone();
        async move {
            for i in from..to {
                let mut tx = ferry.begin().await.unwrap();
                let run = NewRun::new("acme", "charge", format!("k{i}"), json!({"i": i})).traceparent(TP);
                ferry.create_run_idempotent_in(tx.conn(), run).await.unwrap();
                let msg = OutboxMessage::json("acme", "orders", format!("order-{i}"), &json!({"i": i}))
                    .unwrap()
                    .header("source", "test")
                    .traceparent(TP);
                ferry.enqueue_in(tx.conn(), &msg).await.unwrap();
                tx.commit().await.unwrap();
            }
        }
    };
    write(0, 50).await;
    let database_id = ferry.database_id().await.unwrap();
    let relay = slot
        .start(config(capture, &slot, &url, &broker.brokers()), ferry.clone())
        .await;
    let delivered = "SELECT count(*) FROM outbox WHERE state = 'delivered'";
    // After the first rows are out, so that none of the next ones commits
    // while a new slot is being made (those may be published twice).
    wait_for_count(&ferry, delivered, 100, Duration::from_secs(60)).await;
    write(50, 100).await;
    let c = consumer(&broker.brokers(), &["ferry.run-events", "orders"]);
    let recs = read_until(&c, Duration::from_secs(60), |r| distinct(r) >= 200).await;
    assert_eq!(recs.len(), 200, "once each");
    for r in &recs {
        assert_eq!(r.headers["traceparent"], TP);
        assert_eq!(r.headers["ferry-tenant"], "acme");
        if r.topic == "orders" {
            assert_eq!(r.headers["source"], "test");
            assert_eq!(
                r.headers["ferry-effect-key"],
                format!("{database_id}:{}", r.headers["ferry-outbox-id"])
            );
        } else {
            assert_eq!(r.headers["ferry-effect-key"], format!("acme/acme/{}/1", r.key));
        }
    }
    wait_for_count(&ferry, delivered, 200, Duration::from_secs(30)).await;
    let (ready, _) = http_get(relay.addr, "/readyz").await;
    assert!(ready.contains("200"), "{ready}");
    let status = ferry_relay::status::report(&ferry_relay::store::RelayStore::new(ferry.clone()))
        .await
        .unwrap();
    assert_eq!(
        status.contains(&format!("wal slot {}", slot.name)) && status.contains("streaming"),
        capture == Capture::Wal,
        "{status}"
    );
    relay.shutdown().await;
    if capture == Capture::Wal {
        let pool = ferry.db().as_postgres().unwrap();
        assert!(confirmed_flush(pool, &slot.name).await > 0, "the slot was confirmed");
        assert_eq!(
            scalar(&ferry, "SELECT count(*) FROM relay_lanes WHERE owner IS NOT NULL").await,
            0,
            "WAL capture holds no lanes"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_every_row_once_with_its_headers() {
    every_row_once_with_its_headers(Capture::Wal).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poll_every_row_once_with_its_headers() {
    every_row_once_with_its_headers(Capture::Poll).await;
}

/// Key `k`'s records on `orders` in Kafka order, first occurrences only.
fn order_of(recs: &[Record], k: &str) -> Vec<i64> {
    let mut order = Vec::new();
    for r in recs.iter().filter(|r| r.key == k) {
        if !order.contains(&r.outbox_id()) {
            order.push(r.outbox_id());
        }
    }
    order
}

/// A plain SQL writer takes a lower id for key K and commits after the
/// library committed a higher id of K (while the relay runs and has
/// published it). Kafka holds K's records in commit order; many writers of
/// other keys run beside them, and no row is lost.
async fn a_plain_writer_and_the_library_keep_commit_order(capture: Capture) {
    let broker = Kafka::start();
    broker.create_topic("orders", 3);
    let (ferry, url) = pg_ferry().await;
    let slot = SlotGuard::new().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    let k = "k-mixed";
    let lane = ferry::outbox::lane_for(k, ferry.lanes());
    let relay = slot
        .start(config(capture, &slot, &url, &broker.brokers()), ferry.clone())
        .await;
    // The relay streams before the late transaction opens: a new slot
    // waits for every transaction in progress when it is made.
    crate::relay::write_orders(&ferry, 1, 1).await;
    let delivered = "SELECT count(*) FROM outbox WHERE state = 'delivered'";
    wait_for_count(&ferry, delivered, 1, Duration::from_secs(60)).await;
    let others = {
        let ferry = ferry.clone();
        tokio::spawn(async move { crate::relay::write_orders(&ferry, 300, 30).await })
    };
    let mut expected = Vec::new();
    for round in 0..3 {
        let mut late = pool.begin().await.unwrap();
        let lower = plain_insert(&mut *late, lane, k, &format!("plain {round}")).await;
        let higher = ferry
            .enqueue(&OutboxMessage::bytes(
                "acme",
                "orders",
                k,
                format!("library {round}").into_bytes(),
            ))
            .await
            .unwrap();
        assert!(higher > lower);
        wait_for_count(
            &ferry,
            &format!("SELECT count(*) FROM outbox WHERE id = {higher} AND state = 'delivered'"),
            1,
            Duration::from_secs(30),
        )
        .await;
        late.commit().await.unwrap();
        expected.extend([higher, lower]);
    }
    others.await.unwrap();
    let total = scalar(&ferry, "SELECT count(*) FROM outbox").await;
    wait_for_count(&ferry, delivered, total, Duration::from_secs(60)).await;
    relay.shutdown().await;
    let recs = read_all(&broker.brokers(), "orders", false, Duration::from_secs(30)).await;
    assert_eq!(distinct(&recs) as i64, total, "nothing lost");
    assert_eq!(order_of(&recs, k), expected, "key {k} in commit order");
    let mut last: HashMap<&str, i64> = HashMap::new();
    let mut seen = HashSet::new();
    for r in recs.iter().filter(|r| r.key != k) {
        if seen.insert(r.outbox_id()) {
            if let Some(prev) = last.insert(&r.key, r.outbox_id()) {
                assert!(prev < r.outbox_id(), "key {} out of order", r.key);
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_a_plain_writer_and_the_library_keep_commit_order() {
    a_plain_writer_and_the_library_keep_commit_order(Capture::Wal).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poll_a_plain_writer_and_the_library_keep_commit_order() {
    a_plain_writer_and_the_library_keep_commit_order(Capture::Poll).await;
}

/// What polling cannot do: with the relay stopped, the library commits a
/// higher id of K, then a plain writer commits a lower one. The WAL holds
/// the commits in that order, and a restarted relay resumes from its slot:
/// Kafka holds K's records in commit order, and what the first relay
/// published is not published again (its slot was confirmed at shutdown).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_a_restart_resumes_from_the_slot_in_commit_order() {
    let broker = Kafka::start();
    broker.create_topic("orders", 3);
    let (ferry, url) = pg_ferry().await;
    let slot = SlotGuard::new().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    crate::relay::write_orders(&ferry, 100, 10).await;
    let relay = slot.start(slot.config(&url, &broker.brokers()), ferry.clone()).await;
    let delivered = "SELECT count(*) FROM outbox WHERE state = 'delivered'";
    wait_for_count(&ferry, delivered, 100, Duration::from_secs(60)).await;
    relay.shutdown().await;
    let confirmed = confirmed_flush(&pool, &slot.name).await;
    assert!(confirmed > 0);

    let k = "k-late";
    let lane = ferry::outbox::lane_for(k, ferry.lanes());
    let mut late = pool.begin().await.unwrap();
    let lower = plain_insert(&mut *late, lane, k, "plain").await;
    let higher = ferry
        .enqueue(&OutboxMessage::bytes("acme", "orders", k, b"library".to_vec()))
        .await
        .unwrap();
    late.commit().await.unwrap();
    crate::relay::write_orders(&ferry, 50, 10).await;

    let relay = slot.start(slot.config(&url, &broker.brokers()), ferry.clone()).await;
    wait_for_count(&ferry, delivered, 152, Duration::from_secs(60)).await;
    relay.shutdown().await;
    assert!(
        confirmed_flush(&pool, &slot.name).await > confirmed,
        "the slot moved on"
    );
    let recs = read_all(&broker.brokers(), "orders", false, Duration::from_secs(30)).await;
    assert_eq!(distinct(&recs), 152, "nothing lost");
    assert_eq!(recs.len(), 152, "nothing published twice across a clean restart");
    assert_eq!(order_of(&recs, k), vec![higher, lower], "commit order, not id order");
}

/// The slot is dropped while the relay streams (its session terminated),
/// and rows are written while it is gone: the relay makes a new slot,
/// publishes the pending rows from the table, and streams on. Nothing is
/// lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_a_dropped_slot_is_made_anew_and_nothing_is_lost() {
    let broker = Kafka::start();
    broker.create_topic("orders", 3);
    let (ferry, url) = pg_ferry().await;
    let slot = SlotGuard::new().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    let relay = slot.start(slot.config(&url, &broker.brokers()), ferry.clone()).await;
    crate::relay::write_orders(&ferry, 100, 10).await;
    let delivered = "SELECT count(*) FROM outbox WHERE state = 'delivered'";
    wait_for_count(&ferry, delivered, 100, Duration::from_secs(60)).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !terminate_and_drop_slot(&pool, &slot.name).await {
        assert!(std::time::Instant::now() < deadline, "could not drop the slot");
    }
    crate::relay::write_orders(&ferry, 100, 10).await;
    wait_for_count(&ferry, delivered, 200, Duration::from_secs(60)).await;
    crate::relay::write_orders(&ferry, 50, 10).await;
    wait_for_count(&ferry, delivered, 250, Duration::from_secs(60)).await;
    relay.shutdown().await;
    let recs = read_all(&broker.brokers(), "orders", false, Duration::from_secs(30)).await;
    assert_eq!(distinct(&recs), 250, "every row reached Kafka");
}

/// The publication is dropped while the relay streams: PostgreSQL cannot
/// decode past that point with a publication created later, so the relay
/// creates the publication and a new slot and publishes the pending rows
/// from the table. Nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_a_missing_publication_is_created_and_nothing_is_lost() {
    let broker = Kafka::start();
    broker.create_topic("orders", 3);
    let (ferry, url) = pg_ferry().await;
    let slot = SlotGuard::new().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    let relay = slot.start(slot.config(&url, &broker.brokers()), ferry.clone()).await;
    crate::relay::write_orders(&ferry, 100, 10).await;
    let delivered = "SELECT count(*) FROM outbox WHERE state = 'delivered'";
    wait_for_count(&ferry, delivered, 100, Duration::from_secs(60)).await;
    sqlx::query(&format!("DROP PUBLICATION {}", slot.name))
        .execute(&pool)
        .await
        .unwrap();
    crate::relay::write_orders(&ferry, 100, 10).await;
    wait_for_count(&ferry, delivered, 200, Duration::from_secs(60)).await;
    relay.shutdown().await;
    let exists: i64 = scalar(
        &ferry,
        &format!("SELECT count(*) FROM pg_publication WHERE pubname = '{}'", slot.name),
    )
    .await;
    assert_eq!(exists, 1, "the relay created the publication again");
    let recs = read_all(&broker.brokers(), "orders", false, Duration::from_secs(30)).await;
    assert_eq!(distinct(&recs), 200, "every row reached Kafka");
}

/// A poison row in the stream: refused in a shared produce request, found
/// by publishing one record at a time, marked dead; the rest flows. Once
/// an operator replays it, the stream publishes it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_a_poison_record_goes_dead_the_stream_flows_and_a_replay_publishes_it() {
    let broker = Kafka::start();
    broker.create_topic_with("orders", 3, &[("max.message.bytes", "2000")]);
    let (ferry, url) = pg_ferry().await;
    let slot = SlotGuard::new().await;
    let relay = slot.start(slot.config(&url, &broker.brokers()), ferry.clone()).await;
    let poison = crate::poison::poison_rows(&ferry).await;
    wait_for_count(
        &ferry,
        "SELECT count(*) FROM outbox WHERE state <> 'pending'",
        7,
        Duration::from_secs(60),
    )
    .await;
    relay.shutdown().await;
    let dead = ferry_relay::store::RelayStore::new(ferry.clone())
        .list_dead_outbox(10)
        .await
        .unwrap();
    assert_eq!(
        dead.iter().map(|d| (d.id, d.last_error.as_deref())).collect::<Vec<_>>(),
        vec![(poison, Some("message_too_large"))]
    );
    let recs = read_all(&broker.brokers(), "orders", false, Duration::from_secs(30)).await;
    assert_eq!(distinct(&recs), 6);
    assert!(recs.iter().all(|r| r.outbox_id() != poison));
    // An operator shrinks the row and replays it (audited): the stream
    // carries the replay, and the row is published.
    let relay = slot.start(slot.config(&url, &broker.brokers()), ferry.clone()).await;
    sqlx::query("UPDATE outbox SET payload = 'small' WHERE id = $1")
        .bind(poison)
        .execute(ferry.db().as_postgres().unwrap())
        .await
        .unwrap();
    let replayed = ferry_relay::store::RelayStore::new(ferry.clone())
        .replay_dead_outbox(Some(poison), "ops", "shrank the record")
        .await
        .unwrap();
    assert_eq!(replayed, vec![poison]);
    wait_for_count(
        &ferry,
        &format!("SELECT count(*) FROM outbox WHERE id = {poison} AND state = 'delivered'"),
        1,
        Duration::from_secs(60),
    )
    .await;
    relay.shutdown().await;
    let recs = read_all(&broker.brokers(), "orders", false, Duration::from_secs(30)).await;
    assert!(
        recs.iter().any(|r| r.outbox_id() == poison),
        "the replayed row reached Kafka"
    );
}

/// `--on-poison=block` in WAL capture: the stream stops at the poison
/// record and keeps retrying it alone; nothing behind it is produced again
/// (records already in flight in a later produce request when it was
/// refused may have landed once: the at-least-once exception README
/// names), the rows before it are delivered, none is dead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_a_poison_record_blocks_the_stream_and_nothing_behind_it_is_produced_again() {
    let broker = Kafka::start();
    broker.create_topic_with("orders", 3, &[("max.message.bytes", "2000")]);
    let (ferry, url) = pg_ferry().await;
    let slot = SlotGuard::new().await;
    let mut cfg = slot.config(&url, &broker.brokers());
    cfg.on_poison = ferry_relay::OnPoison::Block;
    let relay = slot.start(cfg, ferry.clone()).await;
    crate::relay::write_orders(&ferry, 1, 1).await;
    wait_for_count(
        &ferry,
        "SELECT count(*) FROM outbox WHERE state = 'delivered'",
        1,
        Duration::from_secs(60),
    )
    .await;
    let poison = crate::poison::poison_rows(&ferry).await;
    wait_for_count(
        &ferry,
        &format!("SELECT CAST(publish_attempts AS BIGINT) FROM outbox WHERE id = {poison}"),
        3,
        Duration::from_secs(60),
    )
    .await;
    relay.shutdown().await;
    assert_eq!(
        scalar(
            &ferry,
            &format!("SELECT count(*) FROM outbox WHERE state = 'pending' AND id >= {poison}")
        )
        .await,
        4,
        "the poison row and everything after it stay pending"
    );
    assert_eq!(
        scalar(&ferry, "SELECT count(*) FROM outbox WHERE state = 'dead'").await,
        0
    );
    let behind: Vec<i64> = read_all(&broker.brokers(), "orders", false, Duration::from_secs(30))
        .await
        .iter()
        .map(Record::outbox_id)
        .filter(|id| *id >= poison)
        .collect();
    assert!(!behind.contains(&poison), "the poison row never reached Kafka");
    let once: HashSet<i64> = behind.iter().copied().collect();
    assert_eq!(
        once.len(),
        behind.len(),
        "rows behind the blocked row were produced again: {behind:?}"
    );
}

/// The broker is SIGKILLed while the stream has records in flight and stays
/// down until a row has waited 12 s (longer than the 10 s message timeout
/// these tests once set): every record is retried until acknowledged, none
/// fails, and a key's first occurrences keep commit order (with a finite
/// timeout, the records queued behind a timed-out one overtook it when the
/// broker came back). Nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_a_broker_crash_mid_stream_loses_nothing_and_keeps_first_occurrences_in_order() {
    let mut broker = Kafka::start();
    broker.create_topic("orders", 6);
    let (ferry, url) = pg_ferry().await;
    let slot = SlotGuard::new().await;
    let relay = slot.start(slot.config(&url, &broker.brokers()), ferry.clone()).await;
    crate::relay::write_orders(&ferry, 1, 1).await;
    let delivered = "SELECT count(*) FROM outbox WHERE state = 'delivered'";
    wait_for_count(&ferry, delivered, 1, Duration::from_secs(60)).await;
    let writer = {
        let ferry = ferry.clone();
        tokio::spawn(async move { crate::relay::write_orders(&ferry, 2000, 20).await })
    };
    let c = consumer(&broker.brokers(), &["orders"]);
    let mut recs = read_until(&c, Duration::from_secs(60), |r| distinct(r) >= 300).await;
    let before = scalar(&ferry, "SELECT coalesce(max(id), 0) FROM outbox").await;
    broker.kill();
    crate::relay::write_orders(&ferry, 100, 20).await;
    wait_for_a_row_pending_for(&ferry, before, Duration::from_secs(12)).await;
    broker.restart();
    writer.await.unwrap();
    let more = read_until(&c, Duration::from_secs(120), |r| {
        distinct(&[&recs[..], r].concat()) >= 2101
    })
    .await;
    recs.extend(more);
    wait_for_count(&ferry, delivered, 2101, Duration::from_secs(60)).await;
    assert_no_record_timed_out(relay.addr).await;
    relay.shutdown().await;
    let mut seen = HashSet::new();
    let mut last: HashMap<&str, i64> = HashMap::new();
    for r in &recs {
        if seen.insert(r.outbox_id()) {
            if let Some(prev) = last.insert(&r.key, r.outbox_id()) {
                assert!(prev < r.outbox_id(), "key {}: first occurrences out of order", r.key);
            }
        }
    }
}

/// Two relay processes share one slot: the first streams, the second finds
/// the slot in use and stands by. The first is SIGKILLed mid-stream; the
/// standby takes the slot over and resumes from its confirmed position.
/// Every committed row reaches Kafka (a duplicate is the same row), and a
/// key's first occurrences keep their order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_a_sigkilled_relay_loses_nothing_and_its_standby_takes_over() {
    let broker = Kafka::start();
    broker.create_topic("orders", 6);
    let (ferry, url) = pg_ferry().await;
    let slot = SlotGuard::new().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    let mut active = spawn_relay_process(&url, &broker.brokers(), &slot.args(), &[]);
    let streaming = "SELECT count(*) FROM pg_replication_slots WHERE active AND slot_name = ";
    wait_for_count(
        &ferry,
        &format!("{streaming}'{}'", slot.name),
        1,
        Duration::from_secs(60),
    )
    .await;
    let writer = {
        let ferry = ferry.clone();
        tokio::spawn(async move { crate::relay::write_orders(&ferry, 1500, 40).await })
    };
    let c = consumer(&broker.brokers(), &["orders"]);
    let mut recs = read_until(&c, Duration::from_secs(60), |r| distinct(r) >= 300).await;
    let standby = spawn_relay_process(&url, &broker.brokers(), &slot.args(), &[]);
    let before: i32 = sqlx::query_scalar("SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1")
        .bind(&slot.name)
        .fetch_one(&pool)
        .await
        .unwrap();
    active.kill().unwrap(); // SIGKILL mid-stream
    active.wait().unwrap();
    writer.await.unwrap();
    let more = read_until(&c, Duration::from_secs(120), |r| {
        distinct(&[&recs[..], r].concat()) >= 1500
    })
    .await;
    recs.extend(more);
    wait_for_count(
        &ferry,
        &format!(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{}' AND active AND active_pid <> {before}",
            slot.name
        ),
        1,
        Duration::from_secs(30),
    )
    .await;
    drop(standby);
    let mut by_id: HashMap<i64, &Record> = HashMap::new();
    let mut last: HashMap<&str, i64> = HashMap::new();
    for r in &recs {
        match by_id.insert(r.outbox_id(), r) {
            Some(first) => assert_eq!(
                (&first.key, &first.payload),
                (&r.key, &r.payload),
                "a duplicate is the same row"
            ),
            None => {
                if let Some(prev) = last.insert(&r.key, r.outbox_id()) {
                    assert!(prev < r.outbox_id(), "key {}: first occurrences out of order", r.key);
                }
            }
        }
    }
    eprintln!(
        "wal: {} duplicates after one SIGKILL and a takeover, for {} rows",
        recs.len() - by_id.len(),
        by_id.len()
    );
}

/// Without `--capture`, a PostgreSQL relay streams the WAL when it may
/// (here: a superuser, `wal_level = logical`), with the slot named after
/// the database id by default; `--capture poll` polls, and so does
/// `--exactly-once` unless `--capture wal` asks for the WAL (an exactly-once
/// deployment changes capture only when told to). Deciding creates nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_capture_on_postgres_is_wal_when_the_role_may_replicate() {
    let (ferry, url) = pg_ferry().await;
    let store = ferry_relay::store::RelayStore::new(ferry.clone());
    let mut cfg = RelayConfig::new(&url, "127.0.0.1:1");
    let wal = ferry_relay::wal::plan(&cfg, &store, "relay-1")
        .await
        .unwrap()
        .expect("wal");
    let database_id = ferry.database_id().await.unwrap();
    assert_eq!(wal.slot, ferry_relay::wal::default_slot(&database_id));
    assert!(wal.slot.starts_with("ferry_") && wal.slot.len() == 18, "{}", wal.slot);
    assert_eq!(wal.publication, wal.slot);
    cfg.exactly_once = true;
    assert!(ferry_relay::wal::plan(&cfg, &store, "relay-1").await.unwrap().is_none());
    cfg.exactly_once = false;
    cfg.capture = Some(Capture::Poll);
    assert!(ferry_relay::wal::plan(&cfg, &store, "relay-1").await.unwrap().is_none());
    cfg.capture = Some(Capture::Wal);
    cfg.exactly_once = true;
    let wal = ferry_relay::wal::plan(&cfg, &store, "relay-1")
        .await
        .unwrap()
        .expect("--capture wal --exactly-once streams the WAL");
    assert_eq!(wal.slot, ferry_relay::wal::default_slot(&database_id));
    assert_eq!(
        scalar(
            &ferry,
            &format!(
                "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{}'",
                wal.slot
            )
        )
        .await,
        0
    );
}

/// `--capture wal` is refused on SQLite with a configuration error, before
/// anything is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_capture_is_refused_on_sqlite() {
    let t = ferry_testkit::TestDb::new(ferry::Engine::Sqlite).await;
    let mut cfg = relay_config("sqlite://unused", "127.0.0.1:1");
    cfg.capture = Some(Capture::Wal);
    let relay = ferry_relay::Relay::new(cfg, t.ferry.clone()).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let err = relay.run(listener, std::future::pending()).await.unwrap_err();
    assert_eq!(err.code(), "config", "{err}");
}
