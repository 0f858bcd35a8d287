//! Run inspection (`list_runs` with keyset pagination, `run_lineage`) and
//! follow-up runs (`enqueue_run_in`) on both engines, with an injected clock.

use std::collections::HashSet;
use std::time::Duration;

use ferry::{Error, JobState, Millis, NewRun, OutboxMessage, RunCursor, RunFilter, RunState};
use serde_json::json;
use uuid::Uuid;

use crate::support::{manual_clock, on_every_route, Kind, TestDb, T0};

const LEASE: Duration = Duration::from_secs(30);

fn run(tenant: &str, op: &str, queue: &str, key: &str) -> NewRun {
    NewRun::new(tenant, op, key, json!({"k": key})).queue(queue)
}

/// Every page of `filter`, in order, with `between` called after each page.
async fn all_pages(
    t: &TestDb,
    filter: &RunFilter,
    limit: u32,
    mut between: impl AsyncFnMut(usize),
) -> Vec<ferry::RunSummary> {
    let mut out = Vec::new();
    let mut cursor: Option<RunCursor> = None;
    let mut pages = 0;
    loop {
        let page = t
            .ferry
            .operator()
            .list_runs(filter, cursor.as_ref(), limit)
            .await
            .unwrap();
        assert!(page.runs.len() <= limit as usize);
        out.extend(page.runs);
        pages += 1;
        between(pages).await;
        match page.next {
            // The cursor travels as a string.
            Some(next) => cursor = Some(next.to_string().parse().unwrap()),
            None => break,
        }
    }
    out
}

async fn pages_return_every_run_once_in_order_while_runs_are_accepted(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    let mut expected = Vec::new();
    for i in 0..23 {
        // Runs share instants in threes: ties are ordered by run id.
        if i % 3 == 0 {
            clock.advance(Duration::from_millis(1)).unwrap();
        }
        let r = t
            .ferry
            .create_run_idempotent(run("acme", "charge", "q", &format!("k{i}")))
            .await
            .unwrap()
            .run;
        expected.push((r.created_at, r.run_id));
        t.ferry
            .create_run_idempotent(run("other", "charge", "q", &format!("k{i}")))
            .await
            .unwrap();
    }
    expected.sort();
    expected.reverse();
    let ferry = t.ferry.clone();
    let clock2 = clock.clone();
    let got = all_pages(&t, &RunFilter::tenant("acme"), 5, async |page| {
        // Newer runs arrive while the caller pages: no page shifts.
        clock2.advance(Duration::from_millis(1)).unwrap();
        ferry
            .create_run_idempotent(run("acme", "charge", "q", &format!("late{page}")))
            .await
            .unwrap();
    })
    .await;
    let got: Vec<_> = got.iter().map(|r| (r.created_at, r.run_id)).collect();
    assert_eq!(got, expected, "every run exactly once, newest first, ties by run id");
    // Every tenant (operators): both tenants' runs, still once each.
    let everyone = all_pages(&t, &RunFilter::default(), 7, async |_| {}).await;
    let ids: HashSet<Uuid> = everyone.iter().map(|r| r.run_id).collect();
    assert_eq!(ids.len(), everyone.len());
    assert_eq!(everyone.len() as i64, t.scalar("SELECT COUNT(*) FROM runs").await);
    assert!(everyone
        .windows(2)
        .all(|w| (w[0].created_at, w[0].run_id) > (w[1].created_at, w[1].run_id)));
}

