-- A queue's owner may say its run events need not go to Kafka (issue #21):
-- with publish_events false, the queue's runs still write every run event
-- (history, lineage, the one terminal event per run) but no outbox row for
-- them. Read at each event's write, so a run follows the setting as it is
-- when each of its events is written. Changed only through
-- Operator::set_queue_publish_events, audited like the other settings.
ALTER TABLE ferry_queues ADD COLUMN publish_events BOOLEAN NOT NULL DEFAULT TRUE;
