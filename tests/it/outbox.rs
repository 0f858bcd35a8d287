//! The outbox's contract with the relay: one key's ids follow commit order
//! whoever writes it (PostgreSQL advisory key locks), and no row is written
//! that Kafka's default size limit would refuse.

use ferry::{Ferry, OutboxMessage};
use tokio::sync::oneshot;

use crate::support::{Kind, TestDb};

fn order(n: u8) -> OutboxMessage {
    OutboxMessage::bytes("acme", "orders", "o-1", vec![n])
}

/// Backends waiting for an advisory lock they asked for.
async fn advisory_waits(f: &Ferry, pid: i32) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pg_locks WHERE pid = $1 AND locktype = 'advisory' AND NOT granted")
        .bind(pid)
        .fetch_one(f.db().as_postgres().unwrap())
        .await
        .unwrap()
}

/// Starts tx B on its own connection: it reports its backend pid, enqueues
/// `order(2)` and commits, returning the id.
fn spawn_b(f: Ferry) -> (oneshot::Receiver<i32>, tokio::task::JoinHandle<i64>) {
    let (pid_tx, pid_rx) = oneshot::channel();
    let b = tokio::spawn(async move {
        let mut tx = f.begin().await.unwrap();
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(tx.postgres().unwrap())
            .await
            .unwrap();
        pid_tx.send(pid).unwrap();
        let id = f.enqueue_in(tx.conn(), &order(2)).await.unwrap();
        tx.commit().await.unwrap();
        id
    });
    (pid_rx, b)
}

/// PostgreSQL: tx A enqueues key `o-1` and stays open; tx B enqueues the
/// same key and tries to commit. B must wait for A (seen in `pg_locks`, no
/// timeout involved), so the commit order A, B is also the id order the
/// relay publishes in. Without the lock B draws the higher id and commits
/// first, and a relay polling in between publishes B's row before A's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_key_enqueues_commit_in_id_order() {
    let t = TestDb::new(Kind::Postgres).await;
    let mut a = t.ferry.begin().await.unwrap();
    let a_id = t.ferry.enqueue_in(a.conn(), &order(1)).await.unwrap();

    let (pid, mut b) = spawn_b(t.ferry.clone());
    let pid = pid.await.unwrap();
    // Whichever happens first: B finishes (enqueued and committed while A is
    // open), or B is seen waiting on an advisory lock.
    let b_waits = async {
        while advisory_waits(&t.ferry, pid).await == 0 {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    };
    tokio::select! {
        biased;
        finished = &mut b => {
            let b_id = finished.unwrap();
            a.commit().await.unwrap();
            panic!(
                "tx B enqueued the same key and committed (id {b_id}) while tx A (id {a_id}) was still open: \
                 commit order B, A but id order A, B"
            );
        }
        () = b_waits => {}
    }
    assert!(!b.is_finished(), "B is blocked while A is open");
    a.commit().await.unwrap();
    let b_id = b.await.unwrap();
    assert!(a_id < b_id, "A committed first and has the lower id ({a_id} < {b_id})");
    let by_id: Vec<Vec<u8>> = sqlx::query_scalar("SELECT payload FROM outbox WHERE key = 'o-1' ORDER BY id")
        .fetch_all(t.ferry.db().as_postgres().unwrap())
        .await
        .unwrap();
    assert_eq!(by_id, [vec![1], vec![2]], "id order is commit order");
}

/// PostgreSQL: `.outbox_key_locks(false)` restores the old behaviour, where
/// only writers that lock a common row keep per-key order: B's enqueue and
/// commit finish while A is open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_locks_can_be_turned_off_explicitly() {
    let t = TestDb::new(Kind::Postgres).await;
    let unlocked = Ferry::builder(&t.url).outbox_key_locks(false).connect().await.unwrap();
    let mut a = unlocked.begin().await.unwrap();
    let a_id = unlocked.enqueue_in(a.conn(), &order(1)).await.unwrap();
    let (pid, b) = spawn_b(unlocked.clone());
    pid.await.unwrap();
    let b_id = b.await.unwrap();
    assert!(b_id > a_id, "B drew the higher id and committed first");
    a.commit().await.unwrap();
}

