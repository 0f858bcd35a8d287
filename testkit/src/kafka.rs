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
//!
//! A broker is reused within a test process: when a test drops a broker it
//! started with [`Kafka::start`] and never stopped, killed or restarted,
//! and the test did not panic, the broker's topics and consumer groups are
//! deleted and it waits, alive, for the process's next [`Kafka::start`]
//! (at most [`POOL_MAX`] wait). The next test sees what a new broker shows
//! (no topic, no group, offsets from 0) without a JVM start
//! (about 1.3 s of CPU each, most of what short broker tests spend). A
//! broker a transactional producer used (`__transaction_state` exists: its
//! ids' state outlives the topics), to which a client is still connected (a
//! test's task or producer left running would write into the next test's
//! topics; the broker's connections to itself are not clients), or whose
//! reset fails (a group with members left) is killed as before. A topic's own configs are
//! removed before the topic (KRaft would give them back to a new topic of
//! the same name after a restart). `FERRY_TEST_FRESH_BROKERS=1` starts a
//! new broker every time.
//!
//! **Across test processes.** With `FERRY_TEST_BROKER_POOL` (a directory;
//! `scripts/run-tests.py` sets it for its run, with the run's pid in
//! `FERRY_TEST_BROKER_POOL_OWNER`), a reset broker is parked there instead,
//! for any test process of the run: the next process's tests take one
//! (an atomic rename of its entry, so one taker) instead of starting their
//! own, which is where most broker starts were (one or two per test
//! process, each a JVM start of about 1.3 s of CPU). Such a broker's
//! watchdog outlives its test process and kills it when the run's owner
//! ends; a taker signals it by pid. A broker a test process still held when
//! it died is never parked, so never reused.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use rdkafka::admin::{
    AdminClient, AdminOptions, AlterConfig, ConfigSource, NewTopic, OwnedResourceSpecifier, ResourceSpecifier,
    TopicReplication,
};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::ClientConfig;

use crate::ports::free_port_below_ephemeral;
use crate::watchdog::{Signal, Watchdog};

/// A group coordinator's answer while it is not ready yet: it is loading
/// its `__consumer_offsets` partitions (just created by a group's first
/// request, or moved) or is not known yet. Asked again, it answers.
fn coordinator_not_ready(code: rdkafka::types::RDKafkaErrorCode) -> bool {
    use rdkafka::types::RDKafkaErrorCode as C;
    matches!(
        code,
        C::CoordinatorLoadInProgress | C::CoordinatorNotAvailable | C::NotCoordinator
    )
}

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

/// How many reset brokers a test process keeps for its next tests.
pub const POOL_MAX: usize = 2;

/// How many reset brokers the run's shared pool keeps parked (about what
/// its test processes hold at once: three jobs, two tests each).
pub const SHARED_POOL_MAX: usize = 6;

/// The reset brokers waiting for a test of this process (see the module).
static POOL: std::sync::Mutex<Vec<Kafka>> = std::sync::Mutex::new(Vec::new());

