//! The overview: outbox backlog and lane leases grouped by owner (each
//! lane's backlog one click away), dead rows, live relays, WAL capture's
//! slots (one per stream), jobs by queue and state (with pause and resume),
//! consumer groups with their partitions and
//! ledger, and the sampled plot of backlog and throughput with its axes.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use axum::extract::State;
use maud::{html, Markup, PreEscaped};

use ferry::operator::LaneOwner;

use super::{age, csrf_field, layout, reason_field, ts, Frame};
use crate::auth::Principal;
use crate::error::ConsoleError;
use crate::extract::Query;
use crate::sampler::{Census, Sample};
use crate::store::{ConsumerGroupLedger, ConsumerPartition};
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
    let (lanes, owners, relays, slots, census, dead, partitions, groups, queues, now) = tokio::try_join!(
        state.store.outbox_lanes(t),
        operator.lane_owners(),
        operator.live_relays(),
        // A slot's time lag is the oldest pending row's, any tenant's: read
        // only unfiltered.
        async {
            match t {
                None => operator.wal_slots().await,
                Some(_) => Ok(Vec::new()),
            }
        },
        jobs,
        state.store.outbox_dead_groups(t),
        state.store.consumer_partitions(),
        // The ledger is every tenant's (a group's dead letters and last
        // commit count all of them): read only unfiltered, like the sampler.
        async {
            match t {
                None => state.store.consumer_groups().await.map(Some),
                Some(_) => Ok(None),
            }
        },
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
            h2 { "Outbox lanes by owner" }
            (lane_table(&owners, &backlog, now))
            p.note { (owners.len()) " lanes. Open a row's lanes for the backlog of each lane that has one." }
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
        @if !slots.is_empty() {
            section {
                h2 { "WAL capture slots" }
                table #wal-slots { thead { tr { th { "slot" } th { "state" } th { "WAL held" } th { "oldest waiting" } th { "wal_status" } } }
                    tbody { @for s in &slots {
                        tr data-slot=(s.slot) { td { (s.slot) } td.slot-state { (s.state()) }
                            td.num.lag-bytes { (s.lag_bytes) " B" } td.num { (age(s.lag_ms)) }
                            td { (s.wal_status.as_deref().unwrap_or("—")) } }
                    } } }
                p.note { "One slot per stream with " code { "--streams N" } " (" code { "<slot>_<k>of<N>" }
                    "), each streamed by one relay at a time; an inactive slot holds its WAL until a relay streams from it again." }
            }
        }
        section {
            h2 { "Consumer groups" }
            (consumer_groups(&partitions, groups.as_deref(), now))
        }
        p.note { "Sampled every few seconds into a ring of the newest samples." }
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

/// Lane ids as sorted, comma-separated runs: `0–31, 40, 42–44`.
fn lane_ranges(lanes: &[i32]) -> String {
    let mut sorted = lanes.to_vec();
    sorted.sort_unstable();
    let mut out = String::new();
    let mut i = 0;
    while i < sorted.len() {
        let first = sorted[i];
        while i + 1 < sorted.len() && sorted[i + 1] == sorted[i] + 1 {
            i += 1;
        }
        if !out.is_empty() {
            out.push_str(", ");
        }
        let _ = match sorted[i] {
            last if last == first => write!(out, "{first}"),
            last => write!(out, "{first}–{last}"),
        };
        i += 1;
    }
    out
}

/// `lo–hi`, or `lo` when they are equal.
fn span(lo: i64, hi: i64) -> String {
    if lo == hi {
        lo.to_string()
    } else {
        format!("{lo}–{hi}")
    }
}

/// How far `at` is from `now`: `in 12.0s` or `3.1m ago`.
fn until(at: i64, now: i64) -> String {
    if at > now {
        format!("in {}", age(at - now))
    } else {
        format!("{} ago", age(now - at))
    }
}

