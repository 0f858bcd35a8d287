-- `--capture wal` (PostgreSQL only): the capture check, the replication slot
-- and publication catalogs, the catch-up read of the table, and the set-based
-- marks that the WAL pipeline makes off its critical path. No lane fence: the
-- replication slot is the fence (PostgreSQL lets one session stream from it).
-- Delivered state is the ledger `outbox_delivered` (ranges of acknowledged
-- ids, see its migration): the marker writes it and no outbox row.

-- name: wal_capture_allowed [postgres only]
-- Whether this role may stream logical replication here, and whose outbox it reads.
SELECT current_setting('wal_level') = 'logical' AS logical,
       (r.rolreplication OR r.rolsuper) AS may_replicate,
       current_schema()::text AS schema,
       current_setting('server_version_num')::int AS version,
       COALESCE(current_setting('synchronized_standby_slots', true), '') <> '' AS standby_slots
FROM pg_roles r WHERE r.rolname = current_user

-- name: wal_defaulted_columns [postgres only]
-- The columns of table $2 in schema $1 whose default is a constant (a
-- Debezium-layout table: Debezium's JsonConverter writes a column's constant
-- default where the row holds NULL; a function's, like now(), it has not).
SELECT a.attname::text
FROM pg_attribute a
JOIN pg_class c ON c.oid = a.attrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
WHERE n.nspname = $1 AND c.relname = $2 AND a.attnum > 0 AND NOT a.attisdropped
  AND pg_get_expr(d.adbin, d.adrelid) NOT LIKE '%(%' 

-- name: wal_publication [postgres only]
-- Whether publication $1 exists, and whether it publishes the inserts of table
-- $3 in schema $2 (NULL: this schema's; Ferry's own is outbox), with row
-- filter $4 (NULL: none) when $5 (`rowfilter`, PostgreSQL 15+, read through
-- to_jsonb so the query prepares on every version); and its oid (a
-- publication dropped and made again has a new one).
SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1) AS found,
       (SELECT oid::bigint FROM pg_publication WHERE pubname = $1) AS oid,
       EXISTS (SELECT 1 FROM pg_publication p
               JOIN pg_publication_tables t ON t.pubname = p.pubname
               WHERE p.pubname = $1 AND p.pubinsert
                 AND t.schemaname = COALESCE($2::text, current_schema()) AND t.tablename = $3::text
                 AND (NOT $5::bool OR (to_jsonb(t) ->> 'rowfilter') IS NOT DISTINCT FROM $4::text)) AS covers_outbox

-- name: wal_layout [postgres only]
-- How many streams relay group $1 (its base slot) is split into; no row: one.
SELECT streams FROM relay_wal_layouts WHERE slot = $1

-- name: wal_set_layout [postgres only]
-- A relay's start: its group is split into $2 streams from now on.
INSERT INTO relay_wal_layouts (slot, streams, updated_at) VALUES ($1, $2, {now $3})
ON CONFLICT ON CONSTRAINT relay_wal_layouts_pkey
DO UPDATE SET streams = EXCLUDED.streams, updated_at = EXCLUDED.updated_at
WHERE relay_wal_layouts.streams <> EXCLUDED.streams

-- name: wal_layout_slots [postgres only]
-- Every slot of relay group $1 in this database, whatever its layout: the
-- base slot and the streams' (`<slot>_<k>of<N>`); with whether a session
-- streams from it.
SELECT slot_name::text AS name, active FROM pg_replication_slots
WHERE database = current_database()
  AND (slot_name = $1 OR slot_name ~ ('^' || $1 || '_[0-9]+of[0-9]+$'))
ORDER BY slot_name

-- name: wal_slot [postgres only]
-- Slot $1: whether a session streams from it, whether PostgreSQL removed
-- WAL it needed (invalidated), and whether it decodes this database with pgoutput.
SELECT active,
       COALESCE(wal_status = 'lost', false) AS lost,
       (slot_type = 'logical' AND plugin = 'pgoutput' AND database = current_database()) AS usable
FROM pg_replication_slots WHERE slot_name = $1

-- name: wal_create_slot [postgres only]
-- Waits for every transaction running when it starts to end (a consistent
-- point), however long; a slot whose creating session ends first is not
-- made.
SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')

-- name: wal_session_pid [postgres only]
-- The backend of the session about to create a slot, so a shutdown can end
-- it (`wal_end_session`).
SELECT pg_backend_pid()

