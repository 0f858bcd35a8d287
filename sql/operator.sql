-- The operator's reads and writes of the relay's state: the outbox backlog,
-- dead rows and their replay (announced to WAL capture), the live relays,
-- who holds each lane, and the WAL capture slots. The relay's own hot path
-- (heartbeat, lanes, batches, marks, retention, the slot) is in relay/sql/.

-- name: live_relays
SELECT owner, CAST(max_lanes AS BIGINT) AS max_lanes FROM relay_instances
WHERE expires_at > {now $1}
ORDER BY owner

-- name: lane_owners
SELECT lane, owner, generation, lease_expires_at FROM relay_lanes ORDER BY lane

-- name: outbox_backlog
-- Read every few seconds off the lane path (not per lane tick): the pending
-- rows, those the delivered-ranges ledger covers left out: with an empty
-- ledger a count over the pending partial index (one leg), else over the
-- ledger's gaps (the other; sql/outbox_delivered.sql).
SELECT CAST(COALESCE(sum(b.pending), 0) AS BIGINT) AS pending,
       COALESCE(min(b.oldest), 0) AS oldest,
       {now $1} AS now
FROM (SELECT count(*) AS pending, min(created_at) AS oldest
      FROM outbox WHERE state = 'pending' AND {use outbox_ledger_empty}
      UNION ALL
      SELECT count(*), min(p.created_at) FROM {use outbox_gap_rows} p) b

-- name: outbox_dead_count
SELECT count(*) FROM outbox WHERE state = 'dead'

-- name: list_dead_outbox
-- Dead rows oldest first, optionally only of tenant $2 and error code $3
-- (the operator filters; outbox_dead_idx keeps it off the delivered rows).
SELECT id, tenant, topic, key, last_error, publish_attempts, created_at
FROM outbox
WHERE state = 'dead'
  AND ($2{pg:::text} IS NULL OR tenant = $2)
  AND ($3{pg:::text} IS NULL OR last_error = $3)
ORDER BY id LIMIT $1

-- name: replay_ledger_lock [postgres only]
-- A replay's transaction starts here on PostgreSQL: the ledger's writers'
-- lock, so no range it splits (`replay_uncover`) is merged or extended by
-- the WAL marker meanwhile.
SELECT {use outbox_ledger_lock}

-- name: replay_dead_outbox
-- Back to pending: every dead row, or only id $1, only of tenant $2, only
-- with error code $3, only up to id $4.
UPDATE outbox SET state = 'pending', last_error = NULL
WHERE state = 'dead'
  AND ($1{pg:::bigint} IS NULL OR id = $1)
  AND ($2{pg:::text} IS NULL OR tenant = $2)
  AND ($3{pg:::text} IS NULL OR last_error = $3)
  AND ($4{pg:::bigint} IS NULL OR id <= $4)
RETURNING id

