//! Batch handlers on both engines (`Router::batch_route`): one call takes
//! many jobs of one operation and answers per job; each answer is recorded
//! under its own lease (completed, retried within its own budget, or dead),
//! a job whose lease was lost during the call is not completed, and a
//! batch's completions write the same events and outbox rows as a single
//! completion.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry::worker::{JobContext, Router, Worker, WorkerConfig, WorkerStats};
use ferry::{Claimed, JobError, NewRun, RetryPolicy, RunState};
use serde::Deserialize;
use serde_json::{json, Value};
use uuid::Uuid;

use crate::support::{manual_clock, on_every_route, Kind, TestDb};

/// The batched operation's command: `fate` says how its handler answers.
#[derive(Debug, Deserialize)]
struct Tally {
    i: i64,
    fate: String,
}

fn config(slots: usize) -> WorkerConfig {
    WorkerConfig {
        queues: vec!["q".into()],
        concurrency: slots,
        batch: slots as u32,
        poll_interval: Duration::from_millis(20),
        grace: Duration::from_secs(5),
        retry: RetryPolicy {
            base: Duration::from_millis(1),
            max_jitter: Duration::ZERO,
            ..RetryPolicy::default()
        },
        owner: "batcher".into(),
        rng_seed: Some(3),
        ..WorkerConfig::default()
    }
}

async fn accept(t: &TestDb, queue: &str, key: &str, request: Value, max_attempts: u32) -> Uuid {
    let run = NewRun::new("acme", "tally", key, request)
        .queue(queue)
        .max_attempts(max_attempts);
    t.ferry.create_run_idempotent(run).await.unwrap().run.run_id
}

