//! Which database engine a pool or connection talks to: the one fact about
//! the engine that the layers above the store (errors, notifications) need,
//! kept apart so that naming it does not import the store.

/// Which engine a pool talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// PostgreSQL 13+.
    Postgres,
    /// SQLite in WAL mode, one process.
    Sqlite,
}
