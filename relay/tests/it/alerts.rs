//! The alert rules against a real Prometheus: Debian's `prometheus` server
//! (installed with `promtool` by `scripts/check-prometheus`, which the test
//! command runs before `cargo test`) scrapes a running relay and evaluates
//! a copy of `deploy/prometheus/ferry-rules.yaml`; the test reads the
//! alert's state through Prometheus's HTTP API. Nothing is mocked: the
//! relay, PostgreSQL, the Kafka broker and Prometheus are the real ones.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ferry::{Clock, Ferry, Millis, OutboxMessage};
use ferry_relay::Capture;
use ferry_testkit::Kafka;
use serde_json::{json, Value};

use crate::support::*;

/// The rules as shipped.
const RULES: &str = include_str!("../../../deploy/prometheus/ferry-rules.yaml");

/// The alert under test.
const BACKLOG_OLD: &str = "FerryOutboxBacklogOld";

/// The Prometheus job that scrapes the relay.
const JOB: &str = "ferry-relay";

/// How old the arriving rows are: past the rule's 300 s threshold.
const ROW_AGE: Duration = Duration::from_secs(600);

/// `FerryOutboxBacklogOld` goes from inactive to firing in a real Prometheus
/// that scrapes a WAL capture relay (the default on PostgreSQL; the gauge
/// is the same in poll capture) every second, once the broker is stopped
/// and rows arrive that the relay cannot publish; it resolves when the
/// broker is back and the rows are delivered.
///
/// The rule file is the shipped one with only `FerryOutboxBacklogOld`'s
/// `for:` shortened (5m to 3s); its expression, threshold (300 s) included,
/// and every other rule are kept byte for byte. The threshold is crossed
/// honestly rather than waited for: the relay computes
/// `ferry_relay_oldest_pending_age_seconds` from the oldest pending row's
/// `created_at` against the database clock, and the rows are enqueued
/// through the library by a writer whose injected clock (`Clock::manual`)
/// stands 10 minutes behind the database's, as rows committed 10 minutes
/// ago would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backlog_alert_fires_in_prometheus_while_the_broker_is_down() {
    let rules = with_hold(RULES, BACKLOG_OLD, "3s");
    Prometheus::require();
    let mut broker = Kafka::start_own();
    broker.create_topic("orders", 3);
    let (ferry, url) = pg_ferry().await;
    let (cfg, guard) = config_for(Capture::Wal, &url, &broker.brokers()).await;
    let relay = guard.start(cfg, ferry.clone()).await;

    // Healthy: ready, and a fresh row reaches the broker.
    readyz_until(&relay, "200", Duration::from_secs(60)).await;
    enqueue(&ferry, 0).await;
    wait_for_count(&ferry, &DELIVERED, 1, Duration::from_secs(60)).await;

    let prometheus = Prometheus::start(relay.addr, &rules).await;
    // Scraped: the target is up and the gauge is stored.
    prometheus
        .until_query(&format!("up{{job=\"{JOB}\"}}"), "the relay scraped (up == 1)", |r| {
            r.iter().any(|s| s["value"][1] == "1")
        })
        .await;
    prometheus
        .until_query("ferry_relay_oldest_pending_age_seconds", "the age gauge stored", |r| {
            !r.is_empty()
        })
        .await;
    // Two evaluations later, the rule has been evaluated on the scraped
    // gauge: the first may have started before the gauge was stored, the
    // second starts after the first ended.
    let seen = prometheus.rule(BACKLOG_OLD).await;
    assert_eq!(seen["duration"], 3, "the derived rule holds for 3 s: {seen}");
    let first = prometheus
        .until_rule("an evaluation", |r| r["lastEvaluation"] != seen["lastEvaluation"])
        .await;
    let second = prometheus
        .until_rule("a second evaluation", |r| {
            r["lastEvaluation"] != first["lastEvaluation"]
        })
        .await;
    assert_eq!(
        (&second["health"], &second["state"]),
        (&json!("ok"), &json!("inactive")),
        "healthy relay, broker up: the alert is inactive: {second}"
    );

    // The broker stops while rows arrive: they stay pending.
    tokio::task::block_in_place(|| broker.stop());
    let writer = Ferry::builder(&url)
        .clock(Clock::manual(
            Millis::new(db_now_ms(&ferry).await - ROW_AGE.as_millis() as i64).unwrap(),
        ))
        .connect()
        .await
        .unwrap();
    for i in 1..=5 {
        enqueue(&writer, i).await;
    }
    let down = Instant::now();
    let firing = prometheus
        .until_rule("the alert firing", |r| r["state"] == "firing")
        .await;
    assert_eq!(
        scalar(
            &ferry,
            &format!("SELECT count(*) FROM {OUTBOX} WHERE state = 'pending'")
        )
        .await,
        5,
        "the arriving rows wait for the broker"
    );
    let alert = &firing["alerts"][0];
    assert_eq!(alert["labels"]["severity"], "page", "{firing}");
    assert_eq!(
        alert["annotations"]["runbook_url"], "docs/runbook.md#outbox-backlog-old",
        "{firing}"
    );
    eprintln!(
        "{BACKLOG_OLD} firing {:?} after the rows arrived (oldest pending age {})",
        down.elapsed(),
        alert["value"]
    );

    // The broker is back: the rows are delivered and the alert resolves.
    tokio::task::block_in_place(|| broker.restart());
    wait_for_count(&ferry, &DELIVERED, 6, Duration::from_secs(120)).await;
    prometheus
        .until_rule("the alert resolved", |r| r["state"] == "inactive")
        .await;
    relay.shutdown().await;
}

