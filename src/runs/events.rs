//! Reading runs and appending events: every event is written with the
//! outbox row that carries it, in the caller's transaction (no outbox row
//! when the run's queue has `publish_events` off, see `Operator::set_queue_publish_events`).

use serde_json::Value;
use sqlx::types::Json;
use uuid::Uuid;

use super::*;
use crate::error::{violated_constraint, Error, Result};
use crate::jobs::Jobs;
use crate::outbox::{self, OutboxMessage};
use crate::store::{on_conn, on_pool, Conn};
use crate::{Ferry, Role};

impl Ferry {
    /// The run, if it belongs to `tenant`.
    pub async fn get_run(&self, tenant: &str, run_id: Uuid) -> Result<Run> {
        let row: Option<RunRow> = on_pool!(self.db(), |p, q| {
            sqlx::query_as(q.get_run)
                .bind(tenant)
                .bind(run_id)
                .fetch_optional(p)
                .await?
        });
        row.ok_or(Error::NotFound { what: "run" })?.try_into()
    }

    /// The run's events in seq order (empty for another tenant's run).
    pub async fn list_events(&self, tenant: &str, run_id: Uuid) -> Result<Vec<RunEvent>> {
        Ok(on_pool!(self.db(), |p, q| {
            sqlx::query_as(q.list_events)
                .bind(tenant)
                .bind(run_id)
                .fetch_all(p)
                .await?
        }))
    }

    /// Appends a service's own event to a run, with its outbox row, inside the
    /// caller's transaction. Seqs stay unique and gap-free under concurrent
    /// appends (the run row is locked while the seq is allocated). Terminal
    /// kinds are reserved for Ferry's transitions.
    pub async fn append_event_in<'c>(
        &self,
        conn: impl Into<Conn<'c>>,
        tenant: &str,
        run_id: Uuid,
        kind: &str,
        body: &Value,
    ) -> Result<i64> {
        let mut conn: Conn<'c> = conn.into().routed(self.db());
        self.limits().tenant(tenant)?;
        self.limits().name("kind", kind)?;
        if TERMINAL_KINDS.contains(&kind) || kind == "run_queued" {
            return Err(Error::invalid("kind", "run_* kinds are reserved for Ferry"));
        }
        self.limits().json("body", body)?;
        let next: Option<(i64, i64)> = on_conn!(conn.reborrow(), |c, q| {
            sqlx::query_as(q.next_event_seq)
                .bind(tenant)
                .bind(run_id)
                .bind(self.now())
                .fetch_optional(&mut *c)
                .await?
        });
        let (seq, now) = next.ok_or(Error::NotFound { what: "run" })?;
        let event = Event {
            tenant,
            run_id,
            seq,
            kind,
            body,
            at: now,
            traceparent: None,
        };
        write_event(self, conn, event).await?;
        Ok(seq)
    }

    /// Appends an event in its own transaction.
    pub async fn append_event(&self, tenant: &str, run_id: Uuid, kind: &str, body: &Value) -> Result<i64> {
        let mut tx = self.begin().await?;
        let result = self.append_event_in(tx.conn(), tenant, run_id, kind, body).await;
        tx.finish(result).await
    }
}

impl Jobs<'_> {
    /// Deletes up to `batch` expired idempotency records; returns how many.
    /// Call it until it returns less than `batch`.
    pub async fn sweep_idempotency_keys(&self, batch: u32) -> Result<u64> {
        let done = on_pool!(self.db(), |p, q| {
            sqlx::query(q.sweep_idempotency_keys)
                .bind(self.now())
                .bind(i64::from(batch))
                .execute(p)
                .await?
                .rows_affected()
        });
        Ok(done)
    }
}

pub(crate) async fn get_run_in(conn: Conn<'_>, tenant: &str, run_id: Uuid) -> Result<Run> {
    let row: Option<RunRow> = on_conn!(conn, |c, q| {
        sqlx::query_as(q.get_run)
            .bind(tenant)
            .bind(run_id)
            .fetch_optional(&mut *c)
            .await?
    });
    row.ok_or(Error::NotFound { what: "run" })?.try_into()
}

