//! One record's or one micro-batch's transaction: check the partition lease
//! at our generation, insert the ledger rows (a duplicate skips the
//! handler), run the handlers' writes, store `next_offset = last offset + 1`,
//! commit.

use crate::store::ConsumerStore;
use crate::store::{LedgerEntry, PartitionLease};

use crate::error::HandlerError;
use crate::record::{Handler, Record};

/// How a record's transaction ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Processed {
    /// The handler's effects committed with the offset.
    Applied,
    /// The ledger already had the effect key: only the offset moved.
    Duplicate,
    /// Recorded as dead-lettered (no handler effects), offset moved.
    DeadLettered,
}

/// Why a record's transaction did not commit (nothing of it was written,
/// unless a commit whose outcome is unknown did commit: the ledger row then
/// makes the next attempt a duplicate).
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    /// The partition lease is no longer ours: stop processing that partition.
    #[error("{0}")]
    LostLease(ferry::Error),
    /// The handler failed; its [`HandlerError::class`] says what follows
    /// (a database error it met is classified by
    /// [`classify`](crate::error::classify)).
    #[error("{0}")]
    Handler(HandlerError),
    /// One of the consumer's own steps failed (taking a connection, `BEGIN`,
    /// the partition lock, the ledger rows, the offset, the commit).
    /// [`classify`](crate::error::classify) says whose fault it is: nearly always the
    /// infrastructure's; the record's only when its own data was refused (a
    /// deferred constraint of the handler's writes, checked at commit).
    #[error("{0}")]
    Database(ferry::Error),
}

impl From<ferry::Error> for ProcessError {
    fn from(e: ferry::Error) -> Self {
        if matches!(
            e,
            ferry::Error::LostLease { .. } | ferry::Error::LostLane { .. } | ferry::Error::LostPartition { .. }
        ) {
            ProcessError::LostLease(e)
        } else {
            ProcessError::Database(e)
        }
    }
}

/// Processes `record` under `lease` in one transaction.
pub async fn process_record(
    store: &ConsumerStore,
    lease: &PartitionLease,
    record: &Record,
    effect_key: &str,
    handler: &dyn Handler,
) -> Result<Processed, ProcessError> {
    let mut tx = store.begin().await?;
    let entry = match store
        .begin_record(tx.conn(), lease, effect_key, record.offset, "applied")
        .await
    {
        Ok(e) => e,
        Err(e) => {
            let _ = tx.rollback().await;
            return Err(e.into());
        }
    };
    let outcome = match entry {
        LedgerEntry::Duplicate => Processed::Duplicate,
        LedgerEntry::New => {
            if let Err(h) = handler.handle(record, &mut tx).await {
                let _ = tx.rollback().await;
                return Err(ProcessError::Handler(h));
            }
            Processed::Applied
        }
    };
    if let Err(e) = store.advance_offset(tx.conn(), lease, record.offset + 1).await {
        let _ = tx.rollback().await;
        return Err(e.into());
    }
    tx.commit().await?;
    Ok(outcome)
}

/// Records a dead-lettered record in the ledger and moves the offset, under the lease.
pub async fn record_dead_letter(
    store: &ConsumerStore,
    lease: &PartitionLease,
    record: &Record,
    effect_key: &str,
) -> Result<Processed, ProcessError> {
    let mut tx = store.begin().await?;
    let r = async {
        store
            .begin_record(tx.conn(), lease, effect_key, record.offset, "dead_lettered")
            .await?;
        store.advance_offset(tx.conn(), lease, record.offset + 1).await
    }
    .await;
    match r {
        Ok(()) => {
            tx.commit().await?;
            Ok(Processed::DeadLettered)
        }
        Err(e) => {
            let _ = tx.rollback().await;
            Err(e.into())
        }
    }
}

/// Why a micro-batch did not commit ([`process_batch`]): nothing of it was
/// written (unless a commit whose outcome is unknown did commit, as for
/// [`ProcessError`]).
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct BatchError {
    /// What failed (its message is this error's).
    pub error: ProcessError,
    /// The record the batch stopped at (its handler failed), by index: the
    /// records before it ran without an error. `None` when it failed before
    /// its first handler (a connection, `BEGIN`, the partition lock, the
    /// batch's ledger rows) or after its last (the offset, the commit).
    pub at: Option<usize>,
}

/// Whether an effect key may go in a micro-batch's single ledger statement
/// of `group`. A key the database refuses (a NUL byte, which PostgreSQL's
/// text cannot hold, or one too long for the ledger's primary-key index,
/// whose entries stop at 2,704 bytes with the group id and their headers)
/// would fail the statement for the whole batch, with no record to blame;
/// such a record goes alone, where the refusal is its own.
pub fn batchable_key(group: &str, key: &str) -> bool {
    /// The group id and the key together, below the index's entry limit
    /// with room for the entry's headers.
    const MAX_BATCHED_LEDGER_KEY_BYTES: usize = 2600;
    group.len() + key.len() <= MAX_BATCHED_LEDGER_KEY_BYTES && !key.contains('\0')
}

/// Processes consecutive records of one partition in one transaction (a
/// micro-batch): the lease is checked and the ledger rows of all records
/// inserted in one statement each, then each new record's handler runs in
/// order (duplicates skipped), and the offset after the last record is
/// stored, all committed together. Any failure rolls the whole batch back
/// (nothing of it is written) and says which record it stopped at, if any:
/// the caller can then batch the records before it again, isolate that one,
/// and batch the rest. Every key must pass [`batchable_key`] for `lease`'s
/// group: one that does not may fail the batch's ledger statement, which
/// blames no record (`at` is `None`).
pub async fn process_batch(
    store: &ConsumerStore,
    lease: &PartitionLease,
    records: &[(&Record, String)],
    handler: &dyn Handler,
) -> Result<Vec<Processed>, BatchError> {
    let Some((last, _)) = records.last() else {
        return Ok(Vec::new());
    };
    let outside = |e: ferry::Error| BatchError {
        error: e.into(),
        at: None,
    };
    let mut tx = store.begin().await.map_err(outside)?;
    // The lock and the ledger rows are taken once for the whole batch: an
    // error there is no record's (`at` stays `None`).
    let entries = async {
        store.lock_partition(tx.conn(), lease).await?;
        let keyed: Vec<(&str, i64)> = records.iter().map(|(r, k)| (k.as_str(), r.offset)).collect();
        store.insert_ledger_batch(tx.conn(), lease, &keyed).await
    }
    .await;
    let entries = match entries {
        Ok(entries) => entries,
        Err(e) => {
            let _ = tx.rollback().await;
            return Err(outside(e));
        }
    };
    let mut out = Vec::with_capacity(records.len());
    let result: Result<(), ProcessError> = async {
        for ((record, _), entry) in records.iter().zip(entries) {
            match entry {
                LedgerEntry::Duplicate => out.push(Processed::Duplicate),
                LedgerEntry::New => {
                    handler.handle(record, &mut tx).await.map_err(ProcessError::Handler)?;
                    out.push(Processed::Applied);
                }
            }
        }
        Ok(())
    }
    .await;
    // Every record before `out.len()` ran without an error.
    let at = (out.len() < records.len()).then_some(out.len());
    let result = match result {
        Ok(()) => store
            .advance_offset(tx.conn(), lease, last.offset + 1)
            .await
            .map_err(ProcessError::from),
        Err(e) => Err(e),
    };
    match result {
        Ok(()) => {
            tx.commit().await.map_err(outside)?;
            Ok(out)
        }
        Err(error) => {
            let _ = tx.rollback().await;
            Err(BatchError { error, at })
        }
    }
}