-- name: wal_end_session [postgres only]
-- Ends session $1 (this role's own slot creation, waiting at shutdown):
-- whatever the client drops, the server would wait on and make the slot.
SELECT pg_terminate_backend($1)

-- name: wal_drop_slot [postgres only]
SELECT pg_drop_replication_slot($1)

-- name: wal_slot_make_lock [postgres only]
-- One relay makes slot $1 at a time (a session lock, held from before the
-- catch-up flag is reset until the bound is recorded): another relay
-- waits here, then finds the slot made and leaves its record alone.
SELECT pg_advisory_lock(hashtextextended('ferry.wal_slot/' || $1::text, 0))

-- name: wal_slot_try_make_lock [postgres only]
-- `wal_slot_make_lock` only when no relay is making slot $1 (true: taken).
SELECT pg_try_advisory_lock(hashtextextended('ferry.wal_slot/' || $1::text, 0))

-- name: wal_slot_made_wait_limit [postgres only]
-- The wait below gives up after 5 s on the server (lock_not_available): a
-- maker waiting on a long transaction keeps no reader's connection busy.
SELECT set_config('lock_timeout', '5000', true)

-- name: wal_slot_made_wait [postgres only]
-- A session about to read slot $1's catch-up record: waits (until its
-- transaction ends) for a relay making the slot to have recorded its bound.
SELECT pg_advisory_xact_lock_shared(hashtextextended('ferry.wal_slot/' || $1::text, 0))

-- name: wal_slot_maker_idle_limit [postgres only]
-- The making session is ended by the server after 60 s idle (PostgreSQL
-- 14+): a maker whose client died between two statements does not hold
-- the lock until TCP keepalives notice.
SELECT CASE WHEN current_setting('server_version_num')::int >= 140000
            THEN set_config('idle_session_timeout', '60000', false) END

-- name: wal_slot_exists [postgres only]
SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)

-- name: wal_slot_unbound [postgres only]
-- Slot $1's record was reset for a making (`wal_slot_needs_catch_up`: a
-- generation) and never given its bound: its maker died between the slot's
-- creation and the bound (or met a slot made without the lock). Checked
-- again under the making lock, where a live maker is not in that state.
-- Not on `marked_lsn`: a frozen relay's late mark of the slot before may
-- set it.
SELECT EXISTS (SELECT 1 FROM relay_wal_slots
               WHERE slot = $1 AND NOT caught_up AND catch_up_through IS NULL
                 AND generation > 0)

-- name: wal_slot_needs_catch_up [postgres only]
-- Before a slot is created: the rows committed before it are not in its
-- stream, so the table must be read once (set before creating it, so a
-- crash between the two leaves the flag set).
-- The new slot's stream has positions of its own: what was marked of the
-- old one's is forgotten.
-- A new generation: a table read of an earlier one records nothing.
INSERT INTO relay_wal_slots (slot, caught_up, catch_up_through, updated_at, marked_lsn, generation)
VALUES ($1, false, NULL, {now $2}, NULL, 1)
ON CONFLICT ON CONSTRAINT relay_wal_slots_pkey
DO UPDATE SET caught_up = false, catch_up_through = NULL, updated_at = EXCLUDED.updated_at,
              marked_lsn = NULL, generation = relay_wal_slots.generation + 1
RETURNING generation

-- name: wal_slot_catch_up_bound [postgres only]
-- Right after the slot is created: every row committed before it is visible
-- now, so its id is at most this. Only for generation $2, the creator's: a
-- slot made anew since has its own.
UPDATE relay_wal_slots
SET catch_up_through = (SELECT COALESCE(max(id), 0) FROM outbox)
WHERE slot = $1 AND generation = $2

-- name: wal_slot_catch_up [postgres only]
-- No row means a slot this relay did not create: read the whole table.
-- The generation read goes with the bound to `wal_slot_set_caught_up`.
-- No bound with a generation (a making reset it) is a slot whose maker
-- never recorded the bound (`wal_slot_unbound`).
SELECT caught_up, catch_up_through, generation FROM relay_wal_slots WHERE slot = $1

-- name: wal_slot_generation [postgres only]
-- How many times slot $1 was made (by any relay of the group); no row: none.
SELECT generation FROM relay_wal_slots WHERE slot = $1

-- name: wal_slot_marked [postgres only]
-- The end of the last streamed transaction of slot $1 marked delivered with
-- every one before it (0: none yet, or a slot this relay did not create),
-- and the server's current WAL position: a marked position past it came
-- from another cluster (a dump restored beside a slot made by hand).
SELECT COALESCE((SELECT marked_lsn FROM relay_wal_slots WHERE slot = $1), 0) AS marked,
       (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint AS current

-- name: wal_slot_forget_marked [postgres only]
UPDATE relay_wal_slots SET marked_lsn = NULL WHERE slot = $1

-- name: wal_slot_set_marked [postgres only]
-- In the mark's transaction (or right after `--delete-on-delivery`'s
-- deletes): the slot's stream is marked through $2. It only goes up (a
-- frozen relay's late mark never lowers it); a slot without a row (one
-- this relay did not create) gets one, read in full as before.
INSERT INTO relay_wal_slots (slot, caught_up, catch_up_through, updated_at, marked_lsn)
VALUES ($1, false, NULL, {now $3}, $2)
ON CONFLICT ON CONSTRAINT relay_wal_slots_pkey
DO UPDATE SET marked_lsn = GREATEST(COALESCE(relay_wal_slots.marked_lsn, 0), EXCLUDED.marked_lsn)

