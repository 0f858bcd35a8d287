//! PostgreSQL reached directly or through a pooler in transaction mode
//! (PgBouncer's `pool_mode = transaction`, the managed poolers of hosted
//! PostgreSQL), behind one executor.
//!
//! A transaction pooler hands a server session to a client for one
//! transaction, or, outside a transaction, until the server next says it is
//! idle: after every `Sync` of the extended protocol. sqlx runs a statement
//! with parameters in two such round trips (Parse, Describe, Sync; then Bind,
//! Execute, Sync), so the second can reach another client's session, where
//! a named statement of the same name may exist already (sqlx numbers them
//! per client connection: `prepared statement "sqlx_s_1" already exists`)
//! and the unnamed statement is another client's. Behind a pooler, then,
//! every statement Ferry runs is unnamed (planned on each call, never kept)
//! and inside a transaction: inside the caller's, or in one of its own
//! (`BEGIN`, the statement, `COMMIT`) when the connection is outside one.
//! Directly, statements stay prepared and cached per connection.
//!
//! [`PgDb`] (a pool) and [`PgConn`] (a borrowed connection) are the
//! executors [`crate::on_pool!`] and [`crate::on_conn!`] give their bodies
//! on PostgreSQL, so code that runs a query is written once for both routes.

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgQueryResult, PgRow, PgStatement, PgTypeInfo};
use sqlx::{Describe, Either, Execute, Executor, PgConnection, PgPool, Postgres, TransactionManager};

/// How a PostgreSQL pool reaches its server.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Route {
    /// Each pooled connection is a server session of its own: statements
    /// are prepared once per connection and cached.
    #[default]
    Direct,
    /// Through a pooler in transaction mode: every statement is unnamed and
    /// inside a transaction (see the module's documentation).
    TransactionPooler,
}

/// A PostgreSQL pool and its [`Route`]. As an executor (`&PgDb`), a
/// statement behind a transaction pooler runs in a transaction of its own.
/// It derefs to the sqlx pool (`begin`, `acquire`, `close`): statements run
/// on those connections are the caller's to route (see [`PgDb::pool`]).
#[derive(Debug, Clone)]
pub struct PgDb {
    pool: PgPool,
    route: Route,
}

impl std::ops::Deref for PgDb {
    type Target = PgPool;

    fn deref(&self) -> &PgPool {
        &self.pool
    }
}

impl PgDb {
    /// `pool`, reaching its server by `route`.
    pub fn new(pool: PgPool, route: Route) -> Self {
        PgDb { pool, route }
    }

    /// The sqlx pool. Statements run on it directly are prepared by name:
    /// behind a transaction pooler, run them through `&PgDb` instead, or
    /// with `.persistent(false)` inside a transaction.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// How the pool reaches its server.
    pub fn route(&self) -> Route {
        self.route
    }
}

/// A borrowed PostgreSQL connection and the [`Route`] of its pool. As an
/// executor (`&mut PgConn`), a statement behind a transaction pooler is
/// unnamed, and outside a transaction runs in one of its own.
#[derive(Debug)]
pub struct PgConn<'c> {
    conn: &'c mut PgConnection,
    route: Route,
}

impl<'c> PgConn<'c> {
    /// `conn`, whose pool reaches its server by `route`.
    pub fn new(conn: &'c mut PgConnection, route: Route) -> Self {
        PgConn { conn, route }
    }

    /// Reborrows for one more call.
    pub fn reborrow(&mut self) -> PgConn<'_> {
        PgConn {
            conn: self.conn,
            route: self.route,
        }
    }

    /// How the connection's pool reaches its server.
    pub fn route(&self) -> Route {
        self.route
    }

    /// The sqlx connection (statements run on it directly are prepared by
    /// name, see [`PgDb::pool`]).
    pub fn raw(&mut self) -> &mut PgConnection {
        self.conn
    }

    /// Whether sqlx has a transaction open on the connection.
    pub(crate) fn in_transaction(&self) -> bool {
        in_transaction(self.conn)
    }

    /// The sqlx connection, for as long as this was borrowed.
    pub fn into_raw(self) -> &'c mut PgConnection {
        self.conn
    }
}

/// A query run as the unnamed statement: parsed and planned for this call
/// only, so nothing outlives it on the server session.
struct Unnamed<E>(E);

impl<'q, E: Execute<'q, Postgres>> Execute<'q, Postgres> for Unnamed<E> {
    fn sql(&self) -> &'q str {
        self.0.sql()
    }

    fn statement(&self) -> Option<&PgStatement<'q>> {
        // A prepared statement is a named one: its text is parsed again.
        None
    }

    fn take_arguments(&mut self) -> Result<Option<sqlx::postgres::PgArguments>, sqlx::error::BoxDynError> {
        self.0.take_arguments()
    }

    fn persistent(&self) -> bool {
        false
    }
}

type Step = Either<PgQueryResult, PgRow>;

/// Runs `query` unnamed on `conn` in a transaction of its own, whole (its
/// results are collected before `COMMIT`). A failed statement's transaction
/// is rolled back before this returns, so the session holds no lock after
/// it (a dropped transaction would only queue its `ROLLBACK` for the
/// connection's next use).
async fn in_own_transaction<'q, E>(conn: &mut PgConnection, query: E) -> Result<Vec<Step>, sqlx::Error>
where
    E: Execute<'q, Postgres> + 'q,
{
    let mut tx = sqlx::Connection::begin(conn).await?;
    let steps: Result<Vec<Step>, sqlx::Error> = (&mut *tx).fetch_many(Unnamed(query)).try_collect().await;
    match steps {
        Ok(steps) => {
            tx.commit().await?;
            Ok(steps)
        }
        Err(e) => {
            let _ = tx.rollback().await;
            Err(e)
        }
    }
}

