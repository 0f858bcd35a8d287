//! Browser tests on PostgreSQL (the console's queries are the same on both
//! engines and the HTTP tests cover SQLite; the relay that delivers the
//! replayed row runs against PostgreSQL in production): headless Chromium
//! driven through chromedriver (Debian's `chromium` and `chromium-driver`,
//! installed by `scripts/setup-chromium`). A missing chromedriver or
//! Chromium fails the test, naming what to install. Screenshots of every
//! page go to `<target>/console-screenshots/`.

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use ferry::Engine;
use ferry_console::{Console, ConsoleConfig};
use ferry_relay::store::RelayStore;
use ferry_relay::{Relay, RelayConfig};
use ferry_testkit::{Kafka, TestDb};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::ClientConfig;
use tokio_util::sync::CancellationToken;

use crate::support::*;

/// A chromedriver child in its own process group; the group (chromedriver
/// and the Chromium it started) is killed when dropped, also when the test
/// fails before closing its session.
struct Chromedriver {
    child: Child,
    url: String,
}

impl Drop for Chromedriver {
    fn drop(&mut self) {
        let group = format!("-{}", self.child.id());
        let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn find(env: &str, names: &[&str]) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(env) {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .flat_map(|dir| names.iter().map(move |n| dir.join(n)))
        .find(|p| p.is_file())
}

impl Chromedriver {
    /// Starts chromedriver on a free loopback port and waits for its
    /// "started successfully" line.
    fn start() -> Chromedriver {
        let bin = find("FERRY_CHROMEDRIVER", &["chromedriver"]).unwrap_or_else(|| {
            panic!("chromedriver is missing: run scripts/setup-chromium (apt-get install chromium chromium-driver) or set FERRY_CHROMEDRIVER")
        });
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let mut child = Command::new(&bin)
            .process_group(0)
            .arg(format!("--port={port}"))
            .arg("--allowed-ips=127.0.0.1")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
        let out = child.stdout.take().expect("piped stdout");
        let mut lines = BufReader::new(out).lines();
        let started = lines
            .by_ref()
            .take(20)
            .map_while(Result::ok)
            .any(|l| l.contains("started successfully"));
        assert!(started, "chromedriver ({}) did not report a start", bin.display());
        // Keep draining its output so it never blocks on a full pipe.
        std::thread::spawn(move || lines.for_each(drop));
        Chromedriver {
            child,
            url: format!("http://127.0.0.1:{port}"),
        }
    }
}

async fn browser(driver: &Chromedriver) -> Client {
    let chromium = find("FERRY_CHROMIUM", &["chromium", "chromium-browser", "google-chrome"]).unwrap_or_else(|| {
        panic!("Chromium is missing: run scripts/setup-chromium (apt-get install chromium chromium-driver) or set FERRY_CHROMIUM")
    });
    let caps = serde_json::json!({
        "browserName": "chrome",
        "goog:chromeOptions": {
            "binary": chromium,
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1400,1300", "--hide-scrollbars"]
        }
    });
    let serde_json::Value::Object(caps) = caps else {
        unreachable!()
    };
    ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
        .capabilities(caps)
        .connect(&driver.url)
        .await
        .unwrap_or_else(|e| panic!("cannot open a Chromium session through chromedriver: {e}"))
}

fn screenshot_dir() -> PathBuf {
    // The cargo target dir (CARGO_TARGET_DIR, else the workspace's target/).
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../target")));
    let dir = target.join("console-screenshots");
    std::fs::create_dir_all(&dir).expect("create the screenshot dir");
    dir
}

async fn shot(c: &Client, name: &str) {
    let png = c.screenshot().await.expect("screenshot");
    assert!(png.starts_with(b"\x89PNG"), "{name} is a PNG");
    std::fs::write(screenshot_dir().join(format!("{name}.png")), png).expect("write the screenshot");
}

/// The element, once the page that has it has loaded (a click that submits a
/// form returns before the next page is there).
async fn element(c: &Client, css: &str) -> fantoccini::elements::Element {
    c.wait()
        .at_most(Duration::from_secs(20))
        .for_element(Locator::Css(css))
        .await
        .unwrap_or_else(|e| panic!("no {css}: {e}"))
}

async fn text(c: &Client, css: &str) -> String {
    element(c, css).await.text().await.unwrap().trim().to_owned()
}

async fn fill(c: &Client, css: &str, value: &str) {
    let e = c
        .find(Locator::Css(css))
        .await
        .unwrap_or_else(|e| panic!("no {css}: {e}"));
    e.clear().await.unwrap();
    e.send_keys(value).await.unwrap();
}

async fn click(c: &Client, css: &str) {
    element(c, css).await.click().await.unwrap();
}

/// Accept the console's confirmation prompts (console.js) without a dialog.
async fn no_prompts(c: &Client) {
    c.execute("window.confirm = function () { return true; };", vec![])
        .await
        .unwrap();
}

async fn sign_in(c: &Client, base: &str, token: &str) {
    c.goto(&format!("{base}/")).await.unwrap();
    assert!(
        c.current_url().await.unwrap().path().ends_with("/login"),
        "a fresh browser is sent to the login page"
    );
    fill(c, "#token", token).await;
    click(c, "#sign-in").await;
    element(c, "#actor").await;
    let url = c.current_url().await.unwrap();
    assert_eq!(
        url.path(),
        "/",
        "signing in failed: {}",
        c.source().await.unwrap_or_default()
    );
}

/// How many `<code>` elements on the page are drawn (have a width) with no
/// text: the grey boxes empty error cells showed.
async fn blank_codes(c: &Client) -> i64 {
    c.execute(
        "return Array.from(document.querySelectorAll('code')).filter(function (e) { \
           return e.textContent.trim() === '' && e.getBoundingClientRect().width > 0; }).length;",
        vec![],
    )
    .await
    .unwrap()
    .as_i64()
    .expect("a count")
}

async fn scalar(db: &TestDb, sql: &str) -> i64 {
    db.scalar(sql).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_finds_a_run_replays_a_dead_row_and_sees_it_delivered() {
    let driver = Chromedriver::start();
    let db = TestDb::new(Engine::Postgres).await;
    let s = seed(&db.ferry).await;
    // The row to replay is a run event: acme's second run's run_queued row,
    // dead with a publish error, so its lineage shows where it went.
    let run = s.acme_runs[1];
    let row = scalar(&db, &format!("SELECT min(id) FROM outbox WHERE key = '{run}'")).await;
    let store = RelayStore::new(db.ferry.clone());
    let leases = store
        .acquire_lanes("seeder", Duration::from_secs(30), 1024)
        .await
        .unwrap();
    let lane = scalar(
        &db,
        &format!("SELECT CAST(lane AS BIGINT) FROM outbox WHERE id = {row}"),
    )
    .await;
    let lease = *leases.iter().find(|l| i64::from(l.lane) == lane).unwrap();
    store
        .mark_dead("seeder", lease, row, "request_timed_out")
        .await
        .unwrap();
    for l in leases {
        store.release_lane("seeder", l).await.unwrap();
    }

    // Consumer group `projection` commits one row and dead-letters another.
    let first_pending = scalar(&db, "SELECT min(id) FROM outbox WHERE state = 'pending'").await;
    let last_pending = scalar(&db, "SELECT max(id) FROM outbox WHERE state = 'pending'").await;
    consume(&db.ferry, "projection", &[first_pending]).await;
    dead_letter(&db.ferry, "projection", last_pending, 1).await;

    let console = Console::new(db.ferry.clone(), ConsoleConfig::new(tokens())).unwrap();
    console.sample().await.unwrap();
    console.sample().await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let stop = CancellationToken::new();
    let served = tokio::spawn({
        let stop = stop.clone();
        console.serve(listener, async move { stop.cancelled().await })
    });
    let c = browser(&driver).await;

    // The login page, then the overview with the database's figures.
    c.goto(&format!("{base}/")).await.unwrap();
    shot(&c, "login").await;
    sign_in(&c, &base, ROOT).await;
    let pending = scalar(&db, "SELECT count(*) FROM outbox WHERE state = 'pending'").await;
    let dead = scalar(&db, "SELECT count(*) FROM outbox WHERE state = 'dead'").await;
    assert_eq!(text(&c, "#pending-total").await, pending.to_string());
    assert_eq!(text(&c, "#dead-total").await, dead.to_string());
    assert_eq!(text(&c, "#actor").await, "root-ops");
    for (queue, state) in [("payments", "queued"), ("payments", "dead"), ("default", "queued")] {
        let n = scalar(
            &db,
            &format!("SELECT count(*) FROM jobs WHERE queue = '{queue}' AND state = '{state}'"),
        )
        .await;
        assert_eq!(
            text(&c, &format!("#jobs-{queue}-{state}")).await,
            n.to_string(),
            "{queue}/{state}"
        );
    }
    // The plot has its axes, their units and a legend.
    c.find(Locator::Css("svg#plot")).await.expect("the backlog plot");
    let ticks = c.find_all(Locator::Css("#plot .x-axis .tick")).await.unwrap();
    let newest = ticks.last().expect("time ticks");
    assert_eq!(newest.text().await.unwrap(), "now");
    assert_eq!(text(&c, "#plot .y-axis.left .title").await, "pending rows");
    assert_eq!(text(&c, "#plot .y-axis.right .title").await, "delivered/s");
    let legend = text(&c, "#plot .legend").await;
    assert!(
        legend.contains("pending rows (left)") && legend.contains("delivered/s (right)"),
        "{legend}"
    );
    // No relay holds a lane: one row for all 64; a lane's backlog is one
    // click away.
    let groups = c.find_all(Locator::Css("#lanes tr.lane-group")).await.unwrap();
    assert_eq!(groups.len(), 1, "one row for the unowned lanes");
    assert_eq!(text(&c, "#lanes-unowned summary").await, "0–63");
    let lane = scalar(
        &db,
        "SELECT CAST(min(lane) AS BIGINT) FROM outbox WHERE state = 'pending'",
    )
    .await;
    let in_lane = scalar(
        &db,
        &format!("SELECT count(*) FROM outbox WHERE state = 'pending' AND lane = {lane}"),
    )
    .await;
    let cell = format!("#lane-{lane} .pending");
    assert_eq!(text(&c, &cell).await, "", "closed until asked for");
    click(&c, "#lanes-unowned summary").await;
    assert_eq!(text(&c, &cell).await, in_lane.to_string());
    // The consumer group, with what the database knows of it.
    let group = r#"tr.consumer-group[data-group="projection"]"#;
    assert_eq!(text(&c, &format!("{group} .owners")).await, "consumer-1 (1)");
    assert_eq!(text(&c, &format!("{group} .dead-letters")).await, "1");
    assert!(text(&c, &format!("{group} .last-commit")).await.ends_with(" ago"));
    assert!(text(&c, "#lag-note").await.contains("ferry_consumer_lag"));
    assert_eq!(blank_codes(&c).await, 0, "overview");
    shot(&c, "overview").await;

    // Find the run by its idempotency key and open its lineage.
    c.goto(&format!("{base}/runs?tenant=acme")).await.unwrap();
    element(&c, "a.run-link").await;
    assert_eq!(blank_codes(&c).await, 0, "runs without an error draw no code box");
    c.goto(&format!("{base}/runs")).await.unwrap();
    shot(&c, "runs").await;
    fill(&c, "#key-search input[name=tenant]", "acme").await;
    fill(&c, "#key", "order-2").await;
    click(&c, "#find-by-key").await;
    assert_eq!(text(&c, "#key-hash").await, ferry::redact("order-2"));
    assert!(
        !c.source().await.unwrap().contains("order-2"),
        "the key is never shown in clear"
    );
    shot(&c, "runs-by-key").await;
    click(&c, "#key-runs a.run-link").await;
    assert_eq!(text(&c, "#run-id").await, run.to_string());
    assert_eq!(text(&c, &format!("#outbox-{row} .outbox-state")).await, "dead");
    assert_eq!(blank_codes(&c).await, 0, "lineage");
    shot(&c, "lineage").await;

    // An action without its CSRF token is refused and changes nothing.
    c.goto(&format!("{base}/dead")).await.unwrap();
    shot(&c, "dead").await;
    no_prompts(&c).await;
    c.execute(
        "document.querySelectorAll('form input[name=csrf]').forEach(function (e) { e.remove(); });",
        vec![],
    )
    .await
    .unwrap();
    let form = format!("#dead-row-{row} form");
    fill(&c, &format!("{form} input[name=reason]"), "retry after the broker fix").await;
    click(&c, &format!("#replay-row-{row}")).await;
    assert_eq!(text(&c, "#error-code").await, "csrf");
    shot(&c, "refused-csrf").await;
    // Without any token (the session cookie gone), the action is refused too.
    c.goto(&format!("{base}/dead")).await.unwrap();
    no_prompts(&c).await;
    c.delete_all_cookies().await.unwrap();
    fill(&c, &format!("{form} input[name=reason]"), "retry after the broker fix").await;
    click(&c, &format!("#replay-row-{row}")).await;
    assert_eq!(text(&c, "#error-code").await, "unauthorized");
    shot(&c, "refused-no-token").await;
    let still_dead = format!("SELECT count(*) FROM outbox WHERE id = {row} AND state = 'dead'");
    assert_eq!(scalar(&db, &still_dead).await, 1);
    assert_eq!(scalar(&db, "SELECT count(*) FROM ferry_audit").await, 0);

    // A relay is running; the operator replays the row and sees it delivered.
    let broker = Kafka::start();
    broker.create_topic(ferry::DEFAULT_EVENTS_TOPIC, 3);
    let mut cfg = RelayConfig::new(&db.url, broker.brokers());
    // Polling: a WAL relay would leave its replication slot behind.
    cfg.capture = Some(ferry_relay::Capture::Poll);
    cfg.poll_interval = Duration::from_millis(50);
    let relay = Relay::new(cfg, db.reopen().await).unwrap();
    let relay_stop = CancellationToken::new();
    let relay_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let relaying = tokio::spawn({
        let stop = relay_stop.clone();
        relay.run(relay_listener, async move { stop.cancelled().await })
    });
    sign_in(&c, &base, ROOT).await;
    c.goto(&format!("{base}/dead")).await.unwrap();
    no_prompts(&c).await;
    fill(&c, &format!("{form} input[name=reason]"), "retry after the broker fix").await;
    click(&c, &format!("#replay-row-{row}")).await;
    assert_eq!(text(&c, "#notice").await, format!("Row {row} is pending again."));
    shot(&c, "replayed").await;
    assert_eq!(
        scalar(
            &db,
            "SELECT count(*) FROM ferry_audit WHERE actor = 'root-ops' AND reason = 'retry after the broker fix'"
        )
        .await,
        1
    );
    // The record reaches Kafka...
    let reader: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", broker.brokers())
        .set("group.id", format!("console-{}", uuid::Uuid::now_v7().simple()))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    reader.subscribe(&[ferry::DEFAULT_EVENTS_TOPIC]).unwrap();
    let start = Instant::now();
    let want = row.to_string();
    loop {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "row {row} never reached Kafka"
        );
        let m = tokio::task::block_in_place(|| reader.poll(Duration::from_millis(200)));
        let Some(Ok(m)) = m else { continue };
        let id = m.headers().and_then(|h| {
            h.iter()
                .find(|h| h.key == "ferry-outbox-id")
                .and_then(|h| h.value.map(|v| String::from_utf8_lossy(v).into_owned()))
        });
        if id.as_deref() == Some(want.as_str()) {
            break;
        }
    }
    // ...and the lineage page shows it delivered (the relay marks it after the ack).
    let lineage = format!("{base}/runs/acme/{run}");
    let start = Instant::now();
    loop {
        c.goto(&lineage).await.unwrap();
        if text(&c, &format!("#outbox-{row} .outbox-state")).await == "delivered" {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "row {row} was never marked delivered"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    shot(&c, "lineage-delivered").await;
    c.goto(&format!("{base}/")).await.unwrap();
    assert_eq!(text(&c, "#relays-alive").await, "1");
    // The README's screenshot (docs/console-overview.png) comes from this
    // one: a modest window, tall enough for the consumer groups.
    c.set_window_size(1100, 1480).await.unwrap();
    element(&c, "#consumer-groups").await;
    shot(&c, "overview-with-relay").await;

    c.close().await.unwrap();
    relay_stop.cancel();
    relaying.await.unwrap().unwrap();
    stop.cancel();
    served.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scoped_operator_sees_only_its_tenant_and_no_payloads() {
    let driver = Chromedriver::start();
    let db = TestDb::new(Engine::Postgres).await;
    let s = seed(&db.ferry).await;
    let console = Console::new(db.ferry.clone(), ConsoleConfig::new(tokens())).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let stop = CancellationToken::new();
    let served = tokio::spawn({
        let stop = stop.clone();
        console.serve(listener, async move { stop.cancelled().await })
    });
    let c = browser(&driver).await;
    sign_in(&c, &base, ACME).await;
    assert_eq!(text(&c, "#dead-total").await, "2", "acme's dead rows only");
    c.goto(&format!("{base}/runs/acme/{}", s.acme_runs[0])).await.unwrap();
    let page = c.source().await.unwrap();
    assert!(!page.contains("PAYLOAD-ACME") && page.contains("payload-hidden"));
    shot(&c, "lineage-scoped").await;
    c.goto(&format!("{base}/runs/globex/{}", s.globex_run)).await.unwrap();
    assert_eq!(text(&c, "#error-code").await, "forbidden");
    c.close().await.unwrap();
    stop.cancel();
    served.await.unwrap().unwrap();
}
