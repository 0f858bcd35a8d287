//! Through PgBouncer in transaction pooling (`pgbouncer=true`): what only
//! that route needs, beyond the conformance scenarios every route runs.

use std::time::Duration;

use ferry::Engine;
use ferry_testkit::{through_pooler, TestDb};

/// Sixteen clients at once, through a pooler with fewer server sessions
/// than clients, each alternating two statements of different shapes, on
/// the pool (outside any transaction), on a connection taken from it
/// (outside any transaction) or inside a transaction: every answer is its
/// own. A statement prepared by name would meet another client's of the
/// same name on a shared session (`prepared statement "sqlx_s_1" already
/// exists`), and an unnamed one run outside a transaction could have its
/// execution bound on another client's session, to that client's
/// statement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_never_meet_another_client_s() {
    through_pooler(async {
        let t = TestDb::new(Engine::Postgres).await;
        let tasks: Vec<_> = (0..16i64)
            .map(|task| {
                let db = t.ferry.db().clone();
                tokio::spawn(async move {
                    for i in 0..60i64 {
                        let (sum, text) = match task % 3 {
                            0 => {
                                let ferry::Db::Postgres(pg) = &db else { unreachable!() };
                                (sum(pg, task, i).await, text(pg, task, i).await)
                            }
                            1 => {
                                let mut pooled = db.acquire().await.unwrap();
                                let ferry::Conn::Postgres(mut pg) = pooled.conn() else {
                                    unreachable!()
                                };
                                (sum(&mut pg, task, i).await, text(&mut pg, task, i).await)
                            }
                            _ => {
                                let mut tx = db.begin().await.unwrap();
                                let mut pg = tx.pg().unwrap();
                                let both = (sum(&mut pg, task, i).await, text(&mut pg, task, i).await);
                                tx.commit().await.unwrap();
                                both
                            }
                        };
                        assert_eq!(sum, task + i);
                        assert_eq!(text, format!("{task}/{i}/x"));
                    }
                })
            })
            .collect();
        for task in tasks {
            tokio::time::timeout(Duration::from_secs(60), task)
                .await
                .expect("the clients finish")
                .unwrap();
        }
    })
    .await;
}

async fn sum<'e>(pg: impl sqlx::PgExecutor<'e>, a: i64, b: i64) -> i64 {
    sqlx::query_scalar("SELECT $1::bigint + $2::bigint")
        .bind(a)
        .bind(b)
        .fetch_one(pg)
        .await
        .unwrap()
}

async fn text<'e>(pg: impl sqlx::PgExecutor<'e>, a: i64, b: i64) -> String {
    sqlx::query_scalar("SELECT $1::text || '/' || $2::text || '/' || $3::text")
        .bind(a.to_string())
        .bind(b.to_string())
        .bind("x")
        .fetch_one(pg)
        .await
        .unwrap()
}

/// The operator's replay of dead outbox rows (its ledger statements are
/// PostgreSQL's own, run on the replay's transaction), one row at a time,
/// through the pooler: each replay finds its row, none fails on a
/// statement another left on a server session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_outbox_rows_are_replayed_through_a_pooler() {
    through_pooler(async {
        let t = TestDb::new(Engine::Postgres).await;
        let mut ids = Vec::new();
        for i in 0..6 {
            let msg = ferry::OutboxMessage::bytes("acme", "orders", format!("k{i}"), b"v".to_vec());
            ids.push(t.ferry.enqueue(&msg).await.unwrap());
        }
        t.exec("UPDATE outbox SET state = 'dead', last_error = 'message_too_large'")
            .await
            .unwrap();
        for id in &ids {
            let replayed = t
                .ferry
                .operator()
                .replay_dead_outbox(Some(*id), "ops", "pooler test")
                .await
                .unwrap();
            assert_eq!(replayed, [*id]);
        }
        assert_eq!(t.scalar("SELECT count(*) FROM outbox WHERE state = 'pending'").await, 6);
    })
    .await;
}

/// A worker behind a transaction pooler listens for no `NOTIFY` (a pooler
/// does not deliver notifications to the client that listened) and polls
/// instead: a job accepted while it idles is claimed and completed, and no
/// server session ever ran a `LISTEN` for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_behind_a_pooler_polls_for_work() {
    through_pooler(async {
        let (url, direct) = ferry_testkit::fresh_postgres().await;
        let direct = direct.expect("through the pooler");
        let ferry = ferry::Ferry::builder(&url)
            .direct_url(&direct)
            .migrate(true)
            .connect()
            .await
            .unwrap();
        let (done_tx, mut done) = tokio::sync::mpsc::channel::<()>(1);
        let worker = ferry::worker::Worker::new(
            ferry.clone(),
            ferry::worker::WorkerConfig {
                concurrency: 2,
                poll_interval: Duration::from_millis(100),
                ..Default::default()
            },
            move |_job: ferry::Claimed, _ctx| {
                let done_tx = done_tx.clone();
                async move {
                    let _ = done_tx.try_send(());
                    Ok(serde_json::json!({}))
                }
            },
        );
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let running = tokio::spawn(worker.run(async move {
            let _ = stopped.await;
        }));
        let run = ferry::NewRun::new("acme", "charge", "k-1", serde_json::json!({"amount": 1}));
        let a = ferry.create_run_idempotent(run).await.unwrap();
        tokio::time::timeout(Duration::from_secs(30), done.recv())
            .await
            .expect("the job is claimed by polling");
        let direct = ferry::connect(&direct).await.unwrap();
        let listens = direct
            .fetch_i64(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query ILIKE 'LISTEN%'",
            )
            .await
            .unwrap();
        assert_eq!(listens, 0, "no LISTEN through the pooler");
        let _ = stop.send(());
        running.await.unwrap().unwrap();
        let run = ferry.get_run("acme", a.run.run_id).await.unwrap();
        assert_eq!(run.state, ferry::RunState::Succeeded);
    })
    .await;
}

/// Migrations behind a transaction pooler need the direct URL: without
/// one, `migrate(true)` is refused with a `config` error before anything
/// is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrating_through_a_pooler_without_a_direct_url_is_refused() {
    let (direct, pooled) = ferry_testkit::fresh_database_behind_pgbouncer().await.unwrap();
    let url = format!("{pooled}?pgbouncer=true");
    let e = ferry::Ferry::builder(&url).migrate(true).connect().await.unwrap_err();
    assert_eq!(e.code(), "config", "{e}");
    assert!(e.to_string().contains("direct"), "{e}");
    let direct = ferry::connect(&direct).await.unwrap();
    assert_eq!(
        direct
            .fetch_i64("SELECT count(*) FROM pg_tables WHERE tablename = '_sqlx_migrations'")
            .await
            .unwrap(),
        0,
        "nothing was written"
    );
}
