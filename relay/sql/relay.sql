-- The relay's side of the outbox: lane leases, batches, fenced marks, retention.

-- name: relay_heartbeat
INSERT INTO relay_instances (owner, expires_at, max_lanes)
VALUES ($1, {now $2} + $3, $4)
ON CONFLICT (owner) DO UPDATE SET expires_at = EXCLUDED.expires_at, max_lanes = EXCLUDED.max_lanes

-- name: sweep_relay_instances
-- Instances whose heartbeat expired are gone (a restarted one re-inserts itself).
DELETE FROM relay_instances WHERE expires_at <= {now $1}

-- name: relay_leave
DELETE FROM relay_instances WHERE owner = $1

-- name: renew_lanes
-- Extends every lane this relay still holds; lanes missing from the answer
-- (or back at another generation) are lost. A lease that lapsed while no
-- relay took the lane (this one was starved or cut off from the database)
-- is still this relay's: taking it needs a new generation (acquire_lanes),
-- and every mark is fenced on the generation, so extending it late lets no
-- other relay's work interleave.
UPDATE relay_lanes
SET lease_expires_at = {now $2} + $3
WHERE owner = $1
RETURNING lane, generation

-- name: acquire_lanes
-- Takes up to $4 free or expired lanes below $5, raising their generation.
UPDATE relay_lanes
SET owner = $1,
    generation = generation + 1,
    lease_expires_at = {now $2} + $3
WHERE lane IN (
    SELECT lane FROM relay_lanes
    WHERE lane < $5
      AND (owner IS NULL OR lease_expires_at <= {now $2})
    ORDER BY lane
    LIMIT $4
    {pg:FOR UPDATE SKIP LOCKED}
)
RETURNING lane, generation

-- name: release_lane
UPDATE relay_lanes SET owner = NULL, lease_expires_at = NULL
WHERE lane = $1 AND owner = $2 AND generation = $3

-- name: lock_lane
-- Holds the lane row until commit, so no takeover can interleave with a mark.
SELECT lane FROM relay_lanes
WHERE lane = $1 AND owner = $2 AND generation = $3
{pg:FOR SHARE}

