//! Bulk acceptance (`create_runs_idempotent`): every item answered as the
//! single call would answer it, in input order, on both engines.

use std::time::Duration;

use ferry::{Accepted, Error, Ferry, NewRun};
use serde_json::json;
use uuid::Uuid;

use crate::support::{charge, counts, manual_clock, on_every_route, Kind, TestDb};

/// Every row of `table`, each as one line of text with all its columns, in
/// `order`: what "the same rows" means below.
async fn dump(t: &TestDb, table: &str, order: &str) -> Vec<String> {
    match t.ferry.db() {
        ferry::Db::Postgres(p) => sqlx::query_scalar(&format!("SELECT t::text FROM {table} t ORDER BY {order}"))
            .fetch_all(p)
            .await
            .unwrap(),
        ferry::Db::Sqlite(p) => {
            let cols: Vec<String> =
                sqlx::query_scalar(&format!("SELECT name FROM pragma_table_info('{table}') ORDER BY cid"))
                    .fetch_all(p)
                    .await
                    .unwrap();
            let row = cols
                .iter()
                .map(|c| format!("quote({c})"))
                .collect::<Vec<_>>()
                .join(" || '|' || ");
            sqlx::query_scalar(&format!("SELECT {row} FROM {table} ORDER BY {order}"))
                .fetch_all(p)
                .await
                .unwrap()
        }
    }
}

async fn dump_all(t: &TestDb) -> Vec<Vec<String>> {
    vec![
        dump(t, "runs", "tenant, run_id").await,
        dump(t, "run_events", "tenant, run_id, seq").await,
        dump(t, "jobs", "tenant, run_id").await,
        dump(t, "idempotency_keys", "tenant, operation, key").await,
        dump(t, "outbox", "id").await,
    ]
}

/// A varied batch: queues, attempt budgets, deadlines, schema versions,
/// traceparents, two tenants and two operations, with proposed run ids so
/// two databases can be compared row for row.
fn varied(n: usize) -> Vec<NewRun> {
    (0..n)
        .map(|i| {
            let tenant = if i % 3 == 0 { "globex" } else { "acme" };
            let op = if i % 2 == 0 { "charge" } else { "refund" };
            let mut run = NewRun::new(
                tenant,
                op,
                format!("k-{i}"),
                json!({"i": i, "note": "x\u{e9}", "n": 1.5}),
            )
            .run_id(Uuid::now_v7())
            .queue(if i % 4 == 0 { "slow" } else { "default" })
            .max_attempts(1 + (i as u32 % 7))
            .schema_version(1 + (i as u32 % 2));
            if i % 5 == 0 {
                run = run.deadline(Duration::from_secs(60 + i as u64));
            }
            if i % 6 == 0 {
                run = run.traceparent(format!("00-4bf92f3577b34da6a3ce929d0e0e{i:04x}-00f067aa0ba902b7-01"));
            }
            run
        })
        .collect()
}

async fn a_batch_writes_what_single_acceptances_write(kind: Kind) {
    const N: usize = 40;
    let runs = varied(N);
    let single = TestDb::with_clock(kind, manual_clock()).await;
    let batch = TestDb::with_clock(kind, manual_clock()).await;

    let mut tx = single.ferry.begin().await.unwrap();
    let mut one_by_one = Vec::new();
    for run in runs.clone() {
        one_by_one.push(single.ferry.create_run_idempotent_in(tx.conn(), run).await.unwrap());
    }
    tx.commit().await.unwrap();

    let together: Vec<Accepted> = batch
        .ferry
        .create_runs_idempotent(runs)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap())
        .collect();

    assert_eq!(together, one_by_one, "the same answers, in input order");
    assert!(together.iter().all(|a| !a.replay));
    assert_eq!(counts(&batch).await, [N as i64; 5]);
    let (a, b) = (dump_all(&single).await, dump_all(&batch).await);
    for (table, (a, b)) in ["runs", "run_events", "jobs", "idempotency_keys", "outbox"]
        .iter()
        .zip(a.iter().zip(&b))
    {
        assert_eq!(a, b, "{table}: the batch wrote other rows than the single calls");
    }
    for a in &together {
        assert_eq!(batch.ferry.get_run(&a.run.tenant, a.run.run_id).await.unwrap(), a.run);
    }
}

