-- Each live relay announces its --max-lanes, so every relay can compute the
-- same water-filled share: capped relays take their cap, the others split the
-- rest, and no lane is left unowned when caps differ.
ALTER TABLE relay_instances ADD COLUMN max_lanes INTEGER NOT NULL DEFAULT 1024;
