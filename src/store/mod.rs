//! The two engines behind one contract: connecting by URL, migrations, the
//! transaction and connection handles that every write takes, and the named
//! SQL of each engine.
//!
//! PostgreSQL is the production engine and SQLite (WAL mode) the embedded one.
//! Code that runs a query is written once with [`on_conn!`] and compiled for
//! each engine; only the SQL text differs: each crate's `sql/*.sql`, written
//! once for both engines and rendered per engine at build time (`queries`).
//! Where an algorithm differs (a batch written set-based or one by one),
//! the code above asks the store's questions (`capability`) and never
//! names an engine itself.

use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{PgConnection, PgPool, SqliteConnection, SqlitePool};

pub use crate::engine::Engine;
use crate::error::{Error, Result};

static PG_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/postgres");
static SQLITE_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/sqlite");

/// A connection pool on either engine.
#[derive(Debug, Clone)]
pub enum Db {
    /// PostgreSQL pool.
    Postgres(PgPool),
    /// SQLite pool.
    Sqlite(SqlitePool),
}

/// Options for [`connect_with`].
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// Pool size. SQLite serializes writers anyway; its default is 4.
    pub max_connections: u32,
    /// How long a caller waits for a pooled connection.
    pub acquire_timeout: Duration,
    /// PostgreSQL only: each session's `idle_in_transaction_session_timeout`.
    /// The server ends a session that keeps a transaction open without
    /// sending a statement for longer than this, so a process frozen inside
    /// a transaction (SIGSTOP, a paused VM, a debugger) releases the locks
    /// it holds instead of blocking every other session for as long as it
    /// stays frozen. `None` (the default) keeps the server's setting; a
    /// limit beyond the server's range (about 24.8 days) is its longest, and
    /// `Duration::ZERO` is 1 ms, not "no limit" (that is `None`).
    pub idle_in_transaction_timeout: Option<Duration>,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            max_connections: 16,
            acquire_timeout: Duration::from_secs(10),
            idle_in_transaction_timeout: None,
        }
    }
}

/// Connects to `postgres://…` or `sqlite://…` with default options.
pub async fn connect(url: &str) -> Result<Db> {
    connect_with(url, &ConnectOptions::default()).await
}

/// Connects to `postgres://…` or `sqlite://…`.
///
/// SQLite files are created when missing and opened in WAL mode with foreign
/// keys on and a busy timeout, so concurrent writers queue instead of failing.
pub async fn connect_with(url: &str, opts: &ConnectOptions) -> Result<Db> {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let options = PgConnectOptions::from_str(url)?;
        let mut pool = PgPoolOptions::new()
            .max_connections(opts.max_connections)
            .acquire_timeout(opts.acquire_timeout);
        if let Some(limit) = opts.idle_in_transaction_timeout {
            // A SET after connecting, not a startup option: poolers such as
            // PgBouncer refuse unknown startup parameters. The setting is an
            // `int` of milliseconds: a longer limit is its longest, not a SET
            // every new connection fails on.
            let ms = limit.as_millis().clamp(1, i32::MAX as u128);
            let set = format!("SET idle_in_transaction_session_timeout = {ms}");
            pool = pool.after_connect(move |conn, _| {
                let set = set.clone();
                Box::pin(async move {
                    sqlx::Executor::execute(conn, set.as_str()).await?;
                    Ok(())
                })
            });
        }
        let pool = pool.connect_with(options).await?;
        Ok(Db::Postgres(pool))
    } else if url.starts_with("sqlite:") {
        let options = SqliteConnectOptions::from_str(url)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .foreign_keys(true)
            .busy_timeout(Duration::from_secs(30));
        let pool = SqlitePoolOptions::new()
            .max_connections(opts.max_connections.clamp(1, 4))
            .acquire_timeout(opts.acquire_timeout)
            .connect_with(options)
            .await?;
        Ok(Db::Sqlite(pool))
    } else {
        Err(Error::Config(
            "database URL must start with postgres://, postgresql:// or sqlite:".into(),
        ))
    }
}

