//! The consumer's error types: what a handler returns, what the runtime can
//! fail with, each with a stable code, and [`classify`], which decides whose
//! fault a database error is: the infrastructure's (retried without spending
//! the record's budget, never dead-lettered) or the record's.

/// How a handler failed, which decides what happens to the record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandlerClass {
    /// Retry in place with backoff, the partition paused meanwhile, while the
    /// record's retry budget lasts; then dead-letter it.
    Retryable,
    /// Never retry: dead-letter the record and move on.
    Terminal,
    /// Not this record's fault: the database (or another service every record
    /// needs) failed. Retried in place with backoff and without a budget, the
    /// partition paused, for as long as it takes; never dead-lettered. A
    /// handler's `?` on a database error gives this class to every error
    /// [`classify`] calls [`Fault::Infrastructure`].
    Infrastructure,
}

/// A handler's failure, with a safe code put on the dead-letter record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{class:?} handler error {code}")]
pub struct HandlerError {
    /// Retry classification.
    pub class: HandlerClass,
    /// Safe machine code.
    pub code: String,
}

impl HandlerError {
    /// A retryable failure: it spends the record's retry budget.
    pub fn retryable(code: impl Into<String>) -> Self {
        HandlerError {
            class: HandlerClass::Retryable,
            code: code.into(),
        }
    }

    /// A terminal failure: the record is dead-lettered at once.
    pub fn terminal(code: impl Into<String>) -> Self {
        HandlerError {
            class: HandlerClass::Terminal,
            code: code.into(),
        }
    }

    /// A failure of something every record needs (a service the handler
    /// calls is down): retried without a budget, never dead-lettered.
    pub fn infrastructure(code: impl Into<String>) -> Self {
        HandlerError {
            class: HandlerClass::Infrastructure,
            code: code.into(),
        }
    }
}

impl From<ferry::Error> for HandlerError {
    /// A database error from the handler's own statements, classified by
    /// [`classify`]: the infrastructure's is [`HandlerClass::Infrastructure`]
    /// even though the handler's statement met it (a database outage must
    /// never dead-letter a record); the record's is terminal.
    fn from(e: ferry::Error) -> Self {
        match classify(&e) {
            Fault::Infrastructure(code) => HandlerError::infrastructure(code),
            Fault::Record(code) => HandlerError::terminal(code),
        }
    }
}

impl From<sqlx::Error> for HandlerError {
    /// As for [`ferry::Error`]: classified by [`classify`].
    fn from(e: sqlx::Error) -> Self {
        ferry::Error::from(e).into()
    }
}

/// Whose fault an error met while processing a record is. The code is stable
/// and safe to log: a PostgreSQL SQLSTATE class name, a SQLite result code
/// name, or the name of the client-side failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The database, the network, the pool or the deployment (schema,
    /// grants, configuration) failed, and would fail any record alike: the
    /// record is retried without spending its budget and never dead-lettered.
    Infrastructure(&'static str),
    /// What was written for this record was refused (a constraint, a value
    /// out of range or too large, a row it names is missing): terminal for
    /// the record, which is dead-lettered.
    Record(&'static str),
}

impl Fault {
    /// The stable code.
    pub fn code(self) -> &'static str {
        match self {
            Fault::Infrastructure(c) | Fault::Record(c) => c,
        }
    }
}

