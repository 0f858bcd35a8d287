-- Priorities with aging, and per-queue settings the claim enforces
-- (pause, concurrency limits, a token-bucket rate limit). See the
-- PostgreSQL migration of the same name for the reasoning; SQLite can only
-- add a VIRTUAL generated column, which it indexes just the same.
ALTER TABLE jobs ADD COLUMN priority INTEGER NOT NULL DEFAULT 0
    CONSTRAINT jobs_priority_check CHECK (priority BETWEEN 0 AND 100);
ALTER TABLE jobs ADD COLUMN priority_lead INTEGER NOT NULL DEFAULT 0
    CONSTRAINT jobs_priority_lead_check CHECK (priority_lead >= 0);
ALTER TABLE jobs ADD COLUMN claim_key INTEGER GENERATED ALWAYS AS (available_at - priority_lead) VIRTUAL;

CREATE INDEX jobs_claim_idx ON jobs (queue, claim_key) WHERE state IN ('queued', 'leased');
DROP INDEX jobs_claimable_idx;

CREATE INDEX jobs_leased_idx ON jobs (queue, tenant, lease_expires_at) WHERE state = 'leased';

CREATE TABLE ferry_queues (
    queue                 TEXT    NOT NULL,
    paused                BOOLEAN NOT NULL DEFAULT FALSE,
    max_leased            INTEGER,
    max_leased_per_tenant INTEGER,
    rate_burst            INTEGER,
    rate_interval_ms      INTEGER,
    tokens                INTEGER NOT NULL DEFAULT 0,
    refilled_at           INTEGER NOT NULL DEFAULT 0,
    updated_at            INTEGER NOT NULL,
    CONSTRAINT ferry_queues_pkey PRIMARY KEY (queue),
    CONSTRAINT ferry_queues_limits_check CHECK (
        (max_leased IS NULL OR max_leased >= 1)
        AND (max_leased_per_tenant IS NULL OR max_leased_per_tenant >= 1)
        AND ((rate_burst IS NULL) = (rate_interval_ms IS NULL))
        AND (rate_burst IS NULL OR (rate_burst >= 1 AND rate_interval_ms >= 1))
        AND tokens >= 0
    )
);
