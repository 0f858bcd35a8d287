//! Plain counters of where the relay's time goes, read by the benchmarks
//! (not exported on `/metrics`).

use std::sync::atomic::{AtomicU64, Ordering};

/// Plain counters of where the lanes' time goes, summed over lanes (so with
/// many lanes in parallel they add up to more than wall time). Not exported
/// on `/metrics`; read by the benchmarks.
#[derive(Debug, Default)]
pub struct Timings {
    /// Reads of a lane's pending rows, and their total time (ns).
    pub reads: AtomicU64,
    /// Time spent reading pending rows (ns), on the lane's path only (a read
    /// overlapped with a batch in flight is not counted here).
    pub read_ns: AtomicU64,
    /// Rows returned by those reads.
    pub rows_read: AtomicU64,
    /// Reads that waited on nothing: the next batch was already read while the
    /// previous one was in flight.
    pub prefetched: AtomicU64,
    /// Full reads from the lane's lowest pending row (not a read-ahead).
    pub full_reads: AtomicU64,
    /// Batches and the time from the first produce to the last mark (ns),
    /// marks included.
    pub batches: AtomicU64,
    /// Batch time (ns).
    pub batch_ns: AtomicU64,
    /// Mark statements (delivered or deleted) and their time (ns).
    pub marks: AtomicU64,
    /// Mark time (ns).
    pub mark_ns: AtomicU64,
    /// Idle waits (nothing pending) and their time (ns).
    pub idles: AtomicU64,
    /// Idle time (ns).
    pub idle_ns: AtomicU64,
    /// WAL capture: replication events received, and the time the session
    /// waited for them with nothing else to do (ns).
    pub wal_events: AtomicU64,
    /// See [`Self::wal_events`].
    pub wal_wait_ns: AtomicU64,
    /// WAL capture: hand-overs to the marker that found no room (too many
    /// rows not yet marked), and the time the stream waited for room (ns).
    pub wal_hand_waits: AtomicU64,
    /// See [`Self::wal_hand_waits`].
    pub wal_hand_wait_ns: AtomicU64,
    /// WAL capture: records acknowledged by the broker (marking follows).
    pub wal_acked: AtomicU64,
    /// WAL capture: produce calls that found the producer's queue full.
    pub wal_queue_full: AtomicU64,
    /// WAL capture: mark statements run again for rows not yet visible.
    pub mark_retries: AtomicU64,
    /// WAL capture: where each acknowledged row's commit → ack time went.
    pub wal_stages: Stages,
}

/// How many [`Stages`] samples are kept (a ring: the newest win).
pub const STAGE_SAMPLES: usize = 100_000;

/// Per acknowledged row of WAL capture (replayed rows aside), in µs: the
/// row's `created_at` to its transaction's commit timestamp (from the
/// Begin message), that commit to the session handling the Begin (WAL
/// flush, decoding, sending, and any wait in the replication client's
/// queue or the session's own back-pressure), and that to the broker's
/// acknowledgement as the session saw it (produce, linger, broker,
/// delivery report). A bounded ring of the newest [`STAGE_SAMPLES`], read
/// by the latency benchmark to say which stage the slowest rows spent
/// their time in.
#[derive(Debug, Default)]
pub struct Stages {
    samples: std::sync::Mutex<Vec<[i64; 3]>>,
    next: AtomicU64,
}

impl Stages {
    /// Records one row's three stages (µs).
    pub fn observe(&self, stages: [i64; 3]) {
        let mut s = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        if s.len() < STAGE_SAMPLES {
            s.push(stages);
        } else {
            let at = self.next.fetch_add(1, Ordering::Relaxed) as usize % STAGE_SAMPLES;
            s[at] = stages;
        }
    }

    fn reset(&self) {
        self.samples.lock().unwrap_or_else(|p| p.into_inner()).clear();
        self.next.store(0, Ordering::Relaxed);
    }