/// Decides whose fault `e` is, wherever in a record's transaction it
/// surfaced (the consumer's own statements, the handler's, the commit).
///
/// Only the record's own data makes a record's fault: data exceptions,
/// constraint violations (including deferred ones at commit), cardinality
/// and program limits, and refusals raised by triggers or PL/pgSQL. Every
/// connection, I/O, pool, shutdown, serialization, resource, privilege or
/// schema error is infrastructure: it would strike any record, so it waits
/// for the database or the operator instead of dead-lettering the stream.
/// Each variant of [`ferry::Error`] and [`sqlx::Error`] and each SQLSTATE
/// class is listed; the fallbacks exist only because those enums are
/// `#[non_exhaustive]` and SQLSTATE classes can be added, and they are
/// `unclassified` infrastructure (logged), so an unknown error waits rather
/// than guessing that a record is poison.
pub fn classify(e: &ferry::Error) -> Fault {
    use ferry::Error as E;
    use Fault::{Infrastructure as Infra, Record};
    match e {
        E::Database(e) => classify_sqlx(e),
        // A concurrent change, or a part shutting down: try again.
        E::Raced(_) => Infra("raced"),
        E::ShuttingDown(_) => Infra("shutting_down"),
        // The deployment: schema, configuration, a version skew, a bug.
        E::NotMigrated(_) | E::Migrate(_) | E::Query { .. } => Infra("schema"),
        E::Config(_) | E::Unsupported(_) => Infra("config"),
        E::CorruptRow { .. } => Infra("corrupt_row"),
        E::Invariant(_) => Infra("invariant"),
        // What the handler asked of Ferry for this record was refused.
        E::InvalidInput { .. }
        | E::IdempotencyConflict { .. }
        | E::DuplicateRun { .. }
        | E::NotFound { .. }
        | E::LostLease { .. }
        | E::LostLane { .. }
        | E::LostPartition { .. }
        | E::RunTerminal { .. }
        | E::Cancelled { .. }
        | E::DeadlineExceeded { .. }
        | E::EffectNeedsReconcile { .. }
        | E::AlreadyReplayed { .. }
        | E::InvalidState { .. } => Record(e.code()),
        other => unclassified(other),
    }
}

/// [`classify`] for a driver error.
fn classify_sqlx(e: &sqlx::Error) -> Fault {
    use sqlx::Error as S;
    use Fault::{Infrastructure as Infra, Record};
    match e {
        S::Database(db) => {
            if db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>().is_some() {
                let code = db.code().unwrap_or_default();
                sqlstate_class(code.get(..2).unwrap_or_default(), e)
            } else if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() {
                match db.code().and_then(|c| c.parse::<i32>().ok()) {
                    // The primary result code is the low byte.
                    Some(code) => sqlite_code(code & 0xff, e),
                    None => unclassified(e),
                }
            } else {
                unclassified(e)
            }
        }
        S::Io(_) => Infra("io"),
        S::Tls(_) => Infra("tls"),
        S::Protocol(_) => Infra("protocol"),
        S::PoolTimedOut => Infra("pool_timed_out"),
        S::PoolClosed => Infra("pool_closed"),
        S::WorkerCrashed => Infra("worker_crashed"),
        S::Configuration(_) => Infra("config"),
        S::BeginFailed | S::InvalidSavePointStatement => Infra("transaction_state"),
        // The code and the schema disagree.
        S::TypeNotFound { .. } | S::ColumnIndexOutOfBounds { .. } | S::ColumnNotFound(_) => Infra("schema"),
        S::ColumnDecode { .. } | S::Decode(_) => Infra("decode"),
        S::AnyDriverError(_) => Infra("driver"),
        S::Migrate(_) => Infra("schema"),
        // What the handler bound or looked up for this record.
        S::InvalidArgument(_) => Record("invalid_argument"),
        S::Encode(_) => Record("encode"),
        S::RowNotFound => Record("row_not_found"),
        other => unclassified(other),
    }
}

