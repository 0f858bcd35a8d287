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

/// Parses `250ms`, `15s`, `2m`, `1h`, `3d`, or a bare number of
/// milliseconds, up to [`MAX_DURATION`] (100 years, the most the store
/// accepts): the durations the command lines of the relay, the consumer
/// and the operator take. Anything else, a count that overflows included,
/// is [`Error::Config`] (code `config`: a setting, not a request's
/// input): nothing wraps.
pub fn parse_duration(s: &str) -> Result<Duration> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let n: u64 = n.parse().map_err(|_| Error::Config(format!("not a duration: {s:?}")))?;
    let ms_per_unit: u64 = match unit {
        "" | "ms" => 1,
        "s" => 1000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(Error::Config(format!("unknown unit in {s:?}; use ms, s, m, h or d"))),
    };
    n.checked_mul(ms_per_unit)
        .map(Duration::from_millis)
        .filter(|d| *d <= MAX_DURATION)
        .ok_or_else(|| Error::Config(format!("{s:?} is longer than 100 years")))
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

    /// Milliseconds per unit `parse_duration` takes.
    fn unit_ms(unit: &str) -> u128 {
        match unit {
            "" | "ms" => 1,
            "s" => 1000,
            "m" => 60_000,
            "h" => 3_600_000,
            _ => 86_400_000,
        }
    }

    proptest::proptest! {
        /// Any text is a duration within 100 years or a `config` error.
        #[test]
        fn any_duration_text_parses_or_is_refused(s in proptest::prelude::any::<String>()) {
            match parse_duration(&s) {
                Ok(d) => proptest::prop_assert!(d <= MAX_DURATION),
                Err(e) => proptest::prop_assert_eq!(e.code(), "config"),
            }
        }

        /// A count of any size in any unit is exactly that many units, or
        /// refused when past 100 years: it never wraps (it used to multiply
        /// unchecked, panicking or wrapping on `307445734561825861m`).
        #[test]
        fn duration_counts_never_wrap(
            n in proptest::prop_oneof![proptest::prelude::any::<u64>(), 0..10_000_000_u64],
            unit in proptest::sample::select(vec!["", "ms", "s", "m", "h", "d"]),
        ) {
            let ms = u128::from(n) * unit_ms(unit);
            match parse_duration(&format!("{n}{unit}")) {
                Ok(d) => proptest::prop_assert_eq!(d.as_millis(), ms),
                Err(e) => {
                    proptest::prop_assert_eq!(e.code(), "config");
                    proptest::prop_assert!(ms > MAX_DURATION.as_millis());
                }
            }
        }
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert!(parse_duration("2 weeks").is_err());
        assert_eq!(parse_duration("36500d").unwrap(), Duration::from_secs(36_500 * 86_400));
        assert_eq!(parse_duration("36501d").unwrap_err().code(), "config");
        assert_eq!(parse_duration("307445734561825861m").unwrap_err().code(), "config");
    }

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
