//! ferry-consumer against PostgreSQL and a real Kafka-protocol broker:
//! effects once per group under duplicates, rebalances and
//! crashes; stale members refused; poison records dead-lettered; database
//! outages, simulated on the shared cluster and real (PostgreSQL stopped,
//! on a cluster of the test's own).

use ferry::store::Arg;
use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry::Ferry;
use ferry_consumer::store::PartitionLease;
use ferry_consumer::{Assignment, Consumer, Handler, HandlerError, Record};
use ferry_testkit::{Kafka, PgCluster};
use futures::future::BoxFuture;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;
use tokio_util::sync::CancellationToken;

mod python;

/// A fresh, migrated database with the effects table, and its URL.
async fn pg() -> (Ferry, String) {
    let (ferry, url, _) = pg_routes().await;
    (ferry, url)
}

/// [`pg`], through the test PgBouncer under [`ferry_testkit::through_pooler`]:
/// also the direct URL member processes migrate over.
async fn pg_routes() -> (Ferry, String, Option<String>) {
    let (url, direct) = ferry_testkit::fresh_postgres().await;
    let mut builder = Ferry::builder(&url).migrate(true);
    if let Some(direct) = &direct {
        builder = builder.direct_url(direct);
    }
    let ferry = builder.connect().await.unwrap();
    create_effects_table(&ferry).await;
    (ferry, url, direct)
}

/// The `effects_applied` table [`Apply`] writes.
async fn create_effects_table(ferry: &Ferry) {
    ferry
        .db()
        .execute_raw(
            "CREATE TABLE effects_applied (effect_key TEXT PRIMARY KEY, applied BIGINT NOT NULL, written_by TEXT NOT NULL)",
        )
        .await
        .unwrap();
}

async fn scalar(ferry: &Ferry, sql: &str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(ferry.db().as_postgres().unwrap())
        .await
        .unwrap()
}

/// Waits (bounded) until `sql` returns at least `want`.
async fn until_at_least(ferry: &Ferry, sql: &str, want: i64, limit: Duration) {
    let start = Instant::now();
    loop {
        let n = scalar(ferry, sql).await;
        if n >= want {
            return;
        }
        assert!(start.elapsed() < limit, "{sql}: {n} after {limit:?}, wanted {want}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Writes the effect and counts applications; `poison` keys fail terminally.
struct Apply {
    owner: String,
}

impl Handler for Apply {
    fn handle<'a>(&'a self, r: &'a Record, tx: &'a mut ferry::Tx) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            if r.key.as_deref() == Some(b"poison") {
                return Err(HandlerError::terminal("poison_key"));
            }
            let key = r
                .effect_key()
                .unwrap_or_else(|| format!("{}/{}/{}", r.topic, r.partition, r.offset));
            tx.execute(
                "INSERT INTO effects_applied (effect_key, applied, written_by) VALUES ($1, 1, $2)
                 ON CONFLICT (effect_key) DO UPDATE SET applied = effects_applied.applied + 1",
                &[Arg::from(&key), Arg::from(&self.owner)],
            )
            .await?;
            Ok(())
        })
    }
}

fn producer(brokers: &str) -> FutureProducer {
    producer_with(brokers, &[])
}

/// An idempotent producer acknowledged by all replicas, with `extra`
/// librdkafka settings.
fn producer_with(brokers: &str, extra: &[(&str, &str)]) -> FutureProducer {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all");
    for (k, v) in extra {
        config.set(*k, *v);
    }
    config.create().unwrap()
}

async fn produce(p: &FutureProducer, topic: &str, key: &str, outbox_id: Option<&str>) {
    let mut h = OwnedHeaders::new();
    if let Some(id) = outbox_id {
        h = h.insert(Header {
            key: "ferry-outbox-id",
            value: Some(id),
        });
    }
    p.send(
        FutureRecord::to(topic).key(key).payload("{}").headers(h),
        Duration::from_secs(10),
    )
    .await
    .unwrap();
}

/// A consumer running on the test's runtime. Dropping it without
/// [`Running::stop`] (a failed assertion unwinding) stops the consumer and
/// waits for it to leave the group while the runtime still runs: a runtime
/// dropped under a live consumer hangs, so the test would hang instead of
/// failing.
struct Running {
    stop: CancellationToken,
    task: Option<tokio::task::JoinHandle<()>>,
    metrics: Arc<ferry_consumer::metrics::Metrics>,
}

impl Running {
    /// Runs `c` on the current runtime until stopped.
    fn spawn(c: Consumer) -> Running {
        let metrics = c.metrics();
        let stop = CancellationToken::new();
        let s = stop.clone();
        let task = tokio::spawn(async move { c.run(async move { s.cancelled().await }).await.unwrap() });
        Running {
            stop,
            task: Some(task),
            metrics,
        }
    }

    /// The consumer's live metrics.
    fn metrics(&self) -> Arc<ferry_consumer::metrics::Metrics> {
        self.metrics.clone()
    }

    /// Stops the consumer and waits until it has left the group.
    async fn stop(mut self) {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            task.await.unwrap();
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop.cancel();
        let Some(task) = self.task.take() else {
            return;
        };
        // Every test runs on a multi-threaded runtime; anywhere else the
        // cancellation alone has to do.
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if rt.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread {
            tokio::task::block_in_place(|| {
                let _ = rt.block_on(tokio::time::timeout(Duration::from_secs(60), task));
            });
        }
    }
}

fn in_process(ferry: Ferry, brokers: &str, group: &str, topic: &str, assignment: Assignment, owner: &str) -> Running {
    let c = Consumer::builder(ferry, brokers, group, &[topic])
        .handler(Apply { owner: owner.into() })
        .assignment(assignment)
        .owner(owner)
        .dead_letter_topic(format!("{topic}.dlq"))
        .kafka("session.timeout.ms", "6000")
        .kafka("heartbeat.interval.ms", "500")
        .build()
        .unwrap();
    Running::spawn(c)
}

