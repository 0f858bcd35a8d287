-- Priorities with aging, and per-queue settings the claim enforces
-- (pause, concurrency limits, a token-bucket rate limit).
--
-- priority: 0 (default) to 100, higher first. priority_lead is how far
-- ahead of its available_at the job sorts: priority × the aging step the
-- accepting process used (FerryBuilder::priority_aging). The claim orders by
-- claim_key = available_at - priority_lead, so a job of priority p goes
-- ahead of lower ones unless they have waited p steps longer (linear aging).
-- claim_key is generated, so every statement that moves available_at
-- (claim, renew, retry, release) keeps it consistent without naming it.
ALTER TABLE jobs ADD COLUMN priority SMALLINT NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN priority_lead BIGINT NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD CONSTRAINT jobs_priority_check CHECK (priority BETWEEN 0 AND 100 AND priority_lead >= 0);
ALTER TABLE jobs ADD COLUMN claim_key BIGINT GENERATED ALWAYS AS (available_at - priority_lead) STORED;

-- The claim index: due jobs are those with claim_key <= now (a lead is never
-- negative) and available_at <= now; the second is checked on the rows the
-- index yields. It replaces jobs_claimable_idx (queue, available_at).
CREATE INDEX jobs_claim_idx ON jobs (queue, claim_key) WHERE state IN ('queued', 'leased');
DROP INDEX jobs_claimable_idx;

-- Counting a limited queue's live leases (per tenant) without walking its backlog.
CREATE INDEX jobs_leased_idx ON jobs (queue, tenant, lease_expires_at) WHERE state = 'leased';

-- One row per queue that has settings; a queue without a row is open and
-- unlimited. Changed only through Ferry::pause_queue / resume_queue /
-- set_queue_limits, each audited in ferry_audit in the same transaction.
CREATE TABLE ferry_queues (
    queue                 TEXT    NOT NULL,
    -- A paused queue's jobs are not claimed; leases already taken run on.
    paused                BOOLEAN NOT NULL DEFAULT FALSE,
    -- At most this many unexpired leases in the queue at once.
    max_leased            INTEGER,
    -- At most this many unexpired leases per tenant in the queue.
    max_leased_per_tenant INTEGER,
    -- Token bucket: one token per rate_interval_ms, at most rate_burst
    -- stored; each claimed job takes one. refilled_at keeps the part of an
    -- interval not yet worth a token.
    rate_burst            INTEGER,
    rate_interval_ms      BIGINT,
    tokens                BIGINT  NOT NULL DEFAULT 0,
    refilled_at           BIGINT  NOT NULL DEFAULT 0,
    updated_at            BIGINT  NOT NULL,
    CONSTRAINT ferry_queues_pkey PRIMARY KEY (queue),
    CONSTRAINT ferry_queues_limits_check CHECK (
        (max_leased IS NULL OR max_leased >= 1)
        AND (max_leased_per_tenant IS NULL OR max_leased_per_tenant >= 1)
        AND ((rate_burst IS NULL) = (rate_interval_ms IS NULL))
        AND (rate_burst IS NULL OR (rate_burst >= 1 AND rate_interval_ms >= 1))
        AND tokens >= 0
    )
);
