-- Jobs, leases and attempt history.
-- Fenced statements take $1 tenant, $2 run_id, $3 owner, $4 generation, $5 now
-- and match only `state = 'leased' AND owner AND generation AND lease_expires_at > now`.

-- name: insert_job
INSERT INTO jobs (tenant, run_id, queue, state, available_at, max_attempts, deadline_at, created_at, updated_at)
VALUES ($1, $2, $3, 'queued', $4, $5, $6, $7, $7)

-- name: claim_jobs [postgres]
-- Eligible: due, under the attempt budget, and queued or leased past expiry.
-- The lease ends at now + $5 or the run's deadline, whichever comes first.
-- A leased job keeps available_at = lease_expires_at, so one index serves both.
WITH clock AS (
    SELECT {now $2} AS at
), picked AS (
    SELECT j.tenant, j.run_id
    FROM jobs j, clock
    WHERE j.queue = $1
      AND j.state IN ('queued', 'leased')
      AND j.available_at <= clock.at
      AND j.attempts < j.max_attempts
      AND (j.deadline_at IS NULL OR j.deadline_at > clock.at)
    ORDER BY j.available_at
    LIMIT $3
    FOR UPDATE OF j SKIP LOCKED
), claimed AS (
    UPDATE jobs j
    SET state = 'leased',
        lease_owner = $4,
        -- Never past the run's deadline, exactly like renew_lease.
        lease_expires_at = LEAST(clock.at + $5, COALESCE(j.deadline_at, 9223372036854775807)),
        available_at = LEAST(clock.at + $5, COALESCE(j.deadline_at, 9223372036854775807)),
        lease_generation = j.lease_generation + 1,
        attempts = j.attempts + 1,
        updated_at = clock.at
    FROM picked, clock
    WHERE j.tenant = picked.tenant AND j.run_id = picked.run_id
    RETURNING j.tenant, j.run_id, j.queue, j.lease_owner, j.lease_generation, j.attempts, j.max_attempts,
              j.lease_expires_at, j.deadline_at, j.created_at, j.updated_at
), attempts AS (
    INSERT INTO job_attempts (tenant, run_id, attempt, generation, worker, claimed_at)
    SELECT tenant, run_id, attempts, lease_generation, lease_owner, updated_at FROM claimed
), lost AS (
    -- A reclaimed expired lease: its attempt ended without a word from its worker.
    UPDATE job_attempts a
    SET finished_at = c.updated_at, outcome = 'lost'
    FROM claimed c
    WHERE a.tenant = c.tenant AND a.run_id = c.run_id AND a.generation < c.lease_generation AND a.finished_at IS NULL
)
SELECT c.tenant, c.run_id, c.queue, c.lease_owner, c.lease_generation, c.attempts, c.max_attempts,
       c.lease_expires_at, c.deadline_at, c.created_at, c.updated_at AS claimed_at,
       r.operation, r.request, r.replay_of
FROM claimed c JOIN runs r ON r.tenant = c.tenant AND r.run_id = c.run_id

-- name: claim_jobs [sqlite]
-- Eligible: due, under the attempt budget, and queued or leased past expiry.
-- The lease ends at now + $5 or the run's deadline, whichever comes first.
-- SQLite has one writer (BEGIN IMMEDIATE), so no SKIP LOCKED is needed; the
-- caller writes the attempt rows and reads the run data.
UPDATE jobs
SET state = 'leased',
    lease_owner = $4,
    -- Never past the run's deadline, exactly like renew_lease.
    lease_expires_at = MIN({now $2} + $5,
                           COALESCE(deadline_at, 9223372036854775807)),
    available_at = MIN({now $2} + $5,
                       COALESCE(deadline_at, 9223372036854775807)),
    lease_generation = lease_generation + 1,
    attempts = attempts + 1,
    updated_at = {now $2}
