//! Shared pieces: a migrated PostgreSQL schema, a relay running in-process,
//! and a plain consumer that reads records back.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use ferry::{Engine, Ferry};
use ferry_relay::{Capture, Relay, RelayConfig};
pub use ferry_testkit::OUTBOX;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use tokio_util::sync::CancellationToken;

pub async fn pg_ferry() -> (Ferry, String) {
    tracing_layers();
    let url = ferry_testkit::fresh_database_url(Engine::Postgres)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let ferry = Ferry::builder(&url).migrate(true).connect().await.unwrap();
    (ferry, url)
}

/// The test binary's span exporter and its tracer, for the trace test
/// (see [`tracing_layers`]).
pub struct Tracing {
    pub spans: opentelemetry_sdk::trace::InMemorySpanExporter,
    pub tracer: opentelemetry_sdk::trace::SdkTracerProvider,
}

/// Whether the OpenTelemetry layer records spans: off until the trace test
/// turns it on (see [`tracing_layers`]).
pub static TRACE_ON: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The test binary's one global subscriber, made once: the in-process
/// relay's logs go to the running test's captured output, which the harness
/// shows when the test fails (`ferry_relay=info` unless
/// FERRY_TEST_RELAY_LOG names another filter), and an OpenTelemetry layer
/// into an in-memory exporter records spans while [`TRACE_ON`] is set.
pub fn tracing_layers() -> &'static Tracing {
    use opentelemetry::trace::TracerProvider as _;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::Layer;
    static TRACING: std::sync::OnceLock<Tracing> = std::sync::OnceLock::new();
    TRACING.get_or_init(|| {
        let spans = opentelemetry_sdk::trace::InMemorySpanExporter::default();
        let tracer = opentelemetry_sdk::trace::SdkTracerProvider::builder()
            .with_simple_exporter(spans.clone())
            .build();
        let traces = tracing_opentelemetry::layer()
            .with_tracer(tracer.tracer("ferry-test"))
            .with_filter(
                // Asked at every span, never cached per callsite (a plain
                // `filter_fn` is: a span first met by another test before
                // the trace test turned this on would stay off). Info and
                // above: the spans the trace test follows, and no debug
                // callsite of any dependency made live by this layer.
                tracing_subscriber::filter::dynamic_filter_fn(|m, _| {
                    *m.level() <= tracing::Level::INFO && TRACE_ON.load(std::sync::atomic::Ordering::Relaxed)
                })
                .with_max_level_hint(tracing::level_filters::LevelFilter::INFO),
            );
        let filter = std::env::var("FERRY_TEST_RELAY_LOG").unwrap_or_else(|_| "ferry_relay=info".into());
        let logs = tracing_subscriber::fmt::layer()
            .with_ansi(false)
            .with_test_writer()
            .with_filter(tracing_subscriber::EnvFilter::new(filter));
        tracing::subscriber::set_global_default(tracing_subscriber::registry().with(traces).with(logs))
            .expect("the test binary's subscriber is made once, here");
        Tracing { spans, tracer }
    })
}

/// A polling relay, for the tests about polled lanes only (the
/// conformance tests take theirs from [`config_for`]; a relay left on the
/// default capture would stream from a slot no test drops).
pub fn relay_config(url: &str, brokers: &str) -> RelayConfig {
    let mut cfg = RelayConfig::new(url, brokers);
    cfg.capture = Some(ferry_relay::Capture::Poll);
    cfg.poll_interval = Duration::from_millis(50);
    cfg.lease = Duration::from_secs(3);
    cfg.grace = Duration::from_secs(5);
    cfg
}

