//! `doctor` finds seeded faults of each kind, on both engines, and nothing on
//! a healthy database. The relay-side checks run as the real binary with
//! `--strict`, each test seeding one fault on a fresh database and reading
//! the check's lines and the exit status; the WAL slot check makes a real
//! (inactive) logical replication slot on the shared cluster, under a name
//! of its own, and drops it again.

use std::process::{Command, Output};
use std::time::Duration;

use ferry::{NewRun, OutboxMessage, Reservation};
use ferry_cli::doctor::Finding;
use ferry_relay::store::RelayStore;
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
    let unreclaimed = f.iter().find(|x| x.check == "unreclaimed_leases").unwrap();
    assert_eq!(unreclaimed.runbook, Some("docs/runbook.md#job-leases-unreclaimed"));
    assert_eq!(items(&f, "exhausted_unterminated").len(), 1);
    assert!(items(&f, "exhausted_unterminated")[0].contains("mail"));
    assert!(f.iter().all(|x| !x.action.is_empty()));
}

async fn every_doctor_query_prepares(kind: Kind) {
    let t = TestDb::new(kind).await;
    ferry_cli::doctor::check_queries(&t.ferry).await.unwrap();
}

/// The relay-side checks `ferry doctor` runs on both engines.
const RELAY_CHECKS: [&str; 4] = [
    "outbox_dead_rows",
    "outbox_backlog_old",
    "no_live_relay",
    "lanes_unowned",
];

/// The WAL capture checks: `[ok]` on PostgreSQL without a bad slot,
/// `[skip]` on SQLite.
const WAL_CHECKS: [&str; 5] = [
    "wal_slot_inactive",
    "wal_slot_lag",
    "wal_slot_wal_status",
    "wal_slot_not_synchronized",
    "wal_keep_size_unbounded",
];

/// `ferry doctor --strict` run as the real binary on the test's database.
fn doctor(t: &TestDb) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(["doctor", "--strict", "--database-url", &t.url])
        .output()
        .expect("the ferry binary runs")
}

/// The block of `check` in the doctor's output: its `[status] check` line
/// and the indented lines under it.
fn block<'a>(out: &'a str, check: &str) -> Vec<&'a str> {
    let mut lines = out.lines().skip_while(|l| {
        l.split_once("] ")
            .is_none_or(|(_, rest)| rest != check && !rest.starts_with(&format!("{check}: ")))
    });
    let head = lines.next().unwrap_or_else(|| panic!("no check {check} in\n{out}"));
    std::iter::once(head)
        .chain(lines.take_while(|l| l.starts_with("    ")))
        .collect()
}

/// Asserts that `--strict` failed on exactly the checks `bad` (each
/// `[warning]`, with its runbook line) and printed `[ok]` for every other
/// relay check, the WAL ones too on PostgreSQL (`[skip]` on SQLite); returns
/// stdout.
fn assert_findings(kind: Kind, out: &Output, bad: &[&str]) -> String {
    let stdout = String::from_utf8(out.stdout.clone()).unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if bad.is_empty() {
        assert!(out.status.success(), "doctor failed: {stderr}\n{stdout}");
    } else {
        assert_eq!(out.status.code(), Some(1), "{stderr}\n{stdout}");
        assert!(
            stderr.contains(&format!("ferry: {} checks found problems", bad.len())),
            "{stderr}\n{stdout}"
        );
    }
    let pooler = block(&stdout, "transaction_pooler");
    match kind {
        Kind::Postgres => assert_eq!(pooler, ["[ok] transaction_pooler"], "{stdout}"),
        Kind::Sqlite => assert_eq!(pooler, ["[skip] transaction_pooler: SQLite has no pooler"], "{stdout}"),
    }
    for check in RELAY_CHECKS.iter().chain(&WAL_CHECKS) {
        let lines = block(&stdout, check);
        if bad.contains(check) {
            assert_eq!(lines[0], format!("[warning] {check}"), "{stdout}");
            assert!(
                lines.iter().any(|l| l.starts_with("    runbook: docs/runbook.md#")),
                "{stdout}"
            );
        } else if kind == Kind::Sqlite && WAL_CHECKS.contains(check) {
            assert_eq!(
                lines,
                [format!(
                    "[skip] {check}: SQLite has no WAL capture: its relays poll lanes"
                )],
                "{stdout}"
            );
        } else {
            assert_eq!(lines, [format!("[ok] {check}")], "{stdout}");
        }
    }
    stdout
}

