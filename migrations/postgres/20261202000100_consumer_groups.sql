-- The console's consumer groups: when each group last wrote its ledger and
-- how many records it dead-lettered, each read from an index instead of the
-- group's whole ledger. (group_id, processed_at) also serves the per-group
-- retention sweep, so it replaces the plain processed_at index and the
-- ledger insert keeps one secondary index; dead letters are few, so their
-- partial index costs the consumer's hot path nothing.
-- Old index dropped last: see 20261202000200_attempts_hot.sql.
CREATE INDEX consumer_ledger_group_processed_idx ON consumer_ledger (group_id, processed_at);
CREATE INDEX consumer_ledger_dead_idx ON consumer_ledger (group_id) WHERE outcome = 'dead_lettered';
DROP INDEX consumer_ledger_processed_idx;
