//! Poison rows against PostgreSQL and Apache Kafka: a record the broker
//! refuses is marked dead (or blocks its lane) only on evidence about that
//! row alone, never because it shared a refused produce request with other
//! lanes' rows; and a refusal never lets a lane's later rows overtake
//! earlier ones of the same key. At least once, in both capture modes
//! (`in_both_capture_modes!`); exactly once polls (`--capture wal
//! --exactly-once` is refused for now).

use std::collections::HashSet;
use std::time::{Duration, Instant};

use ferry::outbox::lane_for;
use ferry::{Ferry, OutboxMessage};
use ferry_relay::store::RelayStore;
use ferry_relay::{Capture, OnPoison, RelayConfig};

use crate::support::*;
use ferry_testkit::Kafka;

/// `n` incompressible bytes (so lz4 cannot squeeze them under a topic's
/// limit), different for every `seed` (so records in one batch do not
/// compress against each other either).
fn noise(seed: u64, n: usize) -> Vec<u8> {
    let mut x: u64 = 0x9e3779b97f4a7c15 ^ seed.wrapping_mul(0x2545_f491_4f6c_dd1d);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

pub(crate) async fn poison_rows(ferry: &Ferry) -> i64 {
    let mut poison = 0;
    for i in 0..7 {
        let big = i == 3;
        let payload = if big { noise(0, 50_000) } else { vec![b'y'; 10] };
        let id = ferry
            .enqueue(&OutboxMessage::bytes("acme", "orders", "same-key", payload))
            .await
            .unwrap();
        if big {
            poison = id;
        }
    }
    poison
}

/// A topic whose `max.message.bytes` (2,000) refuses the 50 kB row: a real
/// poison record, refused by the broker and not by the client.
pub(crate) fn poison_topic(broker: &Kafka, name: &str, partitions: i32) {
    broker.create_topic_with(name, partitions, &[("max.message.bytes", "2000")]);
}

/// `n` keys whose rows fall in `n` different lanes of one stream.
fn keys_in_distinct_lanes(ferry: &Ferry, n: usize) -> Vec<String> {
    // All in one stream (`--streams`), whose rows share a producer.
    let streams = streams() as i32;
    let mut lanes = HashSet::new();
    (0..)
        .map(|i| format!("key-{i}"))
        .filter(|k| {
            let lane = lane_for(k, ferry.lanes());
            lane % streams == 0 && lanes.insert(lane)
        })
        .take(n)
        .collect()
}

/// Polls until no row is pending; fails after a minute.
async fn until_settled(ferry: &Ferry) {
    let start = Instant::now();
    let mut every = tokio::time::interval(Duration::from_millis(20));
    while scalar(ferry, &format!("SELECT count(*) FROM {OUTBOX} WHERE state = 'pending'")).await > 0 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "rows still pending after a minute"
        );
        every.tick().await;
    }
}

/// The ids in `state`, in id order.
async fn ids_in(ferry: &Ferry, state: &str) -> Vec<i64> {
    sqlx::query_scalar(&format!("SELECT id FROM {OUTBOX} WHERE state = '{state}' ORDER BY id"))
        .fetch_all(ferry.db().as_postgres().unwrap())
        .await
        .unwrap()
}

/// The dead rows' ids and error codes, in id order.
async fn dead(ferry: &Ferry) -> Vec<(i64, Option<String>)> {
    let mut dead: Vec<_> = RelayStore::new(ferry.clone())
        .ferry()
        .operator()
        .list_dead_outbox(100)
        .await
        .unwrap()
        .into_iter()
        .map(|d| (d.id, d.last_error))
        .collect();
    dead.sort();
    dead
}

/// How many records the relay saw refused as too large (each refusal
/// counted once per record it refused).
fn too_large_refusals(relay: &RunningRelay) -> u64 {
    let line = r#"ferry_relay_publish_errors_total{code="message_too_large"} "#;
    relay
        .state
        .metrics
        .render()
        .lines()
        .find_map(|l| l.strip_prefix(line))
        .map_or(0, |n| n.trim().parse().unwrap())
}

/// `cfg` with a shared producer that lingers, so records of different
/// lanes bound for one partition meet in one produce request.
fn lingering(mut cfg: RelayConfig) -> RelayConfig {
    cfg.kafka.push(("linger.ms".into(), "200".into()));
    cfg
}