/// The lane table: one row per relay holding lanes (and one for the lanes
/// nobody holds), with the lanes as ranges; each row opens onto its lanes'
/// backlog. A lane's backlog is `(pending, oldest created_at)`.
fn lane_table(owners: &[LaneOwner], backlog: &BTreeMap<i32, (i64, i64)>, now: i64) -> Markup {
    let mut held: BTreeMap<&str, Vec<&LaneOwner>> = BTreeMap::new();
    let mut free: Vec<&LaneOwner> = Vec::new();
    for l in owners {
        match l.owner.as_deref() {
            Some(o) => held.entry(o).or_default().push(l),
            None => free.push(l),
        }
    }
    let rows = held
        .into_iter()
        .map(|(o, ls)| (Some(o), ls))
        .chain((!free.is_empty()).then_some((None, free)));
    html! {
        table #lanes {
            thead { tr { th { "owner" } th { "lanes" } th { "lane ids" } th { "pending" } th { "oldest pending" } th { "generation" } th { "lease expires" } } }
            tbody { @for (owner, ls) in rows {
                @let ids: Vec<i32> = ls.iter().map(|l| l.lane).collect();
                @let busy: Vec<(&LaneOwner, i64, i64)> = ls.iter()
                    .filter_map(|l| backlog.get(&l.lane).map(|&(p, o)| (*l, p, o))).collect();
                @let pending: i64 = busy.iter().map(|b| b.1).sum();
                @let oldest = busy.iter().map(|b| b.2).min();
                @let generations = (ls.iter().map(|l| l.generation).min().unwrap_or(0), ls.iter().map(|l| l.generation).max().unwrap_or(0));
                // A lane nobody holds has no lease to expire.
                @let expiries: Vec<i64> = ls.iter().filter(|_| owner.is_some()).filter_map(|l| l.lease_expires_at.map(|e| e.get())).collect();
                @let expired = expiries.iter().filter(|&&e| e <= now).count();
                tr.lane-group id=[owner.is_none().then_some("lanes-unowned")] data-owner=[owner] {
                    td.owner { @match owner { Some(o) => { (o) }, None => { span.muted { "no relay" } } } }
                    td.num.lane-count { (ls.len()) }
                    td.lane-ids { details {
                        summary { (lane_ranges(&ids)) }
                        @if busy.is_empty() { p.empty { "No backlog in these lanes." } }
                        @else {
                            table.lane-detail {
                                thead { tr { th { "lane" } th { "pending" } th { "oldest pending" } th { "generation" } } }
                                tbody { @for (l, lane_pending, lane_oldest) in &busy {
                                    tr id=(format!("lane-{}", l.lane)) {
                                        td.num { (l.lane) } td.num.pending { (lane_pending) }
                                        td { (age(now - lane_oldest)) } td.num { (l.generation) }
                                    }
                                } }
                            }
                        }
                    } }
                    td.num.group-pending { (pending) }
                    td { (oldest.map_or("—".to_owned(), |o| age(now - o))) }
                    td.num.generations { (span(generations.0, generations.1)) }
                    td.expiry {
                        @match (expiries.iter().min(), expiries.iter().max()) {
                            (Some(&lo), Some(&hi)) if lo == hi || until(lo, now) == until(hi, now) => { (until(lo, now)) }
                            (Some(&lo), Some(&hi)) => { (until(lo, now)) " … " (until(hi, now)) }
                            _ => { "—" }
                        }
                        @if expired > 0 { " " span.warn { "(" (expired) " expired)" } }
                    }
                }
            } }
        }
    }
}

/// Consumer groups, one row each: partitions (opening onto each one's
/// owner, lease and stored offset), members holding live leases, when the
/// group last committed a new record, and its dead letters. The lag itself
/// is the consumers' to measure: the high watermark is not in the database.
/// `ledgers` is `None` in a tenant's view: the ledger figures are every
/// tenant's, so those columns are left out.
fn consumer_groups(partitions: &[ConsumerPartition], ledgers: Option<&[ConsumerGroupLedger]>, now: i64) -> Markup {
    let mut by_group: BTreeMap<&str, Vec<&ConsumerPartition>> = BTreeMap::new();
    for p in partitions {
        by_group.entry(&p.group_id).or_default().push(p);
    }
    let ledger: Option<BTreeMap<&str, &ConsumerGroupLedger>> =
        ledgers.map(|ls| ls.iter().map(|l| (l.group_id.as_str(), l)).collect());
    if by_group.is_empty() {
        return html! { p.empty { "No consumer group has stored a partition." } };
    }
    html! {
        table #consumer-groups {
            thead { tr { th { "group" } th { "partitions" } th { "owners (live leases)" }
                @if ledger.is_some() { th { "last commit" } th { "dead letters" } } } }
            tbody { @for (group, ps) in &by_group {
                @let (members, unheld) = members(ps, now);
                @let topics: BTreeSet<&str> = ps.iter().map(|p| p.topic.as_str()).collect();
                tr.consumer-group data-group=(group) {
                    td { (group) }
                    td.partitions { details {
                        summary { (ps.len()) " of " (topics.into_iter().collect::<Vec<_>>().join(", ")) }
                        table.partition-detail {
                            thead { tr { th { "topic" } th { "partition" } th { "owner" } th { "generation" } th { "lease expires" } th { "stored offset" } } }
                            tbody { @for p in ps {
                                tr { td { (p.topic) } td.num { (p.partition) }
                                    td { (p.owner.as_deref().unwrap_or("—")) } td.num { (p.generation) }
                                    td { (p.lease_expires_at.map_or("—".to_owned(), |e| until(e.get(), now))) }
                                    td.num.stored-offset { (p.next_offset.map_or("—".to_owned(), |o| o.to_string())) } }
                            } }
                        }
                    } }
                    td.owners {
                        (members)
                        @if unheld > 0 { " " span.warn { "(" (unheld) " without a live lease)" } }
                    }
                    @if let Some(ledger) = &ledger {
                        @let l = ledger.get(group);
                        td.last-commit { (l.and_then(|l| l.last_processed_at).map_or("—".to_owned(), |at| format!("{} ago", age(now - at.get())))) }
                        td.num.dead-letters { (l.map_or(0, |l| l.dead_letters)) }
                    }
                }
            } }
        }
        p.note #lag-note { "Lag (the topic's high watermark minus the stored offset) is not in the database: "
            "the consumers export it as " code { "ferry_consumer_lag" } ", on the dashboard's Consumer lag panel ("
            code { "deploy/grafana/ferry.json" } "). Open a group's partitions for their owners, generations and stored offsets. "
            @if ledger.is_some() {
                "Last commit is the group's newest ledger entry "
                "(a duplicate moves only the offset; entries past the ledger's retention are swept)."
            } @else {
                "Last commit and dead letters count every tenant's records: shown only unfiltered."
            } }
    }
}

