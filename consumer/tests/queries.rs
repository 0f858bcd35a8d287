//! The consumer's SQL prepares on both engines against the migrated schema.

use ferry::Engine;
use ferry_consumer::store::ConsumerStore;
use ferry_testkit::{on_every_route, TestDb};

async fn every_consumer_query_prepares(engine: Engine) {
    let t = TestDb::new(engine).await;
    ConsumerStore::new(t.ferry.clone()).check_queries().await.unwrap();
}

/// A micro-batch's ledger rows, inserted in one statement, tell each record
/// what inserting them one by one would: a key already in the ledger, or met
/// earlier in the batch, is a duplicate, and a repeated key's row keeps its
/// first record's offset.
async fn a_batch_s_ledger_rows_match_one_by_one(engine: Engine) {
    use ferry_consumer::store::LedgerEntry::{Duplicate, New};
    let t = TestDb::new(engine).await;
    let store = ConsumerStore::new(t.ferry.clone());
    let (lease, _) = store
        .acquire_partition("g", "orders", 0, "m", std::time::Duration::from_secs(30))
        .await
        .unwrap();
    let mut tx = store.begin().await.unwrap();
    store
        .begin_record(tx.conn(), &lease, "seen", 0, "applied")
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let mut tx = store.begin().await.unwrap();
    store.lock_partition(tx.conn(), &lease).await.unwrap();
    let batch = [("a", 1), ("seen", 2), ("b", 3), ("a", 4), ("c", 5)];
    let entries = store.insert_ledger_batch(tx.conn(), &lease, &batch).await.unwrap();
    assert_eq!(entries, [New, Duplicate, New, Duplicate, New]);
    tx.commit().await.unwrap();
    let db = t.ferry.db();
    let offset =
        |key: &str| format!("SELECT \"offset\" FROM consumer_ledger WHERE group_id = 'g' AND effect_key = '{key}'");
    assert_eq!(db.fetch_i64("SELECT count(*) FROM consumer_ledger").await.unwrap(), 4);
    assert_eq!(
        db.fetch_i64(&offset("a")).await.unwrap(),
        1,
        "a repeated key keeps its first record's offset"
    );
    assert_eq!(db.fetch_i64(&offset("b")).await.unwrap(), 3);
    assert_eq!(db.fetch_i64(&offset("seen")).await.unwrap(), 0);
}

/// Counts its calls; writes nothing.
struct Count(std::sync::atomic::AtomicUsize);

impl ferry_consumer::Handler for Count {
    fn handle<'a>(
        &'a self,
        _record: &'a ferry_consumer::Record,
        _tx: &'a mut ferry::Tx,
    ) -> futures::future::BoxFuture<'a, Result<(), ferry_consumer::HandlerError>> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Box::pin(async { Ok(()) })
    }
}

/// A micro-batch of a member whose partition was taken over is refused at
/// its one lock, before any ledger row or handler: the lock taken once per
/// batch fences as the lock per record did.
async fn a_stale_member_s_batch_writes_nothing(engine: Engine) {
    let t = TestDb::new(engine).await;
    let store = ConsumerStore::new(t.ferry.clone());
    let lease = std::time::Duration::from_secs(30);
    let (stale, _) = store.acquire_partition("g", "orders", 0, "a", lease).await.unwrap();
    store.acquire_partition("g", "orders", 0, "b", lease).await.unwrap();
    let records: Vec<ferry_consumer::Record> = (0..3)
        .map(|offset| ferry_consumer::Record {
            topic: "orders".into(),
            partition: 0,
            offset,
            key: None,
            payload: None,
            headers: Default::default(),
            timestamp: None,
        })
        .collect();
    let keyed: Vec<(&ferry_consumer::Record, String)> = records.iter().map(|r| (r, format!("k{}", r.offset))).collect();
    let handler = Count(Default::default());
    let err = ferry_consumer::process_batch(&store, &stale, &keyed, &handler)
        .await
        .unwrap_err();
    assert!(matches!(err.error, ferry_consumer::ProcessError::LostLease(_)), "{err}");
    assert_eq!(err.at, None, "no record is to blame");
    assert_eq!(handler.0.load(std::sync::atomic::Ordering::SeqCst), 0);
    let db = t.ferry.db();
    assert_eq!(db.fetch_i64("SELECT count(*) FROM consumer_ledger").await.unwrap(), 0);
    assert_eq!(
        db.fetch_i64("SELECT COALESCE(max(next_offset), -1) FROM consumer_partitions")
            .await
            .unwrap(),
        -1
    );
}

on_every_route!(
    every_consumer_query_prepares,
    a_batch_s_ledger_rows_match_one_by_one,
    a_stale_member_s_batch_writes_nothing
);
