//! `ferry dead list|replay`: the outbox rows the relay gave up on, listed
//! without payloads, and put back to pending with an audit entry.

use ferry::Ferry;

use super::DbArgs;
use crate::error::CliError;

/// `dead` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum DeadCommand {
    /// List dead rows (no payloads).
    List {
        /// Database.
        #[command(flatten)]
        db: DbArgs,
        /// How many.
        #[arg(long, default_value_t = 100)]
        limit: u32,
    },
    /// Put dead rows back to pending, with an audit entry.
    Replay {
        /// Database.
        #[command(flatten)]
        db: DbArgs,
        /// Only this outbox id (default: every dead row).
        #[arg(long)]
        id: Option<i64>,
        /// Who asks.
        #[arg(long, env = "USER")]
        actor: String,
        /// Why.
        #[arg(long)]
        reason: String,
    },
}

/// Runs a `dead` subcommand.
pub(super) async fn run(command: DeadCommand) -> Result<(), CliError> {
    match command {
        DeadCommand::List { db, limit } => {
            let ferry = Ferry::builder(&db.database_url).connect().await?;
            for r in ferry.operator().list_dead_outbox(limit).await? {
                println!(
                    "{:>10}  {:<12} {:<24} {:<24} {}  attempts={}",
                    r.id,
                    r.tenant,
                    r.topic,
                    r.key,
                    r.last_error.as_deref().unwrap_or("-"),
                    r.publish_attempts
                );
            }
            Ok(())
        }
        DeadCommand::Replay { db, id, actor, reason } => {
            let ferry = Ferry::builder(&db.database_url).connect().await?;
            let ids = ferry.operator().replay_dead_outbox(id, &actor, &reason).await?;
            println!("{} rows back to pending", ids.len());
            Ok(())
        }
    }
}
