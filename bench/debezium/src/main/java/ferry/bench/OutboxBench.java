/*
 * The Debezium baseline of BENCHMARKS.md "WAL capture (issue #20)":
 * Debezium 3.6.1's embedded engine reads the Ferry outbox through the
 * PostgreSQL connector (pgoutput, the slot and publication made by the
 * caller before the rows, snapshot.mode=no_data), the outbox EventRouter
 * turns each row into a record (topic from the `topic` column, key from
 * `key`, value the `payload` bytes), and a plain KafkaProducer (acks=all,
 * idempotent, linger.ms=5, lz4: the settings of the Rust bench's raw
 * produce) sends them. Like Debezium Server's Kafka sink, a batch is
 * marked processed only once Kafka acknowledged every record in it.
 *
 *   drain:   waits for BENCH_ROWS acknowledgements, prints "rows/s N".
 *   latency: prints "ready" once its task runs; forgets its samples at the
 *            row keyed "__warm"; at "__end" prints "p50 N" and "p99 N"
 *            (commit -> ack, ms, from the row's created_at).
 *
 * Settings come from the environment (bench/debezium/run lists them).
 */
package ferry.bench;

import io.debezium.embedded.Connect;
import io.debezium.engine.ChangeEvent;
import io.debezium.engine.DebeziumEngine;
import java.net.URI;
import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Collections;
import java.util.List;
import java.util.Properties;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;
import java.util.concurrent.atomic.AtomicReference;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.common.serialization.ByteArraySerializer;
import org.apache.kafka.connect.header.Header;
import org.apache.kafka.connect.source.SourceRecord;

public final class OutboxBench {
    private static String env(String name, String fallback) {
        String v = System.getenv(name);
        if (v == null || v.isEmpty()) {
            if (fallback == null) {
                throw new IllegalArgumentException(name + " is required");
            }
            return fallback;
        }
        return v;
    }