/// Starts a relay of `guard`'s capture mode and waits until it publishes
/// (in WAL capture: streams from its slot), so the rows written next are
/// captured as they commit.
async fn capturing(guard: &CaptureGuard, cfg: RelayConfig, ferry: &Ferry) -> RunningRelay {
    let relay = guard.start(cfg, ferry.clone()).await;
    ferry
        .enqueue(&OutboxMessage::bytes("acme", "orders", "before", b"first".to_vec()))
        .await
        .unwrap();
    wait_for_count(
        ferry,
        &format!("SELECT count(*) FROM {OUTBOX} WHERE state = 'delivered'"),
        1,
        Duration::from_secs(60),
    )
    .await;
    relay
}

/// A poison row among its key's rows, written while the relay captures:
/// refused in a shared produce request, found by publishing one record at
/// a time, marked dead; the rest flows. Once an operator shrinks it and
/// replays it (audited), it is published.
async fn a_poison_record_goes_dead_and_the_lane_flows(capture: Capture) {
    let broker = Kafka::start();
    poison_topic(&broker, "orders", 3);
    let (ferry, url) = pg_ferry().await;
    let (cfg, guard) = config_for(capture, &url, &broker.brokers()).await;
    let relay = capturing(&guard, cfg.clone(), &ferry).await;
    let poison = poison_rows(&ferry).await;
    let c = consumer(&broker.brokers(), &["orders"]);
    let recs = read_until(&c, Duration::from_secs(60), |r| distinct(r) >= 7).await;
    assert!(recs.iter().all(|r| r.outbox_id() != poison));
    until_settled(&ferry).await;
    assert_eq!(dead(&ferry).await, vec![(poison, Some("message_too_large".into()))]);
    relay.shutdown().await;
    assert_eq!(
        scalar(
            &ferry,
            &format!("SELECT count(*) FROM {OUTBOX} WHERE state = 'delivered'")
        )
        .await,
        7
    );
    // An operator shrinks the row and puts it back (audited): the relay
    // publishes it (in WAL capture, from the replay's announcement).
    let relay = guard.start(cfg, ferry.clone()).await;
    sqlx::query("UPDATE outbox SET payload = 'small' WHERE id = $1")
        .bind(poison)
        .execute(ferry.db().as_postgres().unwrap())
        .await
        .unwrap();
    assert_eq!(
        RelayStore::new(ferry.clone())
            .ferry()
            .operator()
            .replay_dead_outbox(Some(poison), "ops", "shrank the record")
            .await
            .unwrap(),
        vec![poison]
    );
    assert_eq!(
        scalar(
            &ferry,
            "SELECT count(*) FROM ferry_audit WHERE action = 'outbox.replay_dead' AND actor = 'ops'"
        )
        .await,
        1
    );
    wait_for_count(
        &ferry,
        &format!("SELECT count(*) FROM {OUTBOX} WHERE id = {poison} AND state = 'delivered'"),
        1,
        Duration::from_secs(60),
    )
    .await;
    relay.shutdown().await;
    let recs = read_all(&broker.brokers(), "orders", false, Duration::from_secs(30)).await;
    assert!(
        recs.iter().any(|r| r.outbox_id() == poison),
        "the replayed row reached Kafka"
    );
}