async fn duplicates_apply_once(assignment: Assignment) {
    let broker = Kafka::start();
    broker.create_topic("orders", 1);
    broker.create_topic("orders.dlq", 1);
    let (ferry, _) = pg().await;
    let p = producer(&broker.brokers());
    // The same outbox row published three times, as after relay crashes.
    for id in ["42", "42", "43", "42", "44"] {
        produce(&p, "orders", "order-1", Some(id)).await;
    }
    let consumer = in_process(ferry.clone(), &broker.brokers(), "g1", "orders", assignment, "c1");
    let metrics = consumer.metrics();
    until_at_least(
        &ferry,
        "SELECT COALESCE(max(next_offset), 0) FROM consumer_partitions",
        5,
        Duration::from_secs(60),
    )
    .await;
    consumer.stop().await;
    assert_eq!(scalar(&ferry, "SELECT count(*) FROM effects_applied").await, 3);
    assert_eq!(
        scalar(&ferry, "SELECT max(applied) FROM effects_applied").await,
        1,
        "each effect applied once"
    );
    assert_eq!(
        scalar(&ferry, "SELECT count(*) FROM consumer_ledger WHERE group_id = 'g1'").await,
        3
    );
    assert_eq!((metrics.processed.get(), metrics.duplicates.get()), (3, 2));
    assert_eq!(
        scalar(
            &ferry,
            "SELECT count(*) FROM consumer_partitions WHERE owner IS NOT NULL"
        )
        .await,
        0,
        "released on shutdown"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_apply_once_cooperative() {
    duplicates_apply_once(Assignment::CooperativeSticky).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_apply_once_eager() {
    duplicates_apply_once(Assignment::Eager).await;
}

/// Through PgBouncer in transaction pooling: the ledger's dedupe and the
/// partition lease hold there too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_apply_once_through_pgbouncer() {
    ferry_testkit::through_pooler(duplicates_apply_once(Assignment::CooperativeSticky)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_member_cannot_commit() {
    a_stale_member_cannot_commit_on().await;
}

/// Through PgBouncer in transaction pooling: the fence holds there too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_member_cannot_commit_through_pgbouncer() {
    ferry_testkit::through_pooler(a_stale_member_cannot_commit_on()).await;
}

async fn a_stale_member_cannot_commit_on() {
    let broker = Kafka::start();
    broker.create_topic("events", 1);
    let (ferry, _) = pg().await;
    let p = producer(&broker.brokers());
    produce(&p, "events", "k", Some("7")).await;
    // Member A leases the partition and reads the record, then pauses.
    let (lease_a, _) = ferry_consumer::store::ConsumerStore::new(ferry.clone())
        .acquire_partition("g", "events", 0, "member-a", Duration::from_secs(30))
        .await
        .unwrap();
    let reader: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", broker.brokers())
        .set("group.id", "reader")
        .set("auto.offset.reset", "earliest")
        .create()
        .unwrap();
    reader.subscribe(&["events"]).unwrap();
    let record = loop {
        if let Some(Ok(m)) = tokio::task::block_in_place(|| reader.poll(Duration::from_millis(100))) {
            break Record::from_message(&m);
        }
    };
    // The partition moves to B at a higher generation; B applies the effect.
    let consumer = in_process(
        ferry.clone(),
        &broker.brokers(),
        "g",
        "events",
        Assignment::CooperativeSticky,
        "member-b",
    );
    until_at_least(
        &ferry,
        "SELECT count(*) FROM effects_applied",
        1,
        Duration::from_secs(60),
    )
    .await;
    // A resumes: its commit is refused, and nothing of it is written.
    let err = ferry_consumer::process_record(
        &ferry_consumer::store::ConsumerStore::new(ferry.clone()),
        &lease_a,
        &record,
        "7",
        &Apply {
            owner: "member-a".into(),
        },
    )
    .await
    .unwrap_err();
    assert!(matches!(err, ferry_consumer::ProcessError::LostLease(_)), "{err}");
    consumer.stop().await;
    assert_eq!(
        scalar(
            &ferry,
            "SELECT count(*) FROM effects_applied WHERE written_by = 'member-b' AND applied = 1"
        )
        .await,
        1
    );
    assert_eq!(scalar(&ferry, "SELECT count(*) FROM effects_applied").await, 1);
    let _: PartitionLease = lease_a;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_goes_to_the_dead_letter_topic_and_the_partition_flows() {
    let broker = Kafka::start();
    broker.create_topic("jobs", 1);
    broker.create_topic("jobs.dlq", 1);
    let (ferry, _) = pg().await;
    let p = producer(&broker.brokers());
    produce(&p, "jobs", "a", Some("1")).await;
    produce(&p, "jobs", "b", None).await; // no effect key at all
    produce(&p, "jobs", "poison", Some("3")).await; // the handler refuses it
    produce(&p, "jobs", "d", Some("4")).await;
    let consumer = in_process(
        ferry.clone(),
        &broker.brokers(),
        "gp",
        "jobs",
        Assignment::CooperativeSticky,
        "c",
    );
    let metrics = consumer.metrics();
    until_at_least(
        &ferry,
        "SELECT COALESCE(max(next_offset), 0) FROM consumer_partitions",
        4,
        Duration::from_secs(60),
    )
    .await;
    consumer.stop().await;
    assert_eq!(
        scalar(&ferry, "SELECT count(*) FROM effects_applied").await,
        2,
        "the records after the poison were applied"
    );
    assert_eq!(
        scalar(
            &ferry,
            "SELECT count(*) FROM consumer_ledger WHERE outcome = 'dead_lettered'"
        )
        .await,
        2
    );
    assert_eq!(metrics.dead_lettered.get(), 2);
    let dlq: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", broker.brokers())
        .set("group.id", "dlq-reader")
        .set("auto.offset.reset", "earliest")
        .create()
        .unwrap();
    dlq.subscribe(&["jobs.dlq"]).unwrap();
    let mut codes = Vec::new();
    let start = Instant::now();
    while codes.len() < 2 {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "dead letters missing: {codes:?}"
        );
        if let Some(Ok(m)) = tokio::task::block_in_place(|| dlq.poll(Duration::from_millis(100))) {
            let h = m.headers().unwrap();
            let code = h
                .iter()
                .find(|h| h.key == "ferry-error-code")
                .and_then(|h| h.value)
                .unwrap();
            codes.push(String::from_utf8_lossy(code).into_owned());
        }
    }
    codes.sort();
    assert_eq!(codes, ["missing_effect_key", "poison_key"]);
}

/// Runs a consumer (group `group`) over `good` good records, then
/// `poisons` poison ones (the handler refuses them for good), then `good`
/// more, all in the log before it starts (after its first turn, one record
/// until a record was timed, one poll carries the rest), until it has stored
/// every offset; checks each good record applied once and each poison one
/// dead-lettered, and returns the consumer's metrics.
async fn poison_between(
    ferry: &Ferry,
    group: &str,
    good: usize,
    poisons: usize,
) -> Arc<ferry_consumer::metrics::Metrics> {
    let broker = Kafka::start();
    broker.create_topic("mixed", 1);
    broker.create_topic("mixed.dlq", 1);
    let p = producer(&broker.brokers());
    produce_range(&p, "mixed", 1, good + 1).await;
    for i in 0..poisons {
        produce(&p, "mixed", "poison", Some(&(good + 1 + i).to_string())).await;
    }
    produce_range(&p, "mixed", good + poisons + 1, 2 * good + poisons + 1).await;
    let consumer = in_process(
        ferry.clone(),
        &broker.brokers(),
        group,
        "mixed",
        Assignment::CooperativeSticky,
        "c",
    );
    let metrics = consumer.metrics();
    until_at_least(
        ferry,
        &format!("SELECT COALESCE(max(next_offset), 0) FROM consumer_partitions WHERE group_id = '{group}'"),
        (2 * good + poisons) as i64,
        Duration::from_secs(60),
    )
    .await;
    consumer.stop().await;
    assert_eq!(
        scalar(ferry, "SELECT count(*) FROM effects_applied WHERE applied = 1").await,
        (2 * good) as i64
    );
    let dead = format!(
        "SELECT count(*) FROM consumer_ledger WHERE group_id = '{group}' AND outcome = 'dead_lettered' \
         AND \"offset\" BETWEEN {good} AND {}",
        good + poisons - 1
    );
    assert_eq!(scalar(ferry, &dead).await, poisons as i64);
    metrics
}

/// Distinct transactions that wrote group `group`'s ledger rows at the
/// offsets `filter` selects (`< 10`, `> 21`).
async fn ledger_transactions(ferry: &Ferry, group: &str, filter: &str) -> i64 {
    let sql = format!(
        "SELECT count(DISTINCT xmin::text) FROM consumer_ledger WHERE group_id = '{group}' AND \"offset\" {filter}"
    );
    scalar(ferry, &sql).await
}

/// A poison record in the middle of a micro-batch costs one record's
/// isolation, not the batch: the records before it are committed together
/// again, it is dead-lettered alone, and the records after it are committed
/// together. Gone one by one after the rollback, each of the 10 records
/// before the poison and the 10 after it would be a transaction of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_record_leaves_the_rest_of_its_batch_batched() {
    let (ferry, _) = pg().await;
    let metrics = poison_between(&ferry, "gm", 10, 1).await;
    let before = ledger_transactions(&ferry, "gm", "< 10").await;
    let after = ledger_transactions(&ferry, "gm", "> 10").await;
    assert!(
        before <= 3,
        "the 10 records before the poison took {before} transactions"
    );
    assert!(after <= 3, "the 10 records after the poison took {after} transactions");
    assert!(metrics.batches_rolled_back.get() <= 1);
}

/// A run of poison records costs a few failed batches, not one per record,
/// and the good records after it are batched again: 12 poison records
/// between good ones (offsets 10 to 21). The poll after the first turn
/// (offset 0 alone) carries offsets 1 to 31: the batch stops at the run
/// (1), then two stops at its start (the first sends 1 record alone, the
/// second 2 one by one), then 4, then 8 (4 poison records and 4 good
/// ones), and the last 6 good records commit together: 5 failed batches,
/// and 5 transactions after the run. A batch
/// tried after each isolated record fails 12 times; all the records left
/// sent one by one after two short stops take 10 transactions after the run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_of_poison_records_costs_a_few_failed_batches() {
    let (ferry, _) = pg().await;
    let metrics = poison_between(&ferry, "gs", 10, 12).await;
    // One poll carried the records before the run and the run itself:
    // otherwise the counts below are not this test's.
    let before = ledger_transactions(&ferry, "gs", "< 10").await;
    assert!(before <= 2, "the 10 records before the run took {before} transactions");
    let rolled_back = metrics.batches_rolled_back.get();
    assert!(
        rolled_back <= 6,
        "{rolled_back} micro-batches rolled back for a run of 12 poison records"
    );
    let after = ledger_transactions(&ferry, "gs", "> 21").await;
    assert!(after <= 6, "the 10 records after the run took {after} transactions");
}

/// Runs a consumer (group `group`) over 10 good records, one whose effect
/// key is `key`, and 10 good ones, and checks that the record whose key the
/// batch's ledger statement would refuse goes alone before any transaction,
/// so it fails no batch: the records before and after it are committed
/// together, and it is dead-lettered. Sent to the database with the batch,
/// it would fail the whole statement with no record to blame, and the 10
/// records after it would go one by one.
async fn refused_key_between(topic: &str, group: &str, key: &str) {
    let broker = Kafka::start();
    broker.create_topic(topic, 1);
    broker.create_topic(&format!("{topic}.dlq"), 1);
    let (ferry, _) = pg().await;
    let p = producer(&broker.brokers());
    produce_range(&p, topic, 1, 11).await;
    produce(&p, topic, "bad", Some(key)).await;
    produce_range(&p, topic, 12, 22).await;
    let consumer = in_process(
        ferry.clone(),
        &broker.brokers(),
        group,
        topic,
        Assignment::CooperativeSticky,
        "c",
    );
    let metrics = consumer.metrics();
    until_at_least(
        &ferry,
        &format!("SELECT COALESCE(max(next_offset), 0) FROM consumer_partitions WHERE group_id = '{group}'"),
        21,
        Duration::from_secs(60),
    )
    .await;
    consumer.stop().await;
    assert_eq!(
        scalar(&ferry, "SELECT count(*) FROM effects_applied WHERE applied = 1").await,
        20
    );
    assert_eq!(metrics.dead_lettered.get(), 1);
    assert_eq!(metrics.batches_rolled_back.get(), 0, "no batch held the refused key");
    let before = ledger_transactions(&ferry, group, "< 10").await;
    let after = ledger_transactions(&ferry, group, "> 10").await;
    assert!(
        before <= 3,
        "the 10 records before the refused key took {before} transactions"
    );
    assert!(
        after <= 3,
        "the 10 records after the refused key took {after} transactions"
    );
}

/// A NUL byte, which PostgreSQL's text cannot hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_the_ledger_refuses_leaves_the_rest_of_its_batch_batched() {
    refused_key_between("nul", "gn", "bad\0key").await;
}

