//! `ferry runs list|show` and `ferry schedules list|remove` run as the real
//! binary against a test database, on both engines.

use std::process::Command;
use std::time::Duration;

use ferry::{Every, Missed, NewRun};
use serde_json::json;

use ferry::Engine as Kind;
use ferry_testkit::{manual_clock, on_both_engines, TestDb};

/// Runs `ferry <args> --database-url <url>` and returns its stdout; panics
/// with stderr when it fails.
fn ferry(t: &TestDb, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(args)
        .args(["--database-url", &t.url])
        .output()
        .expect("the ferry binary runs");
    assert!(
        out.status.success(),
        "ferry {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

async fn runs_list_pages_and_show_prints_the_lineage(kind: Kind) {
    let clock = manual_clock();
    let t = TestDb::with_clock(kind, clock.clone()).await;
    let mut ids = Vec::new();
    for i in 0..3 {
        clock.advance(Duration::from_millis(1)).unwrap();
        let r = t
            .ferry
            .create_run_idempotent(NewRun::new("acme", "charge", format!("k{i}"), json!({})).queue("payments"))
            .await
            .unwrap();
        ids.push(r.run.run_id);
    }
    let job = t
        .ferry
        .jobs()
        .claim("payments", "worker-1", Duration::from_secs(30), 1)
        .await
        .unwrap()
        .pop()
        .unwrap();
    let mut tx = t.ferry.begin().await.unwrap();
    let child = t
        .ferry
        .enqueue_run_in(&mut tx, &job.lease, NewRun::new("acme", "ship", "ship-1", json!({})))
        .await
        .unwrap();
    t.ferry
        .jobs()
        .complete_in(&mut tx, &job.lease, &json!({}))
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let first = ferry(
        &t,
        &[
            "runs", "list", "--tenant", "acme", "--queue", "payments", "--limit", "2",
        ],
    );
    let cursor = first
        .lines()
        .find_map(|l| l.strip_prefix("next page: --cursor "))
        .unwrap_or_else(|| panic!("no cursor in {first}"))
        .to_owned();
    let second = ferry(
        &t,
        &[
            "runs", "list", "--tenant", "acme", "--queue", "payments", "--limit", "2", "--cursor", &cursor,
        ],
    );
    assert!(second.contains("last page"), "{second}");
    let listed: Vec<&str> = first
        .lines()
        .chain(second.lines())
        .filter(|l| !l.starts_with(['n', '(']))
        .collect();
    let mut newest_first = ids.clone();
    newest_first.reverse();
    assert_eq!(listed.len(), 3, "{first}{second}");
    for (line, id) in listed.iter().zip(&newest_first) {
        assert!(line.starts_with(&id.to_string()), "{line} is not {id}");
    }
    let failed = ferry(&t, &["runs", "list", "--state", "failed"]);
    assert!(failed.contains("(0 runs, last page)"), "{failed}");

    let show = ferry(&t, &["runs", "show", &job.lease.run_id.to_string(), "--tenant", "acme"]);
    for part in [
        "run_queued",
        "run_succeeded",
        "attempt 1 gen 1 worker-1",
        "outbox",
        "pending",
    ] {
        assert!(show.contains(part), "no {part} in {show}");
    }
    assert!(show.contains(&format!("child {}", child.run.run_id)), "{show}");

    t.ferry
        .schedule(
            "nightly",
            Every::cron("0 3 * * *").unwrap(),
            NewRun::new("acme", "report", "-", json!({})),
            Missed::Skip,
            "ops",
        )
        .await
        .unwrap();
    let listed = ferry(&t, &["schedules", "list", "--tenant", "acme"]);
    assert!(
        listed.contains("nightly") && listed.contains("cron 0 3 * * *"),
        "{listed}"
    );
    let removed = ferry(
        &t,
        &[
            "schedules",
            "remove",
            "nightly",
            "--tenant",
            "acme",
            "--actor",
            "ops",
            "--reason",
            "retired",
        ],
    );
    assert!(removed.contains("removed acme/nightly"), "{removed}");
    assert_eq!(
        t.scalar("SELECT COUNT(*) FROM ferry_audit WHERE action = 'schedule.delete' AND reason = 'retired'")
            .await,
        1
    );
}

on_both_engines!(runs_list_pages_and_show_prints_the_lineage);
