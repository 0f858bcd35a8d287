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
use rdkafka::consumer::Consumer;
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
    wait_for_streaming(&pool, &slot.name, None, Duration::from_secs(60)).await;
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
    let status = store.ferry().operator().status_report().await.unwrap();
    assert!(status.contains("capture             wal\n"), "{status}");
    assert!(
        status.contains(&format!(
            "wal slot {:<31} active (streaming to ferry-relay {}), lag ",
            slot.name, relay.state.owner
        )),
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
    let status = store.ferry().operator().status_report().await.unwrap();
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

/// A quiet outbox does not hold back the WAL of the rest of the database:
/// while only other tables are written, the slot's confirmed position still
/// follows the server's (the relay confirms the keepalive's position once
/// nothing is open or in flight). Without that, PostgreSQL keeps every WAL
/// segment written since the last outbox row until its disk fills, which is
/// why Debezium users configure a heartbeat table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_a_quiet_outbox_does_not_hold_back_the_wal_of_other_tables() {
    let broker = Kafka::start();
    let (ferry, url) = pg_ferry().await;
    let slot = SlotGuard::new().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    let relay = slot.start(slot.config(&url, &broker.brokers()), ferry.clone()).await;
    wait_for_streaming(&pool, &slot.name, None, Duration::from_secs(60)).await;
    sqlx::query("CREATE TABLE not_the_outbox (id BIGSERIAL PRIMARY KEY, body TEXT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("INSERT INTO not_the_outbox (body) SELECT repeat('x', 200) FROM generate_series(1, 20000)")
        .execute(&pool)
        .await
        .unwrap();
    let written: i64 = sqlx::query_scalar("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint")
        .fetch_one(&pool)
        .await
        .unwrap();
    // PostgreSQL sends a keepalive once the walsender has caught up and the
    // client's confirmed position is behind it; at the latest after half
    // of wal_sender_timeout (60 s by default).
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    loop {
        let confirmed = confirmed_flush(&pool, &slot.name).await;
        if confirmed >= written {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the slot stayed at {confirmed}, {} bytes behind the other table's writes",
            written - confirmed
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(scalar(&ferry, "SELECT count(*) FROM outbox").await, 0);
    relay.shutdown().await;
}

/// A slot is `active` in `pg_replication_slots` while
/// `pg_create_logical_replication_slot` waits for the transactions running
/// when it started; no relay streams from it then, and the gauges and
/// `status` must not say one does (they said so before they asked
/// `pg_stat_replication` for a walsender).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_a_slot_being_created_is_not_shown_as_streaming() {
    let (ferry, _url) = pg_ferry().await;
    let slot = SlotGuard::new().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    let mut running = pool.begin().await.unwrap();
    sqlx::query("SELECT txid_current()")
        .execute(&mut *running)
        .await
        .unwrap();
    let store = ferry_relay::store::RelayStore::new(ferry.clone());
    let creating = {
        let (store, name) = (store.clone(), slot.name.clone());
        tokio::spawn(async move { store.create_wal_slot(&name, false, std::future::pending()).await })
    };
    let held = format!(
        "SELECT count(*) FROM pg_replication_slots WHERE active AND slot_name = '{}'",
        slot.name
    );
    wait_for_count(&ferry, &held, 1, Duration::from_secs(60)).await;
    let shown = store.ferry().operator().wal_slots().await.unwrap();
    let ours = shown.iter().find(|s| s.slot == slot.name).expect("the slot is listed");
    assert!(ours.present && !ours.active, "{ours:?}");
    assert_eq!(streaming_pid(&pool, &slot.name).await, None);
    running.commit().await.unwrap();
    assert!(creating.await.unwrap().unwrap(), "the slot was made");
}

/// A relay started on a new slot while a transaction holds an xid waits in
/// the slot's creation (for every transaction running then to end):
/// SIGTERM stops it within its grace, and the slot is not made (its
/// creating session ended). Once the transaction ends, a fresh relay makes
/// the slot and publishes the rows from before and after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_shutdown_while_the_slot_waits_to_be_made_returns_within_the_grace() {
    let broker = Kafka::start();
    broker.create_topic("orders", 3);
    let (ferry, url) = pg_ferry().await;
    let slot = SlotGuard::new().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    crate::relay::write_orders(&ferry, 5, 5).await;
    let mut running = pool.begin().await.unwrap();
    sqlx::query("SELECT txid_current()")
        .execute(&mut *running)
        .await
        .unwrap();
    let cfg = slot.config(&url, &broker.brokers());
    let grace = cfg.grace;
    let relay = slot.start(cfg.clone(), ferry.clone()).await;
    let present = format!(
        "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{}'",
        slot.name
    );
    wait_for_count(&ferry, &format!("{present} AND active"), 1, Duration::from_secs(60)).await;
    relay.stop.cancel();
    tokio::time::timeout(grace, relay.handle)
        .await
        .expect("the relay did not stop within its grace while its slot waited to be made")
        .unwrap()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while scalar(&ferry, &present).await > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the slot's creation outlived the relay"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    running.commit().await.unwrap();
    let relay = slot.start(cfg, ferry.clone()).await;
    wait_for_streaming(&pool, &slot.name, None, Duration::from_secs(60)).await;
    crate::relay::write_orders(&ferry, 5, 5).await;
    wait_for_count(&ferry, &DELIVERED, 10, Duration::from_secs(60)).await;
    relay.shutdown().await;
    let recs = read_all(&broker.brokers(), "orders", false, Duration::from_secs(30)).await;
    assert_eq!(distinct(&recs), 10, "every row reached Kafka");
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
    let delivered = &format!("SELECT count(*) FROM {OUTBOX} WHERE state = 'delivered'");
    wait_for_count(&ferry, delivered, 100, Duration::from_secs(60)).await;
    relay.shutdown().await;
    let first = scalar(&ferry, "SELECT max(id) FROM outbox").await;
    let published = read_all(&broker.brokers(), "orders", false, Duration::from_secs(60))
        .await
        .len();

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
    let again = recs.iter().filter(|r| r.outbox_id() <= first).count();
    assert_eq!(
        again, published,
        "the rows delivered before the slot was lost are not published again"
    );
    let duplicates = nothing_lost(&recs, &all_ids(&ferry).await);
    eprintln!("invalidated slot: {duplicates} duplicates for 400 rows");
}

/// A relay process is SIGKILLed while it publishes one 20,001-row
/// transaction: some of its `orders` rows are on the topic, but its last
/// row's topic does not exist yet, so the transaction cannot settle and no
/// row of it may be marked (whatever the machine's speed). The topic is then
/// made and a second relay resumes from the slot: every row is published,
/// each key's first occurrences in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_a_relay_sigkilled_in_the_middle_of_a_large_transaction_loses_nothing() {
    let broker = Kafka::start();
    broker.create_topic("orders", 6);
    let (ferry, url) = pg_ferry().await;
    let slot = SlotGuard::new().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    let mut first = spawn_relay_process(&url, &broker.brokers(), &slot.args(), &[]);
    wait_for_streaming(&pool, &slot.name, None, Duration::from_secs(60)).await;
    let c = consumer(&broker.brokers(), &["orders"]);
    let mut tx = pool.begin().await.unwrap();
    insert_many(&mut *tx, 20_000, None).await;
    sqlx::query(
        "INSERT INTO outbox (tenant, topic, key, lane, payload, headers, created_at)
         VALUES ('acme', 'later', 'last', 0, convert_to('{}', 'UTF8'), '{}'::jsonb, 0)",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let seen = read_until(&c, Duration::from_secs(60), |r| !r.is_empty()).await;
    first.kill().unwrap(); // SIGKILL mid-transaction
    first.wait().unwrap();
    let at_kill = scalar(&ferry, &DELIVERED).await;
    assert_eq!(at_kill, 0, "rows of an unsettled transaction were marked");
    broker.create_topic("later", 1);
    let second = spawn_relay_process(&url, &broker.brokers(), &slot.args(), &[]);
    wait_for_count(&ferry, &DELIVERED, 20_001, Duration::from_secs(180)).await;
    drop(second);
    let recs = read_all(&broker.brokers(), "orders", false, Duration::from_secs(120)).await;
    let orders: Vec<i64> = sqlx::query_scalar("SELECT id FROM outbox WHERE topic = 'orders' ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    let duplicates = nothing_lost(&recs, &orders);
    let later = read_all(&broker.brokers(), "later", false, Duration::from_secs(60)).await;
    assert_eq!(later.len(), 1, "the transaction's last row is published once");
    eprintln!(
        "SIGKILL mid-transaction ({} records seen before it): {duplicates} duplicates",
        seen.len()
    );
}

/// PostgreSQL restarts (a fast or an immediate shutdown) while the relay
/// streams and a writer keeps enqueueing: the relay resumes from the slot on
/// its own and nothing is lost.
async fn a_postgres_restart_while_streaming_loses_nothing(immediate: bool) {
    let broker = Kafka::start();
    broker.create_topic("orders", 4);
    let mut pg = PgCluster::start();
    let ferry = Ferry::builder(pg.url()).migrate(true).connect().await.unwrap();
    let cfg = cluster_relay(&pg, &broker.brokers(), "ferry_restart");
    let relay = start_relay(cfg, Ferry::builder(pg.url()).connect().await.unwrap()).await;
    let writer = tokio::spawn(crate::outage::write_through_outage(ferry.clone(), 0, 3000));
    crate::outage::until_at_least(&ferry, &DELIVERED, 500, Duration::from_secs(90)).await;
    tokio::task::block_in_place(|| {
        if immediate {
            pg.crash();
        }
        pg.restart();
    });
    writer.await.unwrap();
    let total = ferry.db().fetch_i64("SELECT count(*) FROM outbox").await.unwrap();
    crate::outage::until_at_least(&ferry, &DELIVERED, total, Duration::from_secs(120)).await;
    relay.shutdown().await;
    let recs = read_all(&broker.brokers(), "orders", false, Duration::from_secs(60)).await;
    let duplicates = nothing_lost(&recs, &all_ids(&ferry).await);
    eprintln!("PostgreSQL restart (immediate: {immediate}): {duplicates} duplicates for {total} rows");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_a_fast_postgres_restart_while_streaming_loses_nothing() {
    a_postgres_restart_while_streaming_loses_nothing(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_an_immediate_postgres_restart_while_streaming_loses_nothing() {
    a_postgres_restart_while_streaming_loses_nothing(true).await;
}

/// A schema change while the relay streams and a writer enqueues (issue
/// #32): run on the shared cluster, `{publication}` standing for the
/// slot's publication. The relay keeps publishing (a row written through
/// the library after the change included) and loses nothing, within a
/// bound: a silent stall fails the test.
async fn a_schema_change_while_streaming_loses_nothing(change: &str) {
    a_schema_change_while_streaming(change, false).await
}

/// [`a_schema_change_while_streaming_loses_nothing`], waiting after the
/// change, when `remade`, for the relay to make the slot anew (the
/// change's repair, which must come whatever the timing).
async fn a_schema_change_while_streaming(change: &str, remade: bool) {
    let broker = Kafka::start();
    broker.create_topic("orders", 4);
    let (ferry, url) = pg_ferry().await;
    let slot = SlotGuard::new().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    let relay = slot.start(slot.config(&url, &broker.brokers()), ferry.clone()).await;
    let writer = {
        let ferry = ferry.clone();
        tokio::spawn(async move { enqueue(&ferry, 0, 1000).await })
    };
    wait_for_count(&ferry, &DELIVERED, 200, Duration::from_secs(60)).await;
    let made = &format!("SELECT generation FROM relay_wal_slots WHERE slot = '{}'", slot.name);
    let before = scalar(&ferry, made).await;
    sqlx::raw_sql(&change.replace("{publication}", &slot.name))
        .execute(&pool)
        .await
        .unwrap();
    if remade {
        wait_for_relay_count(&ferry, &relay, made, before + 1, Duration::from_secs(60)).await;
    }
    writer.await.unwrap();
    enqueue(&ferry, 1000, 1001).await;
    wait_for_relay_count(&ferry, &relay, &DELIVERED, 1001, Duration::from_secs(90)).await;
    relay.shutdown().await;
    let recs = read_all(&broker.brokers(), "orders", false, Duration::from_secs(60)).await;
    let duplicates = nothing_lost(&recs, &all_ids(&ferry).await);
    eprintln!("{change}: {duplicates} duplicates for 1001 rows");
}

/// A column added: pgoutput sends a new `Relation` message with one more
/// column, and the decoder takes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_a_column_added_while_streaming_loses_nothing() {
    a_schema_change_while_streaming_loses_nothing("ALTER TABLE outbox ADD COLUMN note text DEFAULT 'added'").await;
}

/// Columns' types changed, one of them rewriting the table (`integer` to
/// `bigint`): a new `Relation` message with other type ids.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_a_column_type_changed_while_streaming_loses_nothing() {
    a_schema_change_while_streaming_loses_nothing(
        "ALTER TABLE outbox ALTER COLUMN key TYPE varchar(400), ALTER COLUMN publish_attempts TYPE bigint",
    )
    .await;
}

/// The table rewritten in place (`VACUUM FULL`: new files, same relation).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_the_table_rewritten_while_streaming_loses_nothing() {
    a_schema_change_while_streaming_loses_nothing("VACUUM FULL outbox").await;
}

/// The publication dropped and made again: the relay sees its new oid and
/// makes the slot anew (pgoutput may keep deciding from the old
/// publication's cached membership and skip rows without an error), and
/// the table read publishes what the old stream left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_the_publication_made_again_while_streaming_loses_nothing() {
    a_schema_change_while_streaming(
        "DROP PUBLICATION {publication}; CREATE PUBLICATION {publication} FOR TABLE outbox WITH (publish = 'insert')",
        true,
    )
    .await;
}

/// A publication made again is caught at the next row, not by the periodic
/// check racing it: pgoutput (PostgreSQL 15+, what the suite runs) sends
/// the table's schema again before the first row it decides on anew (as before the first it publishes after
/// skipping rows on the old publication's cached membership), and the
/// relay checks the publication there, before publishing that row. With
/// the periodic check off (the failpoint), one row written after the
/// change makes the slot anew; nothing is lost and each key's rows come
/// in commit order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_the_publication_made_again_is_caught_before_the_next_row() {
    let broker = Kafka::start();
    broker.create_topic("orders", 4);
    let (ferry, url) = pg_ferry().await;
    let slot = SlotGuard::new().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    let relay = spawn_relay_process(
        &url,
        &broker.brokers(),
        &slot.args(),
        &[("FERRY_RELAY_FAILPOINT", "no-periodic-publication-check")],
    );
    enqueue(&ferry, 0, 100).await;
    wait_for_count(&ferry, &DELIVERED, 100, Duration::from_secs(60)).await;
    let made = &format!("SELECT generation FROM relay_wal_slots WHERE slot = '{}'", slot.name);
    let before = scalar(&ferry, made).await;
    sqlx::raw_sql(&format!(
        "DROP PUBLICATION {0}; CREATE PUBLICATION {0} FOR TABLE outbox WITH (publish = 'insert')",
        slot.name
    ))
    .execute(&pool)
    .await
    .unwrap();
    enqueue(&ferry, 100, 101).await;
    wait_for_count(&ferry, made, before + 1, Duration::from_secs(60)).await;
    enqueue(&ferry, 101, 200).await;
    wait_for_count(&ferry, &DELIVERED, 200, Duration::from_secs(60)).await;
    drop(relay);
    let recs = read_all(&broker.brokers(), "orders", false, Duration::from_secs(60)).await;
    nothing_lost(&recs, &all_ids(&ferry).await);
}

