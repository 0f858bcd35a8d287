//! Exactly once, on taking the lane: the lane's transactional producer
//! fences every earlier producer of its `transactional.id`, and the ids of
//! the lane's last committed transaction (read from the progress topic) are
//! marked before anything is published. Every lane task takes its lane
//! over by itself, so a relay takes all its lanes at once.

use std::sync::Arc;
use std::time::Instant;

use prometheus_client::metrics::gauge::Gauge;
use rdkafka::producer::FutureProducer;
use tokio_util::sync::CancellationToken;

use super::BatchEnd;
use crate::config::RelayConfig;
use crate::error::RelayError;
use crate::exactly_once::{self, Progress, ProgressReader};
use crate::state::RelayState;
use crate::store::LaneLease;

/// Exactly once, on taking the lane: fence earlier producers of the lane's
/// `transactional.id`, then mark the ids of the lane's last committed
/// transaction before anything is published. The progress read may wait
/// for another producer's open transaction; it stops as soon as the lane is
/// lost (`abort`) or the relay shuts down (`finish`), since nothing of the
/// lane is in flight yet.
pub(super) async fn take_over(
    state: &RelayState,
    cfg: &Arc<RelayConfig>,
    reader: &Arc<ProgressReader>,
    database_id: &Arc<str>,
    lease: LaneLease,
    finish: &CancellationToken,
    abort: &CancellationToken,
) -> Result<FutureProducer, BatchEnd> {
    let started = Instant::now();
    let _counted = TakingOver::new(&state.metrics.lanes_taking_over);
    let lane = lease.lane;
    let (done, taken) = tokio::sync::oneshot::channel();
    let (c, r, db) = (cfg.clone(), reader.clone(), database_id.clone());
    tokio::task::spawn_blocking(move || {
        let result = match exactly_once::lane_producer(&c, lane) {
            // The read gives up once this task stopped waiting for it.
            Ok(p) => r
                .read(&db, lane, || done.is_closed())
                .map(|progress| (p, progress))
                .map_err(|e| ("progress_read", e)),
            Err(e) => Err(("init_transactions", RelayError::from(e))),
        };
        let _ = done.send(result);
    });
    let (producer, progress) = tokio::select! {
        r = taken => match r {
            Ok(Ok(v)) => v,
            Ok(Err((code, e))) => {
                tracing::warn!(lane, code, error = %e, "taking the lane over failed");
                return Err(BatchEnd::Stalled { id: 0, code });
            }
            Err(_) => {
                tracing::warn!(lane, "taking the lane over panicked");
                return Err(BatchEnd::Stalled { id: 0, code: "init_transactions" });
            }
        },
        _ = abort.cancelled() => return Err(BatchEnd::Lost),
        _ = finish.cancelled() => return Err(BatchEnd::Lost),
    };
    if let Some(p) = progress {
        mark_previous(state, cfg, lease, &p).await?;
    }
    tracing::info!(
        lane,
        transactional_id = %cfg.transactional_id(lane),
        took_ms = started.elapsed().as_millis() as u64,
        "lane producer fenced its predecessors"
    );
    Ok(producer)
}

/// Counts a lane in `lanes_taking_over` from the start of its takeover to
/// its end, however it ends.
struct TakingOver<'a>(&'a Gauge);

impl<'a> TakingOver<'a> {
    fn new(gauge: &'a Gauge) -> Self {
        gauge.inc();
        TakingOver(gauge)
    }
}

impl Drop for TakingOver<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Marks the ids of the previous owner's last committed transaction, fenced
/// by this lease's generation.
async fn mark_previous(
    state: &RelayState,
    cfg: &RelayConfig,
    lease: LaneLease,
    progress: &Progress,
) -> Result<(), BatchEnd> {
    let lane = lease.lane;
    match state
        .store
        .mark_delivered(&state.owner, lease, &progress.ids, cfg.delete_on_delivery)
        .await
    {
        Ok(n) => {
            if n > 0 {
                tracing::info!(
                    lane,
                    marked = n,
                    "marked the last committed transaction of the previous owner"
                );
            }
            Ok(())
        }
        Err(ferry::Error::LostLane { .. }) => Err(BatchEnd::Lost),
        Err(e) => {
            tracing::warn!(lane, error = %e, "marking the lane's last transaction failed");
            Err(BatchEnd::Stalled {
                id: 0,
                code: "mark_delivered",
            })
        }
    }
}
