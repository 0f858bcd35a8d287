//! `--exactly-once --capture wal` against PostgreSQL and Apache Kafka:
//! relays SIGKILLed mid-stream, crashed right after a Kafka commit and
//! before the rows are marked (the table read of a new slot and the
//! stream), a stale owner resumed after a standby took the slot, and poison
//! rows under both `--on-poison` modes. A `read_committed` reader must see
//! every row exactly once, each key in commit order (one writer commits in
//! id order). Every test streams from a slot of its own ([`SlotGuard`]).

use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use ferry::Ferry;
use ferry_relay::OnPoison;

use crate::exactly_once::committed_reader;
use crate::relay::write_orders;
use crate::support::*;
use ferry_testkit::Kafka;

const EOS: &[&str] = &["--exactly-once", "--transactional-id-prefix", "t-eos"];

/// `--capture wal` on the test's slot, exactly once, and `extra`.
fn args<'a>(slot: &'a SlotGuard, extra: &[&'a str]) -> Vec<&'a str> {
    [&slot.args()[..], EOS, extra].concat()
}

/// After a crash: how many rows a `read_committed` reader sees that are
/// still pending (published, committed, not marked). No producer may run.
async fn published_but_pending(ferry: &Ferry, brokers: &str) -> usize {
    let recs = read_all(brokers, "orders", true, Duration::from_secs(60)).await;
    let pending: Vec<i64> = sqlx::query_scalar(&format!("SELECT id FROM {OUTBOX} WHERE state = 'pending'"))
        .fetch_all(ferry.db().as_postgres().unwrap())
        .await
        .unwrap();
    recs.iter().filter(|r| pending.contains(&r.outbox_id())).count()
}

/// SIGTERM, and a clean exit.
fn stop(mut p: RelayProcess) {
    signal(p.id(), "TERM");
    let status = p.wait().unwrap();
    assert!(status.success(), "the relay exits cleanly ({status})");
}

/// Relays SIGKILLed four times while rows stream in: no row is lost, none
/// is seen twice by a `read_committed` reader, each key in commit order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_exactly_once_survives_sigkills_mid_stream() {
    sigkills_mid_stream().await
}

/// The same with `--streams 2`: each stream's transactional producer and
/// progress record of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_exactly_once_survives_sigkills_mid_stream_in_two_streams() {
    STREAMS.scope(2, sigkills_mid_stream()).await
}

async fn sigkills_mid_stream() {
    let broker = Kafka::start();
    broker.create_topic("orders", 6);
    let brokers = broker.brokers();
    let (ferry, url) = pg_ferry().await;
    let slot = SlotGuard::new().await;
    let reader = committed_reader(&brokers, "orders");
    let mut recs: Vec<Record> = Vec::new();
    let per_round = 600;
    for round in 1..=4 {
        let mut child = spawn_relay_process(&url, &brokers, &args(&slot, &[]), &[]);
        let writes = {
            let ferry = ferry.clone();
            tokio::spawn(async move { write_orders(&ferry, per_round, 30).await })
        };
        // Killed with half a round's rows still to come.
        let want = round * per_round - per_round / 2;
        let more = read_until(&reader, Duration::from_secs(120), |r| {
            distinct(recs.iter().chain(r)) >= want
        })
        .await;
        recs.extend(more);
        child.kill().unwrap();
        child.wait().unwrap();
        writes.await.unwrap();
    }
    let total = 4 * per_round;
    let last = spawn_relay_process(&url, &brokers, &args(&slot, &[]), &[]);
    wait_for_count(&ferry, &DELIVERED, total as i64, Duration::from_secs(120)).await;
    stop(last);
    let recs = read_all(&brokers, "orders", true, Duration::from_secs(60)).await;
    assert_once_in_commit_order(&recs, total);
}

