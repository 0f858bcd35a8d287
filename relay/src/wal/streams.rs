//! `--streams N`: the outbox split by lane into N streams, each a slot and a
//! row-filtered publication of its own, spread evenly over the group's live
//! relays.
//!
//! - **Fencing** is the slot's: PostgreSQL lets one session stream from a
//!   slot, so two relays never publish one stream at once, whatever they
//!   think their share is.
//! - **Spreading.** Every relay runs one session loop per stream and takes
//!   part in the group's membership (`relay_wal_members`, a heartbeat every
//!   lease / 3). Its share is an even split of the streams over the live
//!   members (the first ones, by owner, take one more when it does not
//!   divide). A loop starts a session only while the relay streams fewer
//!   than its share; a relay streaming more than its share ends its
//!   highest stream's session cleanly (settled, marked, confirmed), and a
//!   relay short of its share takes it. A dead relay's heartbeat expires
//!   after the lease and the others' shares grow to cover its streams.
//! - **Changing N** ([`retire_other_layouts`]): the last relay started
//!   records its N for the group; a relay of another N stops streaming
//!   and stands by, taking no share. The new layout's slots are made only once
//!   every slot of another layout is dropped, which waits until no session
//!   streams from it: the new slots' table reads then publish whatever the
//!   old streams had not marked (duplicates, never a loss), and no old
//!   stream publishes beside them.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::connect::Ended;
use super::union::Union;
use super::Ctx;
use crate::state::RelayState;

/// This relay's streams of its group: which it streams now, and how many
/// it should (its share).
#[derive(Debug)]
pub(crate) struct Share {
    held: Mutex<BTreeSet<u32>>,
    share: watch::Sender<usize>,
    /// With several streams, the writer of this relay's streams' marks.
    pub(crate) union: Option<Union>,
}

impl Share {
    /// One stream (no `--streams`): taken whenever it is free, as a slot
    /// always was.
    pub(crate) fn whole() -> Arc<Share> {
        Arc::new(Share {
            held: Mutex::default(),
            share: watch::channel(usize::MAX).0,
            union: None,
        })
    }

    /// Several streams: none until the first heartbeat says the share;
    /// their marks are written together through `union`.
    pub(crate) fn split(union: Option<Union>) -> Arc<Share> {
        Arc::new(Share {
            held: Mutex::default(),
            share: watch::channel(0).0,
            union,
        })
    }

    fn held(&self) -> std::sync::MutexGuard<'_, BTreeSet<u32>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether stream `k`'s loop may start a session: it streams already,
    /// or this relay streams fewer than its share.
    pub(crate) fn may_take(&self, k: u32) -> bool {
        let held = self.held();
        held.contains(&k) || held.len() < *self.share.borrow()
    }

    /// Whether stream `k`'s session should end to give the stream to
    /// another relay: this relay streams more than its share, and `k` is
    /// its highest.
    pub(crate) fn must_yield(&self, k: u32) -> bool {
        let held = self.held();
        held.len() > *self.share.borrow() && held.last() == Some(&k)
    }

    /// Records stream `k` streamed by this relay until the guard drops.
    pub(crate) fn hold(self: &Arc<Self>, k: u32) -> Held {
        self.held().insert(k);
        Held { share: self.clone(), k }
    }

    /// How many streams this relay streams now.
    pub(crate) fn streaming(&self) -> usize {
        self.held().len()
    }

    /// A receiver that sees every change of the share.
    pub(crate) fn subscribe(&self) -> watch::Receiver<usize> {
        self.share.subscribe()
    }

    fn set(&self, share: usize) {
        self.share.send_if_modified(|s| std::mem::replace(s, share) != share);
    }
}

/// A stream this relay streams, until dropped.
pub(crate) struct Held {
    share: Arc<Share>,
    k: u32,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.share.held().remove(&self.k);
    }
}

/// Relay `me`'s share of `count` streams among `members` (sorted by owner,
/// `me` counted when absent): an even split, the first members taking one
/// more when it does not divide. Every relay computes the same split from
/// the same membership.
pub(crate) fn share_of(count: u32, members: &[String], me: &str) -> usize {
    let mut all: Vec<&str> = members.iter().map(String::as_str).collect();
    if !all.contains(&me) {
        all.push(me);
        all.sort_unstable();
    }
    let n = all.len();
    let rank = all.iter().position(|m| *m == me).unwrap_or(n - 1);
    let (base, extra) = (count as usize / n, count as usize % n);
    base + usize::from(rank < extra)
}

/// Keeps relay `owner` in its group's membership and its share current,
/// every lease / 3 until `finish`; leaves the membership at the end. A
/// failed heartbeat keeps the last share (the slots still fence).
pub(crate) async fn coordinate(
    state: Arc<RelayState>,
    group: String,
    owner: String,
    count: u32,
    lease: std::time::Duration,
    share: Arc<Share>,
    finish: CancellationToken,
) {
    let mut every = tokio::time::interval(lease / 3);
    loop {
        tokio::select! {
            _ = every.tick() => {}
            _ = finish.cancelled() => break,
        }
        // A relay of another layout (one started since set another N)
        // takes no share: it leaves, so the layout's relays cover every
        // stream between them.
        match state.store.wal_layout(&group).await {
            Ok(n) if n != count => {
                share.set(0);
                if let Err(e) = state.store.wal_member_leave(&group, &owner).await {
                    tracing::warn!(error = %e, "leaving the streams' membership failed");
                }
                continue;
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, code = e.code(), "reading the stream layout failed");
                continue;
            }
        }
        match state.store.wal_member_heartbeat(&group, &owner, lease).await {
            Ok(members) => {
                let mine = share_of(count, &members, &owner);
                if mine != *share.share.borrow() {
                    tracing::info!(
                        streams = count,
                        relays = members.len(),
                        share = mine,
                        streaming = share.streaming(),
                        "this relay's share of the streams"
                    );
                }
                share.set(mine);
            }
            Err(e) => tracing::warn!(error = %e, code = e.code(), "the streams' heartbeat failed"),
        }
    }
    if let Err(e) = state.store.wal_member_leave(&group, &owner).await {
        tracing::warn!(error = %e, "leaving the streams' membership failed (the others wait for its heartbeat to expire)");
    }
}

