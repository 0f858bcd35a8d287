//! What only WAL capture has to survive and show: the slot's lag and
//! activity in the relay's metrics and in `status`, a slot PostgreSQL
//! invalidated (`max_slot_wal_keep_size`) recovered from the table, and
//! faults in the middle of the stream. Tests that change server settings or
//! stop PostgreSQL run on a cluster of their own (`PgCluster`); the others
//! stream from a slot of their own on the shared one ([`SlotGuard`]).

use std::time::Duration;

use ferry::{Ferry, OutboxMessage};
use ferry_relay::{Capture, RelayConfig};
use ferry_testkit::{Kafka, PgCluster};
use serde_json::json;

use crate::support::*;

/// The value of `metric{slot="<slot>"}` (or of its labelled variant with
/// `extra` labels) in a Prometheus exposition; `None` when absent.
fn slot_metric(text: &str, metric: &str, slot: &str, extra: &str) -> Option<f64> {
    let head = format!("{metric}{{slot=\"{slot}\"{extra}}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&head))
        .map(|v| v.trim().parse().unwrap())
}

/// The slot's lag as PostgreSQL reports it now.
async fn lag_now(pool: &sqlx::PgPool, slot: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(slot)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// While the relay streams, the slot is active in the metrics and in
/// `status`; once it stopped and rows wait, the metrics show the WAL the
/// slot holds back (what `pg_replication_slots` shows around the scrape)
/// and the time the oldest waiting row has waited, and `status` shows it
/// inactive with its lag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_slot_lag_and_activity_show_in_the_metrics_and_status() {
    let broker = Kafka::start();
    broker.create_topic("orders", 2);
    let (ferry, url) = pg_ferry().await;
    let slot = SlotGuard::new().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    let relay = slot.start(slot.config(&url, &broker.brokers()), ferry.clone()).await;
    let active = format!(
        "SELECT count(*) FROM pg_replication_slots WHERE active AND slot_name = '{}'",
        slot.name
    );
    wait_for_count(&ferry, &active, 1, Duration::from_secs(60)).await;
    let state = relay.state.clone();
    state.refresh_gauges().await;
    let m = state.metrics.render();
    assert_eq!(
        slot_metric(&m, "ferry_relay_wal_slot_active", &slot.name, ""),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        slot_metric(
            &m,
            "ferry_relay_wal_slot_status",
            &slot.name,
            ",wal_status=\"reserved\""
        ),
        Some(1.0),
        "{m}"
    );
    let store = ferry_relay::store::RelayStore::new(ferry.clone());
    let status = ferry_relay::status::report(&store).await.unwrap();
    assert!(status.contains("capture             wal\n"), "{status}");
    assert!(
        status.contains(&format!("wal slot {:<31} active (streaming), lag ", slot.name)),
        "{status}"
    );
    relay.shutdown().await;

    // Rows written while no relay streams, the oldest 30 s ago.
    for i in 0..50 {
        sqlx::query(
            "INSERT INTO outbox (tenant, topic, key, lane, payload, headers, created_at)
             VALUES ('acme', 'orders', 'k', 0, convert_to($1, 'UTF8'), '{}'::jsonb,
                     (extract(epoch FROM clock_timestamp()) * 1000)::bigint - 30000)",
        )
        .bind(format!("{{\"i\":{i}}}"))
        .execute(&pool)
        .await
        .unwrap();
    }
    let before = lag_now(&pool, &slot.name).await;
    state.refresh_gauges().await;
    let after = lag_now(&pool, &slot.name).await;
    let m = state.metrics.render();
    let bytes = slot_metric(&m, "ferry_relay_wal_slot_lag_bytes", &slot.name, "").unwrap() as i64;
    assert!(
        before > 0 && (before..=after).contains(&bytes),
        "lag {bytes} bytes, PostgreSQL said {before}..{after}"
    );
    let secs = slot_metric(&m, "ferry_relay_wal_slot_lag_seconds", &slot.name, "").unwrap();
    assert!(
        (30.0..90.0).contains(&secs),
        "time lag {secs}s for a row written 30 s ago"
    );
    assert_eq!(
        slot_metric(&m, "ferry_relay_wal_slot_active", &slot.name, ""),
        Some(0.0),
        "{m}"
    );
    let status = ferry_relay::status::report(&store).await.unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with(&format!("wal slot {} ", slot.name)))
        .unwrap_or_else(|| panic!("{status}"));
    assert!(
        line.contains(" inactive, lag ") && line.contains(", wal_status reserved"),
        "{line}"
    );
    assert!(status.contains("capture             none"), "{status}");
}

