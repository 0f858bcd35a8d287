-- The transactional outbox, written by services (SQLite).

-- name: outbox_lanes
SELECT value FROM ferry_settings WHERE name = 'outbox_lanes'

-- name: insert_outbox
INSERT INTO outbox (tenant, topic, key, lane, payload, headers, effect_key, traceparent, created_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, COALESCE($9, CAST(unixepoch('subsec') * 1000 AS INTEGER)))
RETURNING id

-- name: insert_outbox_key_locked
-- The same as insert_outbox: SQLite writers already serialize (every write
-- transaction begins IMMEDIATE and holds the database's write lock until it
-- commits), so ids of one key always follow commit order.
INSERT INTO outbox (tenant, topic, key, lane, payload, headers, effect_key, traceparent, created_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, COALESCE($9, CAST(unixepoch('subsec') * 1000 AS INTEGER)))
RETURNING id
