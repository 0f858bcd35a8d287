//! The parts of a running relay that its tasks share: the store, the
//! metrics, its lease identity, readiness and the fatal-error signal. The
//! HTTP endpoints, the lane tasks and WAL capture read it; the service
//! builds it. Kept apart so that none of them imports the service.

use std::sync::atomic::AtomicBool;

use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::store::RelayStore;

/// A running relay's shared parts, for the HTTP endpoints and tests.
#[derive(Debug)]
pub struct RelayState {
    /// The relay's database side (pool, clock, its queries).
    pub store: RelayStore,
    /// The relay's metrics, rendered on `/metrics` and mirrored to
    /// OpenTelemetry; the lane tasks count into them.
    pub metrics: Metrics,
    /// This relay's lease identity.
    pub owner: String,
    /// Set once the first lane tick succeeded.
    pub ready: AtomicBool,
    /// Cancelled when the shared producer failed fatally: `/readyz` fails,
    /// the relay drains and `Relay::run` returns an error.
    pub fatal: CancellationToken,
}