WHERE (tenant, run_id) IN (
    SELECT tenant, run_id FROM jobs
    WHERE queue = $1
      AND state IN ('queued', 'leased')
      AND available_at <= {now $2}
      AND attempts < max_attempts
      AND (deadline_at IS NULL OR deadline_at > {now $2})
    ORDER BY available_at
    LIMIT $3
)
RETURNING tenant, run_id, queue, lease_owner, lease_generation, attempts, max_attempts,
          lease_expires_at, deadline_at, created_at, updated_at AS claimed_at

-- name: insert_attempt
INSERT INTO job_attempts (tenant, run_id, attempt, generation, worker, claimed_at)
VALUES ($1, $2, $3, $4, $5, $6)

-- name: renew_lease
-- Extends the lease by $6 ms, never past the run's deadline. Returns the new
-- expiry and the instant it was computed from, so a worker can place the
-- expiry on its own clock.
UPDATE jobs
SET lease_expires_at = {least}({now $5} + $6,
                             COALESCE(deadline_at, 9223372036854775807)),
    available_at = {least}({now $5} + $6,
                         COALESCE(deadline_at, 9223372036854775807)),
    updated_at = {now $5}
WHERE tenant = $1 AND run_id = $2 AND state = 'leased' AND lease_owner = $3 AND lease_generation = $4
  AND lease_expires_at > {now $5}
  AND (deadline_at IS NULL OR deadline_at > {now $5})
RETURNING lease_expires_at, updated_at AS now

-- name: lock_fence
-- Holds the job row for the rest of the transaction, so no claim can move the
-- generation between this check and the writes it guards.
SELECT {now $5} AS now, attempts
FROM jobs
WHERE tenant = $1 AND run_id = $2 AND state = 'leased' AND lease_owner = $3 AND lease_generation = $4
  AND lease_expires_at > {now $5}
{pg:FOR NO KEY UPDATE}

-- name: finish_job
-- Fenced: ends the lease with state $6 (queued for a retry, or terminal),
-- available at $7 (retries) and error code $8.
UPDATE jobs
SET state = $6,
    available_at = COALESCE($7, available_at),
    lease_owner = NULL,
    lease_expires_at = NULL,
    last_error_code = $8,
    updated_at = {now $5}
WHERE tenant = $1 AND run_id = $2 AND state = 'leased' AND lease_owner = $3 AND lease_generation = $4
  AND lease_expires_at > {now $5}
RETURNING attempts, max_attempts, created_at, updated_at AS now

-- name: close_lost_attempts
-- The `lost` step of claim_jobs as its own statement (SQLite runs it per claim).
UPDATE job_attempts
SET finished_at = $4, outcome = 'lost'
WHERE tenant = $1 AND run_id = $2 AND generation < $3 AND finished_at IS NULL

-- name: close_attempt
-- Attempt rows are keyed by generation ($3): a release gives the attempt
-- number back, so the next claim can reuse it, but never a generation.
UPDATE job_attempts
SET finished_at = $4, outcome = $5, error_class = $6, error_code = $7
WHERE tenant = $1 AND run_id = $2 AND generation = $3 AND finished_at IS NULL

-- name: job_status
SELECT j.state, j.lease_owner, j.lease_generation, j.lease_expires_at, j.deadline_at, j.attempts,
       r.state AS run_state,
       {now $3} AS now
FROM jobs j JOIN runs r ON r.tenant = j.tenant AND r.run_id = j.run_id
WHERE j.tenant = $1 AND j.run_id = $2

-- name: cancel_job
-- Makes a live job unclaimable. The caller closes the open attempt, if any.
UPDATE jobs
SET state = 'cancelled', lease_owner = NULL, lease_expires_at = NULL, last_error_code = 'cancelled',
    updated_at = {now $3}
WHERE tenant = $1 AND run_id = $2 AND state IN ('queued', 'leased')
RETURNING lease_generation, updated_at AS now

-- name: release_job
-- Fenced: gives a job back on graceful shutdown without spending its attempt.
UPDATE jobs
SET state = 'queued',
    available_at = {now $5},
    attempts = attempts - 1,
    lease_owner = NULL,
    lease_expires_at = NULL,
    updated_at = {now $5}
