//! Property tests over every input the console parses, on both engines
//! (and its one setting that could not run, the sampling interval):
//! each page's query string, each form (the actions, the key search, login
//! and logout) and the lineage path, with any field and any value (NUL,
//! absurd dates and numbers, broken cursors and UUIDs, duplicates). Every
//! answer is a page, a redirect or an error page with a stable code under
//! 500: never a panic, never a server error.

use axum::body::Body;
use axum::http::{header, Request};
use ferry::Engine;
use ferry_testkit::on_both_engines;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

use crate::support::*;

on_both_engines!(any_query_form_or_path_gets_a_page_or_a_typed_error);

/// A sampling interval the timer cannot run on is refused when the console
/// is built (`--sample-every 0` used to panic the sampling task).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unusable_sample_interval_is_refused() {
    let db = ferry_testkit::TestDb::new(Engine::Sqlite).await;
    let zero_or_too_long = [
        std::time::Duration::ZERO,
        ferry::time::MAX_DURATION + std::time::Duration::from_secs(1),
    ];
    for every in zero_or_too_long {
        let mut config = ferry_console::ConsoleConfig::new(tokens());
        config.sample_every = every;
        let e = ferry_console::Console::new(db.ferry.clone(), config).unwrap_err();
        assert_eq!(e.code(), "config", "{every:?}");
    }
}

/// A request the property sends: GET with a query string, POST with a form
/// (the principal's CSRF token added unless the fields name one), or GET of
/// a lineage path.
#[derive(Debug, Clone)]
enum Input {
    Get(&'static str, Vec<(String, String)>),
    Post(&'static str, Vec<(String, String)>),
    Lineage(String, String),
}

/// Every route that parses input, with the fields it reads.
const GETS: [(&str, &[&str]); 3] = [
    ("/", &["tenant"]),
    (
        "/runs",
        &[
            "tenant",
            "run_id",
            "state",
            "operation",
            "queue",
            "from",
            "before",
            "after",
        ],
    ),
    ("/dead", &["tenant", "code"]),
];
const POSTS: [(&str, &[&str]); 8] = [
    ("/runs", &["tenant", "key", "operation"]),
    (
        "/actions/outbox/replay",
        &["reason", "id", "tenant", "error_code", "max_id"],
    ),
    ("/actions/jobs/replay", &["reason", "tenant", "run_id"]),
    ("/actions/runs/cancel", &["reason", "tenant", "run_id"]),
    ("/actions/queues/pause", &["reason", "queue"]),
    ("/actions/queues/resume", &["reason", "queue"]),
    ("/login", &["token"]),
    ("/logout", &[]),
];

/// Values a user could type, absurd ones weighted in.
fn value(known: Vec<String>) -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        prop::sample::select(known),
        "[0-9]{1,12}-[0-9]{1,3}-[0-9]{1,3}([T ][0-9]{1,3}:[0-9]{1,3}(:[0-9]{0,3})?)?",
        "[+-]?[0-9]{1,25}",
        "r2\\.[+-]?[0-9]{1,20}\\.[0-9a-f]{30,34}\\.[a-z:.]{0,6}",
        "[0-9a-f-]{30,40}",
        "[a-z]{0,3}\\x00[a-z]{0,3}",
        Just(String::new()),
    ]
}

fn fields(names: &'static [&'static str], known: Vec<String>) -> impl Strategy<Value = Vec<(String, String)>> {
    let name = prop_oneof![
        4 => prop::sample::select([names, &["csrf", "x\u{0}"]].concat()).prop_map(str::to_owned),
        1 => any::<String>(),
    ];
    prop::collection::vec((name, value(known)), 0..5)
}

fn input(known: Vec<String>) -> impl Strategy<Value = Input> {
    let gets = GETS.map(|(path, names)| {
        fields(names, known.clone())
            .prop_map(move |f| Input::Get(path, f))
            .boxed()
    });
    let posts = POSTS.map(|(path, names)| {
        fields(names, known.clone())
            .prop_map(move |f| Input::Post(path, f))
            .boxed()
    });
    let lineage = (value(known.clone()), value(known))
        .prop_map(|(t, r)| Input::Lineage(t, r))
        .boxed();
    prop::strategy::Union::new(gets.into_iter().chain(posts).chain([lineage]))
}

/// Percent-encodes every byte but unreserved ones.
fn encode_all(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

fn urlencoded(fields: &[(String, String)]) -> String {
    fields
        .iter()
        .map(|(k, v)| format!("{}={}", encode_all(k), encode_all(v)))
        .collect::<Vec<_>>()
        .join("&")
}

async fn check(a: &App, csrf: &str, input: Input) -> Result<(), TestCaseError> {
    let bearer = format!("Bearer {ROOT}");
    let request = match &input {
        Input::Get(path, f) => Request::get(format!("{path}?{}", urlencoded(f)))
            .header(header::AUTHORIZATION, &bearer)
            .body(Body::empty()),
        Input::Post(path, f) => {
            let mut f = f.clone();
            if !f.iter().any(|(k, _)| k == "csrf") {
                f.push(("csrf".into(), csrf.into()));
            }
            Request::post(*path)
                .header(header::AUTHORIZATION, &bearer)
                .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
                .header("sec-fetch-site", "same-origin")
                .body(Body::from(urlencoded(&f)))
        }
        Input::Lineage(tenant, run) => Request::get(format!("/runs/{}/{}", encode_all(tenant), encode_all(run)))
            .header(header::AUTHORIZATION, &bearer)
            .body(Body::empty()),
    }
    .expect("an encoded request always builds");
    let r = a.send(request).await;
    prop_assert!(r.status.as_u16() < 500, "{input:?} answered {}: {}", r.status, r.body);
    let login_refused = matches!(input, Input::Post("/login", _)) && r.status.as_u16() == 401;
    if r.status.is_client_error() && !login_refused {
        // An error page names its code (axum's own rejections are plain text).
        let code = if r.body.contains("id=\"error-code\"") {
            r.text_of("error-code")
        } else {
            String::new()
        };
        prop_assert!(
            !code.is_empty() && code.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'),
            "{input:?} answered {} without an error code: {}",
            r.status,
            r.body
        );
    }
    Ok(())
}

async fn any_query_form_or_path_gets_a_page_or_a_typed_error(engine: Engine) {
    let a = app(engine).await;
    let s = seed(&a.db.ferry).await;
    let csrf = a.csrf(ROOT).await;
    let known: Vec<String> = [
        "acme".to_owned(),
        "globex".into(),
        "payments".into(),
        "card_declined".into(),
        "2024-02-29T23:59:59".into(),
        "99999999-01-01".into(),
        s.acme_dead_run.to_string(),
        s.acme_runs[0].to_string(),
        s.acme_dead_rows[0].to_string(),
    ]
    .into();
    let handle = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || {
        let mut runner = TestRunner::new(Config {
            cases: 300,
            failure_persistence: None,
            ..Config::default()
        });
        let outcome = runner.run(&input(known), |i| handle.block_on(check(&a, &csrf, i)));
        if let Err(e) = outcome {
            panic!("{e}");
        }
    })
    .await
    .unwrap();
}
