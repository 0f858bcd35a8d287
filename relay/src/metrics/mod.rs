//! The relay's metrics as typed handles, exposed in Prometheus text format
//! on `/metrics` and, under the same names, through OpenTelemetry (the global
//! meter provider; a no-op unless `ferry::telemetry::init` installed one).
//! Its own are `ferry_relay_*`; the job gauges it refreshes beside its table
//! gauges, since a relay runs beside every service, are `ferry_jobs_*`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::{AtomicU64, Ordering};

mod gauges;
mod timings;

use gauges::status_label;
pub use gauges::{JobGauges, WalSlotGauges};
pub use timings::Timings;

/// Label of an error counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabel {
    /// The classified error code.
    pub code: String,
}

/// Label of a WAL capture slot's gauges.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SlotLabel {
    /// The replication slot.
    pub slot: String,
}

/// Label of a slot's `wal_status` gauge (1 for the status it has now).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SlotStatusLabel {
    /// The replication slot.
    pub slot: String,
    /// PostgreSQL's `wal_status` (`reserved`, `extended`, `unreserved`,
    /// `lost`), or `dropped` when the slot no longer exists.
    pub wal_status: String,
}

/// Label of a job gauge.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueLabel {
    /// The job queue.
    pub queue: String,
}

/// Every relay metric.
#[derive(Debug)]
pub struct Metrics {
    /// The registry rendered on `/metrics`.
    pub registry: Registry,
    /// Rows published and acknowledged.
    pub published: Counter,
    /// WAL capture: streamed rows delivered already (an earlier session
    /// marked them before the slot was confirmed past them, or exactly once,
    /// a committed Kafka transaction holds them), skipped, not produced.
    pub wal_marked_skipped: Counter,
    /// WAL capture: replication sessions ended, by why (`shutdown`,
    /// `slot_in_use`, a reseed's or a retry's code, such as
    /// `replication_silent` for a connection taken for dead).
    pub wal_sessions_ended: Family<CodeLabel, Counter>,
    /// WAL capture, exactly once: PostgreSQL transactions that could not
    /// be published within the Kafka transaction's timeout.
    pub wal_transactions_too_large: Counter,
    /// Publish errors by code.
    pub publish_errors: Family<CodeLabel, Counter>,
    /// Rows marked dead by this relay.
    pub dead: Counter,
    /// Dead rows in the table (set at scrape).
    pub dead_rows: Gauge,
    /// Pending rows (set at scrape).
    pub backlog: Gauge,
    /// Age of the oldest pending row in seconds (set at scrape).
    pub oldest_pending_age: Gauge<f64, std::sync::atomic::AtomicU64>,
    /// Lanes this relay holds.
    pub lanes_owned: Gauge,
    /// Lane leases lost (taken over by another relay).
    pub lease_losses: Counter,
    /// Renewals that found this relay's leases had lapsed (no renewal for
    /// longer than the lease) and kept them, no other relay having taken
    /// the lanes: a relay starved of CPU or cut off from the database.
    pub lease_lapses: Counter,
    /// Lanes whose exactly-once takeover (fencing, reading and marking the
    /// last progress record) has not finished: nothing of them is published
    /// meanwhile.
    pub lanes_taking_over: Gauge,
    /// Takeovers that found another producer's transaction open on the
    /// lane's progress partition and waited for it before publishing.
    pub takeover_waits: Counter,
    /// Fatal producer errors (the relay then drains and exits non-zero so its
    /// orchestrator restarts it with a new producer).
    pub producer_fatal: Counter,
    /// Seconds from commit to broker acknowledgement: from the
    /// transaction's commit timestamp in WAL capture (the Begin message
    /// carries it), from the row's `created_at` in poll capture and for
    /// WAL capture's catch-up pages.
    pub publish_latency: Histogram,
    /// The WAL capture slots of this schema, from `pg_replication_slots`
    /// (set at scrape and every few seconds): see [`WalSlotGauges`].
    pub wal_slots: WalSlotGauges,
    /// The job queues' signals (set at scrape and every few seconds): see
    /// [`JobGauges`].
    pub jobs: JobGauges,
    /// OpenTelemetry instruments mirroring the ones above.
    otel: Otel,
    /// The latest commit-to-ack samples (ms), for exact quantiles in the demo
    /// and benchmarks; bounded (the newest [`LATENCY_SAMPLES`] are kept).
    pub latency_samples: std::sync::Mutex<Vec<i64>>,
    /// Where a lane's time goes (reads, batches, marks), for benchmarks.
    pub timings: Timings,
    /// Where the next sample goes once the ring is full.
    latency_next: AtomicU64,
}

