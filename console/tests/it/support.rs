//! Shared pieces: a console over a fresh database with known tokens, seeded
//! data, and requests driven through the router in-process.

use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderMap, Request, StatusCode};
use ferry::{Engine, JobError, NewRun, OutboxMessage, RetryPolicy};
use ferry_console::{Console, ConsoleConfig, Tokens};
use ferry_consumer::process::record_dead_letter;
use ferry_consumer::store::ConsumerStore;
use ferry_consumer::{process_record, Handler, HandlerError, Processed, Record};
use ferry_relay::publish::headers_for;
use ferry_relay::store::RelayStore;
use ferry_testkit::TestDb;
use futures::future::BoxFuture;
use http_body_util::BodyExt;
use rand::SeedableRng;
use rdkafka::message::Headers;
use serde_json::json;
use tower::ServiceExt;

/// Every tenant, payloads shown.
pub const ROOT: &str = "root-token-0123456789";
/// Only tenant `acme`, payloads hidden.
pub const ACME: &str = "acme-token-0123456789";

pub struct App {
    pub db: TestDb,
    pub console: Console,
}

pub fn tokens() -> Tokens {
    let text = format!(
        "{}\n{}\n",
        Tokens::line_for("root-ops", ROOT, None, true),
        Tokens::line_for("acme-ops", ACME, Some(&["acme".to_owned()]), false),
    );
    Tokens::parse(&text).unwrap()
}

pub async fn app(engine: Engine) -> App {
    let db = TestDb::new(engine).await;
    let console = Console::new(db.ferry.clone(), ConsoleConfig::new(tokens())).unwrap();
    App { db, console }
}

/// A response, read whole.
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: String,
}

impl Reply {
    /// The text of the element with `id` (up to its first child tag).
    pub fn text_of(&self, id: &str) -> String {
        text_of(&self.body, id)
    }

    pub fn header(&self, name: &str) -> &str {
        self.headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or("")
    }
}

/// The text inside the element with `id`, skipping nested opening tags
/// (`<td id=x><a>3</a>` gives `3`).
pub fn text_of(html: &str, id: &str) -> String {
    let at = html
        .find(&format!("id=\"{id}\""))
        .unwrap_or_else(|| panic!("no element #{id} in the page"));
    let mut rest = &html[at..];
    loop {
        let open = rest.find('>').expect("tag closes");
        rest = &rest[open + 1..];
        if !rest.starts_with('<') || rest.starts_with("</") {
            break;
        }
    }
    rest[..rest.find('<').unwrap_or(rest.len())].trim().to_owned()
}

impl App {
    pub async fn send(&self, req: Request<Body>) -> Reply {
        let r = self.console.router().oneshot(req).await.unwrap();
        let status = r.status();
        let headers = r.headers().clone();
        let bytes = r.into_body().collect().await.unwrap().to_bytes();
        Reply {
            status,
            headers,
            body: String::from_utf8_lossy(&bytes).into_owned(),
        }
    }

    /// GET `path` with a bearer token.
    pub async fn get(&self, token: &str, path: &str) -> Reply {
        self.send(
            Request::get(path)
                .header(header::AUTHORIZATION, format!("Bearer {token}"))
                .body(Body::empty())
                .unwrap(),
        )
        .await
    }

    /// The CSRF token the pages give `token`'s bearer credential.
    pub async fn csrf(&self, token: &str) -> String {
        csrf_in(&self.get(token, "/").await.body)
    }

    /// POST a form with a bearer token, as a same-origin browser would.
    pub async fn post(&self, token: &str, path: &str, form: &[(&str, &str)]) -> Reply {
        self.send(
            Request::post(path)
                .header(header::AUTHORIZATION, format!("Bearer {token}"))
                .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
                .header(header::HOST, "console.test")
                .header(header::ORIGIN, "http://console.test")
                .header("sec-fetch-site", "same-origin")
                .body(Body::from(encode(form)))
                .unwrap(),
        )
        .await
    }

    pub async fn scalar(&self, sql: &str) -> i64 {
        self.db.scalar(sql).await
    }
}

/// The hidden CSRF field's value in a page.
pub fn csrf_in(html: &str) -> String {
    let at = html.find("name=\"csrf\" value=\"").expect("the page has a CSRF field");
    let rest = &html[at + "name=\"csrf\" value=\"".len()..];
    rest[..rest.find('"').unwrap()].to_owned()
}

pub fn encode(form: &[(&str, &str)]) -> String {
    form.iter()
        .map(|(k, v)| format!("{k}={}", urlencode(v)))
        .collect::<Vec<_>>()
        .join("&")
}

