//! Server-rendered pages (maud): the shared layout and formatting helpers
//! (the login and error pages, outside the layout, are in [`bare`]). No inline script or style: the CSP forbids both,
//! so the stylesheet and the one small script are served from `/static/`.

use maud::{html, Markup, DOCTYPE};

use crate::auth::Principal;

pub(crate) mod bare;
pub(crate) mod dead;
pub(crate) mod overview;
pub(crate) mod runs;

/// What every page's frame needs: who is looking and at which tenant.
pub(crate) struct Frame<'a> {
    pub principal: &'a Principal,
    pub tenant: Option<&'a str>,
}

impl Frame<'_> {
    /// `path` with the page's tenant filter kept.
    pub fn link(&self, path: &str) -> String {
        match self.tenant {
            Some(t) => format!("{path}?tenant={}", urlencode(t)),
            None => path.to_owned(),
        }
    }
}

/// The page around `body`.
pub(crate) fn layout(frame: &Frame<'_>, title: &str, body: Markup) -> Markup {
    let p = frame.principal;
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { "Ferry · " (title) }
                link rel="stylesheet" href="/static/console.css";
                script src="/static/console.js" defer {}
            }
            body {
                header {
                    nav {
                        strong { "Ferry" }
                        a href=(frame.link("/")) { "Overview" }
                        a href=(frame.link("/runs")) { "Runs" }
                        a href=(frame.link("/dead")) { "Dead" }
                    }
                    form.tenant method="get" {
                        label for="tenant" { "Tenant" }
                        @match &p.tenants {
                            Some(allowed) => {
                                select #tenant name="tenant" {
                                    @for t in allowed {
                                        option value=(t) selected[frame.tenant == Some(t.as_str())] { (t) }
                                    }
                                }
                            }
                            None => {
                                input #tenant name="tenant" placeholder="all tenants" value=(frame.tenant.unwrap_or(""));
                            }
                        }
                        button type="submit" { "Filter" }
                    }
                    span.who { "signed in as " strong #actor { (p.name) }
                        @if !p.payloads { " · payloads hidden" } }
                    form.logout method="post" action="/logout" {
                        (csrf_field(p))
                        button type="submit" { "Sign out" }
                    }
                }
                main { h1 { (title) } (body) }
            }
        }
    }
}

/// The hidden CSRF field every POST form carries.
pub(crate) fn csrf_field(p: &Principal) -> Markup {
    html! { input type="hidden" name="csrf" value=(p.csrf); }
}

/// The reason field every action asks for.
pub(crate) fn reason_field() -> Markup {
    html! { input name="reason" required minlength="3" maxlength="4096" placeholder="reason (audited)"; }
}

/// `text` as `<code>`, or `blank` (plain text) when there is none: an empty
/// `<code>` still draws its padding and background, a grey box in an
/// empty cell.
pub(crate) fn code_or(text: Option<&str>, blank: &str) -> Markup {
    html! {
        @match text.filter(|t| !t.trim().is_empty()) {
            Some(t) => { code { (t) } }
            None => { (blank) }
        }
    }
}

/// A result page after an action.
pub(crate) fn done(frame: &Frame<'_>, title: &str, message: &str, back: &str) -> Markup {
    layout(
        frame,
        title,
        html! {
            p.notice #notice { (message) }
            p { a href=(back) { "Back" } }
        },
    )
}

/// `ms` since the epoch as `YYYY-MM-DD HH:MM:SS.mmmZ` (UTC).
pub(crate) fn ts(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil from days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms.rem_euclid(1000)
    )
}

/// A duration in ms as a short human figure (`850ms`, `12.3s`, `4.0m`, `2.5h`).
pub(crate) fn age(ms: i64) -> String {
    let ms = ms.max(0);
    match ms {
        0..1_000 => format!("{ms}ms"),
        1_000..60_000 => format!("{:.1}s", ms as f64 / 1e3),
        60_000..3_600_000 => format!("{:.1}m", ms as f64 / 6e4),
        _ => format!("{:.1}h", ms as f64 / 3.6e6),
    }
}

/// Percent-encodes a query value.
pub(crate) fn urlencode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_and_ages_read_right() {
        assert_eq!(ts(0), "1970-01-01 00:00:00.000Z");
        assert_eq!(ts(1_800_000_000_123), "2027-01-15 08:00:00.123Z");
        assert_eq!(ts(951_782_400_000), "2000-02-29 00:00:00.000Z");
        assert_eq!(age(850), "850ms");
        assert_eq!(age(12_340), "12.3s");
        assert_eq!(urlencode("a b/c"), "a%20b%2Fc");
    }
}
