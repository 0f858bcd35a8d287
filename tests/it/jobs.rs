//! Leases, fencing, retries, dead jobs, cancellation and the effect ledger
//! on both engines, with an injected clock: no sleeping.

use std::time::Duration;

use ferry::jobs::FailOutcome;
use ferry::{Error, JobError, NewRun, Reservation, Resolution, RetryPolicy, RunState};
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde_json::json;

use crate::support::{manual_clock, on_every_route, Kind, TestDb, T0};

const LEASE: Duration = Duration::from_secs(30);

fn job(key: &str) -> NewRun {
    NewRun::new("acme", "charge", key, json!({"amount": 5}))
        .queue("payments")
        .max_attempts(3)
}

async fn terminal_events(t: &TestDb) -> Vec<String> {
    let sql =
        "SELECT kind FROM run_events WHERE kind IN ('run_succeeded', 'run_failed', 'run_cancelled') ORDER BY kind";
    match t.ferry.db() {
        ferry::Db::Postgres(p) => sqlx::query_scalar(sql).fetch_all(p).await.unwrap(),
        ferry::Db::Sqlite(p) => sqlx::query_scalar(sql).fetch_all(p).await.unwrap(),
    }
}

async fn expired_lease_recovery_and_stale_fencing(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    let run = t.ferry.create_run_idempotent(job("k")).await.unwrap().run;
    let a = t
        .ferry
        .jobs()
        .claim("payments", "worker-a", LEASE, 10)
        .await
        .unwrap()
        .pop()
        .unwrap();
    assert_eq!((a.lease.generation, a.attempt), (1, 1));
    assert_eq!(a.request, json!({"amount": 5}));
    assert!(
        t.ferry
            .jobs()
            .claim("payments", "worker-b", LEASE, 10)
            .await
            .unwrap()
            .is_empty(),
        "a live lease is not claimable"
    );
    // Worker A pauses; the clock passes its expiry; B takes generation 2.
    clock.advance(LEASE + Duration::from_millis(1)).unwrap();
    let b = t
        .ferry
        .jobs()
        .claim("payments", "worker-b", LEASE, 10)
        .await
        .unwrap()
        .pop()
        .unwrap();
    assert_eq!((b.lease.generation, b.attempt), (2, 2));
    // Every write of A's is refused.
    let policy = RetryPolicy::default();
    let mut rng = StdRng::seed_from_u64(1);
    let errs = [
        t.ferry.jobs().renew(&a.lease, LEASE).await.unwrap_err(),
        t.ferry
            .jobs()
            .complete(&a.lease, &json!({"by": "a"}))
            .await
            .unwrap_err(),
        t.ferry
            .jobs()
            .fail(&a.lease, &JobError::retryable("timeout"), &policy, &mut rng)
            .await
            .unwrap_err(),
        t.ferry
            .jobs()
            .reserve_effect(&a.lease, "pay", "psp.charge")
            .await
            .unwrap_err(),
        t.ferry.jobs().release(&a.lease).await.unwrap_err(),
    ];
    for e in &errs {
        assert_eq!(e.code(), "lost_lease", "{e}");
    }
    t.ferry.jobs().complete(&b.lease, &json!({"by": "b"})).await.unwrap();
    assert_eq!(
        t.ferry
            .jobs()
            .complete(&a.lease, &json!({"by": "a"}))
            .await
            .unwrap_err()
            .code(),
        "lost_lease"
    );
    assert_eq!(terminal_events(&t).await, vec!["run_succeeded"]);
    let events = t.ferry.list_events("acme", run.run_id).await.unwrap();
    assert_eq!(events.last().unwrap().body, json!({"result": {"by": "b"}}));
    let history = t.ferry.operator().list_attempts("acme", run.run_id).await.unwrap();
    assert_eq!(history.len(), 2);
    assert_eq!(
        (history[0].outcome.map(|o| o.as_str()), history[0].worker.as_str()),
        (Some("lost"), "worker-a")
    );
    assert_eq!(
        (history[1].outcome.map(|o| o.as_str()), history[1].generation),
        (Some("succeeded"), 2)
    );
    assert_eq!(
        t.ferry.get_run("acme", run.run_id).await.unwrap().state,
        RunState::Succeeded
    );
}

async fn renewal_extends_only_a_live_lease(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    t.ferry.create_run_idempotent(job("k")).await.unwrap();
    let c = t
        .ferry
        .jobs()
        .claim("payments", "w", LEASE, 1)
        .await
        .unwrap()
        .pop()
        .unwrap();
    assert_eq!(c.lease_expires_at.get(), T0 + 30_000);
    clock.advance(Duration::from_secs(20)).unwrap();
    assert_eq!(t.ferry.jobs().renew(&c.lease, LEASE).await.unwrap().get(), T0 + 50_000);
    clock.advance(Duration::from_secs(29)).unwrap();
    assert!(
        t.ferry
            .jobs()
            .claim("payments", "other", LEASE, 1)
            .await
            .unwrap()
            .is_empty(),
        "the renewed lease still holds"
    );
    clock.advance(Duration::from_secs(2)).unwrap();
    assert_eq!(
        t.ferry.jobs().renew(&c.lease, LEASE).await.unwrap_err().code(),
        "lost_lease"
    );

    // A deadline caps renewals, and past it the job is terminalized.
    t.ferry
        .create_run_idempotent(job("d").deadline(Duration::from_secs(45)))
        .await
        .unwrap();
    let d = t.ferry.jobs().claim("payments", "w", LEASE, 10).await.unwrap();
    let d = d.into_iter().find(|x| x.deadline_at.is_some()).unwrap();
    clock.advance(Duration::from_secs(20)).unwrap();
    assert_eq!(
        t.ferry.jobs().renew(&d.lease, LEASE).await.unwrap(),
        d.deadline_at.unwrap(),
        "never past the deadline"
    );
    clock.advance(Duration::from_secs(30)).unwrap();
    assert_eq!(
        t.ferry.jobs().renew(&d.lease, LEASE).await.unwrap_err().code(),
        "deadline_exceeded"
    );
    assert!(t
        .ferry
        .jobs()
        .claim("payments", "x", LEASE, 10)
        .await
        .unwrap()
        .iter()
        .all(|x| x.lease.run_id != d.lease.run_id));
    assert!(t.ferry.jobs().reap_exhausted("payments", 10).await.unwrap() >= 1);
    let dead = t
        .ferry
        .operator()
        .list_dead("acme", Some("deadline_exceeded"), 10)
        .await
        .unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(
        t.ferry.get_run("acme", d.lease.run_id).await.unwrap().state,
        RunState::Failed
    );
}