-- name: wal_slot_set_caught_up [postgres only]
-- Only for generation $3, the one whose bound the read used (0: no record
-- then): none when the slot was made anew meanwhile, whose rows the read
-- may have missed.
INSERT INTO relay_wal_slots (slot, caught_up, catch_up_through, updated_at, generation)
VALUES ($1, true, NULL, {now $2}, $3)
ON CONFLICT ON CONSTRAINT relay_wal_slots_pkey
DO UPDATE SET caught_up = true, updated_at = EXCLUDED.updated_at
WHERE relay_wal_slots.generation = $3

-- name: wal_pending_after [postgres only]
-- The catch-up read: pending rows above id $1 and up to $3 that no ledger
-- range covers (a recovered slot publishes again only what was not
-- delivered), in id order (the primary key). The covering range of an id is
-- the one with the greatest lo <= id (ranges never overlap): one probe.
-- Only stream $5 of $4's lanes (`--streams`; 0 of 1: every row).
SELECT o.id, o.tenant, o.topic, o.key, o.payload, o.headers, o.effect_key, o.traceparent, o.created_at
FROM outbox o
WHERE o.state = 'pending' AND o.id > $1 AND o.id <= $3 AND o.lane % $4::int = $5::int
  AND NOT COALESCE((SELECT d.hi FROM outbox_delivered d WHERE d.lo <= o.id
                    ORDER BY d.lo DESC LIMIT 1) >= o.id, false)
ORDER BY o.id
LIMIT $2

-- name: wal_ledger_lock [postgres only]
-- The marker's transaction starts here: the ledger's writers' lock (one
-- writer at a time on this schema's ledger, any session, any relay, a
-- replay's split included), so ranges never overlap. Returns
-- the instant the acknowledged ids are recorded at.
WITH locked AS (
    SELECT {use outbox_ledger_lock}
)
SELECT {now $1} AS now FROM locked

