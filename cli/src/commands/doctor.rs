//! `ferry doctor`: runs the failure investigations ([`crate::doctor`]) and
//! prints their findings with actions.

use ferry::Ferry;

use super::DbArgs;
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
    /// Exit non-zero when a warning or critical finding has items.
    #[arg(long)]
    pub strict: bool,
    /// WAL an inactive capture slot may hold back, in bytes, before
    /// `wal_slot_inactive_lag` warns.
    #[arg(long, default_value_t = 1 << 30)]
    pub inactive_slot_lag_bytes: i64,
}

/// Runs the investigations and prints their findings.
pub(super) async fn run(args: DoctorArgs) -> Result<(), CliError> {
    let DoctorArgs {
        db,
        stuck_after,
        strict,
        inactive_slot_lag_bytes,
    } = args;
    let ferry = Ferry::builder(&db.database_url).connect().await?;
    let mut findings = crate::doctor::run(&ferry, stuck_after, 20).await?;
    findings.extend(crate::doctor::wal_capture(&ferry, inactive_slot_lag_bytes).await?);
    let mut bad = 0;
    for f in &findings {
        let status = if f.items.is_empty() {
            "ok".to_owned()
        } else {
            format!("{:?}", f.severity).to_lowercase()
        };
        println!("[{status}] {}", f.check);
        for item in &f.items {
            println!("    {item}");
        }
        if !f.items.is_empty() && f.severity != crate::doctor::Severity::Info {
            bad += 1;
            println!("    action: {}", f.action);
        }
    }
    if strict && bad > 0 {
        return Err(CliError::DoctorFindings(bad));
    }
    Ok(())
}