/// Enqueues `n` rows of `tenant`/`topic`; returns their ids.
async fn enqueue(t: &TestDb, tenant: &str, topic: &str, n: usize) -> Vec<i64> {
    let mut ids = Vec::new();
    for i in 0..n {
        let msg = OutboxMessage::bytes(tenant, topic, format!("k{i}"), b"{}".to_vec());
        ids.push(t.ferry.enqueue(&msg).await.unwrap());
    }
    ids
}

/// A live relay, as a polling relay announces itself: its heartbeat and
/// every lane, for ten minutes.
async fn live_relay(t: &TestDb, owner: &str) -> (RelayStore, Vec<ferry_relay::store::LaneLease>) {
    let store = RelayStore::new(t.ferry.clone());
    let ttl = Duration::from_secs(600);
    store.relay_heartbeat(owner, ttl, 64).await.unwrap();
    let lanes = store.acquire_lanes(owner, ttl, 64).await.unwrap();
    assert_eq!(lanes.len(), 64);
    (store, lanes)
}

/// The lane of outbox row `id`.
async fn lane_of(t: &TestDb, id: i64) -> i32 {
    let lane = t
        .scalar(&format!("SELECT CAST(lane AS BIGINT) FROM outbox WHERE id = {id}"))
        .await;
    i32::try_from(lane).unwrap()
}

async fn doctor_is_ok_on_a_clean_database(kind: Kind) {
    let t = TestDb::new(kind).await;
    assert_findings(kind, &doctor(&t), &[]);
}

async fn doctor_reports_dead_outbox_rows(kind: Kind) {
    let t = TestDb::new(kind).await;
    let mut rows = enqueue(&t, "acme", "orders", 3).await;
    rows.extend(enqueue(&t, "beta", "payments", 2).await);
    let (store, lanes) = live_relay(&t, "relay-a").await;
    for (n, id) in rows.into_iter().enumerate() {
        let lane = lane_of(&t, id).await;
        let lease = *lanes.iter().find(|l| l.lane == lane).unwrap();
        let code = if n < 3 {
            "message_too_large"
        } else {
            "topic_authorization_failed"
        };
        store.mark_dead("relay-a", lease, id, code).await.unwrap();
    }
    let out = assert_findings(kind, &doctor(&t), &["outbox_dead_rows"]);
    let lines = block(&out, "outbox_dead_rows");
    assert_eq!(
        lines[1..4],
        [
            "    outbox: 5 dead rows (the broker refused them for good)",
            "    acme/orders: 3 dead rows (message_too_large)",
            "    beta/payments: 2 dead rows (topic_authorization_failed)",
        ],
        "{out}"
    );
    assert!(lines[4].contains("`ferry dead list`") && lines[4].contains("`ferry dead replay --reason"));
    assert_eq!(lines[5], "    runbook: docs/runbook.md#outbox-dead-rows");
}

async fn doctor_reports_an_old_pending_row(kind: Kind) {
    let t = TestDb::new(kind).await;
    enqueue(&t, "acme", "orders", 2).await;
    live_relay(&t, "relay-a").await;
    // A relay holds every lane and the rows are fresh: nothing to report.
    assert_findings(kind, &doctor(&t), &[]);
    // One row committed two minutes ago and still pending: its lane is stuck.
    t.exec("UPDATE outbox SET created_at = created_at - 120000 WHERE id = (SELECT min(id) FROM outbox)")
        .await
        .unwrap();
    let out = assert_findings(kind, &doctor(&t), &["outbox_backlog_old"]);
    let lines = block(&out, "outbox_backlog_old");
    let waited: f64 = lines[1]
        .strip_prefix("    outbox: the oldest pending row has waited ")
        .and_then(|l| l.strip_suffix("s (more than 60.0s); 2 rows pending"))
        .unwrap_or_else(|| panic!("{out}"))
        .parse()
        .unwrap();
    assert!(waited >= 120.0, "{out}");
    assert_eq!(lines[3], "    runbook: docs/runbook.md#outbox-backlog-old");
}

