//! Scheduled runs (`NewRun::run_at`, `NewRun::delay`) and parent runs
//! (`NewRun::parent`) on both engines, on the single and the bulk
//! acceptance paths, with an injected clock.

use std::time::Duration;

use ferry::{Error, Millis, NewRun, RunState};
use serde_json::json;

use crate::support::{manual_clock, on_every_route, Kind, TestDb, T0};

const LEASE: Duration = Duration::from_secs(30);

fn at(ms: i64) -> Millis {
    Millis::new(ms).unwrap()
}

fn job(key: &str) -> NewRun {
    NewRun::new("acme", "report", key, json!({"n": 1})).queue("later")
}

async fn claimable(t: &TestDb) -> usize {
    let got = t.ferry.jobs().claim("later", "w", LEASE, 10).await.unwrap();
    got.len()
}

async fn a_scheduled_run_is_claimable_from_run_at_and_not_before(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    let run = t
        .ferry
        .create_run_idempotent(job("k").run_at(at(T0 + 60_000)))
        .await
        .unwrap()
        .run;
    assert_eq!(run.state, RunState::Queued);
    assert_eq!(run.scheduled_at, Some(at(T0 + 60_000)));
    assert_eq!(t.ferry.get_run("acme", run.run_id).await.unwrap(), run);
    let queued = t.ferry.list_events("acme", run.run_id).await.unwrap();
    assert_eq!(
        queued[0].body["scheduled_at"],
        json!(T0 + 60_000),
        "run_queued carries the schedule"
    );
    assert_eq!(claimable(&t).await, 0, "not before run_at");
    clock.advance(Duration::from_millis(59_999)).unwrap();
    assert_eq!(claimable(&t).await, 0, "not 1 ms before run_at");
    clock.advance(Duration::from_millis(1)).unwrap();
    let got = t.ferry.jobs().claim("later", "w", LEASE, 10).await.unwrap();
    assert_eq!(got.len(), 1, "claimable at run_at");
    assert_eq!(got[0].lease.run_id, run.run_id);
}

async fn a_delay_counts_from_acceptance_and_a_past_run_at_starts_at_once(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    let delayed = t
        .ferry
        .create_run_idempotent(job("d").delay(Duration::from_secs(5)))
        .await
        .unwrap()
        .run;
    assert_eq!(delayed.scheduled_at, Some(at(T0 + 5_000)));
    // The deadline counts from the start, not from acceptance.
    let past = t
        .ferry
        .create_run_idempotent(job("p").run_at(at(T0 - 1_000)).deadline(Duration::from_secs(1)))
        .await
        .unwrap()
        .run;
    assert_eq!(past.scheduled_at, Some(at(T0 - 1_000)), "the instant asked for is kept");
    assert_eq!(past.deadline_at, Some(at(T0 + 1_000)), "deadline from max(now, run_at)");
    let got = t.ferry.jobs().claim("later", "w", LEASE, 10).await.unwrap();
    assert_eq!(got.len(), 1, "a past run_at is claimable at once");
    assert_eq!(got[0].lease.run_id, past.run_id);
    clock.advance(Duration::from_secs(5)).unwrap();
    let got = t.ferry.jobs().claim("later", "w", LEASE, 10).await.unwrap();
    assert_eq!(
        got.iter().map(|c| c.lease.run_id).collect::<Vec<_>>(),
        vec![delayed.run_id]
    );
    let scheduled_deadline = t
        .ferry
        .create_run_idempotent(
            job("s")
                .delay(Duration::from_secs(3600))
                .deadline(Duration::from_secs(60)),
        )
        .await
        .unwrap()
        .run;
    assert_eq!(
        scheduled_deadline.deadline_at,
        Some(at(T0 + 5_000 + 3_600_000 + 60_000))
    );
}

async fn a_scheduled_run_cancels_like_any_queued_run(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    let run = t
        .ferry
        .create_run_idempotent(job("k").delay(Duration::from_secs(60)))
        .await
        .unwrap()
        .run;
    t.ferry
        .cancel("acme", run.run_id, Some(run.version), "ops", "not needed")
        .await
        .unwrap();
    assert_eq!(
        t.ferry.get_run("acme", run.run_id).await.unwrap().state,
        RunState::Cancelled
    );
    clock.advance(Duration::from_secs(120)).unwrap();
    assert_eq!(
        claimable(&t).await,
        0,
        "a cancelled scheduled run never becomes claimable"
    );
}

async fn a_retry_with_another_start_replays_the_first(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    let first = t
        .ferry
        .create_run_idempotent(job("k").run_at(at(T0 + 60_000)))
        .await
        .unwrap();
    clock.advance(Duration::from_secs(2)).unwrap();
    let again = t
        .ferry
        .create_run_idempotent(job("k").run_at(at(T0 + 62_000)))
        .await
        .unwrap();
    assert!(again.replay, "the start is not part of the fingerprint");
    assert_eq!(again.run, first.run);
    assert_eq!(
        again.run.scheduled_at,
        Some(at(T0 + 60_000)),
        "the first schedule stands"
    );
    let unscheduled = t.ferry.create_run_idempotent(job("k")).await.unwrap();
    assert!(unscheduled.replay);
    let conflict = t
        .ferry
        .create_run_idempotent(NewRun::new("acme", "report", "k", json!({"n": 2})).queue("later"))
        .await
        .unwrap_err();
    assert_eq!(conflict.code(), "idempotency_conflict");
}

