//! The pages outside the layout, which need no signed-in principal: the
//! sign-in form and the error page every [`crate::error::ConsoleError`]
//! renders. Kept apart so that the errors do not depend on the layout and
//! the authentication it shows.

use axum::http::StatusCode;
use maud::{html, Markup, DOCTYPE};

/// The login form.
pub(crate) fn login(message: Option<&str>) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                title { "Ferry · sign in" }
                link rel="stylesheet" href="/static/console.css";
            }
            body.login {
                main {
                    h1 { "Ferry console" }
                    @if let Some(m) = message { p.error #login-error { (m) } }
                    form method="post" action="/login" {
                        label for="token" { "Token" }
                        input #token type="password" name="token" autocomplete="off" required;
                        button #sign-in type="submit" { "Sign in" }
                    }
                }
            }
        }
    }
}

/// An error page: the status, the stable code and a safe message.
pub(crate) fn error_page(status: StatusCode, code: &str, message: &str) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                title { "Ferry · " (status.as_u16()) }
                link rel="stylesheet" href="/static/console.css";
            }
            body {
                main {
                    h1 { (status.as_u16()) " " (status.canonical_reason().unwrap_or("")) }
                    p.error { code #error-code { (code) } ": " (message) }
                    p { a href="/" { "Back to the overview" } }
                }
            }
        }
    }
}
