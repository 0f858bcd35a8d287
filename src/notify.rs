//! Coalesced wake-ups. On PostgreSQL an enqueue may send `NOTIFY ferry_wakeup`
//! with the queue name, but at most once per queue per interval from this
//! process: NOTIFY takes a global lock at commit, and one per transaction cut
//! acceptance throughput 2–3× in a probe.
//!
//! A wake-up skipped inside the interval is not dropped: it arms one
//! *trailing* notification, sent on its own (autocommitted) at the end of the
//! interval, so a row committed just after a notification waits at most one
//! interval for the next, not one listener poll. Listeners keep their poll
//! fallback for what this cannot cover (a transaction still open when the
//! trailing notification goes out, a lost listener, SQLite).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::error::Result;
use crate::store::{on_conn, Conn, Db, PgConn};

pub use crate::store::WAKEUP_CHANNEL as CHANNEL;

/// Payload used when only the outbox has new rows.
pub const OUTBOX_PAYLOAD: &str = "";

/// When a payload was last notified, and whether a trailing notification is
/// armed for it.
#[derive(Debug, Clone, Copy)]
struct Slot {
    last: Instant,
    trailing: bool,
}

#[derive(Debug)]
pub(crate) struct Notifier {
    interval: Duration,
    /// Where trailing notifications go; `None` on SQLite.
    pool: Option<crate::store::PgDb>,
    slots: Arc<Mutex<HashMap<String, Slot>>>,
}

impl Notifier {
    pub(crate) fn new(interval: Duration, db: &Db) -> Self {
        Notifier {
            interval,
            pool: db.as_postgres().cloned(),
            slots: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    /// True when this process has not notified for `payload` within the
    /// interval (records the notification). Otherwise arms the trailing
    /// notification for the end of the interval, once.
    fn due(&self, payload: &str) -> bool {
        let now = Instant::now();
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        match slots.get_mut(payload) {
            Some(slot) if now.duration_since(slot.last) < self.interval => {
                if !slot.trailing {
                    slot.trailing = true;
                    self.arm_trailing(payload.to_owned(), slot.last + self.interval);
                }
                false
            }
            Some(slot) => {
                slot.last = now;
                true
            }
            None => {
                slots.insert(
                    payload.to_owned(),
                    Slot {
                        last: now,
                        trailing: false,
                    },
                );
                true
            }
        }
    }

    /// Sends `payload` at `at` on its own, and records it as the last one.
    /// A failed trailing notification is left to the listeners' poll.
    fn arm_trailing(&self, payload: String, at: Instant) {
        let Some(pool) = self.pool.clone() else { return };
        let slots = self.slots.clone();
        tokio::spawn(async move {
            tokio::time::sleep_until(at.into()).await;
            let sent = sqlx::query(crate::store::queries::POSTGRES_ONLY.notify_work)
                .bind(CHANNEL)
                .bind(&payload)
                .execute(&pool)
                .await;
            if let Err(e) = sent {
                tracing::debug!(error = %e, "trailing wake-up not sent; listeners fall back to their poll");
            }
            let mut slots = slots.lock().unwrap_or_else(|p| p.into_inner());
            slots.insert(
                payload,
                Slot {
                    last: Instant::now(),
                    trailing: false,
                },
            );
        });
    }

    /// Queues a notification inside the caller's transaction (delivered only
    /// if it commits), when one is due. SQLite has no NOTIFY: a no-op.
    pub(crate) async fn wake(&self, conn: Conn<'_>, payload: &str) -> Result<()> {
        if !conn.has_notify() || !self.due(payload) {
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
    pub(crate) async fn wake_many(&self, c: &mut PgConn<'_>, payloads: &[&str]) -> Result<()> {
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