fn urlencode(s: &str) -> String {
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

/// What [`seed`] made.
pub struct Seeded {
    /// acme's runs (the first has key `order-1`).
    pub acme_runs: Vec<uuid::Uuid>,
    /// globex's run.
    pub globex_run: uuid::Uuid,
    /// acme's dead job's run (died with `card_declined`).
    pub acme_dead_run: uuid::Uuid,
    /// Dead outbox rows: acme's two (`message_too_large`), globex's one (`topic_authorization_failed`).
    pub acme_dead_rows: Vec<i64>,
    pub globex_dead_row: i64,
}

/// Runs for `acme` (three, one of them dead) and `globex` (one), dead outbox
/// rows for both, made through the library and the relay store.
pub async fn seed(f: &ferry::Ferry) -> Seeded {
    let mut acme_runs = Vec::new();
    for i in 1..=3 {
        let r = f
            .create_run_idempotent(
                NewRun::new(
                    "acme",
                    "charge",
                    format!("order-{i}"),
                    json!({ "amount": 100 * i, "secret_marker": "PAYLOAD-ACME" }),
                )
                .queue("payments"),
            )
            .await
            .unwrap();
        acme_runs.push(r.run.run_id);
    }
    let globex_run = f
        .create_run_idempotent(NewRun::new(
            "globex",
            "ship",
            "parcel-1",
            json!({ "secret_marker": "PAYLOAD-GLOBEX" }),
        ))
        .await
        .unwrap()
        .run
        .run_id;
    // acme's dead job: the payments queue's first claim fails terminally.
    let c = f
        .jobs()
        .claim("payments", "worker-1", Duration::from_secs(30), 1)
        .await
        .unwrap()
        .pop()
        .unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    f.jobs()
        .fail(
            &c.lease,
            &JobError::terminal("card_declined"),
            &RetryPolicy::default(),
            &mut rng,
        )
        .await
        .unwrap();
    let acme_dead_run = c.lease.run_id;
    // Dead outbox rows, marked dead by a relay holding their lanes.
    let mut acme_dead_rows = Vec::new();
    for i in 0..2 {
        let msg = OutboxMessage::bytes("acme", "orders", format!("poison-{i}"), b"x".to_vec());
        acme_dead_rows.push(f.enqueue(&msg).await.unwrap());
    }
    let globex_dead_row = f
        .enqueue(&OutboxMessage::bytes("globex", "parcels", "poison-g", b"y".to_vec()))
        .await
        .unwrap();
    let store = RelayStore::new(f.clone());
    let leases = store
        .acquire_lanes("seeder", Duration::from_secs(30), 1024)
        .await
        .unwrap();
    for (id, code) in acme_dead_rows
        .iter()
        .map(|id| (*id, "message_too_large"))
        .chain([(globex_dead_row, "topic_authorization_failed")])
    {
        let lane = lane_of(f, id).await;
        let lease = *leases
            .iter()
            .find(|l| l.lane == lane)
            .expect("the seeder holds every lane");
        store.mark_dead("seeder", lease, id, code).await.unwrap();
    }
    for l in leases {
        store.release_lane("seeder", l).await.unwrap();
    }
    Seeded {
        acme_runs,
        globex_run,
        acme_dead_run,
        acme_dead_rows,
        globex_dead_row,
    }
}

async fn lane_of(f: &ferry::Ferry, id: i64) -> i32 {
    i32::try_from(
        f.db()
            .fetch_i64(&format!("SELECT CAST(lane AS BIGINT) FROM outbox WHERE id = {id}"))
            .await
            .unwrap(),
    )
    .unwrap()
}

/// A consumer handler that writes no effects of its own.
struct NoEffects;

impl Handler for NoEffects {
    fn handle<'a>(&'a self, _: &'a Record, _: &'a mut ferry::Tx) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async { Ok(()) })
    }
}

/// The record the relay would publish for the pending outbox row `id`, at
/// `offset` of partition 0: the relay store reads the row
/// (`pending_batch`) and the relay builds its headers (`headers_for`, so the
/// effect key is the one published).
async fn record_of(f: &ferry::Ferry, id: i64, offset: i64) -> Record {
    let database_id = f.database_id().await.unwrap();
    let lane = lane_of(f, id).await;
    let row = RelayStore::new(f.clone())
        .pending_batch(lane, 10_000)
        .await
        .unwrap()
        .into_iter()
        .find(|r| r.id == id)
        .expect("the row is pending");
    let headers = headers_for(&row, Some(&database_id));
    Record {
        topic: row.topic.clone(),
        partition: 0,
        offset,
        key: Some(row.key.clone().into_bytes()),
        payload: Some(row.payload.clone()),
        headers: headers
            .iter()
            .map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec()))
            .collect(),
        timestamp: None,
    }
}

/// Consumer group `group` processes the pending outbox rows `ids` (in
/// order) through the real pipeline's code, the broker's hop aside: the
/// record is the one the relay would publish ([`record_of`]), and the
/// consumer takes the record's effect key (`Record::effect_key`) and commits
/// its ledger row and offset under a partition lease (`process_record`).
/// Returns the effect keys written.
pub async fn consume(f: &ferry::Ferry, group: &str, ids: &[i64]) -> Vec<String> {
    let consumer = ConsumerStore::new(f.clone());
    let mut keys = Vec::new();
    for (offset, id) in (0_i64..).zip(ids) {
        let record = record_of(f, *id, offset).await;
        let (lease, _) = consumer
            .acquire_partition(group, &record.topic, 0, "consumer-1", Duration::from_secs(30))
            .await
            .unwrap();
        let key = record.effect_key().expect("the relay publishes an effect key");
        let done = process_record(&consumer, &lease, &record, &key, &NoEffects)
            .await
            .unwrap();
        assert_eq!(done, Processed::Applied);
        keys.push(key);
    }
    keys
}

/// Consumer group `group` dead-letters the pending outbox row `id` read at
/// `offset` (what the runner records when a record's retries run out), as
/// member `consumer-1`.
pub async fn dead_letter(f: &ferry::Ferry, group: &str, id: i64, offset: i64) {
    let consumer = ConsumerStore::new(f.clone());
    let record = record_of(f, id, offset).await;
    let (lease, _) = consumer
        .acquire_partition(group, &record.topic, 0, "consumer-1", Duration::from_secs(30))
        .await
        .unwrap();
    let key = record.effect_key().expect("the relay publishes an effect key");
    let done = record_dead_letter(&consumer, &lease, &record, &key).await.unwrap();
    assert_eq!(done, Processed::DeadLettered);
}
