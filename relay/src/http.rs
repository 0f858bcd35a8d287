//! `/healthz` (the process is up), `/readyz` (the database answers and the
//! relay has taken part in lane management) and Prometheus `/metrics`.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use tokio_util::sync::CancellationToken;

use crate::state::RelayState;

/// Serves until `stop` is cancelled.
pub async fn serve(listener: tokio::net::TcpListener, state: Arc<RelayState>, stop: CancellationToken) {
    let app = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics))
        .with_state(state);
    let _ = axum::serve(listener, app)
        .with_graceful_shutdown(async move { stop.cancelled().await })
        .await;
}

async fn ready(State(state): State<Arc<RelayState>>) -> impl IntoResponse {
    if state.ready.load(Ordering::Relaxed)
        && !state.fatal.is_cancelled()
        && state.store.ferry().operator().outbox_dead_count().await.is_ok()
    {
        (StatusCode::OK, "ready")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready")
    }
}

async fn metrics(State(state): State<Arc<RelayState>>) -> impl IntoResponse {
    state.refresh_gauges().await;
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.render(),
    )
}
