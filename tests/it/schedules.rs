//! Periodic runs (`Ferry::schedule`, `fire_due_ticks`) on both engines with
//! an injected clock: each tick accepted once across concurrent firers, the
//! missed-tick policies after downtime, and audited changes.

use std::sync::Arc;
use std::time::Duration;

use ferry::{Every, Missed, NewRun, ScheduleChange};
use serde_json::json;
use tokio::sync::Barrier;

use crate::support::{manual_clock, on_every_route, Kind, TestDb, T0};

const MINUTE: Duration = Duration::from_secs(60);

fn template(tenant: &str) -> NewRun {
    NewRun::new(tenant, "report", "replaced-per-tick", json!({"kind": "daily"})).queue("reports")
}

fn every_minute() -> Every {
    Every::interval(MINUTE).unwrap()
}

/// The `scheduled_at` of every run of schedule `name`, oldest first.
async fn tick_runs(t: &TestDb, tenant: &str, name: &str) -> Vec<i64> {
    let sql = format!(
        "SELECT r.scheduled_at FROM runs r JOIN idempotency_keys k ON k.tenant = r.tenant AND k.run_id = r.run_id \
         WHERE r.tenant = '{tenant}' AND k.key LIKE 'schedule:{name}:%' ORDER BY r.scheduled_at"
    );
    match t.ferry.db() {
        ferry::Db::Postgres(p) => sqlx::query_scalar(&sql).fetch_all(p).await.unwrap(),
        ferry::Db::Sqlite(p) => sqlx::query_scalar(&sql).fetch_all(p).await.unwrap(),
    }
}

async fn audits(t: &TestDb, action: &str) -> i64 {
    t.scalar(&format!(
        "SELECT COUNT(*) FROM ferry_audit WHERE action = '{action}' AND actor = 'ops'"
    ))
    .await
}

async fn ticks_fire_once_and_missed_ticks_follow_the_policy(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    let change = t
        .ferry
        .schedule("minutely", every_minute(), template("acme"), Missed::Skip, "ops")
        .await
        .unwrap();
    assert_eq!(change, ScheduleChange::Created);
    assert!(
        t.ferry.fire_due_ticks(10).await.unwrap().is_empty(),
        "the first tick is after registration"
    );

    clock.advance(MINUTE).unwrap();
    let fired = t.ferry.fire_due_ticks(10).await.unwrap();
    assert_eq!(fired.len(), 1);
    assert_eq!(fired[0].tick.get(), T0 + 60_000);
    let run = &fired[0].accepted.run;
    assert_eq!(
        (run.operation.as_str(), run.scheduled_at.map(|m| m.get())),
        ("report", Some(T0 + 60_000))
    );
    assert!(
        t.ferry.fire_due_ticks(10).await.unwrap().is_empty(),
        "a tick fires once"
    );
    let claimed = t.ferry.jobs().claim("reports", "w", MINUTE, 10).await.unwrap();
    assert_eq!(claimed.len(), 1, "a tick's run is claimable at its tick");

    // Ten minutes down, Skip: only the latest missed tick runs.
    clock.advance(10 * MINUTE).unwrap();
    assert_eq!(t.ferry.fire_due_ticks(10).await.unwrap().len(), 1);
    assert_eq!(tick_runs(&t, "acme", "minutely").await, [T0 + 60_000, T0 + 660_000]);

    // Catch up, bounded: the latest three of ten.
    let change = t
        .ferry
        .schedule(
            "minutely",
            every_minute(),
            template("acme"),
            Missed::CatchUp { max: 3 },
            "ops",
        )
        .await
        .unwrap();
    assert_eq!(change, ScheduleChange::Updated);
    clock.advance(10 * MINUTE).unwrap();
    assert_eq!(t.ferry.fire_due_ticks(10).await.unwrap().len(), 3);
    assert_eq!(
        tick_runs(&t, "acme", "minutely").await,
        [
            T0 + 60_000,
            T0 + 660_000,
            T0 + 1_140_000,
            T0 + 1_200_000,
            T0 + 1_260_000
        ]
    );
    // Back to one tick per minute.
    clock.advance(MINUTE).unwrap();
    assert_eq!(t.ferry.fire_due_ticks(10).await.unwrap().len(), 1);
    let listed = t.ferry.operator().list_schedules(Some("acme")).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].last_tick.map(|m| m.get()), Some(T0 + 1_320_000));
    assert_eq!(listed[0].next_tick.get(), T0 + 1_380_000);
    assert_eq!(listed[0].missed, Missed::CatchUp { max: 3 });
}

