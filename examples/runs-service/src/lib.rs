//! An example HTTP admission service on Ferry, the way a Rust service uses it:
//! `POST /v1/runs` with an `Idempotency-Key` (IETF httpapi draft), tenants
//! from bearer tokens, bounded backpressure (429 + `Retry-After`),
//! `GET /v1/runs/{id}`, `POST /v1/runs/{id}/cancel`, and a worker in the
//! same process. Errors are `application/problem+json` with a stable `code`;
//! while the database is unreachable every request gets 503 `unavailable`
//! with `Retry-After` (retrying with the same `Idempotency-Key` is safe:
//! an acceptance commits whole or not at all).
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequestParts, Path, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use ferry::worker::{Worker, WorkerConfig};
use ferry::{Ferry, NewRun};
use serde_json::{json, Value};
use uuid::Uuid;

/// Service settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// Bearer token → tenant.
    pub tokens: HashMap<String, String>,
    /// Queued jobs a tenant may have before new runs get 429.
    pub max_queued_per_tenant: i64,
    /// `Retry-After` seconds on a 429 (backpressure) and on a 503 (the
    /// database unavailable).
    pub retry_after_secs: u64,
    /// Run the worker in this process.
    pub with_worker: bool,
}

/// A setting the service cannot start with: which one and why (never its
/// value, which may hold tokens). Its [`ConfigError::code`] is `config`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The environment variable.
    pub name: &'static str,
    /// What is wrong with it.
    pub reason: String,
}

impl ConfigError {
    fn new(name: &'static str, reason: impl Into<String>) -> Self {
        ConfigError {
            name,
            reason: reason.into(),
        }
    }

    /// The stable machine-readable code: `config`.
    pub fn code(&self) -> &'static str {
        "config"
    }
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.name, self.reason)
    }
}

impl std::error::Error for ConfigError {}

impl Config {
    /// The settings from the environment, read through `var`:
    /// `RUNS_TOKENS` (required, [`Config::parse_tokens`]) and
    /// `MAX_QUEUED_PER_TENANT` (default 1000, [`Config::parse_max_queued`]),
    /// with `Retry-After: 2` and the worker in the process.
    pub fn from_env(var: impl Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        let tokens = var("RUNS_TOKENS").ok_or_else(|| ConfigError::new("RUNS_TOKENS", "is not set"))?;
        Ok(Config {
            tokens: Config::parse_tokens(&tokens)?,
            max_queued_per_tenant: var("MAX_QUEUED_PER_TENANT").map_or(Ok(1000), |v| Config::parse_max_queued(&v))?,
            retry_after_secs: 2,
            with_worker: true,
        })
    }

    /// Parses `token=tenant,token=tenant`: every pair has a token (visible
    /// ASCII, no `,` or `=`) and a valid tenant name, no token twice, and
    /// there is at least one pair. The error never quotes a token.
    pub fn parse_tokens(s: &str) -> Result<HashMap<String, String>, ConfigError> {
        let bad = |n: usize, why: &str| ConfigError::new("RUNS_TOKENS", format!("pair {n}: {why}"));
        let mut tokens = HashMap::new();
        for (n, pair) in (1..).zip(s.split(',')) {
            let (token, tenant) = pair.split_once('=').ok_or_else(|| bad(n, "expected token=tenant"))?;
            let (token, tenant) = (token.trim(), tenant.trim());
            if token.is_empty() || !token.bytes().all(|b| b.is_ascii_graphic() && b != b'=') {
                return Err(bad(n, "the token must be visible ASCII"));
            }
            ferry::Limits::default()
                .tenant(tenant)
                .map_err(|_| bad(n, "the tenant must be 1 to 128 of [A-Za-z0-9._:-]"))?;
            if tokens.insert(token.to_owned(), tenant.to_owned()).is_some() {
                return Err(bad(n, "a token appears twice"));
            }
        }
        Ok(tokens)
    }

    /// Parses `MAX_QUEUED_PER_TENANT`: a whole number from 1 up.
    pub fn parse_max_queued(s: &str) -> Result<i64, ConfigError> {
        s.trim()
            .parse::<i64>()
            .ok()
            .filter(|n| *n >= 1)
            .ok_or_else(|| ConfigError::new("MAX_QUEUED_PER_TENANT", "must be a whole number from 1 up"))
    }
}

