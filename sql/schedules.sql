-- Periodic runs (`ferry_schedules`): definitions and their tick cursor.

-- name: clock_now
-- The instant schedules compute ticks from: the injected one, or the database's.
SELECT {now $1} AS now

-- name: insert_schedule
-- A new schedule; nothing when (tenant, name) exists (a racing insert waits
-- for the other transaction, then does nothing).
INSERT INTO ferry_schedules (tenant, name, spec, template, missed, catch_up_max, anchor_at, last_tick, next_tick,
                             version, created_at, updated_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, NULL, $8, 1, $7, $7)
ON CONFLICT (tenant, name) DO NOTHING
RETURNING version

-- name: lock_schedule
SELECT tenant, name, spec, template, missed, catch_up_max, anchor_at, last_tick, next_tick, version, updated_at
FROM ferry_schedules
WHERE tenant = $1 AND name = $2
{pg:FOR UPDATE}

-- name: update_schedule
-- A changed definition (under lock_schedule's row lock): a new spec re-anchors
-- the ticks at $7 and moves next_tick ($8); version + 1.
UPDATE ferry_schedules
SET spec = $3, template = $4, missed = $5, catch_up_max = $6, anchor_at = $7, next_tick = $8,
    version = version + 1, updated_at = $9
WHERE tenant = $1 AND name = $2

-- name: delete_schedule
DELETE FROM ferry_schedules WHERE tenant = $1 AND name = $2

-- name: list_schedules
-- Every schedule, or one tenant's ($1), by tenant and name.
SELECT tenant, name, spec, template, missed, catch_up_max, anchor_at, last_tick, next_tick, version, updated_at
FROM ferry_schedules
WHERE ($1{pg:::text} IS NULL OR tenant = $1)
ORDER BY tenant, name

-- name: list_due_schedules
-- Schedules with a tick at or before $1, most overdue first, after the key
-- ($2, $3, $4) in that order (ferry_schedules_due_idx): fire_due_ticks pages
-- on past the schedules it could not fire. $5 limit.
SELECT tenant, name, spec, template, missed, catch_up_max, anchor_at, last_tick, next_tick, version, updated_at
FROM ferry_schedules
WHERE next_tick <= $1 AND (next_tick, tenant, name) > ($2, $3, $4)
ORDER BY next_tick, tenant, name
LIMIT $5

-- name: advance_schedule
-- Compare-and-set of the tick cursor, in the transaction that accepts the
-- ticks' runs: only from the version and next_tick the firer read, so of N
-- processes firing one tick one moves it (the others wait for its row lock,
-- then match nothing) and the runs it accepted commit with the move.
UPDATE ferry_schedules
SET last_tick = $3, next_tick = $4, updated_at = {greatest}(updated_at, $7)
WHERE tenant = $1 AND name = $2 AND version = $5 AND next_tick = $6
