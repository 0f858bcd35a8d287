//! Relay configuration: flags and environment variables (clap), one field per
//! setting an operator may need to change.

use std::net::SocketAddr;
use std::time::Duration;

use ferry::time::parse_duration;

use crate::error::RelayError;

mod checks;

pub use checks::check_identifier;
use checks::{check_template, escape_part, weakens_delivery, MAX_TOPIC_NAME};

/// What the relay does with a record Kafka will never accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnPoison {
    /// Mark the row `dead` with its error code and keep the lane going.
    Dead,
    /// Keep the row pending and stop the lane: strict ordering over progress.
    Block,
}

/// How the relay finds committed outbox rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Capture {
    /// PostgreSQL logical replication of the outbox table (`pgoutput`):
    /// transactions arrive in commit order, without reading the table.
    Wal,
    /// Lanes leased by relay instances and read through the pending index:
    /// SQLite, and PostgreSQL roles that may not replicate.
    Poll,
}

/// Settings of `ferry-relay run` (and the relay inside `demo`).
#[derive(Debug, Clone, clap::Args)]
pub struct RelayConfig {
    /// Database URL (`postgres://…` or `sqlite://…`).
    #[arg(long, env = "DATABASE_URL")]
    pub database_url: String,
    /// Kafka bootstrap servers.
    #[arg(long, env = "FERRY_BROKERS", default_value = "127.0.0.1:9092")]
    pub brokers: String,
    /// Any librdkafka producer property, `key=value`; repeatable. Applied
    /// last, but never weakening delivery: `acks` other than `all`,
    /// `enable.idempotence=false`, more than 5 in-flight requests and (at
    /// least once) a finite `message.timeout.ms` are refused at startup.
    /// Values may contain commas (a multi-host
    /// `bootstrap.servers`); in `FERRY_KAFKA`, separate pairs with `;`.
    #[arg(long = "kafka", value_parser = parse_kv, env = "FERRY_KAFKA", value_delimiter = ';')]
    pub kafka: Vec<(String, String)>,
    /// Most lanes this instance holds (the database fixes the lane count).
    #[arg(long, env = "FERRY_MAX_LANES", default_value_t = 1024)]
    pub max_lanes: u32,
    /// Rows per batch and lane.
    #[arg(long, env = "FERRY_BATCH_SIZE", default_value_t = 500)]
    pub batch_size: u32,
    /// Longest wait for new rows when no notification arrives.
    #[arg(long, env = "FERRY_POLL_INTERVAL", value_parser = parse_duration, default_value = "500ms")]
    pub poll_interval: Duration,
    /// Lane lease duration; renewed every third of it.
    #[arg(long, env = "FERRY_LEASE", value_parser = parse_duration, default_value = "15s")]
    pub lease: Duration,
    /// Shutdown grace: in-flight batches finish and are marked within it.
    #[arg(long, env = "FERRY_GRACE", value_parser = parse_duration, default_value = "10s")]
    pub grace: Duration,
    /// Kafka topic of a row: `{topic}` and `{tenant}` are replaced. The
    /// Debezium outbox router's default is `outbox.event.{topic}` (the row's
    /// topic plays `aggregatetype`, its key `aggregateid`).
    #[arg(long, env = "FERRY_TOPIC_TEMPLATE", default_value = "{topic}")]
    pub topic_template: String,
    /// What to do with a record Kafka will never accept.
    #[arg(long, env = "FERRY_ON_POISON", value_enum, default_value_t = OnPoison::Dead)]
    pub on_poison: OnPoison,
    /// Delete rows once acknowledged instead of marking them delivered.
    #[arg(long, env = "FERRY_DELETE_ON_DELIVERY")]
    pub delete_on_delivery: bool,
    /// How long delivered rows are kept before the sweeper deletes them.
    #[arg(long, env = "FERRY_RETENTION", value_parser = parse_duration, default_value = "1h")]
    pub retention: Duration,
    /// `compression.type` of the producer.
    #[arg(long, env = "FERRY_COMPRESSION", default_value = "lz4")]
    pub compression: String,
    /// Address of `/healthz`, `/readyz` and `/metrics`.
    #[arg(long, env = "FERRY_LISTEN", default_value = "127.0.0.1:9464")]
    pub listen: SocketAddr,
    /// This instance's identity in lane leases (default: a fresh id).
    #[arg(long, env = "FERRY_RELAY_ID")]
    pub relay_id: Option<String>,
    /// Exactly-once into Kafka: each lane publishes through a transactional
    /// producer (`transactional.id = <prefix>-lane-<n>`) and writes the ids it
    /// published to the progress topic in the same Kafka transaction, so a
    /// `read_committed` reader sees every row once even across crashes.
    #[arg(long, env = "FERRY_EXACTLY_ONCE")]
    pub exactly_once: bool,
    /// Prefix of the lanes' `transactional.id`s; the same on every relay of
    /// one database, unique per database.
    #[arg(long, env = "FERRY_TRANSACTIONAL_ID_PREFIX", default_value = "ferry-relay")]
    pub transactional_id_prefix: String,
    /// Compacted topic holding each lane's last transaction (key = database
    /// id and lane), one partition per lane; created when missing
    /// (`--exactly-once` only). Default: `<transactional id prefix>.progress`.
    #[arg(long, env = "FERRY_PROGRESS_TOPIC")]
    pub progress_topic: Option<String>,
    /// `wal` or `poll`. Default on PostgreSQL: `wal` when the role may
    /// replicate, `wal_level=logical` and the URL is direct (not through a
    /// transaction pooler, `pgbouncer=true`, which refuses `wal`), else
    /// `poll` (one log line says why); SQLite always polls, and refuses
    /// `wal`.
    #[arg(long, env = "FERRY_CAPTURE", value_enum)]
    pub capture: Option<Capture>,
    /// Replication slot of `--capture wal`: one per relay group, shared by
    /// its standbys (PostgreSQL lets one of them stream at a time). Default:
    /// `ferry_<first 12 hex digits of the database id>`. Lowercase letters,
    /// digits and `_`, at most 63.
    #[arg(long, env = "FERRY_SLOT")]
    pub slot: Option<String>,
    /// Publication of `--capture wal` (on `outbox`, inserts only), created
    /// at start when missing. Default: the slot's name. Lowercase letters,
    /// digits and `_`, at most 63.
    #[arg(long, env = "FERRY_PUBLICATION")]
    pub publication: Option<String>,
    /// A Debezium connector's configuration (Kafka Connect JSON or
    /// `.properties`) whose outbox `EventRouter` the relay plays: WAL
    /// capture of the table in `table.include.list`, each insert published
    /// as the record Debezium 3.6.1 makes of it (topic, key, value bytes,
    /// headers), at least once. Default slot and publication: the
    /// connector's (`slot.name`, `publication.name`), so the relay takes
    /// over where the connector stopped. See
    /// docs/migrating-from-debezium.md.
    #[arg(long, env = "FERRY_DEBEZIUM_CONFIG")]
    pub debezium_config: Option<std::path::PathBuf>,
    /// `--capture wal`: how many streams the outbox is split into, by lane
    /// (`lane % N`), each a slot and a row-filtered publication of its own
    /// (`<slot>_<k>of<N>`; one stream keeps the slot's own name). A key
    /// stays in one stream, in commit order. The relays of a group spread
    /// the streams evenly and take over a dead relay's; the last relay
    /// started with another N sets the group's (the others stand by,
    /// until restarted with it). 1 to 64, at most the lane count;
    /// PostgreSQL 15+.
    #[arg(long, env = "FERRY_STREAMS", default_value_t = 1)]
    pub streams: u32,
}

