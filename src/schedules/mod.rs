//! Periodic runs: [`Ferry::schedule`] registers a run template under a cron
//! expression or an interval ([`Every`]), and [`Ferry::fire_due_ticks`]
//! (driven by [`Ferry::run_scheduler`] in any number of processes) accepts
//! one run per tick.
//!
//! A tick is accepted through the normal acceptance transaction under the
//! idempotency key `schedule:<name>:<tick ms>`, in the same transaction as a
//! compare-and-set that moves the schedule's `next_tick` from the value the
//! firer read. Of several processes firing one tick, one moves it and the
//! others match nothing; and were a cursor ever moved back (a schedule
//! dropped and registered again), the key would still make the tick's
//! second acceptance a replay. No leader is needed.
//!
//! Ticks are computed in UTC from the schedule's spec, the same in every
//! process: a cron expression's occurrences, or the multiples of an
//! interval since the Unix epoch. Ticks missed while nothing fired follow
//! the schedule's [`Missed`] policy.

mod api;
mod scheduler;
mod tick;

pub use api::{FiredTick, Schedule, ScheduleChange};
pub use tick::{tick_key, Every, Missed};
