//! Features that live in the claim (issue #13): priorities with aging,
//! pausing queues, and limits (global, per tenant, rate), on both engines
//! with an injected clock. The same limits under eight concurrent workers
//! are in `pg.rs` (PostgreSQL: SQLite's single writer serializes claims
//! anyway, so concurrency cannot break them there).

use std::collections::BTreeMap;
use std::time::Duration;

use ferry::{Claimed, Ferry, NewRun, QueueLimits, RateLimit};
use serde_json::json;

use crate::support::{manual_clock, on_every_route, Kind, TestDb};

const LEASE: Duration = Duration::from_secs(30);

fn job(tenant: &str, key: &str) -> NewRun {
    NewRun::new(tenant, "work", key, json!({"key": key})).queue("q")
}

/// The idempotency keys of claimed jobs, in claim order.
fn keys(claimed: &[Claimed]) -> Vec<String> {
    claimed
        .iter()
        .map(|c| c.request["key"].as_str().unwrap().to_owned())
        .collect()
}

/// Claims one job at a time until none is left; their keys in claim order.
async fn claim_one_by_one(f: &Ferry) -> Vec<String> {
    let mut order = Vec::new();
    loop {
        let got = f.jobs().claim("q", "w", LEASE, 1).await.unwrap();
        if got.is_empty() {
            return order;
        }
        order.extend(keys(&got));
    }
}

/// A handle on `t`'s database with one priority level worth one second.
async fn with_aging(t: &TestDb, step: Duration) -> Ferry {
    Ferry::builder(&t.url)
        .clock(t.ferry.clock().clone())
        .priority_aging(step)
        .connect()
        .await
        .unwrap()
}

async fn audit_rows(t: &TestDb) -> Vec<(String, String, String, String)> {
    let sql = "SELECT actor, action, subject, reason FROM ferry_audit ORDER BY id";
    match t.ferry.db() {
        ferry::Db::Postgres(p) => sqlx::query_as(sql).fetch_all(p).await.unwrap(),
        ferry::Db::Sqlite(p) => sqlx::query_as(sql).fetch_all(p).await.unwrap(),
    }
}

async fn higher_priority_is_claimed_first(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    // Accepted in this order, a millisecond apart: first come is not first served.
    for (key, p) in [("low", 0), ("low2", 0), ("mid", 2), ("high", 5)] {
        t.ferry
            .create_run_idempotent(job("acme", key).priority(p))
            .await
            .unwrap();
        clock.advance(Duration::from_millis(1)).unwrap();
    }
    assert_eq!(claim_one_by_one(&t.ferry).await, ["high", "mid", "low", "low2"]);
}

async fn aging_lets_a_long_wait_overtake_a_higher_priority(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    let f = with_aging(&t, Duration::from_secs(1)).await;
    f.create_run_idempotent(job("acme", "old-p0")).await.unwrap();
    clock.advance(Duration::from_millis(2_500)).unwrap();
    // Two steps ahead is less than the 2.5 s the old job waited; three is more.
    f.create_run_idempotent(job("acme", "new-p2").priority(2))
        .await
        .unwrap();
    f.create_run_idempotent(job("acme", "new-p3").priority(3))
        .await
        .unwrap();
    assert_eq!(claim_one_by_one(&f).await, ["new-p3", "old-p0", "new-p2"]);
}

async fn the_claim_key_follows_available_at_through_retries_and_renewals(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    let f = with_aging(&t, Duration::from_secs(1)).await;
    for (key, p) in [("a", 7), ("b", 0), ("c", 100)] {
        f.create_run_idempotent(job("acme", key).priority(p)).await.unwrap();
    }
    // A lease sorts at its expiry, not ahead of it by its lead (which would
    // put unexpired leases inside the claim's index range).
    let inconsistent = "SELECT count(*) FROM jobs \
                        WHERE claim_key <> available_at - CASE WHEN state = 'queued' THEN priority * 1000 ELSE 0 END";
    let claimed = f.jobs().claim("q", "w", LEASE, 2).await.unwrap();
    assert_eq!(t.scalar(inconsistent).await, 0, "after the claim");
    clock.advance(Duration::from_secs(5)).unwrap();
    f.jobs().renew(&claimed[0].lease, LEASE).await.unwrap();
    assert_eq!(t.scalar(inconsistent).await, 0, "after a renewal");
    let policy = ferry::RetryPolicy::default();
    let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(3);
    f.jobs()
        .fail(
            &claimed[1].lease,
            &ferry::JobError::retryable("flaky"),
            &policy,
            &mut rng,
        )
        .await
        .unwrap();
    f.jobs().release(&claimed[0].lease).await.unwrap();
    assert_eq!(t.scalar(inconsistent).await, 0, "after a retry and a release");
    assert_eq!(
        t.scalar("SELECT count(*) FROM jobs WHERE priority_lead = 100000").await,
        1
    );
}