/// The publication dropped and not made again (by an operator's mistake).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_the_publication_dropped_while_streaming_loses_nothing() {
    a_schema_change_while_streaming_loses_nothing("DROP PUBLICATION {publication}").await;
}

/// The table replaced by a copy (a new relation id: the publication, which
/// follows the relation id, no longer covers any `outbox`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_the_table_replaced_by_a_copy_while_streaming_loses_nothing() {
    a_schema_change_while_streaming_loses_nothing(
        "BEGIN;
         LOCK TABLE outbox;
         ALTER TABLE outbox RENAME TO outbox_old;
         CREATE TABLE outbox (LIKE outbox_old INCLUDING ALL);
         INSERT INTO outbox OVERRIDING SYSTEM VALUE SELECT * FROM outbox_old;
         SELECT setval(pg_get_serial_sequence('outbox', 'id'), (SELECT max(id) FROM outbox));
         DROP TABLE outbox_old;
         COMMIT;",
    )
    .await;
}

/// Two transactions of 2,000 rows of one key, each larger than
/// `logical_decoding_work_mem = 64kB` (PostgreSQL spills them to disk), the
/// one with the lower ids committing last: every row is published, the
/// key's records in commit order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_transactions_larger_than_logical_decoding_work_mem_are_published_in_commit_order() {
    let broker = Kafka::start();
    broker.create_topic("orders", 4);
    let pg = PgCluster::start();
    pg.configure(&[("logical_decoding_work_mem", "64kB")]).await;
    let ferry = Ferry::builder(pg.url()).migrate(true).connect().await.unwrap();
    let pool = ferry.db().as_postgres().unwrap().clone();
    let relay = start_relay(cluster_relay(&pg, &broker.brokers(), "ferry_spill"), ferry.clone()).await;
    wait_for_streaming(&pool, "ferry_spill", None, Duration::from_secs(60)).await;
    let mut first = pool.begin().await.unwrap();
    let low = insert_many(&mut *first, 2000, Some("big")).await;
    let mut second = pool.begin().await.unwrap();
    let high = insert_many(&mut *second, 2000, Some("big")).await;
    second.commit().await.unwrap();
    first.commit().await.unwrap();
    wait_for_count(&ferry, &DELIVERED, 4000, Duration::from_secs(120)).await;
    let spilled: i64 = sqlx::query_scalar(
        "SELECT COALESCE(sum(spill_bytes), 0)::bigint FROM pg_stat_replication_slots WHERE slot_name = 'ferry_spill'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(spilled > 0, "the transactions did not exceed logical_decoding_work_mem");
    relay.shutdown().await;
    let recs = read_all(&broker.brokers(), "orders", false, Duration::from_secs(60)).await;
    let mut seen = std::collections::HashSet::new();
    let order: Vec<i64> = recs
        .iter()
        .map(Record::outbox_id)
        .filter(|id| seen.insert(*id))
        .collect();
    let commit_order: Vec<i64> = high.iter().chain(&low).copied().collect();
    assert_eq!(order.len(), 4000, "every row published");
    assert!(order == commit_order, "the key's records are not in commit order");
}

