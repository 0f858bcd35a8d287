//! The console's actions. Each is a POST that passes the same-origin and
//! CSRF checks, needs a reason, is refused outside the token's tenant scope,
//! and calls the library function the `ferry` command line calls, which
//! writes the audit entry (actor = the token's name) in the action's own
//! transaction.

use axum::extract::State;
use axum::http::HeaderMap;
use ferry::operator::DeadFilter;
use maud::Markup;
use uuid::Uuid;

use crate::auth::Principal;
use crate::error::ConsoleError;
use crate::extract::Form;
use crate::guard::check_post;
use crate::pages::{done, urlencode, Frame};
use crate::AppState;

/// Fields every action form has.
#[derive(Debug, serde::Deserialize)]
pub(crate) struct Common {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    reason: String,
}

impl Common {
    /// Runs the POST checks and returns the trimmed reason.
    fn check(&self, principal: &Principal, headers: &HeaderMap) -> Result<String, ConsoleError> {
        check_post(principal, headers, &self.csrf)?;
        let reason = self.reason.trim();
        if reason.is_empty() {
            return Err(ConsoleError::BadRequest("every action needs a reason".into()));
        }
        Ok(reason.to_owned())
    }
}

fn blank_to_none(s: Option<String>) -> Option<String> {
    s.map(|s| s.trim().to_owned()).filter(|s| !s.is_empty())
}

/// An optional outbox id from a form field (blank: none).
fn optional_id(field: Option<String>, bad: &'static str) -> Result<Option<i64>, ConsoleError> {
    blank_to_none(field)
        .map(|s| s.parse::<i64>().map_err(|_| ConsoleError::BadRequest(bad.into())))
        .transpose()
}

#[derive(Debug, serde::Deserialize)]
pub(crate) struct ReplayOutbox {
    #[serde(flatten)]
    common: Common,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    tenant: Option<String>,
    #[serde(default)]
    error_code: Option<String>,
    #[serde(default)]
    max_id: Option<String>,
}

/// Replays one dead outbox row (`id`) or one group (`tenant` + `error_code`).
pub(crate) async fn replay_outbox(
    State(state): State<AppState>,
    principal: Principal,
    headers: HeaderMap,
    Form(f): Form<ReplayOutbox>,
) -> Result<Markup, ConsoleError> {
    let reason = f.common.check(&principal, &headers)?;
    let id = optional_id(f.id, "id must be an integer")?;
    let tenant = blank_to_none(f.tenant);
    match &tenant {
        Some(t) => principal.check(t)?,
        None if principal.tenants.is_some() => {
            return Err(ConsoleError::Forbidden(
                "a token scoped to tenants must name the tenant",
            ))
        }
        None => {}
    }
    // A group's code is kept as given (a group may have an empty code).
    let error_code = f.error_code.map(|c| c.trim().to_owned());
    if id.is_none() && error_code.is_none() {
        return Err(ConsoleError::BadRequest("choose a dead row or a group".into()));
    }
    let max_id = optional_id(f.max_id, "max_id must be an integer")?;
    let filter = DeadFilter {
        id,
        tenant: tenant.clone(),
        error_code,
        max_id,
    };
    let ids = state
        .ferry
        .operator()
        .replay_dead_outbox_where(&filter, &principal.name, &reason)
        .await?;
    tracing::info!(actor = %principal.name, rows = ids.len(), "console: outbox.replay_dead");
    let frame = Frame {
        principal: &principal,
        tenant: tenant.as_deref(),
    };
    let message = match ids.as_slice() {
        [] => "No dead row matched (already replayed?).".to_owned(),
        [one] => format!("Row {one} is pending again."),
        many => format!("{} rows are pending again.", many.len()),
    };
    Ok(done(&frame, "Replayed", &message, &frame.link("/dead")))
}

#[derive(Debug, serde::Deserialize)]
pub(crate) struct RunAction {
    #[serde(flatten)]
    common: Common,
    #[serde(default)]
    tenant: String,
    #[serde(default)]
    run_id: String,
}

