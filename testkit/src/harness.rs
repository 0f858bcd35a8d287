//! A migrated database per test, and scenarios written once and run on both
//! engines ([`on_both_engines!`]).

use ferry::{Clock, Engine, Ferry, Millis};

/// A migrated database of one engine, and how to reach it again.
pub struct TestDb {
    /// Its URL (a fresh PostgreSQL schema or SQLite file; a fresh database
    /// through the test PgBouncer under [`through_pooler`]).
    pub url: String,
    /// A handle on it.
    pub ferry: Ferry,
}

/// A start instant far from zero, for injected clocks.
pub const T0: i64 = 1_800_000_000_000;

/// A manual clock at [`T0`].
pub fn manual_clock() -> Clock {
    Clock::manual(Millis::new(T0).expect("T0 is a valid instant"))
}

impl TestDb {
    /// A fresh, migrated database on the database clock.
    pub async fn new(engine: Engine) -> TestDb {
        Self::with_clock(engine, Clock::Database).await
    }

    /// A fresh, migrated database whose handle uses `clock`.
    pub async fn with_clock(engine: Engine, clock: Clock) -> TestDb {
        let (url, direct) = match engine {
            Engine::Postgres => fresh_postgres().await,
            Engine::Sqlite => (fresh_url(engine).await, None),
        };
        let mut builder = Ferry::builder(&url).clock(clock).migrate(true);
        let pooled = direct.is_some();
        if let Some(direct) = direct {
            builder = builder.direct_url(direct);
        }
        let ferry = builder
            .connect()
            .await
            .unwrap_or_else(|e| panic!("cannot open test database {engine:?}: {e}"));
        assert_eq!(
            ferry.behind_transaction_pooler(),
            pooled,
            "the handle's route is the test's"
        );
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

    /// One integer from raw SQL (the same text on both engines); panics
    /// with the statement on error.
    pub async fn scalar(&self, sql: &str) -> i64 {
        self.ferry
            .db()
            .fetch_i64(sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// Runs raw SQL (the same text on both engines); the rows changed.
    pub async fn exec(&self, sql: &str) -> ferry::Result<u64> {
        self.ferry.db().execute_raw(sql).await
    }
}

/// A URL to a brand-new, empty database of `engine`; panics naming what is
/// missing.
pub async fn fresh_url(engine: Engine) -> String {
    crate::fresh_database_url(engine)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Defines one `#[tokio::test]` per engine for each scenario
/// `async fn name(engine: ferry::Engine)`, in modules `postgres` and `sqlite`.
#[macro_export]
macro_rules! on_both_engines {
    ($($name:ident),* $(,)?) => {
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(::ferry::Engine::Postgres).await
                }
            )*
        }
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(::ferry::Engine::Sqlite).await
                }
            )*
        }
    };
}

/// [`on_both_engines!`], and each scenario once more on PostgreSQL through
/// the test PgBouncer in transaction pooling, in module `pgbouncer`: its
/// [`TestDb`] connects through the pooler as behind one (see
/// [`through_pooler`]).
#[macro_export]
macro_rules! on_every_route {
    ($($name:ident),* $(,)?) => {
        $crate::on_both_engines!($($name),*);
        mod pgbouncer {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    $crate::through_pooler(super::$name(::ferry::Engine::Postgres)).await
                }
            )*
        }
    };
}

tokio::task_local! {
    static THROUGH_POOLER: ();
}

/// A new, empty PostgreSQL database for a test that builds its own handle:
/// its URL, and the direct URL to migrate over ([`ferry::FerryBuilder::direct_url`]).
/// Under [`through_pooler`], a database through the test PgBouncer (the URL
/// says `pgbouncer=true`) and its direct URL; otherwise a fresh schema's
/// URL and `None`. Panics naming what is missing.
pub async fn fresh_postgres() -> (String, Option<String>) {
    if THROUGH_POOLER.try_with(|_| ()).is_err() {
        return (fresh_url(Engine::Postgres).await, None);
    }
    let (direct, pooled) = crate::fresh_database_behind_pgbouncer()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let sep = if pooled.contains('?') { '&' } else { '?' };
    (format!("{pooled}{sep}pgbouncer=true"), Some(direct))
}

/// Runs `test` with its [`TestDb`]s on PostgreSQL reached through the test
/// PgBouncer in transaction pooling ([`crate::pgbouncer_url`]): a database
/// each (PgBouncer does not pass the `options` startup parameter that picks
/// a direct test's schema), its URL carrying `pgbouncer=true`, migrated
/// over the direct URL.
pub async fn through_pooler<F: std::future::Future>(test: F) -> F::Output {
    THROUGH_POOLER.scope((), test).await
}
