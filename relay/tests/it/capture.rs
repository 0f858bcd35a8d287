//! Commit order for any writer, in both capture modes, plus what only WAL
//! capture has (`wal_…`, single tests): commit order across a restart,
//! resuming from the slot, recovery when the slot or its publication is
//! gone (the table is the source of truth), a standby taking the slot over,
//! and how the capture mode is chosen. Every WAL test streams from a slot
//! of its own, dropped at the end by [`SlotGuard`]. The rest of the relay's
//! promises run in both modes in `relay.rs`, `poison.rs`, `outage.rs`,
//! `effect_keys.rs` and `trace.rs`.

use std::time::Duration;

use ferry::OutboxMessage;
use ferry_relay::{Capture, RelayConfig};

use crate::support::*;
use ferry_testkit::Kafka;

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

/// A plain SQL writer takes a lower id for key K and commits after the
/// library committed a higher id of K (while the relay runs and has
/// published it). Kafka holds K's records in commit order; many writers of
/// other keys run beside them, and no row is lost.
async fn a_plain_writer_and_the_library_keep_commit_order(capture: Capture) {
    let broker = Kafka::start();
    broker.create_topic("orders", 3);
    let (ferry, url) = pg_ferry().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    let k = "k-mixed";
    let lane = ferry::outbox::lane_for(k, ferry.lanes());
    let (cfg, guard) = config_for(capture, &url, &broker.brokers()).await;
    let relay = guard.start(cfg, ferry.clone()).await;
    // The relay streams before the late transaction opens: a new slot
    // waits for every transaction in progress when it is made.
    crate::relay::write_orders(&ferry, 1, 1).await;
    let delivered = &format!("SELECT count(*) FROM {OUTBOX} WHERE state = 'delivered'");
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
            &format!("SELECT count(*) FROM {OUTBOX} WHERE id = {higher} AND state = 'delivered'"),
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
    // The other keys' rows commit in id order.
    let others: Vec<Record> = recs.into_iter().filter(|r| r.key != k).collect();
    first_occurrences(&others);
}

in_both_capture_modes!(a_plain_writer_and_the_library_keep_commit_order);

/// A WAL drain writes no outbox row. Delivery is recorded as
/// ranges in the ledger, so every row keeps the version its writer's
/// transaction made (`xmin` unchanged: an UPDATE would make a new one),
/// reads delivered through the ledger, and reaches Kafka once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_a_drain_rewrites_no_outbox_row() {
    let broker = Kafka::start();
    broker.create_topic("orders", 3);
    let (ferry, url) = pg_ferry().await;
    let slot = SlotGuard::new().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    let relay = slot.start(slot.config(&url, &broker.brokers()), ferry.clone()).await;
    wait_for_streaming(&pool, &slot.name, None, Duration::from_secs(60)).await;
    let mut written: Vec<(i64, String)> = Vec::new();
    for t in 0..10 {
        let mut tx = pool.begin().await.unwrap();
        for i in 0..50 {
            let key = format!("k-{}", i % 7);
            let lane = ferry::outbox::lane_for(&key, ferry.lanes());
            plain_insert(&mut *tx, lane, &key, &format!("{t}/{i}")).await;
        }
        // Uncommitted, these rows are this transaction's alone: their xmin
        // is its id.
        let ours: Vec<(i64, String)> = sqlx::query_as(
            "SELECT id, xmin::text FROM outbox WHERE xmin::text = pg_current_xact_id()::text ORDER BY id",
        )
        .fetch_all(&mut *tx)
        .await
        .unwrap();
        assert_eq!(ours.len(), 50);
        written.extend(ours);
        tx.commit().await.unwrap();
    }
    wait_for_count(&ferry, &DELIVERED, 500, Duration::from_secs(60)).await;
    relay.shutdown().await;
    let now: Vec<(i64, String)> = sqlx::query_as("SELECT id, xmin::text FROM outbox ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(now.len(), written.len());
    let rewritten = now.iter().zip(&written).filter(|(a, b)| a != b).count();
    assert_eq!(rewritten, 0, "outbox rows rewritten by the drain (a new xmin)");
    let states = ferry_testkit::outbox_states(&pool).await;
    assert!(states.iter().all(|(_, s)| s == "delivered"), "{states:?}");
    let ranges = scalar(&ferry, "SELECT count(*) FROM outbox_delivered").await;
    assert!((1..=500).contains(&ranges), "{ranges} ranges");
    let recs = read_all(&broker.brokers(), "orders", false, Duration::from_secs(30)).await;
    assert_eq!(distinct(&recs), 500, "every row reached Kafka");
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
    // The clean shutdown's last confirmation comes after its settling and
    // marking: under a loaded machine's load that took longer than the
    // tests' 5 s grace (the session abandoned, the slot not moved on).
    let mut cfg = slot.config(&url, &broker.brokers());
    cfg.grace = Duration::from_secs(60);
    let relay = slot.start(cfg.clone(), ferry.clone()).await;
    let delivered = &format!("SELECT count(*) FROM {OUTBOX} WHERE state = 'delivered'");
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

    let relay = slot.start(cfg, ferry.clone()).await;
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
    let delivered = &format!("SELECT count(*) FROM {OUTBOX} WHERE state = 'delivered'");
    wait_for_count(&ferry, delivered, 100, Duration::from_secs(60)).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !terminate_and_drop_slot(&pool, &slot.name).await {
        assert!(std::time::Instant::now() < deadline, "could not drop the slot");
    }
    crate::relay::write_orders(&ferry, 100, 10).await;
    wait_for_relay_count(&ferry, &relay, delivered, 200, Duration::from_secs(60)).await;
    crate::relay::write_orders(&ferry, 50, 10).await;
    wait_for_count(&ferry, delivered, 250, Duration::from_secs(60)).await;
    relay.shutdown().await;
    let recs = read_all(&broker.brokers(), "orders", false, Duration::from_secs(30)).await;
    assert_eq!(distinct(&recs), 250, "every row reached Kafka");
}