/// A relay of `--capture wal` on slot `slot` of a test cluster.
fn cluster_relay(pg: &PgCluster, brokers: &str, slot: &str) -> RelayConfig {
    let mut cfg = relay_config(&pg.url(), brokers);
    cfg.capture = Some(Capture::Wal);
    cfg.slot = Some(slot.into());
    cfg.batch_size = 200;
    cfg
}

/// Enqueues rows `from..to` of [`KEYS`] keys on `orders`.
async fn enqueue(ferry: &Ferry, from: usize, to: usize) {
    for i in from..to {
        let msg = OutboxMessage::json("acme", "orders", format!("key-{}", i % KEYS), &json!({ "i": i })).unwrap();
        ferry.enqueue(&msg).await.unwrap();
    }
}

const KEYS: usize = 20;

/// Every committed row is on `recs` and each key's first occurrences keep
/// id order; returns the number of duplicates.
fn nothing_lost(recs: &[Record], ids: &[i64]) -> usize {
    let first = first_occurrences(recs);
    let lost: Vec<&i64> = ids.iter().filter(|id| !first.contains_key(id)).collect();
    assert!(
        lost.is_empty(),
        "{} committed rows never published: {:?}",
        lost.len(),
        &lost[..lost.len().min(10)]
    );
    recs.len() - first.len()
}

/// Every outbox id, in order.
async fn all_ids(ferry: &Ferry) -> Vec<i64> {
    sqlx::query_scalar("SELECT id FROM outbox ORDER BY id")
        .fetch_all(ferry.db().as_postgres().unwrap())
        .await
        .unwrap()
}

/// With `max_slot_wal_keep_size = 1MB`, the relay stopped and rows written,
/// PostgreSQL removes WAL the slot needs (`wal_status = 'lost'`); the next
/// relay drops the slot, makes it anew and publishes the rows not delivered
/// from the table, then streams on. Nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_an_invalidated_slot_is_made_anew_and_the_undelivered_rows_are_published() {
    let broker = Kafka::start();
    broker.create_topic("orders", 4);
    let pg = PgCluster::start();
    pg.configure(&[("max_slot_wal_keep_size", "1MB")]).await;
    let ferry = Ferry::builder(pg.url()).migrate(true).connect().await.unwrap();
    let cfg = cluster_relay(&pg, &broker.brokers(), "ferry_lost");
    let relay = start_relay(cfg.clone(), ferry.clone()).await;
    enqueue(&ferry, 0, 100).await;
    let delivered = "SELECT count(*) FROM outbox WHERE state = 'delivered'";
    wait_for_count(&ferry, delivered, 100, Duration::from_secs(60)).await;
    relay.shutdown().await;

    enqueue(&ferry, 100, 300).await;
    pg.invalidate_slot("ferry_lost").await;
    let relay = start_relay(cfg, ferry.clone()).await;
    enqueue(&ferry, 300, 400).await;
    wait_for_count(&ferry, delivered, 400, Duration::from_secs(60)).await;
    let status: String = sqlx::query_scalar(
        "SELECT wal_status::text FROM pg_replication_slots WHERE slot_name = 'ferry_lost' AND active",
    )
    .fetch_one(ferry.db().as_postgres().unwrap())
    .await
    .unwrap();
    assert_eq!(status, "reserved", "the slot was made anew and streams");
    relay.shutdown().await;
    let recs = read_all(&broker.brokers(), "orders", false, Duration::from_secs(60)).await;
    let duplicates = nothing_lost(&recs, &all_ids(&ferry).await);
    eprintln!("invalidated slot: {duplicates} duplicates for 400 rows");
}
