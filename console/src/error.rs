//! The console's errors, each with a stable `code()` and an HTTP status; a
//! page shows the code and a safe message, never a payload or a key.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

/// What went wrong serving a page or an action.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsoleError {
    /// A library call failed (its own code is kept).
    #[error(transparent)]
    Ferry(#[from] ferry::Error),
    /// No credential, or one the token file does not have.
    #[error("a bearer token or a session is required")]
    Unauthorized,
    /// The credential is valid but may not do this.
    #[error("forbidden: {0}")]
    Forbidden(&'static str),
    /// A POST without the session's CSRF token, or from another origin.
    #[error("refused: {0}")]
    Csrf(&'static str),
    /// A malformed form or query.
    #[error("bad request: {0}")]
    BadRequest(String),
    /// The token file cannot be used.
    #[error("token file: {0}")]
    TokenFile(String),
    /// A setting of [`crate::ConsoleConfig`] the console cannot run with.
    #[error("console config: {0}")]
    Config(String),
    /// Reading the token file or serving failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl ConsoleError {
    /// A stable machine-readable code (`unauthorized`, `csrf`, ... or the
    /// library error's own code).
    pub fn code(&self) -> &'static str {
        match self {
            ConsoleError::Ferry(e) => e.code(),
            ConsoleError::Unauthorized => "unauthorized",
            ConsoleError::Forbidden(_) => "forbidden",
            ConsoleError::Csrf(_) => "csrf",
            ConsoleError::BadRequest(_) => "bad_request",
            ConsoleError::TokenFile(_) => "token_file",
            ConsoleError::Config(_) => "config",
            ConsoleError::Io(_) => "io",
        }
    }

    /// The HTTP status a page answers with.
    pub fn status(&self) -> StatusCode {
        match self {
            ConsoleError::Ferry(e) => match e {
                ferry::Error::NotFound { .. } => StatusCode::NOT_FOUND,
                ferry::Error::InvalidInput { .. } => StatusCode::BAD_REQUEST,
                ferry::Error::RunTerminal { .. }
                | ferry::Error::AlreadyReplayed { .. }
                | ferry::Error::InvalidState { .. }
                | ferry::Error::Cancelled { .. } => StatusCode::CONFLICT,
                _ => StatusCode::INTERNAL_SERVER_ERROR,
            },
            ConsoleError::Unauthorized => StatusCode::UNAUTHORIZED,
            ConsoleError::Forbidden(_) | ConsoleError::Csrf(_) => StatusCode::FORBIDDEN,
            ConsoleError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ConsoleError::TokenFile(_) | ConsoleError::Config(_) | ConsoleError::Io(_) => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        }
    }
}

impl IntoResponse for ConsoleError {
    fn into_response(self) -> Response {
        let status = self.status();
        if status.is_server_error() {
            tracing::error!(code = self.code(), "console: {self}");
        }
        let mut r = (
            status,
            crate::pages::bare::error_page(status, self.code(), &self.to_string()),
        )
            .into_response();
        if status == StatusCode::UNAUTHORIZED {
            r.headers_mut().insert(
                axum::http::header::WWW_AUTHENTICATE,
                axum::http::HeaderValue::from_static("Bearer realm=\"ferry-console\""),
            );
        }
        r
    }
}
