//! PostgreSQL: `deploy/sql/roles.sql` grants each role what it needs and
//! nothing more; every role is refused outside its grant.

use std::time::Duration;

use ferry::{Ferry, NewRun, OutboxMessage};
use serde_json::json;

use ferry::Engine as Kind;
use ferry_consumer::store::ConsumerStore;
use ferry_relay::store::RelayStore;
use ferry_testkit::TestDb;

/// The URL of the same database, connected as `role`.
fn role_url(t: &TestDb, role: &str) -> String {
    t.url.replace(
        "options=-csearch_path",
        &format!("options=-crole%3D{role}%20-csearch_path"),
    )
}

/// The same database, connected as `role`.
async fn as_role(t: &TestDb, role: &str) -> Ferry {
    Ferry::builder(role_url(t, role))
        .connect()
        .await
        .unwrap_or_else(|e| panic!("connect as {role}: {e}"))
}

async fn refused(f: &Ferry, sql: &str) {
    refused_on(f.db().as_postgres().unwrap(), sql).await;
}

async fn refused_on(pool: &sqlx::PgPool, sql: &str) {
    let err = sqlx::query(sql).execute(pool).await.expect_err(sql);
    let code = err.as_database_error().and_then(|e| e.code()).map(|c| c.into_owned());
    assert_eq!(
        code.as_deref(),
        Some("42501"),
        "{sql} must be refused for lack of privilege: {err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_role_is_refused_outside_its_grant() {
    let t = TestDb::new(Kind::Postgres).await;
    let roles = include_str!("../../deploy/sql/roles.sql");
    sqlx::raw_sql(roles)
        .execute(t.ferry.db().as_postgres().unwrap())
        .await
        .expect("roles.sql applies");
    sqlx::raw_sql(roles)
        .execute(t.ferry.db().as_postgres().unwrap())
        .await
        .expect("and applies again");

    // The service accepts, enqueues and works its jobs...
    let service = as_role(&t, "ferry_service").await;
    let run = service
        .create_run_idempotent(NewRun::new("acme", "charge", "k1", json!({"a": 1})))
        .await
        .unwrap()
        .run;
    service
        .enqueue(&OutboxMessage::bytes("acme", "orders", "o-1", vec![1]))
        .await
        .unwrap();
    let c = service
        .jobs()
        .claim("default", "w", Duration::from_secs(30), 1)
        .await
        .unwrap()
        .pop()
        .unwrap();
    service.jobs().complete(&c.lease, &json!({})).await.unwrap();
    // ...reads lineage (outbox delivery state, not payloads)...
    let lineage = service.operator().run_lineage("acme", run.run_id).await.unwrap();
    assert_eq!(lineage.outbox.len(), 2, "run_queued and run_succeeded");
    // ...but cannot read, mark or delete the outbox, take lanes, or touch ledgers.
    refused(&service, "SELECT payload FROM outbox").await;
    refused(&service, "UPDATE outbox SET state = 'delivered'").await;
    refused(&service, "DELETE FROM outbox").await;
    refused(&service, "UPDATE relay_lanes SET owner = 'me'").await;
    refused(&service, "SELECT * FROM consumer_ledger").await;
    refused(&service, "DELETE FROM run_events").await;
    // Its outbox INSERT is column-limited: no state or publishing columns.
    refused(&service, "INSERT INTO outbox (tenant, topic, key, lane, payload, headers, created_at, state) VALUES ('x', 't', 'k', 0, '', '{}', 0, 'delivered')").await;
    refused(&service, "INSERT INTO outbox (tenant, topic, key, lane, payload, headers, created_at, delivered_at) VALUES ('x', 't', 'k', 0, '', '{}', 0, 0)").await;
    refused(&service, "INSERT INTO outbox (tenant, topic, key, lane, payload, headers, created_at, publish_attempts) VALUES ('x', 't', 'k', 0, '', '{}', 0, 9)").await;
    refused(&service, "INSERT INTO outbox (tenant, topic, key, lane, payload, headers, created_at, last_error) VALUES ('x', 't', 'k', 0, '', '{}', 0, 'e')").await;
    refused(&service, "SELECT * FROM ferry_audit").await;
    refused(&service, "DELETE FROM ferry_audit").await;
    refused(&service, "CREATE TABLE public.ferry_squat (x int)").await;

    // The relay reads and marks the outbox and holds lanes...
    let relay_db = as_role(&t, "ferry_relay").await;
    let relay = RelayStore::new(relay_db.clone());
    let lanes = relay
        .acquire_lanes("relay-1", Duration::from_secs(30), 64)
        .await
        .unwrap();
    relay
        .relay_heartbeat("relay-1", Duration::from_secs(30), 64)
        .await
        .unwrap();
    let mut marked = 0;
    let mut delivered = Vec::new();
    for lane in lanes {
        let ids: Vec<i64> = relay
            .pending_batch(lane.lane, 100)
            .await
            .unwrap()
            .iter()
            .map(|r| r.id)
            .collect();
        marked += relay.mark_delivered("relay-1", lane, &ids, false).await.unwrap();
        delivered.extend(ids);
    }
    assert_eq!(marked, 3, "run_queued, the order, run_succeeded");
    // WAL capture's own statements (the slot itself needs REPLICATION,
    // which these roles do not have: the relay then polls).
    assert!(!relay.wal_setting().await.unwrap().may_replicate);
    let whole = ferry_relay::store::CatchUp {
        through: i64::MAX,
        generation: 0,
        unbound: false,
    };
    assert_eq!(relay.wal_catch_up("s").await.unwrap(), Some(whole));
    assert!(relay.set_wal_slot_caught_up("s", 0).await.unwrap());
    assert_eq!(relay.wal_catch_up("s").await.unwrap(), None);
    assert!(relay.pending_after(0, i64::MAX, 10).await.unwrap().is_empty());
    assert!(relay.wal_delete_delivered(&[-1]).await.unwrap().is_empty());
    // The ledger (rows the marks above delivered: covering them again
    // changes no answer).
    assert_eq!(relay.wal_cover_delivered(&delivered, None).await.unwrap(), 3);
    assert!(relay.wal_states(&[-1]).await.unwrap().is_empty());
    // It reads the job gauges' columns (the run above has ended: no queue
    // reports)...
    assert!(relay_db.operator().queue_gauges().await.unwrap().is_empty());
    // ...and nothing else.
    refused(&relay_db, "SELECT * FROM runs").await;
    refused(&relay_db, "INSERT INTO outbox (tenant, topic, key, lane, payload, headers, created_at) VALUES ('x', 't', 'k', 0, '', '{}', 0)").await;
    refused(&relay_db, "UPDATE outbox SET payload = 'x'").await;
    refused(&relay_db, "UPDATE jobs SET state = 'queued'").await;
    refused(&relay_db, "SELECT tenant, run_id, last_error_code FROM jobs").await;
    refused(&relay_db, "SELECT * FROM consumer_ledger").await;

    // The service registers a schedule (audited) and, an hour later by its
    // clock, fires it.
    let every = ferry::Every::interval(Duration::from_secs(60)).unwrap();
    let template = NewRun::new("acme", "report", "-", json!({}));
    service
        .schedule("minutely", every, template, ferry::Missed::Skip, "deploy")
        .await
        .unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let later = Ferry::builder(role_url(&t, "ferry_service"))
        .clock(ferry::Clock::manual(ferry::Millis::new(now + 3_600_000).unwrap()))
        .connect()
        .await
        .unwrap();
    assert_eq!(later.fire_due_ticks(10).await.unwrap().len(), 1);
    // Its only DELETEs are the retention sweeps, each granted for its query...
    later.jobs().sweep_idempotency_keys(100).await.unwrap();
    service
        .jobs()
        .sweep_attempts(ferry::Millis::new(now).unwrap(), 100)
        .await
        .unwrap();
    // ...so it drops no schedule (the operator's `ferry schedules remove`).
    assert_eq!(
        service
            .operator()
            .unschedule("acme", "minutely", "svc", "test")
            .await
            .unwrap_err()
            .code(),
        "database"
    );
    refused(&service, "DELETE FROM ferry_schedules").await;

    // The consumer keeps its partitions and ledger...
    let consumer_db = as_role(&t, "ferry_consumer").await;
    let consumer = ConsumerStore::new(consumer_db.clone());
    let (lease, _) = consumer
        .acquire_partition("g", "orders", 0, "m", Duration::from_secs(30))
        .await
        .unwrap();
    let mut tx = consumer.begin().await.unwrap();
    consumer
        .begin_record(tx.conn(), &lease, "e1", 0, "applied")
        .await
        .unwrap();
    consumer.advance_offset(tx.conn(), &lease, 1).await.unwrap();
    tx.commit().await.unwrap();
    // ...and reads nothing of the runs or the outbox.
    refused(&consumer_db, "SELECT * FROM runs").await;
    refused(&consumer_db, "SELECT * FROM outbox").await;
    refused(&consumer_db, "UPDATE relay_lanes SET owner = 'me'").await;
    assert_eq!(
        t.ferry.get_run("acme", run.run_id).await.unwrap().state,
        ferry::RunState::Succeeded
    );

    // The operator cancels, replays dead jobs and dead outbox rows, audited...
    let operator = as_role(&t, "ferry_operator").await;
    let queued = service
        .create_run_idempotent(NewRun::new("acme", "charge", "k2", json!({"a": 2})))
        .await
        .unwrap()
        .run;
    let mut tx = operator.begin().await.unwrap();
    operator
        .cancel_in(tx.conn(), "acme", queued.run_id, None, "alice", "test")
        .await
        .unwrap();
    operator
        .operator()
        .audit_in(tx.conn(), "alice", "jobs.cancel", "acme/run", "test")
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let dead = service
        .create_run_idempotent(NewRun::new("acme", "charge", "k3", json!({"a": 3})).max_attempts(1))
        .await
        .unwrap()
        .run;
    let c = service
        .jobs()
        .claim("default", "w", Duration::from_secs(30), 1)
        .await
        .unwrap()
        .pop()
        .unwrap();
    assert_eq!(c.lease.run_id, dead.run_id);
    service
        .jobs()
        .fail(
            &c.lease,
            &ferry::JobError::terminal("boom"),
            &ferry::RetryPolicy::default(),
            &mut <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(1),
        )
        .await
        .unwrap();
    let mut tx = operator.begin().await.unwrap();
    operator
        .operator()
        .replay_dead_in(tx.conn(), "acme", dead.run_id, "alice", "test", false)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    t.exec("UPDATE outbox SET state = 'dead' WHERE id = (SELECT min(id) FROM outbox)")
        .await
        .unwrap();
    assert_eq!(
        RelayStore::new(operator.clone())
            .ferry()
            .operator()
            .list_dead_outbox(10)
            .await
            .unwrap()
            .len(),
        1
    );
    assert_eq!(
        RelayStore::new(operator.clone())
            .ferry()
            .operator()
            .replay_dead_outbox(None, "alice", "test")
            .await
            .unwrap()
            .len(),
        1
    );
    // ...lists runs, reads lineage (effects included) and drops schedules...
    let page = operator
        .operator()
        .list_runs(&ferry::RunFilter::tenant("acme"), None, 100)
        .await
        .unwrap();
    assert!(page.runs.len() >= 4, "{page:?}");
    operator.operator().run_lineage("acme", dead.run_id).await.unwrap();
    assert!(operator
        .operator()
        .unschedule("acme", "minutely", "alice", "test")
        .await
        .unwrap());
    // The operator pauses and limits queues; the service claims a
    // rate-limited queue (its bucket) but cannot change the settings.
    operator
        .operator()
        .pause_queue("default", "alice", "test")
        .await
        .unwrap();
    operator
        .operator()
        .resume_queue("default", "alice", "test")
        .await
        .unwrap();
    let rate = ferry::QueueLimits {
        max_leased: Some(5),
        rate: Some(ferry::RateLimit {
            burst: 2,
            every: Duration::from_secs(60),
        }),
        ..ferry::QueueLimits::default()
    };
    operator
        .operator()
        .set_queue_limits("limited", rate, "alice", "test")
        .await
        .unwrap();
    service
        .create_run_idempotent(NewRun::new("acme", "charge", "k4", json!({"a": 4})).queue("limited"))
        .await
        .unwrap();
    let limited = service
        .jobs()
        .claim("limited", "w", Duration::from_secs(30), 5)
        .await
        .unwrap();
    assert_eq!(limited.len(), 1);
    let queues = operator.operator().list_queues().await.unwrap();
    assert_eq!((queues[1].queue.as_str(), queues[1].tokens), ("limited", 1));
    assert_eq!(
        service
            .operator()
            .pause_queue("default", "mallory", "test")
            .await
            .unwrap_err()
            .code(),
        "database"
    );
    refused(&service, "UPDATE ferry_queues SET paused = false").await;
    // The operator keeps a queue's run events out of Kafka; the service's
    // acceptance reads that setting, and cannot change it.
    operator
        .operator()
        .set_queue_publish_events("quiet", false, "alice", "test")
        .await
        .unwrap();
    service
        .create_run_idempotent(NewRun::new("acme", "charge", "k5", json!({"a": 5})).queue("quiet"))
        .await
        .unwrap();
    refused(&service, "UPDATE ferry_queues SET publish_events = true").await;
    // ...and nothing else: no deletes, no publishing marks, no lanes or ledgers.
    refused(&operator, "DELETE FROM outbox").await;
    refused(&operator, "UPDATE outbox SET delivered_at = 0").await;
    refused(&operator, "UPDATE outbox SET payload = 'x'").await;
    refused(&operator, "INSERT INTO outbox (tenant, topic, key, lane, payload, headers, created_at, state) VALUES ('x', 't', 'k', 0, '', '{}', 0, 'delivered')").await;
    refused(&operator, "DELETE FROM runs").await;
    refused(&operator, "UPDATE relay_lanes SET owner = 'me'").await;
    refused(&operator, "SELECT * FROM consumer_ledger").await;
}

/// One HTTP/1.1 request to a local server; the status code and the body.
async fn http(addr: std::net::SocketAddr, method: &str, path: &str, token: &str, form: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\nSec-Fetch-Site: same-origin\r\n\
         Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{form}",
        form.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = String::new();
    s.read_to_string(&mut buf).await.unwrap();
    let status = buf.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, buf.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_role_serves_every_page_and_action() {
    let t = TestDb::new(Kind::Postgres).await;
    sqlx::raw_sql(include_str!("../../deploy/sql/roles.sql"))
        .execute(t.ferry.db().as_postgres().unwrap())
        .await
        .expect("roles.sql applies");
    let run = t
        .ferry
        .create_run_idempotent(NewRun::new("acme", "charge", "k1", json!({"a": 1})))
        .await
        .unwrap()
        .run;
    t.exec("UPDATE outbox SET state = 'dead', last_error = 'boom' WHERE id = (SELECT min(id) FROM outbox)")
        .await
        .unwrap();
    let console_db = as_role(&t, "ferry_console").await;
    let tokens = ferry_console::Tokens::parse(&ferry_console::Tokens::line_for("ops", "tok", None, true)).unwrap();
    let console = ferry_console::Console::new(console_db.clone(), ferry_console::ConsoleConfig::new(tokens)).unwrap();
    console.sample().await.unwrap();
    console.census().await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let served = tokio::spawn({
        let stop = stop.clone();
        console.serve(listener, async move { stop.cancelled().await })
    });
    let lineage = format!("/runs/acme/{}", run.run_id);
    for path in [
        "/",
        "/?tenant=acme",
        "/dead",
        "/dead?tenant=acme",
        "/runs",
        "/runs?tenant=acme",
        lineage.as_str(),
    ] {
        let (status, body) = http(addr, "GET", path, "tok", "").await;
        assert_eq!(status, 200, "GET {path} as ferry_console: {body}");
    }
    let (_, page) = http(addr, "GET", "/", "tok", "").await;
    let csrf = page
        .split("name=\"csrf\" value=\"")
        .nth(1)
        .unwrap()
        .split('"')
        .next()
        .unwrap()
        .to_owned();
    let run_id = run.run_id.to_string();
    for (path, form) in [
        ("/runs", format!("csrf={csrf}&tenant=acme&key=k1")),
        (
            "/actions/queues/pause",
            format!("csrf={csrf}&queue=default&reason=incident"),
        ),
        (
            "/actions/queues/resume",
            format!("csrf={csrf}&queue=default&reason=incident"),
        ),
        (
            "/actions/outbox/replay",
            format!("csrf={csrf}&tenant=acme&error_code=boom&reason=incident"),
        ),
        (
            "/actions/runs/cancel",
            format!("csrf={csrf}&tenant=acme&run_id={run_id}&reason=incident"),
        ),
    ] {
        let (status, body) = http(addr, "POST", path, "tok", &form).await;
        assert_eq!(status, 200, "POST {path} as ferry_console: {body}");
    }
    assert_eq!(
        t.scalar("SELECT count(*) FROM ferry_audit WHERE actor = 'ops'").await,
        4
    );
    // Still no deletes or publishing marks.
    refused(&console_db, "DELETE FROM outbox").await;
    refused(&console_db, "UPDATE outbox SET delivered_at = 0").await;
    refused(&console_db, "UPDATE relay_lanes SET owner = 'me'").await;
    refused(&console_db, "DELETE FROM consumer_ledger").await;
    stop.cancel();
    served.await.unwrap().unwrap();
}

/// `ferry doctor` (the jobs' checks and the relay's) and `ferry status` run
/// as `ferry_console`, the read-everything role: lanes, relays, the outbox
/// and the WAL capture slots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_role_runs_doctor_and_status() {
    let t = TestDb::new(Kind::Postgres).await;
    sqlx::raw_sql(include_str!("../../deploy/sql/roles.sql"))
        .execute(t.ferry.db().as_postgres().unwrap())
        .await
        .expect("roles.sql applies");
    t.ferry
        .enqueue(&OutboxMessage::bytes("acme", "orders", "o-1", vec![1]))
        .await
        .unwrap();
    let console = as_role(&t, "ferry_console").await;
    ferry_cli::doctor::run(&console, Duration::from_secs(300), 20)
        .await
        .expect("doctor's job checks as ferry_console");
    ferry_cli::doctor::relay(&console, &ferry_cli::doctor::RelayThresholds::default(), 20)
        .await
        .expect("doctor's relay checks as ferry_console");
    console
        .operator()
        .status_report()
        .await
        .expect("ferry status as ferry_console");
}

/// `ferry_writer`, the role of a writer outside Rust, enqueues through
/// `ferry_enqueue` and `ferry_enqueue_json` and is refused everything else:
/// the outbox table itself, its sequence, the runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_writer_role_may_only_enqueue_through_the_functions() {
    let t = TestDb::new(Kind::Postgres).await;
    sqlx::raw_sql(include_str!("../../deploy/sql/roles.sql"))
        .execute(t.ferry.db().as_postgres().unwrap())
        .await
        .expect("roles.sql applies");
    // Not a Ferry: a writer outside Rust has only its driver's connection.
    let pool = sqlx::PgPool::connect(&role_url(&t, "ferry_writer")).await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    let a: i64 = sqlx::query_scalar("SELECT ferry_enqueue_json('acme', 'orders', 'o-1', '{\"n\":1}')")
        .fetch_one(&mut *tx)
        .await
        .expect("the writer calls ferry_enqueue_json");
    let b: i64 = sqlx::query_scalar("SELECT ferry_enqueue('acme', 'orders', 'o-1', '\\x01'::bytea)")
        .fetch_one(&mut *tx)
        .await
        .expect("the writer calls ferry_enqueue");
    tx.commit().await.unwrap();
    assert!(b > a);
    // A writer's temporary objects shadow nothing the functions read or
    // write (their search path puts pg_temp last): not a `ferry_settings`
    // that would lift the limits and move the lanes, not an `outbox`.
    let mut c = pool.acquire().await.unwrap();
    sqlx::raw_sql(
        "CREATE TEMP VIEW ferry_settings AS SELECT * FROM (VALUES ('max_headers', '0'), ('outbox_lanes', '1')) AS s (name, value); \
         CREATE TEMP TABLE outbox (id BIGINT, tenant TEXT, topic TEXT, key TEXT, lane INTEGER, payload BYTEA, headers JSONB, \
             effect_key TEXT, traceparent TEXT, created_at BIGINT)",
    )
    .execute(&mut *c)
    .await
    .expect("a writer may make temporary objects");
    let shadowed: i64 =
        sqlx::query_scalar("SELECT ferry_enqueue_json('acme', 'orders', 'o-2', '{}', '{\"h\": \"v\"}')")
            .fetch_one(&mut *c)
            .await
            .expect("the real limits: one header is allowed");
    let temp_rows: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_temp.outbox")
        .fetch_one(&mut *c)
        .await
        .unwrap();
    assert_eq!(temp_rows, 0, "the writer's temporary outbox was not written");
    sqlx::query("DISCARD TEMP").execute(&mut *c).await.unwrap();
    drop(c);
    let lane: i32 = sqlx::query_scalar("SELECT lane FROM outbox WHERE id = $1")
        .bind(shadowed)
        .fetch_one(t.ferry.db().as_postgres().unwrap())
        .await
        .unwrap();
    assert_eq!(lane, ferry::outbox::lane_for("o-2", 64), "the real lane count");
    for sql in [
        "SELECT payload FROM outbox",
        "INSERT INTO outbox (tenant, topic, key, lane, payload, headers, created_at) VALUES ('acme', 'orders', 'o-1', 0, '', '{}', 0)",
        "SELECT nextval('outbox_id_seq')",
        "SELECT * FROM runs",
        "SELECT * FROM ferry_settings",
        "SELECT ferry_invalid('a', 'b')",
    ] {
        refused_on(&pool, sql).await;
    }
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox")
        .fetch_one(t.ferry.db().as_postgres().unwrap())
        .await
        .unwrap();
    assert_eq!(rows, 3);
}

