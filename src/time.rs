//! Time as the store sees it: the database clock in production, an injected
//! instant in tests, so tests cross lease expiry without sleeping.
//!
//! Instants are milliseconds since the Unix epoch ([`Millis`]). Negative
//! instants and durations are rejected, and every addition is checked.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result};

/// Longest duration the store accepts (100 years), so instant arithmetic can
/// never overflow in SQL either.
pub const MAX_DURATION: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// A non-negative instant in milliseconds since the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub struct Millis(i64);

impl Millis {
    /// Checks that `ms` is not negative.
    pub fn new(ms: i64) -> Result<Self> {
        if ms < 0 {
            return Err(Error::invalid("instant", "instants must not be negative"));
        }
        Ok(Millis(ms))
    }

    /// The raw value.
    pub fn get(self) -> i64 {
        self.0
    }

    /// `self + d`, refusing overflow and durations over [`MAX_DURATION`].
    pub fn checked_add(self, d: Duration) -> Result<Millis> {
        let add = duration_ms(d)?;
        self.0
            .checked_add(add)
            .map(Millis)
            .ok_or_else(|| Error::invalid("instant", "instant arithmetic overflowed"))
    }
}

/// `d` in whole milliseconds, refusing durations over [`MAX_DURATION`].
pub fn duration_ms(d: Duration) -> Result<i64> {
    if d > MAX_DURATION {
        return Err(Error::invalid("duration", "duration exceeds 100 years"));
    }
    Ok(d.as_millis() as i64)
}

/// Where "now" comes from for every store operation.
///
/// [`Clock::Database`] resolves inside SQL (`COALESCE($now, <database clock>)`),
/// so all replicas of a service agree on lease expiry. [`Clock::manual`] is an
/// injected clock shared by clones, for tests.
#[derive(Debug, Clone, Default)]
pub enum Clock {
    /// The database's own clock (production).
    #[default]
    Database,
    /// An injected instant that tests move forward explicitly.
    Manual(Arc<AtomicI64>),
}

impl Clock {
    /// An injected clock starting at `start`.
    pub fn manual(start: Millis) -> Clock {
        Clock::Manual(Arc::new(AtomicI64::new(start.get())))
    }

    /// Moves an injected clock forward; refuses on [`Clock::Database`].
    pub fn advance(&self, d: Duration) -> Result<Millis> {
        match self {
            Clock::Database => Err(Error::Unsupported("the database clock cannot be advanced")),
            Clock::Manual(at) => {
                let next = Millis(at.load(Ordering::SeqCst)).checked_add(d)?;
                at.store(next.get(), Ordering::SeqCst);
                Ok(next)
            }
        }
    }

    /// The value bound as `$now` in SQL: `None` means the database clock.
    pub fn param(&self) -> Option<i64> {
        match self {
            Clock::Database => None,
            Clock::Manual(at) => Some(at.load(Ordering::SeqCst)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negative_instants_and_overflow_are_refused() {
        assert_eq!(Millis::new(-1).unwrap_err().code(), "invalid_input");
        let big = Millis::new(i64::MAX - 5).unwrap();
        assert!(big.checked_add(Duration::from_millis(10)).is_err());
        assert!(Millis::new(0)
            .unwrap()
            .checked_add(MAX_DURATION + Duration::from_secs(1))
            .is_err());
        assert_eq!(
            Millis::new(5)
                .unwrap()
                .checked_add(Duration::from_millis(7))
                .unwrap()
                .get(),
            12
        );
    }

    #[test]
    fn manual_clock_is_shared_by_clones() {
        let c = Clock::manual(Millis::new(1_000).unwrap());
        let c2 = c.clone();
        c.advance(Duration::from_secs(1)).unwrap();
        assert_eq!(c2.param(), Some(2_000));
        assert!(Clock::Database.advance(Duration::from_secs(1)).is_err());
    }
}
