//! `ferry queue pause|resume|limits` change what the claim does, and `ferry
//! queue events` whether a queue's run events reach the outbox; each audits
//! the actor and reason, on both engines.

use std::time::Duration;

use clap::Parser;
use ferry::NewRun;
use ferry_cli::commands::{run, Cli};
use serde_json::json;

use ferry::Engine as Kind;
use ferry_testkit::{manual_clock, on_both_engines, TestDb};

async fn ferry_cmd(t: &TestDb, args: &[&str]) {
    let mut argv = vec!["ferry"];
    argv.extend_from_slice(args);
    argv.extend_from_slice(&["--database-url", &t.url]);
    run(Cli::try_parse_from(argv).unwrap()).await.unwrap();
}

async fn queue_commands_change_the_claim_and_are_audited(kind: Kind) {
    let t = TestDb::with_clock(kind, manual_clock()).await;
    for i in 0..5 {
        let run = NewRun::new("acme", "work", format!("k{i}"), json!({})).queue("mail");
        t.ferry.create_run_idempotent(run).await.unwrap();
    }
    let lease = Duration::from_secs(60);
    ferry_cmd(
        &t,
        &[
            "queue",
            "pause",
            "--queue",
            "mail",
            "--actor",
            "alice",
            "--reason",
            "smtp down",
        ],
    )
    .await;
    assert!(t.ferry.jobs().claim("mail", "w", lease, 10).await.unwrap().is_empty());
    ferry_cmd(
        &t,
        &[
            "queue", "resume", "--queue", "mail", "--actor", "alice", "--reason", "smtp up",
        ],
    )
    .await;
    ferry_cmd(
        &t,
        &[
            "queue",
            "limits",
            "--queue",
            "mail",
            "--max-leased",
            "2",
            "--rate-burst",
            "5",
            "--rate-every",
            "1s",
            "--actor",
            "bob",
            "--reason",
            "provider quota",
        ],
    )
    .await;
    assert_eq!(t.ferry.jobs().claim("mail", "w", lease, 10).await.unwrap().len(), 2);
    ferry_cmd(&t, &["queue", "list"]).await;
    let listed = t.ferry.operator().list_queues().await.unwrap();
    assert_eq!(
        (listed[0].limits.max_leased, listed[0].tokens, listed[0].leased),
        (Some(2), 3, 2)
    );
    let sql = "SELECT actor || ' ' || action || ' ' || subject || ' ' || reason FROM ferry_audit ORDER BY id";
    let audit: Vec<String> = match t.ferry.db() {
        ferry::Db::Postgres(p) => sqlx::query_scalar(sql).fetch_all(p).await.unwrap(),
        ferry::Db::Sqlite(p) => sqlx::query_scalar(sql).fetch_all(p).await.unwrap(),
    };
    assert_eq!(
        audit,
        [
            "alice queue.pause mail smtp down",
            "alice queue.resume mail smtp up",
            "bob queue.limits mail provider quota (max_leased=2 max_leased_per_tenant=none rate=5 per 1000 ms)",
        ]
    );
    // A rate needs both halves; a zero limit is refused and changes nothing.
    assert!(Cli::try_parse_from([
        "ferry",
        "queue",
        "limits",
        "--queue",
        "mail",
        "--rate-burst",
        "5",
        "--reason",
        "x"
    ])
    .is_err());
    let zero = Cli::try_parse_from([
        "ferry",
        "queue",
        "limits",
        "--queue",
        "mail",
        "--max-leased",
        "0",
        "--actor",
        "bob",
        "--reason",
        "oops",
        "--database-url",
        &t.url,
    ])
    .unwrap();
    assert_eq!(run(zero).await.unwrap_err().code(), "invalid_input");
    assert_eq!(t.scalar("SELECT count(*) FROM ferry_audit").await, 3);
}

async fn queue_events_turns_a_queues_outbox_rows_off_and_on(kind: Kind) {
    let t = TestDb::with_clock(kind, manual_clock()).await;
    let events = |publish: &'static str| {
        [
            "queue",
            "events",
            "--queue",
            "thumbs",
            "--publish",
            publish,
            "--actor",
            "carol",
            "--reason",
            "internal",
        ]
    };
    ferry_cmd(&t, &events("false")).await;
    ferry_cmd(&t, &["queue", "list"]).await;
    let listed = t.ferry.operator().list_queues().await.unwrap();
    assert_eq!((listed[0].queue.as_str(), listed[0].publish_events), ("thumbs", false));
    let run = |key: &str| NewRun::new("acme", "work", key, json!({})).queue("thumbs");
    t.ferry.create_run_idempotent(run("k1")).await.unwrap();
    assert_eq!(t.scalar("SELECT count(*) FROM outbox").await, 0);
    ferry_cmd(&t, &events("true")).await;
    t.ferry.create_run_idempotent(run("k2")).await.unwrap();
    assert_eq!(t.scalar("SELECT count(*) FROM outbox").await, 1);
    assert_eq!(
        t.scalar("SELECT count(*) FROM ferry_audit WHERE action = 'queue.publish_events' AND actor = 'carol'")
            .await,
        2
    );
    // The value is required.
    assert!(Cli::try_parse_from(["ferry", "queue", "events", "--queue", "thumbs", "--reason", "x"]).is_err());
}

on_both_engines!(
    queue_commands_change_the_claim_and_are_audited,
    queue_events_turns_a_queues_outbox_rows_off_and_on,
);
