-- Ferry schema, SQLite (WAL mode). Instants are BIGINT milliseconds since the Unix epoch.
-- Every key starts with tenant (except the relay/consumer coordination tables,
-- which are keyed by lane and by consumer group). Every constraint is named so
-- violations map to domain errors by name.

CREATE TABLE ferry_settings (
    name  TEXT NOT NULL,
    value TEXT NOT NULL,
    CONSTRAINT ferry_settings_pkey PRIMARY KEY (name)
);
INSERT INTO ferry_settings (name, value) VALUES ('outbox_lanes', '64');

CREATE TABLE runs (
    tenant         TEXT   NOT NULL,
    run_id         BLOB   NOT NULL,
    operation      TEXT   NOT NULL,
    state          TEXT   NOT NULL,
    version        BIGINT NOT NULL,
    request        TEXT  NOT NULL,
    deadline_at    BIGINT,
    replay_of      UUID,
    created_at     BIGINT NOT NULL,
    updated_at     BIGINT NOT NULL,
    last_event_seq BIGINT NOT NULL,
    CONSTRAINT runs_pkey PRIMARY KEY (tenant, run_id),
    CONSTRAINT runs_state_check CHECK (state IN ('queued', 'succeeded', 'failed', 'cancelled')),
    CONSTRAINT runs_version_check CHECK (version >= 1),
    CONSTRAINT runs_seq_check CHECK (last_event_seq >= 1),
    CONSTRAINT runs_time_check CHECK (created_at >= 0 AND updated_at >= created_at)
);
CREATE INDEX runs_replay_of_idx ON runs (tenant, replay_of) WHERE replay_of IS NOT NULL;

CREATE TABLE run_events (
    tenant     TEXT   NOT NULL,
    run_id     BLOB   NOT NULL,
    seq        BIGINT NOT NULL,
    kind       TEXT   NOT NULL,
    body       TEXT  NOT NULL,
    created_at BIGINT NOT NULL,
    CONSTRAINT run_events_pkey PRIMARY KEY (tenant, run_id, seq),
    CONSTRAINT run_events_run_fkey FOREIGN KEY (tenant, run_id) REFERENCES runs (tenant, run_id) ON DELETE CASCADE,
    CONSTRAINT run_events_seq_check CHECK (seq >= 1)
);
-- At most one terminal event per run (invariant 6), enforced by the schema as well as the code.
CREATE UNIQUE INDEX run_events_one_terminal_idx ON run_events (tenant, run_id)
    WHERE kind IN ('run_succeeded', 'run_failed', 'run_cancelled');

CREATE TABLE idempotency_keys (
    tenant              TEXT    NOT NULL,
    operation           TEXT    NOT NULL,
    key                 TEXT    NOT NULL,
    request_fingerprint TEXT    NOT NULL,
    fingerprint_version INTEGER NOT NULL,
    run_id              BLOB    NOT NULL,
    created_at          BIGINT  NOT NULL,
    expires_at          BIGINT  NOT NULL,
    CONSTRAINT idempotency_keys_pkey PRIMARY KEY (tenant, operation, key),
    -- Deferred: the key is claimed first, so a racing duplicate writes nothing else.
    CONSTRAINT idempotency_keys_run_fkey FOREIGN KEY (tenant, run_id) REFERENCES runs (tenant, run_id) ON DELETE CASCADE DEFERRABLE INITIALLY DEFERRED,
    CONSTRAINT idempotency_keys_expiry_check CHECK (expires_at >= created_at)
);
CREATE INDEX idempotency_keys_expires_idx ON idempotency_keys (expires_at);

CREATE TABLE jobs (
    tenant           TEXT    NOT NULL,
    run_id           BLOB    NOT NULL,
    queue            TEXT    NOT NULL,
    state            TEXT    NOT NULL,
    -- For a leased job this is kept equal to lease_expires_at, so one partial
    -- index serves both "queued and due" and "leased and expired".
    available_at     BIGINT  NOT NULL,
    lease_owner      TEXT,
    lease_expires_at BIGINT,
    lease_generation BIGINT  NOT NULL DEFAULT 0,
    attempts         INTEGER NOT NULL DEFAULT 0,
    max_attempts     INTEGER NOT NULL,
    deadline_at      BIGINT,
    last_error_code  TEXT,
    created_at       BIGINT  NOT NULL,
    updated_at       BIGINT  NOT NULL,
    CONSTRAINT jobs_pkey PRIMARY KEY (tenant, run_id),
    CONSTRAINT jobs_run_fkey FOREIGN KEY (tenant, run_id) REFERENCES runs (tenant, run_id) ON DELETE CASCADE,
    CONSTRAINT jobs_state_check CHECK (state IN ('queued', 'leased', 'succeeded', 'dead', 'cancelled')),
    CONSTRAINT jobs_attempts_check CHECK (attempts >= 0 AND max_attempts >= 1 AND attempts <= max_attempts),
    CONSTRAINT jobs_lease_check CHECK (state <> 'leased' OR (lease_owner IS NOT NULL AND lease_expires_at IS NOT NULL))
);
CREATE INDEX jobs_claimable_idx ON jobs (queue, available_at) WHERE state IN ('queued', 'leased');
CREATE INDEX jobs_tenant_queued_idx ON jobs (tenant) WHERE state = 'queued';
CREATE INDEX jobs_dead_idx ON jobs (tenant, last_error_code) WHERE state = 'dead';