/// The members holding a group's partitions under live leases, as
/// `member (partitions held), …`, and how many partitions none holds.
fn members(partitions: &[&ConsumerPartition], now: i64) -> (String, usize) {
    let mut held: BTreeMap<&str, usize> = BTreeMap::new();
    let mut unheld = 0;
    for p in partitions {
        match (&p.owner, p.lease_expires_at) {
            (Some(o), Some(e)) if e.get() > now => *held.entry(o).or_default() += 1,
            _ => unheld += 1,
        }
    }
    let list = held
        .iter()
        .map(|(m, n)| format!("{m} ({n})"))
        .collect::<Vec<_>>()
        .join(", ");
    (list, unheld)
}

/// Roughly four round steps (1, 2 or 5 times a power of ten) from 0 to at
/// least `max`: the step and the top of the scale.
fn ticks(max: f64, whole: bool) -> (f64, f64) {
    let max = max.max(1.0);
    let raw = max / 4.0;
    let mag = 10f64.powf(raw.log10().floor());
    let mut step = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    if whole {
        step = step.max(1.0).round();
    }
    (step, (max / step).ceil() * step)
}

/// A tick value with as many decimals as its step needs.
fn tick_label(v: f64, step: f64) -> String {
    let decimals = if step >= 1.0 {
        0
    } else {
        (-step.log10().floor()) as usize
    };
    format!("{v:.decimals$}")
}

/// A time before the newest sample as a tick label: `−30 s`, `−1 min 30 s`, `−10 min`.
fn before(ms: i64) -> String {
    let s = ms / 1000;
    match (s / 60, s % 60) {
        (0, s) => format!("−{s} s"),
        (m, 0) => format!("−{m} min"),
        (m, s) => format!("−{m} min {s} s"),
    }
}

