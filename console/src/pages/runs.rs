//! Runs: search (by run id, by tenant and idempotency key, by state,
//! operation, queue and time, in keyset pages through `Operator::list_runs`),
//! and one run's lineage (`Operator::run_lineage` plus each consumer group's
//! ledger entries for its outbox rows): "where is my event?" on one page.

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Redirect, Response};
use ferry::outbox::effect_key_of;
use ferry::{Millis, RunCursor, RunFilter, RunState, RunSummary};
use maud::{html, Markup};
use uuid::Uuid;

use super::dead::replay_job_form;
use super::{age, code_or, csrf_field, layout, reason_field, ts, urlencode, Frame};
use crate::auth::Principal;
use crate::error::ConsoleError;
use crate::extract::{Form, Path, Query};
use crate::guard::check_post;
use crate::AppState;

/// Runs per page.
const PAGE: u32 = 50;
const RUN_STATES: [&str; 4] = ["queued", "succeeded", "failed", "cancelled"];

#[derive(Debug, Default, Clone, serde::Deserialize)]
pub(crate) struct SearchQuery {
    #[serde(default)]
    tenant: Option<String>,
    #[serde(default)]
    run_id: Option<String>,
    #[serde(default)]
    state: Option<String>,
    #[serde(default)]
    operation: Option<String>,
    #[serde(default)]
    queue: Option<String>,
    /// Accepted at or after (`YYYY-MM-DDTHH:MM[:SS]`, UTC, or epoch ms).
    #[serde(default)]
    from: Option<String>,
    /// Accepted before (same forms).
    #[serde(default)]
    before: Option<String>,
    /// The previous page's cursor.
    #[serde(default)]
    after: Option<String>,
}

fn given(s: &Option<String>) -> Option<&str> {
    s.as_deref().map(str::trim).filter(|s| !s.is_empty())
}

/// Parses `YYYY-MM-DD[THH:MM[:SS]]` (UTC; a day of the calendar, in the
/// years 1970 to 9999) or non-negative epoch milliseconds. Anything else,
/// a 31st of February or a year past 9999 included, is `bad_request`:
/// nothing is rolled over into another day or wrapped.
pub(crate) fn parse_instant(s: &str) -> Result<Millis, ConsoleError> {
    let bad = || ConsoleError::BadRequest(format!("{s:?} is not YYYY-MM-DDTHH:MM (UTC) or epoch ms"));
    if let Ok(ms) = s.parse::<i64>() {
        return Millis::new(ms).map_err(|_| bad());
    }
    let (date, time) = s.split_once(['T', ' ']).unwrap_or((s, "00:00"));
    let (mut date, mut time) = (date.split('-'), time.split(':'));
    // One field: decimal digits only (no sign, no space), within `range`.
    let field = |parts: &mut std::str::Split<'_, char>, range: std::ops::RangeInclusive<i64>| {
        parts
            .next()
            .filter(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|p| p.parse::<i64>().ok())
            .filter(|n| range.contains(n))
    };
    let y = field(&mut date, 1970..=9999).ok_or_else(bad)?;
    let m = field(&mut date, 1..=12).ok_or_else(bad)?;
    let day = field(&mut date, 1..=days_in_month(y, m)).ok_or_else(bad)?;
    let hh = field(&mut time, 0..=23).ok_or_else(bad)?;
    let mm = field(&mut time, 0..=59).ok_or_else(bad)?;
    let ss = match time.clone().next() {
        None => 0,
        Some(_) => field(&mut time, 0..=59).ok_or_else(bad)?,
    };
    if date.next().is_some() || time.next().is_some() {
        return Err(bad());
    }
    // Days from civil (Howard Hinnant's algorithm); the bounds above keep
    // every step far from overflow.
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Millis::new(((days * 86_400) + hh * 3600 + mm * 60 + ss) * 1000).map_err(|_| bad())
}

