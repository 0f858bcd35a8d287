//! `ferry demo`: the main job end to end on embedded defaults — a SQLite
//! file and rdkafka's in-process mock cluster — or on `--database-url` and
//! `--brokers` when given. It accepts a stream of runs (some duplicate POSTs,
//! one key reused with another body) and domain events, relays the outbox,
//! reads the topics back with a plain consumer, prints a summary, and exits
//! non-zero if anything was lost.
#![allow(clippy::print_stdout)]

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use ferry::{Ferry, NewRun, OutboxMessage};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::mocking::MockCluster;
use rdkafka::ClientConfig;
use serde_json::json;

use ferry_consumer::{Handler, HandlerError, Record};
use futures::future::BoxFuture;

use ferry_relay::config::RelayConfig;
use ferry_relay::error::RelayError;

/// Demo settings.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Database URL (default: a fresh SQLite file).
    #[arg(long, env = "DATABASE_URL")]
    pub database_url: Option<String>,
    /// Kafka brokers (default: rdkafka's in-process mock cluster).
    #[arg(long)]
    pub brokers: Option<String>,
    /// Runs to accept.
    #[arg(long, default_value_t = 2000)]
    pub runs: usize,
    /// How long to wait for every record to come back.
    #[arg(long, value_parser = ferry::time::parse_duration, default_value = "60s")]
    pub timeout: Duration,
}

const EVENTS: &str = "ferry.run-events";
const ORDERS: &str = "demo.orders";
const TENANTS: [&str; 3] = ["acme", "globex", "initech"];

/// The demo consumer's effect: a per-key projection of order events.
struct Projection;

const PROJECT: &str = "INSERT INTO demo_projection (key, events) VALUES ($1, 1)
    ON CONFLICT (key) DO UPDATE SET events = demo_projection.events + 1";

impl Handler for Projection {
    fn handle<'a>(&'a self, r: &'a Record, tx: &'a mut ferry::Tx) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            let key = String::from_utf8_lossy(r.key.as_deref().unwrap_or_default()).into_owned();
            tx.execute(PROJECT, &[ferry::store::Arg::from(&key)]).await?;
            Ok(())
        })
    }
}

async fn exec(ferry: &Ferry, sql: &str) -> Result<(), RelayError> {
    ferry.db().execute_raw(sql).await.map(drop).map_err(RelayError::Ferry)
}

