-- Least-privilege PostgreSQL roles for Ferry. Apply after the migrations, as
-- the schema owner, in the schema that holds Ferry's tables:
--     psql "$DATABASE_URL" -f deploy/sql/roles.sql
-- Then create login users that inherit one role each, for example
--     CREATE ROLE payments_api LOGIN PASSWORD '…' IN ROLE ferry_service;
-- Roles are cluster-wide; grants are per schema. Re-running is harmless.

DO $$
BEGIN
    CREATE ROLE ferry_service NOLOGIN;
EXCEPTION WHEN duplicate_object THEN NULL;
END $$;
DO $$
BEGIN
    CREATE ROLE ferry_relay NOLOGIN;
EXCEPTION WHEN duplicate_object THEN NULL;
END $$;
DO $$
BEGIN
    CREATE ROLE ferry_consumer NOLOGIN;
EXCEPTION WHEN duplicate_object THEN NULL;
END $$;

DO $$
BEGIN
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO ferry_service, ferry_relay, ferry_consumer', current_schema());
END $$;

GRANT SELECT ON ferry_settings TO ferry_service, ferry_relay, ferry_consumer;

-- The service accepts runs, enqueues outbox messages and works its jobs.
-- Events are append-only; the outbox is write-only (RETURNING id aside).
GRANT SELECT, INSERT, UPDATE ON runs, jobs, effects TO ferry_service;
GRANT SELECT, INSERT ON run_events TO ferry_service;
GRANT SELECT, INSERT, UPDATE, DELETE ON idempotency_keys, job_attempts TO ferry_service;
GRANT INSERT ON outbox TO ferry_service;
GRANT SELECT (id) ON outbox TO ferry_service;
GRANT USAGE ON SEQUENCE outbox_id_seq TO ferry_service;

-- The relay reads and marks the outbox and its lanes, nothing else.
GRANT SELECT, DELETE ON outbox TO ferry_relay;
GRANT UPDATE (state, delivered_at, publish_attempts, last_error) ON outbox TO ferry_relay;
GRANT SELECT, UPDATE ON relay_lanes TO ferry_relay;
GRANT SELECT, INSERT, UPDATE, DELETE ON relay_instances TO ferry_relay;
GRANT INSERT ON ferry_audit TO ferry_relay;
GRANT USAGE ON SEQUENCE ferry_audit_id_seq TO ferry_relay;

-- A consumer touches its ledger and partitions; grant it the handler's own
-- tables separately.
GRANT SELECT, INSERT, UPDATE ON consumer_partitions TO ferry_consumer;
GRANT SELECT, INSERT, DELETE ON consumer_ledger TO ferry_consumer;
