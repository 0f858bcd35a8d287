-- ferry_queues: per-queue settings the claim enforces (pause, limits, the
-- token bucket). Changed only by the audited operator calls in queues.rs.

-- name: set_queue_paused
-- Pauses ($2 true) or resumes queue $1, creating its row when it has none.
INSERT INTO ferry_queues (queue, paused, updated_at)
VALUES ($1, $2, {now $3})
ON CONFLICT (queue) DO UPDATE SET paused = excluded.paused, updated_at = excluded.updated_at
RETURNING updated_at

-- name: set_queue_limits
-- Sets queue $1's limits ($2 max leased, $3 per tenant, $4 burst, $5 refill
-- interval ms; NULL is no limit) and fills its token bucket, keeping paused.
INSERT INTO ferry_queues (queue, max_leased, max_leased_per_tenant, rate_burst, rate_interval_ms, tokens,
                          refilled_at, updated_at)
VALUES ($1, $2, $3, $4, $5, COALESCE($4, 0), {now $6}, {now $6})
ON CONFLICT (queue) DO UPDATE
SET max_leased = excluded.max_leased,
    max_leased_per_tenant = excluded.max_leased_per_tenant,
    rate_burst = excluded.rate_burst,
    rate_interval_ms = excluded.rate_interval_ms,
    tokens = excluded.tokens,
    refilled_at = excluded.refilled_at,
    updated_at = excluded.updated_at
RETURNING updated_at

-- name: list_queues
-- Every queue with settings, with its live leases and due backlog.
SELECT g.queue, g.paused, g.max_leased, g.max_leased_per_tenant, g.rate_burst, g.rate_interval_ms, g.tokens,
       g.updated_at,
       (SELECT count(*) FROM jobs j
        WHERE j.queue = g.queue AND j.state = 'leased' AND j.lease_expires_at > {now $1}) AS leased
FROM ferry_queues g
ORDER BY g.queue
