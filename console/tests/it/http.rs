//! Plain HTTP tests, on both engines: authentication, the session cookie,
//! CSRF and origin checks, tenant scopes, payload permission, the security
//! headers, the actions and their audit entries, and the overview's figures.

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use ferry::Engine;
use ferry_testkit::on_both_engines;

use crate::support::*;

on_both_engines!(
    every_console_query_prepares,
    every_response_carries_the_security_headers,
    pages_and_actions_need_a_token,
    login_sets_a_strict_http_only_session_cookie,
    actions_need_the_csrf_token_and_the_same_origin,
    a_scoped_token_sees_and_touches_only_its_tenants,
    payloads_are_shown_only_to_tokens_allowed_them,
    cancel_and_replay_are_audited_with_the_token_name,
    a_group_replay_goes_no_further_than_the_rows_shown,
    the_overview_figures_match_the_database,
    the_overview_leaves_rows_the_delivered_ledger_covers_out_of_the_backlog,
    the_overview_groups_lanes_by_owner,
    the_overview_shows_each_consumer_group_with_what_the_database_knows,
    a_scoped_overview_shows_no_other_tenant_s_consumer_ledger,
    the_backlog_plot_has_axes_units_and_a_legend,
    empty_error_cells_have_no_code_box,
    runs_are_found_by_key_and_paged_and_their_lineage_shows_where_events_went,
    the_lineage_shows_ledger_entries_under_the_published_key_of_the_row_s_tenant,
);

async fn every_console_query_prepares(engine: Engine) {
    let a = app(engine).await;
    a.console.store().check_queries().await.unwrap();
}

async fn every_response_carries_the_security_headers(engine: Engine) {
    let a = app(engine).await;
    let anonymous = |path: &str| Request::get(path).body(Body::empty()).unwrap();
    let replies = [
        a.send(anonymous("/login")).await,
        a.send(anonymous("/")).await,
        a.send(anonymous("/static/console.css")).await,
        a.get(ROOT, "/").await,
        a.get(ROOT, "/no-such-page").await,
        a.get("wrong", "/").await,
        a.post(ROOT, "/actions/runs/cancel", &[("csrf", "x")]).await,
    ];
    for r in &replies {
        assert_eq!(r.header("content-security-policy"), ferry_console::CSP);
        assert_eq!(r.header("x-content-type-options"), "nosniff");
        assert_eq!(r.header("referrer-policy"), "no-referrer");
        assert_eq!(r.header("x-frame-options"), "DENY");
        assert_eq!(r.header("cache-control"), "no-store");
    }
    assert!(ferry_console::CSP.contains("script-src 'self'") && !ferry_console::CSP.contains("unsafe-inline"));
    assert_eq!(replies[4].status, StatusCode::NOT_FOUND);
    // No inline script or style in a page: the CSP would block it.
    let page = &replies[3].body;
    assert!(!page.contains("<script>") && !page.contains("style=") && !page.contains("<style"));
    assert!(page.contains("<script src=\"/static/console.js\""));
}

async fn pages_and_actions_need_a_token(engine: Engine) {
    let a = app(engine).await;
    let s = seed(&a.db.ferry).await;
    // A browser without a session is sent to the login page.
    let r = a.send(Request::get("/").body(Body::empty()).unwrap()).await;
    assert_eq!(r.status, StatusCode::SEE_OTHER);
    assert_eq!(r.header("location"), "/login");
    // A wrong bearer token is refused outright.
    for bad in ["wrong", "", "root-token-012345678", "ROOT-TOKEN-0123456789"] {
        let r = a.get(bad, "/dead").await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED, "token {bad:?}");
        assert!(r.header("www-authenticate").starts_with("Bearer"));
    }
    // An action without any credential is refused and changes nothing.
    let id = s.acme_dead_rows[0].to_string();
    let r = a
        .send(
            Request::post("/actions/outbox/replay")
                .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
                .body(Body::from(encode(&[("id", &id), ("reason", "try"), ("csrf", "x")])))
                .unwrap(),
        )
        .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert_eq!(a.scalar("SELECT count(*) FROM outbox WHERE state = 'dead'").await, 3);
    assert_eq!(a.scalar("SELECT count(*) FROM ferry_audit").await, 0);
    // The right token gets the page, naming its holder.
    let r = a.get(ROOT, "/").await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.text_of("actor"), "root-ops");
}