async fn a_replay_keeps_the_priority(kind: Kind) {
    let t = TestDb::new(kind).await;
    let run = t
        .ferry
        .create_run_idempotent(job("acme", "k").priority(7).max_attempts(1))
        .await
        .unwrap()
        .run;
    let c = t.ferry.jobs().claim("q", "w", LEASE, 1).await.unwrap().pop().unwrap();
    let policy = ferry::RetryPolicy::default();
    let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(3);
    t.ferry
        .jobs()
        .fail(&c.lease, &ferry::JobError::terminal("boom"), &policy, &mut rng)
        .await
        .unwrap();
    t.ferry
        .operator()
        .replay_dead("acme", run.run_id, "ops", "retry", false)
        .await
        .unwrap();
    assert_eq!(t.scalar("SELECT count(*) FROM jobs WHERE priority = 7").await, 2);
}

async fn a_priority_out_of_range_is_refused_and_writes_nothing(kind: Kind) {
    let t = TestDb::new(kind).await;
    for p in [-1, 101, i16::MAX] {
        let err = t
            .ferry
            .create_run_idempotent(job("acme", "k").priority(p))
            .await
            .unwrap_err();
        assert_eq!((err.code(), p), ("invalid_input", p), "{err}");
    }
    let batch = t
        .ferry
        .create_runs_idempotent(vec![job("acme", "bad").priority(-5), job("acme", "good").priority(100)])
        .await
        .unwrap();
    assert_eq!(batch[0].as_ref().unwrap_err().code(), "invalid_input");
    assert!(batch[1].is_ok());
    assert_eq!(t.scalar("SELECT count(*) FROM runs").await, 1);
    assert_eq!(t.scalar("SELECT count(*) FROM jobs WHERE priority = 100").await, 1);
    assert_eq!(t.scalar("SELECT count(*) FROM idempotency_keys").await, 1);
}

async fn a_paused_queue_is_not_claimed_and_its_leases_run_on(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    for i in 0..4 {
        t.ferry
            .create_run_idempotent(job("acme", &format!("k{i}")))
            .await
            .unwrap();
    }
    t.ferry
        .create_run_idempotent(NewRun::new("acme", "work", "other", json!({"key": "other"})).queue("other"))
        .await
        .unwrap();
    let held = t.ferry.jobs().claim("q", "w", LEASE, 2).await.unwrap();
    t.ferry
        .operator()
        .pause_queue("q", "alice", "incident 42")
        .await
        .unwrap();
    assert!(
        t.ferry.jobs().claim("q", "w", LEASE, 10).await.unwrap().is_empty(),
        "paused"
    );
    assert_eq!(
        t.ferry.jobs().claim("other", "w", LEASE, 10).await.unwrap().len(),
        1,
        "other queues run"
    );
    // The leases taken before the pause renew and complete; completing claims nothing.
    clock.advance(Duration::from_secs(10)).unwrap();
    t.ferry.jobs().renew(&held[0].lease, LEASE).await.unwrap();
    let items = [(held[0].lease.clone(), json!({}))];
    let (done, next) = t
        .ferry
        .jobs()
        .complete_and_claim(&items, "q", "w", LEASE, 5)
        .await
        .unwrap();
    assert!(done[0].is_ok() && next.is_empty(), "completes, claims nothing");
    t.ferry.jobs().complete(&held[1].lease, &json!({})).await.unwrap();
    // Past every lease: still nothing while paused.
    clock.advance(LEASE * 2).unwrap();
    assert!(t.ferry.jobs().claim("q", "w", LEASE, 10).await.unwrap().is_empty());
    let listed = t.ferry.operator().list_queues().await.unwrap();
    assert_eq!(
        (listed.len(), listed[0].queue.as_str(), listed[0].paused),
        (1, "q", true)
    );
    t.ferry.operator().resume_queue("q", "bob", "fixed").await.unwrap();
    assert_eq!(t.ferry.jobs().claim("q", "w", LEASE, 10).await.unwrap().len(), 2);
    assert!(!t.ferry.operator().list_queues().await.unwrap()[0].paused);
    // Bad operator input is refused and audits nothing.
    let err = t.ferry.operator().pause_queue("q", "", "why").await.unwrap_err();
    assert_eq!(err.code(), "invalid_input");
    assert_eq!(
        audit_rows(&t).await,
        vec![
            ("alice".into(), "queue.pause".into(), "q".into(), "incident 42".into()),
            ("bob".into(), "queue.resume".into(), "q".into(), "fixed".into()),
        ]
    );
}

