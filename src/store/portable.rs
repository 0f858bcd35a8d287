//! Portable statements for a service's own simple writes beside Ferry's (a
//! projection row, an order), written once for both engines: the SQL must
//! be text both engines accept, with `$1`-style parameters. Code that needs
//! engine-specific SQL takes its own `sqlx` connection instead and passes it
//! to the `*_in` calls.

use sqlx::pool::PoolConnection;

use super::{Conn, Db, Engine, PgConn, PgDb, Route, Tx};
use crate::error::Result;

/// One parameter of a portable statement.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arg<'a> {
    /// TEXT.
    Text(&'a str),
    /// BIGINT / INTEGER.
    Int(i64),
    /// BOOLEAN (an INTEGER 0/1 on SQLite).
    Bool(bool),
}

impl<'a> From<&'a str> for Arg<'a> {
    fn from(s: &'a str) -> Self {
        Arg::Text(s)
    }
}

impl<'a> From<&'a String> for Arg<'a> {
    fn from(s: &'a String) -> Self {
        Arg::Text(s)
    }
}

impl From<i64> for Arg<'_> {
    fn from(n: i64) -> Self {
        Arg::Int(n)
    }
}

impl From<bool> for Arg<'_> {
    fn from(b: bool) -> Self {
        Arg::Bool(b)
    }
}

macro_rules! bind_all {
    ($q:expr, $args:expr) => {{
        let mut q = $q;
        for a in $args {
            q = match *a {
                Arg::Text(s) => q.bind(s),
                Arg::Int(n) => q.bind(n),
                Arg::Bool(b) => q.bind(b),
            };
        }
        q
    }};
}

impl Conn<'_> {
    /// The engine this connection talks to.
    pub fn engine(&self) -> Engine {
        match self {
            Conn::Postgres(_) => Engine::Postgres,
            Conn::Sqlite(_) => Engine::Sqlite,
        }
    }

    /// Runs one portable statement in this connection's transaction and
    /// returns the rows it changed.
    pub async fn execute(&mut self, sql: &str, args: &[Arg<'_>]) -> Result<u64> {
        Ok(match self {
            Conn::Postgres(c) => bind_all!(sqlx::query(sql), args).execute(c).await?.rows_affected(),
            Conn::Sqlite(c) => bind_all!(sqlx::query(sql), args)
                .execute(&mut **c)
                .await?
                .rows_affected(),
        })
    }
}

impl Tx {
    /// Runs one portable statement in this transaction (see [`Conn::execute`]).
    pub async fn execute(&mut self, sql: &str, args: &[Arg<'_>]) -> Result<u64> {
        self.conn().execute(sql, args).await
    }
}

/// A connection taken from a [`Db`] pool, returned to it on drop.
#[derive(Debug)]
pub enum PooledConn {
    /// PostgreSQL, and how its pool reaches the server.
    Postgres(PoolConnection<sqlx::Postgres>, Route),
    /// SQLite.
    Sqlite(PoolConnection<sqlx::Sqlite>),
}

impl PooledConn {
    /// This connection as a [`Conn`] for one call.
    pub fn conn(&mut self) -> Conn<'_> {
        match self {
            PooledConn::Postgres(c, route) => Conn::Postgres(PgConn::new(c, *route)),
            PooledConn::Sqlite(c) => Conn::Sqlite(c),
        }
    }
}

impl Db {
    /// Takes one connection from the pool (outside any transaction).
    pub async fn acquire(&self) -> Result<PooledConn> {
        Ok(match self {
            Db::Postgres(p) => PooledConn::Postgres(p.pool().acquire().await?, p.route()),
            Db::Sqlite(p) => PooledConn::Sqlite(p.acquire().await?),
        })
    }

    /// Runs one portable statement outside a transaction.
    pub async fn execute(&self, sql: &str, args: &[Arg<'_>]) -> Result<u64> {
        self.acquire().await?.conn().execute(sql, args).await
    }
}

impl From<sqlx::PgPool> for Db {
    /// A pool that reaches its server directly.
    fn from(p: sqlx::PgPool) -> Self {
        Db::Postgres(PgDb::new(p, Route::Direct))
    }
}

impl From<sqlx::SqlitePool> for Db {
    fn from(p: sqlx::SqlitePool) -> Self {
        Db::Sqlite(p)
    }
}
