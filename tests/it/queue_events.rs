//! A queue whose owner turned `publish_events` off (issue #21): on both
//! engines, every path that writes a run event (single and bulk acceptance,
//! completion one by one and in batches, failure, cancellation, expiry,
//! replay, a service's own event) still writes the event and writes no
//! outbox row for it, while a queue with the setting on (explicitly, or by
//! default with no settings row) writes both. Queue `quiet` has it off,
//! `loud` on, `plain` has no row; each scenario's runs of queue `q` belong
//! to tenant `q`, so the rows are counted per tenant.

use std::time::Duration;

use ferry::{JobError, NewRun, RetryPolicy};
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde_json::json;

use crate::support::{manual_clock, on_every_route, Kind, TestDb};

const LEASE: Duration = Duration::from_secs(30);
const QUEUES: [&str; 2] = ["quiet", "loud"];

/// A run of tenant and queue `queue`.
fn run(queue: &str, key: &str) -> NewRun {
    NewRun::new(queue, "work", key, json!({"key": key})).queue(queue)
}

/// A database on a manual clock where `quiet` has publish_events off and
/// `loud` has it on.
async fn setup(kind: Kind) -> TestDb {
    let t = TestDb::with_clock(kind, manual_clock()).await;
    let operator = t.ferry.operator();
    operator
        .set_queue_publish_events("quiet", false, "alice", "internal queue")
        .await
        .unwrap();
    operator
        .set_queue_publish_events("loud", true, "alice", "consumers need it")
        .await
        .unwrap();
    t
}

/// (run events, outbox rows) of tenant `tenant`.
async fn written(t: &TestDb, tenant: &str) -> (i64, i64) {
    (
        t.scalar(&format!("SELECT count(*) FROM run_events WHERE tenant = '{tenant}'"))
            .await,
        t.scalar(&format!("SELECT count(*) FROM outbox WHERE tenant = '{tenant}'"))
            .await,
    )
}

/// `quiet` has `events` run events and no outbox row; `loud` has `events`
/// of each.
async fn assert_written(t: &TestDb, events: i64, path: &str) {
    assert_eq!(written(t, "quiet").await, (events, 0), "{path}: quiet queue");
    assert_eq!(written(t, "loud").await, (events, events), "{path}: loud queue");
}

async fn single_acceptance_writes_no_outbox_row_for_a_quiet_queue(kind: Kind) {
    let t = setup(kind).await;
    for q in QUEUES.into_iter().chain(["plain"]) {
        t.ferry.create_run_idempotent(run(q, "k")).await.unwrap();
    }
    assert_written(&t, 1, "single acceptance").await;
    assert_eq!(written(&t, "plain").await, (1, 1), "no settings row: published");
}

async fn bulk_acceptance_writes_no_outbox_row_for_a_quiet_queue(kind: Kind) {
    let t = setup(kind).await;
    // One call mixing the queues, as a caller's batch would.
    let batch: Vec<NewRun> = (0..3)
        .flat_map(|i| QUEUES.map(|q| run(q, &format!("k{i}"))))
        .chain([run("plain", "k")])
        .collect();
    for r in t.ferry.create_runs_idempotent(batch).await.unwrap() {
        r.unwrap();
    }
    assert_written(&t, 3, "bulk acceptance").await;
    assert_eq!(written(&t, "plain").await, (1, 1), "no settings row: published");
}

async fn completion_writes_no_outbox_row_for_a_quiet_queue(kind: Kind) {
    let t = setup(kind).await;
    let jobs = t.ferry.jobs();
    for q in QUEUES {
        t.ferry.create_run_idempotent(run(q, "k")).await.unwrap();
        let held = jobs.claim(q, "w", LEASE, 1).await.unwrap();
        jobs.complete(&held[0].lease, &json!({"ok": true})).await.unwrap();
    }
    assert_written(&t, 2, "complete").await;
}

async fn batch_completion_writes_no_outbox_row_for_a_quiet_queue(kind: Kind) {
    let t = setup(kind).await;
    let jobs = t.ferry.jobs();
    for q in QUEUES {
        for i in 0..4 {
            t.ferry.create_run_idempotent(run(q, &format!("k{i}"))).await.unwrap();
        }
        let held = jobs.claim(q, "w", LEASE, 4).await.unwrap();
        let items: Vec<_> = held.iter().map(|c| (c.lease.clone(), json!({}))).collect();
        // Two through complete_batch, two through complete_and_claim.
        for r in jobs.complete_batch(&items[..2]).await.unwrap() {
            r.unwrap();
        }
        let (done, next) = jobs.complete_and_claim(&items[2..], q, "w", LEASE, 5).await.unwrap();
        assert!(done.iter().all(Result::is_ok) && next.is_empty());
    }
    assert_written(&t, 8, "complete_batch and complete_and_claim").await;
}