/// A key too long for the ledger's primary-key index (2,700 bytes that do
/// not compress: its entries stop at 2,704 bytes with the group id).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_too_long_for_the_ledger_s_index_leaves_the_rest_of_its_batch_batched() {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let key: String = (0..2700)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ALPHABET[(x % ALPHABET.len() as u64) as usize] as char
        })
        .collect();
    refused_key_between("long", "gl", &key).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ledger_retention_shorter_than_the_redelivery_window_is_refused() {
    let (ferry, _) = pg().await;
    let err = Consumer::builder(ferry, "127.0.0.1:1", "g", &["t"])
        .handler(Apply { owner: "x".into() })
        .ledger_retention(Duration::from_secs(3600), Duration::from_secs(7200))
        .build()
        .err()
        .unwrap();
    assert_eq!(err.code(), "config");
}

/// A zero lease would make every turn one record (a turn fits in a third
/// of the lease) and renew on every turn: refused at build.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_lease_is_refused() {
    let (ferry, _) = pg().await;
    let err = Consumer::builder(ferry, "127.0.0.1:1", "g", &["t"])
        .handler(Apply { owner: "x".into() })
        .lease(Duration::ZERO)
        .build()
        .err()
        .unwrap();
    assert_eq!(err.code(), "config");
    assert!(err.to_string().contains("lease must be longer than zero"), "{err}");
}

/// A member process, killed if the test fails before it ends it.
struct Member(Option<Child>);

impl Member {
    /// Starts `c` as a member process.
    fn spawn(mut c: Command) -> Member {
        Member(Some(c.spawn().expect("spawn ferry-projection")))
    }

    /// Fails when the process already exited on its own (a crash would
    /// otherwise pass for the test's kill).
    fn assert_running(&mut self) {
        let c = self.0.as_mut().expect("a member process");
        let status = c.try_wait().unwrap();
        assert!(status.is_none(), "the member exited on its own: {status:?}");
    }

    fn sigkill(mut self) {
        if let Some(mut c) = self.0.take() {
            c.kill().unwrap();
            c.wait().unwrap();
        }
    }

    fn terminate(mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = Command::new("kill").args(["-TERM", &c.id().to_string()]).status();
            let _ = c.wait();
        }
    }

    fn wait(mut self) -> std::process::ExitStatus {
        self.0.take().unwrap().wait().unwrap()
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn projection(url: &str, brokers: &str, group: &str, topic: &str, crash_at: Option<&str>) -> Member {
    projection_with(url, brokers, group, topic, crash_at, "cooperative")
}

fn projection_with(
    url: &str,
    brokers: &str,
    group: &str,
    topic: &str,
    crash_at: Option<&str>,
    assignment: &str,
) -> Member {
    Member::spawn(projection_command(
        url, None, brokers, group, topic, crash_at, assignment,
    ))
}

/// A `ferry-projection` member's command on `url`, migrating over `direct`
/// when `url` goes through a transaction pooler.
fn projection_command(
    url: &str,
    direct: Option<&str>,
    brokers: &str,
    group: &str,
    topic: &str,
    crash_at: Option<&str>,
    assignment: &str,
) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ferry-projection"));
    if let Some(direct) = direct {
        c.env("FERRY_DIRECT_URL", direct);
    }
    c.env("DATABASE_URL", url)
        .env("FERRY_ASSIGNMENT", assignment)
        .env("FERRY_BROKERS", brokers)
        .env("FERRY_GROUP", group)
        .env("FERRY_TOPICS", topic)
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if let Some(k) = crash_at {
        // One record per transaction, so the crash lands between records.
        c.env("FERRY_CRASH_AT", k).env("FERRY_MICRO_BATCH", "1");
    }
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_handler_and_commit_processes_the_record_once() {
    crash_between_handler_and_commit().await;
}

/// Through PgBouncer in transaction pooling: the member aborted between
/// its handler and its commit leaves nothing, and the next applies the
/// record once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_handler_and_commit_processes_the_record_once_through_pgbouncer() {
    ferry_testkit::through_pooler(crash_between_handler_and_commit()).await;
}

async fn crash_between_handler_and_commit() {
    let broker = Kafka::start();
    broker.create_topic("crash", 1);
    let (ferry, url, direct) = pg_routes().await;
    let member = |crash_at: Option<&str>| {
        Member::spawn(projection_command(
            &url,
            direct.as_deref(),
            &broker.brokers(),
            "gc",
            "crash",
            crash_at,
            "cooperative",
        ))
    };
    let p = producer(&broker.brokers());
    for i in 0..5 {
        produce(&p, "crash", "k", Some(&format!("c{i}-{}", std::process::id()))).await;
    }
    let marker_key = format!("c2-{}", std::process::id());
    let _ = std::fs::remove_file(std::env::temp_dir().join(format!("ferry-crash-{marker_key}")));
    let child = member(Some(&marker_key));
    let status = child.wait();
    assert!(!status.success(), "the process aborted mid-record");
    let stored = scalar(&ferry, "SELECT COALESCE(max(next_offset), 0) FROM consumer_partitions").await;
    assert_eq!(stored, 2, "the offset moved only with the committed effects");
    let child = member(None);
    until_at_least(
        &ferry,
        "SELECT COALESCE(max(next_offset), 0) FROM consumer_partitions",
        5,
        Duration::from_secs(60),
    )
    .await;
    child.terminate();
    assert_eq!(scalar(&ferry, "SELECT count(*) FROM ferry_projection_applied").await, 5);
    assert_eq!(
        scalar(&ferry, "SELECT max(applied) FROM ferry_projection_applied").await,
        1,
        "the crashed record was applied once"
    );
    assert_eq!(
        scalar(&ferry, "SELECT events FROM ferry_projection WHERE key = 'k'").await,
        5
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebalance_storm_applies_every_effect_exactly_once() {
    const N: usize = 10_000;
    let broker = Kafka::start();
    broker.create_topic("storm", 6);
    let (ferry, url) = pg().await;
    let p = producer(&broker.brokers());
    let sends: Vec<_> = (0..N)
        .map(|i| {
            let id = i.to_string();
            let key = format!("k{}", i % 100);
            let h = OwnedHeaders::new().insert(Header {
                key: "ferry-outbox-id",
                value: Some(&id),
            });
            p.send_result(FutureRecord::to("storm").key(&key).payload("{}").headers(h))
                .map_err(|(e, _)| e)
                .unwrap()
        })
        .collect();
    for s in sends {
        s.await.unwrap().map_err(|(e, _)| e).unwrap();
    }
    let brokers = broker.brokers();
    let mut members: Vec<Member> = (0..3)
        .map(|_| projection(&url, &brokers, "storm-group", "storm", None))
        .collect();
    let ledger = "SELECT count(*) FROM consumer_ledger WHERE group_id = 'storm-group'";
    until_at_least(&ferry, ledger, 1500, Duration::from_secs(180)).await;
    members.remove(0).sigkill();
    members.push(projection(&url, &brokers, "storm-group", "storm", None));
    until_at_least(&ferry, ledger, 4000, Duration::from_secs(180)).await;
    members.remove(0).terminate();
    members.push(projection(&url, &brokers, "storm-group", "storm", None));
    members.push(projection(&url, &brokers, "storm-group", "storm", None));
    until_at_least(&ferry, ledger, 7000, Duration::from_secs(180)).await;
    members.remove(1).sigkill();
    until_at_least(&ferry, ledger, N as i64, Duration::from_secs(240)).await;
    for m in members {
        m.terminate();
    }
    assert_eq!(
        scalar(&ferry, "SELECT count(*) FROM ferry_projection_applied").await,
        N as i64
    );
    assert_eq!(
        scalar(&ferry, "SELECT max(applied) FROM ferry_projection_applied").await,
        1,
        "every effect key applied exactly once"
    );
    // Stored offsets match what each partition holds.
    let offsets: Vec<(i32, Option<i64>)> =
        sqlx::query_as("SELECT partition, next_offset FROM consumer_partitions WHERE group_id = 'storm-group'")
            .fetch_all(ferry.db().as_postgres().unwrap())
            .await
            .unwrap();
    let probe: BaseConsumer = ClientConfig::new().set("bootstrap.servers", &brokers).create().unwrap();
    let mut total = 0;
    let by_partition: HashMap<i32, Option<i64>> = offsets.into_iter().collect();
    for partition in 0..6 {
        let (_, high) =
            tokio::task::block_in_place(|| probe.fetch_watermarks("storm", partition, Duration::from_secs(10)))
                .unwrap();
        assert_eq!(
            by_partition.get(&partition).copied().flatten(),
            Some(high),
            "partition {partition}"
        );
        total += high;
    }
    assert_eq!(total, N as i64);
    assert_eq!(
        scalar(&ferry, "SELECT CAST(sum(events) AS BIGINT) FROM ferry_projection").await,
        N as i64
    );
}

/// Generation and owner of a partition row.
async fn holder(ferry: &Ferry, group: &str, topic: &str, partition: i32) -> (Option<String>, i64) {
    sqlx::query_as(
        "SELECT owner, generation FROM consumer_partitions WHERE group_id = $1 AND topic = $2 AND partition = $3",
    )
    .bind(group)
    .bind(topic)
    .bind(partition)
    .fetch_one(ferry.db().as_postgres().unwrap())
    .await
    .unwrap()
}

/// A member that lost a partition lease while its local assignment still
/// lists the partition must not take it back from a member holding a live
/// lease: its view may be stale (the group moved the partition), and taking
/// it anyway hands the partition back and forth between two members. It
/// takes it back once the lease is free, from the offset stored with the
/// effects, and nothing is skipped or applied twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_lease_is_not_taken_back_from_a_live_holder() {
    let broker = Kafka::start();
    broker.create_topic("reclaim", 1);
    let (ferry, _) = pg().await;
    let p = producer(&broker.brokers());
    produce(&p, "reclaim", "k", Some("r0")).await;
    let consumer = in_process(
        ferry.clone(),
        &broker.brokers(),
        "gr",
        "reclaim",
        Assignment::CooperativeSticky,
        "member-a",
    );
    let metrics = consumer.metrics();
    let stored = "SELECT COALESCE(max(next_offset), 0) FROM consumer_partitions WHERE group_id = 'gr'";
    until_at_least(&ferry, stored, 1, Duration::from_secs(60)).await;
    // Another member takes the partition at a higher generation, as the
    // rebalance callback of the partition's new assignee does.
    let (lease_b, _) = ferry_consumer::store::ConsumerStore::new(ferry.clone())
        .acquire_partition("gr", "reclaim", 0, "member-b", Duration::from_secs(120))
        .await
        .unwrap();
    produce(&p, "reclaim", "k", Some("r1")).await;
    produce(&p, "reclaim", "k", Some("r2")).await;
    // A's next commit is refused: it pauses the partition.
    let deadline = Instant::now() + Duration::from_secs(60);
    while metrics.lease_losses.get() == 0 {
        assert!(Instant::now() < deadline, "member A never noticed the lost lease");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A checks again later (Kafka still assigns the partition to it): either
    // it defers to the live lease, or it takes the partition (the bug).
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (_, generation) = holder(&ferry, "gr", "reclaim", 0).await;
        if generation != lease_b.generation || metrics.reclaims_deferred.get() > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "member A never came back for the partition");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        holder(&ferry, "gr", "reclaim", 0).await,
        (Some("member-b".to_owned()), lease_b.generation),
        "member A took the partition from a live lease"
    );
    assert_eq!(scalar(&ferry, "SELECT count(*) FROM effects_applied").await, 1);
    // The holder gives it back: A takes it and resumes from the stored offset.
    assert!(ferry_consumer::store::ConsumerStore::new(ferry.clone())
        .release_partition(&lease_b)
        .await
        .unwrap());
    until_at_least(&ferry, stored, 3, Duration::from_secs(60)).await;
    until_at_least(
        &ferry,
        "SELECT count(*) FROM effects_applied",
        3,
        Duration::from_secs(60),
    )
    .await;
    consumer.stop().await;
    assert_eq!(
        scalar(&ferry, "SELECT max(applied) FROM effects_applied").await,
        1,
        "each effect applied once"
    );
    assert_eq!(
        scalar(
            &ferry,
            "SELECT count(*) FROM effects_applied WHERE written_by = 'member-a'"
        )
        .await,
        3
    );
    let (_, generation) = holder(&ferry, "gr", "reclaim", 0).await;
    assert!(generation > lease_b.generation, "taken back at a new generation");
}

