//! What really differs between the engines in the job path, and nothing
//! else: the claim (one `FOR UPDATE SKIP LOCKED` statement with its attempt
//! rows where the engine writes batches set-based, PostgreSQL; the same
//! steps one by one where it writes them item by item, SQLite's single
//! writer; a limited queue's claim under its `ferry_queues` row lock) and
//! batch completion (one set-based statement; or a savepoint per lease).
//! Which engine takes which path is the store's answer
//! ([`Conn::batching`]); the algorithms are here.

use serde_json::Value;
use sqlx::types::Json;
use sqlx::FromRow;
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::jobs::{ClaimRow, Claimed, Lease, Transition};
use crate::runs::get_run_in;
use crate::store::{on_conn, Batching, Conn, PgConn};
use crate::Ferry;

/// Which claim statement runs: the plain one (open, unlimited queues) or
/// the limited one, with how many candidates it may scan.
#[derive(Debug, Clone, Copy)]
enum ClaimSql {
    Open,
    Limited { scan: i64 },
}

impl Ferry {
    /// Claims up to `limit` jobs of `queue` inside `conn`'s transaction.
    ///
    /// An open, unlimited queue is claimed by one statement (`claim_jobs`),
    /// which claims nothing in a paused or limited queue. Only when it came
    /// back empty is the queue's row asked whether it is limited; then the
    /// limited claim runs ([`Ferry::claim_limited_in`]). A queue this
    /// process last found limited goes to the limited claim first (a hint:
    /// the limited claim says when the queue is no longer limited, and the
    /// plain claim follows in the same transaction).
    pub(crate) async fn claim_in(
        &self,
        mut conn: Conn<'_>,
        queue: &str,
        owner: &str,
        lease_ms: i64,
        limit: u32,
    ) -> Result<Vec<Claimed>> {
        let limit = i64::from(limit);
        if self.limited_hint(queue) {
            if let Some(claimed) = self
                .claim_limited_in(conn.reborrow(), queue, owner, lease_ms, limit)
                .await?
            {
                return Ok(claimed);
            }
            self.set_limited_hint(queue, false);
        }
        let claimed = self
            .run_claim(conn.reborrow(), ClaimSql::Open, queue, owner, lease_ms, limit)
            .await?;
        if !claimed.is_empty() {
            return Ok(claimed);
        }
        let limited: Option<i32> = on_conn!(conn.reborrow(), |c, q| {
            sqlx::query_scalar(q.queue_limited)
                .bind(queue)
                .fetch_optional(&mut *c)
                .await?
        });
        if limited.is_none() {
            return Ok(claimed);
        }
        self.set_limited_hint(queue, true);
        Ok(self
            .claim_limited_in(conn, queue, owner, lease_ms, limit)
            .await?
            .unwrap_or_default())
    }

    /// The claim of a limited queue: locks the queue's row and refills its
    /// bucket (`lock_queue`), so the claims of a limited queue take turns
    /// across processes and each counts the live leases exactly; then
    /// `claim_limited` takes what the limits allow, and the tokens it used
    /// are spent before the transaction commits. `None` when the queue has
    /// no row or no limits (and is not paused): the plain claim applies.
    async fn claim_limited_in(
        &self,
        mut conn: Conn<'_>,
        queue: &str,
        owner: &str,
        lease_ms: i64,
        limit: i64,
    ) -> Result<Option<Vec<Claimed>>> {
        let gate: Option<(bool, bool, bool, i64)> = on_conn!(conn.reborrow(), |c, q| {
            sqlx::query_as(q.lock_queue)
                .bind(queue)
                .bind(self.now())
                .fetch_optional(&mut *c)
                .await?
        });
        let (paused, rated, tokens) = match gate {
            None | Some((false, false, _, _)) => return Ok(None),
            Some((paused, _, rated, tokens)) => (paused, rated, tokens),
        };
        // Under autocommit lock_queue's row lock is already gone, and the
        // claim and the token spending would each commit on their own: no
        // limit would hold. Refused before anything is leased.
        if conn.releases_row_locks_per_statement().await? {
            return Err(Error::Unsupported(
                "a limited queue's claim needs a transaction (pass a Tx, not a bare connection)",
            ));
        }
        let allowed = if rated { limit.min(tokens) } else { limit };
        if paused || allowed <= 0 {
            return Ok(Some(Vec::new()));
        }
        // Room for rows of tenants that reach their cap within this claim.
        let scan = allowed.saturating_mul(8).max(64);
        let claimed = self
            .run_claim(
                conn.reborrow(),
                ClaimSql::Limited { scan },
                queue,
                owner,
                lease_ms,
                allowed,
            )
            .await?;
        if rated && !claimed.is_empty() {
            on_conn!(conn, |c, q| {
                sqlx::query(q.spend_tokens)
                    .bind(queue)
                    .bind(claimed.len() as i64)
                    .execute(&mut *c)
                    .await?;
            });
        }
        Ok(Some(claimed))
    }