/// Rows delivered through a first slot are covered by the ledger and still
/// `pending` in their rows; the slot is dropped and rows are written while
/// it is gone. The new slot's catch-up read publishes only the rows not
/// covered: Kafka holds each row once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_a_new_slot_publishes_only_the_rows_not_covered() {
    let broker = Kafka::start();
    broker.create_topic("orders", 3);
    let (ferry, url) = pg_ferry().await;
    let slot = SlotGuard::new().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    // Streaming before the rows commit: none is both read from the table
    // and streamed by the first slot.
    deliver_100_through_wal(&slot, &url, &broker, &ferry).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !terminate_and_drop_slot(&pool, &slot.name).await {
        assert!(std::time::Instant::now() < deadline, "could not drop the slot");
    }
    crate::relay::write_orders(&ferry, 50, 10).await;
    let relay = slot.start(slot.config(&url, &broker.brokers()), ferry.clone()).await;
    wait_for_count(&ferry, &DELIVERED, 150, Duration::from_secs(60)).await;
    relay.shutdown().await;
    let recs = read_all(&broker.brokers(), "orders", false, Duration::from_secs(30)).await;
    assert_eq!(distinct(&recs), 150, "every row reached Kafka");
    assert_eq!(recs.len(), 150, "no row was published twice");
}

/// A database switched back to polling after WAL capture: the rows WAL
/// capture delivered are covered by the ledger and still `pending` in
/// their rows. The poll relay folds the ledger at its start and publishes
/// none of them again (Kafka holds each row once); every row reads
/// delivered, and no range is left covering a row still `pending`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_then_poll_publishes_nothing_twice() {
    let broker = Kafka::start();
    broker.create_topic("orders", 3);
    let (ferry, url) = pg_ferry().await;
    let slot = SlotGuard::new().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    deliver_100_through_wal(&slot, &url, &broker, &ferry).await;
    assert!(scalar(&ferry, "SELECT count(*) FROM outbox_delivered").await > 0);
    let relay = start_relay(relay_config(&url, &broker.brokers()), ferry.clone()).await;
    crate::relay::write_orders(&ferry, 20, 10).await;
    wait_for_count(&ferry, &DELIVERED, 120, Duration::from_secs(60)).await;
    relay.shutdown().await;
    let states = ferry_testkit::outbox_states(&pool).await;
    assert!(states.iter().all(|(_, s)| s == "delivered"), "{states:?}");
    let left = scalar(
        &ferry,
        "SELECT count(*) FROM outbox o JOIN outbox_delivered d ON o.id BETWEEN d.lo AND d.hi \
         WHERE o.state = 'pending'",
    )
    .await;
    assert_eq!(left, 0, "a range covers a row still pending");
    let recs = read_all(&broker.brokers(), "orders", false, Duration::from_secs(30)).await;
    assert_eq!(distinct(&recs), 120, "every row reached Kafka");
    assert_eq!(recs.len(), 120, "no row was published twice");
}

