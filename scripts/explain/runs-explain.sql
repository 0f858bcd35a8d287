-- The run-listing and lineage statements as sqlx prepares them, under the
-- generic plan, on the database runs-seed.sql filled (BENCHMARKS.md).
SET plan_cache_mode = force_generic_plan;
PREPARE tenant_q(text, bigint, uuid, bigint, text, text, bigint) AS
SELECT r.tenant, r.run_id, r.operation, j.queue, r.state, j.state AS job_state, j.attempts, j.max_attempts,
       j.last_error_code, r.scheduled_at, r.parent_run_id, r.replay_of, r.created_at, r.updated_at
FROM runs r JOIN jobs j ON j.tenant = r.tenant AND j.run_id = r.run_id
WHERE r.tenant = $1 AND (r.created_at, r.run_id) < ($2, $3) AND r.created_at >= $4
  AND ($5::text IS NULL OR r.operation = $5) AND ($6::text IS NULL OR j.queue = $6)
ORDER BY r.created_at DESC, r.run_id DESC LIMIT $7;
PREPARE state_q(text, bigint, uuid, bigint, text, text, bigint, text) AS
SELECT r.tenant, r.run_id, r.operation, j.queue, r.state, j.state AS job_state, j.attempts, j.max_attempts,
       j.last_error_code, r.scheduled_at, r.parent_run_id, r.replay_of, r.created_at, r.updated_at
FROM runs r JOIN jobs j ON j.tenant = r.tenant AND j.run_id = r.run_id
WHERE r.tenant = $1 AND r.state = $8 AND (r.created_at, r.run_id) < ($2, $3) AND r.created_at >= $4
  AND ($5::text IS NULL OR r.operation = $5) AND ($6::text IS NULL OR j.queue = $6)
ORDER BY r.created_at DESC, r.run_id DESC LIMIT $7;
PREPARE all_q(text, bigint, uuid, bigint, text, text, bigint, text) AS
SELECT r.tenant, r.run_id, r.operation, j.queue, r.state, j.state AS job_state, j.attempts, j.max_attempts,
       j.last_error_code, r.scheduled_at, r.parent_run_id, r.replay_of, r.created_at, r.updated_at
FROM runs r JOIN jobs j ON j.tenant = r.tenant AND j.run_id = r.run_id
WHERE ($1::text IS NULL OR r.tenant = $1) AND (r.created_at, r.run_id) < ($2, $3) AND r.created_at >= $4
  AND ($5::text IS NULL OR r.operation = $5) AND ($6::text IS NULL OR j.queue = $6) AND ($8::text IS NULL OR r.state = $8)
ORDER BY r.created_at DESC, r.run_id DESC LIMIT $7;
PREPARE outbox_q(text, text) AS
SELECT id, topic, key, effect_key, state, publish_attempts, last_error, created_at, delivered_at
FROM outbox WHERE tenant = $1 AND key = $2 ORDER BY id;
PREPARE children_q(text, uuid) AS
SELECT r.run_id FROM runs r JOIN jobs j ON j.tenant = r.tenant AND j.run_id = r.run_id
WHERE r.tenant = $1 AND r.parent_run_id = $2 ORDER BY r.created_at, r.run_id;
\echo === 1. all tenants, first page of 50
EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) EXECUTE all_q(NULL, 9223372036854775807, '00000000-0000-0000-0000-000000000000', 0, NULL, NULL, 50, NULL);
\echo === 2. one tenant, first page of 50
EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) EXECUTE tenant_q('tenant-7', 9223372036854775807, '00000000-0000-0000-0000-000000000000', 0, NULL, NULL, 50);
\echo === 3. one tenant, failed (1.5 pct of all runs), first page
EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) EXECUTE state_q('tenant-85', 9223372036854775807, '00000000-0000-0000-0000-000000000000', 0, NULL, NULL, 50, 'failed');
\echo === 4. one tenant, deep page (cursor in the middle of its history)
EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) EXECUTE tenant_q('tenant-7', 1800005000000, '00000000-0000-0000-0000-000000000000', 0, NULL, NULL, 50);
\echo === 5. one tenant, queue filter (1 in 5)
EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) EXECUTE tenant_q('tenant-7', 9223372036854775807, '00000000-0000-0000-0000-000000000000', 0, NULL, 'queue-3', 50);
\echo === 6. all tenants, cancelled (0.5 pct)
EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) EXECUTE all_q(NULL, 9223372036854775807, '00000000-0000-0000-0000-000000000000', 0, NULL, NULL, 50, 'cancelled');
SELECT run_id AS rid FROM runs WHERE tenant = 'tenant-7' LIMIT 1 \gset
\echo === 7. lineage: outbox rows of one run
EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) EXECUTE outbox_q('tenant-7', :'rid');
\echo === 8. lineage: children
EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) EXECUTE children_q('tenant-7', :'rid');
\echo === 9. worst case: one tenant and an operation it never ran (walks all its runs)
EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) EXECUTE tenant_q('tenant-7', 9223372036854775807, '00000000-0000-0000-0000-000000000000', 0, 'op-9', NULL, 50);
