-- Jobs, leases and attempt history.
-- Fenced statements take $1 tenant, $2 run_id, $3 owner, $4 generation, $5 now
-- and match only `state = 'leased' AND owner AND generation AND lease_expires_at > now`.

-- name: insert_job
-- $8 priority, $9 its lead (priority × the aging step): see claim_key.
INSERT INTO jobs (tenant, run_id, queue, state, available_at, max_attempts, deadline_at, created_at, updated_at,
                  priority, priority_lead)
VALUES ($1, $2, $3, 'queued', $4, $5, $6, $7, $7, $8, $9)

-- name: claim_due [fragment]
-- Eligible (invariant 4) in queue $1 at clock.at (= {now $2}), for `jobs j`:
-- due, under the attempt budget, before the deadline, and queued or leased
-- past expiry (a leased job keeps available_at = lease_expires_at). Claims
-- go in claim_key order (available_at - priority_lead for a queued job:
-- priority first, aged by waiting; plain available_at for a leased one, so
-- a live lease sorts beyond now); a lead is never negative, so
-- `claim_key <= now` bounds the index scan of jobs_claim_idx, and
-- `available_at <= now` is checked on the rows it yields. The bound is written with {now $2}, not clock.at: the
-- planner can only make an index condition of a value it has at the scan
-- (one statement has one clock on both engines, so it is the same instant).
j.queue = $1
      AND j.state IN ('queued', 'leased')
      AND j.claim_key <= {now $2}
      AND j.available_at <= clock.at
      AND j.attempts < j.max_attempts
      AND (j.deadline_at IS NULL OR j.deadline_at > clock.at)

-- name: queue_open [fragment]
-- Queue $1 has no settings row that stops the plain claim: not paused, and
-- no limit (a limited queue is claimed by claim_limited, under its row lock).
NOT EXISTS (
          SELECT 1 FROM ferry_queues g
          WHERE g.queue = $1
            AND (g.paused OR g.max_leased IS NOT NULL OR g.max_leased_per_tenant IS NOT NULL OR g.rate_burst IS NOT NULL))