WHERE tenant = $1 AND run_id = $2 AND state = 'leased' AND lease_owner = $3 AND lease_generation = $4
  AND lease_expires_at > {now $5}
RETURNING updated_at AS now

-- name: exhausted_jobs
-- Due jobs nobody may work any more: the last attempt's lease expired (the
-- worker vanished), or the run's deadline passed.
SELECT tenant, run_id, lease_generation, attempts
FROM jobs
WHERE queue = $1 AND state IN ('queued', 'leased')
  AND available_at <= {now $2}
  AND (attempts >= max_attempts OR deadline_at <= {now $2})
ORDER BY available_at
LIMIT $3
{pg:FOR UPDATE SKIP LOCKED}

-- name: expire_job
-- Terminalizes a job found by exhausted_jobs, if it is still unchanged.
UPDATE jobs
SET state = 'dead', lease_owner = NULL, lease_expires_at = NULL,
    last_error_code = CASE WHEN deadline_at <= {now $4} THEN 'deadline_exceeded' ELSE 'lease_expired' END,
    updated_at = {now $4}
WHERE tenant = $1 AND run_id = $2 AND state IN ('queued', 'leased') AND lease_generation = $3
  AND available_at <= {now $4}
RETURNING attempts, updated_at AS now, last_error_code

-- name: list_dead
SELECT j.tenant, j.run_id, j.queue, j.last_error_code, j.attempts, j.updated_at, r.operation
FROM jobs j JOIN runs r ON r.tenant = j.tenant AND r.run_id = j.run_id
WHERE j.tenant = $1 AND j.state = 'dead' AND ($2{pg:::text} IS NULL OR j.last_error_code = $2)
ORDER BY j.updated_at, j.run_id
LIMIT $3

-- name: list_attempts
SELECT attempt, generation, worker, claimed_at, finished_at, outcome, error_class, error_code
FROM job_attempts
WHERE tenant = $1 AND run_id = $2
ORDER BY generation

-- name: get_job
SELECT queue, state, max_attempts, attempts, lease_generation, last_error_code
FROM jobs WHERE tenant = $1 AND run_id = $2

-- name: sweep_attempts
DELETE FROM job_attempts
WHERE (tenant, run_id, generation) IN (
    SELECT tenant, run_id, generation FROM job_attempts
    WHERE finished_at IS NOT NULL AND finished_at <= $1
    LIMIT $2
)

-- name: queued_depth
SELECT count(*) FROM jobs WHERE tenant = $1 AND state = 'queued'

