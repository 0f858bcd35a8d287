-- Delivered ranges (issue #20): see the PostgreSQL migration of the same
-- name. SQLite has no WAL capture, so nothing writes here; the table exists
-- so that the readers' statements are the same on both engines.
CREATE TABLE outbox_delivered (
    lo           INTEGER NOT NULL PRIMARY KEY,
    hi           INTEGER NOT NULL CHECK (hi >= lo),
    delivered_at INTEGER NOT NULL
);
CREATE INDEX outbox_delivered_at_idx ON outbox_delivered (delivered_at);