/// Parses `LISTEN`: an `ip:port` socket address.
pub fn parse_listen(s: &str) -> Result<SocketAddr, ConfigError> {
    s.trim()
        .parse()
        .map_err(|_| ConfigError::new("LISTEN", "must be ip:port, e.g. 0.0.0.0:8080"))
}

#[derive(Clone)]
struct AppState {
    ferry: Ferry,
    config: Arc<Config>,
}

/// The routes.
pub fn app(ferry: Ferry, config: Config) -> Router {
    let state = AppState {
        ferry,
        config: Arc::new(config),
    };
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/v1/runs", post(create_run))
        .route("/v1/runs/{id}", get(get_run))
        .route("/v1/runs/{id}/cancel", post(cancel_run))
        .fallback(|| async { problem(StatusCode::NOT_FOUND, "not_found", "no such route") })
        .method_not_allowed_fallback(|| async {
            problem(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "not with this method",
            )
        })
        .with_state(state)
}

/// Serves on `listener` (and runs the worker, if configured) until `shutdown`.
pub async fn run(
    ferry: Ferry,
    config: Config,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let stop = stop_signal::Stop::default();
    let worker = if config.with_worker {
        let w = Worker::new(
            ferry.clone(),
            WorkerConfig {
                poll_interval: Duration::from_millis(200),
                ..WorkerConfig::default()
            },
            |job: ferry::Claimed, _ctx| async move { Ok(json!({ "accepted": job.request })) },
        );
        let s = stop.clone();
        Some(tokio::spawn(w.run(async move { s.wait().await })))
    } else {
        None
    };
    let s = stop.clone();
    let served = axum::serve(listener, app(ferry, config))
        .with_graceful_shutdown(async move {
            shutdown.await;
            s.fire();
        })
        .await;
    stop.fire();
    if let Some(w) = worker {
        let _ = w.await;
    }
    served
}

/// Binds `addr` and runs.
pub async fn serve(
    ferry: Ferry,
    config: Config,
    addr: SocketAddr,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    run(ferry, config, tokio::net::TcpListener::bind(addr).await?, shutdown).await
}

mod stop_signal {
    //! A tiny one-shot stop signal shared by the server and the worker.
    use std::sync::Arc;
    use tokio::sync::watch;

    #[derive(Clone)]
    pub struct Stop(Arc<watch::Sender<bool>>);

    impl Default for Stop {
        fn default() -> Self {
            Stop(Arc::new(watch::channel(false).0))
        }
    }

    impl Stop {
        pub fn fire(&self) {
            let _ = self.0.send(true);
        }

        pub async fn wait(&self) {
            let mut rx = self.0.subscribe();
            let _ = rx.wait_for(|v| *v).await;
        }
    }
}

/// An `application/problem+json` answer with a stable `code`.
struct Problem {
    status: StatusCode,
    code: String,
    detail: String,
    retry_after: Option<u64>,
}

fn problem(status: StatusCode, code: &str, detail: impl Into<String>) -> Problem {
    Problem {
        status,
        code: code.to_owned(),
        detail: detail.into(),
        retry_after: None,
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let body = json!({
            "type": format!("https://ferry.dev/problems/{}", self.code),
            "title": self.status.canonical_reason().unwrap_or("error"),
            "status": self.status.as_u16(),
            "code": self.code,
            "detail": self.detail,
        });
        let mut r = (
            self.status,
            [(header::CONTENT_TYPE, "application/problem+json")],
            body.to_string(),
        )
            .into_response();
        if let Some(secs) = self.retry_after {
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        r
    }
}

fn tenant(state: &AppState, headers: &HeaderMap) -> Result<String, Problem> {
    let token = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match token.and_then(|t| state.config.tokens.get(t)) {
        Some(t) => Ok(t.clone()),
        None => Err(problem(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "a valid bearer token is required",
        )),
    }
}

/// The `Idempotency-Key` header: an sf-string per the draft (`"…"`); a bare
/// token is accepted too.
fn idempotency_key(headers: &HeaderMap) -> Result<String, Problem> {
    let raw = headers
        .get("idempotency-key")
        .ok_or_else(|| {
            problem(
                StatusCode::BAD_REQUEST,
                "idempotency_key_missing",
                "send an Idempotency-Key header",
            )
        })?
        .to_str()
        .map_err(|_| {
            problem(
                StatusCode::BAD_REQUEST,
                "invalid_input",
                "Idempotency-Key must be visible ASCII",
            )
        })?;
    let key = raw.strip_prefix('"').and_then(|k| k.strip_suffix('"')).unwrap_or(raw);
    Ok(key.to_owned())
}

/// The answer for a library error, by variant. A transient error (the
/// database unreachable or a connection lost mid-call, a raced change) is
/// 503 `unavailable` with `Retry-After`: the acceptance committed whole or
/// not at all, so a retry with the same key creates or replays the run. An
/// error no retry cures is the service's fault (500), never the client's.
fn error_response(e: ferry::Error, retry_after_secs: u64) -> Problem {
    use ferry::Error as E;
    if e.is_transient() {
        tracing::warn!(error = %e, code = e.code(), "transient failure: 503");
        let mut p = problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            format!("temporarily unavailable; retry in {retry_after_secs} s with the same Idempotency-Key"),
        );
        p.retry_after = Some(retry_after_secs);
        return p;
    }
    let status = match &e {
        E::InvalidInput { .. } => StatusCode::BAD_REQUEST,
        E::IdempotencyConflict { .. } | E::RunTerminal { .. } | E::DuplicateRun { .. } | E::InvalidState { .. } => {
            StatusCode::CONFLICT
        }
        E::NotFound { .. } => StatusCode::NOT_FOUND,
        _ => {
            tracing::error!(error = %e, code = e.code(), "request failed");
            return problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                e.code(),
                "internal error; see the service's log",
            );
        }
    };
    // The error text never carries a full key or a payload.
    problem(status, e.code(), e.to_string())
}

