//! The completer: one task that commits finished attempts' completions in
//! batches.

use backon::{ExponentialBuilder, Retryable};
use serde_json::Value;
use tokio::sync::{mpsc, oneshot};

use crate::error::{Error, Result};
use crate::jobs::Lease;
use crate::Ferry;

/// A finished handler's result on its way to the completer, and where to
/// send the outcome.
pub(super) type Completion = (Lease, Value, oneshot::Sender<Result<()>>);

/// Completes finished jobs in batches: whatever queued up while the previous
/// commit ran goes into the next one, so completions share commits under load
/// without delaying a lone job.
pub(super) async fn completer(ferry: Ferry, mut rx: mpsc::Receiver<Completion>, max_batch: usize) {
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        while batch.len() < max_batch {
            match rx.try_recv() {
                Ok(item) => batch.push(item),
                Err(_) => break,
            }
        }
        let items: Vec<(Lease, Value)> = batch.iter().map(|(l, v, _)| (l.clone(), v.clone())).collect();
        let outcome = (|| async { ferry.complete_batch(&items).await })
            .retry(ExponentialBuilder::default().with_max_times(5))
            .when(Error::is_transient)
            .await;
        match outcome {
            Ok(results) => {
                for ((_, _, reply), r) in batch.into_iter().zip(results) {
                    let _ = reply.send(r);
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, code = e.code(), size = items.len(), "batch completion failed; completing one by one");
                for (lease, value, reply) in batch {
                    let one = (|| async { ferry.complete(&lease, &value).await })
                        .retry(ExponentialBuilder::default().with_max_times(5))
                        .when(Error::is_transient)
                        .await;
                    let _ = reply.send(one);
                }
            }
        }
    }
}
