-- Writers outside Rust: `ferry_enqueue` (bytes) and `ferry_enqueue_json`
-- (a JSON document) enqueue an outbox row inside the caller's own
-- transaction with everything `Ferry::enqueue_in` sets, so a service in Java,
-- Go, Python or Node writes rows the relay publishes exactly as it publishes
-- the Rust library's:
--   - the lane is `(murmur2(key) & 0x7fffffff) % outbox_lanes`, Kafka's
--     murmur2 as the library and the Java client compute it;
--   - the same transaction-scoped advisory lock on `(topic, key)` before the
--     id is drawn, so one key's ids follow commit order across both kinds of
--     writer;
--   - `created_at` in milliseconds since the epoch;
--   - the same checks, in the same order, with the same messages: a bad
--     argument raises SQLSTATE 22023 (invalid_parameter_value) with the
--     message `invalid input: <field>: <reason>`, the field in the error's
--     column name and `ferry code: invalid_input` in its detail, and writes
--     nothing;
--   - the wake-up (`NOTIFY ferry_wakeup`, sent by PostgreSQL at commit, once
--     per transaction however many rows it enqueued).
-- The limits are the library's defaults unless `ferry_settings` holds
-- `max_key_bytes`, `max_tenant_bytes`, `max_payload_bytes`,
-- `max_publish_bytes` or `max_headers` (set them to what the services'
-- `Limits` say). Lengths are counted in UTF-8 bytes, as the library counts
-- them, whatever the database's encoding. SECURITY DEFINER, with the search
-- path fixed to Ferry's schema and `pg_temp` last: `ferry_writer`
-- (deploy/sql/roles.sql) may call them and nothing else.

CREATE FUNCTION ferry_murmur2(data bytea) RETURNS integer
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
AS $$
DECLARE
    m CONSTANT bigint := 1540483477; -- 0x5bd1e995
    mask CONSTANT bigint := 4294967295;
    len CONSTANT integer := octet_length(data);
    h bigint := 2538058380 # len; -- seed 0x9747b28c
    k bigint;
    i integer := 0;