/// A session holding the ledger's lock (a long writer), taken before a
/// poll relay starts, so its start-up fold waits on it: the holder's
/// transaction and its backend pid. It holds the lock as long as the test
/// needs, not the 5 s a holder idle in its transaction is given.
async fn hold_the_ledger_lock(ferry: &ferry::Ferry) -> (sqlx::Transaction<'static, sqlx::Postgres>, i32) {
    let mut holder = ferry.db().as_postgres().unwrap().begin().await.unwrap();
    sqlx::query(ferry::store::queries::POSTGRES_ONLY.replay_ledger_lock)
        .execute(&mut *holder)
        .await
        .unwrap();
    sqlx::query("SET LOCAL idle_in_transaction_session_timeout = 0")
        .execute(&mut *holder)
        .await
        .unwrap();
    let pid = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *holder)
        .await
        .unwrap();
    (holder, pid)
}

/// Waits until `relay`'s start-up fold waits on the lock `holder` holds;
/// returns the backend pid of the fold's session.
async fn the_fold_waits(ferry: &ferry::Ferry, relay: &RunningRelay, holder: i32) -> i32 {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let waiting: Option<i32> =
            sqlx::query_scalar("SELECT pid FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))")
                .bind(holder)
                .fetch_optional(ferry.db().as_postgres().unwrap())
                .await
                .unwrap();
        if let Some(pid) = waiting {
            return pid;
        }
        assert!(!relay.handle.is_finished(), "the relay ended before its fold waited");
        assert!(
            std::time::Instant::now() < deadline,
            "the relay's fold never waited on the ledger's lock"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `n` rows covered by ledger ranges (delivered through WAL capture, still
/// `pending` in their rows), one range per row.
async fn covered_rows(ferry: &ferry::Ferry, n: usize) {
    let pool = ferry.db().as_postgres().unwrap().clone();
    let store = ferry_relay::store::RelayStore::new(ferry.clone());
    for i in 0..n {
        let id = plain_insert(&pool, 0, "k", &format!("{i}")).await;
        // Every other id is left out of the ledger, so the ranges never
        // merge: an uncovered row of another lane.
        plain_insert(&pool, 1, "k-gap", &format!("{i}")).await;
        store.wal_cover_delivered(&[id], None).await.unwrap();
    }
}

/// SIGTERM while a poll relay's start-up fold waits (on the ledger's lock
/// here; a long fold of many ranges is the same): the relay stops within
/// its grace instead of finishing the fold first. What it did not fold
/// stays in the ledger for the next start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_during_the_start_up_fold_returns_promptly() {
    let (ferry, url) = pg_ferry().await;
    covered_rows(&ferry, 3).await;
    let cfg = relay_config(&url, "127.0.0.1:1");
    let grace = cfg.grace;
    let (holder, holder_pid) = hold_the_ledger_lock(&ferry).await;
    let relay = start_relay(cfg, ferry.clone()).await;
    the_fold_waits(&ferry, &relay, holder_pid).await;
    relay.stop.cancel();
    let stopped = tokio::time::timeout(grace, relay.handle).await;
    holder.rollback().await.unwrap();
    stopped
        .expect("the relay did not stop within its grace while its fold waited")
        .unwrap()
        .unwrap();
    assert_eq!(
        scalar(&ferry, "SELECT count(*) FROM outbox_delivered").await,
        3,
        "nothing was folded"
    );
}

/// The session of a poll relay's start-up fold is terminated (a database
/// failover, an operator): the relay retries after its backoff instead of
/// exiting, folds the ledger once the cause is gone (every covered row
/// `delivered` in its row, no range left), and publishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fold_that_hit_a_database_error_completes_and_the_relay_publishes() {
    let broker = Kafka::start();
    broker.create_topic("orders", 3);
    let (ferry, url) = pg_ferry().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    covered_rows(&ferry, 3).await;
    let (holder, holder_pid) = hold_the_ledger_lock(&ferry).await;
    let relay = start_relay(relay_config(&url, &broker.brokers()), ferry.clone()).await;
    let fold = the_fold_waits(&ferry, &relay, holder_pid).await;
    let terminated: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(fold)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(terminated);
    holder.rollback().await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while scalar(&ferry, "SELECT count(*) FROM outbox_delivered").await > 0 {
        assert!(
            !relay.handle.is_finished(),
            "the relay exited on its fold's database error"
        );
        assert!(std::time::Instant::now() < deadline, "the ledger was never folded");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The covered rows (key k; the uncovered, k-gap, the relay may be
    // publishing by now).
    assert_eq!(
        scalar(
            &ferry,
            "SELECT count(*) FROM outbox WHERE state = 'delivered' AND key = 'k'"
        )
        .await,
        3,
        "the covered rows are delivered in their rows"
    );
    crate::relay::write_orders(&ferry, 10, 3).await;
    wait_for_count(&ferry, &DELIVERED, 16, Duration::from_secs(60)).await;
    relay.shutdown().await;
    let recs = read_all(&broker.brokers(), "orders", false, Duration::from_secs(30)).await;
    assert_eq!(
        distinct(&recs),
        13,
        "the uncovered rows and the new ones, none of the folded"
    );
}

/// A dead row a ledger range covers (dead-marking does not take the
/// ledger's lock, so it can race the marker; a restored backup or an
/// operator's UPDATE can do the same, as here) is replayed while a WAL relay
/// streams: the replay splits the range around it, so the relay publishes
/// it once more and it reads delivered again, while its neighbours in the
/// range still read delivered and are not published again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_a_covered_dead_row_replayed_is_published_once() {
    let broker = Kafka::start();
    broker.create_topic("orders", 3);
    let (ferry, url) = pg_ferry().await;
    let slot = SlotGuard::new().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    deliver_100_through_wal(&slot, &url, &broker, &ferry).await;
    let (lo, hi): (i64, i64) = sqlx::query_as("SELECT lo, hi FROM outbox_delivered ORDER BY hi - lo DESC LIMIT 1")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(hi - lo >= 2, "a range with a neighbour on each side of its second id");
    let id = lo + 1;
    sqlx::query("UPDATE outbox SET state = 'dead', last_error = 'message_too_large' WHERE id = $1")
        .bind(id)
        .execute(&pool)
        .await
        .unwrap();
    let relay = slot.start(slot.config(&url, &broker.brokers()), ferry.clone()).await;
    wait_for_streaming(&pool, &slot.name, None, Duration::from_secs(60)).await;
    assert_eq!(
        ferry
            .operator()
            .replay_dead_outbox(Some(id), "ops", "covered and dead")
            .await
            .unwrap(),
        vec![id]
    );
    // A row committed after the replay: the marker records transactions in
    // commit order, so once it reads delivered, so does the replayed row
    // if it was published.
    crate::relay::write_orders(&ferry, 1, 1).await;
    wait_for_count(&ferry, &DELIVERED, 101, Duration::from_secs(60)).await;
    relay.shutdown().await;
    let states = ferry_testkit::outbox_states(&pool).await;
    assert!(states.iter().all(|(_, s)| s == "delivered"), "{states:?}");
    let recs = read_all(&broker.brokers(), "orders", false, Duration::from_secs(30)).await;
    let copies = |of: i64| recs.iter().filter(|r| r.outbox_id() == of).count();
    assert_eq!(copies(id), 2, "the replayed row was published once more");
    assert_eq!(
        (copies(lo), copies(hi)),
        (1, 1),
        "its neighbours were not published again"
    );
    assert_eq!((distinct(&recs), recs.len()), (101, 102));
}

/// A replay splits every range covering a replayed id around the replayed
/// ids, whichever end of the range they sit at, and keeps each piece's
/// `delivered_at`; a range covering only replayed ids is gone, and a range
/// covering none is left as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_splits_the_ranges_covering_its_rows() {
    let (ferry, _) = pg_ferry().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    let mut ids = Vec::new();
    for i in 0..14 {
        ids.push(plain_insert(&pool, 0, "k", &format!("{i}")).await);
    }
    let id = |i: usize| ids[i];
    let ranges = [(0, 9, 100), (11, 11, 200), (12, 13, 300)];
    for (lo, hi, at) in ranges {
        sqlx::query("INSERT INTO outbox_delivered (lo, hi, delivered_at) VALUES ($1, $2, $3)")
            .bind(id(lo))
            .bind(id(hi))
            .bind(at)
            .execute(&pool)
            .await
            .unwrap();
    }
    let dead = [id(0), id(4), id(5), id(9), id(11)];
    sqlx::query("UPDATE outbox SET state = 'dead' WHERE id = ANY($1)")
        .bind(&dead[..])
        .execute(&pool)
        .await
        .unwrap();
    let mut replayed = ferry.operator().replay_dead_outbox(None, "ops", "split").await.unwrap();
    replayed.sort_unstable();
    assert_eq!(replayed, dead);
    let left: Vec<(i64, i64, i64)> = sqlx::query_as("SELECT lo, hi, delivered_at FROM outbox_delivered ORDER BY lo")
        .fetch_all(&pool)
        .await
        .unwrap();
    let at = |lo: usize, hi: usize, at: i64| (id(lo), id(hi), at);
    assert_eq!(left, vec![at(1, 3, 100), at(6, 8, 100), at(12, 13, 300)]);
    let pending: Vec<i64> = sqlx::query_scalar(&format!("SELECT id FROM {OUTBOX} WHERE state = 'pending' ORDER BY id"))
        .fetch_all(&pool)
        .await
        .unwrap();
    // id(10) was never covered.
    assert_eq!(pending, vec![id(0), id(4), id(5), id(9), id(10), id(11)]);
}

/// A poll relay beside WAL capture reads a row, and WAL capture delivers
/// it meanwhile (a range covers it): Kafka then refusing the poll relay's
/// copy must not make the delivered row dead (dead and covered, it would
/// read dead although delivered, and a replay would publish it again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poll_relay_refused_a_covered_row_leaves_it_delivered() {
    let (ferry, _) = pg_ferry().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    let store = ferry_relay::store::RelayStore::new(ferry.clone());
    let id = plain_insert(&pool, 0, "k", "0").await;
    let lanes = store
        .acquire_lanes("relay-a", Duration::from_secs(30), 1)
        .await
        .unwrap();
    assert_eq!(store.pending_batch(0, 10).await.unwrap().len(), 1);
    store.wal_cover_delivered(&[id], None).await.unwrap();
    store
        .note_publish_error("relay-a", lanes[0], id, "message_too_large")
        .await
        .unwrap();
    store
        .mark_dead("relay-a", lanes[0], id, "message_too_large")
        .await
        .unwrap();
    ferry_testkit::assert_delivered_unwritten(&pool, id).await;
}

