//! What a worker knows of one lease's expiry, and the deadline it enforces
//! on the handler.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::Clock;

/// What a worker knows of one lease: the expiry the database last reported
/// and, for the database clock, the same instant on the worker's monotonic
/// clock (measured from when the claim or renewal was sent, so it is never
/// later than the database's). With an injected clock the expiry is compared
/// with that clock, the one the database is told.
#[derive(Debug)]
pub(super) struct LeaseWatch {
    clock: Clock,
    known: Mutex<KnownExpiry>,
    revoked: AtomicBool,
}

#[derive(Debug, Clone, Copy)]
struct KnownExpiry {
    expires_at: i64,
    local: tokio::time::Instant,
}

impl LeaseWatch {
    pub(super) fn new(clock: Clock, expires_at: i64, now: i64, sent: tokio::time::Instant) -> Self {
        LeaseWatch {
            clock,
            known: Mutex::new(KnownExpiry::new(expires_at, now, sent)),
            revoked: AtomicBool::new(false),
        }
    }

    /// Records a successful renewal: `expires_at` computed at database time
    /// `now`, for a request sent at `sent`.
    pub(super) fn learn(&self, expires_at: i64, now: i64, sent: tokio::time::Instant) {
        *self.known.lock().unwrap_or_else(|p| p.into_inner()) = KnownExpiry::new(expires_at, now, sent);
    }

    fn known(&self) -> KnownExpiry {
        *self.known.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The attempt was given up: nothing more may be written under it.
    pub(super) fn revoke(&self) {
        self.revoked.store(true, Ordering::SeqCst);
    }

    /// Revoked, or past the known expiry by the worker's clock.
    pub(super) fn expired(&self) -> bool {
        if self.revoked.load(Ordering::SeqCst) {
            return true;
        }
        let known = self.known();
        match self.clock.param() {
            Some(now) => now >= known.expires_at,
            None => tokio::time::Instant::now() >= known.local,
        }
    }

    /// When the known expiry passes on the worker's monotonic clock; `None`
    /// with an injected clock, which is checked at every renewal tick.
    pub(super) fn local_deadline(&self) -> Option<tokio::time::Instant> {
        match self.clock {
            Clock::Database => Some(self.known().local),
            Clock::Manual(_) => None,
        }
    }
}

impl KnownExpiry {
    fn new(expires_at: i64, now: i64, sent: tokio::time::Instant) -> Self {
        let left = Duration::from_millis(u64::try_from(expires_at.saturating_sub(now)).unwrap_or(0));
        KnownExpiry {
            expires_at,
            local: sent + left,
        }
    }
}

/// Resolves at `at`, or never.
pub(super) async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
