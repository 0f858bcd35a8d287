//! The HTTP plumbing: the router, the security headers on every response,
//! authentication (bearer token or session cookie) as an extractor, login
//! and logout, and the static assets compiled into the binary.

use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::{FromRequestParts, State};
use axum::http::header::{self, HeaderMap, HeaderName, HeaderValue};
use axum::http::request::Parts;
use axum::http::Method;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::Router;

use crate::auth::{Auth, Principal, SESSION_COOKIE};
use crate::error::ConsoleError;
use crate::extract::Form;
use crate::guard::{check_post, same_origin};
use crate::{actions, pages, AppState};

/// The Content-Security-Policy of every response: nothing inline, nothing
/// from elsewhere, no framing, forms only back to the console.
pub const CSP: &str = "default-src 'none'; style-src 'self'; script-src 'self'; img-src 'self' data:; \
                       form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

const CSS: &str = include_str!("../assets/console.css");
const JS: &str = include_str!("../assets/console.js");

/// Every route, wrapped in the security headers.
pub(crate) fn router(state: AppState) -> Router {
    Router::new()
        .route("/", get(pages::overview::page))
        .route("/runs", get(pages::runs::search).post(pages::runs::search_by_key))
        .route("/runs/{tenant}/{run_id}", get(pages::runs::lineage))
        .route("/dead", get(pages::dead::page))
        .route("/actions/outbox/replay", post(actions::replay_outbox))
        .route("/actions/jobs/replay", post(actions::replay_job))
        .route("/actions/runs/cancel", post(actions::cancel_run))
        .route("/actions/queues/pause", post(actions::pause_queue))
        .route("/actions/queues/resume", post(actions::resume_queue))
        .route("/healthz", get(|| async { "ok" }))
        .route("/login", get(login_page).post(login))
        .route("/logout", post(logout))
        .route(
            "/static/console.css",
            get(|| async { asset("text/css; charset=utf-8", CSS) }),
        )
        .route(
            "/static/console.js",
            get(|| async { asset("text/javascript; charset=utf-8", JS) }),
        )
        .fallback(|| async { ConsoleError::Ferry(ferry::Error::NotFound { what: "page" }) })
        .layer(axum::middleware::map_response(security_headers))
        .with_state(state)
}

fn asset(kind: &'static str, body: &'static str) -> Response {
    ([(header::CONTENT_TYPE, kind)], body).into_response()
}

async fn security_headers(mut r: Response) -> Response {
    let h = r.headers_mut();
    for (name, value) in [
        (header::CONTENT_SECURITY_POLICY, CSP),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::REFERRER_POLICY, "no-referrer"),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::CACHE_CONTROL, "no-store"),
        (HeaderName::from_static("cross-origin-opener-policy"), "same-origin"),
    ] {
        h.insert(name, HeaderValue::from_static(value));
    }
    r
}

/// Milliseconds since the epoch by the host clock (sessions only; data uses
/// the store's clock).
pub(crate) fn wall_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

fn cookie_value<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

/// Why a request has no principal: a browser without a session is sent to
/// the login page; everything else is refused.
pub(crate) enum NoPrincipal {
    Login,
    Refused(ConsoleError),
}

impl IntoResponse for NoPrincipal {
    fn into_response(self) -> Response {
        match self {
            NoPrincipal::Login => Redirect::to("/login").into_response(),
            NoPrincipal::Refused(e) => e.into_response(),
        }
    }
}

impl FromRequestParts<AppState> for Principal {
    type Rejection = NoPrincipal;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        let auth: &Auth = &state.auth;
        if let Some(value) = parts.headers.get(header::AUTHORIZATION) {
            let token = value
                .to_str()
                .ok()
                .and_then(|v| v.strip_prefix("Bearer "))
                .map(str::trim);
            return token
                .and_then(|t| auth.bearer(t))
                .ok_or(NoPrincipal::Refused(ConsoleError::Unauthorized));
        }
        let session = cookie_value(&parts.headers, SESSION_COOKIE).and_then(|c| auth.session(c, wall_ms()));
        match session {
            Some(p) => Ok(p),
            // A browser without a (valid) session signs in; anything else is refused.
            None if parts.method == Method::GET => Err(NoPrincipal::Login),
            None => Err(NoPrincipal::Refused(ConsoleError::Unauthorized)),
        }
    }
}

async fn login_page() -> Response {
    pages::bare::login(None).into_response()
}

#[derive(serde::Deserialize)]
pub(crate) struct LoginForm {
    #[serde(default)]
    token: String,
}

async fn login(State(state): State<AppState>, headers: HeaderMap, Form(form): Form<LoginForm>) -> Response {
    if let Err(e) = same_origin(&headers) {
        return e.into_response();
    }
    match state.auth.login(form.token.trim(), wall_ms()) {
        Some((cookie, p)) => {
            tracing::info!(actor = %p.name, "console login");
            let set = format!(
                "{SESSION_COOKIE}={cookie}; Path=/; HttpOnly; SameSite=Strict; Max-Age={}{}",
                state.auth.session_secs(),
                if state.secure_cookie { "; Secure" } else { "" }
            );
            let mut r = Redirect::to("/").into_response();
            if let Ok(v) = HeaderValue::from_str(&set) {
                r.headers_mut().insert(header::SET_COOKIE, v);
            }
            r
        }
        None => {
            tracing::warn!("console login refused");
            (
                axum::http::StatusCode::UNAUTHORIZED,
                pages::bare::login(Some("That token is not in the token file.")),
            )
                .into_response()
        }
    }
}

#[derive(serde::Deserialize)]
pub(crate) struct CsrfOnly {
    #[serde(default)]
    csrf: String,
}

async fn logout(
    principal: Principal,
    headers: HeaderMap,
    Form(form): Form<CsrfOnly>,
) -> Result<Response, ConsoleError> {
    check_post(&principal, &headers, &form.csrf)?;
    let mut r = Redirect::to("/login").into_response();
    let clear = format!("{SESSION_COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0");
    if let Ok(v) = HeaderValue::from_str(&clear) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    Ok(r)
}