/// A poll relay beside WAL capture (or after it, before its fold): the
/// lanes' reads and the wake-up probe skip rows a ledger range covers, and
/// so do WAL capture's catch-up read and its re-read of a replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn covered_rows_are_not_pending_to_any_relay_read() {
    let (ferry, _) = pg_ferry().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    let store = ferry_relay::store::RelayStore::new(ferry.clone());
    let mut ids = Vec::new();
    for i in 0..4 {
        ids.push(plain_insert(&pool, 0, "k", &format!("{i}")).await);
    }
    store.wal_cover_delivered(&ids[..2], None).await.unwrap();
    let lanes = store
        .acquire_lanes("relay-a", Duration::from_secs(30), 1)
        .await
        .unwrap();
    assert_eq!(lanes[0].lane, 0);
    let batch: Vec<i64> = store.pending_batch(0, 10).await.unwrap().iter().map(|r| r.id).collect();
    assert_eq!(batch, ids[2..]);
    let besides: Vec<i64> = store
        .pending_besides(0, 10, &ids[2..3])
        .await
        .unwrap()
        .iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(besides, ids[3..]);
    assert_eq!(store.lanes_with_pending("relay-a").await.unwrap(), vec![0]);
    let after: Vec<i64> = store
        .pending_after(0, i64::MAX, 10)
        .await
        .unwrap()
        .iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(after, ids[2..]);
    let replayed: Vec<i64> = store.pending_ids(&ids).await.unwrap().iter().map(|r| r.id).collect();
    assert_eq!(replayed, ids[2..]);
    // Exactly once asks a streamed row's state before publishing it again.
    let states = store.wal_states(&ids[1..3]).await.unwrap();
    assert_eq!(states, vec![(ids[1], "delivered".into()), (ids[2], "pending".into())]);
    store.wal_cover_delivered(&ids[2..], None).await.unwrap();
    assert!(store.pending_batch(0, 10).await.unwrap().is_empty());
    assert!(store.lanes_with_pending("relay-a").await.unwrap().is_empty());
}

