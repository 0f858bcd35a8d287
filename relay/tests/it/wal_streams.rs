//! `--streams N`: the outbox split by lane into N slots with row-filtered
//! publications, spread over the group's relays, moved off a dead relay,
//! and N changed on a running database. (The conformance scenarios run
//! with N = 2 too: `<scenario>::wal_streams`.)

use std::collections::HashSet;
use std::time::{Duration, Instant};

use ferry::{Ferry, OutboxMessage};
use ferry_testkit::Kafka;
use serde_json::json;

use crate::support::*;

const KEYS: usize = 24;

/// `n` rows from `from` on, over [`KEYS`] keys (so over every lane).
async fn enqueue(ferry: &Ferry, from: usize, n: usize) {
    for i in from..from + n {
        let msg = OutboxMessage::json("acme", "orders", format!("key-{}", i % KEYS), &json!({ "i": i })).unwrap();
        ferry.enqueue(&msg).await.unwrap();
    }
}

/// Who streams each of `slots` now: the relay's `--relay-id` from its
/// replication connection's `application_name` (`None`: nobody).
async fn stream_owners(pool: &sqlx::PgPool, slots: &[String]) -> Vec<Option<String>> {
    let mut out = Vec::new();
    for slot in slots {
        let owner: Option<String> = sqlx::query_scalar(
            "SELECT r.application_name::text FROM pg_replication_slots s
             JOIN pg_stat_replication r ON r.pid = s.active_pid WHERE s.slot_name = $1",
        )
        .bind(slot)
        .fetch_optional(pool)
        .await
        .unwrap();
        out.push(owner.map(|a| a.trim_start_matches("ferry-relay ").to_string()));
    }
    out
}

/// Waits until `ok` holds of the streams' owners.
async fn wait_for_owners(pool: &sqlx::PgPool, slots: &[String], what: &str, ok: impl Fn(&[Option<String>]) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let owners = stream_owners(pool, slots).await;
        if ok(&owners) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: the streams' owners are {owners:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Two relays with `--streams 2` on a slot of their own, once each streams
/// one stream.
async fn two_relays_one_stream_each(
    ferry: &Ferry,
    url: &str,
    brokers: &str,
) -> (SlotGuard, RunningRelay, RunningRelay) {
    let pool = ferry.db().as_postgres().unwrap().clone();
    let slot = STREAMS.scope(2, SlotGuard::new()).await;
    let a = slot.start(slot.config(url, brokers), ferry.clone()).await;
    let b = slot
        .start(slot.config(url, brokers), Ferry::builder(url).connect().await.unwrap())
        .await;
    wait_for_owners(&pool, &slot.slots(), "one stream each", |o| {
        o.iter().all(Option::is_some) && o[0] != o[1]
    })
    .await;
    (slot, a, b)
}

/// Two relays with `--streams 2`: each streams one stream (its slot, with a
/// publication filtered on its lanes), every row reaches Kafka once, and
/// each key's records are in commit order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_streams_split_the_outbox_by_lane_and_spread_over_the_relays() {
    let broker = Kafka::start();
    broker.create_topic("orders", 4);
    let brokers = broker.brokers();
    let (ferry, url) = pg_ferry().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    let (slot, a, b) = two_relays_one_stream_each(&ferry, &url, &brokers).await;
    let slots = slot.slots();
    for (k, name) in slots.iter().enumerate() {
        let filter: String = sqlx::query_scalar("SELECT rowfilter FROM pg_publication_tables WHERE pubname = $1")
            .bind(name)
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(filter, format!("((lane % 2) = {k})"));
    }
    enqueue(&ferry, 0, 400).await;
    wait_for_count(&ferry, &DELIVERED, 400, Duration::from_secs(60)).await;
    let (pa, pb) = (a.state.metrics.published.get(), b.state.metrics.published.get());
    a.shutdown().await;
    b.shutdown().await;
    let recs = read_all(&brokers, "orders", false, Duration::from_secs(30)).await;
    assert_once_in_commit_order(&recs, 400);
    assert!(pa > 0 && pb > 0, "both relays published (a: {pa}, b: {pb})");
}