async fn cron_schedules_tick_on_their_expression(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    let every = Every::cron("*/5 * * * *").unwrap();
    t.ferry
        .schedule("five", every, template("acme"), Missed::CatchUp { max: 100 }, "ops")
        .await
        .unwrap();
    clock.advance(Duration::from_secs(4 * 60)).unwrap();
    assert!(t.ferry.fire_due_ticks(10).await.unwrap().is_empty());
    clock.advance(Duration::from_secs(16 * 60)).unwrap();
    t.ferry.fire_due_ticks(10).await.unwrap();
    assert_eq!(
        tick_runs(&t, "acme", "five").await,
        [T0 + 300_000, T0 + 600_000, T0 + 900_000, T0 + 1_200_000]
    );
}

async fn schedule_changes_are_audited_and_bad_ones_refused(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    let f = &t.ferry;
    assert_eq!(
        f.schedule("s", every_minute(), template("acme"), Missed::Skip, "ops")
            .await
            .unwrap(),
        ScheduleChange::Created
    );
    assert_eq!(
        f.schedule("s", every_minute(), template("acme"), Missed::Skip, "ops")
            .await
            .unwrap(),
        ScheduleChange::Unchanged
    );
    let changed = template("acme").queue("other");
    assert_eq!(
        f.schedule("s", every_minute(), changed, Missed::Skip, "ops")
            .await
            .unwrap(),
        ScheduleChange::Updated
    );
    // A new interval re-anchors at now: no tick of it before now fires.
    clock.advance(Duration::from_secs(90)).unwrap();
    let hourly = Every::interval(Duration::from_secs(3600)).unwrap();
    assert_eq!(
        f.schedule("s", hourly, template("acme"), Missed::Skip, "ops")
            .await
            .unwrap(),
        ScheduleChange::Updated
    );
    let s = f.operator().list_schedules(None).await.unwrap().remove(0);
    assert_eq!(s.next_tick.get(), T0 + 3_600_000);
    assert!(
        f.fire_due_ticks(10).await.unwrap().is_empty(),
        "the minute ticks of the old spec are gone"
    );
    assert_eq!(
        (audits(&t, "schedule.create").await, audits(&t, "schedule.update").await),
        (1, 2)
    );

    let before = t.scalar("SELECT COUNT(*) FROM ferry_audit").await;
    let refusals = [
        f.schedule(
            "bad",
            every_minute(),
            template("acme").delay(MINUTE),
            Missed::Skip,
            "ops",
        )
        .await
        .unwrap_err(),
        f.schedule(
            "bad",
            every_minute(),
            template("acme"),
            Missed::CatchUp { max: 0 },
            "ops",
        )
        .await
        .unwrap_err(),
        f.schedule("bad name!", every_minute(), template("acme"), Missed::Skip, "ops")
            .await
            .unwrap_err(),
        f.schedule("bad", every_minute(), template("bad tenant!"), Missed::Skip, "ops")
            .await
            .unwrap_err(),
        Every::cron("61 * * * *").unwrap_err(),
        Every::interval(Duration::from_millis(10)).unwrap_err(),
    ];
    for e in &refusals {
        assert_eq!(e.code(), "invalid_input", "{e}");
    }
    assert_eq!(
        t.scalar("SELECT COUNT(*) FROM ferry_audit").await,
        before,
        "nothing audited"
    );
    assert_eq!(
        t.scalar("SELECT COUNT(*) FROM ferry_schedules").await,
        1,
        "nothing written"
    );

    assert!(f.operator().unschedule("acme", "s", "ops", "retired").await.unwrap());
    assert!(!f.operator().unschedule("acme", "s", "ops", "retired").await.unwrap());
    assert_eq!(audits(&t, "schedule.delete").await, 1);
    clock.advance(Duration::from_secs(7200)).unwrap();
    assert!(
        f.fire_due_ticks(10).await.unwrap().is_empty(),
        "a dropped schedule never fires"
    );
}