async fn retry_schedule_is_exact_and_the_budget_terminalizes(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    let run = t.ferry.create_run_idempotent(job("k")).await.unwrap().run;
    let policy = RetryPolicy::default();
    let mut rng = StdRng::seed_from_u64(42);
    let mut expected_rng = StdRng::seed_from_u64(42);
    let mut now = T0;
    for attempt in 1..=3u32 {
        let c = t
            .ferry
            .jobs()
            .claim("payments", "w", LEASE, 1)
            .await
            .unwrap()
            .pop()
            .expect("claimable when due");
        assert_eq!(c.attempt as u32, attempt);
        let out = t
            .ferry
            .jobs()
            .fail(&c.lease, &JobError::retryable("psp_timeout"), &policy, &mut rng)
            .await
            .unwrap();
        if attempt < 3 {
            let delay = policy.delay(attempt, None, &mut expected_rng);
            let at = now + delay.as_millis() as i64;
            assert_eq!(
                out,
                FailOutcome::Retried {
                    available_at: ferry::Millis::new(at).unwrap()
                }
            );
            assert_eq!(
                t.scalar("SELECT available_at FROM jobs").await,
                at,
                "the schedule is persisted"
            );
            clock.advance(delay - Duration::from_millis(1)).unwrap();
            assert!(
                t.ferry
                    .jobs()
                    .claim("payments", "w", LEASE, 1)
                    .await
                    .unwrap()
                    .is_empty(),
                "not before its time"
            );
            clock.advance(Duration::from_millis(1)).unwrap();
            now = at;
        } else {
            assert_eq!(
                out,
                FailOutcome::Dead {
                    code: "psp_timeout".into()
                },
                "dead exactly at max_attempts"
            );
        }
    }
    assert_eq!(
        t.ferry.get_run("acme", run.run_id).await.unwrap().state,
        RunState::Failed
    );
    let last = t.ferry.list_events("acme", run.run_id).await.unwrap().pop().unwrap();
    assert_eq!(last.kind, "run_failed");
    assert_eq!(last.body["error_code"], "psp_timeout");
    let outcomes: Vec<_> = t
        .ferry
        .operator()
        .list_attempts("acme", run.run_id)
        .await
        .unwrap()
        .into_iter()
        .map(|a| a.outcome.unwrap().as_str().to_owned())
        .collect();
    assert_eq!(outcomes, ["retried", "retried", "dead"]);
    assert_eq!(
        t.scalar(&format!(
            "SELECT count(*) FROM outbox WHERE effect_key = 'acme/{}/2'",
            run.run_id
        ))
        .await,
        1,
        "the run_failed event has its outbox row"
    );

    // Terminal errors go dead at once; Retry-After is honoured.
    let run2 = t.ferry.create_run_idempotent(job("k2")).await.unwrap().run;
    let c = t
        .ferry
        .jobs()
        .claim("payments", "w", LEASE, 1)
        .await
        .unwrap()
        .pop()
        .unwrap();
    let out = t
        .ferry
        .jobs()
        .fail(&c.lease, &JobError::terminal("card_declined"), &policy, &mut rng)
        .await
        .unwrap();
    assert_eq!(
        out,
        FailOutcome::Dead {
            code: "card_declined".into()
        }
    );
    assert_eq!(
        t.ferry.get_run("acme", run2.run_id).await.unwrap().state,
        RunState::Failed
    );
    t.ferry.create_run_idempotent(job("k3")).await.unwrap();
    let c = t
        .ferry
        .jobs()
        .claim("payments", "w", LEASE, 1)
        .await
        .unwrap()
        .pop()
        .unwrap();
    let hint = JobError::retryable("rate_limited").retry_after(Duration::from_secs(600));
    match t.ferry.jobs().fail(&c.lease, &hint, &policy, &mut rng).await.unwrap() {
        FailOutcome::Retried { available_at } => assert!(available_at.get() >= c.claimed_at.get() + 600_000),
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(terminal_events(&t).await, vec!["run_failed", "run_failed"]);
}

async fn cancel_versus_complete_in_both_orders(kind: Kind) {
    let t = TestDb::with_clock(kind, manual_clock()).await;
    // Cancel first: the completion loses and is told the run is cancelled.
    let r1 = t.ferry.create_run_idempotent(job("c1")).await.unwrap().run;
    let c = t
        .ferry
        .jobs()
        .claim("payments", "w", LEASE, 1)
        .await
        .unwrap()
        .pop()
        .unwrap();
    t.ferry
        .cancel("acme", r1.run_id, Some(1), "ops@example", "customer asked")
        .await
        .unwrap();
    match t.ferry.jobs().complete(&c.lease, &json!({})).await.unwrap_err() {
        Error::RunTerminal { state, .. } => assert_eq!(state, "cancelled"),
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(
        t.ferry.jobs().renew(&c.lease, LEASE).await.unwrap_err().code(),
        "cancelled",
        "renew reports cancellation"
    );
    let last = t.ferry.list_events("acme", r1.run_id).await.unwrap().pop().unwrap();
    assert_eq!(
        (last.kind.as_str(), last.body["actor"].as_str()),
        ("run_cancelled", Some("ops@example"))
    );
    // Complete first: the cancel loses and is told the run succeeded.
    let r2 = t.ferry.create_run_idempotent(job("c2")).await.unwrap().run;
    let c = t
        .ferry
        .jobs()
        .claim("payments", "w", LEASE, 1)
        .await
        .unwrap()
        .pop()
        .unwrap();
    t.ferry.jobs().complete(&c.lease, &json!({"ok": true})).await.unwrap();
    match t
        .ferry
        .cancel("acme", r2.run_id, None, "ops", "late")
        .await
        .unwrap_err()
    {
        Error::RunTerminal { state, .. } => assert_eq!(state, "succeeded"),
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(terminal_events(&t).await, vec!["run_cancelled", "run_succeeded"]);
    // A queued job cancelled is never claimable; a stale version is refused.
    let r3 = t.ferry.create_run_idempotent(job("c3")).await.unwrap().run;
    assert_eq!(
        t.ferry
            .cancel("acme", r3.run_id, Some(7), "ops", "stale")
            .await
            .unwrap_err()
            .code(),
        "invalid_state"
    );
    t.ferry.cancel("acme", r3.run_id, Some(1), "ops", "fine").await.unwrap();
    assert!(t
        .ferry
        .jobs()
        .claim("payments", "w", LEASE, 10)
        .await
        .unwrap()
        .is_empty());
    // Racing: exactly one winner.
    for i in 0..5 {
        let run = t
            .ferry
            .create_run_idempotent(job(&format!("race-{i}")))
            .await
            .unwrap()
            .run;
        let c = t
            .ferry
            .jobs()
            .claim("payments", "w", LEASE, 1)
            .await
            .unwrap()
            .pop()
            .unwrap();
        let (f1, f2) = (t.ferry.clone(), t.ferry.clone());
        let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(2));
        let (b1, b2) = (barrier.clone(), barrier);
        let done = tokio::spawn(async move {
            b1.wait().await;
            f1.jobs().complete(&c.lease, &json!({})).await
        });
        let cancelled = tokio::spawn(async move {
            b2.wait().await;
            f2.cancel("acme", run.run_id, None, "ops", "race").await
        });
        let (done, cancelled) = (done.await.unwrap(), cancelled.await.unwrap());
        assert!(
            done.is_ok() ^ cancelled.is_ok(),
            "exactly one wins: {done:?} {cancelled:?}"
        );
        let loser = done.err().or(cancelled.err()).unwrap();
        assert_eq!(loser.code(), "run_terminal");
        let kinds: Vec<_> = t
            .ferry
            .list_events("acme", run.run_id)
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.kind)
            .collect();
        assert_eq!(kinds.len(), 2, "run_queued and one terminal event: {kinds:?}");
    }
}

async fn effect_ledger(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    let policy = RetryPolicy {
        base: Duration::from_secs(1),
        max_jitter: Duration::ZERO,
        ..RetryPolicy::default()
    };
    let mut rng = StdRng::seed_from_u64(3);
    // Reserve, then success; later reservations see it done.
    t.ferry.create_run_idempotent(job("e1")).await.unwrap();
    let c = t
        .ferry
        .jobs()
        .claim("payments", "w", LEASE, 1)
        .await
        .unwrap()
        .pop()
        .unwrap();
    assert!(matches!(
        t.ferry
            .jobs()
            .reserve_effect(&c.lease, "pay", "psp.charge")
            .await
            .unwrap(),
        Reservation::Proceed(_)
    ));
    assert!(matches!(
        t.ferry
            .jobs()
            .reserve_effect(&c.lease, "pay", "psp.charge")
            .await
            .unwrap(),
        Reservation::Proceed(_)
    ));
    let rec = t
        .ferry
        .jobs()
        .record_effect_success(&c.lease, "pay", "psp.charge", "ch_123")
        .await
        .unwrap();
    assert_eq!(rec.provider_ref.as_deref(), Some("ch_123"));
    match t
        .ferry
        .jobs()
        .reserve_effect(&c.lease, "pay", "psp.charge")
        .await
        .unwrap()
    {
        Reservation::AlreadyDone(r) => assert_eq!(r.provider_ref.as_deref(), Some("ch_123")),
        other => panic!("unexpected {other:?}"),
    }
    t.ferry.jobs().complete(&c.lease, &json!({})).await.unwrap();

    // Ambiguous outcome: the effect becomes unknown and must be reconciled.
    let r2 = t.ferry.create_run_idempotent(job("e2")).await.unwrap().run;
    let c = t
        .ferry
        .jobs()
        .claim("payments", "w", LEASE, 1)
        .await
        .unwrap()
        .pop()
        .unwrap();
    assert!(matches!(
        t.ferry
            .jobs()
            .reserve_effect(&c.lease, "pay", "psp.charge")
            .await
            .unwrap(),
        Reservation::Proceed(_)
    ));
    let out = t
        .ferry
        .jobs()
        .fail(&c.lease, &JobError::ambiguous("psp_timeout"), &policy, &mut rng)
        .await
        .unwrap();
    assert!(matches!(out, FailOutcome::Retried { .. }));
    assert_eq!(
        format!(
            "{:?}",
            t.ferry
                .get_effect("acme", r2.run_id, "pay", "psp.charge")
                .await
                .unwrap()
                .state
        ),
        "Unknown"
    );
    clock.advance(Duration::from_secs(2)).unwrap();
    let c2 = t
        .ferry
        .jobs()
        .claim("payments", "w", LEASE, 1)
        .await
        .unwrap()
        .pop()
        .unwrap();
    match t
        .ferry
        .jobs()
        .reserve_effect(&c2.lease, "pay", "psp.charge")
        .await
        .unwrap()
    {
        Reservation::NeedsReconcile(r) => assert_eq!(r.generation, 1),
        other => panic!("must reconcile first, got {other:?}"),
    }
    let resolved = t
        .ferry
        .jobs()
        .reconcile_effect(
            &c2.lease,
            "pay",
            "psp.charge",
            Resolution::Succeeded {
                provider_ref: "ch_9".into(),
            },
        )
        .await
        .unwrap();
    assert!(
        matches!(resolved, Reservation::AlreadyDone(ref r) if r.generation == 2 && r.provider_ref.as_deref() == Some("ch_9"))
    );
    // A reconcile that finds nothing happened lets the step run under the new generation.
    assert!(matches!(
        t.ferry
            .jobs()
            .reserve_effect(&c2.lease, "ship", "wms.ship")
            .await
            .unwrap(),
        Reservation::Proceed(_)
    ));
    t.ferry
        .jobs()
        .record_effect_failure(&c2.lease, "ship", "wms.ship", "wms_timeout", true)
        .await
        .unwrap();
    match t
        .ferry
        .jobs()
        .reconcile_effect(&c2.lease, "ship", "wms.ship", Resolution::NotApplied)
        .await
        .unwrap()
    {
        Reservation::Proceed(r) => assert_eq!((format!("{:?}", r.state), r.generation), ("Reserved".into(), 2)),
        other => panic!("unexpected {other:?}"),
    }

    t.ferry.jobs().complete(&c2.lease, &json!({})).await.unwrap();

    // A stale generation can write nothing.
    let r3 = t.ferry.create_run_idempotent(job("e3")).await.unwrap().run;
    let a = t
        .ferry
        .jobs()
        .claim("payments", "a", LEASE, 1)
        .await
        .unwrap()
        .pop()
        .unwrap();
    assert_eq!(a.lease.run_id, r3.run_id);
    t.ferry
        .jobs()
        .reserve_effect(&a.lease, "pay", "psp.charge")
        .await
        .unwrap();
    clock.advance(LEASE * 2).unwrap();
    let b = t
        .ferry
        .jobs()
        .claim("payments", "b", LEASE, 1)
        .await
        .unwrap()
        .pop()
        .unwrap();
    assert_eq!(b.lease.run_id, r3.run_id);
    for e in [
        t.ferry
            .jobs()
            .record_effect_success(&a.lease, "pay", "psp.charge", "ch_stale")
            .await
            .unwrap_err(),
        t.ferry
            .jobs()
            .record_effect_failure(&a.lease, "pay", "psp.charge", "x", false)
            .await
            .unwrap_err(),
        t.ferry
            .jobs()
            .reconcile_effect(&a.lease, "pay", "psp.charge", Resolution::NotApplied)
            .await
            .unwrap_err(),
    ] {
        assert_eq!(e.code(), "lost_lease");
    }
    let rec = t
        .ferry
        .get_effect("acme", r3.run_id, "pay", "psp.charge")
        .await
        .unwrap();
    assert_eq!(
        (rec.generation, rec.provider_ref),
        (1, None),
        "the stale worker changed nothing"
    );
    assert!(matches!(
        t.ferry
            .jobs()
            .reserve_effect(&b.lease, "pay", "psp.charge")
            .await
            .unwrap(),
        Reservation::NeedsReconcile(_)
    ));
}

async fn dead_jobs_are_listed_and_replayed_once(kind: Kind) {
    let t = TestDb::with_clock(kind, manual_clock()).await;
    let run = t.ferry.create_run_idempotent(job("d1")).await.unwrap().run;
    let c = t
        .ferry
        .jobs()
        .claim("payments", "w", LEASE, 1)
        .await
        .unwrap()
        .pop()
        .unwrap();
    let mut rng = StdRng::seed_from_u64(0);
    t.ferry
        .jobs()
        .fail(
            &c.lease,
            &JobError::terminal("card_declined"),
            &RetryPolicy::default(),
            &mut rng,
        )
        .await
        .unwrap();
    assert!(t
        .ferry
        .operator()
        .list_dead("acme", Some("other_code"), 10)
        .await
        .unwrap()
        .is_empty());
    let dead = t
        .ferry
        .operator()
        .list_dead("acme", Some("card_declined"), 10)
        .await
        .unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].history.len(), 1);
    assert_eq!(dead[0].history[0].error_class.as_deref(), Some("terminal"));
    let replay = t
        .ferry
        .operator()
        .replay_dead("acme", run.run_id, "ops@example", "card updated", false)
        .await
        .unwrap();
    assert!(!replay.replay);
    assert_ne!(replay.run.run_id, run.run_id, "a new run");
    assert_eq!(replay.run.replay_of, Some(run.run_id));
    assert_eq!(replay.run.operation, "charge", "the operation is kept");
    let audit = t.ferry.list_events("acme", run.run_id).await.unwrap().pop().unwrap();
    assert_eq!(
        (
            audit.kind.as_str(),
            audit.body["actor"].as_str(),
            audit.body["reason"].as_str()
        ),
        ("replay_requested", Some("ops@example"), Some("card updated"))
    );
    let again = t
        .ferry
        .operator()
        .replay_dead("acme", run.run_id, "ops", "again", false)
        .await
        .unwrap_err();
    assert_eq!(again.code(), "already_replayed");
    let forced = t
        .ferry
        .operator()
        .replay_dead("acme", run.run_id, "ops", "again, on purpose", true)
        .await
        .unwrap();
    assert_ne!(forced.run.run_id, replay.run.run_id);
    let c = t.ferry.jobs().claim("payments", "w", LEASE, 10).await.unwrap();
    assert_eq!(c.len(), 2, "both replays are claimable");
    assert!(c.iter().all(|x| x.replay_of == Some(run.run_id)));
    assert_eq!(
        t.ferry
            .operator()
            .replay_dead("acme", replay.run.run_id, "ops", "x", false)
            .await
            .unwrap_err()
            .code(),
        "invalid_state"
    );
}