    /// Runs one claim statement and, where the engine writes one by one
    /// (SQLite), the steps the set-based statement does itself (closing
    /// lost attempts, writing the new attempt rows, reading the runs).
    async fn run_claim(
        &self,
        conn: Conn<'_>,
        which: ClaimSql,
        queue: &str,
        owner: &str,
        lease_ms: i64,
        limit: i64,
    ) -> Result<Vec<Claimed>> {
        let args = (which, queue, owner, lease_ms, limit);
        match conn.batching() {
            Batching::SetBased(c) => {
                let rows: Vec<ClaimedPgRow> = self.claim_rows(Conn::from(c), args).await?;
                Ok(rows.into_iter().map(ClaimedPgRow::into_claimed).collect())
            }
            Batching::OneByOne(mut conn) => {
                let rows: Vec<ClaimRow> = self.claim_rows(conn.reborrow(), args).await?;
                let mut out = Vec::with_capacity(rows.len());
                for row in rows {
                    on_conn!(conn.reborrow(), |c, q| {
                        sqlx::query(q.close_lost_attempts)
                            .bind(&row.tenant)
                            .bind(row.run_id)
                            .bind(row.lease_generation)
                            .bind(row.claimed_at)
                            .execute(&mut *c)
                            .await?;
                        sqlx::query(q.insert_attempt)
                            .bind(&row.tenant)
                            .bind(row.run_id)
                            .bind(row.attempts)
                            .bind(row.lease_generation)
                            .bind(&row.lease_owner)
                            .bind(row.claimed_at)
                            .execute(&mut *c)
                            .await?;
                    });
                    let run = get_run_in(conn.reborrow(), &row.tenant, row.run_id).await?;
                    out.push(row.into_claimed(run.operation, run.request, run.replay_of));
                }
                Ok(out)
            }
        }
    }

    /// The rows of the claim statement `which` (its engine's own text: on
    /// PostgreSQL it also writes the attempt rows and returns the runs'
    /// data, read as [`ClaimedPgRow`]; on SQLite it only leases, read as
    /// [`ClaimRow`]).
    async fn claim_rows<R>(
        &self,
        conn: Conn<'_>,
        (which, queue, owner, lease_ms, limit): (ClaimSql, &str, &str, i64, i64),
    ) -> Result<Vec<R>>
    where
        R: Send + Unpin + for<'r> FromRow<'r, sqlx::postgres::PgRow> + for<'r> FromRow<'r, sqlx::sqlite::SqliteRow>,
    {
        Ok(on_conn!(conn, |c, q| {
            let sql = match which {
                ClaimSql::Open => q.claim_jobs,
                ClaimSql::Limited { .. } => q.claim_limited,
            };
            let mut query = sqlx::query_as::<_, R>(sql)
                .bind(queue)
                .bind(self.now())
                .bind(limit)
                .bind(owner)
                .bind(lease_ms);
            if let ClaimSql::Limited { scan } = which {
                query = query.bind(scan);
            }
            query.fetch_all(&mut *c).await?
        }))
    }

