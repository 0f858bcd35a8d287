//! The operator's view of the outbox: the pending backlog, dead (poison)
//! rows, and their replay. A replay puts rows back to pending and writes its
//! audit entry in one transaction, and announces itself to WAL capture in
//! that same transaction, since WAL capture streams inserts only; on
//! PostgreSQL it also splits the delivered ranges that cover a replayed row,
//! which would otherwise read delivered and never be published again.

use crate::error::{Error, Result};
use crate::store::queries::POSTGRES_ONLY;
use crate::store::{on_conn, on_pool, Tx};
use crate::time::Millis;
use crate::{Operator, Role};

/// A dead (poison) outbox row, without its payload.
#[derive(Debug, Clone, PartialEq, serde::Serialize, sqlx::FromRow)]
pub struct DeadRow {
    /// Outbox id.
    pub id: i64,
    /// Tenant.
    pub tenant: String,
    /// Topic.
    pub topic: String,
    /// Key.
    pub key: String,
    /// The error code that killed it.
    pub last_error: Option<String>,
    /// Publish attempts.
    pub publish_attempts: i32,
    /// Enqueued at.
    pub created_at: Millis,
}

/// Which dead rows an operator means: every one, or only one id, one
/// tenant's, one error code's (the conditions combine).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeadFilter {
    /// Only this outbox id.
    pub id: Option<i64>,
    /// Only this tenant's rows (a console token scoped to tenants sets it).
    pub tenant: Option<String>,
    /// Only rows dead with this error code (a group on the console).
    pub error_code: Option<String>,
    /// Only rows up to this id (a group as the operator saw it: rows that
    /// die later are not replayed with it).
    pub max_id: Option<i64>,
}

/// Pending backlog.
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::FromRow)]
pub struct Backlog {
    /// Pending rows.
    pub pending: i64,
    /// `created_at` of the oldest pending row (0 when none).
    pub oldest: Millis,
    /// The clock's now.
    pub now: Millis,
}

impl Backlog {
    /// Age of the oldest pending row in ms (0 when none).
    pub fn oldest_age_ms(&self) -> i64 {
        if self.pending == 0 {
            0
        } else {
            (self.now.get() - self.oldest.get()).max(0)
        }
    }
}

impl Operator<'_> {
    /// The pending backlog and the age of its oldest row.
    pub async fn outbox_backlog(&self) -> Result<Backlog> {
        Ok(on_pool!(self.db(), |p, q| {
            sqlx::query_as(q.outbox_backlog).bind(self.now()).fetch_one(p).await?
        }))
    }

    /// How many rows are dead.
    pub async fn outbox_dead_count(&self) -> Result<i64> {
        Ok(on_pool!(self.db(), |p, q| {
            sqlx::query_scalar(q.outbox_dead_count).fetch_one(p).await?
        }))
    }

    /// Dead rows, oldest first, without payloads.
    pub async fn list_dead_outbox(&self, limit: u32) -> Result<Vec<DeadRow>> {
        self.list_dead_outbox_where(&DeadFilter::default(), limit).await
    }

    /// Dead rows matching `filter` (its `id` is ignored), oldest first,
    /// without payloads.
    pub async fn list_dead_outbox_where(&self, filter: &DeadFilter, limit: u32) -> Result<Vec<DeadRow>> {
        Ok(on_pool!(self.db(), |p, q| {
            sqlx::query_as(q.list_dead_outbox)
                .bind(i64::from(limit))
                .bind(filter.tenant.as_deref())
                .bind(filter.error_code.as_deref())
                .fetch_all(p)
                .await?
        }))
    }

    /// Puts dead rows (all, or only `id`) back to pending and writes an audit
    /// entry naming `actor` and `reason`, in one transaction. Returns the ids.
    pub async fn replay_dead_outbox(&self, id: Option<i64>, actor: &str, reason: &str) -> Result<Vec<i64>> {
        let filter = DeadFilter {
            id,
            ..DeadFilter::default()
        };
        self.replay_dead_outbox_where(&filter, actor, reason).await
    }

    /// Puts the dead rows matching `filter` back to pending and writes an
    /// audit entry (`outbox.replay_dead`, the ids as its subject) naming
    /// `actor` and `reason`, in one transaction, which also uncovers the ids
    /// in the delivered-ranges ledger and announces them to WAL capture.
    /// Returns the ids (empty when nothing matched; the audit entry is
    /// written all the same).
    pub async fn replay_dead_outbox_where(&self, filter: &DeadFilter, actor: &str, reason: &str) -> Result<Vec<i64>> {
        self.limits().text("actor", actor, 255)?;
        self.limits().text("reason", reason, 4096)?;
        let mut tx = self.begin().await?;
        let r = async {
            if let Some(mut conn) = tx.pg() {
                sqlx::query(POSTGRES_ONLY.replay_ledger_lock).execute(&mut conn).await?;
            }
            let ids: Vec<i64> = on_conn!(tx.conn(), |c, q| {
                sqlx::query_scalar(q.replay_dead_outbox)
                    .bind(filter.id)
                    .bind(filter.tenant.as_deref())
                    .bind(filter.error_code.as_deref())
                    .bind(filter.max_id)
                    .fetch_all(&mut *c)
                    .await?
            });
            uncover_replayed(&mut tx, &ids).await?;
            announce_replay(&mut tx, &ids).await?;
            let subject = format!("outbox:{}", serde_json::to_string(&ids).unwrap_or_default());
            self.audit_in(tx.conn(), actor, "outbox.replay_dead", &subject, reason)
                .await?;
            Ok(ids)
        }
        .await;
        tx.finish(r).await
    }
}

/// Splits, inside the replay's transaction (under the ledger's lock, taken
/// first), every delivered range covering one of `ids` around them (see
/// `replay_uncover`): a replayed row reads pending, so WAL capture's re-read
/// of the replay publishes it, and the rest of each range still reads
/// delivered. Nothing on SQLite, whose ledger is always empty.
async fn uncover_replayed(tx: &mut Tx, ids: &[i64]) -> Result<()> {
    let Some(mut conn) = tx.pg() else { return Ok(()) };
    if ids.is_empty() {
        return Ok(());
    }
    sqlx::query(POSTGRES_ONLY.replay_uncover)
        .bind(ids)
        .execute(&mut conn)
        .await?;
    Ok(())
}

/// Announces, inside the replay's transaction, that rows `ids` are back to
/// pending (see `wal_announce_replay`): WAL capture streams inserts only, so
/// the relay learns of the replay from this logical message
/// (`ferry.replay.<database id>`, the ids as JSON). Nothing on SQLite or
/// below `wal_level = logical`.
async fn announce_replay(tx: &mut Tx, ids: &[i64]) -> Result<()> {
    let Some(mut conn) = tx.pg() else { return Ok(()) };
    if ids.is_empty() {
        return Ok(());
    }
    let ids = serde_json::to_string(ids).map_err(|e| Error::Invariant(e.to_string()))?;
    sqlx::query(POSTGRES_ONLY.wal_announce_replay)
        .bind(ids)
        .fetch_optional(&mut conn)
        .await?;
    Ok(())
}
