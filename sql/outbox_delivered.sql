-- Reading delivery state through the delivered-ranges ledger
-- (outbox_delivered, issue #20; see its migration). An outbox id is covered
-- when a range has lo <= id <= hi; then
--   delivered = state = 'delivered' OR (state = 'pending' AND covered)
--   pending   = state = 'pending' AND NOT covered
--   dead      = state = 'dead'
-- The console and the doctor borrow these fragments (generate_sharing).

-- name: outbox_pending [fragment]
-- The pending outbox rows (id, lane, tenant, created_at), as a derived
-- table: `FROM {use outbox_pending} p`. Never walks covered rows (millions
-- until retention): pending rows lie only in the ledger's gaps, below the
-- first range, between two ranges that do not touch, above the last, and
-- each gap is a primary-key range probe of outbox. With an empty ledger
-- (SQLite, poll capture) the gaps are none and the first branch, behind a
-- one-time NOT EXISTS, is today's read of the pending partial index.
(SELECT o.id, o.lane, o.tenant, o.created_at
 FROM outbox o
 WHERE o.state = 'pending' AND NOT EXISTS (SELECT 1 FROM outbox_delivered)
 UNION ALL
 SELECT o.id, o.lane, o.tenant, o.created_at
 FROM (SELECT -9223372036854775807 AS lo, min(d.lo) - 1 AS hi FROM outbox_delivered d
       UNION ALL
       SELECT r.hi + 1, COALESCE(r.next_lo - 1, 9223372036854775807)
       FROM (SELECT d.hi, lead(d.lo) OVER (ORDER BY d.lo) AS next_lo FROM outbox_delivered d) r
       WHERE r.next_lo IS NULL OR r.next_lo > r.hi + 1) g
 JOIN outbox o ON o.id BETWEEN g.lo AND g.hi
 WHERE o.state = 'pending')

-- name: outbox_covering [fragment]
-- The range covering outbox row `o` (a LEFT JOIN's condition: no range
-- when uncovered): ranges never overlap, so it is the one with the
-- greatest lo <= o.id, when its hi reaches o.id (one backward probe of
-- outbox_delivered_pkey per row).
d.lo = (SELECT max(d2.lo) FROM outbox_delivered d2 WHERE d2.lo <= o.id) AND d.hi >= o.id
