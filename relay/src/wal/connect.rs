//! The replication connection: its settings, taken from the relay's
//! `DATABASE_URL`, and the explicit classification of everything that can
//! end a replication session.

use std::time::Duration;

use pgwire_replication::{Lsn, PgWireError, ReplicationConfig};

use crate::error::RelayError;

/// How often the replication client reports the confirmed position while
/// it changes (the slot's `confirmed_flush_lsn` trails the marks by this).
pub const STATUS_INTERVAL: Duration = Duration::from_secs(1);

/// The replication session's settings for `url` (`postgres://user:password@host:port/db`;
/// `PGPASSWORD` when the URL has no password), streaming `slot` with
/// `publication` from the slot's confirmed position.
pub fn replication_config(
    url: &str,
    slot: &str,
    publication: &str,
    application_name: &str,
) -> Result<ReplicationConfig, RelayError> {
    let bad = |why: &str| RelayError::Config(format!("--capture wal: the database URL {why}"));
    let u = url::Url::parse(url).map_err(|_| bad("is not a URL"))?;
    if !matches!(u.scheme(), "postgres" | "postgresql") {
        return Err(bad("is not postgres://"));
    }
    let decode = |s: &str| {
        percent_decode(s).ok_or_else(|| bad("has a user, password or database that is not valid percent-encoded UTF-8"))
    };
    for (k, v) in u.query_pairs() {
        if k == "sslmode" && !matches!(v.as_ref(), "disable" | "allow" | "prefer") {
            return Err(bad(
                "asks for TLS, which the relay's PostgreSQL connections do not have",
            ));
        }
    }
    let host = u.host_str().unwrap_or("localhost").to_owned();
    let user = match u.username() {
        "" => std::env::var("PGUSER").unwrap_or_else(|_| "postgres".into()),
        user => decode(user)?,
    };
    let password = match u.password() {
        Some(p) => decode(p)?,
        None => std::env::var("PGPASSWORD").unwrap_or_default(),
    };
    let database = match u.path().trim_start_matches('/') {
        "" => user.clone(),
        db => decode(db)?,
    };
    Ok(
        ReplicationConfig::new(host, user, password, database, slot, publication)
            .with_port(u.port().unwrap_or(5432))
            .with_start_lsn(Lsn::ZERO)
            .with_status_interval(STATUS_INTERVAL)
            .with_wakeup_interval(Duration::from_secs(5))
            // The decoder reads bytea in hex, and timestamps (of a
            // Debezium-layout table) in ISO format and UTC, whatever the
            // server's defaults.
            .with_options("-c bytea_output=hex -c DateStyle=ISO -c TimeZone=UTC")
            .with_application_name(application_name),
    )
}

/// `%XX` escapes of a URL part, decoded.
fn percent_decode(s: &str) -> Option<String> {
    percent_encoding::percent_decode_str(s)
        .decode_utf8()
        .ok()
        .map(|c| c.into_owned())
}