/// Bytes librdkafka counts against its `message.max.bytes` (1,000,000 by
/// default) for the record the relay builds from a stored row: 36 bytes of
/// record framing, key, value and each header with its two length varints
/// (at most 5 bytes each), including the headers the relay adds.
fn record_bytes(row: &StoredRow) -> usize {
    let header = |name: &str, value: usize| 10 + name.len() + value;
    let headers: std::collections::BTreeMap<String, String> = serde_json::from_str(&row.headers).unwrap();
    36 + row.key.len()
        + row.payload.len()
        + headers.iter().map(|(k, v)| header(k, v.len())).sum::<usize>()
        + header("ferry-outbox-id", row.id.to_string().len())
        + header("ferry-tenant", row.tenant.len())
        + header(
            "ferry-effect-key",
            row.effect_key.as_ref().map_or(row.id.to_string().len(), String::len),
        )
        + row.traceparent.as_ref().map_or(0, |tp| header("traceparent", tp.len()))
}

#[derive(sqlx::FromRow)]
struct StoredRow {
    id: i64,
    tenant: String,
    key: String,
    payload: Vec<u8>,
    headers: String,
    effect_key: Option<String>,
    traceparent: Option<String>,
}

async fn stored_rows(t: &TestDb) -> Vec<StoredRow> {
    let sql = "SELECT id, tenant, key, payload, CAST(headers AS TEXT) AS headers, effect_key, traceparent FROM outbox ORDER BY id";
    match t.ferry.db() {
        ferry::Db::Postgres(p) => sqlx::query_as(sql).fetch_all(p).await,
        ferry::Db::Sqlite(p) => sqlx::query_as(sql).fetch_all(p).await,
    }
    .unwrap()
}

async fn written(t: &TestDb) -> [i64; 5] {
    let mut n = [0; 5];
    for (i, table) in ["runs", "run_events", "jobs", "idempotency_keys", "outbox"]
        .iter()
        .enumerate()
    {
        n[i] = t.scalar(&format!("SELECT count(*) FROM {table}")).await;
    }
    n
}

/// A command under the old 1 MiB payload limit whose `run_queued` event
/// (envelope, key and headers) would pass Kafka's default 1,000,000-byte
/// record limit is refused before anything is written; one that fits is
/// accepted, and its outbox row makes a record within the limit. The same
/// for a raw outbox message.
async fn events_that_kafka_would_refuse_are_not_accepted(kind: Kind) {
    let t = TestDb::new(kind).await;
    let command = |len: usize| serde_json::json!({ "blob": "x".repeat(len) });
    let too_big = command(1_000_000);
    assert!(
        serde_json::to_vec(&too_big).unwrap().len() < 1024 * 1024,
        "under the old limit"
    );
    let Err(err) = t
        .ferry
        .create_run_idempotent(ferry::NewRun::new("acme", "charge", "big", too_big))
        .await
    else {
        panic!("a command whose run_queued record passes 1,000,000 bytes is refused");
    };
    assert_eq!(err.code(), "invalid_input", "{err}");
    assert_eq!(written(&t).await, [0; 5], "nothing written");

    let Err(err) = t
        .ferry
        .enqueue(&OutboxMessage::bytes("acme", "orders", "o-1", vec![7; 999_990]))
        .await
    else {
        panic!("a message whose record passes 1,000,000 bytes is refused");
    };
    assert_eq!(err.code(), "invalid_input", "{err}");
    assert_eq!(written(&t).await, [0; 5], "nothing written");

    t.ferry
        .create_run_idempotent(ferry::NewRun::new("acme", "charge", "fits", command(990_000)))
        .await
        .unwrap();
    t.ferry
        .enqueue(&OutboxMessage::bytes("acme", "orders", "o-1", vec![7; 990_000]))
        .await
        .unwrap();
    let rows = stored_rows(&t).await;
    assert_eq!(rows.len(), 2);
    for row in &rows {
        assert!(row.payload.len() >= 990_000);
        let size = record_bytes(row);
        assert!(size <= 1_000_000, "row {} makes a {size}-byte record", row.id);
    }
}

crate::support::on_both_engines!(events_that_kafka_would_refuse_are_not_accepted);