/// Enqueues row `i` of the `orders` topic through `ferry` (and its clock).
async fn enqueue(ferry: &Ferry, i: usize) {
    let msg = OutboxMessage::json("acme", "orders", format!("key-{i}"), &json!({ "i": i })).unwrap();
    ferry.enqueue(&msg).await.unwrap();
}

/// The database clock, in ms since the Unix epoch.
async fn db_now_ms(ferry: &Ferry) -> i64 {
    scalar(ferry, "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint").await
}

/// `rules` with the `for:` of alert `alert` set to `hold`, every other
/// byte kept (the alert's expression, the other rules). Panics when the
/// alert or its `for:` is not found once.
fn with_hold(rules: &str, alert: &str, hold: &str) -> String {
    let header = format!("- alert: {alert}");
    let mut out = Vec::new();
    let mut in_alert = false;
    let mut replaced = 0;
    for line in rules.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("- ") {
            in_alert = trimmed == header;
        }
        if in_alert && trimmed.starts_with("for:") {
            let indent = &line[..line.len() - trimmed.len()];
            out.push(format!("{indent}for: {hold}"));
            replaced += 1;
        } else {
            out.push(line.to_owned());
        }
    }
    assert_eq!(
        replaced, 1,
        "deploy/prometheus/ferry-rules.yaml: expected one `for:` in alert {alert}"
    );
    out.join("\n") + "\n"
}

/// How long Prometheus may take to start, scrape, or change an alert's
/// state (a bound, not a synchronization).
const PROMETHEUS_WITHIN: Duration = Duration::from_secs(90);

/// A `prometheus` server of the test's own: a temporary storage directory, a
/// free loopback port, one job scraping the relay every second, rules
/// evaluated every second. Killed, and its directory removed, on drop (also
/// when the test fails).
struct Prometheus {
    child: Child,
    dir: PathBuf,
    addr: SocketAddr,
}

impl Prometheus {
    /// Fails (never skips) when the `prometheus` binary is missing.
    fn require() {
        if let Err(e) = Command::new("prometheus")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
        {
            panic!(
                "the prometheus server binary is required and could not be run ({e}): \
                 run scripts/check-prometheus (it installs Debian's prometheus package)"
            );
        }
    }

