-- The transactional outbox, written by services (SQLite).

-- name: outbox_lanes
SELECT value FROM ferry_settings WHERE name = 'outbox_lanes'

-- name: insert_outbox
INSERT INTO outbox (tenant, topic, key, lane, payload, headers, effect_key, traceparent, created_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, COALESCE($9, CAST(unixepoch('subsec') * 1000 AS INTEGER)))
RETURNING id