/// The value of a run event's Kafka record: the event's envelope around its
/// body (sized in [`crate::Limits::run_event_overhead`]). Fields are declared
/// in byte order of their names, the order a JSON object map serializes in
/// by default, and written straight from borrowed data: no `Value` is built.
#[derive(serde::Serialize)]
struct EventEnvelope<'a, B> {
    at: i64,
    body: &'a B,
    kind: &'a str,
    run_id: Uuid,
    seq: i64,
    tenant: &'a str,
}

/// The serialized envelope of event `seq` (see [`EventEnvelope`]).
pub(crate) fn event_payload<B: serde::Serialize>(
    tenant: &str,
    run_id: Uuid,
    seq: i64,
    kind: &str,
    at: i64,
    body: &B,
) -> Result<Vec<u8>> {
    let envelope = EventEnvelope {
        at,
        body,
        kind,
        run_id,
        seq,
        tenant,
    };
    serde_json::to_vec(&envelope).map_err(|e| Error::invalid("body", e.to_string()))
}

/// The outbox message that carries event `seq` of a run: its envelope as
/// JSON, keyed by the run id, deduped on `tenant/run_id/seq`. The bulk
/// acceptance builds its rows with this too, so both paths write the same bytes.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_event_message<B: serde::Serialize>(
    ferry: &Ferry,
    tenant: &str,
    run_id: Uuid,
    seq: i64,
    kind: &str,
    body: &B,
    now: i64,
    traceparent: Option<String>,
) -> Result<OutboxMessage> {
    Ok(OutboxMessage {
        tenant: tenant.to_owned(),
        topic: ferry.inner.events_topic.clone(),
        key: run_id.to_string(),
        payload: event_payload(tenant, run_id, seq, kind, now, body)?,
        headers: [
            ("content-type".to_owned(), "application/json".to_owned()),
            ("ferry-event-kind".to_owned(), kind.to_owned()),
        ]
        .into(),
        effect_key: Some(format!("{tenant}/{run_id}/{seq}")),
        traceparent,
    })
}

/// One run event to write: which run, its sequence number, kind and body,
/// the instant, and the trace context its outbox row carries.
pub(crate) struct Event<'a, B = Value> {
    pub(crate) tenant: &'a str,
    pub(crate) run_id: Uuid,
    pub(crate) seq: i64,
    pub(crate) kind: &'a str,
    pub(crate) body: &'a B,
    pub(crate) at: i64,
    pub(crate) traceparent: Option<String>,
}

/// Writes event `seq` of a run and the outbox row that carries it, unless
/// the run's queue has `publish_events` off as this write finds it (the
/// run's job must exist). The effect key `tenant/run_id/seq` lets consumers
/// dedupe re-published events.
pub(crate) async fn write_event<B: serde::Serialize + Sync>(
    ferry: &Ferry,
    mut conn: Conn<'_>,
    event: Event<'_, B>,
) -> Result<()> {
    let Event {
        tenant,
        run_id,
        seq,
        kind,
        body,
        at: now,
        traceparent,
    } = event;
    let inserted: std::result::Result<bool, sqlx::Error> = on_conn!(conn.reborrow(), |c, q| {
        sqlx::query_scalar(q.insert_event)
            .bind(tenant)
            .bind(run_id)
            .bind(seq)
            .bind(kind)
            .bind(Json(body))
            .bind(now)
            .fetch_one(&mut *c)
            .await
    });
    let publish = inserted.map_err(|e| match violated_constraint(&e).as_deref() {
        Some("run_events_one_terminal_idx") => Error::RunTerminal {
            run_id,
            state: "terminal".into(),
        },
        _ => e.into(),
    })?;
    if !publish {
        // The run's queue has publish_events off: the event is history only.
        return Ok(());
    }
    let msg = run_event_message(ferry, tenant, run_id, seq, kind, body, now, traceparent)?;
    // No key lock: every writer of a run's events holds the run's row.
    outbox::insert(ferry, conn, &msg, Some(now), false).await?;
    Ok(())
}