-- name: claim_writes [fragment]
-- PostgreSQL: leases the rows of CTE `picked` for owner $1 for $2 ms (never
-- past the run's deadline, exactly like renew_lease), writes their attempt
-- rows and closes the attempts of reclaimed expired leases (`lost`).
claimed AS (
    UPDATE jobs j
    SET state = 'leased',
        lease_owner = $1,
        lease_expires_at = LEAST(clock.at + $2, COALESCE(j.deadline_at, 9223372036854775807)),
        available_at = LEAST(clock.at + $2, COALESCE(j.deadline_at, 9223372036854775807)),
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

-- name: claimed_rows [fragment]
-- PostgreSQL: what a claim returns, from CTE `claimed`.
SELECT c.tenant, c.run_id, c.queue, c.lease_owner, c.lease_generation, c.attempts, c.max_attempts,
       c.lease_expires_at, c.deadline_at, c.created_at, c.updated_at AS claimed_at,
       r.operation, r.request, r.replay_of
FROM claimed c JOIN runs r ON r.tenant = c.tenant AND r.run_id = c.run_id

-- name: claim_update_sqlite [fragment]
-- SQLite: leases the rows of CTE `picked` for owner $1 for $2 ms, like
-- claim_writes; SQLite has one writer (BEGIN IMMEDIATE), so no SKIP LOCKED
-- is needed, and the caller writes the attempt rows and reads the run data.
UPDATE jobs
SET state = 'leased',
    lease_owner = $1,
    lease_expires_at = MIN((SELECT at FROM clock) + $2, COALESCE(deadline_at, 9223372036854775807)),
    available_at = MIN((SELECT at FROM clock) + $2, COALESCE(deadline_at, 9223372036854775807)),
    lease_generation = lease_generation + 1,
    attempts = attempts + 1,
    updated_at = (SELECT at FROM clock)
WHERE (tenant, run_id) IN (SELECT tenant, run_id FROM picked)
RETURNING tenant, run_id, queue, lease_owner, lease_generation, attempts, max_attempts,
          lease_expires_at, deadline_at, created_at, updated_at AS claimed_at

-- name: claim_jobs [postgres]
-- Claims up to $3 due jobs of queue $1 for owner $4 for $5 ms, if the queue
-- is open and unlimited (else nothing; see queue_limited).
WITH clock AS (
    SELECT {now $2} AS at
), picked AS (
    SELECT j.tenant, j.run_id
    FROM jobs j, clock
    WHERE {use claim_due $1 $2}
      AND {use queue_open $1}
    ORDER BY j.claim_key
    LIMIT $3
    FOR UPDATE OF j SKIP LOCKED
), {use claim_writes $4 $5}
{use claimed_rows}

-- name: claim_jobs [sqlite]
WITH clock AS (
    SELECT {now $2} AS at
), picked AS (
    SELECT j.tenant, j.run_id
    FROM jobs j, clock
    WHERE {use claim_due $1 $2}
      AND {use queue_open $1}
    ORDER BY j.claim_key
    LIMIT $3
)
{use claim_update_sqlite $4 $5}

-- name: queue_limited
-- Whether queue $1 is open but limited: its claims go through lock_queue
-- and claim_limited.
SELECT 1 FROM ferry_queues
WHERE queue = $1 AND NOT paused
  AND (max_leased IS NOT NULL OR max_leased_per_tenant IS NOT NULL OR rate_burst IS NOT NULL)

-- name: lock_queue
-- Locks queue $1's settings row for the rest of the claim's transaction, so
-- the claims of a limited queue take turns and the leases each one counts
-- are exact, and refills its token bucket by the time passed since
-- refilled_at: one token per rate_interval_ms, at most rate_burst; the part
-- of an interval not yet worth a token is kept (a full bucket keeps none).
UPDATE ferry_queues
SET tokens = CASE WHEN rate_burst IS NULL THEN tokens
                  ELSE {least}(rate_burst, tokens + {greatest}(0, {now $2} - refilled_at) / rate_interval_ms) END,
    refilled_at = CASE WHEN rate_burst IS NULL THEN refilled_at
                       WHEN tokens + {greatest}(0, {now $2} - refilled_at) / rate_interval_ms >= rate_burst
                           THEN {greatest}(refilled_at, {now $2})
                       ELSE refilled_at + ({greatest}(0, {now $2} - refilled_at) / rate_interval_ms) * rate_interval_ms END
WHERE queue = $1
RETURNING paused,
          (max_leased IS NOT NULL OR max_leased_per_tenant IS NOT NULL OR rate_burst IS NOT NULL) AS limited,
          rate_burst IS NOT NULL AS rated, tokens

-- name: in_transaction [postgres only]
-- Whether this connection is in a transaction that has taken a row lock or
-- written: true right after lock_queue took the queue's row inside one,
-- false under autocommit (that statement's transaction has ended, and with
-- it the row lock the limited claim relies on).
SELECT pg_current_xact_id_if_assigned() IS NOT NULL

-- name: spend_tokens
-- Takes $2 tokens from queue $1's bucket (inside lock_queue's transaction).
UPDATE ferry_queues SET tokens = tokens - $2 WHERE queue = $1

-- name: limited_pick [fragment]
-- The CTEs that choose what a limited claim of queue $1 at {now $4} may take, after
-- lock_queue: at most $2 jobs (the caller's limit, already cut to the
-- tokens), at most max_leased unexpired leases in the queue, and at most
-- max_leased_per_tenant per tenant. A tenant at its cap is skipped, not
-- stopped at: its rows are filtered out of the scan, which looks at up to
-- $3 due candidates of the others (a tenant filling its cap within this
-- one claim ends the candidates it gets there).
cap AS (
    SELECT (SELECT max_leased FROM ferry_queues WHERE queue = $1) AS total,
           (SELECT max_leased_per_tenant FROM ferry_queues WHERE queue = $1) AS per_tenant
), leased AS (
    SELECT j.tenant, count(*) AS n
    FROM jobs j, clock
    WHERE j.queue = $1 AND j.state = 'leased' AND j.lease_expires_at > clock.at
    GROUP BY j.tenant
), room AS (
    SELECT {greatest}(0, {least}($2, COALESCE(cap.total - (SELECT COALESCE(sum(n), 0){pg:::bigint} FROM leased), $2))) AS n
    FROM cap
), candidates AS (
    SELECT d.tenant, d.run_id, d.claim_key,
           row_number() OVER (PARTITION BY d.tenant ORDER BY d.claim_key) + COALESCE(l.n, 0) AS nth
    FROM (
        SELECT j.tenant, j.run_id, j.claim_key
        FROM jobs j, clock, cap
        WHERE {use claim_due $1 $4}
          AND (cap.per_tenant IS NULL
               OR NOT EXISTS (SELECT 1 FROM leased l WHERE l.tenant = j.tenant AND l.n >= cap.per_tenant))
        ORDER BY j.claim_key
        LIMIT $3
        {pg:FOR UPDATE OF j SKIP LOCKED}
    ) d LEFT JOIN leased l ON l.tenant = d.tenant
), picked AS (
    SELECT c.tenant, c.run_id
    FROM candidates c, cap
    WHERE cap.per_tenant IS NULL OR c.nth <= cap.per_tenant
    ORDER BY c.claim_key
    LIMIT (SELECT n FROM room)
)

-- name: claim_limited [postgres]
-- Claims in a limited queue, inside lock_queue's transaction: $1 queue,
-- $2 now, $3 limit, $4 owner, $5 lease ms, $6 candidates to scan.
WITH clock AS (
    SELECT {now $2} AS at
), {use limited_pick $1 $3 $6 $2},
{use claim_writes $4 $5}
{use claimed_rows}

-- name: claim_limited [sqlite]
WITH clock AS (
    SELECT {now $2} AS at
), {use limited_pick $1 $3 $6 $2}
{use claim_update_sqlite $4 $5}

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
  AND claim_key <= {now $2}
  AND available_at <= {now $2}
  AND (attempts >= max_attempts OR deadline_at <= {now $2})
ORDER BY claim_key
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
SELECT queue, state, max_attempts, attempts, lease_generation, last_error_code, priority
FROM jobs WHERE tenant = $1 AND run_id = $2

-- name: sweep_attempts
-- Finished attempts at or before $1, found through job_attempts_claimed_idx:
-- an attempt is claimed before it finishes, so claimed_at <= $1 loses none
-- of them, and closing an attempt (which writes finished_at, not indexed)
-- stays a HOT update.
DELETE FROM job_attempts
WHERE (tenant, run_id, generation) IN (
    SELECT tenant, run_id, generation FROM job_attempts
    WHERE claimed_at <= $1 AND finished_at IS NOT NULL AND finished_at <= $1
    LIMIT $2
)

-- name: queued_depth
SELECT count(*) FROM jobs WHERE tenant = $1 AND state = 'queued'

-- name: complete_writes [fragment]
-- PostgreSQL: the CTEs that complete many leases ($1 tenants, $2 run ids,
-- $3 owners, $4 generations, $5 results, $6 outbox lanes, at {now $7}, run
-- events to topic $8). Each input row is fenced like finish_job (`done`:
-- tenant, run id and the generation completed); for each completed job the
-- run is compare-and-set to succeeded (`finished`), the run_succeeded event
-- and its outbox row are written (no outbox row when the job's queue has
-- publish_events off, as insert_event decides), and the attempt is closed
-- (`closed`).
input AS (
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
    RETURNING j.tenant, j.run_id, j.queue, j.lease_generation, i.result, i.lane, 'queued'::text AS run_state
), finished AS (
    -- `r.state = d.run_state`, not `r.state = 'queued'`: with the constant,
    -- statistics taken while few runs were queued made the planner look
    -- each run up through runs_tenant_state_created_idx, reading every
    -- queued run of the tenant per completed job (0.4-2 s per statement of
    -- 100 under a growing backlog, BENCHMARKS.md "The pipeline"). Compared
    -- with a column of a data-modifying CTE, the state's selectivity is no
    -- longer read from the statistics of 'queued' (the planner assumes one
    -- state among the distinct ones), so the unique primary key, which
    -- binds every column, is the cheaper lookup: the state index stays
    -- usable in principle, and pg::a_batch_completion_reads_runs_by_key_
    -- under_stale_statistics checks the planner does not pick it.
    UPDATE runs r
    SET state = 'succeeded', version = r.version + 1, last_event_seq = r.last_event_seq + 1,
        updated_at = GREATEST(r.updated_at, clock.at)
    FROM done d, clock
    WHERE r.tenant = d.tenant AND r.run_id = d.run_id AND r.state = d.run_state
    RETURNING r.tenant, r.run_id, r.last_event_seq AS seq, d.queue, d.lease_generation, d.result, d.lane
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
    WHERE NOT EXISTS (SELECT 1 FROM ferry_queues g WHERE g.queue = f.queue AND NOT g.publish_events)
), closed AS (
    UPDATE job_attempts a
    SET finished_at = clock.at, outcome = 'succeeded'
    FROM finished f, clock
    WHERE a.tenant = f.tenant AND a.run_id = f.run_id AND a.generation = f.lease_generation AND a.finished_at IS NULL
)

-- name: complete_batch [postgres only]
-- PostgreSQL only: completes many leases in one statement (complete_writes).
-- Returns each completed lease (tenant, run id, generation: a batch may hold
-- two leases of one job, or one run id of two tenants) and whether its run
-- moved (always, unless the schema was tampered with).
WITH {use complete_writes $1 $2 $3 $4 $5 $6 $7 $8}
SELECT d.tenant, d.run_id, d.lease_generation,
       EXISTS (SELECT 1 FROM finished f WHERE f.tenant = d.tenant AND f.run_id = d.run_id) AS moved
FROM done d

-- name: complete_and_claim [postgres only]
-- PostgreSQL only: complete_batch and claim_jobs in ONE statement (a paused
-- or limited queue claims nothing here; the worker's claim loop claims it
-- through claim_limited), so a
-- worker's finished jobs and the next jobs for the freed slots commit
-- together in one round trip. $1..$8 as complete_batch; $9 queue, $10 limit,
-- $11 owner, $12 lease ms, as claim_jobs' $1, $3, $4, $5. One clock for
-- both halves: a lease this statement may complete is unexpired, so the claim
-- half (due rows only) never picks it, and a refused expired lease may be
-- claimed but is never written twice. A run that did not move (the schema was
-- tampered with) fails the whole statement, so nothing commits.
-- Rows: kind 'claimed' (claim_jobs' columns), then kind 'done' (tenant,
-- run_id, lease_generation: the lease completed).
WITH {use complete_writes $1 $2 $3 $4 $5 $6 $7 $8}, picked AS (
    SELECT j.tenant, j.run_id
    FROM jobs j, clock
    -- Completes first: `done` runs to its end (waiting for any row it
    -- needs) before this scan locks anything. A row this scan locks and
    -- then skips (claimed meanwhile by a commit newer than the snapshot)
    -- stays locked until commit, so completing after it could deadlock
    -- with another worker's statement doing the same.
    WHERE (SELECT count(*) FROM done) >= 0
      AND {use claim_due $9 $7}
      AND {use queue_open $9}
    ORDER BY j.claim_key
    LIMIT $10
    FOR UPDATE OF j SKIP LOCKED
), {use claim_writes $11 $12}
SELECT 'claimed' AS kind, c.tenant, c.run_id, c.queue, c.lease_owner, c.lease_generation, c.attempts, c.max_attempts,
       c.lease_expires_at, c.deadline_at, c.created_at, c.updated_at AS claimed_at,
       r.operation, r.request, r.replay_of
FROM claimed c JOIN runs r ON r.tenant = c.tenant AND r.run_id = c.run_id
UNION ALL
SELECT 'done', d.tenant, d.run_id, NULL, NULL, d.lease_generation, NULL, NULL, NULL, NULL, NULL,
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

-- name: queue_gauges
-- Per queue with a queued or leased job, at {now $1}: the `available_at` of
-- its oldest due queued job (NULL when none is due) and how many leases
-- expired and were neither reclaimed nor reaped: under the attempt budget
-- (doctor's unreclaimed_leases) or on their last attempt (doctor's
-- exhausted_unterminated); both wait for a claim in the queue. The relay exports them every few seconds, so
-- every step is an index range, never the backlog: the queues come from
-- jobs_claim_idx by a loose index scan (one probe per queue); the oldest due
-- job is found in claim_key order, where a queued job sorts at most its
-- priority lead before its available_at: the head (the first due queued job
-- by claim_key) has some available_at H >= the minimum, and every job whose
-- available_at is the minimum has claim_key <= H, so the minimum lies among
-- the jobs with claim_key <= H (the head's own instant with no priorities,
-- at most the largest lead's window with them; H is taken as the least
-- available_at among the first 64 jobs in claim order, still >= the minimum
-- and so still bounding it, and narrow even when a young high-priority job
-- leads a long backlog); expired leases are counted
-- on jobs_leased_idx, which holds only leased jobs (as many as workers
-- hold, plus the expired ones). `state <> 'leased'` (not `= 'queued'`, the
-- same inside jobs_claim_idx) keeps the planner off jobs_tenant_queued_idx,
-- which it would AND in by reading every queued job's entry.
WITH RECURSIVE queues(queue) AS (
    SELECT min(queue) FROM jobs WHERE state IN ('queued', 'leased')
    UNION ALL
    SELECT (SELECT min(n.queue) FROM jobs n WHERE n.state IN ('queued', 'leased') AND n.queue > queues.queue)
    FROM queues WHERE queues.queue IS NOT NULL
),
heads AS (
    SELECT q.queue,
           (SELECT h.claim_key FROM jobs h
            WHERE h.queue = q.queue AND h.state IN ('queued', 'leased') AND h.state <> 'leased'
              AND h.claim_key <= {now $1} AND h.available_at <= {now $1}
            ORDER BY h.claim_key LIMIT 1) AS head_key,
           (SELECT min(f.available_at) FROM (
                SELECT h.available_at FROM jobs h
                WHERE h.queue = q.queue AND h.state IN ('queued', 'leased') AND h.state <> 'leased'
                  AND h.claim_key <= {now $1} AND h.available_at <= {now $1}
                ORDER BY h.claim_key LIMIT 64) f) AS head_at
    FROM queues q WHERE q.queue IS NOT NULL
)
SELECT g.queue,
       (SELECT min(j.available_at) FROM jobs j
        WHERE j.queue = g.queue AND j.state IN ('queued', 'leased') AND j.state <> 'leased'
          AND j.available_at <= {now $1}
          AND j.claim_key BETWEEN g.head_key AND g.head_at) AS oldest_due,
       (SELECT count(*) FROM jobs l
        WHERE l.queue = g.queue AND l.state = 'leased'
          AND l.lease_expires_at <= {now $1}) AS expired_leases,
       {now $1} AS now
FROM heads g
ORDER BY g.queue

-- name: dead_by_queue
-- Dead jobs per queue (queues with none are absent): a bitmap scan of the
-- partial jobs_dead_idx, so it costs what the dead jobs number, never the
-- finished ones.
SELECT queue, count(*) AS dead FROM jobs WHERE state = 'dead' GROUP BY queue ORDER BY queue
