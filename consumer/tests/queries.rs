//! The consumer's SQL prepares on both engines against the migrated schema.

use ferry::Engine;
use ferry_consumer::store::ConsumerStore;
use ferry_testkit::{on_both_engines, TestDb};

async fn every_consumer_query_prepares(engine: Engine) {
    let t = TestDb::new(engine).await;
    ConsumerStore::new(t.ferry.clone()).check_queries().await.unwrap();
}

on_both_engines!(every_consumer_query_prepares);