    /// [`Jobs::complete_batch`](crate::Jobs::complete_batch) inside `conn`'s transaction: one set-based
    /// statement, or a savepoint per lease where the engine writes one by one.
    pub(crate) async fn complete_batch_in(&self, conn: Conn<'_>, items: &[(Lease, Value)]) -> Result<Vec<Result<()>>> {
        match conn.batching() {
            Batching::SetBased(mut c) => self.complete_batch_pg(&mut c, items).await,
            Batching::OneByOne(mut conn) => {
                let mut out = Vec::with_capacity(items.len());
                for (lease, result) in items {
                    // A savepoint per lease keeps a refused one from leaving half its writes.
                    let one = conn
                        .in_savepoint(async |c| self.jobs().complete_in(c, lease, result).await)
                        .await?;
                    out.push(one);
                }
                Ok(out)
            }
        }
    }

    /// Binds the completions of `items` as complete_writes' $1..$8.
    fn bind_completions<'q>(
        &'q self,
        q: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
        items: &'q [(Lease, Value)],
    ) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
        q.bind(items.iter().map(|(l, _)| l.tenant.as_str()).collect::<Vec<_>>())
            .bind(items.iter().map(|(l, _)| l.run_id).collect::<Vec<_>>())
            .bind(items.iter().map(|(l, _)| l.owner.as_str()).collect::<Vec<_>>())
            .bind(items.iter().map(|(l, _)| l.generation).collect::<Vec<_>>())
            .bind(items.iter().map(|(_, v)| Json(v)).collect::<Vec<_>>())
            .bind(
                items
                    .iter()
                    .map(|(l, _)| crate::outbox::lane_for(&l.run_id.to_string(), self.lanes()))
                    .collect::<Vec<_>>(),
            )
            .bind(self.now())
            .bind(&self.inner.events_topic)
    }

    /// Each item's answer: `Ok` when its very lease (tenant, run id,
    /// generation) is among `done`, else the typed refusal. Matching on the
    /// run id alone would answer `Ok` for a stale lease batched beside the
    /// current lease of the same job, or for another tenant's run id.
    async fn answer_completions(
        &self,
        c: &mut PgConn<'_>,
        items: &[(Lease, Value)],
        done: &std::collections::HashSet<(String, Uuid, i64)>,
    ) -> Vec<Result<()>> {
        let mut out = Vec::with_capacity(items.len());
        for (lease, _) in items {
            out.push(
                if done.contains(&(lease.tenant.clone(), lease.run_id, lease.generation)) {
                    Ok(())
                } else {
                    Err(self
                        .jobs()
                        .refusal(Conn::from(c.reborrow()), lease, Transition::Finish)
                        .await)
                },
            );
        }
        out
    }

    async fn complete_batch_pg(&self, c: &mut PgConn<'_>, items: &[(Lease, Value)]) -> Result<Vec<Result<()>>> {
        let rows = self
            .bind_completions(sqlx::query(crate::store::queries::POSTGRES_ONLY.complete_batch), items)
            .fetch_all(&mut *c)
            .await?;
        let mut done = std::collections::HashSet::with_capacity(rows.len());
        for row in &rows {
            let row = CompletedRow::from_row(row)?;
            if !row.moved {
                return Err(Error::Invariant(
                    "a leased job's run was already terminal; the batch was rolled back".into(),
                ));
            }
            done.insert(row.lease.key());
        }
        Ok(self.answer_completions(c, items, &done).await)
    }

    /// [`Jobs::complete_and_claim`](crate::Jobs::complete_and_claim) inside `conn`'s transaction (or, on
    /// PostgreSQL, as one autocommitted statement when `conn` is outside
    /// one): completes `items` exactly like [`Jobs::complete_batch`](crate::Jobs::complete_batch) and
    /// claims up to `limit` jobs of `queue` exactly like [`Jobs::claim`](crate::Jobs::claim).
    /// `limited` (the caller's reading of the hint, with `conn` in a
    /// transaction) completes first and then claims through [`Ferry::claim_in`],
    /// which takes a limited queue's row lock.
    pub(crate) async fn complete_and_claim_on(
        &self,
        conn: Conn<'_>,
        items: &[(Lease, Value)],
        (queue, owner, lease_ms, limit): (&str, &str, i64, u32),
        limited: bool,
    ) -> Result<(Vec<Result<()>>, Vec<Claimed>)> {
        match conn.batching() {
            // A limited queue: the completions, then the limited claim, in
            // the caller's transaction (the combined statement claims
            // nothing there).
            Batching::SetBased(mut c) if limited => {
                let done = self.complete_batch_pg(&mut c, items).await?;
                let claimed = if limit == 0 {
                    Vec::new()
                } else {
                    self.claim_in(Conn::from(c), queue, owner, lease_ms, limit).await?
                };
                Ok((done, claimed))
            }
            Batching::SetBased(mut c) => {
                let rows = self
                    .bind_completions(
                        sqlx::query(crate::store::queries::POSTGRES_ONLY.complete_and_claim),
                        items,
                    )
                    .bind(queue)
                    .bind(i64::from(limit))
                    .bind(owner)
                    .bind(lease_ms)
                    .fetch_all(&mut c)
                    .await?;
                let mut done = std::collections::HashSet::new();
                let mut claimed = Vec::new();
                for row in &rows {
                    if RowKind::from_row(row)?.kind == "claimed" {
                        claimed.push(claimed_from_pg_row(row)?);
                    } else {
                        done.insert(CompletedLease::from_row(row)?.key());
                    }
                }
                let out = self.answer_completions(&mut c, items, &done).await;
                Ok((out, claimed))
            }
            Batching::OneByOne(mut conn) => {
                let done = self.complete_batch_in(conn.reborrow(), items).await?;
                let claimed = self.claim_in(conn, queue, owner, lease_ms, limit).await?;
                Ok((done, claimed))
            }
        }
    }
}

