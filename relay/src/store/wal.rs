//! The database side of `--capture wal` (PostgreSQL only): whether this role
//! may stream, the publication and the replication slot (catalog reads,
//! creation, removal), the slot's catch-up flag, the catch-up read of the
//! table, and the set-based marks. None of it is fenced by a lane: the
//! replication slot is the fence, since PostgreSQL lets one session at a
//! time stream from it and only the streaming relay writes these marks.

use std::future::Future;
use std::time::Duration;

use sqlx::PgPool;

use super::queries::POSTGRES_ONLY as Q;
use super::{PendingRow, PendingSqlRow, RelayStore};
use ferry::{Error, Result};

/// How long one of WAL capture's statements may go unanswered before it
/// fails as a transient database error (`Error::Database`, an I/O timeout).
/// A half-open connection (packets dropped, no reset) answers nothing and
/// reports nothing: without a bound, a mark or a catch-up page sent into
/// it would hold the session, and the relay's shutdown, for ever.
pub const STATEMENT_BOUND: Duration = Duration::from_secs(30);

/// The bound of the statements whose work grows with the data (the table
/// read's page, a mark's ledger statement or deletes, which may also wait
/// for the ledger's lock during an operator's replay): long enough for any
/// legitimate one, still a bound on a connection that went half-open.
pub const LONG_STATEMENT_BOUND: Duration = Duration::from_secs(600);

/// `work` within [`STATEMENT_BOUND`]; its future (and connection) is
/// dropped past it.
pub(crate) async fn bounded<T>(work: impl Future<Output = Result<T>>) -> Result<T> {
    bounded_by(STATEMENT_BOUND, work).await
}

/// `work` within `bound`, else a transient database error.
async fn bounded_by<T>(bound: Duration, work: impl Future<Output = Result<T>>) -> Result<T> {
    match tokio::time::timeout(bound, work).await {
        Ok(r) => r,
        Err(_) => Err(Error::Database(sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("PostgreSQL did not answer within {bound:?}"),
        )))),
    }
}

/// The table a publication publishes: this schema's `outbox`, or with
/// `--debezium-config` a Debezium-layout table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishedTable {
    /// Its schema (`None`: the connection's `current_schema()`).
    pub schema: Option<String>,
    /// Its name.
    pub name: String,
}

impl PublishedTable {
    /// The table as SQL names it, each part quoted.
    fn quoted(&self) -> String {
        let q = |s: &str| format!("\"{}\"", s.replace('"', "\"\""));
        match &self.schema {
            Some(schema) => format!("{}.{}", q(schema), q(&self.name)),
            None => q(&self.name),
        }
    }
}

/// What decides the default capture mode on PostgreSQL.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct WalSetting {
    /// `wal_level = logical`: logical decoding is possible at all.
    pub logical: bool,
    /// The role has `REPLICATION` (or is a superuser).
    pub may_replicate: bool,
    /// `current_schema()`: whose `outbox` the publication covers.
    pub schema: String,
    /// `server_version_num`: failover slots are 17's.
    pub version: i32,
    /// `synchronized_standby_slots` is set (PostgreSQL 17+): the walsender
    /// sends a logical slot's reader only WAL those standbys have.
    pub standby_slots: bool,
}

impl WalSetting {
    /// Whether slots are made failover slots, which a standby synchronises
    /// so that a promotion keeps the slot: PostgreSQL 17+ with
    /// `synchronized_standby_slots` set. Without it, the relay could be sent
    /// (and, exactly once, record in its progress) positions a promoted
    /// standby never had, and a kept slot would then skip transactions the
    /// new primary writes below them.
    pub fn failover_slots(&self) -> bool {
        self.version >= 170_000 && self.standby_slots
    }
}

/// Slot creation on PostgreSQL 17+ (not a templated query: the checked
/// query set must prepare on every supported version, and the five-argument
/// form is 17's): a failover slot, which standbys with
/// `sync_replication_slots` keep in step.
const CREATE_FAILOVER_SLOT: &str =
    "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput', false, false, true)";

/// A replication slot as `pg_replication_slots` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::FromRow)]
pub struct SlotState {
    /// A session streams from it now (another relay, or ours not yet gone).
    pub active: bool,
    /// PostgreSQL removed WAL it still needed (`wal_status = 'lost'`): it
    /// can never stream again and must be dropped and made anew.
    pub lost: bool,
    /// A logical `pgoutput` slot of this database.
    pub usable: bool,
}

/// One stream of a relay group's outbox (`--streams`): the rows whose
/// `lane % count == index`, from a slot and a row-filtered publication of
/// their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Stream {
    /// Which stream, 0 to `count - 1`.
    pub index: u32,
    /// How many streams the group's outbox is split into.
    pub count: u32,
}

