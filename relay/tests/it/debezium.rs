//! Debezium outbox compatibility: ferry-relay given a Debezium connector's
//! file (`--debezium-config`) publishes the rows of
//! `tests/debezium/rows.sql` as the records Debezium 3.6.1's outbox
//! EventRouter made of the same rows (`tests/debezium/*.golden.jsonl`,
//! written by `bench/debezium/golden` with Debezium itself): the same
//! topic, partition, key, value and headers, byte for byte, in the same
//! order per partition, nothing more. Rows deleted in the transaction that
//! inserted them (Debezium's recommended pattern) are published; updates and
//! rolled-back inserts are not. A row Ferry cannot render as Debezium would
//! stops WAL capture there (the relay unready), and nothing after it is
//! published until the configuration changes; then it resumes from the slot
//! and loses nothing.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ferry_relay::metrics::CodeLabel;
use ferry_testkit::Kafka;
use rdkafka::message::{Headers, Message};
use serde_json::Value;

use crate::support::*;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/debezium")
}

/// One record: topic, partition (-1: keyless, any), key, value, headers.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Rec {
    topic: String,
    partition: i32,
    key: Option<Vec<u8>>,
    value: Option<Vec<u8>>,
    headers: Vec<(String, Option<Vec<u8>>)>,
}

impl std::fmt::Debug for Rec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let text = |b: &Option<Vec<u8>>| b.as_ref().map(|b| String::from_utf8_lossy(b).into_owned());
        let headers: Vec<(&str, Option<String>)> = self.headers.iter().map(|(k, v)| (k.as_str(), text(v))).collect();
        write!(
            f,
            "\n{} [{}] key {:?} value {:?} headers {:?}",
            self.topic,
            self.partition,
            text(&self.key),
            text(&self.value),
            headers
        )
    }
}

fn unhex(v: &Value) -> Option<Vec<u8>> {
    let s = v.as_str()?;
    Some(
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect(),
    )
}

/// The golden records of a connector file.
fn golden(file: &str) -> Vec<Rec> {
    let stem = file.rsplit_once('.').unwrap().0;
    let text = std::fs::read_to_string(fixtures().join(format!("{stem}.golden.jsonl"))).unwrap();
    text.lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            Rec {
                topic: v["topic"].as_str().unwrap().to_owned(),
                partition: v["partition"].as_i64().unwrap() as i32,
                key: unhex(&v["key"]),
                value: unhex(&v["value"]),
                headers: v["headers"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|h| (h[0].as_str().unwrap().to_owned(), unhex(&h[1])))
                    .collect(),
            }
        })
        .collect()
}

/// The connector's run id header: a fresh UUID per start of the connector
/// (or the relay), so only its presence and form are compared.
const RUN_ID: &str = "__debezium.context.runId";

/// Records per topic and partition, in offset order; a keyless record's
/// partition is the producer's choice (sticky in Java, random in
/// librdkafka), so those are listed per topic under partition -1. Run ids
/// are checked to be UUIDs and then blanked.
fn by_partition(recs: &[Rec]) -> BTreeMap<(String, i32), Vec<Rec>> {
    let mut out: BTreeMap<(String, i32), Vec<Rec>> = BTreeMap::new();
    for r in recs {
        let p = if r.key.is_none() { -1 } else { r.partition };
        let mut r = r.clone();
        r.partition = p;
        for (name, value) in &mut r.headers {
            if name == RUN_ID {
                let id = value.take().expect("a run id");
                assert!(
                    uuid::Uuid::parse_str(std::str::from_utf8(&id).unwrap()).is_ok(),
                    "{id:?}"
                );
            }
        }
        out.entry((r.topic.clone(), p)).or_default().push(r);
    }
    out
}

/// Every record of `topics` from the beginning, until `want` arrived.
fn read(brokers: &str, topics: &[String], want: usize, limit: Duration) -> Vec<Rec> {
    let names: Vec<&str> = topics.iter().map(String::as_str).collect();
    let c = consumer(brokers, &names);
    let start = Instant::now();
    let mut out = Vec::new();
    while out.len() < want {
        assert!(
            start.elapsed() < limit,
            "{} of {want} records after {limit:?}: {out:?}",
            out.len()
        );
        if let Some(m) = c.poll(Duration::from_millis(100)) {
            let m = m.unwrap();
            out.push(Rec {
                topic: m.topic().to_owned(),
                partition: m.partition(),
                key: m.key().map(<[u8]>::to_vec),
                value: m.payload().map(<[u8]>::to_vec),
                headers: m
                    .headers()
                    .map(|h| {
                        h.iter()
                            .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec)))
                            .collect()
                    })
                    .unwrap_or_default(),
            });
        }
    }
    out
}