async fn a_global_limit_caps_live_leases(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    for i in 0..6 {
        t.ferry
            .create_run_idempotent(job("acme", &format!("k{i}")))
            .await
            .unwrap();
    }
    let zero = QueueLimits {
        max_leased: Some(0),
        ..QueueLimits::default()
    };
    let err = t
        .ferry
        .operator()
        .set_queue_limits("q", zero, "ops", "try")
        .await
        .unwrap_err();
    assert_eq!(err.code(), "invalid_input");
    assert_eq!(
        t.scalar("SELECT count(*) FROM ferry_queues").await,
        0,
        "nothing written"
    );
    let two = QueueLimits {
        max_leased: Some(2),
        ..QueueLimits::default()
    };
    t.ferry
        .operator()
        .set_queue_limits("q", two, "ops", "db is hot")
        .await
        .unwrap();
    let held = t.ferry.jobs().claim("q", "w", LEASE, 10).await.unwrap();
    assert_eq!(held.len(), 2);
    assert!(
        t.ferry.jobs().claim("q", "w", LEASE, 10).await.unwrap().is_empty(),
        "at the limit"
    );
    // A completion frees a place, and a claim with completions never
    // claims past the limit either.
    let items = [(held[0].lease.clone(), json!({}))];
    let (_, next) = t
        .ferry
        .jobs()
        .complete_and_claim(&items, "q", "w", LEASE, 5)
        .await
        .unwrap();
    let next = if next.is_empty() {
        t.ferry.jobs().claim("q", "w", LEASE, 10).await.unwrap()
    } else {
        next
    };
    assert_eq!(next.len(), 1);
    assert!(t.ferry.jobs().claim("q", "w", LEASE, 10).await.unwrap().is_empty());
    // Expired leases stop counting (and their jobs are claimable again).
    clock.advance(LEASE + Duration::from_millis(1)).unwrap();
    assert_eq!(t.ferry.jobs().claim("q", "w", LEASE, 10).await.unwrap().len(), 2);
    // Lifting the limit lets the rest go.
    t.ferry
        .operator()
        .set_queue_limits("q", QueueLimits::default(), "ops", "cooled down")
        .await
        .unwrap();
    assert_eq!(t.ferry.jobs().claim("q", "w", LEASE, 10).await.unwrap().len(), 3);
    let audit = audit_rows(&t).await;
    assert_eq!(audit.len(), 2);
    assert_eq!(
        audit[0],
        (
            "ops".into(),
            "queue.limits".into(),
            "q".into(),
            "db is hot (max_leased=2 max_leased_per_tenant=none rate=none)".into()
        )
    );
}

async fn a_tenant_at_its_cap_is_skipped_not_waited_for(kind: Kind) {
    let t = TestDb::with_clock(kind, manual_clock()).await;
    // Tenant A's flood is older than B's jobs, and longer than one claim scans.
    let flood: Vec<_> = (0..150).map(|i| job("a", &format!("a{i}"))).collect();
    for r in t.ferry.create_runs_idempotent(flood).await.unwrap() {
        r.unwrap();
    }
    for i in 0..3 {
        t.ferry.create_run_idempotent(job("b", &format!("b{i}"))).await.unwrap();
    }
    let cap = QueueLimits {
        max_leased_per_tenant: Some(2),
        ..QueueLimits::default()
    };
    t.ferry
        .operator()
        .set_queue_limits("q", cap, "ops", "fair share")
        .await
        .unwrap();
    let mut by_tenant: BTreeMap<String, Vec<Claimed>> = BTreeMap::new();
    loop {
        let got = t.ferry.jobs().claim("q", "w", LEASE, 10).await.unwrap();
        if got.is_empty() {
            break;
        }
        for c in got {
            by_tenant.entry(c.lease.tenant.clone()).or_default().push(c);
        }
    }
    let counts: Vec<(&str, usize)> = by_tenant.iter().map(|(k, v)| (k.as_str(), v.len())).collect();
    assert_eq!(counts, [("a", 2), ("b", 2)], "each tenant up to its cap");
    // B's freed place goes to B's third job, not to A's flood.
    t.ferry
        .jobs()
        .complete(&by_tenant["b"][0].lease, &json!({}))
        .await
        .unwrap();
    let next = t.ferry.jobs().claim("q", "w", LEASE, 10).await.unwrap();
    assert_eq!(keys(&next), ["b2"]);
}