/// Two relays share two streams under steady writes; one dies (its task
/// dropped: connections cut, no goodbye). Its stream moves to the other
/// once its heartbeat expires; nothing is lost and each key's first
/// occurrences stay in commit order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_streams_a_dead_relays_stream_moves_to_the_others() {
    let broker = Kafka::start();
    broker.create_topic("orders", 4);
    let brokers = broker.brokers();
    let (ferry, url) = pg_ferry().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    let (slot, a, b) = two_relays_one_stream_each(&ferry, &url, &brokers).await;
    let slots = slot.slots();
    let writer = {
        let ferry = ferry.clone();
        tokio::spawn(async move {
            for round in 0..40 {
                enqueue(&ferry, round * 20, 20).await;
            }
        })
    };
    wait_for_count(&ferry, &DELIVERED, 100, Duration::from_secs(60)).await;
    let survivor = a.state.owner.clone();
    b.handle.abort();
    wait_for_owners(&pool, &slots, "the survivor streams both", |o| {
        o.iter().all(|x| x.as_deref() == Some(survivor.as_str()))
    })
    .await;
    writer.await.unwrap();
    wait_for_count(&ferry, &DELIVERED, 800, Duration::from_secs(90)).await;
    a.shutdown().await;
    let recs = read_all(&brokers, "orders", false, Duration::from_secs(30)).await;
    nothing_lost(&recs, &all_ids(&ferry).await);
}

/// Changing N on a running database: a relay streams the outbox as one
/// stream under steady writes; a relay started with `--streams 2` takes
/// the group over. The first stops streaming and stands by (saying why); the
/// old slot is dropped once idle and the two new ones made (their table
/// reads publish what the old stream had not marked). Nothing is lost,
/// each key's first occurrences stay in commit order, and the old relay
/// never makes its slot again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_streams_changing_n_loses_and_reorders_nothing() {
    let broker = Kafka::start();
    broker.create_topic("orders", 4);
    let brokers = broker.brokers();
    let (ferry, url) = pg_ferry().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    let slot = STREAMS.scope(2, SlotGuard::new()).await;
    let mut one = slot.config(&url, &brokers);
    one.streams = 1;
    let old = slot.start(one, ferry.clone()).await;
    wait_for_streaming(&pool, &slot.name, None, Duration::from_secs(60)).await;
    let writer = {
        let ferry = ferry.clone();
        tokio::spawn(async move {
            for round in 0..40 {
                enqueue(&ferry, round * 20, 20).await;
            }
        })
    };
    wait_for_count(&ferry, &DELIVERED, 100, Duration::from_secs(60)).await;
    let new = slot
        .start(
            slot.config(&url, &brokers),
            Ferry::builder(&url).connect().await.unwrap(),
        )
        .await;
    let slots = slot.slots();
    let owner = new.state.owner.clone();
    wait_for_owners(&pool, &slots, "the new relay streams both", |o| {
        o.iter().all(|x| x.as_deref() == Some(owner.as_str()))
    })
    .await;
    writer.await.unwrap();
    wait_for_count(&ferry, &DELIVERED, 800, Duration::from_secs(90)).await;
    let gone: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1")
        .bind(&slot.name)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(gone, 0, "the one-stream slot was dropped and not made again");
    let ended = old.state.metrics.render();
    assert!(
        ended.contains(r#"ferry_relay_wal_sessions_ended_total{code="stream_layout_changed"}"#),
        "the relay of the old layout said why it stands by: {ended}"
    );
    old.shutdown().await;
    new.shutdown().await;
    let recs = read_all(&brokers, "orders", false, Duration::from_secs(30)).await;
    let ids = all_ids(&ferry).await;
    nothing_lost(&recs, &ids);
    let distinct: HashSet<i64> = recs.iter().map(|r| r.outbox_id()).collect();
    assert_eq!(distinct.len(), ids.len());
}