/// Several processes (pools) fire the same schedules at once, round after
/// round: every tick is accepted exactly once.
async fn concurrent_firers_accept_each_tick_once(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    for (tenant, name) in [("acme", "a"), ("acme", "b"), ("other", "a")] {
        t.ferry
            .schedule(
                name,
                every_minute(),
                template(tenant),
                Missed::CatchUp { max: 5 },
                "ops",
            )
            .await
            .unwrap();
    }
    let mut firers = Vec::new();
    for _ in 0..4 {
        firers.push(t.reopen().await);
    }
    let rounds = 6;
    let mut fired_total = 0;
    for round in 0..rounds {
        // Some rounds miss ticks, caught up by whoever wins.
        clock.advance(if round % 2 == 0 { MINUTE } else { 2 * MINUTE }).unwrap();
        let barrier = Arc::new(Barrier::new(firers.len()));
        let handles: Vec<_> = firers
            .iter()
            .cloned()
            .map(|f| {
                let barrier = barrier.clone();
                tokio::spawn(async move {
                    barrier.wait().await;
                    f.fire_due_ticks(10).await.unwrap()
                })
            })
            .collect();
        for h in handles {
            let fired = h.await.unwrap();
            assert!(fired.iter().all(|f| !f.accepted.replay), "a loser accepts nothing");
            fired_total += fired.len();
        }
    }
    let ticks_per_schedule = 9; // 3 rounds of one minute, 3 of two
    assert_eq!(fired_total, 3 * ticks_per_schedule);
    for (tenant, name) in [("acme", "a"), ("acme", "b"), ("other", "a")] {
        let ticks = tick_runs(&t, tenant, name).await;
        let expected: Vec<i64> = (1..=ticks_per_schedule as i64).map(|k| T0 + k * 60_000).collect();
        assert_eq!(ticks, expected, "{tenant}/{name}: each tick once");
    }
}

/// The scheduler loop fires before it waits, so a shutdown that is already
/// complete lets exactly one round run.
async fn the_scheduler_loop_fires_due_ticks(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    t.ferry
        .schedule("s", every_minute(), template("acme"), Missed::Skip, "ops")
        .await
        .unwrap();
    clock.advance(MINUTE).unwrap();
    t.ferry.run_scheduler(Duration::from_secs(1), async {}).await.unwrap();
    assert_eq!(tick_runs(&t, "acme", "s").await, [T0 + 60_000]);
    assert_eq!(
        t.ferry
            .run_scheduler(Duration::ZERO, async {})
            .await
            .unwrap_err()
            .code(),
        "invalid_input"
    );
}

async fn a_template_keeps_its_priority(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    let f = &t.ferry;
    let urgent = || template("acme").priority(90);
    assert_eq!(
        f.schedule("s", every_minute(), urgent(), Missed::Skip, "ops")
            .await
            .unwrap(),
        ScheduleChange::Created
    );
    clock.advance(MINUTE).unwrap();
    assert_eq!(f.fire_due_ticks(10).await.unwrap().len(), 1);
    assert_eq!(
        t.scalar("SELECT CAST(priority AS BIGINT) FROM jobs").await,
        90,
        "the tick's job has the template's priority"
    );
    assert_eq!(
        f.schedule("s", every_minute(), urgent(), Missed::Skip, "ops")
            .await
            .unwrap(),
        ScheduleChange::Unchanged
    );
    assert_eq!(
        f.schedule("s", every_minute(), urgent().priority(10), Missed::Skip, "ops")
            .await
            .unwrap(),
        ScheduleChange::Updated,
        "a new priority alone is a change"
    );
    assert_eq!(audits(&t, "schedule.update").await, 1);
}

