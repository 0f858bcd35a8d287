-- Seeds 1M runs (with jobs, events, outbox rows, attempts) into a migrated, empty
-- PostgreSQL database for the run-listing EXPLAIN in BENCHMARKS.md:
--   ferry migrate --database-url $URL && psql $URL -f scripts/explain/runs-seed.sql
INSERT INTO runs (tenant, run_id, operation, state, version, request, deadline_at, replay_of, created_at, updated_at, last_event_seq, scheduled_at, parent_run_id)
SELECT 'tenant-' || (i % 100), gen_random_uuid(), 'op-' || (i % 10),
       CASE WHEN i % 1000 < 900 THEN 'succeeded' WHEN i % 1000 < 980 THEN 'queued' WHEN i % 1000 < 995 THEN 'failed' ELSE 'cancelled' END,
       2, '{"amount": 5}', NULL, NULL, 1800000000000 + i * 10, 1800000000000 + i * 10, 2, NULL, NULL
FROM generate_series(1, 1000000) i;
INSERT INTO jobs (tenant, run_id, queue, state, available_at, max_attempts, attempts, created_at, updated_at)
SELECT tenant, run_id, 'queue-' || (abs(hashtext(run_id::text)) % 5),
       CASE state WHEN 'succeeded' THEN 'succeeded' WHEN 'queued' THEN 'queued' WHEN 'failed' THEN 'dead' ELSE 'cancelled' END,
       created_at, 5, 1, created_at, updated_at
FROM runs;
INSERT INTO run_events (tenant, run_id, seq, kind, body, created_at)
SELECT tenant, run_id, 1, 'run_queued', '{}', created_at FROM runs;
INSERT INTO outbox (tenant, topic, key, lane, payload, headers, effect_key, created_at, state, delivered_at)
SELECT tenant, 'ferry.run-events', run_id::text, 0, '\x00', '{}', tenant || '/' || run_id || '/1', created_at, 'delivered', created_at FROM runs;
INSERT INTO job_attempts (tenant, run_id, attempt, generation, worker, claimed_at, finished_at, outcome)
SELECT tenant, run_id, 1, 1, 'w', created_at, created_at, 'succeeded' FROM runs WHERE state = 'succeeded';
VACUUM ANALYZE;
SELECT count(*) FROM runs;
