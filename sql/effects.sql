-- The effect ledger: reserve before an external call, close it after.

-- name: reserve_effect
INSERT INTO effects (tenant, run_id, step, operation, state, generation, created_at, updated_at)
VALUES ($1, $2, $3, $4, 'reserved', $5, $6, $6)
ON CONFLICT (tenant, run_id, step, operation) DO NOTHING
RETURNING state

-- name: get_effect
SELECT step, operation, state, provider_ref, generation, error_code, created_at, updated_at
FROM effects
WHERE tenant = $1 AND run_id = $2 AND step = $3 AND operation = $4

-- name: update_effect
-- Closes or re-opens a record under the caller's (already fenced) generation.
UPDATE effects
SET state = $5, provider_ref = COALESCE($6, provider_ref), error_code = $7, generation = $8, updated_at = $9
WHERE tenant = $1 AND run_id = $2 AND step = $3 AND operation = $4

-- name: mark_effects_unknown
-- An ambiguous attempt: whatever it reserved may or may not have happened.
UPDATE effects
SET state = 'unknown', updated_at = $4
WHERE tenant = $1 AND run_id = $2 AND generation = $3 AND state = 'reserved'

-- name: list_effects
-- A run's ledger entries (lineage), in the order they were reserved.
SELECT step, operation, state, provider_ref, generation, error_code, created_at, updated_at
FROM effects
WHERE tenant = $1 AND run_id = $2
ORDER BY created_at, step, operation
