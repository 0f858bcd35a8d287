//! The relay's database side, without Kafka: lane leases with generations
//! that only go up, batches in `id` order, marks fenced by the lane
//! generation, poison rows and retention. Its SQL is `relay/sql/`, rendered
//! for both engines at build time; this module is the only place in the
//! relay that talks to the database. What an operator reads or replays (the
//! backlog, dead rows, lane owners, the slots' state) is the core's
//! [`ferry::Operator`], which the relay's gauges and `status` read too.

use std::collections::BTreeMap;
use std::time::Duration;

use sqlx::types::Json;

use ferry::operator::LiveRelay;
use ferry::store::{on_conn, on_pool, Conn};
use ferry::time::duration_ms;
use ferry::{Error, Ferry, Millis, Result};

mod queries {
    include!(concat!(env!("OUT_DIR"), "/queries.rs"));
}
mod wal;
use queries::QUERIES;

pub use wal::{CatchUp, LayoutSlot, PublishedTable, SlotState, Stream, WalSetting};

/// A lane this relay holds, at a generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::FromRow)]
pub struct LaneLease {
    /// Lane number.
    pub lane: i32,
    /// Generation of this relay's lease on it.
    pub generation: i64,
}

/// An outbox row waiting to be published.
#[derive(Debug, Clone, PartialEq)]
pub struct PendingRow {
    /// Outbox id: publication order within the lane; with the database id,
    /// the default effect key (`<database id>:<id>`).
    pub id: i64,
    /// Tenant.
    pub tenant: String,
    /// Topic before routing.
    pub topic: String,
    /// Kafka key.
    pub key: String,
    /// Record value.
    pub payload: Vec<u8>,
    /// Row headers.
    pub headers: BTreeMap<String, String>,
    /// Effect key, when the writer set one.
    pub effect_key: Option<String>,
    /// W3C trace context captured at enqueue.
    pub traceparent: Option<String>,
    /// Commit-side timestamp (ms), for commit-to-ack latency.
    pub created_at: Millis,
}

#[derive(sqlx::FromRow)]
pub(crate) struct PendingSqlRow {
    id: i64,
    tenant: String,
    topic: String,
    key: String,
    payload: Vec<u8>,
    headers: Json<BTreeMap<String, String>>,
    effect_key: Option<String>,
    traceparent: Option<String>,
    created_at: Millis,
}

/// The relay's handle on the outbox tables: a [`Ferry`] (pool, clock,
/// limits) and the relay's own queries. Cheap to clone.
#[derive(Debug, Clone)]
pub struct RelayStore {
    ferry: Ferry,
}

impl RelayStore {
    /// The relay's store over `ferry`'s pool and clock.
    pub fn new(ferry: Ferry) -> Self {
        RelayStore { ferry }
    }

    /// The core handle (limits, lanes, database id).
    pub fn ferry(&self) -> &Ferry {
        &self.ferry
    }

    fn now(&self) -> Option<i64> {
        self.ferry.clock().param()
    }

    async fn begin(&self) -> Result<ferry::Tx> {
        self.ferry.begin().await
    }

    fn db(&self) -> &ferry::Db {
        self.ferry.db()
    }

    /// Prepares every query of the relay's own on this database (the
    /// conformance check); the operator queries it also runs (live relays,
    /// backlog, dead rows, slots) are the core's, prepared by its check.
    pub async fn check_queries(&self) -> Result<()> {
        ferry::store::check_queries(self.db(), QUERIES.get(self.db().engine()).all()).await?;
        if self.db().as_postgres().is_some() {
            ferry::store::check_queries(self.db(), queries::POSTGRES_ONLY.all()).await?;
        }
        Ok(())
    }

    /// Announces relay `owner` alive for `ttl` with its lane cap, sweeps
    /// instances whose heartbeat expired, and returns the live relays (this
    /// one included) with their caps, ordered by owner.
    pub async fn relay_heartbeat(&self, owner: &str, ttl: Duration, max_lanes: u32) -> Result<Vec<LiveRelay>> {
        let ttl = duration_ms(ttl)?;
        let cap = i64::from(max_lanes);
        on_pool!(self.db(), QUERIES, |p, q| {
            sqlx::query(q.relay_heartbeat)
                .bind(owner)
                .bind(self.now())
                .bind(ttl)
                .bind(cap)
                .execute(p)
                .await?;
            sqlx::query(q.sweep_relay_instances).bind(self.now()).execute(p).await?;
        });
        self.ferry.operator().live_relays().await
    }

    /// Removes relay `owner` from the membership (clean shutdown).
    pub async fn relay_leave(&self, owner: &str) -> Result<()> {
        on_pool!(self.db(), QUERIES, |p, q| {
            sqlx::query(q.relay_leave).bind(owner).execute(p).await?;
        });
        Ok(())
    }

