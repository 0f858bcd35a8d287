-- Reading delivery state through the delivered-ranges ledger
-- (outbox_delivered, issue #20; see its migration). An outbox id is covered
-- when a range has lo <= id <= hi; then
--   delivered = state = 'delivered' OR (state = 'pending' AND covered)
--   pending   = state = 'pending' AND NOT covered
--   dead      = state = 'dead'

-- name: outbox_covering [fragment]
-- The range covering outbox row `o` (a LEFT JOIN's condition: no range
-- when uncovered): ranges never overlap, so it is the one with the
-- greatest lo <= o.id, when its hi reaches o.id (one backward probe of
-- outbox_delivered_pkey per row).
d.lo = (SELECT max(d2.lo) FROM outbox_delivered d2 WHERE d2.lo <= o.id) AND d.hi >= o.id
