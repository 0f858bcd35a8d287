//! Test databases: a fresh PostgreSQL schema or a fresh SQLite file per test,
//! migrated, so tests run in parallel. PostgreSQL must be reachable: a test
//! that needs it fails with a message naming what is missing.

use ferry::{Clock, Ferry, Millis};

/// Which engine a scenario runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Postgres,
    Sqlite,
}

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
    let engine = match kind {
        Kind::Postgres => ferry::Engine::Postgres,
        Kind::Sqlite => ferry::Engine::Sqlite,
    };
    ferry::testing::fresh_database_url(engine)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
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