/// Kills the one claimable job of `queue` terminally.
async fn kill_next(t: &TestDb, queue: &str) -> uuid::Uuid {
    let c = t.ferry.jobs().claim(queue, "w", LEASE, 1).await.unwrap().pop().unwrap();
    let mut rng = StdRng::seed_from_u64(0);
    t.ferry
        .jobs()
        .fail(&c.lease, &JobError::terminal("boom"), &RetryPolicy::default(), &mut rng)
        .await
        .unwrap();
    c.lease.run_id
}

/// A replay keeps its operation at any allowed length (it used to become
/// `<operation>.replay`, which no `Router` route matched and which a
/// 122-byte operation could not hold), a replay of a replay works, and the
/// replay's key is its own: a client run that holds it is a conflict, and
/// the refused replay writes nothing.
async fn replays_keep_the_operation_at_any_length_and_chain(kind: Kind) {
    let t = TestDb::with_clock(kind, manual_clock()).await;
    let operation = "o".repeat(128);
    let run = NewRun::new("acme", &*operation, "long-1", json!({"n": 1})).queue("q");
    let first = t.ferry.create_run_idempotent(run).await.unwrap().run;
    assert_eq!(kill_next(&t, "q").await, first.run_id);
    let replay = t
        .ferry
        .operator()
        .replay_dead("acme", first.run_id, "ops", "fixed", false)
        .await
        .unwrap();
    assert!(!replay.replay);
    assert_eq!(
        (replay.run.operation.as_str(), replay.run.replay_of, &replay.run.request),
        (operation.as_str(), Some(first.run_id), &json!({"n": 1}))
    );
    // The replay dies too; it is replayed in turn, under the same operation.
    assert_eq!(kill_next(&t, "q").await, replay.run.run_id);
    let again = t
        .ferry
        .operator()
        .replay_dead("acme", replay.run.run_id, "ops", "fixed again", false)
        .await
        .unwrap();
    assert_eq!(
        (again.run.operation.as_str(), again.run.replay_of),
        (operation.as_str(), Some(replay.run.run_id))
    );
    let claimed = t.ferry.jobs().claim("q", "w", LEASE, 10).await.unwrap();
    assert_eq!(
        claimed
            .iter()
            .map(|c| (c.lease.run_id, c.operation.as_str()))
            .collect::<Vec<_>>(),
        vec![(again.run.run_id, operation.as_str())]
    );
    // A client run under the key the next replay of `third` would take.
    let third = t
        .ferry
        .create_run_idempotent(NewRun::new("acme", "charge", "c-3", json!({"n": 3})).queue("z"))
        .await
        .unwrap()
        .run;
    kill_next(&t, "z").await;
    let seq = t.ferry.get_run("acme", third.run_id).await.unwrap().last_event_seq;
    let squatter = NewRun::new(
        "acme",
        "charge",
        format!("replay:{}:{seq}", third.run_id.simple()),
        json!({"n": 3}),
    )
    .queue("elsewhere");
    let squatter = t.ferry.create_run_idempotent(squatter).await.unwrap().run;
    let runs = t.scalar("SELECT count(*) FROM runs").await;
    let e = t
        .ferry
        .operator()
        .replay_dead("acme", third.run_id, "ops", "x", false)
        .await
        .unwrap_err();
    assert!(
        matches!(&e, Error::IdempotencyConflict { existing_run, .. } if *existing_run == squatter.run_id),
        "{e:?}"
    );
    assert_eq!(t.scalar("SELECT count(*) FROM runs").await, runs, "nothing written");
    assert_eq!(
        t.ferry.list_events("acme", third.run_id).await.unwrap().len() as i64,
        seq,
        "no replay_requested event"
    );
}