/// How many commit-to-ack samples are kept (a ring: the newest win).
pub const LATENCY_SAMPLES: usize = 100_000;

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers the relay's own metrics under the `ferry_relay_` prefix and
    /// the job gauges under `ferry_jobs_`.
    pub fn new() -> Self {
        let mut root = Registry::default();
        let m = Metrics {
            published: Counter::default(),
            wal_marked_skipped: Counter::default(),
            wal_sessions_ended: Family::default(),
            wal_transactions_too_large: Counter::default(),
            publish_errors: Family::default(),
            dead: Counter::default(),
            dead_rows: Gauge::default(),
            backlog: Gauge::default(),
            oldest_pending_age: Gauge::default(),
            lanes_owned: Gauge::default(),
            lease_losses: Counter::default(),
            lease_lapses: Counter::default(),
            lanes_taking_over: Gauge::default(),
            takeover_waits: Counter::default(),
            producer_fatal: Counter::default(),
            wal_slots: WalSlotGauges::default(),
            jobs: JobGauges::default(),
            publish_latency: Histogram::new([0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]),
            registry: Registry::default(),
            latency_samples: std::sync::Mutex::new(Vec::new()),
            otel: Otel::default(),
            timings: Timings::default(),
            latency_next: AtomicU64::new(0),
        };
        let registry = root.sub_registry_with_prefix("ferry_relay");
        registry.register(
            "published",
            "Rows published and acknowledged by the broker",
            m.published.clone(),
        );
        registry.register(
            "publish_errors",
            "Publish errors by classified code",
            m.publish_errors.clone(),
        );
        registry.register(
            "wal_marked_skipped",
            "WAL capture: streamed rows delivered already (marked by an earlier session, or in a committed Kafka transaction), skipped instead of produced again",
            m.wal_marked_skipped.clone(),
        );
        registry.register(
            "wal_sessions_ended",
            "WAL capture: replication sessions ended, by code",
            m.wal_sessions_ended.clone(),
        );
        registry.register(
            "wal_transactions_too_large",
            "WAL capture, exactly once: PostgreSQL transactions too large to publish within transaction.timeout.ms",
            m.wal_transactions_too_large.clone(),
        );
        registry.register("dead", "Rows this relay marked dead", m.dead.clone());
        registry.register("dead_rows", "Dead rows in the outbox", m.dead_rows.clone());
        registry.register("backlog_rows", "Pending outbox rows", m.backlog.clone());
        registry.register(
            "oldest_pending_age_seconds",
            "Age of the oldest pending row",
            m.oldest_pending_age.clone(),
        );
        registry.register("lanes_owned", "Lanes this relay holds", m.lanes_owned.clone());
        registry.register(
            "lease_losses",
            "Lane leases lost to another relay",
            m.lease_losses.clone(),
        );
        registry.register(
            "lease_lapses",
            "Renewals that found the lane leases lapsed and kept them (no other relay took the lanes)",
            m.lease_lapses.clone(),
        );
        registry.register(
            "lanes_taking_over",
            "Lanes whose exactly-once takeover has not finished",
            m.lanes_taking_over.clone(),
        );
        registry.register(
            "takeover_waits",
            "Exactly-once takeovers that waited for another producer's open transaction on the progress topic",
            m.takeover_waits.clone(),
        );
        registry.register(
            "producer_fatal",
            "Fatal producer errors; the relay exits to be restarted",
            m.producer_fatal.clone(),
        );
        registry.register(
            "publish_latency_seconds",
            "Seconds from commit to broker acknowledgement",
            m.publish_latency.clone(),
        );
        let w = &m.wal_slots;
        registry.register(
            "wal_slot_lag_bytes",
            "WAL a capture slot holds back: the current position minus its confirmed one",
            w.lag_bytes.clone(),
        );
        registry.register(
            "wal_slot_lag_seconds",
            "How long the oldest outbox row not yet delivered has waited (the slot's time lag)",
            w.lag_seconds.clone(),
        );
        registry.register(
            "wal_slot_active",
            "1 while a relay streams from the capture slot",
            w.active.clone(),
        );
        registry.register(
            "wal_slot_safe_wal_size_bytes",
            "WAL that may still be written before PostgreSQL invalidates the slot (absent when unbounded)",
            w.safe_wal_size.clone(),
        );
        registry.register(
            "wal_slot_status",
            "1 for the capture slot's wal_status (reserved, extended, unreserved, lost, dropped)",
            w.status.clone(),
        );
        let jobs = root.sub_registry_with_prefix("ferry_jobs");
        jobs.register(
            "oldest_due_age_seconds",
            "How long the queue's oldest due queued job has waited since its available_at",
            m.jobs.oldest_due_age.clone(),
        );
        jobs.register(
            "expired_leases",
            "Leased jobs whose lease expired and that no claim has taken back yet",
            m.jobs.expired_leases.clone(),
        );
        jobs.register("dead", "Dead jobs in the queue", m.jobs.dead.clone());
        let otel = Otel::new(&m);
        Metrics {
            registry: root,
            otel,
            ..m
        }
    }

    /// Counts a WAL capture session's end under `code`.
    pub fn wal_session_ended(&self, code: &str) {
        self.wal_sessions_ended
            .get_or_create(&CodeLabel { code: code.to_owned() })
            .inc();
    }

    /// Counts a classified publish error under `code`.
    pub fn publish_error(&self, code: &str) {
        self.publish_errors
            .get_or_create(&CodeLabel { code: code.to_owned() })
            .inc();
        if let Some(c) = &self.otel.publish_errors {
            c.add(1, &[opentelemetry::KeyValue::new("code", code.to_owned())]);
        }
    }

    /// Records one commit-to-ack latency.
    pub fn observe_latency(&self, ms: i64) {
        self.publish_latency.observe(ms.max(0) as f64 / 1000.0);
        if let Some(h) = &self.otel.publish_latency {
            h.record(ms.max(0) as f64 / 1000.0, &[]);
        }
        let mut s = self.latency_samples.lock().unwrap_or_else(|p| p.into_inner());
        if s.len() < LATENCY_SAMPLES {
            s.push(ms.max(0));
        } else {
            let at = self.latency_next.fetch_add(1, Ordering::Relaxed) as usize % LATENCY_SAMPLES;
            s[at] = ms.max(0);
        }
    }

    /// Forgets the recorded latency samples (after a benchmark's warm-up).
    pub fn reset_latency(&self) {
        self.latency_samples.lock().unwrap_or_else(|p| p.into_inner()).clear();
        self.latency_next.store(0, Ordering::Relaxed);
    }

    /// The `q` quantile (0..=1) of the recorded latencies, in ms.
    pub fn latency_quantile(&self, q: f64) -> Option<i64> {
        let mut s = self.latency_samples.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if s.is_empty() {
            return None;
        }
        s.sort_unstable();
        Some(s[((s.len() - 1) as f64 * q.clamp(0.0, 1.0)) as usize])
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// The OpenTelemetry side: counters and gauges are observed from the
/// Prometheus handles at collection time; errors and latency are recorded
/// directly. Names match the Prometheus ones (without the `_total` suffix
/// Prometheus adds to counters).
#[derive(Debug, Default)]
struct Otel {
    publish_errors: Option<opentelemetry::metrics::Counter<u64>>,
    publish_latency: Option<opentelemetry::metrics::Histogram<f64>>,
    _observed: Vec<Box<dyn std::any::Any + Send + Sync>>,
}

impl Otel {
    fn new(m: &Metrics) -> Otel {
        let meter = opentelemetry::global::meter("ferry-relay");
        let mut observed: Vec<Box<dyn std::any::Any + Send + Sync>> = Vec::new();
        for (name, counter) in [
            ("ferry_relay_published", m.published.clone()),
            ("ferry_relay_dead", m.dead.clone()),
            ("ferry_relay_lease_losses", m.lease_losses.clone()),
            ("ferry_relay_lease_lapses", m.lease_lapses.clone()),
            ("ferry_relay_takeover_waits", m.takeover_waits.clone()),
            ("ferry_relay_producer_fatal", m.producer_fatal.clone()),
        ] {
            observed.push(Box::new(
                meter
                    .u64_observable_counter(name)
                    .with_callback(move |o| o.observe(counter.get(), &[]))
                    .build(),
            ));
        }
        for (name, gauge) in [
            ("ferry_relay_backlog_rows", m.backlog.clone()),
            ("ferry_relay_dead_rows", m.dead_rows.clone()),
            ("ferry_relay_lanes_owned", m.lanes_owned.clone()),
            ("ferry_relay_lanes_taking_over", m.lanes_taking_over.clone()),
        ] {
            observed.push(Box::new(
                meter
                    .i64_observable_gauge(name)
                    .with_callback(move |o| o.observe(gauge.get(), &[]))
                    .build(),
            ));
        }
        let age = m.oldest_pending_age.clone();
        observed.push(Box::new(
            meter
                .f64_observable_gauge("ferry_relay_oldest_pending_age_seconds")
                .with_callback(move |o| o.observe(age.get(), &[]))
                .build(),
        ));
        type Pick = fn(&ferry::operator::WalSlot) -> Option<f64>;
        let picks: [(&'static str, Pick); 4] = [
            ("ferry_relay_wal_slot_lag_bytes", |s| Some(s.lag_bytes as f64)),
            ("ferry_relay_wal_slot_lag_seconds", |s| Some(s.lag_ms as f64 / 1000.0)),
            ("ferry_relay_wal_slot_active", |s| Some(f64::from(u8::from(s.active)))),
            ("ferry_relay_wal_slot_safe_wal_size_bytes", |s| {
                s.safe_wal_size.map(|n| n as f64)
            }),
        ];
        for (name, pick) in picks {
            let latest = m.wal_slots.latest.clone();
            observed.push(Box::new(
                meter
                    .f64_observable_gauge(name)
                    .with_callback(move |o| {
                        for s in latest.lock().unwrap_or_else(|p| p.into_inner()).iter() {
                            if let Some(v) = pick(s) {
                                o.observe(v, &[opentelemetry::KeyValue::new("slot", s.slot.clone())]);
                            }
                        }
                    })
                    .build(),
            ));
        }
        type PickJob = fn(&ferry::QueueGauges) -> f64;
        let job_picks: [(&'static str, PickJob); 3] = [
            ("ferry_jobs_oldest_due_age_seconds", |q| {
                q.oldest_due_age_ms as f64 / 1000.0
            }),
            ("ferry_jobs_expired_leases", |q| q.expired_leases as f64),
            ("ferry_jobs_dead", |q| q.dead as f64),
        ];
        for (name, pick) in job_picks {
            let latest = m.jobs.latest.clone();
            observed.push(Box::new(
                meter
                    .f64_observable_gauge(name)
                    .with_callback(move |o| {
                        for q in latest.lock().unwrap_or_else(|p| p.into_inner()).iter() {
                            o.observe(pick(q), &[opentelemetry::KeyValue::new("queue", q.queue.clone())]);
                        }
                    })
                    .build(),
            ));
        }
        let latest = m.wal_slots.latest.clone();
        observed.push(Box::new(
            meter
                .u64_observable_gauge("ferry_relay_wal_slot_status")
                .with_callback(move |o| {
                    for s in latest.lock().unwrap_or_else(|p| p.into_inner()).iter() {
                        let status = status_label(s);
                        o.observe(
                            1,
                            &[
                                opentelemetry::KeyValue::new("slot", s.slot.clone()),
                                opentelemetry::KeyValue::new("wal_status", status),
                            ],
                        );
                    }
                })
                .build(),
        ));
        Otel {
            publish_errors: Some(meter.u64_counter("ferry_relay_publish_errors").build()),
            publish_latency: Some(
                meter
                    .f64_histogram("ferry_relay_publish_latency_seconds")
                    .with_unit("s")
                    .build(),
            ),
            _observed: observed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A benchmark prints the stage timings of its measured window beside
    /// the latency of that window: the warm-up's must not be in them.
    #[test]
    fn the_stage_timings_start_again_after_a_reset() {
        let t = Timings::default();
        Timings::add(&t.marks, &t.mark_ns, std::time::Duration::from_millis(3));
        Timings::add(
            &t.wal_hand_waits,
            &t.wal_hand_wait_ns,
            std::time::Duration::from_secs(2),
        );
        t.wal_acked.fetch_add(7, Ordering::Relaxed);
        t.mark_retries.fetch_add(1, Ordering::Relaxed);
        t.reset();
        assert_eq!(t.summary(), Timings::default().summary());
    }

    /// Series names as Prometheus stores them, from a rendering's `# TYPE`
    /// lines: a counter gains `_total`, a histogram `_bucket`, `_sum` and
    /// `_count`. Every sample line of the rendering must be one of them.
    fn series_names(rendered: &str) -> std::collections::BTreeSet<String> {
        let mut names = std::collections::BTreeSet::new();
        for line in rendered.lines() {
            let Some(rest) = line.strip_prefix("# TYPE ") else {
                continue;
            };
            let (name, kind) = rest.split_once(' ').expect("a TYPE line names a kind");
            match kind {
                "counter" => {
                    names.insert(format!("{name}_total"));
                }
                "gauge" => {
                    names.insert(name.to_owned());
                }
                "histogram" => names.extend(["_bucket", "_sum", "_count"].map(|s| format!("{name}{s}"))),
                other => panic!("{name}: a {other} has no rule here"),
            }
        }
        for line in rendered.lines().filter(|l| !l.starts_with('#') && !l.is_empty()) {
            let sample = line.split(['{', ' ']).next().unwrap_or_default();
            assert!(names.contains(sample), "{sample} is not derived from a TYPE line");
        }
        names
    }

    /// deploy/prometheus/metrics.txt lists what the alert rules and the
    /// Grafana dashboard may name (scripts/check-promql.py): it must be
    /// exactly what the relay's and the consumer's registries render.
    #[test]
    fn the_metric_list_matches_the_registries() {
        let relay = Metrics::new();
        relay.publish_error("broker_unreachable");
        relay.wal_session_ended("replication_silent");
        relay.observe_latency(12);
        // Families render only once they have a member.
        relay.wal_slots.set(&[ferry::operator::WalSlot {
            slot: "ferry_main".into(),
            active: true,
            streamed_by: None,
            present: true,
            lag_bytes: 0,
            lag_ms: 0,
            wal_status: Some("reserved".into()),
            safe_wal_size: Some(1),
        }]);
        relay.jobs.set(&[ferry::QueueGauges {
            queue: "default".into(),
            oldest_due_age_ms: 0,
            expired_leases: 0,
            dead: 0,
        }]);
        let consumer = ferry_consumer::metrics::Metrics::new();
        consumer.set_lag("t", 0, 1);
        consumer.observe_handler(0.01);
        let mut rendered = series_names(&relay.render());
        rendered.extend(series_names(&consumer.render()));
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/prometheus/metrics.txt");
        let listed: std::collections::BTreeSet<String> = std::fs::read_to_string(path)
            .expect("deploy/prometheus/metrics.txt")
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .map(|l| l.trim().to_owned())
            .collect();
        let missing: Vec<_> = rendered.difference(&listed).collect();
        let stale: Vec<_> = listed.difference(&rendered).collect();
        assert!(
            missing.is_empty() && stale.is_empty(),
            "deploy/prometheus/metrics.txt disagrees with the code: exported but not listed {missing:?}, listed but not exported {stale:?}"
        );
    }
}