/// Why a replication session ended, classified: what the relay does next
/// depends only on this.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ended {
    /// The relay is shutting down: everything acknowledged was marked and
    /// confirmed.
    Shutdown,
    /// Another session streams from the slot (SQLSTATE 55006): wait as a
    /// standby and try again.
    SlotInUse,
    /// `--streams`: the stream is another relay's share (the session
    /// did not start), or this relay streams more than its share and gave
    /// its highest stream back, ending cleanly: wait until the share
    /// changes.
    Yielded,
    /// The slot cannot carry on: it was dropped (42704 on the slot), lost
    /// the WAL it needed (55000), its publication is gone (42704 on the
    /// publication: the slot's historic catalog never sees a new one), or
    /// the server cannot decode its WAL at all (`could not map filenode`,
    /// XX000: see [`classify`]). The slot is made anew and the table read
    /// once (it is the source of truth).
    Reseed(&'static str),
    /// A record Kafka refused as poison in a produce request shared with
    /// others: the stream resumes from the slot one record at a time up to
    /// the transaction whose commit is at `through_lsn`, and the catch-up
    /// read up to row `through_id`.
    Isolate {
        /// The last streamed transaction with a refused record.
        through_lsn: Option<u64>,
        /// The last catch-up row refused.
        through_id: Option<i64>,
    },
    /// Exactly once: a row was marked dead inside a Kafka transaction,
    /// which was aborted (the producer cannot commit after a refused
    /// record): the next session starts at once, from the slot and the
    /// progress record, and leaves the dead row out.
    Aborted,
    /// Worth retrying after a backoff: the database or the broker was
    /// unreachable, the session was terminated, a record failed for a
    /// transient reason, or a poison row blocks (`--on-poison=block`).
    Retry(&'static str),
    /// The shared producer failed fatally: the relay exits to be restarted.
    Fatal,
    /// The stream holds a row this relay cannot publish as it is
    /// configured to (a Debezium-layout row it cannot render): WAL capture
    /// stops, the relay turns unready, and an operator changes the
    /// configuration and restarts it. Retrying would only publish the
    /// transaction's earlier rows again.
    Stopped(&'static str),
}

impl Ended {
    /// The code a session's end is counted under
    /// (`ferry_relay_wal_sessions_ended_total`).
    pub fn code(&self) -> &'static str {
        match self {
            Ended::Shutdown => "shutdown",
            Ended::SlotInUse => "slot_in_use",
            Ended::Yielded => "stream_yielded",
            Ended::Reseed(code) | Ended::Retry(code) | Ended::Stopped(code) => code,
            Ended::Isolate { .. } => "isolate",
            Ended::Aborted => "aborted",
            Ended::Fatal => "fatal",
        }
    }
}

/// The classification of a replication client error. PostgreSQL's errors
/// carry their SQLSTATE in the client's message (`… (SQLSTATE 55006)`);
/// codes not named here are `unclassified` and retried, never guessed at.
///
/// One internal error (XX000) is named: `could not map filenode "…" to
/// relation OID` (`filenumber` from PostgreSQL 16 on). Logical decoding
/// raises it when the slot's historic catalog cannot see a table some
/// decoded change touched, any table of the database, not only the outbox
/// (seen on PostgreSQL 15.20: a slot made while other sessions created
/// tables could never decode a later insert into one of them). It is the
/// slot's state, not a passing fault: every session from that slot stops
/// at the same change, so retrying never ends. The slot is made anew (`slot_undecodable`), as for an invalidated
/// one: a new slot starts after that change, and the table read publishes
/// every row not yet delivered.
pub fn classify(e: &PgWireError) -> Ended {
    match e {
        PgWireError::Io(_) | PgWireError::Task(_) => Ended::Retry("replication_io"),
        PgWireError::Auth(_) => Ended::Retry("replication_auth"),
        PgWireError::Tls(_) => Ended::Retry("replication_tls"),
        PgWireError::Protocol(_) | PgWireError::Internal(_) | PgWireError::MessageTooLarge { .. } => {
            Ended::Retry("replication_protocol")
        }
        PgWireError::Server(message) => classify_server(message),
        _ => Ended::Retry("unclassified"),
    }
}

fn classify_server(message: &str) -> Ended {
    let code = message
        .rsplit_once("(SQLSTATE ")
        .and_then(|(_, rest)| rest.get(..5))
        .unwrap_or("");
    match code {
        "55006" => Ended::SlotInUse,
        "42704" if message.contains("publication") => Ended::Reseed("publication_missing"),
        "42704" => Ended::Reseed("slot_missing"),
        "55000" => Ended::Reseed("slot_invalidated"),
        // "filenode" up to 15, "filenumber" from 16 on.
        "XX000" if message.contains("could not map filenode") || message.contains("could not map filenumber") => {
            tracing::error!(%message, "logical decoding cannot map a table of this database in the slot's historic catalog (a PostgreSQL decoding defect): the slot cannot go on");
            Ended::Reseed("slot_undecodable")
        }
        // Terminated, the server shutting down or starting, a lost connection.
        "57P01" | "57P02" | "57P03" => Ended::Retry("replication_terminated"),
        c if c.starts_with("08") => Ended::Retry("replication_io"),
        // Wrong credentials or privileges: an operator fixes them.
        c if c.starts_with("28") || c == "42501" => Ended::Retry("replication_permission"),
        "53300" => Ended::Retry("too_many_connections"),
        _ => {
            tracing::warn!(%message, "unclassified replication error; retried");
            Ended::Retry("unclassified")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_errors_are_classified_by_sqlstate() {
        let s = |m: &str| classify(&PgWireError::Server(m.into()));
        assert_eq!(
            s("replication slot \"a\" is active for PID 7 (SQLSTATE 55006)"),
            Ended::SlotInUse
        );
        assert_eq!(
            s("replication slot \"a\" does not exist (SQLSTATE 42704)"),
            Ended::Reseed("slot_missing")
        );
        assert_eq!(
            s("publication \"p\" does not exist (SQLSTATE 42704)"),
            Ended::Reseed("publication_missing")
        );
        assert_eq!(
            s("can no longer get changes from replication slot \"a\" (SQLSTATE 55000)"),
            Ended::Reseed("slot_invalidated")
        );
        assert_eq!(
            s("terminating connection due to administrator command (SQLSTATE 57P01)"),
            Ended::Retry("replication_terminated")
        );
        assert_eq!(
            s("could not map filenode \"base/5/787802\" to relation OID (SQLSTATE XX000)"),
            Ended::Reseed("slot_undecodable")
        );
        assert_eq!(
            s("could not map filenumber \"base/5/16390\" to relation OID (SQLSTATE XX000)"),
            Ended::Reseed("slot_undecodable")
        );
        assert_eq!(
            s("some other internal error (SQLSTATE XX000)"),
            Ended::Retry("unclassified")
        );
        assert_eq!(s("something new (SQLSTATE XX999)"), Ended::Retry("unclassified"));
        assert_eq!(s("no code at all"), Ended::Retry("unclassified"));
    }

    #[test]
    fn the_database_url_gives_the_replication_settings() {
        let c = replication_config("postgres://ops:p%40ss@db.local:6543/app?options=x", "s", "p", "relay").unwrap();
        assert_eq!(
            (
                c.host.as_str(),
                c.port,
                c.user.as_str(),
                c.password.as_str(),
                c.database.as_str()
            ),
            ("db.local", 6543, "ops", "p@ss", "app")
        );
        assert!(replication_config("sqlite://x.db", "s", "p", "r").is_err());
        assert!(replication_config("postgres://h/db?sslmode=require", "s", "p", "r").is_err());
    }
}
