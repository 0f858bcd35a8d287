//! The example service over real HTTP on 127.0.0.1:0 against PostgreSQL:
//! retried POSTs, conflicts, tenants, credentials, backpressure, bad input,
//! and a database outage in the middle of a load (on a cluster of the test's own).

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use ferry::{Engine, Ferry, NewRun};
use ferry_testkit::PgCluster;
use serde_json::{json, Value};

struct Service {
    base: String,
    /// The service's database, to count what a request wrote.
    ferry: Ferry,
    client: reqwest::Client,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    handle: tokio::task::JoinHandle<std::io::Result<()>>,
}

async fn start(max_queued: i64, with_worker: bool) -> Service {
    let url = ferry_testkit::fresh_database_url(Engine::Postgres)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let ferry = Ferry::builder(&url).migrate(true).connect().await.unwrap();
    start_on(ferry, max_queued, with_worker).await
}

async fn start_on(ferry: Ferry, max_queued: i64, with_worker: bool) -> Service {
    let config = runs_service::Config {
        tokens: HashMap::from([
            ("tok-acme".into(), "acme".into()),
            ("tok-globex".into(), "globex".into()),
        ]),
        max_queued_per_tenant: max_queued,
        retry_after_secs: 3,
        with_worker,
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let handle = tokio::spawn(runs_service::run(ferry.clone(), config, listener, async move {
        let _ = stopped.await;
    }));
    Service {
        base,
        ferry,
        client: reqwest::Client::new(),
        stop: Some(stop),
        handle,
    }
}

impl Service {
    async fn post(&self, token: Option<&str>, key: Option<&str>, body: &Value) -> reqwest::Response {
        let mut r = self.client.post(format!("{}/v1/runs", self.base)).json(body);
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        if let Some(k) = key {
            r = r.header("Idempotency-Key", format!("\"{k}\""));
        }
        r.send().await.unwrap()
    }

    /// Rows in runs, jobs, idempotency_keys and outbox.
    async fn written(&self) -> [i64; 4] {
        let mut out = [0; 4];
        for (n, table) in out.iter_mut().zip(["runs", "jobs", "idempotency_keys", "outbox"]) {
            *n = self
                .ferry
                .db()
                .fetch_i64(&format!("SELECT count(*) FROM {table}"))
                .await
                .unwrap();
        }
        out
    }

    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.handle.await.unwrap().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_post_gives_one_run_and_a_changed_body_conflicts() {
    let s = start(1000, false).await;
    let body = json!({"operation": "charge", "amount": 5});
    let first = s.post(Some("tok-acme"), Some("key-1"), &body).await;
    assert_eq!(first.status(), 202);
    let location = first.headers()["location"].to_str().unwrap().to_owned();
    let first: Value = first.json().await.unwrap();
    assert!(location.ends_with(first["run_id"].as_str().unwrap()));
    // The same key with an equivalent body (keys reordered) returns the original.
    let again = s
        .post(
            Some("tok-acme"),
            Some("key-1"),
            &json!({"amount": 5, "operation": "charge"}),
        )
        .await;
    assert_eq!(again.status(), 202);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.headers()["location"].to_str().unwrap(), location);
    let again: Value = again.json().await.unwrap();
    assert_eq!(again["run_id"], first["run_id"]);
    // Another body under the same key.
    let conflict = s
        .post(
            Some("tok-acme"),
            Some("key-1"),
            &json!({"operation": "charge", "amount": 6}),
        )
        .await;
    assert_eq!(conflict.status(), 409);
    assert_eq!(conflict.headers()["content-type"], "application/problem+json");
    let problem: Value = conflict.json().await.unwrap();
    assert_eq!(problem["code"], "idempotency_conflict");
    assert!(!problem.to_string().contains("key-1"), "the key is not echoed");
    // Missing or invalid keys, missing credentials.
    assert_eq!(s.post(Some("tok-acme"), None, &body).await.status(), 400);
    assert_eq!(s.post(Some("tok-acme"), Some("has space"), &body).await.status(), 400);
    assert_eq!(s.post(None, Some("key-2"), &body).await.status(), 401);
    assert_eq!(s.post(Some("wrong"), Some("key-2"), &body).await.status(), 401);
    // The run reads back with its events; cancel works once.
    let got: Value = s
        .client
        .get(format!("{}{location}", s.base))
        .bearer_auth("tok-acme")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(got["events"][0]["kind"], "run_queued");
    let cancel = s
        .client
        .post(format!("{}{location}/cancel", s.base))
        .bearer_auth("tok-acme")
        .send()
        .await
        .unwrap();
    assert_eq!(cancel.status(), 200);
    let again = s
        .client
        .post(format!("{}{location}/cancel", s.base))
        .bearer_auth("tok-acme")
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 409);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wrong_tenant_sees_nothing() {
    let s = start(1000, false).await;
    let r: Value = s
        .post(Some("tok-acme"), Some("k"), &json!({"x": 1}))
        .await
        .json()
        .await
        .unwrap();
    let path = format!("{}/v1/runs/{}", s.base, r["run_id"].as_str().unwrap());
    assert_eq!(
        s.client
            .get(&path)
            .bearer_auth("tok-globex")
            .send()
            .await
            .unwrap()
            .status(),
        404
    );
    assert_eq!(
        s.client
            .post(format!("{path}/cancel"))
            .bearer_auth("tok-globex")
            .send()
            .await
            .unwrap()
            .status(),
        404
    );
    assert_eq!(
        s.client
            .get(&path)
            .bearer_auth("tok-acme")
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    // The same key under another tenant is another run.
    let other: Value = s
        .post(Some("tok-globex"), Some("k"), &json!({"x": 1}))
        .await
        .json()
        .await
        .unwrap();
    assert_ne!(other["run_id"], r["run_id"]);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_gets_429_with_retry_after() {
    let s = start(5, false).await;
    let mut statuses = Vec::new();
    for i in 0..12 {
        let r = s
            .post(Some("tok-acme"), Some(&format!("flood-{i}")), &json!({"i": i}))
            .await;
        let status = r.status().as_u16();
        if status == 429 {
            assert_eq!(r.headers()["retry-after"], "3");
            let p: Value = r.json().await.unwrap();
            assert_eq!(p["code"], "backpressure");
        }
        statuses.push(status);
    }
    assert_eq!(statuses.iter().filter(|s| **s == 202).count(), 5, "{statuses:?}");
    assert_eq!(statuses.iter().filter(|s| **s == 429).count(), 7);
    // Another tenant is not throttled by acme's backlog.
    assert_eq!(s.post(Some("tok-globex"), Some("g"), &json!({})).await.status(), 202);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_in_process_worker_completes_runs() {
    let s = start(1000, true).await;
    let r: Value = s
        .post(Some("tok-acme"), Some("w1"), &json!({"operation": "charge"}))
        .await
        .json()
        .await
        .unwrap();
    let path = format!("{}/v1/runs/{}", s.base, r["run_id"].as_str().unwrap());
    let start = std::time::Instant::now();
    loop {
        let got: Value = s
            .client
            .get(&path)
            .bearer_auth("tok-acme")
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if got["run"]["state"] == "succeeded" {
            assert_eq!(got["events"][1]["kind"], "run_succeeded");
            break;
        }
        assert!(
            start.elapsed() < std::time::Duration::from_secs(30),
            "the worker never completed the run"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    s.stop().await;
}

/// An error no retry cures (here a table the queries need is gone) is the
/// service's fault: 500 with the library's code and no `Retry-After`, never
/// a 503 that would have clients retry for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_error_no_retry_cures_is_a_500_without_retry_after() {
    let url = ferry_testkit::fresh_database_url(Engine::Postgres)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let ferry = Ferry::builder(&url).migrate(true).connect().await.unwrap();
    ferry
        .db()
        .execute_raw("ALTER TABLE jobs RENAME TO jobs_gone")
        .await
        .unwrap();
    let s = start_on(ferry, 1000, false).await;
    let r = s.post(Some("tok-acme"), Some("k"), &json!({"x": 1})).await;
    assert_eq!(r.status(), 500);
    assert!(r.headers().get("retry-after").is_none());
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["code"], "database", "{p}");
    s.stop().await;
}

/// A tenant over its queue limit still gets the answer to a retried POST:
/// the replay (it used to get 429, so a client retrying after a lost
/// response could not learn its run), or the conflict. Only a new run gets
/// 429, and it writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_post_is_answered_before_the_queue_limit() {
    let s = start(1, false).await;
    let body = json!({"operation": "charge", "amount": 5});
    let first = s.post(Some("tok-acme"), Some("key-1"), &body).await;
    assert_eq!(first.status(), 202);
    let first: Value = first.json().await.unwrap();
    let new = s.post(Some("tok-acme"), Some("key-2"), &json!({"amount": 6})).await;
    assert_eq!(new.status(), 429, "a new run past the limit");
    assert_eq!(s.written().await, [1, 1, 1, 1], "the refused run wrote nothing");
    let retried = s.post(Some("tok-acme"), Some("key-1"), &body).await;
    assert_eq!(retried.status(), 202);
    assert_eq!(retried.headers()["idempotent-replayed"], "true");
    let retried: Value = retried.json().await.unwrap();
    assert_eq!(retried["run_id"], first["run_id"]);
    let conflict = s
        .post(
            Some("tok-acme"),
            Some("key-1"),
            &json!({"operation": "charge", "amount": 7}),
        )
        .await;
    assert_eq!(conflict.status(), 409);
    assert_eq!(s.written().await, [1, 1, 1, 1]);
    s.stop().await;
}

/// NUL in a POST, escaped in any string or key of the command, raw in the
/// body, or in the `Idempotency-Key` header, is a 400 and writes nothing
/// (PostgreSQL cannot store NUL in text or JSON).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nul_bytes_are_refused_with_400_and_write_nothing() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = start(1000, false).await;
    let bodies = [
        r#"{"operation": "charge", "note": "a\u0000b"}"#,
        r#"{"operation": "charge", "nested": [{"k\u0000": 1}]}"#,
        r#"{"operation": "char\u0000ge"}"#,
        "{\"operation\": \"charge\", \"note\": \"a\u{0}b\"}",
    ];
    for (i, body) in bodies.iter().enumerate() {
        let r = s
            .client
            .post(format!("{}/v1/runs", s.base))
            .bearer_auth("tok-acme")
            .header("Idempotency-Key", format!("nul-{i}"))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "body {i}");
        assert_eq!(r.headers()["content-type"], "application/problem+json");
        let p: Value = r.json().await.unwrap();
        assert_eq!(p["code"], "invalid_input", "body {i}: {p}");
    }
    // A NUL in the key header: HTTP clients refuse to send one, so raw bytes.
    let mut conn = tokio::net::TcpStream::connect(s.base.trim_start_matches("http://"))
        .await
        .unwrap();
    let request = "POST /v1/runs HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer tok-acme\r\n\
                   Idempotency-Key: a\u{0}b\r\nContent-Type: application/json\r\n\
                   Content-Length: 2\r\nConnection: close\r\n\r\n{}";
    conn.write_all(request.as_bytes()).await.unwrap();
    let mut answer = String::new();
    conn.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert_eq!(s.written().await, [0; 4], "nothing was written");
    s.stop().await;
}

/// One request of the property below.
#[derive(Debug, Clone)]
enum Input {
    /// POST /v1/runs with this `Idempotency-Key` (raw header bytes) and body.
    Create(Vec<u8>, Vec<u8>),
    /// GET /v1/runs/{id} and POST /v1/runs/{id}/cancel with this id.
    Run(String),
}

fn input() -> impl proptest::strategy::Strategy<Value = Input> {
    use proptest::prelude::*;
    let key = prop_oneof![
        "[!-~]{1,300}".prop_map(String::into_bytes),
        "\"[!-~]{0,20}\"?".prop_map(String::into_bytes),
        prop::collection::vec(any::<u8>(), 0..40),
    ];
    let json = prop::collection::vec(("[a-z\\x00]{1,8}", any::<String>()), 0..4).prop_map(|kv| {
        let mut m = serde_json::Map::new();
        for (k, v) in kv {
            m.insert(k, Value::String(v));
        }
        serde_json::to_vec(&m).unwrap()
    });
    let body = prop_oneof![
        json,
        any::<String>().prop_map(String::into_bytes),
        prop::collection::vec(any::<u8>(), 0..64),
        Just(br#"{"operation": 7}"#.to_vec()),
        Just(br#"{"operation": ""}"#.to_vec()),
        Just(br#"[1, 2]"#.to_vec()),
    ];
    prop_oneof![
        (key, body).prop_map(|(k, b)| Input::Create(k, b)),
        prop_oneof![any::<String>(), "[0-9a-fA-F-]{30,40}"].prop_map(Input::Run),
    ]
}

/// Percent-encodes every byte but unreserved ones.
fn encode_all(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// Whatever a client sends as the key, the body or the run id, the answer
/// is a success or an `application/problem+json` error under 500 with a
/// stable code (a non-string `operation` used to become `run` silently, a
/// bad run id got axum's plain-text rejection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_key_body_or_run_id_gets_an_answer_or_a_typed_problem() {
    use proptest::test_runner::{Config, TestCaseError, TestRunner};
    let s = start(1000, false).await;
    let handle = tokio::runtime::Handle::current();
    let s = tokio::task::spawn_blocking(move || {
        let mut runner = TestRunner::new(Config {
            cases: 300,
            failure_persistence: None,
            ..Config::default()
        });
        let outcome = runner.run(&input(), |i| {
            handle.block_on(async {
                let replies = match &i {
                    Input::Create(key, body) => {
                        let Ok(key) = reqwest::header::HeaderValue::from_bytes(key) else {
                            return Ok(()); // no HTTP client can send it
                        };
                        let r = s
                            .client
                            .post(format!("{}/v1/runs", s.base))
                            .bearer_auth("tok-acme")
                            .header("Idempotency-Key", key)
                            .body(body.clone())
                            .send()
                            .await
                            .unwrap();
                        vec![r]
                    }
                    Input::Run(id) => {
                        // An empty id is another route (`/v1/runs/`): answered too.
                        let path = format!("{}/v1/runs/{}", s.base, encode_all(id));
                        let get = s.client.get(&path).bearer_auth("tok-acme").send().await.unwrap();
                        let cancel = s
                            .client
                            .post(format!("{path}/cancel"))
                            .bearer_auth("tok-acme")
                            .send()
                            .await
                            .unwrap();
                        vec![get, cancel]
                    }
                };
                for r in replies {
                    let status = r.status().as_u16();
                    if status < 400 {
                        continue;
                    }
                    let kind = r.headers().get("content-type").cloned();
                    let p: Value = r.json().await.unwrap_or_default();
                    let code = p["code"].as_str().unwrap_or_default().to_owned();
                    if status >= 500
                        || kind.as_ref().and_then(|k| k.to_str().ok()) != Some("application/problem+json")
                        || code.is_empty()
                    {
                        return Err(TestCaseError::fail(format!("{i:?} answered {status}: {p}")));
                    }
                }
                Ok(())
            })
        });
        if let Err(e) = outcome {
            panic!("{e}");
        }
        s
    })
    .await
    .unwrap();
    s.stop().await;
}

/// What the outage test's clients have seen so far.
#[derive(Debug, Default)]
struct Tally {
    /// Keys answered 202 (each client moves to its next key only then).
    accepted: BTreeSet<String>,
    /// 202s that were replays (a commit whose answer the outage lost).
    replays: usize,
    /// 503s, each with `Retry-After` and the `unavailable` code.
    unavailable: usize,
    /// Answers that break the contract; the client stops at the first.
    wrong: Option<String>,
}

/// Posts keys `c<client>-<n>` one after another; a 503 is retried with the
/// same key, and the client stops only after an accepted key, so every key
/// it sent is accepted in the end.
async fn outage_client(
    s: std::sync::Arc<Service>,
    client: usize,
    stop: tokio::sync::watch::Receiver<bool>,
    tally: tokio::sync::watch::Sender<Tally>,
) {
    let mut n = 0;
    while !*stop.borrow() {
        let key = format!("c{client}-{n}");
        let r = s
            .post(Some("tok-acme"), Some(&key), &json!({"operation": "charge", "n": n}))
            .await;
        match r.status().as_u16() {
            202 => {
                let replay = r.headers().contains_key("idempotent-replayed");
                tally.send_modify(|t| {
                    t.accepted.insert(key);
                    t.replays += usize::from(replay);
                });
                n += 1;
            }
            503 => {
                let retry_after = r.headers().get("retry-after").cloned();
                let p: Value = r.json().await.unwrap();
                let right = retry_after.as_ref().is_some_and(|v| v == "3")
                    && p["code"] == "unavailable"
                    && !p.to_string().contains(&key);
                tally.send_modify(|t| match right {
                    true => t.unavailable += 1,
                    false => t.wrong = Some(format!("503 with Retry-After {retry_after:?}: {p}")),
                });
                if !right {
                    return;
                }
            }
            other => {
                let body = r.text().await.unwrap();
                tally.send_modify(|t| t.wrong = Some(format!("{other}: {body}")));
                return;
            }
        }
    }
}

/// Waits until `done` holds for the tally, failing after `limit`.
async fn tally_until(
    tally: &tokio::sync::watch::Sender<Tally>,
    limit: Duration,
    what: &str,
    done: impl Fn(&Tally) -> bool,
) {
    let mut rx = tally.subscribe();
    let waited = tokio::time::timeout(limit, rx.wait_for(|t| t.wrong.is_some() || done(t))).await;
    let t = tally.borrow();
    assert!(
        t.wrong.is_none(),
        "a client got a wrong answer: {}",
        t.wrong.as_deref().unwrap_or_default()
    );
    assert!(waited.is_ok(), "{what} not within {limit:?}: {t:?}");
}

/// PostgreSQL stops for 45 s (fast shutdown) under four clients posting
/// runs: requests meanwhile get 503 with `Retry-After` and the stable code
/// `unavailable`, the library's acceptance fails with a transient error, and
/// once the database is back every key is accepted exactly once, each run
/// whole (run, `run_queued`, job, idempotency record, outbox row).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_outage_answers_503_with_retry_after_and_writes_nothing_half() {
    const CLIENTS: usize = 4;
    let mut pg = PgCluster::start();
    let ferry = Ferry::builder(pg.url()).migrate(true).connect().await.unwrap();
    let s = std::sync::Arc::new(start_on(ferry.clone(), 1_000_000, false).await);
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let tally = tokio::sync::watch::Sender::new(Tally::default());
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| tokio::spawn(outage_client(s.clone(), c, stopped.clone(), tally.clone())))
        .collect();
    tally_until(
        &tally,
        Duration::from_secs(60),
        "40 runs accepted before the outage",
        |t| t.accepted.len() >= 40,
    )
    .await;

    tokio::task::block_in_place(|| pg.stop());
    let down = tokio::time::Instant::now();
    let err = ferry
        .create_run_idempotent(NewRun::new("acme", "charge", "library-1", json!({"n": 1})))
        .await
        .expect_err("no acceptance without the database");
    assert!(
        err.is_transient(),
        "a database outage is retryable: {err} ({})",
        err.code()
    );
    tally_until(&tally, Duration::from_secs(40), "a 503 for every client", |t| {
        t.unavailable >= CLIENTS
    })
    .await;
    // The outage lasts 45 s: the fault injected, not a synchronization.
    tokio::time::sleep_until(down + Duration::from_secs(45)).await;
    tokio::task::block_in_place(|| pg.restart());

    let before = tally.borrow().accepted.len();
    tally_until(
        &tally,
        Duration::from_secs(60),
        "40 more runs accepted after the outage",
        |t| t.accepted.len() >= before + 40,
    )
    .await;
    stop.send_replace(true);
    for c in clients {
        c.await.unwrap();
    }
    let accepted = ferry
        .create_run_idempotent(NewRun::new("acme", "charge", "library-1", json!({"n": 1})))
        .await
        .unwrap();
    assert!(!accepted.replay, "the failed acceptance wrote nothing");

    let t = tally.borrow();
    eprintln!(
        "outage: {} runs accepted, {} answers 503, {} replays after a lost answer",
        t.accepted.len(),
        t.unavailable,
        t.replays
    );
    let db = ferry.db();
    let scalar = |sql: String| async move { db.fetch_i64(&sql).await.unwrap_or_else(|e| panic!("{sql}: {e}")) };
    let listed = t
        .accepted
        .iter()
        .map(|k| format!("'{k}'"))
        .collect::<Vec<_>>()
        .join(",");
    assert_eq!(
        scalar(format!("SELECT count(*) FROM idempotency_keys WHERE key IN ({listed})")).await,
        t.accepted.len() as i64,
        "an idempotency record for every accepted key"
    );
    let whole = t.accepted.len() as i64 + 1;
    for table in ["runs", "run_events", "jobs", "idempotency_keys", "outbox"] {
        let n = scalar(format!("SELECT count(*) FROM {table}")).await;
        assert_eq!(n, whole, "{table}: one row per accepted run, no other");
    }
    let broken = scalar(
        "SELECT count(*) FROM runs r WHERE NOT EXISTS (SELECT 1 FROM jobs j WHERE j.tenant = r.tenant AND j.run_id = r.run_id)
            OR NOT EXISTS (SELECT 1 FROM run_events e WHERE e.tenant = r.tenant AND e.run_id = r.run_id AND e.seq = 1 AND e.kind = 'run_queued')
            OR NOT EXISTS (SELECT 1 FROM idempotency_keys k WHERE k.tenant = r.tenant AND k.run_id = r.run_id)"
            .into(),
    )
    .await;
    assert_eq!(broken, 0, "every run was written whole");
    drop(t);
    std::sync::Arc::into_inner(s).expect("clients are done").stop().await;
}