/// Retention after WAL capture: rows the ledger covers (still `pending`
/// in their rows) are swept with the rows marked delivered once their range
/// is past the retention, in batches, then the ranges left covering
/// nothing; a pending row no range covers and a dead row are never swept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_sweeps_covered_rows_then_their_ranges() {
    let t = ferry_testkit::TestDb::with_clock(ferry::Engine::Postgres, ferry_testkit::manual_clock()).await;
    let pool = t.ferry.db().as_postgres().unwrap().clone();
    let store = ferry_relay::store::RelayStore::new(t.ferry.clone());
    let mut ids = Vec::new();
    for i in 0..8 {
        ids.push(plain_insert(&pool, 0, "k", &format!("{i}")).await);
    }
    // Covered: 0-2 and 4-5; 3 pending and not covered; 6 dead; 7 marked
    // delivered by a poll relay.
    store
        .wal_cover_delivered(&[ids[0], ids[1], ids[2], ids[4], ids[5]], None)
        .await
        .unwrap();
    sqlx::query("UPDATE outbox SET state = 'dead' WHERE id = $1")
        .bind(ids[6])
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("UPDATE outbox SET state = 'delivered', delivered_at = $2 WHERE id = $1")
        .bind(ids[7])
        .bind(ferry_testkit::T0)
        .execute(&pool)
        .await
        .unwrap();
    let retention = Duration::from_secs(3600);
    let sweep = || async {
        let mut rows = 0;
        loop {
            let n = store.sweep_delivered(retention, 2).await.unwrap();
            rows += n;
            if n < 2 {
                break;
            }
        }
        let ranges = store.sweep_delivered_ranges(retention, 2).await.unwrap();
        (rows, ranges)
    };
    t.ferry.clock().advance(Duration::from_secs(3599)).unwrap();
    assert_eq!(sweep().await, (0, 0), "nothing is past the retention yet");
    t.ferry.clock().advance(Duration::from_secs(1)).unwrap();
    assert_eq!(
        sweep().await,
        (6, 2),
        "the covered rows, the delivered row, then the ranges"
    );
    let left: Vec<(i64, String)> = sqlx::query_as("SELECT id, state FROM outbox ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(left, vec![(ids[3], "pending".into()), (ids[6], "dead".into())]);
    assert_eq!(
        t.scalar("SELECT count(*) FROM outbox_delivered").await,
        0,
        "the ledger is empty"
    );
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
    let delivered = &format!("SELECT count(*) FROM {OUTBOX} WHERE state = 'delivered'");
    wait_for_count(&ferry, delivered, 100, Duration::from_secs(60)).await;
    sqlx::query(&format!("DROP PUBLICATION {}", slot.name))
        .execute(&pool)
        .await
        .unwrap();
    crate::relay::write_orders(&ferry, 100, 10).await;
    wait_for_relay_count(&ferry, &relay, delivered, 200, Duration::from_secs(60)).await;
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
    wait_for_streaming(&pool, &slot.name, None, Duration::from_secs(60)).await;
    let writer = {
        let ferry = ferry.clone();
        tokio::spawn(async move { crate::relay::write_orders(&ferry, 1500, 40).await })
    };
    let c = consumer(&broker.brokers(), &["orders"]);
    let mut recs = read_until(&c, Duration::from_secs(60), |r| distinct(r) >= 300).await;
    // The active relay's walsender now, before a standby exists.
    let before = wait_for_streaming(&pool, &slot.name, None, Duration::from_secs(60)).await;
    let standby = spawn_relay_process(&url, &broker.brokers(), &slot.args(), &[]);
    active.kill().unwrap(); // SIGKILL mid-stream
    active.wait().unwrap();
    writer.await.unwrap();
    let more = read_until(&c, Duration::from_secs(120), |r| distinct(recs.iter().chain(r)) >= 1500).await;
    recs.extend(more);
    wait_for_streaming(&pool, &slot.name, Some(before), Duration::from_secs(30)).await;
    drop(standby);
    let first = first_occurrences(&recs);
    eprintln!(
        "wal: {} duplicates after one SIGKILL and a takeover, for {} rows",
        recs.len() - first.len(),
        first.len()
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

/// Behind a transaction pooler (the test PgBouncer, the URL saying
/// `pgbouncer=true`) the default capture is poll: WAL capture needs a
/// replication connection, which PgBouncer refuses, and the slot maker's
/// session lock, which it would hand to other clients. `--capture wal` is
/// refused with that reason before anything is made. Polling through the
/// pooler, every row reaches Kafka once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_a_transaction_pooler_the_relay_polls_and_refuses_wal_capture() {
    let (direct, pooled) = ferry_testkit::fresh_database_behind_pgbouncer().await.unwrap();
    let url = format!("{pooled}?pgbouncer=true");
    let ferry = ferry::Ferry::builder(&url)
        .direct_url(direct)
        .migrate(true)
        .connect()
        .await
        .unwrap();
    assert!(ferry.behind_transaction_pooler());
    let store = ferry_relay::store::RelayStore::new(ferry.clone());
    let mut cfg = RelayConfig::new(&url, "127.0.0.1:1");
    assert!(ferry_relay::wal::plan(&cfg, &store, "relay-1").await.unwrap().is_none());
    cfg.capture = Some(Capture::Wal);
    let err = ferry_relay::wal::plan(&cfg, &store, "relay-1").await.unwrap_err();
    assert_eq!(err.code(), "config");
    assert!(err.to_string().contains("transaction pooler"), "{err}");
    assert_eq!(scalar(&ferry, "SELECT count(*) FROM pg_publication").await, 0);
    let broker = Kafka::start();
    broker.create_topic("orders", 3);
    crate::relay::write_orders(&ferry, 20, 5).await;
    let mut cfg = relay_config(&url, &broker.brokers());
    cfg.capture = None;
    let relay = start_relay(cfg, ferry_relay::service::connect(&url).await.unwrap()).await;
    wait_for_count(&ferry, &DELIVERED, 20, Duration::from_secs(60)).await;
    relay.shutdown().await;
    let recs = read_all(&broker.brokers(), "orders", false, Duration::from_secs(30)).await;
    assert_eq!(recs.len(), 20, "every row once");
    assert_eq!(distinct(&recs), 20);
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

/// 100 rows written once `slot`'s relay streams, delivered through WAL
/// capture (covered by the ledger), and that relay shut down.
async fn deliver_100_through_wal(slot: &SlotGuard, url: &str, broker: &Kafka, ferry: &ferry::Ferry) {
    let pool = ferry.db().as_postgres().unwrap().clone();
    let relay = slot.start(slot.config(url, &broker.brokers()), ferry.clone()).await;
    wait_for_streaming(&pool, &slot.name, None, Duration::from_secs(60)).await;
    crate::relay::write_orders(ferry, 100, 10).await;
    wait_for_count(ferry, &DELIVERED, 100, Duration::from_secs(60)).await;
    relay.shutdown().await;
}