/// Inserts schedule `name` of acme by SQL, due at T0 (before any registered
/// one), with `template` as stored.
async fn insert_due_schedule(t: &TestDb, name: &str, template: &str) {
    t.exec(&format!(
        "INSERT INTO ferry_schedules (tenant, name, spec, template, missed, catch_up_max, anchor_at, last_tick, \
         next_tick, version, created_at, updated_at) VALUES ('acme', '{name}', 'every:60000', '{template}', 'skip', 1, \
         {a}, NULL, {T0}, 1, {a}, {a})",
        a = T0 - 60_000
    ))
    .await
    .unwrap();
}

async fn refused_and_unreadable_schedules_do_not_starve_the_others(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    t.ferry
        .schedule("good", every_minute(), template("acme"), Missed::Skip, "ops")
        .await
        .unwrap();
    // Most overdue, and never firing: a template this version cannot read,
    // and one whose runs are refused (no attempts).
    insert_due_schedule(&t, "unreadable", r#"{"nonsense": true}"#).await;
    insert_due_schedule(
        &t,
        "refused",
        r#"{"operation": "report", "schema_version": 1, "command": {}, "queue": "reports", "max_attempts": 0, "deadline_ms": null}"#,
    )
    .await;
    for round in 1..=3 {
        clock.advance(MINUTE).unwrap();
        let fired = t.ferry.fire_due_ticks(1).await.unwrap();
        let names: Vec<&str> = fired.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["good"], "round {round}");
    }
    clock.advance(MINUTE).unwrap();
    let fired = t.ferry.fire_due_ticks(10).await.unwrap();
    assert_eq!(fired.len(), 1, "an unreadable row does not fail the others' read");
    assert_eq!(tick_runs(&t, "acme", "good").await.len(), 4);
    assert_eq!(
        t.scalar("SELECT COUNT(*) FROM runs").await,
        4,
        "the broken ones accepted nothing"
    );
    let stuck = t
        .scalar(&format!("SELECT COUNT(*) FROM ferry_schedules WHERE next_tick = {T0}"))
        .await;
    assert_eq!(stuck, 2, "the broken ones stay due, retried at each call");
}

async fn a_name_whose_tick_keys_exceed_the_key_limit_is_refused(kind: Kind) {
    let t = TestDb::new(kind).await;
    let limits = ferry::Limits {
        max_key_bytes: 40,
        ..Default::default()
    };
    let f = ferry::Ferry::builder(&t.url).limits(limits).connect().await.unwrap();
    // "schedule:<20 bytes>:0" fits in 40 bytes; a real tick's key does not.
    let name = "n".repeat(20);
    let e = f
        .schedule(&name, every_minute(), template("acme"), Missed::Skip, "ops")
        .await
        .unwrap_err();
    assert_eq!(e.code(), "invalid_input", "{e}");
    assert_eq!(t.scalar("SELECT COUNT(*) FROM ferry_schedules").await, 0);
}

on_every_route!(
    refused_and_unreadable_schedules_do_not_starve_the_others,
    a_name_whose_tick_keys_exceed_the_key_limit_is_refused,
    a_template_keeps_its_priority,
    ticks_fire_once_and_missed_ticks_follow_the_policy,
    cron_schedules_tick_on_their_expression,
    schedule_changes_are_audited_and_bad_ones_refused,
    concurrent_firers_accept_each_tick_once,
    the_scheduler_loop_fires_due_ticks,
);
