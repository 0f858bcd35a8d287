//! Runs: search, and one run's lineage.

use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::Form;
use maud::{html, Markup};
use uuid::Uuid;

use super::{layout, ts, Frame};
use crate::auth::Principal;
use crate::error::ConsoleError;
use crate::web::{check_post, AppState};

#[derive(Debug, Default, serde::Deserialize)]
pub(crate) struct SearchQuery {
    #[serde(default)]
    tenant: Option<String>,
}

pub(crate) async fn search(
    State(_state): State<AppState>,
    principal: Principal,
    Query(q): Query<SearchQuery>,
) -> Result<Markup, ConsoleError> {
    let tenant = principal.scope(q.tenant.as_deref())?;
    let frame = Frame {
        principal: &principal,
        tenant: tenant.as_deref(),
    };
    Ok(layout(&frame, "Runs", html! { p { "Search" } }))
}

#[derive(Debug, serde::Deserialize)]
pub(crate) struct KeyForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    tenant: String,
}

pub(crate) async fn search_by_key(
    State(_state): State<AppState>,
    principal: Principal,
    headers: HeaderMap,
    Form(f): Form<KeyForm>,
) -> Result<Markup, ConsoleError> {
    check_post(&principal, &headers, &f.csrf)?;
    principal.check(&f.tenant)?;
    let frame = Frame {
        principal: &principal,
        tenant: Some(&f.tenant),
    };
    Ok(layout(&frame, "Runs", html! { p { "Search" } }))
}

pub(crate) async fn lineage(
    State(state): State<AppState>,
    principal: Principal,
    Path((tenant, run_id)): Path<(String, Uuid)>,
) -> Result<Markup, ConsoleError> {
    principal.check(&tenant)?;
    let run = state.ferry.get_run(&tenant, run_id).await?;
    let frame = Frame {
        principal: &principal,
        tenant: Some(&tenant),
    };
    Ok(layout(
        &frame,
        "Run",
        html! { p { (run.run_id) " " (ts(run.created_at.get())) } },
    ))
}
