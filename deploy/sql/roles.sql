-- Least-privilege PostgreSQL roles for Ferry. Apply after the migrations, as
-- the schema owner, in the schema that holds Ferry's tables:
--     psql -v ON_ERROR_STOP=1 "$DATABASE_URL" -f deploy/sql/roles.sql
-- Then create login users that inherit one role each, for example
--     CREATE ROLE payments_api LOGIN PASSWORD '…' IN ROLE ferry_service;
-- Roles are cluster-wide; grants are per schema. The script is one
-- transaction: an error rolls all of it back (with ON_ERROR_STOP psql then
-- exits non-zero; without it, psql goes on and the COMMIT rolls back).
-- Re-running is harmless, and so are runs at once: in one database they
-- take turns on an advisory lock (and with this version's migrations of
-- the same schema, on their lock; an older Ferry's migrator does not take
-- it), since two transactions granting or revoking on one object at once
-- fail ("tuple concurrently updated"); a role or membership another
-- database's run made meanwhile counts as made.

BEGIN;
DO $$
BEGIN
    IF current_schema() IS NULL THEN
        RAISE EXCEPTION 'roles.sql: search_path names no existing schema: set it to the schema that holds Ferry''s tables';
    END IF;
    PERFORM pg_advisory_xact_lock(x'46657272'::int, hashtext('deploy/sql/roles.sql'));
    -- The migrations' lock on this schema (ferry::migrate): grants and a
    -- migration's changes to one table never run at once either.
    PERFORM pg_advisory_xact_lock(x'46657272'::int, hashtext(current_schema()));
END $$;

DO $$
DECLARE
    r text;
BEGIN
    FOREACH r IN ARRAY ARRAY['ferry_service', 'ferry_relay', 'ferry_consumer', 'ferry_writer',
                             'ferry_operator', 'ferry_console'] LOOP
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = r) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', r);
            EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
            END;
        END IF;
    END LOOP;
END $$;

-- PostgreSQL 13 and 14 let every role create objects in the public schema
-- (15 stopped); nobody here needs that.
-- (A database without a public schema has nothing to revoke.)
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_namespace WHERE nspname = 'public') THEN
        REVOKE CREATE ON SCHEMA public FROM PUBLIC;
    END IF;
END $$;

DO $$
BEGIN
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO ferry_service, ferry_writer, ferry_relay, ferry_consumer, ferry_operator, ferry_console',
                   current_schema());
END $$;

GRANT SELECT ON ferry_settings TO ferry_service, ferry_relay, ferry_consumer, ferry_operator;

-- The service accepts runs, enqueues outbox messages and works its jobs.
-- Events are append-only; the outbox is write-only (RETURNING id aside).
-- Its only DELETEs are the retention sweeps: sweep_idempotency_keys
-- (expired idempotency records) and sweep_attempts (old attempt history).
GRANT SELECT, INSERT, UPDATE ON runs, jobs, effects TO ferry_service;
GRANT SELECT, INSERT ON run_events TO ferry_service;
GRANT SELECT, INSERT, UPDATE, DELETE ON idempotency_keys, job_attempts TO ferry_service;
-- Only the columns insert_outbox writes (lane is computed by the library):
-- a new row is pending, and its state, delivered_at, publish_attempts and
-- last_error belong to the relay.
REVOKE INSERT ON outbox FROM ferry_service;
GRANT INSERT (tenant, topic, key, lane, payload, headers, effect_key, traceparent, created_at)
    ON outbox TO ferry_service;
-- Reading a run's lineage (run_lineage) shows its outbox rows' delivery
-- state, never their payloads, headers or trace context.
GRANT SELECT (id, tenant, topic, key, effect_key, state, publish_attempts, last_error, created_at, delivered_at)
    ON outbox TO ferry_service;
GRANT SELECT ON outbox_delivered TO ferry_service;
GRANT USAGE ON SEQUENCE outbox_id_seq TO ferry_service;
-- Periodic schedules: registered at startup, fired by any process. Creating
-- and changing one is audited in its transaction, so the service may append
-- to the audit trail (never read, change or delete it). Dropping one
-- (unschedule, delete_schedule) is the operator's `ferry schedules remove`.
GRANT SELECT, INSERT, UPDATE ON ferry_schedules TO ferry_service;
REVOKE DELETE ON ferry_schedules FROM ferry_service;
GRANT INSERT ON ferry_audit TO ferry_service;
GRANT USAGE ON SEQUENCE ferry_audit_id_seq TO ferry_service;
-- The claim reads its queue's settings and, in a rate-limited queue, takes
-- tokens from the bucket; pausing and limits are the operator's.
GRANT SELECT ON ferry_queues TO ferry_service;
GRANT UPDATE (tokens, refilled_at) ON ferry_queues TO ferry_service;

