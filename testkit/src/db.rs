//! A brand-new PostgreSQL schema or SQLite file per test, so tests run in
//! parallel against real databases. PostgreSQL must be reachable; when it is
//! not, the helper fails with a message naming what is missing (tests never
//! skip).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::ConnectOptions as _;

use ferry::Engine;

/// Why a test database could not be made; the message names what is missing.
#[derive(Debug, thiserror::Error)]
#[error("test database: {0}")]
pub struct TestDbError(String);

type Result<T> = std::result::Result<T, TestDbError>;

/// The test PostgreSQL: `DATABASE_URL`, or the local server.
pub fn postgres_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// The test PgBouncer in transaction pooling in front of [`postgres_url`]
/// (`scripts/setup-pgbouncer`): `FERRY_PGBOUNCER_URL`, or the local one on
/// port 6433. Every database name it is given reaches the same name on the
/// server.
pub fn pgbouncer_url() -> String {
    std::env::var("FERRY_PGBOUNCER_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:6433/postgres".into())
}

/// A new, empty database of its own on the test PostgreSQL, and its URL
/// through the test PgBouncer ([`pgbouncer_url`]): `(direct, through the
/// pooler)`. A database, not a schema: PgBouncer does not pass the
/// `options` startup parameter that selects a test's schema.
pub async fn fresh_database_behind_pgbouncer() -> Result<(String, String)> {
    let n = SEQ.fetch_add(1, Ordering::Relaxed);
    let born = unix_secs();
    let name = format!("ferry_t_{born}_{}_{n}{}", std::process::id(), run_suffix());
    let admin = admin_pool().await?;
    drop_stale(&admin, Stale::Databases, born).await;
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&admin)
        .await
        .map_err(|e| TestDbError(format!("CREATE DATABASE {name}: {e}")))?;
    admin.close().await;
    // The URL's database replaced, its parameters kept.
    let with_db = |url: &str| {
        let (base, query) = url.split_once('?').map_or((url, None), |(b, q)| (b, Some(q)));
        let server = match base.split_once("://") {
            Some((scheme, rest)) => format!("{scheme}://{}", rest.split('/').next().unwrap_or(rest)),
            None => base.to_owned(),
        };
        match query {
            Some(q) => format!("{server}/{name}?{q}"),
            None => format!("{server}/{name}"),
        }
    };
    Ok((with_db(&postgres_url()), with_db(&pgbouncer_url())))
}

/// One connection to the test PostgreSQL, for making databases and schemas.
async fn admin_pool() -> Result<sqlx::PgPool> {
    let base = postgres_url();
    let opts: PgConnectOptions = base.parse().map_err(|e| TestDbError(format!("DATABASE_URL: {e}")))?;
    PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(opts.disable_statement_logging())
        .await
        .map_err(|e| {
            TestDbError(format!(
                "PostgreSQL is required and unreachable at {base} ({e}); start it or set DATABASE_URL"
            ))
        })
}

static SEQ: AtomicU64 = AtomicU64::new(0);

/// A URL to a new, empty database of `engine`: a fresh schema (selected by
/// `search_path`) in the test PostgreSQL, or a fresh SQLite file under the
/// temp dir. Schemas left by earlier runs of other processes are dropped.
pub async fn fresh_database_url(engine: Engine) -> Result<String> {
    let n = SEQ.fetch_add(1, Ordering::Relaxed);
    let pid = std::process::id();
    match engine {
        Engine::Sqlite => {
            let dir = std::env::temp_dir().join("ferry-tests");
            std::fs::create_dir_all(&dir).map_err(|e| TestDbError(format!("temp dir: {e}")))?;
            let path = dir.join(format!("t{pid}_{n}_{}.db", uuid::Uuid::now_v7().simple()));
            Ok(format!("sqlite://{}", path.display()))
        }
        Engine::Postgres => {
            let base = postgres_url();
            let born = unix_secs();
            let schema = format!("ferry_t_{born}_{pid}_{n}{}", run_suffix());
            let admin = admin_pool().await?;
            if n == 0 {
                drop_stale(&admin, Stale::Schemas, born).await;
            }
            sqlx::query(&format!("CREATE SCHEMA {schema}"))
                .execute(&admin)
                .await
                .map_err(|e| TestDbError(format!("CREATE SCHEMA {schema}: {e}")))?;
            admin.close().await;
            let sep = if base.contains('?') { '&' } else { '?' };
            Ok(format!("{base}{sep}options=-csearch_path%3D{schema}"))
        }
    }
}