    /// Starts a server scraping `relay` with `rules` as its rule file, and
    /// waits until it is ready.
    async fn start(relay: SocketAddr, rules: &str) -> Prometheus {
        let dir = std::env::temp_dir().join(format!("ferry-prometheus-{}", uuid::Uuid::now_v7().simple()));
        std::fs::create_dir_all(&dir).expect("prometheus temp dir");
        std::fs::write(dir.join("rules.yaml"), rules).expect("rules.yaml");
        let config = format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n  - {rules}\n\
             scrape_configs:\n  - job_name: {JOB}\n    static_configs:\n      - targets: ['{relay}']\n",
            rules = dir.join("rules.yaml").display()
        );
        std::fs::write(dir.join("prometheus.yml"), config).expect("prometheus.yml");
        let addr: SocketAddr = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free loopback port");
        let log = std::fs::File::create(dir.join("prometheus.log")).expect("prometheus.log");
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", dir.join("prometheus.yml").display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
            .arg(format!("--web.listen-address={addr}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("could not start prometheus ({e}): run scripts/check-prometheus"));
        let mut prometheus = Prometheus { child, dir, addr };
        let deadline = Instant::now() + PROMETHEUS_WITHIN;
        loop {
            if let Ok(Some(status)) = prometheus.child.try_wait() {
                panic!("prometheus exited ({status}): {}", prometheus.log_tail());
            }
            if tokio::net::TcpStream::connect(addr).await.is_ok() && http_get(addr, "/-/ready").await.0.contains("200")
            {
                return prometheus;
            }
            assert!(
                Instant::now() < deadline,
                "prometheus not ready after {PROMETHEUS_WITHIN:?}: {}",
                prometheus.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The last lines of the server's log, for failure messages.
    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("prometheus.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// GETs `path` of the HTTP API and returns its `data`; fails on an
    /// error answer.
    async fn api(&self, path: &str) -> Value {
        let (status, body) = http_get(self.addr, path).await;
        let answer: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("GET {path}: {status}: {e}: {body}"));
        assert_eq!(answer["status"], "success", "GET {path}: {status}: {body}");
        answer["data"].clone()
    }

    /// Alerting rule `name` as `/api/v1/rules` reports it (state, health,
    /// last evaluation, active alerts).
    async fn rule(&self, name: &str) -> Value {
        let data = self.api("/api/v1/rules?type=alert").await;
        data["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["rules"].as_array().into_iter().flatten())
            .find(|r| r["name"] == name)
            .unwrap_or_else(|| panic!("no alerting rule {name} loaded: {data}"))
            .clone()
    }

    /// Polls rule [`BACKLOG_OLD`] until `done` holds for it (`what`), within
    /// [`PROMETHEUS_WITHIN`]; returns it.
    async fn until_rule(&self, what: &str, done: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + PROMETHEUS_WITHIN;
        loop {
            let rule = self.rule(BACKLOG_OLD).await;
            if done(&rule) {
                return rule;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: not seen within {PROMETHEUS_WITHIN:?}; {BACKLOG_OLD} is {rule}\nprometheus log:\n{}",
                self.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Polls the instant query `query` until `done` holds for its result
    /// vector (`what`), within [`PROMETHEUS_WITHIN`].
    async fn until_query(&self, query: &str, what: &str, done: impl Fn(&[Value]) -> bool) {
        let path = format!(
            "/api/v1/query?query={}",
            percent_encoding::utf8_percent_encode(query, percent_encoding::NON_ALPHANUMERIC)
        );
        let deadline = Instant::now() + PROMETHEUS_WITHIN;
        loop {
            let data = self.api(&path).await;
            if done(data["result"].as_array().map(Vec::as_slice).unwrap_or_default()) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: not seen within {PROMETHEUS_WITHIN:?}; {query} is {data}\nprometheus log:\n{}",
                self.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
