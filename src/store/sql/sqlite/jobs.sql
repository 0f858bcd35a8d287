-- Jobs, leases and attempt history (SQLite).
-- Fenced statements take $1 tenant, $2 run_id, $3 owner, $4 generation, $5 now
-- and match only `state = 'leased' AND owner AND generation AND lease_expires_at > now`.

-- name: insert_job
INSERT INTO jobs (tenant, run_id, queue, state, available_at, max_attempts, deadline_at, created_at, updated_at)
VALUES ($1, $2, $3, 'queued', $4, $5, $6, $7, $7)

-- name: claim_jobs
-- Eligible: due, under the attempt budget, and queued or leased past expiry.
-- The lease ends at now + $5 or the run's deadline, whichever comes first.
-- SQLite has one writer (BEGIN IMMEDIATE), so no SKIP LOCKED is needed; the
-- caller writes the attempt rows and reads the run data.
UPDATE jobs
SET state = 'leased',
    lease_owner = $4,
    -- Never past the run's deadline, exactly like renew_lease.
    lease_expires_at = MIN(COALESCE($2, CAST(unixepoch('subsec') * 1000 AS INTEGER)) + $5,
                           COALESCE(deadline_at, 9223372036854775807)),
    available_at = MIN(COALESCE($2, CAST(unixepoch('subsec') * 1000 AS INTEGER)) + $5,
                       COALESCE(deadline_at, 9223372036854775807)),
    lease_generation = lease_generation + 1,
    attempts = attempts + 1,
    updated_at = COALESCE($2, CAST(unixepoch('subsec') * 1000 AS INTEGER))
WHERE (tenant, run_id) IN (
    SELECT tenant, run_id FROM jobs
    WHERE queue = $1
      AND state IN ('queued', 'leased')
      AND available_at <= COALESCE($2, CAST(unixepoch('subsec') * 1000 AS INTEGER))
      AND attempts < max_attempts
      AND (deadline_at IS NULL OR deadline_at > COALESCE($2, CAST(unixepoch('subsec') * 1000 AS INTEGER)))
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
SET lease_expires_at = MIN(COALESCE($5, CAST(unixepoch('subsec') * 1000 AS INTEGER)) + $6,
                             COALESCE(deadline_at, 9223372036854775807)),
    available_at = MIN(COALESCE($5, CAST(unixepoch('subsec') * 1000 AS INTEGER)) + $6,
                         COALESCE(deadline_at, 9223372036854775807)),
    updated_at = COALESCE($5, CAST(unixepoch('subsec') * 1000 AS INTEGER))
WHERE tenant = $1 AND run_id = $2 AND state = 'leased' AND lease_owner = $3 AND lease_generation = $4
  AND lease_expires_at > COALESCE($5, CAST(unixepoch('subsec') * 1000 AS INTEGER))
  AND (deadline_at IS NULL OR deadline_at > COALESCE($5, CAST(unixepoch('subsec') * 1000 AS INTEGER)))
RETURNING lease_expires_at, updated_at AS now

-- name: lock_fence
-- BEGIN IMMEDIATE holds the write lock for the rest of the transaction, so no
-- claim can move the generation between this check and the writes it guards.
SELECT COALESCE($5, CAST(unixepoch('subsec') * 1000 AS INTEGER)) AS now, attempts
FROM jobs
WHERE tenant = $1 AND run_id = $2 AND state = 'leased' AND lease_owner = $3 AND lease_generation = $4
  AND lease_expires_at > COALESCE($5, CAST(unixepoch('subsec') * 1000 AS INTEGER))

-- name: finish_job
-- Fenced: ends the lease with state $6 (queued for a retry, or terminal),
-- available at $7 (retries) and error code $8.
UPDATE jobs
SET state = $6,
    available_at = COALESCE($7, available_at),
    lease_owner = NULL,
    lease_expires_at = NULL,
    last_error_code = $8,
    updated_at = COALESCE($5, CAST(unixepoch('subsec') * 1000 AS INTEGER))
WHERE tenant = $1 AND run_id = $2 AND state = 'leased' AND lease_owner = $3 AND lease_generation = $4
  AND lease_expires_at > COALESCE($5, CAST(unixepoch('subsec') * 1000 AS INTEGER))
RETURNING attempts, max_attempts, created_at, updated_at AS now

-- name: close_lost_attempts
-- SQLite's half of claim_jobs: closes attempts whose lease expired unreported.
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
       COALESCE($3, CAST(unixepoch('subsec') * 1000 AS INTEGER)) AS now
FROM jobs j JOIN runs r ON r.tenant = j.tenant AND r.run_id = j.run_id
WHERE j.tenant = $1 AND j.run_id = $2

-- name: cancel_job
-- Makes a live job unclaimable. The caller closes the open attempt, if any.
UPDATE jobs
SET state = 'cancelled', lease_owner = NULL, lease_expires_at = NULL, last_error_code = 'cancelled',
    updated_at = COALESCE($3, CAST(unixepoch('subsec') * 1000 AS INTEGER))
WHERE tenant = $1 AND run_id = $2 AND state IN ('queued', 'leased')
RETURNING lease_generation, updated_at AS now

-- name: release_job
-- Fenced: gives a job back on graceful shutdown without spending its attempt.
UPDATE jobs
SET state = 'queued',
    available_at = COALESCE($5, CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    attempts = attempts - 1,
    lease_owner = NULL,
    lease_expires_at = NULL,
    updated_at = COALESCE($5, CAST(unixepoch('subsec') * 1000 AS INTEGER))
WHERE tenant = $1 AND run_id = $2 AND state = 'leased' AND lease_owner = $3 AND lease_generation = $4
  AND lease_expires_at > COALESCE($5, CAST(unixepoch('subsec') * 1000 AS INTEGER))
RETURNING updated_at AS now

-- name: exhausted_jobs
-- Due jobs nobody may work any more: the last attempt's lease expired (the
-- worker vanished), or the run's deadline passed.
SELECT tenant, run_id, lease_generation, attempts
FROM jobs
WHERE queue = $1 AND state IN ('queued', 'leased')
  AND available_at <= COALESCE($2, CAST(unixepoch('subsec') * 1000 AS INTEGER))
  AND (attempts >= max_attempts OR deadline_at <= COALESCE($2, CAST(unixepoch('subsec') * 1000 AS INTEGER)))
ORDER BY available_at
LIMIT $3

-- name: expire_job
-- Terminalizes a job found by exhausted_jobs, if it is still unchanged.
UPDATE jobs
SET state = 'dead', lease_owner = NULL, lease_expires_at = NULL,
    last_error_code = CASE WHEN deadline_at <= COALESCE($4, CAST(unixepoch('subsec') * 1000 AS INTEGER)) THEN 'deadline_exceeded' ELSE 'lease_expired' END,
    updated_at = COALESCE($4, CAST(unixepoch('subsec') * 1000 AS INTEGER))
WHERE tenant = $1 AND run_id = $2 AND state IN ('queued', 'leased') AND lease_generation = $3
  AND available_at <= COALESCE($4, CAST(unixepoch('subsec') * 1000 AS INTEGER))
RETURNING attempts, updated_at AS now, last_error_code

-- name: list_dead
SELECT j.tenant, j.run_id, j.queue, j.last_error_code, j.attempts, j.updated_at, r.operation
FROM jobs j JOIN runs r ON r.tenant = j.tenant AND r.run_id = j.run_id
WHERE j.tenant = $1 AND j.state = 'dead' AND ($2 IS NULL OR j.last_error_code = $2)
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