    public static void main(String[] args) throws Exception {
        String mode = args.length > 0 ? args[0] : "drain";
        URI db = URI.create(env("BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres"));
        String[] user = (db.getUserInfo() == null ? "postgres" : db.getUserInfo()).split(":", 2);
        String schema = env("BENCH_SCHEMA", null);
        String slot = env("BENCH_SLOT", null);

        Properties p = new Properties();
        p.setProperty("name", "ferry-outbox-bench");
        p.setProperty("connector.class", "io.debezium.connector.postgresql.PostgresConnector");
        p.setProperty("offset.storage", "org.apache.kafka.connect.storage.MemoryOffsetBackingStore");
        p.setProperty("offset.flush.interval.ms", "1000");
        p.setProperty("topic.prefix", "ferrybench");
        p.setProperty("database.hostname", db.getHost());
        p.setProperty("database.port", String.valueOf(db.getPort() > 0 ? db.getPort() : 5432));
        p.setProperty("database.user", user[0]);
        p.setProperty("database.password", user.length > 1 ? user[1] : "");
        p.setProperty("database.dbname", db.getPath().replaceFirst("^/", ""));
        p.setProperty("plugin.name", "pgoutput");
        p.setProperty("slot.name", slot);
        p.setProperty("publication.name", slot);
        p.setProperty("publication.autocreate.mode", "disabled");
        p.setProperty("snapshot.mode", "no_data");
        p.setProperty("table.include.list", schema + ".outbox");
        p.setProperty("binary.handling.mode", "bytes");
        p.setProperty("extended.headers.enabled", "false");
        String pollMs = System.getenv("BENCH_POLL_INTERVAL_MS");
        if (pollMs != null && !pollMs.isEmpty()) {
            p.setProperty("poll.interval.ms", pollMs);
        }
        // The outbox EventRouter on Ferry's columns (not Debezium's
        // aggregatetype/aggregateid/payload defaults).
        p.setProperty("transforms", "outbox");
        p.setProperty("transforms.outbox.type", "io.debezium.transforms.outbox.EventRouter");
        p.setProperty("transforms.outbox.table.field.event.id", "id");
        p.setProperty("transforms.outbox.table.field.event.key", "key");
        p.setProperty("transforms.outbox.table.field.event.payload", "payload");
        p.setProperty("transforms.outbox.route.by.field", "topic");
        p.setProperty("transforms.outbox.route.topic.replacement", "${routedByValue}");
        p.setProperty("transforms.outbox.table.fields.additional.placement", "created_at:header:created_at");

        Properties kp = new Properties();
        kp.setProperty("bootstrap.servers", env("BENCH_BROKERS", null));
        kp.setProperty("acks", "all");
        kp.setProperty("enable.idempotence", "true");
        kp.setProperty("linger.ms", "5");
        kp.setProperty("compression.type", "lz4");
        KafkaProducer<byte[], byte[]> producer =
                new KafkaProducer<>(kp, new ByteArraySerializer(), new ByteArraySerializer());

        boolean latency = mode.equals("latency");
        long rows = latency ? Long.MAX_VALUE : Long.parseLong(env("BENCH_ROWS", null));
        AtomicLong acked = new AtomicLong();
        List<Long> samples = Collections.synchronizedList(new ArrayList<>());
        CountDownLatch done = new CountDownLatch(1);
        AtomicReference<Exception> failed = new AtomicReference<>();
        long started = System.nanoTime();

        DebeziumEngine<ChangeEvent<SourceRecord, SourceRecord>> engine = DebeziumEngine.create(Connect.class)
                .using(p)
                .using(new DebeziumEngine.ConnectorCallback() {
                    @Override
                    public void taskStarted() {
                        System.out.println("ready");
                        System.out.flush();
                    }
                })
                .notifying((records, committer) -> {
                    CountDownLatch batch = new CountDownLatch(records.size());
                    for (ChangeEvent<SourceRecord, SourceRecord> event : records) {
                        SourceRecord r = event.value();
                        String key = String.valueOf(r.key());
                        Header created = r.headers().lastWithName("created_at");
                        long createdAt = created == null ? 0 : ((Number) created.value()).longValue();
                        producer.send(
                                new ProducerRecord<>(r.topic(), key.getBytes(StandardCharsets.UTF_8), bytes(r.value())),
                                (meta, e) -> {
                                    if (e != null) {
                                        failed.compareAndSet(null, e);
                                        done.countDown();
                                    } else if (latency) {
                                        if (key.equals("__warm")) {
                                            samples.clear();
                                        } else if (key.equals("__end")) {
                                            done.countDown();
                                        } else {
                                            samples.add(System.currentTimeMillis() - createdAt);
                                        }
                                    } else if (acked.incrementAndGet() == rows) {
                                        done.countDown();
                                    }
                                    batch.countDown();
                                });
                    }
                    batch.await();
                    for (ChangeEvent<SourceRecord, SourceRecord> event : records) {
                        committer.markProcessed(event);
                    }
                    committer.markBatchFinished();
                })
                .build();
        ExecutorService runner = Executors.newSingleThreadExecutor();
        runner.execute(engine);
        done.await();
        double secs = (System.nanoTime() - started) / 1e9;
        if (failed.get() != null) {
            System.err.println("produce failed: " + failed.get());
        } else if (latency) {
            List<Long> s = new ArrayList<>(samples);
            Collections.sort(s);
            System.out.println("p50 " + quantile(s, 0.5));
            System.out.println("p99 " + quantile(s, 0.99));
            System.out.println("samples " + s.size());
        } else {
            System.out.printf("rows/s %.0f%n", rows / secs);
        }
        System.out.flush();
        engine.close();
        producer.close();
        runner.shutdown();
        runner.awaitTermination(30, TimeUnit.SECONDS);
        System.exit(failed.get() == null ? 0 : 1);
    }

    private static byte[] bytes(Object v) {
        if (v == null) {
            return null;
        }
        if (v instanceof byte[] b) {
            return b;
        }
        if (v instanceof ByteBuffer bb) {
            byte[] out = new byte[bb.remaining()];
            bb.duplicate().get(out);
            return out;
        }
        return v.toString().getBytes(StandardCharsets.UTF_8);
    }

    private static long quantile(List<Long> sorted, double q) {
        if (sorted.isEmpty()) {
            return 0;
        }
        int i = (int) Math.ceil(q * sorted.size()) - 1;
        return sorted.get(Math.max(0, Math.min(sorted.size() - 1, i)));
    }
}
