//! Publishing one held lane, in `id` order, in one of two modes:
//!
//! - **at least once** (default): rows stream through the shared idempotent
//!   producer; acknowledged rows are marked as acknowledgements arrive (every
//!   [`MARK_EVERY`] or [`MARK_ROWS`] acknowledgements), so a crash republishes
//!   little. At the first failed row nothing more of the lane is produced:
//!   what is in flight is awaited, only the acknowledged prefix is marked, and
//!   the lane backs off and resumes from the failed row.
//! - **exactly once** (`--exactly-once`): one Kafka transaction per batch
//!   through the lane's transactional producer, carrying the rows and a
//!   progress record with their exact ids; the rows are marked right after
//!   the commit and before the next transaction (see [`crate::exactly_once`]).
//!
//! Which lanes this relay holds is decided beside them, in `share`
//! ([`tick`]: heartbeat, renew, take a fair share of the free lanes, give
//! back extras).
//!
//! The parts, each in its own file:
//! - `task`: [`run`], the lane loop (take over, read, publish one batch in a
//!   `ferry.relay.batch` span, then act on how it ended);
//! - `at_least_once`: streaming a batch through the shared producer;
//! - `marker`: the acknowledged ids not yet marked, flushed under the lane
//!   generation;
//! - `take_over` and `transactional`: the exactly-once lane producer and its
//!   transactions;
//! - `poison`: what a record Kafka refuses does to a batch (isolation: the
//!   refused row re-sent alone through the [`LoneProducer`], or one row per
//!   transaction; then dead or blocking).

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};
use rdkafka::producer::FutureProducer;
use tokio_util::sync::CancellationToken;

use crate::exactly_once::ProgressReader;

mod at_least_once;
mod marker;
mod poison;
mod share;
mod take_over;
mod task;
mod transactional;

pub use poison::LoneProducer;
pub use share::{fair_share, tick, LanePlan};
pub use task::run;

/// A lane reads ahead (its pending rows besides the batch in flight) while a
/// batch is in flight; at least this often it reads in full instead, as it
/// does when it catches up (an empty read) and after any failure.
pub const RESCAN_EVERY: Duration = Duration::from_secs(1);

/// Per-lane wake-ups: the relay's probe (on `NOTIFY` and every poll
/// interval, one query for all its lanes) wakes only the lanes with pending
/// rows. A wake-up sent while the lane is busy is kept (a permit) and ends
/// its next idle wait at once, so none is lost between a read and the wait.
#[derive(Debug)]
pub struct Wakes {
    lanes: Vec<tokio::sync::Notify>,
}

impl Wakes {
    /// One wake-up per lane, `0..lanes`.
    pub fn new(lanes: i32) -> Self {
        Wakes {
            lanes: (0..lanes.max(1)).map(|_| tokio::sync::Notify::new()).collect(),
        }
    }

    /// Lane `lane`'s wake-up.
    pub fn lane(&self, lane: i32) -> &tokio::sync::Notify {
        &self.lanes[(lane.max(0) as usize) % self.lanes.len()]
    }

    /// Wakes every lane (shutdown).
    pub fn all(&self) {
        for n in &self.lanes {
            n.notify_one();
        }
    }
}

/// Mark the acknowledged rows at least this often while a batch is in flight.
pub const MARK_EVERY: Duration = Duration::from_millis(100);
/// ... or after this many acknowledgements, whichever comes first.
pub const MARK_ROWS: usize = 200;

/// How a batch ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BatchEnd {
    /// Every row was acknowledged and marked (or marked dead).
    Done,
    /// Stopped at row `id`: back off, then resume from the lane's first
    /// pending row.
    Stalled { id: i64, code: &'static str },
    /// The broker refused a record as poison (too large, say) in a produce
    /// request that may hold other records: it refuses the whole request, so
    /// whether this row is poison is unknown (at least once, the shared
    /// producer's requests hold other lanes' records; exactly once, the
    /// transaction held several rows). Publish the lane's rows through
    /// `through` one at a time, each alone in its request, to find out;
    /// nothing is marked dead on a guess.
    Isolate { through: i64, code: &'static str },
    /// Some rows were settled (a row refused before sending was marked dead)
    /// but the batch's others are still pending (their transaction was
    /// aborted): go on at once from a full read, never from the read-ahead,
    /// which left the whole batch out and would overtake them.
    Unfinished,
    /// The lane is no longer ours (taken over, or its producer fenced):
    /// publish nothing more.
    Lost,
    /// The shared producer failed fatally: stop; the relay drains and exits
    /// non-zero to be restarted with a new producer.
    Fatal,
    /// A transactional call (commit, abort) did not end cleanly: the
    /// producer's transaction state is unknown, so it is dropped and the lane
    /// is taken over again (`init_transactions` settles the open
    /// transaction, the progress read marks what it committed).
    Reinit { id: i64, code: &'static str },
}

impl BatchEnd {
    /// The `outcome` recorded on the batch span.
    fn outcome(&self) -> &'static str {
        match self {
            BatchEnd::Done => "done",
            BatchEnd::Stalled { .. } => "stalled",
            BatchEnd::Isolate { .. } => "isolate",
            BatchEnd::Unfinished => "unfinished",
            BatchEnd::Lost => "lost",
            BatchEnd::Fatal => "fatal",
            BatchEnd::Reinit { .. } => "reinit",
        }
    }

    /// The failure code recorded on the batch span, if the batch stopped on one.
    fn code(&self) -> Option<&'static str> {
        match self {
            BatchEnd::Stalled { code, .. } | BatchEnd::Isolate { code, .. } | BatchEnd::Reinit { code, .. } => {
                Some(code)
            }
            BatchEnd::Done | BatchEnd::Unfinished | BatchEnd::Lost | BatchEnd::Fatal => None,
        }
    }
}

/// Where a lane's records go, which also picks the lane's mode: the shared
/// producer publishes at least once, a transactional producer per lane
/// exactly once. One `Sink` is cloned into every lane task.
#[derive(Clone)]
pub enum Sink {
    /// The relay's shared idempotent producer (at least once), and its
    /// lone producer for rows being isolated.
    Shared(FutureProducer, LoneProducer),
    /// The lane's own transactional producer, created on the lane task, and
    /// the relay's reader of the progress topic.
    Transactional(Arc<ProgressReader>),
}

/// The relay's retry delays: exponential from 100 ms to 10 s, with jitter,
/// never giving up.
pub(crate) fn retry_backoff() -> ExponentialBackoff {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(10))
        .with_jitter()
        .without_max_times()
        .build()
}

/// Sleeps the next backoff step; true when the lane should stop instead.
async fn pause(
    backoff: &mut impl Iterator<Item = Duration>,
    finish: &CancellationToken,
    abort: &CancellationToken,
) -> bool {
    let d = backoff.next().unwrap_or(Duration::from_secs(10));
    tokio::select! {
        _ = tokio::time::sleep(d) => false,
        _ = finish.cancelled() => true,
        _ = abort.cancelled() => true,
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