async fn a_rate_limit_gives_the_burst_then_one_per_interval(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    for i in 0..12 {
        t.ferry
            .create_run_idempotent(job("acme", &format!("k{i}")))
            .await
            .unwrap();
    }
    let rate = QueueLimits {
        rate: Some(RateLimit {
            burst: 3,
            every: Duration::from_secs(1),
        }),
        ..QueueLimits::default()
    };
    t.ferry
        .operator()
        .set_queue_limits("q", rate, "ops", "partner API quota")
        .await
        .unwrap();
    let lease = Duration::from_secs(3600);
    let mut claims = Vec::new();
    for step_ms in [0, 0, 999, 1, 0, 2_500, 500, 60_000, 0] {
        clock.advance(Duration::from_millis(step_ms)).unwrap();
        claims.push(t.ferry.jobs().claim("q", "w", lease, 10).await.unwrap().len());
    }
    // Full bucket; empty; not yet a second; one token; none; 2.5 intervals
    // give two (the half is kept); the kept half and 0.5 s make one; a
    // minute refills to the burst, not more; empty again.
    assert_eq!(claims, [3, 0, 0, 1, 0, 2, 1, 3, 0]);
    assert_eq!(t.ferry.operator().list_queues().await.unwrap()[0].tokens, 0);
}

async fn setting_the_same_limits_again_changes_nothing(kind: Kind) {
    let t = TestDb::with_clock(kind, manual_clock()).await;
    for i in 0..5 {
        t.ferry
            .create_run_idempotent(job("acme", &format!("k{i}")))
            .await
            .unwrap();
    }
    let hourly = |burst| QueueLimits {
        rate: Some(RateLimit {
            burst,
            every: Duration::from_secs(3600),
        }),
        ..QueueLimits::default()
    };
    t.ferry
        .operator()
        .set_queue_limits("q", hourly(2), "ops", "quota")
        .await
        .unwrap();
    assert_eq!(t.ferry.jobs().claim("q", "w", LEASE, 10).await.unwrap().len(), 2);
    // Every instance applying its limits at startup: no refill, no audit row.
    t.ferry
        .operator()
        .set_queue_limits("q", hourly(2), "ops", "startup")
        .await
        .unwrap();
    assert!(
        t.ferry.jobs().claim("q", "w", LEASE, 10).await.unwrap().is_empty(),
        "the same limits again refilled the bucket"
    );
    assert_eq!(audit_rows(&t).await.len(), 1, "the same limits again were audited");
    // A new rate keeps the tokens left (none), capped at its burst.
    t.ferry
        .operator()
        .set_queue_limits("q", hourly(3), "ops", "more")
        .await
        .unwrap();
    assert!(t.ferry.jobs().claim("q", "w", LEASE, 10).await.unwrap().is_empty());
    assert_eq!(audit_rows(&t).await.len(), 2);
}

on_every_route!(
    higher_priority_is_claimed_first,
    aging_lets_a_long_wait_overtake_a_higher_priority,
    the_claim_key_follows_available_at_through_retries_and_renewals,
    a_replay_keeps_the_priority,
    a_priority_out_of_range_is_refused_and_writes_nothing,
    a_paused_queue_is_not_claimed_and_its_leases_run_on,
    a_global_limit_caps_live_leases,
    a_tenant_at_its_cap_is_skipped_not_waited_for,
    a_rate_limit_gives_the_burst_then_one_per_interval,
    setting_the_same_limits_again_changes_nothing,
);