async fn attempt_history_is_bounded_by_retention(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    for i in 0..3 {
        t.ferry.create_run_idempotent(job(&format!("h{i}"))).await.unwrap();
    }
    for c in t.ferry.jobs().claim("payments", "w", LEASE, 10).await.unwrap() {
        t.ferry.jobs().complete(&c.lease, &json!({})).await.unwrap();
    }
    clock.advance(Duration::from_secs(3600)).unwrap();
    let cutoff = ferry::Millis::new(T0 + 1).unwrap();
    assert_eq!(t.ferry.jobs().sweep_attempts(cutoff, 2).await.unwrap(), 2);
    assert_eq!(t.ferry.jobs().sweep_attempts(cutoff, 2).await.unwrap(), 1);
    assert_eq!(t.scalar("SELECT count(*) FROM job_attempts").await, 0);
}

async fn batch_completion_fences_each_lease(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    for i in 0..4 {
        t.ferry.create_run_idempotent(job(&format!("b{i}"))).await.unwrap();
    }
    let mut claimed = t.ferry.jobs().claim("payments", "w", LEASE, 10).await.unwrap();
    assert_eq!(claimed.len(), 4);
    // One lease goes stale (cancelled), one is forged with a wrong generation.
    t.ferry
        .cancel("acme", claimed[1].lease.run_id, None, "ops", "no")
        .await
        .unwrap();
    claimed[2].lease.generation += 1;
    let items: Vec<_> = claimed
        .iter()
        .map(|c| (c.lease.clone(), json!({"run": c.lease.run_id})))
        .collect();
    let results = t.ferry.jobs().complete_batch(&items).await.unwrap();
    let codes: Vec<_> = results.iter().map(|r| r.as_ref().err().map(|e| e.code())).collect();
    assert_eq!(codes, [None, Some("run_terminal"), Some("lost_lease"), None]);
    assert_eq!(
        terminal_events(&t).await,
        vec!["run_cancelled", "run_succeeded", "run_succeeded"]
    );
    for c in [&claimed[0], &claimed[3]] {
        let id = c.lease.run_id;
        assert_eq!(t.ferry.get_run("acme", id).await.unwrap().state, RunState::Succeeded);
        let last = t.ferry.list_events("acme", id).await.unwrap().pop().unwrap();
        assert_eq!(last.body, json!({"result": {"run": id}}));
        assert_eq!(
            t.ferry.operator().list_attempts("acme", id).await.unwrap()[0]
                .outcome
                .map(|o| o.as_str()),
            Some("succeeded")
        );
        let lane = ferry::outbox::lane_for(&id.to_string(), t.ferry.lanes());
        let sql =
            format!("SELECT count(*) FROM outbox WHERE effect_key = 'acme/{id}/2' AND key = '{id}' AND lane = {lane}");
        assert_eq!(t.scalar(&sql).await, 1, "the event's outbox row, on the run's lane");
    }
    assert_eq!(
        t.ferry.get_run("acme", claimed[2].lease.run_id).await.unwrap().state,
        RunState::Queued
    );
}

