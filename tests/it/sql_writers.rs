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
    // Rows of one key written both ways share its lane (50 distinct keys:
    // two random short keys can be equal).
    let mut seen = std::collections::HashSet::new();
    for k in keys.iter().filter(|k| seen.insert(k.as_str())).take(50) {
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
        // Two faults: the one the library checks first is the one named.
        (
            "bad tenant and bad topic",
            OutboxMessage {
                tenant: "ac me".into(),
                topic: "a/b".into(),
                ..ok()
            },
        ),
        (
            "too many headers and a reserved one",
            OutboxMessage {
                headers: (0..65).map(|i| (format!("ferry-{i}"), "v".to_owned())).collect(),
                ..ok()
            },
        ),
        (
            "bad effect key and bad traceparent",
            ok().effect_key("").traceparent("x"),
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
    // A refused call inside a transaction that already enqueued: the
    // transaction fails whole, nothing of it is written.
    {
        let pool = t.ferry.db().as_postgres().unwrap();
        let mut tx = pool.begin().await.unwrap();
        sqlx::query("SELECT ferry_enqueue('acme', 'orders', 'o-1', '\\x01'::bytea)")
            .execute(&mut *tx)
            .await
            .unwrap();
        sqlx::query("SELECT ferry_enqueue('acme', 'bad/topic', 'o-1', '\\x01'::bytea)")
            .execute(&mut *tx)
            .await
            .expect_err("a bad topic");
        // PostgreSQL answers the commit of a failed transaction with ROLLBACK.
        tx.commit().await.unwrap();
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
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    a.commit().await.unwrap();
    let b_id = b.await.unwrap();
    assert!(
        b_id > a_id,
        "the SQL writer's id ({b_id}) follows the library writer's ({a_id})"
    );
}

/// The row a SQL writer enqueues is the row the library enqueues for the
/// same message: every column the relay publishes from (headers, effect key,
/// trace context, lane) equal, `created_at` in milliseconds from the same
/// clock; `ferry_enqueue_json` adds `content-type` unless the caller set
/// one; the commit sends the wake-up workers and relays listen for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sql_writers_row_is_the_row_the_library_writes() {
    let t = TestDb::new(Kind::Postgres).await;
    let pool = t.ferry.db().as_postgres().unwrap();
    let mut listener = sqlx::postgres::PgListener::connect_with(pool).await.unwrap();
    listener.listen(ferry::NOTIFY_CHANNEL).await.unwrap();
    let msg = OutboxMessage::json("acme", "orders", "o-1", &serde_json::json!({"n": 1}))
        .unwrap()
        .header("x-source", "billing")
        .effect_key("charge-1")
        .traceparent("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01");
    let mut writer = pool.acquire().await.unwrap();
    let writer_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *writer)
        .await
        .unwrap();
    let sql: i64 = sqlx::query_scalar("SELECT ferry_enqueue_json($1, $2, $3, $4::json, $5, $6, $7)")
        .bind(&msg.tenant)
        .bind(&msg.topic)
        .bind(&msg.key)
        .bind(String::from_utf8(msg.payload.clone()).unwrap())
        .bind(serde_json::json!({"x-source": "billing"}))
        .bind(&msg.effect_key)
        .bind(&msg.traceparent)
        .fetch_one(&mut *writer)
        .await
        .unwrap();
    drop(writer);
    // The SQL writer's commit wakes the listeners: a notification from its
    // backend (other tests share the database, and notify too).
    tokio::time::timeout(std::time::Duration::from_secs(10), async {
        loop {
            let n = listener.recv().await.unwrap();
            if n.channel() == ferry::NOTIFY_CHANNEL && n.process_id() == writer_pid as u32 {
                break;
            }
        }
    })
    .await
    .expect("the SQL writer's commit sent no wake-up");
    let lib = t.ferry.enqueue(&msg).await.unwrap();
    type Row = (
        String,
        String,
        String,
        i32,
        Vec<u8>,
        serde_json::Value,
        Option<String>,
        Option<String>,
        i64,
    );
    let row = |id: i64| async move {
        sqlx::query_as::<_, Row>(
            "SELECT tenant, topic, key, lane, payload, headers, effect_key, traceparent, created_at FROM outbox WHERE id = $1",
        )
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
    };
    let (a, b) = (row(lib).await, row(sql).await);
    assert_eq!(
        (&a.0, &a.1, &a.2, a.3, &a.4, &a.5, &a.6, &a.7),
        (&b.0, &b.1, &b.2, b.3, &b.4, &b.5, &b.6, &b.7),
        "the same row"
    );
    assert!(
        (b.8 - a.8).abs() < 60_000,
        "created_at in milliseconds: {} and {}",
        a.8,
        b.8
    );
    // A content type of the caller's replaces the default.
    let own: i64 = sqlx::query_scalar(
        "SELECT ferry_enqueue_json('acme', 'orders', 'o-1', '{}', '{\"content-type\": \"application/vnd.acme+json\"}')",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        row(own).await.5,
        serde_json::json!({"content-type": "application/vnd.acme+json"})
    );
}

/// Limits set in `ferry_settings` hold; without a lane count the function
/// refuses as the library does (not migrated), instead of guessing one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sql_function_takes_its_limits_and_lanes_from_ferry_settings() {
    let t = TestDb::new(Kind::Postgres).await;
    let pool = t.ferry.db().as_postgres().unwrap();
    sqlx::query("INSERT INTO ferry_settings (name, value) VALUES ('max_headers', '2')")
        .execute(pool)
        .await
        .unwrap();
    let three = OutboxMessage::bytes("acme", "orders", "o-1", vec![1])
        .header("a", "1")
        .header("b", "2")
        .header("c", "3");
    let (state, message) = sql_error(&t, "three headers", &three).await;
    assert_eq!(
        (state.as_str(), message.as_str()),
        ("22023", "invalid input: headers: at most 2 headers")
    );
    sqlx::query("DELETE FROM ferry_settings WHERE name = 'outbox_lanes'")
        .execute(pool)
        .await
        .unwrap();
    let (state, message) = sql_error(&t, "no lanes", &OutboxMessage::bytes("acme", "orders", "o-1", vec![1])).await;
    assert_eq!(state, "55000");
    assert!(message.starts_with("schema not migrated"), "{message}");
}
