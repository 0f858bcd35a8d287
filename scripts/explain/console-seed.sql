-- The console benchmark (BENCHMARKS.md, "The console on 1M outbox rows and 1M jobs"):
-- 1M runs/jobs/keys/events over 100 tenants and 5 queues; 1M outbox rows
-- (98 % delivered, 1.5 % pending, 0.5 % dead). Run on a migrated scratch database.
SET synchronous_commit = off;
CREATE TEMP TABLE g AS
SELECT i, 't' || (i % 100) AS tenant,
       md5(i::text)::uuid AS run_id,
       1800000000000 + i * 10 AS at,
       CASE WHEN i % 1000 < 950 THEN 'succeeded' WHEN i % 1000 < 970 THEN 'queued' WHEN i % 1000 < 980 THEN 'leased'
            WHEN i % 1000 < 985 THEN 'dead' ELSE 'cancelled' END AS jstate
FROM generate_series(1, 1000000) i;
INSERT INTO runs (tenant, run_id, operation, state, version, request, created_at, updated_at, last_event_seq)
SELECT tenant, run_id, 'op' || (i % 7),
       CASE jstate WHEN 'succeeded' THEN 'succeeded' WHEN 'dead' THEN 'failed' WHEN 'cancelled' THEN 'cancelled' ELSE 'queued' END,
       1, '{"n":1}', at, at, 1 FROM g;
INSERT INTO run_events (tenant, run_id, seq, kind, body, created_at)
SELECT tenant, run_id, 1, 'run_queued', '{}', at FROM g;
INSERT INTO idempotency_keys (tenant, operation, key, request_fingerprint, fingerprint_version, run_id, created_at, expires_at)
SELECT tenant, 'op' || (i % 7), 'key-' || i, 'fp', 1, run_id, at, at + 86400000 FROM g;
INSERT INTO jobs (tenant, run_id, queue, state, available_at, lease_owner, lease_expires_at, lease_generation, attempts,
                  max_attempts, last_error_code, created_at, updated_at)
SELECT tenant, run_id, 'q' || (i % 5), jstate, at,
       CASE WHEN jstate = 'leased' THEN 'w1' END, CASE WHEN jstate = 'leased' THEN at + 30000 END,
       1, 1, 5, CASE WHEN jstate = 'dead' THEN 'code' || (i % 3) END, at, at FROM g;
INSERT INTO outbox (tenant, topic, key, lane, payload, headers, effect_key, created_at, state, last_error, delivered_at)
SELECT tenant, 'ferry.run-events', run_id::text, (i % 64), '\x00', '{}', tenant || '/' || run_id || '/1', at,
       CASE WHEN i % 1000 < 980 THEN 'delivered' WHEN i % 1000 < 995 THEN 'pending' ELSE 'dead' END,
       CASE WHEN i % 1000 >= 995 THEN 'message_too_large' END,
       CASE WHEN i % 1000 < 980 THEN at + 50 END
FROM g;
ANALYZE;