/// Fencing with a frozen relay. Two relay processes on one slot; the active
/// one is SIGSTOPped while a writer enqueues. Its walsender gets no reply
/// and ends the session after `wal_sender_timeout` (2 s here), and the
/// standby takes the slot over within that plus its retry interval. Once
/// the standby published everything, the old relay is SIGCONTed: its
/// session is gone, so it cannot confirm the slot, and its marks touch only
/// rows still pending; whatever it produces then is its unconfirmed tail
/// (what the walsender sent it before ending the session, which its socket
/// buffers held while it was frozen: all committed before the takeover),
/// never a row committed after the takeover. Nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_a_frozen_relay_is_fenced_and_publishes_nothing_new_after_sigcont() {
    a_frozen_relay_is_fenced(1).await
}

/// The same in two streams (`--streams 2`): the frozen relay streams one,
/// the other relay the other; the frozen one's stream moves to the other
/// relay once its walsender and its membership expired, and after SIGCONT
/// it takes a stream back only as the other relay yields it (settled,
/// marked, confirmed). Nothing is lost, and no row committed after the
/// takeover comes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_streams_a_frozen_relay_is_fenced_and_publishes_nothing_new_after_sigcont() {
    a_frozen_relay_is_fenced(2).await
}

async fn a_frozen_relay_is_fenced(streams: u32) {
    let wal_sender_timeout = Duration::from_secs(2);
    let broker = Kafka::start();
    broker.create_topic("orders", 4);
    let pg = PgCluster::start();
    pg.configure(&[("wal_sender_timeout", "2s")]).await;
    let ferry = Ferry::builder(pg.url()).migrate(true).connect().await.unwrap();
    let pool = ferry.db().as_postgres().unwrap().clone();
    let n = streams.to_string();
    let args = ["--capture", "wal", "--slot", "ferry_fence", "--streams", n.as_str()];
    // The frozen relay's slot: the one slot, or stream 0 (the first relay
    // takes both streams, and yields its highest, stream 1, to the second).
    let slot = match streams {
        1 => "ferry_fence".to_string(),
        _ => "ferry_fence_0of2".to_string(),
    };
    let mut old = spawn_relay_process(&pg.url(), &broker.brokers(), &args, &[]);
    let before = wait_for_streaming(&pool, &slot, None, Duration::from_secs(60)).await;
    let second = match streams {
        1 => None,
        _ => Some(wait_for_streaming(&pool, "ferry_fence_1of2", None, Duration::from_secs(60)).await),
    };
    let standby = spawn_relay_process(&pg.url(), &broker.brokers(), &args, &[]);
    if let Some(second) = second {
        wait_for_streaming(&pool, "ferry_fence_1of2", Some(second), Duration::from_secs(60)).await;
        assert_eq!(
            streaming_pid(&pool, &slot).await,
            Some(before),
            "the first relay kept stream 0"
        );
    }
    let writer = tokio::spawn(crate::outage::write_through_outage(ferry.clone(), 0, 3000));
    wait_for_count(&ferry, &DELIVERED, 300, Duration::from_secs(60)).await;

    signal(old.id(), "STOP");
    let stopped = tokio::time::Instant::now();
    let deadline = stopped + Duration::from_secs(60);
    loop {
        if streaming_pid(&pool, &slot).await.is_some_and(|p| p != before) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the standby never took the slot over"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let took = stopped.elapsed();
    // The walsender ended the old session before the standby's began, so
    // nothing committed from here on can ever reach the old relay (what it
    // received before, up to its socket buffers, is its unconfirmed tail).
    let max_at_takeover = scalar(&ferry, "SELECT COALESCE(max(id), 0) FROM outbox").await;
    eprintln!("takeover {took:?} after SIGSTOP (wal_sender_timeout {wal_sender_timeout:?}, lease 1 s)");
    assert!(
        took <= wal_sender_timeout + Duration::from_secs(5),
        "takeover took {took:?}"
    );
    writer.await.unwrap();
    let total = scalar(&ferry, "SELECT count(*) FROM outbox").await;
    wait_for_count(&ferry, &DELIVERED, total, Duration::from_secs(120)).await;
    let probe: rdkafka::consumer::BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", broker.brokers())
        .create()
        .unwrap();
    let hwm: Vec<i64> = (0..4)
        .map(|p| probe.fetch_watermarks("orders", p, Duration::from_secs(10)).unwrap().1)
        .collect();

    signal(old.id(), "CONT");
    crate::outage::write_through_outage(ferry.clone(), 3000, 3100).await;
    wait_for_count(&ferry, &DELIVERED, total + 100, Duration::from_secs(60)).await;
    // The old relay drains and exits: all it could still produce is sent.
    signal(old.id(), "TERM");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while old.try_wait().unwrap().is_none() {
        assert!(
            std::time::Instant::now() < deadline,
            "the old relay did not exit on SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(standby);

    let recs = read_all(&broker.brokers(), "orders", false, Duration::from_secs(60)).await;
    let mut position = [0i64; 4];
    let mut seen = std::collections::HashSet::new();
    let mut tail = 0;
    for r in &recs {
        let p = r.partition as usize;
        let fresh = seen.insert(r.outbox_id());
        if position[p] >= hwm[p] && !fresh {
            assert!(
                r.outbox_id() <= max_at_takeover,
                "row {} (committed after the takeover, published by the standby) published again after SIGCONT",
                r.outbox_id()
            );
            tail += 1;
        }
        position[p] += 1;
    }
    let duplicates = nothing_lost(&recs, &all_ids(&ferry).await);
    eprintln!(
        "SIGSTOP/SIGCONT: {duplicates} duplicates, {tail} of them after SIGCONT (the old relay's unconfirmed tail)"
    );
}

/// Duplicates per SIGKILL are bounded by what was in flight, not by the
/// slot's status-update period. A writer enqueues without
/// pause while a `ferry-relay` process streaming from one slot is
/// SIGKILLed three times, a new one started each time. At each kill the
/// rows the ledger covers are delivered: whatever the slot's confirmed
/// position says (it follows the marks only at the client's next status
/// update, a second apart), no later relay may produce any of them again.
/// Only rows produced and not yet acknowledged, or acknowledged and not
/// yet marked, may come twice. Before the slot's marked position, every
/// restart produced again about a second of covered rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_a_relay_sigkilled_under_load_never_produces_a_covered_row_again() {
    let broker = Kafka::start();
    broker.create_topic("orders", 4);
    let (ferry, url) = pg_ferry().await;
    let slot = SlotGuard::new().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    let stop = tokio_util::sync::CancellationToken::new();
    let writer = {
        let (ferry, stop) = (ferry.clone(), stop.clone());
        tokio::spawn(async move {
            let mut i = 0;
            while !stop.is_cancelled() {
                enqueue(&ferry, i, i + 1).await;
                i += 1;
            }
            i
        })
    };
    let mut kills = Vec::new();
    let mut before = None;
    for _ in 0..3 {
        let mut relay = spawn_relay_process(&url, &broker.brokers(), &slot.args(), &[]);
        before = Some(wait_for_streaming(&pool, &slot.name, before, Duration::from_secs(60)).await);
        let delivered = scalar(&ferry, &DELIVERED).await;
        // Under load, well past the marks of the previous kill's replay.
        wait_for_count(&ferry, &DELIVERED, delivered + 500, Duration::from_secs(60)).await;
        relay.kill().unwrap(); // SIGKILL
        relay.wait().unwrap();
        kills.push((delivered_ids(&pool).await, end_offsets(&broker.brokers(), "orders")));
    }
    stop.cancel();
    let written = writer.await.unwrap();
    let last = spawn_relay_process(&url, &broker.brokers(), &slot.args(), &[]);
    wait_for_count(&ferry, &DELIVERED, written as i64, Duration::from_secs(120)).await;
    drop(last);
    let recs = read_all(&broker.brokers(), "orders", false, Duration::from_secs(60)).await;
    let duplicates = nothing_lost(&recs, &all_ids(&ferry).await);
    for (k, (delivered, ends)) in kills.iter().enumerate() {
        assert_nothing_delivered_produced_again(&recs, delivered, ends, &format!("kill {}", k + 1));
    }
    eprintln!("3 SIGKILLs under load: {duplicates} duplicates in {written} rows");
}

/// A streamed transaction skipped because an earlier session marked it
/// must not be marked again: a row of it that Kafka refused (marked dead)
/// and an operator replayed since would be covered by that second mark and
/// never published. The first relay process never confirms the slot (the
/// crash tests' `never-confirm` seam: what a relay killed between its
/// marks and the client's next status update leaves, without the race);
/// once its rows are marked and the poison row dead it is killed; the row
/// is shrunk and replayed; the next relay streams every transaction again
/// (skipped), then the replay: the row is published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_a_row_replayed_after_its_transaction_was_marked_is_published() {
    let broker = Kafka::start();
    crate::poison::poison_topic(&broker, "orders", 3);
    let (ferry, url) = pg_ferry().await;
    let slot = SlotGuard::new().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    let mut args = slot.args().to_vec();
    args.extend(["--on-poison", "dead"]);
    let mut first = spawn_relay_process(
        &url,
        &broker.brokers(),
        &args,
        &[("FERRY_RELAY_FAILPOINT", "never-confirm")],
    );
    wait_for_streaming(&pool, &slot.name, None, Duration::from_secs(60)).await;
    let poison = crate::poison::poison_rows(&ferry).await;
    wait_for_count(&ferry, &DELIVERED, 6, Duration::from_secs(60)).await;
    let dead = format!("SELECT count(*) FROM outbox WHERE id = {poison} AND state = 'dead'");
    wait_for_count(&ferry, &dead, 1, Duration::from_secs(60)).await;
    let marked = "SELECT COALESCE(max(marked_lsn), 0) FROM relay_wal_slots";
    let confirmed = confirmed_flush(&pool, &slot.name).await;
    assert!(
        scalar(&ferry, marked).await > confirmed,
        "the slot stayed before the marks"
    );
    first.kill().unwrap();
    first.wait().unwrap();
    sqlx::query("UPDATE outbox SET payload = 'small' WHERE id = $1")
        .bind(poison)
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(
        ferry
            .operator()
            .replay_dead_outbox(Some(poison), "ops", "shrank it")
            .await
            .unwrap(),
        vec![poison]
    );
    let relay = spawn_relay_process(&url, &broker.brokers(), &args, &[]);
    let delivered = format!("SELECT count(*) FROM {OUTBOX} WHERE id = {poison} AND state = 'delivered'");
    wait_for_count(&ferry, &delivered, 1, Duration::from_secs(60)).await;
    drop(relay);
    let recs = read_all(&broker.brokers(), "orders", false, Duration::from_secs(60)).await;
    assert!(
        recs.iter().any(|r| r.outbox_id() == poison),
        "the replayed row was marked delivered without being published"
    );
}

/// Two relays on slots of their own over one outbox (a blue/green deploy,
/// a slot renamed): the ledger is shared, the slots' marked positions are
/// not. Relay B's slot, made before the rows were written, carries every
/// row relay A delivered meanwhile; B skips each of them (the ledger covers
/// them, whatever B's slot says) and publishes only the rows written after.
/// Before sessions looked at the ledger, B produced all of A's rows again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_rows_the_ledger_covers_are_skipped_whatever_the_slot_says() {
    let broker = Kafka::start();
    broker.create_topic("orders", 3);
    let brokers = broker.brokers();
    let (ferry, url) = pg_ferry().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    let (a, b) = (SlotGuard::new().await, SlotGuard::new().await);
    // B makes its slot and streams, then stops: its slot holds what follows.
    let relay_b = b.start(b.config(&url, &brokers), ferry.clone()).await;
    wait_for_streaming(&pool, &b.name, None, Duration::from_secs(60)).await;
    relay_b.shutdown().await;
    let relay_a = a.start(a.config(&url, &brokers), ferry.clone()).await;
    wait_for_streaming(&pool, &a.name, None, Duration::from_secs(60)).await;
    enqueue(&ferry, 0, 200).await;
    wait_for_count(&ferry, &DELIVERED, 200, Duration::from_secs(60)).await;
    relay_a.shutdown().await;
    let by_a = (delivered_ids(&pool).await, end_offsets(&brokers, "orders"));
    enqueue(&ferry, 200, 250).await;
    // B's stream holds A's rows before these: once these are delivered, B
    // has handled every one of A's.
    let relay_b = b.start(b.config(&url, &brokers), ferry.clone()).await;
    wait_for_count(&ferry, &DELIVERED, 250, Duration::from_secs(60)).await;
    let skipped = relay_b.state.metrics.wal_marked_skipped.get();
    relay_b.shutdown().await;
    let recs = read_all(&brokers, "orders", false, Duration::from_secs(30)).await;
    let duplicates = nothing_lost(&recs, &all_ids(&ferry).await);
    assert_nothing_delivered_produced_again(&recs, &by_a.0, &by_a.1, "relay B");
    assert_eq!(duplicates, 0, "every row produced once");
    assert!(skipped >= 200, "B skipped A's 200 rows ({skipped} skipped)");
}

