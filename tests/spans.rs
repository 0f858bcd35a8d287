//! Claim, complete and fail each open a span with the identifiers DESIGN
//! names (queue, tenant, run id, lease generation, error code), and no span
//! carries the request or the result.
//!
//! Its own test binary: the subscriber is installed per thread
//! (`set_default`), and claims on other tests' threads in a shared binary
//! made tracing's per-callsite interest cache drop these spans' fields now
//! and then.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry::{JobError, NewRun, RetryPolicy};
use serde_json::json;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Record};
use tracing::{Id, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::Layer;

use ferry::Engine as Kind;
use ferry_testkit::TestDb;

/// A span's name and every field recorded on it, as text.
type SpanRecord = (String, Vec<(String, String)>);

/// Every span opened while the layer is installed.
#[derive(Clone, Default)]
struct Spans(Arc<Mutex<Vec<SpanRecord>>>);

struct Fields<'a>(&'a mut Vec<(String, String)>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.push((field.name().to_owned(), format!("{value:?}")));
    }
}

impl<S: Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>> Layer<S> for Spans {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, _ctx: Context<'_, S>) {
        let mut fields = vec![("id".to_owned(), format!("{}", id.into_u64()))];
        attrs.record(&mut Fields(&mut fields));
        self.0
            .lock()
            .unwrap()
            .push((attrs.metadata().name().to_owned(), fields));
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _ctx: Context<'_, S>) {
        let mut all = self.0.lock().unwrap();
        let key = format!("{}", id.into_u64());
        if let Some((_, fields)) = all
            .iter_mut()
            .rev()
            .find(|(_, f)| f.iter().any(|(k, v)| k == "id" && *v == key))
        {
            values.record(&mut Fields(fields));
        }
    }
}

impl Spans {
    fn field(&self, span: &str, field: &str) -> Option<String> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|(name, _)| name == span)
            .flat_map(|(_, f)| f.iter().filter(|(k, _)| k == field).map(|(_, v)| v.clone()))
            .last()
    }
}

#[tokio::test(flavor = "current_thread")]
async fn claim_complete_and_fail_are_spans_without_payloads() {
    let spans = Spans::default();
    let _guard = tracing::subscriber::set_default(tracing_subscriber::registry().with(spans.clone()));
    let t = TestDb::new(Kind::Sqlite).await;
    let secret = "card-4242-secret";
    for key in ["k-ok", "k-bad"] {
        let run = NewRun::new("acme", "charge", key, json!({"card": secret})).queue("q");
        t.ferry.create_run_idempotent(run).await.unwrap();
    }
    let mut claimed = t
        .ferry
        .jobs()
        .claim("q", "w1", Duration::from_secs(30), 2)
        .await
        .unwrap();
    assert_eq!(spans.field("ferry.claim", "queue").as_deref(), Some("\"q\""));
    assert_eq!(spans.field("ferry.claim", "claimed").as_deref(), Some("2"));
    let bad = claimed.pop().unwrap();
    let ok = claimed.pop().unwrap();
    t.ferry
        .jobs()
        .complete(&ok.lease, &json!({"receipt": secret}))
        .await
        .unwrap();
    assert_eq!(
        spans.field("ferry.complete", "run_id"),
        Some(ok.lease.run_id.to_string())
    );
    assert_eq!(spans.field("ferry.complete", "generation").as_deref(), Some("1"));
    assert_eq!(spans.field("ferry.complete", "tenant").as_deref(), Some("acme"));
    let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(1);
    t.ferry
        .jobs()
        .fail(
            &bad.lease,
            &JobError::terminal("card_declined"),
            &RetryPolicy::default(),
            &mut rng,
        )
        .await
        .unwrap();
    assert_eq!(
        spans.field("ferry.fail", "error_code").as_deref(),
        Some("card_declined")
    );
    assert_eq!(spans.field("ferry.fail", "outcome").as_deref(), Some("\"dead\""));
    let all = format!("{:?}", spans.0.lock().unwrap());
    assert!(!all.contains(secret), "a span carried a payload: {all}");
}
