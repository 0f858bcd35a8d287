//! Property tests over the core's parsers and validators of user input:
//! run cursors (a query parameter or CLI flag), state names, cron
//! expressions and intervals, instants and durations, tenants, names,
//! idempotency keys, free text, topics and trace contexts. Any input is
//! accepted as what it says or refused with `invalid_input`; nothing panics
//! and nothing wraps.

use std::time::Duration;

use ferry::time::{duration_ms, MAX_DURATION};
use ferry::{AttemptOutcome, Every, JobState, Limits, Millis, RunCursor, RunState};
use proptest::prelude::*;

/// Text a user could type into any field, absurd and near-valid values weighted in.
fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        "[+-]?[0-9]{1,25}",
        "r2\\.[+-]?[0-9]{1,22}\\.[0-9a-fA-F-]{28,40}(\\.[a-z:.\\x00]{0,6})?",
        "[A-Za-z0-9._:-]{0,140}",
        "[!-~]{0,300}",
        "[a-z]{0,3}\\x00[a-z]{0,3}",
    ]
}

fn assert_invalid_input(e: &ferry::Error) -> Result<(), TestCaseError> {
    prop_assert_eq!(e.code(), "invalid_input", "{:?}", e);
    Ok(())
}

proptest! {
    /// A cursor is one `list_runs` could have printed, or `invalid_input`.
    #[test]
    fn any_cursor_text_is_a_cursor_or_invalid_input(s in text()) {
        match s.parse::<RunCursor>() {
            Ok(c) => prop_assert_eq!(c.to_string().parse::<RunCursor>().unwrap(), c),
            Err(e) => assert_invalid_input(&e)?,
        }
    }

    /// State names parse to themselves or are `invalid_input`.
    #[test]
    fn any_state_name_is_a_state_or_invalid_input(s in prop_oneof![text(), "(queued|leased|succeeded|failed|dead|cancelled|released|expired)"]) {
        match s.parse::<RunState>() {
            Ok(v) => prop_assert_eq!(v.as_str(), s.as_str()),
            Err(e) => assert_invalid_input(&e)?,
        }
        match s.parse::<JobState>() {
            Ok(v) => prop_assert_eq!(v.as_str(), s.as_str()),
            Err(e) => assert_invalid_input(&e)?,
        }
        match s.parse::<AttemptOutcome>() {
            Ok(v) => prop_assert_eq!(v.as_str(), s.as_str()),
            Err(e) => assert_invalid_input(&e)?,
        }
    }

    /// A cron expression, from any text or from cron-like fields with
    /// absurd numbers and steps, is accepted or `invalid_input`.
    #[test]
    fn any_cron_text_is_a_schedule_or_invalid_input(
        s in prop_oneof![
            text(),
            "([0-9]{1,12}|\\*)(/[0-9]{1,12})?( ([0-9]{1,12}|\\*|[0-9]{1,3}-[0-9]{1,12})(/[0-9]{1,12})?){4,5}",
        ],
    ) {
        if let Err(e) = Every::cron(s) {
            assert_invalid_input(&e)?;
        }
    }

    /// An interval is whole seconds from one second to `MAX_DURATION`, or
    /// `invalid_input` (a fraction under a millisecond used to be dropped).
    #[test]
    fn any_interval_is_a_schedule_or_invalid_input(
        secs in prop_oneof![any::<u64>(), 0..100_000_u64],
        nanos in prop_oneof![0..1_000_000_000_u32, 1..1_000_000_u32, Just(0)],
    ) {
        let d = Duration::new(secs, nanos);
        match Every::interval(d) {
            Ok(_) => prop_assert!(d >= Duration::from_secs(1) && d <= MAX_DURATION && nanos == 0),
            Err(e) => assert_invalid_input(&e)?,
        }
    }

    /// Instants are non-negative and additions are checked.
    #[test]
    fn instants_and_durations_never_wrap(ms in any::<i64>(), secs in any::<u64>()) {
        let d = Duration::from_secs(secs);
        match Millis::new(ms) {
            Ok(m) => {
                prop_assert!(ms >= 0);
                match m.checked_add(d) {
                    Ok(sum) => prop_assert_eq!(i128::from(sum.get()), i128::from(ms) + d.as_millis() as i128),
                    Err(e) => assert_invalid_input(&e)?,
                }
            }
            Err(e) => assert_invalid_input(&e)?,
        }
        match duration_ms(d) {
            Ok(n) => prop_assert_eq!(i128::from(n), d.as_millis() as i128),
            Err(e) => assert_invalid_input(&e)?,
        }
    }

    /// Every validator of caller text accepts exactly what it documents,
    /// and refuses the rest with `invalid_input`.
    #[test]
    fn validators_accept_what_they_document(s in text()) {
        let l = Limits::default();
        let name_ok = |max: usize| {
            !s.is_empty() && s.len() <= max && s.bytes().all(|b| b.is_ascii_alphanumeric() || b".:_-".contains(&b))
        };
        let checks = [
            (l.tenant(&s), name_ok(128)),
            (l.name("queue", &s), name_ok(128)),
            (
                l.idempotency_key(&s),
                !s.is_empty() && s.len() <= 255 && s.bytes().all(|b| (0x21..=0x7e).contains(&b)),
            ),
            (
                l.text("reason", &s, 4096),
                !s.is_empty() && s.len() <= 4096 && !s.chars().any(char::is_control),
            ),
            (l.no_nul("key", &s), !s.contains('\0')),
            (
                l.topic(&s),
                !s.is_empty() && s.len() <= 249 && s != "." && s != ".."
                    && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)),
            ),
        ];
        for (i, (got, ok)) in checks.into_iter().enumerate() {
            match got {
                Ok(()) => prop_assert!(ok, "check {} accepted {:?}", i, s),
                Err(e) => {
                    prop_assert!(!ok, "check {} refused {:?}", i, s);
                    assert_invalid_input(&e)?;
                }
            }
        }
    }

    /// A trace context header parses to a valid context or to nothing.
    #[test]
    fn any_traceparent_parses_or_is_ignored(s in prop_oneof![text(), "00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}"]) {
        if let Some(sc) = ferry::telemetry::parse_traceparent(&s) {
            prop_assert!(sc.is_valid());
        }
    }
}