/// [`classify`] for a PostgreSQL SQLSTATE class (its first two characters).
fn sqlstate_class(class: &str, e: &sqlx::Error) -> Fault {
    use Fault::{Infrastructure as Infra, Record};
    match class {
        // The record's data.
        "09" => Record("triggered_action_exception"),
        "20" => Record("case_not_found"),
        "21" => Record("cardinality_violation"),
        "22" => Record("data_exception"),
        "23" => Record("integrity_constraint_violation"),
        "27" => Record("triggered_data_change_violation"),
        "44" => Record("with_check_option_violation"),
        "54" => Record("program_limit_exceeded"),
        "P0" => Record("plpgsql_error"),
        // The database and the connection to it.
        "08" => Infra("connection_exception"),
        "40" => Infra("transaction_rollback"),
        "53" => Infra("insufficient_resources"),
        "55" => Infra("object_not_in_prerequisite_state"),
        "57" => Infra("operator_intervention"),
        "58" => Infra("system_error"),
        "72" => Infra("snapshot_failure"),
        "XX" => Infra("internal_error"),
        "F0" => Infra("config_file_error"),
        "HV" => Infra("fdw_error"),
        // Transaction and session state.
        "03" => Infra("sql_statement_not_yet_complete"),
        "0B" => Infra("invalid_transaction_initiation"),
        "24" => Infra("invalid_cursor_state"),
        "25" => Infra("invalid_transaction_state"),
        "26" => Infra("invalid_sql_statement_name"),
        "2D" => Infra("invalid_transaction_termination"),
        "34" => Infra("invalid_cursor_name"),
        "3B" => Infra("savepoint_exception"),
        "0F" => Infra("locator_exception"),
        "0Z" => Infra("diagnostics_exception"),
        // The deployment: schema, grants, roles, code.
        "0A" => Infra("feature_not_supported"),
        "0L" => Infra("invalid_grantor"),
        "0P" => Infra("invalid_role_specification"),
        "28" => Infra("invalid_authorization_specification"),
        "2B" => Infra("dependent_privilege_descriptors_still_exist"),
        "2F" => Infra("sql_routine_exception"),
        "38" => Infra("external_routine_exception"),
        "39" => Infra("external_routine_invocation_exception"),
        "3D" => Infra("invalid_catalog_name"),
        "3F" => Infra("invalid_schema_name"),
        "42" => Infra("syntax_error_or_access_rule_violation"),
        // Not errors (00, 01, 02), or a class this version does not know.
        _ => unclassified(e),
    }
}

/// [`classify`] for a SQLite primary result code.
fn sqlite_code(code: i32, e: &sqlx::Error) -> Fault {
    use Fault::{Infrastructure as Infra, Record};
    match code {
        // The record's data.
        18 => Record("sqlite_toobig"),
        19 => Record("sqlite_constraint"),
        20 => Record("sqlite_mismatch"),
        // The database file, its locks and the process.
        5 => Infra("sqlite_busy"),
        6 => Infra("sqlite_locked"),
        2 => Infra("sqlite_internal"),
        4 => Infra("sqlite_abort"),
        7 => Infra("sqlite_nomem"),
        8 => Infra("sqlite_readonly"),
        9 => Infra("sqlite_interrupt"),
        10 => Infra("sqlite_ioerr"),
        11 => Infra("sqlite_corrupt"),
        12 => Infra("sqlite_notfound"),
        13 => Infra("sqlite_full"),
        14 => Infra("sqlite_cantopen"),
        15 => Infra("sqlite_protocol"),
        16 => Infra("sqlite_empty"),
        22 => Infra("sqlite_nolfs"),
        23 => Infra("sqlite_auth"),
        26 => Infra("sqlite_notadb"),
        // SQLite's generic code also carries a few refusals of the record's
        // data (PostgreSQL's data exceptions), named by their messages.
        1 if sqlite_data_error(e) => Record("sqlite_data_error"),
        // The schema and the code (a missing table, a bad statement).
        1 => Infra("sqlite_error"),
        3 => Infra("sqlite_perm"),
        17 => Infra("sqlite_schema"),
        21 => Infra("sqlite_misuse"),
        24 => Infra("sqlite_format"),
        25 => Infra("sqlite_range"),
        // Not errors (notice, warning, row, done), or unknown.
        _ => unclassified(e),
    }
}

/// Whether an `SQLITE_ERROR` refuses the data rather than the statement:
/// JSON that does not parse, an integer that overflows (on PostgreSQL, data
/// exceptions, class 22).
fn sqlite_data_error(e: &sqlx::Error) -> bool {
    const DATA_ERRORS: [&str; 2] = ["malformed JSON", "integer overflow"];
    e.as_database_error()
        .is_some_and(|db| DATA_ERRORS.iter().any(|m| db.message().starts_with(m)))
}

/// An error this version does not classify: logged, and infrastructure, so
/// the record waits rather than being dead-lettered on a guess.
fn unclassified(e: &dyn std::fmt::Display) -> Fault {
    tracing::warn!(error = %e, "unclassified error; treated as infrastructure (retried, never dead-lettered)");
    Fault::Infrastructure("unclassified")
}

