-- Attempt rows are keyed by lease generation, which only goes up, instead of
-- the attempt number: a release gives the attempt back (attempts - 1), so the
-- next claim reuses the number, and keying on it made that claim fail on the
-- primary key (and, the released job being due first, every later claim of
-- the queue with it). SQLite cannot change a primary key in place, so the
-- table is rebuilt; nothing references job_attempts.
CREATE TABLE job_attempts_by_generation (
    tenant      TEXT    NOT NULL,
    run_id      BLOB    NOT NULL,
    attempt     INTEGER NOT NULL,
    generation  BIGINT  NOT NULL,
    worker      TEXT    NOT NULL,
    claimed_at  BIGINT  NOT NULL,
    finished_at BIGINT,
    outcome     TEXT,
    error_class TEXT,
    error_code  TEXT,
    CONSTRAINT job_attempts_pkey PRIMARY KEY (tenant, run_id, generation),
    CONSTRAINT job_attempts_job_fkey FOREIGN KEY (tenant, run_id) REFERENCES jobs (tenant, run_id) ON DELETE CASCADE,
    CONSTRAINT job_attempts_outcome_check CHECK (outcome IS NULL OR outcome IN ('succeeded', 'retried', 'dead', 'cancelled', 'lost', 'released')),
    CONSTRAINT job_attempts_class_check CHECK (error_class IS NULL OR error_class IN ('retryable', 'terminal', 'ambiguous'))
);
INSERT INTO job_attempts_by_generation
    (tenant, run_id, attempt, generation, worker, claimed_at, finished_at, outcome, error_class, error_code)
SELECT tenant, run_id, attempt, generation, worker, claimed_at, finished_at, outcome, error_class, error_code
FROM job_attempts;
DROP TABLE job_attempts;
ALTER TABLE job_attempts_by_generation RENAME TO job_attempts;
CREATE INDEX job_attempts_finished_idx ON job_attempts (finished_at) WHERE finished_at IS NOT NULL;