/// The session blocked by `holder` on a statement whose text contains
/// `text`, once there is one (the holder's transaction is the only thing
/// it waits for).
async fn wait_for_blocked(pool: &sqlx::PgPool, holder: i32, text: &str, what: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let blocked: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid)) AND strpos(query, $2) > 0",
        )
        .bind(holder)
        .bind(text)
        .fetch_one(pool)
        .await
        .unwrap();
        if blocked > 0 {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what} never waited on the held lock"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A session reads the table for its new slot while the slot is lost
/// (PostgreSQL invalidates it and ends the session's stream) and another
/// relay makes it anew. A row committed between the two slots is in no
/// stream anyone will read and above the first read's bound: only the new
/// slot's table read publishes it. The first read, ending after the new
/// slot was made, must not record the table read for the new slot. Before
/// a read was tied to the slot's generation it did: the new slot's session
/// skipped its read and the row was lost (10 of 11 delivered).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_a_table_read_outlived_by_its_slot_is_not_taken_for_the_new_slots() {
    let broker = Kafka::start();
    broker.create_topic("orders", 3);
    let brokers = broker.brokers();
    let (ferry, url) = pg_ferry().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    let slot = SlotGuard::new().await;
    enqueue(&ferry, 0, 10).await;
    // The publication, and the first slot made as a relay makes it: its
    // table read goes up to the 10 rows.
    sqlx::query(&format!(
        "CREATE PUBLICATION {} FOR TABLE outbox WITH (publish = 'insert')",
        slot.name
    ))
    .execute(&pool)
    .await
    .unwrap();
    let store = ferry_relay::store::RelayStore::new(ferry.clone());
    assert!(store
        .create_wal_slot(&slot.name, false, std::future::pending())
        .await
        .unwrap());
    // The relay's table read waits: the ledger it probes is locked.
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE outbox_delivered IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let holder_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *holder)
        .await
        .unwrap();
    let relay = slot.start(slot.config(&url, &brokers), ferry.clone()).await;
    wait_for_blocked(&pool, holder_pid, "o.id <= $3", "the relay's table read").await;
    // The slot is lost under the read (its session ended, the slot gone)...
    while !terminate_and_drop_slot(&pool, &slot.name).await {}
    // Committed with no slot: in no stream, and above the read's bound.
    enqueue(&ferry, 10, 11).await;
    // ... and another relay makes it anew (its creation waits for the
    // holder's transaction: its record is already reset).
    let other = ferry_relay::store::RelayStore::new(ferry.clone());
    let name = slot.name.clone();
    let making = tokio::spawn(async move { other.create_wal_slot(&name, false, std::future::pending()).await });
    wait_for_blocked(
        &pool,
        holder_pid,
        "pg_create_logical_replication_slot",
        "the new slot's creation",
    )
    .await;
    holder.commit().await.unwrap();
    assert!(making.await.unwrap().unwrap());
    wait_for_count(&ferry, &DELIVERED, 11, Duration::from_secs(60)).await;
    relay.shutdown().await;
    let recs = read_all(&brokers, "orders", false, Duration::from_secs(30)).await;
    nothing_lost(&recs, &all_ids(&ferry).await);
}

