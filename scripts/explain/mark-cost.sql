-- What marking a delivered outbox row costs PostgreSQL, three ways, on
-- the real schema: the relay's mark (`UPDATE … SET state = 'delivered'`,
-- which moves the row between partial indexes, so it is never HOT), an
-- update of columns no index names (HOT when the page has room: the
-- fillfactor below), and the delete that `--delete-on-delivery` makes.
-- Each way marks 100,000 rows of 100 B in batches of 10,000 ids, as the
-- WAL marker does. Run on a database Ferry migrated (BENCHMARKS.md):
--   createdb mark_cost && ferry migrate --database-url postgres://…/mark_cost
--   psql postgres://…/mark_cost -f scripts/explain/mark-cost.sql
-- It empties that database's outbox.
\set ON_ERROR_STOP 1
TRUNCATE outbox;
ALTER TABLE outbox SET (fillfactor = 80);
INSERT INTO outbox (tenant, topic, key, lane, payload, headers, created_at)
SELECT 'acme', 'orders', 'k' || (g % 1000), g % 64, convert_to(repeat('x', 100), 'UTF8'), '{}'::jsonb, 1
FROM generate_series(1, 300000) g;
VACUUM ANALYZE outbox;
CREATE TEMP TABLE cost (way TEXT, ms NUMERIC, wal_bytes NUMERIC, hot BIGINT);
CREATE FUNCTION pg_temp.mark(way TEXT, first BIGINT) RETURNS VOID LANGUAGE plpgsql AS $$
DECLARE t0 TIMESTAMPTZ; l0 PG_LSN; h0 BIGINT; ids BIGINT[];
BEGIN
  SELECT n_tup_hot_upd INTO h0 FROM pg_stat_user_tables WHERE relname = 'outbox';
  t0 := clock_timestamp(); l0 := pg_current_wal_insert_lsn();
  FOR b IN 0..9 LOOP
    ids := ARRAY(SELECT generate_series(first + b * 10000, first + b * 10000 + 9999));
    IF way = 'update state (the mark)' THEN
      UPDATE outbox SET state = 'delivered', delivered_at = 2, publish_attempts = publish_attempts + 1
      WHERE id = ANY (ids) AND state = 'pending';
    ELSIF way = 'update unindexed columns' THEN
      UPDATE outbox SET last_error = NULL, publish_attempts = publish_attempts + 1
      WHERE id = ANY (ids) AND state = 'pending';
    ELSE
      DELETE FROM outbox WHERE id = ANY (ids) AND state = 'pending';
    END IF;
  END LOOP;
  INSERT INTO cost VALUES (way, round(extract(epoch FROM clock_timestamp() - t0)::numeric * 1000),
                           pg_current_wal_insert_lsn() - l0, 0);
END $$;
SELECT min(id) AS lo FROM outbox \gset
SELECT pg_temp.mark('update state (the mark)', :lo);
SELECT pg_temp.mark('update unindexed columns', :lo + 100000);
SELECT pg_temp.mark('delete (--delete-on-delivery)', :lo + 200000);
SELECT way, ms AS "ms per 100k rows", round(wal_bytes / 100000) AS "WAL bytes per row" FROM cost;
SELECT pg_stat_force_next_flush();
SELECT n_tup_upd, n_tup_hot_upd, n_tup_del FROM pg_stat_user_tables WHERE relname = 'outbox';
ALTER TABLE outbox RESET (fillfactor);
TRUNCATE outbox;
