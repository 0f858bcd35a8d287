//! Progressive marks (at least once): acknowledged ids are buffered and
//! marked delivered in one statement fenced by the lane generation, every
//! [`MARK_EVERY`] or [`MARK_ROWS`] acknowledgements.

use std::time::Instant;

use super::{BatchEnd, MARK_EVERY, MARK_ROWS};
use crate::config::RelayConfig;
use crate::state::RelayState;
use crate::store::LaneLease;

/// Acknowledged ids not yet marked, flushed in one fenced statement.
pub(super) struct Marker {
    pub(super) lease: LaneLease,
    ids: Vec<i64>,
    since: Instant,
}

impl Marker {
    pub(super) fn new(lease: LaneLease) -> Self {
        Marker {
            lease,
            ids: Vec::new(),
            since: Instant::now(),
        }
    }

    pub(super) fn push(&mut self, id: i64) {
        if self.ids.is_empty() {
            self.since = Instant::now();
        }
        self.ids.push(id);
    }

    pub(super) fn due(&self) -> bool {
        self.ids.len() >= MARK_ROWS || self.since.elapsed() >= MARK_EVERY
    }

    /// Marks what is buffered; `Some` stops the batch (lane lost, or the
    /// database refused: the rows stay pending and are republished).
    pub(super) async fn flush(&mut self, state: &RelayState, cfg: &RelayConfig) -> Option<BatchEnd> {
        if self.ids.is_empty() {
            return None;
        }
        let first = self.ids[0];
        let started = Instant::now();
        let marked = state
            .store
            .mark_delivered(&state.owner, self.lease, &self.ids, cfg.delete_on_delivery)
            .await;
        let t = &state.metrics.timings;
        crate::metrics::Timings::add(&t.marks, &t.mark_ns, started.elapsed());
        match marked {
            Ok(n) => {
                state.metrics.published.inc_by(n);
                self.ids.clear();
                None
            }
            Err(ferry::Error::LostLane { .. }) => {
                tracing::warn!(lane = self.lease.lane, "lane taken over; its marks were refused");
                Some(BatchEnd::Lost)
            }
            Err(e) => {
                tracing::warn!(lane = self.lease.lane, error = %e, "marking delivered failed; rows will be republished");
                Some(BatchEnd::Stalled {
                    id: first,
                    code: "mark_delivered",
                })
            }
        }
    }
}