-- name: complete_batch [postgres only]
-- PostgreSQL only: completes many leases in one statement. Each input row is
-- fenced like finish_job; for each completed job the run is compare-and-set
-- to succeeded, the run_succeeded event and its outbox row are written, and
-- the attempt is closed. Returns the completed run ids and whether their run
-- moved (always, unless the schema was tampered with).
WITH input AS (
    SELECT * FROM UNNEST($1::text[], $2::uuid[], $3::text[], $4::bigint[], $5::jsonb[], $6::int[])
        AS i(tenant, run_id, owner, generation, result, lane)
), clock AS (
    SELECT {now $7} AS at
), done AS (
    UPDATE jobs j
    SET state = 'succeeded', lease_owner = NULL, lease_expires_at = NULL, last_error_code = NULL, updated_at = clock.at
    FROM input i, clock
    WHERE j.tenant = i.tenant AND j.run_id = i.run_id AND j.state = 'leased' AND j.lease_owner = i.owner
      AND j.lease_generation = i.generation AND j.lease_expires_at > clock.at
    RETURNING j.tenant, j.run_id, j.lease_generation, i.result, i.lane
), finished AS (
    UPDATE runs r
    SET state = 'succeeded', version = r.version + 1, last_event_seq = r.last_event_seq + 1,
        updated_at = GREATEST(r.updated_at, clock.at)
    FROM done d, clock
    WHERE r.tenant = d.tenant AND r.run_id = d.run_id AND r.state = 'queued'
    RETURNING r.tenant, r.run_id, r.last_event_seq AS seq, d.lease_generation, d.result, d.lane
), events AS (
    INSERT INTO run_events (tenant, run_id, seq, kind, body, created_at)
    SELECT f.tenant, f.run_id, f.seq, 'run_succeeded', jsonb_build_object('result', f.result), clock.at
    FROM finished f, clock
), outbox_rows AS (
    INSERT INTO outbox (tenant, topic, key, lane, payload, headers, effect_key, created_at)
    SELECT f.tenant, $8, f.run_id::text, f.lane,
           convert_to(jsonb_build_object('tenant', f.tenant, 'run_id', f.run_id, 'seq', f.seq, 'kind', 'run_succeeded',
                                         'at', clock.at, 'body', jsonb_build_object('result', f.result))::text, 'UTF8'),
           jsonb_build_object('content-type', 'application/json', 'ferry-event-kind', 'run_succeeded'),
           f.tenant || '/' || f.run_id::text || '/' || f.seq::text,
           clock.at
    FROM finished f, clock
), attempts AS (
    UPDATE job_attempts a
    SET finished_at = clock.at, outcome = 'succeeded'
    FROM finished f, clock
    WHERE a.tenant = f.tenant AND a.run_id = f.run_id AND a.generation = f.lease_generation AND a.finished_at IS NULL
)
SELECT d.run_id, EXISTS (SELECT 1 FROM finished f WHERE f.tenant = d.tenant AND f.run_id = d.run_id) AS moved
FROM done d