/// Applies the embedded migrations of the pool's engine. Idempotent.
pub async fn migrate(db: &Db) -> Result<()> {
    match db {
        Db::Postgres(p) => PG_MIGRATOR.run(p).await?,
        Db::Sqlite(p) => SQLITE_MIGRATOR.run(p).await?,
    }
    Ok(())
}

impl Db {
    /// The engine behind this pool.
    pub fn engine(&self) -> Engine {
        match self {
            Db::Postgres(_) => Engine::Postgres,
            Db::Sqlite(_) => Engine::Sqlite,
        }
    }

    /// Starts a write transaction (`BEGIN IMMEDIATE` on SQLite, so a
    /// read-then-write transaction never fails to upgrade its lock).
    pub async fn begin(&self) -> Result<Tx> {
        Ok(match self {
            Db::Postgres(p) => Tx::Postgres(p.begin().await?),
            Db::Sqlite(p) => Tx::Sqlite(p.begin_with("BEGIN IMMEDIATE").await?),
        })
    }

    /// Closes the pool.
    pub async fn close(&self) {
        match self {
            Db::Postgres(p) => p.close().await,
            Db::Sqlite(p) => p.close().await,
        }
    }

    /// Runs one statement whose text is the same on both engines (no
    /// parameters) and returns the rows it changed: for tests, seeds and
    /// operator scripts, never on a hot path.
    pub async fn execute_raw(&self, sql: &str) -> Result<u64> {
        Ok(match self {
            Db::Postgres(p) => sqlx::query(sql).execute(p).await?.rows_affected(),
            Db::Sqlite(p) => sqlx::query(sql).execute(p).await?.rows_affected(),
        })
    }

    /// The one integer a query whose text is the same on both engines
    /// returns (a count, a max): for tests and operator checks.
    pub async fn fetch_i64(&self, sql: &str) -> Result<i64> {
        Ok(match self {
            Db::Postgres(p) => sqlx::query_scalar(sql).fetch_one(p).await?,
            Db::Sqlite(p) => sqlx::query_scalar(sql).fetch_one(p).await?,
        })
    }

    /// The PostgreSQL pool, if this is one.
    pub fn as_postgres(&self) -> Option<&PgPool> {
        match self {
            Db::Postgres(p) => Some(p),
            Db::Sqlite(_) => None,
        }
    }

    /// The SQLite pool, if this is one.
    pub fn as_sqlite(&self) -> Option<&SqlitePool> {
        match self {
            Db::Sqlite(p) => Some(p),
            Db::Postgres(_) => None,
        }
    }
}

