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
    /// Cancelled when a producer failed fatally: `/readyz` fails,
    /// the relay drains and `Relay::run` returns an error.
    pub fatal: CancellationToken,
    /// The producers of `--streams`' further streams (each has its own), for
    /// the relay's periodic read of their fatal error beside the shared one.
    pub stream_producers: StreamProducers,
}

/// The further streams' producers (see [`RelayState::stream_producers`]).
#[derive(Default)]
pub struct StreamProducers(std::sync::Mutex<Vec<rdkafka::producer::FutureProducer>>);

impl StreamProducers {
    /// Keeps `p` for [`StreamProducers::fatal_error`].
    pub fn add(&self, p: rdkafka::producer::FutureProducer) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(p);
    }

    /// The first fatal error one of them raised, if any.
    pub fn fatal_error(&self) -> Option<(rdkafka::types::RDKafkaErrorCode, String)> {
        use rdkafka::producer::Producer as _;
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find_map(|p| p.client().fatal_error())
    }
}

impl std::fmt::Debug for StreamProducers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.0.lock().map(|v| v.len()).unwrap_or_default();
        write!(f, "StreamProducers({n})")
    }
}
