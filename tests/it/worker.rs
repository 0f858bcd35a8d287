//! The worker runtime on both engines: retries, lease loss, cancellation at
//! renew, graceful shutdown that releases only jobs it still owns, and
//! dispatch by operation with typed commands (`Router`); answers of one
//! claim share one completion statement.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ferry::worker::{JobContext, Router, Worker, WorkerConfig, WorkerStats};
use ferry::{Claimed, JobError, NewRun, RetryPolicy, RunState};
use serde::Deserialize;
use serde_json::json;
use tokio::sync::mpsc;

use crate::support::{manual_clock, on_every_route, Kind, TestDb};

fn fast_config(owner: &str) -> WorkerConfig {
    WorkerConfig {
        queues: vec!["q".into()],
        concurrency: 4,
        batch: 4,
        lease: Duration::from_secs(30),
        poll_interval: Duration::from_millis(20),
        grace: Duration::from_secs(5),
        retry: RetryPolicy {
            base: Duration::from_millis(1),
            max_jitter: Duration::ZERO,
            ..RetryPolicy::default()
        },
        owner: owner.into(),
        rng_seed: Some(9),
        ..WorkerConfig::default()
    }
}

async fn accept(t: &TestDb, n: usize) -> Vec<uuid::Uuid> {
    let mut ids = Vec::new();
    for i in 0..n {
        let run = NewRun::new("acme", "work", format!("k-{i}"), json!({"i": i})).queue("q");
        ids.push(t.ferry.create_run_idempotent(run).await.unwrap().run.run_id);
    }
    ids
}

async fn worker_completes_and_retries(kind: Kind) {
    let t = TestDb::new(kind).await;
    let ids = accept(&t, 30).await;
    let succeeded = Arc::new(AtomicUsize::new(0));
    let (all_done, mut done_rx) = mpsc::channel::<()>(1);
    let s = succeeded.clone();
    let worker = Worker::new(
        t.ferry.clone(),
        fast_config("w1"),
        move |job: Claimed, _ctx: JobContext| {
            let s = s.clone();
            let all_done = all_done.clone();
            async move {
                let i = job.request["i"].as_i64().unwrap();
                if i % 3 == 0 && job.attempt == 1 {
                    return Err(JobError::retryable("flaky"));
                }
                if s.fetch_add(1, Ordering::SeqCst) + 1 == 30 {
                    let _ = all_done.try_send(());
                }
                Ok(json!({"i": i}))
            }
        },
    );
    let stats = worker.stats();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(worker.run(async move {
        let _ = stop_rx.await;
    }));
    done_rx.recv().await.unwrap();
    stop_tx.send(()).unwrap();
    running.await.unwrap().unwrap();
    assert_eq!(stats.completed.load(Ordering::SeqCst), 30);
    assert_eq!(stats.retried.load(Ordering::SeqCst), 10);
    for (i, id) in ids.iter().enumerate() {
        let run = t.ferry.get_run("acme", *id).await.unwrap();
        assert_eq!(run.state, ferry::RunState::Succeeded);
        let attempts = t.ferry.operator().list_attempts("acme", *id).await.unwrap();
        assert_eq!(attempts.len(), if i % 3 == 0 { 2 } else { 1 });
    }
    assert_eq!(
        t.scalar("SELECT count(*) FROM jobs WHERE state <> 'succeeded'").await,
        0
    );
}

