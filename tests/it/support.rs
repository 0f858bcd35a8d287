//! Test databases: a fresh PostgreSQL schema or a fresh SQLite file per test,
//! migrated, so tests run in parallel. PostgreSQL must be reachable: a test
//! that needs it fails with a message naming what is missing.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use ferry::{Clock, Ferry, Millis};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::ConnectOptions as _;

/// Which engine a scenario runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Postgres,
    Sqlite,
}

/// The base URL of the test PostgreSQL.
pub fn pg_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

static SEQ: AtomicU64 = AtomicU64::new(0);

/// A migrated database of one engine, and how to reach it again.
pub struct TestDb {
    pub url: String,
    pub ferry: Ferry,
}

/// A start instant far from zero, for injected clocks.
pub const T0: i64 = 1_800_000_000_000;

pub fn manual_clock() -> Clock {
    Clock::manual(Millis::new(T0).unwrap())
}

impl TestDb {
    pub async fn new(kind: Kind) -> TestDb {
        Self::with_clock(kind, Clock::Database).await
    }

    pub async fn with_clock(kind: Kind, clock: Clock) -> TestDb {
        let url = fresh_url(kind).await;
        let ferry = Ferry::builder(&url)
            .clock(clock)
            .migrate(true)
            .connect()
            .await
            .unwrap_or_else(|e| panic!("cannot open test database {kind:?}: {e}"));
        TestDb { url, ferry }
    }

    /// Another handle on the same database (another pool), sharing the clock.
    pub async fn reopen(&self) -> Ferry {
        Ferry::builder(&self.url)
            .clock(self.ferry.clock().clone())
            .connect()
            .await
            .expect("reopen")
    }

    /// One scalar from a raw SQL query (the same text on both engines).
    pub async fn scalar(&self, sql: &str) -> i64 {
        match self.ferry.db() {
            ferry::Db::Postgres(p) => sqlx::query_scalar::<_, i64>(sql).fetch_one(p).await,
            ferry::Db::Sqlite(p) => sqlx::query_scalar::<_, i64>(sql).fetch_one(p).await,
        }
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// Runs raw SQL (the same text on both engines).
    pub async fn exec(&self, sql: &str) -> Result<u64, sqlx::Error> {
        match self.ferry.db() {
            ferry::Db::Postgres(p) => sqlx::query(sql).execute(p).await.map(|r| r.rows_affected()),
            ferry::Db::Sqlite(p) => sqlx::query(sql).execute(p).await.map(|r| r.rows_affected()),
        }
    }
}

/// A URL to a brand-new, empty database of `kind`.
pub async fn fresh_url(kind: Kind) -> String {
    let n = SEQ.fetch_add(1, Ordering::Relaxed);
    let pid = std::process::id();
    match kind {
        Kind::Sqlite => {
            let dir = std::env::temp_dir().join("ferry-tests");
            std::fs::create_dir_all(&dir).expect("temp dir");
            let path = dir.join(format!("t{pid}_{n}_{}.db", uuid::Uuid::now_v7().simple()));
            format!("sqlite://{}", path.display())
        }
        Kind::Postgres => {
            let base = pg_url();
            let schema = format!("ferry_t_{pid}_{n}");
            let opts: PgConnectOptions = base
                .parse()
                .expect("DATABASE_URL must be a postgres:// URL");
            let admin = PgPoolOptions::new()
                .max_connections(1)
                .acquire_timeout(Duration::from_secs(5))
                .connect_with(opts.clone().disable_statement_logging())
                .await
                .unwrap_or_else(|e| {
                    panic!("PostgreSQL is required for this test and is unreachable at {base} ({e}); start it or set DATABASE_URL")
                });
            if n == 0 {
                drop_stale_schemas(&admin, pid).await;
            }
            sqlx::query(&format!("CREATE SCHEMA {schema}"))
                .execute(&admin)
                .await
                .expect("create schema");
            admin.close().await;
            let sep = if base.contains('?') { '&' } else { '?' };
            format!("{base}{sep}options=-csearch_path%3D{schema}")
        }
    }
}

/// Drops schemas left by earlier runs of the test binary (other pids).
async fn drop_stale_schemas(admin: &sqlx::PgPool, pid: u32) {
    let stale: Vec<String> = sqlx::query_scalar(
        "SELECT nspname::text FROM pg_namespace WHERE nspname LIKE 'ferry\\_t\\_%' AND nspname NOT LIKE $1",
    )
    .bind(format!("ferry\\_t\\_{pid}\\_%"))
    .fetch_all(admin)
    .await
    .unwrap_or_default();
    for s in stale {
        let _ = sqlx::query(&format!("DROP SCHEMA IF EXISTS {s} CASCADE"))
            .execute(admin)
            .await;
    }
}

/// Defines one `#[tokio::test]` per engine for each scenario `fn name(Kind)`.
macro_rules! on_both_engines {
    ($($name:ident),* $(,)?) => {
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::support::Kind::Postgres).await
                }
            )*
        }
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::support::Kind::Sqlite).await
                }
            )*
        }
    };
}
pub(crate) use on_both_engines;
