//! Effect keys are unique across databases: two Ferry databases whose
//! outbox rows share ids, relayed into one topic and consumed by one group,
//! both have their effects applied (a bare outbox id would make the second
//! a duplicate for the whole ledger retention). Caller-chosen effect keys
//! are scoped by tenant. In both capture modes.

use ferry::store::Arg;
use std::time::{Duration, Instant};

use ferry::{Ferry, OutboxMessage};
use ferry_consumer::{Consumer, Handler, HandlerError, Record};
use ferry_relay::Capture;
use ferry_testkit::Kafka;
use futures::future::BoxFuture;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::support::{config_for, in_both_capture_modes, pg_ferry, scalar};

/// Records every application with the effect key it was applied under.
struct Applied;

impl Handler for Applied {
    fn handle<'a>(&'a self, r: &'a Record, tx: &'a mut ferry::Tx) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            let key = r.effect_key().unwrap_or_default();
            let payload = String::from_utf8_lossy(r.payload.as_deref().unwrap_or_default()).into_owned();
            tx.execute(
                "INSERT INTO applied (effect_key, payload) VALUES ($1, $2)",
                &[Arg::from(&key), Arg::from(&payload)],
            )
            .await?;
            Ok(())
        })
    }
}

async fn rows(ferry: &Ferry, sql: &str) -> Vec<String> {
    sqlx::query_scalar(sql)
        .fetch_all(ferry.db().as_postgres().unwrap())
        .await
        .unwrap()
}

async fn two_databases_with_the_same_outbox_ids_both_apply(capture: Capture) {
    let broker = Kafka::start();
    broker.create_topic("orders", 1);
    let (a, url_a) = pg_ferry().await;
    let (b, url_b) = pg_ferry().await;
    // Each database: outbox id 1 (default key) and id 2 with the same
    // caller-chosen effect key, from different tenants.
    for (ferry, db, tenant) in [(&a, "a", "acme"), (&b, "b", "globex")] {
        let id = ferry
            .enqueue(&OutboxMessage::json(tenant, "orders", "k", &json!({"db": db, "n": 1})).unwrap())
            .await
            .unwrap();
        assert_eq!(id, 1);
        let id = ferry
            .enqueue(
                &OutboxMessage::json(tenant, "orders", "k", &json!({"db": db, "n": 2}))
                    .unwrap()
                    .effect_key("charge-1"),
            )
            .await
            .unwrap();
        assert_eq!(id, 2);
    }
    let (cfg_a, guard_a) = config_for(capture, &url_a, &broker.brokers()).await;
    let (cfg_b, guard_b) = config_for(capture, &url_b, &broker.brokers()).await;
    let relay_a = guard_a.start(cfg_a, a.clone()).await;
    let relay_b = guard_b.start(cfg_b, b.clone()).await;
    // One consumer group, its ledger in database a.
    sqlx::query("CREATE TABLE applied (effect_key TEXT NOT NULL, payload TEXT NOT NULL)")
        .execute(a.db().as_postgres().unwrap())
        .await
        .unwrap();
    let c = Consumer::builder(a.clone(), broker.brokers(), "projection", &["orders"])
        .handler(Applied)
        .kafka("session.timeout.ms", "6000")
        .kafka("heartbeat.interval.ms", "500")
        .build()
        .unwrap();
    let metrics = c.metrics();
    let stop = CancellationToken::new();
    let _stop_on_panic = stop.clone().drop_guard();
    let s = stop.clone();
    let consumer = tokio::spawn(async move { c.run(async move { s.cancelled().await }).await.unwrap() });
    let stored = "SELECT COALESCE(max(next_offset), 0) FROM consumer_partitions WHERE group_id = 'projection'";
    let deadline = Instant::now() + Duration::from_secs(90);
    while scalar(&a, stored).await < 4 {
        assert!(Instant::now() < deadline, "the four records were never consumed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.cancel();
    consumer.await.unwrap();
    relay_a.shutdown().await;
    relay_b.shutdown().await;
    assert_eq!(
        rows(&a, "SELECT payload FROM applied ORDER BY payload").await,
        [
            r#"{"db":"a","n":1}"#,
            r#"{"db":"a","n":2}"#,
            r#"{"db":"b","n":1}"#,
            r#"{"db":"b","n":2}"#
        ],
        "every record applied once, none skipped as another database's duplicate"
    );
    assert_eq!((metrics.processed.get(), metrics.duplicates.get()), (4, 0));
    // The keys: `<database id>:<outbox id>` by default, `<tenant>/<key>`
    // for a caller's key; each database has its own id.
    let (id_a, id_b) = (a.database_id().await.unwrap(), b.database_id().await.unwrap());
    assert_ne!(id_a, id_b);
    assert!(uuid::Uuid::parse_str(&id_a).is_ok(), "{id_a}");
    let mut want = vec![
        format!("{id_a}:1"),
        format!("{id_b}:1"),
        "acme/charge-1".to_owned(),
        "globex/charge-1".to_owned(),
    ];
    want.sort();
    assert_eq!(
        rows(
            &a,
            "SELECT effect_key FROM consumer_ledger WHERE group_id = 'projection' ORDER BY effect_key"
        )
        .await,
        want
    );
}

in_both_capture_modes!(two_databases_with_the_same_outbox_ids_both_apply);