/// `_<run>` when the process is a test job of `scripts/run-tests.py`
/// (`FERRY_TEST_RUN`: up to 16 lowercase letters and digits, one value per
/// run), the end of its schemas' and databases' names, so that run drops
/// what its tests made once they all passed; otherwise nothing.
fn run_suffix() -> String {
    match std::env::var("FERRY_TEST_RUN") {
        Ok(run) if is_run_token(&run) => format!("_{run}"),
        _ => String::new(),
    }
}

/// A run's token: 1 to 16 lowercase letters and digits.
fn is_run_token(run: &str) -> bool {
    !run.is_empty() && run.len() <= 16 && run.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

/// A test schema's or database's birth stamp, and whether a run made it,
/// when `name` is exactly one of the names made here:
/// `ferry_t_<born>_<pid>_<n>`, and `_<run>` ([`is_run_token`]). Anything
/// else (another tool's name that merely starts alike, one that needs
/// quoting) is not ours and is never dropped.
fn parse_test_name(name: &str) -> Option<(u64, bool)> {
    let digits = |p: &str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit());
    let parts: Vec<&str> = name.strip_prefix("ferry_t_")?.split('_').collect();
    let of_a_run = match parts.as_slice() {
        [b, p, n] if digits(b) && digits(p) && digits(n) => false,
        [b, p, n, run] if digits(b) && digits(p) && digits(n) && is_run_token(run) => true,
        _ => return None,
    };
    Some((parts[0].parse().ok()?, of_a_run))
}

/// Seconds since the Unix epoch: the birth stamp in a test schema's or
/// database's name.
fn unix_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// What test runs leave in the test PostgreSQL: its catalog query and
/// how one is dropped.
enum Stale {
    /// `ferry_t_*` schemas of the direct tests.
    Schemas,
    /// `ferry_t_*` databases of [`fresh_database_behind_pgbouncer`].
    Databases,
}

/// How old a test schema or database of a `scripts/run-tests.py` run (its
/// name ends with the run's token) must be before a test drops it: a test
/// job is killed after 15 minutes, so nothing running uses it.
const STALE_AFTER_SECS: u64 = 20 * 60;

/// How old another test schema must be before a test drops it: one of a
/// plain `cargo test`, a benchmark or a soak, which no job timeout bounds.
/// (Another test database is dropped after [`STALE_AFTER_SECS`] all the
/// same: only the pooler tests make them, each with a catalog's worth of
/// disk.)
const STALE_UNBOUNDED_AFTER_SECS: u64 = 24 * 3600;

/// Drops the `ferry_t_*` databases made more than [`STALE_AFTER_SECS`]
/// ago, or the schemas (a run's after [`STALE_AFTER_SECS`], others after
/// [`STALE_UNBOUNDED_AFTER_SECS`]). Each database holds a catalog's worth
/// of disk (about 7.5 MB) and is one more for autovacuum to visit. Each schema's
/// relations stay in the database's catalog, and some DDL reads all of
/// it: with 3,477 schemas of earlier runs left, an `ALTER TABLE … ADD
/// COLUMN … DEFAULT` took 36 ms instead of 0.7 ms, and a test's
/// migrations 317 ms instead of 140 ms (measured on the 2-core machine,
/// once the schemas were dropped and the catalogs vacuumed). By age only:
/// a test process elsewhere (another container on the same server) is not
/// in this machine's process list, and concurrent runs keep theirs. One
/// process at a time drops (a session advisory lock it only tries); the
/// others go on and leave what is stale to it or to a later test.
async fn drop_stale(admin: &sqlx::PgPool, what: Stale, now: u64) {
    let (list, lock) = match what {
        Stale::Schemas => (
            "SELECT nspname::text FROM pg_namespace WHERE nspname LIKE 'ferry\\_t\\_%'",
            DROP_STALE_SCHEMAS_LOCK,
        ),
        Stale::Databases => (
            "SELECT datname::text FROM pg_database WHERE datname LIKE 'ferry\\_t\\_%'",
            DROP_STALE_DATABASES_LOCK,
        ),
    };
    let mut conn = match admin.acquire().await {
        Ok(c) => c,
        Err(_) => return,
    };
    let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(lock)
        .fetch_one(&mut *conn)
        .await
        .unwrap_or(false);
    if !locked {
        return;
    }
    // A session still holding a lock in a stale schema (idle in a
    // transaction) makes its drop fail after 2 s instead of holding this
    // test until its job's timeout.
    let _ = sqlx::query("SET lock_timeout = '2s'").execute(&mut *conn).await;
    drop_stale_locked(&mut conn, what, list, now).await;
    let _ = sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(lock)
        .execute(&mut *conn)
        .await;
    let _ = sqlx::query("RESET lock_timeout").execute(&mut *conn).await;
}

