//! Bulk acceptance ([`Ferry::create_runs_idempotent_in`]), set-based or one
//! by one as the store answers for the engine ([`Conn::batching`]).
//!
//! PostgreSQL decides a whole batch in a fixed number of statements: it
//! claims every distinct key at once (`claim_idempotency_keys`), reads the
//! records of the keys it could not claim (`find_idempotency_keys`, only
//! when there are any), and writes the winners' runs, events, jobs and
//! outbox rows in one statement (`insert_accepted_runs`). Which item wins a
//! key, replays it or conflicts with it is worked out here, in input order,
//! so each item gets the answer the single call would have given it.
//!
//! SQLite has one writer, so it accepts the items one by one under
//! savepoints ([`Ferry::accept_each_in`]); PostgreSQL does the same for the
//! rare batch that proposes one run id twice, or names as a parent a run id
//! another item proposes, where the outcome depends on which keys win.

use std::collections::{HashMap, HashSet};

use serde_json::Value;
use sqlx::types::Json;
use sqlx::FromRow;
use uuid::Uuid;

use crate::error::{violated_constraint, Error, Result};
use crate::fingerprint::{fingerprint, Fingerprint};
use crate::outbox::{lane_for, OutboxMessage};
use crate::runs::{check_equivalent, queued_body, run_event_message, Accepted, NewRun, Run, RunRow, RunState};
use crate::store::queries::POSTGRES_ONLY;
use crate::store::{Batching, Conn, PgConn};
use crate::time::duration_ms;
use crate::Ferry;

/// A valid item of a batch, fingerprinted, with its run id.
struct Item {
    /// Position in the caller's batch.
    pos: usize,
    run: NewRun,
    fp: Fingerprint,
    run_id: Uuid,
    /// Its proposed run id already exists: it can only replay or conflict.
    id_taken: bool,
    /// Its parent run does not exist: it can only replay or conflict, and
    /// is refused with `NotFound` where the single call would claim its key.
    parent_missing: bool,
}

/// An idempotency record read back for a key the batch did not claim.
struct Record {
    fingerprint: String,
    version: i32,
    run_id: Uuid,
    live: bool,
    run: Option<Run>,
}

/// A row of `find_idempotency_keys`: the key's record, then the run it
/// names (read as a [`RunRow`] when `run_id` is not NULL).
#[derive(sqlx::FromRow)]
struct KeyRecordRow {
    /// The input position of the key's group, from 1.
    ord: i64,
    request_fingerprint: String,
    fingerprint_version: i32,
    key_run_id: Uuid,
    live: bool,
    /// The run's id, NULL when the run row is missing.
    run_id: Option<Uuid>,
}

/// What an item comes to before the winners are written.
enum Outcome {
    Done(Result<Accepted>),
    /// Wins its key: its rows are written.
    New,
    /// Replays the winner that is item `.0` of this batch.
    ReplayOf(usize),
}

impl Ferry {
    /// Dispatches a batch to its engine's path (see the module docs).
    pub(crate) async fn accept_batch_in(&self, conn: Conn<'_>, runs: Vec<NewRun>) -> Result<Vec<Result<Accepted>>> {
        match conn.batching() {
            Batching::SetBased(mut c) if needs_item_by_item(&runs) => {
                let queues: Vec<String> = runs.iter().map(|r| r.queue.clone()).collect();
                let out = self.accept_each_in(Conn::from(c.reborrow()), runs).await?;
                let woken: Vec<&str> = out
                    .iter()
                    .zip(&queues)
                    .filter(|(r, _)| matches!(r, Ok(a) if !a.replay))
                    .map(|(_, q)| q.as_str())
                    .collect();
                self.inner.notifier.wake_many(&mut c, &distinct(woken)).await?;
                Ok(out)
            }
            Batching::SetBased(mut c) => self.accept_batch_pg(&mut c, runs).await,
            Batching::OneByOne(conn) => self.accept_each_in(conn, runs).await,
        }
    }