/// Lanes share one producer, and librdkafka puts records of different lanes
/// bound for one partition into one produce request, which the broker
/// refuses whole. Five times over, acme's 50 kB row (one lane) and globex's
/// 10-byte row (another lane) go to the one partition of a topic that takes
/// 2,000 bytes: only the big rows are dead, every small one is delivered.
/// (In WAL capture the rows are read from the table for the new slot,
/// through the same shared producer.)
async fn a_row_refused_with_another_lane_s_poison_row_is_delivered(capture: Capture) {
    let broker = Kafka::start();
    poison_topic(&broker, "orders", 1);
    let (ferry, url) = pg_ferry().await;
    let keys = keys_in_distinct_lanes(&ferry, 2);
    let (mut big, mut small) = (Vec::new(), Vec::new());
    for i in 0..5 {
        let msg = OutboxMessage::bytes("acme", "orders", &keys[0], noise(i, 50_000));
        big.push(ferry.enqueue(&msg).await.unwrap());
        let msg = OutboxMessage::bytes("globex", "orders", &keys[1], format!("small-{i:04}").into_bytes());
        small.push(ferry.enqueue(&msg).await.unwrap());
    }
    let (cfg, guard) = config_for(capture, &url, &broker.brokers()).await;
    let relay = guard.start(lingering(cfg), ferry.clone()).await;
    until_settled(&ferry).await;
    // Each big row is refused twice (with its request, then alone): more
    // means a small row was refused with a big one, the case under test.
    assert!(too_large_refusals(&relay) > 10, "no small row met a big one");
    relay.shutdown().await;
    let expected: Vec<_> = big.iter().map(|id| (*id, Some("message_too_large".into()))).collect();
    assert_eq!(dead(&ferry).await, expected, "only the big rows are dead");
    assert_eq!(ids_in(&ferry, "delivered").await, small);
    let on_topic: HashSet<i64> = read_all(&broker.brokers(), "orders", false, Duration::from_secs(30))
        .await
        .iter()
        .map(Record::outbox_id)
        .collect();
    assert_eq!(on_topic, small.iter().copied().collect());
}

/// No poison row at all: six valid 1,000-byte rows of six lanes meet in one
/// produce request to the one partition of a topic that takes 2,000 bytes,
/// and the broker refuses it for their sum. None is dead: each is delivered.
async fn valid_rows_refused_for_their_sum_are_all_delivered(capture: Capture) {
    let broker = Kafka::start();
    poison_topic(&broker, "orders", 1);
    let (ferry, url) = pg_ferry().await;
    let mut ids = Vec::new();
    for (i, key) in keys_in_distinct_lanes(&ferry, 6).iter().enumerate() {
        let msg = OutboxMessage::bytes("acme", "orders", key, noise(i as u64, 1_000));
        ids.push(ferry.enqueue(&msg).await.unwrap());
    }
    let (cfg, guard) = config_for(capture, &url, &broker.brokers()).await;
    let relay = guard.start(lingering(cfg), ferry.clone()).await;
    until_settled(&ferry).await;
    // A valid row alone is never refused: these refusals were of requests
    // holding several rows, the case under test.
    assert!(too_large_refusals(&relay) >= 2, "the rows never met in one request");
    relay.shutdown().await;
    assert_eq!(dead(&ferry).await, vec![], "no row is dead");
    assert_eq!(ids_in(&ferry, "delivered").await, ids);
    let on_topic: HashSet<i64> = read_all(&broker.brokers(), "orders", false, Duration::from_secs(30))
        .await
        .iter()
        .map(Record::outbox_id)
        .collect();
    assert_eq!(on_topic, ids.iter().copied().collect());
}

/// Exactly once: the client refuses a row larger than its own
/// `message.max.bytes` before sending it, so its transaction is aborted
/// while the rows of that transaction are still pending. Key K's rows id1,
/// id2 (too large), id3 and id4, in batches of three: id2 is dead, and a
/// `read_committed` reader sees K's other rows in id order (id4 never
/// overtakes the aborted id1 and id3). Poll capture only: exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_refused_before_sending_lets_no_later_row_overtake_its_transaction() {
    let broker = Kafka::start();
    broker.create_topic("orders", 1);
    let (ferry, url) = pg_ferry().await;
    let mut ids = Vec::new();
    for i in 0..4 {
        let payload = if i == 1 {
            noise(0, 50_000)
        } else {
            format!("v{i}").into_bytes()
        };
        ids.push(
            ferry
                .enqueue(&OutboxMessage::bytes("acme", "orders", "K", payload))
                .await
                .unwrap(),
        );
    }
    let mut cfg = relay_config(&url, &broker.brokers());
    cfg.exactly_once = true;
    cfg.batch_size = 3;
    cfg.kafka.push(("message.max.bytes".into(), "10000".into()));
    let relay = start_relay(cfg, ferry.clone()).await;
    until_settled(&ferry).await;
    relay.shutdown().await;
    assert_eq!(dead(&ferry).await, vec![(ids[1], Some("message_too_large".into()))]);
    let k: Vec<i64> = read_all(&broker.brokers(), "orders", true, Duration::from_secs(30))
        .await
        .iter()
        .filter(|r| r.key == "K")
        .map(Record::outbox_id)
        .collect();
    assert_eq!(k, vec![ids[0], ids[2], ids[3]], "K's rows in id order");
}