async fn login_sets_a_strict_http_only_session_cookie(engine: Engine) {
    let a = app(engine).await;
    let login = |token: &str| {
        Request::post("/login")
            .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
            .body(Body::from(encode(&[("token", token)])))
            .unwrap()
    };
    let r = a.send(login("nope")).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert!(r.headers.get(header::SET_COOKIE).is_none());

    let r = a.send(login(ROOT)).await;
    assert_eq!(r.status, StatusCode::SEE_OTHER);
    let set = r.header("set-cookie").to_owned();
    for part in ["HttpOnly", "SameSite=Strict", "Path=/"] {
        assert!(set.contains(part), "{set} lacks {part}");
    }
    assert!(!set.contains(ROOT), "the cookie must not carry the token");
    let cookie = set.split(';').next().unwrap().to_owned();
    let with_cookie = |c: &str| Request::get("/").header(header::COOKIE, c).body(Body::empty()).unwrap();
    let r = a.send(with_cookie(&cookie)).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.text_of("actor"), "root-ops");
    // A tampered cookie is no session.
    let tampered = cookie.replace("root-ops", "acme-ops");
    assert_eq!(a.send(with_cookie(&tampered)).await.status, StatusCode::SEE_OTHER);
    // Another console process (another server key) does not know it.
    let other = ferry_console::Console::new(a.db.ferry.clone(), ferry_console::ConsoleConfig::new(tokens())).unwrap();
    let r = tower::ServiceExt::oneshot(other.router(), with_cookie(&cookie))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::SEE_OTHER);
}

