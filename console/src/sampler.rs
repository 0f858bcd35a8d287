//! The overview's time series: a task samples the outbox every few seconds
//! (pending rows, rows delivered since the previous sample) into a bounded
//! in-memory ring. A restart starts an empty ring; nothing is written to the
//! database, so several consoles never contend.
//!
//! Throughput counts rows marked delivered since the last sample that are
//! still in the table: a relay that deletes rows on delivery (`--delete`)
//! shows the backlog only, and so does WAL capture, which records
//! deliveries as ranges of ids (`outbox_delivered`) whose `delivered_at`
//! moves when a range is extended, so a per-interval count of them would
//! count a growing range's rows again. The backlog leaves covered rows out.

use std::collections::VecDeque;
use std::sync::Mutex;

use ferry::Millis;

use crate::store::{ConsoleStore, QueueStateCount};

/// One point of the series.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// When it was taken (the store's clock).
    pub at: Millis,
    /// Pending outbox rows.
    pub pending: i64,
    /// Rows delivered per second since the previous sample (0 for the first).
    pub delivered_per_sec: f64,
}

/// A bounded ring of samples, newest last, and the latest jobs census.
#[derive(Debug)]
pub struct Sampler {
    capacity: usize,
    ring: Mutex<VecDeque<Sample>>,
    census: Mutex<Option<Census>>,
}

/// Every tenant's jobs counted by queue and state, as of an instant.
///
/// Counting a million jobs takes longer than a page may (it reads every
/// row: no index makes an exact count of the finished jobs cheap), so the
/// all-tenants overview shows the census the sampler takes in the
/// background, with its age; a page filtered to one tenant counts live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Census {
    /// When it was taken (the store's clock).
    pub at: Millis,
    /// The counts.
    pub counts: Vec<QueueStateCount>,
}

impl Sampler {
    /// A ring keeping the newest `capacity` samples (at least 2).
    pub fn new(capacity: usize) -> Sampler {
        let capacity = capacity.max(2);
        Sampler {
            capacity,
            ring: Mutex::new(VecDeque::with_capacity(capacity)),
            census: Mutex::new(None),
        }
    }

    /// Counts every tenant's jobs by queue and state and keeps the result.
    pub async fn take_census(&self, store: &ConsoleStore) -> ferry::Result<Census> {
        let (counts, at) = tokio::try_join!(store.jobs_by_queue_state(None), store.now())?;
        let c = Census { at, counts };
        *self.census.lock().unwrap_or_else(|p| p.into_inner()) = Some(c.clone());
        Ok(c)
    }

    /// The latest census, if one was taken.
    pub fn census(&self) -> Option<Census> {
        self.census.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Takes one sample and appends it, dropping the oldest past capacity.
    pub async fn sample(&self, store: &ConsoleStore) -> ferry::Result<Sample> {
        let last = self.latest();
        let since = last.map_or(i64::MAX, |s| s.at.get());
        let r = store.sample_outbox(since).await?;
        let rate = match last {
            Some(l) if r.now.get() > l.at.get() => r.delivered as f64 * 1000.0 / (r.now.get() - l.at.get()) as f64,
            _ => 0.0,
        };
        let s = Sample {
            at: r.now,
            pending: r.pending,
            delivered_per_sec: rate,
        };
        self.push(s);
        Ok(s)
    }

    fn push(&self, s: Sample) {
        let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        if ring.len() == self.capacity {
            ring.pop_front();
        }
        ring.push_back(s);
    }

    /// The newest sample.
    pub fn latest(&self) -> Option<Sample> {
        self.ring.lock().unwrap_or_else(|p| p.into_inner()).back().copied()
    }

    /// Every kept sample, oldest first.
    pub fn series(&self) -> Vec<Sample> {
        self.ring
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .copied()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_keeps_only_the_newest() {
        let s = Sampler::new(3);
        for i in 0..5 {
            s.push(Sample {
                at: Millis::new(i).unwrap(),
                pending: i,
                delivered_per_sec: 0.0,
            });
        }
        let pending: Vec<i64> = s.series().iter().map(|x| x.pending).collect();
        assert_eq!(pending, [2, 3, 4]);
    }
}
