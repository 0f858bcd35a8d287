//! Through PgBouncer in transaction pooling (`pgbouncer=true`): what only
//! that route needs, beyond the conformance scenarios every route runs.

use std::time::Duration;

use ferry::Engine;
use ferry_testkit::{through_pooler, TestDb};

/// Sixteen clients at once, through a pooler with fewer server sessions
/// than clients, each alternating two statements of different shapes
/// outside any transaction: every answer is its own. A statement prepared
/// by name would meet another client's of the same name on a shared
/// session (`prepared statement "sqlx_s_1" already exists`), and an unnamed
/// one run outside a transaction could have its execution bound on another
/// client's session, to that client's statement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_outside_a_transaction_never_meet_another_client_s() {
    through_pooler(async {
        let t = TestDb::new(Engine::Postgres).await;
        assert!(t.ferry.behind_transaction_pooler());
        let tasks: Vec<_> = (0..16i64)
            .map(|task| {
                let db = t.ferry.db().clone();
                tokio::spawn(async move {
                    let ferry::Db::Postgres(pg) = &db else { unreachable!() };
                    for i in 0..100i64 {
                        let sum: i64 = sqlx::query_scalar("SELECT $1::bigint + $2::bigint")
                            .bind(task)
                            .bind(i)
                            .fetch_one(pg)
                            .await
                            .unwrap();
                        assert_eq!(sum, task + i);
                        let text: String = sqlx::query_scalar("SELECT $1::text || '/' || $2::text || '/' || $3::text")
                            .bind(task.to_string())
                            .bind(i.to_string())
                            .bind("x")
                            .fetch_one(pg)
                            .await
                            .unwrap();
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

/// A worker behind a transaction pooler listens for no `NOTIFY` (a pooler
/// does not deliver notifications to the client that listened) and polls
/// instead: a job accepted while it idles is claimed and completed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_behind_a_pooler_polls_for_work() {
    through_pooler(async {
        let t = TestDb::new(Engine::Postgres).await;
        let (done_tx, mut done) = tokio::sync::mpsc::channel::<()>(1);
        let worker = ferry::worker::Worker::new(
            t.ferry.clone(),
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
        let a = t.ferry.create_run_idempotent(run).await.unwrap();
        tokio::time::timeout(Duration::from_secs(30), done.recv())
            .await
            .expect("the job is claimed by polling");
        let _ = stop.send(());
        running.await.unwrap().unwrap();
        let run = t.ferry.get_run("acme", a.run.run_id).await.unwrap();
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
