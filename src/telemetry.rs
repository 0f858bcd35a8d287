//! Trace context across the pipeline: accepting a run captures the current
//! span's W3C `traceparent` into the outbox row, the relay publishes it as a
//! Kafka header, and consumers continue it. Without an OpenTelemetry layer
//! the current span has no valid context and nothing is captured, so this
//! costs nothing when tracing export is not configured.
//!
//! With the `otlp` feature, [`init`] installs logging (text, or JSON with
//! `FERRY_LOG_FORMAT=json`) and, when `OTEL_EXPORTER_OTLP_ENDPOINT` is set,
//! OTLP span and metric exporters.

use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The W3C `traceparent` of the current tracing span, if it is recorded by
/// an OpenTelemetry layer.
pub fn current_traceparent() -> Option<String> {
    let cx = tracing::Span::current().context();
    let span = cx.span();
    let sc = span.span_context();
    if !sc.is_valid() {
        return None;
    }
    Some(format!(
        "00-{}-{}-{:02x}",
        sc.trace_id(),
        sc.span_id(),
        sc.trace_flags().to_u8()
    ))
}

/// Parses a W3C `traceparent` into a remote span context.
pub fn parse_traceparent(tp: &str) -> Option<SpanContext> {
    let mut parts = tp.split('-');
    let (version, trace, span, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if version != "00" || parts.next().is_some() || trace.len() != 32 || span.len() != 16 || flags.len() != 2 {
        return None;
    }
    let sc = SpanContext::new(
        TraceId::from_hex(trace).ok()?,
        SpanId::from_hex(span).ok()?,
        TraceFlags::new(u8::from_str_radix(flags, 16).ok()?),
        true,
        TraceState::default(),
    );
    sc.is_valid().then_some(sc)
}

/// Makes `span` a child of the producer's context in `traceparent` and links
/// it to the producer's span. Returns whether a valid context was found.
pub fn continue_trace(span: &tracing::Span, traceparent: Option<&str>) -> bool {
    let Some(sc) = traceparent.and_then(parse_traceparent) else {
        return false;
    };
    let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(sc.clone()));
    span.add_link(sc);
    true
}

/// Flushes and shuts the exporter down when dropped.
#[cfg(feature = "otlp")]
pub struct TelemetryGuard {
    provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
    meters: Option<opentelemetry_sdk::metrics::SdkMeterProvider>,
}

#[cfg(feature = "otlp")]
impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            let _ = p.shutdown();
        }
        if let Some(m) = self.meters.take() {
            let _ = m.shutdown();
        }
    }
}

/// Installs logging to stderr filtered by `RUST_LOG` (default
/// `default_level`), as JSON when `FERRY_LOG_FORMAT=json`, and exports spans
/// over OTLP/gRPC when `OTEL_EXPORTER_OTLP_ENDPOINT` is set.
#[cfg(feature = "otlp")]
pub fn init(service_name: &'static str, default_level: &str) -> TelemetryGuard {
    use opentelemetry::trace::TracerProvider as _;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;

    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default_level.into());
    let json = std::env::var("FERRY_LOG_FORMAT").as_deref() == Ok("json");
    let fmt = if json {
        tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
            .boxed()
    } else {
        tracing_subscriber::fmt::layer().with_writer(std::io::stderr).boxed()
    };
    let provider = std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT").ok().and_then(|_| {
        let exporter = opentelemetry_otlp::SpanExporter::builder().with_tonic().build().ok()?;
        let resource = opentelemetry_sdk::Resource::builder()
            .with_service_name(service_name)
            .build();
        Some(
            opentelemetry_sdk::trace::SdkTracerProvider::builder()
                .with_batch_exporter(exporter)
                .with_resource(resource)
                .build(),
        )
    });
    let otel = provider
        .as_ref()
        .map(|p| tracing_opentelemetry::layer().with_tracer(p.tracer(service_name)));
    let _ = tracing_subscriber::registry()
        .with(filter)
        .with(fmt)
        .with(otel)
        .try_init();
    // Metrics under the same names as the Prometheus endpoints.
    let meters = std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT").ok().and_then(|_| {
        let exporter = opentelemetry_otlp::MetricExporter::builder()
            .with_tonic()
            .build()
            .ok()?;
        let resource = opentelemetry_sdk::Resource::builder()
            .with_service_name(service_name)
            .build();
        let meters = opentelemetry_sdk::metrics::SdkMeterProvider::builder()
            .with_periodic_exporter(exporter)
            .with_resource(resource)
            .build();
        opentelemetry::global::set_meter_provider(meters.clone());
        Some(meters)
    });
    TelemetryGuard { provider, meters }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparents_round_trip() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let sc = parse_traceparent(tp).unwrap();
        assert_eq!(
            format!("00-{}-{}-{:02x}", sc.trace_id(), sc.span_id(), sc.trace_flags().to_u8()),
            tp
        );
        assert!(parse_traceparent("00-00000000000000000000000000000000-00f067aa0ba902b7-01").is_none());
        assert!(parse_traceparent("garbage").is_none());
        assert_eq!(current_traceparent(), None, "no OpenTelemetry layer, nothing captured");
    }
}
