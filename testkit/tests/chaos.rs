//! A worker process SIGKILLed mid-job loses nothing: its lease blocks
//! everyone until it expires, then another worker recovers the job at the
//! next generation and the run ends exactly once. PostgreSQL only: the child
//! is a separate process, which an SQLite test file would serialize anyway.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use ferry::{Clock, Engine, Ferry, Millis, NewRun};
use ferry_testkit::fresh_database_url;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_worker_loses_nothing() {
    let url = fresh_database_url(Engine::Postgres).await.unwrap();
    let ferry = Ferry::builder(&url).migrate(true).connect().await.unwrap();
    let run = NewRun::new("acme", "work", "k-chaos", json!({"i": 1})).queue("chaos");
    let id = ferry.create_run_idempotent(run).await.unwrap().run.run_id;
    let mut child = Command::new(env!("CARGO_BIN_EXE_ferry-test-worker"))
        .env("FERRY_URL", &url)
        .env("FERRY_QUEUE", "chaos")
        .env("FERRY_LEASE_MS", "60000")
        .env("FERRY_MODE", "hang")
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the worker process");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(
        line.trim(),
        format!("claimed {id} 1"),
        "the child holds the job mid-work"
    );
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    // Nobody can take it while the dead worker's lease lasts...
    assert!(ferry
        .jobs()
        .claim("chaos", "rescuer", Duration::from_secs(30), 1)
        .await
        .unwrap()
        .is_empty());
    // ...and after expiry (an injected clock an hour ahead) another worker recovers it.
    let now: i64 = sqlx::query_scalar("SELECT (extract(epoch FROM now()) * 1000)::bigint")
        .fetch_one(ferry.db().as_postgres().unwrap())
        .await
        .unwrap();
    let later = Ferry::builder(&url)
        .clock(Clock::manual(Millis::new(now + 3_600_000).unwrap()))
        .connect()
        .await
        .unwrap();
    let c = later
        .jobs()
        .claim("chaos", "rescuer", Duration::from_secs(30), 1)
        .await
        .unwrap()
        .pop()
        .expect("recovered after expiry");
    assert_eq!((c.lease.run_id, c.lease.generation, c.attempt), (id, 2, 2));
    later
        .jobs()
        .complete(&c.lease, &json!({"by": "rescuer"}))
        .await
        .unwrap();
    let attempts = ferry.operator().list_attempts("acme", id).await.unwrap();
    assert_eq!(attempts[0].outcome.map(|o| o.as_str()), Some("lost"));
    assert_eq!(attempts[1].outcome.map(|o| o.as_str()), Some("succeeded"));
    let kinds: Vec<_> = ferry
        .list_events("acme", id)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.kind)
        .collect();
    assert_eq!(kinds, ["run_queued", "run_succeeded"]);
}
