//! A real Apache Kafka broker for tests and benchmarks.
//!
//! [`Kafka::start`] launches one single-node KRaft broker (combined broker and
//! controller) from the jars `scripts/install-kafka` assembled from Maven
//! Central, on free 127.0.0.1 ports with a fresh temporary log dir and
//! `auto.create.topics.enable=false`. It is ready when a metadata request
//! through librdkafka answers with the broker: no fixed sleep anywhere.
//!
//! The broker is held by the `sh` watchdog (`watchdog.rs`) whose standard
//! input is a pipe from the test process: when the test process ends in any
//! way (including SIGKILL or an abort), the pipe closes and the watchdog
//! SIGKILLs the broker, so no broker outlives its test binary.
//!
//! When the jars are missing, starting fails with a message naming
//! `scripts/install-kafka`; a test never passes without its broker.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::ClientConfig;

use crate::ports::free_port_below_ephemeral;
use crate::watchdog::{Signal, Watchdog};

/// The pinned Apache Kafka version: the one `scripts/kafka/pom.xml` resolves.
pub fn kafka_version() -> &'static str {
    const POM: &str = include_str!("../../scripts/kafka/pom.xml");
    let start = POM.find("<kafka.version>").expect("kafka.version in pom") + "<kafka.version>".len();
    let end = POM[start..].find('<').expect("kafka.version closes");
    &POM[start..start + end]
}

/// Where the assembled broker lives: `FERRY_KAFKA_HOME`, or
/// `~/.cache/ferry/kafka-<version>` (what `scripts/install-kafka` writes).
pub fn kafka_home() -> PathBuf {
    if let Ok(h) = std::env::var("FERRY_KAFKA_HOME") {
        return PathBuf::from(h);
    }
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    Path::new(&home)
        .join(".cache/ferry")
        .join(format!("kafka-{}", kafka_version()))
}

/// How long startup may take before the launcher gives up and quotes the log.
const READY_WITHIN: Duration = Duration::from_secs(90);

/// One Apache Kafka broker process; SIGKILLed on drop (data dir removed).
pub struct Kafka {
    port: u16,
    controller_port: u16,
    /// A second client listener `(port, advertised port)`: clients that
    /// bootstrap through a proxy on the advertised port keep going through
    /// it ([`Kafka::start_behind`]).
    proxied: Option<(u16, u16)>,
    dir: PathBuf,
    proc: Option<Watchdog>,
}

impl Kafka {
    /// Starts a broker and waits until it answers metadata requests.
    /// Panics with what is missing (jars, java) or with the tail of the
    /// broker's log when it does not become ready.
    pub fn start() -> Kafka {
        Self::start_with(&[])
    }

    /// [`Kafka::start`] with extra `server.properties` lines (`key`, `value`),
    /// for example `("message.max.bytes", "20000")`.
    pub fn start_with(overrides: &[(&str, &str)]) -> Kafka {
        Self::start_on(overrides, None)
    }

    /// [`Kafka::start`] with a second client listener, on
    /// [`Kafka::proxied_port`], that advertises `127.0.0.1:<advertised>`:
    /// a client bootstrapping from a TCP proxy listening there (toxiproxy,
    /// forwarding to `proxied_port`) reaches the broker only through the
    /// proxy, metadata included. [`Kafka::brokers`] stays direct.
    pub fn start_behind(advertised: u16) -> Kafka {
        Self::start_on(&[], Some(advertised))
    }

    /// The port of the listener [`Kafka::start_behind`] added.
    pub fn proxied_port(&self) -> Option<u16> {
        self.proxied.map(|(port, _)| port)
    }