    /// Extends every lane `owner` still holds; returns them. Lanes missing from
    /// the answer were lost.
    pub async fn renew_lanes(&self, owner: &str, lease: Duration) -> Result<Vec<LaneLease>> {
        let ms = duration_ms(lease)?;
        Ok(on_pool!(self.db(), QUERIES, |p, q| {
            sqlx::query_as(q.renew_lanes)
                .bind(owner)
                .bind(self.now())
                .bind(ms)
                .fetch_all(p)
                .await?
        }))
    }

    /// Takes up to `max` free or expired lanes, each at a new generation.
    pub async fn acquire_lanes(&self, owner: &str, lease: Duration, max: u32) -> Result<Vec<LaneLease>> {
        let ms = duration_ms(lease)?;
        if max == 0 {
            return Ok(Vec::new());
        }
        let mut tx = self.begin().await?;
        let r = async {
            Ok(on_conn!(tx.conn(), QUERIES, |c, q| {
                sqlx::query_as(q.acquire_lanes)
                    .bind(owner)
                    .bind(self.now())
                    .bind(ms)
                    .bind(i64::from(max))
                    .bind(self.ferry.lanes())
                    .fetch_all(&mut *c)
                    .await?
            }))
        }
        .await;
        tx.finish(r).await
    }

    /// Gives a lane back, only if `owner` still holds it at that generation.
    pub async fn release_lane(&self, owner: &str, lane: LaneLease) -> Result<bool> {
        let n = on_pool!(self.db(), QUERIES, |p, q| {
            sqlx::query(q.release_lane)
                .bind(lane.lane)
                .bind(owner)
                .bind(lane.generation)
                .execute(p)
                .await?
                .rows_affected()
        });
        Ok(n == 1)
    }

    /// The next `limit` pending rows of `lane`, in `id` order.
    pub async fn pending_batch(&self, lane: i32, limit: u32) -> Result<Vec<PendingRow>> {
        let rows: Vec<PendingSqlRow> = on_pool!(self.db(), QUERIES, |p, q| {
            sqlx::query_as(q.pending_batch)
                .bind(lane)
                .bind(i64::from(limit))
                .fetch_all(p)
                .await?
        });
        Ok(Self::pending_rows(rows))
    }

    /// The lane's first pending rows other than `in_flight` (the batch being
    /// published): the read-ahead. Rows that committed late with lower ids
    /// than the batch are included, so a key's rows keep their id order.
    pub async fn pending_besides(&self, lane: i32, limit: u32, in_flight: &[i64]) -> Result<Vec<PendingRow>> {
        let rows: Vec<PendingSqlRow> = on_pool!(self.db(), QUERIES, |p, q| {
            sqlx::query_as(q.pending_besides)
                .bind(lane)
                .bind(i64::from(limit))
                .bind(ferry::store::Ids(in_flight))
                .fetch_all(p)
                .await?
        });
        Ok(Self::pending_rows(rows))
    }

    /// The lanes `owner` holds that have at least one pending row.
    pub async fn lanes_with_pending(&self, owner: &str) -> Result<Vec<i32>> {
        Ok(on_pool!(self.db(), QUERIES, |p, q| {
            sqlx::query_scalar(q.lanes_with_pending)
                .bind(owner)
                .fetch_all(p)
                .await?
        }))
    }

    pub(crate) fn pending_rows(rows: Vec<PendingSqlRow>) -> Vec<PendingRow> {
        rows.into_iter()
            .map(|r| PendingRow {
                id: r.id,
                tenant: r.tenant,
                topic: r.topic,
                key: r.key,
                payload: r.payload,
                headers: r.headers.0,
                effect_key: r.effect_key,
                traceparent: r.traceparent,
                created_at: r.created_at,
            })
            .collect()
    }

