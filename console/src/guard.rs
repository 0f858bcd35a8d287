//! The checks every state-changing POST passes before anything is read:
//! the request comes from the console's own origin, and it carries the
//! credential's CSRF token. The router's login and every action and POST
//! page call them; they depend only on the credential and the errors.

use axum::http::header::{self, HeaderMap};

use crate::auth::{Auth, Principal};
use crate::error::ConsoleError;

/// Refuses a POST that a browser says came from another site, or whose
/// `Origin` is not this host. A browser's `Sec-Fetch-Site` decides when it is
/// sent: under `Referrer-Policy: no-referrer` the same browser sends
/// `Origin: null` on its own forms, so `Origin` is only checked without it.
pub(crate) fn same_origin(headers: &HeaderMap) -> Result<(), ConsoleError> {
    if let Some(site) = headers.get("sec-fetch-site") {
        return match site.to_str() {
            Ok("same-origin" | "none") => Ok(()),
            _ => Err(ConsoleError::Csrf("cross-site request")),
        };
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let host = headers.get(header::HOST).and_then(|h| h.to_str().ok()).unwrap_or("");
        let origin = origin.to_str().unwrap_or("null");
        let ok = !host.is_empty() && (origin == format!("http://{host}") || origin == format!("https://{host}"));
        if !ok {
            return Err(ConsoleError::Csrf("cross-origin request"));
        }
    }
    Ok(())
}

/// The checks of every state-changing POST: same origin, then the
/// credential's CSRF token.
pub(crate) fn check_post(principal: &Principal, headers: &HeaderMap, csrf: &str) -> Result<(), ConsoleError> {
    same_origin(headers)?;
    if csrf.is_empty() {
        return Err(ConsoleError::Csrf("the CSRF token is missing"));
    }
    if !Auth::csrf_ok(principal, csrf) {
        return Err(ConsoleError::Csrf("the CSRF token does not match this session"));
    }
    Ok(())
}