/// The session advisory lock keys [`drop_stale`] tries, in the database of
/// [`postgres_url`], where every test process's admin connection is.
const DROP_STALE_SCHEMAS_LOCK: i64 = 0x6665_7272_795f_7331;
const DROP_STALE_DATABASES_LOCK: i64 = 0x6665_7272_795f_6431;

/// [`drop_stale`]'s drops, its lock held: each stale one dropped on its
/// own (one transaction per drop, so few locks are held at once).
async fn drop_stale_locked(conn: &mut sqlx::PgConnection, what: Stale, list: &str, now: u64) {
    let names: Vec<String> = sqlx::query_scalar(list).fetch_all(&mut *conn).await.unwrap_or_default();
    for drop in names.iter().filter_map(|name| stale_drop(name, &what, now)) {
        let _ = sqlx::query(&drop).execute(&mut *conn).await;
    }
}

/// The statement that drops `name` when it is one of ours
/// ([`parse_test_name`]: only digits, lowercase letters and `_`, so it
/// needs no quoting) and stale at `now`; `None` otherwise.
fn stale_drop(name: &str, what: &Stale, now: u64) -> Option<String> {
    let (born, of_a_run) = parse_test_name(name)?;
    let max_age = match what {
        Stale::Schemas if !of_a_run => STALE_UNBOUNDED_AFTER_SECS,
        Stale::Schemas | Stale::Databases => STALE_AFTER_SECS,
    };
    (born.saturating_add(max_age) < now).then(|| match what {
        Stale::Schemas => format!("DROP SCHEMA IF EXISTS {name} CASCADE"),
        Stale::Databases => format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 2_000_000_000;

    #[test]
    fn only_names_made_here_and_stale_are_dropped() {
        let old = NOW - STALE_UNBOUNDED_AFTER_SECS - 1;
        let recent = NOW - STALE_AFTER_SECS - 1;
        // A run's, after 20 minutes; a plain test's schema after a day.
        assert_eq!(
            stale_drop(&format!("ferry_t_{recent}_12_0_ab12"), &Stale::Schemas, NOW).as_deref(),
            Some(format!("DROP SCHEMA IF EXISTS ferry_t_{recent}_12_0_ab12 CASCADE").as_str())
        );
        assert_eq!(
            stale_drop(&format!("ferry_t_{recent}_12_0"), &Stale::Schemas, NOW),
            None
        );
        assert!(stale_drop(&format!("ferry_t_{old}_12_0"), &Stale::Schemas, NOW).is_some());
        assert_eq!(
            stale_drop(&format!("ferry_t_{recent}_12_0"), &Stale::Databases, NOW).as_deref(),
            Some(format!("DROP DATABASE IF EXISTS ferry_t_{recent}_12_0 WITH (FORCE)").as_str())
        );
        assert_eq!(
            stale_drop(&format!("ferry_t_{NOW}_12_0_ab12"), &Stale::Schemas, NOW),
            None
        );
        // Not ours: never dropped, however old they look.
        for name in [
            "ferry_t_1_x, victim",
            "ferry_t_1_2_3_ab12_Q",
            "ferry_t_1_2_3_AB12",
            "ferry_t_1_2_3_ab12\n",
            "ferry_t_1_2_3_a_b",
            "ferry_t_1_2",
            "ferry_t_1_2_3_01234567890123456",
            "ferry_t__2_3",
            "ferry_t_18446744073709551616_1_1",
        ] {
            assert_eq!(stale_drop(name, &Stale::Schemas, NOW), None, "{name:?}");
            assert_eq!(stale_drop(name, &Stale::Databases, NOW), None, "{name:?}");
        }
        // A stamp at the top of the range does not overflow.
        assert_eq!(
            stale_drop("ferry_t_18446744073709551615_1_1", &Stale::Schemas, NOW),
            None
        );
    }
}