impl Stream {
    /// The outbox whole, in one stream (no `--streams`).
    pub const WHOLE: Stream = Stream { index: 0, count: 1 };

    /// The publication's row filter, as PostgreSQL prints it back
    /// (`pg_publication_tables.rowfilter`); `None` for the whole outbox.
    pub fn row_filter(&self) -> Option<String> {
        (self.count > 1).then(|| format!("((lane % {}) = {})", self.count, self.index))
    }

    /// The slot (or publication) name of this stream in a group named
    /// `base`: `base` itself for the whole outbox, else `<base>_<k>of<N>`.
    pub fn name(&self, base: &str) -> String {
        match self.count {
            1 => base.to_string(),
            n => format!("{base}_{}of{n}", self.index),
        }
    }
}

/// A slot of a relay group, whatever its layout ([`RelayStore::wal_layout_slots`]).
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct LayoutSlot {
    /// The slot's name.
    pub name: String,
    /// A session streams from it.
    pub active: bool,
}

/// A publication as [`RelayStore::wal_publication`] finds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::FromRow)]
pub struct WalPublication {
    /// It exists.
    pub found: bool,
    /// Its oid: a publication dropped and made again has a new one.
    pub oid: Option<i64>,
    /// It publishes the table's inserts (with the stream's row filter).
    #[sqlx(rename = "covers_outbox")]
    pub covers: bool,
}

/// The table read a slot still needs ([`RelayStore::wal_catch_up`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CatchUp {
    /// The highest id to read: every row committed before the slot has an
    /// id at most this (`i64::MAX` when unknown: duplicates, never a loss).
    pub through: i64,
    /// Which making of the slot the bound belongs to (0: no record of the
    /// slot): recording the read done is conditional on it.
    pub generation: i64,
    /// The slot was made and its bound never recorded (its maker died in
    /// between, or met a slot made without the making lock): the read must
    /// not run; the slot is made anew
    /// ([`RelayStore::remake_unbound_wal_slot`]).
    pub unbound: bool,
}

/// How [`RelayStore::make_wal_slot`] goes about the making lock and a slot
/// found made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Making {
    /// Waits for the lock; a slot found made is kept.
    Create,
    /// Only when the lock is free; a slot found made and unbound is dropped
    /// and made anew.
    RemakeUnbound,
}

impl RelayStore {
    fn pg(&self) -> Result<&PgPool> {
        self.ferry()
            .db()
            .as_postgres()
            .map(|p| p.pool())
            .ok_or(Error::Unsupported("WAL capture needs PostgreSQL"))
    }

    /// Whether `wal_level` is `logical` and this role may replicate.
    pub async fn wal_setting(&self) -> Result<WalSetting> {
        // Asked before the capture is chosen, so through the pool's route
        // (a transaction pooler is refused WAL capture after this).
        let db = self
            .ferry()
            .db()
            .as_postgres()
            .ok_or(Error::Unsupported("WAL capture needs PostgreSQL"))?;
        bounded(async move { Ok(sqlx::query_as(Q.wal_capture_allowed).fetch_one(db).await?) }).await
    }

    /// The columns of `schema.table` that have a default (none if the table
    /// does not exist).
    pub async fn wal_defaulted_columns(&self, schema: &str, table: &str) -> Result<Vec<String>> {
        bounded(async move {
            Ok(sqlx::query_scalar(Q.wal_defaulted_columns)
                .bind(schema)
                .bind(table)
                .fetch_all(self.pg()?)
                .await?)
        })
        .await
    }

    /// Whether `publication` exists, and whether it publishes the inserts of
    /// `table` (with `filter`: exactly that row filter, `None` for none; a
    /// publication filtered otherwise would skip rows the stream owns).
    pub async fn wal_publication(
        &self,
        publication: &str,
        table: &PublishedTable,
        filter: Option<Option<String>>,
    ) -> Result<WalPublication> {
        bounded(async move {
            Ok(sqlx::query_as(Q.wal_publication)
                .bind(publication)
                .bind(table.schema.as_deref())
                .bind(&table.name)
                .bind(filter.clone().flatten())
                .bind(filter.is_some())
                .fetch_one(self.pg()?)
                .await?)
        })
        .await
    }

    /// Creates `publication` on `table`, inserts only, and with `stream`
    /// only its lanes' rows (a row filter). A concurrent creation by
    /// another relay is not an error.
    pub async fn create_wal_publication(
        &self,
        publication: &str,
        table: &PublishedTable,
        stream: Stream,
    ) -> Result<()> {
        let ddl = match stream.row_filter() {
            Some(f) => format!("CREATE PUBLICATION {{p}} FOR TABLE {{t}} WHERE {f} WITH (publish = 'insert')"),
            None => "CREATE PUBLICATION {p} FOR TABLE {t} WITH (publish = 'insert')".into(),
        };
        self.publication_ddl(publication, table, &ddl).await
    }

