//! WAL capture across a primary failover: a primary with a
//! synchronous streaming standby (`PgCluster::start_standby`), the primary
//! crashed (an immediate shutdown) mid-stream, the standby promoted, and a
//! relay started against it. PostgreSQL 15 does not carry logical slots to
//! a standby, so the new primary's slot is made anew and the rows not
//! delivered are read from the table. One scenario, run as a table over the
//! delivery modes: at least once, nothing is lost and no row delivered
//! before the promotion is produced again; exactly once, a `read_committed`
//! reader sees every row once, each key in commit order, although the
//! relay died right after a Kafka commit and before marking it (so the
//! progress record alone knows those rows are in Kafka, and its stream
//! position means nothing on the new primary).

use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

use ferry::{Ferry, OutboxMessage};
use ferry_testkit::{Kafka, PgCluster};
use serde_json::json;

use crate::support::*;

/// The delivery mode a scenario runs in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    AtLeastOnce,
    ExactlyOnce,
}

const SLOT: &str = "ferry_failover";

impl Mode {
    fn args(self) -> Vec<&'static str> {
        let mut args = vec!["--capture", "wal", "--slot", SLOT];
        if self == Mode::ExactlyOnce {
            args.extend(["--exactly-once", "--transactional-id-prefix", "t-failover"]);
        }
        args
    }
}

/// Enqueues `n` rows of 20 keys from `from`; stops at the first error (the
/// primary went away) and returns how many committed or may have.
async fn write(ferry: &Ferry, from: usize, n: usize) -> usize {
    for i in from..from + n {
        let msg = OutboxMessage::json("acme", "orders", format!("key-{}", i % 20), &json!({ "i": i })).unwrap();
        if ferry.enqueue(&msg).await.is_err() {
            return i - from;
        }
    }
    n
}

async fn a_promotion_mid_stream(mode: Mode) {
    let broker = Kafka::start();
    broker.create_topic("orders", 6);
    let brokers = broker.brokers();
    let mut primary = PgCluster::start();
    let standby = primary.start_standby().await;
    let ferry = Ferry::builder(primary.url()).migrate(true).connect().await.unwrap();
    let pool = ferry.db().as_postgres().unwrap().clone();
    // Exactly once, the relay aborts right after its third Kafka commit,
    // before marking it: those rows are in Kafka and pending everywhere.
    let env: &[(&str, &str)] = match mode {
        Mode::ExactlyOnce => &[("FERRY_RELAY_FAILPOINT", "crash-after-commit:3")],
        Mode::AtLeastOnce => &[],
    };
    let mut relay = spawn_relay_process(&primary.url(), &brokers, &mode.args(), env);
    wait_for_streaming(&pool, SLOT, None, Duration::from_secs(60)).await;
    // Chunks of 50 rows, bounded in time, not in rows written (a fresh
    // broker's transaction coordinator may take a while to load). At least
    // once, the writer runs ahead of the relay (the crash comes with rows
    // in flight); exactly once, each chunk waits until the relay marked it
    // or aborted, so its third commit comes within a few chunks.
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut written = 0;
    'chunks: loop {
        written += write(&ferry, written, 50).await;
        loop {
            let delivered = scalar(&ferry, &DELIVERED).await as usize;
            match mode {
                Mode::ExactlyOnce if relay.try_wait().unwrap().is_some() => break 'chunks,
                Mode::ExactlyOnce if delivered >= written => break,
                Mode::AtLeastOnce if delivered >= 300 => break 'chunks,
                Mode::AtLeastOnce => break,
                Mode::ExactlyOnce => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
        assert!(
            Instant::now() < deadline,
            "the relay never got there: {written} rows written"
        );
    }
    // Under load (at least once, the relay still streams and marks): the
    // primary dies at once, the standby takes over, and the relay is
    // restarted against it.
    let writer = {
        let ferry = ferry.clone();
        tokio::spawn(async move { write(&ferry, written, 100_000).await })
    };
    tokio::task::block_in_place(|| primary.crash());
    let _ = writer.await.unwrap();
    if mode == Mode::ExactlyOnce {
        let status = relay.wait().unwrap();
        assert_eq!(status.signal(), Some(6), "the failpoint aborted the relay ({status})");
    }
    drop(relay);
    standby.promote().await;
    let ferry = Ferry::builder(standby.url()).connect().await.unwrap();
    let pool = ferry.db().as_postgres().unwrap().clone();
    let delivered = delivered_ids(&pool).await;
    let ends = end_offsets(&brokers, "orders");
    let before = scalar(&ferry, "SELECT count(*) FROM outbox").await as usize;
    assert_eq!(write(&ferry, 1_000_000, 200).await, 200, "the new primary takes writes");
    let relay = spawn_relay_process(&standby.url(), &brokers, &mode.args(), &[]);
    let total = before + 200;
    wait_for_count(&ferry, &DELIVERED, total as i64, Duration::from_secs(120)).await;
    drop(relay);
    let ids: Vec<i64> = sqlx::query_scalar("SELECT id FROM outbox ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(ids.len(), total);
    match mode {
        Mode::ExactlyOnce => {
            let recs = read_all(&brokers, "orders", true, Duration::from_secs(60)).await;
            assert_once_in_commit_order(&recs, total);
        }
        Mode::AtLeastOnce => {
            let recs = read_all(&brokers, "orders", false, Duration::from_secs(60)).await;
            let duplicates = nothing_lost(&recs, &ids);
            assert_nothing_delivered_produced_again(&recs, &delivered, &ends, "the promotion");
            eprintln!("failover, at least once: {duplicates} duplicates in {total} rows");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_failover_at_least_once_loses_nothing_and_republishes_nothing_delivered() {
    a_promotion_mid_stream(Mode::AtLeastOnce).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_failover_exactly_once_publishes_every_row_once() {
    a_promotion_mid_stream(Mode::ExactlyOnce).await;
}
