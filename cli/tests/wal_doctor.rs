//! `doctor` and `status` on WAL capture slots, on a PostgreSQL cluster of
//! the test's own (it changes `max_slot_wal_keep_size` and invalidates a
//! slot): nothing where no relay made a slot; an inactive slot, a slot
//! holding WAL back, and an unbounded `max_slot_wal_keep_size`, warn; a lost
//! slot warns; before PostgreSQL 17 the failover check says what a failover
//! costs (no slot can be synchronised).

use ferry::Ferry;
use ferry_cli::doctor::{Finding, RelayThresholds, Severity};
use ferry_relay::store::RelayStore;
use ferry_testkit::PgCluster;

fn items<'a>(findings: &'a [Finding], check: &str) -> &'a [String] {
    &findings
        .iter()
        .find(|f| f.check == check)
        .unwrap_or_else(|| panic!("no check {check} in {findings:?}"))
        .items
}

/// The relay-side findings, warning about any WAL a slot holds back when
/// `lag_bytes` is 0.
async fn relay_findings(ferry: &Ferry, lag_bytes: i64) -> Vec<Finding> {
    let thresholds = RelayThresholds {
        slot_lag_bytes: lag_bytes,
        ..RelayThresholds::default()
    };
    ferry_cli::doctor::relay(ferry, &thresholds, 20).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_warns_about_slots_that_hold_wal_back() {
    let pg = PgCluster::start();
    let ferry = Ferry::builder(pg.url()).migrate(true).connect().await.unwrap();
    let pool = ferry.db().as_postgres().unwrap().clone();
    let none = relay_findings(&ferry, 0).await;
    assert!(
        none.iter()
            .all(|f| f.check != "wal_capture" && f.items.is_empty() && f.skipped.is_none()),
        "no slot, no WAL finding: {none:?}"
    );

    // A slot no relay streams from, and WAL written since it was made.
    let store = RelayStore::new(ferry.clone());
    assert!(store
        .create_wal_slot("ferry_doctor", false, std::future::pending())
        .await
        .unwrap());
    sqlx::raw_sql("CREATE TABLE filler AS SELECT generate_series(1, 1000) AS n")
        .execute(&pool)
        .await
        .unwrap();
    let f = relay_findings(&ferry, 0).await;
    let capture = items(&f, "wal_capture");
    assert_eq!(
        capture[0], "capture: none (no relay streams from a slot or holds a lane)",
        "{capture:?}"
    );
    assert!(
        capture[1].starts_with("ferry_doctor: inactive, lag ") && capture[1].contains("wal_status reserved"),
        "{capture:?}"
    );
    let inactive = items(&f, "wal_slot_inactive");
    assert!(
        inactive.len() == 1 && inactive[0].starts_with("ferry_doctor: inactive, lag "),
        "{inactive:?}"
    );
    let lagging = items(&f, "wal_slot_lag");
    assert!(
        lagging.len() == 1
            && lagging[0].starts_with("ferry_doctor: lag ")
            && lagging[0].ends_with(" bytes (more than 0)"),
        "{lagging:?}"
    );
    assert_eq!(
        items(&f, "wal_keep_size_unbounded"),
        ["max_slot_wal_keep_size: -1 (unbounded) with slots ferry_doctor"]
    );
    assert!(items(&f, "wal_slot_wal_status").is_empty());
    for w in [
        "wal_slot_inactive",
        "wal_slot_lag",
        "wal_slot_wal_status",
        "wal_keep_size_unbounded",
    ] {
        let sev = f.iter().find(|x| x.check == w).unwrap().severity;
        assert_eq!(sev, Severity::Warning, "{w}");
    }
    // PostgreSQL 15 has no failover slots: the check says what a failover
    // costs instead of warning.
    let failover = f.iter().find(|x| x.check == "wal_slot_not_synchronized").unwrap();
    let version = ferry.operator().wal_failover().await.unwrap().version;
    if version < 170_000 {
        assert!(
            failover.skipped.is_some_and(|why| why.contains("makes the slot anew")),
            "{failover:?}"
        );
    } else {
        assert!(
            failover
                .items
                .iter()
                .any(|i| i.contains("synchronized_standby_slots is empty")),
            "{failover:?}"
        );
    }
    let roomy = relay_findings(&ferry, i64::MAX).await;
    assert!(items(&roomy, "wal_slot_lag").is_empty(), "below the threshold");
    assert_eq!(items(&roomy, "wal_slot_inactive").len(), 1, "inactive at any lag");

    // A bounded retention, exceeded: PostgreSQL invalidates the slot.
    pg.configure(&[("max_slot_wal_keep_size", "1MB")]).await;
    pg.invalidate_slot("ferry_doctor").await;
    let f = relay_findings(&ferry, i64::MAX).await;
    assert_eq!(items(&f, "wal_slot_wal_status"), ["ferry_doctor: wal_status lost"]);
    assert!(items(&f, "wal_keep_size_unbounded").is_empty(), "{f:?}");
    let status = ferry.operator().status_report().await.unwrap();
    assert!(
        status
            .lines()
            .any(|l| l.starts_with("wal slot ferry_doctor") && l.contains("wal_status lost")),
        "{status}"
    );
}