async fn filters_narrow_by_state_queue_operation_and_time(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    let a = t
        .ferry
        .create_run_idempotent(run("acme", "charge", "payments", "a"))
        .await
        .unwrap()
        .run;
    clock.advance(Duration::from_secs(1)).unwrap();
    let b = t
        .ferry
        .create_run_idempotent(run("acme", "refund", "payments", "b"))
        .await
        .unwrap()
        .run;
    clock.advance(Duration::from_secs(1)).unwrap();
    let c = t
        .ferry
        .create_run_idempotent(run("acme", "charge", "mail", "c"))
        .await
        .unwrap()
        .run;
    t.ferry
        .create_run_idempotent(run("other", "charge", "payments", "a"))
        .await
        .unwrap();
    t.ferry.cancel("acme", b.run_id, None, "ops", "test").await.unwrap();
    let ids = |f: RunFilter| {
        let ferry = t.ferry.clone();
        async move {
            let page = ferry.operator().list_runs(&f, None, 100).await.unwrap();
            assert!(page.next.is_none());
            page.runs.into_iter().map(|r| r.run_id).collect::<Vec<_>>()
        }
    };
    assert_eq!(ids(RunFilter::tenant("acme")).await, vec![c.run_id, b.run_id, a.run_id]);
    assert_eq!(
        ids(RunFilter::tenant("acme").state(RunState::Cancelled)).await,
        vec![b.run_id]
    );
    assert_eq!(
        ids(RunFilter::tenant("acme").state(RunState::Queued)).await,
        vec![c.run_id, a.run_id]
    );
    assert_eq!(
        ids(RunFilter::tenant("acme").queue("payments")).await,
        vec![b.run_id, a.run_id]
    );
    assert_eq!(
        ids(RunFilter::tenant("acme").operation("charge")).await,
        vec![c.run_id, a.run_id]
    );
    let window = RunFilter::tenant("acme").created(
        Some(Millis::new(T0 + 1_000).unwrap()),
        Some(Millis::new(T0 + 2_000).unwrap()),
    );
    assert_eq!(ids(window).await, vec![b.run_id], "[from, before)");
    let mut cancelled_anywhere = RunFilter::default().state(RunState::Cancelled);
    assert_eq!(ids(cancelled_anywhere.clone()).await, vec![b.run_id]);
    cancelled_anywhere.operation = Some("charge".into());
    assert!(ids(cancelled_anywhere).await.is_empty());
    let page = t
        .ferry
        .operator()
        .list_runs(&RunFilter::tenant("acme"), None, 1)
        .await
        .unwrap();
    let summary = &page.runs[0];
    assert_eq!(
        (summary.queue.as_str(), summary.state, summary.job_state),
        ("mail", RunState::Queued, JobState::Queued)
    );
    assert!(page.next.is_some(), "a full page has a next cursor");
    // Bad input is a typed error.
    assert_eq!(
        t.ferry
            .operator()
            .list_runs(&RunFilter::tenant("acme"), None, 0)
            .await
            .unwrap_err()
            .code(),
        "invalid_input"
    );
    assert_eq!("nonsense".parse::<RunCursor>().unwrap_err().code(), "invalid_input");
    assert_eq!("r2.5.zz.acme".parse::<RunCursor>().unwrap_err().code(), "invalid_input");
    assert_eq!(
        format!("r2.5.{}.", Uuid::nil().simple())
            .parse::<RunCursor>()
            .unwrap_err()
            .code(),
        "invalid_input"
    );
    assert_eq!(RunFilter::tenant("bad tenant!"), RunFilter::tenant("bad tenant!"));
    assert_eq!(
        t.ferry
            .operator()
            .list_runs(&RunFilter::tenant("bad tenant!"), None, 5)
            .await
            .unwrap_err()
            .code(),
        "invalid_input"
    );
}

