//! The console's tests in one binary: plain HTTP (auth, CSRF, tenant scopes,
//! headers, actions, figures) and property tests over every input it parses
//! on both engines, and headless-Chromium browser tests on PostgreSQL.

mod browser;
mod http;
mod input;
mod support;