/// The most streams `--streams` takes (each holds a walsender and a slot).
pub const MAX_STREAMS: u32 = 64;

impl RelayConfig {
    /// A configuration with the defaults above.
    pub fn new(database_url: impl Into<String>, brokers: impl Into<String>) -> Self {
        RelayConfig {
            database_url: database_url.into(),
            brokers: brokers.into(),
            kafka: Vec::new(),
            max_lanes: 1024,
            batch_size: 500,
            poll_interval: Duration::from_millis(500),
            lease: Duration::from_secs(15),
            grace: Duration::from_secs(10),
            topic_template: "{topic}".into(),
            on_poison: OnPoison::Dead,
            delete_on_delivery: false,
            retention: Duration::from_secs(3600),
            compression: "lz4".into(),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            relay_id: None,
            exactly_once: false,
            transactional_id_prefix: "ferry-relay".into(),
            progress_topic: None,
            capture: None,
            slot: None,
            publication: None,
            debezium_config: None,
            streams: 1,
        }
    }

    /// Checks values a typo could make dangerous.
    pub fn validate(&self) -> Result<(), RelayError> {
        if self.batch_size == 0 || self.batch_size > 100_000 {
            return Err(RelayError::Config("batch size must be 1 to 100000".into()));
        }
        if self.lease < Duration::from_millis(300) {
            return Err(RelayError::Config("lease must be at least 300ms".into()));
        }
        // Zero would poll the database in a busy loop.
        if self.poll_interval.is_zero() {
            return Err(RelayError::Config("poll interval must be at least 1ms".into()));
        }
        for (name, d) in [
            ("poll interval", self.poll_interval),
            ("lease", self.lease),
            ("grace", self.grace),
            ("retention", self.retention),
        ] {
            if d > ferry::time::MAX_DURATION {
                return Err(RelayError::Config(format!("{name} must be at most 100 years")));
            }
        }
        check_template(&self.topic_template)?;
        for (what, name) in [("--slot", &self.slot), ("--publication", &self.publication)] {
            if let Some(name) = name {
                check_identifier(what, name)?;
            }
        }
        for (k, v) in &self.kafka {
            weakens_delivery(k, v, self.exactly_once)?;
        }
        if self.exactly_once && (self.transactional_id_prefix.is_empty() || self.progress_topic().is_empty()) {
            return Err(RelayError::Config(
                "--exactly-once needs a transactional id prefix and a progress topic".into(),
            ));
        }
        if self.exactly_once {
            self.check_transaction_timeout()?;
        }
        if !(1..=MAX_STREAMS).contains(&self.streams) {
            return Err(RelayError::Config(format!("--streams must be 1 to {MAX_STREAMS}")));
        }
        if self.streams > 1 && self.capture == Some(Capture::Poll) {
            return Err(RelayError::Config(
                "--streams splits WAL capture; polled lanes are already parallel (--capture poll takes no --streams)"
                    .into(),
            ));
        }
        if self.debezium_config.is_some() {
            if self.streams > 1 {
                return Err(RelayError::Config(
                    "--debezium-config streams from the connector's one slot; --streams is not supported with it"
                        .into(),
                ));
            }
            if self.exactly_once {
                return Err(RelayError::Config(
                    "--debezium-config publishes at least once; --exactly-once is not supported with it".into(),
                ));
            }
            if self.capture == Some(Capture::Poll) {
                return Err(RelayError::Config(
                    "--debezium-config reads the WAL; --capture poll is not supported with it".into(),
                ));
            }
        }
        Ok(())
    }