/// The worst moment: the relay dies right after a Kafka commit and before
/// that transaction's rows are marked and the slot confirmed past them
/// (the project's `crash-after-commit` failpoint), once in a new slot's
/// table read and once in the stream. The next session finds the rows in
/// the progress record and publishes none of them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_exactly_once_a_crash_between_the_kafka_commit_and_the_mark_publishes_nothing_twice() {
    let broker = Kafka::start();
    broker.create_topic("orders", 6);
    let brokers = broker.brokers();
    let (ferry, url) = pg_ferry().await;
    let slot = SlotGuard::new().await;

    // 1. Rows written before the slot exists: the table read (pages of 50)
    //    crashes after its second page's commit.
    write_orders(&ferry, 200, 20).await;
    let mut child = spawn_relay_process(
        &url,
        &brokers,
        &args(&slot, &[]),
        &[("FERRY_RELAY_FAILPOINT", "crash-after-commit:2")],
    );
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(6), "the failpoint aborted the relay ({status})");
    assert!(
        published_but_pending(&ferry, &brokers).await > 0,
        "the crash left committed rows unmarked"
    );
    let next = spawn_relay_process(&url, &brokers, &args(&slot, &[]), &[]);
    wait_for_count(&ferry, &DELIVERED, 200, Duration::from_secs(120)).await;
    stop(next);

    // 2. The stream: rows arrive in chunks, each committed before the next
    //    is written, until the third Kafka commit crashes the relay.
    let mut child = spawn_relay_process(
        &url,
        &brokers,
        &args(&slot, &[]),
        &[("FERRY_RELAY_FAILPOINT", "crash-after-commit:3")],
    );
    let reader = committed_reader(&brokers, "orders");
    let mut seen: Vec<Record> = read_until(&reader, Duration::from_secs(60), |r| distinct(r) >= 200).await;
    let mut written = 200;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(written < 200 + 50 * 10, "the relay never crashed");
        write_orders(&ferry, 50, 20).await;
        written += 50;
        // Visible once committed, or the crash came first.
        let more = read_until(&reader, Duration::from_secs(60), |r| {
            distinct(seen.iter().chain(r)) >= written || child.try_wait().unwrap().is_some()
        })
        .await;
        seen.extend(more);
    };
    assert_eq!(status.signal(), Some(6), "the failpoint aborted the relay ({status})");
    assert!(
        published_but_pending(&ferry, &brokers).await > 0,
        "the crash left committed rows unmarked"
    );
    let last = spawn_relay_process(&url, &brokers, &args(&slot, &[]), &[]);
    wait_for_count(&ferry, &DELIVERED, written as i64, Duration::from_secs(120)).await;
    stop(last);
    let recs = read_all(&brokers, "orders", true, Duration::from_secs(60)).await;
    assert_once_in_commit_order(&recs, written);
}

/// A stale owner: the active relay is paused (SIGSTOP) and its replication
/// session cut (as `wal_sender_timeout` would), a standby takes the slot
/// and publishes (its `init_transactions` fences the paused relay's
/// producer), then the paused relay resumes (SIGCONT) with its Kafka
/// transaction open. It cannot commit: every row once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_exactly_once_a_stale_owner_cannot_commit_after_a_standby_took_over() {
    let broker = Kafka::start();
    broker.create_topic("orders", 6);
    let brokers = broker.brokers();
    let (ferry, url) = pg_ferry().await;
    let slot = SlotGuard::new().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    let a = spawn_relay_process(&url, &brokers, &args(&slot, &["--relay-id", "relay-a"]), &[]);
    wait_for_streaming(&pool, &slot.name, None, Duration::from_secs(60)).await;
    let total = 2000;
    let writes = {
        let ferry = ferry.clone();
        tokio::spawn(async move { write_orders(&ferry, total, 30).await })
    };
    wait_for_count(&ferry, &DELIVERED, 300, Duration::from_secs(60)).await;
    // A's walsender now (a session of A restarted on a transient error has a new one).
    let a_pid = wait_for_streaming(&pool, &slot.name, None, Duration::from_secs(60)).await;
    signal(a.id(), "STOP");
    let _ = sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(a_pid)
        .execute(&pool)
        .await
        .unwrap();
    let at_stop = scalar(&ferry, &DELIVERED).await;
    let b = spawn_relay_process(&url, &brokers, &args(&slot, &["--relay-id", "relay-b"]), &[]);
    wait_for_streaming(&pool, &slot.name, Some(a_pid), Duration::from_secs(60)).await;
    // B committed and marked transactions of its own.
    wait_for_count(&ferry, &DELIVERED, at_stop + 200, Duration::from_secs(60)).await;
    signal(a.id(), "CONT");
    writes.await.unwrap();
    wait_for_count(&ferry, &DELIVERED, total as i64, Duration::from_secs(120)).await;
    stop(b);
    drop(a);
    let recs = read_all(&brokers, "orders", true, Duration::from_secs(60)).await;
    assert_once_in_commit_order(&recs, total);
}