/// A row of `claim_jobs` (or a claimed row of `complete_and_claim`) on
/// PostgreSQL: the job, and the run data the statement reads with it.
#[derive(sqlx::FromRow)]
struct ClaimedPgRow {
    #[sqlx(flatten)]
    job: ClaimRow,
    operation: String,
    request: Json<Value>,
    replay_of: Option<Uuid>,
}

/// The lease a completion statement (`complete_batch`,
/// `complete_and_claim`) completed.
#[derive(sqlx::FromRow)]
struct CompletedLease {
    tenant: String,
    run_id: Uuid,
    lease_generation: i64,
}

impl CompletedLease {
    /// What [`Ferry::answer_completions`] matches a lease against.
    fn key(self) -> (String, Uuid, i64) {
        (self.tenant, self.run_id, self.lease_generation)
    }
}

/// A row of `complete_batch`: the completed lease, and whether its run
/// moved (false when the run was already terminal).
#[derive(sqlx::FromRow)]
struct CompletedRow {
    moved: bool,
    #[sqlx(flatten)]
    lease: CompletedLease,
}

/// Which half of `complete_and_claim` a row belongs to: `claimed` or a
/// completion.
#[derive(sqlx::FromRow)]
struct RowKind {
    kind: String,
}

impl ClaimedPgRow {
    /// The claimed job with its run's data.
    fn into_claimed(self) -> Claimed {
        self.job.into_claimed(self.operation, self.request.0, self.replay_of)
    }
}

/// A row of `claim_jobs` (or the claimed rows of `complete_and_claim`) on PostgreSQL.
fn claimed_from_pg_row(row: &sqlx::postgres::PgRow) -> Result<Claimed> {
    Ok(ClaimedPgRow::from_row(row)?.into_claimed())
}
