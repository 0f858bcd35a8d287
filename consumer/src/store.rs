//! The consumer's database side, without Kafka: partition leases whose
//! generation only goes up, the dedupe ledger, and offsets stored in the same
//! transaction as a handler's effects. Its SQL is
//! `consumer/sql/`, rendered for both engines at build time; this module is
//! the only place in the consumer that talks to the database.

use std::time::Duration;

use ferry::store::{on_conn, on_pool, Conn};
use ferry::time::duration_ms;
use ferry::{Error, Ferry, Result};

mod queries {
    include!(concat!(env!("OUT_DIR"), "/queries.rs"));
}
use queries::QUERIES;

/// A consumer's lease on `(group, topic, partition)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionLease {
    /// Consumer group.
    pub group: String,
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// The consumer holding it.
    pub owner: String,
    /// Generation of this lease.
    pub generation: i64,
}

impl PartitionLease {
    fn lost(&self) -> Error {
        Error::LostPartition {
            topic: self.topic.clone(),
            partition: self.partition,
            generation: self.generation,
        }
    }
}

/// A partition's stored position.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct StoredOffset {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// The next offset to process, stored with the effects.
    pub next_offset: Option<i64>,
    /// Current holder.
    pub owner: Option<String>,
    /// Current generation.
    pub generation: i64,
}

/// What [`ConsumerStore::begin_record`] or
/// [`ConsumerStore::insert_ledger_batch`] found in the ledger for a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LedgerEntry {
    /// First time: run the handler's effects in this transaction.
    New,
    /// Already processed by this group: skip the handler, only advance.
    Duplicate,
}

/// The consumer's handle on its tables: a [`Ferry`] (pool, clock) and the
/// consumer's own queries. Cheap to clone.
#[derive(Debug, Clone)]
pub struct ConsumerStore {
    ferry: Ferry,
}

impl ConsumerStore {
    /// The consumer's store over `ferry`'s pool and clock.
    pub fn new(ferry: Ferry) -> Self {
        ConsumerStore { ferry }
    }

    /// How many of the consumer's transactions may run at once: half of a
    /// PostgreSQL pool (leaving a handler room to take a second connection,
    /// and the rest of the process its share), one on SQLite (one writer at
    /// a time).
    pub fn parallel_transactions(&self) -> usize {
        self.ferry
            .db()
            .as_postgres()
            .map_or(1, |p| (p.options().get_max_connections() / 2).max(1) as usize)
    }

    /// The core handle.
    pub fn ferry(&self) -> &Ferry {
        &self.ferry
    }

    /// Starts the transaction a record's effects, ledger row and offset
    /// commit in.
    pub async fn begin(&self) -> Result<ferry::Tx> {
        self.ferry.begin().await
    }

    fn now(&self) -> Option<i64> {
        self.ferry.clock().param()
    }

    fn db(&self) -> &ferry::Db {
        self.ferry.db()
    }

    /// Prepares every consumer query on this database (the conformance check).
    pub async fn check_queries(&self) -> Result<()> {
        ferry::store::check_queries(self.db(), QUERIES.get(self.db().engine()).all()).await
    }

    /// Takes the lease on a partition Kafka assigned to `owner`, raising its
    /// generation. Returns the lease and the offset stored with the effects.
    pub async fn acquire_partition(
        &self,
        group: &str,
        topic: &str,
        partition: i32,
        owner: &str,
        lease: Duration,
    ) -> Result<(PartitionLease, Option<i64>)> {
        let ms = duration_ms(lease)?;
        let (generation, next): (i64, Option<i64>) = on_pool!(self.db(), QUERIES, |p, q| {
            sqlx::query_as(q.acquire_partition)
                .bind(group)
                .bind(topic)
                .bind(partition)
                .bind(owner)
                .bind(self.now())
                .bind(ms)
                .fetch_one(p)
                .await?
        });
        let lease = PartitionLease {
            group: group.into(),
            topic: topic.into(),
            partition,
            owner: owner.into(),
            generation,
        };
        Ok((lease, next))
    }

