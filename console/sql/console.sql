-- The console's read-only queries (its actions go through the library
-- calls the command line uses). $1 is an optional tenant filter throughout:
-- NULL means every tenant (only for a token without a tenant scope).

-- name: outbox_lanes
-- Pending backlog per lane and its oldest row, over the pending partial index.
SELECT lane, count(*) AS pending, min(created_at) AS oldest
FROM outbox
WHERE state = 'pending' AND ($1{pg:::text} IS NULL OR tenant = $1)
GROUP BY lane
ORDER BY lane

-- name: outbox_dead_groups
-- Dead rows by tenant and error code (outbox_dead_idx).
SELECT tenant, COALESCE(last_error, '') AS error_code, count(*) AS rows, min(id) AS first_id
FROM outbox
WHERE state = 'dead' AND ($1{pg:::text} IS NULL OR tenant = $1)
GROUP BY tenant, last_error
ORDER BY count(*) DESC, tenant, error_code

-- name: jobs_by_queue_state
-- Jobs by queue and state.
SELECT queue, state, count(*) AS jobs
FROM jobs
WHERE ($1{pg:::text} IS NULL OR tenant = $1)
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

-- name: sample_outbox
-- The sampler's reading: pending rows, and rows marked delivered after $1.
SELECT (SELECT count(*) FROM outbox WHERE state = 'pending') AS pending,
       (SELECT count(*) FROM outbox WHERE state = 'delivered' AND delivered_at > $1) AS delivered,
       {now $2} AS now

-- name: db_now
SELECT {now $1}