async fn actions_need_the_csrf_token_and_the_same_origin(engine: Engine) {
    let a = app(engine).await;
    let s = seed(&a.db.ferry).await;
    let id = s.acme_dead_rows[0].to_string();
    let csrf = a.csrf(ROOT).await;
    let dead = "SELECT count(*) FROM outbox WHERE state = 'dead'";
    // No CSRF token, a wrong one, another credential's.
    let other = a.csrf(ACME).await;
    for token in ["", "0000", other.as_str()] {
        let r = a
            .post(
                ROOT,
                "/actions/outbox/replay",
                &[("id", &id), ("reason", "retry"), ("csrf", token)],
            )
            .await;
        assert_eq!(r.status, StatusCode::FORBIDDEN, "csrf {token:?}");
        assert_eq!(r.text_of("error-code"), "csrf");
    }
    // The right token from another origin, or a cross-site fetch.
    for (name, value) in [
        ("origin", "http://evil.test"),
        ("origin", "null"),
        ("sec-fetch-site", "cross-site"),
    ] {
        let r = a
            .send(
                Request::post("/actions/outbox/replay")
                    .header(header::AUTHORIZATION, format!("Bearer {ROOT}"))
                    .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
                    .header(header::HOST, "console.test")
                    .header(name, value)
                    .body(Body::from(encode(&[("id", &id), ("reason", "retry"), ("csrf", &csrf)])))
                    .unwrap(),
            )
            .await;
        assert_eq!(r.status, StatusCode::FORBIDDEN, "{name}: {value}");
    }
    // A GET cannot act: the route only answers POST.
    let r = a
        .get(ROOT, &format!("/actions/outbox/replay?id={id}&reason=x&csrf={csrf}"))
        .await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(a.scalar(dead).await, 3, "nothing was replayed");
    // A reason is required.
    let r = a
        .post(
            ROOT,
            "/actions/outbox/replay",
            &[("id", &id), ("reason", " "), ("csrf", &csrf)],
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(a.scalar("SELECT count(*) FROM ferry_audit").await, 0);
    // With everything right the row is pending again, audited.
    let r = a
        .post(
            ROOT,
            "/actions/outbox/replay",
            &[("id", &id), ("reason", "broker fixed"), ("csrf", &csrf)],
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.text_of("notice"), format!("Row {id} is pending again."));
    assert_eq!(a.scalar(dead).await, 2);
    assert_eq!(
        a.scalar(&format!(
            "SELECT count(*) FROM ferry_audit WHERE actor = 'root-ops' AND action = 'outbox.replay_dead' \
             AND reason = 'broker fixed' AND subject = 'outbox:[{id}]'"
        ))
        .await,
        1
    );
    // A group: acme's message_too_large rows (one left).
    let r = a
        .post(
            ROOT,
            "/actions/outbox/replay",
            &[
                ("tenant", "acme"),
                ("error_code", "message_too_large"),
                ("reason", "limit raised"),
                ("csrf", &csrf),
            ],
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(a.scalar(dead).await, 1, "globex's row is another group");
}

async fn a_scoped_token_sees_and_touches_only_its_tenants(engine: Engine) {
    let a = app(engine).await;
    let s = seed(&a.db.ferry).await;
    // Pages default to the token's tenant and refuse another.
    let r = a.get(ACME, "/dead").await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(r.body.contains("message_too_large"));
    assert!(!r.body.contains("globex") && !r.body.contains("topic_authorization_failed"));
    for path in ["/?tenant=globex", "/dead?tenant=globex", "/runs?tenant=globex"] {
        assert_eq!(a.get(ACME, path).await.status, StatusCode::FORBIDDEN, "{path}");
    }
    let lineage = format!("/runs/globex/{}", s.globex_run);
    assert_eq!(a.get(ACME, &lineage).await.status, StatusCode::FORBIDDEN);
    assert_eq!(a.get(ROOT, &lineage).await.status, StatusCode::OK);
    // The overview's figures are acme's only: two of the three dead rows.
    assert_eq!(a.get(ACME, "/").await.text_of("dead-total"), "2");
    assert_eq!(a.get(ROOT, "/").await.text_of("dead-total"), "3");
    // Every tenant's traffic (the sampler's throughput and plot) is shown
    // only unfiltered.
    a.console.sample().await.unwrap();
    a.console.sample().await.unwrap();
    for path in ["/", "/?tenant=acme"] {
        let scoped = a.get(if path == "/" { ACME } else { ROOT }, path).await.body;
        assert!(
            !scoped.contains("id=\"throughput\"") && !scoped.contains("id=\"plot\""),
            "{path}"
        );
    }
    let all = a.get(ROOT, "/").await.body;
    assert!(all.contains("id=\"throughput\"") && all.contains("id=\"plot\""));
    // Actions outside the scope change nothing.
    let csrf = a.csrf(ACME).await;
    let g = s.globex_dead_row.to_string();
    let globex_run = s.globex_run.to_string();
    let refused = [
        a.post(
            ACME,
            "/actions/outbox/replay",
            &[
                ("tenant", "globex"),
                ("error_code", "topic_authorization_failed"),
                ("reason", "r"),
                ("csrf", &csrf),
            ],
        )
        .await,
        a.post(
            ACME,
            "/actions/outbox/replay",
            &[("id", &g), ("reason", "r"), ("csrf", &csrf)],
        )
        .await,
        a.post(
            ACME,
            "/actions/runs/cancel",
            &[
                ("tenant", "globex"),
                ("run_id", &globex_run),
                ("reason", "r"),
                ("csrf", &csrf),
            ],
        )
        .await,
        a.post(
            ACME,
            "/actions/queues/pause",
            &[("queue", "default"), ("reason", "r"), ("csrf", &csrf)],
        )
        .await,
    ];
    for r in &refused {
        assert_eq!(r.status, StatusCode::FORBIDDEN, "{}", r.body);
    }
    // Naming its own tenant with another tenant's row id matches nothing.
    let r = a
        .post(
            ACME,
            "/actions/outbox/replay",
            &[("tenant", "acme"), ("id", &g), ("reason", "r"), ("csrf", &csrf)],
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.text_of("notice"), "No dead row matched (already replayed?).");
    assert_eq!(
        a.scalar(&format!(
            "SELECT count(*) FROM outbox WHERE id = {g} AND state = 'dead'"
        ))
        .await,
        1
    );
    assert_eq!(
        a.scalar("SELECT count(*) FROM runs WHERE tenant = 'globex' AND state = 'queued'")
            .await,
        1
    );
}

async fn payloads_are_shown_only_to_tokens_allowed_them(engine: Engine) {
    let a = app(engine).await;
    let s = seed(&a.db.ferry).await;
    let path = format!("/runs/acme/{}", s.acme_runs[1]);
    let shown = a.get(ROOT, &path).await;
    assert_eq!(shown.status, StatusCode::OK);
    assert!(shown.body.contains("PAYLOAD-ACME"), "root may see payloads");
    let hidden = a.get(ACME, &path).await;
    assert_eq!(hidden.status, StatusCode::OK);
    assert!(!hidden.body.contains("PAYLOAD-ACME"), "acme-ops may not see payloads");
    assert!(hidden.body.contains("hidden"));
}

async fn cancel_and_replay_are_audited_with_the_token_name(engine: Engine) {
    let a = app(engine).await;
    let s = seed(&a.db.ferry).await;
    let csrf = a.csrf(ACME).await;
    let live = s.acme_runs.iter().find(|r| **r != s.acme_dead_run).unwrap().to_string();
    let r = a
        .post(
            ACME,
            "/actions/runs/cancel",
            &[
                ("tenant", "acme"),
                ("run_id", &live),
                ("reason", "customer asked"),
                ("csrf", &csrf),
            ],
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(
        a.scalar("SELECT count(*) FROM runs WHERE tenant = 'acme' AND state = 'cancelled'")
            .await,
        1
    );
    // Cancelling again is refused (the run ended) and audits nothing more.
    let r = a
        .post(
            ACME,
            "/actions/runs/cancel",
            &[
                ("tenant", "acme"),
                ("run_id", &live),
                ("reason", "again"),
                ("csrf", &csrf),
            ],
        )
        .await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    assert_eq!(r.text_of("error-code"), "run_terminal");
    let dead = s.acme_dead_run.to_string();
    let r = a
        .post(
            ACME,
            "/actions/jobs/replay",
            &[
                ("tenant", "acme"),
                ("run_id", &dead),
                ("reason", "card updated"),
                ("csrf", &csrf),
            ],
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(
        a.scalar("SELECT count(*) FROM runs WHERE tenant = 'acme' AND replay_of IS NOT NULL")
            .await,
        1
    );
    let audited = a
        .scalar(
            "SELECT count(*) FROM ferry_audit WHERE actor = 'acme-ops' AND \
             ((action = 'jobs.cancel' AND reason = 'customer asked') OR (action = 'jobs.replay_dead' AND reason = 'card updated'))",
        )
        .await;
    assert_eq!(audited, 2);
    assert_eq!(a.scalar("SELECT count(*) FROM ferry_audit").await, 2);
}

async fn the_overview_figures_match_the_database(engine: Engine) {
    let a = app(engine).await;
    seed(&a.db.ferry).await;
    let r = a.get(ROOT, "/").await;
    assert_eq!(r.status, StatusCode::OK);
    let pending = a.scalar("SELECT count(*) FROM outbox WHERE state = 'pending'").await;
    assert!(pending > 0);
    assert_eq!(r.text_of("pending-total"), pending.to_string());
    assert_eq!(r.text_of("dead-total"), "3");
    for (queue, state) in [
        ("payments", "queued"),
        ("payments", "dead"),
        ("default", "queued"),
        ("payments", "succeeded"),
    ] {
        let n = a
            .scalar(&format!(
                "SELECT count(*) FROM jobs WHERE queue = '{queue}' AND state = '{state}'"
            ))
            .await;
        let id = format!("jobs-{queue}-{state}");
        assert_eq!(r.text_of(&id), n.to_string(), "{id}");
    }
    assert_eq!(r.text_of("jobs-payments-dead"), "1");
    // Per lane.
    let lane = a
        .scalar("SELECT CAST(min(lane) AS BIGINT) FROM outbox WHERE state = 'pending'")
        .await;
    let in_lane = a
        .scalar(&format!(
            "SELECT count(*) FROM outbox WHERE state = 'pending' AND lane = {lane}"
        ))
        .await;
    let row = &r.body[r.body.find(&format!("id=\"lane-{lane}\"")).unwrap()..];
    assert!(
        row.contains(&format!("class=\"num pending\">{in_lane}<")),
        "lane {lane}"
    );
    // Every tenant's job counts come from the background census; one
    // tenant's are live.
    a.db.ferry
        .create_run_idempotent(ferry::NewRun::new("acme", "charge", "late", serde_json::json!({})))
        .await
        .unwrap();
    let live = a
        .scalar("SELECT count(*) FROM jobs WHERE queue = 'default' AND state = 'queued'")
        .await;
    let before = a.get(ROOT, "/").await.text_of("jobs-default-queued");
    assert_eq!(before, (live - 1).to_string(), "the census was taken before the run");
    let acme_live = a
        .scalar("SELECT count(*) FROM jobs WHERE tenant = 'acme' AND queue = 'default' AND state = 'queued'")
        .await;
    assert_eq!(
        a.get(ROOT, "/?tenant=acme").await.text_of("jobs-default-queued"),
        acme_live.to_string()
    );
    a.console.census().await.unwrap();
    assert_eq!(a.get(ROOT, "/").await.text_of("jobs-default-queued"), live.to_string());
    // Two samples make a plot.
    a.console.sample().await.unwrap();
    let s = a.console.sample().await.unwrap();
    assert_eq!(s.pending, pending + 1, "the late run's event is pending too");
    let r = a.get(ROOT, "/").await;
    assert!(r.body.contains("<svg id=\"plot\""));
    // A queue whose run events stay out of Kafka says so.
    a.db.ferry
        .operator()
        .set_queue_publish_events("payments", false, "alice", "internal")
        .await
        .unwrap();
    let r = a.get(ROOT, "/").await;
    assert_eq!(r.text_of("unpublished-payments"), "(events not published)");
    assert!(!r.body.contains("unpublished-default"));
}

/// Rows the delivered-ranges ledger covers (`outbox_delivered`, written by
/// WAL capture; inserted here directly) are delivered: neither the total,
/// nor their lane's count, nor the sampler's pending counts them; rows
/// below the first range, in the hole between two and above the last do.
async fn the_overview_leaves_rows_the_delivered_ledger_covers_out_of_the_backlog(engine: Engine) {
    let a = app(engine).await;
    seed(&a.db.ferry).await;
    for i in 0..8 {
        let msg = ferry::OutboxMessage::bytes("acme", "orders", format!("k{i}"), b"{}".to_vec());
        a.db.ferry.enqueue(&msg).await.unwrap();
    }
    let total = a.scalar("SELECT count(*) FROM outbox WHERE state = 'pending'").await;
    let nth = |n: i64| format!("SELECT id FROM outbox WHERE state = 'pending' ORDER BY id LIMIT 1 OFFSET {n}");
    let ids = [
        a.scalar(&nth(1)).await,
        a.scalar(&nth(2)).await,
        a.scalar(&nth(4)).await,
    ];
    assert!(total > 5, "the seed leaves rows above the last range");
    let (first, second) = ((ids[0], ids[1]), (ids[2], a.scalar(&nth(5)).await));
    for (lo, hi) in [first, second] {
        a.db.exec(&format!(
            "INSERT INTO outbox_delivered (lo, hi, delivered_at) VALUES ({lo}, {hi}, 1)"
        ))
        .await
        .unwrap();
    }
    let r = a.get(ROOT, "/").await;
    assert_eq!(r.text_of("pending-total"), (total - 4).to_string());
    let lane = a
        .scalar(&format!(
            "SELECT CAST(lane AS BIGINT) FROM outbox WHERE id = {}",
            ids[0]
        ))
        .await;
    let in_lane = a
        .scalar(&format!(
            "SELECT count(*) FROM outbox WHERE state = 'pending' AND lane = {lane} \
             AND id NOT BETWEEN {} AND {} AND id NOT BETWEEN {} AND {}",
            first.0, first.1, second.0, second.1
        ))
        .await;
    let shown = r.body.find(&format!("id=\"lane-{lane}\"")).map(|at| {
        let row = &r.body[at..];
        row[..row.find("</tr>").unwrap()].contains(&format!("class=\"num pending\">{in_lane}<"))
    });
    assert_eq!(shown, (in_lane > 0).then_some(true), "lane {lane}: {in_lane} pending");
    assert_eq!(a.console.sample().await.unwrap().pending, total - 4);
}

/// The lane table's row for `owner` (or for the unowned lanes): from its
/// opening tag to the next group row or the table's end.
fn lane_group<'a>(page: &'a str, owner: Option<&str>) -> &'a str {
    let marker = match owner {
        Some(o) => format!("data-owner=\"{o}\""),
        None => "id=\"lanes-unowned\"".to_owned(),
    };
    let at = page
        .find(&marker)
        .unwrap_or_else(|| panic!("no lane table row for {owner:?}"));
    let rest = &page[at..];
    let end = rest[1..].find("class=\"lane-group\"").map_or(rest.len(), |e| e + 1);
    &rest[..end]
}

/// The text of the first `<tag>` in `html`.
fn first(html: &str, tag: &str) -> String {
    let open = format!("<{tag}>");
    let at = html.find(&open).unwrap_or_else(|| panic!("no <{tag}> in {html}")) + open.len();
    html[at..at + html[at..].find('<').unwrap()].to_owned()
}

async fn the_overview_groups_lanes_by_owner(engine: Engine) {
    let a = app(engine).await;
    seed(&a.db.ferry).await;
    assert_eq!(a.db.ferry.lanes(), 64);
    // relay-a holds lanes 0–31, relay-b 16 of the others, 16 are free.
    let relays = ferry_relay::store::RelayStore::new(a.db.ferry.clone());
    let lease = std::time::Duration::from_secs(30);
    for l in relays.acquire_lanes("relay-a", lease, 64).await.unwrap() {
        if l.lane >= 32 {
            relays.release_lane("relay-a", l).await.unwrap();
        }
    }
    let b = relays.acquire_lanes("relay-b", lease, 16).await.unwrap();
    assert_eq!(b.len(), 16);
    let page = a.get(ROOT, "/").await.body;
    assert_eq!(
        page.matches("class=\"lane-group\"").count(),
        3,
        "one row per owner and one for the free lanes"
    );
    let row = lane_group(&page, Some("relay-a"));
    assert_eq!(first(row, "summary"), "0–31", "{row}");
    assert!(row.contains("class=\"num lane-count\">32<"), "{row}");
    let row = lane_group(&page, Some("relay-b"));
    assert!(row.contains("class=\"num lane-count\">16<"), "{row}");
    let row = lane_group(&page, None);
    assert!(row.contains("class=\"num lane-count\">16<"), "{row}");
    assert!(row.contains("no relay"), "{row}");
    // Every lane's backlog is still there, inside its owner's row.
    let pending = a.scalar("SELECT count(*) FROM outbox WHERE state = 'pending'").await;
    let lanes = a
        .scalar("SELECT count(DISTINCT lane) FROM outbox WHERE state = 'pending'")
        .await;
    assert_eq!(page.matches("class=\"num pending\"").count() as i64, lanes);
    let summed: i64 = page
        .split("class=\"num group-pending\">")
        .skip(1)
        .map(|r| r[..r.find('<').unwrap()].parse::<i64>().unwrap())
        .sum();
    assert_eq!(summed, pending);
}

async fn the_overview_shows_each_consumer_group_with_what_the_database_knows(engine: Engine) {
    let a = app(engine).await;
    seed(&a.db.ferry).await;
    // Group `projection` commits one row and dead-letters another.
    let first_pending = a.scalar("SELECT min(id) FROM outbox WHERE state = 'pending'").await;
    let last_pending = a.scalar("SELECT max(id) FROM outbox WHERE state = 'pending'").await;
    consume(&a.db.ferry, "projection", &[first_pending]).await;
    dead_letter(&a.db.ferry, "projection", last_pending, 1).await;
    let page = a.get(ROOT, "/").await.body;
    let at = page
        .find("data-group=\"projection\"")
        .expect("a row for group projection");
    let group = &page[at..];
    let group = &group[group.find("</details>").unwrap()..];
    let group = &group[..group.find("</tr>").unwrap()];
    assert!(group.contains("consumer-1 (1)"), "{group}");
    assert!(group.contains("class=\"num dead-letters\">1<"), "{group}");
    let last = &group[group.find("class=\"last-commit\">").unwrap()..];
    assert!(last[..last.find('<').unwrap()].ends_with(" ago"), "{group}");
    assert!(text_of(&page, "lag-note").starts_with("Lag (the topic"));
    assert!(page.contains("<code>ferry_consumer_lag</code>"));
}

/// WAL capture's slots (one per stream) show on the unfiltered overview
/// with their state, the WAL they hold and their `wal_status`: a slot made
/// and not streamed from is inactive, one recorded and gone is dropped. A
/// tenant's view has none (a slot's time lag is any tenant's oldest row).
#[tokio::test]
async fn the_overview_shows_each_wal_capture_slot() {
    let a = app(Engine::Postgres).await;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let base = format!("ferry_console_{}_{nanos}", std::process::id());
    let (made, gone) = (format!("{base}_0of2"), format!("{base}_1of2"));
    let relays = ferry_relay::store::RelayStore::new(a.db.ferry.clone());
    assert!(relays
        .create_wal_slot(&made, false, std::future::pending())
        .await
        .unwrap());
    sqlx::query("INSERT INTO relay_wal_slots (slot, caught_up, updated_at) VALUES ($1, true, 0)")
        .bind(&gone)
        .execute(a.db.ferry.db().as_postgres().unwrap())
        .await
        .unwrap();
    let (all, scoped) = (a.get(ROOT, "/").await.body, a.get(ACME, "/").await.body);
    // A slot holds WAL for ever: dropped before anything can fail.
    sqlx::query("SELECT pg_drop_replication_slot($1)")
        .bind(&made)
        .execute(a.db.ferry.db().as_postgres().unwrap())
        .await
        .unwrap();
    let row = |slot: &str| {
        let at = all
            .find(&format!("data-slot=\"{slot}\""))
            .unwrap_or_else(|| panic!("{slot} on the overview: {all}"));
        all[at..all[at..].find("</tr>").unwrap() + at].to_owned()
    };
    let made = row(&made);
    assert!(made.contains("class=\"slot-state\">inactive<"), "{made}");
    assert!(made.contains("<td>reserved</td>"), "{made}");
    let gone = row(&gone);
    assert!(gone.contains("class=\"slot-state\">dropped<"), "{gone}");
    assert!(!scoped.contains("wal-slots"), "a tenant's view shows no slot");
}

async fn a_scoped_overview_shows_no_other_tenant_s_consumer_ledger(engine: Engine) {
    let a = app(engine).await;
    seed(&a.db.ferry).await;
    // Group `projection` dead-letters one of globex's rows: its ledger is
    // every tenant's, so acme's view must not count it nor date it.
    let globex = a
        .scalar("SELECT max(id) FROM outbox WHERE tenant = 'globex' AND state = 'pending'")
        .await;
    dead_letter(&a.db.ferry, "projection", globex, 0).await;
    let all = a.get(ROOT, "/").await.body;
    assert!(
        all.contains("class=\"num dead-letters\">1<"),
        "root sees the group's dead letter"
    );
    for (token, path) in [(ACME, "/"), (ROOT, "/?tenant=acme")] {
        let scoped = a.get(token, path).await.body;
        assert!(
            scoped.contains("data-group=\"projection\""),
            "{path}: the group is shared"
        );
        assert!(
            !scoped.contains("dead-letters") && !scoped.contains("last-commit"),
            "{path}: another tenant's dead letters and last commit are shown to a tenant's view"
        );
    }
}

async fn the_backlog_plot_has_axes_units_and_a_legend(engine: Engine) {
    let a = app(engine).await;
    seed(&a.db.ferry).await;
    a.console.sample().await.unwrap();
    a.console.sample().await.unwrap();
    let page = a.get(ROOT, "/").await.body;
    let svg = &page[page.find("<svg id=\"plot\"").expect("the plot")..];
    let svg = &svg[..svg.find("</svg>").unwrap()];
    for part in [
        "<g class=\"y-axis left\">",
        "<g class=\"y-axis right\">",
        "<g class=\"x-axis\">",
        "<g class=\"legend\">",
        ">pending rows<",
        ">delivered/s<",
        ">now<",
        ">pending rows (left)<",
        ">delivered/s (right)<",
    ] {
        assert!(svg.contains(part), "{part} in {svg}");
    }
    // The left axis starts at 0 and reaches the backlog.
    let pending = a.scalar("SELECT count(*) FROM outbox WHERE state = 'pending'").await;
    let left = &svg[svg.find("y-axis left").unwrap()..svg.find("y-axis right").unwrap()];
    let ticks: Vec<i64> = left
        .split("class=\"tick end\"")
        .skip(1)
        .map(|t| {
            let t = &t[t.find('>').unwrap() + 1..];
            t[..t.find('<').unwrap()].parse().unwrap()
        })
        .collect();
    assert_eq!(ticks.first(), Some(&0), "{left}");
    assert!(ticks.last().is_some_and(|t| *t >= pending), "{ticks:?} reach {pending}");
    assert!(!svg.contains("style="), "no inline style");
}

async fn empty_error_cells_have_no_code_box(engine: Engine) {
    let a = app(engine).await;
    let s = seed(&a.db.ferry).await;
    // Runs without an error, a lineage whose outbox row has none, and the
    // dead lists: no empty <code> anywhere.
    for path in [
        "/runs?tenant=acme".to_owned(),
        format!("/runs/acme/{}", s.acme_runs[0]),
        format!("/runs/acme/{}", s.acme_dead_run),
        "/dead?tenant=acme".to_owned(),
    ] {
        let r = a.get(ROOT, &path).await;
        assert_eq!(r.status, StatusCode::OK, "{path}");
        assert!(!r.body.contains("<code></code>"), "an empty <code> on {path}");
        assert!(!r.body.contains("<code> </code>"), "a blank <code> on {path}");
    }
}

async fn runs_are_found_by_key_and_paged_and_their_lineage_shows_where_events_went(engine: Engine) {
    let a = app(engine).await;
    let s = seed(&a.db.ferry).await;
    // By key: POSTed, found, the key never echoed in clear.
    let csrf = a.csrf(ACME).await;
    let r = a
        .post(
            ACME,
            "/runs",
            &[
                ("tenant", "acme"),
                ("key", "order-1"),
                ("operation", ""),
                ("csrf", &csrf),
            ],
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert!(r.body.contains(&format!("/runs/acme/{}", s.acme_runs[0])));
    assert!(!r.body.contains("order-1"), "the key is shown redacted only");
    assert_eq!(r.text_of("key-hash"), ferry::redact("order-1"));
    let r = a
        .post(
            ACME,
            "/runs",
            &[
                ("tenant", "acme"),
                ("key", "order-1"),
                ("operation", "charge"),
                ("csrf", &csrf),
            ],
        )
        .await;
    assert!(r.body.contains(&s.acme_runs[0].to_string()));
    // Another tenant's key is refused to a scoped token; a wrong key finds nothing.
    let r = a
        .post(
            ACME,
            "/runs",
            &[("tenant", "globex"), ("key", "parcel-1"), ("csrf", &csrf)],
        )
        .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    let r = a
        .post(ACME, "/runs", &[("tenant", "acme"), ("key", "nope"), ("csrf", &csrf)])
        .await;
    assert!(r.body.contains("id=\"no-runs\""));
    // By run id: straight to the lineage.
    let r = a
        .get(ROOT, &format!("/runs?tenant=acme&run_id={}", s.acme_runs[2]))
        .await;
    assert_eq!(r.status, StatusCode::SEE_OTHER);
    assert_eq!(r.header("location"), format!("/runs/acme/{}", s.acme_runs[2]));
    // By state, keyset pages: 60 more acme runs make two pages.
    for i in 0..60 {
        a.db.ferry
            .create_run_idempotent(ferry::NewRun::new(
                "acme",
                "bulk",
                format!("b-{i}"),
                serde_json::json!({}),
            ))
            .await
            .unwrap();
    }
    let first = a.get(ACME, "/runs?state=queued").await;
    assert_eq!(first.status, StatusCode::OK);
    let at = first.body.find("id=\"next-page\"").expect("a next page link");
    let href = &first.body[at..];
    let next = href[href.find("href=\"").unwrap() + 6..]
        .split('"')
        .next()
        .unwrap()
        .replace("&amp;", "&");
    let second = a.get(ACME, &next).await;
    assert_eq!(second.status, StatusCode::OK);
    let count = |b: &str| b.matches("class=\"run-link\"").count();
    let queued = a
        .scalar("SELECT count(*) FROM runs WHERE tenant = 'acme' AND state = 'queued'")
        .await;
    assert_eq!((count(&first.body) + count(&second.body)) as i64, queued);
    assert!(!second.body.contains("next-page"));
    assert!(
        !first.body.contains(&s.acme_dead_run.to_string()),
        "the failed run is not queued"
    );
    // The dead job's lineage: its attempt (generation, owner, outcome), its
    // events' outbox rows with their state, and the replay action.
    let r = a.get(ROOT, &format!("/runs/acme/{}", s.acme_dead_run)).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.text_of("run-state"), "failed");
    let attempts = &r.body[r.body.find("id=\"attempts\"").unwrap()..];
    assert!(attempts.contains("worker-1") && attempts.contains(">dead<") && attempts.contains("card_declined"));
    let rows = a
        .scalar(&format!(
            "SELECT count(*) FROM outbox WHERE tenant = 'acme' AND key = '{}'",
            s.acme_dead_run
        ))
        .await;
    assert_eq!(rows, 2, "run_queued and run_failed");
    assert_eq!(r.body.matches("class=\"outbox-state state-pending\"").count(), 2);
    assert!(r.body.contains("/actions/jobs/replay"));
    // The consumer ledger entry for one of its rows shows up.
    let id = a
        .scalar(&format!(
            "SELECT min(id) FROM outbox WHERE tenant = 'acme' AND key = '{}'",
            s.acme_dead_run
        ))
        .await;
    let keys = consume(&a.db.ferry, "projector", &[id]).await;
    let r = a.get(ROOT, &format!("/runs/acme/{}", s.acme_dead_run)).await;
    assert_eq!(
        ledger_rows(&r.body),
        vec![(id, "projector".to_owned(), keys[0].clone())]
    );
}

/// The `(outbox id, group, effect key)` of each row of a lineage page's
/// consumer ledger table.
fn ledger_rows(page: &str) -> Vec<(i64, String, String)> {
    let Some(at) = page.find("id=\"ledger\"") else {
        return Vec::new();
    };
    let table = &page[at..at + page[at..].find("</table>").expect("the table ends")];
    let between = |s: &str, open: &str, close: &str| -> String {
        let from = s.find(open).expect("the cell") + open.len();
        s[from..from + s[from..].find(close).expect("the cell ends")].to_owned()
    };
    table
        .split("<tr>")
        .filter(|row| row.starts_with("<td class=\"num\">"))
        .map(|row| {
            let id = between(row, "<td class=\"num\">", "</td>").parse().unwrap();
            let group = between(row, "</td><td>", "</td>");
            (id, group, between(row, "<code>", "</code>"))
        })
        .collect()
}

/// A run's lineage shows each consumer group's ledger entries under the
/// effect key its rows were published with, `<tenant>/<key>` for a writer's
/// key (it used to look the raw key up, so no keyed row, run events
/// included, ever showed an entry), and never another tenant's entry: an
/// acme row whose own key reads `globex/x` does not show globex's entry for
/// its key `x`, published as `globex/x`.
async fn the_lineage_shows_ledger_entries_under_the_published_key_of_the_row_s_tenant(engine: Engine) {
    let a = app(engine).await;
    let f = &a.db.ferry;
    let run = f
        .create_run_idempotent(ferry::NewRun::new("acme", "charge", "order-1", serde_json::json!({})))
        .await
        .unwrap()
        .run
        .run_id;
    let queued = a
        .scalar(&format!(
            "SELECT id FROM outbox WHERE tenant = 'acme' AND key = '{run}'"
        ))
        .await;
    let enqueue = |m: ferry::OutboxMessage| async move { f.enqueue(&m).await.unwrap() };
    let bytes = |tenant: &str, key: &str| ferry::OutboxMessage::bytes(tenant, "orders", key, b"x".to_vec());
    let mimic = enqueue(bytes("acme", &run.to_string()).effect_key("globex/x")).await;
    let unkeyed = enqueue(bytes("acme", &run.to_string())).await;
    let globex = enqueue(bytes("globex", "parcel-1").effect_key("x")).await;
    // The group processes all but acme's mimic row.
    let keys = consume(f, "projector", &[queued, unkeyed, globex]).await;
    let database_id = f.database_id().await.unwrap();
    assert_eq!(
        keys,
        [
            format!("acme/acme/{run}/1"),
            format!("{database_id}:{unkeyed}"),
            "globex/x".to_owned()
        ]
    );
    let page = a.get(ROOT, &format!("/runs/acme/{run}")).await;
    assert_eq!(page.status, StatusCode::OK);
    let group = || "projector".to_owned();
    assert_eq!(
        ledger_rows(&page.body),
        vec![(queued, group(), keys[0].clone()), (unkeyed, group(), keys[1].clone())],
        "the run event's entry and the unkeyed row's; nothing for the mimic row"
    );
    // The outbox table shows each row's published effect key.
    assert!(page.body.contains("<code>acme/globex/x</code>"), "row {mimic}");
    assert!(page.body.contains(&format!("<code>acme/acme/{run}/1</code>")));
}

/// The dead page's group form carries the highest id it counted, and a group
/// replay stops there: a row of the group that died after the page was shown
/// is not replayed unseen.
async fn a_group_replay_goes_no_further_than_the_rows_shown(engine: Engine) {
    let a = app(engine).await;
    let s = seed(&a.db.ferry).await;
    let (first, last) = (s.acme_dead_rows[0], s.acme_dead_rows[1]);
    assert!(first < last);
    let page = a.get(ACME, "/dead").await.body;
    assert!(page.contains(&format!("name=\"max_id\" value=\"{last}\"")), "{page}");
    // As if the page had been shown before `last` died.
    let csrf = a.csrf(ACME).await;
    let shown = first.to_string();
    let r = a
        .post(
            ACME,
            "/actions/outbox/replay",
            &[
                ("tenant", "acme"),
                ("error_code", "message_too_large"),
                ("max_id", &shown),
                ("reason", "retry the group"),
                ("csrf", &csrf),
            ],
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let state = |id: i64| format!("SELECT count(*) FROM outbox WHERE id = {id} AND state = 'dead'");
    assert_eq!(a.scalar(&state(first)).await, 0, "the row shown is replayed");
    assert_eq!(a.scalar(&state(last)).await, 1, "the later row stays dead");
}
