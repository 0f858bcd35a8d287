//! Relay configuration: flags and environment variables (clap), one field per
//! setting an operator may need to change.

use std::net::SocketAddr;
use std::time::Duration;

use crate::error::RelayError;

/// What the relay does with a record Kafka will never accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnPoison {
    /// Mark the row `dead` with its error code and keep the lane going.
    Dead,
    /// Keep the row pending and stop the lane: strict ordering over progress.
    Block,
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
    /// Any librdkafka producer property, `key=value`; repeatable. Applied last.
    #[arg(long = "kafka", value_parser = parse_kv, env = "FERRY_KAFKA", value_delimiter = ',')]
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
    /// Compacted topic holding each lane's last transaction (key = lane), one
    /// partition per lane; created when missing (`--exactly-once` only).
    #[arg(long, env = "FERRY_PROGRESS_TOPIC", default_value = "ferry.relay-progress")]
    pub progress_topic: String,
}

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
            progress_topic: "ferry.relay-progress".into(),
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
        if !self.topic_template.contains("{topic}")
            && !self.topic_template.contains("{tenant}")
            && self.topic_template.contains('{')
        {
            return Err(RelayError::Config(
                "topic template may only use {topic} and {tenant}".into(),
            ));
        }
        if self.exactly_once && (self.transactional_id_prefix.is_empty() || self.progress_topic.is_empty()) {
            return Err(RelayError::Config(
                "--exactly-once needs a transactional id prefix and a progress topic".into(),
            ));
        }
        Ok(())
    }

    /// The `transactional.id` of `lane` (`--exactly-once`).
    pub fn transactional_id(&self, lane: i32) -> String {
        format!("{}-lane-{lane}", self.transactional_id_prefix)
    }

    /// The Kafka topic for a row.
    pub fn route(&self, topic: &str, tenant: &str) -> String {
        self.topic_template
            .replace("{topic}", topic)
            .replace("{tenant}", tenant)
    }
}

fn parse_kv(s: &str) -> Result<(String, String), String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("expected key=value, got {s:?}"))?;
    Ok((k.trim().to_owned(), v.trim().to_owned()))
}

/// Parses `250ms`, `15s`, `2m`, `1h`, or a bare number of milliseconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let n: u64 = n.parse().map_err(|_| format!("not a duration: {s:?}"))?;
    Ok(match unit {
        "" | "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n * 60),
        "h" => Duration::from_secs(n * 3600),
        "d" => Duration::from_secs(n * 86_400),
        _ => return Err(format!("unknown unit in {s:?}; use ms, s, m, h or d")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_routes() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert!(parse_duration("2 weeks").is_err());
        let mut c = RelayConfig::new("sqlite://x", "b");
        c.topic_template = "outbox.event.{topic}".into();
        assert_eq!(c.route("order", "acme"), "outbox.event.order");
        assert!(parse_kv("linger.ms=5").is_ok());
        assert!(parse_kv("nope").is_err());
    }
}