/// Two relays make one slot at once while a writer's transaction runs (the
/// first waits for it: its consistent point). The second must neither
/// record a bound read before that point (the highest id visible before the
/// transaction commits: its row, in no stream and above the bound, was
/// lost, seen once under load) nor reset the record after the first
/// recorded its bound (a table read without a bound publishes the rows
/// committed after the slot, which the stream carries in commit order, in
/// id order: a key's records out of order, seen in a full run). Relays make
/// a slot one at a time: the second waits, finds the slot made and leaves
/// the first's bound, exactly the running transaction's row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_two_relays_making_one_slot_at_once_keep_the_makers_bound() {
    let (ferry, _) = pg_ferry().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    let slot = SlotGuard::new().await;
    enqueue(&ferry, 0, 3).await;
    // A writer's transaction, running when the slot is made.
    let mut writer = pool.begin().await.unwrap();
    let writer_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *writer)
        .await
        .unwrap();
    let late: i64 = sqlx::query_scalar(
        "INSERT INTO outbox (tenant, topic, key, lane, payload, headers, created_at)
         VALUES ('acme', 'orders', 'k', 0, '\\x00', '{}'::jsonb, 0) RETURNING id",
    )
    .fetch_one(&mut *writer)
    .await
    .unwrap();
    let (first, second) = (
        ferry_relay::store::RelayStore::new(ferry.clone()),
        ferry_relay::store::RelayStore::new(ferry.clone()),
    );
    let name = slot.name.clone();
    let making = tokio::spawn(async move { first.create_wal_slot(&name, false, std::future::pending()).await });
    wait_for_blocked(
        &pool,
        writer_pid,
        "pg_create_logical_replication_slot",
        "the first relay's creation",
    )
    .await;
    let name = slot.name.clone();
    let meeting = tokio::spawn(async move { second.create_wal_slot(&name, false, std::future::pending()).await });
    // A third relay, which found the slot listed (it is, while being
    // made), reads its catch-up record: it must read the maker's bound.
    let third = ferry_relay::store::RelayStore::new(ferry.clone());
    let name = slot.name.clone();
    let reading = tokio::spawn(async move { third.wal_catch_up(&name).await });
    // The second and the third wait for the first's making.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        if making_lock_waiters(&pool, &slot.name).await == 2 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the other relays never waited for the first"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    writer.commit().await.unwrap();
    assert!(making.await.unwrap().unwrap());
    assert!(meeting.await.unwrap().unwrap());
    let read = reading.await.unwrap().unwrap().unwrap();
    assert_eq!(read.through, late, "the reader waited for the maker's bound");
    let store = ferry_relay::store::RelayStore::new(ferry.clone());
    let read = store.wal_catch_up(&slot.name).await.unwrap().unwrap();
    assert_eq!(
        read.through, late,
        "the table read's bound is the maker's: every row committed before the slot, none after"
    );
    assert_eq!(read.generation, 1, "the second relay left the record alone");
}