    async fn accept_batch_pg(&self, c: &mut PgConn<'_>, runs: Vec<NewRun>) -> Result<Vec<Result<Accepted>>> {
        let n = runs.len();
        let mut outcomes: Vec<Option<Outcome>> = (0..n).map(|_| None).collect();
        let mut items: Vec<Item> = Vec::with_capacity(n);
        for (pos, run) in runs.into_iter().enumerate() {
            if let Err(e) = run.validate(self) {
                outcomes[pos] = Some(Outcome::Done(Err(e)));
                continue;
            }
            let fp = fingerprint(&run.operation, run.schema_version, &run.tenant, &run.command);
            let run_id = run.run_id.unwrap_or_else(Uuid::now_v7);
            items.push(Item {
                pos,
                run,
                fp,
                run_id,
                id_taken: false,
                parent_missing: false,
            });
        }
        if items.is_empty() {
            return Ok(outcomes
                .into_iter()
                .map(|o| match o {
                    Some(Outcome::Done(r)) => r,
                    _ => Err(Error::Invariant("a batch item was left undecided".into())),
                })
                .collect());
        }
        self.mark_existing(c, &mut items).await?;

        // Items by key, in input order; the first whose id is free is the
        // key's candidate, the only one offered to the claim.
        let mut group_of: HashMap<(&str, &str, &str), usize> = HashMap::with_capacity(items.len());
        let mut groups: Vec<Vec<usize>> = Vec::new();
        for (i, it) in items.iter().enumerate() {
            let key = (
                it.run.tenant.as_str(),
                it.run.operation.as_str(),
                it.run.idempotency_key.as_str(),
            );
            let g = *group_of.entry(key).or_insert_with(|| {
                groups.push(Vec::new());
                groups.len() - 1
            });
            groups[g].push(i);
        }
        drop(group_of);
        let candidates: Vec<Option<usize>> = groups
            .iter()
            .map(|members| {
                members
                    .iter()
                    .copied()
                    .find(|&i| !items[i].id_taken && !items[i].parent_missing)
            })
            .collect();

        // Claim every candidate's key in one statement.
        let offered: Vec<&Item> = candidates.iter().flatten().map(|&i| &items[i]).collect();
        let ttl = duration_ms(self.limits().idempotency_ttl)?;
        let claimed_rows: Vec<(String, String, String, i64)> = if offered.is_empty() {
            Vec::new()
        } else {
            sqlx::query_as(POSTGRES_ONLY.claim_idempotency_keys)
                .bind(offered.iter().map(|i| i.run.tenant.as_str()).collect::<Vec<_>>())
                .bind(offered.iter().map(|i| i.run.operation.as_str()).collect::<Vec<_>>())
                .bind(
                    offered
                        .iter()
                        .map(|i| i.run.idempotency_key.as_str())
                        .collect::<Vec<_>>(),
                )
                .bind(offered.iter().map(|i| i.fp.hex.as_str()).collect::<Vec<_>>())
                .bind(offered.iter().map(|i| i.fp.version).collect::<Vec<_>>())
                .bind(offered.iter().map(|i| i.run_id).collect::<Vec<_>>())
                .bind(self.now())
                .bind(ttl)
                .fetch_all(&mut *c)
                .await?
        };
        let now = claimed_rows.first().map(|(.., at)| *at);
        // By key, not by proposed run id: two items of the batch may propose
        // one id, and only the key says which of them was claimed.
        let claimed: HashSet<(String, String, String)> =
            claimed_rows.into_iter().map(|(t, o, k, _)| (t, o, k)).collect();
        let won: Vec<bool> = candidates
            .iter()
            .map(|cand| {
                cand.is_some_and(|i| {
                    let r = &items[i].run;
                    claimed.contains(&(r.tenant.clone(), r.operation.clone(), r.idempotency_key.clone()))
                })
            })
            .collect();

        // Read back the records of the keys nobody in the batch claimed.
        let unclaimed: Vec<usize> = (0..groups.len()).filter(|&g| !won[g]).collect();
        let records = self.find_records(c, &items, &groups, &unclaimed, now).await?;

        // Decide every item in input order, as one call after another would.
        for (g, members) in groups.iter().enumerate() {
            let cand = candidates[g];
            let record = records.get(&g);
            for &i in members {
                let it = &items[i];
                let outcome = if won[g] && cand == Some(i) {
                    Outcome::New
                } else if cand.is_none_or(|c| i < c) {
                    // Its proposed id exists; only a live record saves it
                    // from being a duplicate run.
                    match record {
                        Some(r) if !won[g] && r.live => Outcome::Done(replay_of_record(it, r)),
                        // The single call checks the parent before it inserts the run.
                        _ if it.parent_missing => Outcome::Done(Err(Error::NotFound { what: "parent run" })),
                        _ => Outcome::Done(Err(Error::DuplicateRun { run_id: it.run_id })),
                    }
                } else if won[g] {
                    let winner = &items[cand.unwrap_or(i)];
                    match check_equivalent(
                        &it.run,
                        &it.fp.hex,
                        it.fp.version,
                        &winner.fp.hex,
                        winner.fp.version,
                        winner.run_id,
                    ) {
                        Ok(_) => Outcome::ReplayOf(winner.pos),
                        Err(e) => Outcome::Done(Err(e)),
                    }
                } else {
                    match record {
                        Some(r) => Outcome::Done(replay_of_record(it, r)),
                        // Swept between the claim and the read: a retry claims it afresh.
                        None => Outcome::Done(Err(Error::Raced("the idempotency record was swept"))),
                    }
                };
                outcomes[it.pos] = Some(outcome);
            }
        }

        // Write the winners.
        let winners: Vec<Item> = items
            .into_iter()
            .filter(|it| matches!(outcomes[it.pos], Some(Outcome::New)))
            .collect();
        let mut runs_by_pos: HashMap<usize, Run> = HashMap::with_capacity(winners.len());
        if let Some(now) = now {
            let queues = self.insert_winners(c, &winners, now).await?;
            self.inner.notifier.wake_many(c, &queues).await?;
            for it in winners {
                let (scheduled_at, _, deadline_at) = it.run.instants(now)?;
                runs_by_pos.insert(
                    it.pos,
                    Run {
                        tenant: it.run.tenant,
                        run_id: it.run_id,
                        operation: it.run.operation,
                        state: RunState::Queued,
                        version: 1,
                        request: it.run.command,
                        deadline_at: deadline_at.map(crate::Millis::new).transpose()?,
                        replay_of: it.run.replay_of,
                        scheduled_at: scheduled_at.map(crate::Millis::new).transpose()?,
                        parent_run_id: it.run.parent_run_id,
                        created_at: crate::Millis::new(now)?,
                        updated_at: crate::Millis::new(now)?,
                        last_event_seq: 1,
                    },
                );
            }
        }
        let accepted = runs_by_pos.len();
        // A winner's run moves into its answer unless a later item replays it.
        let replayed: HashSet<usize> = outcomes
            .iter()
            .filter_map(|o| match o {
                Some(Outcome::ReplayOf(w)) => Some(*w),
                _ => None,
            })
            .collect();
        let out = outcomes
            .into_iter()
            .enumerate()
            .map(|(pos, o)| match o {
                Some(Outcome::Done(r)) => r,
                Some(Outcome::New) => if replayed.contains(&pos) {
                    runs_by_pos.get(&pos).cloned()
                } else {
                    runs_by_pos.remove(&pos)
                }
                .map(|run| Accepted { run, replay: false })
                .ok_or_else(|| Error::Invariant("a claimed key has no instant".into())),
                Some(Outcome::ReplayOf(w)) => runs_by_pos
                    .get(&w)
                    .map(|run| Accepted {
                        run: run.clone(),
                        replay: true,
                    })
                    .ok_or_else(|| Error::Invariant("a replay's winner was not written".into())),
                None => Err(Error::Invariant("a batch item was left undecided".into())),
            })
            .collect();
        tracing::debug!(items = n, accepted, "batch accepted");
        Ok(out)
    }

