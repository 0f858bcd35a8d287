//! `ferry jobs list|inspect|cancel|replay-dead`: a tenant's jobs, one run's
//! history, and the audited repairs.

use ferry::Ferry;

use super::DbArgs;
use crate::error::CliError;

/// `jobs` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum JobsCommand {
    /// List a tenant's jobs, newest first.
    List {
        /// Database.
        #[command(flatten)]
        db: DbArgs,
        /// Tenant.
        #[arg(long)]
        tenant: String,
        /// Only this state.
        #[arg(long)]
        state: Option<ferry::JobState>,
        /// How many.
        #[arg(long, default_value_t = 50)]
        limit: u32,
    },
    /// Show a run with its events, attempts and job.
    Inspect {
        /// Database.
        #[command(flatten)]
        db: DbArgs,
        /// Tenant.
        #[arg(long)]
        tenant: String,
        /// Run id.
        #[arg(long)]
        run: uuid::Uuid,
    },
    /// Cancel a run (compare-and-set; refused if it already ended).
    Cancel {
        /// Database.
        #[command(flatten)]
        db: DbArgs,
        /// Tenant.
        #[arg(long)]
        tenant: String,
        /// Run id.
        #[arg(long)]
        run: uuid::Uuid,
        /// Who asks.
        #[arg(long, env = "USER")]
        actor: String,
        /// Why.
        #[arg(long)]
        reason: String,
    },
    /// Replay a dead run as a new linked run.
    ReplayDead {
        /// Database.
        #[command(flatten)]
        db: DbArgs,
        /// Tenant.
        #[arg(long)]
        tenant: String,
        /// The dead run.
        #[arg(long)]
        run: uuid::Uuid,
        /// Who asks.
        #[arg(long, env = "USER")]
        actor: String,
        /// Why.
        #[arg(long)]
        reason: String,
        /// Replay even if it was replayed before.
        #[arg(long)]
        force: bool,
    },
}

/// Runs a `jobs` subcommand.
pub(super) async fn run(command: JobsCommand) -> Result<(), CliError> {
    match command {
        JobsCommand::List {
            db,
            tenant,
            state,
            limit,
        } => {
            let ferry = Ferry::builder(&db.database_url).connect().await?;
            for j in ferry.operator().list_jobs(&tenant, state, limit).await? {
                println!(
                    "{}  {:<10} {:<12} attempts {}/{}  {}",
                    j.run_id,
                    j.queue,
                    j.state,
                    j.attempts,
                    j.max_attempts,
                    j.last_error_code.as_deref().unwrap_or("")
                );
            }
        }
        JobsCommand::Inspect { db, tenant, run } => {
            let ferry = Ferry::builder(&db.database_url).connect().await?;
            let r = ferry.get_run(&tenant, run).await?;
            println!(
                "run {} {} {} version {}",
                r.run_id,
                r.operation,
                r.state.as_str(),
                r.version
            );
            for e in ferry.list_events(&tenant, run).await? {
                println!("  event {:>3} {:<18} {}", e.seq, e.kind, e.body);
            }
            for a in ferry.operator().list_attempts(&tenant, run).await? {
                println!(
                    "  attempt {} gen {} {} {} {}",
                    a.attempt,
                    a.generation,
                    a.worker,
                    a.outcome.map_or("running", |o| o.as_str()),
                    a.error_code.as_deref().unwrap_or("")
                );
            }
        }
        JobsCommand::Cancel {
            db,
            tenant,
            run,
            actor,
            reason,
        } => {
            let ferry = Ferry::builder(&db.database_url).connect().await?;
            ferry.operator().cancel_audited(&tenant, run, &actor, &reason).await?;
            println!("cancelled {run}");
        }
        JobsCommand::ReplayDead {
            db,
            tenant,
            run,
            actor,
            reason,
            force,
        } => {
            let ferry = Ferry::builder(&db.database_url).connect().await?;
            let a = ferry
                .operator()
                .replay_dead_audited(&tenant, run, &actor, &reason, force)
                .await?;
            println!("replayed {run} as {}", a.run.run_id);
        }
    }
    Ok(())
}
