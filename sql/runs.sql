-- Runs, run events and idempotency records.
-- `$now` parameters are NULL in production (the database clock) or an injected instant.

-- name: claim_idempotency_key
-- Inserts the record, or takes over an expired one. Returns nothing when a live
-- record exists; a racing insert waits for the other transaction to finish.
INSERT INTO idempotency_keys AS k
    (tenant, operation, key, request_fingerprint, fingerprint_version, run_id, created_at, expires_at)
VALUES ($1, $2, $3, $4, $5, $6,
        {now $7},
        {now $7} + $8)
ON CONFLICT (tenant, operation, key) DO UPDATE
    SET request_fingerprint = EXCLUDED.request_fingerprint,
        fingerprint_version = EXCLUDED.fingerprint_version,
        run_id = EXCLUDED.run_id,
        created_at = EXCLUDED.created_at,
        expires_at = EXCLUDED.expires_at
    WHERE k.expires_at <= EXCLUDED.created_at
RETURNING created_at

-- name: find_idempotency_key
SELECT request_fingerprint, fingerprint_version, run_id
FROM idempotency_keys
WHERE tenant = $1 AND operation = $2 AND key = $3

-- name: sweep_idempotency_keys
DELETE FROM idempotency_keys
WHERE (tenant, operation, key) IN (
    SELECT tenant, operation, key FROM idempotency_keys
    WHERE expires_at <= {now $1}
    LIMIT $2
)

-- name: insert_run
INSERT INTO runs (tenant, run_id, operation, state, version, request, deadline_at, replay_of,
                  created_at, updated_at, last_event_seq)
VALUES ($1, $2, $3, 'queued', 1, $4, $5, $6, $7, $7, 1)

-- name: get_run
SELECT tenant, run_id, operation, state, version, request, deadline_at, replay_of,
       created_at, updated_at, last_event_seq
FROM runs
WHERE tenant = $1 AND run_id = $2

-- name: list_events
SELECT seq, kind, body, created_at
FROM run_events
WHERE tenant = $1 AND run_id = $2
ORDER BY seq

-- name: insert_event
INSERT INTO run_events (tenant, run_id, seq, kind, body, created_at)
VALUES ($1, $2, $3, $4, $5, $6)

-- name: next_event_seq
-- Allocates the next event seq under the run's row lock (non-terminal events).
UPDATE runs
SET last_event_seq = last_event_seq + 1,
    updated_at = {greatest}(updated_at, {now $3})
WHERE tenant = $1 AND run_id = $2
RETURNING last_event_seq, updated_at

-- name: terminate_run
-- Compare-and-set to a terminal state: only a queued run, and only at the
-- expected version when one is given. Allocates the terminal event's seq.
UPDATE runs
SET state = $3,
    version = version + 1,
    last_event_seq = last_event_seq + 1,
    updated_at = {greatest}(updated_at, {now $4})
WHERE tenant = $1 AND run_id = $2 AND state = 'queued'
  AND ($5{pg:::bigint} IS NULL OR version = $5)
RETURNING last_event_seq, version, updated_at

-- name: find_replay
SELECT run_id FROM runs WHERE tenant = $1 AND replay_of = $2 ORDER BY created_at LIMIT 1

-- name: lock_run
SELECT state, version FROM runs WHERE tenant = $1 AND run_id = $2 {pg:FOR UPDATE}
