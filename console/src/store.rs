//! The console's read-only queries (`sql/console.sql`), rendered for both
//! engines at build time. Actions never come through here: they call the
//! library functions the command line calls.

use ferry::store::on_pool;
use ferry::{Ferry, Millis, Result};

mod queries {
    include!(concat!(env!("OUT_DIR"), "/queries.rs"));
}
use queries::QUERIES;

/// One lane's pending backlog.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct LaneBacklog {
    /// Lane.
    pub lane: i32,
    /// Pending rows in it.
    pub pending: i64,
    /// `created_at` of its oldest (lowest id) pending row.
    pub oldest: Millis,
}

/// Dead outbox rows of one tenant with one error code.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct DeadOutboxGroup {
    /// Tenant.
    pub tenant: String,
    /// The error code they died with (empty when none was recorded).
    pub error_code: String,
    /// How many.
    pub rows: i64,
    /// The lowest id among them (where to start looking).
    pub first_id: i64,
    /// The highest id among them: a group replay goes no further, so rows
    /// that died after the page was shown are not replayed unseen.
    pub last_id: i64,
}

/// How many jobs of a queue are in a state.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct QueueStateCount {
    /// Queue.
    pub queue: String,
    /// Job state (`queued`, `leased`, `succeeded`, `dead`, `cancelled`).
    pub state: String,
    /// How many.
    pub jobs: i64,
}

/// Dead jobs of one tenant with one error code.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct DeadJobGroup {
    /// Tenant.
    pub tenant: String,
    /// The safe error code (empty when none was recorded).
    pub error_code: String,
    /// How many.
    pub jobs: i64,
}

/// A consumer group's partition as stored with its effects.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct ConsumerPartition {
    /// Consumer group.
    pub group_id: String,
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// Member holding its lease.
    pub owner: Option<String>,
    /// Lease generation (raised by every assignment).
    pub generation: i64,
    /// Lease expiry.
    pub lease_expires_at: Option<Millis>,
    /// Next offset to process, stored in the effect transaction.
    pub next_offset: Option<i64>,
}

/// What the database knows of a consumer group's progress beyond its
/// partitions: its ledger. (How far behind the topic it is, the high
/// watermark minus the stored offset, only the consumers know: the broker's
/// watermark is not in the database.)
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct ConsumerGroupLedger {
    /// Consumer group.
    pub group_id: String,
    /// When the group last committed a record it had not seen before (its
    /// newest ledger entry); `None` when the ledger holds none of its
    /// entries, e.g. all swept past retention.
    pub last_processed_at: Option<Millis>,
    /// Records it dead-lettered that are still in the ledger.
    pub dead_letters: i64,
}

/// One sampler reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::FromRow)]
pub struct OutboxReading {
    /// Pending rows now.
    pub pending: i64,
    /// Rows marked delivered after the instant asked about.
    pub delivered: i64,
    /// The clock's now.
    pub now: Millis,
}

/// What an idempotency key accepted: the run, and when the record expires.
/// The key itself stays in the struct only to be redacted for display.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct KeyedRun {
    /// Operation the key was used with.
    pub operation: String,
    /// The key as stored (never rendered: pages show `ferry::redact` of it).
    pub key: String,
    /// The run it accepted.
    pub run_id: uuid::Uuid,
    /// When the key was claimed.
    pub created_at: Millis,
    /// When the record stops deduplicating.
    pub expires_at: Millis,
}

/// A consumer group's ledger entry for one of a run's outbox rows.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct LedgerEntry {
    /// The outbox row it is for.
    pub outbox_id: i64,
    /// Consumer group.
    pub group_id: String,
    /// The effect key the group deduplicated on.
    pub effect_key: String,
    /// Where the record was read.
    pub topic: String,
    /// Its partition.
    pub partition: i32,
    /// Its offset.
    pub record_offset: i64,
    /// `applied` or `dead_lettered`.
    pub outcome: String,
    /// When the group processed it.
    pub processed_at: Millis,
}

/// The console's queries over a [`Ferry`] handle.
#[derive(Debug, Clone)]
pub struct ConsoleStore {
    ferry: Ferry,
}

impl ConsoleStore {
    /// Queries through `ferry`'s pool and clock.
    pub fn new(ferry: Ferry) -> Self {
        ConsoleStore { ferry }
    }

    /// Prepares every console query on this database (the conformance check).
    pub async fn check_queries(&self) -> Result<()> {
        let db = self.ferry.db();
        ferry::store::check_queries(db, QUERIES.get(db.engine()).all()).await
    }