/// One Apache Kafka broker process; on drop, reset and kept for the
/// process's next test, or SIGKILLed and its data dir removed (see the
/// module).
pub struct Kafka {
    port: u16,
    controller_port: u16,
    /// A second client listener `(port, advertised port)`: clients that
    /// bootstrap through a proxy on the advertised port keep going through
    /// it ([`Kafka::start_behind`]).
    proxied: Option<(u16, u16)>,
    dir: PathBuf,
    proc: Option<Watchdog>,
    /// The broker's pid when another test process of the run started it
    /// (taken from the shared pool): signalled directly, not through a
    /// watchdog of this process.
    adopted: Option<u32>,
    /// Started plainly and never stopped, killed or restarted: may be reset
    /// and reused when dropped.
    reusable: bool,
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
        Self::start_on(overrides, None, true)
    }

    /// [`Kafka::start`], never a reused broker: for a test that stops,
    /// kills or restarts it. A pooled broker would replay earlier tests'
    /// metadata and transactions when restarted, and is not reused after
    /// such a test anyway.
    pub fn start_own() -> Kafka {
        Self::start_on(&[], None, false)
    }

    /// [`Kafka::start`] with a second client listener, on
    /// [`Kafka::proxied_port`], that advertises `127.0.0.1:<advertised>`:
    /// a client bootstrapping from a TCP proxy listening there (toxiproxy,
    /// forwarding to `proxied_port`) reaches the broker only through the
    /// proxy, metadata included. [`Kafka::brokers`] stays direct.
    pub fn start_behind(advertised: u16) -> Kafka {
        Self::start_on(&[], Some(advertised), true)
    }

    /// The port of the listener [`Kafka::start_behind`] added.
    pub fn proxied_port(&self) -> Option<u16> {
        self.proxied.map(|(port, _)| port)
    }

    fn start_on(overrides: &[(&str, &str)], advertised: Option<u16>, pooled: bool) -> Kafka {
        let reusable = pooled
            && overrides.is_empty()
            && advertised.is_none()
            && std::env::var_os("FERRY_TEST_FRESH_BROKERS").is_none();
        if reusable {
            if let Some(k) = Self::pooled().or_else(shared::take) {
                return k;
            }
        }
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
            let mut k = Self::configure(overrides, advertised, reusable);
            k.format(overrides.is_empty());
            match k.try_spawn() {
                Ok(()) => {
                    k.reusable = reusable;
                    return k;
                }
                // Dropping `k` removes its directory.
                Err(_) if attempt < 5 && k.log_tail(usize::MAX).contains("Address already in use") => {}
                Err(e) => panic!("{e}"),
            }
        }
    }

    /// A broker's directory and `server.properties` on two free ports (not
    /// started); the directory is in the run's shared pool only when the
    /// broker may be parked there (`reusable`), so any other broker dies
    /// with its test process.
    ///
    /// The controller appends no no-op records to the metadata log
    /// (`metadata.max.idle.interval.ms=0`; by default one every 500 ms,
    /// each an append, a flush and a replay): an idle broker then spends
    /// 1.6 % of a core instead of 2.35 % (measured side by side over a
    /// minute on the 2-core machine), and a run keeps several brokers alive
    /// or parked at once. Nothing a test checks waits for one: topic,
    /// group and transaction changes are metadata records of their own.
    fn configure(overrides: &[(&str, &str)], advertised: Option<u16>, reusable: bool) -> Kafka {
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
        static SWEPT: std::sync::Once = std::sync::Once::new();
        SWEPT.call_once(remove_dead_processes_dirs);
        let name = format!("ferry-kafka-{}-{port}", std::process::id());
        // A broker that may be parked in the run's shared pool keeps its
        // directory there (removed with the pool), not where this process's
        // leftovers are swept once it is gone.
        let dir = match shared::dir() {
            Some(pool) if reusable => pool.join("brokers").join(name),
            _ => std::env::temp_dir().join(name),
        };
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("data")).expect("broker temp dir");
        let mut props = format!(
            "process.roles=broker,controller\n\
             node.id=1\n\
             controller.quorum.voters=1@127.0.0.1:{controller_port}\n\
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
             log.flush.interval.messages=9223372036854775807\n\
             metadata.max.idle.interval.ms=0\n",
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
            adopted: None,
            reusable: false,
        }
    }

    /// A reset broker of this process that is still alive, if one waits.
    fn pooled() -> Option<Kafka> {
        loop {
            let k = POOL.lock().unwrap_or_else(|e| e.into_inner()).pop()?;
            if k.broker_alive() {
                return Some(k);
            }
        }
    }

    /// Deletes every consumer group and every topic but the internal ones
    /// (`__consumer_offsets`), and waits until the metadata shows none. An
    /// error when a client is still connected, when a transactional
    /// producer used the broker, when a group cannot be deleted (members
    /// left) or the topics do not go.
    fn reset(&self) -> Result<(), String> {
        // A client of the test that is still alive (a relay task left
        // running until its runtime drops, a leaked producer with records
        // queued for a topic of that name) would write into the next test's
        // topics: only a broker no client is connected to is reused.
        let clients = self.client_connections();
        if clients > 0 {
            return Err(format!("{clients} client connections still open"));
        }
        let c = self.metadata_client();
        let md = c
            .fetch_metadata(None, Duration::from_secs(5))
            .map_err(|e| e.to_string())?;
        // A transactional producer's ids keep their state past the topics
        // (an exactly-once test's relay stalled on a reused one, cause not
        // found): such a broker is not reused.
        if md.topics().iter().any(|t| t.name() == "__transaction_state") {
            return Err("a transactional producer used it".into());
        }
        let topics: Vec<String> = md
            .topics()
            .iter()
            .map(|t| t.name().to_owned())
            .filter(|t| !t.starts_with("__"))
            .collect();
        // A group coordinator still loading its partitions (one the test
        // made moments ago) answers the listing with an error for a while.
        let deadline = Instant::now() + Duration::from_secs(10);
        let groups: Vec<String> = loop {
            match c.fetch_group_list(None, Duration::from_secs(5)) {
                Ok(list) => break list.groups().iter().map(|g| g.name().to_owned()).collect(),
                Err(rdkafka::error::KafkaError::GroupListFetch(code))
                    if coordinator_not_ready(code) && Instant::now() < deadline =>
                {
                    // A poll interval: the loop ends on the coordinator's answer.
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => return Err(e.to_string()),
            }
        };
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", self.brokers())
            .create()
            .map_err(|e| e.to_string())?;
        let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
        if !groups.is_empty() {
            let names: Vec<&str> = groups.iter().map(String::as_str).collect();
            for r in futures::executor::block_on(admin.delete_groups(&names, &opts)).map_err(|e| e.to_string())? {
                r.map_err(|(g, e)| format!("group {g}: {e}"))?;
            }
        }
        if !topics.is_empty() {
            self.delete_topics(&admin, &c, &topics)?;
        }
        // Once more, now that the last test's clients had the time the
        // deletions took: a client of a task still running then, or one
        // that was between connections at the first look.
        drop(admin);
        drop(c);
        let clients = self.client_connections();
        if clients > 0 {
            return Err(format!("{clients} client connections still open"));
        }
        Ok(())
    }

    /// Deletes `topics`, their own configs first, and waits until the
    /// metadata no longer lists them.
    fn delete_topics(
        &self,
        admin: &AdminClient<DefaultClientContext>,
        c: &BaseConsumer,
        topics: &[String],
    ) -> Result<(), String> {
        let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
        // A topic's own configs outlive its deletion in KRaft's metadata
        // log: after a restart, a new topic of that name had them again
        // (a later test's `orders` refusing records as too large). They
        // are removed first (AlterConfigs replaces a topic's configs
        // whole: none), and the broker is not reused unless they went.
        let specs: Vec<ResourceSpecifier> = topics.iter().map(|t| ResourceSpecifier::Topic(t)).collect();
        let own = |specs: &[ResourceSpecifier]| -> Result<Vec<String>, String> {
            let mut own = Vec::new();
            for r in futures::executor::block_on(admin.describe_configs(specs, &opts)).map_err(|e| e.to_string())? {
                let r = r.map_err(|e| e.to_string())?;
                if r.entries.iter().any(|e| e.source == ConfigSource::DynamicTopic) {
                    if let OwnedResourceSpecifier::Topic(t) = r.specifier {
                        own.push(t);
                    }
                }
            }
            Ok(own)
        };
        let configured = own(&specs)?;
        if !configured.is_empty() {
            let none: Vec<AlterConfig> = configured
                .iter()
                .map(|t| AlterConfig::new(ResourceSpecifier::Topic(t)))
                .collect();
            for r in futures::executor::block_on(admin.alter_configs(&none, &opts)).map_err(|e| e.to_string())? {
                r.map_err(|(t, e)| format!("removing the configs of {t:?}: {e}"))?;
            }
            let specs: Vec<ResourceSpecifier> = configured.iter().map(|t| ResourceSpecifier::Topic(t)).collect();
            // The controller answered once the change was committed; the
            // broker's own copy of the metadata, which answers the check,
            // follows a moment later.
            let deadline = Instant::now() + Duration::from_secs(10);
            while let Some(t) = own(&specs)?.first() {
                if Instant::now() > deadline {
                    return Err(format!("topic {t} kept configs of its own"));
                }
                // A poll interval: the loop ends on the broker's answer.
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let names: Vec<&str> = topics.iter().map(String::as_str).collect();
        for r in futures::executor::block_on(admin.delete_topics(&names, &opts)).map_err(|e| e.to_string())? {
            r.map_err(|(t, e)| format!("topic {t}: {e}"))?;
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(md) = c.fetch_metadata(None, Duration::from_secs(2)) {
                if !md.topics().iter().any(|t| topics.iter().any(|n| n == t.name())) {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                return Err("its topics were not deleted within 30 s".into());
            }
            // A poll interval, not a synchronisation: the loop ends on the
            // metadata.
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Client connections to it: established TCP connections to its port
    /// whose client end is not one of the broker's own sockets (a broker
    /// may connect to itself).
    fn client_connections(&self) -> usize {
        // The tables first, the broker's sockets after: one it opened
        // between the two reads is not in the tables, and one of its own
        // seen in them is still among its sockets unless it closed
        // meanwhile (then counted: a broker not reused, nothing leaked).
        let mut tables = Vec::new();
        for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
            let Ok(text) = std::fs::read_to_string(table) else {
                return usize::MAX;
            };
            tables.push(text);
        }
        let pid = self.proc.as_ref().map(Watchdog::server_pid).or(self.adopted);
        let own = pid.map(socket_inodes).unwrap_or_default();
        let mut n = 0;
        for text in tables {
            n += text
                .lines()
                .skip(1)
                .filter(|line| {
                    let cols: Vec<&str> = line.split_whitespace().collect();
                    let port = |addr: &str| addr.rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok());
                    cols.len() > 9
                        && cols[3] == "01"
                        && port(cols[2]) == Some(self.port)
                        && !cols[9].parse::<u64>().is_ok_and(|inode| own.contains(&inode))
                })
                .count();
        }
        n
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
        self.reusable = false;
        self.signal(Signal::Term);
    }

    /// SIGKILL the broker (a crash) and wait until it is gone.
    pub fn kill(&mut self) {
        self.reusable = false;
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
        if let Some(pid) = self.adopted.take() {
            // Only the broker itself: a pid that died and was reused is
            // another process's.
            if shared::is_broker(pid, &self.dir) {
                crate::watchdog::stop_pid(pid, signal);
            }
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

    /// Formats the log dir, as `kafka-storage.sh format` does for a static
    /// quorum (`controller.quorum.voters`): `meta.properties` (this node,
    /// a new cluster id and directory id) and `bootstrap.checkpoint` (the
    /// release's metadata version and features, the same for every broker
    /// of a Kafka version; only its batch's timestamps differ). The first
    /// format on a machine runs `kafka.tools.StorageTool` and keeps its
    /// `bootstrap.checkpoint` in the Kafka home; later ones write both
    /// files themselves: no JVM (about 0.8 s of CPU) per broker start.
    /// A broker with settings of its own (`plain` false) is formatted by
    /// the tool, which reads them; so is one when the template is not
    /// whole (its record batches do not fill the file exactly), which the
    /// format then writes again.
    fn format(&self, plain: bool) {
        let data = self.dir.join("data");
        let template = template_checkpoint();
        if plain {
            match std::fs::read(&template) {
                Ok(checkpoint) if whole_batches(&checkpoint) => {
                    let meta = format!(
                        "node.id=1\ndirectory.id={}\nversion=1\ncluster.id={}\n",
                        cluster_id(),
                        cluster_id()
                    );
                    std::fs::write(data.join("meta.properties"), meta).expect("meta.properties");
                    std::fs::write(data.join("bootstrap.checkpoint"), checkpoint).expect("bootstrap.checkpoint");
                    return;
                }
                Ok(_) => eprintln!("{}: not whole, formatting with the storage tool", template.display()),
                Err(_) => {}
            }
        }
        let out = Command::new(Self::java())
            .args(Self::jvm_options())
            .args(Self::class_data("format"))
            .arg(Self::log4j())
            .arg("-cp")
            .arg(Self::classpath())
            .args(["kafka.tools.StorageTool", "format", "-t", &cluster_id(), "-c"])
            .arg(self.dir.join("server.properties"))
            .output()
            .unwrap_or_else(|e| panic!("java is required to run Apache Kafka ({e}); install a JDK 17+"));
        assert!(
            out.status.success(),
            "formatting the Kafka log dir failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if !plain {
            return;
        }
        // Kept for the next starts: written under a name of this start's
        // own, flushed, and renamed into place, so a reader (a concurrent
        // one, or one after a machine crash) sees the whole file or none
        // (a failure only costs the next start a format of its own).
        let tmp = template.with_extension(format!("checkpoint.{}-{}", std::process::id(), self.port));
        let kept = std::fs::copy(data.join("bootstrap.checkpoint"), &tmp)
            .and_then(|_| std::fs::File::open(&tmp)?.sync_all())
            .and_then(|()| std::fs::rename(&tmp, &template));
        if kept.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
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
        // A broker that may be parked for the run's other test processes
        // lives until the run ends, not until this process does.
        if let (Some(pool), Some(owner)) = (shared::dir(), shared::owner()) {
            if self.dir.starts_with(pool) {
                // A process group of its own too: a test job killed for
                // hanging (its group) must not kill a broker another job took.
                use std::os::unix::process::CommandExt as _;
                command.env("FERRY_WATCHDOG_OWNER", owner.to_string()).process_group(0);
            }
        }
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
            || self.adopted.is_some_and(|p| shared::is_broker(p, &self.dir))
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
        if std::thread::panicking() {
            // What the broker found wrong (a reused one's log holds its
            // earlier tests' too), for the failing test's output.
            let log = self.log_tail(usize::MAX);
            let bad: Vec<&str> = log
                .lines()
                .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
                .collect();
            eprintln!(
                "Kafka broker on port {}: its last warnings and errors:\n{}",
                self.port,
                bad[bad.len().saturating_sub(20)..].join("\n")
            );
        }
        let reset = || match self.reset() {
            Ok(()) => true,
            Err(e) => {
                // Shown with a failing test's output.
                eprintln!("Kafka broker on port {}: not reused: {e}", self.port);
                false
            }
        };
        if self.reusable && !std::thread::panicking() && self.broker_alive() && reset() {
            if shared::park(self) {
                // Its watchdog (dropped with this value) keeps it for the run.
                return;
            }
            // Not parked, a broker of the pool's directory is killed: kept
            // in this process, its watchdog would keep it after the process
            // ended, for nobody.
            let in_shared_dir = shared::dir().is_some_and(|p| self.dir.starts_with(p));
            let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
            if pool.len() < POOL_MAX && !in_shared_dir {
                pool.push(Kafka {
                    port: self.port,
                    controller_port: self.controller_port,
                    proxied: self.proxied,
                    dir: std::mem::take(&mut self.dir),
                    proc: self.proc.take(),
                    adopted: self.adopted.take(),
                    reusable: true,
                });
                return;
            }
        }
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The run's pool of reset brokers shared by its test processes (see the
/// module): entries `<pool>/parked/<port>` holding `port controller_port
/// pid dir`, written whole (a rename) and taken by a rename into
/// `<pool>/taken/`, so each parked broker has one taker.
mod shared {
    use std::path::{Path, PathBuf};

    use super::Kafka;

    /// The pool this process uses instead of the environment's: `Some(None)`
    /// none, `Some(Some((dir, owner)))` that one (the pool's own test).
    static FORCED: std::sync::Mutex<Option<Option<(PathBuf, u32)>>> = std::sync::Mutex::new(None);

    fn forced() -> Option<Option<(PathBuf, u32)>> {
        FORCED.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Uses `pool` instead of the environment's for the rest of the
    /// process (`None`: no shared pool).
    #[cfg(test)]
    pub(super) fn force(pool: Option<(PathBuf, u32)>) {
        *FORCED.lock().unwrap_or_else(|e| e.into_inner()) = Some(pool);
    }

    /// The pool's directory, when the run has one.
    pub(super) fn dir() -> Option<PathBuf> {
        match forced() {
            Some(pool) => pool.map(|(d, _)| d),
            None => std::env::var_os("FERRY_TEST_BROKER_POOL").map(PathBuf::from),
        }
    }

    /// The pid of the run that owns the pool (its brokers die with it).
    pub(super) fn owner() -> Option<u32> {
        match forced() {
            Some(pool) => pool.map(|(_, o)| o),
            None => std::env::var("FERRY_TEST_BROKER_POOL_OWNER").ok()?.parse().ok(),
        }
    }

    /// Parks reset broker `k` for the run's test processes: true when it
    /// did (its directory is the pool's, its watchdog waits for the owner,
    /// and fewer than [`super::SHARED_POOL_MAX`] are parked).
    pub(super) fn park(k: &mut Kafka) -> bool {
        let (Some(pool), Some(_)) = (dir(), owner()) else {
            return false;
        };
        if !k.dir.starts_with(&pool) {
            return false;
        }
        let Some(pid) = k.proc.as_ref().map(|w| w.server_pid()).or(k.adopted) else {
            return false;
        };
        let parked = pool.join("parked");
        if std::fs::create_dir_all(&parked).is_err() {
            return false;
        }
        let waiting = std::fs::read_dir(&parked).map(|d| d.count()).unwrap_or(usize::MAX);
        if waiting >= super::SHARED_POOL_MAX {
            return false;
        }
        let entry = format!("{} {} {} {}", k.port, k.controller_port, pid, k.dir.display());
        let tmp = pool.join(format!("parking-{}-{}", std::process::id(), k.port));
        if std::fs::write(&tmp, entry).is_err() || std::fs::rename(&tmp, parked.join(k.port.to_string())).is_err() {
            let _ = std::fs::remove_file(&tmp);
            return false;
        }
        // Dropping the watchdog's pipe leaves the broker to the owner.
        k.proc = None;
        k.adopted = None;
        k.dir = PathBuf::new();
        true
    }

    /// Whether `pid` runs the broker of log dir `dir` (not a process that
    /// took a dead broker's pid).
    pub(super) fn is_broker(pid: u32, dir: &Path) -> bool {
        let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            return false;
        };
        let needle = dir.join("server.properties");
        let needle = needle.as_os_str().as_encoded_bytes();
        crate::watchdog::pid_alive(pid) && cmdline.split(|b| *b == 0).any(|arg| arg == needle)
    }

    /// A parked broker of the run that is still alive, taken for this
    /// process; a dead one's entry and directory are removed.
    pub(super) fn take() -> Option<Kafka> {
        let pool = dir()?;
        owner()?;
        let taken = pool.join("taken");
        std::fs::create_dir_all(&taken).ok()?;
        for e in std::fs::read_dir(pool.join("parked")).ok()?.flatten() {
            let mine = taken.join(format!("{}-{}", e.file_name().to_string_lossy(), std::process::id()));
            if std::fs::rename(e.path(), &mine).is_err() {
                continue; // another process took it first
            }
            let entry = std::fs::read_to_string(&mine).unwrap_or_default();
            let _ = std::fs::remove_file(&mine);
            let mut f = entry.splitn(4, ' ');
            let (Some(port), Some(controller_port), Some(pid), Some(dir)) = (
                f.next().and_then(|p| p.parse().ok()),
                f.next().and_then(|p| p.parse().ok()),
                f.next().and_then(|p| p.parse::<u32>().ok()),
                f.next().map(Path::new),
            ) else {
                continue;
            };
            if !is_broker(pid, dir) {
                let _ = std::fs::remove_dir_all(dir);
                continue;
            }
            return Some(Kafka {
                port,
                controller_port,
                proxied: None,
                dir: dir.to_owned(),
                proc: None,
                adopted: Some(pid),
                reusable: true,
            });
        }
        None
    }
}

/// The socket inodes process `pid` holds open.
fn socket_inodes(pid: u32) -> std::collections::HashSet<u64> {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Default::default();
    };
    fds.flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .filter_map(|link| {
            let link = link.to_string_lossy().into_owned();
            link.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
        })
        .collect()
}

/// Removes the log dirs of brokers whose test process is gone: the
/// brokers a process kept for reuse are killed by their watchdogs when it
/// exits, but their directories are left (`ferry-kafka-<pid>-<port>`).
fn remove_dead_processes_dirs() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix("ferry-kafka-").and_then(|r| r.split('-').next()) else {
            continue;
        };
        if pid.parse::<u32>().is_ok() && !Path::new("/proc").join(pid).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// The storage tool's `bootstrap.checkpoint` kept for later formats, named
/// by the Kafka version (a home reinstalled in place with another version
/// does not reuse an older one).
fn template_checkpoint() -> PathBuf {
    kafka_home().join(format!("bootstrap-{}.checkpoint", kafka_version()))
}

/// Whether `log` is a whole Kafka log file: record batches (an 8-byte base
/// offset, a 4-byte length, then that many bytes, whose CRC-32C at bytes
/// 17..21 covers the rest from byte 21) that end exactly at its end, at
/// least one. A truncated, padded or damaged file is not.
fn whole_batches(log: &[u8]) -> bool {
    const CRC32C: crc::Crc<u32> = crc::Crc::<u32>::new(&crc::CRC_32_ISCSI);
    let mut at = 0usize;
    while at < log.len() {
        let Some(len) = log.get(at + 8..at + 12) else {
            return false;
        };
        let len = i32::from_be_bytes([len[0], len[1], len[2], len[3]]);
        let Ok(len) = usize::try_from(len) else {
            return false;
        };
        let (Some(stored), Some(covered)) = (log.get(at + 17..at + 21), log.get(at + 21..at + 12 + len)) else {
            return false;
        };
        if u32::from_be_bytes([stored[0], stored[1], stored[2], stored[3]]) != CRC32C.checksum(covered) {
            return false;
        }
        at += 12 + len;
    }
    at == log.len() && !log.is_empty()
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
    fn a_template_checkpoint_is_used_only_when_its_batches_fill_it() {
        // A batch of 20 bytes after its length: leader epoch, magic, the
        // CRC-32C of what follows it, then 11 bytes.
        let batch = |n: u8| {
            let mut b = 0i64.to_be_bytes().to_vec();
            b.extend_from_slice(&20i32.to_be_bytes());
            b.extend_from_slice(&[0, 0, 0, 0, 2]);
            let rest = vec![n; 11];
            let crc = crc::Crc::<u32>::new(&crc::CRC_32_ISCSI).checksum(&rest);
            b.extend_from_slice(&crc.to_be_bytes());
            b.extend(rest);
            b
        };
        let two = [batch(1), batch(2)].concat();
        assert!(whole_batches(&two));
        assert!(whole_batches(&batch(3)));
        assert!(!whole_batches(&two[..two.len() - 1]), "truncated");
        assert!(!whole_batches(&two[..30]), "cut inside a batch");
        assert!(!whole_batches(&[two.clone(), vec![0; 5]].concat()), "padded");
        assert!(!whole_batches(&[]), "empty");
        let mut flipped = two.clone();
        flipped[30] ^= 1;
        assert!(!whole_batches(&flipped), "a bit flipped inside a batch");
        let mut negative = batch(4);
        negative[8..12].copy_from_slice(&(-1i32).to_be_bytes());
        assert!(!whole_batches(&negative));
        // The storage tool's own, when this machine has made it.
        if let Ok(real) = std::fs::read(template_checkpoint()) {
            assert!(whole_batches(&real));
        }
    }

    #[test]
    fn cluster_ids_are_22_base64url_chars() {
        let id = cluster_id();
        assert_eq!(id.len(), 22, "{id}");
        assert!(id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'));
        assert_ne!(id, cluster_id());
        assert!((0..2000).all(|_| !cluster_id().starts_with('-')));
        assert_eq!(encode_cluster_id([0xfb; 16]), "-_v7-_v7-_v7-_v7-_v7-w");
    }

    /// A dropped broker comes back to the next start of the process with
    /// no topic and no group (the same port: not a new JVM), and one where
    /// a topic had a config of its own without it, even after a restart; a
    /// broker a client is still connected to, one a transactional producer
    /// used, one that was killed, or one started with settings of its own,
    /// is not reused. One test, so no other test of this binary takes the
    /// pooled broker meanwhile.
    #[test]
    fn a_dropped_broker_is_reused_empty_unless_it_kept_something_of_its_test() {
        if std::env::var_os("FERRY_TEST_FRESH_BROKERS").is_some() {
            return; // reuse is off by request: nothing to check
        }
        // This process's own pool first (the run's shared one would let
        // another test process take the dropped broker meanwhile).
        shared::force(None);
        let group_and_topic = |k: &Kafka| {
            k.create_topic("orders", 2);
            let c: BaseConsumer = ClientConfig::new()
                .set("bootstrap.servers", k.brokers())
                .set("group.id", "pool-test")
                .create()
                .unwrap();
            let mut tpl = rdkafka::TopicPartitionList::new();
            tpl.add_partition_offset("orders", 0, rdkafka::Offset::Offset(0))
                .unwrap();
            // The group's first commit on a new broker creates
            // `__consumer_offsets`; until the coordinator has loaded its
            // partition it answers `NotCoordinator` (seen once under load).
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                match c.commit(&tpl, rdkafka::consumer::CommitMode::Sync) {
                    Ok(()) => break,
                    Err(rdkafka::error::KafkaError::ConsumerCommit(code))
                        if coordinator_not_ready(code) && Instant::now() < deadline =>
                    {
                        // A poll interval: the loop ends on the coordinator's answer.
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    Err(e) => panic!("committing the group's offset: {e}"),
                }
            }
            c
        };
        let first = Kafka::start();
        let port = first.port();
        drop(group_and_topic(&first));
        drop(first);
        let second = Kafka::start();
        assert_eq!(second.port(), port, "the dropped broker is reused");
        let c = second.metadata_client();
        let md = c.fetch_metadata(None, Duration::from_secs(5)).unwrap();
        let topics: Vec<&str> = md
            .topics()
            .iter()
            .map(|t| t.name())
            .filter(|t| !t.starts_with("__"))
            .collect();
        assert!(topics.is_empty(), "topics left: {topics:?}");
        let groups = c.fetch_group_list(None, Duration::from_secs(5)).unwrap();
        assert!(groups.groups().is_empty(), "groups left");
        drop(c);
        // A client still connected when it is dropped: not reused.
        let leaked = group_and_topic(&second);
        drop(second);
        let third = Kafka::start();
        assert_ne!(third.port(), port, "a broker with a client connected is not reused");
        drop(leaked);
        // One where a topic had configs of its own is reused, the configs
        // removed with the topic: a restart (which replays the metadata
        // log) does not give them back to a new topic of that name.
        third.create_topic_with("small", 1, &[("max.message.bytes", "2000")]);
        let configured = third.port();
        drop(third);
        let mut reused = Kafka::start();
        assert_eq!(reused.port(), configured, "reused, its topic's configs removed");
        reused.restart();
        reused.create_topic("small", 1);
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", reused.brokers())
            .create()
            .unwrap();
        let described = futures::executor::block_on(
            admin.describe_configs(&[ResourceSpecifier::Topic("small")], &AdminOptions::new()),
        )
        .unwrap();
        let entries = &described[0].as_ref().unwrap().entries;
        assert!(
            entries.iter().all(|e| e.source != ConfigSource::DynamicTopic),
            "a new topic of that name has no config of the old one"
        );
        drop(admin);
        drop(reused);
        let fourth = Kafka::start();
        // Nor one a transactional producer used.
        let producer: rdkafka::producer::BaseProducer = ClientConfig::new()
            .set("bootstrap.servers", fourth.brokers())
            .set("transactional.id", "pool-test")
            .create()
            .unwrap();
        rdkafka::producer::Producer::init_transactions(&producer, Duration::from_secs(30)).unwrap();
        drop(producer);
        let transactional = fourth.port();
        drop(fourth);
        let mut fifth = Kafka::start();
        assert_ne!(fifth.port(), transactional, "a broker with transactions is not reused");
        // Nor a killed one.
        let killed = fifth.port();
        fifth.kill();
        drop(fifth);
        // Nor one started with settings of its own, which a plain start
        // must not inherit.
        let special = Kafka::start_with(&[("num.partitions", "2")]);
        assert_ne!(special.port(), killed, "a killed broker is not reused");
        let special_port = special.port();
        drop(special);
        assert_ne!(
            Kafka::start().port(),
            special_port,
            "a broker with its own settings is not reused"
        );

        // The run's shared pool, this process its owner: a dropped broker
        // is parked there, not kept in the process, and the next start
        // takes it as a broker of another process would (by its pid), reset.
        let pool = std::env::temp_dir().join(format!("ferry-test-broker-pool-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&pool);
        for mut k in std::mem::take(&mut *POOL.lock().unwrap()) {
            k.kill(); // not reused: the next start is the pool's
        }
        shared::force(Some((pool.clone(), std::process::id())));
        // An entry whose pid runs no broker of its dir (a dead broker's pid
        // reused: here this test process) is dropped, never taken.
        std::fs::create_dir_all(pool.join("parked")).unwrap();
        let stale = format!("1 2 {} {}", std::process::id(), pool.join("gone").display());
        std::fs::write(pool.join("parked").join("1"), stale).unwrap();
        let first = Kafka::start();
        assert!(
            first.adopted.is_none() && first.port() != 1,
            "a stale entry is not taken"
        );
        assert!(
            first.dir.starts_with(&pool),
            "a poolable broker lives in the pool's directory"
        );
        let port = first.port();
        drop(group_and_topic(&first));
        drop(first);
        assert!(
            POOL.lock().unwrap().iter().all(|k| k.port != port),
            "parked, not kept here"
        );
        assert!(
            pool.join("parked").join(port.to_string()).exists(),
            "parked in the pool"
        );
        let mut taken = Kafka::start();
        assert_eq!(taken.port(), port, "the parked broker is taken");
        let pid = taken.adopted.expect("taken by pid, as another process would");
        assert!(!pool.join("parked").join(port.to_string()).exists(), "one taker");
        let c = taken.metadata_client();
        let md = c.fetch_metadata(None, Duration::from_secs(5)).unwrap();
        assert!(
            md.topics().iter().all(|t| t.name().starts_with("__")),
            "reset before parking"
        );
        drop(c);
        // A taken broker stops and restarts as one of this process would.
        taken.restart();
        assert!(!crate::watchdog::pid_alive(pid), "stopped by pid");
        assert!(taken.broker_alive());
        taken.kill();
        assert!(!taken.broker_alive());
        drop(taken);
        shared::force(None);
        let _ = std::fs::remove_dir_all(&pool);
    }

    #[test]
    fn the_pinned_version_is_read_from_the_pom() {
        assert!(kafka_version().starts_with("4."), "{}", kafka_version());
    }
}
