//! The operator audit trail (`ferry_audit`): every operator action (cancel,
//! replay, pause) is written in the same transaction as the action itself.

use crate::store::{on_conn, Conn};
use crate::{Operator, Result, Role};

impl Operator<'_> {
    /// Appends an operator action to `ferry_audit` inside the caller's
    /// transaction, naming the actor, the action, its subject and the reason.
    pub async fn audit_in<'c>(
        &self,
        conn: impl Into<Conn<'c>>,
        actor: &str,
        action: &str,
        subject: &str,
        reason: &str,
    ) -> Result<()> {
        let conn: Conn<'c> = conn.into().routed(self.db());
        on_conn!(conn, |c, q| {
            sqlx::query(q.insert_audit)
                .bind(self.now())
                .bind(actor)
                .bind(action)
                .bind(subject)
                .bind(reason)
                .execute(&mut *c)
                .await?;
        });
        Ok(())
    }
}
