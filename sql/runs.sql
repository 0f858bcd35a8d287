-- Runs, run events and idempotency records.
-- `$now` parameters are NULL in production (the database clock) or an injected instant.

-- name: claim_idempotency_key
-- Inserts the record, or takes over an expired one. Returns nothing when a live
-- record exists; a racing insert waits for the other transaction to finish.
INSERT INTO idempotency_keys AS k
    (tenant, operation, key, request_fingerprint, fingerprint_version, run_id, created_at, expires_at)
VALUES ($1, $2, $3, $4, $5, $6,
        {now $7},
        {now $7} + $8)
ON CONFLICT (tenant, operation, key) DO UPDATE
    SET request_fingerprint = EXCLUDED.request_fingerprint,
        fingerprint_version = EXCLUDED.fingerprint_version,
        run_id = EXCLUDED.run_id,
        created_at = EXCLUDED.created_at,
        expires_at = EXCLUDED.expires_at
    WHERE k.expires_at <= EXCLUDED.created_at
RETURNING created_at

-- name: find_idempotency_key
SELECT request_fingerprint, fingerprint_version, run_id
FROM idempotency_keys
WHERE tenant = $1 AND operation = $2 AND key = $3

-- name: sweep_idempotency_keys
DELETE FROM idempotency_keys
WHERE (tenant, operation, key) IN (
    SELECT tenant, operation, key FROM idempotency_keys
    WHERE expires_at <= {now $1}
    LIMIT $2
)

-- name: insert_run
INSERT INTO runs (tenant, run_id, operation, state, version, request, deadline_at, replay_of,
                  created_at, updated_at, last_event_seq, scheduled_at, parent_run_id)
VALUES ($1, $2, $3, 'queued', 1, $4, $5, $6, $7, $7, 1, $8, $9)

-- name: get_run
SELECT tenant, run_id, operation, state, version, request, deadline_at, replay_of,
       scheduled_at, parent_run_id, created_at, updated_at, last_event_seq
FROM runs
WHERE tenant = $1 AND run_id = $2

-- name: list_events
SELECT seq, kind, body, created_at
FROM run_events
WHERE tenant = $1 AND run_id = $2
ORDER BY seq

-- name: insert_event
-- Writes event $3 of run ($1, $2). Returns whether the event goes to Kafka:
-- true unless the run's job is in a queue whose ferry_queues row has
-- publish_events off, as the row stands at this write (the caller then
-- writes no outbox row). The job row must exist (acceptance writes it
-- before the run_queued event).
INSERT INTO run_events (tenant, run_id, seq, kind, body, created_at)
VALUES ($1, $2, $3, $4, $5, $6)
RETURNING NOT EXISTS (
    SELECT 1 FROM jobs j JOIN ferry_queues g ON g.queue = j.queue
    WHERE j.tenant = $1 AND j.run_id = $2 AND NOT g.publish_events) AS publish

-- name: next_event_seq
-- Allocates the next event seq under the run's row lock (non-terminal events).
UPDATE runs
SET last_event_seq = last_event_seq + 1,
    updated_at = {greatest}(updated_at, {now $3})
WHERE tenant = $1 AND run_id = $2
RETURNING last_event_seq, updated_at

-- name: terminate_run
-- Compare-and-set to a terminal state: only a queued run, and only at the
-- expected version when one is given. Allocates the terminal event's seq.
UPDATE runs
SET state = $3,
    version = version + 1,
    last_event_seq = last_event_seq + 1,
    updated_at = {greatest}(updated_at, {now $4})
WHERE tenant = $1 AND run_id = $2 AND state = 'queued'
  AND ($5{pg:::bigint} IS NULL OR version = $5)
RETURNING last_event_seq, version, updated_at

-- name: find_replay
SELECT run_id FROM runs WHERE tenant = $1 AND replay_of = $2 ORDER BY created_at LIMIT 1

-- name: lock_run
SELECT state, version FROM runs WHERE tenant = $1 AND run_id = $2 {pg:FOR UPDATE}

-- name: existing_run_ids [postgres only]
-- The bulk acceptance's check of proposed run ids: which of the pairs
-- ($1 tenant, $2 run id) already exist.
SELECT r.tenant, r.run_id
FROM UNNEST($1::text[], $2::uuid[]) AS i(tenant, run_id)
JOIN runs r ON r.tenant = i.tenant AND r.run_id = i.run_id

-- name: claim_idempotency_keys [postgres only]
-- claim_idempotency_key for many keys in one statement (distinct keys: the
-- caller keeps the first of each): inserts each record, or takes over an
-- expired one, under one instant. Rows go in key order, so two batches
-- sharing keys wait for each other in the same order and cannot deadlock.
-- Returns every key claimed (by the key, never by the proposed run id: two
-- items may propose one id) and the claim's instant; a live record is left
-- alone, and a racing insert of the same key waits for the other transaction.
INSERT INTO idempotency_keys AS k
    (tenant, operation, key, request_fingerprint, fingerprint_version, run_id, created_at, expires_at)