/// Rows the delivered-ranges ledger covers (`outbox_delivered`, written by
/// WAL capture; inserted here directly) are delivered: however old, they
/// make no `outbox_backlog_old`; an old uncovered row between two ranges
/// does, counted alone.
async fn doctor_reads_the_backlog_through_the_delivered_ledger(kind: Kind) {
    let t = TestDb::new(kind).await;
    let ids = enqueue(&t, "acme", "orders", 5).await;
    live_relay(&t, "relay-a").await;
    t.exec("UPDATE outbox SET created_at = created_at - 120000")
        .await
        .unwrap();
    for (lo, hi) in [(ids[0], ids[1]), (ids[3], ids[4])] {
        t.exec(&format!(
            "INSERT INTO outbox_delivered (lo, hi, delivered_at) VALUES ({lo}, {hi}, 1)"
        ))
        .await
        .unwrap();
    }
    let out = assert_findings(kind, &doctor(&t), &["outbox_backlog_old"]);
    let lines = block(&out, "outbox_backlog_old");
    assert!(lines[1].ends_with("s (more than 60.0s); 1 rows pending"), "{out}");
    t.exec(&format!(
        "INSERT INTO outbox_delivered (lo, hi, delivered_at) VALUES ({0}, {0}, 1)",
        ids[2]
    ))
    .await
    .unwrap();
    assert_findings(kind, &doctor(&t), &[]);
}

/// Rows the ledger covers wait for no relay: with no relay live, neither
/// `no_live_relay` nor `lanes_unowned` counts them.
async fn covered_rows_wait_in_no_lane(kind: Kind) {
    let t = TestDb::new(kind).await;
    let ids = enqueue(&t, "acme", "orders", 3).await;
    t.exec(&format!(
        "INSERT INTO outbox_delivered (lo, hi, delivered_at) VALUES ({}, {}, 1)",
        ids[0], ids[2]
    ))
    .await
    .unwrap();
    assert_findings(kind, &doctor(&t), &[]);
}

async fn doctor_reports_pending_rows_without_a_live_relay(kind: Kind) {
    let t = TestDb::new(kind).await;
    let id = enqueue(&t, "acme", "orders", 3).await[0];
    let lane = lane_of(&t, id).await;
    // Nobody polls: no live relay, and the rows' lane has no owner either.
    let out = assert_findings(kind, &doctor(&t), &["no_live_relay", "lanes_unowned"]);
    let lines = block(&out, "no_live_relay");
    assert_eq!(
        lines[1],
        "    outbox: 3 pending rows and no live relay (no relay heartbeat, no lane held, no WAL slot streaming)",
        "{out}"
    );
    assert_eq!(lines[3], "    runbook: docs/runbook.md#no-live-relay");
    assert!(block(&out, "lanes_unowned")[1].starts_with(&format!("    lane {lane}: ")));
    // A relay heartbeats and takes the lanes: all is well.
    live_relay(&t, "relay-a").await;
    assert_findings(kind, &doctor(&t), &[]);
}

async fn doctor_reports_an_unowned_lane_with_pending_rows(kind: Kind) {
    let t = TestDb::new(kind).await;
    let id = enqueue(&t, "acme", "orders", 1).await[0];
    let lane = lane_of(&t, id).await;
    // A live relay holds every lane but the row's (it gave it back).
    let (store, lanes) = live_relay(&t, "relay-a").await;
    let lease = *lanes.iter().find(|l| l.lane == lane).unwrap();
    assert!(store.release_lane("relay-a", lease).await.unwrap());
    let out = assert_findings(kind, &doctor(&t), &["lanes_unowned"]);
    let lines = block(&out, "lanes_unowned");
    assert!(
        lines[1].starts_with(&format!("    lane {lane}: 1 pending rows wait, the oldest for "))
            && lines[1].ends_with(" s; no relay holds the lane"),
        "{out}"
    );
    assert_eq!(lines[3], "    runbook: docs/runbook.md#lanes-unowned");
}

on_both_engines!(
    doctor_finds_seeded_faults,
    every_doctor_query_prepares,
    doctor_is_ok_on_a_clean_database,
    doctor_reports_dead_outbox_rows,
    doctor_reports_an_old_pending_row,
    doctor_reads_the_backlog_through_the_delivered_ledger,
    covered_rows_wait_in_no_lane,
    doctor_reports_pending_rows_without_a_live_relay,
    doctor_reports_an_unowned_lane_with_pending_rows,
);

/// Drops a replication slot when the test ends, passed or not: a slot left
/// on the shared cluster would hold its WAL for ever.
struct DropSlot {
    url: String,
    slot: String,
}

impl Drop for DropSlot {
    fn drop(&mut self) {
        let (url, slot) = (self.url.clone(), self.slot.clone());
        let dropped = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            rt.block_on(async {
                let pool = sqlx::PgPool::connect(&url).await?;
                sqlx::query(
                    "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1",
                )
                .bind(&slot)
                .execute(&pool)
                .await?;
                Ok::<_, sqlx::Error>(())
            })
            .map_err(std::io::Error::other)
        })
        .join();
        if !std::thread::panicking() {
            dropped.expect("the drop thread ran").expect("the slot is dropped");
        }
    }
}