/// Days in month `m` (1 to 12) of year `y`, in the Gregorian calendar.
fn days_in_month(y: i64, m: i64) -> i64 {
    match m {
        2 if y % 4 == 0 && (y % 100 != 0 || y % 400 == 0) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

pub(crate) async fn search(
    State(state): State<AppState>,
    principal: Principal,
    Query(q): Query<SearchQuery>,
) -> Result<Response, ConsoleError> {
    let tenant = principal.scope(q.tenant.as_deref())?;
    if let Some(id) = given(&q.run_id) {
        let run = Uuid::parse_str(id).map_err(|_| ConsoleError::BadRequest("run id must be a UUID".into()))?;
        let Some(t) = &tenant else {
            return Err(ConsoleError::BadRequest("give the tenant with a run id".into()));
        };
        return Ok(Redirect::to(&format!("/runs/{}/{run}", urlencode(t))).into_response());
    }
    let filter = RunFilter {
        tenant: tenant.clone(),
        state: given(&q.state).map(str::parse::<RunState>).transpose()?,
        queue: given(&q.queue).map(str::to_owned),
        operation: given(&q.operation).map(str::to_owned),
        created_from: given(&q.from).map(parse_instant).transpose()?,
        created_before: given(&q.before).map(parse_instant).transpose()?,
    };
    let after: Option<RunCursor> = given(&q.after).map(str::parse).transpose()?;
    let page = state.ferry.operator().list_runs(&filter, after.as_ref(), PAGE).await?;
    let frame = Frame {
        principal: &principal,
        tenant: tenant.as_deref(),
    };
    let next_link = page.next.map(|c| {
        let mut params = vec![];
        for (k, v) in [
            ("tenant", &tenant),
            ("state", &q.state),
            ("operation", &q.operation),
            ("queue", &q.queue),
            ("from", &q.from),
            ("before", &q.before),
        ] {
            if let Some(v) = given(v) {
                params.push(format!("{k}={}", urlencode(v)));
            }
        }
        params.push(format!("after={}", urlencode(&c.to_string())));
        format!("/runs?{}", params.join("&"))
    });
    let body = html! {
        (search_forms(&principal, tenant.as_deref(), &q))
        h2 { "Runs" @if after.is_some() { " (continued)" } }
        (run_table(&page.runs, "runs"))
        @if page.runs.is_empty() { p.empty #no-runs { "No run matches." } }
        @if let Some(next) = next_link { p { a #next-page href=(next) { "Next " (PAGE) " →" } } }
    };
    Ok(layout(&frame, "Runs", body).into_response())
}

fn search_forms(principal: &Principal, tenant: Option<&str>, q: &SearchQuery) -> Markup {
    let v = |s: &Option<String>| s.clone().unwrap_or_default();
    html! {
        form.search method="get" action="/runs" #run-search {
            @if let Some(t) = tenant { input type="hidden" name="tenant" value=(t); }
            label { "Run id" input name="run_id" size="36" value=(v(&q.run_id)); }
            label { "State" select name="state" {
                option value="" { "any" }
                @for s in RUN_STATES { option value=(s) selected[q.state.as_deref() == Some(s)] { (s) } }
            } }
            label { "Operation" input name="operation" value=(v(&q.operation)); }
            label { "Queue" input name="queue" value=(v(&q.queue)); }
            label { "Accepted from (UTC)" input name="from" type="datetime-local" value=(v(&q.from)); }
            label { "before" input name="before" type="datetime-local" value=(v(&q.before)); }
            button type="submit" { "Search" }
        }
        // POST, so the key never lands in a URL, a log or the history.
        form.search method="post" action="/runs" #key-search {
            (csrf_field(principal))
            label { "Tenant"
                input name="tenant" required value=(tenant.unwrap_or("")); }
            label { "Idempotency key" input #key name="key" type="password" autocomplete="off" required; }
            label { "Operation (optional)" input name="operation"; }
            button #find-by-key type="submit" { "Find by key" }
        }
    }
}

fn state_class(s: &str) -> String {
    format!("state-{s}")
}

fn run_table(runs: &[RunSummary], id: &str) -> Markup {
    html! {
        @if !runs.is_empty() {
            table id=(id) {
                thead { tr { th { "run" } th { "tenant" } th { "operation" } th { "queue" } th { "state" } th { "job" } th { "attempts" } th { "error" } th { "accepted" } } }
                tbody { @for r in runs {
                    tr { td { a.run-link href=(format!("/runs/{}/{}", urlencode(&r.tenant), r.run_id)) { code { (r.run_id) } } }
                        td { (r.tenant) } td { (r.operation) } td { (r.queue) }
                        td class=(state_class(r.state.as_str())) { (r.state.as_str()) }
                        td { (r.job_state.as_str()) }
                        td.num { (r.attempts) "/" (r.max_attempts) }
                        td { (code_or(r.last_error_code.as_deref(), "")) }
                        td { (ts(r.created_at.get())) } }
                } }
            }
        }
    }
}

#[derive(Debug, serde::Deserialize)]
pub(crate) struct KeyForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    tenant: String,
    #[serde(default)]
    key: String,
    #[serde(default)]
    operation: Option<String>,
}

/// Finds runs by tenant and idempotency key (POSTed, compared as Ferry
/// stores the key, shown only redacted).
pub(crate) async fn search_by_key(
    State(state): State<AppState>,
    principal: Principal,
    headers: HeaderMap,
    Form(f): Form<KeyForm>,
) -> Result<Markup, ConsoleError> {
    check_post(&principal, &headers, &f.csrf)?;
    let tenant = f.tenant.trim();
    if tenant.is_empty() || f.key.is_empty() {
        return Err(ConsoleError::BadRequest("give the tenant and the key".into()));
    }
    principal.check(tenant)?;
    let found = state.store.runs_by_key(tenant, &f.key, given(&f.operation)).await?;
    let frame = Frame {
        principal: &principal,
        tenant: Some(tenant),
    };
    let body = html! {
        (search_forms(&principal, Some(tenant), &SearchQuery::default()))
        h2 { "Runs for key " code #key-hash { (ferry::redact(&f.key)) } "…" }
        @if found.is_empty() { p.empty #no-runs { "No run was accepted with that key (or its record expired)." } }
        @else {
            table #key-runs {
                thead { tr { th { "run" } th { "operation" } th { "key (redacted)" } th { "accepted" } th { "deduplicates until" } } }
                tbody { @for k in &found {
                    tr { td { a.run-link href=(format!("/runs/{}/{}", urlencode(tenant), k.run_id)) { code { (k.run_id) } } }
                        td { (k.operation) } td { code { (ferry::redact(&k.key)) } }
                        td { (ts(k.created_at.get())) } td { (ts(k.expires_at.get())) } }
                } }
            }
        }
    };
    Ok(layout(&frame, "Runs", body))
}

pub(crate) async fn lineage(
    State(state): State<AppState>,
    principal: Principal,
    Path((tenant, run_id)): Path<(String, Uuid)>,
) -> Result<Markup, ConsoleError> {
    principal.check(&tenant)?;
    let l = state.ferry.operator().run_lineage(&tenant, run_id).await?;
    let ids: Vec<i64> = l.outbox.iter().map(|o| o.id).collect();
    let (ledger, now, database_id) = tokio::try_join!(
        state.store.ledger_for_outbox_rows(&tenant, &ids),
        state.store.now(),
        state.ferry.database_id(),
    )?;
    let frame = Frame {
        principal: &principal,
        tenant: Some(&tenant),
    };
    let r = &l.run;
    let s = &l.summary;
    let hidden = html! { span.note.payload-hidden { "hidden (this token may not see payloads)" } };
    let run_link = |id: Uuid| format!("/runs/{}/{id}", urlencode(&tenant));
    let body = html! {
        table #run {
            tbody {
                tr { th { "tenant" } td { (r.tenant) } }
                tr { th { "run id" } td { code #run-id { (r.run_id) } } }
                tr { th { "operation" } td { (r.operation) } }
                tr { th { "state" } td #run-state class=(state_class(r.state.as_str())) { (r.state.as_str()) } }
                tr { th { "version" } td { (r.version) } }
                tr { th { "job" } td { (s.queue) " · " span #job-state { (s.job_state.as_str()) } " · attempts " (s.attempts) "/" (s.max_attempts)
                    @if let Some(c) = s.last_error_code.as_deref().filter(|c| !c.is_empty()) { " · " code { (c) } } } }
                tr { th { "accepted" } td { (ts(r.created_at.get())) " (" (age(now.get() - r.created_at.get())) " ago)" } }
                tr { th { "updated" } td { (ts(r.updated_at.get())) } }
                @if let Some(at) = s.scheduled_at { tr { th { "scheduled for" } td { (ts(at.get())) } } }
                @if let Some(d) = r.deadline_at { tr { th { "deadline" } td { (ts(d.get())) } } }
                @if let Some(p) = s.parent_run_id { tr { th { "parent" } td { a href=(run_link(p)) { code { (p) } } } } }
                @if let Some(p) = r.replay_of { tr { th { "replays" } td { a href=(run_link(p)) { code { (p) } } } } }
                tr { th { "request" } td { @if principal.payloads { pre #request { (r.request) } } @else { (hidden) } } }
            }
        }
        section.actions {
            @if !r.state.is_terminal() {
                form.inline method="post" action="/actions/runs/cancel" {
                    (csrf_field(&principal))
                    input type="hidden" name="tenant" value=(r.tenant);
                    input type="hidden" name="run_id" value=(r.run_id);
                    (reason_field())
                    button #cancel-run type="submit" { "Cancel run" }
                }
            }
            @if r.state == RunState::Failed { (replay_job_form(&principal, &r.tenant, &r.run_id.to_string())) }
        }
        section {
            h2 { "Events" }
            table #events {
                thead { tr { th { "seq" } th { "kind" } th { "at" } th { "body" } } }
                tbody { @for e in &l.events {
                    tr { td.num { (e.seq) } td { (e.kind) } td { (ts(e.created_at.get())) }
                        td { @if principal.payloads { pre { (e.body) } } @else { (hidden) } } }
                } }
            }
        }
        section {
            h2 { "Job attempts" }
            @if l.attempts.is_empty() { p.empty { "Not claimed yet." } }
            @else {
                table #attempts {
                    thead { tr { th { "attempt" } th { "generation" } th { "owner" } th { "claimed" } th { "finished" } th { "outcome" } th { "error" } } }
                    tbody { @for a in &l.attempts {
                        tr { td.num { (a.attempt) } td.num { (a.generation) } td { (a.worker) } td { (ts(a.claimed_at.get())) }
                            td { (a.finished_at.map_or("—".to_owned(), |f| ts(f.get()))) }
                            td { (a.outcome.map_or("running", |o| o.as_str())) }
                            td { (code_or(Some(&[a.error_class.as_deref(), a.error_code.as_deref()].into_iter().flatten().collect::<Vec<_>>().join(" ")), "")) } }
                    } }
                }
            }
        }
        section {
            h2 { "Effects" }
            @if l.effects.is_empty() { p.empty { "No effect recorded." } }
            @else {
                table #effects {
                    thead { tr { th { "step" } th { "operation" } th { "state" } th { "generation" } th { "provider ref" } th { "error" } } }
                    tbody { @for e in &l.effects {
                        tr { td { (e.step) } td { (e.operation) } td { (format!("{:?}", e.state).to_lowercase()) } td.num { (e.generation) }
                            td { (e.provider_ref.as_deref().unwrap_or("")) } td { (code_or(e.error_code.as_deref(), "")) } }
                    } }
                }
            }
        }
        section {
            h2 { "Outbox rows" }
            @if l.outbox.is_empty() { p.empty { "No outbox row keyed by this run (or retention removed them)." } }
            @else {
                table #outbox {
                    thead { tr { th { "id" } th { "topic" } th { "effect key" } th { "state" } th { "publish attempts" } th { "last error" } th { "written" } th { "delivered" } } }
                    tbody { @for o in &l.outbox {
                        tr id=(format!("outbox-{}", o.id)) { td.num { (o.id) } td { (o.topic) }
                            td { (code_or(effect_key_of(&tenant, o.effect_key.as_deref(), o.id, Some(&database_id)).as_deref(), "")) }
                            td class=(format!("outbox-state {}", state_class(&o.state))) { (o.state) }
                            td.num { (o.publish_attempts) } td { (code_or(o.last_error.as_deref(), "")) }
                            td { (ts(o.created_at.get())) }
                            td { (o.delivered_at.map_or("—".to_owned(), |d| ts(d.get()))) } }
                    } }
                }
            }
        }
        section {
            h2 { "Consumer ledger" }
            @if ledger.is_empty() { p.empty #no-ledger { "No consumer group has processed these rows." } }
            @else {
                table #ledger {
                    thead { tr { th { "outbox id" } th { "group" } th { "effect key" } th { "topic" } th { "partition" } th { "offset" } th { "outcome" } th { "processed" } } }
                    tbody { @for e in &ledger {
                        tr { td.num { (e.outbox_id) } td { (e.group_id) } td { code { (e.effect_key) } } td { (e.topic) }
                            td.num { (e.partition) } td.num { (e.record_offset) } td class=(state_class(&e.outcome)) { (e.outcome) }
                            td { (ts(e.processed_at.get())) } }
                    } }
                }
            }
        }
        @if !l.children.is_empty() {
            section { h2 { "Child runs" } (run_table(&l.children, "children")) }
        }
    };
    Ok(layout(&frame, &format!("Run {}", r.run_id), body))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn instants_parse_as_utc() {
        assert_eq!(parse_instant("1970-01-01T00:00").unwrap().get(), 0);
        assert_eq!(parse_instant("2027-01-15T08:00:00").unwrap().get(), 1_800_000_000_000);
        assert_eq!(parse_instant("2000-02-29").unwrap().get(), 951_782_400_000);
        assert_eq!(parse_instant("1800000000123").unwrap().get(), 1_800_000_000_123);
        for bad in ["2020-13-01", "yesterday", "2020-01-01T25:00", "-5"] {
            assert!(parse_instant(bad).is_err(), "{bad}");
        }
    }

    /// The instant chrono gives a date and time, `None` for a day the
    /// calendar does not have.
    fn chrono_ms(y: i32, m: u32, d: u32, hh: u32, mm: u32, ss: u32) -> Option<i64> {
        let at = chrono::NaiveDate::from_ymd_opt(y, m, d)?.and_hms_opt(hh, mm, ss)?;
        Some(at.and_utc().timestamp_millis())
    }

    #[test]
    fn absurd_dates_are_refused_not_wrapped() {
        for bad in [
            "99999999-01-01",
            "999999999999-12-31T23:59",
            "2024-02-30",
            "2023-02-29",
            "2024-04-31",
            "1969-12-31",
            "-5-01-01",
            "2024-+1-01",
            "2024-01-01T24:00",
            "2024-01-01T10:00:",
            "2024-01-01-01",
            "-1",
        ] {
            assert_eq!(parse_instant(bad).unwrap_err().code(), "bad_request", "{bad}");
        }
        assert_eq!(parse_instant("2024-02-29T12:30:15").unwrap().get(), 1_709_209_815_000);
        assert_eq!(parse_instant("9999-12-31 23:59:59").unwrap().get(), 253_402_300_799_000);
        assert_eq!(parse_instant("42").unwrap().get(), 42);
    }

    proptest! {
        /// Any text is an instant or `bad_request`, never a panic.
        #[test]
        fn any_text_is_an_instant_or_bad_request(s in any::<String>()) {
            if let Err(e) = parse_instant(&s) {
                prop_assert_eq!(e.code(), "bad_request");
            }
        }

        /// Every field combination near the bounds: accepted exactly when
        /// the calendar has that moment (years 1970 to 9999), and then the
        /// instant chrono computes.
        #[test]
        fn dates_match_the_calendar(
            y in prop_oneof![1900..10_100_i64, any::<i64>()],
            m in 0..14_i64,
            d in 0..33_i64,
            hh in 0..26_i64,
            mm in 0..62_i64,
            ss in prop::option::of(0..62_i64),
            sep in prop::sample::select(vec!["T", " "]),
        ) {
            let text = match ss {
                Some(ss) => format!("{y:04}-{m:02}-{d:02}{sep}{hh:02}:{mm:02}:{ss:02}"),
                None => format!("{y:04}-{m:02}-{d:02}{sep}{hh:02}:{mm:02}"),
            };
            let field = |v: i64| u32::try_from(v).ok();
            let want = (1970..=9999)
                .contains(&y)
                .then(|| {
                    let (y, m, d, hh, mm, ss) =
                        (i32::try_from(y).ok()?, field(m)?, field(d)?, field(hh)?, field(mm)?, field(ss.unwrap_or(0))?);
                    // chrono takes a leap second (ss = 60); a user's clock text does not.
                    (ss < 60).then(|| chrono_ms(y, m, d, hh, mm, ss)).flatten()
                })
                .flatten();
            prop_assert_eq!(parse_instant(&text).ok().map(Millis::get), want, "{}", text);
        }
    }
}