/// What a relay killed between creating slot `name` and recording its
/// table read's bound leaves: the record reset (generation 1, no bound),
/// then the slot created.
async fn dead_makers_slot(pool: &sqlx::PgPool, name: &str) {
    sqlx::query(
        "INSERT INTO relay_wal_slots (slot, caught_up, catch_up_through, updated_at, marked_lsn, generation)
         VALUES ($1, false, NULL, 0, NULL, 1)",
    )
    .bind(name)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
        .bind(name)
        .execute(pool)
        .await
        .unwrap();
}

/// Slot `name`'s recorded table-read bound and generation.
async fn slot_record(pool: &sqlx::PgPool, name: &str) -> (Option<i64>, i64) {
    sqlx::query_as("SELECT catch_up_through, generation FROM relay_wal_slots WHERE slot = $1")
        .bind(name)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A relay killed between creating a slot and recording its table read's
/// bound leaves a slot whose record has no bound. The next relay found the
/// slot made and read the table without a bound: the rows committed after
/// the slot were published from the table in id order (and again from the
/// stream), where the stream carries them in commit order. It must make the
/// slot anew instead, with a bound: on the code before, the record stayed
/// at generation 1 with no bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_a_slot_whose_maker_died_before_its_bound_is_made_anew() {
    let broker = Kafka::start();
    broker.create_topic("orders", 3);
    let brokers = broker.brokers();
    let (ferry, url) = pg_ferry().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    let slot = SlotGuard::new().await;
    enqueue(&ferry, 0, 3).await;
    // The publication first, as a relay makes it: the slot streams from it.
    sqlx::query(&format!(
        "CREATE PUBLICATION {} FOR TABLE outbox WITH (publish = 'insert')",
        slot.name
    ))
    .execute(&pool)
    .await
    .unwrap();
    dead_makers_slot(&pool, &slot.name).await;
    // Committed after the dead maker's slot.
    enqueue(&ferry, 3, 5).await;
    let last = scalar(&ferry, "SELECT max(id) FROM outbox").await;
    let relay = slot.start(slot.config(&url, &brokers), ferry.clone()).await;
    wait_for_count(&ferry, &DELIVERED, 5, Duration::from_secs(60)).await;
    assert_eq!(
        slot_record(&pool, &slot.name).await,
        (Some(last), 2),
        "the slot was made anew, with the bound of the rows committed before it"
    );
    enqueue(&ferry, 5, 8).await;
    wait_for_count(&ferry, &DELIVERED, 8, Duration::from_secs(60)).await;
    relay.shutdown().await;
    let recs = read_all(&brokers, "orders", false, Duration::from_secs(30)).await;
    nothing_lost(&recs, &all_ids(&ferry).await);
}