SELECT i.tenant, i.operation, i.key, i.fingerprint, i.fingerprint_version, i.run_id, c.at, c.at + $8
FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[], $5::int[], $6::uuid[])
         AS i(tenant, operation, key, fingerprint, fingerprint_version, run_id),
     (SELECT {now $7} AS at) c
ORDER BY i.tenant, i.operation, i.key
ON CONFLICT (tenant, operation, key) DO UPDATE
    SET request_fingerprint = EXCLUDED.request_fingerprint,
        fingerprint_version = EXCLUDED.fingerprint_version,
        run_id = EXCLUDED.run_id,
        created_at = EXCLUDED.created_at,
        expires_at = EXCLUDED.expires_at
    WHERE k.expires_at <= EXCLUDED.created_at
RETURNING k.tenant, k.operation, k.key, k.created_at

-- name: find_idempotency_keys [postgres only]
-- find_idempotency_key for many keys ($1 tenant, $2 operation, $3 key; the
-- input position is `ord`, from 1), with whether each record is live at $4
-- (a claim would not take it over) and the run it names, the original a
-- replay answers with.
SELECT i.ord, k.request_fingerprint, k.fingerprint_version, k.run_id AS key_run_id,
       k.expires_at > {now $4} AS live,
       r.tenant, r.run_id, r.operation, r.state, r.version, r.request, r.deadline_at, r.replay_of,
       r.scheduled_at, r.parent_run_id, r.created_at, r.updated_at, r.last_event_seq
FROM UNNEST($1::text[], $2::text[], $3::text[]) WITH ORDINALITY AS i(tenant, operation, key, ord)
JOIN idempotency_keys k ON k.tenant = i.tenant AND k.operation = i.operation AND k.key = i.key
LEFT JOIN runs r ON r.tenant = k.tenant AND r.run_id = k.run_id

-- name: insert_accepted_runs [postgres only]
-- The writes of many acceptances whose keys were claimed, in one statement:
-- for each input row the run (insert_run), its run_queued event at seq 1
-- (insert_event, the body built as queued_body builds it), its job
-- (insert_job, available at $21) and the event's outbox row (insert_outbox,
-- no key lock: nobody else can write a brand-new run's events), unless the
-- run's queue has publish_events off (as insert_event decides). $15 is the
-- claim's instant; the outbox key, payload, effect key and lane come from the
-- code that builds the single acceptance's row, so both write the same bytes.
-- Outbox rows go in input order, so outbox ids follow it. Foreign keys are checked
-- at the end of the statement, when the runs exist.
WITH input AS (
    SELECT *
    FROM UNNEST($1::text[], $2::uuid[], $3::text[], $4::jsonb[], $5::bigint[], $6::uuid[], $7::text[],
                $8::int[], $9::bigint[], $10::text[], $11::int[], $12::bytea[], $13::text[], $14::text[],
                $18::smallint[], $19::bigint[], $20::bigint[], $21::bigint[], $22::uuid[])
        WITH ORDINALITY
        AS i(tenant, run_id, operation, request, deadline_at, replay_of, queue, max_attempts, schema_version,
             key, lane, payload, effect_key, traceparent, priority, priority_lead, scheduled_at, available_at,
             parent_run_id, ord)
), run_rows AS (
    INSERT INTO runs (tenant, run_id, operation, state, version, request, deadline_at, replay_of,
                      created_at, updated_at, last_event_seq, scheduled_at, parent_run_id)
    SELECT tenant, run_id, operation, 'queued', 1, request, deadline_at, replay_of, $15::bigint, $15::bigint, 1,
           scheduled_at, parent_run_id
    -- Run rows in (tenant, run_id) order: two batches proposing the same
    -- ids wait for each other in one order (a unique violation, answered
    -- as a race), never deadlock.
    FROM input ORDER BY tenant, run_id
), event_rows AS (
    INSERT INTO run_events (tenant, run_id, seq, kind, body, created_at)
    SELECT tenant, run_id, 1, 'run_queued',
           jsonb_build_object('operation', operation, 'queue', queue, 'schema_version', schema_version,
                              'request', request, 'replay_of', replay_of)
           || jsonb_strip_nulls(jsonb_build_object('parent_run_id', parent_run_id, 'scheduled_at', scheduled_at)),
           $15::bigint
    FROM input ORDER BY ord
), job_rows AS (
    INSERT INTO jobs (tenant, run_id, queue, state, available_at, max_attempts, deadline_at, created_at, updated_at,
                      priority, priority_lead)
    SELECT tenant, run_id, queue, 'queued', available_at, max_attempts, deadline_at, $15::bigint, $15::bigint,
           priority, priority_lead
    FROM input ORDER BY ord
)
INSERT INTO outbox (tenant, topic, key, lane, payload, headers, effect_key, traceparent, created_at)
SELECT tenant, $16::text, key, lane, payload, $17::jsonb, effect_key, traceparent, $15::bigint
FROM input
WHERE NOT EXISTS (SELECT 1 FROM ferry_queues g WHERE g.queue = input.queue AND NOT g.publish_events)
ORDER BY ord