async fn lineage_shows_events_attempts_effects_outbox_and_children(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    let parent = t
        .ferry
        .create_run_idempotent(run("acme", "order", "q", "p"))
        .await
        .unwrap()
        .run;
    // First attempt lost, second completes with a follow-up run.
    t.ferry.jobs().claim("q", "worker-a", LEASE, 1).await.unwrap();
    clock.advance(LEASE + Duration::from_millis(1)).unwrap();
    let job = t
        .ferry
        .jobs()
        .claim("q", "worker-b", LEASE, 1)
        .await
        .unwrap()
        .pop()
        .unwrap();
    assert!(matches!(
        t.ferry
            .jobs()
            .reserve_effect(&job.lease, "pay", "psp.charge")
            .await
            .unwrap(),
        ferry::Reservation::Proceed(_)
    ));
    t.ferry
        .jobs()
        .record_effect_success(&job.lease, "pay", "psp.charge", "ch_1")
        .await
        .unwrap();
    let mut tx = t.ferry.begin().await.unwrap();
    let child = t
        .ferry
        .enqueue_run_in(&mut tx, &job.lease, run("acme", "ship", "q", "ship-p"))
        .await
        .unwrap()
        .run;
    let msg = OutboxMessage::json("acme", "orders", parent.run_id.to_string(), &json!({"paid": true})).unwrap();
    t.ferry.enqueue_in(&mut tx, &msg).await.unwrap();
    t.ferry
        .jobs()
        .complete_in(&mut tx, &job.lease, &json!({"ok": true}))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    t.exec("UPDATE outbox SET state = 'delivered', delivered_at = 1 WHERE topic = 'orders'")
        .await
        .unwrap();

    let l = t.ferry.operator().run_lineage("acme", parent.run_id).await.unwrap();
    assert_eq!(l.run.state, RunState::Succeeded);
    assert_eq!(l.summary.job_state, JobState::Succeeded);
    assert_eq!(
        l.events.iter().map(|e| e.kind.as_str()).collect::<Vec<_>>(),
        ["run_queued", "run_succeeded"]
    );
    let attempts: Vec<_> = l
        .attempts
        .iter()
        .map(|a| (a.generation, a.worker.as_str(), a.outcome.map(|o| o.as_str())))
        .collect();
    assert_eq!(
        attempts,
        [(1, "worker-a", Some("lost")), (2, "worker-b", Some("succeeded"))]
    );
    assert_eq!(l.effects.len(), 1);
    assert_eq!(l.effects[0].provider_ref.as_deref(), Some("ch_1"));
    let outbox: Vec<_> = l.outbox.iter().map(|o| (o.topic.as_str(), o.state.as_str())).collect();
    assert_eq!(
        outbox,
        [
            ("ferry.run-events", "pending"),
            ("orders", "delivered"),
            ("ferry.run-events", "pending")
        ],
        "its events' rows and the service's row keyed by it, with delivery state"
    );
    assert_eq!(l.children.iter().map(|c| c.run_id).collect::<Vec<_>>(), [child.run_id]);
    let cl = t.ferry.operator().run_lineage("acme", child.run_id).await.unwrap();
    assert_eq!(cl.run.parent_run_id, Some(parent.run_id));
    assert_eq!(cl.summary.parent_run_id, Some(parent.run_id));
    assert!(cl.children.is_empty() && cl.attempts.is_empty());
    // Tenant-scoped.
    let other = t
        .ferry
        .operator()
        .run_lineage("other", parent.run_id)
        .await
        .unwrap_err();
    assert_eq!(other.code(), "not_found");
}

async fn a_follow_up_run_exists_only_if_its_parent_completes(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    let children = "SELECT COUNT(*) FROM runs WHERE parent_run_id IS NOT NULL";
    t.ferry
        .create_run_idempotent(run("acme", "order", "q", "p"))
        .await
        .unwrap();
    let a = t
        .ferry
        .jobs()
        .claim("q", "worker-a", LEASE, 1)
        .await
        .unwrap()
        .pop()
        .unwrap();

    // The lease expires inside the handler's transaction: the follow-up was
    // accepted, complete_in is refused, and the rollback takes both.
    let mut tx = t.ferry.begin().await.unwrap();
    t.ferry
        .enqueue_run_in(&mut tx, &a.lease, run("acme", "ship", "q", "ship-p"))
        .await
        .unwrap();
    clock.advance(LEASE).unwrap();
    let refused = t
        .ferry
        .jobs()
        .complete_in(&mut tx, &a.lease, &json!({}))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), "lost_lease");
    tx.rollback().await.unwrap();
    assert_eq!(
        t.scalar(children).await,
        0,
        "the child is rolled back with the refused completion"
    );

    // A stale handler (another worker holds generation 2) creates nothing.
    let b = t
        .ferry
        .jobs()
        .claim("q", "worker-b", LEASE, 1)
        .await
        .unwrap()
        .pop()
        .unwrap();
    let mut tx = t.ferry.begin().await.unwrap();
    let stale = t
        .ferry
        .enqueue_run_in(&mut tx, &a.lease, run("acme", "ship", "q", "ship-p"))
        .await
        .unwrap_err();
    assert!(matches!(stale, Error::LostLease { .. }), "{stale}");
    tx.rollback().await.unwrap();
    assert_eq!(t.scalar(children).await, 0);

    // Wrong tenant or another parent: typed errors, nothing written.
    let mut tx = t.ferry.begin().await.unwrap();
    let foreign = t
        .ferry
        .enqueue_run_in(&mut tx, &b.lease, run("other", "ship", "q", "x"))
        .await
        .unwrap_err();
    assert_eq!(foreign.code(), "invalid_input");
    let elsewhere = run("acme", "ship", "q", "x").parent(Uuid::now_v7());
    assert_eq!(
        t.ferry
            .enqueue_run_in(&mut tx, &b.lease, elsewhere)
            .await
            .unwrap_err()
            .code(),
        "invalid_input"
    );
    tx.rollback().await.unwrap();

    // The current holder's follow-up commits with its completion, and a
    // retried handler's follow-up replays it.
    let mut tx = t.ferry.begin().await.unwrap();
    let child = t
        .ferry
        .enqueue_run_in(&mut tx, &b.lease, run("acme", "ship", "q", "ship-p"))
        .await
        .unwrap();
    let again = t
        .ferry
        .enqueue_run_in(&mut tx, &b.lease, run("acme", "ship", "q", "ship-p"))
        .await
        .unwrap();
    assert!(!child.replay && again.replay && again.run.run_id == child.run.run_id);
    t.ferry.jobs().complete_in(&mut tx, &b.lease, &json!({})).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(t.scalar(children).await, 1);
    assert_eq!(child.run.parent_run_id, Some(b.lease.run_id));
}

