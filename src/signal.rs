//! The signal a Ferry process stops on: the relay, the example consumer and
//! the operator's console pass [`shutdown_signal`] as the `shutdown` future
//! their `run` or `serve` takes, so the binaries stay thin and tests pass a
//! future of their own.

/// Resolves on SIGTERM (what Kubernetes and `docker stop` send) or Ctrl-C.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
