/*
 * The golden records of Ferry's Debezium outbox compatibility
 * (relay/tests/debezium/*.golden.jsonl): Debezium 3.6.1's embedded engine
 * reads a table through the PostgreSQL connector (pgoutput, the slot and
 * publication made by the caller before the rows), applies the connector
 * file's transforms (the outbox EventRouter), and each record goes through
 * the converters the file names, as Kafka Connect's worker would send it.
 * One JSON line per record: topic, partition (Kafka's default partitioner,
 * murmur2 of the key bytes over BENCH_PARTITIONS; -1 without a key), key,
 * value and every header's bytes in hex, headers in order.
 *
 *   java ... ferry.bench.EventRouterGolden <connector file> <records> <output>
 *
 * bench/debezium/golden runs it (it lists the environment). With
 * BENCH_BROKERS set it is instead the Debezium side of
 * relay/examples/bench_debezium.rs: each converted record is produced to
 * that broker as Kafka Connect's worker sends it (acks=all, idempotent,
 * linger.ms=5, lz4, the same as the relay), sent without waiting for the
 * acknowledgements of a batch before the next (as Kafka Connect's worker
 * sends; it commits offsets of acknowledged records apart, and a benchmark
 * keeps them in memory), and "rows/s N" printed once <records> were
 * acknowledged, from the first acknowledgement (the engine's start left
 * out; the output file is not written).
 */
package ferry.bench;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import io.debezium.embedded.Connect;
import io.debezium.engine.ChangeEvent;
import io.debezium.engine.DebeziumEngine;
import java.io.FileReader;
import java.io.Reader;
import java.net.URI;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.Iterator;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;
import java.util.concurrent.atomic.AtomicReference;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.common.header.internals.RecordHeaders;
import org.apache.kafka.common.serialization.ByteArraySerializer;
import org.apache.kafka.common.utils.Utils;
import org.apache.kafka.connect.header.Header;
import org.apache.kafka.connect.source.SourceRecord;
import org.apache.kafka.connect.storage.Converter;
import org.apache.kafka.connect.storage.HeaderConverter;
import org.apache.kafka.connect.storage.SimpleHeaderConverter;

public final class EventRouterGolden {
    public static void main(String[] args) throws Exception {
        Path file = Path.of(args[0]);
        int want = Integer.parseInt(args[1]);
        Path output = Path.of(args[2]);
        Properties p = read(file);
        String url = System.getenv().getOrDefault("BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres");
        URI db = URI.create(url);
        String[] user = (db.getUserInfo() == null ? "postgres" : db.getUserInfo()).split(":", 2);
        String slot = System.getenv("BENCH_SLOT");
        int partitions = Integer.parseInt(System.getenv().getOrDefault("BENCH_PARTITIONS", "3"));
        p.setProperty("offset.storage", "org.apache.kafka.connect.storage.MemoryOffsetBackingStore");
        p.setProperty("offset.flush.interval.ms", "1000");
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

        Converter key = converter(p, "key");
        Converter value = converter(p, "value");
        HeaderConverter headers = new SimpleHeaderConverter();
        headers.configure(new HashMap<>());

        String brokers = System.getenv("BENCH_BROKERS");
        KafkaProducer<byte[], byte[]> producer = null;
        if (brokers != null && !brokers.isEmpty()) {
            Properties kp = new Properties();
            kp.setProperty("bootstrap.servers", brokers);
            kp.setProperty("acks", "all");
            kp.setProperty("enable.idempotence", "true");
            kp.setProperty("linger.ms", "5");
            kp.setProperty("compression.type", "lz4");
            producer = new KafkaProducer<>(kp, new ByteArraySerializer(), new ByteArraySerializer());
        }
        final KafkaProducer<byte[], byte[]> kafka = producer;
        AtomicLong acked = new AtomicLong();
        AtomicLong firstAck = new AtomicLong();
        AtomicReference<Exception> failed = new AtomicReference<>();
        List<String> lines = new ArrayList<>();
        CountDownLatch done = new CountDownLatch(1);
        DebeziumEngine<ChangeEvent<SourceRecord, SourceRecord>> engine = DebeziumEngine.create(Connect.class)
                .using(p)
                .notifying((records, committer) -> {
                    if (kafka != null) {
                        for (ChangeEvent<SourceRecord, SourceRecord> event : records) {
                            SourceRecord r = event.value();
                            if (r == null) {
                                continue;
                            }
                            byte[] k = key.fromConnectData(r.topic(), r.keySchema(), r.key());
                            byte[] v = value.fromConnectData(r.topic(), r.valueSchema(), r.value());
                            RecordHeaders hs = new RecordHeaders();
                            for (Header h : r.headers()) {
                                hs.add(h.key(), headers.fromConnectHeader(r.topic(), h.key(), h.schema(), h.value()));
                            }
                            kafka.send(new ProducerRecord<>(r.topic(), null, k, v, hs), (meta, e) -> {
                                if (e != null) {
                                    failed.compareAndSet(null, e);
                                    done.countDown();
                                } else {
                                    long a = acked.incrementAndGet();
                                    if (a == 1) {
                                        firstAck.set(System.nanoTime());
                                    }
                                    if (a == want) {
                                        done.countDown();
                                    }
                                }
                            });
                        }
                        for (ChangeEvent<SourceRecord, SourceRecord> event : records) {
                            committer.markProcessed(event);
                        }
                        committer.markBatchFinished();
                        return;
                    }
                    for (ChangeEvent<SourceRecord, SourceRecord> event : records) {
                        SourceRecord r = event.value();
                        if (r != null && lines.size() < want) {
                            lines.add(line(r, key, value, headers, partitions));
                            if (lines.size() == want) {
                                done.countDown();
                            }
                        }
                        committer.markProcessed(event);
                    }
                    committer.markBatchFinished();
                })
                .using((success, message, error) -> {
                    if (!success) {
                        System.err.println("the engine stopped: " + message + (error == null ? "" : ": " + error));
                        done.countDown();
                    }
                })
                .build();
        ExecutorService runner = Executors.newSingleThreadExecutor();
        runner.execute(engine);
        if (kafka != null) {
            boolean all = done.await(600, TimeUnit.SECONDS) && failed.get() == null;
            double secs = (System.nanoTime() - firstAck.get()) / 1e9;
            if (all) {
                System.out.printf("rows/s %.0f%n", (want - 1) / secs);
            } else {
                System.err.println("produce failed or timed out: " + failed.get() + ", " + acked.get() + " acknowledged");
            }
            System.out.flush();
            engine.close();
            kafka.close();
            System.exit(all ? 0 : 1);
        }
        boolean all = done.await(120, TimeUnit.SECONDS) && lines.size() == want;
        Files.write(output, lines, StandardCharsets.UTF_8);
        if (!all) {
            System.err.println("only " + lines.size() + " of " + want + " records");
            System.exit(1);
        }
        engine.close();
        runner.shutdown();
        runner.awaitTermination(30, TimeUnit.SECONDS);
        System.exit(0);
    }

