//! The one error type of the `ferry` library, with a stable machine-readable
//! [`Error::code`] for logs, metrics and HTTP bodies.
//!
//! Error text never carries a full idempotency key, a fingerprint source or a
//! payload: keys appear only as a short hash prefix ([`crate::redact`]).

use uuid::Uuid;

/// Convenience alias used across the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything a `ferry` call can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The input was refused before anything was written.
    #[error("invalid input: {field}: {reason}")]
    InvalidInput {
        /// Which field was refused.
        field: &'static str,
        /// Why, in words safe to show a caller.
        reason: String,
    },
    /// The idempotency key was used before with a request that is not equivalent.
    #[error("idempotency key {key_hash} was already used with a different request (operation {operation})")]
    IdempotencyConflict {
        /// The operation the key is scoped to.
        operation: String,
        /// A short hash prefix of the key, never the key itself.
        key_hash: String,
        /// The run the key is bound to.
        existing_run: Uuid,
    },
    /// A run with the proposed id already exists; nothing was written.
    #[error("run {run_id} already exists")]
    DuplicateRun {
        /// The proposed id that collided.
        run_id: Uuid,
    },
    /// The thing asked for does not exist for this tenant.
    #[error("{what} not found")]
    NotFound {
        /// What was looked up.
        what: &'static str,
    },
    /// The caller's lease is gone (expired, taken over, or finished): a stale
    /// worker may publish nothing further.
    #[error("lease lost on run {run_id} (generation {generation})")]
    LostLease {
        /// The run whose lease was lost.
        run_id: Uuid,
        /// The generation the caller held.
        generation: i64,
    },
    /// A relay's lane lease is gone (taken over by another relay at a newer
    /// generation, or released): it may not mark the lane's rows.
    #[error("lane {lane} lease lost (generation {generation})")]
    LostLane {
        /// The lane.
        lane: i32,
        /// The generation the relay held.
        generation: i64,
    },
    /// A consumer's partition lease is gone (the partition moved to another
    /// consumer at a higher generation): it may not commit effects.
    #[error("partition {topic}/{partition} lease lost (generation {generation})")]
    LostPartition {
        /// Topic.
        topic: String,
        /// Partition.
        partition: i32,
        /// The generation the consumer held.
        generation: i64,
    },
    /// The run already reached a terminal state, so the transition lost the race.
    #[error("run {run_id} is already {state}")]
    RunTerminal {
        /// The run.
        run_id: Uuid,
        /// The terminal state that won.
        state: String,
    },
    /// The run was cancelled; the holder of the lease must stop.
    #[error("run {run_id} was cancelled")]
    Cancelled {
        /// The run.
        run_id: Uuid,
    },
    /// The lease cannot be extended beyond the run's deadline.
    #[error("run {run_id} reached its deadline")]
    DeadlineExceeded {
        /// The run.
        run_id: Uuid,
    },
    /// An effect from an earlier generation is unresolved and must be
    /// reconciled before the step repeats.
    #[error("effect {step}/{operation} is {state} from generation {generation}; reconcile it first")]
    EffectNeedsReconcile {
        /// The step name.
        step: String,
        /// The operation name.
        operation: String,
        /// `reserved` or `unknown`.
        state: String,
        /// The generation that left it unresolved.
        generation: i64,
    },
    /// A dead run was already replayed and the caller did not ask to replay again.
    #[error("run {run_id} was already replayed as {replayed_as}")]
    AlreadyReplayed {
        /// The dead run.
        run_id: Uuid,
        /// The run created by the earlier replay.
        replayed_as: Uuid,
    },
    /// The run is not in a state that allows the request.
    #[error("run {run_id} is {state}: {reason}")]
    InvalidState {
        /// The run.
        run_id: Uuid,
        /// Its current state.
        state: String,
        /// Why that refuses the request.
        reason: &'static str,
    },
    /// The configuration is unusable (a bad URL, a worker without queues).
    #[error("configuration: {0}")]
    Config(String),
    /// The schema is not the one this version expects: migrations were not
    /// run, or a settings row is missing.
    #[error("schema not migrated: {0}")]
    NotMigrated(String),
    /// A named query does not prepare on this database (found by
    /// `store::check_queries`): the schema and the code disagree.
    #[error("query {name} does not prepare on {engine:?}: {message}")]
    Query {
        /// The query's name in its `sql/` file.
        name: &'static str,
        /// The engine it was prepared on.
        engine: crate::engine::Engine,
        /// The database's message.
        message: String,
    },
    /// A row holds a value this version does not know (an unknown state), so
    /// it was written by something else or by a newer version.
    #[error("corrupt row: {what} {value:?}")]
    CorruptRow {
        /// Which column.
        what: &'static str,
        /// The value found.
        value: String,
    },
    /// A statement returned something its own SQL rules out: a bug in Ferry.
    #[error("broken invariant: {0}")]
    Invariant(String),
    /// The part that would do the work is shutting down (a worker's slots or
    /// its completer closed); retry on another instance.
    #[error("shutting down: {0}")]
    ShuttingDown(&'static str),
    /// The call raced a concurrent change that removed what it had just
    /// seen (an idempotency record swept between its conflict and its read);
    /// nothing was written and the same call may be retried.
    #[error("raced a concurrent change: {0}; retry")]
    Raced(&'static str),
    /// The call is not supported in this setup: advancing the database
    /// clock, or claiming from a limited queue on a PostgreSQL connection
    /// outside a transaction (its limits need the queue's row lock held to
    /// commit). Nothing was written by the refused step.
    #[error("unsupported: {0}")]
    Unsupported(&'static str),
    /// The database failed or could not be reached.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// Migrations failed.
    #[error("migration: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
}

impl Error {
    /// The stable machine-readable code of this error.
    pub fn code(&self) -> &'static str {
        match self {
            Error::InvalidInput { .. } => "invalid_input",
            Error::IdempotencyConflict { .. } => "idempotency_conflict",
            Error::DuplicateRun { .. } => "duplicate_run",
            Error::NotFound { .. } => "not_found",
            Error::LostLease { .. } | Error::LostLane { .. } | Error::LostPartition { .. } => "lost_lease",
            Error::RunTerminal { .. } => "run_terminal",
            Error::Cancelled { .. } => "cancelled",
            Error::DeadlineExceeded { .. } => "deadline_exceeded",
            Error::EffectNeedsReconcile { .. } => "effect_needs_reconcile",
            Error::AlreadyReplayed { .. } => "already_replayed",
            Error::InvalidState { .. } => "invalid_state",
            Error::Config(_) => "config",
            Error::NotMigrated(_) => "not_migrated",
            Error::Query { .. } => "query_does_not_prepare",
            Error::CorruptRow { .. } => "corrupt_row",
            Error::Invariant(_) => "invariant",
            Error::ShuttingDown(_) => "shutting_down",
            Error::Unsupported(_) => "unsupported",
            Error::Raced(_) => "raced",
            Error::Database(_) => "database",
            Error::Migrate(_) => "migrate",
        }
    }

    /// True when retrying the same call later may succeed (database
    /// unreachable, connection reset, serialization failure, a part shutting
    /// down).
    pub fn is_transient(&self) -> bool {
        match self {
            Error::ShuttingDown(_) | Error::Raced(_) => true,
            Error::Database(e) => match e {
                sqlx::Error::Io(_)
                | sqlx::Error::Protocol(_)
                | sqlx::Error::PoolTimedOut
                | sqlx::Error::PoolClosed
                | sqlx::Error::WorkerCrashed => true,
                sqlx::Error::Database(db) => match db.code().as_deref() {
                    // Any connection exception (class 08).
                    Some(code) if code.starts_with("08") => true,
                    // serialization_failure, deadlock_detected, statement
                    // timeout (query_canceled), lock_not_available,
                    // read_only_sql_transaction (a failover in progress),
                    // idle_in_transaction_session_timeout (the session was
                    // ended, its transaction rolled back),
                    // too_many_connections, admin_shutdown, crash_shutdown,
                    // cannot_connect_now; SQLITE_BUSY, SQLITE_LOCKED,
                    // SQLITE_BUSY_SNAPSHOT.
                    Some(
                        "40001" | "40P01" | "57014" | "55P03" | "25006" | "25P03" | "53300" | "57P01" | "57P02"
                        | "57P03" | "5" | "6" | "517",
                    ) => true,
                    _ => false,
                },
                _ => false,
            },
            _ => false,
        }
    }

    pub(crate) fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidInput {
            field,
            reason: reason.into(),
        }
    }
}

/// The name of the violated constraint, when `err` is a constraint violation.
pub(crate) fn violated_constraint(err: &sqlx::Error) -> Option<String> {
    let db = err.as_database_error()?;
    if let Some(name) = db.constraint() {
        return Some(name.to_owned());
    }
    // SQLite does not report constraint names; map its messages to our names.
    let msg = db.message();
    if msg.starts_with("UNIQUE constraint failed: runs.") {
        Some("runs_pkey".into())
    } else if msg.starts_with("UNIQUE constraint failed: run_events.") {
        Some(
            if msg.contains("seq") {
                "run_events_pkey"
            } else {
                "run_events_one_terminal_idx"
            }
            .into(),
        )
    } else if msg.starts_with("UNIQUE constraint failed: idempotency_keys.") {
        Some("idempotency_keys_pkey".into())
    } else {
        None
    }
}