async fn failure_and_expiry_write_no_outbox_row_for_a_quiet_queue(kind: Kind) {
    let t = setup(kind).await;
    let jobs = t.ferry.jobs();
    let policy = RetryPolicy::default();
    let mut rng = StdRng::seed_from_u64(7);
    for q in QUEUES {
        // A retry (no event), then a terminal failure: run_failed.
        t.ferry.create_run_idempotent(run(q, "fails")).await.unwrap();
        let held = jobs.claim(q, "w", LEASE, 1).await.unwrap();
        jobs.fail(&held[0].lease, &JobError::retryable("timeout"), &policy, &mut rng)
            .await
            .unwrap();
        // Past the first retry's backoff (at most 1 s and 30 s of jitter).
        t.ferry.clock().advance(Duration::from_secs(60)).unwrap();
        let held = jobs.claim(q, "w", LEASE, 1).await.unwrap();
        jobs.fail(&held[0].lease, &JobError::terminal("declined"), &policy, &mut rng)
            .await
            .unwrap();
    }
    assert_written(&t, 2, "fail").await;
    for q in QUEUES {
        // A last attempt whose lease expires: reaped, run_failed.
        t.ferry
            .create_run_idempotent(run(q, "expires").max_attempts(1))
            .await
            .unwrap();
        assert_eq!(jobs.claim(q, "w", LEASE, 1).await.unwrap().len(), 1);
    }
    t.ferry.clock().advance(LEASE * 2).unwrap();
    for q in QUEUES {
        assert_eq!(jobs.reap_exhausted(q, 10).await.unwrap(), 1);
    }
    assert_written(&t, 4, "fail and reap_exhausted").await;
}

async fn cancel_replay_and_own_events_write_no_outbox_row_for_a_quiet_queue(kind: Kind) {
    let t = setup(kind).await;
    let jobs = t.ferry.jobs();
    let policy = RetryPolicy::default();
    let mut rng = StdRng::seed_from_u64(7);
    for q in QUEUES {
        let cancelled = t.ferry.create_run_idempotent(run(q, "cancelled")).await.unwrap();
        t.ferry
            .append_event(q, cancelled.run.run_id, "progress", &json!({"done": 1}))
            .await
            .unwrap();
        t.ferry
            .cancel(q, cancelled.run.run_id, None, "alice", "not needed")
            .await
            .unwrap();
        let dead = t.ferry.create_run_idempotent(run(q, "dead")).await.unwrap();
        let held = jobs.claim(q, "w", LEASE, 1).await.unwrap();
        jobs.fail(&held[0].lease, &JobError::terminal("declined"), &policy, &mut rng)
            .await
            .unwrap();
        // replay_requested on the dead run, run_queued on the new one.
        t.ferry
            .operator()
            .replay_dead(q, dead.run.run_id, "alice", "fixed", false)
            .await
            .unwrap();
    }
    // cancelled: queued, progress, cancelled; dead: queued, failed,
    // replay_requested; the replay: queued.
    assert_written(&t, 7, "append_event, cancel, replay_dead").await;
}

async fn each_event_follows_the_setting_when_it_is_written(kind: Kind) {
    let t = TestDb::with_clock(kind, manual_clock()).await;
    let operator = t.ferry.operator();
    let jobs = t.ferry.jobs();
    // Accepted while on, finished after it was turned off.
    t.ferry.create_run_idempotent(run("quiet", "k")).await.unwrap();
    let held = jobs.claim("quiet", "w", LEASE, 1).await.unwrap();
    operator
        .set_queue_publish_events("quiet", false, "alice", "internal now")
        .await
        .unwrap();
    jobs.complete(&held[0].lease, &json!({})).await.unwrap();
    assert_eq!(
        written(&t, "quiet").await,
        (2, 1),
        "run_queued published, run_succeeded not"
    );
    operator
        .set_queue_publish_events("quiet", true, "bob", "a consumer again")
        .await
        .unwrap();
    t.ferry.create_run_idempotent(run("quiet", "k2")).await.unwrap();
    assert_eq!(written(&t, "quiet").await, (3, 2), "published again");
    let listed = operator.list_queues().await.unwrap();
    assert_eq!(
        listed
            .iter()
            .map(|q| (q.queue.as_str(), q.publish_events, q.paused))
            .collect::<Vec<_>>(),
        [("quiet", true, false)]
    );
    assert_eq!(
        t.scalar("SELECT count(*) FROM ferry_audit WHERE action = 'queue.publish_events'")
            .await,
        2
    );
}

async fn a_bad_publish_events_request_is_refused_and_writes_nothing(kind: Kind) {
    let t = TestDb::with_clock(kind, manual_clock()).await;
    let operator = t.ferry.operator();
    for (queue, actor, reason) in [
        ("bad queue", "alice", "why"),
        ("", "alice", "why"),
        ("quiet", "", "why"),
        ("quiet", "alice", ""),
    ] {
        let err = operator
            .set_queue_publish_events(queue, false, actor, reason)
            .await
            .unwrap_err();
        assert_eq!(err.code(), "invalid_input", "{queue:?} {actor:?} {reason:?}: {err}");
        // As pause_queue refuses the same input.
        let paused = operator.pause_queue(queue, actor, reason).await.unwrap_err();
        assert_eq!(paused.code(), "invalid_input");
    }
    assert_eq!(t.scalar("SELECT count(*) FROM ferry_queues").await, 0);
    assert_eq!(t.scalar("SELECT count(*) FROM ferry_audit").await, 0);
}

on_every_route!(
    single_acceptance_writes_no_outbox_row_for_a_quiet_queue,
    bulk_acceptance_writes_no_outbox_row_for_a_quiet_queue,
    completion_writes_no_outbox_row_for_a_quiet_queue,
    batch_completion_writes_no_outbox_row_for_a_quiet_queue,
    failure_and_expiry_write_no_outbox_row_for_a_quiet_queue,
    cancel_replay_and_own_events_write_no_outbox_row_for_a_quiet_queue,
    each_event_follows_the_setting_when_it_is_written,
    a_bad_publish_events_request_is_refused_and_writes_nothing,
);