/// Sends on drop: proves the worker dropped (cancelled) the handler future.
struct DropSignal(mpsc::UnboundedSender<&'static str>);
impl Drop for DropSignal {
    fn drop(&mut self) {
        let _ = self.0.send("dropped");
    }
}

async fn lost_lease_and_cancellation_stop_the_handler(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    let ids = accept(&t, 1).await;
    let (tx, mut rx) = mpsc::unbounded_channel::<&'static str>();
    let mut cfg = fast_config("victim");
    cfg.renew_every = Some(Duration::from_millis(10));
    cfg.concurrency = 1;
    cfg.batch = 1;
    let worker = Worker::new(t.ferry.clone(), cfg, move |_job: Claimed, _ctx: JobContext| {
        let tx = tx.clone();
        async move {
            let _guard = DropSignal(tx.clone());
            let _ = tx.send("started");
            std::future::pending::<()>().await;
            Ok(json!({}))
        }
    });
    let stats = worker.stats();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(worker.run(async move {
        let _ = stop_rx.await;
    }));
    assert_eq!(rx.recv().await, Some("started"));
    // Another worker takes the job over once the (injected) clock passes
    // expiry. The victim drops its handler at the known expiry and, its slot
    // free, may reclaim the job before the thief does; then the thief waits
    // for that handler to start and expires it too.
    let mut started: u32 = 1;
    // Counted wherever they arrive: a stale handler dropped before the
    // victim reclaims is signalled before that reclaim's start.
    let mut dropped: u32 = 0;
    let mut rounds = 0;
    let thief = loop {
        rounds += 1;
        clock.advance(Duration::from_secs(31)).unwrap();
        let claimed = t
            .ferry
            .jobs()
            .claim("q", "thief", Duration::from_secs(600), 1)
            .await
            .unwrap();
        if let Some(c) = claimed.into_iter().next() {
            break c;
        }
        loop {
            match rx.recv().await.expect("handler signals") {
                "started" => break,
                _ => dropped += 1,
            }
        }
        started += 1;
    };
    assert_eq!(thief.lease.generation, 1 + i64::from(started));
    while dropped < started {
        match rx.recv().await {
            Some("dropped") => dropped += 1,
            other => panic!("the stale handler must be cancelled, got {other:?}"),
        }
    }
    t.ferry
        .jobs()
        .complete(&thief.lease, &json!({"by": "thief"}))
        .await
        .unwrap();

    // Cancellation reaches a running handler through renew.
    let run = NewRun::new("acme", "work", "k-cancel", json!({"i": 99})).queue("q");
    let id = t.ferry.create_run_idempotent(run).await.unwrap().run.run_id;
    assert_eq!(rx.recv().await, Some("started"));
    t.ferry.cancel("acme", id, None, "ops", "stop it").await.unwrap();
    assert_eq!(rx.recv().await, Some("dropped"));
    stop_tx.send(()).unwrap();
    running.await.unwrap().unwrap();
    assert_eq!(stats.lost.load(Ordering::SeqCst), u64::from(started) + 1);
    assert!(rounds >= 1);
    assert_eq!(stats.completed.load(Ordering::SeqCst), 0);
    let kinds: Vec<_> = t
        .ferry
        .list_events("acme", ids[0])
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.kind)
        .collect();
    assert_eq!(kinds, ["run_queued", "run_succeeded"]);
}

async fn shutdown_releases_only_owned_jobs(kind: Kind) {
    let t = TestDb::new(kind).await;
    let ids = accept(&t, 2).await;
    let (tx, mut rx) = mpsc::unbounded_channel::<bool>();
    let mut cfg = fast_config("shy");
    cfg.grace = Duration::from_millis(200);
    let worker = Worker::new(t.ferry.clone(), cfg, move |job: Claimed, ctx: JobContext| {
        let tx = tx.clone();
        async move {
            let polite = job.request["i"] == 0;
            let _ = tx.send(polite);
            if polite {
                // Observes the shutdown signal and gives up cleanly.
                ctx.cancellation().cancelled().await;
                return Err(JobError::retryable("shutting_down"));
            }
            // Ignores it: released after the grace period.
            std::future::pending::<()>().await;
            Ok(json!({}))
        }
    });
    let stats = worker.stats();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(worker.run(async move {
        let _ = stop_rx.await;
    }));
    rx.recv().await.unwrap();
    rx.recv().await.unwrap();
    stop_tx.send(()).unwrap();
    running.await.unwrap().unwrap();
    assert_eq!(stats.released.load(Ordering::SeqCst), 2);
    for id in ids {
        let attempts = t.ferry.operator().list_attempts("acme", id).await.unwrap();
        assert_eq!(attempts[0].outcome.map(|o| o.as_str()), Some("released"));
    }
    assert_eq!(
        t.scalar("SELECT count(*) FROM jobs WHERE state = 'queued' AND attempts = 0")
            .await,
        2,
        "no attempt was spent"
    );
}