/// `roles.sql` run by several sessions at once in one database (two
/// deploys' init jobs, tests in parallel) applies in each: the runs take
/// turns, where two transactions revoking or granting on one object at
/// once fail with "tuple concurrently updated".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn roles_sql_run_by_several_sessions_at_once_applies_in_each() {
    use sqlx::Connection as _;
    let t = TestDb::new(Kind::Postgres).await;
    for round in 0..3 {
        let runs = (0..4).map(|_| async {
            let mut c = sqlx::PgConnection::connect(&t.url).await.unwrap();
            sqlx::raw_sql(include_str!("../../deploy/sql/roles.sql"))
                .execute(&mut c)
                .await
        });
        for (i, applied) in futures::future::join_all(runs).await.into_iter().enumerate() {
            if let Err(e) = applied {
                panic!("round {round}, run {i}: roles.sql did not apply: {e}");
            }
        }
    }
}

/// `roles.sql` applies in a database without a `public` schema (a common
/// hardening), and a `search_path` naming no existing schema is refused
/// with a message that says so, nothing applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn roles_sql_applies_without_a_public_schema_and_refuses_a_missing_one() {
    use sqlx::Connection as _;
    let (direct, _) = ferry_testkit::fresh_database_behind_pgbouncer().await.unwrap();
    let mut owner = sqlx::PgConnection::connect(&direct).await.unwrap();
    sqlx::raw_sql("DROP SCHEMA public; CREATE SCHEMA app")
        .execute(&mut owner)
        .await
        .unwrap();
    let sep = if direct.contains('?') { '&' } else { '?' };
    let app = format!("{direct}{sep}options=-csearch_path%3Dapp");
    Ferry::builder(&app).migrate(true).connect().await.unwrap();
    let mut c = sqlx::PgConnection::connect(&app).await.unwrap();
    sqlx::raw_sql(include_str!("../../deploy/sql/roles.sql"))
        .execute(&mut c)
        .await
        .expect("roles.sql applies without a public schema");

    let missing = format!("{direct}{sep}options=-csearch_path%3Dnowhere");
    let mut c = sqlx::PgConnection::connect(&missing).await.unwrap();
    let err = sqlx::raw_sql(include_str!("../../deploy/sql/roles.sql"))
        .execute(&mut c)
        .await
        .expect_err("roles.sql with no schema to grant on");
    assert!(
        err.to_string().contains("search_path names no existing schema"),
        "{err}"
    );
}