impl RunAction {
    fn target(&self, principal: &Principal) -> Result<(String, Uuid), ConsoleError> {
        let tenant = self.tenant.trim();
        if tenant.is_empty() {
            return Err(ConsoleError::BadRequest("tenant is required".into()));
        }
        principal.check(tenant)?;
        let run = Uuid::parse_str(self.run_id.trim())
            .map_err(|_| ConsoleError::BadRequest("run_id must be a UUID".into()))?;
        Ok((tenant.to_owned(), run))
    }
}

fn run_link(tenant: &str, run: Uuid) -> String {
    format!("/runs/{}/{run}", urlencode(tenant))
}

/// Replays a dead job's run as a new linked run.
pub(crate) async fn replay_job(
    State(state): State<AppState>,
    principal: Principal,
    headers: HeaderMap,
    Form(f): Form<RunAction>,
) -> Result<Markup, ConsoleError> {
    let reason = f.common.check(&principal, &headers)?;
    let (tenant, run) = f.target(&principal)?;
    let accepted = state
        .ferry
        .operator()
        .replay_dead_audited(&tenant, run, &principal.name, &reason, false)
        .await?;
    tracing::info!(actor = %principal.name, %tenant, %run, "console: jobs.replay_dead");
    let frame = Frame {
        principal: &principal,
        tenant: Some(&tenant),
    };
    let new = accepted.run.run_id;
    Ok(done(
        &frame,
        "Replayed",
        &format!("Run {run} replayed as {new}."),
        &run_link(&tenant, new),
    ))
}

/// Cancels a run.
pub(crate) async fn cancel_run(
    State(state): State<AppState>,
    principal: Principal,
    headers: HeaderMap,
    Form(f): Form<RunAction>,
) -> Result<Markup, ConsoleError> {
    let reason = f.common.check(&principal, &headers)?;
    let (tenant, run) = f.target(&principal)?;
    state
        .ferry
        .operator()
        .cancel_audited(&tenant, run, &principal.name, &reason)
        .await?;
    tracing::info!(actor = %principal.name, %tenant, %run, "console: jobs.cancel");
    let frame = Frame {
        principal: &principal,
        tenant: Some(&tenant),
    };
    Ok(done(
        &frame,
        "Cancelled",
        &format!("Run {run} is cancelled."),
        &run_link(&tenant, run),
    ))
}

#[derive(Debug, serde::Deserialize)]
pub(crate) struct QueueAction {
    #[serde(flatten)]
    common: Common,
    #[serde(default)]
    queue: String,
}

/// Pauses a queue.
pub(crate) async fn pause_queue(
    State(state): State<AppState>,
    principal: Principal,
    headers: HeaderMap,
    Form(f): Form<QueueAction>,
) -> Result<Markup, ConsoleError> {
    queue_action(state, principal, headers, f, true).await
}

/// Resumes a queue.
pub(crate) async fn resume_queue(
    State(state): State<AppState>,
    principal: Principal,
    headers: HeaderMap,
    Form(f): Form<QueueAction>,
) -> Result<Markup, ConsoleError> {
    queue_action(state, principal, headers, f, false).await
}

async fn queue_action(
    state: AppState,
    principal: Principal,
    headers: HeaderMap,
    f: QueueAction,
    pause: bool,
) -> Result<Markup, ConsoleError> {
    let reason = f.common.check(&principal, &headers)?;
    if principal.tenants.is_some() {
        return Err(ConsoleError::Forbidden(
            "queues are shared by every tenant: a token scoped to tenants cannot pause or resume them",
        ));
    }
    let queue = f.queue.trim();
    if queue.is_empty() {
        return Err(ConsoleError::BadRequest("queue is required".into()));
    }
    if pause {
        state
            .ferry
            .operator()
            .pause_queue(queue, &principal.name, &reason)
            .await?;
    } else {
        state
            .ferry
            .operator()
            .resume_queue(queue, &principal.name, &reason)
            .await?;
    }
    tracing::info!(actor = %principal.name, queue, pause, "console: queue pause/resume");
    let frame = Frame {
        principal: &principal,
        tenant: None,
    };
    let what = if pause {
        "paused: its jobs are not claimed"
    } else {
        "resumed"
    };
    Ok(done(
        &frame,
        if pause { "Paused" } else { "Resumed" },
        &format!("Queue {queue} is {what}."),
        "/",
    ))
}