fn accepted_body(run: &ferry::Run) -> Value {
    json!({ "run_id": run.run_id, "state": run.state, "operation": run.operation })
}

async fn create_run(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Problem> {
    let tenant = tenant(&state, &headers)?;
    let key = idempotency_key(&headers)?;
    let body = body.map_err(|e| {
        problem(
            e.status(),
            "invalid_input",
            "the body could not be read (at most 2 MiB)",
        )
    })?;
    let command: Value = match serde_json::from_slice(&body) {
        Ok(v @ Value::Object(_)) => v,
        _ => {
            return Err(problem(
                StatusCode::BAD_REQUEST,
                "invalid_input",
                "the body must be a JSON object",
            ))
        }
    };
    let operation = match command.get("operation") {
        None => "run".to_owned(),
        Some(Value::String(op)) => op.clone(),
        Some(_) => {
            return Err(problem(
                StatusCode::BAD_REQUEST,
                "invalid_input",
                "operation must be a string",
            ))
        }
    };
    let a = admit(&state, NewRun::new(&tenant, operation, key, command)).await?;
    let location = format!("/v1/runs/{}", a.run.run_id);
    let mut r = (StatusCode::ACCEPTED, Json(accepted_body(&a.run))).into_response();
    if let Ok(v) = HeaderValue::from_str(&location) {
        r.headers_mut().insert(header::LOCATION, v);
    }
    if a.replay {
        r.headers_mut()
            .insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    Ok(r)
}

/// Accepts `run` unless it takes its tenant past the queue limit. The limit
/// applies to new runs only: the run is accepted first and the tenant's
/// backlog, the new run included, counted in the same transaction, which
/// rolls back when over the limit. So a retried request is answered as the
/// replay it is (or as a conflict) whatever the backlog, and a refused one
/// writes nothing.
async fn admit(state: &AppState, run: NewRun) -> Result<ferry::Accepted, Problem> {
    let tenant = run.tenant.clone();
    let retry_after = state.config.retry_after_secs;
    let mut tx = state.ferry.begin().await.map_err(|e| error_response(e, retry_after))?;
    let accepted: ferry::Result<Option<ferry::Accepted>> = async {
        let a = state.ferry.create_run_idempotent_in(tx.conn(), run).await?;
        if !a.replay && state.ferry.queued_depth_in(tx.conn(), &tenant).await? > state.config.max_queued_per_tenant {
            return Ok(None);
        }
        Ok(Some(a))
    }
    .await;
    match accepted {
        Ok(Some(a)) => {
            tx.commit().await.map_err(|e| error_response(e, retry_after))?;
            Ok(a)
        }
        Ok(None) => {
            tx.rollback().await.map_err(|e| error_response(e, retry_after))?;
            let mut p = problem(
                StatusCode::TOO_MANY_REQUESTS,
                "backpressure",
                "too many queued runs for this tenant",
            );
            p.retry_after = Some(state.config.retry_after_secs);
            Err(p)
        }
        Err(e) => {
            // The acceptance's error is the answer, whatever the rollback says.
            let _ = tx.rollback().await;
            Err(error_response(e, retry_after))
        }
    }
}

/// The `{id}` of a run's path: a UUID, else `400` `invalid_input`.
struct RunId(Uuid);

impl<S: Send + Sync> FromRequestParts<S> for RunId {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Problem> {
        let bad = || problem(StatusCode::BAD_REQUEST, "invalid_input", "the run id must be a UUID");
        let Path(id) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|_| bad())?;
        Uuid::try_parse(&id).map(RunId).map_err(|_| bad())
    }
}

async fn get_run(State(state): State<AppState>, headers: HeaderMap, RunId(id): RunId) -> Result<Response, Problem> {
    let tenant = tenant(&state, &headers)?;
    let run = state
        .ferry
        .get_run(&tenant, id)
        .await
        .map_err(|e| error_response(e, state.config.retry_after_secs))?;
    let events = state
        .ferry
        .list_events(&tenant, id)
        .await
        .map_err(|e| error_response(e, state.config.retry_after_secs))?;
    Ok(Json(json!({ "run": run, "events": events })).into_response())
}

async fn cancel_run(State(state): State<AppState>, headers: HeaderMap, RunId(id): RunId) -> Result<Response, Problem> {
    let tenant = tenant(&state, &headers)?;
    state
        .ferry
        .cancel(&tenant, id, None, &format!("api:{tenant}"), "cancelled through the API")
        .await
        .map_err(|e| error_response(e, state.config.retry_after_secs))?;
    Ok(Json(json!({ "run_id": id, "state": "cancelled" })).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Any `RUNS_TOKENS` text is a map of valid pairs or `config`.
        #[test]
        fn any_tokens_text_parses_or_is_a_config_error(s in any::<String>()) {
            match Config::parse_tokens(&s) {
                Ok(tokens) => {
                    prop_assert!(!tokens.is_empty());
                    for (token, tenant) in &tokens {
                        prop_assert!(!token.is_empty() && ferry::Limits::default().tenant(tenant).is_ok());
                    }
                }
                Err(e) => prop_assert_eq!(e.code(), "config"),
            }
        }

        /// A refused pair is named by its position, never by its token.
        #[test]
        fn a_refused_pair_never_shows_its_token(
            pairs in prop::collection::vec(("[A-Za-z0-9]{12,20}", any::<String>()), 1..4),
        ) {
            let text = pairs.iter().map(|(t, tenant)| format!("{t}={tenant}")).collect::<Vec<_>>().join(",");
            if let Err(e) = Config::parse_tokens(&text) {
                for (token, _) in &pairs {
                    prop_assert!(!e.to_string().contains(token.as_str()), "{}", e);
                }
            }
        }

        /// `MAX_QUEUED_PER_TENANT` and `LISTEN`: a usable value or `config`.
        #[test]
        fn any_limit_or_address_parses_or_is_a_config_error(
            s in prop_oneof![any::<String>(), "[+-]?[0-9]{1,25}", "[0-9.:\\[\\]a-f]{1,30}"],
        ) {
            match Config::parse_max_queued(&s) {
                Ok(n) => prop_assert!(n >= 1),
                Err(e) => prop_assert_eq!(e.code(), "config"),
            }
            if let Err(e) = parse_listen(&s) {
                prop_assert_eq!(e.code(), "config");
            }
        }
    }

    #[test]
    fn the_environment_is_read_or_refused_by_name() {
        let env = |tokens: Option<&str>, max: Option<&str>| {
            Config::from_env(|name| match name {
                "RUNS_TOKENS" => tokens.map(str::to_owned),
                "MAX_QUEUED_PER_TENANT" => max.map(str::to_owned),
                _ => None,
            })
        };
        let c = env(Some("t1=acme, t2=globex"), None).unwrap();
        assert_eq!((c.tokens.len(), c.max_queued_per_tenant), (2, 1000));
        assert_eq!(env(None, None).unwrap_err().name, "RUNS_TOKENS");
        assert_eq!(env(Some("t1=acme,broken"), None).unwrap_err().name, "RUNS_TOKENS");
        assert_eq!(env(Some("t1=acme,t1=globex"), None).unwrap_err().name, "RUNS_TOKENS");
        // A typo used to fall back to 1000 silently.
        assert_eq!(
            env(Some("t1=acme"), Some("1e3")).unwrap_err().name,
            "MAX_QUEUED_PER_TENANT"
        );
        assert_eq!(env(Some("t1=acme"), Some(" 5 ")).unwrap().max_queued_per_tenant, 5);
    }
}
