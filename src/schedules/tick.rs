//! Tick arithmetic: when a schedule ticks ([`Every`]: the occurrences of a
//! cron expression, or the multiples of an interval since the Unix epoch, in
//! UTC), what happens to ticks missed while nothing fired ([`Missed`]), and
//! each tick's idempotency key. Pure functions of the spec, the same in
//! every process.

use std::collections::VecDeque;
use std::fmt;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::time::duration_ms;

/// When a schedule ticks.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Every {
    /// A cron expression in UTC: five fields (minute to weekday) or six
    /// (with seconds first), as `croner` parses them. Build with [`Every::cron`].
    Cron(String),
    /// A fixed interval of whole seconds, ticking at its multiples since the
    /// Unix epoch (every hour ticks on the hour). Build with [`Every::interval`].
    Interval(Duration),
}

impl Every {
    /// A cron schedule; an expression `croner` refuses is
    /// [`Error::InvalidInput`].
    pub fn cron(expr: impl Into<String>) -> Result<Every> {
        let every = Every::Cron(expr.into());
        every.check()?;
        Ok(every)
    }

    /// An interval schedule: whole seconds, at least one, at most
    /// [`crate::time::MAX_DURATION`].
    pub fn interval(d: Duration) -> Result<Every> {
        let every = Every::Interval(d);
        every.check()?;
        Ok(every)
    }

    pub(super) fn check(&self) -> Result<()> {
        match self {
            Every::Cron(expr) => cron(expr).map(drop),
            Every::Interval(d) => interval_ms(*d).map(drop),
        }
    }

    /// The stored text: `cron:<expression>` or `every:<milliseconds>`.
    pub(super) fn spec(&self) -> Result<String> {
        Ok(match self {
            Every::Cron(expr) => format!("cron:{expr}"),
            Every::Interval(d) => format!("every:{}", interval_ms(*d)?),
        })
    }

    pub(super) fn parse_spec(spec: &str) -> Result<Every> {
        let corrupt = || Error::CorruptRow {
            what: "ferry_schedules.spec",
            value: spec.into(),
        };
        if let Some(expr) = spec.strip_prefix("cron:") {
            return Every::cron(expr).map_err(|_| corrupt());
        }
        let ms: u64 = spec
            .strip_prefix("every:")
            .and_then(|ms| ms.parse().ok())
            .ok_or_else(corrupt)?;
        Every::interval(Duration::from_millis(ms)).map_err(|_| corrupt())
    }

    /// The first tick strictly after `t`.
    pub(super) fn next_after(&self, t: i64) -> Result<i64> {
        match self {
            Every::Interval(d) => {
                let step = interval_ms(*d)?;
                (t.div_euclid(step) + 1)
                    .checked_mul(step)
                    .ok_or_else(|| Error::invalid("every", "the next tick overflows"))
            }
            Every::Cron(expr) => {
                let cron = cron(expr)?;
                // Ticks are whole seconds: the first after `t` is the first
                // after `t` rounded down to its second.
                let from = utc(t.div_euclid(1000) * 1000)?;
                let next = cron
                    .find_next_occurrence(&from, false)
                    .map_err(|e| Error::invalid("every", format!("no next occurrence: {e}")))?;
                Ok(next.timestamp() * 1000)
            }
        }
    }

    /// The latest `max` ticks in `(after, now]`, oldest first.
    pub(super) fn ticks(&self, after: i64, now: i64, max: usize) -> Result<Vec<i64>> {
        if let Every::Interval(d) = self {
            let step = interval_ms(*d)?;
            let last = now.div_euclid(step);
            let first = after.div_euclid(step) + 1;
            let from = first.max(last - max as i64 + 1);
            return Ok((from..=last).map(|k| k * step).collect());
        }
        // Look back over a window that grows until it holds `max` ticks or
        // reaches `after`, so a long downtime costs the ticks of the window,
        // not every tick missed.
        let mut window: i64 = 3_600_000;
        loop {
            let start = after.max(now.saturating_sub(window));
            let mut latest = VecDeque::with_capacity(max);
            let mut t = start;
            loop {
                let tick = self.next_after(t)?;
                if tick > now {
                    break;
                }
                if latest.len() == max {
                    latest.pop_front();
                }
                latest.push_back(tick);
                t = tick;
            }
            if latest.len() == max || start == after {
                return Ok(latest.into());
            }
            window = window.saturating_mul(8);
        }
    }
}

impl fmt::Display for Every {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Every::Cron(expr) => write!(f, "cron {expr}"),
            Every::Interval(d) => write!(f, "every {}s", d.as_secs()),
        }
    }
}