-- name: replay_uncover [postgres only]
-- In the replay's transaction, once rows $1 are back to pending: a dead row
-- a ledger range covers (dead-marking does not take the ledger's lock, a
-- restored backup, an operator's UPDATE) would read delivered once pending,
-- and WAL capture's re-read of the replay would skip it. Each range
-- covering a replayed id (its covering range is the one with the greatest
-- lo <= id, one probe) is deleted and its pieces around the replayed ids
-- inserted with its delivered_at, so the rest of it still reads delivered.
-- The pieces are computed from the DELETE's rows, so each range is gone
-- before a piece starting at its lo is inserted.
WITH hit AS (
    SELECT DISTINCT c.lo
    FROM unnest($1::bigint[]) AS r (id)
    CROSS JOIN LATERAL (SELECT d.lo, d.hi FROM outbox_delivered d
                        WHERE d.lo <= r.id ORDER BY d.lo DESC LIMIT 1) c
    WHERE c.hi >= r.id
), split AS (
    DELETE FROM outbox_delivered d USING hit h WHERE d.lo = h.lo
    RETURNING d.lo, d.hi, d.delivered_at
), cuts AS (
    SELECT s.hi, s.delivered_at, c.id AS after,
           lead(c.id) OVER (PARTITION BY s.lo ORDER BY c.id) AS upto
    FROM split s
    CROSS JOIN LATERAL (SELECT s.lo - 1 AS id
                        UNION ALL
                        SELECT r.id FROM unnest($1::bigint[]) AS r (id)
                        WHERE r.id BETWEEN s.lo AND s.hi) c
)
INSERT INTO outbox_delivered (lo, hi, delivered_at)
SELECT after + 1, COALESCE(upto - 1, hi), delivered_at FROM cuts
WHERE after + 1 <= COALESCE(upto - 1, hi)

-- name: wal_announce_replay [postgres only]
-- In the transaction that puts dead rows back to pending: WAL capture
-- streams inserts only, so the replay is announced in the WAL as a
-- transactional logical message (prefix `ferry.replay.<database id>`, the
-- ids as JSON), which reaches the stream in this transaction's commit order.
-- Nothing is written below wal_level = logical (the relay then polls).
SELECT pg_logical_emit_message(true, 'ferry.replay.' || s.value, $1::text)::text
FROM ferry_settings s
WHERE s.name = 'database_id' AND current_setting('wal_level') = 'logical'

-- name: wal_slots [postgres only]
-- The slots WAL capture made in this schema, for `status`, `doctor` and the
-- relay's gauges: whether a relay streams from each (a walsender holds it:
-- `active` alone is also true while `pg_create_logical_replication_slot`
-- builds the slot), how many bytes of WAL
-- it holds back (the current position minus its confirmed one), its time
-- lag (how long the oldest row not yet delivered has waited: the slot's
-- confirmed position has passed no pending row, and a row the ledger
-- covers is delivered; 0 when none waits), and
-- PostgreSQL's `wal_status` and `safe_wal_size` (NULL when it has none),
-- and the relay streaming from it (its replication connection's
-- `application_name`, `ferry-relay <relay id>`).
SELECT w.slot,
       EXISTS (SELECT 1 FROM pg_stat_replication r WHERE r.pid = s.active_pid) AS active,
       (SELECT r.application_name::text FROM pg_stat_replication r WHERE r.pid = s.active_pid) AS streamed_by,
       s.slot_name IS NOT NULL AS present,
       COALESCE((pg_current_wal_lsn() - s.confirmed_flush_lsn)::bigint, 0) AS lag_bytes,
       COALESCE((SELECT {now $1} - min(b.oldest)
                 FROM (SELECT min(created_at) AS oldest
                       FROM outbox WHERE state = 'pending' AND {use outbox_ledger_empty}
                       UNION ALL
                       SELECT min(p.created_at) FROM {use outbox_gap_rows} p) b), 0) AS lag_ms,
       s.wal_status::text AS wal_status,
       s.safe_wal_size::bigint AS safe_wal_size
FROM relay_wal_slots w
LEFT JOIN pg_replication_slots s ON s.slot_name = w.slot
ORDER BY w.slot

-- name: wal_failover [postgres only]
-- Whether the slots WAL capture made survive a failover: the server's
-- version (failover slots are PostgreSQL 17's), `synchronized_standby_slots`
-- (the physical slots of the standbys that must confirm WAL before a
-- logical slot's reader gets it; NULL before 17), and each present slot's
-- `failover` flag (read through to_jsonb: the column is 17's).
SELECT current_setting('server_version_num')::int AS version,
       NULLIF(current_setting('synchronized_standby_slots', true), '') AS synchronized_standby_slots,
       COALESCE(array_agg(w.slot ORDER BY w.slot) FILTER (WHERE s.slot_name IS NOT NULL
                AND NOT COALESCE((to_jsonb(s) ->> 'failover')::boolean, false)), ARRAY[]::text[]) AS not_failover,
       count(s.slot_name) AS present
FROM relay_wal_slots w
LEFT JOIN pg_replication_slots s ON s.slot_name = w.slot

-- name: wal_keep_size [postgres only]
-- `max_slot_wal_keep_size` in bytes, -1 when unbounded (a slot then holds
-- WAL for ever while its relay is gone).
SELECT CASE WHEN setting::bigint < 0 THEN -1 ELSE setting::bigint * 1024 * 1024 END
FROM pg_settings WHERE name = 'max_slot_wal_keep_size'
