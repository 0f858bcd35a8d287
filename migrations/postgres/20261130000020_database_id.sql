-- This database's identity, generated once at migration. The relay publishes
-- default effect keys as `<database_id>:<outbox id>`, so two databases (or a
-- database recreated from scratch) never share keys in one consumer group's
-- ledger. A database restored from a backup keeps its id: see README.
INSERT INTO ferry_settings (name, value) VALUES ('database_id', gen_random_uuid()::text)
ON CONFLICT ON CONSTRAINT ferry_settings_pkey DO NOTHING;
