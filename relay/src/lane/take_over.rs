//! Exactly once, on taking the lane: the lane's transactional producer
//! fences every earlier producer of its `transactional.id`, and the ids of
//! the lane's last committed transaction (read from the progress topic) are
//! marked before anything is published.

use std::sync::Arc;

use rdkafka::producer::FutureProducer;
use tokio_util::sync::CancellationToken;

use super::BatchEnd;
use crate::config::RelayConfig;
use crate::error::RelayError;
use crate::exactly_once::{self, Progress, ProgressReader};
use crate::service::RelayState;
use crate::store::LaneLease;

/// Exactly once, on taking the lane: fence earlier producers of the lane's
/// `transactional.id`, then mark the ids of the lane's last committed
/// transaction before anything is published.
pub(super) async fn take_over(
    state: &RelayState,
    cfg: &Arc<RelayConfig>,
    reader: &Arc<ProgressReader>,
    database_id: &Arc<str>,
    lease: LaneLease,
    abort: &CancellationToken,
) -> Result<FutureProducer, BatchEnd> {
    let (c, r, db) = (cfg.clone(), reader.clone(), database_id.clone());
    let lane = lease.lane;
    let init = tokio::task::spawn_blocking(move || {
        let p = exactly_once::lane_producer(&c, lane).map_err(RelayError::from)?;
        let progress = r.read(&db, lane)?;
        Ok::<_, RelayError>((p, progress))
    });
    let (producer, progress) = tokio::select! {
        r = init => match r {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => {
                tracing::warn!(lane, error = %e, "taking the lane's transactional producer failed");
                return Err(BatchEnd::Stalled { id: 0, code: "init_transactions" });
            }
            Err(e) => {
                tracing::warn!(lane, error = %e, "taking the lane's transactional producer panicked");
                return Err(BatchEnd::Stalled { id: 0, code: "init_transactions" });
            }
        },
        _ = abort.cancelled() => return Err(BatchEnd::Lost),
    };
    if let Some(p) = progress {
        mark_previous(state, cfg, lease, &p).await?;
    }
    tracing::info!(lane, transactional_id = %cfg.transactional_id(lane), "lane producer fenced its predecessors");
    Ok(producer)
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
