-- The outbox tables of relay/tests/it/debezium.rs and bench/debezium/golden,
-- in Debezium's outbox layout (created in the search_path's schema).
CREATE TABLE outbox_event (
    id            uuid PRIMARY KEY,
    aggregatetype varchar(255) NOT NULL,
    aggregateid   varchar(255) NOT NULL,
    type          varchar(255) NOT NULL,
    payload       jsonb,
    tenant        text,
    version       integer,
    occurred_at   timestamptz
);

CREATE TABLE domain_events (
    event_id  uuid PRIMARY KEY,
    stream    text NOT NULL,
    entity_id text,
    kind      text NOT NULL,
    seq       bigint NOT NULL,
    body      bytea,
    live      boolean NOT NULL
);
