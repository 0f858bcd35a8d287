-- Reading delivery state through the delivered-ranges ledger
-- (outbox_delivered, issue #20; see its migration). An outbox id is covered
-- when a range has lo <= id <= hi; then
--   delivered = state = 'delivered' OR (state = 'pending' AND covered)
--   pending   = state = 'pending' AND NOT covered
--   dead      = state = 'dead'
-- The console, the doctor and the relay borrow these fragments
-- (generate_sharing).

-- name: outbox_ledger_lock [fragment]
-- The ledger's writers' lock (PostgreSQL; a transaction-scoped advisory
-- lock on this schema's ledger), taken first by the WAL marker, a poll
-- relay's fold and a replay's split: one writer at a time, so ranges never
-- overlap and none is merged, extended or split under another writer.
-- Every writer sends its statements back to back, so the holder's session
-- is ended after 5 s idle in this transaction (as the relay binary's pool
-- sets for all its sessions, `IDLE_IN_TRANSACTION_LIMIT`), whatever pool
-- it came from (a replay's, an in-process relay's): a process frozen
-- holding the lock (SIGSTOP, Ctrl-Z, a paused VM) would otherwise stop
-- every other writer for as long as it stays frozen.
set_config('idle_in_transaction_session_timeout', '5s', true),
pg_advisory_xact_lock(hashtextextended(current_schema() || '.outbox_delivered', 0))

-- name: outbox_ledger_empty [fragment]
-- True when no range is recorded (SQLite, poll capture, a ledger folded or
-- swept): a pending reader then reads `state = 'pending'` alone, as before
-- the ledger, in a UNION ALL leg of its own so that leg plans as before
-- (the pending partial index, or a parallel scan); PostgreSQL evaluates it
-- once, a one-time filter.
NOT EXISTS (SELECT 1 FROM outbox_delivered)

-- name: outbox_gap_rows [fragment]
-- The pending outbox rows (id, lane, tenant, created_at) when ranges are
-- recorded, as a derived table: `FROM {use outbox_gap_rows} p`; the other
-- leg of a reader's UNION ALL beside `state = 'pending' AND {use
-- outbox_ledger_empty}` (with an empty ledger it has no gap and reads
-- nothing). It never walks covered rows (millions until retention):
-- pending rows lie only in the ledger's gaps (below the first range,
-- between two ranges that do not touch, above the last), each gap a
-- primary-key range probe of outbox. On PostgreSQL the gaps go through
-- arrays and unnest, estimated at 10 rows, and each probe is a LATERAL
-- subquery kept apart (OFFSET 0), whose bounds are then parameters and
-- estimated as one range: joined directly, the planner estimates a third
-- of the ledger as gaps and a ninth of outbox per gap, a cost past
-- jit_above_cost that JIT-compiles for up to a second (BENCHMARKS.md
-- "Reading delivery state through the ledger").
(SELECT o.id, o.lane, o.tenant, o.created_at
 FROM {pg:(SELECT array_agg(g.lo) AS los, array_agg(g.hi) AS his FROM }
      (SELECT -9223372036854775807 AS lo, min(d.lo) - 1 AS hi FROM outbox_delivered d
       UNION ALL
       SELECT r.hi + 1, COALESCE(r.next_lo - 1, 9223372036854775807)
       FROM (SELECT d.hi, lead(d.lo) OVER (ORDER BY d.lo) AS next_lo FROM outbox_delivered d) r
       WHERE r.next_lo IS NULL OR r.next_lo > r.hi + 1) g
      {pg:) a CROSS JOIN unnest(a.los, a.his) AS g(lo, hi)}
 {pg:CROSS JOIN LATERAL (SELECT o.id, o.lane, o.tenant, o.created_at FROM outbox o WHERE}{sqlite:JOIN outbox o ON}
      o.id BETWEEN g.lo AND g.hi AND o.state = 'pending'{pg: OFFSET 0) o})

-- name: outbox_covered [fragment]
-- Whether a range covers outbox row `o`: ranges never overlap, so the
-- covering range is the one with the greatest lo <= o.id, if its hi
-- reaches o.id (one backward probe of outbox_delivered_pkey; a join
-- would hash the whole ledger).
COALESCE((SELECT d.hi FROM outbox_delivered d WHERE d.lo <= o.id ORDER BY d.lo DESC LIMIT 1) >= o.id, false)