    /// Pending backlog per lane (lanes with none are left out).
    pub async fn outbox_lanes(&self, tenant: Option<&str>) -> Result<Vec<LaneBacklog>> {
        Ok(on_pool!(self.ferry.db(), QUERIES, |p, q| {
            match tenant {
                Some(t) => sqlx::query_as(q.outbox_lanes_of_tenant).bind(t).fetch_all(p).await?,
                None => sqlx::query_as(q.outbox_lanes).fetch_all(p).await?,
            }
        }))
    }

    /// Dead outbox rows grouped by tenant and error code, largest first.
    pub async fn outbox_dead_groups(&self, tenant: Option<&str>) -> Result<Vec<DeadOutboxGroup>> {
        Ok(on_pool!(self.ferry.db(), QUERIES, |p, q| {
            sqlx::query_as(q.outbox_dead_groups).bind(tenant).fetch_all(p).await?
        }))
    }

    /// Jobs counted by queue and state: one tenant's, or (reading every job:
    /// the census only) every tenant's.
    pub async fn jobs_by_queue_state(&self, tenant: Option<&str>) -> Result<Vec<QueueStateCount>> {
        Ok(on_pool!(self.ferry.db(), QUERIES, |p, q| {
            match tenant {
                Some(t) => {
                    sqlx::query_as(q.jobs_of_tenant_by_queue_state)
                        .bind(t)
                        .fetch_all(p)
                        .await?
                }
                None => sqlx::query_as(q.jobs_by_queue_state).fetch_all(p).await?,
            }
        }))
    }

    /// Dead jobs grouped by tenant and error code, largest first.
    pub async fn dead_job_groups(&self, tenant: Option<&str>) -> Result<Vec<DeadJobGroup>> {
        Ok(on_pool!(self.ferry.db(), QUERIES, |p, q| {
            sqlx::query_as(q.dead_job_groups).bind(tenant).fetch_all(p).await?
        }))
    }

    /// Every consumer group's partitions.
    pub async fn consumer_partitions(&self) -> Result<Vec<ConsumerPartition>> {
        Ok(on_pool!(self.ferry.db(), QUERIES, |p, q| {
            sqlx::query_as(q.consumer_partitions).fetch_all(p).await?
        }))
    }

    /// Every consumer group's newest ledger entry and dead letters.
    pub async fn consumer_groups(&self) -> Result<Vec<ConsumerGroupLedger>> {
        Ok(on_pool!(self.ferry.db(), QUERIES, |p, q| {
            sqlx::query_as(q.consumer_groups).fetch_all(p).await?
        }))
    }

    /// The sampler's reading: pending rows and rows delivered after `since`.
    pub async fn sample_outbox(&self, since: i64) -> Result<OutboxReading> {
        let now = self.ferry.clock().param();
        Ok(on_pool!(self.ferry.db(), QUERIES, |p, q| {
            sqlx::query_as(q.sample_outbox)
                .bind(since)
                .bind(now)
                .fetch_one(p)
                .await?
        }))
    }

    /// The runs idempotency key `key` accepted for `tenant` (only under
    /// `operation` when given: then one primary-key lookup).
    pub async fn runs_by_key(&self, tenant: &str, key: &str, operation: Option<&str>) -> Result<Vec<KeyedRun>> {
        Ok(on_pool!(self.ferry.db(), QUERIES, |p, q| {
            match operation {
                Some(op) => {
                    sqlx::query_as(q.runs_by_key_and_operation)
                        .bind(tenant)
                        .bind(key)
                        .bind(op)
                        .fetch_all(p)
                        .await?
                }
                None => {
                    sqlx::query_as(q.runs_by_key)
                        .bind(tenant)
                        .bind(key)
                        .fetch_all(p)
                        .await?
                }
            }
        }))
    }

    /// Every consumer group's ledger entries for `tenant`'s outbox rows
    /// `ids`, each looked up under the effect key the relay publishes it
    /// with (`ferry::outbox::effect_key_of`); ids of other tenants'
    /// rows match nothing.
    pub async fn ledger_for_outbox_rows(&self, tenant: &str, ids: &[i64]) -> Result<Vec<LedgerEntry>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let database_id = self.ferry.database_id().await?;
        Ok(on_pool!(self.ferry.db(), QUERIES, |p, q| {
            sqlx::query_as(q.ledger_for_outbox_rows)
                .bind(&database_id)
                .bind(ferry::store::Ids(ids))
                .bind(tenant)
                .fetch_all(p)
                .await?
        }))
    }

    /// The clock's now (the database clock unless one was injected).
    pub async fn now(&self) -> Result<Millis> {
        let now = self.ferry.clock().param();
        let ms: i64 = on_pool!(self.ferry.db(), QUERIES, |p, q| {
            sqlx::query_scalar(q.db_now).bind(now).fetch_one(p).await?
        });
        Millis::new(ms)
    }
}