/// An open transaction on either engine. Services use it for their own domain
/// writes ([`Tx::postgres`], [`Tx::sqlite`]) beside Ferry's, and nothing
/// commits until [`Tx::commit`]. Dropping it rolls back.
#[derive(Debug)]
pub enum Tx {
    /// A PostgreSQL transaction.
    Postgres(sqlx::Transaction<'static, sqlx::Postgres>),
    /// A SQLite transaction.
    Sqlite(sqlx::Transaction<'static, sqlx::Sqlite>),
}

impl Tx {
    /// Commits everything written in this transaction.
    pub async fn commit(self) -> Result<()> {
        match self {
            Tx::Postgres(t) => t.commit().await?,
            Tx::Sqlite(t) => t.commit().await?,
        }
        Ok(())
    }

    /// Ends the transaction by the result of the work done in it: commits on
    /// `Ok`, rolls back on `Err` and returns the error (a failed rollback only
    /// means the connection is gone, and the database rolls back for us).
    pub async fn finish<T>(self, result: Result<T>) -> Result<T> {
        match result {
            Ok(v) => {
                self.commit().await?;
                Ok(v)
            }
            Err(e) => {
                let _ = self.rollback().await;
                Err(e)
            }
        }
    }

    /// Rolls back everything written in this transaction.
    pub async fn rollback(self) -> Result<()> {
        match self {
            Tx::Postgres(t) => t.rollback().await?,
            Tx::Sqlite(t) => t.rollback().await?,
        }
        Ok(())
    }

    /// The PostgreSQL connection, for the service's own statements.
    pub fn postgres(&mut self) -> Option<&mut PgConnection> {
        match self {
            Tx::Postgres(t) => Some(&mut **t),
            Tx::Sqlite(_) => None,
        }
    }

    /// The SQLite connection, for the service's own statements.
    pub fn sqlite(&mut self) -> Option<&mut SqliteConnection> {
        match self {
            Tx::Sqlite(t) => Some(&mut **t),
            Tx::Postgres(_) => None,
        }
    }

    /// This transaction as a [`Conn`] for Ferry's `*_in` calls.
    pub fn conn(&mut self) -> Conn<'_> {
        match self {
            Tx::Postgres(t) => Conn::Postgres(t),
            Tx::Sqlite(t) => Conn::Sqlite(t),
        }
    }
}

/// A borrowed connection on either engine, usually inside a transaction the
/// caller holds. `&mut PgConnection`, `&mut SqliteConnection` and `&mut Tx`
/// all convert into it, so a service's own `sqlx::Transaction` works too.
///
/// On SQLite, begin your own transaction with `BEGIN IMMEDIATE` (sqlx:
/// `pool.begin_with("BEGIN IMMEDIATE")`), as [`Db::begin`] does: several
/// `*_in` calls read before they write, and a deferred transaction can then
/// fail to upgrade its lock with `SQLITE_BUSY` instead of waiting.
#[derive(Debug)]
pub enum Conn<'c> {
    /// PostgreSQL.
    Postgres(&'c mut PgConnection),
    /// SQLite.
    Sqlite(&'c mut SqliteConnection),
}

impl<'c> From<&'c mut PgConnection> for Conn<'c> {
    fn from(c: &'c mut PgConnection) -> Self {
        Conn::Postgres(c)
    }
}

impl<'c> From<&'c mut SqliteConnection> for Conn<'c> {
    fn from(c: &'c mut SqliteConnection) -> Self {
        Conn::Sqlite(c)
    }
}

impl<'c> From<&'c mut Tx> for Conn<'c> {
    fn from(t: &'c mut Tx) -> Self {
        t.conn()
    }
}

impl Conn<'_> {
    /// Reborrows for one more call.
    pub fn reborrow(&mut self) -> Conn<'_> {
        match self {
            Conn::Postgres(c) => Conn::Postgres(c),
            Conn::Sqlite(c) => Conn::Sqlite(c),
        }
    }

    /// Runs `f` under a savepoint of this connection's transaction: its
    /// writes stay when it returns `Ok` and are rolled back when it returns
    /// `Err`, so one refused item of a batch leaves none of its writes. The
    /// outer `Err` is the savepoint's own failure; the inner result is `f`'s.
    pub(crate) async fn in_savepoint<T>(&mut self, f: impl AsyncFnOnce(Conn<'_>) -> Result<T>) -> Result<Result<T>> {
        on_conn!(self.reborrow(), |c, _q| {
            let mut sp = sqlx::Connection::begin(&mut *c).await?;
            let one = f(Conn::from(&mut *sp)).await;
            if one.is_ok() {
                sp.commit().await?;
            } else {
                sp.rollback().await?;
            }
            Ok(one)
        })
    }
}

mod capability;
pub(crate) use capability::Batching;
mod millis;
mod portable;
pub use portable::{Arg, PooledConn};
mod text_enum;
pub(crate) use text_enum::text_enum;
mod wakeup;
pub use wakeup::{Wakeup, CHANNEL as WAKEUP_CHANNEL};

/// A pair of values, one per engine: the rendered queries of a crate
/// (`QUERIES` generated by `ferry-sqlgen` from its `sql/` directory).
#[derive(Debug)]
pub struct PerEngine<Q> {
    /// The PostgreSQL value.
    pub postgres: Q,
    /// The SQLite value.
    pub sqlite: Q,
}

impl<Q> PerEngine<Q> {
    /// The value for `engine`.
    pub fn get(&self, engine: Engine) -> &Q {
        match engine {
            Engine::Postgres => &self.postgres,
            Engine::Sqlite => &self.sqlite,
        }
    }
}

