//! The relay's SQL prepares on both engines against the migrated schema.

use ferry::Engine;
use ferry_relay::store::RelayStore;
use ferry_testkit::{on_both_engines, TestDb};

async fn every_relay_query_prepares(engine: Engine) {
    let t = TestDb::new(engine).await;
    RelayStore::new(t.ferry.clone()).check_queries().await.unwrap();
}

on_both_engines!(every_relay_query_prepares);
