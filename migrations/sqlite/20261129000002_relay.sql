-- Relay membership (for a fair split of lanes) and the operator audit log.

CREATE TABLE relay_instances (
    owner      TEXT    NOT NULL,
    expires_at INTEGER NOT NULL,
    CONSTRAINT relay_instances_pkey PRIMARY KEY (owner)
);

CREATE TABLE ferry_audit (
    id      INTEGER CONSTRAINT ferry_audit_pkey PRIMARY KEY AUTOINCREMENT,
    at      INTEGER NOT NULL,
    actor   TEXT    NOT NULL,
    action  TEXT    NOT NULL,
    subject TEXT    NOT NULL,
    reason  TEXT    NOT NULL
);
