//! Acceptance, idempotency, tenants and events: one scenario per invariant,
//! run on both engines.

use std::sync::Arc;
use std::time::Duration;

use ferry::{Error, NewRun, OutboxMessage, RunState};
use serde_json::json;
use uuid::Uuid;

use crate::support::{charge, counts, manual_clock, on_every_route, Kind, TestDb};

async fn migration_and_atomic_first_event(kind: Kind) {
    let t = TestDb::new(kind).await;
    let again = ferry::migrate(t.ferry.db()).await;
    if t.ferry.behind_transaction_pooler() {
        // Through a transaction pooler migrations are refused (they need a
        // session): the harness migrated over the direct URL.
        let e = again.expect_err("migrations through a transaction pooler are refused");
        assert_eq!(e.code(), "config", "{e}");
    } else {
        again.expect("migrations are idempotent");
    }
    assert_eq!(counts(&t).await, [0; 5]);
    let a = t.ferry.create_run_idempotent(charge("k-1", 5)).await.unwrap();
    assert!(!a.replay);
    assert_eq!(a.run.state, RunState::Queued);
    assert_eq!(a.run.last_event_seq, 1);
    assert_eq!(
        counts(&t).await,
        [1, 1, 1, 1, 1],
        "run, run_queued, job, key and outbox row commit together"
    );
    let events = t.ferry.list_events("acme", a.run.run_id).await.unwrap();
    assert_eq!(events.len(), 1);
    assert_eq!((events[0].seq, events[0].kind.as_str()), (1, "run_queued"));
    assert_eq!(events[0].body["request"], json!({"amount": 5, "currency": "EUR"}));
    let key = format!("acme/{}/1", a.run.run_id);
    assert_eq!(
        t.scalar(&format!("SELECT count(*) FROM outbox WHERE effect_key = '{key}' AND topic = 'ferry.run-events' AND state = 'pending'")).await,
        1
    );
    assert_eq!(
        t.scalar("SELECT count(*) FROM jobs WHERE state = 'queued' AND attempts = 0 AND max_attempts = 5")
            .await,
        1
    );
    assert_eq!(t.ferry.get_run("acme", a.run.run_id).await.unwrap(), a.run);
}

async fn duplicate_run_id_rolls_back_the_whole_acceptance(kind: Kind) {
    let t = TestDb::new(kind).await;
    let id = Uuid::now_v7();
    t.ferry
        .create_run_idempotent(charge("k-1", 5).run_id(id))
        .await
        .unwrap();
    let before = counts(&t).await;
    let err = t
        .ferry
        .create_run_idempotent(charge("k-2", 7).run_id(id))
        .await
        .unwrap_err();
    assert_eq!(err.code(), "duplicate_run");
    assert_eq!(
        counts(&t).await,
        before,
        "nothing of the second acceptance stays, not even its key"
    );
    // The key was not burnt: it accepts normally afterwards.
    let again = t.ferry.create_run_idempotent(charge("k-2", 7)).await.unwrap();
    assert!(!again.replay);
    assert_ne!(again.run.run_id, id);
}

async fn projection_and_event_commit_together(kind: Kind) {
    let t = TestDb::new(kind).await;
    let a = t.ferry.create_run_idempotent(charge("k-1", 5)).await.unwrap();
    let id = a.run.run_id;
    // Inject a failure between the projection update and the event insert:
    // a stray event already occupies the next seq, so the insert fails after
    // the run row has been bumped.
    let blob = match kind {
        Kind::Postgres => format!("'{id}'"),
        Kind::Sqlite => format!("X'{}'", id.simple()),
    };
    let body = match kind {
        Kind::Postgres => "'{}'::jsonb",
        Kind::Sqlite => "'{}'",
    };
    t.exec(&format!("INSERT INTO run_events (tenant, run_id, seq, kind, body, created_at) VALUES ('acme', {blob}, 2, 'stray', {body}, 0)"))
        .await
        .unwrap();
    let outbox_before = t.scalar("SELECT count(*) FROM outbox").await;
    let err = t
        .ferry
        .append_event("acme", id, "note", &json!({"n": 1}))
        .await
        .unwrap_err();
    assert_eq!(err.code(), "database");
    let run = t.ferry.get_run("acme", id).await.unwrap();
    assert_eq!(
        run.last_event_seq, 1,
        "the projection update rolled back with the failed event"
    );
    assert_eq!(
        t.scalar("SELECT count(*) FROM outbox").await,
        outbox_before,
        "no outbox row either"
    );
}