    /// Marks the items whose proposed run id already exists and those whose
    /// parent run does not (one statement, only when some item proposes an
    /// id or names a parent).
    async fn mark_existing(&self, c: &mut PgConn<'_>, items: &mut [Item]) -> Result<()> {
        let mut asked: Vec<(&str, Uuid)> = Vec::new();
        for it in items.iter() {
            if it.run.run_id.is_some() {
                asked.push((&it.run.tenant, it.run_id));
            }
            if let Some(parent) = it.run.parent_run_id {
                asked.push((&it.run.tenant, parent));
            }
        }
        if asked.is_empty() {
            return Ok(());
        }
        let found: Vec<(String, Uuid)> = sqlx::query_as(POSTGRES_ONLY.existing_run_ids)
            .bind(asked.iter().map(|(t, _)| *t).collect::<Vec<_>>())
            .bind(asked.iter().map(|(_, id)| *id).collect::<Vec<_>>())
            .fetch_all(&mut *c)
            .await?;
        let found: HashSet<(String, Uuid)> = found.into_iter().collect();
        for it in items.iter_mut() {
            let tenant = it.run.tenant.clone();
            it.id_taken = it.run.run_id.is_some() && found.contains(&(tenant.clone(), it.run_id));
            it.parent_missing = it.run.parent_run_id.is_some_and(|p| !found.contains(&(tenant, p)));
        }
        Ok(())
    }