fn cron(expr: &str) -> Result<croner::Cron> {
    croner::Cron::new(expr)
        .with_seconds_optional()
        .parse()
        .map_err(|e| Error::invalid("every", format!("not a cron expression: {e}")))
}

fn interval_ms(d: Duration) -> Result<i64> {
    let ms = duration_ms(d)?;
    // Whole seconds: a fraction is refused, never rounded away.
    if ms < 1000 || d.subsec_nanos() != 0 {
        return Err(Error::invalid("every", "an interval is whole seconds, at least one"));
    }
    Ok(ms)
}

fn utc(ms: i64) -> Result<chrono::DateTime<chrono::Utc>> {
    chrono::DateTime::from_timestamp_millis(ms).ok_or_else(|| Error::invalid("instant", "out of range"))
}

/// What happens to ticks missed while no process fired (downtime), stated
/// per schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Missed {
    /// Only the latest missed tick runs; the earlier ones are skipped.
    Skip,
    /// The latest `max` missed ticks run (1 to 1000), oldest first; any
    /// earlier ones are skipped, so a long downtime never floods a queue.
    CatchUp {
        /// Most ticks one firing accepts.
        max: u32,
    },
}

impl Missed {
    pub(super) fn stored(self) -> Result<(&'static str, i32)> {
        match self {
            Missed::Skip => Ok(("skip", 1)),
            Missed::CatchUp { max } if (1..=1000).contains(&max) => Ok(("catch_up", max as i32)),
            Missed::CatchUp { .. } => Err(Error::invalid("missed", "catch-up max must be 1 to 1000")),
        }
    }

    pub(super) fn parse(missed: &str, max: i32) -> Result<Missed> {
        match (missed, u32::try_from(max)) {
            ("skip", _) => Ok(Missed::Skip),
            ("catch_up", Ok(max)) => Ok(Missed::CatchUp { max }),
            _ => Err(Error::CorruptRow {
                what: "ferry_schedules.missed",
                value: format!("{missed} {max}"),
            }),
        }
    }

    pub(super) fn max(self) -> usize {
        match self {
            Missed::Skip => 1,
            Missed::CatchUp { max } => max as usize,
        }
    }
}

/// The idempotency key of tick `tick` of schedule `name`.
pub fn tick_key(name: &str, tick: i64) -> String {
    format!("schedule:{name}:{tick}")
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: i64 = 1_800_000_000_000; // a multiple of one minute and five

    #[test]
    fn interval_ticks_are_epoch_multiples_and_bounded() {
        let every = Every::interval(Duration::from_secs(60)).unwrap();
        assert_eq!(every.next_after(T0).unwrap(), T0 + 60_000);
        assert_eq!(every.next_after(T0 - 1).unwrap(), T0);
        assert_eq!(
            every.ticks(T0, T0 + 600_000, 3).unwrap(),
            [T0 + 480_000, T0 + 540_000, T0 + 600_000]
        );
        assert_eq!(every.ticks(T0, T0 + 59_999, 3).unwrap(), Vec::<i64>::new());
        assert_eq!(every.ticks(T0, T0 + 120_000, 5).unwrap(), [T0 + 60_000, T0 + 120_000]);
        assert!(Every::interval(Duration::from_millis(1500)).is_err());
        assert!(Every::interval(Duration::ZERO).is_err());
    }

    #[test]
    fn cron_ticks_look_back_only_as_far_as_needed() {
        let every = Every::cron("*/5 * * * *").unwrap();
        assert_eq!(every.next_after(T0).unwrap(), T0 + 300_000);
        assert_eq!(every.next_after(T0 + 1).unwrap(), T0 + 300_000);
        assert_eq!(every.next_after(T0 - 1).unwrap(), T0);
        // Thirty days down, catch up 2: the latest two only.
        let month = 30 * 86_400_000;
        assert_eq!(
            every.ticks(T0, T0 + month, 2).unwrap(),
            [T0 + month - 300_000, T0 + month]
        );
        // A yearly tick found across a long look-back.
        let yearly = Every::cron("0 0 1 1 *").unwrap();
        let ticks = yearly.ticks(0, T0, 1).unwrap();
        assert_eq!(ticks.len(), 1);
        assert_eq!(utc(ticks[0]).unwrap().to_rfc3339(), "2027-01-01T00:00:00+00:00");
        assert!(Every::cron("not cron").is_err());
        assert_eq!(Every::parse_spec(&every.spec().unwrap()).unwrap(), every);
    }
}
