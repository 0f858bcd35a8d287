-- Retention of attempts reads claimed_at (set at the insert, never updated)
-- instead of finished_at: see the PostgreSQL migration of the same name
-- (there, closing an attempt becomes a HOT update). SQLite has no HOT
-- updates; the index follows the shared query.
DROP INDEX job_attempts_finished_idx;
CREATE INDEX job_attempts_claimed_idx ON job_attempts (claimed_at);
