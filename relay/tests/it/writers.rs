//! Writers outside Rust: a Python service (psycopg 3) and a Node service
//! (node-postgres) enqueue through `ferry_enqueue_json` inside their own
//! transactions, on the same keys as the Rust library, and Kafka cannot tell
//! the rows apart: each key's records arrive in commit order on one
//! partition, with the same headers; a rolled-back transaction publishes
//! nothing; bad input is a typed SQL error that writes nothing. The drivers
//! are installed by `scripts/setup-writers` (the test command runs it); a
//! missing one fails the test naming that script.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use ferry::{Ferry, OutboxMessage};
use ferry_relay::Capture;
use ferry_testkit::Kafka;
use serde_json::{json, Value};

use crate::support::*;

const KEYS: usize = 4;
/// Rows per key per round; the rounds alternate between the library and the
/// other language's writer.
const PER_ROUND: i64 = 5;
const ROUNDS: i64 = 4;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// The command that runs `language`'s writer with `plan`.
fn writer_command(language: &str, plan: &Value) -> Command {
    let root = root();
    let (program, script) = match language {
        "python" => (
            root.join("target/writers-venv/bin/python"),
            root.join("tests/writers/python/writer.py"),
        ),
        "node" => (PathBuf::from("node"), root.join("tests/writers/node/writer.js")),
        other => panic!("no writer in {other}"),
    };
    let installed = match language {
        "python" => program.exists(),
        _ => root.join("tests/writers/node/node_modules/pg").exists(),
    };
    assert!(
        installed,
        "the {language} writer's driver is not installed: run scripts/setup-writers"
    );
    let mut c = Command::new(program);
    c.arg(script).arg(plan.to_string());
    c
}

