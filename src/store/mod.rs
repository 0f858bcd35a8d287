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
use sqlx::{PgConnection, SqliteConnection, SqlitePool};

pub use crate::engine::Engine;
use crate::error::{Error, Result};

/// The PostgreSQL migrations, without sqlx's own lock: that one is one
/// exclusive advisory lock per database, so every schema's migrator in a
/// database waited for every other's. [`migrate`] takes its own instead.
/// (`locking` and `run_direct`, below, are public but hidden in sqlx
/// 0.8.6; the lockfile pins the version, and an sqlx that drops them fails
/// to compile here rather than change behaviour.)
static PG_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate::Migrator {
    locking: false,
    ..sqlx::migrate!("./migrations/postgres")
};

/// The first key of the migrations' lock on their schema (`"Ferr"`), in
/// PostgreSQL's two-key space of advisory locks, apart from the one-key
/// space sqlx's lock and Ferry's other locks use; the second key is the
/// schema's `hashtext`.
const MIGRATION_LOCK: i32 = 0x4665_7272;

/// The key of sqlx's migration lock on `database` (sqlx-postgres 0.8.6,
/// `generate_lock_id`), which Ferry's releases before this one took
/// exclusively around their migrations. [`migrate`] takes it shared: an
/// older migrator of the same database (a rolling deploy, an older `ferry
/// migrate`) and this one exclude each other, and migrators of this
/// version do not wait for each other on it.
fn sqlx_migration_lock(database: &str) -> i64 {
    const CRC_IEEE: crc::Crc<u32> = crc::Crc::<u32>::new(&crc::CRC_32_ISO_HDLC);
    0x3d32ad9e * i64::from(CRC_IEEE.checksum(database.as_bytes()))
}

static SQLITE_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/sqlite");

/// A connection pool on either engine.
#[derive(Debug, Clone)]
pub enum Db {
    /// PostgreSQL pool, direct or through a transaction pooler.
    Postgres(PgDb),
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
    /// PostgreSQL only: the URL reaches the server through a pooler in
    /// transaction mode (PgBouncer's `pool_mode = transaction`, the managed
    /// poolers of hosted PostgreSQL), which hands each transaction, or each
    /// round trip outside one, to any of its server sessions. Then nothing
    /// may rely on a session: every statement is unnamed and inside a
    /// transaction ([`Route::TransactionPooler`]), no session `SET` is made
    /// (it would stay on a server session other clients then get;
    /// `idle_in_transaction_timeout` is not applied, set it on the role
    /// instead), and wake-ups poll instead of `LISTEN` (see
    /// [`crate::FerryBuilder::transaction_pooler`]). Also set by the URL
    /// parameter `pgbouncer=true`, which is removed before connecting.
    pub transaction_pooler: bool,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            max_connections: 16,
            acquire_timeout: Duration::from_secs(10),
            idle_in_transaction_timeout: None,
            transaction_pooler: false,
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
        let (url, pooler) = transaction_pooler_param(url)?;
        let pooler = pooler || opts.transaction_pooler;
        let mut options = PgConnectOptions::from_str(&url)?;
        if pooler {
            // A stock PgBouncer refuses startup parameters it does not know
            // (`ignore_startup_parameters`), and sqlx sends this one; the
            // server's default since PostgreSQL 12 already prints floats
            // exactly, and sqlx reads results in binary anyway.
            options = options.extra_float_digits(None);
        }
        let mut pool = PgPoolOptions::new()
            .max_connections(opts.max_connections)
            .acquire_timeout(opts.acquire_timeout);
        if let (Some(_), true) = (opts.idle_in_transaction_timeout, pooler) {
            tracing::warn!(
                "behind a transaction pooler a session SET would stay on a server session other clients get: \
                 idle_in_transaction_timeout is not applied (set it on the role: \
                 ALTER ROLE ... SET idle_in_transaction_session_timeout)"
            );
        } else if let Some(limit) = opts.idle_in_transaction_timeout {
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
        let route = if pooler {
            Route::TransactionPooler
        } else {
            Route::Direct
        };
        Ok(Db::Postgres(PgDb::new(pool, route)))
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

/// Splits the URL parameter `pgbouncer=true` (or `false`) off a PostgreSQL
/// URL: the URL without it, and whether it said a transaction pooler is in
/// between (the parameter Prisma users know; libpq and sqlx do not).
pub fn transaction_pooler_param(url: &str) -> Result<(String, bool)> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_owned(), false));
    };
    let mut pooler = false;
    let mut kept = Vec::new();
    for pair in query.split('&') {
        match pair.split_once('=') {
            Some(("pgbouncer", v)) => {
                pooler = match v {
                    "true" | "1" => true,
                    "false" | "0" => false,
                    _ => {
                        return Err(Error::Config(format!(
                            "database URL parameter pgbouncer={v}: expected true or false"
                        )))
                    }
                }
            }
            _ => kept.push(pair),
        }
    }
    let url = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    Ok((url, pooler))
}