BEGIN
    WHILE i + 4 <= len LOOP
        k := get_byte(data, i)::bigint
            | (get_byte(data, i + 1)::bigint << 8)
            | (get_byte(data, i + 2)::bigint << 16)
            | (get_byte(data, i + 3)::bigint << 24);
        k := (k * m) & mask;
        k := k # (k >> 24);
        k := (k * m) & mask;
        h := ((h * m) & mask) # k;
        i := i + 4;
    END LOOP;
    IF len - i >= 3 THEN
        h := h # (get_byte(data, i + 2)::bigint << 16);
    END IF;
    IF len - i >= 2 THEN
        h := h # (get_byte(data, i + 1)::bigint << 8);
    END IF;
    IF len - i >= 1 THEN
        h := (h # get_byte(data, i)::bigint);
        h := (h * m) & mask;
    END IF;
    h := h # (h >> 13);
    h := (h * m) & mask;
    h := h # (h >> 15);
    RETURN (CASE WHEN h >= 2147483648 THEN h - 4294967296 ELSE h END)::integer;
END
$$;
COMMENT ON FUNCTION ferry_murmur2(bytea) IS
    'Kafka''s murmur2 (the Java client''s Utils.murmur2), as ferry::outbox::murmur2';

CREATE FUNCTION ferry_invalid(field text, reason text) RETURNS void
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    RAISE EXCEPTION USING
        ERRCODE = 'invalid_parameter_value',
        MESSAGE = format('invalid input: %s: %s', field, reason),
        DETAIL = 'ferry code: invalid_input',
        COLUMN = field;
END
$$;

CREATE FUNCTION ferry_enqueue(
    tenant text,
    topic text,
    key text,
    payload bytea,
    headers jsonb DEFAULT '{}',
    effect_key text DEFAULT NULL,
    traceparent text DEFAULT NULL
) RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
DECLARE
    max_key integer := 255;
    max_tenant integer := 128;
    max_payload integer := 1048576;
    max_publish integer := 1000000;
    max_headers integer := 64;
    setting record;
    header record;
    header_count integer := 0;
    size bigint;
    lanes integer;
    new_id bigint;
BEGIN
    FOR setting IN
        SELECT s.name, s.value FROM ferry_settings s
        WHERE s.name IN ('max_key_bytes', 'max_tenant_bytes', 'max_payload_bytes', 'max_publish_bytes', 'max_headers')
    LOOP
        CASE setting.name
            WHEN 'max_key_bytes' THEN max_key := setting.value::integer;
            WHEN 'max_tenant_bytes' THEN max_tenant := setting.value::integer;
            WHEN 'max_payload_bytes' THEN max_payload := setting.value::integer;
            WHEN 'max_publish_bytes' THEN max_publish := setting.value::integer;
            ELSE max_headers := setting.value::integer;
        END CASE;
    END LOOP;

    -- The checks of OutboxMessage::validate, in its order.
    IF tenant IS NULL OR octet_length(convert_to(tenant, 'UTF8')) NOT BETWEEN 1 AND max_tenant THEN
        PERFORM ferry_invalid('tenant', format('must be 1 to %s bytes', max_tenant));
    END IF;
    IF tenant !~ '^[A-Za-z0-9._:-]+$' THEN
        PERFORM ferry_invalid('tenant', 'may only contain [A-Za-z0-9._:-]');
    END IF;
    IF topic IS NULL OR topic !~ '^[A-Za-z0-9._-]{1,249}$' OR topic IN ('.', '..') THEN
        PERFORM ferry_invalid('topic', 'must be 1 to 249 bytes of [A-Za-z0-9._-]');
    END IF;
    IF key IS NULL OR octet_length(convert_to(key, 'UTF8')) NOT BETWEEN 1 AND max_key THEN
        PERFORM ferry_invalid('key', format('must be 1 to %s bytes', max_key));
    END IF;
    IF payload IS NULL THEN
        PERFORM ferry_invalid('payload', 'must not be NULL');
    END IF;
    IF octet_length(payload) > max_payload THEN
        PERFORM ferry_invalid('payload', format('is %s bytes; the limit is %s', octet_length(payload), max_payload));
    END IF;
    IF headers IS NULL OR jsonb_typeof(headers) <> 'object' THEN
        PERFORM ferry_invalid('headers', 'must be a JSON object of strings');
    END IF;
    size := 36 + octet_length(convert_to(key, 'UTF8')) + octet_length(payload);
    FOR header IN SELECT h.key AS name, h.value FROM jsonb_each(headers) h LOOP
        header_count := header_count + 1;
        IF jsonb_typeof(header.value) <> 'string' THEN
            PERFORM ferry_invalid('headers', 'must be a JSON object of strings');
        END IF;
        size := size + 10 + octet_length(convert_to(header.name, 'UTF8')) + octet_length(convert_to(header.value #>> '{}', 'UTF8'));
    END LOOP;
    IF header_count > max_headers THEN
        PERFORM ferry_invalid('headers', format('at most %s headers', max_headers));
    END IF;
    IF EXISTS (SELECT 1 FROM jsonb_object_keys(headers) AS n WHERE n = '' OR n LIKE 'ferry-%') THEN
        PERFORM ferry_invalid('headers', 'names must be non-empty and not start with ferry-');
    END IF;
    IF effect_key IS NOT NULL AND octet_length(convert_to(effect_key, 'UTF8')) NOT BETWEEN 1 AND max_key THEN
        PERFORM ferry_invalid('effect_key', format('must be 1 to %s bytes', max_key));
    END IF;
    IF traceparent IS NOT NULL
       AND traceparent !~ '^[0-9A-Fa-f]{2}-[0-9A-Fa-f]{32}-[0-9A-Fa-f]{16}-[0-9A-Fa-f]{2}$' THEN
        PERFORM ferry_invalid('traceparent', 'must be a W3C traceparent');
    END IF;
    -- The record Kafka would have to take, counted as Limits::max_publish_bytes
    -- counts it: the relay's own headers (ferry-outbox-id, ferry-tenant,
    -- ferry-effect-key) and a traceparent always included.
    size := size
        + (10 + 15 + 20)
        + (10 + 12 + octet_length(convert_to(tenant, 'UTF8')))
        + (10 + 16 + CASE WHEN effect_key IS NULL THEN 36 + 1 + 20
                         ELSE octet_length(convert_to(tenant, 'UTF8')) + 1 + octet_length(convert_to(effect_key, 'UTF8')) END)
        + (10 + 11 + 55);
    IF size > max_publish THEN
        PERFORM ferry_invalid('payload', format(
            'makes a %s-byte Kafka record with its key and headers; the limit is %s', size, max_publish));
    END IF;

    SELECT s.value::integer INTO lanes FROM ferry_settings s WHERE s.name = 'outbox_lanes';
    IF lanes IS NULL OR lanes <= 0 THEN
        -- Error::NotMigrated, as the library's load_lanes.
        RAISE EXCEPTION USING
            ERRCODE = 'object_not_in_prerequisite_state',
            MESSAGE = 'schema not migrated: ferry_settings.outbox_lanes is missing or not a positive integer',
            DETAIL = 'ferry code: not_migrated';
    END IF;
    -- insert_outbox_key_locked: the same lock as the library's writers.
    PERFORM pg_advisory_xact_lock(hashtextextended(topic || '/' || key, 0));
    INSERT INTO outbox (tenant, topic, key, lane, payload, headers, effect_key, traceparent, created_at)
    VALUES (
        ferry_enqueue.tenant,
        ferry_enqueue.topic,
        ferry_enqueue.key,
        (ferry_murmur2(convert_to(ferry_enqueue.key, 'UTF8')) & 2147483647) % lanes,
        ferry_enqueue.payload,
        ferry_enqueue.headers,
        ferry_enqueue.effect_key,
        ferry_enqueue.traceparent,
        (extract(epoch FROM now()) * 1000)::bigint
    )
    RETURNING id INTO new_id;
    PERFORM pg_notify('ferry_wakeup', '');
    RETURN new_id;
END
$$;
COMMENT ON FUNCTION ferry_enqueue(text, text, text, bytea, jsonb, text, text) IS
    'Enqueues an outbox row in the caller''s transaction, as Ferry::enqueue_in does; returns its id';

CREATE FUNCTION ferry_enqueue_json(
    tenant text,
    topic text,
    key text,
    payload json,
    headers jsonb DEFAULT '{}',
    effect_key text DEFAULT NULL,
    traceparent text DEFAULT NULL
) RETURNS bigint
LANGUAGE sql VOLATILE SECURITY DEFINER
AS $$
    -- OutboxMessage::json: the document's text as given (a `json` argument
    -- keeps it byte for byte) and `content-type: application/json`, which a
    -- header of the caller's may replace.
    SELECT ferry_enqueue(
        tenant,
        topic,
        key,
        convert_to(payload::text, 'UTF8'),
        '{"content-type": "application/json"}'::jsonb || coalesce(headers, 'null'::jsonb),
        effect_key,
        traceparent
    )
$$;
COMMENT ON FUNCTION ferry_enqueue_json(text, text, text, json, jsonb, text, text) IS
    'ferry_enqueue with a JSON document as the value and content-type: application/json';

-- SECURITY DEFINER functions resolve names in Ferry's schema, then in the
-- caller's temporary schema last (PostgreSQL looks there first unless told
-- otherwise): a caller's temporary `ferry_settings` view or `outbox` table
-- is never what they read or write.
DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION ferry_enqueue(text, text, text, bytea, jsonb, text, text) SET search_path = %I, pg_temp',
                   current_schema());
    EXECUTE format('ALTER FUNCTION ferry_enqueue_json(text, text, text, json, jsonb, text, text) SET search_path = %I, pg_temp',
                   current_schema());
END $$;

REVOKE ALL ON FUNCTION ferry_murmur2(bytea) FROM PUBLIC;
REVOKE ALL ON FUNCTION ferry_invalid(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION ferry_enqueue(text, text, text, bytea, jsonb, text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION ferry_enqueue_json(text, text, text, json, jsonb, text, text) FROM PUBLIC;