/// Produces records `from..to` of `topic` (effect key = index, 100 keys).
async fn produce_range(p: &FutureProducer, topic: &str, from: usize, to: usize) {
    let sends: Vec<_> = (from..to)
        .map(|i| {
            let id = i.to_string();
            let key = format!("k{}", i % 100);
            let h = OwnedHeaders::new().insert(Header {
                key: "ferry-outbox-id",
                value: Some(&id),
            });
            p.send_result(FutureRecord::to(topic).key(&key).payload("{}").headers(h))
                .map_err(|(e, _)| e)
                .unwrap()
        })
        .collect();
    for s in sends {
        s.await.unwrap().map_err(|(e, _)| e).unwrap();
    }
}

/// Three member processes, one SIGKILLed and replaced at each step of
/// progress while records keep arriving: the group converges with every
/// effect applied once and both the stored offsets and the group's Kafka
/// committed offsets at the log end (a short version of
/// `examples/soak_consumer.rs`).
async fn a_kill_storm_converges(assignment: &str) {
    const N: usize = 10_000;
    const PARTITIONS: i32 = 6;
    let broker = Kafka::start();
    broker.create_topic("kills", PARTITIONS);
    let (ferry, url) = pg().await;
    let p = producer(&broker.brokers());
    let brokers = broker.brokers();
    let group = format!("kills-{assignment}");
    produce_range(&p, "kills", 0, N / 2).await;
    let mut members: Vec<Member> = (0..3)
        .map(|_| projection_with(&url, &brokers, &group, "kills", None, assignment))
        .collect();
    let ledger = format!("SELECT count(*) FROM consumer_ledger WHERE group_id = '{group}'");
    // A kill at each step, the victim rotating; the second half of the
    // records arrives in the middle of it.
    for (step, at) in [600, 1500, 2400, 3300, 4200, 5400, 6600, 7800].into_iter().enumerate() {
        until_at_least(&ferry, &ledger, at, Duration::from_secs(120)).await;
        members.remove(step % members.len()).sigkill();
        members.push(projection_with(&url, &brokers, &group, "kills", None, assignment));
        if step == 3 {
            produce_range(&p, "kills", N / 2, N).await;
        }
    }
    until_at_least(&ferry, &ledger, N as i64, Duration::from_secs(120)).await;
    assert_eq!(
        scalar(&ferry, "SELECT count(*) FROM ferry_projection_applied").await,
        N as i64
    );
    assert_eq!(
        scalar(&ferry, "SELECT max(applied) FROM ferry_projection_applied").await,
        1,
        "every effect key applied exactly once"
    );
    // Stored offsets and the group's Kafka commits reach the log end.
    let probe: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("group.id", &group)
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut high = HashMap::new();
    for partition in 0..PARTITIONS {
        let (_, h) =
            tokio::task::block_in_place(|| probe.fetch_watermarks("kills", partition, Duration::from_secs(10)))
                .unwrap();
        high.insert(partition, h);
    }
    assert_eq!(high.values().sum::<i64>(), N as i64);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let stored: Vec<(i32, Option<i64>)> =
            sqlx::query_as("SELECT partition, next_offset FROM consumer_partitions WHERE group_id = $1")
                .bind(&group)
                .fetch_all(ferry.db().as_postgres().unwrap())
                .await
                .unwrap();
        let stored: HashMap<i32, i64> = stored.into_iter().filter_map(|(p, o)| Some((p, o?))).collect();
        let mut tpl = rdkafka::TopicPartitionList::new();
        for partition in 0..PARTITIONS {
            tpl.add_partition("kills", partition);
        }
        let committed: HashMap<i32, i64> =
            tokio::task::block_in_place(|| probe.committed_offsets(tpl, Duration::from_secs(5)))
                .map(|t| {
                    t.elements()
                        .iter()
                        .filter_map(|e| match e.offset() {
                            rdkafka::Offset::Offset(o) => Some((e.partition(), o)),
                            _ => None,
                        })
                        .collect()
                })
                .unwrap_or_default();
        if high == stored && high == committed {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "offsets short of the log end {high:?}: stored {stored:?}, committed {committed:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for m in members {
        m.terminate();
    }
    assert_eq!(
        scalar(&ferry, "SELECT max(applied) FROM ferry_projection_applied").await,
        1,
        "every effect key applied exactly once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_storm_converges_eager() {
    a_kill_storm_converges("eager").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_storm_converges_cooperative() {
    a_kill_storm_converges("cooperative").await;
}

/// The offset stored for `group`'s partition 0 of `topic` (0 when none).
async fn stored_next(ferry: &Ferry, group: &str, topic: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT COALESCE(max(next_offset), 0) FROM consumer_partitions WHERE group_id = $1 AND topic = $2",
    )
    .bind(group)
    .bind(topic)
    .fetch_one(ferry.db().as_postgres().unwrap())
    .await
    .unwrap()
}

/// A dead letter that cannot be published (the dead-letter topic does not
/// exist yet) is retried with its partition paused: the stored offset and
/// the records after it wait, nothing is passed over, and once the topic
/// exists the record reaches it and the ledger and the partition flows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_dead_letter_publish_is_retried_and_never_passed_over() {
    let broker = Kafka::start();
    broker.create_topic("dlqmiss", 1);
    let (ferry, _) = pg().await;
    let p = producer(&broker.brokers());
    produce(&p, "dlqmiss", "a", Some("1")).await;
    produce(&p, "dlqmiss", "poison", Some("2")).await; // offset 1, terminal
    produce(&p, "dlqmiss", "c", Some("3")).await;
    produce(&p, "dlqmiss", "d", Some("4")).await;
    let c = Consumer::builder(ferry.clone(), broker.brokers(), "gd", &["dlqmiss"])
        .handler(Apply { owner: "c".into() })
        .dead_letter_topic("dlqmiss.dlq") // missing: auto.create.topics.enable=false
        .retry(3, Duration::from_millis(100), Duration::from_secs(1))
        .micro_batch(1)
        .kafka("session.timeout.ms", "6000")
        .kafka("heartbeat.interval.ms", "500")
        .build()
        .unwrap();
    let consumer = Running::spawn(c);
    let metrics = consumer.metrics();
    // Until the dead-letter publish failed twice, the stored offset must
    // never pass the poison record (offset 1).
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let next = stored_next(&ferry, "gd", "dlqmiss").await;
        assert!(
            next <= 1,
            "the stored offset moved past the undead-lettered poison record: next_offset = {next}, dead-letter failures = {}",
            metrics.dead_letter_failures.get()
        );
        if metrics.dead_letter_failures.get() >= 2 {
            break;
        }
        assert!(Instant::now() < deadline, "the dead-letter publish never failed twice");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(stored_next(&ferry, "gd", "dlqmiss").await, 1);
    assert_eq!(scalar(&ferry, "SELECT count(*) FROM effects_applied").await, 1);
    assert_eq!(
        scalar(&ferry, "SELECT count(*) FROM consumer_ledger WHERE group_id = 'gd'").await,
        1
    );
    assert_eq!(metrics.dead_lettered.get(), 0);
    // The topic appears: the record is dead-lettered and the partition flows.
    broker.create_topic("dlqmiss.dlq", 1);
    let deadline = Instant::now() + Duration::from_secs(90);
    while stored_next(&ferry, "gd", "dlqmiss").await < 4 {
        assert!(
            Instant::now() < deadline,
            "the partition never got past the poison record"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    consumer.stop().await;
    assert_eq!(scalar(&ferry, "SELECT count(*) FROM effects_applied").await, 3);
    assert_eq!(
        scalar(
            &ferry,
            "SELECT count(*) FROM consumer_ledger WHERE group_id = 'gd' AND outcome = 'dead_lettered' AND \"offset\" = 1"
        )
        .await,
        1
    );
    assert_eq!(metrics.dead_lettered.get(), 1);
    let dlq: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", broker.brokers())
        .set("group.id", "dlqmiss-reader")
        .set("auto.offset.reset", "earliest")
        .create()
        .unwrap();
    dlq.subscribe(&["dlqmiss.dlq"]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let m = loop {
        assert!(Instant::now() < deadline, "the dead letter never reached the topic");
        if let Some(Ok(m)) = tokio::task::block_in_place(|| dlq.poll(Duration::from_millis(100))) {
            break Record::from_message(&m);
        }
    };
    assert_eq!(m.key.as_deref(), Some(&b"poison"[..]));
    assert_eq!(m.header("ferry-error-code"), Some("poison_key"));
    assert_eq!(m.header("ferry-source-offset"), Some("1"));
}

/// A test that panics while its in-process consumer runs fails instead of
/// hanging: the panic unwinds out of the runtime's `block_on` and drops the
/// runtime, as `#[tokio::test]` does; the test body runs on its own thread so
/// a hang is seen (with a deadline) rather than suffered.
#[test]
fn a_test_that_panics_with_its_consumer_running_fails_instead_of_hanging() {
    let broker = Kafka::start();
    broker.create_topic("panics", 1);
    let brokers = broker.brokers();
    let (done, outcome) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let r = std::panic::catch_unwind(|| {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let (ferry, _) = pg().await;
                let _running = in_process(
                    ferry.clone(),
                    &brokers,
                    "gpanic",
                    "panics",
                    Assignment::CooperativeSticky,
                    "c",
                );
                // The consumer is in the group and holds the partition.
                until_at_least(
                    &ferry,
                    "SELECT count(*) FROM consumer_partitions WHERE owner IS NOT NULL",
                    1,
                    Duration::from_secs(60),
                )
                .await;
                panic!("a failing assertion while the consumer runs");
            })
        });
        let _ = done.send(r.is_err());
    });
    let panicked = outcome
        .recv_timeout(Duration::from_secs(90))
        .expect("the panicking test hung with its consumer running instead of failing");
    assert!(panicked, "the test body panicked");
}