/// Before a session makes its slot: `Err` when the group's layout is not
/// this relay's (it stands by), or while a slot of another layout still
/// streams (waiting for it to end); the other layouts' idle slots (and
/// their publications) are dropped.
pub(super) async fn retire_other_layouts(ctx: &Ctx) -> Result<(), Ended> {
    let store = &ctx.state.store;
    let capture = &ctx.capture;
    let db = |e: ferry::Error| {
        tracing::warn!(error = %e, code = e.code(), "reading the streams' layout failed");
        Ended::Retry("database")
    };
    layout_is_mine(ctx).await?;
    let count = capture.stream.count;
    let mine: Vec<String> = (0..count)
        .map(|index| crate::store::Stream { index, count }.name(&capture.group))
        .collect();
    for slot in store.wal_layout_slots(&capture.group).await.map_err(db)? {
        if mine.contains(&slot.name) {
            continue;
        }
        if slot.active || !store.drop_wal_slot(&slot.name).await.map_err(db)? {
            tracing::info!(slot = %slot.name, "a slot of another stream layout still streams; waiting for its relay to stop");
            return Err(Ended::Retry("old_layout_streaming"));
        }
        tracing::warn!(slot = %slot.name, "dropped a slot of another stream layout (its pending rows are read from the table)");
        if capture.router.is_none() {
            let publication = slot.name.replacen(&capture.group, &capture.publication_base(), 1);
            if let Err(e) = store.drop_wal_publication(&publication).await {
                tracing::warn!(%publication, error = %e, "dropping the old layout's publication failed; drop it by hand");
            }
        }
    }
    Ok(())
}

/// `Err` (stand by) when the group's recorded stream count is not this
/// relay's: a relay started later with another `--streams` took over. The
/// relay stays ready (a sidecar's readiness is its service's), and says so
/// in an error line and `ferry_relay_wal_sessions_ended_total{code=
/// "stream_layout_changed"}`. A failed read ends the session as the
/// database's, but for one stream, which streams as it did before layouts
/// (a role without the table's grants).
pub(super) async fn layout_is_mine(ctx: &Ctx) -> Result<(), Ended> {
    let capture = &ctx.capture;
    let read = tokio::time::timeout(super::session::PING_WAIT, ctx.state.store.wal_layout(&capture.group)).await;
    match read {
        Ok(Ok(n)) if n == capture.stream.count => Ok(()),
        Ok(Ok(n)) => {
            tracing::error!(group = %capture.group, recorded = n, mine = capture.stream.count, "the relay group now runs --streams {n} (set by a relay started since): this relay stands by; restart it with --streams {n}");
            Err(Ended::Retry("stream_layout_changed"))
        }
        Ok(Err(e)) if capture.stream.count == 1 => {
            tracing::warn!(error = %e, code = e.code(), "reading the stream layout failed; streaming as one stream");
            Ok(())
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %e, code = e.code(), "reading the stream layout failed");
            Err(Ended::Retry("database"))
        }
        Err(_) => {
            tracing::warn!("PostgreSQL did not answer the stream layout read in time");
            Err(Ended::Retry("database"))
        }
    }
}

/// A streaming session's look (every 5 s): `Some` to end it when the
/// group's layout is no longer this relay's; a failed or slow read is only
/// logged (the stream goes on, as after a failed publication check).
pub(super) async fn layout_changed(ctx: &Ctx) -> Option<Ended> {
    let capture = &ctx.capture;
    let read = tokio::time::timeout(super::session::PING_WAIT, ctx.state.store.wal_layout(&capture.group)).await;
    match read {
        Ok(Ok(n)) if n == capture.stream.count => None,
        Ok(Ok(n)) => {
            tracing::error!(group = %capture.group, recorded = n, mine = capture.stream.count, "the relay group now runs --streams {n} (set by a relay started since): this relay stops streaming and stands by; restart it with --streams {n}");
            Some(Ended::Retry("stream_layout_changed"))
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %e, code = e.code(), "reading the stream layout failed; checking again later");
            None
        }
        Err(_) => {
            tracing::warn!("PostgreSQL did not answer the stream layout read in time; checking again later");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owners(n: &[&str]) -> Vec<String> {
        n.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn shares_split_evenly_and_cover_every_stream() {
        let members = owners(&["a", "b", "c"]);
        let shares: Vec<usize> = ["a", "b", "c"].iter().map(|m| share_of(4, &members, m)).collect();
        assert_eq!(shares, vec![2, 1, 1]);
        assert_eq!(share_of(4, &owners(&["a"]), "a"), 4);
        // Not yet in the membership read: counted as a member.
        assert_eq!(share_of(4, &owners(&["b"]), "a"), 2);
        assert_eq!(share_of(2, &members, "c"), 0);
    }

    #[test]
    fn a_relay_over_its_share_yields_its_highest_stream() {
        let share = Share::split(None);
        share.set(2);
        let held: Vec<Held> = [0, 1, 3].iter().map(|k| share.hold(*k)).collect();
        assert!(share.must_yield(3) && !share.must_yield(1));
        assert!(!share.may_take(2));
        assert!(share.may_take(1), "a stream held may be taken again");
        drop(held);
        assert!(share.may_take(2) && share.streaming() == 0);
    }
}