/// Through the test PgBouncer in transaction pooling, the doctor's probe
/// finds one connection's statements served by several server sessions
/// (or another connection's transaction on the session it just used), and
/// says Ferry needs a direct URL or `pgbouncer=true`; the same database
/// reached directly is fine. The real binary prints only that finding and
/// fails `--strict`; with `pgbouncer=true` in the URL every check runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_finds_a_pooler_in_transaction_mode() {
    let (direct, pooled) = ferry_testkit::fresh_database_behind_pgbouncer().await.unwrap();
    let f = ferry_cli::doctor::transaction_pooler(&direct).await.unwrap();
    assert_eq!(f.status(), "ok", "{f:?}");
    let f = ferry_cli::doctor::transaction_pooler(&pooled).await.unwrap();
    assert_eq!(f.status(), "critical", "{f:?}");
    assert!(f.items[0].contains("served by server sessions"), "{f:?}");
    let out = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(["doctor", "--strict", "--database-url", &pooled])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}\n{stdout}");
    let lines = block(&stdout, "transaction_pooler");
    assert_eq!(lines[0], "[critical] transaction_pooler", "{stdout}");
    assert!(lines.iter().any(|l| l.contains("direct URL")), "{stdout}");
    assert_eq!(
        stdout.lines().filter(|l| l.starts_with('[')).count(),
        1,
        "no other check runs: {stdout}"
    );
    // Declared (`pgbouncer=true`), the pooler is served as one: the check
    // passes and the other checks run through it.
    ferry::Ferry::builder(&direct).migrate(true).connect().await.unwrap();
    let declared = format!("{pooled}?pgbouncer=true");
    let f = ferry_cli::doctor::transaction_pooler(&declared).await.unwrap();
    assert_eq!(f.status(), "ok", "{f:?}");
    let out = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(["doctor", "--database-url", &declared])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}\n{stdout}");
    assert_eq!(
        block(&stdout, "transaction_pooler"),
        ["[ok] transaction_pooler"],
        "{stdout}"
    );
    assert!(
        stdout.lines().filter(|l| l.starts_with('[')).count() > 5,
        "the other checks run: {stdout}"
    );
}

/// A Ferry slot (made as the relay makes one: registered in
/// `relay_wal_slots`, then `pg_create_logical_replication_slot`) that no
/// walsender streams from is `wal_slot_inactive`, and no lane is expected
/// to be held (`lanes_unowned` skips).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_reports_an_inactive_wal_slot() {
    let t = TestDb::new(Kind::Postgres).await;
    let slot = format!("ferry_doctor_{}", uuid::Uuid::now_v7().simple());
    let _drop = DropSlot {
        url: ferry_testkit::postgres_url(),
        slot: slot.clone(),
    };
    assert!(RelayStore::new(t.ferry.clone())
        .create_wal_slot(&slot, false, std::future::pending())
        .await
        .unwrap());
    // The shared cluster may leave max_slot_wal_keep_size unbounded: then
    // its check warns about the slot as well.
    let unbounded = t.ferry.operator().wal_keep_size().await.unwrap().is_none();
    let out = doctor(&t);
    let stdout = String::from_utf8(out.stdout.clone()).unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let problems = if unbounded { 2 } else { 1 };
    assert_eq!(out.status.code(), Some(1), "{stderr}\n{stdout}");
    assert!(
        stderr.contains(&format!("ferry: {problems} checks found problems")),
        "{stderr}\n{stdout}"
    );
    let lines = block(&stdout, "wal_slot_inactive");
    assert_eq!(lines[0], "[warning] wal_slot_inactive", "{stdout}");
    assert!(lines[1].starts_with(&format!("    {slot}: inactive, lag ")), "{stdout}");
    assert!(
        lines[2].contains("ferry-relay run --capture wal --slot <slot>"),
        "{stdout}"
    );
    assert_eq!(lines[3], "    runbook: docs/runbook.md#wal-slot-inactive");
    assert_eq!(
        block(&stdout, "lanes_unowned"),
        ["[skip] lanes_unowned: WAL capture: the relays stream from a slot and hold no lanes"],
        "{stdout}"
    );
    for check in [
        "outbox_dead_rows",
        "outbox_backlog_old",
        "no_live_relay",
        "wal_slot_lag",
        "wal_slot_wal_status",
    ] {
        assert_eq!(block(&stdout, check), [format!("[ok] {check}")], "{stdout}");
    }
}