    /// Exactly once, librdkafka refuses a transactional producer whose
    /// `message.timeout.ms` (30 s unless overridden) exceeds its
    /// `transaction.timeout.ms`: refused here at startup, instead of on
    /// every session or lane takeover.
    fn check_transaction_timeout(&self) -> Result<(), RelayError> {
        // The last override of any of a setting's names wins, as in
        // librdkafka (`delivery.timeout.ms` is `message.timeout.ms`).
        let ms = |keys: &[&str], default: u64| {
            self.kafka
                .iter()
                .rev()
                .find(|(k, _)| keys.contains(&k.trim()))
                .map_or(Ok(default), |(_, v)| v.trim().parse::<u64>())
        };
        let (Ok(message), Ok(transaction)) = (
            ms(&["message.timeout.ms", "delivery.timeout.ms"], 30_000),
            ms(&["transaction.timeout.ms"], 60_000),
        ) else {
            return Err(RelayError::Config(
                "--kafka message.timeout.ms and transaction.timeout.ms take milliseconds".into(),
            ));
        };
        if message == 0 || message > transaction {
            return Err(RelayError::Config(format!(
                "--exactly-once needs message.timeout.ms ({message}) between 1 and transaction.timeout.ms ({transaction})"
            )));
        }
        Ok(())
    }

