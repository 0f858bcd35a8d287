//! The consumer's metrics as typed handles, in Prometheus text format and,
//! under the same names, through OpenTelemetry (the global meter provider; a
//! no-op unless `ferry::telemetry::init` installed one).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// A partition label.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PartitionLabel {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
}

/// Every consumer metric, prefixed `ferry_consumer_`.
#[derive(Debug)]
pub struct Metrics {
    /// The registry.
    pub registry: Registry,
    /// Records whose effects committed.
    pub processed: Counter,
    /// Records skipped as duplicates by the ledger.
    pub duplicates: Counter,
    /// Records sent to the dead-letter topic.
    pub dead_lettered: Counter,
    /// Failed attempts to dead-letter a record (the dead-letter publish or
    /// its ledger write failed); the record is retried, never passed over.
    pub dead_letter_failures: Counter,
    /// Attempts at a record that failed on an infrastructure error (the
    /// database, not the record: see [`crate::error::classify`]); each is
    /// retried, its partition paused, without spending the record's budget.
    /// While it grows the consumer is waiting out an outage.
    pub infrastructure_retries: Counter,
    /// Partition leases lost (a commit refused).
    pub lease_losses: Counter,
    /// Reclaims put off because another member held a live lease.
    pub reclaims_deferred: Counter,
    /// Micro-batch transactions that failed: a record's handler, or the
    /// connection, `BEGIN`, the partition lock, the batch's ledger rows, the
    /// offset or the commit (an unknown commit outcome counts too). A batch
    /// stopped by a record without an effect key, or with one its ledger
    /// statement may refuse, runs no transaction and is not counted.
    pub batches_rolled_back: Counter,
    /// Records behind the high watermark, per partition.
    pub lag: Family<PartitionLabel, Gauge>,
    /// Handler time in seconds.
    pub handler_latency: Histogram,
    otel_latency: opentelemetry::metrics::Histogram<f64>,
    otel_lag: opentelemetry::metrics::Gauge<i64>,
    _observed: Vec<opentelemetry::metrics::ObservableCounter<u64>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every metric.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("ferry_consumer");
        let meter = opentelemetry::global::meter("ferry-consumer");
        let m = Metrics {
            registry: Registry::default(),
            processed: Counter::default(),
            duplicates: Counter::default(),
            dead_lettered: Counter::default(),
            dead_letter_failures: Counter::default(),
            infrastructure_retries: Counter::default(),
            lease_losses: Counter::default(),
            reclaims_deferred: Counter::default(),
            batches_rolled_back: Counter::default(),
            lag: Family::default(),
            handler_latency: Histogram::new([0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0]),
            otel_latency: meter
                .f64_histogram("ferry_consumer_handler_latency_seconds")
                .with_unit("s")
                .build(),
            otel_lag: meter.i64_gauge("ferry_consumer_lag").build(),
            _observed: Vec::new(),
        };
        registry.register("processed", "Records whose effects committed", m.processed.clone());
        registry.register("duplicates", "Records skipped as duplicates", m.duplicates.clone());
        registry.register(
            "dead_lettered",
            "Records sent to the dead-letter topic",
            m.dead_lettered.clone(),
        );
        registry.register(
            "dead_letter_failures",
            "Failed attempts to dead-letter a record (publish or ledger write); retried in place",
            m.dead_letter_failures.clone(),
        );
        registry.register(
            "infrastructure_retries",
            "Record attempts failed on an infrastructure error; retried in place without spending the record's budget",
            m.infrastructure_retries.clone(),
        );
        registry.register("lease_losses", "Partition leases lost", m.lease_losses.clone());
        registry.register(
            "reclaims_deferred",
            "Reclaims of a lost partition put off: another member holds a live lease",
            m.reclaims_deferred.clone(),
        );
        registry.register(
            "batches_rolled_back",
            "Micro-batch transactions that failed (a record's handler, the connection, the lock, the ledger rows, the offset or the commit)",
            m.batches_rolled_back.clone(),
        );
        registry.register("lag", "Records behind the high watermark", m.lag.clone());
        registry.register("handler_latency_seconds", "Handler time", m.handler_latency.clone());
        let observed = [
            ("ferry_consumer_processed", m.processed.clone()),
            ("ferry_consumer_duplicates", m.duplicates.clone()),
            ("ferry_consumer_dead_lettered", m.dead_lettered.clone()),
            ("ferry_consumer_dead_letter_failures", m.dead_letter_failures.clone()),
            (
                "ferry_consumer_infrastructure_retries",
                m.infrastructure_retries.clone(),
            ),
            ("ferry_consumer_lease_losses", m.lease_losses.clone()),
            ("ferry_consumer_reclaims_deferred", m.reclaims_deferred.clone()),
            ("ferry_consumer_batches_rolled_back", m.batches_rolled_back.clone()),
        ]
        .into_iter()
        .map(|(name, c)| {
            meter
                .u64_observable_counter(name)
                .with_callback(move |o| o.observe(c.get(), &[]))
                .build()
        })
        .collect();
        Metrics {
            registry,
            _observed: observed,
            ..m
        }
    }

    /// Records one handler (or micro-batch) duration.
    pub fn observe_handler(&self, secs: f64) {
        self.handler_latency.observe(secs);
        self.otel_latency.record(secs, &[]);
    }

    /// Sets a partition's lag.
    pub fn set_lag(&self, topic: &str, partition: i32, lag: i64) {
        self.lag
            .get_or_create(&PartitionLabel {
                topic: topic.to_owned(),
                partition,
            })
            .set(lag);
        self.otel_lag.record(
            lag,
            &[
                opentelemetry::KeyValue::new("topic", topic.to_owned()),
                opentelemetry::KeyValue::new("partition", i64::from(partition)),
            ],
        );
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}