/// Records in `topics` now (every partition's end offset, summed).
fn records_in(brokers: &str, topics: &[String]) -> i64 {
    topics
        .iter()
        .map(|t| end_offsets(brokers, t).values().sum::<i64>())
        .sum()
}

/// The fixture's tables in the test's schema.
async fn tables(pool: &sqlx::PgPool) {
    sqlx::raw_sql(&std::fs::read_to_string(fixtures().join("tables.sql")).unwrap())
        .execute(pool)
        .await
        .unwrap();
}

/// The connector file with its table moved from `inventory` to the test's
/// schema and `edit` applied (written to a temp file).
async fn connector_file(pool: &sqlx::PgPool, file: &str, edit: impl Fn(String) -> String) -> PathBuf {
    let schema: String = sqlx::query_scalar("SELECT current_schema()::text")
        .fetch_one(pool)
        .await
        .unwrap();
    let text = std::fs::read_to_string(fixtures().join(file))
        .unwrap()
        .replace("inventory.", &format!("{schema}."));
    let path = std::env::temp_dir().join(format!("{schema}-{file}"));
    std::fs::write(&path, edit(text)).unwrap();
    path
}

async fn publishes_what_debezium_published(file: &str) {
    let (ferry, url) = pg_ferry().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    let kafka = Kafka::start();
    let want = golden(file);
    let topics: Vec<String> = want
        .iter()
        .map(|r| r.topic.clone())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    for t in &topics {
        kafka.create_topic(t, 3);
    }
    tables(&pool).await;
    let config = connector_file(&pool, file, |t| t).await;
    let slot = SlotGuard::new().await;
    let mut cfg = slot.config(&url, &kafka.brokers());
    cfg.debezium_config = Some(config);
    let relay = slot.start(cfg, ferry.clone()).await;
    wait_for_streaming(&pool, &slot.name, None, Duration::from_secs(60)).await;
    sqlx::raw_sql(&std::fs::read_to_string(fixtures().join("rows.sql")).unwrap())
        .execute(&pool)
        .await
        .unwrap();
    let got = read(&kafka.brokers(), &topics, want.len(), Duration::from_secs(60));
    // Shut down: everything produced is settled, so the topics hold all of
    // it (an update, a rolled-back insert or a delete published would be
    // more).
    relay.shutdown().await;
    assert_eq!(
        by_partition(&got),
        by_partition(&want),
        "records differ from Debezium's"
    );
    assert_eq!(
        records_in(&kafka.brokers(), &topics),
        want.len() as i64,
        "more records than Debezium's"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_outbox_setup_publishes_debezium_s_records() {
    publishes_what_debezium_published("outbox_event.properties").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_columns_regex_routes_and_envelope_fields_publish_debezium_s_records() {
    publishes_what_debezium_published("domain_events.json").await;
}

fn unsupported_ends(relay: &RunningRelay) -> u64 {
    relay
        .state
        .metrics
        .wal_sessions_ended
        .get_or_create(&CodeLabel {
            code: "unsupported_event".into(),
        })
        .get()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_ferry_cannot_render_stops_the_stream_until_the_configuration_changes() {
    let (ferry, url) = pg_ferry().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    let kafka = Kafka::start();
    let topic = "outbox.event.Order".to_owned();
    kafka.create_topic(&topic, 1);
    let file = "outbox_event.properties";
    tables(&pool).await;
    let config = connector_file(&pool, file, |t| t).await;
    let slot = SlotGuard::new().await;
    let mut cfg = slot.config(&url, &kafka.brokers());
    cfg.debezium_config = Some(config);
    let relay = slot.start(cfg.clone(), ferry.clone()).await;
    wait_for_streaming(&pool, &slot.name, None, Duration::from_secs(60)).await;
    let insert = |n: u32, payload: &str| {
        format!(
            "INSERT INTO outbox_event (id, aggregatetype, aggregateid, type, payload) \
             VALUES ('00000000-0000-4000-8000-{n:012}', 'Order', 'o-{n}', 'T', '{payload}')"
        )
    };
    sqlx::query(&insert(1, r#"{"n": 1}"#)).execute(&pool).await.unwrap();
    // An array of objects with different fields: the EventRouter's
    // expansion of it is not one Ferry reproduces byte for byte.
    sqlx::query(&insert(2, r#"{"lines": [{"sku": "a"}, {"qty": 2}]}"#))
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query(&insert(3, r#"{"n": 3}"#)).execute(&pool).await.unwrap();
    let first = read(
        &kafka.brokers(),
        std::slice::from_ref(&topic),
        1,
        Duration::from_secs(60),
    );
    assert_eq!(first[0].value.as_deref(), Some(&br#"{"n":1}"#[..]));
    // WAL capture stops at row 2, once (a retry would publish the
    // transaction's earlier rows again), and the relay turns unready.
    let deadline = Instant::now() + Duration::from_secs(60);
    while unsupported_ends(&relay) < 1 {
        assert!(Instant::now() < deadline, "the stream did not stop at the row");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    readyz_until(&relay, "503", Duration::from_secs(30)).await;
    assert_eq!(
        records_in(&kafka.brokers(), std::slice::from_ref(&topic)),
        1,
        "published past the row"
    );
    assert_eq!(unsupported_ends(&relay), 1, "the stream was tried again");
    relay.shutdown().await;

    // Without expansion the payload is a JSON string, which Ferry renders:
    // rows 2 and 3 follow from the slot, in order, row 1 not lost.
    let plain = connector_file(&pool, file, |t| {
        t.replace("table.expand.json.payload=true", "table.expand.json.payload=false")
    })
    .await;
    cfg.debezium_config = Some(plain);
    let relay = slot.start(cfg, ferry.clone()).await;
    let all = read(
        &kafka.brokers(),
        std::slice::from_ref(&topic),
        3,
        Duration::from_secs(60),
    );
    relay.shutdown().await;
    let keys: Vec<&[u8]> = all.iter().map(|r| r.key.as_deref().unwrap()).collect();
    assert_eq!(keys, [&b"o-1"[..], b"o-2", b"o-3"]);
    assert_eq!(
        all[1].value.as_deref(),
        Some(&br#""{\"lines\": [{\"sku\": \"a\"}, {\"qty\": 2}]}""#[..])
    );
}

/// The connector's slot, made and read by someone else (Debezium), is
/// where the relay starts: given the connector's file alone (its
/// `slot.name` and `publication.name`, a publication of every operation),
/// it publishes exactly the inserts after the slot's confirmed position,
/// none before it, and no update or delete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_takes_over_the_connector_s_slot_where_it_stopped() {
    let (ferry, url) = pg_ferry().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    let kafka = Kafka::start();
    let topic = "outbox.event.Order".to_owned();
    kafka.create_topic(&topic, 1);
    tables(&pool).await;
    let slot = SlotGuard::new().await;
    let name = slot.name.clone();
    sqlx::query(&format!("CREATE PUBLICATION {name} FOR TABLE outbox_event"))
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("SELECT 1 FROM pg_create_logical_replication_slot($1, 'pgoutput')")
        .bind(&name)
        .execute(&pool)
        .await
        .unwrap();
    let insert = |n: u32| {
        format!(
            "INSERT INTO outbox_event (id, aggregatetype, aggregateid, type, payload) \
             VALUES ('00000000-0000-4000-8000-{n:012}', 'Order', 'o-{n}', 'T', '{{\"n\": {n}}}')"
        )
    };
    for n in 1..=3 {
        sqlx::query(&insert(n)).execute(&pool).await.unwrap();
    }
    // "Debezium" published rows 1-3 and confirmed them.
    sqlx::query("SELECT 1 FROM pg_replication_slot_advance($1, pg_current_wal_lsn())")
        .bind(&name)
        .execute(&pool)
        .await
        .unwrap();
    for n in 4..=6 {
        sqlx::query(&insert(n)).execute(&pool).await.unwrap();
    }
    sqlx::query("UPDATE outbox_event SET type = 'U'")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("DELETE FROM outbox_event").execute(&pool).await.unwrap();
    sqlx::query(&insert(7)).execute(&pool).await.unwrap();
    let config = connector_file(&pool, "outbox_event.properties", |t| {
        format!("{t}slot.name={name}\npublication.name={name}\n")
    })
    .await;
    let mut cfg = slot.config(&url, &kafka.brokers());
    (cfg.slot, cfg.publication) = (None, None);
    cfg.debezium_config = Some(config);
    let relay = slot.start(cfg, ferry.clone()).await;
    let got = read(
        &kafka.brokers(),
        std::slice::from_ref(&topic),
        4,
        Duration::from_secs(60),
    );
    relay.shutdown().await;
    let keys: Vec<&[u8]> = got.iter().map(|r| r.key.as_deref().unwrap()).collect();
    assert_eq!(keys, [&b"o-4"[..], b"o-5", b"o-6", b"o-7"]);
    assert_eq!(
        records_in(&kafka.brokers(), std::slice::from_ref(&topic)),
        4,
        "an update, a delete or a confirmed row published"
    );
}

/// A relay process is SIGKILLed while it publishes one 5,001-row
/// transaction whose last row's topic does not exist yet (so the
/// transaction cannot settle and the slot cannot move past it); a second
/// relay resumes from the slot: every row is published, each key's first
/// occurrences in commit order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_sigkilled_mid_transaction_loses_nothing() {
    let (ferry, url) = pg_ferry().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    let kafka = Kafka::start();
    let topic = "outbox.event.Order".to_owned();
    kafka.create_topic(&topic, 3);
    tables(&pool).await;
    let config = connector_file(&pool, "outbox_event.properties", |t| t).await;
    let slot = SlotGuard::new().await;
    let args = slot.args();
    let config = config.display().to_string();
    let mut flags: Vec<&str> = args.to_vec();
    flags.extend(["--debezium-config", config.as_str()]);
    let mut first = spawn_relay_process(&url, &kafka.brokers(), &flags, &[]);
    wait_for_streaming(&pool, &slot.name, None, Duration::from_secs(60)).await;
    const ROWS: i64 = 5_000;
    sqlx::raw_sql(&format!(
        "BEGIN;
         INSERT INTO outbox_event (id, aggregatetype, aggregateid, type, payload)
           SELECT ('00000000-0000-4000-8000-' || lpad(i::text, 12, '0'))::uuid, 'Order', 'k' || (i % 10), 'T',
                  jsonb_build_object('i', i)
           FROM generate_series(1, {ROWS}) i;
         INSERT INTO outbox_event (id, aggregatetype, aggregateid, type, payload)
           VALUES ('00000000-0000-4000-9000-000000000000', 'Later', 'last', 'T', '{{}}');
         COMMIT;"
    ))
    .execute(&pool)
    .await
    .unwrap();
    let seen = read(
        &kafka.brokers(),
        std::slice::from_ref(&topic),
        1,
        Duration::from_secs(60),
    );
    assert!(!seen.is_empty());
    first.kill().unwrap(); // SIGKILL mid-transaction
    first.wait().unwrap();
    kafka.create_topic("outbox.event.Later", 1);
    let _second = spawn_relay_process(&url, &kafka.brokers(), &flags, &[]);
    let later = read(
        &kafka.brokers(),
        &["outbox.event.Later".to_owned()],
        1,
        Duration::from_secs(120),
    );
    assert_eq!(later[0].key.as_deref(), Some(&b"last"[..]));
    // Every row, each key's first occurrences in commit order.
    let c = consumer(&kafka.brokers(), &[topic.as_str()]);
    let mut first_seen: BTreeSet<i64> = BTreeSet::new();
    let mut last_of_key: BTreeMap<String, i64> = BTreeMap::new();
    let mut total = 0i64;
    read_until(&c, Duration::from_secs(120), |recs| {
        for r in &recs[usize::try_from(total).unwrap()..] {
            let v: Value = serde_json::from_slice(&r.payload).unwrap();
            let i = v["i"].as_i64().unwrap();
            if first_seen.insert(i) {
                if let Some(prev) = last_of_key.insert(r.key.clone(), i) {
                    assert!(prev < i, "key {}: {prev} then {i}", r.key);
                }
            }
        }
        total = recs.len() as i64;
        first_seen.len() as i64 == ROWS
    })
    .await;
    eprintln!("SIGKILL mid-transaction: {} duplicates", total - ROWS);
}
