-- `--capture wal --streams N`: how many streams a relay group splits the
-- outbox into, by its base slot name (`--slot`, or the default). Stream k
-- of N is slot `<slot>_<k>of<N>` with a publication filtered on
-- `lane % N = k` (one stream: the slot itself). The last relay started
-- sets it; a relay of another N stops streaming and stands by, and the
-- slots of another layout are dropped (once no session streams from them)
-- before this layout's are made, so a change of N reads the pending rows
-- from the table and loses nothing.
CREATE TABLE relay_wal_layouts (
    slot       TEXT    NOT NULL,
    streams    INTEGER NOT NULL CHECK (streams >= 1),
    updated_at BIGINT  NOT NULL,
    CONSTRAINT relay_wal_layouts_pkey PRIMARY KEY (slot)
);

-- The relays of a group taking part in its streams, with when their
-- heartbeat expires: each takes an even share of the streams (the relays of
-- other groups and polling relays, in `relay_instances`, take none).
CREATE TABLE relay_wal_members (
    slot       TEXT   NOT NULL,
    owner      TEXT   NOT NULL,
    expires_at BIGINT NOT NULL,
    CONSTRAINT relay_wal_members_pkey PRIMARY KEY (slot, owner)
);