    /// Drops `publication` (a stream layout's no relay uses any more); one
    /// already gone is not an error.
    pub async fn drop_wal_publication(&self, publication: &str) -> Result<()> {
        crate::config::check_identifier("publication", publication).map_err(|_| Error::InvalidInput {
            field: "publication",
            reason: "use 1 to 63 lowercase letters, digits and '_'".into(),
        })?;
        bounded(async move {
            sqlx::query(&format!("DROP PUBLICATION IF EXISTS {publication}"))
                .execute(self.pg()?)
                .await?;
            Ok(())
        })
        .await
    }

    /// How many streams relay group `base` (its base slot's name) is split
    /// into: the last started relay's `--streams`; 1 when none said.
    pub async fn wal_layout(&self, base: &str) -> Result<u32> {
        bounded(async move {
            let n: Option<i32> = sqlx::query_scalar(Q.wal_layout)
                .bind(base)
                .fetch_optional(self.pg()?)
                .await?;
            Ok(n.map_or(1, |n| n.max(1) as u32))
        })
        .await
    }

    /// Sets relay group `base`'s stream count (a relay's start); returns
    /// the count it replaced.
    pub async fn set_wal_layout(&self, base: &str, streams: u32) -> Result<u32> {
        let before = self.wal_layout(base).await?;
        bounded(async move {
            sqlx::query(Q.wal_set_layout)
                .bind(base)
                .bind(streams as i32)
                .bind(self.ferry().clock().param())
                .execute(self.pg()?)
                .await?;
            Ok(before)
        })
        .await
    }

    /// Announces relay `owner` in group `base`'s streams for `ttl`, and
    /// returns the group's live relays (this one included), by owner.
    pub async fn wal_member_heartbeat(&self, base: &str, owner: &str, ttl: Duration) -> Result<Vec<String>> {
        let ttl = ferry::time::duration_ms(ttl)?;
        bounded(async move {
            let pool = self.pg()?;
            sqlx::query(Q.wal_member_heartbeat)
                .bind(base)
                .bind(owner)
                .bind(self.ferry().clock().param())
                .bind(ttl)
                .execute(pool)
                .await?;
            Ok(sqlx::query_scalar(Q.wal_members)
                .bind(base)
                .bind(self.ferry().clock().param())
                .fetch_all(pool)
                .await?)
        })
        .await
    }

    /// Relay `owner` leaves group `base`'s streams (a clean shutdown): the
    /// others take its share at once instead of after its heartbeat.
    pub async fn wal_member_leave(&self, base: &str, owner: &str) -> Result<()> {
        bounded(async move {
            sqlx::query(Q.wal_member_leave)
                .bind(base)
                .bind(owner)
                .execute(self.pg()?)
                .await?;
            Ok(())
        })
        .await
    }

    /// Every slot of relay group `base` in this database, of any layout.
    pub async fn wal_layout_slots(&self, base: &str) -> Result<Vec<LayoutSlot>> {
        bounded(async move {
            Ok(sqlx::query_as(Q.wal_layout_slots)
                .bind(base)
                .fetch_all(self.pg()?)
                .await?)
        })
        .await
    }

    /// Adds `table` to `publication` (one that no longer publishes it: the
    /// table was replaced by a copy, a new relation id, or an operator
    /// altered it). Tables already in it stay; one already there is not an
    /// error.
    ///
    /// A stream's publication (`--streams`, Ferry's own, on `outbox` alone)
    /// is set to the table with the stream's row filter instead, whatever
    /// it held.
    pub async fn add_table_to_wal_publication(
        &self,
        publication: &str,
        table: &PublishedTable,
        stream: Stream,
    ) -> Result<()> {
        let ddl = match stream.row_filter() {
            Some(f) => format!("ALTER PUBLICATION {{p}} SET TABLE {{t}} WHERE {f}"),
            None => "ALTER PUBLICATION {p} ADD TABLE {t}".into(),
        };
        self.publication_ddl(publication, table, &ddl).await
    }

    /// Runs `ddl` with `{p}` replaced by `publication`, a name
    /// [`crate::config::check_identifier`] accepts (so it needs no
    /// quoting), and `{t}` by `table` (quoted); `duplicate_object` (another
    /// relay raced it, or the table is in it already) is not an error.
    async fn publication_ddl(&self, publication: &str, table: &PublishedTable, ddl: &str) -> Result<()> {
        bounded(async move {
            crate::config::check_identifier("publication", publication).map_err(|_| Error::InvalidInput {
                field: "publication",
                reason: "use 1 to 63 lowercase letters, digits and '_'".into(),
            })?;
            let ddl = ddl.replace("{p}", publication).replace("{t}", &table.quoted());
            match sqlx::query(&ddl).execute(self.pg()?).await {
                Ok(_) => Ok(()),
                Err(e) if sqlstate(&e).as_deref() == Some("42710") => Ok(()), // duplicate_object
                Err(e) => Err(e.into()),
            }
        })
        .await
    }

