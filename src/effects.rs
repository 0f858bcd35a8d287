//! The effect ledger, keyed by `(tenant, run_id, step, operation)`: reserve
//! before an external call, record its outcome after, and reconcile anything a
//! previous generation left `reserved` or `unknown` before the step repeats.
//! Every write is fenced by the caller's lease, so a stale worker writes nothing.

use uuid::Uuid;

use crate::error::{Error, Result};
use crate::jobs::{Jobs, Lease};
use crate::store::{on_conn, Conn};
use crate::{Ferry, Role};

/// Where an effect stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EffectState {
    /// About to call, or calling, the provider.
    Reserved,
    /// The provider confirmed it; `provider_ref` says where.
    Succeeded,
    /// The provider definitively refused it; it may be tried again.
    Failed,
    /// The call's outcome is not known (timeout, crash, ambiguous error).
    Unknown,
}

impl EffectState {
    fn as_str(self) -> &'static str {
        match self {
            EffectState::Reserved => "reserved",
            EffectState::Succeeded => "succeeded",
            EffectState::Failed => "failed",
            EffectState::Unknown => "unknown",
        }
    }

    fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "reserved" => EffectState::Reserved,
            "succeeded" => EffectState::Succeeded,
            "failed" => EffectState::Failed,
            "unknown" => EffectState::Unknown,
            other => {
                return Err(Error::CorruptRow {
                    what: "effects.state",
                    value: other.into(),
                })
            }
        })
    }
}

/// A ledger entry.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct EffectRecord {
    /// Run.
    pub run_id: Uuid,
    /// Step of the handler.
    pub step: String,
    /// The external operation.
    pub operation: String,
    /// State.
    pub state: EffectState,
    /// The provider's reference (charge id, message id, ...).
    pub provider_ref: Option<String>,
    /// Lease generation that last wrote it.
    pub generation: i64,
    /// Safe error code of a failure.
    pub error_code: Option<String>,
}

#[derive(sqlx::FromRow)]
struct EffectRow {
    step: String,
    operation: String,
    state: String,
    provider_ref: Option<String>,
    generation: i64,
    error_code: Option<String>,
}

/// The answer to [`Jobs::reserve_effect`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reservation {
    /// Reserved for this generation: make the external call now.
    Proceed(EffectRecord),
    /// Already succeeded earlier: do not call again; use `provider_ref`.
    AlreadyDone(EffectRecord),
    /// An earlier generation left it `reserved` or `unknown`: call
    /// [`Jobs::reconcile_effect`] before anything else.
    NeedsReconcile(EffectRecord),
}

/// What a reconcile function found out at the provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolution {
    /// The effect happened.
    Succeeded {
        /// The provider's reference.
        provider_ref: String,
    },
    /// The provider refused it definitively.
    Failed {
        /// Safe error code.
        code: String,
    },
    /// It did not happen: it may be made now.
    NotApplied,
}