async fn event_seqs_stay_unique_under_concurrent_appends(kind: Kind) {
    let t = TestDb::new(kind).await;
    let id = t
        .ferry
        .create_run_idempotent(charge("k-1", 5))
        .await
        .unwrap()
        .run
        .run_id;
    let barrier = Arc::new(tokio::sync::Barrier::new(16));
    let mut tasks = Vec::new();
    for i in 0..16 {
        let f = t.ferry.clone();
        let b = barrier.clone();
        tasks.push(tokio::spawn(async move {
            b.wait().await;
            f.append_event("acme", id, "progress", &json!({"i": i})).await.unwrap()
        }));
    }
    let mut seqs: Vec<i64> = futures::future::join_all(tasks)
        .await
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    seqs.sort_unstable();
    assert_eq!(seqs, (2..18).collect::<Vec<_>>());
    let events = t.ferry.list_events("acme", id).await.unwrap();
    assert_eq!(
        events.iter().map(|e| e.seq).collect::<Vec<_>>(),
        (1..18).collect::<Vec<_>>()
    );
    assert_eq!(t.ferry.get_run("acme", id).await.unwrap().last_event_seq, 17);
}

async fn no_orphan_events(kind: Kind) {
    let t = TestDb::new(kind).await;
    let err = t
        .ferry
        .append_event("acme", Uuid::now_v7(), "note", &json!({}))
        .await
        .unwrap_err();
    assert_eq!(err.code(), "not_found");
    let blob = match kind {
        Kind::Postgres => format!("'{}'", Uuid::now_v7()),
        Kind::Sqlite => format!("X'{}'", Uuid::now_v7().simple()),
    };
    let direct = t
        .exec(&format!("INSERT INTO run_events (tenant, run_id, seq, kind, body, created_at) VALUES ('acme', {blob}, 1, 'x', '{{}}', 0)"))
        .await;
    assert!(direct.is_err(), "the schema refuses an event without its run");
    assert_eq!(
        t.scalar("SELECT count(*) FROM run_events e WHERE NOT EXISTS (SELECT 1 FROM runs r WHERE r.tenant = e.tenant AND r.run_id = e.run_id)").await,
        0
    );
}

async fn invalid_input_writes_nothing(kind: Kind) {
    let t = TestDb::new(kind).await;
    let big = "x".repeat(1024 * 1024 + 1);
    let cases = vec![
        charge("", 1),
        charge("has space", 1),
        charge(&"k".repeat(256), 1),
        charge("k\u{e9}", 1),
        NewRun::new("", "charge", "k", json!({})),
        NewRun::new("ac me", "charge", "k", json!({})),
        NewRun::new("acme", "", "k", json!({})),
        NewRun::new("acme", "charge", "k", json!([1, 2])),
        NewRun::new("acme", "charge", "k", json!({"blob": big})),
        charge("k", 1).max_attempts(0),
        charge("k", 1).queue("bad queue"),
        charge("k", 1).deadline(Duration::ZERO),
        charge("k", 1).traceparent("not-a-trace"),
    ];
    for (i, case) in cases.into_iter().enumerate() {
        let err = t.ferry.create_run_idempotent(case).await.unwrap_err();
        assert_eq!(err.code(), "invalid_input", "case {i}: {err}");
    }
    let msg = OutboxMessage::bytes("acme", "bad/topic", "k", vec![1]);
    assert_eq!(t.ferry.enqueue(&msg).await.unwrap_err().code(), "invalid_input");
    let msg = OutboxMessage::bytes("acme", "orders", "k", vec![1]).header("ferry-outbox-id", "spoof");
    assert_eq!(t.ferry.enqueue(&msg).await.unwrap_err().code(), "invalid_input");
    assert_eq!(counts(&t).await, [0; 5]);
    // The schema refuses impossible states too.
    assert!(
        t.exec("UPDATE jobs SET state = 'bogus'").await.is_ok(),
        "no rows to violate yet"
    );
    let id = t
        .ferry
        .create_run_idempotent(charge("k-ok", 1))
        .await
        .unwrap()
        .run
        .run_id;
    assert!(t.exec("UPDATE runs SET state = 'bogus'").await.is_err());
    assert!(t.exec("UPDATE jobs SET attempts = -1").await.is_err());
    assert_eq!(t.ferry.get_run("acme", id).await.unwrap().state, RunState::Queued);
}

