-- Delivered state without rewriting outbox rows (issue #20). `--capture wal`
-- records what Kafka acknowledged as ranges of outbox ids, one ledger row
-- per run of consecutive delivered ids, instead of an UPDATE of every row
-- (a new row version, 532 WAL bytes per row: BENCHMARKS.md "The mark's cost
-- at the SQL level"). Meaning, for every reader:
--   delivered = state = 'delivered' OR (state = 'pending' AND covered)
--   pending   = state = 'pending' AND NOT covered
--   dead      = state = 'dead'
-- where covered = some row of this table has lo <= id <= hi. Ranges never
-- overlap (the marker trims a republished range to what is not covered and
-- serializes on an advisory lock), so the range covering an id is the one
-- with the greatest lo <= id. Adjacent ranges acknowledged within a second
-- of each other are merged, keeping the later delivered_at (so a range's
-- delivered_at is at most a second after each of its rows' acknowledgement).
-- Retention deletes covered rows and then the ranges left covering none.
CREATE TABLE outbox_delivered (
    lo           BIGINT NOT NULL,
    hi           BIGINT NOT NULL,
    delivered_at BIGINT NOT NULL,
    CONSTRAINT outbox_delivered_pkey PRIMARY KEY (lo),
    CONSTRAINT outbox_delivered_range_check CHECK (hi >= lo)
);
CREATE INDEX outbox_delivered_at_idx ON outbox_delivered (delivered_at);
