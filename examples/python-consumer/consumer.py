"""A Ferry consumer in Python: each effect applied exactly once.

The effect-ledger protocol of docs/consumer-protocol.md, on the tables
`ferry-consumer` uses (consumer_partitions, consumer_ledger), with
confluent-kafka and psycopg 3. Replace `apply_effect` with your own; it runs
inside the transaction that records the effect key and the next offset, so
the three commit together or not at all.

Settings (environment):
  FERRY_DATABASE_URL  PostgreSQL URL (its search_path selects Ferry's schema)
  FERRY_BROKERS       Kafka bootstrap servers
  FERRY_GROUP         consumer group id (also the ledger's group)
  FERRY_TOPICS        comma-separated topics
  FERRY_OWNER         this member's name (default: host name and pid)
  FERRY_LEASE_MS      partition lease, renewed every third of it (default 10000)
  FERRY_EFFECTS_TABLE the demo effect's table (default example_effects;
                      made when missing)

Run: python consumer.py (stops on SIGINT or SIGTERM, giving its leases back).
"""

import json
import os
import signal
import socket
import sys
import time

import psycopg
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

# The statements of consumer/sql/consumer.sql, with the database's clock
# (`now` is milliseconds since the Unix epoch).
NOW = "(extract(epoch FROM now()) * 1000)::bigint"

ACQUIRE = f"""
INSERT INTO consumer_partitions AS p (group_id, topic, partition, owner, generation, lease_expires_at)
VALUES (%(group)s, %(topic)s, %(partition)s, %(owner)s, 1, {NOW} + %(lease)s)
ON CONFLICT (group_id, topic, partition) DO UPDATE
    SET owner = EXCLUDED.owner, generation = p.generation + 1,
        lease_expires_at = EXCLUDED.lease_expires_at
RETURNING generation, next_offset
"""

# The reclaim of a lease this member lost while Kafka still assigns it the
# partition: only if nobody holds it (released, expired, or its own).
ACQUIRE_FREE = f"""
INSERT INTO consumer_partitions AS p (group_id, topic, partition, owner, generation, lease_expires_at)
VALUES (%(group)s, %(topic)s, %(partition)s, %(owner)s, 1, {NOW} + %(lease)s)
ON CONFLICT (group_id, topic, partition) DO UPDATE
    SET owner = EXCLUDED.owner, generation = p.generation + 1,
        lease_expires_at = EXCLUDED.lease_expires_at
    WHERE p.owner IS NULL OR p.owner = EXCLUDED.owner OR p.lease_expires_at IS NULL
        OR p.lease_expires_at <= {NOW}
RETURNING generation, next_offset
"""

RELEASE = """
UPDATE consumer_partitions SET owner = NULL, lease_expires_at = NULL
WHERE group_id = %(group)s AND topic = %(topic)s AND partition = %(partition)s
  AND owner = %(owner)s AND generation = %(generation)s
"""

RENEW = f"""
UPDATE consumer_partitions SET lease_expires_at = {NOW} + %(lease)s
WHERE group_id = %(group)s AND topic = %(topic)s AND partition = %(partition)s
  AND owner = %(owner)s AND generation = %(generation)s
"""

LOCK = """
SELECT next_offset FROM consumer_partitions
WHERE group_id = %(group)s AND topic = %(topic)s AND partition = %(partition)s
  AND owner = %(owner)s AND generation = %(generation)s
FOR UPDATE
"""

LEDGER = f"""
INSERT INTO consumer_ledger (group_id, effect_key, topic, partition, "offset", outcome, processed_at)
VALUES (%(group)s, %(key)s, %(topic)s, %(partition)s, %(offset)s, %(outcome)s, {NOW})
ON CONFLICT (group_id, effect_key) DO NOTHING
RETURNING effect_key
"""

ADVANCE = """
UPDATE consumer_partitions SET next_offset = %(next)s
WHERE group_id = %(group)s AND topic = %(topic)s AND partition = %(partition)s
  AND owner = %(owner)s AND generation = %(generation)s
"""


class LostPartition(Exception):
    """The partition's lease is no longer this member's generation."""