    /// Takes the lease on a partition only if nobody holds it (never leased,
    /// released, already `owner`'s, or expired), raising its generation.
    /// `None` when another member holds a live lease. This is the reclaim of a
    /// member that lost a lease: unlike [`ConsumerStore::acquire_partition`], which
    /// the rebalance callback uses because Kafka's assignment is current
    /// there, it never takes a partition from a live holder on the strength
    /// of a possibly stale local view.
    pub async fn acquire_free_partition(
        &self,
        group: &str,
        topic: &str,
        partition: i32,
        owner: &str,
        lease: Duration,
    ) -> Result<Option<(PartitionLease, Option<i64>)>> {
        let ms = duration_ms(lease)?;
        let row: Option<(i64, Option<i64>)> = on_pool!(self.db(), QUERIES, |p, q| {
            sqlx::query_as(q.acquire_free_partition)
                .bind(group)
                .bind(topic)
                .bind(partition)
                .bind(owner)
                .bind(self.now())
                .bind(ms)
                .fetch_optional(p)
                .await?
        });
        Ok(row.map(|(generation, next)| {
            let lease = PartitionLease {
                group: group.into(),
                topic: topic.into(),
                partition,
                owner: owner.into(),
                generation,
            };
            (lease, next)
        }))
    }

    /// Extends one partition lease at its generation. `false` when it is no
    /// longer current (taken over or released).
    pub async fn renew_partition(&self, lease: &PartitionLease, duration: Duration) -> Result<bool> {
        let ms = duration_ms(duration)?;
        let n = on_pool!(self.db(), QUERIES, |p, q| {
            sqlx::query(q.renew_partition)
                .bind(&lease.group)
                .bind(&lease.topic)
                .bind(lease.partition)
                .bind(&lease.owner)
                .bind(lease.generation)
                .bind(self.now())
                .bind(ms)
                .execute(p)
                .await?
                .rows_affected()
        });
        Ok(n == 1)
    }

    /// Gives a partition back, only if the lease is still current.
    pub async fn release_partition(&self, lease: &PartitionLease) -> Result<bool> {
        let n = on_pool!(self.db(), QUERIES, |p, q| {
            sqlx::query(q.release_partition)
                .bind(&lease.group)
                .bind(&lease.topic)
                .bind(lease.partition)
                .bind(&lease.owner)
                .bind(lease.generation)
                .execute(p)
                .await?
                .rows_affected()
        });
        Ok(n == 1)
    }

    /// Extends every partition lease `owner` holds in `group`.
    pub async fn renew_partitions(&self, group: &str, owner: &str, lease: Duration) -> Result<u64> {
        let ms = duration_ms(lease)?;
        Ok(on_pool!(self.db(), QUERIES, |p, q| {
            sqlx::query(q.renew_partitions)
                .bind(group)
                .bind(owner)
                .bind(self.now())
                .bind(ms)
                .execute(p)
                .await?
                .rows_affected()
        }))
    }

    /// Steps 1–2 of processing a record, inside the caller's transaction:
    /// locks the partition row if `lease` is current ([`Error::LostPartition`]
    /// otherwise, with nothing written) and inserts the ledger row for
    /// `effect_key`, telling whether it is new or a duplicate.
    pub async fn begin_record(
        &self,
        conn: Conn<'_>,
        lease: &PartitionLease,
        effect_key: &str,
        offset: i64,
        outcome: &str,
    ) -> Result<LedgerEntry> {
        let mut conn = conn.routed(self.db());
        self.lock_partition(conn.reborrow(), lease).await?;
        let inserted: Option<String> = on_conn!(conn, QUERIES, |c, q| {
            sqlx::query_scalar(q.insert_ledger)
                .bind(&lease.group)
                .bind(effect_key)
                .bind(&lease.topic)
                .bind(lease.partition)
                .bind(offset)
                .bind(outcome)
                .bind(self.now())
                .fetch_optional(&mut *c)
                .await?
        });
        Ok(if inserted.is_some() {
            LedgerEntry::New
        } else {
            LedgerEntry::Duplicate
        })
    }