/// A slot whose bound was never recorded reads as unbound (a session then
/// ends and its next `prepare` makes the slot anew, instead of reading the
/// table without a bound), and is made anew only when no relay is making
/// it: a live maker's record is unbound until it records the bound, and
/// waiting for it would hold a connection as long as the creation waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_an_unbound_slot_is_made_anew_only_when_no_relay_is_making_it() {
    let (ferry, _) = pg_ferry().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    let slot = SlotGuard::new().await;
    enqueue(&ferry, 0, 3).await;
    dead_makers_slot(&pool, &slot.name).await;
    let last = scalar(&ferry, "SELECT max(id) FROM outbox").await;
    let store = ferry_relay::store::RelayStore::new(ferry.clone());
    let read = store.wal_catch_up(&slot.name).await.unwrap().unwrap();
    assert!(read.unbound, "{read:?}");
    // Another relay holds the making lock: the slot is left to it.
    let mut maker = pool.acquire().await.unwrap();
    let lock = MAKING_LOCK;
    sqlx::query(&format!("SELECT pg_advisory_lock({lock})"))
        .bind(&slot.name)
        .execute(&mut *maker)
        .await
        .unwrap();
    assert!(store
        .remake_unbound_wal_slot(&slot.name, false, std::future::pending())
        .await
        .unwrap());
    assert_eq!(
        slot_record(&pool, &slot.name).await,
        (None, 1),
        "a slot being made is left to its maker"
    );
    sqlx::query(&format!("SELECT pg_advisory_unlock({lock})"))
        .bind(&slot.name)
        .execute(&mut *maker)
        .await
        .unwrap();
    drop(maker);
    assert!(store
        .remake_unbound_wal_slot(&slot.name, false, std::future::pending())
        .await
        .unwrap());
    assert_eq!(
        slot_record(&pool, &slot.name).await,
        (Some(last), 2),
        "made anew, with its bound"
    );
    let read = store.wal_catch_up(&slot.name).await.unwrap().unwrap();
    assert_eq!((read.through, read.generation, read.unbound), (last, 2, false));
}