    /** A connector file: Kafka Connect's JSON ({"config": {...}} or flat) or properties. */
    private static Properties read(Path file) throws Exception {
        Properties p = new Properties();
        String text = Files.readString(file);
        if (text.trim().startsWith("{")) {
            JsonNode root = new ObjectMapper().readTree(text);
            JsonNode config = root.has("config") ? root.get("config") : root;
            if (root.has("config") && root.has("name")) {
                p.setProperty("name", root.get("name").asText());
            }
            Iterator<Map.Entry<String, JsonNode>> fields = config.fields();
            while (fields.hasNext()) {
                Map.Entry<String, JsonNode> f = fields.next();
                p.setProperty(f.getKey(), f.getValue().asText());
            }
        } else {
            try (Reader in = new FileReader(file.toFile(), StandardCharsets.UTF_8)) {
                p.load(in);
            }
        }
        return p;
    }

    /** The `<role>.converter` class, configured with its `<role>.converter.*` settings. */
    private static Converter converter(Properties p, String role) throws Exception {
        String prefix = role + ".converter";
        Converter c = (Converter) Class.forName(p.getProperty(prefix)).getDeclaredConstructor().newInstance();
        Map<String, Object> settings = new HashMap<>();
        for (String name : p.stringPropertyNames()) {
            if (name.startsWith(prefix + ".")) {
                settings.put(name.substring(prefix.length() + 1), p.getProperty(name));
            }
        }
        c.configure(settings, role.equals("key"));
        return c;
    }

    private static String line(SourceRecord r, Converter key, Converter value, HeaderConverter headers, int partitions) {
        byte[] k = key.fromConnectData(r.topic(), r.keySchema(), r.key());
        byte[] v = value.fromConnectData(r.topic(), r.valueSchema(), r.value());
        StringBuilder s = new StringBuilder("{\"topic\":").append(str(r.topic()));
        s.append(",\"partition\":").append(k == null ? -1 : Utils.toPositive(Utils.murmur2(k)) % partitions);
        s.append(",\"key\":").append(hex(k));
        s.append(",\"value\":").append(hex(v));
        s.append(",\"headers\":[");
        boolean first = true;
        for (Header h : r.headers()) {
            if (!first) {
                s.append(',');
            }
            first = false;
            byte[] b = headers.fromConnectHeader(r.topic(), h.key(), h.schema(), h.value());
            s.append('[').append(str(h.key())).append(',').append(hex(b)).append(']');
        }
        return s.append("]}").toString();
    }

    private static String hex(byte[] b) {
        if (b == null) {
            return "null";
        }
        StringBuilder s = new StringBuilder("\"");
        for (byte x : b) {
            s.append(String.format("%02x", x));
        }
        return s.append('"').toString();
    }

    private static String str(String s) {
        StringBuilder out = new StringBuilder("\"");
        for (char c : s.toCharArray()) {
            if (c == '"' || c == '\\') {
                out.append('\\').append(c);
            } else if (c < 0x20) {
                out.append(String.format("\\u%04x", (int) c));
            } else {
                out.append(c);
            }
        }
        return out.append('"').toString();
    }
}