    /// The records of the keys of `groups[g]` for each `g` in `which`, by group.
    async fn find_records(
        &self,
        c: &mut PgConn<'_>,
        items: &[Item],
        groups: &[Vec<usize>],
        which: &[usize],
        now: Option<i64>,
    ) -> Result<HashMap<usize, Record>> {
        if which.is_empty() {
            return Ok(HashMap::new());
        }
        let first = |g: &usize| &items[groups[*g][0]].run;
        let rows = sqlx::query(POSTGRES_ONLY.find_idempotency_keys)
            .bind(which.iter().map(|g| first(g).tenant.as_str()).collect::<Vec<_>>())
            .bind(which.iter().map(|g| first(g).operation.as_str()).collect::<Vec<_>>())
            .bind(
                which
                    .iter()
                    .map(|g| first(g).idempotency_key.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(now.or(self.now()))
            .fetch_all(&mut *c)
            .await?;
        let mut records = HashMap::with_capacity(rows.len());
        for row in rows {
            let key = KeyRecordRow::from_row(&row)?;
            // The run's columns are NULL when the key names no run.
            let run = match key.run_id {
                Some(_) => Some(Run::try_from(RunRow::from_row(&row)?)?),
                None => None,
            };
            let ord = key.ord;
            let g = usize::try_from(ord - 1)
                .ok()
                .and_then(|k| which.get(k))
                .ok_or_else(|| Error::Invariant(format!("find_idempotency_keys returned ord {ord}")))?;
            records.insert(
                *g,
                Record {
                    fingerprint: key.request_fingerprint,
                    version: key.fingerprint_version,
                    run_id: key.key_run_id,
                    live: key.live,
                    run,
                },
            );
        }
        Ok(records)
    }

    /// Writes the winners' runs, events, jobs and outbox rows in one
    /// statement; returns their distinct queues, for the wake-up.
    async fn insert_winners<'a>(&self, c: &mut PgConn<'_>, winners: &'a [Item], now: i64) -> Result<Vec<&'a str>> {
        if winners.is_empty() {
            return Ok(Vec::new());
        }
        let current_trace = crate::telemetry::current_traceparent();
        let mut deadlines = Vec::with_capacity(winners.len());
        let mut scheduled = Vec::with_capacity(winners.len());
        let mut available = Vec::with_capacity(winners.len());
        let mut messages: Vec<OutboxMessage> = Vec::with_capacity(winners.len());
        for it in winners {
            let (scheduled_at, available_at, deadline_at) = it.run.instants(now)?;
            deadlines.push(deadline_at);
            scheduled.push(scheduled_at);
            available.push(available_at);
            let body = queued_body(&it.run, scheduled_at);
            let traceparent = it.run.traceparent.clone().or_else(|| current_trace.clone());
            let msg = run_event_message(
                self,
                &it.run.tenant,
                it.run_id,
                1,
                "run_queued",
                &body,
                now,
                traceparent,
            )?;
            msg.fits_a_record(self.limits())?;
            messages.push(msg);
        }
        let lanes = self.lanes();
        let inserted = sqlx::query(POSTGRES_ONLY.insert_accepted_runs)
            .bind(winners.iter().map(|i| i.run.tenant.as_str()).collect::<Vec<_>>())
            .bind(winners.iter().map(|i| i.run_id).collect::<Vec<_>>())
            .bind(winners.iter().map(|i| i.run.operation.as_str()).collect::<Vec<_>>())
            .bind(
                winners
                    .iter()
                    .map(|i| Json(&i.run.command))
                    .collect::<Vec<Json<&Value>>>(),
            )
            .bind(&deadlines)
            .bind(winners.iter().map(|i| i.run.replay_of).collect::<Vec<_>>())
            .bind(winners.iter().map(|i| i.run.queue.as_str()).collect::<Vec<_>>())
            .bind(winners.iter().map(|i| i.run.max_attempts as i32).collect::<Vec<_>>())
            .bind(
                winners
                    .iter()
                    .map(|i| i64::from(i.run.schema_version))
                    .collect::<Vec<_>>(),
            )
            .bind(messages.iter().map(|m| m.key.as_str()).collect::<Vec<_>>())
            .bind(messages.iter().map(|m| lane_for(&m.key, lanes)).collect::<Vec<_>>())
            .bind(messages.iter().map(|m| m.payload.as_slice()).collect::<Vec<_>>())
            .bind(messages.iter().map(|m| m.effect_key.as_deref()).collect::<Vec<_>>())
            .bind(messages.iter().map(|m| m.traceparent.as_deref()).collect::<Vec<_>>())
            .bind(now)
            .bind(&self.inner.events_topic)
            .bind(Json(&messages[0].headers))
            .bind(winners.iter().map(|i| i.run.priority).collect::<Vec<_>>())
            .bind(winners.iter().map(|i| i.run.priority_lead(self)).collect::<Vec<_>>())
            .bind(&scheduled)
            .bind(&available)
            .bind(winners.iter().map(|i| i.run.parent_run_id).collect::<Vec<_>>())
            .execute(&mut *c)
            .await;
        if let Err(e) = inserted {
            return Err(match violated_constraint(&e).as_deref() {
                // Checked before the claim; only a concurrent insert gets here.
                Some("runs_pkey") => Error::Raced("a proposed run id was taken by a concurrent acceptance"),
                _ => e.into(),
            });
        }
        Ok(distinct(winners.iter().map(|i| i.run.queue.as_str()).collect()))
    }
}

/// The answer to an item whose key holds `r` from before the batch.
fn replay_of_record(it: &Item, r: &Record) -> Result<Accepted> {
    check_equivalent(&it.run, &it.fp.hex, it.fp.version, &r.fingerprint, r.version, r.run_id)?;
    let run = r.run.clone().ok_or(Error::NotFound { what: "run" })?;
    Ok(Accepted { run, replay: true })
}

/// Whether the batch cannot be decided set-based: two items propose the
/// same run id for one tenant, or an item's parent is a run id another item
/// proposes (the parent exists only if that item wins, decided in order).
fn needs_item_by_item(runs: &[NewRun]) -> bool {
    let mut seen = HashSet::new();
    let twice = runs
        .iter()
        .filter_map(|r| r.run_id.map(|id| (r.tenant.as_str(), id)))
        .any(|pair| !seen.insert(pair));
    twice
        || runs
            .iter()
            .filter_map(|r| r.parent_run_id.map(|p| (r.tenant.as_str(), p)))
            .any(|pair| seen.contains(&pair))
}

fn distinct(mut v: Vec<&str>) -> Vec<&str> {
    v.sort_unstable();
    v.dedup();
    v
}