    /// Whether slot `slot`'s record was reset for a making and never given
    /// the table read's bound: its maker died between creating the slot and
    /// recording the bound (or met a slot made without the making lock). Read without
    /// the making lock, so a live maker can be seen in that state too;
    /// [`Self::remake_unbound_wal_slot`] checks again under the lock.
    pub async fn wal_slot_unbound(&self, slot: &str) -> Result<bool> {
        bounded(async move {
            Ok(sqlx::query_scalar(Q.wal_slot_unbound)
                .bind(slot)
                .fetch_one(self.pg()?)
                .await?)
        })
        .await
    }

    /// How many times slot `slot` was made by this relay group (each making
    /// raises it); `None` before the first.
    pub async fn wal_slot_generation(&self, slot: &str) -> Result<Option<i64>> {
        bounded(async move {
            Ok(sqlx::query_scalar(Q.wal_slot_generation)
                .bind(slot)
                .fetch_optional(self.pg()?)
                .await?)
        })
        .await
    }

    /// Slot `slot`, if it exists.
    pub async fn wal_slot(&self, slot: &str) -> Result<Option<SlotState>> {
        bounded(async move { Ok(sqlx::query_as(Q.wal_slot).bind(slot).fetch_optional(self.pg()?).await?) }).await
    }

    /// Creates logical slot `slot` (pgoutput), first flagging that the rows
    /// already committed must be read from the table once, and then
    /// recording the highest id committed before it (the table read's
    /// bound). Relays make a slot one at a time (a session advisory lock,
    /// on a connection closed at the end, never handed back to the pool):
    /// one that waited finds the slot made and changes nothing. Had it reset
    /// the record after the maker's bound, the table read would have no
    /// bound and would publish rows committed after the slot, which the
    /// stream carries in commit order, in id order. Creation waits for
    /// every transaction running when it starts to end; when `stop` comes
    /// first (while waiting for the lock too), the session is ended (a slot
    /// whose creator ends is not made) and `false` is returned.
    ///
    /// With `failover` (PostgreSQL 17+), the slot is a failover slot.
    pub async fn create_wal_slot(&self, slot: &str, failover: bool, stop: impl Future<Output = ()>) -> Result<bool> {
        self.make_wal_slot(slot, failover, Making::Create, stop).await
    }

    /// Drops slot `slot` and makes it anew when its maker died between
    /// creating it and recording the table read's bound
    /// ([`Self::wal_slot_unbound`], checked again under the making lock):
    /// read without a bound, the table would publish rows committed after
    /// the slot in id order. Only when no relay is making it (the lock is
    /// free: a live maker's record is unbound until it records the bound;
    /// its session's [`Self::wal_catch_up`] waits for that, bounded) and no
    /// session streams from it. `true` when the slot is there for a
    /// session, made anew or left as it was; `false` as for
    /// [`Self::create_wal_slot`]. Never for a Debezium-layout capture,
    /// which does not read the table: making its slot anew would skip what
    /// committed since.
    pub async fn remake_unbound_wal_slot(
        &self,
        slot: &str,
        failover: bool,
        stop: impl Future<Output = ()>,
    ) -> Result<bool> {
        self.make_wal_slot(slot, failover, Making::RemakeUnbound, stop).await
    }

