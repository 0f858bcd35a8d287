-- `ferry doctor`: the failure investigations as queries, the jobs' side
-- and the relay's. Each returns rows of (subject TEXT, detail TEXT).

-- name: doctor_duplicate_acceptances [postgres]
-- Runs with the same tenant, operation and request: one idempotency scope
-- accepted twice (a key reused after expiry, or keys generated per retry).
-- Runs scheduled for different instants (a periodic schedule's ticks) or
-- following different parents are different requests.
SELECT tenant || '/' || operation AS subject,
       count(*)::text || ' runs with one request: ' || string_agg(run_id::text, ', ' ORDER BY created_at) AS detail
FROM runs
WHERE replay_of IS NULL
GROUP BY tenant, operation, request, scheduled_at, parent_run_id
HAVING count(*) > 1
LIMIT $1

-- name: doctor_duplicate_acceptances [sqlite]
-- Runs with the same tenant, operation and request: one idempotency scope
-- accepted twice (a key reused after expiry, or keys generated per retry).
-- Runs scheduled for different instants (a periodic schedule's ticks) or
-- following different parents are different requests.
SELECT tenant || '/' || operation AS subject,
       count(*) || ' runs with one request: ' || group_concat(lower(hex(run_id)), ', ') AS detail
FROM runs
WHERE replay_of IS NULL
GROUP BY tenant, operation, request, scheduled_at, parent_run_id
HAVING count(*) > 1
LIMIT $1

-- name: doctor_effect_provider_refs [postgres]
-- One run's operation recorded with several provider refs: the external call
-- was made more than once.
SELECT tenant || '/' || run_id::text || '/' || operation AS subject,
       string_agg(DISTINCT provider_ref, ', ') AS detail
FROM effects
WHERE provider_ref IS NOT NULL
GROUP BY tenant, run_id, operation
HAVING count(DISTINCT provider_ref) > 1
LIMIT $1

-- name: doctor_effect_provider_refs [sqlite]
-- One run's operation recorded with several provider refs: the external call
-- was made more than once.
SELECT tenant || '/' || lower(hex(run_id)) || '/' || operation AS subject,
       group_concat(DISTINCT provider_ref) AS detail
FROM effects
WHERE provider_ref IS NOT NULL
GROUP BY tenant, run_id, operation
HAVING count(DISTINCT provider_ref) > 1
LIMIT $1

-- name: doctor_multiple_terminal_events [postgres]
SELECT tenant || '/' || run_id::text AS subject, string_agg(kind || '@' || seq::text, ', ' ORDER BY seq) AS detail
FROM run_events
WHERE kind IN ('run_succeeded', 'run_failed', 'run_cancelled')
GROUP BY tenant, run_id
HAVING count(*) > 1
LIMIT $1

-- name: doctor_multiple_terminal_events [sqlite]
SELECT tenant || '/' || lower(hex(run_id)) AS subject, group_concat(kind || '@' || seq, ', ') AS detail
FROM run_events
WHERE kind IN ('run_succeeded', 'run_failed', 'run_cancelled')
GROUP BY tenant, run_id
HAVING count(*) > 1
LIMIT $1

-- name: doctor_stale_completions [postgres]
-- A completion recorded by an attempt whose generation is not the job's current one.
SELECT a.tenant || '/' || a.run_id::text AS subject,
       'attempt ' || a.attempt::text || ' (generation ' || a.generation::text || ', ' || a.worker || ') succeeded; current generation ' || j.lease_generation::text AS detail
FROM job_attempts a JOIN jobs j ON j.tenant = a.tenant AND j.run_id = a.run_id
WHERE a.outcome = 'succeeded' AND a.generation <> j.lease_generation
LIMIT $1

-- name: doctor_stale_completions [sqlite]
-- A completion recorded by an attempt whose generation is not the job's current one.
SELECT a.tenant || '/' || lower(hex(a.run_id)) AS subject,
       'attempt ' || a.attempt || ' (generation ' || a.generation || ', ' || a.worker || ') succeeded; current generation ' || j.lease_generation AS detail
FROM job_attempts a JOIN jobs j ON j.tenant = a.tenant AND j.run_id = a.run_id
WHERE a.outcome = 'succeeded' AND a.generation <> j.lease_generation
LIMIT $1

-- name: doctor_lease_expiry [postgres]
-- How leases sit against the database clock.
SELECT 'leased jobs' AS subject,
       count(*)::text || ' leased; ' ||
       count(*) FILTER (WHERE lease_expires_at <= {now $1})::text || ' past expiry; ' ||
       count(*) FILTER (WHERE lease_expires_at > {now $1} + 86400000)::text || ' expiring more than a day ahead' AS detail
FROM jobs WHERE state = 'leased'

-- name: doctor_lease_expiry [sqlite]
-- How leases sit against the database clock.
SELECT 'leased jobs' AS subject,
       count(*) || ' leased; ' ||
       count(*) FILTER (WHERE lease_expires_at <= {now $1}) || ' past expiry; ' ||
       count(*) FILTER (WHERE lease_expires_at > {now $1} + 86400000) || ' expiring more than a day ahead' AS detail
FROM jobs WHERE state = 'leased'

-- name: doctor_unreclaimed_leases [postgres]
-- Leased past expiry by more than $2 ms while still claimable: no worker serves the queue.
SELECT tenant || '/' || run_id::text AS subject,
       'queue ' || queue || ', expired ' || (({now $1} - lease_expires_at) / 1000)::text || ' s ago, owner ' || COALESCE(lease_owner, '-') AS detail
FROM jobs
WHERE state = 'leased' AND attempts < max_attempts
  AND lease_expires_at <= {now $1} - $2
ORDER BY lease_expires_at
LIMIT $3

-- name: doctor_unreclaimed_leases [sqlite]
-- Leased past expiry by more than $2 ms while still claimable: no worker serves the queue.
SELECT tenant || '/' || lower(hex(run_id)) AS subject,
       'queue ' || queue || ', expired ' || (({now $1} - lease_expires_at) / 1000) || ' s ago, owner ' || COALESCE(lease_owner, '-') AS detail
FROM jobs
WHERE state = 'leased' AND attempts < max_attempts
  AND lease_expires_at <= {now $1} - $2
ORDER BY lease_expires_at
LIMIT $3

-- name: doctor_exhausted_unterminated [postgres]
SELECT tenant || '/' || run_id::text AS subject,
       'queue ' || queue || ', ' || state || ', attempts ' || attempts::text || '/' || max_attempts::text AS detail
FROM jobs
WHERE state IN ('queued', 'leased') AND attempts >= max_attempts
  AND available_at <= {now $1}
LIMIT $2

-- name: doctor_exhausted_unterminated [sqlite]
SELECT tenant || '/' || lower(hex(run_id)) AS subject,
       'queue ' || queue || ', ' || state || ', attempts ' || attempts || '/' || max_attempts AS detail
FROM jobs
WHERE state IN ('queued', 'leased') AND attempts >= max_attempts
  AND available_at <= {now $1}
LIMIT $2

-- name: doctor_outbox_dead_groups [postgres]
-- Dead rows by tenant and topic, the largest groups first, with their
-- error codes (on outbox_dead_idx).
SELECT tenant || '/' || topic AS subject,
       count(*)::text || ' dead rows (' || COALESCE(string_agg(DISTINCT last_error, ', '), 'no error code') || ')' AS detail
FROM outbox
WHERE state = 'dead'
GROUP BY tenant, topic
ORDER BY count(*) DESC, tenant, topic
LIMIT $1

-- name: doctor_outbox_dead_groups [sqlite]
-- Dead rows by tenant and topic, the largest groups first, with their
-- error codes (on outbox_dead_idx).
SELECT tenant || '/' || topic AS subject,
       count(*) || ' dead rows (' || COALESCE(group_concat(DISTINCT last_error), 'no error code') || ')' AS detail
FROM outbox
WHERE state = 'dead'
GROUP BY tenant, topic
ORDER BY count(*) DESC, tenant, topic
LIMIT $1

-- name: doctor_unowned_lanes
-- Lanes holding pending rows whose lease is not live at $1: no relay polls
-- them. Rows the delivered-ranges ledger covers are left out (fragments
-- borrowed from the library's sql/outbox_delivered.sql): with an empty
-- ledger a count per lane on outbox_pending_idx (one leg, the statement
-- as before the ledger), else in the ledger's gaps (the other).
SELECT 'lane ' || b.lane{pg:::text} AS subject,
       b.pending{pg:::text} || ' pending rows wait, the oldest for ' || (({now $1} - b.oldest) / 1000){pg:::text} || ' s; ' ||
       CASE WHEN b.owner IS NULL OR b.lease_expires_at IS NULL THEN 'no relay holds the lane'
            ELSE 'the lease of ' || b.owner || ' expired ' || (({now $1} - b.lease_expires_at) / 1000){pg:::text} || ' s ago' END AS detail
FROM (SELECT l.lane, l.owner, l.lease_expires_at, count(*) AS pending, min(o.created_at) AS oldest
      FROM relay_lanes l
      JOIN outbox o ON o.lane = l.lane AND o.state = 'pending'
      WHERE (l.owner IS NULL OR l.lease_expires_at IS NULL OR l.lease_expires_at <= {now $1})
        AND {use outbox_ledger_empty}
      GROUP BY l.lane, l.owner, l.lease_expires_at
      UNION ALL
      SELECT l.lane, l.owner, l.lease_expires_at, count(*), min(p.created_at)
      FROM relay_lanes l
      JOIN {use outbox_gap_rows} p ON p.lane = l.lane
      WHERE l.owner IS NULL OR l.lease_expires_at IS NULL OR l.lease_expires_at <= {now $1}
      GROUP BY l.lane, l.owner, l.lease_expires_at) b
ORDER BY b.lane
LIMIT $2
