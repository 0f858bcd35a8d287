//! The questions whose answer is the engine's, asked by the code above the
//! store instead of matching on the engine: how a batch of items is written
//! ([`Conn::batching`]: one set-based statement, or item by item), whether
//! one statement may write without a transaction, whether a row lock ends
//! with its statement, and whether the engine has `NOTIFY`. Each answer is
//! given here, once; the algorithms that follow from it stay with their
//! domain (the claim and batch completion in `jobs/claim.rs`, bulk
//! acceptance in `runs/bulk.rs`).

use super::{queries, Conn, Db, PgConn, Route};
use crate::error::Result;

/// How an engine writes a batch of items (the jobs of one claim, the leases
/// of one completion, the runs of one bulk acceptance): what
/// [`Conn::batching`] answers, with the connection to do it on.
#[derive(Debug)]
pub(crate) enum Batching<'c> {
    /// The whole batch in one statement: data-modifying CTEs over array
    /// parameters (the `[postgres only]` queries), and a claim statement
    /// that writes the attempt rows and reads the runs itself. PostgreSQL.
    SetBased(PgConn<'c>),
    /// Item by item, a few statements each (a savepoint per item where one
    /// refused item must not leave half its writes), and a claim statement
    /// that only leases: the attempt rows and the runs are steps of their
    /// own. SQLite: one writer serializes the items anyway, and it has
    /// neither array parameters nor data-modifying CTEs.
    OneByOne(Conn<'c>),
}

impl<'c> Conn<'c> {
    /// How this connection's engine writes a batch (see [`Batching`]).
    pub(crate) fn batching(self) -> Batching<'c> {
        match self {
            Conn::Postgres(c) => Batching::SetBased(c),
            conn @ Conn::Sqlite(_) => Batching::OneByOne(conn),
        }
    }
}

impl Conn<'_> {
    /// Whether this engine has `LISTEN`/`NOTIFY` (PostgreSQL). SQLite has
    /// none: its listeners only poll, so a wake-up is not sent at all.
    pub(crate) fn has_notify(&self) -> bool {
        matches!(self, Conn::Postgres(_))
    }

    /// Whether a row lock taken on this connection ends with its statement:
    /// a PostgreSQL connection outside a transaction (autocommit). SQLite
    /// takes no row locks (its writer lock is the whole database's), so
    /// never. A step that must hold a row until commit refuses such a
    /// connection before it writes anything.
    pub(crate) async fn releases_row_locks_per_statement(&mut self) -> Result<bool> {
        Ok(match self {
            // Behind a transaction pooler, a statement outside a
            // transaction runs in one of its own, so the question is
            // sqlx's: whether it has one open on the connection.
            Conn::Postgres(c) if c.route() == Route::TransactionPooler => !c.in_transaction(),
            Conn::Postgres(c) => {
                let in_tx: bool = sqlx::query_scalar(queries::POSTGRES_ONLY.in_transaction)
                    .fetch_one(c)
                    .await?;
                !in_tx
            }
            Conn::Sqlite(_) => false,
        })
    }
}

impl Db {
    /// Whether this engine does several writes in one autocommitted
    /// statement (PostgreSQL's data-modifying CTEs; [`Batching::SetBased`]),
    /// so a caller may run such a statement on a pooled connection without
    /// a transaction. SQLite runs the same writes one by one, which needs a
    /// transaction around them.
    pub(crate) fn writes_in_one_statement(&self) -> bool {
        matches!(self, Db::Postgres(_))
    }
}
