-- Consumer partition leases and the dedupe ledger.

-- name: acquire_partition
-- Kafka assigned the partition to $4: take the lease at a higher generation,
-- whoever held it. Returns the generation and the offset stored with effects.
INSERT INTO consumer_partitions AS p (group_id, topic, partition, owner, generation, lease_expires_at)
VALUES ($1, $2, $3, $4, 1, {now $5} + $6)
ON CONFLICT (group_id, topic, partition) DO UPDATE
    SET owner = EXCLUDED.owner, generation = p.generation + 1, lease_expires_at = EXCLUDED.lease_expires_at
RETURNING generation, next_offset

-- name: acquire_free_partition
-- A member whose lease was lost takes it back only if nobody holds it: the
-- row is new, released, already $4's, or its lease expired. The takeover of
-- `acquire_partition` belongs to the rebalance callback alone, where Kafka's
-- assignment is current; a member's local view may be stale. No row: held.
INSERT INTO consumer_partitions AS p (group_id, topic, partition, owner, generation, lease_expires_at)
VALUES ($1, $2, $3, $4, 1, {now $5} + $6)
ON CONFLICT (group_id, topic, partition) DO UPDATE
    SET owner = EXCLUDED.owner, generation = p.generation + 1, lease_expires_at = EXCLUDED.lease_expires_at
    WHERE p.owner IS NULL OR p.owner = EXCLUDED.owner OR p.lease_expires_at IS NULL
        OR p.lease_expires_at <= {now $5}
RETURNING generation, next_offset

-- name: release_partition
UPDATE consumer_partitions SET owner = NULL, lease_expires_at = NULL
WHERE group_id = $1 AND topic = $2 AND partition = $3 AND owner = $4 AND generation = $5

-- name: renew_partitions
UPDATE consumer_partitions
SET lease_expires_at = {now $3} + $4
WHERE group_id = $1 AND owner = $2

-- name: renew_partition
-- Extends one lease, only at its generation: a member renews what it holds,
-- never a row it released or lost. No row: the lease is gone.
UPDATE consumer_partitions
SET lease_expires_at = {now $6} + $7
WHERE group_id = $1 AND topic = $2 AND partition = $3 AND owner = $4 AND generation = $5

-- name: lock_partition
-- Holds the partition row until commit: no takeover interleaves with the effects.
SELECT next_offset FROM consumer_partitions
WHERE group_id = $1 AND topic = $2 AND partition = $3 AND owner = $4 AND generation = $5
{pg:FOR UPDATE}

-- name: insert_ledger
INSERT INTO consumer_ledger (group_id, effect_key, topic, partition, "offset", outcome, processed_at)
VALUES ($1, $2, $3, $4, $5, $6, {now $7})
ON CONFLICT (group_id, effect_key) DO NOTHING
RETURNING effect_key

-- name: insert_ledger_batch
-- insert_ledger for a micro-batch in one statement, in record order: $2 is
-- a JSON array of [effect key, offset] pairs (one array, not two: a join of
-- two json_each is quadratic on SQLite). A key repeated among them is
-- inserted once, with its first record's offset. Returns the keys inserted.
INSERT INTO consumer_ledger (group_id, effect_key, topic, partition, "offset", outcome, processed_at)
SELECT $1{pg:::text}, p.value ->> 0, $3{pg:::text}, $4{pg:::int}, {pg:(}p.value ->> 1{pg:)::bigint}, $5{pg:::text}, {now $6}
FROM {pg:jsonb_array_elements($2::jsonb) WITH ORDINALITY AS p (value, ord)}{sqlite:json_each($2) AS p}
WHERE true
ORDER BY {pg:p.ord}{sqlite:p.key}
ON CONFLICT (group_id, effect_key) DO NOTHING
RETURNING effect_key

-- name: advance_offset
UPDATE consumer_partitions SET next_offset = $6
WHERE group_id = $1 AND topic = $2 AND partition = $3 AND owner = $4 AND generation = $5

-- name: sweep_ledger
DELETE FROM consumer_ledger
WHERE (group_id, effect_key) IN (
    SELECT group_id, effect_key FROM consumer_ledger
    WHERE group_id = $1 AND processed_at <= {now $2} - $3
    LIMIT $4
)

-- name: stored_offsets
SELECT topic, partition, next_offset, owner, generation FROM consumer_partitions
WHERE group_id = $1 ORDER BY topic, partition
