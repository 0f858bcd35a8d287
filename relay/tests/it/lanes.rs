//! Lane ownership against PostgreSQL and Apache Kafka: lanes the database
//! says a relay holds but it has no task for are published, mixed
//! `--max-lanes` settings leave no lane unowned, publish errors are fenced,
//! and expired relay instances are swept. Poll capture only: lane leases
//! are how polled lanes are owned; WAL capture holds no lanes (one relay
//! streams from the slot, `capture.rs`).

use std::time::{Duration, Instant};

use crate::relay::write_orders;
use crate::support::*;
use ferry_testkit::Kafka;

async fn delivered_within(ferry: &ferry::Ferry, want: i64, limit: Duration, what: &str) {
    let start = Instant::now();
    while scalar(
        ferry,
        &format!("SELECT count(*) FROM {OUTBOX} WHERE state = 'delivered'"),
    )
    .await
        < want
    {
        assert!(start.elapsed() < limit, "{what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The three ways a relay id can own lanes in the database without a local
/// task: a crash and restart with the same `--relay-id` inside the lease, an
/// acquire whose reply was lost, a release that failed. The lease (60 s) is
/// far longer than the bound (20 s): renewing such lanes without publishing
/// them would strand their rows until the test gives up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lanes_owned_without_a_task_are_published() {
    let broker = Kafka::start();
    broker.create_topic("orders", 6);
    let (ferry, url) = pg_ferry().await;
    let mut cfg = relay_config(&url, &broker.brokers());
    cfg.lease = Duration::from_secs(60);
    cfg.relay_id = Some("pod-0".into());

    // A crash: the relay's task is dropped with every lane still leased.
    let a = start_relay(cfg.clone(), ferry.clone()).await;
    write_orders(&ferry, 50, 10).await;
    delivered_within(&ferry, 50, Duration::from_secs(30), "the first relay published").await;
    a.handle.abort();
    let _ = a.handle.await;
    assert_eq!(
        scalar(&ferry, "SELECT count(*) FROM relay_lanes WHERE owner = 'pod-0'").await,
        64,
        "the crashed relay left its lanes leased"
    );
    // Restarted at once with the same id.
    let b = start_relay(cfg.clone(), ferry.clone()).await;
    write_orders(&ferry, 50, 10).await;
    delivered_within(
        &ferry,
        100,
        Duration::from_secs(20),
        "rows behind orphaned lanes stayed pending",
    )
    .await;
    b.shutdown().await;

    // A lost acquire reply (or a failed release): the database holds lanes
    // for pod-0 that no running relay knows about.
    let taken = ferry_relay::store::RelayStore::new(ferry.clone())
        .acquire_lanes("pod-0", cfg.lease, 64)
        .await
        .unwrap();
    assert_eq!(taken.len(), 64);
    let c = start_relay(cfg, ferry.clone()).await;
    write_orders(&ferry, 50, 10).await;
    delivered_within(
        &ferry,
        150,
        Duration::from_secs(20),
        "rows behind lost-reply lanes stayed pending",
    )
    .await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capped_relay_beside_an_uncapped_one_leaves_no_lane_unowned() {
    let broker = Kafka::start();
    let (ferry, url) = pg_ferry().await;
    let mut small = relay_config(&url, &broker.brokers());
    small.max_lanes = 10;
    small.relay_id = Some("small".into());
    let mut big = relay_config(&url, &broker.brokers());
    big.relay_id = Some("big".into());
    let a = start_relay(small, ferry.clone()).await;
    let b = start_relay(big, ferry.clone()).await;
    let owned = "SELECT count(*) FROM relay_lanes WHERE owner IS NOT NULL";
    let start = Instant::now();
    while scalar(&ferry, owned).await < 64
        || scalar(&ferry, "SELECT count(*) FROM relay_lanes WHERE owner = 'small'").await != 10
    {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{} lanes owned, {} by the capped relay",
            scalar(&ferry, owned).await,
            scalar(&ferry, "SELECT count(*) FROM relay_lanes WHERE owner = 'small'").await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_errors_are_fenced_and_dead_instances_swept() {
    let (ferry, _) = pg_ferry().await;
    write_orders(&ferry, 1, 1).await;
    let id = scalar(&ferry, "SELECT max(id) FROM outbox").await;
    let lane = scalar(&ferry, "SELECT CAST(max(lane) AS BIGINT) FROM outbox").await as i32;
    let lease = Duration::from_secs(30);
    let a = ferry_relay::store::RelayStore::new(ferry.clone())
        .acquire_lanes("a", lease, 64)
        .await
        .unwrap();
    let a_lane = *a.iter().find(|l| l.lane == lane).unwrap();
    ferry_relay::store::RelayStore::new(ferry.clone())
        .release_lane("a", a_lane)
        .await
        .unwrap();
    let b = ferry_relay::store::RelayStore::new(ferry.clone())
        .acquire_lanes("b", lease, 64)
        .await
        .unwrap();
    let err = ferry_relay::store::RelayStore::new(ferry.clone())
        .note_publish_error("a", a_lane, id, "timeout")
        .await
        .unwrap_err();
    assert_eq!(err.code(), "lost_lease");
    assert_eq!(
        scalar(
            &ferry,
            &format!("SELECT CAST(publish_attempts AS BIGINT) FROM outbox WHERE id = {id}")
        )
        .await,
        0,
        "a relay that lost the lane counted an attempt"
    );
    let b_lane = *b.iter().find(|l| l.lane == lane).unwrap();
    ferry_relay::store::RelayStore::new(ferry.clone())
        .note_publish_error("b", b_lane, id, "timeout")
        .await
        .unwrap();
    assert_eq!(
        scalar(
            &ferry,
            &format!("SELECT CAST(publish_attempts AS BIGINT) FROM outbox WHERE id = {id}")
        )
        .await,
        1
    );

    // Instances whose heartbeat expired are swept by the next heartbeat.
    sqlx::query("INSERT INTO relay_instances (owner, expires_at) SELECT 'gone-' || g, 1 FROM generate_series(1, 50) g")
        .execute(ferry.db().as_postgres().unwrap())
        .await
        .unwrap();
    let live = ferry_relay::store::RelayStore::new(ferry.clone())
        .relay_heartbeat("me", lease, 64)
        .await
        .unwrap();
    assert_eq!(live.len(), 1);
    assert_eq!(scalar(&ferry, "SELECT count(*) FROM relay_instances").await, 1);
}
