//! The operator's handle, [`Operator`] (`ferry.operator()`), and its
//! actions with their audit entry: each runs the action and appends to
//! `ferry_audit` (actor, action, subject, reason) in one transaction, so an
//! action that happened is always audited and an audited action always
//! happened. The `ferry` command line and the web console both call these.
//! `outbox` holds the dead rows and their replay, `relays` the relays'
//! state and the status report; the job, queue, run and schedule calls are
//! beside their domain.

mod outbox;
mod relays;

use uuid::Uuid;

use crate::runs::Accepted;
use crate::{Ferry, Result, Role};

pub use outbox::{Backlog, DeadFilter, DeadRow};
pub use relays::{CaptureState, LaneOwner, LiveRelay, WalFailover, WalSlot};

/// The operator calls, from [`Ferry::operator`]: dead jobs and their replay,
/// cancel with its audit entry, queue pauses and limits, run listing and
/// lineage, schedule administration and the audit trail. The `ferry` command
/// line and the console call it. It borrows the `Ferry`, so it costs nothing
/// to make.
#[derive(Debug, Clone, Copy)]
pub struct Operator<'a> {
    pub(crate) ferry: &'a Ferry,
}

impl Operator<'_> {
    /// Cancels a run ([`Ferry::cancel_in`], no version check) and audits it as
    /// `jobs.cancel` on `<tenant>/<run id>`, in one transaction.
    pub async fn cancel_audited(&self, tenant: &str, run_id: Uuid, actor: &str, reason: &str) -> Result<()> {
        let mut tx = self.begin().await?;
        let r = async {
            self.ferry
                .cancel_in(tx.conn(), tenant, run_id, None, actor, reason)
                .await?;
            self.audit_in(tx.conn(), actor, "jobs.cancel", &format!("{tenant}/{run_id}"), reason)
                .await
        }
        .await;
        tx.finish(r).await
    }

    /// Replays a dead run as a new linked run ([`Operator::replay_dead_in`]) and
    /// audits it as `jobs.replay_dead` on `<tenant>/<run id>`, in one
    /// transaction.
    pub async fn replay_dead_audited(
        &self,
        tenant: &str,
        run_id: Uuid,
        actor: &str,
        reason: &str,
        force: bool,
    ) -> Result<Accepted> {
        let mut tx = self.begin().await?;
        let r = async {
            let accepted = self
                .replay_dead_in(tx.conn(), tenant, run_id, actor, reason, force)
                .await?;
            self.audit_in(
                tx.conn(),
                actor,
                "jobs.replay_dead",
                &format!("{tenant}/{run_id}"),
                reason,
            )
            .await?;
            Ok(accepted)
        }
        .await;
        tx.finish(r).await
    }
}