async fn a_mixed_batch_answers_each_item_in_order(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    let old = t.ferry.create_run_idempotent(charge("k-old", 1)).await.unwrap();
    clock.advance(Duration::from_secs(24 * 3600)).unwrap();
    let seen = t.ferry.create_run_idempotent(charge("k-seen", 5)).await.unwrap();
    let taken_id = t
        .ferry
        .create_run_idempotent(charge("k-other", 9))
        .await
        .unwrap()
        .run
        .run_id;
    let before = counts(&t).await;

    let equivalent = NewRun::new(
        "acme",
        "charge",
        "k-seen",
        serde_json::from_str(r#"{ "currency": "EUR", "amount": 5.0 }"#).unwrap(),
    );
    let batch = vec![
        charge("k-new-1", 1),                      // 0: new
        equivalent.clone().run_id(Uuid::now_v7()), // 1: replay of `seen`
        charge("k-seen", 6),                       // 2: conflict with `seen`
        charge("has space", 1),                    // 3: invalid
        charge("k-dup", 7),                        // 4: new, first of its key
        charge("k-dup", 7),                        // 5: replay of item 4
        charge("k-dup", 8),                        // 6: conflict with item 4
        charge("k-old", 2),                        // 7: takes over the expired key
        charge("k-old", 2),                        // 8: replay of item 7
        charge("k-fresh", 3).run_id(taken_id),     // 9: a new key, an existing run id
        equivalent.run_id(old.run.run_id),         // 10: a live key wins over an existing run id
        charge("k-new-2", 1).max_attempts(0),      // 11: invalid
        charge("k-new-2", 2),                      // 12: new (the invalid item took nothing)
    ];
    let out = t.ferry.create_runs_idempotent(batch).await.unwrap();
    assert_eq!(out.len(), 13);
    let ok = |i: usize| out[i].as_ref().unwrap_or_else(|e| panic!("item {i}: {e}"));
    let code = |i: usize| out[i].as_ref().map(|_| "ok").unwrap_or_else(|e| e.code());

    for i in [0, 4, 7, 12] {
        assert!(!ok(i).replay, "item {i} is new");
    }
    assert_eq!(ok(0).run.request, json!({"amount": 1, "currency": "EUR"}));
    assert_eq!(ok(12).run.request, json!({"amount": 2, "currency": "EUR"}));
    assert!(ok(1).replay);
    assert_eq!(ok(1).run, seen.run, "a replay answers with the original run");
    match &out[2] {
        Err(Error::IdempotencyConflict { existing_run, .. }) => assert_eq!(*existing_run, seen.run.run_id),
        other => panic!("item 2: {other:?}"),
    }
    assert_eq!(code(3), "invalid_input");
    assert!(ok(5).replay);
    assert_eq!(ok(5).run, ok(4).run, "an in-batch duplicate replays the first");
    match &out[6] {
        Err(Error::IdempotencyConflict { existing_run, .. }) => assert_eq!(*existing_run, ok(4).run.run_id),
        other => panic!("item 6: {other:?}"),
    }
    assert_ne!(ok(7).run.run_id, old.run.run_id, "an expired key is taken over");
    assert!(ok(8).replay);
    assert_eq!(ok(8).run.run_id, ok(7).run.run_id);
    match &out[9] {
        Err(Error::DuplicateRun { run_id }) => assert_eq!(*run_id, taken_id),
        other => panic!("item 9: {other:?}"),
    }
    assert!(ok(10).replay);
    assert_eq!(ok(10).run.run_id, seen.run.run_id);
    assert_eq!(code(11), "invalid_input");

    let after = counts(&t).await;
    let keys_added = 3; // k-new-1, k-dup, k-new-2; k-old was replaced in place
    assert_eq!(
        after,
        [
            before[0] + 4,
            before[1] + 4,
            before[2] + 4,
            before[3] + keys_added,
            before[4] + 4
        ],
        "only the four new items wrote"
    );
    for i in [0, 4, 7, 12] {
        let run = &ok(i).run;
        assert_eq!(t.ferry.get_run("acme", run.run_id).await.unwrap(), *run);
        assert_eq!(t.ferry.list_events("acme", run.run_id).await.unwrap().len(), 1);
    }
    assert_eq!(
        t.scalar(
            "SELECT count(*) FROM runs WHERE CAST(request AS TEXT) LIKE '%8%' OR CAST(request AS TEXT) LIKE '%6%'"
        )
        .await,
        0,
        "no conflicting request was stored"
    );
    // The key record points at the batch's winner.
    assert!(t.ferry.create_run_idempotent(charge("k-dup", 7)).await.unwrap().replay);
    assert!(t.ferry.create_run_idempotent(charge("k-fresh", 3)).await.is_ok());
}

async fn a_batch_in_the_callers_transaction_rolls_back_with_it(kind: Kind) {
    let t = TestDb::new(kind).await;
    let runs: Vec<NewRun> = (0..20).map(|i| charge(&format!("k-{i}"), i)).collect();
    let mut tx = t.ferry.begin().await.unwrap();
    let out = t
        .ferry
        .create_runs_idempotent_in(tx.conn(), runs.clone())
        .await
        .unwrap();
    assert!(out.iter().all(|r| matches!(r, Ok(a) if !a.replay)));
    tx.rollback().await.unwrap();
    assert_eq!(counts(&t).await, [0; 5], "the rollback took all of it");

    let mut tx = t.ferry.begin().await.unwrap();
    let out = t.ferry.create_runs_idempotent_in(tx.conn(), runs).await.unwrap();
    assert!(
        out.iter().all(|r| matches!(r, Ok(a) if !a.replay)),
        "nothing was left to replay"
    );
    tx.commit().await.unwrap();
    assert_eq!(counts(&t).await, [20; 5]);
}

async fn a_replayed_batch_writes_nothing(kind: Kind) {
    let t = TestDb::new(kind).await;
    let runs: Vec<NewRun> = (0..30).map(|i| charge(&format!("k-{i}"), i)).collect();
    let first: Vec<Accepted> = t
        .ferry
        .create_runs_idempotent(runs.clone())
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    let before = dump_all(&t).await;
    assert_eq!(counts(&t).await, [30; 5]);
    // Again, with other proposed run ids, which a replay ignores.
    let again: Vec<Accepted> = t
        .ferry
        .create_runs_idempotent(runs.into_iter().map(|r| r.run_id(Uuid::now_v7())).collect())
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    assert!(again.iter().all(|a| a.replay));
    assert_eq!(
        again.iter().map(|a| &a.run).collect::<Vec<_>>(),
        first.iter().map(|a| &a.run).collect::<Vec<_>>()
    );
    assert_eq!(dump_all(&t).await, before, "a replayed batch writes nothing");
}

async fn a_run_id_proposed_twice_goes_to_the_first_winner(kind: Kind) {
    let t = TestDb::new(kind).await;
    let seen = t.ferry.create_run_idempotent(charge("k-seen", 5)).await.unwrap();
    let id = Uuid::now_v7();
    let out = t
        .ferry
        .create_runs_idempotent(vec![
            charge("k-seen", 5).run_id(id), // a replay: does not take the id
            charge("k-a", 1).run_id(id),    // wins the id
            charge("k-b", 2).run_id(id),    // a duplicate run
        ])
        .await
        .unwrap();
    assert_eq!(out[0].as_ref().unwrap().run.run_id, seen.run.run_id);
    assert_eq!(out[1].as_ref().unwrap().run.run_id, id);
    assert_eq!(out[2].as_ref().unwrap_err().code(), "duplicate_run");
    assert_eq!(counts(&t).await, [2, 2, 2, 2, 2]);
    assert!(
        !t.ferry.create_run_idempotent(charge("k-b", 2)).await.unwrap().replay,
        "the refused item left its key free"
    );
}

async fn an_empty_or_invalid_batch_writes_nothing(kind: Kind) {
    let t = TestDb::new(kind).await;
    assert!(t.ferry.create_runs_idempotent(Vec::new()).await.unwrap().is_empty());
    let out = t
        .ferry
        .create_runs_idempotent(vec![charge("", 1), NewRun::new("acme", "charge", "k", json!([1]))])
        .await
        .unwrap();
    assert!(out.iter().all(|r| r.as_ref().unwrap_err().code() == "invalid_input"));
    assert_eq!(counts(&t).await, [0; 5]);
}

async fn a_start_whose_deadline_overflows_refuses_that_item_only(kind: Kind) {
    let t = TestDb::new(kind).await;
    // The deadline counts from the start: past the last instant.
    let far = ferry::Millis::new(i64::MAX - 5).unwrap();
    let out = t
        .ferry
        .create_runs_idempotent(vec![
            charge("k-good", 1),
            charge("k-far", 2).run_at(far).deadline(Duration::from_secs(60)),
        ])
        .await
        .unwrap();
    assert!(!out[0].as_ref().unwrap().replay);
    assert_eq!(out[1].as_ref().unwrap_err().code(), "invalid_input");
    assert_eq!(counts(&t).await, [1; 5], "the good item is written, the other is not");
}

on_every_route!(
    a_start_whose_deadline_overflows_refuses_that_item_only,
    a_batch_writes_what_single_acceptances_write,
    a_mixed_batch_answers_each_item_in_order,
    a_batch_in_the_callers_transaction_rolls_back_with_it,
    a_replayed_batch_writes_nothing,
    a_run_id_proposed_twice_goes_to_the_first_winner,
    an_empty_or_invalid_batch_writes_nothing,
    a_key_with_a_live_record_is_not_won_by_a_shared_run_id,
);

/// Two items of other tenants propose one run id; the first's key already
/// has a live record (run Z). Only the second item's key is claimed, so the
/// first is a replay of Z and the second is new: deciding "claimed" by the
/// proposed id instead of by the key would make both new, a second run for a
/// key whose record names Z.
async fn a_key_with_a_live_record_is_not_won_by_a_shared_run_id(kind: Kind) {
    let t = TestDb::new(kind).await;
    let request = |tenant: &str, key: &str| NewRun::new(tenant, "charge", key, json!({"amount": 1}));
    let z = t
        .ferry
        .create_run_idempotent(request("b", "k2"))
        .await
        .unwrap()
        .run
        .run_id;
    let before = counts(&t).await;
    let x = Uuid::now_v7();
    let out = t
        .ferry
        .create_runs_idempotent(vec![request("b", "k2").run_id(x), request("a", "k1").run_id(x)])
        .await
        .unwrap();
    let first = out[0].as_ref().unwrap();
    assert!(first.replay, "b/k2 is a replay of its live record");
    assert_eq!(first.run.run_id, z);
    let second = out[1].as_ref().unwrap();
    assert!(!second.replay);
    assert_eq!(second.run.run_id, x);
    let after = counts(&t).await;
    assert_eq!(after[0], before[0] + 1, "exactly one new run (a/x)");
}

/// PostgreSQL: batches racing over the same keys, in opposite orders, make
/// one run per key and do not deadlock (keys are claimed in key order).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_racing_batches_share_one_run_per_key() {
    let t = TestDb::new(Kind::Postgres).await;
    let keys: Vec<String> = (0..200).map(|i| format!("race-{i}")).collect();
    let mut tasks = Vec::new();
    for b in 0..4 {
        let f = t.reopen().await;
        let mut batch: Vec<NewRun> = keys.iter().map(|k| charge(k, 5)).collect();
        if b % 2 == 1 {
            batch.reverse();
        }
        tasks.push(tokio::spawn(
            async move { f.create_runs_idempotent(batch).await.unwrap() },
        ));
    }
    let results: Vec<Vec<ferry::Result<Accepted>>> = futures::future::join_all(tasks)
        .await
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    let new: usize = results
        .iter()
        .flatten()
        .filter(|r| matches!(r, Ok(a) if !a.replay))
        .count();
    assert_eq!(new, 200, "exactly one winner per key");
    assert!(results.iter().flatten().all(|r| r.is_ok()));
    assert_eq!(counts(&t).await, [200; 5]);
}