    /// The progress topic (`--exactly-once`): `--progress-topic`, or
    /// `<transactional id prefix>.progress`, so deployments with different
    /// prefixes never share one by default.
    pub fn progress_topic(&self) -> String {
        self.progress_topic
            .clone()
            .unwrap_or_else(|| format!("{}.progress", self.transactional_id_prefix))
    }

    /// The `transactional.id` of `lane` (`--exactly-once`).
    pub fn transactional_id(&self, lane: i32) -> String {
        format!("{}-lane-{lane}", self.transactional_id_prefix)
    }

    /// The `transactional.id` of WAL capture from `slot` (`--exactly-once
    /// --capture wal`): one producer per slot, which has one reader at a time.
    pub fn wal_transactional_id(&self, slot: &str) -> String {
        format!("{}-wal-{slot}", self.transactional_id_prefix)
    }

    /// The Kafka topic for a row. With `{tenant}` in the template, both
    /// parts are escaped so that different (topic, tenant) pairs never share
    /// a Kafka topic, not even under Kafka's rule that `.` and `_` collide,
    /// and a tenant's name never makes an illegal one: ASCII letters and
    /// digits stay, `-` becomes `--`, `.` becomes `-d`, `_` becomes `-u`, `:`
    /// becomes `-c`, any other byte `-xHH`. Escaped parts hold neither `.`
    /// nor `_`, and [`RelayConfig::validate`] requires a `.` in the template
    /// text between placeholders, so the routed name splits back one way
    /// only. A name longer than Kafka's 249 characters keeps its first 230
    /// and ends in `-h` and a 16-hex-digit FNV-1a hash of the whole name.
    /// Without `{tenant}` the topic is used as it is.
    pub fn route(&self, topic: &str, tenant: &str) -> String {
        if !self.topic_template.contains("{tenant}") {
            return self.topic_template.replace("{topic}", topic);
        }
        let name = self
            .topic_template
            .replace("{topic}", &escape_part(topic))
            .replace("{tenant}", &escape_part(tenant));
        if name.len() <= MAX_TOPIC_NAME {
            return name;
        }
        let hash = name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        format!("{}-h{hash:016x}", &name[..230])
    }
}

