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

/// The code of the terminal [`JobError`] every job of a batch call gets when
/// the batch handler answered a different number of jobs than it was given:
/// which answer belongs to which job is unknown, so none is recorded as
/// given. It is a wiring mistake, so the jobs die loudly instead of burning
/// their retries; once fixed, an operator replays the dead runs.
pub const BATCH_ANSWER_COUNT: &str = "batch_answer_count";

/// A route: turns the claimed job into the typed handler's future.
type Route = Box<dyn Fn(Claimed, JobContext) -> BoxFuture<'static, Result<Value, JobError>> + Send + Sync>;

/// One answer per job of a batch call, in order.
pub(super) type Answers = Vec<Result<Value, JobError>>;

/// Turns the claimed jobs of a batched operation into the typed batch
/// handler's future.
type BatchCall = Box<dyn Fn(Vec<(Claimed, JobContext)>) -> BoxFuture<'static, Answers> + Send + Sync>;

/// A batch route: its largest call, and the call.
struct BatchRoute {
    size: usize,
    call: BatchCall,
}

/// `answers` if there is one per job of the `jobs` a batch call was given,
/// else [`BATCH_ANSWER_COUNT`] for each of them.
pub(super) fn one_answer_per_job(answers: Answers, jobs: usize) -> Answers {
    if answers.len() == jobs {
        return answers;
    }
    tracing::warn!(
        jobs,
        answers = answers.len(),
        "a batch handler's answers do not match its jobs"
    );
    (0..jobs).map(|_| Err(JobError::terminal(BATCH_ANSWER_COUNT))).collect()
}

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
///
/// A batch route ([`Router::batch_route`]) takes many jobs of its operation
/// in one call, in the style of graphile-worker's batch jobs, and answers per
/// job.
#[derive(Default)]
pub struct Router {
    routes: HashMap<String, Route>,
    batches: HashMap<String, BatchRoute>,
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
        let operation = self.unrouted(operation.into());
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

    /// Routes jobs of `operation` to the batch handler `handler`, called
    /// with up to `size` jobs of it at once, each as its request
    /// deserialized into `T` with its own [`JobContext`] (its own lease).
    /// It answers one result per job, in order: `Ok` completes that run,
    /// `Err` retries or kills that job alone, by its class and the job's
    /// own attempt budget. A job whose lease is lost while the call runs
    /// is not completed: its answer is dropped.
    ///
    /// The worker claims up to [`WorkerConfig::batch`](super::WorkerConfig::batch)
    /// jobs per claim (and one per free slot), so `size` beyond it (or
    /// beyond the concurrency) is never reached. The successes of a call are
    /// completed together, in the worker's set-based completion statement.
    /// A request that does not deserialize fails with [`INVALID_COMMAND`]
    /// without reaching the handler; answers that do not number the jobs
    /// fail every job of the call with [`BATCH_ANSWER_COUNT`].
    ///
    /// # Panics
    ///
    /// If `operation` is already routed, or `size` is 0.
    pub fn batch_route<T, F, Fut>(mut self, operation: impl Into<String>, size: usize, handler: F) -> Self
    where
        T: DeserializeOwned + Send + 'static,
        F: Fn(Vec<(T, JobContext)>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Vec<Result<Value, JobError>>> + Send + 'static,
    {
        assert!(size > 0, "a batch route takes at least one job per call");
        let operation = self.unrouted(operation.into());
        let handler = std::sync::Arc::new(handler);
        let call = Box::new(move |jobs: Vec<(Claimed, JobContext)>| {
            let handler = handler.clone();
            let n = jobs.len();
            // Each job's slot in the answers: the handler's answer, or the
            // terminal refusal of a request that does not deserialize.
            let mut answers: Vec<Option<Result<Value, JobError>>> = (0..n).map(|_| None).collect();
            let mut commands = Vec::with_capacity(n);
            for (i, (job, ctx)) in jobs.into_iter().enumerate() {
                match serde_json::from_value::<T>(job.request) {
                    Ok(command) => commands.push((i, command, ctx)),
                    Err(_) => {
                        tracing::warn!(
                            run_id = %job.lease.run_id,
                            operation = %job.operation,
                            "the request does not deserialize into the batch route's command"
                        );
                        answers[i] = Some(Err(JobError::terminal(INVALID_COMMAND)));
                    }
                }
            }
            Box::pin(async move {
                if !commands.is_empty() {
                    let (places, batch): (Vec<usize>, Vec<(T, JobContext)>) = commands
                        .into_iter()
                        .map(|(i, command, ctx)| (i, (command, ctx)))
                        .unzip();
                    let given = handler(batch).await;
                    for (i, answer) in places.iter().zip(one_answer_per_job(given, places.len())) {
                        answers[*i] = Some(answer);
                    }
                }
                answers
                    .into_iter()
                    .map(|a| a.expect("every job has an answer"))
                    .collect()
            }) as BoxFuture<'static, Answers>
        });
        self.batches.insert(operation, BatchRoute { size, call });
        self
    }

    /// `operation`, checked to have no route or batch route yet.
    fn unrouted(&self, operation: String) -> String {
        assert!(
            !self.routes.contains_key(&operation) && !self.batches.contains_key(&operation),
            "operation {operation:?} is routed twice"
        );
        operation
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

    fn batch_size(&self, operation: &str) -> Option<usize> {
        self.batches.get(operation).map(|b| b.size)
    }

    fn handle_batch(
        &self,
        jobs: Vec<(Claimed, JobContext)>,
    ) -> impl Future<Output = Vec<Result<Value, JobError>>> + Send {
        // The worker batches only the jobs of one batched operation.
        let batch = jobs
            .first()
            .and_then(|(job, _)| self.batches.get(job.operation.as_str()));
        let calls: BoxFuture<'_, Answers> = match batch {
            Some(batch) => (batch.call)(jobs),
            None => Box::pin(futures::future::join_all(
                jobs.into_iter().map(|(job, ctx)| self.handle(job, ctx)),
            )),
        };
        calls
    }
}

impl fmt::Debug for Router {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut operations: Vec<&str> = self.routes.keys().map(String::as_str).collect();
        operations.sort_unstable();
        let mut batched: Vec<&str> = self.batches.keys().map(String::as_str).collect();
        batched.sort_unstable();
        f.debug_struct("Router")
            .field("operations", &operations)
            .field("batched", &batched)
            .finish()
    }
}