async fn replay_returns_the_first_run_and_writes_nothing(kind: Kind) {
    let t = TestDb::new(kind).await;
    let first = t
        .ferry
        .create_run_idempotent(charge("k-1", 5).run_id(Uuid::now_v7()))
        .await
        .unwrap();
    let before = counts(&t).await;
    // Same command, keys in another order, a different proposed run id.
    let retry = NewRun::new(
        "acme",
        "charge",
        "k-1",
        serde_json::from_str(r#"{ "currency":"EUR", "amount": 5.0 }"#).unwrap(),
    )
    .run_id(Uuid::now_v7());
    let second = t.ferry.create_run_idempotent(retry).await.unwrap();
    assert!(second.replay);
    assert_eq!(second.run.run_id, first.run.run_id);
    assert_eq!(counts(&t).await, before, "a replay writes nothing");
    let events = t.ferry.list_events("acme", first.run.run_id).await.unwrap();
    assert_eq!(events.iter().filter(|e| e.kind == "run_queued").count(), 1);
}

async fn different_fingerprint_is_a_conflict(kind: Kind) {
    let t = TestDb::new(kind).await;
    let key = "secret-key-that-must-not-leak";
    let first = t.ferry.create_run_idempotent(charge(key, 5)).await.unwrap();
    let before = counts(&t).await;
    let err = t.ferry.create_run_idempotent(charge(key, 6)).await.unwrap_err();
    assert_eq!(err.code(), "idempotency_conflict");
    assert!(
        !format!("{err} {err:?}").contains(key),
        "the key never appears in error text"
    );
    match err {
        Error::IdempotencyConflict { existing_run, .. } => {
            assert_eq!(existing_run, first.run.run_id)
        }
        other => panic!("unexpected {other:?}"),
    }
    // Another schema version of the same command is another request too.
    let err = t
        .ferry
        .create_run_idempotent(charge(key, 5).schema_version(2))
        .await
        .unwrap_err();
    assert_eq!(err.code(), "idempotency_conflict");
    // The same key under another operation is another scope.
    let other_op = NewRun::new("acme", "refund", key, json!({"amount": 5, "currency": "EUR"}));
    assert!(!t.ferry.create_run_idempotent(other_op).await.unwrap().replay);
    assert_eq!(counts(&t).await[0], before[0] + 1);
}

async fn tenants_are_isolated(kind: Kind) {
    let t = TestDb::new(kind).await;
    let a = t.ferry.create_run_idempotent(charge("shared-key", 5)).await.unwrap();
    let other = NewRun::new(
        "globex",
        "charge",
        "shared-key",
        json!({"amount": 5, "currency": "EUR"}),
    );
    let b = t.ferry.create_run_idempotent(other).await.unwrap();
    assert!(!b.replay, "another tenant's key is another record");
    assert_ne!(a.run.run_id, b.run.run_id);
    assert_eq!(
        t.ferry.get_run("globex", a.run.run_id).await.unwrap_err().code(),
        "not_found"
    );
    assert!(t.ferry.list_events("globex", a.run.run_id).await.unwrap().is_empty());
    assert_eq!(
        t.ferry
            .append_event("globex", a.run.run_id, "note", &json!({}))
            .await
            .unwrap_err()
            .code(),
        "not_found"
    );
    let err = t
        .ferry
        .cancel("globex", a.run.run_id, None, "ops", "wrong tenant")
        .await
        .unwrap_err();
    assert_eq!(err.code(), "not_found");
    assert_eq!(
        t.ferry.get_run("acme", a.run.run_id).await.unwrap().state,
        RunState::Queued
    );
}

async fn acceptance_inside_the_callers_transaction(kind: Kind) {
    let t = TestDb::new(kind).await;
    t.exec("CREATE TABLE orders (id TEXT PRIMARY KEY, total BIGINT NOT NULL)")
        .await
        .unwrap();
    async fn own_write(tx: &mut ferry::Tx, id: &str) {
        let sql = "INSERT INTO orders (id, total) VALUES ($1, 42)";
        tx.execute(sql, &[ferry::store::Arg::from(id)]).await.unwrap();
    }
    // Rolled back: nothing, neither ours nor Ferry's.
    let mut tx = t.ferry.begin().await.unwrap();
    own_write(&mut tx, "o-1").await;
    t.ferry
        .create_run_idempotent_in(tx.conn(), charge("k-1", 5))
        .await
        .unwrap();
    let msg = OutboxMessage::json("acme", "orders", "o-1", &json!({"placed": true})).unwrap();
    t.ferry.enqueue_in(tx.conn(), &msg).await.unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(counts(&t).await, [0; 5]);
    assert_eq!(t.scalar("SELECT count(*) FROM orders").await, 0);
    // Committed: all of it, and the key now replays.
    let mut tx = t.ferry.begin().await.unwrap();
    own_write(&mut tx, "o-1").await;
    let a = t
        .ferry
        .create_run_idempotent_in(tx.conn(), charge("k-1", 5))
        .await
        .unwrap();
    let id = t.ferry.enqueue_in(tx.conn(), &msg).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(counts(&t).await, [1, 1, 1, 1, 2]);
    assert_eq!(t.scalar("SELECT count(*) FROM orders").await, 1);
    let lane = ferry::outbox::lane_for("o-1", t.ferry.lanes());
    assert_eq!(
        t.scalar(&format!("SELECT CAST(lane AS BIGINT) FROM outbox WHERE id = {id}"))
            .await,
        i64::from(lane)
    );
    assert!(t.ferry.create_run_idempotent(charge("k-1", 5)).await.unwrap().replay);
    assert_eq!(
        t.ferry.get_run("acme", a.run.run_id).await.unwrap().run_id,
        a.run.run_id
    );
}

async fn expired_keys_are_swept_in_batches(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    for i in 0..5 {
        t.ferry
            .create_run_idempotent(charge(&format!("k-{i}"), i))
            .await
            .unwrap();
    }
    assert_eq!(
        t.ferry.jobs().sweep_idempotency_keys(2).await.unwrap(),
        0,
        "nothing has expired yet"
    );
    clock.advance(Duration::from_secs(24 * 3600)).unwrap();
    // An expired record is taken over by a new request rather than replayed.
    let fresh = t.ferry.create_run_idempotent(charge("k-0", 99)).await.unwrap();
    assert!(!fresh.replay);
    let swept: Vec<u64> = {
        let mut v = Vec::new();
        for _ in 0..4 {
            v.push(t.ferry.jobs().sweep_idempotency_keys(2).await.unwrap());
        }
        v
    };
    assert_eq!(swept, vec![2, 2, 0, 0]);
    assert_eq!(
        t.scalar("SELECT count(*) FROM idempotency_keys").await,
        1,
        "the live record stays"
    );
    assert_eq!(
        t.scalar("SELECT count(*) FROM runs").await,
        6,
        "runs outlive their keys"
    );
}

async fn every_named_query_prepares(kind: Kind) {
    let t = TestDb::new(kind).await;
    let db = t.ferry.db();
    let mut named = ferry::store::queries::QUERIES.get(db.engine()).all();
    if db.engine() == ferry::Engine::Postgres {
        named.extend(ferry::store::queries::POSTGRES_ONLY.all());
    }
    ferry::store::check_queries(db, named).await.unwrap();
}

on_every_route!(
    migration_and_atomic_first_event,
    duplicate_run_id_rolls_back_the_whole_acceptance,
    projection_and_event_commit_together,
    event_seqs_stay_unique_under_concurrent_appends,
    no_orphan_events,
    invalid_input_writes_nothing,
    replay_returns_the_first_run_and_writes_nothing,
    different_fingerprint_is_a_conflict,
    tenants_are_isolated,
    acceptance_inside_the_callers_transaction,
    expired_keys_are_swept_in_batches,
    every_named_query_prepares,
);

/// PostgreSQL: connections racing with one key produce one run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_racing_connections_share_one_run() {
    let t = TestDb::new(Kind::Postgres).await;
    for round in 0..5 {
        let key = format!("race-{round}");
        let n = 8;
        let barrier = Arc::new(tokio::sync::Barrier::new(n));
        let mut tasks = Vec::new();
        for _ in 0..n {
            let f = t.ferry.clone();
            let b = barrier.clone();
            let key = key.clone();
            tasks.push(tokio::spawn(async move {
                b.wait().await;
                f.create_run_idempotent(charge(&key, 5)).await.unwrap()
            }));
        }
        let results: Vec<_> = futures::future::join_all(tasks)
            .await
            .into_iter()
            .map(|r| r.unwrap())
            .collect();
        assert_eq!(results.iter().filter(|a| !a.replay).count(), 1, "exactly one winner");
        assert!(results.iter().all(|a| a.run.run_id == results[0].run.run_id));
    }
    assert_eq!(counts(&t).await, [5, 5, 5, 5, 5]);
}