-- A writer outside Rust (Java, Go, Python, Node) enqueues outbox rows through
-- ferry_enqueue and ferry_enqueue_json (SECURITY DEFINER: they insert as the
-- schema owner, after the library's checks) and may do nothing else here: no
-- table, no sequence. The service may call them too.
GRANT EXECUTE ON FUNCTION ferry_enqueue(text, text, text, bytea, jsonb, text, text),
    ferry_enqueue_json(text, text, text, json, jsonb, text, text) TO ferry_writer, ferry_service;

-- The relay reads and marks the outbox and its lanes; of the jobs it reads
-- only the columns of its job gauges (oldest due job, expired leases, dead
-- jobs per queue), never a tenant, run or error.
GRANT SELECT, DELETE ON outbox TO ferry_relay;
GRANT SELECT (queue, state, available_at, claim_key, lease_expires_at, attempts, max_attempts) ON jobs TO ferry_relay;
GRANT UPDATE (state, delivered_at, publish_attempts, last_error) ON outbox TO ferry_relay;
GRANT SELECT, UPDATE ON relay_lanes TO ferry_relay;
GRANT SELECT, INSERT, UPDATE, DELETE ON relay_instances TO ferry_relay;
GRANT INSERT ON ferry_audit TO ferry_relay;
GRANT USAGE ON SEQUENCE ferry_audit_id_seq TO ferry_relay;
-- `--capture wal` also needs `ALTER ROLE ferry_relay REPLICATION` and its
-- publication, which only the outbox's owner may create:
--   CREATE PUBLICATION <slot name> FOR TABLE outbox WITH (publish = 'insert');
-- With `--streams N`, one per stream k (0 to N-1), named after the
-- publication (`--publication`, default the slot's name):
--   CREATE PUBLICATION <publication>_<k>of<N> FOR TABLE outbox WHERE (lane % N = k) WITH (publish = 'insert');
-- Without the REPLICATION attribute the relay polls (`--capture poll`).
GRANT SELECT, INSERT, UPDATE ON relay_wal_slots, relay_wal_layouts TO ferry_relay;
GRANT SELECT, INSERT, UPDATE, DELETE ON relay_wal_members TO ferry_relay;
-- Delivered ranges (`--capture wal` writes them; retention and a poll
-- relay's fold delete them).
GRANT SELECT, INSERT, UPDATE, DELETE ON outbox_delivered TO ferry_relay;

-- A consumer touches its ledger and partitions; grant it the handler's own
-- tables separately.
GRANT SELECT, INSERT, UPDATE ON consumer_partitions TO ferry_consumer;
GRANT SELECT, INSERT, DELETE ON consumer_ledger TO ferry_consumer;

-- An operator runs `ferry jobs list|inspect|cancel|replay-dead`,
-- `ferry runs list|show`, `ferry schedules list|remove`,
-- `ferry queue list|pause|resume|limits` and `ferry dead list|replay`: cancel terminates a run (job, run, event,
-- attempt, outbox row), replay-dead accepts a linked run and appends
-- `replay_requested` to the dead one, dead replay sets dead outbox rows back
-- to pending (splitting the delivered ranges that cover them), schedules
-- remove drops a schedule (its runs stay); each writes a ferry_audit entry.
-- No DELETE but of a schedule and of a range a replay splits, no lanes, no
-- consumer ledger, no publishing marks.
GRANT SELECT, INSERT, UPDATE ON runs, jobs, idempotency_keys TO ferry_operator;
GRANT SELECT, INSERT ON run_events TO ferry_operator;
GRANT SELECT, UPDATE ON job_attempts TO ferry_operator;
GRANT SELECT ON effects TO ferry_operator;
GRANT SELECT, INSERT, UPDATE, DELETE ON ferry_schedules TO ferry_operator;
GRANT INSERT (tenant, topic, key, lane, payload, headers, effect_key, traceparent, created_at)
    ON outbox TO ferry_operator;
GRANT SELECT ON outbox, outbox_delivered TO ferry_operator;
GRANT INSERT, DELETE ON outbox_delivered TO ferry_operator;
GRANT UPDATE (state, last_error) ON outbox TO ferry_operator;
GRANT USAGE ON SEQUENCE outbox_id_seq TO ferry_operator;
GRANT INSERT ON ferry_audit TO ferry_operator;
GRANT USAGE ON SEQUENCE ferry_audit_id_seq TO ferry_operator;
-- `ferry queue pause|resume|limits|list`, audited.
GRANT SELECT, INSERT, UPDATE ON ferry_queues TO ferry_operator;

-- The web console (`ferry console`) takes the operator's actions, pauses and
-- resumes queues (as the operator), and reads what its pages show: lanes and relays, consumer
-- partitions and ledger entries (a run's lineage), effects. `ferry doctor`
-- and `ferry status` run as it too: they also read the WAL capture slots.
-- Still no DELETE, no publishing marks, no lane, slot or partition writes.
DO $$
BEGIN
    IF NOT pg_has_role('ferry_console', 'ferry_operator', 'MEMBER') THEN
        GRANT ferry_operator TO ferry_console;
    END IF;
EXCEPTION WHEN unique_violation THEN NULL;
END $$;
GRANT SELECT ON relay_lanes, relay_instances, relay_wal_slots, relay_wal_layouts, relay_wal_members, outbox_delivered, consumer_partitions, consumer_ledger, effects TO ferry_console;

COMMIT;