    /// Marks acknowledged rows delivered (or deletes them, with `delete`), in
    /// one autocommitted statement that carries its own fence (the lane's
    /// owner and generation): a relay that lost the lane gets
    /// [`Error::LostLane`] and changes nothing. Only when fewer rows change
    /// than `ids` does a second query tell a lost lane from rows that were no
    /// longer pending.
    pub async fn mark_delivered(&self, owner: &str, lane: LaneLease, ids: &[i64], delete: bool) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let marked = on_pool!(self.db(), QUERIES, |p, q| {
            let fenced = sqlx::query(if delete { q.delete_delivered } else { q.mark_delivered })
                .bind(lane.lane)
                .bind(ferry::store::Ids(ids))
                .bind(owner)
                .bind(lane.generation);
            // Only a mark stamps the instant ($5); a delete has none.
            let fenced = if delete { fenced } else { fenced.bind(self.now()) };
            fenced.execute(p).await?.rows_affected()
        });
        if marked < ids.len() as u64 {
            let mut conn = self.db().acquire().await?;
            self.lock_lane(conn.conn(), owner, lane).await?;
        }
        Ok(marked)
    }

    /// Marks a row Kafka will never accept `dead` with its error code, fenced
    /// by the lane generation.
    pub async fn mark_dead(&self, owner: &str, lane: LaneLease, id: i64, code: &str) -> Result<()> {
        let mut tx = self.begin().await?;
        let r = async {
            self.lock_lane(tx.conn(), owner, lane).await?;
            on_conn!(tx.conn(), QUERIES, |c, q| {
                sqlx::query(q.mark_dead)
                    .bind(lane.lane)
                    .bind(id)
                    .bind(code)
                    .execute(&mut *c)
                    .await?;
            });
            Ok(())
        }
        .await;
        tx.finish(r).await
    }

    /// Records a transient publish failure on a row (attempt count and code),
    /// fenced by the lane generation: a relay that lost the lane gets
    /// [`Error::LostLane`] and changes nothing.
    pub async fn note_publish_error(&self, owner: &str, lane: LaneLease, id: i64, code: &str) -> Result<()> {
        let mut tx = self.begin().await?;
        let r = async {
            self.lock_lane(tx.conn(), owner, lane).await?;
            on_conn!(tx.conn(), QUERIES, |c, q| {
                sqlx::query(q.note_publish_error)
                    .bind(lane.lane)
                    .bind(id)
                    .bind(code)
                    .bind(owner)
                    .bind(lane.generation)
                    .execute(&mut *c)
                    .await?;
            });
            Ok(())
        }
        .await;
        tx.finish(r).await
    }

    /// Deletes up to `batch` rows delivered more than `retention` ago:
    /// marked delivered, or covered by a ledger range delivered that long
    /// ago (`--capture wal` leaves its rows `pending` and covered). No
    /// undelivered row (pending and not covered) and no dead row is deleted.
    pub async fn sweep_delivered(&self, retention: Duration, batch: u32) -> Result<u64> {
        self.sweep(retention, batch, false).await
    }

    /// After [`Self::sweep_delivered`] found no more: deletes up to `batch`
    /// ledger ranges delivered more than `retention` ago that cover no
    /// pending row any more.
    pub async fn sweep_delivered_ranges(&self, retention: Duration, batch: u32) -> Result<u64> {
        self.sweep(retention, batch, true).await
    }

    async fn sweep(&self, retention: Duration, batch: u32, ranges: bool) -> Result<u64> {
        let ms = duration_ms(retention)?;
        Ok(on_pool!(self.db(), QUERIES, |p, q| {
            sqlx::query(if ranges {
                q.sweep_delivered_ranges
            } else {
                q.sweep_delivered
            })
            .bind(self.now())
            .bind(ms)
            .bind(i64::from(batch))
            .execute(p)
            .await?
            .rows_affected()
        }))
    }

    /// One step of a poll relay's fold after `--capture wal` (PostgreSQL;
    /// the ledger is empty on SQLite): the first `batch` ranges of the
    /// delivered-ranges ledger become row states in one transaction under
    /// the ledger's lock (a WAL relay beside this one keeps marking between
    /// steps), so the lanes' pending index stops carrying rows already
    /// delivered. Each folded range's pending rows become `delivered` at
    /// its `delivered_at`, then the range is deleted. Returns the ranges
    /// folded: fewer than `batch` once the ledger is folded. A step that
    /// failed or was cut short did not commit and changed nothing.
    pub async fn fold_delivered(&self, batch: u32) -> Result<u64> {
        let Some(pool) = self.db().as_postgres() else {
            return Ok(0);
        };
        let mut tx = pool.begin().await?;
        let mut c = ferry::store::PgConn::new(&mut tx, pool.route());
        sqlx::query(queries::POSTGRES_ONLY.fold_delivered_lock)
            .execute(&mut c)
            .await?;
        let n: i64 = sqlx::query_scalar(queries::POSTGRES_ONLY.fold_delivered)
            .bind(i64::from(batch))
            .fetch_one(&mut c)
            .await?;
        tx.commit().await?;
        Ok(n as u64)
    }

    async fn lock_lane(&self, conn: Conn<'_>, owner: &str, lane: LaneLease) -> Result<()> {
        let held: Option<i32> = on_conn!(conn, QUERIES, |c, q| {
            sqlx::query_scalar(q.lock_lane)
                .bind(lane.lane)
                .bind(owner)
                .bind(lane.generation)
                .fetch_optional(&mut *c)
                .await?
        });
        match held {
            Some(_) => Ok(()),
            None => Err(Error::LostLane {
                lane: lane.lane,
                generation: lane.generation,
            }),
        }
    }
}