async fn released_jobs_are_drained_by_the_next_worker(kind: Kind) {
    const N: usize = 3;
    let t = TestDb::new(kind).await;
    let ids = accept(&t, N).await;
    // The first worker takes every job, then shuts down: all are released.
    let (tx, mut rx) = mpsc::unbounded_channel::<()>();
    let worker = Worker::new(
        t.ferry.clone(),
        fast_config("leaving"),
        move |_job: Claimed, ctx: JobContext| {
            let tx = tx.clone();
            async move {
                let _ = tx.send(());
                ctx.cancellation().cancelled().await;
                Err(JobError::retryable("shutting_down"))
            }
        },
    );
    let stats = worker.stats();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(worker.run(async move {
        let _ = stop_rx.await;
    }));
    for _ in 0..N {
        rx.recv().await.unwrap();
    }
    stop_tx.send(()).unwrap();
    running.await.unwrap().unwrap();
    assert_eq!(stats.released.load(Ordering::SeqCst), N as u64);

    // A new worker drains the queue.
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<()>();
    let worker = Worker::new(
        t.ferry.clone(),
        fast_config("next"),
        move |job: Claimed, _ctx: JobContext| {
            let done_tx = done_tx.clone();
            async move {
                let _ = done_tx.send(());
                Ok(json!({"attempt": job.attempt}))
            }
        },
    );
    let stats = worker.stats();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(worker.run(async move {
        let _ = stop_rx.await;
    }));
    // Bounded, so a wedged queue fails the test instead of hanging it.
    tokio::time::timeout(Duration::from_secs(60), async {
        for _ in 0..N {
            done_rx.recv().await.unwrap();
        }
    })
    .await
    .expect("the new worker drains the released jobs (the queue is wedged)");
    stop_tx.send(()).unwrap();
    running.await.unwrap().unwrap();
    assert_eq!(stats.completed.load(Ordering::SeqCst), N as u64);
    for id in ids {
        assert_eq!(
            t.ferry.get_run("acme", id).await.unwrap().state,
            ferry::RunState::Succeeded
        );
        let history: Vec<_> = t
            .ferry
            .operator()
            .list_attempts("acme", id)
            .await
            .unwrap()
            .into_iter()
            .map(|a| (a.attempt, a.generation, a.outcome.unwrap().as_str().to_owned()))
            .collect();
        assert_eq!(history, [(1, 1, "released".to_owned()), (1, 2, "succeeded".to_owned())]);
    }
}

/// Makes every lease renewal of the worker fail with a transient error, for
/// real, whether or not the lease would still match: on PostgreSQL a
/// statement trigger raises `serialization_failure` on every `UPDATE jobs`
/// from the worker's connections (named by `application_name`); on SQLite
/// another connection holds the write lock, so the worker's writes get
/// `SQLITE_BUSY` after its short busy timeout. `heal` lets them through again.
enum RenewalFault {
    Postgres(ferry::store::PgDb),
    Sqlite(sqlx::SqliteConnection),
}

impl RenewalFault {
    async fn inject(t: &TestDb) -> RenewalFault {
        match t.ferry.db() {
            ferry::Db::Postgres(p) => {
                for sql in [
                    "CREATE FUNCTION fail_renewals() RETURNS trigger LANGUAGE plpgsql AS $$ \
                     BEGIN RAISE EXCEPTION 'injected renewal failure' USING ERRCODE = 'serialization_failure'; END $$",
                    "CREATE TRIGGER fail_renewals BEFORE UPDATE ON jobs FOR EACH STATEMENT \
                     WHEN (current_setting('application_name') = 'ferry-flaky-worker') \
                     EXECUTE FUNCTION fail_renewals()",
                ] {
                    sqlx::query(sql).execute(p).await.unwrap();
                }
                RenewalFault::Postgres(p.clone())
            }
            ferry::Db::Sqlite(_) => {
                use sqlx::Connection;
                let mut c = sqlx::SqliteConnection::connect(&t.url).await.unwrap();
                sqlx::query("BEGIN IMMEDIATE").execute(&mut c).await.unwrap();
                RenewalFault::Sqlite(c)
            }
        }
    }

    async fn heal(self) {
        match self {
            RenewalFault::Postgres(p) => {
                sqlx::query("DROP TRIGGER fail_renewals ON jobs")
                    .execute(&p)
                    .await
                    .unwrap();
            }
            RenewalFault::Sqlite(mut c) => {
                sqlx::query("ROLLBACK").execute(&mut c).await.unwrap();
            }
        }
    }
}

/// A handle for the worker with its own pool; on SQLite a short busy
/// timeout, so a held write lock fails a renewal quickly (and transiently).
async fn worker_ferry(t: &TestDb) -> ferry::Ferry {
    match t.ferry.db() {
        ferry::Db::Postgres(_) => ferry::Ferry::builder(format!("{}&application_name=ferry-flaky-worker", t.url))
            .clock(t.ferry.clock().clone())
            .connect()
            .await
            .unwrap(),
        ferry::Db::Sqlite(_) => {
            use std::str::FromStr;
            let opts = sqlx::sqlite::SqliteConnectOptions::from_str(&t.url)
                .unwrap()
                .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
                .foreign_keys(true)
                .busy_timeout(Duration::from_millis(20));
            let pool = sqlx::sqlite::SqlitePoolOptions::new()
                .max_connections(2)
                .connect_with(opts)
                .await
                .unwrap();
            ferry::Ferry::builder(&t.url)
                .clock(t.ferry.clock().clone())
                .build(ferry::Db::Sqlite(pool))
                .await
                .unwrap()
        }
    }
}

