-- Attempt rows are keyed by lease generation, which only goes up, instead of
-- the attempt number: a release gives the attempt back (attempts - 1), so the
-- next claim reuses the number, and keying on it made that claim fail on the
-- primary key (and, the released job being due first, every later claim of
-- the queue with it). One claim writes one row per generation, so existing
-- rows already satisfy the new key.
ALTER TABLE job_attempts DROP CONSTRAINT job_attempts_pkey;
ALTER TABLE job_attempts ADD CONSTRAINT job_attempts_pkey PRIMARY KEY (tenant, run_id, generation);
