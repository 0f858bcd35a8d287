//! The console's request extractors: axum's `Query`, `Form` and `Path`, but
//! whatever they refuse becomes a [`ConsoleError::BadRequest`] page (code
//! `bad_request`, a fixed message that never echoes the input) instead of
//! axum's plain-text rejection, and a query string or form with a NUL
//! character in any name or value is refused before a handler sees it:
//! PostgreSQL cannot compare text holding one, so it would otherwise come
//! back as a `database` error.

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::header;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;

use crate::error::ConsoleError;

/// The query string, deserialized into `T`.
pub(crate) struct Query<T>(pub T);

/// A `application/x-www-form-urlencoded` body, deserialized into `T`.
pub(crate) struct Form<T>(pub T);

/// The path parameters, deserialized into `T`.
pub(crate) struct Path<T>(pub T);

fn bad(what: &str) -> ConsoleError {
    ConsoleError::BadRequest(format!("{what} does not parse"))
}

/// `T` from urlencoded `bytes`, refusing NUL anywhere in them.
fn urlencoded<T: DeserializeOwned>(bytes: &[u8], what: &str) -> Result<T, ConsoleError> {
    if form_urlencoded::parse(bytes).any(|(k, v)| k.contains('\0') || v.contains('\0')) {
        return Err(ConsoleError::BadRequest(format!("{what} holds a NUL character")));
    }
    serde_urlencoded::from_bytes(bytes).map_err(|_| bad(what))
}

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for Query<T> {
    type Rejection = ConsoleError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ConsoleError> {
        let query = parts.uri.query().unwrap_or_default();
        urlencoded(query.as_bytes(), "the query string").map(Query)
    }
}

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for Form<T> {
    type Rejection = ConsoleError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ConsoleError> {
        let urlencoded_body = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/x-www-form-urlencoded"));
        if !urlencoded_body {
            return Err(ConsoleError::BadRequest(
                "a form must be application/x-www-form-urlencoded".into(),
            ));
        }
        let body = Bytes::from_request(req, state).await.map_err(|_| bad("the form"))?;
        urlencoded(&body, "the form").map(Form)
    }
}

impl<T: DeserializeOwned + Send, S: Send + Sync> FromRequestParts<S> for Path<T> {
    type Rejection = ConsoleError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ConsoleError> {
        axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map(|axum::extract::Path(t)| Path(t))
            .map_err(|_| bad("the path"))
    }
}