/// Runs `scenario(capture)` once per capture mode, as the tests
/// `<scenario>::poll` and `<scenario>::wal`: one conformance suite, since
/// every promise of the relay holds whichever way rows are captured.
/// (`cargo test -p ferry-relay --test it ::wal` runs the WAL part.)
macro_rules! in_both_capture_modes {
    ($($scenario:ident),* $(,)?) => {
        $(
            mod $scenario {
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn poll() {
                    super::$scenario(::ferry_relay::Capture::Poll).await
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn wal() {
                    super::$scenario(::ferry_relay::Capture::Wal).await
                }
            }
        )*
    };
}
pub(crate) use in_both_capture_modes;

/// [`in_both_capture_modes`] and `<scenario>::wal_streams`: WAL capture
/// split into [`TEST_STREAMS`] streams (`--streams`), for the fault
/// scenarios every stream must survive as the one stream does (a SIGKILL,
/// a broker crash, a database outage, order under concurrent writers and
/// two relays); the others run in two modes (the test command's time).
macro_rules! in_every_capture_mode {
    ($($scenario:ident),* $(,)?) => {
        $(
            mod $scenario {
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn poll() {
                    super::$scenario(::ferry_relay::Capture::Poll).await
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn wal() {
                    super::$scenario(::ferry_relay::Capture::Wal).await
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn wal_streams() {
                    $crate::support::STREAMS
                        .scope($crate::support::TEST_STREAMS, super::$scenario(::ferry_relay::Capture::Wal))
                        .await
                }
            }
        )*
    };
}
pub(crate) use in_every_capture_mode;

/// The stream count of the conformance suite's `wal_streams` runs.
pub const TEST_STREAMS: u32 = 2;

tokio::task_local! {
    /// `--streams` for the slots made in this scope ([`SlotGuard::new`]).
    pub static STREAMS: u32;
}

/// The stream count of the running scenario (1 outside a `wal_streams` run).
pub fn streams() -> u32 {
    STREAMS.try_with(|n| *n).unwrap_or(1)
}

/// A test's capture mode: the relay configuration for it and, in WAL
/// capture, the test's own replication slot, dropped with this guard (after
/// the relays started through [`CaptureGuard::start`] are stopped).
pub struct CaptureGuard {
    slot: Option<SlotGuard>,
}

impl CaptureGuard {
    pub async fn new(capture: Capture) -> CaptureGuard {
        let slot = match capture {
            Capture::Wal => Some(SlotGuard::new().await),
            Capture::Poll => None,
        };
        CaptureGuard { slot }
    }

    /// A relay configuration capturing this way (polling: [`relay_config`];
    /// WAL: streaming from the test's slot).
    pub fn config(&self, url: &str, brokers: &str) -> RelayConfig {
        match &self.slot {
            Some(slot) => slot.config(url, brokers),
            None => relay_config(url, brokers),
        }
    }

    /// Starts an in-process relay, stopped before the slot is dropped.
    pub async fn start(&self, cfg: RelayConfig, ferry: Ferry) -> RunningRelay {
        match &self.slot {
            Some(slot) => slot.start(cfg, ferry).await,
            None => start_relay(cfg, ferry).await,
        }
    }

    /// The flags for a relay process capturing this way (it polls without
    /// them).
    pub fn args(&self) -> Vec<&str> {
        self.slot.as_ref().map(|s| s.args().to_vec()).unwrap_or_default()
    }

    /// The WAL capture's slot (`None` when polling).
    pub fn slot(&self) -> Option<&SlotGuard> {
        self.slot.as_ref()
    }
}

/// The relay configuration of `capture` for one test, and the guard that
/// drops its slot.
pub async fn config_for(capture: Capture, url: &str, brokers: &str) -> (RelayConfig, CaptureGuard) {
    let guard = CaptureGuard::new(capture).await;
    (guard.config(url, brokers), guard)
}

pub struct RunningRelay {
    pub stop: CancellationToken,
    pub handle: tokio::task::JoinHandle<Result<(), ferry_relay::RelayError>>,
    pub state: std::sync::Arc<ferry_relay::state::RelayState>,
    pub addr: std::net::SocketAddr,
}

pub async fn start_relay(cfg: RelayConfig, ferry: Ferry) -> RunningRelay {
    tracing_layers();
    let relay = Relay::new(cfg, ferry).unwrap();
    let state = relay.state();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    let s = stop.clone();
    let handle = tokio::spawn(relay.run(listener, async move { s.cancelled().await }));
    RunningRelay {
        stop,
        handle,
        state,
        addr,
    }
}

impl RunningRelay {
    pub async fn shutdown(self) {
        self.stop.cancel();
        self.handle.await.unwrap().unwrap();
    }
}

/// One record as read back.
#[derive(Debug, Clone)]
pub struct Record {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub key: String,
    pub payload: Vec<u8>,
    pub headers: HashMap<String, String>,
}

impl Record {
    pub fn outbox_id(&self) -> i64 {
        self.headers["ferry-outbox-id"].parse().unwrap()
    }
}

/// The first occurrence of each outbox id in `recs`, checking that a
/// duplicate is the same row and that each key's first occurrences come in
/// id order (a lane never produces past a failed row, so it never writes
/// `i+1, i, i+1`).
pub fn first_occurrences(recs: &[Record]) -> HashMap<i64, &Record> {
    let mut first: HashMap<i64, &Record> = HashMap::new();
    let mut last: HashMap<&str, i64> = HashMap::new();
    for r in recs {
        let id = r.outbox_id();
        match first.get(&id) {
            Some(f) => assert_eq!(
                (&f.key, &f.payload),
                (&r.key, &r.payload),
                "a duplicate is the same row"
            ),
            None => {
                first.insert(id, r);
                if let Some(prev) = last.insert(&r.key, id) {
                    assert!(
                        prev < id,
                        "key {}: first occurrences out of order ({prev} then {id})",
                        r.key
                    );
                }
            }
        }
    }
    first
}

/// How many distinct outbox ids `recs` holds (a slice, or records already
/// read chained with new ones: nothing is cloned).
pub fn distinct<'a>(recs: impl IntoIterator<Item = &'a Record>) -> usize {
    recs.into_iter().map(Record::outbox_id).collect::<HashSet<_>>().len()
}

/// Key `key`'s outbox ids in `recs`' order, first occurrences only.
pub fn order_of(recs: &[Record], key: &str) -> Vec<i64> {
    let mut order = Vec::new();
    for r in recs.iter().filter(|r| r.key == key) {
        if !order.contains(&r.outbox_id()) {
            order.push(r.outbox_id());
        }
    }
    order
}

/// A reader of every partition of `topics` (made beforehand) from the
/// beginning.
pub fn consumer(brokers: &str, topics: &[&str]) -> BaseConsumer {
    let c: BaseConsumer = reader_config(brokers).create().unwrap();
    assign_from_start(&c, topics);
    c
}

/// A test reader's settings: the `group.id` librdkafka needs before it
/// assigns partitions by hand, never joined and nothing committed under it
/// (no commit on a timer or at close, which would wait for the group's
/// coordinator); from the earliest offset again should one go out of range.
pub fn reader_config(brokers: &str) -> ClientConfig {
    let mut cfg = ClientConfig::new();
    cfg.set("bootstrap.servers", brokers)
        .set("group.id", "ferry-test-reader")
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest");
    cfg
}

/// Assigns `c` every partition of `topics` at their first offset. A reader
/// without a consumer group: no session to time out on a starved machine, no
/// rebalance, so what a test reads depends only on what reached Kafka.
pub fn assign_from_start(c: &BaseConsumer, topics: &[&str]) {
    let mut all = TopicPartitionList::new();
    for topic in topics {
        let md = c.fetch_metadata(Some(topic), Duration::from_secs(10)).unwrap();
        let partitions = md
            .topics()
            .iter()
            .find(|t| t.name() == *topic && t.error().is_none())
            .map_or(0, |t| t.partitions().len());
        assert!(
            partitions > 0,
            "topic {topic} has no partitions: create it before reading it"
        );
        for p in 0..partitions as i32 {
            all.add_partition_offset(topic, p, Offset::Beginning).unwrap();
        }
    }
    c.assign(&all).unwrap();
}

/// Reads until `done(records)` holds; fails after `limit` (a bound, not a
/// sync). With `n` records read, `done` is asked again after up to `n / 8`
/// more that librdkafka already holds (at most 500), not after every one: a
/// test's check looks at every record read, so asking after each made a
/// long read quadratic, seconds of a debug build's CPU per thousand rows.
/// A test that stops at its first records still stops right there.
pub async fn read_until(c: &BaseConsumer, limit: Duration, mut done: impl FnMut(&[Record]) -> bool) -> Vec<Record> {
    let mut out = Vec::new();
    let start = Instant::now();
    while !done(&out) {
        if start.elapsed() >= limit {
            panic!(
                "gave up after {limit:?} with {} records; {}",
                out.len(),
                where_the_consumer_stands(c)
            );
        }
        tokio::task::block_in_place(|| {
            if let Some(Ok(m)) = c.poll(Duration::from_millis(100)) {
                out.push(to_record(&m));
                for _ in 0..(out.len() / 8).min(500) {
                    match c.poll(Duration::ZERO) {
                        Some(Ok(m)) => out.push(to_record(&m)),
                        _ => break,
                    }
                }
            }
        });
    }
    out
}

/// For a failure's message: each assigned partition's position beside its
/// watermarks, which tells a consumer that stopped fetching (position
/// behind) from records that never reached Kafka (position at the mark).
/// A `read_committed` reader is told the last stable offset as its upper
/// mark: there, a position at the mark may be a transaction left open.
fn where_the_consumer_stands(c: &BaseConsumer) -> String {
    let assigned = match c.assignment() {
        Ok(a) => a,
        Err(e) => return format!("no assignment: {e}"),
    };
    let positions = c.position().ok();
    let mut parts = Vec::new();
    for e in assigned.elements() {
        let at = positions
            .as_ref()
            .and_then(|p| p.find_partition(e.topic(), e.partition()))
            .map(|p| format!("{:?}", p.offset()))
            .unwrap_or_else(|| "?".into());
        let marks = c
            .fetch_watermarks(e.topic(), e.partition(), Duration::from_secs(1))
            .map(|(lo, hi)| format!("{lo}..{hi}"))
            .unwrap_or_else(|err| format!("({err})"));
        parts.push(format!("{}[{}] at {at}, marks {marks}", e.topic(), e.partition()));
    }
    format!(
        "assigned: {}",
        if parts.is_empty() {
            "none".into()
        } else {
            parts.join("; ")
        }
    )
}

fn to_record(m: &rdkafka::message::BorrowedMessage<'_>) -> Record {
    {
        {
            let headers = m
                .headers()
                .map(|h| {
                    h.iter()
                        .map(|h| {
                            (
                                h.key.to_owned(),
                                String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned(),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            Record {
                topic: m.topic().to_owned(),
                partition: m.partition(),
                offset: m.offset(),
                key: String::from_utf8_lossy(m.key().unwrap_or_default()).into_owned(),
                payload: m.payload().unwrap_or_default().to_vec(),
                headers,
            }
        }
    }
}

/// Every record of `topic`, read from the beginning to the end of every
/// partition by a fresh consumer (`read_committed` or not). No producer may
/// be running. Fails after `limit`.
pub async fn read_all(brokers: &str, topic: &str, read_committed: bool, limit: Duration) -> Vec<Record> {
    let c: BaseConsumer = reader_config(brokers)
        .set("enable.partition.eof", "true")
        .set(
            "isolation.level",
            if read_committed {
                "read_committed"
            } else {
                "read_uncommitted"
            },
        )
        .create()
        .unwrap();
    assign_from_start(&c, &[topic]);
    let mut open: HashSet<i32> = c
        .assignment()
        .unwrap()
        .elements()
        .iter()
        .map(|e| e.partition())
        .collect();
    let mut out = Vec::new();
    let start = Instant::now();
    while !open.is_empty() {
        assert!(
            start.elapsed() < limit,
            "never reached the end of {topic} ({open:?} open)"
        );
        match tokio::task::block_in_place(|| c.poll(Duration::from_millis(200))) {
            Some(Ok(m)) => out.push(to_record(&m)),
            Some(Err(rdkafka::error::KafkaError::PartitionEOF(p))) => {
                open.remove(&p);
            }
            Some(Err(e)) => panic!("reading {topic}: {e}"),
            None => {}
        }
    }
    out
}

pub async fn scalar(ferry: &Ferry, sql: &str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(ferry.db().as_postgres().unwrap())
        .await
        .unwrap()
}

/// GET `path` on a local HTTP server; returns the status line and body.
/// HTTP/1.0, so that no server sends the body chunked (Prometheus's does
/// to an HTTP/1.1 request for a large answer).
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> (String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut buf = String::new();
    s.read_to_string(&mut buf).await.unwrap();
    let status = buf.lines().next().unwrap_or_default().to_owned();
    let body = buf.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned();
    (status, body)
}

/// Polls `/readyz` until its status line contains `want`, within `limit`.
pub async fn readyz_until(relay: &RunningRelay, want: &str, limit: Duration) {
    let deadline = Instant::now() + limit;
    loop {
        let (status, _) = http_get(relay.addr, "/readyz").await;
        if status.contains(want) {
            return;
        }
        assert!(Instant::now() < deadline, "/readyz never answered {want}: {status}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A `ferry-relay run` child process, SIGKILLed when dropped (also when
/// the test fails), so no relay outlives its test. Its log (the relay's
/// own at info, its libraries' warnings and errors) goes to a file of its
/// own, printed when it is dropped during a failing test: a relay that
/// stalled says why in the test's output.
pub struct RelayProcess(pub std::process::Child, Option<std::path::PathBuf>);

impl std::ops::Deref for RelayProcess {
    type Target = std::process::Child;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for RelayProcess {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        if let Some(log) = self.1.take() {
            if std::thread::panicking() {
                // Lossy: one byte that is not UTF-8 must not hide the rest.
                let text = std::fs::read(&log)
                    .map(|b| String::from_utf8_lossy(&b).into_owned())
                    .unwrap_or_else(|e| format!("(unreadable: {e})"));
                let lines: Vec<&str> = text.lines().collect();
                eprintln!(
                    "ferry-relay (pid {}) log, last 40 lines:\n{}",
                    self.0.id(),
                    lines[lines.len().saturating_sub(40)..].join("\n")
                );
            }
            let _ = std::fs::remove_file(log);
        }
    }
}

/// A `ferry-relay run` process (1 s lane leases, batches of 50), polling
/// unless `extra` holds [`CaptureGuard::args`], with extra flags and
/// environment, for the crash tests. Its log: [`RelayProcess`]
/// (`FERRY_TEST_RELAY_LOG=<filter>` sends it to the test's stderr instead).
pub fn spawn_relay_process(url: &str, brokers: &str, extra: &[&str], env: &[(&str, &str)]) -> RelayProcess {
    let mut cmd = relay_command(url, brokers, extra, env);
    if let Ok(filter) = std::env::var("FERRY_TEST_RELAY_LOG") {
        cmd.env("RUST_LOG", filter).stderr(std::process::Stdio::inherit());
        return RelayProcess(cmd.spawn().expect("spawn ferry-relay"), None);
    }
    static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let log = std::env::temp_dir().join(format!(
        "ferry-relay-test-{}-{}.log",
        std::process::id(),
        SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let file = std::fs::File::create(&log).expect("relay log file");
    cmd.env("RUST_LOG", "warn,ferry_relay=info").stderr(file);
    RelayProcess(cmd.spawn().expect("spawn ferry-relay"), Some(log))
}

/// [`spawn_relay_process`] whose warnings and errors go to `log`, one JSON
/// object a line, for tests about what a relay logs.
pub fn spawn_relay_process_logging(url: &str, brokers: &str, extra: &[&str], log: &std::path::Path) -> RelayProcess {
    let file = std::fs::File::create(log).expect("relay log file");
    let mut cmd = relay_command(url, brokers, extra, &[]);
    cmd.env("RUST_LOG", "warn").env("FERRY_LOG_FORMAT", "json").stderr(file);
    RelayProcess(cmd.spawn().expect("spawn ferry-relay"), None)
}

fn relay_command(url: &str, brokers: &str, extra: &[&str], env: &[(&str, &str)]) -> std::process::Command {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_ferry-relay"));
    cmd.args([
        "run",
        "--database-url",
        url,
        "--brokers",
        brokers,
        "--lease",
        "1s",
        "--poll-interval",
        "50ms",
    ])
    .args(["--batch-size", "50", "--listen", "127.0.0.1:0", "--grace", "5s"])
    .args(extra)
    // Polling unless `extra` says `--capture wal` (which overrides it).
    .env("FERRY_CAPTURE", "poll")
    .envs(env.iter().copied())
    .stdout(std::process::Stdio::null());
    cmd
}

/// A replication slot (and publication) name of its own for one test
/// (`ferry_test_<born>_<pid>_<n>`): slot names are cluster-wide and tests
/// run in parallel on one cluster. Both are dropped with the guard, even
/// when the test fails, so leftover slots never hold WAL; slots a crashed
/// run left behind are dropped by the first guard of a later run once an
/// hour old.
pub struct SlotGuard {
    pub name: String,
    /// `--streams` of the relays on it (the slots are then
    /// `<name>_<k>of<N>`).
    pub streams: u32,
    streams_arg: String,
    /// The relays started on it: stopped first, or one could make the slot
    /// anew after the guard dropped it.
    relays: std::sync::Mutex<Vec<tokio::task::AbortHandle>>,
}

impl SlotGuard {
    pub async fn new() -> SlotGuard {
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let born = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        if n == 0 {
            drop_stale_slots(born).await;
        }
        let streams = streams();
        SlotGuard {
            name: format!("ferry_test_{born}_{}_{n}", std::process::id()),
            streams,
            streams_arg: streams.to_string(),
            relays: Default::default(),
        }
    }

    /// The replication slots of the relays on it, one per stream.
    pub fn slots(&self) -> Vec<String> {
        (0..self.streams)
            .map(|index| {
                ferry_relay::store::Stream {
                    index,
                    count: self.streams,
                }
                .name(&self.name)
            })
            .collect()
    }

    /// Starts an in-process relay streaming from this slot.
    pub async fn start(&self, cfg: RelayConfig, ferry: Ferry) -> RunningRelay {
        let relay = start_relay(cfg, ferry).await;
        self.relays.lock().unwrap().push(relay.handle.abort_handle());
        relay
    }

    /// `--capture wal --slot … --publication …` (and `--streams`) for a
    /// relay process.
    pub fn args(&self) -> Vec<&str> {
        let mut args = vec!["--capture", "wal", "--slot", &self.name, "--publication", &self.name];
        if self.streams > 1 {
            args.extend(["--streams", &self.streams_arg]);
        }
        args
    }

    /// A relay configuration streaming from this slot.
    pub fn config(&self, url: &str, brokers: &str) -> RelayConfig {
        let mut cfg = relay_config(url, brokers);
        cfg.capture = Some(ferry_relay::Capture::Wal);
        cfg.slot = Some(self.name.clone());
        cfg.publication = Some(self.name.clone());
        cfg.streams = self.streams;
        cfg
    }
}

fn admin_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// Ends the session streaming from `slot` (if any) and drops it; true once
/// it is gone. A relay may take the slot again between the two: callers loop.
pub async fn terminate_and_drop_slot(pool: &sqlx::PgPool, slot: &str) -> bool {
    let _ = sqlx::query(
        "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1 AND active",
    )
    .bind(slot)
    .execute(pool)
    .await;
    let dropped =
        sqlx::query("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1")
            .bind(slot)
            .execute(pool)
            .await;
    dropped.is_ok()
        && sqlx::query_scalar::<_, i64>("SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1")
            .bind(slot)
            .fetch_one(pool)
            .await
            .map(|n| n == 0)
            .unwrap_or(false)
}

async fn drop_stale_slots(born: u64) {
    let Ok(pool) = sqlx::PgPool::connect(&admin_url()).await else {
        return;
    };
    let names: Vec<String> = sqlx::query_scalar(
        "SELECT slot_name::text FROM pg_replication_slots WHERE slot_name LIKE 'ferry\\_test\\_%' AND NOT active",
    )
    .fetch_all(&pool)
    .await
    .unwrap_or_default();
    for name in names {
        let old = name
            .split('_')
            .nth(2)
            .and_then(|b| b.parse::<u64>().ok())
            .is_some_and(|b| b + 3600 < born);
        if old {
            let _ = sqlx::query("SELECT pg_drop_replication_slot($1)")
                .bind(&name)
                .execute(&pool)
                .await;
        }
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        for relay in self.relays.lock().unwrap().drain(..) {
            relay.abort();
        }
        // The slot of one stream too: a test may change the layout.
        let mut names = self.slots();
        if self.streams > 1 {
            names.push(self.name.clone());
        }
        // A runtime of its own: drop runs inside (or after) the test's.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let Ok(pool) = sqlx::PgPool::connect(&admin_url()).await else {
                    return;
                };
                let deadline = Instant::now() + Duration::from_secs(20);
                for name in names {
                    while !terminate_and_drop_slot(&pool, &name).await && Instant::now() < deadline {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    // Publications are per database, not per schema: no leftovers.
                    let _ = sqlx::query(&format!("DROP PUBLICATION IF EXISTS {name}"))
                        .execute(&pool)
                        .await;
                }
            });
        })
        .join();
    }
}

/// The slot's `confirmed_flush_lsn` as a number (0 when it has none).
pub async fn confirmed_flush(pool: &sqlx::PgPool, slot: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT COALESCE((confirmed_flush_lsn - '0/0'::pg_lsn)::bigint, 0) FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(slot)
    .fetch_optional(pool)
    .await
    .unwrap()
    .unwrap_or(0)
}

/// Every committed row in `ids` is on `recs` (a duplicate is the same row)
/// and each key's first occurrences keep id order; the number of extra
/// copies.
pub fn nothing_lost(recs: &[Record], ids: &[i64]) -> usize {
    let first = first_occurrences(recs);
    let lost: Vec<&i64> = ids.iter().filter(|id| !first.contains_key(id)).collect();
    assert!(
        lost.is_empty(),
        "{} committed rows never published: {:?}",
        lost.len(),
        &lost[..lost.len().min(10)]
    );
    recs.len() - first.len()
}

/// Every id of `recs` exactly once, `total` of them, and each key's ids in
/// increasing order (the order one writer committed them in).
pub fn assert_once_in_commit_order(recs: &[Record], total: usize) {
    let mut count: HashMap<i64, usize> = HashMap::new();
    for r in recs {
        *count.entry(r.outbox_id()).or_default() += 1;
    }
    let mut dups: Vec<_> = count.iter().filter(|(_, n)| **n > 1).collect();
    dups.sort();
    assert!(
        dups.is_empty(),
        "{} rows duplicated for a read_committed reader: {:?}",
        dups.len(),
        &dups[..dups.len().min(10)]
    );
    assert_eq!(count.len(), total, "every row exactly once");
    let mut last: HashMap<&str, i64> = HashMap::new();
    for r in recs {
        let id = r.outbox_id();
        if let Some(prev) = last.insert(&r.key, id) {
            assert!(prev < id, "key {} out of commit order: {prev} then {id}", r.key);
        }
    }
}

/// Sends `signal` (`STOP`, `CONT`, `TERM`) to process `pid`.
pub fn signal(pid: u32, signal: &str) {
    let ok = std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -{signal} {pid}");
}

/// Counts the rows delivered (marked, or covered by the ledger).
pub static DELIVERED: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| format!("SELECT count(*) FROM {OUTBOX} WHERE state = 'delivered'"));

/// Waits until a row written after `after_id` has been pending for longer
/// than `age` (with the broker down: an outage at least that long for the
/// records in flight).
pub async fn wait_for_a_row_pending_for(ferry: &Ferry, after_id: i64, age: Duration) {
    let sql = format!(
        "SELECT count(*) FROM {OUTBOX} WHERE id > {after_id} AND state = 'pending' \
         AND created_at < (extract(epoch FROM clock_timestamp()) * 1000)::bigint - {}",
        age.as_millis()
    );
    wait_for_count(ferry, &sql, 1, age + Duration::from_secs(60)).await;
}

/// Asserts that no record failed for a timeout: at least once, a record is
/// retried until acknowledged (a timed-out one would let the records
/// behind it overtake it).
pub async fn assert_no_record_timed_out(addr: std::net::SocketAddr) {
    let (_, metrics) = http_get(addr, "/metrics").await;
    assert!(
        !metrics.contains("ferry_relay_publish_errors_total{code=\"timeout\"}"),
        "records timed out during the outage: {metrics}"
    );
}

/// Waits until `sql` (a count) reaches `want`; fails after `limit`.
/// The walsender streaming from `slot`, if one does. A slot is also
/// `active` while `pg_create_logical_replication_slot` builds it (its
/// creator holds it until a consistent point, seconds on a busy server), so
/// only a pid that `pg_stat_replication` lists as a walsender counts.
pub async fn streaming_pid(pool: &sqlx::PgPool, slot: &str) -> Option<i32> {
    sqlx::query_scalar(
        "SELECT s.active_pid FROM pg_replication_slots s JOIN pg_stat_replication r ON r.pid = s.active_pid
         WHERE s.slot_name = $1",
    )
    .bind(slot)
    .fetch_optional(pool)
    .await
    .ok()
    .flatten()
}

/// Waits until a walsender other than `except` streams from `slot`, and
/// returns its pid.
pub async fn wait_for_streaming(pool: &sqlx::PgPool, slot: &str, except: Option<i32>, limit: Duration) -> i32 {
    let deadline = Instant::now() + limit;
    loop {
        match streaming_pid(pool, slot).await {
            Some(pid) if Some(pid) != except => return pid,
            _ => {}
        }
        assert!(
            Instant::now() < deadline,
            "no session streams from slot {slot} after {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The cluster's transactions holding an xid, oldest first (what a new
/// logical slot waits for): for the message of a test that timed out.
pub async fn running_xacts(ferry: &Ferry) -> String {
    sqlx::query_scalar::<_, String>(
        "SELECT format('pid %s db %s xid %s for %s s %s: %s', pid, datname, backend_xid,
                round(extract(epoch FROM clock_timestamp() - xact_start)), state, left(query, 120))
         FROM pg_stat_activity WHERE backend_xid IS NOT NULL ORDER BY xact_start",
    )
    .fetch_all(ferry.db().as_postgres().unwrap())
    .await
    .map(|rows| rows.join("; "))
    .unwrap_or_else(|e| format!("(unreadable: {e})"))
}

/// The outbox rows not delivered (the first 20) and the WAL slots' catch-up
/// records: whether a row the relay never delivered was below the table
/// read's bound or should have come in the stream.
async fn undelivered(ferry: &Ferry) -> String {
    let pool = ferry.db().as_postgres().unwrap();
    let rows: Vec<String> = sqlx::query_scalar(&format!(
        "SELECT format('id %s %s lane %s attempts %s error %s at %s', id, state, lane, publish_attempts, last_error, created_at)
         FROM {OUTBOX} WHERE state <> 'delivered' ORDER BY id LIMIT 20"
    ))
    .fetch_all(pool)
    .await
    .unwrap_or_else(|e| vec![format!("(unreadable: {e})")]);
    let slots: Vec<String> = sqlx::query_scalar(
        "SELECT format('%s caught up %s through %s generation %s marked %s', slot, caught_up, catch_up_through, generation, marked_lsn)
         FROM relay_wal_slots ORDER BY slot",
    )
    .fetch_all(pool)
    .await
    .unwrap_or_else(|e| vec![format!("(unreadable: {e})")]);
    format!(
        "not delivered: [{}]; WAL slots: [{}]",
        rows.join(", "),
        slots.join(", ")
    )
}

pub async fn wait_for_count(ferry: &Ferry, sql: &str, want: i64, limit: Duration) {
    wait_for(ferry, None, sql, want, limit).await;
}

/// [`wait_for_count`], naming on timeout how `relay`'s WAL sessions ended
/// and the publish errors it met (what it did meanwhile).
pub async fn wait_for_relay_count(ferry: &Ferry, relay: &RunningRelay, sql: &str, want: i64, limit: Duration) {
    wait_for(ferry, Some(relay), sql, want, limit).await;
}

async fn wait_for(ferry: &Ferry, relay: Option<&RunningRelay>, sql: &str, want: i64, limit: Duration) {
    let deadline = Instant::now() + limit;
    loop {
        let asked = Instant::now();
        let n = scalar(ferry, sql).await;
        if n >= want {
            return;
        }
        // Asked again after as long as the count took (at least 20 ms): a
        // count over the outbox's state view reads every row, tens of
        // milliseconds on a busy machine, so a wait costs at most half a
        // backend of the CPU the relay under test needs.
        let took = asked.elapsed();
        if Instant::now() >= deadline {
            let story = relay.map_or_else(String::new, |r| {
                let counts: Vec<String> = r
                    .state
                    .metrics
                    .render()
                    .lines()
                    .filter(|l| {
                        l.starts_with("ferry_relay_wal_sessions_ended") || l.starts_with("ferry_relay_publish_errors")
                    })
                    .map(str::to_owned)
                    .collect();
                format!("; the relay: {}", counts.join(", "))
            });
            panic!(
                "{sql}: {n} after {limit:?}, wanted {want}; transactions running: {}{story}; {}",
                running_xacts(ferry).await,
                undelivered(ferry).await
            );
        }
        tokio::time::sleep(took.max(Duration::from_millis(20))).await;
    }
}

/// Each partition's end offset of `topic` (the next offset to be written).
pub fn end_offsets(brokers: &str, topic: &str) -> HashMap<i32, i64> {
    let c: rdkafka::consumer::BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("ends-{}", uuid::Uuid::now_v7().simple()))
        .create()
        .unwrap();
    let md = c.fetch_metadata(Some(topic), Duration::from_secs(10)).unwrap();
    md.topics()[0]
        .partitions()
        .iter()
        .map(|p| {
            let (_, high) = c.fetch_watermarks(topic, p.id(), Duration::from_secs(10)).unwrap();
            (p.id(), high)
        })
        .collect()
}

/// The ids delivered now (marked, or covered by the ledger).
pub async fn delivered_ids(pool: &sqlx::PgPool) -> HashSet<i64> {
    sqlx::query_scalar(&format!("SELECT id FROM {OUTBOX} WHERE state = 'delivered'"))
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
}

/// No record past `ends` (each partition's end offset when the relay that
/// delivered `delivered` was gone) carries one of those rows: what was
/// delivered is never produced again (`what` names the moment).
pub fn assert_nothing_delivered_produced_again(
    recs: &[Record],
    delivered: &HashSet<i64>,
    ends: &HashMap<i32, i64>,
    what: &str,
) {
    let again: Vec<i64> = recs
        .iter()
        .filter(|r| r.offset >= ends[&r.partition] && delivered.contains(&r.outbox_id()))
        .map(Record::outbox_id)
        .collect();
    assert!(
        again.is_empty(),
        "{what}: {} rows delivered before it were produced again, e.g. {:?}",
        again.len(),
        &again[..again.len().min(10)]
    );
}

/// Every outbox id, in order.
pub async fn all_ids(ferry: &Ferry) -> Vec<i64> {
    sqlx::query_scalar("SELECT id FROM outbox ORDER BY id")
        .fetch_all(ferry.db().as_postgres().unwrap())
        .await
        .unwrap()
}

/// One transaction's worth of plain SQL inserts: `n` rows of key `key` (or
/// of 20 keys `key-<g % 20>` when `key` is `None`), ids in one block;
/// returns their ids.
pub async fn insert_many<'c>(conn: impl sqlx::PgExecutor<'c>, n: i64, key: Option<&str>) -> Vec<i64> {
    sqlx::query_scalar(
        "INSERT INTO outbox (tenant, topic, key, lane, payload, headers, created_at)
         SELECT 'acme', 'orders', COALESCE($2, 'key-' || (g % 20)), 0,
                convert_to('{\"g\":' || g || '}', 'UTF8'), '{}'::jsonb,
                (extract(epoch FROM clock_timestamp()) * 1000)::bigint
         FROM generate_series(1, $1) g
         RETURNING id",
    )
    .bind(n)
    .bind(key)
    .fetch_all(conn)
    .await
    .unwrap()
}
