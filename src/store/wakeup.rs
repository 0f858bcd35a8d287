//! Wake-ups after committed writes: `LISTEN ferry_wakeup` on PostgreSQL. On
//! SQLite (one process, no NOTIFY) and while the listener connection is down,
//! callers fall back to their poll interval, so a missed notification costs
//! at most one interval.

use std::time::{Duration, Instant};

use sqlx::postgres::PgListener;
use sqlx::PgPool;

use super::Db;

/// The channel enqueues notify and workers and relays listen on.
pub const CHANNEL: &str = "ferry_wakeup";

/// A listener on [`CHANNEL`] that reconnects by itself (with backoff up to
/// 10 s) and degrades to plain waiting when it cannot.
#[derive(Debug)]
pub struct Wakeup {
    pool: Option<PgPool>,
    listener: Option<PgListener>,
    retry_at: Instant,
    backoff: Duration,
}

impl Wakeup {
    /// Starts listening on `db` (PostgreSQL); on SQLite it only waits.
    pub async fn connect(db: &Db) -> Wakeup {
        let pool = match db {
            Db::Postgres(p) => Some(p.pool().clone()),
            Db::Sqlite(_) => None,
        };
        let mut w = Wakeup {
            pool,
            listener: None,
            retry_at: Instant::now(),
            backoff: Duration::from_millis(100),
        };
        w.reconnect().await;
        w
    }

    /// A listener that never listens: [`Wakeup::wait`] waits out its
    /// timeout (behind a transaction pooler, see
    /// [`crate::Ferry::wakeup`]).
    pub fn polling() -> Wakeup {
        Wakeup {
            pool: None,
            listener: None,
            retry_at: Instant::now(),
            backoff: Duration::from_millis(100),
        }
    }

    async fn reconnect(&mut self) {
        let Some(pool) = &self.pool else { return };
        let listener = async {
            let mut l = PgListener::connect_with(pool).await?;
            l.listen(CHANNEL).await?;
            Ok::<_, sqlx::Error>(l)
        }
        .await;
        match listener {
            Ok(l) => {
                self.listener = Some(l);
                self.backoff = Duration::from_millis(100);
            }
            Err(e) => {
                tracing::warn!(error = %e, retry_in_ms = self.backoff.as_millis() as u64, "LISTEN unavailable; polling meanwhile");
                self.retry_at = Instant::now() + self.backoff;
                self.backoff = (self.backoff * 2).min(Duration::from_secs(10));
            }
        }
    }

    /// Waits for a notification or `timeout`, whichever comes first, and
    /// says whether a notification arrived.
    pub async fn wait(&mut self, timeout: Duration) -> bool {
        if self.listener.is_none() && self.pool.is_some() && Instant::now() >= self.retry_at {
            self.reconnect().await;
        }
        match self.listener.as_mut() {
            Some(l) => match tokio::time::timeout(timeout, l.recv()).await {
                Ok(Ok(_)) => true,
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "LISTEN connection lost; polling until it is back");
                    self.listener = None;
                    self.retry_at = Instant::now() + self.backoff;
                    false
                }
                Err(_) => false,
            },
            None => {
                tokio::time::sleep(timeout).await;
                false
            }
        }
    }
}