/// A database of the test's own on the shared cluster, for tests that take it
/// away (`ALLOW_CONNECTIONS false`, its backends terminated) without touching
/// anyone else's: an outage is injected per database, not per schema. Ones
/// that failed runs left behind are dropped a day later.
struct OwnDatabase {
    name: String,
    url: String,
    admin: sqlx::PgPool,
}

impl OwnDatabase {
    async fn create() -> OwnDatabase {
        let base = ferry_testkit::postgres_url();
        let admin = sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .connect(&base)
            .await
            .unwrap_or_else(|e| panic!("PostgreSQL is required at {base} (set DATABASE_URL): {e}"));
        let born = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let stale: Vec<String> =
            sqlx::query_scalar("SELECT datname::text FROM pg_database WHERE datname LIKE 'ferry\\_outage\\_%'")
                .fetch_all(&admin)
                .await
                .unwrap();
        for s in stale {
            let at: u64 = s.split('_').nth(2).and_then(|b| b.parse().ok()).unwrap_or(0);
            if at + 24 * 3600 < born {
                let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {s} WITH (FORCE)"))
                    .execute(&admin)
                    .await;
            }
        }
        let random = uuid::Uuid::new_v4().simple().to_string();
        let name = format!("ferry_outage_{born}_{}_{}", std::process::id(), &random[..12]);
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&admin)
            .await
            .unwrap();
        // The base URL with the new database as its path.
        let (head, query) = base.split_once('?').unwrap_or((base.as_str(), ""));
        let host = head.find("://").map_or(0, |i| i + 3);
        let head = head[host..].find('/').map_or(head, |i| &head[..host + i]);
        let query = if query.is_empty() {
            String::new()
        } else {
            format!("?{query}")
        };
        let url = format!("{head}/{name}{query}");
        OwnDatabase { name, url, admin }
    }

    /// A migrated [`Ferry`] on it, with the `effects_applied` table of [`Apply`].
    async fn ferry(&self) -> Ferry {
        let ferry = Ferry::builder(&self.url).migrate(true).connect().await.unwrap();
        create_effects_table(&ferry).await;
        ferry
    }

    /// The outage begins: no new connection is accepted, and every open one
    /// (an open transaction's included) is terminated, except the backends
    /// `spare`.
    async fn refuse_connections(&self, spare: &[i32]) {
        sqlx::query(&format!("ALTER DATABASE {} ALLOW_CONNECTIONS false", self.name))
            .execute(&self.admin)
            .await
            .unwrap();
        self.terminate_backends(spare).await;
    }

    /// Terminates every backend connected to the database but `spare`.
    async fn terminate_backends(&self, spare: &[i32]) {
        sqlx::query(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = $1 AND NOT pid = ANY($2)",
        )
        .bind(&self.name)
        .bind(spare)
        .execute(&self.admin)
        .await
        .unwrap();
    }

    /// The outage ends.
    async fn allow_connections(&self) {
        sqlx::query(&format!("ALTER DATABASE {} ALLOW_CONNECTIONS true", self.name))
            .execute(&self.admin)
            .await
            .unwrap();
    }

    /// Drops the database (`ferry`'s pool closed first).
    async fn drop_with(self, ferry: Ferry) {
        ferry.db().close().await;
        sqlx::query(&format!("DROP DATABASE {} WITH (FORCE)", self.name))
            .execute(&self.admin)
            .await
            .unwrap();
    }
}

/// What a handler's `?` makes of real PostgreSQL errors: its own data
/// refused (a unique violation) is the record's fault, so the record is
/// dead-lettered with the SQLSTATE class's name; its transaction's backend
/// terminated under it, or its database refusing connections, is the
/// infrastructure's, retried without spending the record's budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_s_database_errors_are_classified_by_whose_fault_they_are() {
    use ferry_consumer::{classify, Fault, HandlerClass};
    let db = OwnDatabase::create().await;
    let ferry = db.ferry().await;
    let insert = "INSERT INTO effects_applied (effect_key, applied, written_by) VALUES ('k', 1, 'x')";
    let mut tx = ferry.begin().await.unwrap();
    tx.execute(insert, &[]).await.unwrap();
    let duplicate = tx.execute(insert, &[]).await.unwrap_err();
    assert_eq!(
        HandlerError::from(duplicate),
        HandlerError::terminal("integrity_constraint_violation")
    );
    tx.rollback().await.unwrap();
    let mut tx = ferry.begin().await.unwrap();
    db.refuse_connections(&[]).await;
    let cut = tx.execute(insert, &[]).await.unwrap_err();
    let cut = HandlerError::from(cut);
    assert_eq!(cut.class, HandlerClass::Infrastructure, "{cut:?}");
    drop(tx);
    let refused = ferry.begin().await.unwrap_err();
    assert_eq!(
        classify(&refused),
        Fault::Infrastructure("object_not_in_prerequisite_state"),
        "{refused}"
    );
    db.allow_connections().await;
    db.drop_with(ferry).await;
}