/// The series as a server-drawn SVG: pending rows on the left axis,
/// delivered per second on the right, time on the bottom counted back from
/// the newest sample, with a legend; its look is the stylesheet's (`.plot`).
fn plot(series: &[Sample]) -> Markup {
    // The drawing area inside the viewBox, margins for the labels around it.
    const W: f64 = 720.0;
    const H: f64 = 230.0;
    const L: f64 = 56.0;
    const R: f64 = 664.0;
    const T: f64 = 30.0;
    const B: f64 = 182.0;
    const TIME_STEPS_S: [i64; 14] = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200];
    let (Some(first), Some(last)) = (series.first(), series.last()) else {
        return html! { p.empty #plot-empty { "Collecting samples…" } };
    };
    if series.len() < 2 {
        return html! { p.empty #plot-empty { "Collecting samples…" } };
    }
    let (t0, t1) = (first.at.get(), last.at.get());
    let span_ms = (t1 - t0).max(1);
    let x = |at: i64| L + (at - t0) as f64 / span_ms as f64 * (R - L);
    let max_p = series.iter().map(|s| s.pending).max().unwrap_or(0) as f64;
    let max_r = series.iter().map(|s| s.delivered_per_sec).fold(0.0, f64::max);
    let (p_step, p_top) = ticks(max_p, true);
    let (r_step, r_top) = ticks(max_r, false);
    let y = |v: f64, top: f64| B - v / top * (B - T);
    let line = |f: &dyn Fn(&Sample) -> f64, top: f64| {
        let mut pts = String::new();
        for s in series {
            let _ = write!(pts, "{:.1},{:.1} ", x(s.at.get()), y(f(s), top));
        }
        pts
    };
    let mut svg = format!(
        "<svg id=\"plot\" class=\"plot\" viewBox=\"0 0 {W} {H}\" role=\"img\" \
         aria-label=\"pending rows and delivered per second over the sampled time\">"
    );
    // Left axis (pending rows) with its grid, right axis (delivered/s).
    svg.push_str("<g class=\"y-axis left\">");
    let mut v = 0.0;
    while v <= p_top + p_step / 2.0 {
        let yy = y(v, p_top);
        let _ = write!(
            svg,
            "<line class=\"grid\" x1=\"{L}\" x2=\"{R}\" y1=\"{yy:.1}\" y2=\"{yy:.1}\"/>\
             <text class=\"tick end\" x=\"{:.1}\" y=\"{:.1}\">{}</text>",
            L - 6.0,
            yy + 4.0,
            tick_label(v, p_step)
        );
        v += p_step;
    }
    let mid = (T + B) / 2.0;
    let _ = write!(
        svg,
        "<text class=\"title\" transform=\"translate(14 {mid}) rotate(-90)\">pending rows</text></g>"
    );
    svg.push_str("<g class=\"y-axis right\">");
    let mut v = 0.0;
    while v <= r_top + r_step / 2.0 {
        let _ = write!(
            svg,
            "<text class=\"tick\" x=\"{:.1}\" y=\"{:.1}\">{}</text>",
            R + 6.0,
            y(v, r_top) + 4.0,
            tick_label(v, r_step)
        );
        v += r_step;
    }
    let _ = write!(
        svg,
        "<text class=\"title\" transform=\"translate({} {mid}) rotate(90)\">delivered/s</text></g>",
        W - 12.0
    );
    // Time axis: ticks counted back from the newest sample.
    let step_ms = 1000
        * TIME_STEPS_S
            .into_iter()
            .find(|s| span_ms / (1000 * s) <= 6)
            .unwrap_or(7200);
    svg.push_str("<g class=\"x-axis\">");
    let _ = write!(
        svg,
        "<line class=\"axis\" x1=\"{L}\" x2=\"{R}\" y1=\"{B}\" y2=\"{B}\"/>"
    );
    let mut back = (span_ms / step_ms) * step_ms;
    while back >= 0 {
        let xx = x(t1 - back);
        let label = if back == 0 { "now".to_owned() } else { before(back) };
        let _ = write!(
            svg,
            "<line class=\"axis\" x1=\"{xx:.1}\" x2=\"{xx:.1}\" y1=\"{B}\" y2=\"{}\"/>\
             <text class=\"tick middle\" x=\"{xx:.1}\" y=\"{}\">{label}</text>",
            B + 4.0,
            B + 17.0
        );
        back -= step_ms;
    }
    let _ = write!(
        svg,
        "<text class=\"title middle\" x=\"{}\" y=\"{}\">time before the newest sample ({})</text></g>",
        (L + R) / 2.0,
        H - 8.0,
        &ts(t1)[11..19]
    );
    let _ = write!(
        svg,
        "<polyline class=\"backlog\" points=\"{}\"/><polyline class=\"rate\" points=\"{}\"/>",
        line(&|s| s.pending as f64, p_top),
        line(&|s| s.delivered_per_sec, r_top)
    );
    // Legend, above the drawing area.
    let _ = write!(
        svg,
        "<g class=\"legend\"><rect class=\"swatch backlog\" x=\"{L}\" y=\"8\" width=\"14\" height=\"4\"/>\
         <text x=\"{}\" y=\"14\">pending rows (left)</text>\
         <rect class=\"swatch rate\" x=\"{}\" y=\"8\" width=\"14\" height=\"4\"/>\
         <text x=\"{}\" y=\"14\">delivered/s (right)</text></g></svg>",
        L + 18.0,
        L + 160.0,
        L + 178.0
    );
    html! {
        (PreEscaped(svg))
        p.legend { (series.len()) " samples from " (ts(t0)) " to " (ts(t1)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_read_as_ranges() {
        assert_eq!(lane_ranges(&[3, 0, 1, 2, 7, 9, 10]), "0–3, 7, 9–10");
        assert_eq!(lane_ranges(&(0..32).collect::<Vec<_>>()), "0–31");
        assert_eq!(lane_ranges(&[]), "");
    }

    #[test]
    fn ticks_are_round_and_cover_the_maximum() {
        assert_eq!(ticks(0.0, true), (1.0, 1.0));
        assert_eq!(ticks(0.0, false), (0.5, 1.0));
        assert_eq!(ticks(4.0, true), (1.0, 4.0));
        assert_eq!(ticks(1234.0, true), (500.0, 1500.0));
        assert_eq!(ticks(0.9, false), (0.5, 1.0));
        assert_eq!(tick_label(0.5, 0.5), "0.5");
        assert_eq!(before(90_000), "−1 min 30 s");
        assert_eq!(before(600_000), "−10 min");
        assert_eq!(before(30_000), "−30 s");
    }
}
