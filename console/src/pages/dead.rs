//! Dead outbox rows and dead jobs, grouped by tenant and error code with
//! counts, each row and each group with its replay action.

use axum::extract::State;
use ferry::operator::DeadFilter;
use maud::{html, Markup};

use super::{age, code_or, csrf_field, layout, reason_field, ts, urlencode, Frame};
use crate::auth::Principal;
use crate::error::ConsoleError;
use crate::extract::Query;
use crate::AppState;

const LIST: u32 = 50;

#[derive(Debug, Default, serde::Deserialize)]
pub(crate) struct DeadQuery {
    #[serde(default)]
    tenant: Option<String>,
    /// Only this error code in the lists.
    #[serde(default)]
    code: Option<String>,
}

pub(crate) async fn page(
    State(state): State<AppState>,
    principal: Principal,
    Query(q): Query<DeadQuery>,
) -> Result<Markup, ConsoleError> {
    let tenant = principal.scope(q.tenant.as_deref())?;
    let t = tenant.as_deref();
    let code = q.code.filter(|c| !c.is_empty());
    let filter = DeadFilter {
        id: None,
        tenant: tenant.clone(),
        error_code: code.clone(),
        max_id: None,
    };
    let operator = state.ferry.operator();
    let (outbox_groups, job_groups, rows, now) = tokio::try_join!(
        state.store.outbox_dead_groups(t),
        state.store.dead_job_groups(t),
        operator.list_dead_outbox_where(&filter, LIST),
        state.store.now(),
    )?;
    let jobs = match t {
        Some(t) => operator.list_dead(t, code.as_deref(), LIST).await?,
        None => Vec::new(),
    };
    let frame = Frame {
        principal: &principal,
        tenant: t,
    };
    let group_link = |tenant: &str, code: &str| format!("/dead?tenant={}&code={}", urlencode(tenant), urlencode(code));
    let body = html! {
        @if let Some(c) = &code { p.note { "Showing error code " code { (c) } ". " a href=(frame.link("/dead")) { "Show every code" } } }
        section {
            h2 { "Dead outbox rows by error code" }
            @if outbox_groups.is_empty() { p.empty #no-dead-rows { "No dead rows." } }
            @else {
                table #dead-row-groups {
                    thead { tr { th { "tenant" } th { "error code" } th { "rows" } th { "replay the group" } } }
                    tbody { @for g in &outbox_groups {
                        tr { td { (g.tenant) } td { a href=(group_link(&g.tenant, &g.error_code)) { (code_or(Some(&g.error_code), "(no code)")) } }
                            td.num.count { (g.rows) }
                            td { form.inline method="post" action="/actions/outbox/replay" {
                                (csrf_field(&principal))
                                input type="hidden" name="tenant" value=(g.tenant);
                                input type="hidden" name="error_code" value=(g.error_code);
                                input type="hidden" name="max_id" value=(g.last_id);
                                (reason_field())
                                button type="submit" { "Replay " (g.rows) " rows" }
                            } } }
                    } }
                }
                h3 { "Rows (oldest first, at most " (LIST) ")" }
                table #dead-rows {
                    thead { tr { th { "id" } th { "tenant" } th { "topic" } th { "key" } th { "error" } th { "attempts" } th { "age" } th { "replay" } } }
                    tbody { @for r in &rows {
                        tr id=(format!("dead-row-{}", r.id)) { td.num { (r.id) } td { (r.tenant) } td { (r.topic) } td { (r.key) }
                            td { (code_or(r.last_error.as_deref(), "")) } td.num { (r.publish_attempts) }
                            td { (age(now.get() - r.created_at.get())) }
                            td { form.inline method="post" action="/actions/outbox/replay" {
                                (csrf_field(&principal))
                                input type="hidden" name="id" value=(r.id);
                                input type="hidden" name="tenant" value=(r.tenant);
                                (reason_field())
                                button type="submit" id=(format!("replay-row-{}", r.id)) { "Replay" }
                            } } }
                    } }
                }
            }
        }
        section {
            h2 { "Dead jobs by error code" }
            @if job_groups.is_empty() { p.empty #no-dead-jobs { "No dead jobs." } }
            @else {
                table #dead-job-groups {
                    thead { tr { th { "tenant" } th { "error code" } th { "jobs" } } }
                    tbody { @for g in &job_groups {
                        tr { td { (g.tenant) } td { a href=(group_link(&g.tenant, &g.error_code)) { (code_or(Some(&g.error_code), "(no code)")) } } td.num.count { (g.jobs) } }
                    } }
                }
                @if t.is_none() { p.note { "Choose a tenant (or a group) to list its dead jobs." } }
                @else {
                    table #dead-jobs {
                        thead { tr { th { "run" } th { "queue" } th { "operation" } th { "error" } th { "attempts" } th { "died" } th { "replay" } } }
                        tbody { @for j in &jobs {
                            tr { td { a href=(format!("/runs/{}/{}", urlencode(&j.tenant), j.run_id)) { (j.run_id) } }
                                td { (j.queue) } td { (j.operation) } td { (code_or(j.error_code.as_deref(), "")) }
                                td.num { (j.attempts) } td { (ts(j.died_at.get())) }
                                td { (replay_job_form(&principal, &j.tenant, &j.run_id.to_string())) } }
                        } }
                    }
                }
            }
        }
    };
    Ok(layout(&frame, "Dead rows and dead jobs", body))
}

/// The form replaying one dead job (here and on its lineage page).
pub(crate) fn replay_job_form(principal: &Principal, tenant: &str, run_id: &str) -> Markup {
    html! {
        form.inline method="post" action="/actions/jobs/replay" {
            (csrf_field(principal))
            input type="hidden" name="tenant" value=(tenant);
            input type="hidden" name="run_id" value=(run_id);
            (reason_field())
            button type="submit" { "Replay as a new run" }
        }
    }
}