/// Writes the effect like [`Apply`]; on its first call it tells the test
/// that it holds the record's transaction open, and goes on only when the
/// test says so.
struct HoldFirst {
    apply: Apply,
    entered: std::sync::Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
    proceed: std::sync::Mutex<Option<tokio::sync::oneshot::Receiver<()>>>,
}

impl Handler for HoldFirst {
    fn handle<'a>(&'a self, r: &'a Record, tx: &'a mut ferry::Tx) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            let entered = self.entered.lock().unwrap().take();
            if let Some(entered) = entered {
                let _ = entered.send(());
                let proceed = self.proceed.lock().unwrap().take();
                if let Some(proceed) = proceed {
                    let _ = proceed.await;
                }
            }
            self.apply.handle(r, tx).await
        })
    }
}

/// A database outage longer than the retry budget, while a record is in
/// progress, never skips the record. The consumer runs as by default, with
/// no dead-letter topic (a dead letter is then only a ledger row), on a
/// database of its own; with the record's transaction open in the handler,
/// the database stops accepting connections and its backends are
/// terminated, again and again, for far longer than the budget lasts. When
/// it is back, the record's effect is applied once and the ledger says
/// `applied`, and so for the record after it (the old consumer charged the
/// outage to the record's budget, recorded it `dead_lettered` and skipped
/// it). A second outage shows that the consumer shuts down while a record
/// waits on one, leaving that record unprocessed and the stored offset
/// before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_outage_longer_than_the_retry_budget_never_skips_a_record() {
    const BUDGET: u32 = 3;
    // The budget is spent within a second (3 attempts, 20 ms to 200 ms apart).
    const OUTAGE: Duration = Duration::from_secs(8);
    let broker = Kafka::start();
    broker.create_topic("outage", 1);
    let db = OwnDatabase::create().await;
    let ferry = db.ferry().await;
    let p = producer(&broker.brokers());
    produce(&p, "outage", "k", Some("o0")).await;
    produce(&p, "outage", "k", Some("o1")).await;
    let (entered_tx, entered) = tokio::sync::oneshot::channel();
    let (proceed, proceed_rx) = tokio::sync::oneshot::channel();
    let c = Consumer::builder(ferry.clone(), broker.brokers(), "go", &["outage"])
        .handler(HoldFirst {
            apply: Apply { owner: "c".into() },
            entered: std::sync::Mutex::new(Some(entered_tx)),
            proceed: std::sync::Mutex::new(Some(proceed_rx)),
        })
        .retry(BUDGET, Duration::from_millis(20), Duration::from_millis(200))
        .micro_batch(1)
        .kafka("session.timeout.ms", "6000")
        .kafka("heartbeat.interval.ms", "500")
        .build()
        .unwrap();
    let consumer = Running::spawn(c);
    let metrics = consumer.metrics();
    tokio::time::timeout(Duration::from_secs(60), entered)
        .await
        .expect("the first record never reached the handler")
        .unwrap();
    // The record's transaction is open in the handler: the outage begins.
    db.refuse_connections(&[]).await;
    proceed.send(()).unwrap();
    let outage = Instant::now();
    let mut every = tokio::time::interval(Duration::from_millis(100));
    while outage.elapsed() < OUTAGE {
        every.tick().await;
        db.terminate_backends(&[]).await;
    }
    db.allow_connections().await;
    until_at_least(
        &ferry,
        "SELECT count(*) FROM consumer_ledger WHERE group_id = 'go'",
        2,
        Duration::from_secs(60),
    )
    .await;
    let ledger: Vec<(i64, String)> =
        sqlx::query_as("SELECT \"offset\", outcome FROM consumer_ledger WHERE group_id = 'go' ORDER BY \"offset\"")
            .fetch_all(ferry.db().as_postgres().unwrap())
            .await
            .unwrap();
    assert_eq!(
        ledger,
        [(0, "applied".to_owned()), (1, "applied".to_owned())],
        "the record in progress during the outage was applied, not skipped"
    );
    assert_eq!(
        scalar(&ferry, "SELECT count(*) FROM effects_applied WHERE applied = 1").await,
        2,
        "each effect applied once"
    );
    assert_eq!(stored_next(&ferry, "go", "outage").await, 2);
    assert_eq!(
        (metrics.dead_lettered.get(), metrics.dead_letter_failures.get()),
        (0, 0)
    );
    assert!(
        metrics.infrastructure_retries.get() > u64::from(BUDGET),
        "the outage outlasted the budget: {} attempts waited",
        metrics.infrastructure_retries.get()
    );
    // A second outage: the consumer shuts down while a record waits on it.
    db.refuse_connections(&[]).await;
    let before = metrics.infrastructure_retries.get();
    produce(&p, "outage", "k", Some("o2")).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while metrics.infrastructure_retries.get() <= before + u64::from(BUDGET) {
        assert!(Instant::now() < deadline, "the third record never waited on the outage");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::timeout(Duration::from_secs(60), consumer.stop())
        .await
        .expect("the consumer did not shut down during the outage");
    db.allow_connections().await;
    assert_eq!(
        scalar(&ferry, "SELECT count(*) FROM consumer_ledger WHERE group_id = 'go'").await,
        2,
        "the record waiting on the outage was neither applied nor dead-lettered"
    );
    assert_eq!(stored_next(&ferry, "go", "outage").await, 2, "nothing moved past it");
    assert_eq!(metrics.dead_lettered.get(), 0);
    db.drop_with(ferry).await;
}

/// PostgreSQL itself stopped for 45 s (a fast shutdown of a cluster of the
/// test's own, so the shared one is never restarted), far longer than the
/// retry budget and the 30 s partition lease, while a record's transaction
/// is open in the handler and 300 records wait on three partitions. Once it
/// is back, without anyone's help, every record's effect is applied once,
/// every ledger row says `applied`, nothing is skipped or dead-lettered, and
/// the stored offsets reach the end of each partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_stopped_for_45_s_mid_record_applies_every_record_once() {
    // One attempt (the first retryable failure is dead-lettered): an
    // attempt on a stopped server waits out the pool's 10 s acquire timeout.
    const BUDGET: u32 = 1;
    const RECORDS: usize = 300;
    let broker = Kafka::start();
    broker.create_topic("stopped", 3);
    let mut pg = PgCluster::start();
    let ferry = Ferry::builder(pg.url()).migrate(true).connect().await.unwrap();
    create_effects_table(&ferry).await;
    let p = producer(&broker.brokers());
    produce_range(&p, "stopped", 0, RECORDS).await;
    let (entered_tx, entered) = tokio::sync::oneshot::channel();
    let (proceed, proceed_rx) = tokio::sync::oneshot::channel();
    let c = Consumer::builder(ferry.clone(), broker.brokers(), "stop", &["stopped"])
        .handler(HoldFirst {
            apply: Apply { owner: "c".into() },
            entered: std::sync::Mutex::new(Some(entered_tx)),
            proceed: std::sync::Mutex::new(Some(proceed_rx)),
        })
        .retry(BUDGET, Duration::from_millis(20), Duration::from_millis(200))
        .kafka("session.timeout.ms", "6000")
        .kafka("heartbeat.interval.ms", "500")
        .build()
        .unwrap();
    let consumer = Running::spawn(c);
    let metrics = consumer.metrics();
    tokio::time::timeout(Duration::from_secs(60), entered)
        .await
        .expect("the first record never reached the handler")
        .unwrap();
    // The record's transaction is open in the handler: the outage begins.
    tokio::task::block_in_place(|| pg.stop());
    let down = Instant::now();
    proceed.send(()).unwrap();
    while metrics.infrastructure_retries.get() < u64::from(BUDGET) {
        assert!(
            down.elapsed() < Duration::from_secs(44),
            "the record never failed on the outage"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The outage lasts 45 s: the fault injected, not a synchronization.
    tokio::time::sleep(Duration::from_secs(45).saturating_sub(down.elapsed())).await;
    tokio::task::block_in_place(|| pg.restart());

    let ledger = "SELECT count(*) FROM consumer_ledger WHERE group_id = 'stop'";
    until_at_least(&ferry, ledger, RECORDS as i64, Duration::from_secs(120)).await;
    assert_eq!(
        scalar(
            &ferry,
            "SELECT count(*) FROM consumer_ledger WHERE group_id = 'stop' AND outcome = 'applied'"
        )
        .await,
        RECORDS as i64,
        "every record applied, the one in progress during the outage included"
    );
    assert_eq!(
        scalar(&ferry, "SELECT count(*) FROM effects_applied WHERE applied = 1").await,
        RECORDS as i64,
        "each effect applied once"
    );
    assert_eq!(
        scalar(
            &ferry,
            "SELECT CAST(COALESCE(sum(next_offset), 0) AS BIGINT) FROM consumer_partitions WHERE group_id = 'stop'"
        )
        .await,
        RECORDS as i64,
        "the stored offsets reached the end of every partition"
    );
    assert_eq!(
        (metrics.dead_lettered.get(), metrics.dead_letter_failures.get()),
        (0, 0)
    );
    eprintln!(
        "consumer outage: {} attempts waited on the database, {} lease losses",
        metrics.infrastructure_retries.get(),
        metrics.lease_losses.get()
    );
    consumer.stop().await;
}

/// Takes the `gate` row's lock without waiting (`FOR UPDATE NOWAIT`), then
/// writes the effect like [`Apply`], counting its calls: while the test
/// holds that row, each attempt fails with `lock_not_available`, an
/// infrastructure error the handler's own statement meets.
struct Gated {
    apply: Apply,
    calls: Arc<std::sync::atomic::AtomicU32>,
}

impl Handler for Gated {
    fn handle<'a>(&'a self, r: &'a Record, tx: &'a mut ferry::Tx) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tx.execute("SELECT id FROM gate WHERE id = 1 FOR UPDATE NOWAIT", &[])
                .await?;
            self.apply.handle(r, tx).await
        })
    }
}

