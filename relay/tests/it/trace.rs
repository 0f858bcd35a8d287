//! One trace from end to end: a request span accepts a run, the outbox row
//! keeps its traceparent, the relay publishes it, and the consumer's span is a
//! child of (and linked to) the request span. Spans go to the SDK's
//! in-memory exporter. In both capture modes.

use std::sync::OnceLock;
use std::time::Duration;

use ferry::NewRun;
use ferry_consumer::{Consumer, Handler, HandlerError, Record};
use ferry_relay::Capture;
use ferry_testkit::Kafka;
use futures::future::BoxFuture;
use opentelemetry::trace::TraceContextExt;
use opentelemetry_sdk::metrics::{InMemoryMetricExporter, SdkMeterProvider};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use serde_json::json;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::support::*;

struct Exporters {
    spans: InMemorySpanExporter,
    tracer: SdkTracerProvider,
    metrics: InMemoryMetricExporter,
    meters: SdkMeterProvider,
}

fn exporters() -> &'static Exporters {
    static CELL: OnceLock<Exporters> = OnceLock::new();
    CELL.get_or_init(|| {
        let Tracing { spans, tracer } = tracing_layers();
        TRACE_ON.store(true, std::sync::atomic::Ordering::Relaxed);
        let (spans, tracer) = (spans.clone(), tracer.clone());
        let metrics = InMemoryMetricExporter::default();
        let meters = SdkMeterProvider::builder()
            .with_periodic_exporter(metrics.clone())
            .build();
        opentelemetry::global::set_meter_provider(meters.clone());
        Exporters {
            spans,
            tracer,
            metrics,
            meters,
        }
    })
}

struct Noop;
impl Handler for Noop {
    fn handle<'a>(&'a self, _r: &'a Record, _tx: &'a mut ferry::Tx) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async { Ok(()) })
    }
}

async fn one_trace_from_request_to_consumer(capture: Capture) {
    let Exporters {
        spans: exporter,
        tracer: provider,
        metrics: metric_exporter,
        meters,
    } = exporters();
    let broker = Kafka::start();
    broker.create_topic("ferry.run-events", 1);
    let (ferry, url) = pg_ferry().await;

    let request = tracing::info_span!("http.request");
    let request_cx = request.context().span().span_context().clone();
    assert!(
        request_cx.is_valid(),
        "the OpenTelemetry layer records the request span"
    );
    let run = async {
        ferry
            .create_run_idempotent(NewRun::new("acme", "charge", "traced", json!({"a": 1})))
            .await
            .unwrap()
    }
    .instrument(request.clone())
    .await
    .run;
    let stored: Option<String> = sqlx::query_scalar("SELECT traceparent FROM outbox")
        .fetch_one(ferry.db().as_postgres().unwrap())
        .await
        .unwrap();
    let expected = format!("00-{}-{}-01", request_cx.trace_id(), request_cx.span_id());
    assert_eq!(
        stored.as_deref(),
        Some(expected.as_str()),
        "acceptance captured the request's context"
    );

    let (lane, key, payload): (i32, String, Vec<u8>) = sqlx::query_as("SELECT lane, key, payload FROM outbox")
        .fetch_one(ferry.db().as_postgres().unwrap())
        .await
        .unwrap();
    let payload = String::from_utf8(payload).unwrap();

    let (cfg, guard) = config_for(capture, &url, &broker.brokers()).await;
    let relay = guard.start(cfg, ferry.clone()).await;
    let consumer = Consumer::builder(ferry.clone(), broker.brokers(), "traced-group", &["ferry.run-events"])
        .handler(Noop)
        .kafka("session.timeout.ms", "6000")
        .build()
        .unwrap();
    let metrics = consumer.metrics();
    let stop = tokio_util::sync::CancellationToken::new();
    let s = stop.clone();
    let consuming = tokio::spawn(consumer.run(async move { s.cancelled().await }));
    let start = std::time::Instant::now();
    while metrics.processed.get() < 1 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the record was never consumed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The same metric names reach OpenTelemetry as Prometheus.
    meters.force_flush().unwrap();
    let names: std::collections::BTreeSet<String> = metric_exporter
        .get_finished_metrics()
        .unwrap()
        .iter()
        .flat_map(|rm| {
            rm.scope_metrics()
                .flat_map(|sm| sm.metrics().map(|m| m.name().to_owned()))
                .collect::<Vec<_>>()
        })
        .collect();
    let (_, prometheus) = http_get(relay.addr, "/metrics").await;
    for name in [
        "ferry_relay_published",
        "ferry_relay_backlog_rows",
        "ferry_relay_publish_latency_seconds",
        "ferry_consumer_processed",
    ] {
        assert!(names.contains(name), "{name} missing from OpenTelemetry: {names:?}");
    }
    for name in [
        "ferry_relay_published_total",
        "ferry_relay_backlog_rows",
        "ferry_relay_publish_latency_seconds",
    ] {
        assert!(prometheus.contains(name), "{name} missing from /metrics");
    }
    assert!(metrics.render().contains("ferry_consumer_processed_total"));
    stop.cancel();
    consuming.await.unwrap().unwrap();
    relay.shutdown().await;
    drop(request);
    let _ = provider.force_flush();

    let spans = exporter.get_finished_spans().unwrap();
    let consume = spans
        .iter()
        .find(|s| s.name == "ferry.consume" && s.span_context.trace_id() == request_cx.trace_id())
        .unwrap_or_else(|| panic!("no consumer span in the request's trace (run {})", run.run_id));
    assert_eq!(
        consume.parent_span_id,
        request_cx.span_id(),
        "the consumer continues the request span"
    );
    assert!(
        consume
            .links
            .links
            .iter()
            .any(|l| l.span_context.span_id() == request_cx.span_id()),
        "and links to the producer's span"
    );

    // The relay's batch span names the lane, never the key or the payload.
    // Other tests share the exporter: every batch span is checked, and one
    // must be of this row's lane. (Polled lanes only: WAL capture has no
    // lanes and no batch span.)
    if capture == Capture::Wal {
        return;
    }
    let batches: Vec<_> = spans.iter().filter(|s| s.name == "ferry.relay.batch").collect();
    assert!(
        batches.iter().any(|s| s
            .attributes
            .iter()
            .any(|a| a.key.as_str() == "lane" && a.value == opentelemetry::Value::I64(i64::from(lane)))),
        "no ferry.relay.batch span with lane {lane}"
    );
    for batch in &batches {
        let keys: Vec<&str> = batch.attributes.iter().map(|a| a.key.as_str()).collect();
        for field in ["lane", "generation", "first_id", "last_id", "count", "mode", "outcome"] {
            assert!(keys.contains(&field), "batch span without {field}: {keys:?}");
        }
        for a in &batch.attributes {
            let value = a.value.as_str();
            assert!(
                !matches!(a.key.as_str(), "key" | "payload") && !value.contains(&payload) && !value.contains(&key),
                "the batch span carries a key or a payload: {} = {value}",
                a.key
            );
        }
    }
}

in_both_capture_modes!(one_trace_from_request_to_consumer);
