//! Retry delays: `min(cap, base · 2^(attempt-1))` plus bounded jitter drawn from
//! an injected RNG, a bounded `Retry-After` honoured, and a total retry
//! deadline. Seeding the RNG makes the whole schedule exact in tests.

use std::time::Duration;

use rand::{Rng, RngCore};

/// How failed attempts are rescheduled.
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    /// Delay before the second attempt.
    pub base: Duration,
    /// Largest exponential delay.
    pub cap: Duration,
    /// Jitter is uniform in `[0, min(max_jitter, delay / 2)]`.
    pub max_jitter: Duration,
    /// Longest `Retry-After` honoured; longer hints are clamped to it.
    pub max_retry_after: Duration,
    /// No retry is scheduled later than `created_at + max_elapsed`: past it the
    /// job goes dead with `retry_deadline_exceeded`.
    pub max_elapsed: Option<Duration>,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            base: Duration::from_secs(1),
            cap: Duration::from_secs(3600),
            max_jitter: Duration::from_secs(30),
            max_retry_after: Duration::from_secs(3600),
            max_elapsed: Some(Duration::from_secs(7 * 24 * 3600)),
        }
    }
}

impl RetryPolicy {
    /// The delay after failed attempt number `attempt` (1-based).
    pub fn delay(&self, attempt: u32, retry_after: Option<Duration>, rng: &mut (dyn RngCore + Send)) -> Duration {
        let exp = self
            .base
            .checked_mul(1u32.checked_shl(attempt.saturating_sub(1)).unwrap_or(u32::MAX))
            .unwrap_or(self.cap)
            .min(self.cap);
        let jitter_bound = self.max_jitter.min(exp / 2).as_millis() as u64;
        let jitter = Duration::from_millis(if jitter_bound == 0 {
            0
        } else {
            rng.random_range(0..=jitter_bound)
        });
        let delay = exp + jitter;
        match retry_after {
            Some(hint) => delay.max(hint.min(self.max_retry_after)),
            None => delay,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    #[test]
    fn exponential_capped_and_bounded_jitter() {
        let p = RetryPolicy {
            base: Duration::from_millis(100),
            cap: Duration::from_millis(1000),
            max_jitter: Duration::from_millis(40),
            ..RetryPolicy::default()
        };
        let mut rng = StdRng::seed_from_u64(7);
        for (attempt, exp) in [(1, 100), (2, 200), (3, 400), (4, 800), (5, 1000), (40, 1000)] {
            let d = p.delay(attempt, None, &mut rng).as_millis() as u64;
            assert!(d >= exp && d <= exp + 40.min(exp / 2), "attempt {attempt}: {d}");
        }
    }

    #[test]
    fn retry_after_is_honoured_but_bounded() {
        let p = RetryPolicy {
            base: Duration::from_millis(10),
            max_jitter: Duration::ZERO,
            max_retry_after: Duration::from_secs(60),
            ..RetryPolicy::default()
        };
        let mut rng = StdRng::seed_from_u64(1);
        assert_eq!(
            p.delay(1, Some(Duration::from_secs(5)), &mut rng),
            Duration::from_secs(5)
        );
        assert_eq!(
            p.delay(1, Some(Duration::from_secs(600)), &mut rng),
            Duration::from_secs(60)
        );
    }

    #[test]
    fn seeded_schedule_is_reproducible() {
        let p = RetryPolicy::default();
        let a: Vec<_> = (1..6)
            .map(|n| p.delay(n, None, &mut StdRng::seed_from_u64(n as u64)))
            .collect();
        let b: Vec<_> = (1..6)
            .map(|n| p.delay(n, None, &mut StdRng::seed_from_u64(n as u64)))
            .collect();
        assert_eq!(a, b);
    }
}