/// An infrastructure error that the handler's own statement meets (here a
/// row lock it cannot take, `lock_not_available`) spends none of the
/// record's budget and never dead-letters it: the record is tried again and
/// again, its partition paused (the record after it waits, though the
/// database is up), and once the lock is free both are applied in order.
/// The old consumer charged it to the budget, and with no dead-letter topic
/// recorded the record `dead_lettered` and went on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_infrastructure_error_met_by_the_handler_waits_with_its_partition_paused() {
    const BUDGET: u32 = 3;
    let broker = Kafka::start();
    broker.create_topic("gated", 1);
    let (ferry, _) = pg().await;
    let pool = ferry.db().as_postgres().unwrap().clone();
    sqlx::query("CREATE TABLE gate (id INT PRIMARY KEY)")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("INSERT INTO gate VALUES (1)").execute(&pool).await.unwrap();
    let mut held = pool.begin().await.unwrap();
    sqlx::query("SELECT id FROM gate WHERE id = 1 FOR UPDATE")
        .execute(&mut *held)
        .await
        .unwrap();
    let p = producer(&broker.brokers());
    produce(&p, "gated", "k", Some("g0")).await;
    produce(&p, "gated", "k", Some("g1")).await;
    let calls = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let c = Consumer::builder(ferry.clone(), broker.brokers(), "gg", &["gated"])
        .handler(Gated {
            apply: Apply { owner: "c".into() },
            calls: calls.clone(),
        })
        .retry(BUDGET, Duration::from_millis(20), Duration::from_millis(200))
        .micro_batch(1)
        .kafka("session.timeout.ms", "6000")
        .kafka("heartbeat.interval.ms", "500")
        .build()
        .unwrap();
    let consumer = Running::spawn(c);
    let metrics = consumer.metrics();
    let ledger = "SELECT \"offset\", outcome FROM consumer_ledger WHERE group_id = 'gg' ORDER BY \"offset\"";
    let deadline = Instant::now() + Duration::from_secs(60);
    while calls.load(std::sync::atomic::Ordering::SeqCst) < 2 * BUDGET {
        let rows: Vec<(i64, String)> = sqlx::query_as(ledger).fetch_all(&pool).await.unwrap();
        assert!(
            rows.is_empty(),
            "the record waiting on the lock was dead-lettered or passed over: {rows:?} after {} handler calls",
            calls.load(std::sync::atomic::Ordering::SeqCst)
        );
        assert!(Instant::now() < deadline, "the handler was not tried again and again");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        stored_next(&ferry, "gg", "gated").await,
        0,
        "nothing moved past the record"
    );
    held.rollback().await.unwrap();
    until_at_least(
        &ferry,
        "SELECT count(*) FROM consumer_ledger WHERE group_id = 'gg'",
        2,
        Duration::from_secs(60),
    )
    .await;
    let rows: Vec<(i64, String)> = sqlx::query_as(ledger).fetch_all(&pool).await.unwrap();
    assert_eq!(rows, [(0, "applied".to_owned()), (1, "applied".to_owned())]);
    assert_eq!(
        scalar(&ferry, "SELECT count(*) FROM effects_applied WHERE applied = 1").await,
        2
    );
    consumer.stop().await;
    assert_eq!(metrics.dead_lettered.get(), 0);
    assert!(metrics.infrastructure_retries.get() >= u64::from(2 * BUDGET - 1));
}

/// A partition lease lost during an outage stops the member; it never skips
/// the record it was retrying. While the database refuses connections and
/// the record waits on the outage, another member takes the partition (on a
/// connection the outage spared, as a member reaching the database another
/// way would); when the database is back, the member's retry is refused, it
/// pauses the partition and defers to the live lease, having written
/// nothing; once the lease is given back it takes the partition again and
/// applies the record from the stored offset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_lost_during_an_outage_stops_the_member_and_skips_nothing() {
    let broker = Kafka::start();
    broker.create_topic("handover", 1);
    let db = OwnDatabase::create().await;
    let ferry = db.ferry().await;
    // The other member's one connection, which the outage spares.
    let other = Ferry::builder(&db.url).max_connections(1).connect().await.unwrap();
    let spared: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(other.db().as_postgres().unwrap())
        .await
        .unwrap();
    let consumer = in_process(
        ferry.clone(),
        &broker.brokers(),
        "gh",
        "handover",
        Assignment::CooperativeSticky,
        "member-a",
    );
    let metrics = consumer.metrics();
    until_at_least(
        &ferry,
        "SELECT count(*) FROM consumer_partitions WHERE group_id = 'gh' AND owner = 'member-a'",
        1,
        Duration::from_secs(60),
    )
    .await;
    db.refuse_connections(&[spared]).await;
    let p = producer(&broker.brokers());
    produce(&p, "handover", "k", Some("h0")).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while metrics.infrastructure_retries.get() == 0 {
        assert!(Instant::now() < deadline, "the record never waited on the outage");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (lease_b, _) = ferry_consumer::store::ConsumerStore::new(other.clone())
        .acquire_partition("gh", "handover", 0, "member-b", Duration::from_secs(120))
        .await
        .unwrap();
    db.allow_connections().await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while metrics.lease_losses.get() == 0 || metrics.reclaims_deferred.get() == 0 {
        assert!(
            Instant::now() < deadline,
            "member A neither noticed the lost lease nor deferred to it"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        scalar(&ferry, "SELECT count(*) FROM consumer_ledger WHERE group_id = 'gh'").await,
        0,
        "the member that lost the lease wrote nothing"
    );
    assert_eq!(
        holder(&ferry, "gh", "handover", 0).await,
        (Some("member-b".to_owned()), lease_b.generation)
    );
    assert!(ferry_consumer::store::ConsumerStore::new(other.clone())
        .release_partition(&lease_b)
        .await
        .unwrap());
    until_at_least(
        &ferry,
        "SELECT count(*) FROM consumer_ledger WHERE group_id = 'gh' AND outcome = 'applied'",
        1,
        Duration::from_secs(60),
    )
    .await;
    consumer.stop().await;
    assert_eq!(
        scalar(
            &ferry,
            "SELECT count(*) FROM effects_applied WHERE written_by = 'member-a' AND applied = 1"
        )
        .await,
        1
    );
    assert_eq!(metrics.dead_lettered.get(), 0);
    other.db().close().await;
    db.drop_with(ferry).await;
}

/// A record whose effect key the database refuses (a NUL byte, which
/// PostgreSQL text cannot hold; a key too long for the ledger's index is
/// another) is the record's own fault: it is dead-lettered, and since its
/// key cannot go into the ledger, the dead letter's ledger row is the one of
/// its position (as for a record without a key), and the partition flows.
/// The old consumer retried the dead letter's ledger write under the refused
/// key forever: the partition stayed stuck behind one bad header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_whose_effect_key_the_database_refuses_is_dead_lettered_and_the_partition_flows() {
    let broker = Kafka::start();
    broker.create_topic("badkey", 1);
    broker.create_topic("badkey.dlq", 1);
    let (ferry, _) = pg().await;
    let p = producer(&broker.brokers());
    produce(&p, "badkey", "a", Some("bad\0key")).await;
    produce(&p, "badkey", "b", Some("2")).await;
    let consumer = in_process(
        ferry.clone(),
        &broker.brokers(),
        "gk",
        "badkey",
        Assignment::CooperativeSticky,
        "c",
    );
    let metrics = consumer.metrics();
    let deadline = Instant::now() + Duration::from_secs(60);
    while stored_next(&ferry, "gk", "badkey").await < 2 {
        assert!(
            Instant::now() < deadline,
            "the partition is stuck behind the record whose effect key the database refuses: next_offset = {}, dead-letter failures = {}",
            stored_next(&ferry, "gk", "badkey").await,
            metrics.dead_letter_failures.get()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    consumer.stop().await;
    let ledger: Vec<(String, i64, String)> = sqlx::query_as(
        "SELECT effect_key, \"offset\", outcome FROM consumer_ledger WHERE group_id = 'gk' ORDER BY \"offset\"",
    )
    .fetch_all(ferry.db().as_postgres().unwrap())
    .await
    .unwrap();
    assert_eq!(
        ledger,
        [
            ("!unkeyed/badkey/0/0".to_owned(), 0, "dead_lettered".to_owned()),
            ("2".to_owned(), 1, "applied".to_owned())
        ]
    );
    assert_eq!(scalar(&ferry, "SELECT count(*) FROM effects_applied").await, 1);
    assert_eq!(metrics.dead_lettered.get(), 1);
}

/// Notes which partitions have a record in the handler right now, and
/// whether a record ever met one of another partition there. A record
/// keyed `gate` holds the poll loop until `open` is notified.
struct Meet {
    inside: tokio::sync::watch::Sender<std::collections::HashSet<i32>>,
    met: Arc<std::sync::atomic::AtomicBool>,
    open: Arc<tokio::sync::Notify>,
    at_gate: Arc<tokio::sync::Notify>,
}

impl Handler for Meet {
    fn handle<'a>(&'a self, r: &'a Record, _tx: &'a mut ferry::Tx) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            if r.key.as_deref() == Some(b"warm") {
                return Ok(());
            }
            if r.key.as_deref() == Some(b"gate") {
                self.at_gate.notify_one();
                let _ = tokio::time::timeout(Duration::from_secs(60), self.open.notified()).await;
                return Ok(());
            }
            // Once two records met, the rest pass at once.
            if self.met.load(std::sync::atomic::Ordering::SeqCst) {
                return Ok(());
            }
            let mut seen = self.inside.subscribe();
            self.inside.send_modify(|s| {
                s.insert(r.partition);
            });
            // Bounded: handled one partition after another, no record
            // ever finds another partition's here, and each gives up. A
            // record that came in while this one waits finds this one and
            // leaves before this one wakes, so this one also ends on `met`.
            // (The guard `wait_for` returns is dropped at once: holding it
            // across `send_modify` would deadlock.)
            let wait = seen.wait_for(|s| s.len() >= 2 || self.met.load(std::sync::atomic::Ordering::SeqCst));
            if matches!(tokio::time::timeout(Duration::from_secs(1), wait).await, Ok(Ok(_))) {
                self.met.store(true, std::sync::atomic::Ordering::SeqCst);
            }
            self.inside.send_modify(|s| {
                s.remove(&r.partition);
            });
            Ok(())
        })
    }
}