-- name: complete_and_claim [postgres only]
-- PostgreSQL only: complete_batch and claim_jobs in ONE statement, so a
-- worker's finished jobs and the next jobs for the freed slots commit
-- together in one round trip. $1..$8 as complete_batch; $9 queue, $10 limit,
-- $11 owner, $12 lease ms, as claim_jobs' $1, $3, $4, $5. One clock for
-- both halves: a lease this statement may complete is unexpired, so the claim
-- half (due rows only) never picks it, and a refused expired lease may be
-- claimed but is never written twice. A run that did not move (the schema was
-- tampered with) fails the whole statement, so nothing commits.
-- Rows: kind 'claimed' (claim_jobs' columns), then kind 'done' (run_id).
WITH input AS (
    SELECT * FROM UNNEST($1::text[], $2::uuid[], $3::text[], $4::bigint[], $5::jsonb[], $6::int[])
        AS i(tenant, run_id, owner, generation, result, lane)
), clock AS (
    SELECT {now $7} AS at
), done AS (
    UPDATE jobs j
    SET state = 'succeeded', lease_owner = NULL, lease_expires_at = NULL, last_error_code = NULL, updated_at = clock.at
    FROM input i, clock
    WHERE j.tenant = i.tenant AND j.run_id = i.run_id AND j.state = 'leased' AND j.lease_owner = i.owner
      AND j.lease_generation = i.generation AND j.lease_expires_at > clock.at
    RETURNING j.tenant, j.run_id, j.lease_generation, i.result, i.lane
), finished AS (
    UPDATE runs r
    SET state = 'succeeded', version = r.version + 1, last_event_seq = r.last_event_seq + 1,
        updated_at = GREATEST(r.updated_at, clock.at)
    FROM done d, clock
    WHERE r.tenant = d.tenant AND r.run_id = d.run_id AND r.state = 'queued'
    RETURNING r.tenant, r.run_id, r.last_event_seq AS seq, d.lease_generation, d.result, d.lane
), events AS (
    INSERT INTO run_events (tenant, run_id, seq, kind, body, created_at)
    SELECT f.tenant, f.run_id, f.seq, 'run_succeeded', jsonb_build_object('result', f.result), clock.at
    FROM finished f, clock
), outbox_rows AS (
    INSERT INTO outbox (tenant, topic, key, lane, payload, headers, effect_key, created_at)
    SELECT f.tenant, $8, f.run_id::text, f.lane,
           convert_to(jsonb_build_object('tenant', f.tenant, 'run_id', f.run_id, 'seq', f.seq, 'kind', 'run_succeeded',
                                         'at', clock.at, 'body', jsonb_build_object('result', f.result))::text, 'UTF8'),
           jsonb_build_object('content-type', 'application/json', 'ferry-event-kind', 'run_succeeded'),
           f.tenant || '/' || f.run_id::text || '/' || f.seq::text,
           clock.at
    FROM finished f, clock
), closed AS (
    UPDATE job_attempts a
    SET finished_at = clock.at, outcome = 'succeeded'
    FROM finished f, clock
    WHERE a.tenant = f.tenant AND a.run_id = f.run_id AND a.generation = f.lease_generation AND a.finished_at IS NULL
), picked AS (
    SELECT j.tenant, j.run_id
    FROM jobs j, clock
    WHERE j.queue = $9
      -- Completes first: `done` runs to its end (waiting for any row it
      -- needs) before this scan locks anything. A row this scan locks and
      -- then skips (claimed meanwhile by a commit newer than the snapshot)
      -- stays locked until commit, so completing after it could deadlock
      -- with another worker's statement doing the same.
      AND (SELECT count(*) FROM done) >= 0
      AND j.state IN ('queued', 'leased')
      AND j.available_at <= clock.at
      AND j.attempts < j.max_attempts
      AND (j.deadline_at IS NULL OR j.deadline_at > clock.at)
    ORDER BY j.available_at
    LIMIT $10
    FOR UPDATE OF j SKIP LOCKED
), claimed AS (
    UPDATE jobs j
    SET state = 'leased',
        lease_owner = $11,
        lease_expires_at = LEAST(clock.at + $12, COALESCE(j.deadline_at, 9223372036854775807)),
        available_at = LEAST(clock.at + $12, COALESCE(j.deadline_at, 9223372036854775807)),
        lease_generation = j.lease_generation + 1,
        attempts = j.attempts + 1,
        updated_at = clock.at
    FROM picked, clock
    WHERE j.tenant = picked.tenant AND j.run_id = picked.run_id
    RETURNING j.tenant, j.run_id, j.queue, j.lease_owner, j.lease_generation, j.attempts, j.max_attempts,
              j.lease_expires_at, j.deadline_at, j.created_at, j.updated_at
), attempts AS (
    INSERT INTO job_attempts (tenant, run_id, attempt, generation, worker, claimed_at)
    SELECT tenant, run_id, attempts, lease_generation, lease_owner, updated_at FROM claimed
), lost AS (
    UPDATE job_attempts a
    SET finished_at = c.updated_at, outcome = 'lost'
    FROM claimed c
    WHERE a.tenant = c.tenant AND a.run_id = c.run_id AND a.generation < c.lease_generation AND a.finished_at IS NULL
)
SELECT 'claimed' AS kind, c.tenant, c.run_id, c.queue, c.lease_owner, c.lease_generation, c.attempts, c.max_attempts,
       c.lease_expires_at, c.deadline_at, c.created_at, c.updated_at AS claimed_at,
       r.operation, r.request, r.replay_of
FROM claimed c JOIN runs r ON r.tenant = c.tenant AND r.run_id = c.run_id
UNION ALL
SELECT 'done', d.tenant, d.run_id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       -- Fails the statement (22P02) if the run did not move.
       CASE WHEN EXISTS (SELECT 1 FROM finished f WHERE f.tenant = d.tenant AND f.run_id = d.run_id) THEN NULL
            ELSE ('ferry invariant: the run of leased job ' || d.run_id::text || ' was already terminal')::bigint END,
       NULL, NULL, NULL
FROM done d

-- name: list_jobs
SELECT j.tenant, j.run_id, j.queue, j.state, j.attempts, j.max_attempts, j.lease_owner, j.last_error_code, j.updated_at
FROM jobs j
WHERE j.tenant = $1 AND ($2{pg:::text} IS NULL OR j.state = $2)
ORDER BY j.updated_at DESC
LIMIT $3