async fn release_then_claim_again_completes(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    let run = t.ferry.create_run_idempotent(job("r")).await.unwrap().run;
    let first = t
        .ferry
        .jobs()
        .claim("payments", "w1", LEASE, 1)
        .await
        .unwrap()
        .pop()
        .unwrap();
    assert_eq!((first.lease.generation, first.attempt), (1, 1));
    t.ferry.jobs().release(&first.lease).await.unwrap();
    // The released job is due first; claiming it again must not wedge the queue.
    t.ferry.create_run_idempotent(job("r-later")).await.unwrap();
    let again = t
        .ferry
        .jobs()
        .claim("payments", "w2", LEASE, 1)
        .await
        .expect("a released job is claimable again")
        .pop()
        .unwrap();
    assert_eq!(again.lease.run_id, run.run_id, "the released job is due first");
    assert_eq!(
        (again.lease.generation, again.attempt),
        (2, 1),
        "a release spends no attempt; the generation still goes up"
    );
    t.ferry.jobs().release(&again.lease).await.unwrap();
    let third = t.ferry.jobs().claim("payments", "w3", LEASE, 2).await.unwrap();
    assert_eq!(third.len(), 2, "the queue keeps moving");
    for c in &third {
        t.ferry
            .jobs()
            .complete(&c.lease, &json!({"by": c.lease.owner}))
            .await
            .unwrap();
    }
    assert_eq!(
        t.ferry.get_run("acme", run.run_id).await.unwrap().state,
        RunState::Succeeded
    );
    let history: Vec<_> = t
        .ferry
        .operator()
        .list_attempts("acme", run.run_id)
        .await
        .unwrap()
        .into_iter()
        .map(|a| {
            (
                a.attempt,
                a.generation,
                a.worker,
                a.outcome.unwrap().as_str().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        history,
        [
            (1, 1, "w1".to_owned(), "released".to_owned()),
            (1, 2, "w2".to_owned(), "released".to_owned()),
            (1, 3, "w3".to_owned(), "succeeded".to_owned()),
        ]
    );
}

/// Counts of every table a refused call could have written to.
async fn written(t: &TestDb) -> Vec<i64> {
    let mut out = Vec::new();
    for table in ["runs", "run_events", "jobs", "idempotency_keys", "outbox", "effects"] {
        out.push(t.scalar(&format!("SELECT count(*) FROM {table}")).await);
    }
    out.push(
        t.scalar("SELECT count(*) FROM effects WHERE provider_ref IS NOT NULL OR state <> 'reserved'")
            .await,
    );
    out.push(t.scalar("SELECT count(*) FROM jobs WHERE state <> 'leased'").await);
    out
}

async fn nul_bytes_are_invalid_input_and_write_nothing(kind: Kind) {
    let t = TestDb::with_clock(kind, manual_clock()).await;
    let nul = "a\u{0}b";
    t.ferry.create_run_idempotent(job("ok")).await.unwrap();
    let c = t
        .ferry
        .jobs()
        .claim("payments", "w", LEASE, 1)
        .await
        .unwrap()
        .pop()
        .unwrap();
    t.ferry
        .jobs()
        .reserve_effect(&c.lease, "pay", "psp.charge")
        .await
        .unwrap();
    let before = written(&t).await;
    let mut errs = vec![
        (
            "command value",
            t.ferry
                .create_run_idempotent(NewRun::new("acme", "charge", "n1", json!({ "note": nul })))
                .await
                .unwrap_err(),
        ),
        (
            "command key",
            t.ferry
                .create_run_idempotent(NewRun::new("acme", "charge", "n2", json!({ nul: [1] })))
                .await
                .unwrap_err(),
        ),
        (
            "result",
            t.ferry
                .jobs()
                .complete(&c.lease, &json!({ "nested": [{ "v": nul }] }))
                .await
                .unwrap_err(),
        ),
        (
            "batch result",
            t.ferry
                .jobs()
                .complete_batch(&[(c.lease.clone(), json!({ "v": nul }))])
                .await
                .unwrap_err(),
        ),
        (
            "event body",
            t.ferry
                .append_event("acme", c.lease.run_id, "note", &json!({ "v": nul }))
                .await
                .unwrap_err(),
        ),
        (
            "provider ref",
            t.ferry
                .jobs()
                .record_effect_success(&c.lease, "pay", "psp.charge", nul)
                .await
                .unwrap_err(),
        ),
        (
            "reconciled provider ref",
            t.ferry
                .jobs()
                .reconcile_effect(
                    &c.lease,
                    "pay",
                    "psp.charge",
                    Resolution::Succeeded {
                        provider_ref: nul.into(),
                    },
                )
                .await
                .unwrap_err(),
        ),
    ];
    let outbox = |key: &str| ferry::OutboxMessage::bytes("acme", "orders", key, vec![1]);
    for (what, msg) in [
        ("outbox key", outbox(nul)),
        ("header name", outbox("k").header(nul, "v")),
        ("header value", outbox("k").header("h", nul)),
        ("effect key", outbox("k").effect_key(nul)),
    ] {
        errs.push((what, t.ferry.enqueue(&msg).await.unwrap_err()));
        let mut tx = t.ferry.begin().await.unwrap();
        errs.push((what, t.ferry.enqueue_in(tx.conn(), &msg).await.unwrap_err()));
        tx.rollback().await.unwrap();
    }
    for (what, e) in &errs {
        assert_eq!(e.code(), "invalid_input", "{what}: {e}");
    }
    assert_eq!(written(&t).await, before, "nothing was written");
    // The lease is intact: the same calls without NUL succeed.
    t.ferry
        .jobs()
        .record_effect_success(&c.lease, "pay", "psp.charge", "ch_1")
        .await
        .unwrap();
    t.ferry.jobs().complete(&c.lease, &json!({"ok": true})).await.unwrap();
}

async fn claim_never_leases_past_the_deadline(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    let run = t
        .ferry
        .create_run_idempotent(job("dl").deadline(Duration::from_secs(45)))
        .await
        .unwrap()
        .run;
    let deadline = run.deadline_at.unwrap().get();
    assert_eq!(deadline, T0 + 45_000);
    let c = t
        .ferry
        .jobs()
        .claim("payments", "w", Duration::from_secs(60), 1)
        .await
        .unwrap()
        .pop()
        .unwrap();
    assert_eq!(
        c.lease_expires_at.get(),
        deadline,
        "the claim caps the lease at the deadline"
    );
    assert_eq!(
        t.scalar("SELECT lease_expires_at FROM jobs").await,
        deadline,
        "as stored"
    );
    assert_eq!(
        t.scalar("SELECT available_at FROM jobs").await,
        deadline,
        "a leased job keeps available_at = lease_expires_at"
    );
    // A lease shorter than the time left is not touched.
    t.ferry
        .create_run_idempotent(job("dl2").deadline(Duration::from_secs(45)))
        .await
        .unwrap();
    let short = t
        .ferry
        .jobs()
        .claim("payments", "w", LEASE, 1)
        .await
        .unwrap()
        .pop()
        .unwrap();
    assert_eq!(short.lease_expires_at.get(), T0 + 30_000);
    // At the deadline the capped lease is over: nothing can be written under it.
    clock.advance(Duration::from_secs(45)).unwrap();
    assert_eq!(
        t.ferry.jobs().complete(&c.lease, &json!({})).await.unwrap_err().code(),
        "lost_lease"
    );
}

/// `complete_and_claim` in the caller's transaction: a rollback undoes both
/// halves (the job stays leased, nothing is claimed); a commit keeps both.
async fn complete_and_claim_commits_both_halves_or_neither(kind: Kind) {
    let t = TestDb::with_clock(kind, manual_clock()).await;
    for i in 0..3 {
        t.ferry.create_run_idempotent(job(&format!("cc{i}"))).await.unwrap();
    }
    let first = t
        .ferry
        .jobs()
        .claim("payments", "w", LEASE, 1)
        .await
        .unwrap()
        .pop()
        .unwrap();
    let items = [(first.lease.clone(), json!({"ok": 1}))];
    let mut tx = t.ferry.begin().await.unwrap();
    let (done, next) = t
        .ferry
        .jobs()
        .complete_and_claim_in(&mut tx, &items, "payments", "w", LEASE, 1)
        .await
        .unwrap();
    assert!(done[0].is_ok());
    assert_eq!(next.len(), 1);
    tx.rollback().await.unwrap();
    assert_eq!(t.scalar("SELECT count(*) FROM jobs WHERE state = 'leased'").await, 1);
    assert_eq!(t.scalar("SELECT count(*) FROM jobs WHERE state = 'queued'").await, 2);
    assert_eq!(
        t.scalar("SELECT count(*) FROM job_attempts").await,
        1,
        "no attempt row kept"
    );
    assert!(terminal_events(&t).await.is_empty());
    assert_eq!(
        t.scalar("SELECT count(*) FROM outbox WHERE effect_key LIKE 'acme/%/2'")
            .await,
        0
    );
    // The rolled-back completion did not spend the lease: it completes now,
    // and the claim takes the two queued jobs in the same commit.
    let (done, next) = t
        .ferry
        .jobs()
        .complete_and_claim(&items, "payments", "w2", LEASE, 5)
        .await
        .unwrap();
    assert!(done[0].is_ok());
    assert_eq!(next.len(), 2);
    assert!(next
        .iter()
        .all(|c| c.lease.owner == "w2" && c.attempt == 1 && c.lease.run_id != first.lease.run_id));
    assert_eq!(
        t.ferry.get_run("acme", first.lease.run_id).await.unwrap().state,
        RunState::Succeeded
    );
    assert_eq!(terminal_events(&t).await, vec!["run_succeeded"]);
    let id = first.lease.run_id;
    assert_eq!(
        t.scalar(&format!("SELECT count(*) FROM outbox WHERE effect_key = 'acme/{id}/2'"))
            .await,
        1
    );
    assert_eq!(t.scalar("SELECT count(*) FROM jobs WHERE state = 'leased'").await, 2);
    for c in &next {
        assert_eq!(c.request, json!({"amount": 5}));
        let attempts = t.ferry.operator().list_attempts("acme", c.lease.run_id).await.unwrap();
        assert_eq!((attempts.len(), attempts[0].worker.as_str()), (1, "w2"));
    }
    assert_eq!(
        t.ferry.operator().list_attempts("acme", id).await.unwrap()[0]
            .outcome
            .map(|o| o.as_str()),
        Some("succeeded")
    );
}

/// A stale lease in the batch is refused and named, the others complete,
/// and the claim for the freed slots still happens.
async fn complete_and_claim_refuses_stale_leases_and_still_claims(kind: Kind) {
    let t = TestDb::with_clock(kind, manual_clock()).await;
    for i in 0..4 {
        t.ferry.create_run_idempotent(job(&format!("s{i}"))).await.unwrap();
    }
    let mut claimed = t.ferry.jobs().claim("payments", "w", LEASE, 10).await.unwrap();
    assert_eq!(claimed.len(), 4);
    let mut fresh = Vec::new();
    for i in 0..2 {
        fresh.push(
            t.ferry
                .create_run_idempotent(job(&format!("n{i}")))
                .await
                .unwrap()
                .run
                .run_id,
        );
    }
    t.ferry
        .cancel("acme", claimed[1].lease.run_id, None, "ops", "no")
        .await
        .unwrap();
    claimed[2].lease.generation += 1;
    let items: Vec<_> = claimed.iter().map(|c| (c.lease.clone(), json!({}))).collect();
    let (results, next) = t
        .ferry
        .jobs()
        .complete_and_claim(&items, "payments", "w", LEASE, 4)
        .await
        .unwrap();
    let codes: Vec<_> = results.iter().map(|r| r.as_ref().err().map(|e| e.code())).collect();
    assert_eq!(codes, [None, Some("run_terminal"), Some("lost_lease"), None]);
    let mut got: Vec<_> = next.iter().map(|c| c.lease.run_id).collect();
    got.sort();
    fresh.sort();
    assert_eq!(got, fresh, "the claim took exactly the queued jobs");
    assert_eq!(
        terminal_events(&t).await,
        vec!["run_cancelled", "run_succeeded", "run_succeeded"]
    );
    // The forged lease's job is still leased under its real generation.
    claimed[2].lease.generation -= 1;
    t.ferry.jobs().complete(&claimed[2].lease, &json!({})).await.unwrap();
}

/// A batch holding two leases of one job (the expired one and the one that
/// reclaimed it) completes the current one and refuses the stale one, in
/// both batch calls: answers are matched by the whole lease (tenant, run id,
/// generation), not by the run id.
async fn a_stale_and_a_current_lease_of_one_job_in_one_batch(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    for complete_and_claim in [false, true] {
        t.ferry
            .create_run_idempotent(job(&format!("twice-{complete_and_claim}")))
            .await
            .unwrap();
        let first = t.ferry.jobs().claim("payments", "w", LEASE, 1).await.unwrap().remove(0);
        clock.advance(LEASE + Duration::from_millis(1)).unwrap();
        let again = t.ferry.jobs().claim("payments", "w", LEASE, 1).await.unwrap().remove(0);
        assert_eq!(again.lease.run_id, first.lease.run_id, "the expired lease is reclaimed");
        assert_eq!(again.lease.generation, first.lease.generation + 1);
        let items = vec![(first.lease.clone(), json!({})), (again.lease.clone(), json!({}))];
        let results = if complete_and_claim {
            t.ferry
                .jobs()
                .complete_and_claim(&items, "payments", "w", LEASE, 0)
                .await
                .unwrap()
                .0
        } else {
            t.ferry.jobs().complete_batch(&items).await.unwrap()
        };
        let codes: Vec<_> = results.iter().map(|r| r.as_ref().err().map(|e| e.code())).collect();
        assert_eq!(
            codes,
            [Some("lost_lease"), None],
            "complete_and_claim: {complete_and_claim}"
        );
    }
}

on_every_route!(
    a_stale_and_a_current_lease_of_one_job_in_one_batch,
    complete_and_claim_commits_both_halves_or_neither,
    complete_and_claim_refuses_stale_leases_and_still_claims,
    batch_completion_fences_each_lease,
    expired_lease_recovery_and_stale_fencing,
    renewal_extends_only_a_live_lease,
    retry_schedule_is_exact_and_the_budget_terminalizes,
    cancel_versus_complete_in_both_orders,
    effect_ledger,
    dead_jobs_are_listed_and_replayed_once,
    replays_keep_the_operation_at_any_length_and_chain,
    attempt_history_is_bounded_by_retention,
    release_then_claim_again_completes,
    nul_bytes_are_invalid_input_and_write_nothing,
    claim_never_leases_past_the_deadline,
);