    fn start_on(overrides: &[(&str, &str)], advertised: Option<u16>) -> Kafka {
        let libs = kafka_home().join("libs");
        assert!(
            libs.join(format!("kafka_2.13-{}.jar", kafka_version())).exists(),
            "Apache Kafka {} is required and is not assembled at {}: run scripts/install-kafka (or set FERRY_KAFKA_HOME)",
            kafka_version(),
            libs.display()
        );
        // A port found free can be taken (by another test process's
        // service) before the broker binds it: then
        // the broker exits at once with "Address already in use", and the
        // start is tried again on new ports, a few times.
        let mut attempt = 0;
        loop {
            attempt += 1;
            let mut k = Self::configure(overrides, advertised);
            k.format();
            match k.try_spawn() {
                Ok(()) => return k,
                // Dropping `k` removes its directory.
                Err(_) if attempt < 5 && k.log_tail(usize::MAX).contains("Address already in use") => {}
                Err(e) => panic!("{e}"),
            }
        }
    }

    /// A broker's directory and `server.properties` on two free ports (not
    /// started).
    fn configure(overrides: &[(&str, &str)], advertised: Option<u16>) -> Kafka {
        let port = free_port_below_ephemeral();
        let controller_port = free_port_below_ephemeral();
        let proxied = advertised.map(|a| (free_port_below_ephemeral(), a));
        let (listener, advertised_listener, protocol) = match proxied {
            Some((p, a)) => (
                format!(",PROXIED://127.0.0.1:{p}"),
                format!(",PROXIED://127.0.0.1:{a}"),
                ",PROXIED:PLAINTEXT",
            ),
            None => (String::new(), String::new(), ""),
        };
        let dir = std::env::temp_dir().join(format!("ferry-kafka-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("data")).expect("broker temp dir");
        let mut props = format!(
            "process.roles=broker,controller\n\
             node.id=1\n\
             controller.quorum.bootstrap.servers=127.0.0.1:{controller_port}\n\
             listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}{listener}\n\
             advertised.listeners=PLAINTEXT://127.0.0.1:{port}{advertised_listener}\n\
             controller.listener.names=CONTROLLER\n\
             listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT{protocol}\n\
             log.dirs={data}\n\
             offsets.topic.replication.factor=1\n\
             offsets.topic.num.partitions=10\n\
             transaction.state.log.replication.factor=1\n\
             transaction.state.log.min.isr=1\n\
             transaction.state.log.num.partitions=10\n\
             group.initial.rebalance.delay.ms=0\n\
             group.consumer.min.session.timeout.ms=3000\n\
             group.classic.min.session.timeout.ms=3000\n\
             auto.create.topics.enable=false\n\
             num.partitions=1\n\
             log.flush.interval.messages=9223372036854775807\n",
            data = dir.join("data").display()
        );
        for (k, v) in overrides {
            props.push_str(&format!("{k}={v}\n"));
        }
        std::fs::write(dir.join("server.properties"), props).expect("server.properties");
        Kafka {
            port,
            controller_port,
            proxied,
            dir,
            proc: None,
        }
    }

    /// `bootstrap.servers` for it.
    pub fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The client port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The broker's own log so far (for assertion messages).
    pub fn log_tail(&self, lines: usize) -> String {
        let mut s = String::new();
        if let Ok(mut f) = std::fs::File::open(self.dir.join("broker.log")) {
            let _ = f.read_to_string(&mut s);
        }
        let all: Vec<&str> = s.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Creates a topic with `partitions` partitions (replication 1) and waits
    /// until every partition has a leader.
    pub fn create_topic(&self, name: &str, partitions: i32) {
        self.create_topic_with(name, partitions, &[]);
    }

    /// [`Kafka::create_topic`] with topic configs, e.g.
    /// `("max.message.bytes", "2000")` for a real poison record.
    pub fn create_topic_with(&self, name: &str, partitions: i32, config: &[(&str, &str)]) {
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", self.brokers())
            .create()
            .expect("admin client");
        let mut topic = NewTopic::new(name, partitions, TopicReplication::Fixed(1));
        for (k, v) in config {
            topic = topic.set(k, v);
        }
        let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
        let res = futures::executor::block_on(admin.create_topics([&topic], &opts)).expect("create_topics");
        for r in res {
            if let Err((t, e)) = r {
                panic!("creating topic {t} failed: {e}");
            }
        }
        self.wait_for_leaders(name, partitions);
    }

    fn wait_for_leaders(&self, topic: &str, partitions: i32) {
        let c = self.metadata_client();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(md) = c.fetch_metadata(Some(topic), Duration::from_secs(2)) {
                let ready = md.topics().iter().any(|t| {
                    t.name() == topic
                        && t.error().is_none()
                        && t.partitions().len() == partitions as usize
                        && t.partitions().iter().all(|p| p.leader() >= 0 && p.error().is_none())
                });
                if ready {
                    return;
                }
            }
            assert!(Instant::now() < deadline, "topic {topic} has no leaders after 30 s");
        }
    }

    /// SIGTERM (controlled shutdown) and wait until the broker exited: it is
    /// down until [`Kafka::restart`].
    pub fn stop(&mut self) {
        self.signal(Signal::Term);
    }

    /// SIGKILL the broker (a crash) and wait until it is gone.
    pub fn kill(&mut self) {
        self.signal(Signal::Kill);
    }

    /// Starts it again on the same ports and log dir (data is kept), and
    /// waits until it is ready.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    fn signal(&mut self, signal: Signal) {
        if let Some(w) = self.proc.take() {
            w.stop(signal);
        }
    }

    fn java() -> String {
        match std::env::var("JAVA_HOME") {
            Ok(h) if Path::new(&h).join("bin/java").exists() => format!("{h}/bin/java"),
            _ => "java".into(),
        }
    }

    fn classpath() -> String {
        format!("{}/*", kafka_home().join("libs").display())
    }

    /// The JVM's compiler and collector: `FERRY_KAFKA_JVM_OPTS` (split on
    /// spaces) when set, else G1 with both JIT tiers, a broker's usual
    /// settings. The test command sets `-XX:TieredStopAtLevel=1
    /// -XX:+UseSerialGC` (the C1 compiler alone, a serial collector): a
    /// broker then starts on half the CPU (about 2 s instead of 4 s, the
    /// format 1.0 s instead of 1.7 s, measured on the 2-core machine),
    /// which is what dozens of short-lived test brokers spend most of;
    /// benchmarks keep the defaults.
    fn jvm_options() -> Vec<String> {
        match std::env::var("FERRY_KAFKA_JVM_OPTS") {
            Ok(opts) => opts.split_whitespace().map(str::to_owned).collect(),
            Err(_) => vec!["-XX:+UseG1GC".into()],
        }
    }

    /// `-XX:SharedArchiveFile` for the class-data sharing archive `name`
    /// (`format` or `broker`) that `scripts/install-kafka` made in
    /// `<kafka home>/cds`, when it is there: the JVM maps the startup
    /// classes instead of loading and verifying them (a broker starts on
    /// 1.3 s of CPU instead of 2.4 s, the format takes 0.5 s instead of 1.0 s).
    /// An archive the JVM cannot use is ignored by it (`-Xshare:auto`).
    fn class_data(name: &str) -> Option<String> {
        let archive = kafka_home().join("cds").join(format!("{name}.jsa"));
        archive
            .exists()
            .then(|| format!("-XX:SharedArchiveFile={}", archive.display()))
    }

    fn log4j() -> String {
        format!(
            "-Dlog4j2.configurationFile={}",
            kafka_home().join("log4j2.properties").display()
        )
    }

    /// `kafka-storage.sh format --standalone`: `kafka.tools.StorageTool`.
    fn format(&self) {
        let out = Command::new(Self::java())
            .args(Self::jvm_options())
            .args(Self::class_data("format"))
            .arg(Self::log4j())
            .arg("-cp")
            .arg(Self::classpath())
            .args([
                "kafka.tools.StorageTool",
                "format",
                "--standalone",
                "-t",
                &cluster_id(),
                "-c",
            ])
            .arg(self.dir.join("server.properties"))
            .output()
            .unwrap_or_else(|e| panic!("java is required to run Apache Kafka ({e}); install a JDK 17+"));
        assert!(
            out.status.success(),
            "formatting the Kafka log dir failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// [`Kafka::try_spawn`], panicking with the broker's log if it fails.
    fn spawn(&mut self) {
        if let Err(e) = self.try_spawn() {
            panic!("{e}");
        }
    }

    /// `kafka-server-start.sh server.properties`: `kafka.Kafka`, under the
    /// watchdog; returns once a metadata request answers with the broker,
    /// or the reason it did not, with the tail of its log.
    fn try_spawn(&mut self) -> Result<(), String> {
        let mut command = Watchdog::command(&self.dir.join("broker.log"));
        command
            .arg(Self::java())
            .args(["-Xms256m", "-Xmx768m", "-Djava.awt.headless=true"])
            .args(Self::jvm_options())
            .args(Self::class_data("broker"))
            .arg(Self::log4j())
            .arg("-cp")
            .arg(Self::classpath())
            .arg("kafka.Kafka")
            .arg(self.dir.join("server.properties"))
            .env_remove("KAFKA_OPTS");
        self.proc = Some(Watchdog::spawn(command));
        self.wait_ready()
    }

    fn metadata_client(&self) -> BaseConsumer {
        ClientConfig::new()
            .set("bootstrap.servers", self.brokers())
            .set("socket.connection.setup.timeout.ms", "1000")
            .set("reconnect.backoff.ms", "20")
            .set("reconnect.backoff.max.ms", "200")
            .set("log_level", "0")
            .create()
            .expect("metadata client")
    }

    fn broker_alive(&self) -> bool {
        self.proc.as_ref().is_some_and(Watchdog::server_alive)
    }

    fn wait_ready(&self) -> Result<(), String> {
        let c = self.metadata_client();
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            // Blocks up to its timeout waiting for the broker's answer.
            if let Ok(md) = c.fetch_metadata(None, Duration::from_secs(1)) {
                if md.brokers().iter().any(|b| b.id() == 1 && b.port() as u16 == self.port) {
                    return Ok(());
                }
            }
            if !self.broker_alive() {
                return Err(format!(
                    "Apache Kafka exited during startup on port {}; its log:\n{}",
                    self.port,
                    self.log_tail(40)
                ));
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "Apache Kafka did not answer a metadata request on port {} within {READY_WITHIN:?}; its log:\n{}",
                    self.port,
                    self.log_tail(40)
                ));
            }
        }
    }