async fn failing_renewals_cancel_the_handler_at_the_known_expiry(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    let id = accept(&t, 1).await[0];
    let (tx, mut rx) = mpsc::unbounded_channel::<&'static str>();
    let (ctx_tx, mut ctx_rx) = mpsc::unbounded_channel::<JobContext>();
    let mut cfg = fast_config("flaky-renewals");
    cfg.renew_every = Some(Duration::from_millis(10));
    cfg.concurrency = 1;
    cfg.batch = 1;
    let worker = Worker::new(worker_ferry(&t).await, cfg, move |_job: Claimed, ctx: JobContext| {
        let (tx, ctx_tx) = (tx.clone(), ctx_tx.clone());
        async move {
            let _guard = DropSignal(tx.clone());
            let reserved = ctx.reserve_effect("before", "psp.charge").await;
            assert!(matches!(reserved, Ok(ferry::Reservation::Proceed(_))), "{reserved:?}");
            let _ = ctx_tx.send(ctx.clone());
            let _ = tx.send("started");
            std::future::pending::<()>().await;
            Ok(json!({}))
        }
    });
    let stats = worker.stats();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(worker.run(async move {
        let _ = stop_rx.await;
    }));
    assert_eq!(rx.recv().await, Some("started"));
    let ctx = ctx_rx.recv().await.unwrap();
    let fault = RenewalFault::inject(&t).await;
    // The lease the worker knows ends at T0 + 30 s; renewals now fail.
    clock.advance(Duration::from_secs(30)).unwrap();
    // Bounded, so a handler that is never cancelled fails the test.
    let dropped = tokio::time::timeout(Duration::from_secs(30), rx.recv()).await;
    assert_eq!(
        dropped.ok().flatten(),
        Some("dropped"),
        "the handler is cancelled once its known lease expiry passes, though renewals only fail transiently"
    );
    // Nothing may be reserved or recorded under the abandoned attempt.
    let refused = ctx.reserve_effect("after", "psp.charge").await.unwrap_err();
    assert_eq!(refused.code(), "lost_lease", "{refused}");
    let refused = ctx
        .record_effect_success("before", "psp.charge", "ch_late")
        .await
        .unwrap_err();
    assert_eq!(refused.code(), "lost_lease", "{refused}");
    // Stop the worker while the fault still refuses its claims: once healed,
    // it could claim the expired job again and race the assertions below.
    stop_tx.send(()).unwrap();
    running.await.unwrap().unwrap();
    fault.heal().await;
    let refused = ctx.reserve_effect("after", "psp.charge").await.unwrap_err();
    assert_eq!(
        refused.code(),
        "lost_lease",
        "refused locally even once the database answers again"
    );
    assert_eq!(stats.lost.load(Ordering::SeqCst), 1);
    assert_eq!(stats.completed.load(Ordering::SeqCst), 0);
    let effects = t
        .scalar(
            "SELECT count(*) FROM effects WHERE step <> 'before' OR provider_ref IS NOT NULL OR state <> 'reserved'",
        )
        .await;
    assert_eq!(effects, 0, "nothing was recorded after the known expiry");
    assert_eq!(t.scalar("SELECT count(*) FROM effects").await, 1);
    assert_eq!(
        t.ferry.get_run("acme", id).await.unwrap().state,
        ferry::RunState::Queued,
        "recovered by lease expiry, like any vanished worker"
    );
}

#[derive(Debug, Deserialize)]
struct ChargeCommand {
    amount: u64,
    currency: String,
}

#[derive(Debug, Deserialize)]
struct RefundCommand {
    charge_id: String,
}

/// Accepts one run of `operation` on queue `q`.
async fn accept_op(t: &TestDb, operation: &str, key: &str, request: serde_json::Value) -> uuid::Uuid {
    let run = NewRun::new("acme", operation, key, request).queue("q");
    t.ferry.create_run_idempotent(run).await.unwrap().run.run_id
}

/// A router for `charge` and `refund` that counts its handler calls.
fn payments_router(calls: Arc<AtomicUsize>) -> Router {
    let refunds = calls.clone();
    Router::new()
        .route("charge", move |cmd: ChargeCommand, ctx: JobContext| {
            let calls = calls.clone();
            async move {
                calls.fetch_add(1, Ordering::SeqCst);
                Ok(json!({
                    "charged": cmd.amount * 100,
                    "currency": cmd.currency,
                    "run": ctx.run_id(),
                    "attempt": ctx.attempt(),
                    "operation": ctx.operation(),
                }))
            }
        })
        .route("refund", move |cmd: RefundCommand, ctx: JobContext| {
            let calls = refunds.clone();
            async move {
                calls.fetch_add(1, Ordering::SeqCst);
                Ok(json!({"refunded": cmd.charge_id, "generation": ctx.lease().generation}))
            }
        })
}