async fn all_tenants_pages_keep_runs_that_share_an_instant_and_an_id(kind: Kind) {
    // Run ids are unique per tenant only: one batch gives two tenants' runs
    // the same acceptance instant and the same proposed id.
    let t = TestDb::with_clock(kind, manual_clock()).await;
    let id = Uuid::now_v7();
    let out = t
        .ferry
        .create_runs_idempotent(vec![
            run("acme", "charge", "q", "k").run_id(id),
            run("zeta", "charge", "q", "k").run_id(id),
        ])
        .await
        .unwrap();
    assert!(out.iter().all(|r| r.as_ref().unwrap().run.run_id == id));
    let listed = all_pages(&t, &RunFilter::default(), 1, async |_| {}).await;
    let tenants: Vec<&str> = listed.iter().map(|r| r.tenant.as_str()).collect();
    assert_eq!(
        tenants,
        ["zeta", "acme"],
        "each tenant's run on its own page, newest tenant first"
    );
}

async fn a_child_key_held_by_another_parents_child_is_a_conflict(kind: Kind) {
    let t = TestDb::with_clock(kind, manual_clock()).await;
    for key in ["p1", "p2"] {
        t.ferry
            .create_run_idempotent(run("acme", "order", "q", key))
            .await
            .unwrap();
    }
    let mut leases = t
        .ferry
        .jobs()
        .claim("q", "w", LEASE, 2)
        .await
        .unwrap()
        .into_iter()
        .map(|c| c.lease);
    let (first, second) = (leases.next().unwrap(), leases.next().unwrap());
    let mut tx = t.ferry.begin().await.unwrap();
    let child = t
        .ferry
        .enqueue_run_in(&mut tx, &first, run("acme", "ship", "q", "ship"))
        .await
        .unwrap();
    t.ferry.jobs().complete_in(&mut tx, &first, &json!({})).await.unwrap();
    tx.commit().await.unwrap();
    // The second parent's follow-up under the same key is not a replay of
    // the first parent's child.
    let mut tx = t.ferry.begin().await.unwrap();
    let e = t
        .ferry
        .enqueue_run_in(&mut tx, &second, run("acme", "ship", "q", "ship"))
        .await
        .unwrap_err();
    tx.rollback().await.unwrap();
    assert!(
        matches!(&e, Error::IdempotencyConflict { existing_run, .. } if *existing_run == child.run.run_id),
        "{e}"
    );
    let children = "SELECT COUNT(*) FROM runs WHERE parent_run_id IS NOT NULL";
    assert_eq!(t.scalar(children).await, 1);
}

on_every_route!(
    a_child_key_held_by_another_parents_child_is_a_conflict,
    all_tenants_pages_keep_runs_that_share_an_instant_and_an_id,
    pages_return_every_run_once_in_order_while_runs_are_accepted,
    filters_narrow_by_state_queue_operation_and_time,
    lineage_shows_events_attempts_effects_outbox_and_children,
    a_follow_up_run_exists_only_if_its_parent_completes,
);
