-- Retention of attempts (sweep_attempts) on 1M attempt rows, under the
-- generic plan sqlx gets, on a migrated, empty PostgreSQL database
-- (BENCHMARKS.md "Per-job write cost at the SQL level"):
--   psql $URL -f scripts/explain/attempts-sweep.sql
-- 90 % finished, claimed over 1M ms; the cutoff keeps the newest half.
INSERT INTO runs (tenant, run_id, operation, state, version, request, created_at, updated_at, last_event_seq)
SELECT 'tenant-' || (i % 100), gen_random_uuid(), 'op', 'succeeded', 2, '{}', 1800000000000 + i, 1800000000000 + i, 2
FROM generate_series(1, 1000000) i;
INSERT INTO jobs (tenant, run_id, queue, state, available_at, max_attempts, attempts, lease_generation, created_at, updated_at)
SELECT tenant, run_id, 'q', 'succeeded', created_at, 5, 1, 1, created_at, updated_at FROM runs;
INSERT INTO job_attempts (tenant, run_id, attempt, generation, worker, claimed_at, finished_at, outcome)
SELECT tenant, run_id, 1, 1, 'w', created_at,
       CASE WHEN created_at % 10 = 0 THEN NULL ELSE created_at + 50 END,
       CASE WHEN created_at % 10 = 0 THEN NULL ELSE 'succeeded' END
FROM runs;
VACUUM ANALYZE;
SET plan_cache_mode = force_generic_plan;
PREPARE sweep(bigint, bigint) AS
DELETE FROM job_attempts
WHERE (tenant, run_id, generation) IN (
    SELECT tenant, run_id, generation FROM job_attempts
    WHERE claimed_at <= $1 AND finished_at IS NOT NULL AND finished_at <= $1
    LIMIT $2
);
BEGIN;
EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) EXECUTE sweep(1800000500000, 1000);
ROLLBACK;