/// Block mode, the poison row written while the relay captures: the lane
/// (in WAL capture, the stream) stops at the poison record and keeps
/// retrying it alone; the rows before it are delivered, none is dead, and
/// nothing behind it (same key) is produced again on any retry. Rows in
/// flight in a later produce request when it was refused may have landed
/// once (the at-least-once exception README names); exactly once, a
/// `read_committed` reader sees none of them.
async fn poison_blocks(capture: Capture, exactly_once: bool) {
    let broker = Kafka::start();
    poison_topic(&broker, "orders", 3);
    let (ferry, url) = pg_ferry().await;
    let (mut cfg, guard) = config_for(capture, &url, &broker.brokers()).await;
    cfg.on_poison = OnPoison::Block;
    cfg.exactly_once = exactly_once;
    let relay = capturing(&guard, cfg, &ferry).await;
    let poison = poison_rows(&ferry).await;
    let start = Instant::now();
    while scalar(
        &ferry,
        &format!("SELECT CAST(publish_attempts AS BIGINT) FROM outbox WHERE id = {poison}"),
    )
    .await
        < 3
    {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the relay never retried the poison row"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    relay.shutdown().await;
    assert_eq!(
        scalar(
            &ferry,
            &format!("SELECT count(*) FROM {OUTBOX} WHERE state = 'delivered'")
        )
        .await,
        4,
        "only rows before it"
    );
    assert_eq!(
        scalar(
            &ferry,
            &format!("SELECT count(*) FROM {OUTBOX} WHERE state = 'pending' AND id >= {poison}")
        )
        .await,
        4
    );
    assert_eq!(
        scalar(&ferry, &format!("SELECT count(*) FROM {OUTBOX} WHERE state = 'dead'")).await,
        0
    );
    let on_topic = read_all(&broker.brokers(), "orders", exactly_once, Duration::from_secs(30)).await;
    assert!(
        on_topic.iter().all(|r| r.outbox_id() != poison),
        "the poison row never reached Kafka"
    );
    let behind: Vec<i64> = on_topic
        .iter()
        .map(Record::outbox_id)
        .filter(|id| *id > poison)
        .collect();
    let once: HashSet<i64> = behind.iter().copied().collect();
    assert_eq!(
        once.len(),
        behind.len(),
        "rows behind the blocked row were produced again: {behind:?}"
    );
    if exactly_once {
        assert!(
            behind.is_empty(),
            "rows behind the blocked row were committed: {behind:?}"
        );
    }
}

async fn a_poison_record_blocks_the_lane_and_nothing_behind_it_is_produced_again(capture: Capture) {
    poison_blocks(capture, false).await;
}

/// Poll capture only: exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_record_blocks_an_exactly_once_lane() {
    poison_blocks(Capture::Poll, true).await;
}

/// Block mode, the poison row refused by the client before sending (larger
/// than the relay's own `message.max.bytes`) behind three valid rows of its
/// key, all in one batch: the rows before it are delivered and marked once,
/// never held back with it nor republished on every retry; nothing behind
/// it reaches the topic.
async fn a_client_refusal_blocks_only_what_is_behind_it(capture: Capture, exactly_once: bool) {
    let broker = Kafka::start();
    broker.create_topic("orders", 1);
    let (ferry, url) = pg_ferry().await;
    let mut ids = Vec::new();
    for i in 0..5 {
        let payload = if i == 3 {
            noise(0, 50_000)
        } else {
            format!("v{i}").into_bytes()
        };
        ids.push(
            ferry
                .enqueue(&OutboxMessage::bytes("acme", "orders", "K", payload))
                .await
                .unwrap(),
        );
    }
    let poison = ids[3];
    let (mut cfg, guard) = config_for(capture, &url, &broker.brokers()).await;
    cfg.on_poison = OnPoison::Block;
    cfg.exactly_once = exactly_once;
    cfg.kafka.push(("message.max.bytes".into(), "10000".into()));
    let relay = guard.start(cfg, ferry.clone()).await;
    let start = Instant::now();
    let attempts = format!("SELECT CAST(publish_attempts AS BIGINT) FROM outbox WHERE id = {poison}");
    let mut every = tokio::time::interval(Duration::from_millis(20));
    while scalar(&ferry, &attempts).await < 3 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the relay never retried the poison row"
        );
        every.tick().await;
    }
    relay.shutdown().await;
    assert_eq!(
        ids_in(&ferry, "delivered").await,
        ids[..3].to_vec(),
        "the rows before the blocked row are delivered"
    );
    assert_eq!(ids_in(&ferry, "pending").await, ids[3..].to_vec());
    let k: Vec<i64> = read_all(&broker.brokers(), "orders", exactly_once, Duration::from_secs(30))
        .await
        .iter()
        .map(Record::outbox_id)
        .collect();
    assert_eq!(k, ids[..3].to_vec(), "each row before it once, nothing behind it");
}