/// Applies the embedded migrations of the pool's engine. Idempotent.
///
/// On PostgreSQL it runs on a session of its own, taken out of the pool,
/// which holds an advisory lock on the schema it migrates (`current_schema()`,
/// the first existing schema of `search_path`): concurrent migrators of one
/// schema wait for each other (for as long as it takes, as sqlx's did),
/// while those of other schemas in the same database go on. It also holds
/// sqlx's lock on the database shared, so an older Ferry migrating the same
/// database (which took that one exclusively) and this one wait for each
/// other. The session is closed at the end, or dropped with the future when
/// the caller gives up, and the server releases both locks with it (a
/// backend waiting for a lock notices its client gone once it has it). It
/// prepares statements by name: run it on a direct connection, not through
/// a transaction pooler (see [`crate::FerryBuilder::direct_url`]).
pub async fn migrate(db: &Db) -> Result<()> {
    if db.route() == Route::TransactionPooler {
        return Err(Error::Config(
            "migrations need a session of their own (a lock, named statements), which a transaction pooler does \
             not give: run them with a direct URL (FerryBuilder::direct_url, or `ferry migrate`)"
                .into(),
        ));
    }
    match db {
        Db::Postgres(p) => {
            use sqlx::Connection as _;
            // Taken out of the pool (its connect hooks and acquire timeout
            // apply), never given back: a connection given back by a
            // dropped future would keep the locks for as long as it lives.
            let mut session = p.pool().acquire().await?.detach();
            let database: String = sqlx::query_scalar("SELECT current_database()::text")
                .fetch_one(&mut session)
                .await?;
            // The schema's lock first, then sqlx's shared: a migrator that
            // waits for its schema holds nothing an older migrator's
            // exclusive request (and every migrator queued behind that
            // request) would wait for.
            sqlx::query("SELECT pg_advisory_lock($1, hashtext(coalesce(current_schema(), '')))")
                .bind(MIGRATION_LOCK)
                .execute(&mut session)
                .await?;
            sqlx::query("SELECT pg_advisory_lock_shared($1)")
                .bind(sqlx_migration_lock(&database))
                .execute(&mut session)
                .await?;
            // `run_direct`, not `run`: `run` on a connection makes this
            // future fail `Send` for a spawned task (sqlx's "`Acquire` is
            // not general enough"; `run_direct` is its way around it).
            PG_MIGRATOR.run_direct(&mut session).await?;
            // Migrated: a failure to say goodbye is the session's end all
            // the same, and the server releases the locks with it.
            if let Err(e) = session.close().await {
                tracing::debug!(error = %e, "closing the migrations' session");
            }
        }
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
            Db::Postgres(p) => Tx::Postgres(p.pool().begin().await?, p.route()),
            Db::Sqlite(p) => Tx::Sqlite(p.begin_with("BEGIN IMMEDIATE").await?),
        })
    }

    /// Closes the pool.
    pub async fn close(&self) {
        match self {
            Db::Postgres(p) => p.pool().close().await,
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

    /// The PostgreSQL pool, if this is one (an executor that follows its
    /// [`Route`]; see [`PgDb`]).
    pub fn as_postgres(&self) -> Option<&PgDb> {
        match self {
            Db::Postgres(p) => Some(p),
            Db::Sqlite(_) => None,
        }
    }

    /// How the pool reaches its server ([`Route::Direct`] on SQLite).
    pub fn route(&self) -> Route {
        match self {
            Db::Postgres(p) => p.route(),
            Db::Sqlite(_) => Route::Direct,
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
    /// A PostgreSQL transaction, and how its pool reaches the server.
    Postgres(sqlx::Transaction<'static, sqlx::Postgres>, Route),
    /// A SQLite transaction.
    Sqlite(sqlx::Transaction<'static, sqlx::Sqlite>),
}

impl Tx {
    /// Commits everything written in this transaction.
    pub async fn commit(self) -> Result<()> {
        match self {
            Tx::Postgres(t, _) => t.commit().await?,
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
            Tx::Postgres(t, _) => t.rollback().await?,
            Tx::Sqlite(t) => t.rollback().await?,
        }
        Ok(())
    }

    /// The PostgreSQL connection, for the service's own statements (behind
    /// a transaction pooler, give them `.persistent(false)`: a named
    /// statement can meet another client's of the same name).
    pub fn postgres(&mut self) -> Option<&mut PgConnection> {
        match self {
            Tx::Postgres(t, _) => Some(&mut **t),
            Tx::Sqlite(_) => None,
        }
    }

    /// The PostgreSQL connection as an executor that follows the pool's
    /// [`Route`] (unnamed statements behind a transaction pooler).
    pub fn pg(&mut self) -> Option<PgConn<'_>> {
        match self {
            Tx::Postgres(t, route) => Some(PgConn::new(t, *route)),
            Tx::Sqlite(_) => None,
        }
    }

    /// The SQLite connection, for the service's own statements.
    pub fn sqlite(&mut self) -> Option<&mut SqliteConnection> {
        match self {
            Tx::Sqlite(t) => Some(&mut **t),
            Tx::Postgres(..) => None,
        }
    }

    /// This transaction as a [`Conn`] for Ferry's `*_in` calls.
    pub fn conn(&mut self) -> Conn<'_> {
        match self {
            Tx::Postgres(t, route) => Conn::Postgres(PgConn::new(t, *route)),
            Tx::Sqlite(t) => Conn::Sqlite(t),
        }
    }
}

/// A borrowed connection on either engine, usually inside a transaction the
/// caller holds. `&mut PgConnection`, `&mut SqliteConnection` and `&mut Tx`
/// all convert into it, so a service's own `sqlx::Transaction` works too
/// (a `&mut PgConnection` as reached directly: Ferry's `*_in` calls give it
/// their handle's [`Route`]).
///
/// On SQLite, begin your own transaction with `BEGIN IMMEDIATE` (sqlx:
/// `pool.begin_with("BEGIN IMMEDIATE")`), as [`Db::begin`] does: several
/// `*_in` calls read before they write, and a deferred transaction can then
/// fail to upgrade its lock with `SQLITE_BUSY` instead of waiting.
#[derive(Debug)]
pub enum Conn<'c> {
    /// PostgreSQL.
    Postgres(PgConn<'c>),
    /// SQLite.
    Sqlite(&'c mut SqliteConnection),
}

impl<'c> From<&'c mut PgConnection> for Conn<'c> {
    fn from(c: &'c mut PgConnection) -> Self {
        Conn::Postgres(PgConn::new(c, Route::Direct))
    }
}

impl<'c> From<PgConn<'c>> for Conn<'c> {
    fn from(c: PgConn<'c>) -> Self {
        Conn::Postgres(c)
    }
}

impl<'a> From<&'a mut PgConn<'_>> for Conn<'a> {
    fn from(c: &'a mut PgConn<'_>) -> Self {
        Conn::Postgres(c.reborrow())
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
            Conn::Postgres(c) => Conn::Postgres(c.reborrow()),
            Conn::Sqlite(c) => Conn::Sqlite(c),
        }
    }

    /// Runs `f` under a savepoint of this connection's transaction: its
    /// writes stay when it returns `Ok` and are rolled back when it returns
    /// `Err`, so one refused item of a batch leaves none of its writes. The
    /// outer `Err` is the savepoint's own failure; the inner result is `f`'s.
    pub(crate) async fn in_savepoint<T>(&mut self, f: impl AsyncFnOnce(Conn<'_>) -> Result<T>) -> Result<Result<T>> {
        macro_rules! under_savepoint {
            ($c:expr, |$sp:ident| $conn:expr) => {{
                let mut sp = sqlx::Connection::begin($c).await?;
                let one = {
                    let $sp = &mut *sp;
                    f($conn).await
                };
                if one.is_ok() {
                    sp.commit().await?;
                } else {
                    sp.rollback().await?;
                }
                Ok(one)
            }};
        }
        match self.reborrow() {
            Conn::Postgres(mut c) => {
                let route = c.route();
                under_savepoint!(c.raw(), |sp| Conn::Postgres(PgConn::new(sp, route)))
            }
            Conn::Sqlite(c) => under_savepoint!(c, |sp| Conn::Sqlite(sp)),
        }
    }

    /// This connection with its pool's route taken from `db` (a
    /// `&mut PgConnection` converts as reached directly; a handle behind a
    /// transaction pooler says so here, in its `*_in` calls).
    pub fn routed(self, db: &Db) -> Self {
        match self {
            Conn::Postgres(c) => {
                let route = match db.route() {
                    Route::Direct => c.route(),
                    pooler => pooler,
                };
                Conn::Postgres(PgConn::new(c.into_raw(), route))
            }
            sqlite => sqlite,
        }
    }
}

mod capability;
pub(crate) use capability::Batching;
mod millis;
mod pooled;
pub use pooled::{PgConn, PgDb, Route};
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
            $crate::store::Conn::Postgres(mut $c) => {
                let $c = &mut $c;
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
    if let Db::Postgres(p) = db {
        if p.route() == Route::TransactionPooler {
            return check_through_pooler(p, named).await;
        }
    }
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

/// [`check_queries`] through a transaction pooler: each query is prepared
/// with SQL's `PREPARE` under a unique name and deallocated at once, all in
/// one transaction (one server session), so no statement is left on a
/// session that other clients get, and none of another client's is met.
async fn check_through_pooler(p: &PgDb, named: Vec<(&'static str, &'static str)>) -> Result<()> {
    let mut tx = p.pool().begin().await?;
    let tag = uuid::Uuid::now_v7().simple();
    for (i, (name, sql)) in named.into_iter().enumerate() {
        let statement = format!("ferry_check_{tag}_{i}");
        let prepare = format!("PREPARE {statement} AS {sql}");
        sqlx::Executor::execute(&mut *tx, prepare.as_str())
            .await
            .map_err(|e| Error::Query {
                name,
                engine: Engine::Postgres,
                message: e.to_string(),
            })?;
        let deallocate = format!("DEALLOCATE {statement}");
        sqlx::Executor::execute(&mut *tx, deallocate.as_str()).await?;
    }
    tx.rollback().await?;
    Ok(())
}
