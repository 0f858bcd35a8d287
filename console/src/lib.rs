//! The operator web console (`ferry console`): server-rendered pages over the
//! same database a service, its workers, relays and consumers share.
//!
//! - **Overview**: outbox backlog and oldest pending age per lane, dead rows,
//!   lane owners and generations, live relays, jobs by queue and state,
//!   consumer partitions with owners, generations and stored offsets, and a
//!   plot of backlog and throughput from the [`sampler`].
//! - **Runs**: search, and one run's lineage.
//! - **Dead**: dead outbox rows and dead jobs grouped by error code.
//! - **Actions** (POST with a CSRF token, a reason, audited with the token's
//!   name as actor): replay a dead outbox row or group, replay a dead job,
//!   cancel a run, pause or resume a queue. Each is the library call the
//!   `ferry` command line makes.
//!
//! Security: [`auth`] (bearer token or `HttpOnly`, `SameSite=Strict` session
//! cookie; tenant scopes; the `payloads` permission), a strict CSP with no
//! inline script or style, and the headers in [`web`]. The binary binds
//! 127.0.0.1 unless told otherwise.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use ferry::Ferry;
use tokio_util::sync::CancellationToken;

mod actions;
pub mod auth;
mod error;
mod extract;
mod guard;
mod pages;
pub mod sampler;
pub mod store;
mod web;

pub use auth::{Principal, Tokens};
pub use error::ConsoleError;
pub use web::CSP;

/// How the console runs.
#[derive(Debug, Clone)]
pub struct ConsoleConfig {
    /// The accepted tokens.
    pub tokens: Tokens,
    /// How often the sampler reads the outbox for the plot.
    pub sample_every: Duration,
    /// How many samples the ring keeps (the plot's width).
    pub samples: usize,
    /// Every how many samples the jobs census is retaken (it reads every
    /// job; see [`sampler::Census`]).
    pub census_every: u32,
    /// How long a login session lasts.
    pub session_ttl: Duration,
    /// Mark the session cookie `Secure` (set when TLS is terminated in front).
    pub secure_cookie: bool,
}

impl ConsoleConfig {
    /// Defaults around `tokens`: a sample every 5 s, 120 kept (10 minutes),
    /// a jobs census every 6 samples (30 s), 12-hour sessions, no `Secure` flag (plain HTTP on loopback).
    pub fn new(tokens: Tokens) -> ConsoleConfig {
        ConsoleConfig {
            tokens,
            sample_every: Duration::from_secs(5),
            samples: 120,
            census_every: 6,
            session_ttl: Duration::from_secs(12 * 3600),
            secure_cookie: false,
        }
    }
}

pub(crate) struct Inner {
    pub(crate) ferry: Ferry,
    pub(crate) store: store::ConsoleStore,
    pub(crate) auth: auth::Auth,
    pub(crate) sampler: sampler::Sampler,
    pub(crate) secure_cookie: bool,
    sample_every: Duration,
    census_every: u32,
}

/// Shared state of the handlers.
pub(crate) type AppState = Arc<Inner>;

/// The console: its state and router. Cheap to clone.
#[derive(Clone)]
pub struct Console {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Console {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Console").finish_non_exhaustive()
    }
}

impl Console {
    /// A console over `ferry`'s database (PostgreSQL or SQLite).
    /// [`ConsoleError::Config`] for a `sample_every` of zero or over
    /// [`ferry::time::MAX_DURATION`] (the sampling timer cannot run on it).
    pub fn new(ferry: Ferry, config: ConsoleConfig) -> Result<Console, ConsoleError> {
        if config.sample_every.is_zero() || config.sample_every > ferry::time::MAX_DURATION {
            return Err(ConsoleError::Config(
                "sample_every must be more than zero and at most 100 years".into(),
            ));
        }
        Ok(Console {
            inner: Arc::new(Inner {
                store: store::ConsoleStore::new(ferry.clone()),
                ferry,
                auth: auth::Auth::new(config.tokens, config.session_ttl),
                sampler: sampler::Sampler::new(config.samples),
                secure_cookie: config.secure_cookie,
                sample_every: config.sample_every,
                census_every: config.census_every.max(1),
            }),
        })
    }

    /// The HTTP routes (for serving, or for driving in-process in tests).
    pub fn router(&self) -> axum::Router {
        web::router(self.inner.clone())
    }

    /// The console's read queries (the conformance test prepares them all).
    pub fn store(&self) -> &store::ConsoleStore {
        &self.inner.store
    }

    /// Takes one sample now (the serving loop does this every
    /// `sample_every`).
    pub async fn sample(&self) -> ferry::Result<sampler::Sample> {
        self.inner.sampler.sample(&self.inner.store).await
    }

    /// Retakes the jobs census now (the serving loop does this every
    /// `census_every` samples).
    pub async fn census(&self) -> ferry::Result<sampler::Census> {
        self.inner.sampler.take_census(&self.inner.store).await
    }

    /// Serves on `listener` until `shutdown` completes, sampling in the
    /// background; in-flight requests finish first.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let stop = CancellationToken::new();
        let sampling = {
            let me = self.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(me.inner.sample_every);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                for n in 0u64.. {
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        _ = tick.tick() => {
                            if let Err(e) = me.sample().await {
                                tracing::warn!(code = e.code(), "console sampler: {e}");
                            }
                            if n % u64::from(me.inner.census_every) == 0 {
                                if let Err(e) = me.inner.sampler.take_census(&me.inner.store).await {
                                    tracing::warn!(code = e.code(), "console jobs census: {e}");
                                }
                            }
                        }
                    }
                }
            })
        };
        if let Ok(addr) = listener.local_addr() {
            tracing::info!(%addr, "console listening");
        }
        let served = axum::serve(listener, self.router())
            .with_graceful_shutdown(shutdown)
            .await;
        stop.cancel();
        let _ = sampling.await;
        served
    }
}