-- Run listing (list_runs): newest first, keyset on (created_at, run_id)
-- strictly below ($2, $3) and created_at >= $4, so every page is an index
-- range scan whatever the page depth. Across tenants the keyset is
-- (created_at, run_id, tenant) below ($2, $3, $9): run ids are unique per
-- tenant only, and one batch gives its runs one instant, so two tenants' runs
-- can share both. Three queries, one per index, because
-- a `($n IS NULL OR tenant = $n)` predicate cannot drive an index once
-- PostgreSQL switches a prepared statement to its generic plan. Optional
-- filters: $5 operation, $6 queue; $7 limit.

-- name: list_runs_of_tenant
-- One tenant, any state: runs_tenant_created_idx.
SELECT r.tenant, r.run_id, r.operation, j.queue, r.state, j.state AS job_state, j.attempts, j.max_attempts,
       j.last_error_code, r.scheduled_at, r.parent_run_id, r.replay_of, r.created_at, r.updated_at
FROM runs r JOIN jobs j ON j.tenant = r.tenant AND j.run_id = r.run_id
WHERE r.tenant = $1
  AND (r.created_at, r.run_id) < ($2, $3)
  AND r.created_at >= $4
  AND ($5{pg:::text} IS NULL OR r.operation = $5)
  AND ($6{pg:::text} IS NULL OR j.queue = $6)
ORDER BY r.created_at DESC, r.run_id DESC
LIMIT $7

-- name: list_runs_of_tenant_in_state
-- One tenant, one state ($8): runs_tenant_state_created_idx.
SELECT r.tenant, r.run_id, r.operation, j.queue, r.state, j.state AS job_state, j.attempts, j.max_attempts,
       j.last_error_code, r.scheduled_at, r.parent_run_id, r.replay_of, r.created_at, r.updated_at
FROM runs r JOIN jobs j ON j.tenant = r.tenant AND j.run_id = r.run_id
WHERE r.tenant = $1 AND r.state = $8
  AND (r.created_at, r.run_id) < ($2, $3)
  AND r.created_at >= $4
  AND ($5{pg:::text} IS NULL OR r.operation = $5)
  AND ($6{pg:::text} IS NULL OR j.queue = $6)
ORDER BY r.created_at DESC, r.run_id DESC
LIMIT $7

-- name: list_runs_of_all_tenants
-- Every tenant (operators), optionally one state ($8): runs_created_idx.
-- The per-tenant queries ignore $9 (their tenant is fixed).
-- Called with $1 NULL; the tenant filter only keeps the three queries'
-- parameters alike.
SELECT r.tenant, r.run_id, r.operation, j.queue, r.state, j.state AS job_state, j.attempts, j.max_attempts,
       j.last_error_code, r.scheduled_at, r.parent_run_id, r.replay_of, r.created_at, r.updated_at
FROM runs r JOIN jobs j ON j.tenant = r.tenant AND j.run_id = r.run_id
WHERE ($1{pg:::text} IS NULL OR r.tenant = $1)
  AND (r.created_at, r.run_id, r.tenant) < ($2, $3, $9)
  AND r.created_at >= $4
  AND ($5{pg:::text} IS NULL OR r.operation = $5)
  AND ($6{pg:::text} IS NULL OR j.queue = $6)
  AND ($8{pg:::text} IS NULL OR r.state = $8)
ORDER BY r.created_at DESC, r.run_id DESC, r.tenant DESC
LIMIT $7

-- name: get_run_summary
-- One run as list_runs shows it.
SELECT r.tenant, r.run_id, r.operation, j.queue, r.state, j.state AS job_state, j.attempts, j.max_attempts,
       j.last_error_code, r.scheduled_at, r.parent_run_id, r.replay_of, r.created_at, r.updated_at
FROM runs r JOIN jobs j ON j.tenant = r.tenant AND j.run_id = r.run_id
WHERE r.tenant = $1 AND r.run_id = $2

-- name: list_child_runs
-- The runs whose parent is ($1, $2), oldest first (runs_parent_idx).
SELECT r.tenant, r.run_id, r.operation, j.queue, r.state, j.state AS job_state, j.attempts, j.max_attempts,
       j.last_error_code, r.scheduled_at, r.parent_run_id, r.replay_of, r.created_at, r.updated_at
FROM runs r JOIN jobs j ON j.tenant = r.tenant AND j.run_id = r.run_id
WHERE r.tenant = $1 AND r.parent_run_id = $2
ORDER BY r.created_at, r.run_id
