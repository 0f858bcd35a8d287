-- The console's read-only queries (its actions go through the library
-- calls the command line uses). $1 is an optional tenant filter throughout:
-- NULL means every tenant (only for a token without a tenant scope).

-- name: outbox_lanes
-- Pending backlog per lane, every tenant, rows the delivered-ranges ledger
-- covers left out (fragments borrowed from the library's
-- sql/outbox_delivered.sql): with an empty ledger counted on the pending
-- partial index (lane, id) alone (one leg), else in the ledger's gaps (the
-- other); the age read from each lane's lowest pending id (ids follow
-- commit order, so it is the lane's oldest row).
SELECT b.lane, b.pending, o.created_at AS oldest
FROM (SELECT lane, count(*) AS pending, min(id) AS first_id
      FROM outbox WHERE state = 'pending' AND {use outbox_ledger_empty} GROUP BY lane
      UNION ALL
      SELECT p.lane, count(*), min(p.id) FROM {use outbox_gap_rows} p GROUP BY p.lane) b
JOIN outbox o ON o.id = b.first_id
ORDER BY b.lane

-- name: outbox_lanes_of_tenant
-- outbox_lanes for tenant $1 (its own statement: an optional tenant
-- predicate would keep a generic plan off the index).
SELECT b.lane, b.pending, o.created_at AS oldest
FROM (SELECT lane, count(*) AS pending, min(id) AS first_id
      FROM outbox WHERE state = 'pending' AND tenant = $1 AND {use outbox_ledger_empty} GROUP BY lane
      UNION ALL
      SELECT p.lane, count(*), min(p.id) FROM {use outbox_gap_rows} p WHERE p.tenant = $1 GROUP BY p.lane) b
JOIN outbox o ON o.id = b.first_id
ORDER BY b.lane

-- name: outbox_dead_groups
-- Dead rows by tenant and error code (outbox_dead_idx).
SELECT tenant, COALESCE(last_error, '') AS error_code, count(*) AS rows, min(id) AS first_id, max(id) AS last_id
FROM outbox
WHERE state = 'dead' AND ($1{pg:::text} IS NULL OR tenant = $1)
GROUP BY tenant, last_error
ORDER BY count(*) DESC, tenant, error_code

-- name: jobs_by_queue_state
-- Every tenant's jobs by queue and state: reads every job, so only the
-- sampler's background census runs it, never a request.
SELECT queue, state, count(*) AS jobs
FROM jobs
GROUP BY queue, state
ORDER BY queue, state

-- name: jobs_of_tenant_by_queue_state
-- Tenant $1's jobs by queue and state (a jobs_pkey range).
SELECT queue, state, count(*) AS jobs
FROM jobs
WHERE tenant = $1
GROUP BY queue, state
ORDER BY queue, state

-- name: dead_job_groups
-- Dead jobs by tenant and error code (jobs_dead_idx).
SELECT tenant, COALESCE(last_error_code, '') AS error_code, count(*) AS jobs
FROM jobs
WHERE state = 'dead' AND ($1{pg:::text} IS NULL OR tenant = $1)
GROUP BY tenant, last_error_code
ORDER BY count(*) DESC, tenant, error_code

-- name: consumer_partitions
-- Every consumer group's partitions: holder, generation, lease and stored offset.
SELECT group_id, topic, partition, owner, generation, lease_expires_at, next_offset
FROM consumer_partitions
ORDER BY group_id, topic, partition

-- name: consumer_groups
-- Per consumer group: the newest ledger entry (when the group last committed
-- a record it had not seen: a duplicate moves only the offset, and entries
-- past the ledger's retention are swept) and its dead letters still in the
-- ledger. Each an index probe (consumer_ledger_group_processed_idx, the
-- partial consumer_ledger_dead_idx), never a read of the group's ledger.
SELECT g.group_id,
       (SELECT max(l.processed_at) FROM consumer_ledger l WHERE l.group_id = g.group_id) AS last_processed_at,
       (SELECT count(*) FROM consumer_ledger l
         WHERE l.group_id = g.group_id AND l.outcome = 'dead_lettered') AS dead_letters
FROM (SELECT DISTINCT group_id FROM consumer_partitions) g
ORDER BY g.group_id

-- name: sample_outbox
-- The sampler's reading: pending rows (the ledger's covered rows left out,
-- as in outbox_lanes), and rows marked delivered after $1.
SELECT (SELECT count(*) FROM outbox WHERE state = 'pending' AND {use outbox_ledger_empty})
       + (SELECT count(*) FROM {use outbox_gap_rows} p) AS pending,
       (SELECT count(*) FROM outbox WHERE state = 'delivered' AND delivered_at > $1) AS delivered,
       {now $2} AS now

-- name: db_now
SELECT {now $1}

-- name: runs_by_key_and_operation
-- The run idempotency key $2 of operation $3 accepted for tenant $1: the key
-- compared as Ferry stores it, a primary-key lookup.
SELECT operation, key, run_id, created_at, expires_at
FROM idempotency_keys
WHERE tenant = $1 AND operation = $3 AND key = $2

-- name: runs_by_key
-- The runs idempotency key $2 accepted for tenant $1 under any operation:
-- walks the tenant's part of the primary key (prefer naming the operation).
SELECT operation, key, run_id, created_at, expires_at
FROM idempotency_keys
WHERE tenant = $1 AND key = $2
ORDER BY created_at DESC
LIMIT 50

-- name: ledger_for_outbox_rows
-- Consumer ledger entries for tenant $3's outbox rows $2 (ids), under the
-- key each row is published with (ferry_relay::publish::effect_key): the
-- writer's key scoped by the tenant, `<tenant>/<key>`, else
-- `<database id $1>:<outbox id>`; looked up in every consumer group's
-- ledger by primary key. A row's own key is never looked up raw: it could
-- read like another tenant's scoped key.
SELECT o.id AS outbox_id, l.group_id, l.effect_key, l.topic, l.partition, l."offset" AS record_offset,
       l.outcome, l.processed_at
FROM outbox o
CROSS JOIN (SELECT DISTINCT group_id FROM consumer_partitions) g
JOIN consumer_ledger l
  ON l.group_id = g.group_id
 AND l.effect_key = COALESCE(o.tenant || '/' || o.effect_key, $1 || ':' || CAST(o.id AS TEXT))
WHERE o.id {ids $2} AND o.tenant = $3
ORDER BY o.id, l.group_id
