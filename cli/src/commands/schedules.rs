//! `ferry schedules list|remove`: periodic schedules, removed with an
//! audit entry.

use ferry::Ferry;

use super::{opt, DbArgs};
use crate::error::CliError;

/// `schedules` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum SchedulesCommand {
    /// List schedules with their last and next tick.
    List {
        /// Database.
        #[command(flatten)]
        db: DbArgs,
        /// Only this tenant (default: every tenant).
        #[arg(long)]
        tenant: Option<String>,
    },
    /// Drop a schedule (its runs stay), with an audit entry.
    Remove {
        /// Database.
        #[command(flatten)]
        db: DbArgs,
        /// Tenant.
        #[arg(long)]
        tenant: String,
        /// Schedule name.
        name: String,
        /// Who asks.
        #[arg(long, env = "USER")]
        actor: String,
        /// Why.
        #[arg(long)]
        reason: String,
    },
}

/// Runs a `schedules` subcommand.
pub(super) async fn run(command: SchedulesCommand) -> Result<(), CliError> {
    match command {
        SchedulesCommand::List { db, tenant } => {
            let ferry = Ferry::builder(&db.database_url).connect().await?;
            for s in ferry.operator().list_schedules(tenant.as_deref()).await? {
                println!(
                    "{:<12} {:<20} {:<22} {:<16} queue {:<10} missed {:?}  last {}  next {}",
                    s.tenant,
                    s.name,
                    s.every.to_string(),
                    s.operation,
                    s.queue,
                    s.missed,
                    opt(&s.last_tick.map(|m| m.get())),
                    s.next_tick.get()
                );
            }
        }
        SchedulesCommand::Remove {
            db,
            tenant,
            name,
            actor,
            reason,
        } => {
            let ferry = Ferry::builder(&db.database_url).connect().await?;
            if ferry.operator().unschedule(&tenant, &name, &actor, &reason).await? {
                println!("removed {tenant}/{name}");
            } else {
                println!("no schedule {tenant}/{name}");
            }
        }
    }
    Ok(())
}
