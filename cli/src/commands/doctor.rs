//! `ferry doctor`: runs the failure investigations ([`crate::doctor`]), the
//! jobs' side and the relay's, and prints their findings with actions and
//! runbook links.

use ferry::Ferry;

use super::DbArgs;
use crate::doctor::RelayThresholds;
use crate::error::CliError;

/// `ferry doctor`.
#[derive(Debug, clap::Args)]
pub struct DoctorArgs {
    /// Database.
    #[command(flatten)]
    pub db: DbArgs,
    /// How long past expiry a lease may sit before it counts as stuck.
    #[arg(long, value_parser = ferry::time::parse_duration, default_value = "5m")]
    pub stuck_after: std::time::Duration,
    /// How long the oldest pending outbox row may wait before
    /// `outbox_backlog_old` warns (a live relay publishes within
    /// milliseconds; the alert waits 5 minutes).
    #[arg(long, value_parser = ferry::time::parse_duration, default_value = "60s")]
    pub pending_age: std::time::Duration,
    /// Exit non-zero when a warning or critical finding has items.
    #[arg(long)]
    pub strict: bool,
    /// WAL a capture slot may hold back, in bytes, before `wal_slot_lag`
    /// warns (the bound of the `FerryWalSlotLagBytes` alert).
    #[arg(long, alias = "inactive-slot-lag-bytes", default_value_t = 1 << 30)]
    pub slot_lag_bytes: i64,
    /// How long the oldest row not yet delivered through a capture slot may
    /// wait before `wal_slot_lag` warns (the bound of the
    /// `FerryWalSlotLagSeconds` alert).
    #[arg(long, value_parser = ferry::time::parse_duration, default_value = "5m")]
    pub slot_lag: std::time::Duration,
}

/// Runs the investigations and prints their findings: `[ok]`, `[skip]`
/// with why the check cannot apply here, or the severity with the items,
/// the action and the runbook section.
pub(super) async fn run(args: DoctorArgs) -> Result<(), CliError> {
    let DoctorArgs {
        db,
        stuck_after,
        pending_age,
        strict,
        slot_lag_bytes,
        slot_lag,
    } = args;
    let thresholds = RelayThresholds {
        pending_age,
        slot_lag_bytes,
        slot_lag,
    };
    // First, before Ferry prepares a statement: through a pooler in
    // transaction mode that the URL does not declare (`pgbouncer=true`),
    // the other checks' own statements can fail or reach another client's
    // session, so they are not run.
    let mut findings = vec![crate::doctor::transaction_pooler(&db.database_url).await?];
    if !findings[0].is_problem() {
        let ferry = Ferry::builder(&db.database_url).connect().await?;
        findings.extend(crate::doctor::run(&ferry, stuck_after, 20).await?);
        findings.extend(crate::doctor::relay(&ferry, &thresholds, 20).await?);
    }
    let mut bad = 0;
    for f in &findings {
        match f.skipped {
            Some(why) => println!("[skip] {}: {why}", f.check),
            None => println!("[{}] {}", f.status(), f.check),
        }
        for item in &f.items {
            println!("    {item}");
        }
        if f.is_problem() {
            bad += 1;
            println!("    action: {}", f.action);
            if let Some(runbook) = f.runbook {
                println!("    runbook: {runbook}");
            }
        }
    }
    if strict && bad > 0 {
        return Err(CliError::DoctorFindings(bad));
    }
    Ok(())
}
