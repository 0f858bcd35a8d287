-- `ferry-relay run --capture wal` (PostgreSQL only: SQLite always polls).
-- One row per replication slot the relay created. A new slot streams only
-- what commits after it, so the rows already in the table are published once
-- from the table first; `caught_up` says that read finished. It is set false
-- before the slot is created, so a crash in between still catches up.
-- `catch_up_through` is the highest id committed when the slot was made
-- (read after it): every row committed before the slot has an id at most
-- that, so the read stops there and later rows come from the stream alone.
CREATE TABLE relay_wal_slots (
    slot             TEXT    NOT NULL,
    caught_up        BOOLEAN NOT NULL,
    catch_up_through BIGINT,
    updated_at       BIGINT  NOT NULL,
    CONSTRAINT relay_wal_slots_pkey PRIMARY KEY (slot)
);