/// PostgreSQL: a batch wakes each queue it wrote to, once, with coalescing
/// off. (PostgreSQL delivers identical notifications of one transaction
/// once, so listeners cannot count statements; the batch sends one.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_batch_wakes_each_of_its_queues() {
    let t = TestDb::new(Kind::Postgres).await;
    let f = Ferry::builder(&t.url)
        .notify_interval(Duration::ZERO)
        .connect()
        .await
        .unwrap();
    let mut listener = sqlx::postgres::PgListener::connect(&ferry_testkit::postgres_url())
        .await
        .unwrap();
    listener.listen(ferry::NOTIFY_CHANNEL).await.unwrap();
    let tag = Uuid::now_v7().simple().to_string();
    let (qa, qb) = (format!("qa{tag}"), format!("qb{tag}"));
    let runs: Vec<NewRun> = (0..50)
        .map(|i| charge(&format!("k-{i}"), i).queue(if i % 2 == 0 { &qa } else { &qb }))
        .collect();
    f.create_runs_idempotent(runs).await.unwrap();
    // Other processes' wake-ups share the channel: listen for a bounded
    // time, keeping only this test's queues.
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    while let Ok(Ok(n)) = tokio::time::timeout_at(deadline, listener.recv()).await {
        if n.payload().ends_with(&tag) {
            got.push(n.payload().to_owned());
        }
    }
    got.sort();
    assert_eq!(got, vec![qa, qb]);
}