def apply_effect(cur, msg, table):
    """The demo effect: counts each effect key's applications (always 1
    when the protocol holds), the table `ferry-projection` keeps too, so
    members of both may share a group. Replace with your own writes."""
    cur.execute(
        f"""INSERT INTO {table} (effect_key, applied) VALUES (%s, 1)
            ON CONFLICT (effect_key) DO UPDATE SET applied = {table}.applied + 1""",
        (effect_key(msg),),
    )


def header(msg, name):
    """The first header `name` as text; None when absent or not UTF-8."""
    for key, value in msg.headers() or []:
        if key == name:
            try:
                return None if value is None else value.decode()
            except UnicodeDecodeError:
                return None
    return None


def effect_key(msg):
    """What to dedupe on, by `ferry-consumer`'s rule: the `ferry-effect-key`
    header every Ferry record carries (the writer's effect key, or the
    database id and outbox id), else `ferry-outbox-id` (relays that set no
    effect key); None when that is missing or empty."""
    key = header(msg, "ferry-effect-key")
    if key is None:
        key = header(msg, "ferry-outbox-id")
    return key or None


class Member:
    def __init__(self):
        self.group = os.environ["FERRY_GROUP"]
        self.owner = os.environ.get("FERRY_OWNER") or f"{socket.gethostname()}-{os.getpid()}"
        self.lease_ms = int(os.environ.get("FERRY_LEASE_MS", "10000"))
        self.table = os.environ.get("FERRY_EFFECTS_TABLE", "example_effects")
        self.db = psycopg.connect(os.environ["FERRY_DATABASE_URL"], autocommit=True)
        # A member stopped inside a transaction (SIGSTOP, a long pause) holds
        # its partition row's lock; the server ends it after this, so the
        # member that took the partition over is not held up behind it.
        self.db.execute("SET idle_in_transaction_session_timeout = '10s'")
        # Members start together, and two concurrent CREATE TABLE IF NOT
        # EXISTS of one table can both pass the check and one then fails on
        # the catalog's unique index: one member at a time.
        with self.db.transaction():
            self.db.execute("SELECT pg_advisory_xact_lock(hashtext('ferry-example-effects-ddl'))")
            self.db.execute(
                f"CREATE TABLE IF NOT EXISTS {self.table} (effect_key TEXT PRIMARY KEY, applied BIGINT NOT NULL)"
            )
        # (topic, partition) -> generation of the lease this member holds.
        self.leases = {}
        # Partitions Kafka assigns here whose lease was lost: paused, and
        # taken back once nobody holds the lease.
        self.unleased = set()
        self.consumer = Consumer(
            {
                "bootstrap.servers": os.environ["FERRY_BROKERS"],
                "group.id": self.group,
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                # Eager: ferry-consumer's `Assignment::Eager` members use
                # `range` too, so both may share a group (cooperative-sticky
                # members would find no common protocol with this one).
                "partition.assignment.strategy": "range",
                "session.timeout.ms": 6000,
                "heartbeat.interval.ms": 1000,
            }
        )
        self.stopping = False

    def lease(self, topic, partition, generation=None):
        params = {"group": self.group, "topic": topic, "partition": partition, "owner": self.owner}
        if generation is not None:
            params["generation"] = generation
        return params

    def on_assign(self, consumer, partitions):
        """Kafka assigned the partitions: take each lease at a higher
        generation (whoever held it) and start at the offset stored with the
        effects, where there is one."""
        for tp in partitions:
            params = self.lease(tp.topic, tp.partition)
            params["lease"] = self.lease_ms
            generation, next_offset = self.db.execute(ACQUIRE, params).fetchone()
            self.leases[(tp.topic, tp.partition)] = generation
            self.unleased.discard((tp.topic, tp.partition))
            if next_offset is not None:
                tp.offset = next_offset
        consumer.assign(partitions)
        # A partition paused when its lease was lost runs again once leased.
        consumer.resume(partitions)

    def on_revoke(self, consumer, partitions):
        """Give each lease back, only if still this generation."""
        for tp in partitions:
            self.unleased.discard((tp.topic, tp.partition))
            generation = self.leases.pop((tp.topic, tp.partition), None)
            if generation is not None:
                self.db.execute(RELEASE, self.lease(tp.topic, tp.partition, generation))
        consumer.unassign()

    def renew(self):
        """Extends every lease held (one another member took is lost: its
        partition pauses) and takes back a lost one nobody holds any more,
        starting again at the offset stored with the effects."""
        for (topic, partition), generation in list(self.leases.items()):
            params = self.lease(topic, partition, generation)
            params["lease"] = self.lease_ms
            if self.db.execute(RENEW, params).rowcount == 0:
                self.lost(topic, partition)
        for topic, partition in list(self.unleased):
            params = self.lease(topic, partition)
            params["lease"] = self.lease_ms
            row = self.db.execute(ACQUIRE_FREE, params).fetchone()
            if row is None:
                continue
            generation, next_offset = row
            self.unleased.discard((topic, partition))
            self.leases[(topic, partition)] = generation
            # Records polled while the lease was lost were passed over: start
            # again at the stored offset (none stored: nothing was processed).
            start = OFFSET_BEGINNING if next_offset is None else next_offset
            self.consumer.seek(TopicPartition(topic, partition, start))
            self.consumer.resume([TopicPartition(topic, partition)])

    def lost(self, topic, partition):
        self.leases.pop((topic, partition), None)
        self.unleased.add((topic, partition))
        self.consumer.pause([TopicPartition(topic, partition)])
        print(f"lease lost: {topic}/{partition}", file=sys.stderr, flush=True)

    def process(self, msg):
        """One record, one transaction: lock the partition row at this
        member's generation, insert the ledger row, apply the effect only if
        the key is new, store the next offset; commit. The Kafka offset is
        committed after, for monitoring only: the stored offset is the truth."""
        generation = self.leases.get((msg.topic(), msg.partition()))
        if generation is None:
            return
        params = self.lease(msg.topic(), msg.partition(), generation)
        key = effect_key(msg)
        if key is None:
            # Not a Ferry record: recorded as dead-lettered under a key no
            # relay publishes, as ferry-consumer does (which also sends it
            # to its dead-letter topic), and passed over.
            print(f"no effect key: {msg.topic()}/{msg.partition()}@{msg.offset()}", file=sys.stderr, flush=True)
            ledger = {"key": f"!unkeyed/{msg.topic()}/{msg.partition()}/{msg.offset()}", "outcome": "dead_lettered"}
        else:
            ledger = {"key": key, "outcome": "applied"}
        try:
            with self.db.transaction():
                with self.db.cursor() as cur:
                    if cur.execute(LOCK, params).fetchone() is None:
                        raise LostPartition()
                    new = cur.execute(LEDGER, {**params, **ledger, "offset": msg.offset()}).fetchone()
                    if new is not None and key is not None:
                        apply_effect(cur, msg, self.table)
                    cur.execute(ADVANCE, {**params, "next": msg.offset() + 1})
        except LostPartition:
            self.lost(msg.topic(), msg.partition())
            return
        self.consumer.commit(message=msg, asynchronous=True)

    def run(self):
        topics = os.environ["FERRY_TOPICS"].split(",")
        self.consumer.subscribe(topics, on_assign=self.on_assign, on_revoke=self.on_revoke)
        renew_at = time.monotonic() + self.lease_ms / 3000
        print(json.dumps({"ready": self.owner}), flush=True)
        while not self.stopping:
            msg = self.consumer.poll(0.2)
            if time.monotonic() >= renew_at:
                self.renew()
                renew_at = time.monotonic() + self.lease_ms / 3000
            if msg is None:
                continue
            if msg.error():
                # Only a fatal error ends the member; the client retries
                # the others (a broker away, a topic not there yet).
                if msg.error().fatal():
                    raise RuntimeError(msg.error())
                if msg.error().code() != KafkaError._PARTITION_EOF:
                    print(f"kafka: {msg.error()}", file=sys.stderr, flush=True)
                continue
            self.process(msg)
        # Leaving the group revokes the partitions: on_revoke releases them.
        self.consumer.close()
        self.db.close()


def main():
    member = Member()

    def stop(*_):
        member.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    member.run()


if __name__ == "__main__":
    main()
