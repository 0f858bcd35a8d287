//! The overview: outbox backlog per lane with lane leases, dead rows, live
//! relays, jobs by queue and state (with pause and resume), consumer
//! partitions, and the sampled plot of backlog and throughput.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use axum::extract::State;
use maud::{html, Markup, PreEscaped};

use super::{age, csrf_field, layout, reason_field, ts, Frame};
use crate::auth::Principal;
use crate::error::ConsoleError;
use crate::extract::Query;
use crate::sampler::{Census, Sample};
use crate::AppState;

/// The `?tenant=` filter every page takes.
#[derive(Debug, Default, serde::Deserialize)]
pub(crate) struct TenantQuery {
    #[serde(default)]
    pub tenant: Option<String>,
}

const STATES: [&str; 5] = ["queued", "leased", "succeeded", "dead", "cancelled"];

pub(crate) async fn page(
    State(state): State<AppState>,
    principal: Principal,
    Query(q): Query<TenantQuery>,
) -> Result<Markup, ConsoleError> {
    let tenant = principal.scope(q.tenant.as_deref())?;
    let t = tenant.as_deref();
    let jobs = async {
        match (t, state.sampler.census()) {
            (None, Some(c)) => Ok(c),
            (None, None) => state.sampler.take_census(&state.store).await,
            (Some(_), _) => {
                let (counts, at) = tokio::try_join!(state.store.jobs_by_queue_state(t), state.store.now())?;
                Ok(Census { at, counts })
            }
        }
    };
    let operator = state.ferry.operator();
    let (lanes, owners, relays, census, dead, partitions, queues, now) = tokio::try_join!(
        state.store.outbox_lanes(t),
        operator.lane_owners(),
        operator.live_relays(),
        jobs,
        state.store.outbox_dead_groups(t),
        state.store.consumer_partitions(),
        operator.list_queues(),
        state.store.now(),
    )?;
    let paused: BTreeSet<&str> = queues.iter().filter(|q| q.paused).map(|q| q.queue.as_str()).collect();
    let unpublished: BTreeSet<&str> = queues
        .iter()
        .filter(|q| !q.publish_events)
        .map(|q| q.queue.as_str())
        .collect();
    let now = now.get();
    let backlog: BTreeMap<i32, (i64, i64)> = lanes.iter().map(|l| (l.lane, (l.pending, l.oldest.get()))).collect();
    let pending: i64 = lanes.iter().map(|l| l.pending).sum();
    let oldest = lanes.iter().map(|l| l.oldest.get()).min();
    let dead_rows: i64 = dead.iter().map(|d| d.rows).sum();
    let mut by_queue: BTreeMap<&str, BTreeMap<&str, i64>> = BTreeMap::new();
    for j in &census.counts {
        *by_queue.entry(&j.queue).or_default().entry(&j.state).or_default() += j.jobs;
    }
    for q in &queues {
        by_queue.entry(&q.queue).or_default();
    }
    let frame = Frame {
        principal: &principal,
        tenant: t,
    };
    let series = state.sampler.series();
    let body = html! {
        section.cards {
            div.card { span.label { "Outbox pending" } span.figure #pending-total { (pending) } }
            div.card { span.label { "Oldest pending" } span.figure #oldest-age { (oldest.map_or("—".to_owned(), |o| age(now - o))) } }
            div.card { span.label { "Dead rows" } span.figure #dead-total { a href=(frame.link("/dead")) { (dead_rows) } } }
            div.card { span.label { "Relays alive" } span.figure #relays-alive { (relays.len()) } }
            // The sampler counts every tenant's rows: shown only unfiltered,
            // so a tenant's view never reveals the others' volume.
            @if t.is_none() {
                div.card { span.label { "Delivered/s" } span.figure #throughput {
                    (series.last().map_or("—".to_owned(), |s| format!("{:.1}", s.delivered_per_sec))) } }
            }
        }
        @if t.is_some() {
            p.note { "Figures are for tenant " strong { (t.unwrap_or_default()) }
                "; lanes, relays and consumer groups are shared by every tenant." }
        }
        @if t.is_none() {
            section {
                h2 { "Backlog and throughput" }
                (plot(&series))
            }
        }
        section {
            h2 { "Jobs by queue and state" }
            table #jobs {
                thead { tr { th { "queue" } @for s in STATES { th { (s) } } th { "actions" } } }
                tbody {
                    @for (queue, counts) in &by_queue {
                        tr {
                            th { (queue) @if paused.contains(queue) { " " span.warn id=(format!("paused-{queue}")) { "(paused)" } }
                                @if unpublished.contains(queue) { " " span id=(format!("unpublished-{queue}")) { "(events not published)" } } }
                            @for s in STATES {
                                td.num id=(format!("jobs-{queue}-{s}")) { (counts.get(s).copied().unwrap_or(0)) }
                            }
                            td { @if principal.tenants.is_none() { (queue_actions(&principal, queue, paused.contains(queue))) } }
                        }
                    }
                }
            }
            @if by_queue.is_empty() { p.empty { "No jobs." } }
            @if t.is_none() { p.note #census-age { "Counted " (age(now - census.at.get())) " ago in the background (every tenant's jobs are counted every few samples); choose a tenant for live counts." } }
        }
        section {
            h2 { "Outbox lanes" }
            table #lanes {
                thead { tr { th { "lane" } th { "pending" } th { "oldest pending" } th { "owner" } th { "generation" } th { "lease expires" } } }
                tbody {
                    @for l in &owners {
                        @let (lane_pending, lane_oldest) = backlog.get(&l.lane).copied().unwrap_or((0, 0));
                        @let live = l.lease_expires_at.is_some_and(|e| e.get() > now);
                        @if lane_pending > 0 || l.owner.is_some() {
                            tr id=(format!("lane-{}", l.lane)) {
                                td.num { (l.lane) }
                                td.num.pending { (lane_pending) }
                                td { @if lane_pending > 0 { (age(now - lane_oldest)) } @else { "—" } }
                                td { (l.owner.as_deref().unwrap_or("—")) @if !live && l.owner.is_some() { " " span.warn { "(expired)" } } }
                                td.num { (l.generation) }
                                td { @match l.lease_expires_at {
                                    Some(e) if e.get() > now => { "in " (age(e.get() - now)) }
                                    Some(e) => { (age(now - e.get())) " ago" }
                                    None => { "—" }
                                } }
                            }
                        }
                    }
                }
            }
            p.note { (owners.len()) " lanes; lanes with no backlog and no owner are not listed." }
        }
        section {
            h2 { "Relays alive" }
            @if relays.is_empty() { p.empty #no-relays { "No relay has a live heartbeat." } }
            @else {
                table #relays { thead { tr { th { "relay" } th { "lanes held" } th { "max lanes" } } }
                    tbody { @for r in &relays {
                        tr { td { (r.owner) }
                            td.num { (owners.iter().filter(|l| l.owner.as_deref() == Some(&r.owner) && l.lease_expires_at.is_some_and(|e| e.get() > now)).count()) }
                            td.num { (r.max_lanes) } }
                    } } }
            }
        }
        section {
            h2 { "Consumer groups" }
            @if partitions.is_empty() { p.empty { "No consumer group has stored a partition." } }
            @else {
                table #partitions {
                    thead { tr { th { "group" } th { "topic" } th { "partition" } th { "owner" } th { "generation" } th { "lease expires" } th { "stored offset" } } }
                    tbody { @for p in &partitions {
                        tr { td { (p.group_id) } td { (p.topic) } td.num { (p.partition) }
                            td { (p.owner.as_deref().unwrap_or("—")) } td.num { (p.generation) }
                            td { (p.lease_expires_at.map_or("—".to_owned(), |e| ts(e.get()))) }
                            td.num { (p.next_offset.map_or("—".to_owned(), |o| o.to_string())) } }
                    } }
                }
            }
        }
        @let groups: BTreeSet<&str> = partitions.iter().map(|p| p.group_id.as_str()).collect();
        p.note { "Sampled every few seconds into a ring of the newest samples; " (groups.len()) " consumer groups." }
    };
    Ok(layout(&frame, "Overview", body))
}

fn queue_actions(principal: &Principal, queue: &str, paused: bool) -> Markup {
    let (action, label) = if paused {
        ("resume", "Resume")
    } else {
        ("pause", "Pause")
    };
    html! {
        {
            form.inline method="post" action=(format!("/actions/queues/{action}")) {
                (csrf_field(principal))
                input type="hidden" name="queue" value=(queue);
                (reason_field())
                button type="submit" { (label) }
            }
        }
    }
}

/// The series as an inline SVG: backlog (left scale) and delivered per
/// second (right scale), oldest sample on the left.
fn plot(series: &[Sample]) -> Markup {
    const W: f64 = 600.0;
    const H: f64 = 120.0;
    if series.len() < 2 {
        return html! { p.empty #plot-empty { "Collecting samples…" } };
    }
    let max_p = series.iter().map(|s| s.pending).max().unwrap_or(0).max(1) as f64;
    let max_r = series.iter().map(|s| s.delivered_per_sec).fold(0.0, f64::max).max(1.0);
    let step = W / (series.len() - 1) as f64;
    let line = |f: &dyn Fn(&Sample) -> f64, max: f64| {
        let mut pts = String::new();
        for (i, s) in series.iter().enumerate() {
            let _ = write!(pts, "{:.1},{:.1} ", i as f64 * step, H - f(s) / max * (H - 4.0) - 2.0);
        }
        pts
    };
    let backlog = line(&|s| s.pending as f64, max_p);
    let rate = line(&|s| s.delivered_per_sec, max_r);
    let svg = format!(
        "<svg id=\"plot\" class=\"plot\" viewBox=\"0 0 {W} {H}\" preserveAspectRatio=\"none\" role=\"img\" aria-label=\"backlog and throughput\">\
         <polyline class=\"backlog\" points=\"{backlog}\"/><polyline class=\"rate\" points=\"{rate}\"/></svg>"
    );
    html! {
        (PreEscaped(svg))
        p.legend { span.backlog { "■ pending (max " (max_p as i64) ")" } " " span.rate { "■ delivered/s (max " (format!("{max_r:.1}")) ")" }
            " · " (series.len()) " samples from " (ts(series[0].at.get())) }
    }
}