    /// Step 1, inside the caller's transaction: locks the partition row
    /// until commit if `lease` is current (no takeover can interleave with
    /// the effects), [`Error::LostPartition`] otherwise, with nothing
    /// written. A micro-batch takes it once for all its records.
    pub async fn lock_partition(&self, conn: Conn<'_>, lease: &PartitionLease) -> Result<()> {
        let held: Option<Option<i64>> = on_conn!(conn.routed(self.db()), QUERIES, |c, q| {
            sqlx::query_scalar(q.lock_partition)
                .bind(&lease.group)
                .bind(&lease.topic)
                .bind(lease.partition)
                .bind(&lease.owner)
                .bind(lease.generation)
                .fetch_optional(&mut *c)
                .await?
        });
        match held {
            Some(_) => Ok(()),
            None => Err(lease.lost()),
        }
    }

    /// Step 2 for a micro-batch, after [`Self::lock_partition`] in the same
    /// transaction: inserts the `applied` ledger rows of `records` (effect
    /// key, offset; in record order) in one statement and tells, per record,
    /// whether it is new or a duplicate. A key that comes twice is new only
    /// at its first record, as if the records were inserted one by one.
    pub async fn insert_ledger_batch(
        &self,
        conn: Conn<'_>,
        lease: &PartitionLease,
        records: &[(&str, i64)],
    ) -> Result<Vec<LedgerEntry>> {
        // Tuples serialize as JSON arrays: `[["key", 7], …]`.
        let pairs = serde_json::to_string(records).map_err(|e| Error::Invariant(e.to_string()))?;
        let inserted: Vec<String> = on_conn!(conn.routed(self.db()), QUERIES, |c, q| {
            sqlx::query_scalar(q.insert_ledger_batch)
                .bind(&lease.group)
                .bind(&pairs)
                .bind(&lease.topic)
                .bind(lease.partition)
                .bind("applied")
                .bind(self.now())
                .fetch_all(&mut *c)
                .await?
        });
        let mut new: std::collections::HashSet<String> = inserted.into_iter().collect();
        Ok(records
            .iter()
            .map(|(key, _)| match new.remove(*key) {
                true => LedgerEntry::New,
                false => LedgerEntry::Duplicate,
            })
            .collect())
    }

    /// Step 4: stores `next_offset` with the effects, under the lease.
    pub async fn advance_offset(&self, conn: Conn<'_>, lease: &PartitionLease, next_offset: i64) -> Result<()> {
        let n = on_conn!(conn.routed(self.db()), QUERIES, |c, q| {
            sqlx::query(q.advance_offset)
                .bind(&lease.group)
                .bind(&lease.topic)
                .bind(lease.partition)
                .bind(&lease.owner)
                .bind(lease.generation)
                .bind(next_offset)
                .execute(&mut *c)
                .await?
                .rows_affected()
        });
        if n == 0 {
            return Err(lease.lost());
        }
        Ok(())
    }

    /// Deletes up to `batch` ledger rows of `group` older than `retention`.
    pub async fn sweep_ledger(&self, group: &str, retention: Duration, batch: u32) -> Result<u64> {
        let ms = duration_ms(retention)?;
        Ok(on_pool!(self.db(), QUERIES, |p, q| {
            sqlx::query(q.sweep_ledger)
                .bind(group)
                .bind(self.now())
                .bind(ms)
                .bind(i64::from(batch))
                .execute(p)
                .await?
                .rows_affected()
        }))
    }

    /// Every partition's stored offset for `group`.
    pub async fn stored_offsets(&self, group: &str) -> Result<Vec<StoredOffset>> {
        Ok(on_pool!(self.db(), QUERIES, |p, q| {
            sqlx::query_as(q.stored_offsets).bind(group).fetch_all(p).await?
        }))
    }
}
