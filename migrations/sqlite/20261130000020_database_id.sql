-- This database's identity, generated once at migration. The relay publishes
-- default effect keys as `<database_id>:<outbox id>`, so two databases (or a
-- database recreated from scratch) never share keys in one consumer group's
-- ledger. A database restored from a backup keeps its id: see README.
-- A random (version 4) UUID in its canonical lowercase text form.
INSERT OR IGNORE INTO ferry_settings (name, value) VALUES ('database_id', lower(
    hex(randomblob(4)) || '-' || hex(randomblob(2)) || '-4' || substr(hex(randomblob(2)), 2) || '-'
    || substr('89ab', 1 + (abs(random()) % 4), 1) || substr(hex(randomblob(2)), 2) || '-' || hex(randomblob(6))
));
