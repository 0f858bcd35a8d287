//! Investigations an operator runs when something looks wrong, as queries:
//! a URL through a pooler in transaction mode ([`transaction_pooler`],
//! probed before anything else), duplicate paid generations, two workers completing one run, jobs leased
//! forever (here; `unreclaimed_leases` is watched by the
//! `FerryJobLeasesUnreclaimed` alert), and the relay's side ([`relay()`]: dead outbox rows, an old
//! backlog, no live relay, unowned lanes, WAL capture slots that are
//! inactive, lag or were invalidated). Each finding comes with a suggested
//! action and, where an alert watches the same fault, the runbook section
//! that alert links. Read-only: repairs go through the ordinary fenced
//! transitions (cancel, replay).

mod relay;

use std::str::FromStr as _;
use std::time::Duration;

use ferry::store::on_pool;
use ferry::time::duration_ms;
use ferry::{Ferry, Result};

mod queries {
    include!(concat!(env!("OUT_DIR"), "/queries.rs"));
}
use queries::{Queries, QUERIES};

pub use relay::{relay, RelayThresholds};

/// How bad a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    /// Context, not a fault.
    Info,
    /// Needs a look.
    Warning,
    /// An invariant was broken.
    Critical,
}

/// One check's result.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Finding {
    /// Stable name of the check.
    pub check: &'static str,
    /// Severity when `items` is not empty.
    pub severity: Severity,
    /// What was found: `subject: detail` lines (bounded).
    pub items: Vec<String>,
    /// What to do about it.
    pub action: &'static str,
    /// The `docs/runbook.md` section of the alert that watches the same
    /// fault (the alert's `runbook_url`), so the page and the doctor lead
    /// to one place.
    pub runbook: Option<&'static str>,
    /// Why the check cannot apply to this database (WAL capture on SQLite,
    /// lanes where WAL capture streams): it was not run, which is not `ok`.
    pub skipped: Option<&'static str>,
}

impl Finding {
    /// `ok`, `skip`, or the severity (`info`, `warning`, `critical`) when
    /// there are items: what `ferry doctor` prints in brackets.
    pub fn status(&self) -> &'static str {
        match (self.skipped, self.items.is_empty(), self.severity) {
            (Some(_), _, _) => "skip",
            (None, true, _) => "ok",
            (None, false, Severity::Info) => "info",
            (None, false, Severity::Warning) => "warning",
            (None, false, Severity::Critical) => "critical",
        }
    }

    /// A warning or critical finding with items: what `--strict` fails on
    /// (never a skipped check, never context).
    pub fn is_problem(&self) -> bool {
        self.skipped.is_none() && !self.items.is_empty() && self.severity != Severity::Info
    }
}

struct Check {
    name: &'static str,
    query: fn(&Queries) -> &'static str,
    severity: Severity,
    action: &'static str,
}

const CHECKS: [Check; 4] = [
    Check {
        name: "duplicate_acceptances",
        query: |q| q.doctor_duplicate_acceptances,
        severity: Severity::Warning,
        action: "the same request was accepted as several runs: check that clients reuse one Idempotency-Key per operation and that the key TTL covers their retry window; cancel the extra runs (`ferry jobs cancel`)",
    },
    Check {
        name: "effect_provider_refs",
        query: |q| q.doctor_effect_provider_refs,
        severity: Severity::Critical,
        action: "an external effect happened more than once: refund or void the extra provider refs, and make the handler reserve_effect/reconcile before calling the provider",
    },
    Check {
        name: "multiple_terminal_events",
        query: |q| q.doctor_multiple_terminal_events,
        severity: Severity::Critical,
        action: "a run ended twice: restore the run_events_one_terminal_idx index and check for writers bypassing Ferry",
    },
    Check {
        name: "stale_completions",
        query: |q| q.doctor_stale_completions,
        severity: Severity::Critical,
        action: "a worker completed with an old lease generation: look for writers bypassing the fenced complete and for clock skew",
    },
];

/// Prepares every doctor query on `ferry`'s database (the conformance check).
pub async fn check_queries(ferry: &Ferry) -> Result<()> {
    ferry::store::check_queries(ferry.db(), QUERIES.get(ferry.db().engine()).all()).await
}