/// What the consumer runtime can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumerError {
    /// The database, or a fenced write refused (`lost_lease`).
    #[error(transparent)]
    Ferry(#[from] ferry::Error),
    /// Kafka.
    #[error("kafka: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
    /// Unusable configuration.
    #[error("configuration: {0}")]
    Config(String),
}

impl ConsumerError {
    /// Stable machine-readable code.
    pub fn code(&self) -> &'static str {
        match self {
            ConsumerError::Ferry(e) => e.code(),
            ConsumerError::Kafka(_) => "kafka",
            ConsumerError::Config(_) => "config",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Fault::{Infrastructure as Infra, Record};

    #[test]
    fn an_outage_is_the_infrastructure_s_even_from_a_handler_s_statement() {
        let cut = || {
            ferry::Error::Database(sqlx::Error::Io(std::io::Error::from(
                std::io::ErrorKind::ConnectionReset,
            )))
        };
        assert_eq!(classify(&cut()), Infra("io"));
        assert_eq!(
            classify(&ferry::Error::Database(sqlx::Error::PoolTimedOut)),
            Infra("pool_timed_out")
        );
        assert_eq!(HandlerError::from(cut()), HandlerError::infrastructure("io"));
        assert_eq!(
            HandlerError::from(sqlx::Error::PoolTimedOut).class,
            HandlerClass::Infrastructure
        );
    }

    #[test]
    fn only_the_record_s_own_data_makes_a_record_s_fault() {
        let e = sqlx::Error::PoolClosed;
        for (class, fault) in [
            ("08", Infra("connection_exception")),
            ("57", Infra("operator_intervention")),
            ("40", Infra("transaction_rollback")),
            ("55", Infra("object_not_in_prerequisite_state")),
            ("53", Infra("insufficient_resources")),
            ("42", Infra("syntax_error_or_access_rule_violation")),
            ("23", Record("integrity_constraint_violation")),
            ("22", Record("data_exception")),
            ("54", Record("program_limit_exceeded")),
            // Not an error class, or one this version does not know: waits.
            ("01", Infra("unclassified")),
            ("ZZ", Infra("unclassified")),
        ] {
            assert_eq!(sqlstate_class(class, &e), fault, "SQLSTATE class {class}");
        }
        assert_eq!(sqlite_code(5, &e), Infra("sqlite_busy"));
        assert_eq!(sqlite_code(19, &e), Record("sqlite_constraint"));
        assert_eq!(sqlite_code(101, &e), Infra("unclassified"));
        assert_eq!(
            classify(&ferry::Error::Database(sqlx::Error::RowNotFound)),
            Record("row_not_found")
        );
        let refused = ferry::Error::InvalidInput {
            field: "key",
            reason: "too long".into(),
        };
        assert_eq!(classify(&refused), Record("invalid_input"));
        assert_eq!(HandlerError::from(refused), HandlerError::terminal("invalid_input"));
        assert_eq!(classify(&ferry::Error::Raced("swept")), Infra("raced"));
        assert_eq!(
            classify(&ferry::Error::NotMigrated("consumer_ledger".into())),
            Infra("schema")
        );
    }

    /// SQLite reports some refusals of the record's data under its generic
    /// code, which otherwise means a schema or statement error.
    #[tokio::test]
    async fn a_record_s_malformed_json_is_the_record_s_fault_on_sqlite_too() {
        let pool = sqlx::SqlitePool::connect("sqlite::memory:").await.unwrap();
        let e = sqlx::query("SELECT json_extract('{not json', '$.a')")
            .execute(&pool)
            .await
            .unwrap_err();
        let fault = classify(&ferry::Error::Database(e));
        assert_eq!(fault, Fault::Record("sqlite_data_error"));
        let e = sqlx::query("SELECT sum(x) FROM (SELECT 9223372036854775807 AS x UNION ALL SELECT 1)")
            .execute(&pool)
            .await
            .unwrap_err();
        assert_eq!(classify(&ferry::Error::Database(e)), Fault::Record("sqlite_data_error"));
        let e = sqlx::query("SELECT * FROM no_such_table")
            .execute(&pool)
            .await
            .unwrap_err();
        assert_eq!(
            classify(&ferry::Error::Database(e)),
            Fault::Infrastructure("sqlite_error")
        );
    }
}
