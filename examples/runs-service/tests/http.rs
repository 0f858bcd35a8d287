//! The example service over real HTTP on 127.0.0.1:0 against PostgreSQL:
//! retried POSTs, conflicts, tenants, credentials and backpressure.

use std::collections::HashMap;

use ferry::{Engine, Ferry};
use serde_json::{json, Value};

struct Service {
    base: String,
    client: reqwest::Client,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    handle: tokio::task::JoinHandle<std::io::Result<()>>,
}

async fn start(max_queued: i64, with_worker: bool) -> Service {
    let url = ferry_testkit::fresh_database_url(Engine::Postgres)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let ferry = Ferry::builder(&url).migrate(true).connect().await.unwrap();
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
    let handle = tokio::spawn(runs_service::run(ferry, config, listener, async move {
        let _ = stopped.await;
    }));
    Service {
        base,
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