    /// One line: commit → ack's p50 / p99 (ms), each stage's, and the mean
    /// of each stage over the slowest 1 % of rows by their sum; empty
    /// without samples.
    pub fn summary(&self) -> String {
        let s = self.samples.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if s.is_empty() {
            return String::new();
        }
        let quantile = |mut v: Vec<i64>, q: f64| {
            v.sort_unstable();
            v[((v.len() - 1) as f64 * q) as usize] as f64 / 1000.0
        };
        let q = |i: usize, q: f64| quantile(s.iter().map(|x| x[i]).collect(), q);
        let from_commit = |q: f64| quantile(s.iter().map(|x| x[1] + x[2]).collect(), q);
        let mut by_total = s.clone();
        by_total.sort_unstable_by_key(|x| std::cmp::Reverse(x[0] + x[1] + x[2]));
        let tail = &by_total[..(by_total.len() / 100).max(1)];
        let mean = |i: usize| tail.iter().map(|x| x[i]).sum::<i64>() as f64 / tail.len() as f64 / 1000.0;
        format!(
            "from the commit {:.1} / {:.1} ms; insert → commit {:.1} / {:.1} ms, commit → received {:.1} / {:.1} ms, received → ack {:.1} / {:.1} ms \
             (p50 / p99); the slowest 1 % ({} rows) spent {:.1} + {:.1} + {:.1} ms on average",
            from_commit(0.5),
            from_commit(0.99),
            q(0, 0.5),
            q(0, 0.99),
            q(1, 0.5),
            q(1, 0.99),
            q(2, 0.5),
            q(2, 0.99),
            tail.len(),
            mean(0),
            mean(1),
            mean(2),
        )
    }
}

impl Timings {
    /// Adds `d` to `ns` and one to `count`.
    pub fn add(count: &AtomicU64, ns: &AtomicU64, d: std::time::Duration) {
        count.fetch_add(1, Ordering::Relaxed);
        ns.fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Forgets every count and time (after a benchmark's warm-up, beside
    /// [`Metrics::reset_latency`](super::Metrics::reset_latency), so both describe the same window).
    pub fn reset(&self) {
        let Timings {
            reads,
            read_ns,
            rows_read,
            prefetched,
            full_reads,
            batches,
            batch_ns,
            marks,
            mark_ns,
            idles,
            idle_ns,
            wal_events,
            wal_wait_ns,
            wal_hand_waits,
            wal_hand_wait_ns,
            wal_acked,
            wal_queue_full,
            mark_retries,
            wal_stages,
        } = self;
        wal_stages.reset();
        for a in [
            reads,
            read_ns,
            rows_read,
            prefetched,
            full_reads,
            batches,
            batch_ns,
            marks,
            mark_ns,
            idles,
            idle_ns,
            wal_events,
            wal_wait_ns,
            wal_hand_waits,
            wal_hand_wait_ns,
            wal_acked,
            wal_queue_full,
            mark_retries,
        ] {
            a.store(0, Ordering::Relaxed);
        }
    }

    /// One line: counts and mean/total times.
    pub fn summary(&self) -> String {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let ms = |a: &AtomicU64| g(a) as f64 / 1e6;
        let per = |ns: &AtomicU64, n: &AtomicU64| if g(n) == 0 { 0.0 } else { ms(ns) / g(n) as f64 };
        format!(
            "reads {} ({} full, {} prefetched, {} rows, {:.0} ms on the lane path, {:.2} ms each); \
             batches {} ({:.0} ms, {:.2} ms each); marks {} ({:.0} ms, {:.2} ms each, {} for rows not yet visible); \
             idle waits {} ({:.0} ms); wal events {} ({:.0} ms waited for); waits for the marker {} ({:.0} ms); \
             producer queue full {}",
            g(&self.reads),
            g(&self.full_reads),
            g(&self.prefetched),
            g(&self.rows_read),
            ms(&self.read_ns),
            per(&self.read_ns, &self.reads),
            g(&self.batches),
            ms(&self.batch_ns),
            per(&self.batch_ns, &self.batches),
            g(&self.marks),
            ms(&self.mark_ns),
            per(&self.mark_ns, &self.marks),
            g(&self.mark_retries),
            g(&self.idles),
            ms(&self.idle_ns),
            g(&self.wal_events),
            ms(&self.wal_wait_ns),
            g(&self.wal_hand_waits),
            ms(&self.wal_hand_wait_ns),
            g(&self.wal_queue_full),
        )
    }
}
