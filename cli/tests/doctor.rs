//! `doctor` finds seeded faults of each kind, on both engines, and nothing on
//! a healthy database.

use std::time::Duration;

use ferry::{NewRun, Reservation};
use ferry_cli::doctor::Finding;
use serde_json::json;

use ferry::Engine as Kind;
use ferry_testkit::{manual_clock, on_both_engines, TestDb};

fn items<'a>(findings: &'a [Finding], check: &str) -> &'a [String] {
    &findings
        .iter()
        .find(|f| f.check == check)
        .unwrap_or_else(|| panic!("no check {check}"))
        .items
}

async fn doctor_finds_seeded_faults(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    let lease = Duration::from_secs(30);
    // A healthy history first: nothing to report.
    t.ferry
        .create_run_idempotent(NewRun::new("acme", "charge", "ok", json!({"n": 0})))
        .await
        .unwrap();
    let c = t
        .ferry
        .jobs()
        .claim("default", "w", lease, 1)
        .await
        .unwrap()
        .pop()
        .unwrap();
    t.ferry.jobs().complete(&c.lease, &json!({})).await.unwrap();
    // A schedule's ticks and the follow-ups of different parents share one
    // request: they are no duplicate acceptances.
    let every = ferry::Every::interval(Duration::from_secs(60)).unwrap();
    let report = NewRun::new("acme", "report", "-", json!({"same": true})).queue("reports");
    let missed = ferry::Missed::CatchUp { max: 2 };
    t.ferry.schedule("tick", every, report, missed, "ops").await.unwrap();
    clock.advance(Duration::from_secs(120)).unwrap();
    let ticks = t.ferry.fire_due_ticks(10).await.unwrap();
    assert_eq!(ticks.len(), 2);
    for (key, parent) in [("n1", c.lease.run_id), ("n2", ticks[0].accepted.run.run_id)] {
        let notify = NewRun::new("acme", "notify", key, json!({}))
            .queue("notify")
            .parent(parent);
        t.ferry.create_run_idempotent(notify).await.unwrap();
    }
    let clean = ferry_cli::doctor::run(&t.ferry, Duration::from_secs(300), 20)
        .await
        .unwrap();
    assert!(
        clean
            .iter()
            .filter(|f| f.check != "lease_expiry")
            .all(|f| f.items.is_empty()),
        "{clean:?}"
    );

    // Duplicate paid generations: one request accepted twice, and one
    // operation with two provider refs.
    for key in ["k1", "k2"] {
        t.ferry
            .create_run_idempotent(NewRun::new("acme", "charge", key, json!({"n": 1})))
            .await
            .unwrap();
    }
    let c = t
        .ferry
        .jobs()
        .claim("default", "w", lease, 1)
        .await
        .unwrap()
        .pop()
        .unwrap();
    for (step, reference) in [("a", "ch_1"), ("b", "ch_2")] {
        assert!(matches!(
            t.ferry
                .jobs()
                .reserve_effect(&c.lease, step, "psp.charge")
                .await
                .unwrap(),
            Reservation::Proceed(_)
        ));
        t.ferry
            .jobs()
            .record_effect_success(&c.lease, step, "psp.charge", reference)
            .await
            .unwrap();
    }
    t.ferry.jobs().complete(&c.lease, &json!({})).await.unwrap();
    // Two workers completed one run: a second terminal event, and a
    // completion whose generation is not the current one.
    t.exec("DROP INDEX run_events_one_terminal_idx").await.unwrap();
    t.exec("INSERT INTO run_events (tenant, run_id, seq, kind, body, created_at)
            SELECT tenant, run_id, seq + 1, 'run_failed', body, created_at FROM run_events WHERE kind = 'run_succeeded'")
        .await
        .unwrap();
    t.exec("UPDATE jobs SET lease_generation = lease_generation + 5 WHERE state = 'succeeded'")
        .await
        .unwrap();
    // Jobs leased forever: one expired and unclaimed, one out of attempts.
    t.ferry
        .create_run_idempotent(NewRun::new("acme", "ship", "s1", json!({})).queue("shipping"))
        .await
        .unwrap();
    t.ferry
        .create_run_idempotent(
            NewRun::new("acme", "mail", "m1", json!({}))
                .queue("mail")
                .max_attempts(1),
        )
        .await
        .unwrap();
    t.ferry.jobs().claim("shipping", "gone-1", lease, 1).await.unwrap();
    t.ferry.jobs().claim("mail", "gone-2", lease, 1).await.unwrap();
    clock.advance(Duration::from_secs(3600)).unwrap();

    let f = ferry_cli::doctor::run(&t.ferry, Duration::from_secs(300), 20)
        .await
        .unwrap();
    assert_eq!(items(&f, "duplicate_acceptances").len(), 1);
    assert!(
        items(&f, "duplicate_acceptances")[0].contains("2 runs"),
        "{:?}",
        items(&f, "duplicate_acceptances")
    );
    assert_eq!(items(&f, "effect_provider_refs").len(), 1);
    assert!(
        items(&f, "effect_provider_refs")[0].contains("ch_1") && items(&f, "effect_provider_refs")[0].contains("ch_2")
    );
    assert_eq!(items(&f, "multiple_terminal_events").len(), 2);
    assert_eq!(items(&f, "stale_completions").len(), 2);
    assert_eq!(items(&f, "unreclaimed_leases").len(), 1);
    assert!(items(&f, "unreclaimed_leases")[0].contains("gone-1"));
    assert_eq!(items(&f, "exhausted_unterminated").len(), 1);
    assert!(items(&f, "exhausted_unterminated")[0].contains("mail"));
    assert!(f.iter().all(|x| !x.action.is_empty()));
}

async fn every_doctor_query_prepares(kind: Kind) {
    let t = TestDb::new(kind).await;
    ferry_cli::doctor::check_queries(&t.ferry).await.unwrap();
}

on_both_engines!(doctor_finds_seeded_faults, every_doctor_query_prepares);
