//! The outbox as its readers see it since the delivered-ranges ledger:
//! `--capture wal` records delivery as ranges of ids in
//! `outbox_delivered` and leaves the rows `pending`, so a test that asks
//! whether a row is delivered asks through [`OUTBOX`] (the one copy of the
//! readers' predicate in the tests), never `outbox.state` alone.

/// The outbox with each row's effective `state` and `delivered_at`, to put
/// where a statement names the table: `format!("SELECT count(*) FROM
/// {OUTBOX} WHERE state = 'delivered'")`. A row is `delivered` when marked
/// so or when it is `pending` and a ledger range covers it (the range with
/// the greatest `lo <= id`, since ranges never overlap), `pending` when
/// `pending` and not covered, `dead` when dead; its `delivered_at` is its
/// own or its covering range's. The same text runs on both engines.
pub const OUTBOX: &str = "(SELECT o.id, o.tenant, o.topic, o.key, o.lane, o.payload, o.effect_key, \
     o.traceparent, o.created_at, o.publish_attempts, o.last_error, \
     CASE WHEN o.state = 'pending' AND COALESCE((SELECT d.hi FROM outbox_delivered d WHERE d.lo <= o.id \
     ORDER BY d.lo DESC LIMIT 1) >= o.id, false) THEN 'delivered' ELSE o.state END AS state, \
     COALESCE(o.delivered_at, (SELECT CASE WHEN d.hi >= o.id THEN d.delivered_at END FROM outbox_delivered d \
     WHERE d.lo <= o.id ORDER BY d.lo DESC LIMIT 1)) AS delivered_at \
     FROM outbox o) AS outbox";

/// Every outbox row's id and effective state (see [`OUTBOX`]), in id order.
pub async fn outbox_states(pool: &sqlx::PgPool) -> Vec<(i64, String)> {
    sqlx::query_as(&format!("SELECT id, state FROM {OUTBOX} ORDER BY id"))
        .fetch_all(pool)
        .await
        .unwrap_or_else(|e| panic!("reading the outbox's states: {e}"))
}

/// Asserts that row `id` is the only outbox row, reads delivered through
/// the ledger, and was never written by a refusal (no attempt counted, no
/// error kept).
pub async fn assert_delivered_unwritten(pool: &sqlx::PgPool, id: i64) {
    assert_eq!(outbox_states(pool).await, vec![(id, "delivered".to_string())]);
    let (attempts, error): (i32, Option<String>) =
        sqlx::query_as("SELECT publish_attempts, last_error FROM outbox WHERE id = $1")
            .bind(id)
            .fetch_one(pool)
            .await
            .unwrap_or_else(|e| panic!("reading row {id}: {e}"));
    assert_eq!((attempts, error), (0, None), "a delivered row is not written");
}