    async fn make_wal_slot(
        &self,
        slot: &str,
        failover: bool,
        making: Making,
        stop: impl Future<Output = ()>,
    ) -> Result<bool> {
        let pool = self.pg()?;
        let mut maker = pool.acquire().await?;
        // Never handed back to the pool, however this ends (a caller
        // dropping this future included): the lock goes with the session.
        maker.close_on_drop();
        sqlx::query(Q.wal_slot_maker_idle_limit).execute(&mut *maker).await?;
        let pid: i32 = sqlx::query_scalar(Q.wal_session_pid).fetch_one(&mut *maker).await?;
        tokio::pin!(stop);
        let locked = match making {
            Making::Create => tokio::select! {
                locked = sqlx::query(Q.wal_slot_make_lock).bind(slot).execute(&mut *maker) => Some(locked.map(|_| true)),
                _ = &mut stop => None,
            },
            Making::RemakeUnbound => Some(
                sqlx::query_scalar(Q.wal_slot_try_make_lock)
                    .bind(slot)
                    .fetch_one(&mut *maker)
                    .await,
            ),
        };
        match locked {
            Some(Ok(true)) => {}
            // Held: by a relay making it (its bound comes), or by a reader
            // of the record or a maker that will keep the slot (then the
            // session's catch-up read finds it still unbound, and the next
            // session, after a backoff, tries again).
            Some(Ok(false)) => return Ok(true),
            Some(Err(e)) => return Err(e.into()),
            None => {
                drop(maker);
                sqlx::query(Q.wal_end_session).bind(pid).execute(pool).await?;
                return Ok(false);
            }
        }
        let made = async {
            let exists: bool = sqlx::query_scalar(Q.wal_slot_exists)
                .bind(slot)
                .fetch_one(&mut *maker)
                .await?;
            if exists {
                let unbound = making == Making::RemakeUnbound
                    && sqlx::query_scalar(Q.wal_slot_unbound)
                        .bind(slot)
                        .fetch_one(&mut *maker)
                        .await?;
                if !unbound {
                    return Ok::<_, sqlx::Error>(Some(true));
                }
                match sqlx::query(Q.wal_drop_slot).bind(slot).execute(&mut *maker).await {
                    Ok(_) => tracing::warn!(%slot, "the slot's maker stopped before recording the table read's bound; making it anew"),
                    Err(e) if sqlstate(&e).as_deref() == Some("42704") => {} // dropped meanwhile
                    // A session streams from it (an older relay): it is
                    // left to that session.
                    Err(e) if sqlstate(&e).as_deref() == Some("55006") => return Ok(Some(true)),
                    Err(e) => return Err(e),
                }
            }
            let generation: i64 = sqlx::query_scalar(Q.wal_slot_needs_catch_up)
                .bind(slot)
                .bind(self.ferry().clock().param())
                .fetch_one(&mut *maker)
                .await?;
            let created = tokio::select! {
                created = sqlx::query(if failover { CREATE_FAILOVER_SLOT } else { Q.wal_create_slot })
                    .bind(slot)
                    .fetch_one(&mut *maker) => Some(created),
                _ = &mut stop => None,
            };
            match created {
                None => return Ok(None),
                Some(Ok(_)) => {}
                // Made by someone who does not take the lock (an older relay,
                // an operator): its bound is unknown. The record stays
                // unbound, so the session's catch-up read sees it and the
                // slot is made anew under the lock.
                Some(Err(e)) if sqlstate(&e).as_deref() == Some("42710") => return Ok(Some(true)),
                Some(Err(e)) => return Err(e),
            }
            sqlx::query(Q.wal_slot_catch_up_bound)
                .bind(slot)
                .bind(generation)
                .execute(&mut *maker)
                .await?;
            Ok(Some(true))
        }
        .await;
        // Closing the session releases the lock.
        drop(maker);
        match made {
            Ok(Some(made)) => Ok(made),
            Ok(None) => {
                // The server goes on making the slot whatever this side
                // drops: end the session.
                sqlx::query(Q.wal_end_session).bind(pid).execute(pool).await?;
                Ok(false)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Drops slot `slot`; `false` when a session streams from it (55006,
    /// object_in_use). A slot already gone counts as dropped.
    pub async fn drop_wal_slot(&self, slot: &str) -> Result<bool> {
        bounded(async move {
            match sqlx::query(Q.wal_drop_slot).bind(slot).execute(self.pg()?).await {
                Ok(_) => Ok(true),
                Err(e) if sqlstate(&e).as_deref() == Some("42704") => Ok(true), // undefined_object
                Err(e) if sqlstate(&e).as_deref() == Some("55006") => Ok(false),
                Err(e) => Err(e.into()),
            }
        })
        .await
    }

    /// What is left to read from the table for `slot`: `None` when it was
    /// read once since the slot was created, else the highest id to read
    /// (`i64::MAX` for a slot this relay did not create: reading too much
    /// costs duplicates, and rows committed after the slot in id order) and
    /// the slot's generation, which the read hands back to
    /// [`Self::set_wal_slot_caught_up`]. A slot whose maker never recorded
    /// the bound is [`CatchUp::unbound`]: it is not read but made anew.
    ///
    /// A relay making the slot at that moment is waited for (its lock), so
    /// the bound it records is read, not the reset before it (a table read
    /// without a bound would publish rows committed after the slot in id
    /// order).
    pub async fn wal_catch_up(&self, slot: &str) -> Result<Option<CatchUp>> {
        bounded(async move {
            let mut tx = self.pg()?.begin().await?;
            // Bounded on the server: a client-side timeout would leave the
            // dropped connection waiting for the lock in the pool.
            sqlx::query(Q.wal_slot_made_wait_limit).execute(&mut *tx).await?;
            sqlx::query(Q.wal_slot_made_wait).bind(slot).execute(&mut *tx).await?;
            let found: Option<(bool, Option<i64>, i64)> = sqlx::query_as(Q.wal_slot_catch_up)
                .bind(slot)
                .fetch_optional(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok(match found {
                Some((true, _, _)) => None,
                Some((false, through, generation)) => Some(CatchUp {
                    through: through.unwrap_or(i64::MAX),
                    generation,
                    unbound: through.is_none() && generation > 0,
                }),
                None => Some(CatchUp {
                    through: i64::MAX,
                    generation: 0,
                    unbound: false,
                }),
            })
        })
        .await
    }

    /// Records that the table's rows from before `slot` are published, for
    /// the slot's `generation` read with the bound ([`CatchUp`]); `false`
    /// (nothing recorded) when the slot was made anew since: the rows
    /// committed between the two slots are in no stream this read saw, so
    /// the new slot's session must read the table itself.
    pub async fn set_wal_slot_caught_up(&self, slot: &str, generation: i64) -> Result<bool> {
        bounded(async move {
            let done = sqlx::query(Q.wal_slot_set_caught_up)
                .bind(slot)
                .bind(self.ferry().clock().param())
                .bind(generation)
                .execute(self.pg()?)
                .await?;
            Ok(done.rows_affected() == 1)
        })
        .await
    }

    /// The catch-up read: up to `limit` pending rows above `after` and up
    /// to `through`, in id order.
    pub async fn pending_after(&self, after: i64, through: i64, limit: u32) -> Result<Vec<PendingRow>> {
        self.pending_after_in(Stream::WHOLE, after, through, limit).await
    }

    /// [`Self::pending_after`] for the rows of `stream`'s lanes only.
    pub async fn pending_after_in(
        &self,
        stream: Stream,
        after: i64,
        through: i64,
        limit: u32,
    ) -> Result<Vec<PendingRow>> {
        bounded_by(LONG_STATEMENT_BOUND, async move {
            let rows: Vec<PendingSqlRow> = sqlx::query_as(Q.wal_pending_after)
                .bind(after)
                .bind(i64::from(limit))
                .bind(through)
                .bind(stream.count as i32)
                .bind(stream.index as i32)
                .fetch_all(self.pg()?)
                .await?;
            Ok(Self::pending_rows(rows))
        })
        .await
    }

    /// Records acknowledged rows `ids` as delivered in the ledger
    /// (`outbox_delivered`), in one transaction under the ledger's advisory
    /// lock: the ranges near them are read, the ledger's `cover` says what
    /// to delete and insert, and no outbox row is written. Returns how many
    /// of `ids` were not covered before (a republished
    /// duplicate counts none). A row not visible yet needs no second look:
    /// covering a committed row is correct whether or not it is visible.
    ///
    /// With `marked`, the slot's stream is recorded as marked through that
    /// position in the same transaction ([`Self::wal_set_marked`]).
    pub async fn wal_cover_delivered(&self, ids: &[i64], marked: Option<(&str, u64)>) -> Result<u64> {
        self.wal_cover_runs(&crate::wal::ledger::runs(ids), marked.as_slice())
            .await
    }

    /// [`Self::wal_cover_delivered`] for ids given as sorted, disjoint,
    /// non-adjacent runs `(lo, hi)` (`IdSet::runs`), recording each slot of
    /// `marked` as marked through its position (several with `--streams`:
    /// the streams' marks written together).
    pub async fn wal_cover_runs(&self, runs: &[(i64, i64)], marked: &[(&str, u64)]) -> Result<u64> {
        bounded_by(LONG_STATEMENT_BOUND, async move {
            if runs.is_empty() {
                return Ok(0);
            }
            let mut tx = self.pg()?.begin().await?;
            let now: i64 = sqlx::query_scalar(Q.wal_ledger_lock)
                .bind(self.ferry().clock().param())
                .fetch_one(&mut *tx)
                .await?;
            let (los, his): (Vec<i64>, Vec<i64>) = runs.iter().copied().unzip();
            let near: Vec<crate::wal::ledger::Range> = sqlx::query_as(Q.wal_ledger_near)
                .bind(&los)
                .bind(&his)
                .fetch_all(&mut *tx)
                .await?;
            let change = crate::wal::ledger::cover(runs, &near, now);
            if !change.delete.is_empty() {
                sqlx::query(Q.wal_ledger_delete)
                    .bind(ferry::store::Ids(&change.delete))
                    .execute(&mut *tx)
                    .await?;
            }
            if !change.insert.is_empty() {
                let los: Vec<i64> = change.insert.iter().map(|r| r.lo).collect();
                let his: Vec<i64> = change.insert.iter().map(|r| r.hi).collect();
                let ats: Vec<i64> = change.insert.iter().map(|r| r.delivered_at).collect();
                sqlx::query(Q.wal_ledger_insert)
                    .bind(&los)
                    .bind(&his)
                    .bind(&ats)
                    .execute(&mut *tx)
                    .await?;
            }
            for &(slot, lsn) in marked {
                self.set_marked_in(&mut tx, slot, lsn).await?;
            }
            tx.commit().await?;
            Ok(change.newly_covered)
        })
        .await
    }

    /// The end of the last streamed transaction of `slot` whose rows, and
    /// every earlier streamed transaction's, are marked (0: none yet). A
    /// session skips the streamed transactions it covers, whatever the
    /// slot's confirmed position says.
    ///
    /// A position past the server's current one came from another cluster
    /// (a dump restored beside a slot made by hand, where LSNs start lower):
    /// it is forgotten, never honoured.
    pub async fn wal_marked(&self, slot: &str) -> Result<u64> {
        bounded(async move {
            let (marked, current): (i64, i64) = sqlx::query_as(Q.wal_slot_marked)
                .bind(slot)
                .fetch_one(self.pg()?)
                .await?;
            if marked > current {
                tracing::warn!(
                    slot,
                    marked,
                    current,
                    "the slot's marked position is past the server's WAL (another cluster's); forgotten"
                );
                sqlx::query(Q.wal_slot_forget_marked)
                    .bind(slot)
                    .execute(self.pg()?)
                    .await?;
                return Ok(0);
            }
            Ok(u64::try_from(marked).unwrap_or(0))
        })
        .await
    }

    /// Records that the stream of `slot` is marked through `lsn` (it only
    /// goes up). Only after the marks it stands for are committed.
    pub async fn wal_set_marked(&self, slot: &str, lsn: u64) -> Result<()> {
        bounded(async move {
            let mut conn = self.pg()?.acquire().await?;
            self.set_marked_in(&mut conn, slot, lsn).await
        })
        .await
    }

    async fn set_marked_in(&self, conn: &mut sqlx::PgConnection, slot: &str, lsn: u64) -> Result<()> {
        // A position past i64::MAX is not recorded: skipping less only
        // costs duplicates.
        let Ok(lsn) = i64::try_from(lsn) else { return Ok(()) };
        sqlx::query(Q.wal_slot_set_marked)
            .bind(slot)
            .bind(lsn)
            .bind(self.ferry().clock().param())
            .execute(conn)
            .await?;
        Ok(())
    }

    /// Up to `limit` ledger ranges in `lo` order, from the last one
    /// starting at or below `id` on (the one covering `id`, if any).
    pub async fn wal_ledger_from(&self, id: i64, limit: i64) -> Result<Vec<crate::wal::ledger::Range>> {
        bounded(async move {
            Ok(sqlx::query_as(Q.wal_ledger_from)
                .bind(id)
                .bind(limit)
                .fetch_all(self.pg()?)
                .await?)
        })
        .await
    }

    /// `--delete-on-delivery`: deletes acknowledged rows `ids` in one
    /// statement; returns the ids it deleted (rows no longer pending, or not
    /// visible yet, are left alone).
    pub async fn wal_delete_delivered(&self, ids: &[i64]) -> Result<Vec<i64>> {
        bounded_by(LONG_STATEMENT_BOUND, async move {
            if ids.is_empty() {
                return Ok(Vec::new());
            }
            Ok(sqlx::query_scalar(Q.wal_delete_delivered)
                .bind(ferry::store::Ids(ids))
                .fetch_all(self.pg()?)
                .await?)
        })
        .await
    }

    /// The rows of `ids` visible now, with their state (`pending`,
    /// `delivered`, `dead`) as every reader sees it: a pending row the
    /// ledger covers is `delivered`.
    pub async fn wal_states(&self, ids: &[i64]) -> Result<Vec<(i64, String)>> {
        bounded(async move {
            Ok(sqlx::query_as(Q.wal_states)
                .bind(ferry::store::Ids(ids))
                .fetch_all(self.pg()?)
                .await?)
        })
        .await
    }

    /// Marks row `id`, which Kafka refused alone, dead with `code`.
    pub async fn wal_mark_dead(&self, id: i64, code: &str) -> Result<()> {
        bounded(async move {
            sqlx::query(Q.wal_mark_dead)
                .bind(id)
                .bind(code)
                .execute(self.pg()?)
                .await?;
            Ok(())
        })
        .await
    }

    /// The announced rows `ids` that are still pending, in id order.
    pub async fn pending_ids(&self, ids: &[i64]) -> Result<Vec<PendingRow>> {
        self.pending_ids_in(Stream::WHOLE, ids).await
    }

    /// [`Self::pending_ids`] for the rows of `stream`'s lanes only (every
    /// stream reads a replay's announcement; each publishes its own rows).
    pub async fn pending_ids_in(&self, stream: Stream, ids: &[i64]) -> Result<Vec<PendingRow>> {
        bounded(async move {
            let rows: Vec<PendingSqlRow> = sqlx::query_as(Q.wal_pending_ids)
                .bind(ferry::store::Ids(ids))
                .bind(stream.count as i32)
                .bind(stream.index as i32)
                .fetch_all(self.pg()?)
                .await?;
            Ok(Self::pending_rows(rows))
        })
        .await
    }

    /// A trivial statement on a connection of its own, opened for it and
    /// closed: answered when PostgreSQL and the network to it are alive
    /// (the probe of a session waiting on a statement of its own, whose
    /// bound is long). Not the pool's: a pool whose connections are all
    /// busy with long statements of a healthy server (many streams reading
    /// their tables at once) is no evidence of a dead one.
    pub async fn wal_answers(&self) -> Result<()> {
        use sqlx::Connection;
        let mut conn = sqlx::PgConnection::connect_with(&self.pg()?.connect_options()).await?;
        sqlx::query("SELECT 1").execute(&mut conn).await?;
        let _ = conn.close().await;
        Ok(())
    }

    /// Sends a ping through the WAL: a non-transactional logical message
    /// with prefix `prefix`, streamed to every slot of the database.
    /// Returns the ping's position.
    pub async fn wal_ping(&self, prefix: &str) -> Result<i64> {
        bounded(async move {
            Ok(sqlx::query_scalar(Q.wal_ping)
                .bind(prefix)
                .fetch_one(self.pg()?)
                .await?)
        })
        .await
    }

    /// How far this relay's walsender (the one streaming `slot` for
    /// `application_name`) has read the WAL (-1 when the server does not
    /// show it to this role); `None` when the server has no such session.
    pub async fn wal_own_sent(&self, slot: &str, application_name: &str) -> Result<Option<i64>> {
        bounded(async move {
            Ok(sqlx::query_scalar(Q.wal_own_sent)
                .bind(slot)
                .bind(application_name)
                .fetch_optional(self.pg()?)
                .await?
                .flatten())
        })
        .await
    }

    /// Ends the walsender that holds `slot` for `application_name` (this
    /// relay's own earlier session, gone silent); whether one was ended.
    pub async fn wal_end_own_walsender(&self, slot: &str, application_name: &str) -> Result<bool> {
        bounded(async move {
            let ended: Vec<bool> = sqlx::query_scalar(Q.wal_end_own_walsender)
                .bind(slot)
                .bind(application_name)
                .fetch_all(self.pg()?)
                .await?;
            Ok(ended.into_iter().any(|e| e))
        })
        .await
    }

    /// Records a failed publish of row `id` (attempt count and code).
    pub async fn wal_note_publish_error(&self, id: i64, code: &str) -> Result<()> {
        bounded(async move {
            sqlx::query(Q.wal_note_publish_error)
                .bind(id)
                .bind(code)
                .execute(self.pg()?)
                .await?;
            Ok(())
        })
        .await
    }
}

/// The SQLSTATE of a database error.
fn sqlstate(e: &sqlx::Error) -> Option<String> {
    e.as_database_error()?.code().map(|c| c.into_owned())
}

#[cfg(test)]
mod tests {
    use super::Q;
    use crate::service::{connect, IDLE_IN_TRANSACTION_LIMIT};
    use crate::store::RelayStore;

    /// A relay frozen inside the ledger's transaction, right after taking
    /// its lock (SIGSTOP, a paused VM), held the lock for as long as it
    /// stayed frozen, and every other relay's marks waited on it: CI saw a
    /// standby that took the slot over deliver nothing for 120 s. The
    /// relay's sessions end after [`IDLE_IN_TRANSACTION_LIMIT`] idle in a
    /// transaction, so another relay's mark goes through, and the frozen
    /// relay finds its transaction gone when it thaws.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_relay_frozen_holding_the_ledger_lock_does_not_stop_other_marks() {
        let t = ferry_testkit::TestDb::new(ferry::Engine::Postgres).await;
        let frozen = connect(&t.url).await.unwrap();
        let mut tx = frozen.db().as_postgres().unwrap().begin().await.unwrap();
        let _: i64 = sqlx::query_scalar(Q.wal_ledger_lock)
            .bind(None::<i64>)
            .fetch_one(&mut *tx)
            .await
            .unwrap();

        let other = RelayStore::new(t.ferry.clone());
        let covered = tokio::time::timeout(6 * IDLE_IN_TRANSACTION_LIMIT, other.wal_cover_delivered(&[1, 2], None))
            .await
            .expect("a mark waited on a frozen relay's lock")
            .unwrap();
        assert_eq!(covered, 2);
        let thawed = sqlx::query("SELECT 1").execute(&mut *tx).await;
        assert!(thawed.is_err(), "the frozen relay's transaction outlived the limit");
    }
}
