-- ferry_queues: per-queue settings the claim enforces (pause, limits, the
-- token bucket), and whether the queue's run events go to Kafka
-- (publish_events, read where events are written). Changed only by the
-- audited operator calls in queues.rs.

-- name: set_queue_paused
-- Pauses ($2 true) or resumes queue $1, creating its row when it has none.
INSERT INTO ferry_queues (queue, paused, updated_at)
VALUES ($1, $2, {now $3})
ON CONFLICT (queue) DO UPDATE SET paused = excluded.paused, updated_at = excluded.updated_at
RETURNING updated_at

-- name: set_queue_publish_events
-- Sets whether queue $1's run events get outbox rows ($2), creating its row
-- when it has none.
INSERT INTO ferry_queues (queue, publish_events, updated_at)
VALUES ($1, $2, {now $3})
ON CONFLICT (queue) DO UPDATE SET publish_events = excluded.publish_events, updated_at = excluded.updated_at
RETURNING updated_at

-- name: set_queue_limits
-- Sets queue $1's limits ($2 max leased, $3 per tenant, $4 burst, $5 refill
-- interval ms; NULL is no limit), keeping paused. A new row, or a row that
-- had no rate, starts with a full bucket; an unchanged rate keeps the
-- bucket as it is, and a changed one keeps the tokens left, at most the new
-- burst (so every process applying its limits at startup refills nothing).
-- Settings identical to the row's change nothing and return no row.
INSERT INTO ferry_queues (queue, max_leased, max_leased_per_tenant, rate_burst, rate_interval_ms, tokens,
                          refilled_at, updated_at)
VALUES ($1, $2, $3, $4, $5, COALESCE($4, 0), {now $6}, {now $6})
ON CONFLICT (queue) DO UPDATE
SET max_leased = excluded.max_leased,
    max_leased_per_tenant = excluded.max_leased_per_tenant,
    rate_burst = excluded.rate_burst,
    rate_interval_ms = excluded.rate_interval_ms,
    tokens = CASE WHEN ferry_queues.rate_burst IS NULL THEN excluded.tokens
                  WHEN ferry_queues.rate_burst IS NOT DISTINCT FROM excluded.rate_burst
                       AND ferry_queues.rate_interval_ms IS NOT DISTINCT FROM excluded.rate_interval_ms
                      THEN ferry_queues.tokens
                  ELSE {least}(ferry_queues.tokens, excluded.tokens) END,
    refilled_at = CASE WHEN ferry_queues.rate_burst IS NULL THEN excluded.refilled_at
                       ELSE ferry_queues.refilled_at END,
    updated_at = excluded.updated_at
WHERE ferry_queues.max_leased IS DISTINCT FROM excluded.max_leased
   OR ferry_queues.max_leased_per_tenant IS DISTINCT FROM excluded.max_leased_per_tenant
   OR ferry_queues.rate_burst IS DISTINCT FROM excluded.rate_burst
   OR ferry_queues.rate_interval_ms IS DISTINCT FROM excluded.rate_interval_ms
RETURNING updated_at

-- name: list_queues
-- Every queue with settings, with its live leases and due backlog.
SELECT g.queue, g.paused, g.publish_events, g.max_leased, g.max_leased_per_tenant, g.rate_burst, g.rate_interval_ms, g.tokens,
       g.updated_at,
       (SELECT count(*) FROM jobs j
        WHERE j.queue = g.queue AND j.state = 'leased' AND j.lease_expires_at > {now $1}) AS leased
FROM ferry_queues g
ORDER BY g.queue