async fn a_client_refusal_in_block_mode_holds_back_only_the_rows_behind_it(capture: Capture) {
    a_client_refusal_blocks_only_what_is_behind_it(capture, false).await;
}

/// Poll capture only: exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_refusal_in_block_mode_holds_back_only_the_rows_behind_it_exactly_once() {
    a_client_refusal_blocks_only_what_is_behind_it(Capture::Poll, true).await;
}

/// Exactly once, a transaction large enough that the broker refuses its
/// first row (too large for the topic) while the later rows are still being
/// handed to the producer, which then refuses them before sending (the
/// transaction already needs an abort): the broker's refusal of the earlier
/// row decides, so the poison row is found and dead, not the lane stalled
/// on a later valid row on every retry. Poll capture only: exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_early_row_s_refusal_outranks_later_rows_refused_before_sending() {
    let broker = Kafka::start();
    poison_topic(&broker, "orders", 1);
    let (ferry, url) = pg_ferry().await;
    let poison = ferry
        .enqueue(&OutboxMessage::bytes("acme", "orders", "K", noise(0, 50_000)))
        .await
        .unwrap();
    let small = ferry
        .enqueue(&OutboxMessage::bytes("acme", "orders", "K", b"v".to_vec()))
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO outbox (tenant, topic, key, lane, payload, headers, created_at) \
         SELECT tenant, topic, key, lane, payload, headers, created_at \
         FROM outbox, generate_series(1, 20000) WHERE id = $1",
    )
    .bind(small)
    .execute(ferry.db().as_postgres().unwrap())
    .await
    .unwrap();
    let mut cfg = relay_config(&url, &broker.brokers());
    cfg.exactly_once = true;
    cfg.batch_size = 30_000;
    let relay = start_relay(cfg, ferry.clone()).await;
    let start = Instant::now();
    let mut every = tokio::time::interval(Duration::from_millis(20));
    while dead(&ferry).await.is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the poison row was never found (last error of the lane's rows: {:?})",
            sqlx::query_scalar::<_, Option<String>>(
                "SELECT last_error FROM outbox WHERE last_error IS NOT NULL ORDER BY id LIMIT 1"
            )
            .fetch_optional(ferry.db().as_postgres().unwrap())
            .await
            .unwrap()
        );
        every.tick().await;
    }
    relay.shutdown().await;
    assert_eq!(dead(&ferry).await, vec![(poison, Some("message_too_large".into()))]);
}

/// In two streams (`--streams 2`), the big and the small rows in one
/// stream, whose records share a producer: isolating the poison row never
/// blames a row of the same request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_refused_with_another_lane_s_poison_row_is_delivered_in_two_streams() {
    STREAMS
        .scope(
            TEST_STREAMS,
            a_row_refused_with_another_lane_s_poison_row_is_delivered(Capture::Wal),
        )
        .await
}

in_both_capture_modes!(
    a_poison_record_goes_dead_and_the_lane_flows,
    a_row_refused_with_another_lane_s_poison_row_is_delivered,
    valid_rows_refused_for_their_sum_are_all_delivered,
    a_poison_record_blocks_the_lane_and_nothing_behind_it_is_produced_again,
    a_client_refusal_in_block_mode_holds_back_only_the_rows_behind_it,
);