/// A poison row among seven one-row transactions of one key (the topic's
/// `max.message.bytes` refuses it). Dead: it is found alone, marked dead,
/// its Kafka transaction aborted and streamed again without it; the six
/// others are seen once, in order. Block: the rows before it are published
/// (each transaction alone while isolating), it and everything behind it
/// stay pending, and none of them is seen.
async fn wal_exactly_once_poison(on_poison: OnPoison) {
    let broker = Kafka::start();
    broker.create_topic_with("orders", 3, &[("max.message.bytes", "2000")]);
    let brokers = broker.brokers();
    let (ferry, url) = pg_ferry().await;
    let slot = SlotGuard::new().await;
    let mut cfg = slot.config(&url, &brokers);
    cfg.exactly_once = true;
    cfg.on_poison = on_poison;
    let relay = slot.start(cfg, ferry.clone()).await;
    write_orders(&ferry, 1, 1).await;
    wait_for_count(&ferry, &DELIVERED, 1, Duration::from_secs(60)).await;
    let poison = crate::poison::poison_rows(&ferry).await;
    let dead_rows = &format!("SELECT count(*) FROM {OUTBOX} WHERE state = 'dead'");
    match on_poison {
        OnPoison::Dead => wait_for_count(&ferry, &DELIVERED, 7, Duration::from_secs(60)).await,
        OnPoison::Block => {
            wait_for_count(
                &ferry,
                &format!("SELECT CAST(publish_attempts AS BIGINT) FROM outbox WHERE id = {poison}"),
                3,
                Duration::from_secs(60),
            )
            .await
        }
    }
    relay.shutdown().await;
    let recs = read_all(&brokers, "orders", true, Duration::from_secs(30)).await;
    assert!(
        recs.iter().all(|r| r.outbox_id() != poison),
        "the poison row was never seen"
    );
    match on_poison {
        OnPoison::Dead => {
            assert_eq!(scalar(&ferry, dead_rows).await, 1);
            assert_eq!(
                scalar(
                    &ferry,
                    &format!("SELECT count(*) FROM {OUTBOX} WHERE id = {poison} AND state = 'dead'")
                )
                .await,
                1
            );
            assert_once_in_commit_order(&recs, 7);
        }
        OnPoison::Block => {
            assert_eq!(scalar(&ferry, dead_rows).await, 0);
            assert_eq!(
                scalar(
                    &ferry,
                    &format!("SELECT count(*) FROM {OUTBOX} WHERE state = 'pending' AND id >= {poison}")
                )
                .await,
                4,
                "the poison row and everything behind it stay pending"
            );
            assert_eq!(scalar(&ferry, &DELIVERED).await, 4, "the rows before it are delivered");
            assert_once_in_commit_order(&recs, 4);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_exactly_once_a_poison_row_goes_dead_and_the_rest_is_seen_once() {
    wal_exactly_once_poison(OnPoison::Dead).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_exactly_once_a_poison_row_blocks_and_nothing_behind_it_is_seen() {
    wal_exactly_once_poison(OnPoison::Block).await;
}

/// A row this relay marked dead is left out of its aborted transaction when
/// that is streamed again; once an operator shrinks it and replays it
/// (while the same relay runs), the replay's announcement publishes it: a
/// `read_committed` reader sees it once, and it is delivered (never left
/// pending behind a slot confirmed past its announcement).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_exactly_once_a_dead_row_replayed_while_the_relay_runs_is_published_once() {
    let broker = Kafka::start();
    broker.create_topic_with("orders", 3, &[("max.message.bytes", "2000")]);
    let brokers = broker.brokers();
    let (ferry, url) = pg_ferry().await;
    let slot = SlotGuard::new().await;
    let mut cfg = slot.config(&url, &brokers);
    cfg.exactly_once = true;
    cfg.on_poison = OnPoison::Dead;
    let relay = slot.start(cfg, ferry.clone()).await;
    write_orders(&ferry, 1, 1).await;
    wait_for_count(&ferry, &DELIVERED, 1, Duration::from_secs(60)).await;
    let poison = crate::poison::poison_rows(&ferry).await;
    wait_for_count(&ferry, &DELIVERED, 7, Duration::from_secs(60)).await;
    let is_dead = format!("SELECT count(*) FROM {OUTBOX} WHERE id = {poison} AND state = 'dead'");
    assert_eq!(scalar(&ferry, &is_dead).await, 1);
    sqlx::query("UPDATE outbox SET payload = 'small' WHERE id = $1")
        .bind(poison)
        .execute(ferry.db().as_postgres().unwrap())
        .await
        .unwrap();
    assert_eq!(
        ferry_relay::store::RelayStore::new(ferry.clone())
            .ferry()
            .operator()
            .replay_dead_outbox(Some(poison), "ops", "shrank the record")
            .await
            .unwrap(),
        vec![poison]
    );
    // Rows written after the replay are delivered only once the stream
    // passed the announcement.
    write_orders(&ferry, 1, 1).await;
    wait_for_count(
        &ferry,
        &format!("SELECT count(*) FROM {OUTBOX} WHERE state = 'delivered' AND id = (SELECT max(id) FROM outbox)"),
        1,
        Duration::from_secs(60),
    )
    .await;
    relay.shutdown().await;
    let recs = read_all(&brokers, "orders", true, Duration::from_secs(30)).await;
    let seen = recs.iter().filter(|r| r.outbox_id() == poison).count();
    assert_eq!(
        scalar(
            &ferry,
            &format!("SELECT count(*) FROM {OUTBOX} WHERE id = {poison} AND state = 'delivered'")
        )
        .await,
        1,
        "the replayed row is delivered (seen {seen} times)"
    );
    assert_eq!(seen, 1, "a read_committed reader sees the replayed row once");
    assert_eq!(distinct(&recs), 9);
}

/// The slot is gone (a failover or a restore: the new primary's WAL may
/// sit below the position the last progress record names) and is made
/// anew. That position belongs to the old slot: a transaction the new slot
/// streams below it is published, never taken for one already in Kafka
/// (marked delivered, seen by no reader).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_exactly_once_a_new_slot_ignores_the_old_slot_s_position() {
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let broker = Kafka::start();
    broker.create_topic("orders", 3);
    let brokers = broker.brokers();
    let (ferry, url) = pg_ferry().await;
    let slot = SlotGuard::new().await;
    let mut cfg = slot.config(&url, &brokers);
    cfg.exactly_once = true;
    let relay = slot.start(cfg.clone(), ferry.clone()).await;
    write_orders(&ferry, 1, 1).await;
    wait_for_count(&ferry, &DELIVERED, 1, Duration::from_secs(60)).await;
    relay.shutdown().await;
    // The last progress record names a position ahead of this database's
    // WAL, as one written against the old primary's history does.
    let pool = ferry.db().as_postgres().unwrap().clone();
    let now: i64 = sqlx::query_scalar("SELECT (pg_current_wal_lsn() - '0/0')::bigint")
        .fetch_one(&pool)
        .await
        .unwrap();
    let database = ferry.database_id().await.unwrap();
    let value = serde_json::to_vec(&ferry_relay::exactly_once::WalProgress {
        database: database.to_string(),
        slot: slot.name.clone(),
        end_lsn: now as u64 + (1 << 40),
        catch_up: Vec::new(),
        catch_up_through: 0,
        unmarked: Some(Vec::new()),
    })
    .unwrap();
    let key = ferry_relay::exactly_once::WalProgress::key(&database, &slot.name);
    let producer: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()
        .unwrap();
    producer
        .send(
            FutureRecord::to(&cfg.progress_topic())
                .partition(ferry_relay::exactly_once::WAL_PARTITION)
                .key(&key)
                .payload(&value),
            Duration::from_secs(30),
        )
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !terminate_and_drop_slot(&pool, &slot.name).await {
        assert!(std::time::Instant::now() < deadline, "could not drop the slot");
    }
    let relay = slot.start(cfg, ferry.clone()).await;
    // The new slot is being made (its catch-up flag was cleared before)
    // and then read once: what commits after that is streamed.
    for sql in [
        "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1 AND active",
        "SELECT count(*) FROM relay_wal_slots WHERE slot = $1 AND caught_up",
    ] {
        wait_for_count(
            &ferry,
            &sql.replace("$1", &format!("'{}'", slot.name)),
            1,
            Duration::from_secs(60),
        )
        .await;
    }
    write_orders(&ferry, 5, 1).await;
    wait_for_count(&ferry, &DELIVERED, 6, Duration::from_secs(60)).await;
    relay.shutdown().await;
    let recs = read_all(&brokers, "orders", true, Duration::from_secs(30)).await;
    assert_once_in_commit_order(&recs, 6);
}

/// One PostgreSQL transaction too large to publish within the Kafka
/// transaction's timeout (`transaction.timeout.ms` 2 s here; 200,000 rows,
/// never split): the relay stops it before the broker would abort it at
/// the commit, says so in an error, counts it
/// (`ferry_relay_wal_transactions_too_large_total`) and retries after a
/// backoff, instead of having every session's commit refused with nothing
/// said. A `read_committed` reader sees only the rows before it. Before the
/// bound, nothing counted it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_exactly_once_a_transaction_too_large_for_the_kafka_timeout_fails_loudly() {
    let broker = Kafka::start();
    broker.create_topic("orders", 3);
    let brokers = broker.brokers();
    let (ferry, url) = pg_ferry().await;
    let slot = SlotGuard::new().await;
    let mut cfg = slot.config(&url, &brokers);
    cfg.exactly_once = true;
    cfg.kafka.push(("transaction.timeout.ms".into(), "2000".into()));
    cfg.kafka.push(("message.timeout.ms".into(), "2000".into()));
    let relay = slot.start(cfg, ferry.clone()).await;
    write_orders(&ferry, 10, 5).await;
    wait_for_count(&ferry, &DELIVERED, 10, Duration::from_secs(60)).await;
    sqlx::query(
        "INSERT INTO outbox (tenant, topic, key, lane, payload, headers, created_at)
         SELECT 'acme', 'orders', 'key-' || (g % 20), 0, convert_to('{}', 'UTF8'), '{}'::jsonb, 0
         FROM generate_series(1, 200000) g",
    )
    .execute(ferry.db().as_postgres().unwrap())
    .await
    .unwrap();
    let too_large = &relay.state.metrics.wal_transactions_too_large;
    let started = std::time::Instant::now();
    while too_large.get() == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(90),
            "the too large transaction was never reported"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    relay.shutdown().await;
    assert_eq!(scalar(&ferry, &DELIVERED).await, 10, "nothing of it was marked");
    let recs = read_all(&brokers, "orders", true, Duration::from_secs(60)).await;
    assert_once_in_commit_order(&recs, 10);
}
