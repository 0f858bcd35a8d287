//! The two engines behind one contract: connecting by URL, migrations, the
//! transaction and connection handles that every write takes, and the named
//! SQL of each engine.
//!
//! PostgreSQL is the production engine and SQLite (WAL mode) the embedded one.
//! Code that runs a query is written once with [`on_conn!`] and compiled for
//! each engine; only the SQL text, kept in `store/sql/<engine>/*.sql`, differs.

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::LazyLock;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{PgConnection, PgPool, SqliteConnection, SqlitePool};

use crate::error::{Error, Result};

static PG_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/postgres");
static SQLITE_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/sqlite");

/// Which engine a pool talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// PostgreSQL 13+.
    Postgres,
    /// SQLite in WAL mode, one process.
    Sqlite,
}

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
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            max_connections: 16,
            acquire_timeout: Duration::from_secs(10),
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
        let pool = PgPoolOptions::new()
            .max_connections(opts.max_connections)
            .acquire_timeout(opts.acquire_timeout)
            .connect_with(options)
            .await?;
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
}

/// Runs `$body` with `$c` bound to the engine's `&mut Connection` and `$q` to
/// its [`Queries`]. The body is compiled once per engine.
macro_rules! on_conn {
    ($conn:expr, |$c:ident, $q:ident| $body:expr) => {
        match $conn {
            $crate::store::Conn::Postgres($c) => {
                let $q = &*$crate::store::POSTGRES;
                $body
            }
            $crate::store::Conn::Sqlite($c) => {
                let $q = &*$crate::store::SQLITE;
                $body
            }
        }
    };
}
pub(crate) use on_conn;

/// Runs `$body` with `$c` bound to the engine's pool and `$q` to its [`Queries`].
macro_rules! on_pool {
    ($db:expr, |$c:ident, $q:ident| $body:expr) => {
        match $db {
            $crate::store::Db::Postgres($c) => {
                let $q = &*$crate::store::POSTGRES;
                $body
            }
            $crate::store::Db::Sqlite($c) => {
                let $q = &*$crate::store::SQLITE;
                $body
            }
        }
    };
}
pub(crate) use on_pool;

/// The named queries of one engine, parsed from `-- name: <name>` sections.
#[derive(Debug)]
pub struct Queries {
    engine: Engine,
    by_name: HashMap<&'static str, &'static str>,
}

impl Queries {
    fn parse(engine: Engine, files: &[&'static str]) -> Queries {
        let mut by_name = HashMap::new();
        for file in files {
            let mut rest = *file;
            while let Some(start) = rest.find("-- name: ") {
                let after = &rest[start + "-- name: ".len()..];
                let name_end = after.find('\n').unwrap_or(after.len());
                let name = after[..name_end].trim();
                let body_and_more = &after[name_end..];
                let body_end = body_and_more.find("-- name: ").unwrap_or(body_and_more.len());
                let body = body_and_more[..body_end].trim();
                assert!(by_name.insert(name, body).is_none(), "duplicate query name {name}");
                rest = &body_and_more[body_end..];
            }
        }
        Queries { engine, by_name }
    }

    /// The SQL of query `name`. Every name exists on both engines (checked by
    /// the conformance suite), so a missing one is a programming error.
    pub fn get(&self, name: &str) -> &'static str {
        match self.by_name.get(name) {
            Some(sql) => sql,
            None => panic!("no query named {name} for {:?}", self.engine),
        }
    }

    /// Every query name, for the conformance suite.
    pub fn names(&self) -> Vec<&'static str> {
        let mut names: Vec<_> = self.by_name.keys().copied().collect();
        names.sort_unstable();
        names
    }
}

macro_rules! engine_sql {
    ($engine:literal) => {
        [
            include_str!(concat!("sql/", $engine, "/runs.sql")),
            include_str!(concat!("sql/", $engine, "/outbox.sql")),
            include_str!(concat!("sql/", $engine, "/jobs.sql")),
            include_str!(concat!("sql/", $engine, "/effects.sql")),
            include_str!(concat!("sql/", $engine, "/relay.sql")),
            include_str!(concat!("sql/", $engine, "/consumer.sql")),
            include_str!(concat!("sql/", $engine, "/doctor.sql")),
        ]
    };
}

/// Queries only PostgreSQL has: set-based statements built on data-modifying
/// CTEs, which SQLite lacks (it runs the equivalent statement by statement),
/// and NOTIFY (one SQLite process has nobody to notify).
pub const POSTGRES_ONLY: &[&str] = &["complete_batch", "notify_work"];

/// PostgreSQL's named queries.
pub static POSTGRES: LazyLock<Queries> = LazyLock::new(|| Queries::parse(Engine::Postgres, &engine_sql!("postgres")));
/// SQLite's named queries.
pub static SQLITE: LazyLock<Queries> = LazyLock::new(|| Queries::parse(Engine::Sqlite, &engine_sql!("sqlite")));