/// Parses a `--kafka` override, `key=value` (both trimmed; the key not
/// empty). Anything else is [`RelayError::Config`].
fn parse_kv(s: &str) -> Result<(String, String), RelayError> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| RelayError::Config(format!("expected key=value, got {s:?}")))?;
    if k.trim().is_empty() {
        return Err(RelayError::Config(format!("no key before '=' in {s:?}")));
    }
    Ok((k.trim().to_owned(), v.trim().to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    use proptest::prelude::*;

    proptest! {
        /// A `--kafka` override is a non-empty key and a value, or `config`.
        #[test]
        fn any_override_text_parses_or_is_a_config_error(s in any::<String>()) {
            match parse_kv(&s) {
                Ok((k, v)) => {
                    prop_assert!(!k.is_empty() && k == k.trim() && v == v.trim());
                    prop_assert!(s.contains('='));
                }
                Err(e) => prop_assert_eq!(e.code(), "config"),
            }
        }

        /// Every flag of `ferry-relay run`, with any value, is parsed and
        /// validated into a usable configuration or refused with a typed
        /// error (clap's, or `config`), never a panic.
        #[test]
        fn any_flags_parse_and_validate_or_are_refused(
            flags in prop::collection::vec(
                (
                    prop::sample::select(vec![
                        "--max-lanes", "--batch-size", "--poll-interval", "--lease", "--grace",
                        "--retention", "--topic-template", "--on-poison", "--compression",
                        "--listen", "--kafka", "--relay-id", "--transactional-id-prefix",
                        "--progress-topic",
                    ]),
                    prop_oneof![
                        any::<String>(),
                        "[0-9]{1,25}(ms|s|m|h|d)?",
                        "-?[0-9]{1,12}",
                        "\\{(topic|tenant)\\}[._-]?\\{(topic|tenant)\\}",
                    ],
                ),
                0..6,
            )
        ) {
            use clap::Parser;
            #[derive(clap::Parser)]
            struct Cli {
                #[command(flatten)]
                relay: RelayConfig,
            }
            let mut args = vec!["relay".to_owned(), "--database-url".into(), "sqlite://x".into()];
            for (flag, value) in flags {
                args.push(format!("{flag}={value}"));
            }
            if let Ok(cli) = Cli::try_parse_from(&args) {
                if let Err(e) = cli.relay.validate() {
                    prop_assert_eq!(e.code(), "config");
                }
            }
        }
    }

    #[test]
    fn routes_and_kafka_overrides() {
        let mut c = RelayConfig::new("sqlite://x", "b");
        c.topic_template = "outbox.event.{topic}".into();
        assert_eq!(c.route("order", "acme"), "outbox.event.order");
        assert!(parse_kv("linger.ms=5").is_ok());
        assert!(parse_kv("nope").is_err());
    }

    #[test]
    fn tenant_templates_never_collide_or_make_illegal_names() {
        let mut c = RelayConfig::new("sqlite://x", "b");
        c.topic_template = "{topic}.{tenant}".into();
        assert!(c.validate().is_ok());
        assert_ne!(c.route("a.b", "c"), c.route("a", "b.c"));
        assert_ne!(c.route("a-d", "c"), c.route("a.", "c"));
        // Kafka treats '.' and '_' as the same character when it checks
        // for colliding topics: normalized names must differ too.
        let kafka = |n: String| n.replace('_', ".");
        assert_ne!(kafka(c.route("a_", "b")), kafka(c.route("a", "_b")));
        assert_ne!(kafka(c.route("a.b", "c")), kafka(c.route("a_b", "c")));
        assert_eq!(c.route("orders", "acme"), "orders.acme");
        let name = c.route("orders", "team:eu_1");
        assert_eq!(name, "orders.team-ceu-u1");
        let long = c.route(&"t".repeat(128), &":".repeat(128));
        assert!(long.len() <= 249, "{}", long.len());
        assert_ne!(long, c.route(&"t".repeat(128), &":".repeat(127)));
        assert!(name
            .chars()
            .all(|ch| ch.is_ascii_alphanumeric() || matches!(ch, '.' | '_' | '-')));
        for bad in [
            "{tenant}{topic}",
            "{tenant}-{topic}",
            "{topic}_{tenant}",
            "{tenant}:{topic}",
            "{topic}.{region}",
        ] {
            c.topic_template = bad.into();
            assert!(c.validate().is_err(), "{bad} accepted");
        }
        c.topic_template = "outbox.event.{topic}".into();
        assert!(c.validate().is_ok());
        assert_eq!(
            c.route("a.b", "t:1"),
            "outbox.event.a.b",
            "without {{tenant}} the topic is kept as is"
        );
    }

    #[test]
    fn overrides_never_weaken_delivery() {
        let with = |k: &str, v: &str| {
            let mut c = RelayConfig::new("sqlite://x", "b");
            c.kafka = vec![(k.into(), v.into())];
            c.validate().map_err(|e| e.code())
        };
        assert_eq!(with("acks", "1"), Err("config"));
        assert_eq!(with("acks", "0"), Err("config"));
        assert_eq!(with("enable.idempotence", "false"), Err("config"));
        assert_eq!(with("max.in.flight", "6"), Err("config"));
        assert_eq!(with("max.in.flight.requests.per.connection", "100"), Err("config"));
        assert_eq!(with("transactional.id", "mine"), Err("config"));
        assert_eq!(with("partitioner", "random"), Err("config"));
        assert_eq!(with("acks", "all"), Ok(()));
        assert_eq!(with("acks", "-1"), Ok(()));
        assert_eq!(with("max.in.flight", "5"), Ok(()));
        assert_eq!(with("linger.ms", "20"), Ok(()));
        assert_eq!(with("message.timeout.ms", "10000"), Err("config"));
        assert_eq!(with("delivery.timeout.ms", "300000"), Err("config"));
        assert_eq!(with("message.timeout.ms", "0"), Ok(()));
        let exactly_once = |k: &str, v: &str| {
            let mut c = RelayConfig::new("sqlite://x", "b");
            c.exactly_once = true;
            c.kafka = vec![(k.into(), v.into())];
            c.validate().map_err(|e| e.code())
        };
        assert_eq!(exactly_once("message.timeout.ms", "10000"), Ok(()));
        assert_eq!(exactly_once("transaction.timeout.ms", "20000"), Err("config"));
        assert_eq!(exactly_once("transaction.timeout.ms", "600000"), Ok(()));
        assert_eq!(exactly_once("transaction.timeout.ms", "soon"), Err("config"));
        assert_eq!(exactly_once("message.timeout.ms", "0"), Err("config"));
    }

    #[test]
    fn exactly_once_checks_the_delivery_timeout_alias_too() {
        // librdkafka's `delivery.timeout.ms` is `message.timeout.ms` by
        // another name: applied last, it would replace the relay's 30 s.
        let exactly_once = |kafka: &[(&str, &str)]| {
            let mut c = RelayConfig::new("sqlite://x", "b");
            c.exactly_once = true;
            c.kafka = kafka.iter().map(|(k, v)| ((*k).into(), (*v).into())).collect();
            c.validate().map_err(|e| e.code())
        };
        assert_eq!(exactly_once(&[("delivery.timeout.ms", "0")]), Err("config"));
        assert_eq!(exactly_once(&[("delivery.timeout.ms", "120000")]), Err("config"));
        assert_eq!(exactly_once(&[("delivery.timeout.ms", "10000")]), Ok(()));
        // The last of the two names wins, as in librdkafka.
        assert_eq!(
            exactly_once(&[("message.timeout.ms", "10000"), ("delivery.timeout.ms", "0")]),
            Err("config")
        );
        assert_eq!(
            exactly_once(&[("delivery.timeout.ms", "0"), ("message.timeout.ms", "10000")]),
            Ok(())
        );
    }

    #[test]
    fn slot_and_publication_names_are_plain_identifiers() {
        let with = |slot: &str| {
            let mut c = RelayConfig::new("sqlite://x", "b");
            c.slot = Some(slot.into());
            c.validate().map_err(|e| e.code())
        };
        assert_eq!(with("ferry_orders_1"), Ok(()));
        for bad in ["", "Orders", "a-b", "a\"; DROP TABLE outbox; --", &"s".repeat(64)] {
            assert_eq!(with(bad), Err("config"), "{bad:?} accepted");
        }
    }

    #[test]
    fn a_multi_host_bootstrap_override_keeps_its_commas() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            relay: RelayConfig,
        }
        let cli = Cli::try_parse_from([
            "relay",
            "--database-url",
            "sqlite://x",
            "--kafka",
            "bootstrap.servers=a:9092,b:9092,c:9092",
            "--kafka",
            "linger.ms=10",
        ])
        .unwrap();
        assert_eq!(
            cli.relay.kafka,
            vec![
                ("bootstrap.servers".to_owned(), "a:9092,b:9092,c:9092".to_owned()),
                ("linger.ms".to_owned(), "10".to_owned())
            ]
        );
    }
}
