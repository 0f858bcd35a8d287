-- The transactional outbox, written by services.

-- name: outbox_lanes
SELECT value FROM ferry_settings WHERE name = 'outbox_lanes'

-- name: insert_outbox
INSERT INTO outbox (tenant, topic, key, lane, payload, headers, effect_key, traceparent, created_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, {now $9})
RETURNING id

-- name: insert_outbox_key_locked [postgres]
-- insert_outbox behind a transaction-scoped advisory lock on (topic, key),
-- taken before the id is drawn: a second writer of the key waits here, before
-- nextval, until the first commits or rolls back, so one key's ids follow
-- its commit order. Topics cannot contain '/', so `topic/key` is injective; a
-- hash collision between two keys only makes them wait for each other.
WITH key_lock AS MATERIALIZED (
    SELECT pg_advisory_xact_lock(hashtextextended($2::text || '/' || $3::text, 0))
)
INSERT INTO outbox (tenant, topic, key, lane, payload, headers, effect_key, traceparent, created_at)
SELECT $1, $2, $3, $4, $5, $6, $7, $8, {now $9}
FROM key_lock
RETURNING id

-- name: insert_outbox_key_locked [sqlite]
-- The same as insert_outbox: SQLite writers already serialize (every write
-- transaction begins IMMEDIATE and holds the database's write lock until it
-- commits), so ids of one key always follow commit order.
INSERT INTO outbox (tenant, topic, key, lane, payload, headers, effect_key, traceparent, created_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, {now $9})
RETURNING id

-- name: notify_work [postgres only]
SELECT pg_notify($1, $2)

-- name: notify_work_many [postgres only]
-- notify_work for several payloads ($2) in one statement: a batch's wake-ups.
SELECT pg_notify($1, p) FROM UNNEST($2::text[]) AS p

-- name: list_outbox_of_key
-- A run's outbox rows with their delivery state: its events' rows are keyed
-- by the run id ($2, as text), and so are a service's own rows keyed by it
-- (outbox_tenant_key_idx). No payloads. The state and delivered_at read
-- through the delivered-ranges ledger (sql/outbox_delivered.sql): a row a
-- range covers was delivered at the range's delivered_at, and reads
-- delivered unless it is dead.
SELECT o.id, o.topic, o.key, o.effect_key,
       CASE WHEN o.state = 'pending' AND {use outbox_covered} THEN 'delivered' ELSE o.state END AS state,
       o.publish_attempts, o.last_error, o.created_at,
       COALESCE(o.delivered_at,
                CASE WHEN {use outbox_covered}
                     THEN (SELECT d.delivered_at FROM outbox_delivered d WHERE d.lo <= o.id ORDER BY d.lo DESC LIMIT 1) END)
           AS delivered_at
FROM outbox o
WHERE o.tenant = $1 AND o.key = $2
ORDER BY o.id