CREATE TABLE job_attempts (
    tenant      TEXT    NOT NULL,
    run_id      BLOB    NOT NULL,
    attempt     INTEGER NOT NULL,
    generation  BIGINT  NOT NULL,
    worker      TEXT    NOT NULL,
    claimed_at  BIGINT  NOT NULL,
    finished_at BIGINT,
    outcome     TEXT,
    error_class TEXT,
    error_code  TEXT,
    CONSTRAINT job_attempts_pkey PRIMARY KEY (tenant, run_id, attempt),
    CONSTRAINT job_attempts_job_fkey FOREIGN KEY (tenant, run_id) REFERENCES jobs (tenant, run_id) ON DELETE CASCADE,
    CONSTRAINT job_attempts_outcome_check CHECK (outcome IS NULL OR outcome IN ('succeeded', 'retried', 'dead', 'cancelled', 'lost', 'released')),
    CONSTRAINT job_attempts_class_check CHECK (error_class IS NULL OR error_class IN ('retryable', 'terminal', 'ambiguous'))
);
CREATE INDEX job_attempts_finished_idx ON job_attempts (finished_at) WHERE finished_at IS NOT NULL;

CREATE TABLE effects (
    tenant        TEXT    NOT NULL,
    run_id        BLOB    NOT NULL,
    step          TEXT    NOT NULL,
    operation     TEXT    NOT NULL,
    state         TEXT    NOT NULL,
    provider_ref  TEXT,
    generation    BIGINT  NOT NULL,
    error_code    TEXT,
    created_at    BIGINT  NOT NULL,
    updated_at    BIGINT  NOT NULL,
    CONSTRAINT effects_pkey PRIMARY KEY (tenant, run_id, step, operation),
    CONSTRAINT effects_run_fkey FOREIGN KEY (tenant, run_id) REFERENCES runs (tenant, run_id) ON DELETE CASCADE,
    CONSTRAINT effects_state_check CHECK (state IN ('reserved', 'succeeded', 'failed', 'unknown'))
);

CREATE TABLE outbox (
    id               INTEGER CONSTRAINT outbox_pkey PRIMARY KEY AUTOINCREMENT,
    tenant           TEXT    NOT NULL,
    topic            TEXT    NOT NULL,
    key              TEXT    NOT NULL,
    lane             INTEGER NOT NULL,
    payload          BLOB   NOT NULL,
    headers          TEXT   NOT NULL,
    -- Consumers dedupe on this; NULL means "use the outbox id".
    effect_key       TEXT,
    traceparent      TEXT,
    created_at       BIGINT  NOT NULL,
    state            TEXT    NOT NULL DEFAULT 'pending',
    publish_attempts INTEGER NOT NULL DEFAULT 0,
    last_error       TEXT,
    delivered_at     BIGINT,
    CONSTRAINT outbox_state_check CHECK (state IN ('pending', 'delivered', 'dead')),
    CONSTRAINT outbox_lane_check CHECK (lane >= 0)
);
CREATE INDEX outbox_pending_idx ON outbox (lane, id) WHERE state = 'pending';
CREATE INDEX outbox_delivered_idx ON outbox (delivered_at) WHERE state = 'delivered';

CREATE TABLE relay_lanes (
    lane             INTEGER NOT NULL,
    owner            TEXT,
    generation       BIGINT  NOT NULL DEFAULT 0,
    lease_expires_at BIGINT,
    CONSTRAINT relay_lanes_pkey PRIMARY KEY (lane)
);
WITH RECURSIVE n(lane) AS (SELECT 0 UNION ALL SELECT lane + 1 FROM n WHERE lane < 63) INSERT INTO relay_lanes (lane) SELECT lane FROM n;

CREATE TABLE consumer_partitions (
    group_id         TEXT    NOT NULL,
    topic            TEXT    NOT NULL,
    partition        INTEGER NOT NULL,
    owner            TEXT,
    generation       BIGINT  NOT NULL DEFAULT 0,
    lease_expires_at BIGINT,
    next_offset      BIGINT,
    CONSTRAINT consumer_partitions_pkey PRIMARY KEY (group_id, topic, partition)
);

CREATE TABLE consumer_ledger (
    group_id     TEXT    NOT NULL,
    effect_key   TEXT    NOT NULL,
    topic        TEXT    NOT NULL,
    partition    INTEGER NOT NULL,
    "offset"     BIGINT  NOT NULL,
    outcome      TEXT    NOT NULL DEFAULT 'applied',
    processed_at BIGINT  NOT NULL,
    CONSTRAINT consumer_ledger_pkey PRIMARY KEY (group_id, effect_key),
    CONSTRAINT consumer_ledger_outcome_check CHECK (outcome IN ('applied', 'dead_lettered'))
);
CREATE INDEX consumer_ledger_processed_idx ON consumer_ledger (processed_at);