/// The core's named queries, rendered at build time from `sql/*.sql` (one
/// file per table; see `ferry-sqlgen` for the template tokens). A query the
/// code names but the SQL lacks, on either engine, fails the build.
pub mod queries {
    include!(concat!(env!("OUT_DIR"), "/queries.rs"));
}

/// Runs `$body` with `$c` bound to the engine's `&mut Connection` and `$q` to
/// the engine's rendering of a query set (the core's own, or a crate's
/// `QUERIES` passed as the second argument). The body is compiled once per
/// engine, so it is written once; this macro is the only place outside the
/// store where the engine is chosen.
#[macro_export]
macro_rules! on_conn {
    ($conn:expr, |$c:ident, $q:ident| $body:expr) => {
        $crate::on_conn!($conn, $crate::store::queries::QUERIES, |$c, $q| $body)
    };
    ($conn:expr, $queries:expr, |$c:ident, $q:ident| $body:expr) => {
        match $conn {
            $crate::store::Conn::Postgres($c) => {
                let $q = &$queries.postgres;
                $body
            }
            $crate::store::Conn::Sqlite($c) => {
                let $q = &$queries.sqlite;
                $body
            }
        }
    };
}

/// [`on_conn!`] for a pool ([`Db`]): `$c` is the engine's pool.
#[macro_export]
macro_rules! on_pool {
    ($db:expr, |$c:ident, $q:ident| $body:expr) => {
        $crate::on_pool!($db, $crate::store::queries::QUERIES, |$c, $q| $body)
    };
    ($db:expr, $queries:expr, |$c:ident, $q:ident| $body:expr) => {
        match $db {
            $crate::store::Db::Postgres($c) => {
                let $q = &$queries.postgres;
                $body
            }
            $crate::store::Db::Sqlite($c) => {
                let $q = &$queries.sqlite;
                $body
            }
        }
    };
}
pub use crate::{on_conn, on_pool};

/// A list of ids bound as one parameter: a `bigint[]` on PostgreSQL and a
/// JSON array on SQLite, matched in SQL by the `{ids $N}` template token.
#[derive(Debug, Clone, Copy)]
pub struct Ids<'a>(pub &'a [i64]);

impl sqlx::Type<sqlx::Postgres> for Ids<'_> {
    fn type_info() -> sqlx::postgres::PgTypeInfo {
        <Vec<i64> as sqlx::Type<sqlx::Postgres>>::type_info()
    }
}

impl<'q> sqlx::Encode<'q, sqlx::Postgres> for Ids<'_> {
    fn encode_by_ref(
        &self,
        buf: &mut sqlx::postgres::PgArgumentBuffer,
    ) -> std::result::Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
        <&[i64] as sqlx::Encode<'q, sqlx::Postgres>>::encode_by_ref(&self.0, buf)
    }
}

impl sqlx::Type<sqlx::Sqlite> for Ids<'_> {
    fn type_info() -> sqlx::sqlite::SqliteTypeInfo {
        <String as sqlx::Type<sqlx::Sqlite>>::type_info()
    }
}

impl<'q> sqlx::Encode<'q, sqlx::Sqlite> for Ids<'_> {
    fn encode_by_ref(
        &self,
        buf: &mut Vec<sqlx::sqlite::SqliteArgumentValue<'q>>,
    ) -> std::result::Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
        let json = serde_json::to_string(self.0)?;
        <String as sqlx::Encode<'q, sqlx::Sqlite>>::encode(json, buf)
    }
}

/// Prepares each `(name, sql)` on `db`, so a query that does not parse or
/// names a missing column fails in each crate's conformance test (run on
/// both engines) instead of at first use. Pass the generated
/// `QUERIES.get(db.engine()).all()`.
pub async fn check_queries(db: &Db, named: Vec<(&'static str, &'static str)>) -> Result<()> {
    let engine = db.engine();
    for (name, sql) in named {
        let prepared = match db {
            Db::Postgres(p) => sqlx::Executor::prepare(p, sql).await.map(drop),
            Db::Sqlite(p) => sqlx::Executor::prepare(p, sql).await.map(drop),
        };
        prepared.map_err(|e| Error::Query {
            name,
            engine,
            message: e.to_string(),
        })?;
    }
    Ok(())
}
