-- The operator console: dead rows grouped by tenant and error code without
-- reading the delivered rows (dead rows are few, so the partial index is small
-- and costs nothing on the relay's hot path: rows enter it only when they die).
CREATE INDEX outbox_dead_idx ON outbox (tenant, last_error) WHERE state = 'dead';