async fn a_parent_is_recorded_and_must_exist(kind: Kind) {
    let t = TestDb::with_clock(kind, manual_clock()).await;
    let parent = t.ferry.create_run_idempotent(job("parent")).await.unwrap().run;
    let child = t
        .ferry
        .create_run_idempotent(job("child").parent(parent.run_id))
        .await
        .unwrap()
        .run;
    assert_eq!(child.parent_run_id, Some(parent.run_id));
    assert_eq!(
        t.ferry.get_run("acme", child.run_id).await.unwrap().parent_run_id,
        Some(parent.run_id)
    );
    let queued = t.ferry.list_events("acme", child.run_id).await.unwrap();
    assert_eq!(queued[0].body["parent_run_id"], json!(parent.run_id));
    let runs_before = t.scalar("SELECT COUNT(*) FROM runs").await;
    let outbox_before = t.scalar("SELECT COUNT(*) FROM outbox").await;
    let missing = t
        .ferry
        .create_run_idempotent(job("orphan").parent(uuid::Uuid::now_v7()))
        .await
        .unwrap_err();
    assert!(matches!(missing, Error::NotFound { what: "parent run" }), "{missing}");
    // Another tenant's run is no parent.
    let foreign = t
        .ferry
        .create_run_idempotent(NewRun::new("other", "report", "x", json!({})).parent(parent.run_id))
        .await
        .unwrap_err();
    assert_eq!(foreign.code(), "not_found");
    assert_eq!(
        t.scalar("SELECT COUNT(*) FROM runs").await,
        runs_before,
        "nothing written"
    );
    assert_eq!(
        t.scalar("SELECT COUNT(*) FROM outbox").await,
        outbox_before,
        "nothing written"
    );
    assert_eq!(
        t.scalar("SELECT COUNT(*) FROM idempotency_keys").await,
        2,
        "no key claimed"
    );
}

/// The bulk path (set-based on PostgreSQL) stores what the single call
/// stores: schedule, availability, parent, and the same run_queued bytes.
async fn bulk_acceptance_schedules_and_links_like_the_single_call(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    let parent = t.ferry.create_run_idempotent(job("parent")).await.unwrap().run;
    let single = t
        .ferry
        .create_run_idempotent(job("single").delay(Duration::from_secs(60)).parent(parent.run_id))
        .await
        .unwrap()
        .run;
    let results = t
        .ferry
        .create_runs_idempotent(vec![
            job("bulk").delay(Duration::from_secs(60)).parent(parent.run_id),
            job("orphan").parent(uuid::Uuid::now_v7()),
            job("now"),
        ])
        .await
        .unwrap();
    let bulk = results[0].as_ref().unwrap().run.clone();
    assert!(
        matches!(results[1], Err(Error::NotFound { what: "parent run" })),
        "{:?}",
        results[1]
    );
    assert!(results[2].is_ok(), "the others proceed");
    assert_eq!(bulk.scheduled_at, Some(at(T0 + 60_000)));
    assert_eq!(bulk.parent_run_id, Some(parent.run_id));
    assert_eq!(t.ferry.get_run("acme", bulk.run_id).await.unwrap(), bulk);
    let single_event = t.ferry.list_events("acme", single.run_id).await.unwrap().remove(0).body;
    let bulk_event = t.ferry.list_events("acme", bulk.run_id).await.unwrap().remove(0).body;
    assert_eq!(single_event, bulk_event, "both paths write one event body");
    let payload_len = |id: uuid::Uuid| format!("SELECT CAST(length(payload) AS BIGINT) FROM outbox WHERE key = '{id}'");
    assert_eq!(
        t.scalar(&payload_len(single.run_id)).await,
        t.scalar(&payload_len(bulk.run_id)).await,
        "both paths write the same run_queued record (up to the run id)"
    );
    // Only the unscheduled bulk item and the parent are claimable now.
    let got = t.ferry.jobs().claim("later", "w", LEASE, 10).await.unwrap();
    assert_eq!(got.len(), 2);
    assert!(got
        .iter()
        .all(|c| c.lease.run_id != bulk.run_id && c.lease.run_id != single.run_id));
    clock.advance(Duration::from_secs(60)).unwrap();
    let got: Vec<_> = t
        .ferry
        .jobs()
        .claim("later", "w", LEASE, 10)
        .await
        .unwrap()
        .into_iter()
        .map(|c| c.lease.run_id)
        .collect();
    assert!(
        got.contains(&bulk.run_id) && got.contains(&single.run_id),
        "both scheduled runs become claimable at their start"
    );
}

/// A batch whose item names as parent a run id another item proposes is
/// decided in order, as one call after another would: the parent exists
/// once the earlier item is accepted.
async fn a_batch_can_chain_a_child_to_an_earlier_item(kind: Kind) {
    let t = TestDb::with_clock(kind, manual_clock()).await;
    let parent_id = uuid::Uuid::now_v7();
    let results = t
        .ferry
        .create_runs_idempotent(vec![
            job("child-first").parent(parent_id),
            job("parent").run_id(parent_id),
            job("child").parent(parent_id),
        ])
        .await
        .unwrap();
    assert!(
        matches!(results[0], Err(Error::NotFound { what: "parent run" })),
        "{:?}",
        results[0]
    );
    assert_eq!(results[1].as_ref().unwrap().run.run_id, parent_id);
    assert_eq!(results[2].as_ref().unwrap().run.parent_run_id, Some(parent_id));
}

on_every_route!(
    a_batch_can_chain_a_child_to_an_earlier_item,
    a_scheduled_run_is_claimable_from_run_at_and_not_before,
    a_delay_counts_from_acceptance_and_a_past_run_at_starts_at_once,
    a_scheduled_run_cancels_like_any_queued_run,
    a_retry_with_another_start_replays_the_first,
    a_parent_is_recorded_and_must_exist,
    bulk_acceptance_schedules_and_links_like_the_single_call,
);