/// PostgreSQL: a wake-up skipped inside the coalescing interval is not
/// dropped. The second acceptance, right after the first, sends nothing at
/// its commit, so the interval's end must carry a trailing notification;
/// without it the second run would wait for the listeners' poll. Exactly
/// two arrive: the trailing one does not re-arm itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_coalesced_wakeup_trails_at_the_end_of_the_interval() {
    let t = TestDb::new(Kind::Postgres).await;
    let interval = Duration::from_secs(1);
    let f = Ferry::builder(&t.url)
        .notify_interval(interval)
        .connect()
        .await
        .unwrap();
    let mut listener = sqlx::postgres::PgListener::connect(&ferry_testkit::postgres_url())
        .await
        .unwrap();
    listener.listen(ferry::NOTIFY_CHANNEL).await.unwrap();
    let queue = format!("q{}", Uuid::now_v7().simple());
    let started = tokio::time::Instant::now();
    f.create_run_idempotent(charge("k-1", 1).queue(&queue)).await.unwrap();
    f.create_run_idempotent(charge("k-2", 2).queue(&queue)).await.unwrap();
    let mut arrivals = Vec::new();
    let deadline = started + 3 * interval;
    while let Ok(Ok(n)) = tokio::time::timeout_at(deadline, listener.recv()).await {
        if n.payload() == queue {
            arrivals.push(started.elapsed());
        }
    }
    assert_eq!(arrivals.len(), 2, "one at the first commit, one trailing: {arrivals:?}");
    assert!(
        arrivals[1] >= interval,
        "the trailing wake-up waits for the interval's end: {arrivals:?}"
    );
}
