-- A queue's owner may say its run events need not go to Kafka (issue #21):
-- see the PostgreSQL migration of the same name.
ALTER TABLE ferry_queues ADD COLUMN publish_events BOOLEAN NOT NULL DEFAULT TRUE;