/// Whether `url` gives each connection a server session of its own. A
/// pooler in transaction mode (PgBouncer's `pool_mode = transaction`)
/// hands each transaction, and each statement outside one, to any of its
/// server sessions: prepared statements then land on sessions other
/// clients use, and notifications never reach their listener. Probed, not
/// guessed, with simple queries only (nothing prepared, nothing notified,
/// nothing written, so it is safe on a live pooler and on a standby):
/// connection A reads its server's pid, connection B opens a transaction
/// (which holds whatever session it is given) and reads its pid, and A
/// reads its pid again. Directly, A keeps its pid and B has another. Through
/// a transaction pooler, B is given the session A just released, or A is
/// moved to another. A session pooler keeps each client on one session and
/// passes. Skipped on SQLite.
pub async fn transaction_pooler(url: &str) -> Result<Finding> {
    let mut f = Finding {
        check: "transaction_pooler",
        severity: Severity::Critical,
        items: Vec::new(),
        action: "this URL goes through a pooler in transaction mode (PgBouncer pool_mode=transaction) without saying so: Ferry's prepared statements can reach another client's session there and its wake-ups never arrive. Add pgbouncer=true to the URL (every statement then runs unnamed and in a transaction, and wake-ups poll), or give the server's direct URL",
        runbook: None,
        skipped: None,
    };
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        f.skipped = Some("SQLite has no pooler");
        return Ok(f);
    }
    async fn pid(c: &mut sqlx::PgConnection) -> std::result::Result<i32, sqlx::Error> {
        use sqlx::Row as _;
        sqlx::raw_sql("SELECT pg_backend_pid()").fetch_one(c).await?.try_get(0)
    }
    // Without the `extra_float_digits` startup parameter sqlx sends by
    // default, which a PgBouncer not configured to ignore it refuses (the
    // probe must reach the pooler it is looking for).
    let (url, declared) = ferry::store::transaction_pooler_param(url)?;
    let options = sqlx::postgres::PgConnectOptions::from_str(&url)?.extra_float_digits(None);
    let probe = async {
        let mut a: sqlx::PgConnection = sqlx::Connection::connect_with(&options).await?;
        let mut b: sqlx::PgConnection = sqlx::Connection::connect_with(&options).await?;
        let first = pid(&mut a).await?;
        sqlx::raw_sql("BEGIN").execute(&mut b).await?;
        let held = pid(&mut b).await?;
        // Twice: a pooler handing out its idle sessions in turn may give A
        // its first session back once.
        let again = [pid(&mut a).await?, pid(&mut a).await?];
        sqlx::raw_sql("ROLLBACK").execute(&mut b).await?;
        let _ = sqlx::Connection::close(a).await;
        let _ = sqlx::Connection::close(b).await;
        Ok::<_, sqlx::Error>((first, held, again))
    };
    // Bounded as Ferry's own pool is: an unreachable server is an error
    // after this, not the system's TCP timeout.
    let (first, held, again) = tokio::time::timeout(PROBE_WITHIN, probe).await.map_err(|_| {
        sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("the pooler probe did not finish within {PROBE_WITHIN:?}"),
        ))
    })??;
    // A URL that says `pgbouncer=true` is served as behind a pooler either
    // way.
    if !declared && (held == first || again.iter().any(|p| *p != first)) {
        f.items.push(format!(
            "one connection was served by server sessions {first} and then {again:?}, while another connection's transaction held session {held}"
        ));
    }
    Ok(f)
}

/// How long [`transaction_pooler`] may take (Ferry's pool waits as long for
/// a connection).
const PROBE_WITHIN: Duration = Duration::from_secs(10);

/// Runs every investigation, listing at most `limit` items each;
/// `stuck_after` is how long past expiry a lease may sit before it counts as
/// not being reclaimed.
pub async fn run(ferry: &Ferry, stuck_after: Duration, limit: u32) -> Result<Vec<Finding>> {
    let now = ferry.clock().param();
    {
        let limit = i64::from(limit);
        let mut out = Vec::new();
        for c in &CHECKS {
            let rows: Vec<(String, String)> = on_pool!(ferry.db(), QUERIES, |p, q| {
                sqlx::query_as((c.query)(q)).bind(limit).fetch_all(p).await?
            });
            out.push(finding(c.name, c.severity, rows, c.action));
        }
        let expiry: Vec<(String, String)> = on_pool!(ferry.db(), QUERIES, |p, q| {
            sqlx::query_as(q.doctor_lease_expiry).bind(now).fetch_all(p).await?
        });
        out.push(finding(
            "lease_expiry",
            Severity::Info,
            expiry,
            "leases far in the future point at clock skew between workers and the database",
        ));
        let stuck_ms = duration_ms(stuck_after)?;
        let stuck: Vec<(String, String)> = on_pool!(ferry.db(), QUERIES, |p, q| {
            sqlx::query_as(q.doctor_unreclaimed_leases)
                .bind(now)
                .bind(stuck_ms)
                .bind(limit)
                .fetch_all(p)
                .await?
        });
        out.push(Finding {
            runbook: Some("docs/runbook.md#job-leases-unreclaimed"),
            ..finding(
                "unreclaimed_leases",
                Severity::Warning,
                stuck,
                "expired leases nobody reclaims: start workers for these queues, or check that they can reach the database",
            )
        });
        let exhausted: Vec<(String, String)> = on_pool!(ferry.db(), QUERIES, |p, q| {
            sqlx::query_as(q.doctor_exhausted_unterminated)
                .bind(now)
                .bind(limit)
                .fetch_all(p)
                .await?
        });
        out.push(finding(
            "exhausted_unterminated",
            Severity::Warning,
            exhausted,
            "attempts exhausted but not terminalized: run a worker on the queue (it reaps them) or ferry.jobs().reap_exhausted",
        ));
        Ok(out)
    }
}

fn finding(check: &'static str, severity: Severity, rows: Vec<(String, String)>, action: &'static str) -> Finding {
    Finding {
        check,
        severity,
        items: rows.into_iter().map(|(s, d)| format!("{s}: {d}")).collect(),
        action,
        runbook: None,
        skipped: None,
    }
}