/// Sends `n` records keyed `key` with `payload` to each of partitions
/// `parts` of `pairs` (ids from `first`), and waits for their acknowledgements.
async fn produce_to(p: &FutureProducer, key: &str, parts: &[i32], first: usize, n: usize, payload: &str) {
    let sends: Vec<_> = (0..parts.len() * n)
        .map(|i| {
            let id = (first + i).to_string();
            let h = OwnedHeaders::new().insert(Header {
                key: "ferry-outbox-id",
                value: Some(&id),
            });
            let record = FutureRecord::to("pairs")
                .key(key)
                .partition(parts[i % parts.len()])
                .payload(payload)
                .headers(h);
            p.send_result(record).map_err(|(e, _)| e).unwrap()
        })
        .collect();
    for s in sends {
        s.await.unwrap().map_err(|(e, _)| e).unwrap();
    }
}

/// The records of one poll are grouped by partition and the groups run at
/// once (their commits share WAL flushes): with both partitions' records
/// fetched while the loop was busy, a record of one is in the handler
/// while one of the other is. Handled one group after another, none is.
///
/// Up to three rounds: librdkafka hands a fetch answer's partitions to the
/// poll queue one after the other, so a poll that starts between them sees
/// one partition's records alone (a race of microseconds, longer on a busy
/// machine). Handled one group after another, no round ever meets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poll_s_partitions_are_handled_at_once() {
    let broker = Kafka::start();
    broker.create_topic("pairs", 2);
    let (ferry, _) = pg().await;
    let met = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let open = Arc::new(tokio::sync::Notify::new());
    let at_gate = Arc::new(tokio::sync::Notify::new());
    let c = Consumer::builder(ferry.clone(), broker.brokers(), "meet", &["pairs"])
        .handler(Meet {
            inside: tokio::sync::watch::Sender::new(Default::default()),
            met: met.clone(),
            open: open.clone(),
            at_gate: at_gate.clone(),
        })
        // A long lease: the gate's wait counts as a slow record, and with
        // the default lease it would shrink the turns (see
        // `a_slow_handler_s_turns_end_inside_the_lease`) below one
        // partition's records.
        .lease(Duration::from_secs(600))
        .kafka("session.timeout.ms", "6000")
        // A fetch is answered once 30 kB are there (the warm and gate
        // records are that big alone), or after 10 s: a round whose pair
        // came in two answers (its producing outlasted the wait) then ends
        // without a meeting, and the next round tries again.
        .kafka("fetch.min.bytes", "30000")
        .kafka("fetch.wait.max.ms", "10000")
        .build()
        .unwrap();
    let consumer = Running::spawn(c);
    // Each send waits up to a second for the others: each partition's 20
    // records go as one batch, however the sending loop is paused, so no
    // fetch answer can take a part of them (one partition's 20 kB are not
    // enough to answer it, both partitions' are).
    let p = producer_with(&broker.brokers(), &[("linger.ms", "1000")]);
    let handled = "SELECT count(*) FROM consumer_ledger WHERE group_id = 'meet'";
    let big = format!("{{\"pad\":\"{}\"}}", "x".repeat(30_000));
    // Both partitions assigned and fetching (a first fetch starts each
    // partition on its own).
    produce_to(&p, "warm", &[0, 1], 1, 1, &big).await;
    until_at_least(&ferry, handled, 2, Duration::from_secs(60)).await;
    let pad = format!("{{\"pad\":\"{}\"}}", "x".repeat(1000));
    for round in 0..3 {
        let first = 3 + round * 41;
        // The gate holds the loop in its handler; meanwhile librdkafka
        // fetches the records after it into its queue, both partitions'.
        produce_to(&p, "gate", &[0], first, 1, &big).await;
        tokio::time::timeout(Duration::from_secs(60), at_gate.notified())
            .await
            .expect("the gate record reached the handler");
        // Each partition's 20 records of 1 kB are fewer bytes than a fetch
        // waits for (`fetch.min.bytes`), both partitions' are more: one
        // fetch answer carries both, so they are in one poll.
        produce_to(&p, "pair", &[0, 1], first + 1, 20, &pad).await;
        open.notify_one();
        until_at_least(&ferry, handled, 2 + 41 * (round as i64 + 1), Duration::from_secs(120)).await;
        if met.load(std::sync::atomic::Ordering::SeqCst) {
            break;
        }
    }
    consumer.stop().await;
    assert!(
        met.load(std::sync::atomic::Ordering::SeqCst),
        "no record was in the handler while one of the other partition was, in three rounds: partitions handled one after another"
    );
}

/// Takes `per_record` over each record (a slow effect).
struct Slow {
    per_record: Duration,
}

impl Handler for Slow {
    fn handle<'a>(&'a self, _r: &'a Record, _tx: &'a mut ferry::Tx) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            tokio::time::sleep(self.per_record).await;
            Ok(())
        })
    }
}

/// Leases are renewed between poll turns, so a turn must end well inside
/// the lease: with a slow handler, a turn takes only as many records as
/// fit in a third of it (here 4 of 250 ms in a 3 s lease), never the whole
/// micro-batch (24 records, 6 s), and the lease never runs out while the
/// member works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_handler_s_turns_end_inside_the_lease() {
    let broker = Kafka::start();
    broker.create_topic("slow", 1);
    let (ferry, _) = pg().await;
    let p = producer(&broker.brokers());
    produce_range(&p, "slow", 1, 25).await;
    let c = Consumer::builder(ferry.clone(), broker.brokers(), "slow", &["slow"])
        .handler(Slow {
            per_record: Duration::from_millis(250),
        })
        .lease(Duration::from_secs(3))
        .kafka("session.timeout.ms", "6000")
        .build()
        .unwrap();
    let consumer = Running::spawn(c);
    let expired = "SELECT count(*) FROM consumer_partitions WHERE group_id = 'slow' AND owner IS NOT NULL \
                   AND lease_expires_at < (extract(epoch FROM clock_timestamp()) * 1000)::bigint";
    let handled = "SELECT count(*) FROM consumer_ledger WHERE group_id = 'slow'";
    let started = Instant::now();
    let mut ran_out = 0;
    // Watches the lease while the records are worked through (an expiry
    // lasts seconds when a turn outlasts the lease; a look every 50 ms
    // cannot miss it).
    while scalar(&ferry, handled).await < 24 {
        ran_out += scalar(&ferry, expired).await;
        assert!(
            started.elapsed() < Duration::from_secs(90),
            "24 slow records not handled in 90 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    consumer.stop().await;
    assert_eq!(
        ran_out, 0,
        "the lease ran out while the member was working (a turn outlasted it)"
    );
}
