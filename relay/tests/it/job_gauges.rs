//! The job gauges the relay refreshes beside its table gauges
//! (`ferry_jobs_*{queue}`), on both engines: jobs accepted, claimed and
//! failed through the library under an injected clock, then one refresh
//! and the rendered values.

use std::time::Duration;

use ferry::jobs::FailOutcome;
use ferry::{Engine, JobError, NewRun, RetryPolicy};
use ferry_relay::Relay;
use ferry_testkit::{manual_clock, on_both_engines, TestDb};
use rand::SeedableRng;
use serde_json::json;

use crate::support::relay_config;

/// The value of `name{queue="<queue>"}` in a rendering, if present.
fn gauge(rendered: &str, name: &str, queue: &str) -> Option<f64> {
    let prefix = format!("{name}{{queue=\"{queue}\"}} ");
    rendered
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map(|v| v.trim().parse().expect("a number"))
}

/// Queue `mail`: two jobs due for 150 s and one whose lease expired 50 s
/// ago; queue `payments`: a job whose lease expired on its last attempt
/// (nothing claims there to make it dead, and it is neither queued nor
/// dead: it must still show); queue `billing`: one job dead on its retry
/// budget. A queue whose
/// jobs all end is dropped from the gauges at the next refresh.
async fn the_job_gauges_show_the_oldest_due_job_expired_leases_and_dead_jobs(engine: Engine) {
    let clock = manual_clock();
    let t = TestDb::with_clock(engine, clock.clone()).await;
    let ferry = &t.ferry;
    for key in ["m1", "m2", "m3"] {
        ferry
            .create_run_idempotent(NewRun::new("acme", "send", key, json!({})).queue("mail"))
            .await
            .unwrap();
    }
    ferry
        .create_run_idempotent(
            NewRun::new("acme", "charge", "b1", json!({}))
                .queue("billing")
                .max_attempts(1),
        )
        .await
        .unwrap();
    ferry
        .create_run_idempotent(
            NewRun::new("acme", "pay", "p1", json!({}))
                .queue("payments")
                .max_attempts(1),
        )
        .await
        .unwrap();
    clock.advance(Duration::from_secs(90)).unwrap();
    let jobs = ferry.jobs();
    let paying = jobs.claim("payments", "w1", Duration::from_secs(10), 1).await.unwrap();
    assert_eq!(paying.len(), 1);
    let charge = jobs
        .claim("billing", "w1", Duration::from_secs(30), 1)
        .await
        .unwrap()
        .pop()
        .expect("the billing job is due");
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let outcome = jobs
        .fail(
            &charge.lease,
            &JobError::retryable("card_declined"),
            &RetryPolicy::default(),
            &mut rng,
        )
        .await
        .unwrap();
    assert!(matches!(outcome, FailOutcome::Dead { .. }), "{outcome:?}");
    // A high-priority job accepted now sorts first in claim order, far
    // ahead of the older ones: the oldest due job must still be found.
    ferry
        .create_run_idempotent(
            NewRun::new("acme", "send", "urgent", json!({}))
                .queue("mail")
                .priority(100),
        )
        .await
        .unwrap();
    let claimed = jobs.claim("mail", "w1", Duration::from_secs(10), 1).await.unwrap();
    assert_eq!(claimed.len(), 1);
    clock.advance(Duration::from_secs(60)).unwrap();

    let relay = Relay::new(relay_config(&t.url, "127.0.0.1:1"), ferry.clone()).unwrap();
    let state = relay.state();
    state.refresh_gauges().await;
    let m = state.metrics.render();
    assert_eq!(
        gauge(&m, "ferry_jobs_oldest_due_age_seconds", "mail"),
        Some(150.0),
        "{m}"
    );
    assert_eq!(gauge(&m, "ferry_jobs_expired_leases", "mail"), Some(1.0), "{m}");
    assert_eq!(gauge(&m, "ferry_jobs_dead", "mail"), Some(0.0), "{m}");
    assert_eq!(
        gauge(&m, "ferry_jobs_oldest_due_age_seconds", "billing"),
        Some(0.0),
        "{m}"
    );
    assert_eq!(gauge(&m, "ferry_jobs_expired_leases", "billing"), Some(0.0), "{m}");
    assert_eq!(gauge(&m, "ferry_jobs_dead", "billing"), Some(1.0), "{m}");
    assert_eq!(gauge(&m, "ferry_jobs_expired_leases", "payments"), Some(1.0), "{m}");
    assert_eq!(gauge(&m, "ferry_jobs_dead", "payments"), Some(0.0), "{m}");

    // Every mail job completed (the expired lease reclaimed with them):
    // mail reports nothing any more; the dead billing job stays.
    for c in jobs.claim("mail", "w2", Duration::from_secs(30), 4).await.unwrap() {
        jobs.complete(&c.lease, &json!({})).await.unwrap();
    }
    state.refresh_gauges().await;
    let m = state.metrics.render();
    assert_eq!(gauge(&m, "ferry_jobs_oldest_due_age_seconds", "mail"), None, "{m}");
    assert_eq!(gauge(&m, "ferry_jobs_dead", "billing"), Some(1.0), "{m}");
}

on_both_engines!(the_job_gauges_show_the_oldest_due_job_expired_leases_and_dead_jobs);