/// A relay reading a slot's catch-up record while another relay makes the
/// slot and waits on a long transaction gives up after the server's lock
/// timeout, leaving no session of its own waiting on the lock (a
/// client-side timeout left the dropped connection waiting in the pool, one
/// more per retry, until the transaction ended).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_a_catch_up_read_behind_a_long_slot_creation_gives_up_on_the_server() {
    let (ferry, _) = pg_ferry().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    let slot = SlotGuard::new().await;
    let mut writer = pool.begin().await.unwrap();
    let writer_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *writer)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO outbox (tenant, topic, key, lane, payload, headers, created_at)
         VALUES ('acme', 'orders', 'k', 0, '\\x00', '{}'::jsonb, 0)",
    )
    .execute(&mut *writer)
    .await
    .unwrap();
    let maker = ferry_relay::store::RelayStore::new(ferry.clone());
    let name = slot.name.clone();
    let making = tokio::spawn(async move { maker.create_wal_slot(&name, false, std::future::pending()).await });
    wait_for_blocked(
        &pool,
        writer_pid,
        "pg_create_logical_replication_slot",
        "the slot's creation",
    )
    .await;
    let reader = ferry_relay::store::RelayStore::new(ferry.clone());
    let read = tokio::time::timeout(Duration::from_secs(20), reader.wal_catch_up(&slot.name))
        .await
        .expect("the read gave up on the server's lock timeout");
    assert!(
        read.is_err(),
        "no record is read while the slot is being made: {read:?}"
    );
    assert_eq!(
        making_lock_waiters(&pool, &slot.name).await,
        0,
        "no session still waits on the making lock"
    );
    writer.commit().await.unwrap();
    assert!(making.await.unwrap().unwrap());
}

/// The key of the slot named by `$1`'s making lock, as the relay takes it
/// (`relay/sql/wal.sql`).
const MAKING_LOCK: &str = "hashtextextended('ferry.wal_slot/' || $1::text, 0)";

/// How many sessions wait on `slot`'s making lock: that slot's only (a
/// bigint advisory lock shows as its high and low halves), since other
/// tests make slots of their own meanwhile.
async fn making_lock_waiters(pool: &sqlx::PgPool, slot: &str) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT count(*) FROM pg_locks
         WHERE locktype = 'advisory' AND NOT granted AND objsubid = 1
           AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
           AND ((classid::bigint << 32) | objid::bigint) = {MAKING_LOCK}"
    ))
    .bind(slot)
    .fetch_one(pool)
    .await
    .unwrap()
}
