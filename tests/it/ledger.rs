//! Readers of delivery state honour the delivered-ranges ledger
//! (`outbox_delivered`, issue #20), on both engines: a run's outbox rows in
//! its lineage, and the operator's backlog (`ferry status`, the relay's
//! gauges). Ranges are inserted directly, as the WAL marker writes them;
//! SQLite's ledger is never written in production, but its statements are
//! the same and must read it the same way.

use std::time::Duration;

use ferry::{Millis, NewRun, OutboxMessage};
use serde_json::json;

use crate::support::{manual_clock, on_every_route, Kind, TestDb, T0};

/// Records ids `lo..=hi` as delivered at `at`, as the WAL marker does.
async fn cover(t: &TestDb, lo: i64, hi: i64, at: i64) {
    t.exec(&format!(
        "INSERT INTO outbox_delivered (lo, hi, delivered_at) VALUES ({lo}, {hi}, {at})"
    ))
    .await
    .unwrap();
}

/// Enqueues `n` rows of `acme`/`orders` keyed `key`, one second apart on
/// `clock`; returns their ids.
async fn enqueue(t: &TestDb, clock: &ferry::Clock, key: &str, n: usize) -> Vec<i64> {
    let mut ids = Vec::new();
    for _ in 0..n {
        let msg = OutboxMessage::json("acme", "orders", key, &json!({})).unwrap();
        ids.push(t.ferry.enqueue(&msg).await.unwrap());
        clock.advance(Duration::from_secs(1)).unwrap();
    }
    ids
}

async fn lineage_reads_delivery_through_the_ledger(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    let run = t
        .ferry
        .create_run_idempotent(NewRun::new("acme", "order", "o-1", json!({})))
        .await
        .unwrap()
        .run;
    let ids = enqueue(&t, &clock, &run.run_id.to_string(), 5).await;
    // ids[0] covered alone; ids[1] in the hole; ids[2..=3] covered, ids[3]
    // dead all the same; ids[4] delivered by a poll relay's per-row mark.
    cover(&t, ids[0], ids[0], 111).await;
    cover(&t, ids[2], ids[3], 222).await;
    t.exec(&format!(
        "UPDATE outbox SET state = 'dead', last_error = 'message_too_large' WHERE id = {}",
        ids[3]
    ))
    .await
    .unwrap();
    t.exec(&format!(
        "UPDATE outbox SET state = 'delivered', delivered_at = 5 WHERE id = {}",
        ids[4]
    ))
    .await
    .unwrap();
    let l = t.ferry.operator().run_lineage("acme", run.run_id).await.unwrap();
    let rows: Vec<_> = l
        .outbox
        .iter()
        .filter(|o| o.topic == "orders")
        .map(|o| (o.id, o.state.as_str(), o.delivered_at.map(Millis::get)))
        .collect();
    assert_eq!(
        rows,
        [
            (ids[0], "delivered", Some(111)),
            (ids[1], "pending", None),
            (ids[2], "delivered", Some(222)),
            (ids[3], "dead", Some(222)),
            (ids[4], "delivered", Some(5)),
        ]
    );
}

async fn the_backlog_leaves_covered_rows_out(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    let ids = enqueue(&t, &clock, "k", 12).await;
    let created = |i: usize| T0 + i as i64 * 1000;
    let backlog = || async { t.ferry.operator().outbox_backlog().await.unwrap() };
    // An empty ledger: every pending row, as before.
    let b = backlog().await;
    assert_eq!((b.pending, b.oldest.get()), (12, created(0)));
    // ids[0] delivered per row and ids[7] dead: not pending, covered or not.
    // Ranges [2, 3] and [5, 6] (ids[7] is dead inside nothing): pending are
    // ids[1] below the first range, ids[4] in the hole, ids[8..] above the
    // last.
    t.exec(&format!(
        "UPDATE outbox SET state = 'delivered', delivered_at = 1 WHERE id = {}",
        ids[0]
    ))
    .await
    .unwrap();
    t.exec(&format!("UPDATE outbox SET state = 'dead' WHERE id = {}", ids[7]))
        .await
        .unwrap();
    cover(&t, ids[2], ids[3], T0).await;
    cover(&t, ids[5], ids[6], T0).await;
    let b = backlog().await;
    assert_eq!((b.pending, b.oldest.get()), (6, created(1)));
    // The oldest pending row covered by a range touching the next one: the
    // hole's row is now the oldest, and touching ranges make no gap.
    cover(&t, ids[1], ids[1], T0).await;
    let b = backlog().await;
    assert_eq!((b.pending, b.oldest.get()), (5, created(4)));
    // Everything delivered: no backlog, however old the covered rows.
    cover(&t, ids[4], ids[4], T0).await;
    cover(&t, ids[8], ids[11], T0).await;
    clock.advance(Duration::from_secs(3600)).unwrap();
    let b = backlog().await;
    assert_eq!((b.pending, b.oldest_age_ms()), (0, 0));
    let status = t.ferry.operator().status_report().await.unwrap();
    assert!(status.contains("pending rows        0\n"), "{status}");
    assert!(status.contains("dead rows           1\n"), "{status}");
}

on_every_route!(
    lineage_reads_delivery_through_the_ledger,
    the_backlog_leaves_covered_rows_out
);
