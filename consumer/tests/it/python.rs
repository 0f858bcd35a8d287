//! The effect-ledger protocol outside Rust: the Python example consumer
//! (`examples/python-consumer/consumer.py`, confluent-kafka and psycopg,
//! installed by `scripts/setup-writers`) in one group with a `ferry-projection`
//! member, on the same tables, SIGKILLed while records arrive.

use std::path::{Path, PathBuf};

use super::*;

/// The Python interpreter of the venv `scripts/setup-writers` makes.
fn python() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let python = root.join("target/writers-venv/bin/python");
    let installed = Command::new(&python)
        .args(["-c", "import confluent_kafka, psycopg"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        installed,
        "confluent-kafka and psycopg are not installed in {}: run scripts/setup-writers",
        python.display()
    );
    python
}

/// One Python member of `group`, writing the projection's effect table.
fn python_member(url: &str, brokers: &str, group: &str, topic: &str) -> Member {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let child = Command::new(python())
        .arg(root.join("examples/python-consumer/consumer.py"))
        .env("FERRY_DATABASE_URL", url)
        .env("FERRY_BROKERS", brokers)
        .env("FERRY_GROUP", group)
        .env("FERRY_TOPICS", topic)
        .env("FERRY_EFFECTS_TABLE", "ferry_projection_applied")
        .env("FERRY_LEASE_MS", "6000")
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn the Python consumer");
    Member(Some(child))
}

/// Records `from..to` of `topic` with Ferry's headers (effect key
/// `db:<i>`, 50 record keys).
async fn produce_keyed(p: &FutureProducer, topic: &str, from: usize, to: usize) {
    let sends: Vec<_> = (from..to)
        .map(|i| {
            let effect = format!("db:{i}");
            let key = format!("k{}", i % 50);
            let h = OwnedHeaders::new().insert(Header {
                key: "ferry-effect-key",
                value: Some(&effect),
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

/// Two Python members consume one topic alone, SIGKILLed and replaced at
/// each step of progress (so the Python side does the work), then a
/// `ferry-projection` joins them (eager, so the group shares the `range`
/// assignor) and is SIGKILLed once, while more records and a republished
/// slice arrive (the same effect keys at later offsets, as a relay's restart
/// republishes). No member dies on its own; every effect key is applied
/// exactly once, whoever applied it, and the offsets stored with the
/// effects reach the log end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_and_rust_members_apply_every_effect_once_under_sigkills() {
    const N: usize = 3_000;
    const PARTITIONS: i32 = 4;
    let broker = Kafka::start();
    broker.create_topic("py", PARTITIONS);
    let (ferry, url) = pg().await;
    let brokers = broker.brokers();
    let p = producer(&brokers);
    let group = "py-mixed";
    produce_keyed(&p, "py", 0, N / 2).await;
    let mut pythons = vec![
        python_member(&url, &brokers, group, "py"),
        python_member(&url, &brokers, group, "py"),
    ];
    let ledger = format!("SELECT count(*) FROM consumer_ledger WHERE group_id = '{group}'");
    let mut rust = None;
    for (step, at) in [200, 500, 800, 1_300, 1_800, 2_300].into_iter().enumerate() {
        until_at_least(&ferry, &ledger, at, Duration::from_secs(120)).await;
        for m in &mut pythons {
            m.assert_running();
        }
        match step {
            // Up to here the Python members alone applied the effects.
            2 => {
                rust = Some(projection_with(&url, &brokers, group, "py", None, "eager"));
                // The second half, and a republished slice of the first.
                produce_keyed(&p, "py", N / 2, N).await;
                produce_keyed(&p, "py", 0, 300).await;
            }
            4 => {
                let mut killed = rust.take().expect("the Rust member runs");
                killed.assert_running();
                killed.sigkill();
                rust = Some(projection_with(&url, &brokers, group, "py", None, "eager"));
            }
            _ => {
                pythons.remove(step % pythons.len()).sigkill();
                pythons.push(python_member(&url, &brokers, group, "py"));
            }
        }
    }
    until_at_least(&ferry, &ledger, N as i64, Duration::from_secs(120)).await;
    let probe: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("group.id", group)
        .create()
        .unwrap();
    let mut high = HashMap::new();
    for partition in 0..PARTITIONS {
        let (_, h) =
            tokio::task::block_in_place(|| probe.fetch_watermarks("py", partition, Duration::from_secs(10))).unwrap();
        high.insert(partition, h);
    }
    assert_eq!(high.values().sum::<i64>(), (N + 300) as i64);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let stored: Vec<(i32, Option<i64>)> =
            sqlx::query_as("SELECT partition, next_offset FROM consumer_partitions WHERE group_id = $1")
                .bind(group)
                .fetch_all(ferry.db().as_postgres().unwrap())
                .await
                .unwrap();
        let stored: HashMap<i32, i64> = stored.into_iter().filter_map(|(p, o)| Some((p, o?))).collect();
        if stored == high {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "stored offsets {stored:?} short of the log end {high:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut rust = rust.expect("the Rust member runs");
    rust.assert_running();
    rust.terminate();
    for mut m in pythons {
        m.assert_running();
        m.terminate();
    }
    assert_eq!(
        scalar(&ferry, "SELECT count(*) FROM ferry_projection_applied").await,
        N as i64,
        "every effect applied"
    );
    assert_eq!(
        scalar(&ferry, "SELECT max(applied) FROM ferry_projection_applied").await,
        1,
        "every effect key applied exactly once"
    );
}