    /// The controller port (for tests that need to reach the quorum).
    pub fn controller_port(&self) -> u16 {
        self.controller_port
    }
}

impl Drop for Kafka {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A KRaft cluster id: 16 random bytes, base64url without padding (what
/// `kafka-storage.sh random-uuid` prints). Like Kafka's `Uuid.randomUuid`,
/// it never starts with `-`, which the storage tool would read as a flag.
fn cluster_id() -> String {
    loop {
        let id = encode_cluster_id(uuid::Uuid::new_v4().into_bytes());
        if !id.starts_with('-') {
            return id;
        }
    }
}

fn encode_cluster_id(bytes: [u8; 16]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::with_capacity(22);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | (u32::from(*b) << (16 - 8 * i)));
        let chars = chunk.len() + 1;
        for i in 0..chars {
            out.push(A[((n >> (18 - 6 * i)) & 63) as usize] as char);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_ids_are_22_base64url_chars() {
        let id = cluster_id();
        assert_eq!(id.len(), 22, "{id}");
        assert!(id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'));
        assert_ne!(id, cluster_id());
        assert!((0..2000).all(|_| !cluster_id().starts_with('-')));
        assert_eq!(encode_cluster_id([0xfb; 16]), "-_v7-_v7-_v7-_v7-_v7-w");
    }

    #[test]
    fn the_pinned_version_is_read_from_the_pom() {
        assert!(kafka_version().starts_with("4."), "{}", kafka_version());
    }
}
