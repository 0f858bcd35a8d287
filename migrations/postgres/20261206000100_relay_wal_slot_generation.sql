-- `--capture wal`: which making of a slot its record describes. Every time a
-- relay is about to make the slot (anew), `generation` goes up with the
-- reset of `caught_up`, `catch_up_through` and `marked_lsn`. A table read
-- records `caught_up` only for the generation it read the bound of: a
-- session whose slot was invalidated and made anew by another relay while
-- it read the table must not tell the new slot's session that its rows
-- (committed between the two slots) were read.
ALTER TABLE relay_wal_slots ADD COLUMN generation BIGINT NOT NULL DEFAULT 0;
