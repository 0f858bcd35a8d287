//! PostgreSQL: `ferry_enqueue`, the outbox's interface for writers outside
//! Rust, writes what `Ferry::enqueue_in` writes: the library's lane for every
//! key (Kafka's murmur2, UTF-8 included), the same refusals with the same
//! messages (SQLSTATE 22023, nothing written), and the same per-key lock, so
//! one key's ids follow commit order across both kinds of writer. The other
//! languages' drivers are exercised end to end in the relay's
//! `writers` tests.

use std::collections::BTreeMap;

use ferry::outbox::murmur2;
use ferry::OutboxMessage;
use rand::Rng;

use crate::support::{Kind, TestDb};

/// The database's error for `sql`: (SQLSTATE, message).
async fn sql_error(t: &TestDb, sql: &str, binds: &OutboxMessage) -> (String, String) {
    let headers = serde_json::to_value(&binds.headers).unwrap();
    let err = sqlx::query("SELECT ferry_enqueue($1, $2, $3, $4, $5, $6, $7)")
        .bind(&binds.tenant)
        .bind(&binds.topic)
        .bind(&binds.key)
        .bind(&binds.payload)
        .bind(headers)
        .bind(&binds.effect_key)
        .bind(&binds.traceparent)
        .execute(t.ferry.db().as_postgres().unwrap())
        .await
        .expect_err(sql);
    let db = err.as_database_error().unwrap_or_else(|| panic!("{sql}: {err}"));
    (db.code().unwrap().into_owned(), db.message().to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sql_function_computes_the_librarys_murmur2_and_lanes() {
    let t = TestDb::new(Kind::Postgres).await;
    let pool = t.ferry.db().as_postgres().unwrap();
    let mut rng = rand::rng();
    let alphabet: Vec<char> = "abcXYZ019-_.:/ é日本🦀\u{7f}".chars().collect();
    let mut keys: Vec<String> = (0..2000)
        .map(|_| {
            let len = rng.random_range(1..48);
            (0..len)
                .map(|_| alphabet[rng.random_range(0..alphabet.len())])
                .collect()
        })
        .collect();
    keys.extend(["21", "foobar", "a", "ab", "abc", "abcd"].map(str::to_owned));
    let got: Vec<(String, i32)> =
        sqlx::query_as("SELECT k, ferry_murmur2(convert_to(k, 'UTF8')) FROM unnest($1::text[]) AS k")
            .bind(&keys)
            .fetch_all(pool)
            .await
            .unwrap();
    assert_eq!(got.len(), keys.len());
    for (k, h) in &got {
        assert_eq!(*h, murmur2(k.as_bytes()), "murmur2({k:?})");
    }
    // Rows of one key written both ways share its lane.
    for k in keys.iter().take(50) {
        let mut tx = t.ferry.begin().await.unwrap();
        t.ferry
            .enqueue_in(tx.conn(), &OutboxMessage::bytes("acme", "orders", k.clone(), vec![1]))
            .await
            .unwrap();
        sqlx::query("SELECT ferry_enqueue('acme', 'orders', $1, '\\x02'::bytea)")
            .bind(k)
            .execute(tx.postgres().unwrap())
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    let lanes: Vec<(String, Vec<i32>)> =
        sqlx::query_as("SELECT key, array_agg(DISTINCT lane) FROM outbox GROUP BY key")
            .fetch_all(pool)
            .await
            .unwrap();
    assert_eq!(lanes.len(), 50);
    for (k, l) in lanes {
        assert_eq!(l, vec![ferry::outbox::lane_for(&k, 64)], "key {k:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sql_function_refuses_what_the_library_refuses_with_its_message() {
    let t = TestDb::new(Kind::Postgres).await;
    let ok = || OutboxMessage::bytes("acme", "orders", "o-1", vec![1]);
    let many: BTreeMap<String, String> = (0..65).map(|i| (format!("h{i}"), "v".to_owned())).collect();
    let cases: Vec<(&str, OutboxMessage)> = vec![
        (
            "tenant charset",
            OutboxMessage {
                tenant: "ac me".into(),
                ..ok()
            },
        ),
        (
            "tenant too long",
            OutboxMessage {
                tenant: "t".repeat(129),
                ..ok()
            },
        ),
        (
            "empty tenant",
            OutboxMessage {
                tenant: String::new(),
                ..ok()
            },
        ),
        (
            "topic charset",
            OutboxMessage {
                topic: "bad/topic".into(),
                ..ok()
            },
        ),
        (
            "topic dot",
            OutboxMessage {
                topic: "..".into(),
                ..ok()
            },
        ),
        (
            "empty key",
            OutboxMessage {
                key: String::new(),
                ..ok()
            },
        ),
        (
            "key too long",
            OutboxMessage {
                key: "é".repeat(128),
                ..ok()
            },
        ),
        (
            "payload too large",
            OutboxMessage {
                payload: vec![0; 1024 * 1024 + 1],
                ..ok()
            },
        ),
        ("too many headers", OutboxMessage { headers: many, ..ok() }),
        ("reserved header", ok().header("ferry-tenant", "other")),
        ("empty header name", ok().header("", "v")),
        ("empty effect key", ok().effect_key("")),
        ("effect key too long", ok().effect_key("e".repeat(256))),
        ("bad traceparent", ok().traceparent("00-abc")),
        (
            "record too large",
            OutboxMessage {
                payload: vec![7; 999_900],
                ..ok()
            },
        ),
        (
            "record too large with headers",
            OutboxMessage {
                payload: vec![7; 990_000],
                ..ok()
            }
            .header("big", "x".repeat(9_900)),
        ),
    ];
    for (case, msg) in &cases {
        let lib = t.ferry.enqueue(msg).await.expect_err(case);
        assert_eq!(lib.code(), "invalid_input", "{case}");
        let (state, message) = sql_error(&t, case, msg).await;
        assert_eq!(state, "22023", "{case}");
        assert_eq!(message, lib.to_string(), "{case}: the library's message");
    }
    // Just within the record limit, both write.
    let fits = OutboxMessage {
        payload: vec![7; 999_000],
        ..ok()
    };
    t.ferry.enqueue(&fits).await.unwrap();
    sqlx::query("SELECT ferry_enqueue('acme', 'orders', 'o-1', $1)")
        .bind(&fits.payload)
        .execute(t.ferry.db().as_postgres().unwrap())
        .await
        .unwrap();
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox")
        .fetch_one(t.ferry.db().as_postgres().unwrap())
        .await
        .unwrap();
    assert_eq!(rows, 2, "nothing written by any refused call");
}

/// A library writer holds key `o-1`; a SQL writer of the same key waits for
/// its commit before drawing an id (the same advisory lock), so ids follow
/// commit order across both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_keys_ids_follow_commit_order_across_the_library_and_sql_writers() {
    let t = TestDb::new(Kind::Postgres).await;
    let pool = t.ferry.db().as_postgres().unwrap().clone();
    let mut a = t.ferry.begin().await.unwrap();
    let a_id = t
        .ferry
        .enqueue_in(a.conn(), &OutboxMessage::bytes("acme", "orders", "o-1", vec![1]))
        .await
        .unwrap();
    let (pid_tx, pid_rx) = tokio::sync::oneshot::channel();
    let b_pool = pool.clone();
    let b = tokio::spawn(async move {
        let mut tx = b_pool.begin().await.unwrap();
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        pid_tx.send(pid).unwrap();
        let id: i64 = sqlx::query_scalar("SELECT ferry_enqueue('acme', 'orders', 'o-1', '\\x02'::bytea)")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        id
    });
    let pid = pid_rx.await.unwrap();
    // B waits on the key's advisory lock, before its id is drawn.
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks WHERE pid = $1 AND locktype = 'advisory' AND NOT granted",
        )
        .bind(pid)
        .fetch_one(&pool)
        .await
        .unwrap();
        if waiting > 0 {
            break;
        }
        assert!(
            !b.is_finished(),
            "the SQL writer did not wait for the library's transaction"
        );
        tokio::task::yield_now().await;
    }
    a.commit().await.unwrap();
    let b_id = b.await.unwrap();
    assert!(
        b_id > a_id,
        "the SQL writer's id ({b_id}) follows the library writer's ({a_id})"
    );
}