-- name: pending_batch
-- The lane's first pending rows that no ledger range covers (a row `--capture
-- wal` delivered is covered and stays 'pending' in its row until a fold or
-- retention): the pending index, one ledger probe per row (none found when
-- the ledger is empty, as on SQLite).
SELECT o.id, o.tenant, o.topic, o.key, o.payload, o.headers, o.effect_key, o.traceparent, o.created_at
FROM outbox o
WHERE o.lane = $1 AND o.state = 'pending'
  AND NOT COALESCE((SELECT d.hi FROM outbox_delivered d WHERE d.lo <= o.id
                    ORDER BY d.lo DESC LIMIT 1) >= o.id, false)
ORDER BY o.id
LIMIT $2

-- name: pending_besides
-- The lane's first pending rows other than the batch in flight ($3), read
-- while that batch is in flight. Not "after the last id read": a row that
-- drew a lower id but committed late must come before every later row of
-- its key, and one statement that sees the later row also sees it (the
-- per-key lock makes it commit first). The scan starts at the lane's lowest
-- pending id and skips at most the in-flight batch. Covered rows are not
-- pending (as in pending_batch).
SELECT o.id, o.tenant, o.topic, o.key, o.payload, o.headers, o.effect_key, o.traceparent, o.created_at
FROM outbox o
WHERE o.lane = $1 AND o.state = 'pending' AND NOT (o.id {ids $3})
  AND NOT COALESCE((SELECT d.hi FROM outbox_delivered d WHERE d.lo <= o.id
                    ORDER BY d.lo DESC LIMIT 1) >= o.id, false)
ORDER BY o.id
LIMIT $2

-- name: lanes_with_pending
-- The lanes $1 holds that have a pending row no ledger range covers: one
-- index probe per lane (and one ledger probe per pending row it passes).
SELECT l.lane FROM relay_lanes l
WHERE l.owner = $1
  AND EXISTS (SELECT 1 FROM outbox o WHERE o.lane = l.lane AND o.state = 'pending'
              AND NOT COALESCE((SELECT d.hi FROM outbox_delivered d WHERE d.lo <= o.id
                                  ORDER BY d.lo DESC LIMIT 1) >= o.id, false))
ORDER BY l.lane

-- name: mark_delivered
-- One autocommitted statement, fence and mark together: the lane must still
-- be $3's at generation $4, its row held (FOR SHARE) until the statement
-- commits so no takeover interleaves. Fewer rows than ids sends the caller
-- to lock_lane to tell a lost lane from rows no longer pending.
UPDATE outbox
SET state = 'delivered', delivered_at = {now $5},
    publish_attempts = publish_attempts + 1
WHERE lane = $1 AND state = 'pending' AND id {ids $2}
  AND EXISTS (SELECT 1 FROM relay_lanes l
              WHERE l.lane = $1 AND l.owner = $3 AND l.generation = $4 {pg:FOR SHARE})

-- name: delete_delivered
-- mark_delivered's delete-on-delivery twin, fenced the same way.
DELETE FROM outbox WHERE lane = $1 AND state = 'pending' AND id {ids $2}
  AND EXISTS (SELECT 1 FROM relay_lanes l
              WHERE l.lane = $1 AND l.owner = $3 AND l.generation = $4 {pg:FOR SHARE})

-- name: mark_dead
-- A row a ledger range covers was delivered (WAL capture beside this relay
-- published it meanwhile) and is left alone, as a row marked delivered is
-- (dead and covered, it would read dead although delivered, and a replay
-- would publish it again).
UPDATE outbox
SET state = 'dead', last_error = $3, publish_attempts = publish_attempts + 1
WHERE lane = $1 AND id = $2 AND state = 'pending'
  AND NOT COALESCE((SELECT d.hi FROM outbox_delivered d WHERE d.lo <= $2
                    ORDER BY d.lo DESC LIMIT 1) >= $2, false)

-- name: note_publish_error
-- Fenced like every relay write: only the lane's current holder counts
-- attempts, on a row not delivered (a covered row is left alone).
UPDATE outbox SET publish_attempts = publish_attempts + 1, last_error = $3
WHERE lane = $1 AND id = $2 AND state = 'pending'
  AND NOT COALESCE((SELECT d.hi FROM outbox_delivered d WHERE d.lo <= $2
                    ORDER BY d.lo DESC LIMIT 1) >= $2, false)
  AND EXISTS (SELECT 1 FROM relay_lanes l WHERE l.lane = $1 AND l.owner = $4 AND l.generation = $5)

-- name: sweep_delivered
-- Up to $3 rows delivered more than $2 ms ago: marked delivered (the
-- delivered index), or still 'pending' in their row but covered by a ledger
-- range delivered that long ago (`--capture wal`; the ledger's delivered_at
-- index, then the rows by primary-key range). Nothing else is deleted.
DELETE FROM outbox
WHERE id IN (
    SELECT id FROM (
        SELECT id FROM outbox
        WHERE state = 'delivered' AND delivered_at <= {now $1} - $2
        UNION ALL
        SELECT o.id FROM outbox_delivered d
        JOIN outbox o ON o.id BETWEEN d.lo AND d.hi
        WHERE d.delivered_at <= {now $1} - $2 AND o.state = 'pending'
    ) AS due
    LIMIT $3
)

-- name: sweep_delivered_ranges
-- Then up to $3 ledger ranges delivered more than $2 ms ago that cover no
-- pending row any more (their rows swept; a dead row needs no range).
DELETE FROM outbox_delivered
WHERE lo IN (
    SELECT d.lo FROM outbox_delivered d
    WHERE d.delivered_at <= {now $1} - $2
      AND NOT EXISTS (SELECT 1 FROM outbox o
                      WHERE o.id BETWEEN d.lo AND d.hi AND o.state = 'pending')
    LIMIT $3
)

-- name: fold_delivered_lock [postgres only]
-- A poll relay's fold of the ledger starts here: the WAL marker's lock, so
-- no range it folds is merged or extended meanwhile.
SELECT {use outbox_ledger_lock}

-- name: fold_delivered [postgres only]
-- At a poll relay's start: the first $1 ledger ranges become row states
-- (their pending rows delivered at the range's delivered_at, so the lanes'
-- pending index stops carrying them), then those ranges, now covering no
-- pending row, are deleted. Returns how many ranges were folded.
WITH batch AS (
    SELECT lo, hi, delivered_at FROM outbox_delivered ORDER BY lo LIMIT $1
), folded AS (
    UPDATE outbox o SET state = 'delivered', delivered_at = b.delivered_at
    FROM batch b
    WHERE o.id BETWEEN b.lo AND b.hi AND o.state = 'pending'
), emptied AS (
    DELETE FROM outbox_delivered d USING batch b WHERE d.lo = b.lo
    RETURNING d.lo
)
SELECT count(*) FROM emptied
