//! Poison rows: records Kafka will never accept. A produce request holding
//! several rows is refused whole, so a refusal only names a row when it was
//! alone; otherwise the batch stops with [`BatchEnd::Isolate`] and the lane
//! loop publishes the rows one at a time until the poison row is found.
//! Nothing is marked dead on a guess. A row known to be poison is marked
//! dead (`--on-poison=dead`, the default) or blocks the lane
//! (`--on-poison=block`).

use super::BatchEnd;
use crate::config::{OnPoison, RelayConfig};
use crate::service::RelayState;
use crate::store::{LaneLease, PendingRow};

/// At least once: `row`'s record was refused as poison with `code` (already
/// counted). `alone`: the refusal is certainly this row's. `Some` stops the
/// batch.
pub(super) async fn refused(
    state: &RelayState,
    cfg: &RelayConfig,
    lease: LaneLease,
    row: &PendingRow,
    code: &'static str,
    alone: bool,
) -> Option<BatchEnd> {
    if !alone {
        return Some(BatchEnd::Isolate {
            through: i64::MAX,
            code,
        });
    }
    if cfg.on_poison == OnPoison::Block {
        tracing::error!(
            lane = lease.lane,
            id = row.id,
            code,
            "poison record blocks the lane (--on-poison=block)"
        );
        return Some(BatchEnd::Stalled { id: row.id, code });
    }
    poison_dead(state, lease, row, code).await
}

/// Exactly once, after the transaction was aborted: the `i`th of `rows` was
/// refused as poison with `code`. `sync_failure`: the client refused it
/// before sending, so the refusal is certainly this row's.
pub(super) async fn refused_in_txn(
    state: &RelayState,
    cfg: &RelayConfig,
    lease: LaneLease,
    rows: &[PendingRow],
    i: usize,
    code: &'static str,
    sync_failure: bool,
) -> BatchEnd {
    // Refused with the rest of its request: find the row first.
    if rows.len() > 1 && !sync_failure {
        return BatchEnd::Isolate {
            through: rows.last().map(|r| r.id).unwrap_or(0),
            code,
        };
    }
    state.metrics.publish_error(code);
    if cfg.on_poison == OnPoison::Dead {
        poison_dead(state, lease, &rows[i], code)
            .await
            .unwrap_or(BatchEnd::Done)
    } else {
        BatchEnd::Stalled { id: rows[i].id, code }
    }
}

/// Marks a poison row dead (logged without its payload); `Some` stops.
pub(super) async fn poison_dead(
    state: &RelayState,
    lease: LaneLease,
    row: &PendingRow,
    code: &'static str,
) -> Option<BatchEnd> {
    tracing::error!(lane = lease.lane, id = row.id, tenant = %row.tenant, topic = %row.topic, code, "record refused by Kafka; marked dead");
    match state.store.mark_dead(&state.owner, lease, row.id, code).await {
        Ok(()) => {
            state.metrics.dead.inc();
            None
        }
        Err(ferry::Error::LostLane { .. }) => Some(BatchEnd::Lost),
        Err(e) => {
            tracing::warn!(error = %e, "marking a poison row dead failed");
            Some(BatchEnd::Stalled {
                id: row.id,
                code: "mark_dead",
            })
        }
    }
}