/// A pooled connection running a statement in a transaction of its own:
/// dropped before it finished (the caller's future cancelled, between
/// `BEGIN` and `COMMIT` included), the connection is closed instead of
/// going back to the pool, so no server session is left holding an open
/// transaction (sqlx rolls back on drop only once `BEGIN` was answered).
struct OwnTransaction(Option<PoolConnection<Postgres>>);

impl OwnTransaction {
    async fn run<'q, E>(pool: &PgPool, query: E) -> Result<Vec<Step>, sqlx::Error>
    where
        E: Execute<'q, Postgres> + 'q,
    {
        let mut held = OwnTransaction(Some(pool.acquire().await?));
        let conn = held.0.as_mut().expect("held until finished");
        let steps = in_own_transaction(conn, query).await;
        // Finished, committed or rolled back: the connection may be reused.
        held.0.take();
        steps
    }
}

impl Drop for OwnTransaction {
    fn drop(&mut self) {
        if let Some(mut conn) = self.0.take() {
            conn.close_on_drop();
        }
    }
}

fn replay<'e>(steps: BoxFuture<'e, Result<Vec<Step>, sqlx::Error>>) -> BoxStream<'e, Result<Step, sqlx::Error>> {
    futures::stream::once(steps)
        .map_ok(|steps| futures::stream::iter(steps.into_iter().map(Ok)))
        .try_flatten()
        .boxed()
}

/// Preparing a statement by name (sqlx's `prepare`, `describe`) behind a
/// transaction pooler: the statement would stay on a server session other
/// clients get, and sqlx would bind it by name on whichever session serves
/// the connection next.
fn named_refused() -> sqlx::Error {
    sqlx::Error::Configuration(
        "a prepared statement cannot cross a transaction pooler (route TransactionPooler): run the query instead"
            .into(),
    )
}

fn first_row(steps: Vec<Step>) -> Option<PgRow> {
    steps.into_iter().find_map(|s| s.right())
}

impl<'p> Executor<'p> for &'p PgDb {
    type Database = Postgres;

    fn fetch_many<'e, 'q: 'e, E>(self, query: E) -> BoxStream<'e, Result<Step, sqlx::Error>>
    where
        'p: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        match self.route {
            Route::Direct => self.pool.fetch_many(query),
            Route::TransactionPooler => replay(Box::pin(OwnTransaction::run(&self.pool, query))),
        }
    }

    fn fetch_optional<'e, 'q: 'e, E>(self, query: E) -> BoxFuture<'e, Result<Option<PgRow>, sqlx::Error>>
    where
        'p: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        match self.route {
            Route::Direct => self.pool.fetch_optional(query),
            Route::TransactionPooler => {
                let pool = &self.pool;
                Box::pin(async move { Ok(first_row(OwnTransaction::run(pool, query).await?)) })
            }
        }
    }

    fn prepare_with<'e, 'q: 'e>(
        self,
        sql: &'q str,
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, Result<PgStatement<'q>, sqlx::Error>>
    where
        'p: 'e,
    {
        match self.route {
            Route::Direct => self.pool.prepare_with(sql, parameters),
            Route::TransactionPooler => Box::pin(async { Err(named_refused()) }),
        }
    }

    fn describe<'e, 'q: 'e>(self, sql: &'q str) -> BoxFuture<'e, Result<Describe<Postgres>, sqlx::Error>>
    where
        'p: 'e,
    {
        match self.route {
            Route::Direct => self.pool.describe(sql),
            Route::TransactionPooler => Box::pin(async { Err(named_refused()) }),
        }
    }
}

/// Whether sqlx has a transaction open on `conn` (one begun through sqlx:
/// behind a transaction pooler, begin transactions with sqlx's `begin`, not
/// a `BEGIN` statement of your own).
fn in_transaction(conn: &PgConnection) -> bool {
    sqlx::postgres::PgTransactionManager::get_transaction_depth(conn) > 0
}

impl<'a, 'c> Executor<'a> for &'a mut PgConn<'c> {
    type Database = Postgres;

    fn fetch_many<'e, 'q: 'e, E>(self, query: E) -> BoxStream<'e, Result<Step, sqlx::Error>>
    where
        'a: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        let conn = &mut *self.conn;
        match self.route {
            Route::Direct => conn.fetch_many(query),
            Route::TransactionPooler if in_transaction(conn) => conn.fetch_many(Unnamed(query)),
            Route::TransactionPooler => replay(Box::pin(in_own_transaction(conn, query))),
        }
    }

    fn fetch_optional<'e, 'q: 'e, E>(self, query: E) -> BoxFuture<'e, Result<Option<PgRow>, sqlx::Error>>
    where
        'a: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        let conn = &mut *self.conn;
        match self.route {
            Route::Direct => conn.fetch_optional(query),
            Route::TransactionPooler if in_transaction(conn) => conn.fetch_optional(Unnamed(query)),
            Route::TransactionPooler => Box::pin(async move { Ok(first_row(in_own_transaction(conn, query).await?)) }),
        }
    }

    fn prepare_with<'e, 'q: 'e>(
        self,
        sql: &'q str,
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, Result<PgStatement<'q>, sqlx::Error>>
    where
        'a: 'e,
    {
        match self.route {
            Route::Direct => self.conn.prepare_with(sql, parameters),
            Route::TransactionPooler => Box::pin(async { Err(named_refused()) }),
        }
    }

    fn describe<'e, 'q: 'e>(self, sql: &'q str) -> BoxFuture<'e, Result<Describe<Postgres>, sqlx::Error>>
    where
        'a: 'e,
    {
        match self.route {
            Route::Direct => self.conn.describe(sql),
            Route::TransactionPooler => Box::pin(async { Err(named_refused()) }),
        }
    }
}