/// Runs `router` on queue `q` with `slots` slots until every run of `ids`
/// has ended (bounded), then shuts the worker down; returns its counters.
async fn work_until_terminal(t: &TestDb, router: Router, slots: usize, ids: &[Uuid]) -> Arc<WorkerStats> {
    let worker = Worker::new(t.ferry.clone(), config(slots), router);
    let stats = worker.stats();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(worker.run(async move {
        let _ = stop_rx.await;
    }));
    for id in ids {
        tokio::time::timeout(Duration::from_secs(30), async {
            while !t.ferry.get_run("acme", *id).await.unwrap().state.is_terminal() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the batched run ends");
    }
    stop_tx.send(()).unwrap();
    running.await.unwrap().unwrap();
    stats
}

/// A batch route for `tally` that records the size of each call and
/// answers each job by its `fate`.
fn tally_router(calls: Arc<Mutex<Vec<usize>>>) -> Router {
    Router::new().batch_route("tally", 16, move |jobs: Vec<(Tally, JobContext)>| {
        calls.lock().unwrap().push(jobs.len());
        async move {
            jobs.into_iter()
                .map(|(cmd, ctx)| match cmd.fate.as_str() {
                    "ok" => Ok(json!({ "i": cmd.i, "attempt": ctx.attempt() })),
                    "flaky" => Err(JobError::retryable("flaky")),
                    _ => Err(JobError::terminal("doomed")),
                })
                .collect()
        }
    })
}

/// `(outcome, class, code)` of each attempt of run `id`.
async fn attempts(t: &TestDb, id: Uuid) -> Vec<(String, Option<String>, Option<String>)> {
    t.ferry
        .operator()
        .list_attempts("acme", id)
        .await
        .unwrap()
        .into_iter()
        .map(|a| {
            (
                a.outcome.map(|o| o.as_str().to_owned()).unwrap_or_default(),
                a.error_class,
                a.error_code,
            )
        })
        .collect()
}

async fn last_body(t: &TestDb, id: Uuid, kind: &str) -> Value {
    let events = t.ferry.list_events("acme", id).await.unwrap();
    let last = events.last().unwrap();
    assert_eq!(last.kind, kind, "{events:?}");
    last.body.clone()
}

fn s(v: &str) -> Option<String> {
    Some(v.to_owned())
}

/// One call answers five jobs five ways: two complete, one is retried until
/// its own budget of two is spent and dies there, one dies at once, and one
/// whose request does not deserialize never reaches the handler.
async fn a_batch_call_answers_per_job(kind: Kind) {
    let t = TestDb::new(kind).await;
    let ok1 = accept(&t, "q", "k-ok1", json!({"i": 1, "fate": "ok"}), 5).await;
    let ok2 = accept(&t, "q", "k-ok2", json!({"i": 2, "fate": "ok"}), 5).await;
    let flaky = accept(&t, "q", "k-flaky", json!({"i": 3, "fate": "flaky"}), 2).await;
    let doomed = accept(&t, "q", "k-doomed", json!({"i": 4, "fate": "doomed"}), 5).await;
    let bad = accept(&t, "q", "k-bad", json!({"i": "four", "fate": "ok"}), 5).await;
    let calls = Arc::new(Mutex::new(Vec::new()));
    let ids = [ok1, ok2, flaky, doomed, bad];
    let stats = work_until_terminal(&t, tally_router(calls.clone()), 8, &ids).await;

    let calls = calls.lock().unwrap().clone();
    assert_eq!(calls, [4, 1], "one call for the four good commands, one for the retry");
    for (id, i) in [(ok1, 1), (ok2, 2)] {
        assert_eq!(t.ferry.get_run("acme", id).await.unwrap().state, RunState::Succeeded);
        assert_eq!(
            last_body(&t, id, "run_succeeded").await,
            json!({"result": {"i": i, "attempt": 1}})
        );
        assert_eq!(attempts(&t, id).await, [("succeeded".into(), None, None)]);
    }
    assert_eq!(
        attempts(&t, flaky).await,
        [
            ("retried".into(), s("retryable"), s("flaky")),
            ("dead".into(), s("retryable"), s("flaky"))
        ],
        "retried once, dead at its budget of two"
    );
    assert_eq!(
        last_body(&t, flaky, "run_failed").await,
        json!({"error_code": "flaky", "error_class": "retryable", "attempts": 2})
    );
    assert_eq!(
        attempts(&t, doomed).await,
        [("dead".into(), s("terminal"), s("doomed"))]
    );
    assert_eq!(
        attempts(&t, bad).await,
        [("dead".into(), s("terminal"), s("invalid_command"))]
    );
    for id in [flaky, doomed, bad] {
        assert_eq!(t.ferry.get_run("acme", id).await.unwrap().state, RunState::Failed);
    }
    assert_eq!(stats.completed.load(Ordering::SeqCst), 2);
    assert_eq!(stats.retried.load(Ordering::SeqCst), 1);
    assert_eq!(stats.dead.load(Ordering::SeqCst), 3);
    assert_eq!(stats.lost.load(Ordering::SeqCst), 0);
}

/// A job whose lease is lost while its batch call runs (given back and
/// claimed by another worker) is not completed by the batch: its answer is
/// dropped, its new owner completes it, and the rest of the batch completes.
async fn a_stale_job_in_a_batch_is_not_completed(kind: Kind) {
    let t = TestDb::with_clock(kind, manual_clock()).await;
    let mut ids = Vec::new();
    for i in 0..3 {
        ids.push(accept(&t, "q", &format!("k-{i}"), json!({"i": i, "fate": "ok"}), 5).await);
    }
    let stolen: Arc<Mutex<Option<Claimed>>> = Arc::default();
    let calls = Arc::new(Mutex::new(Vec::new()));
    let (ferry, thief, sizes) = (t.ferry.clone(), stolen.clone(), calls.clone());
    let router = Router::new().batch_route("tally", 16, move |jobs: Vec<(Tally, JobContext)>| {
        sizes.lock().unwrap().push(jobs.len());
        let (ferry, thief) = (ferry.clone(), thief.clone());
        async move {
            // The lease of job 1 is lost meanwhile: given back, then taken
            // by another worker at the next generation.
            let (_, victim) = jobs.iter().find(|(cmd, _)| cmd.i == 1).expect("job 1 is in the batch");
            ferry.jobs().release(victim.lease()).await.unwrap();
            let taken = ferry
                .jobs()
                .claim("q", "thief", Duration::from_secs(600), 1)
                .await
                .unwrap();
            *thief.lock().unwrap() = taken.into_iter().next();
            jobs.iter()
                .map(|(cmd, _)| Ok(json!({ "by": "batch", "i": cmd.i })))
                .collect()
        }
    });
    let done: Vec<Uuid> = ids.iter().copied().filter(|id| *id != ids[1]).collect();
    let stats = work_until_terminal(&t, router, 3, &done).await;
    assert_eq!(calls.lock().unwrap().clone(), [3], "the three jobs came in one call");

    let thief = stolen.lock().unwrap().take().expect("the thief claimed job 1");
    assert_eq!(thief.lease.run_id, ids[1]);
    assert_eq!(thief.lease.generation, 2);
    assert_eq!(
        t.ferry.get_run("acme", ids[1]).await.unwrap().state,
        RunState::Queued,
        "the stale answer did not complete the run"
    );
    assert_eq!(stats.completed.load(Ordering::SeqCst), 2);
    assert_eq!(stats.lost.load(Ordering::SeqCst), 1, "the stale answer was dropped");
    for id in &done {
        assert_eq!(last_body(&t, *id, "run_succeeded").await["result"]["by"], "batch");
    }
    t.ferry
        .jobs()
        .complete(&thief.lease, &json!({"by": "thief"}))
        .await
        .unwrap();
    assert_eq!(
        last_body(&t, ids[1], "run_succeeded").await,
        json!({"result": {"by": "thief"}})
    );
    let kinds: Vec<String> = t
        .ferry
        .list_events("acme", ids[1])
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.kind)
        .collect();
    assert_eq!(kinds, ["run_queued", "run_succeeded"], "exactly one terminal event");
}

/// What a run's terminal outbox row carries, with the run id written as
/// `RUN` so rows of two runs compare: topic, effect key, whether the lane is
/// the run id's, headers, and the payload as JSON.
async fn terminal_outbox_row(t: &TestDb, id: Uuid) -> (String, String, bool, Value, Value) {
    let sql_pg =
        "SELECT topic, effect_key, lane, headers::text, payload FROM outbox WHERE key = $1 ORDER BY id DESC LIMIT 1";
    let sql_lite =
        "SELECT topic, effect_key, lane, headers, payload FROM outbox WHERE key = $1 ORDER BY id DESC LIMIT 1";
    let key = id.to_string();
    let (topic, effect_key, lane, headers, payload): (String, String, i32, String, Vec<u8>) =
        match (t.ferry.db().as_postgres(), t.ferry.db().as_sqlite()) {
            (Some(pg), _) => sqlx::query_as(sql_pg).bind(&key).fetch_one(pg).await.unwrap(),
            (_, Some(lite)) => sqlx::query_as(sql_lite).bind(&key).fetch_one(lite).await.unwrap(),
            _ => unreachable!("a database is PostgreSQL or SQLite"),
        };
    let anonymous = |text: &str| text.replace(&key, "RUN");
    (
        topic,
        anonymous(&effect_key),
        lane == ferry::outbox::lane_for(&key, t.ferry.lanes()),
        serde_json::from_str(&headers).unwrap(),
        serde_json::from_str(&anonymous(std::str::from_utf8(&payload).unwrap())).unwrap(),
    )
}

/// A batch's completions write what a single completion writes: the
/// `run_succeeded` event, its outbox row (topic, key, lane, effect key,
/// headers, payload) and the closed attempt.
async fn a_batch_completes_as_a_single_completion_does(kind: Kind) {
    let t = TestDb::with_clock(kind, manual_clock()).await;
    let single = accept(&t, "single", "k-single", json!({"i": 0, "fate": "ok"}), 5).await;
    let job = t
        .ferry
        .jobs()
        .claim("single", "solo", Duration::from_secs(30), 1)
        .await
        .unwrap()
        .pop()
        .unwrap();
    t.ferry
        .jobs()
        .complete(&job.lease, &json!({"same": true}))
        .await
        .unwrap();
    let mut batched = Vec::new();
    for i in 0..3 {
        batched.push(accept(&t, "q", &format!("k-{i}"), json!({"i": i, "fate": "ok"}), 5).await);
    }
    let calls = Arc::new(Mutex::new(Vec::new()));
    let sizes = calls.clone();
    let router = Router::new().batch_route("tally", 16, move |jobs: Vec<(Tally, JobContext)>| {
        sizes.lock().unwrap().push(jobs.len());
        std::future::ready(jobs.iter().map(|_| Ok(json!({"same": true}))).collect())
    });
    work_until_terminal(&t, router, 4, &batched).await;
    assert_eq!(calls.lock().unwrap().clone(), [3]);

    let strip = |events: Vec<ferry::RunEvent>| -> (usize, i64, String, Value, ferry::Millis) {
        let n = events.len();
        let e = events.into_iter().last().expect("events");
        (n, e.seq, e.kind, e.body, e.created_at)
    };
    let expected_events = strip(t.ferry.list_events("acme", single).await.unwrap());
    let expected_row = terminal_outbox_row(&t, single).await;
    assert_eq!(expected_row.1, "acme/RUN/2");
    assert!(expected_row.2, "the run's lane");
    for id in batched {
        assert_eq!(strip(t.ferry.list_events("acme", id).await.unwrap()), expected_events);
        assert_eq!(terminal_outbox_row(&t, id).await, expected_row);
        assert_eq!(attempts(&t, id).await, [("succeeded".into(), None, None)]);
        assert_eq!(
            t.scalar(&format!("SELECT count(*) FROM outbox WHERE key = '{id}'"))
                .await,
            2,
            "run_queued's row and run_succeeded's"
        );
    }
}

/// A job of a running batch call whose run is cancelled is given up alone
/// at its next renewal (its context's token fires), while the call goes on
/// and its other job completes.
async fn a_cancelled_job_leaves_its_batch_call_alone(kind: Kind) {
    let t = TestDb::with_clock(kind, manual_clock()).await;
    let mut ids = Vec::new();
    for i in 0..2 {
        ids.push(accept(&t, "q", &format!("k-{i}"), json!({"i": i, "fate": "ok"}), 5).await);
    }
    let (ferry, victim_id) = (t.ferry.clone(), ids[0]);
    let router = Router::new().batch_route("tally", 16, move |jobs: Vec<(Tally, JobContext)>| {
        let ferry = ferry.clone();
        async move {
            let (_, victim) = jobs
                .iter()
                .find(|(_, ctx)| ctx.run_id() == victim_id)
                .expect("in the batch");
            ferry.cancel("acme", victim_id, None, "ops", "stop it").await.unwrap();
            // The worker learns it at a renewal and cancels this job alone.
            victim.cancellation().cancelled().await;
            let others_live = jobs
                .iter()
                .filter(|(_, ctx)| ctx.run_id() != victim_id)
                .all(|(_, ctx)| !ctx.cancellation().is_cancelled());
            assert!(others_live, "only the cancelled job's token fired");
            jobs.iter().map(|(cmd, _)| Ok(json!({ "i": cmd.i }))).collect()
        }
    });
    let mut cfg = config(2);
    cfg.renew_every = Some(Duration::from_millis(10));
    let worker = Worker::new(t.ferry.clone(), cfg, router);
    let stats = worker.stats();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(worker.run(async move {
        let _ = stop_rx.await;
    }));
    tokio::time::timeout(Duration::from_secs(30), async {
        while !t.ferry.get_run("acme", ids[1]).await.unwrap().state.is_terminal() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the other job completes");
    stop_tx.send(()).unwrap();
    running.await.unwrap().unwrap();
    assert_eq!(
        t.ferry.get_run("acme", ids[0]).await.unwrap().state,
        RunState::Cancelled
    );
    assert_eq!(
        t.ferry.get_run("acme", ids[1]).await.unwrap().state,
        RunState::Succeeded
    );
    assert_eq!(stats.completed.load(Ordering::SeqCst), 1);
    assert_eq!(
        stats.lost.load(Ordering::SeqCst),
        1,
        "the cancelled job was given up, its answer dropped"
    );
}

on_every_route!(
    a_batch_call_answers_per_job,
    a_stale_job_in_a_batch_is_not_completed,
    a_batch_completes_as_a_single_completion_does,
    a_cancelled_job_leaves_its_batch_call_alone,
);