/// Runs the demo.
pub async fn run(args: DemoArgs) -> Result<(), RelayError> {
    let mock;
    let brokers = match &args.brokers {
        Some(b) => b.clone(),
        None => {
            mock = MockCluster::new(3)?;
            for t in [EVENTS, ORDERS] {
                mock.create_topic(t, 6, 1)?;
            }
            mock.bootstrap_servers()
        }
    };
    if args.brokers.is_some() {
        create_topics(&brokers).await?;
    }
    let dir = std::env::temp_dir().join(format!("ferry-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let url = args
        .database_url
        .clone()
        .unwrap_or_else(|| format!("sqlite://{}", dir.join("ferry.db").display()));
    let ferry = Ferry::builder(&url).migrate(true).connect().await?;
    println!(
        "ferry demo: database {url}, brokers {}",
        if args.brokers.is_some() {
            brokers.as_str()
        } else {
            "in-process mock cluster"
        }
    );

    // The relay runs while the service accepts, as a sidecar would.
    let mut cfg = RelayConfig::new(&url, &brokers);
    // Polling: a demo leaves no replication slot behind in the database.
    cfg.capture = Some(ferry_relay::Capture::Poll);
    cfg.poll_interval = Duration::from_millis(50);
    cfg.lease = Duration::from_secs(3);
    let relay = ferry_relay::service::Relay::new(cfg, ferry.clone())?;
    let state = relay.state();
    let stop = tokio_util::sync::CancellationToken::new();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let stopped = stop.clone();
    let running = tokio::spawn(relay.run(listener, async move { stopped.cancelled().await }));
    exec(
        &ferry,
        "CREATE TABLE IF NOT EXISTS demo_projection (key TEXT PRIMARY KEY, events BIGINT NOT NULL)",
    )
    .await?;
    let consumer_app = ferry_consumer::Consumer::builder(
        ferry.clone(),
        &brokers,
        format!("ferry-demo-projection-{}", uuid::Uuid::now_v7().simple()),
        &[ORDERS],
    )
    .handler(Projection)
    .kafka("session.timeout.ms", "6000")
    .build()
    .map_err(|e| RelayError::Config(e.to_string()))?;
    let consumer_metrics = consumer_app.metrics();
    let consumer_stop = tokio_util::sync::CancellationToken::new();
    let cs = consumer_stop.clone();
    let consuming = tokio::spawn(consumer_app.run(async move { cs.cancelled().await }));

    // Accept runs and domain events, like a service behind an HTTP endpoint would.
    let bar = indicatif::ProgressBar::new(args.runs as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg:>10} {bar:40} {pos}/{len}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_message("accepting");
    let (mut accepted, mut replays, mut conflicts) = (0u64, 0u64, 0u64);
    for i in 0..args.runs {
        let tenant = TENANTS[i % TENANTS.len()];
        let run = NewRun::new(
            tenant,
            "charge",
            format!("order-{i}"),
            json!({"amount": 100 + i, "currency": "EUR"}),
        );
        let tries = if i % 5 == 0 { 2 } else { 1 };
        for _ in 0..tries {
            let mut tx = ferry.begin().await?;
            let a = ferry.create_run_idempotent_in(tx.conn(), run.clone()).await?;
            if a.replay {
                replays += 1;
                tx.rollback().await?;
            } else {
                accepted += 1;
                let event = OutboxMessage::json(
                    tenant,
                    ORDERS,
                    format!("order-{i}"),
                    &json!({"order": i, "status": "placed"}),
                )
                .map_err(RelayError::Ferry)?;
                ferry.enqueue_in(tx.conn(), &event).await?;
                tx.commit().await?;
            }
        }
        bar.inc(1);
    }
    let reused = NewRun::new("acme", "charge", "order-0", json!({"amount": 1, "currency": "EUR"}));
    match ferry.create_run_idempotent(reused).await {
        Err(ferry::Error::IdempotencyConflict { .. }) => conflicts += 1,
        other => {
            return Err(RelayError::Lost(format!(
                "expected an idempotency conflict, got {other:?}"
            )))
        }
    }
    // Every accepted run wrote its run_queued event and one order event.
    let expected = accepted * 2;
    bar.finish_and_clear();

    // Read everything back.
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("group.id", format!("ferry-demo-{}", uuid::Uuid::now_v7().simple()))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .create()?;
    consumer.subscribe(&[EVENTS, ORDERS])?;
    let bar = indicatif::ProgressBar::new(expected);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg:>10} {bar:40} {pos}/{len}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_message("relaying");
    let mut seen: HashSet<String> = HashSet::new();
    let mut read = 0u64;
    let mut per_topic: HashMap<String, u64> = HashMap::new();
    let started = Instant::now();
    while (seen.len() as u64) < expected && started.elapsed() < args.timeout {
        let msg = tokio::task::block_in_place(|| consumer.poll(Duration::from_millis(100)));
        match msg {
            Some(Ok(m)) => {
                read += 1;
                *per_topic.entry(m.topic().to_owned()).or_default() += 1;
                let id = m.headers().and_then(|h| {
                    h.iter()
                        .find(|h| h.key == "ferry-outbox-id")
                        .and_then(|h| h.value.map(|v| String::from_utf8_lossy(v).into_owned()))
                });
                if let Some(id) = id {
                    seen.insert(id);
                }
                bar.set_position(seen.len() as u64);
            }
            Some(Err(e)) => tracing::warn!(error = %e, "consumer error"),
            None => {}
        }
    }
    bar.finish_and_clear();
    let m = &state.metrics;
    let (p50, p99) = (
        m.latency_quantile(0.5).unwrap_or(0),
        m.latency_quantile(0.99).unwrap_or(0),
    );
    // A relay crash after publishing but before marking republishes rows:
    // simulate it for 50 order rows; the consumer's ledger must skip them.
    let replayed = 50.min(accepted);
    exec(&ferry, &format!("UPDATE outbox SET state = 'pending' WHERE id IN (SELECT id FROM outbox WHERE topic = '{ORDERS}' ORDER BY id LIMIT {replayed})")).await?;
    let orders = accepted;
    let waited = Instant::now();
    while consumer_metrics.processed.get() < orders || consumer_metrics.duplicates.get() < replayed {
        if waited.elapsed() > args.timeout {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    consumer_stop.cancel();
    consuming
        .await
        .map_err(|e| RelayError::Config(e.to_string()))?
        .map_err(|e| RelayError::Config(e.to_string()))?;
    stop.cancel();
    running.await.map_err(|e| RelayError::Config(e.to_string()))??;
    let published = m.published.get();
    println!("runs accepted        {accepted}");
    println!("replays collapsed    {replays}");
    println!("conflicts rejected   {conflicts}");
    println!("outbox rows          {expected}");
    println!("rows published       {published}");
    println!(
        "records read back    {read} ({})",
        per_topic
            .iter()
            .map(|(t, n)| format!("{t}: {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!("distinct rows read   {}", seen.len());
    println!("duplicates           {}", read.saturating_sub(seen.len() as u64));
    println!("commit → ack         p50 {p50} ms, p99 {p99} ms");
    println!(
        "effects applied      {} (per-key projection, one per order event)",
        consumer_metrics.processed.get()
    );
    println!(
        "duplicates skipped   {} (of {replayed} republished rows)",
        consumer_metrics.duplicates.get()
    );
    if consumer_metrics.processed.get() < orders {
        return Err(RelayError::Lost(format!(
            "the consumer applied {} of {orders} order events",
            consumer_metrics.processed.get()
        )));
    }
    if (seen.len() as u64) < expected {
        return Err(RelayError::Lost(format!(
            "lost {} of {expected} rows",
            expected - seen.len() as u64
        )));
    }
    println!("nothing lost");
    Ok(())
}

async fn create_topics(brokers: &str) -> Result<(), RelayError> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new().set("bootstrap.servers", brokers).create()?;
    let topics = [
        NewTopic::new(EVENTS, 6, TopicReplication::Fixed(1)),
        NewTopic::new(ORDERS, 6, TopicReplication::Fixed(1)),
    ];
    // Existing topics are fine.
    let _ = admin.create_topics(&topics, &AdminOptions::new()).await?;
    Ok(())
}