/// Runs a worker with `router` until every run of `ids` is terminal
/// (bounded), then shuts it down; returns its counters.
async fn run_router_until_terminal(t: &TestDb, router: Router, ids: &[uuid::Uuid]) -> Arc<WorkerStats> {
    let worker = Worker::new(t.ferry.clone(), fast_config("router"), router);
    let stats = worker.stats();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(worker.run(async move {
        let _ = stop_rx.await;
    }));
    for id in ids {
        until_terminal(t, *id).await;
    }
    stop_tx.send(()).unwrap();
    running.await.unwrap().unwrap();
    stats
}

/// Polls run `id` of `acme` until it ends (bounded) and returns its state.
async fn until_terminal(t: &TestDb, id: uuid::Uuid) -> RunState {
    tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let state = t.ferry.get_run("acme", id).await.unwrap().state;
            if state.is_terminal() {
                return state;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the routed run ends")
}

/// The body of the run's last event, which must be of `kind`.
async fn last_event(t: &TestDb, id: uuid::Uuid, kind: &str) -> serde_json::Value {
    let events = t.ferry.list_events("acme", id).await.unwrap();
    let last = events.last().expect("the run has events");
    assert_eq!(last.kind, kind, "{events:?}");
    last.body.clone()
}

/// A handler's follow-up run (`JobContext::enqueue_run`) is linked to its
/// parent, and a retried attempt replays it: one child per parent.
async fn a_handler_enqueues_one_follow_up_across_retries(kind: Kind) {
    let t = TestDb::new(kind).await;
    let order = accept_op(&t, "order", "k-order", json!({})).await;
    let router = Router::new().route("order", |_cmd: serde_json::Value, ctx: JobContext| async move {
        let ship = NewRun::new("acme", "ship", format!("ship-{}", ctx.run_id()), json!({})).queue("later");
        let child = ctx.enqueue_run(ship).await?;
        if ctx.attempt() == 1 {
            return Err(JobError::retryable("flaky"));
        }
        Ok(json!({ "child": child.run.run_id, "replay": child.replay }))
    });
    run_router_until_terminal(&t, router, &[order]).await;
    let lineage = t.ferry.operator().run_lineage("acme", order).await.unwrap();
    assert_eq!(lineage.run.state, RunState::Succeeded);
    assert_eq!(lineage.attempts.len(), 2);
    assert_eq!(lineage.children.len(), 1, "one child across two attempts");
    let child = &lineage.children[0];
    assert_eq!((child.operation.as_str(), child.parent_run_id), ("ship", Some(order)));
    let result = last_event(&t, order, "run_succeeded").await;
    assert_eq!(result["result"], json!({ "child": child.run_id, "replay": true }));
}

/// A run that died under a `Router` is replayed through the public API and
/// the same router, still running, completes the replay: the replay keeps
/// the operation its route matches (it used to run as `charge.replay` and
/// die again as `unknown_operation`).
async fn a_run_dead_under_a_router_replays_under_the_same_router(kind: Kind) {
    let t = TestDb::new(kind).await;
    let declined = Arc::new(AtomicBool::new(true));
    let card = declined.clone();
    let router = Router::new().route("charge", move |cmd: ChargeCommand, ctx: JobContext| {
        let declined = card.load(Ordering::SeqCst);
        async move {
            if declined {
                return Err(JobError::terminal("card_declined"));
            }
            Ok(json!({ "charged": cmd.amount, "replay_of": ctx.replay_of() }))
        }
    });
    let worker = Worker::new(t.ferry.clone(), fast_config("router"), router);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(worker.run(async move {
        let _ = stop_rx.await;
    }));
    let dead = accept_op(&t, "charge", "k-charge", json!({"amount": 7, "currency": "EUR"})).await;
    assert_eq!(until_terminal(&t, dead).await, RunState::Failed);
    assert_eq!(last_event(&t, dead, "run_failed").await["error_code"], "card_declined");
    declined.store(false, Ordering::SeqCst);
    let replay = t
        .ferry
        .operator()
        .replay_dead("acme", dead, "ops@example", "card updated", false)
        .await
        .unwrap()
        .run;
    let state = until_terminal(&t, replay.run_id).await;
    let events = t.ferry.list_events("acme", replay.run_id).await.unwrap();
    let last = events.last().map(|e| (e.kind.as_str(), e.body["error_code"].clone()));
    assert_eq!(state, RunState::Succeeded, "the replay ended with {last:?}");
    assert_eq!(replay.operation, "charge");
    assert_eq!(
        last_event(&t, replay.run_id, "run_succeeded").await["result"],
        json!({ "charged": 7, "replay_of": dead })
    );
    stop_tx.send(()).unwrap();
    running.await.unwrap().unwrap();
}

async fn router_runs_typed_commands_by_operation(kind: Kind) {
    let t = TestDb::new(kind).await;
    let charge = accept_op(&t, "charge", "k-charge", json!({"amount": 7, "currency": "EUR"})).await;
    let refund = accept_op(&t, "refund", "k-refund", json!({"charge_id": "ch_1"})).await;
    let calls = Arc::new(AtomicUsize::new(0));
    let stats = run_router_until_terminal(&t, payments_router(calls.clone()), &[charge, refund]).await;
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(stats.completed.load(Ordering::SeqCst), 2);
    assert_eq!(
        last_event(&t, charge, "run_succeeded").await["result"],
        json!({"charged": 700, "currency": "EUR", "run": charge, "attempt": 1, "operation": "charge"}),
        "the charge handler got its typed command and the job's facts"
    );
    assert_eq!(
        last_event(&t, refund, "run_succeeded").await["result"],
        json!({"refunded": "ch_1", "generation": 1})
    );
}

/// Runs one job through the payments router and checks that it died on its
/// first attempt with the terminal `code`, without calling a handler or
/// leaking the request into the stored failure.
async fn assert_dies_at_once(kind: Kind, operation: &str, request: serde_json::Value, code: &str) {
    let t = TestDb::new(kind).await;
    let id = accept_op(&t, operation, "k-bad", request).await;
    let calls = Arc::new(AtomicUsize::new(0));
    let stats = run_router_until_terminal(&t, payments_router(calls.clone()), &[id]).await;
    assert_eq!(calls.load(Ordering::SeqCst), 0, "no handler ran");
    assert_eq!(t.ferry.get_run("acme", id).await.unwrap().state, RunState::Failed);
    assert_eq!(stats.dead.load(Ordering::SeqCst), 1);
    assert_eq!(stats.retried.load(Ordering::SeqCst), 0, "retrying cannot help");
    let attempts = t.ferry.operator().list_attempts("acme", id).await.unwrap();
    assert_eq!(attempts.len(), 1, "one attempt only: {attempts:?}");
    assert_eq!(attempts[0].outcome.map(|o| o.as_str()), Some("dead"));
    assert_eq!(attempts[0].error_class.as_deref(), Some("terminal"));
    assert_eq!(attempts[0].error_code.as_deref(), Some(code));
    let body = last_event(&t, id, "run_failed").await;
    assert_eq!(body["error_code"], code, "{body}");
    assert_eq!(body["error_class"], "terminal", "{body}");
    assert_eq!(body["attempts"], 1, "{body}");
    assert!(!body.to_string().contains("4111"), "the payload leaked: {body}");
}

async fn router_kills_a_bad_command_after_one_attempt(kind: Kind) {
    // `amount` must be a number: the command does not deserialize.
    let request = json!({"amount": "4111-1111", "currency": "EUR"});
    assert_dies_at_once(kind, "charge", request, "invalid_command").await;
}

async fn router_kills_an_unknown_operation(kind: Kind) {
    let request = json!({"amount": 4111, "currency": "EUR"});
    assert_dies_at_once(kind, "chargeback", request, "unknown_operation").await;
}

/// A running worker whose handler answers job `i` = 0 at once (saying so on
/// `answered`) and job 1 only when `gate` is notified.
struct Gated {
    gate: Arc<tokio::sync::Notify>,
    answered: mpsc::UnboundedReceiver<()>,
    stop: tokio::sync::oneshot::Sender<()>,
    running: tokio::task::JoinHandle<ferry::Result<()>>,
    stats: Arc<WorkerStats>,
}

impl Gated {
    /// Starts a worker of `cfg` on `t`; job 1 answers successfully, or with
    /// a terminal error if `fail` is set.
    fn start(t: &TestDb, cfg: WorkerConfig, fail: bool) -> Gated {
        let gate = Arc::new(tokio::sync::Notify::new());
        let g = gate.clone();
        let (answered_tx, answered) = mpsc::unbounded_channel::<()>();
        let worker = Worker::new(t.ferry.clone(), cfg, move |job: Claimed, _ctx: JobContext| {
            let gate = g.clone();
            let answered_tx = answered_tx.clone();
            async move {
                if job.request["i"] != 1 {
                    let _ = answered_tx.send(());
                    return Ok(json!({}));
                }
                gate.notified().await;
                if fail {
                    return Err(JobError::terminal("refused"));
                }
                Ok(json!({}))
            }
        });
        let stats = worker.stats();
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let running = tokio::spawn(worker.run(async move {
            let _ = stop_rx.await;
        }));
        Gated {
            gate,
            answered,
            stop,
            running,
            stats,
        }
    }

    /// Stops the worker and returns its counters.
    async fn stop(self) -> Arc<WorkerStats> {
        self.stop.send(()).unwrap();
        self.running.await.unwrap().unwrap();
        self.stats
    }

    /// Waits (bounded by 20 s, a third of the window) until run `id` is
    /// `state`, stops the worker, and checks how many jobs it completed.
    async fn ends_soon(self, t: &TestDb, id: uuid::Uuid, state: RunState, completed: u64) {
        let ended = tokio::time::timeout(Duration::from_secs(20), until_terminal(t, id))
            .await
            .expect("the completion is committed without waiting for the window");
        assert_eq!(ended, state);
        let stats = self.stop().await;
        assert_eq!(stats.completed.load(Ordering::SeqCst), completed);
    }
}

/// Two slots claimed together, a 60 s completion window (a completion waits
/// for the other job of its claim), and a lease long enough for it.
fn waiting_config(owner: &str) -> WorkerConfig {
    WorkerConfig {
        concurrency: 2,
        batch: 2,
        completion_window: Duration::from_secs(60),
        lease: Duration::from_secs(600),
        ..fast_config(owner)
    }
}

/// Jobs claimed together whose handlers answer at different moments share
/// one completion statement: while a job claimed with a batch's job is
/// still to answer, the completer waits for it (up to the completion
/// window, 60 s here). Job 0 answers at once; job 1 is let go after the
/// first completion statement, or after two seconds if none came. The two
/// seconds are not a synchronisation: they give a completer that does not
/// wait the time to commit job 0 alone, which makes two statements and
/// fails the test.
async fn answers_of_one_claim_share_a_completion_statement(kind: Kind) {
    let t = TestDb::new(kind).await;
    let ids = accept(&t, 2).await;
    let mut w = Gated::start(&t, waiting_config("sharer"), false);
    w.answered.recv().await.unwrap();
    let alone = tokio::time::timeout(Duration::from_secs(2), async {
        while w.stats.completion_statements.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    w.gate.notify_one();
    for id in &ids {
        assert_eq!(until_terminal(&t, *id).await, RunState::Succeeded);
    }
    let stats = w.stop().await;
    assert!(alone.is_err(), "job 0 was completed before job 1 answered");
    assert_eq!(stats.completion_statements.load(Ordering::SeqCst), 1);
    assert_eq!(stats.completed.load(Ordering::SeqCst), 2);
}

/// The completion window never delays an answer when no other handler is
/// left to answer: with a 60 s window and two slots, a lone job completes
/// at once.
async fn a_last_answer_is_not_held_by_the_completion_window(kind: Kind) {
    let t = TestDb::new(kind).await;
    let ids = accept(&t, 1).await;
    let w = Gated::start(&t, waiting_config("lone"), false);
    w.ends_soon(&t, ids[0], RunState::Succeeded, 1).await;
}

/// A job that ends without a completion lets the waiting completions of its
/// claim go: job 0 answers and its completion waits for job 1 (60 s window);
/// job 1 then fails for good, and job 0 is committed at once.
async fn a_failed_job_lets_its_claim_s_completions_go(kind: Kind) {
    let t = TestDb::new(kind).await;
    let ids = accept(&t, 2).await;
    let mut w = Gated::start(&t, waiting_config("failer"), true);
    w.answered.recv().await.unwrap();
    w.gate.notify_one();
    assert_eq!(until_terminal(&t, ids[1]).await, RunState::Failed);
    w.ends_soon(&t, ids[0], RunState::Succeeded, 1).await;
}

/// Jobs of another claim never hold a completion: job 1 is claimed first and
/// stays running (gated); job 0, accepted after it, comes in a claim of its
/// own and is committed at once despite the 60 s window.
async fn a_running_job_of_another_claim_does_not_hold_a_completion(kind: Kind) {
    let t = TestDb::new(kind).await;
    let first = NewRun::new("acme", "work", "k-1", json!({"i": 1})).queue("q");
    let held = t.ferry.create_run_idempotent(first).await.unwrap().run.run_id;
    let w = Gated::start(&t, waiting_config("other"), false);
    tokio::time::timeout(Duration::from_secs(20), async {
        while t.scalar("SELECT count(*) FROM jobs WHERE state = 'leased'").await == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("job 1 is claimed");
    let second = NewRun::new("acme", "work", "k-0", json!({"i": 0})).queue("q");
    let id = t.ferry.create_run_idempotent(second).await.unwrap().run.run_id;
    let ended = tokio::time::timeout(Duration::from_secs(20), until_terminal(&t, id))
        .await
        .expect("job 0 is committed while job 1 of the other claim still runs");
    assert_eq!(ended, RunState::Succeeded);
    assert_eq!(t.ferry.get_run("acme", held).await.unwrap().state, RunState::Queued);
    w.gate.notify_one();
    w.ends_soon(&t, held, RunState::Succeeded, 2).await;
}

/// Shutdown's signal ends a completion's wait for the rest of its claim:
/// job 0 answers and its completion waits for job 1 (60 s window); the
/// worker is told to stop while job 1 still runs, and job 0 is committed
/// within 20 s, before the window or the 120 s grace period could have let
/// it go. Job 1, let go afterwards, still completes inside the grace period.
async fn shutdown_s_signal_ends_a_completion_window_wait(kind: Kind) {
    let t = TestDb::new(kind).await;
    let ids = accept(&t, 2).await;
    let cfg = WorkerConfig {
        grace: Duration::from_secs(120),
        ..waiting_config("leaver")
    };
    let mut w = Gated::start(&t, cfg, false);
    w.answered.recv().await.unwrap();
    w.stop.send(()).unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(20), until_terminal(&t, ids[0]))
        .await
        .expect("job 0 is committed once shutdown is signalled");
    assert_eq!(ended, RunState::Succeeded);
    assert_eq!(t.ferry.get_run("acme", ids[1]).await.unwrap().state, RunState::Queued);
    w.gate.notify_one();
    w.running.await.unwrap().unwrap();
    assert_eq!(until_terminal(&t, ids[1]).await, RunState::Succeeded);
    assert_eq!(w.stats.completed.load(Ordering::SeqCst), 2);
}

/// A completion window of half the lease left after a renewal period or
/// more is refused before anything is claimed (a finished job's lease is not
/// renewed while its completion waits), and so is a renewal period that is
/// not shorter than the lease.
async fn a_completion_window_near_the_lease_is_refused(kind: Kind) {
    let t = TestDb::new(kind).await;
    let ids = accept(&t, 1).await;
    let s = Duration::from_secs;
    // The defaults leave (30 - 10) / 2 = 10 s; a 27 s renewal period 1.5 s.
    // A renewal period of the whole lease is refused for itself, whatever
    // the window (zero here).
    let cases = [
        (s(10), None, "completion_window"),
        (Duration::MAX, None, "completion_window"),
        (s(2), Some(s(27)), "completion_window"),
        (Duration::ZERO, Some(s(30)), "renew_every"),
    ];
    for (window, renew_every, blamed) in cases {
        let cfg = WorkerConfig {
            completion_window: window,
            lease: s(30),
            renew_every,
            ..fast_config("refused")
        };
        let worker = Worker::new(t.ferry.clone(), cfg, |_job: Claimed, _ctx: JobContext| async {
            Ok(json!({}))
        });
        let err = worker.run(std::future::pending()).await.unwrap_err();
        assert_eq!(err.code(), "config", "{err}");
        assert!(err.to_string().contains(blamed), "{err}");
    }
    assert_eq!(t.ferry.get_run("acme", ids[0]).await.unwrap().state, RunState::Queued);
}

on_every_route!(
    worker_completes_and_retries,
    lost_lease_and_cancellation_stop_the_handler,
    shutdown_releases_only_owned_jobs,
    released_jobs_are_drained_by_the_next_worker,
    failing_renewals_cancel_the_handler_at_the_known_expiry,
    router_runs_typed_commands_by_operation,
    router_kills_a_bad_command_after_one_attempt,
    router_kills_an_unknown_operation,
    a_run_dead_under_a_router_replays_under_the_same_router,
    a_handler_enqueues_one_follow_up_across_retries,
    answers_of_one_claim_share_a_completion_statement,
    a_last_answer_is_not_held_by_the_completion_window,
    a_failed_job_lets_its_claim_s_completions_go,
    a_running_job_of_another_claim_does_not_hold_a_completion,
    shutdown_s_signal_ends_a_completion_window_wait,
    a_completion_window_near_the_lease_is_refused,
);
