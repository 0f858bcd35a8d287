//! Dispatch by operation: one handler per operation, each of a typed command
//! deserialized from the run's request.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;

use futures::future::BoxFuture;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::{Handler, JobContext};
use crate::jobs::{Claimed, JobError};

/// The code of the terminal [`JobError`] a [`Router`] gives a request that
/// does not deserialize into its route's command type. Retrying cannot fix
/// the stored request, so the job dies on its first attempt; the code never
/// includes the payload.
pub const INVALID_COMMAND: &str = "invalid_command";

/// The code of the terminal [`JobError`] a [`Router`] gives a job whose
/// operation has no route.
pub const UNKNOWN_OPERATION: &str = "unknown_operation";

/// A route: turns the claimed job into the typed handler's future.
type Route = Box<dyn Fn(Claimed, JobContext) -> BoxFuture<'static, Result<Value, JobError>> + Send + Sync>;

/// A [`Handler`] that dispatches on the run's operation
/// ([`Claimed::operation`]) to a handler of a typed command, in the style of
/// River's and Oban's workers: each route deserializes [`Claimed::request`]
/// into its command type `T` (any [`DeserializeOwned`]) and calls its
/// handler with the command and the [`JobContext`]. The context carries
/// what the handler would otherwise read from [`Claimed`]: the lease
/// ([`JobContext::lease`]), the run ([`JobContext::run_id`]), the attempt
/// ([`JobContext::attempt`]) and the job's other facts.
///
/// Two failures are decided before any handler runs, both terminal (the job
/// dies on that attempt, and the `run_failed` event and attempt history
/// carry the code):
///
/// - a request that does not deserialize into `T` fails with
///   [`INVALID_COMMAND`]: the stored request never changes, so retrying
///   cannot fix it. Neither the error nor the log includes the payload.
/// - an operation with no route fails with [`UNKNOWN_OPERATION`]: a deploy
///   that forgot a route should fail loudly rather than burn the retry
///   budget silently; once a route is deployed, an operator replays the
///   dead runs.
///
/// ```no_run
/// # async fn demo(ferry: ferry::Ferry) -> ferry::Result<()> {
/// use ferry::worker::{JobContext, Router, Worker, WorkerConfig};
/// use ferry::JobError;
/// use serde::Deserialize;
/// use serde_json::json;
///
/// #[derive(Deserialize)]
/// struct ChargeCommand {
///     amount: u64,
///     currency: String,
/// }
///
/// #[derive(Deserialize)]
/// struct RefundCommand {
///     charge_id: String,
/// }
///
/// let router = Router::new()
///     .route("charge", |cmd: ChargeCommand, ctx: JobContext| async move {
///         // The claimed job's facts come with the context.
///         let (run, attempt) = (ctx.run_id(), ctx.attempt());
///         Ok(json!({ "charged": cmd.amount, "currency": cmd.currency, "run": run, "attempt": attempt }))
///     })
///     .route("refund", |cmd: RefundCommand, _ctx: JobContext| async move {
///         if cmd.charge_id.is_empty() {
///             return Err(JobError::terminal("no_charge"));
///         }
///         Ok(json!({ "refunded": cmd.charge_id }))
///     });
/// let worker = Worker::new(ferry, WorkerConfig::default(), router);
/// worker.run(async { let _ = tokio::signal::ctrl_c().await; }).await
/// # }
/// ```
#[derive(Default)]
pub struct Router {
    routes: HashMap<String, Route>,
}

impl Router {
    /// A router with no routes: every job fails with [`UNKNOWN_OPERATION`]
    /// until [`Router::route`] adds its operation.
    pub fn new() -> Self {
        Self::default()
    }

    /// Routes jobs of `operation` to `handler`, called with the run's
    /// request deserialized into `T` and the attempt's [`JobContext`].
    ///
    /// # Panics
    ///
    /// If `operation` is already routed: two handlers for one operation is
    /// a wiring mistake, caught where the worker is built.
    pub fn route<T, F, Fut>(mut self, operation: impl Into<String>, handler: F) -> Self
    where
        T: DeserializeOwned + Send + 'static,
        F: Fn(T, JobContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Value, JobError>> + Send + 'static,
    {
        let operation = operation.into();
        assert!(
            !self.routes.contains_key(&operation),
            "operation {operation:?} is routed twice"
        );
        let route: Route = Box::new(move |job: Claimed, ctx: JobContext| {
            match serde_json::from_value::<T>(job.request) {
                Ok(command) => Box::pin(handler(command, ctx)),
                Err(_) => {
                    // The serde error quotes the payload: it is not logged.
                    tracing::warn!(
                        run_id = %job.lease.run_id,
                        operation = %job.operation,
                        "the request does not deserialize into the route's command"
                    );
                    Box::pin(std::future::ready(Err(JobError::terminal(INVALID_COMMAND))))
                }
            }
        });
        self.routes.insert(operation, route);
        self
    }
}

impl Handler for Router {
    fn handle(&self, job: Claimed, ctx: JobContext) -> impl Future<Output = Result<Value, JobError>> + Send {
        match self.routes.get(job.operation.as_str()) {
            Some(route) => route(job, ctx),
            None => {
                tracing::warn!(run_id = %job.lease.run_id, operation = %job.operation, "no route for the operation");
                Box::pin(std::future::ready(Err(JobError::terminal(UNKNOWN_OPERATION))))
            }
        }
    }
}

impl fmt::Debug for Router {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut operations: Vec<&str> = self.routes.keys().map(String::as_str).collect();
        operations.sort_unstable();
        f.debug_struct("Router").field("operations", &operations).finish()
    }
}
