//! Coalesced wake-ups. On PostgreSQL an enqueue may send `NOTIFY ferry_wakeup`
//! with the queue name, but at most once per queue per interval from this
//! process: NOTIFY takes a global lock at commit, and one per transaction cut
//! acceptance throughput 2–3× in a probe. Listeners keep a poll fallback, so
//! a skipped notification costs at most one poll interval.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::error::Result;
use crate::store::{on_conn, Conn};

pub use crate::store::WAKEUP_CHANNEL as CHANNEL;

/// Payload used when only the outbox has new rows.
pub const OUTBOX_PAYLOAD: &str = "";

#[derive(Debug)]
pub(crate) struct Notifier {
    interval: Duration,
    last: Mutex<HashMap<String, Instant>>,
}

impl Notifier {
    pub(crate) fn new(interval: Duration) -> Self {
        Notifier {
            interval,
            last: Mutex::new(HashMap::new()),
        }
    }

    /// True when this process has not notified for `payload` within the interval;
    /// records the attempt.
    fn due(&self, payload: &str) -> bool {
        let now = Instant::now();
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        match last.get(payload) {
            Some(at) if now.duration_since(*at) < self.interval => false,
            _ => {
                last.insert(payload.to_owned(), now);
                true
            }
        }
    }

    /// Queues a notification inside the caller's transaction (delivered only
    /// if it commits), when one is due. SQLite has no NOTIFY: a no-op.
    pub(crate) async fn wake(&self, conn: Conn<'_>, payload: &str) -> Result<()> {
        if conn.engine() == crate::Engine::Sqlite || !self.due(payload) {
            return Ok(());
        }
        on_conn!(conn, |c, _q| {
            sqlx::query(crate::store::queries::POSTGRES_ONLY.notify_work)
                .bind(CHANNEL)
                .bind(payload)
                .execute(&mut *c)
                .await?;
        });
        Ok(())
    }

    /// [`Notifier::wake`] for a batch on PostgreSQL: one notification per
    /// due payload (each queue at most once per interval, as for single
    /// writes), all queued by one statement, and none when nothing is due.
    pub(crate) async fn wake_many(&self, c: &mut sqlx::PgConnection, payloads: &[&str]) -> Result<()> {
        let mut due: Vec<&str> = Vec::new();
        for p in payloads {
            if !due.contains(p) && self.due(p) {
                due.push(p);
            }
        }
        if due.is_empty() {
            return Ok(());
        }
        sqlx::query(crate::store::queries::POSTGRES_ONLY.notify_work_many)
            .bind(CHANNEL)
            .bind(&due)
            .execute(c)
            .await?;
        Ok(())
    }
}