/// Runs the writer and returns what it printed (JSON).
fn run_writer(language: &str, plan: &Value) -> Value {
    let out = writer_command(language, plan)
        .output()
        .unwrap_or_else(|e| panic!("running the {language} writer: {e}"));
    assert!(
        out.status.success(),
        "the {language} writer failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "the {language} writer printed no JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

fn key(k: usize) -> String {
    format!("order-{k}")
}

async fn rust_round(ferry: &Ferry, seqs: std::ops::Range<i64>) {
    for seq in seqs {
        for k in 0..KEYS {
            // Key by key in its own transaction, like the other writer.
            let msg = OutboxMessage::json("acme", "orders", key(k), &json!({"seq": seq, "writer": "rust"})).unwrap();
            ferry.enqueue(&msg).await.unwrap();
        }
    }
}

async fn another_language_writes_rows_kafka_cannot_tell_from_the_librarys(language: &str) {
    let broker = Kafka::start();
    broker.create_topic("orders", 6);
    let (ferry, url) = pg_ferry().await;
    sqlx::query("CREATE TABLE app_orders (id BIGSERIAL PRIMARY KEY, key TEXT NOT NULL, seq BIGINT NOT NULL, writer TEXT NOT NULL)")
        .execute(ferry.db().as_postgres().unwrap())
        .await
        .unwrap();
    let (cfg, guard) = config_for(Capture::Wal, &url, &broker.brokers()).await;
    let relay = guard.start(cfg, ferry.clone()).await;

    let mut bad_inputs = Vec::new();
    for round in 0..ROUNDS {
        let seqs = round * PER_ROUND..(round + 1) * PER_ROUND;
        if round % 2 == 0 {
            rust_round(&ferry, seqs).await;
        } else {
            let rows: Vec<Value> = seqs
                .flat_map(|seq| (0..KEYS).map(move |k| json!([key(k), seq])))
                .collect();
            let plan = json!({
                "url": url, "tenant": "acme", "topic": "orders", "writer": language,
                "rows": rows, "rollback": [[key(0), 1000], [key(1), 1001]],
            });
            let out = run_writer(language, &plan);
            assert_eq!(out["ids"].as_array().unwrap().len(), rows.len());
            bad_inputs.push(out["bad_input"].clone());
        }
    }
    let total = (KEYS as i64 * PER_ROUND * ROUNDS) as usize;

    // Bad input: SQLSTATE 22023 with the library's message, nothing written.
    for bad in &bad_inputs {
        assert_eq!(bad["sqlstate"], "22023", "{bad}");
        assert_eq!(
            bad["message"], "invalid input: topic: must be 1 to 249 bytes of [A-Za-z0-9._-]",
            "{bad}"
        );
        assert_eq!(bad["detail"], "ferry code: invalid_input", "{bad}");
        assert_eq!(bad["column"], "topic", "{bad}");
    }
    let pool = ferry.db().as_postgres().unwrap();
    let app: Vec<(String, i64)> = sqlx::query_as("SELECT key, seq FROM app_orders ORDER BY id")
        .fetch_all(pool)
        .await
        .unwrap();
    assert_eq!(
        app.len(),
        total / 2,
        "the writer's own rows committed with its outbox rows, none of a rolled-back or failed transaction: {app:?}"
    );
    assert_eq!(scalar(&ferry, "SELECT count(*) FROM outbox").await as usize, total);
    // One lane per key, whoever wrote it: the library's murmur2.
    let lanes: Vec<(String, i32)> = sqlx::query_as("SELECT DISTINCT key, lane FROM outbox")
        .fetch_all(pool)
        .await
        .unwrap();
    assert_eq!(lanes.len(), KEYS, "one lane per key: {lanes:?}");
    for (k, lane) in &lanes {
        assert_eq!(*lane, ferry::outbox::lane_for(k, 64), "key {k}");
    }

    let c = consumer(&broker.brokers(), &["orders"]);
    let recs = read_until(&c, Duration::from_secs(90), |r| distinct(r) >= total).await;
    relay.shutdown().await;
    let first = first_occurrences(&recs);
    assert_eq!(first.len(), total);
    let database_id = ferry.database_id().await.unwrap();
    let mut by_key: HashMap<&str, Vec<&Record>> = HashMap::new();
    let mut ids: Vec<i64> = first.keys().copied().collect();
    ids.sort_unstable();
    for id in &ids {
        let r = first[id];
        by_key.entry(r.key.as_str()).or_default().push(r);
    }
    for k in 0..KEYS {
        let recs = &by_key[key(k).as_str()];
        let values: Vec<Value> = recs
            .iter()
            .map(|r| serde_json::from_slice(&r.payload).unwrap())
            .collect();
        let seqs: Vec<i64> = values.iter().map(|v| v["seq"].as_i64().unwrap()).collect();
        assert_eq!(
            seqs,
            (0..PER_ROUND * ROUNDS).collect::<Vec<_>>(),
            "key {}: commit order across writers, nothing rolled back",
            key(k)
        );
        let partitions: BTreeSet<i32> = recs.iter().map(|r| r.partition).collect();
        assert_eq!(partitions.len(), 1, "key {}: one partition, {partitions:?}", key(k));
        for (r, value) in recs.iter().zip(&values) {
            let writer = value["writer"].as_str().unwrap();
            // The value's bytes are the writer's document as it wrote it.
            assert_eq!(
                r.payload,
                serde_json::to_vec(&json!({"seq": value["seq"], "writer": writer})).unwrap(),
                "compact JSON from every writer"
            );
            let names: BTreeSet<&str> = r.headers.keys().map(String::as_str).collect();
            assert_eq!(
                names,
                BTreeSet::from(["content-type", "ferry-effect-key", "ferry-outbox-id", "ferry-tenant"]),
                "the same headers from the {writer} writer"
            );
            assert_eq!(r.headers["content-type"], "application/json");
            assert_eq!(r.headers["ferry-tenant"], "acme");
            assert_eq!(
                r.headers["ferry-effect-key"],
                format!("{database_id}:{}", r.outbox_id())
            );
        }
        let writers: BTreeSet<String> = values
            .iter()
            .map(|v| v["writer"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(writers, BTreeSet::from(["rust".to_owned(), language.to_owned()]));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_writer_and_the_library_share_keys_order_and_headers() {
    another_language_writes_rows_kafka_cannot_tell_from_the_librarys("python").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_writer_and_the_library_share_keys_order_and_headers() {
    another_language_writes_rows_kafka_cannot_tell_from_the_librarys("node").await;
}
