-- Scheduled runs, run lineage, run listing and periodic schedules.
--
-- runs.scheduled_at: the instant the caller asked the run to start at
-- (`NewRun::run_at` / `delay`); its job is claimable from
-- max(scheduled_at, created_at). NULL: start at once.
-- runs.parent_run_id: the run (same tenant) whose handler created this one
-- (`NewRun::parent`, `Ferry::enqueue_run_in`). Checked by the acceptance in
-- its transaction (runs are never deleted by Ferry), not by a foreign key,
-- which SQLite cannot add to an existing table.
ALTER TABLE runs ADD COLUMN scheduled_at BIGINT;
ALTER TABLE runs ADD COLUMN parent_run_id BLOB;

-- list_runs keyset pagination, newest first, on (created_at, run_id): across
-- tenants (operators; with the tenant last, since run ids are unique per
-- tenant only), in one tenant, and in one tenant and state.
CREATE INDEX runs_created_idx ON runs (created_at, run_id, tenant);
CREATE INDEX runs_tenant_created_idx ON runs (tenant, created_at, run_id);
CREATE INDEX runs_tenant_state_created_idx ON runs (tenant, state, created_at, run_id);
-- A run's children (lineage).
CREATE INDEX runs_parent_idx ON runs (tenant, parent_run_id) WHERE parent_run_id IS NOT NULL;
-- A run's outbox rows (lineage): its events' rows are keyed by the run id.
CREATE INDEX outbox_tenant_key_idx ON outbox (tenant, key);

-- Periodic runs (`Ferry::schedule`). Each tick is accepted as a run under the
-- idempotency key `schedule:<name>:<tick ms>`, in the transaction that moves
-- next_tick with a compare-and-set, so any number of firing processes create
-- each tick once and need no leader.
CREATE TABLE ferry_schedules (
    tenant       TEXT    NOT NULL,
    name         TEXT    NOT NULL,
    -- `cron:<expression>` (UTC) or `every:<milliseconds>` (ticks at multiples
    -- of the interval since the Unix epoch, the same in every process).
    spec         TEXT    NOT NULL,
    -- The run each tick accepts: operation, schema_version, command, queue,
    -- max_attempts, deadline_ms, priority.
    template     TEXT    NOT NULL,
    -- Missed ticks after downtime: 'skip' fires the latest only, 'catch_up'
    -- fires at most catch_up_max of the latest.
    missed       TEXT    NOT NULL,
    catch_up_max INTEGER NOT NULL,
    -- Ticks at or before this instant never fire (set when the spec is (re)defined).
    anchor_at    BIGINT  NOT NULL,
    last_tick    BIGINT,
    next_tick    BIGINT  NOT NULL,
    version      BIGINT  NOT NULL,
    created_at   BIGINT  NOT NULL,
    updated_at   BIGINT  NOT NULL,
    CONSTRAINT ferry_schedules_pkey PRIMARY KEY (tenant, name),
    CONSTRAINT ferry_schedules_missed_check CHECK (missed IN ('skip', 'catch_up') AND catch_up_max >= 1)
);
-- Due schedules in firing order; fire_due_ticks pages on it past the ones it
-- could not fire.
CREATE INDEX ferry_schedules_due_idx ON ferry_schedules (next_tick, tenant, name);