-- name: wal_ledger_near [postgres only]
-- The ranges that overlap or touch one of the runs lo = $1[i], hi = $2[i]:
-- per run, the range before it (the greatest lo below the run's) and those
-- starting inside it or right after it, by primary key. Sorted by lo.
SELECT DISTINCT d.lo, d.hi, d.delivered_at
FROM unnest($1::bigint[], $2::bigint[]) AS r (lo, hi)
CROSS JOIN LATERAL (
    SELECT d.lo, d.hi, d.delivered_at FROM outbox_delivered d
    WHERE d.lo >= COALESCE((SELECT b.lo FROM outbox_delivered b
                            WHERE b.lo < r.lo ORDER BY b.lo DESC LIMIT 1), r.lo)
      AND d.lo <= r.hi + 1
) d
WHERE d.hi >= r.lo - 1
ORDER BY d.lo

-- name: wal_ledger_from [postgres only]
-- A streaming session's view of the ledger: up to $2 ranges in lo order,
-- from the last one starting at or below id $1 (the one that covers it, if
-- any: one probe) on.
SELECT d.lo, d.hi, d.delivered_at FROM outbox_delivered d
WHERE d.lo >= COALESCE((SELECT b.lo FROM outbox_delivered b
                        WHERE b.lo <= $1 ORDER BY b.lo DESC LIMIT 1), $1)
ORDER BY d.lo
LIMIT $2

-- name: wal_ledger_delete [postgres only]
-- The ranges a merge absorbed (by lo).
DELETE FROM outbox_delivered WHERE lo {ids $1}

-- name: wal_ledger_insert [postgres only]
-- The new or merged ranges lo = $1[i], hi = $2[i], delivered_at = $3[i].
INSERT INTO outbox_delivered (lo, hi, delivered_at)
SELECT lo, hi, delivered_at FROM unnest($1::bigint[], $2::bigint[], $3::bigint[]) AS r (lo, hi, delivered_at)

-- name: wal_delete_delivered [postgres only]
-- `--delete-on-delivery`: the acknowledged rows are deleted instead of
-- covered (a row not visible yet is looked for again by the marker).
DELETE FROM outbox WHERE id {ids $1} AND state = 'pending'
RETURNING id

-- name: wal_mark_dead [postgres only]
-- A row Kafka refused alone (the evidence is about this row only). A row a
-- ledger range covers was delivered (a restart republished it: the slot was
-- not confirmed past it) and is left alone, as a row marked delivered is:
-- dead and covered, it would read dead although delivered, and a replay
-- would publish it again.
UPDATE outbox
SET state = 'dead', last_error = $2, publish_attempts = publish_attempts + 1
WHERE id = $1 AND state = 'pending'
  AND NOT COALESCE((SELECT d.hi FROM outbox_delivered d WHERE d.lo <= $1
                    ORDER BY d.lo DESC LIMIT 1) >= $1, false)

-- name: wal_note_publish_error [postgres only]
-- A failed attempt on a row not delivered (a covered row is left alone, as
-- in wal_mark_dead).
UPDATE outbox SET publish_attempts = publish_attempts + 1, last_error = $2
WHERE id = $1 AND state = 'pending'
  AND NOT COALESCE((SELECT d.hi FROM outbox_delivered d WHERE d.lo <= $1
                    ORDER BY d.lo DESC LIMIT 1) >= $1, false)

-- name: wal_pending_ids [postgres only]
-- The rows a replay announced, still pending and not covered (a session
-- reading the announcement again after an earlier one delivered them), in
-- id order. Only stream $3 of $2's lanes (`--streams`; 0 of 1: every row):
-- every stream reads the announcement.
SELECT o.id, o.tenant, o.topic, o.key, o.payload, o.headers, o.effect_key, o.traceparent, o.created_at
FROM outbox o
WHERE o.id {ids $1} AND o.state = 'pending' AND o.lane % $2::int = $3::int
  AND NOT COALESCE((SELECT d.hi FROM outbox_delivered d WHERE d.lo <= o.id
                    ORDER BY d.lo DESC LIMIT 1) >= o.id, false)
ORDER BY o.id

-- name: wal_states [postgres only]
-- The rows of $1 this statement sees, with their state as every reader
-- sees it: a pending row a ledger range covers is 'delivered'. Logical
-- decoding can hand a commit over a moment before the transaction is
-- visible to new snapshots, so a row the stream carried may be missing here
-- (or, for a replay, still dead) for that moment.
SELECT o.id,
       CASE WHEN o.state = 'pending'
                 AND COALESCE((SELECT d.hi FROM outbox_delivered d WHERE d.lo <= o.id
                               ORDER BY d.lo DESC LIMIT 1) >= o.id, false)
            THEN 'delivered' ELSE o.state END AS state
FROM outbox o WHERE o.id {ids $1}

-- name: wal_ping [postgres only]
-- A streaming session heard nothing for a while: a non-transactional
-- logical message ($1 names this database's pings) goes through the WAL to
-- every slot of the database at once; the session that sees it come back
-- knows its replication connection carries data. Returns its position.
SELECT (pg_logical_emit_message(false, $1, '') - '0/0'::pg_lsn)::bigint

-- name: wal_end_own_walsender [postgres only]
-- The walsender holding slot $1 for application $2: this relay's own
-- earlier session, whose connection went silent (half-open) while the
-- server has not noticed yet (`wal_sender_timeout`). Ended, so the slot is
-- free at once; another relay's session is never touched.
SELECT pg_terminate_backend(s.active_pid)
FROM pg_replication_slots s
JOIN pg_stat_replication r ON r.pid = s.active_pid
WHERE s.slot_name = $1 AND r.application_name = $2

-- name: wal_own_sent [postgres only]
-- How far the walsender streaming slot $1 for application $2 (this
-- relay's session) has read the WAL; no row when the server has no such
-- session. It moves while the walsender decodes WAL it sends nothing of
-- (other tables), so a silent stream that is still catching up is told
-- from a dead one. -1 when the position is not shown to this role.
SELECT COALESCE((r.sent_lsn - '0/0'::pg_lsn)::bigint, -1)
FROM pg_replication_slots s
JOIN pg_stat_replication r ON r.pid = s.active_pid
WHERE s.slot_name = $1 AND r.application_name = $2

-- name: wal_member_heartbeat [postgres only]
-- Relay $2 takes part in group $1's streams for $4 more.
INSERT INTO relay_wal_members (slot, owner, expires_at) VALUES ($1, $2, {now $3} + $4)
ON CONFLICT ON CONSTRAINT relay_wal_members_pkey DO UPDATE SET expires_at = EXCLUDED.expires_at

-- name: wal_members [postgres only]
-- Group $1's relays whose heartbeat has not expired, by owner; the
-- expired are swept first.
WITH swept AS (
    DELETE FROM relay_wal_members WHERE slot = $1 AND expires_at <= {now $2}
)
SELECT owner FROM relay_wal_members WHERE slot = $1 AND expires_at > {now $2} ORDER BY owner

-- name: wal_member_leave [postgres only]
DELETE FROM relay_wal_members WHERE slot = $1 AND owner = $2
