//! Example consumer: keeps a per-key projection (`ferry_projection`: events
//! seen and last offset per record key) and counts how often each effect
//! key's effect was applied (`ferry_projection_applied`), which must stay 1.
//!
//! Environment: `DATABASE_URL` (with `FERRY_DIRECT_URL`, the direct URL migrations
//! run over, when it goes through a transaction pooler), `FERRY_BROKERS`, `FERRY_GROUP`, `FERRY_TOPICS`
//! (comma-separated), `FERRY_DLQ` (dead-letter topic), `FERRY_ASSIGNMENT`
//! (`eager` or `cooperative`), `FERRY_MICRO_BATCH` (records per poll turn, default 500),
//! and for tests `FERRY_CRASH_AT` (abort the process inside the handler,
//! before commit, the first time this effect key is seen; a marker file makes
//! it once) and `FERRY_POISON_KEY` (records with this key fail terminally).

use std::time::Duration;

use ferry::store::Arg;
use ferry::Ferry;
use ferry_consumer::{Assignment, Consumer, ConsumerError, Handler, HandlerError, Record};
use futures::future::BoxFuture;

struct Projection {
    crash_at: Option<String>,
    marker: std::path::PathBuf,
    poison_key: Option<String>,
}

const UPSERT: &str = "INSERT INTO ferry_projection (key, events, last_offset) VALUES ($1, 1, $2)
    ON CONFLICT (key) DO UPDATE SET events = ferry_projection.events + 1, last_offset = excluded.last_offset";
const APPLIED: &str = "INSERT INTO ferry_projection_applied (effect_key, applied) VALUES ($1, 1)
    ON CONFLICT (effect_key) DO UPDATE SET applied = ferry_projection_applied.applied + 1";

impl Handler for Projection {
    fn handle<'a>(&'a self, r: &'a Record, tx: &'a mut ferry::Tx) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            let key = String::from_utf8_lossy(r.key.as_deref().unwrap_or_default()).into_owned();
            if self.poison_key.as_deref() == Some(key.as_str()) {
                return Err(HandlerError::terminal("poison_key"));
            }
            let effect = r.effect_key().unwrap_or_default();
            tx.execute(UPSERT, &[Arg::from(&key), Arg::Int(r.offset)]).await?;
            tx.execute(APPLIED, &[Arg::from(&effect)]).await?;
            if self.crash_at.as_deref() == Some(effect.as_str()) && !self.marker.exists() {
                let _ = std::fs::write(&self.marker, b"crashed");
                // Between the handler's writes and the commit.
                std::process::abort();
            }
            Ok(())
        })
    }
}

/// `FERRY_ASSIGNMENT`: `eager` or `cooperative`; anything else is
/// [`ConsumerError::Config`] (it used to mean `cooperative` silently).
fn assignment(v: &str) -> Result<Assignment, ConsumerError> {
    match v.trim() {
        "eager" => Ok(Assignment::Eager),
        "cooperative" => Ok(Assignment::CooperativeSticky),
        _ => Err(ConsumerError::Config(
            "FERRY_ASSIGNMENT must be eager or cooperative".into(),
        )),
    }
}

/// `FERRY_MICRO_BATCH`: records per poll turn, a whole number from 1 up;
/// anything else is [`ConsumerError::Config`] (it used to mean 50 silently).
fn micro_batch(v: &str) -> Result<usize, ConsumerError> {
    v.trim()
        .parse::<usize>()
        .ok()
        .filter(|n| *n >= 1)
        .ok_or_else(|| ConsumerError::Config("FERRY_MICRO_BATCH must be a whole number from 1 up".into()))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    #[cfg(feature = "otlp")]
    let _telemetry = ferry::telemetry::init("ferry-projection", "warn");
    let env = |k: &str, d: &str| std::env::var(k).unwrap_or_else(|_| d.to_owned());
    let url = std::env::var("DATABASE_URL")?;
    let mut builder = Ferry::builder(&url).migrate(true);
    // DATABASE_URL through a transaction pooler (`pgbouncer=true`):
    // migrations run over the direct URL.
    if let Ok(direct) = std::env::var("FERRY_DIRECT_URL") {
        builder = builder.direct_url(direct);
    }
    let ferry = builder.connect().await?;
    // Members start together, and two concurrent `CREATE TABLE IF NOT
    // EXISTS` of one table can both pass the check and one then fails on
    // the catalog's unique index: one member at a time (the lock is the
    // transaction's; SQLite serializes its writers anyway).
    let mut tx = ferry.db().begin().await?;
    if ferry.db().engine() == ferry::Engine::Postgres {
        tx.execute("SELECT pg_advisory_xact_lock(hashtext('ferry-projection-ddl'))", &[])
            .await?;
    }
    for ddl in [
        "CREATE TABLE IF NOT EXISTS ferry_projection (key TEXT PRIMARY KEY, events BIGINT NOT NULL, last_offset BIGINT NOT NULL)",
        "CREATE TABLE IF NOT EXISTS ferry_projection_applied (effect_key TEXT PRIMARY KEY, applied BIGINT NOT NULL)",
    ] {
        tx.execute(ddl, &[]).await?;
    }
    tx.commit().await?;
    let topics = env("FERRY_TOPICS", "ferry.run-events");
    let topics: Vec<&str> = topics.split(',').collect();
    let assignment = assignment(&env("FERRY_ASSIGNMENT", "cooperative"))?;
    let micro_batch = micro_batch(&env(
        "FERRY_MICRO_BATCH",
        &ferry_consumer::DEFAULT_MICRO_BATCH.to_string(),
    ))?;
    let crash_at = std::env::var("FERRY_CRASH_AT").ok();
    let handler = Projection {
        marker: std::env::temp_dir().join(format!(
            "ferry-crash-{}",
            crash_at.clone().unwrap_or_default().replace('/', "_")
        )),
        crash_at,
        poison_key: std::env::var("FERRY_POISON_KEY").ok(),
    };
    let mut builder = Consumer::builder(
        ferry,
        env("FERRY_BROKERS", "127.0.0.1:9092"),
        env("FERRY_GROUP", "ferry-projection"),
        &topics,
    )
    .handler(handler)
    .assignment(assignment)
    .lease(Duration::from_secs(10))
    .micro_batch(micro_batch)
    .kafka("session.timeout.ms", "6000")
    .kafka("heartbeat.interval.ms", "500");
    if let Ok(dlq) = std::env::var("FERRY_DLQ") {
        builder = builder.dead_letter_topic(dlq);
    }
    builder.run(ferry::signal::shutdown_signal()).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Any value of either variable is used as given or refused with
        /// `config`, never replaced by a default.
        #[test]
        fn any_setting_is_used_or_refused(v in prop_oneof![any::<String>(), "[+-]?[0-9]{1,25}", "(eager|cooperative)"]) {
            match micro_batch(&v) {
                Ok(n) => prop_assert_eq!(Some(n), v.trim().parse().ok()),
                Err(e) => prop_assert_eq!(e.code(), "config"),
            }
            match assignment(&v) {
                Ok(a) => prop_assert_eq!(a == Assignment::Eager, v.trim() == "eager"),
                Err(e) => prop_assert_eq!(e.code(), "config"),
            }
        }
    }
}