impl Jobs<'_> {
    /// Reserves `(step, operation)` under `lease` before an external call.
    /// Returns the existing record when there is one.
    pub async fn reserve_effect(&self, lease: &Lease, step: &str, operation: &str) -> Result<Reservation> {
        self.limits().name("step", step)?;
        self.limits().name("operation", operation)?;
        let mut tx = self.begin().await?;
        let r = async {
            let (now, _) = self.lock_fence(tx.conn(), lease).await?;
            let inserted: Option<String> = on_conn!(tx.conn(), |c, q| {
                sqlx::query_scalar(q.reserve_effect)
                    .bind(&lease.tenant)
                    .bind(lease.run_id)
                    .bind(step)
                    .bind(operation)
                    .bind(lease.generation)
                    .bind(now)
                    .fetch_optional(&mut *c)
                    .await?
            });
            let record = get_effect(tx.conn(), &lease.tenant, lease.run_id, step, operation).await?;
            if inserted.is_some() {
                return Ok(Reservation::Proceed(record));
            }
            Ok(match record.state {
                EffectState::Succeeded => Reservation::AlreadyDone(record),
                EffectState::Reserved if record.generation == lease.generation => Reservation::Proceed(record),
                EffectState::Reserved | EffectState::Unknown => Reservation::NeedsReconcile(record),
                EffectState::Failed => {
                    update_effect(
                        tx.conn(),
                        lease,
                        step,
                        operation,
                        EffectState::Reserved,
                        None,
                        None,
                        now,
                    )
                    .await?;
                    Reservation::Proceed(get_effect(tx.conn(), &lease.tenant, lease.run_id, step, operation).await?)
                }
            })
        }
        .await;
        tx.finish(r).await
    }

    /// Records that the external call succeeded with `provider_ref`.
    pub async fn record_effect_success(
        &self,
        lease: &Lease,
        step: &str,
        operation: &str,
        provider_ref: &str,
    ) -> Result<EffectRecord> {
        self.close_effect(lease, step, operation, EffectState::Succeeded, Some(provider_ref), None)
            .await
    }

    /// Records that the external call failed: `ambiguous` when its outcome is
    /// not known (the record becomes `unknown` and must be reconciled).
    pub async fn record_effect_failure(
        &self,
        lease: &Lease,
        step: &str,
        operation: &str,
        code: &str,
        ambiguous: bool,
    ) -> Result<EffectRecord> {
        self.limits().name("error code", code)?;
        let state = if ambiguous {
            EffectState::Unknown
        } else {
            EffectState::Failed
        };
        self.close_effect(lease, step, operation, state, None, Some(code)).await
    }

    /// Resolves a record an earlier generation left unresolved, with what
    /// `resolution` (from the caller's reconcile function, run outside any
    /// transaction) found at the provider. Returns the reservation to act on.
    pub async fn reconcile_effect(
        &self,
        lease: &Lease,
        step: &str,
        operation: &str,
        resolution: Resolution,
    ) -> Result<Reservation> {
        let record = match resolution {
            Resolution::Succeeded { provider_ref } => {
                return Ok(Reservation::AlreadyDone(
                    self.close_effect(
                        lease,
                        step,
                        operation,
                        EffectState::Succeeded,
                        Some(&provider_ref),
                        None,
                    )
                    .await?,
                ))
            }
            Resolution::Failed { code } => self.record_effect_failure(lease, step, operation, &code, false).await?,
            Resolution::NotApplied => {
                self.close_effect(lease, step, operation, EffectState::Reserved, None, None)
                    .await?
            }
        };
        Ok(Reservation::Proceed(record))
    }

    async fn close_effect(
        &self,
        lease: &Lease,
        step: &str,
        operation: &str,
        state: EffectState,
        provider_ref: Option<&str>,
        code: Option<&str>,
    ) -> Result<EffectRecord> {
        if let Some(r) = provider_ref {
            if r.is_empty() || r.len() > self.limits().max_key_bytes {
                return Err(Error::invalid(
                    "provider_ref",
                    format!("must be 1 to {} bytes", self.limits().max_key_bytes),
                ));
            }
            self.limits().no_nul("provider_ref", r)?;
        }
        let mut tx = self.begin().await?;
        let r = async {
            let (now, _) = self.lock_fence(tx.conn(), lease).await?;
            let changed = update_effect(tx.conn(), lease, step, operation, state, provider_ref, code, now).await?;
            if changed == 0 {
                return Err(Error::NotFound { what: "effect" });
            }
            get_effect(tx.conn(), &lease.tenant, lease.run_id, step, operation).await
        }
        .await;
        tx.finish(r).await
    }
}

impl Ferry {
    /// Reads a record (no fence: reads are harmless).
    pub async fn get_effect(&self, tenant: &str, run_id: Uuid, step: &str, operation: &str) -> Result<EffectRecord> {
        let mut c = self.db().acquire().await?;
        get_effect(c.conn(), tenant, run_id, step, operation).await
    }
}

/// A run's ledger entries in the order they were reserved (lineage).
pub(crate) async fn list_effects_in(conn: Conn<'_>, tenant: &str, run_id: Uuid) -> Result<Vec<EffectRecord>> {
    let rows: Vec<EffectRow> = on_conn!(conn, |c, q| {
        sqlx::query_as(q.list_effects)
            .bind(tenant)
            .bind(run_id)
            .fetch_all(&mut *c)
            .await?
    });
    rows.into_iter().map(|row| row.into_record(run_id)).collect()
}

impl EffectRow {
    fn into_record(self, run_id: Uuid) -> Result<EffectRecord> {
        Ok(EffectRecord {
            run_id,
            step: self.step,
            operation: self.operation,
            state: EffectState::parse(&self.state)?,
            provider_ref: self.provider_ref,
            generation: self.generation,
            error_code: self.error_code,
        })
    }
}

async fn get_effect(conn: Conn<'_>, tenant: &str, run_id: Uuid, step: &str, operation: &str) -> Result<EffectRecord> {
    let row: Option<EffectRow> = on_conn!(conn, |c, q| {
        sqlx::query_as(q.get_effect)
            .bind(tenant)
            .bind(run_id)
            .bind(step)
            .bind(operation)
            .fetch_optional(&mut *c)
            .await?
    });
    row.ok_or(Error::NotFound { what: "effect" })?.into_record(run_id)
}

#[allow(clippy::too_many_arguments)]
async fn update_effect(
    conn: Conn<'_>,
    lease: &Lease,
    step: &str,
    operation: &str,
    state: EffectState,
    provider_ref: Option<&str>,
    code: Option<&str>,
    now: i64,
) -> Result<u64> {
    let done = on_conn!(conn, |c, q| {
        sqlx::query(q.update_effect)
            .bind(&lease.tenant)
            .bind(lease.run_id)
            .bind(step)
            .bind(operation)
            .bind(state.as_str())
            .bind(provider_ref)
            .bind(code)
            .bind(lease.generation)
            .bind(now)
            .execute(&mut *c)
            .await?
            .rows_affected()
    });
    Ok(done)
}
