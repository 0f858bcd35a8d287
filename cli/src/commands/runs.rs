//! `ferry runs list|show`: runs page by page (keyset cursors), and one
//! run's lineage.

use ferry::Ferry;

use super::{opt, DbArgs};
use crate::error::CliError;

/// `runs` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum RunsCommand {
    /// List runs, newest first, one page at a time; prints the cursor of the next page.
    List {
        /// Database.
        #[command(flatten)]
        db: DbArgs,
        /// Only this tenant (default: every tenant).
        #[arg(long)]
        tenant: Option<String>,
        /// Only runs in this state (queued, succeeded, failed, cancelled).
        #[arg(long)]
        state: Option<ferry::RunState>,
        /// Only runs on this queue.
        #[arg(long)]
        queue: Option<String>,
        /// Only runs of this operation.
        #[arg(long)]
        operation: Option<String>,
        /// Only runs accepted at or after this instant (epoch milliseconds).
        #[arg(long)]
        since_ms: Option<i64>,
        /// Only runs accepted before this instant (epoch milliseconds).
        #[arg(long)]
        before_ms: Option<i64>,
        /// Page size (1 to 1000).
        #[arg(long, default_value_t = 50)]
        limit: u32,
        /// The cursor a previous page printed.
        #[arg(long)]
        cursor: Option<ferry::RunCursor>,
    },
    /// Show a run's lineage: events, attempts, effects, outbox rows and child runs.
    Show {
        /// Database.
        #[command(flatten)]
        db: DbArgs,
        /// Tenant.
        #[arg(long)]
        tenant: String,
        /// Run id.
        run: uuid::Uuid,
    },
}

/// Runs a `runs` subcommand.
pub(super) async fn run(command: RunsCommand) -> Result<(), CliError> {
    match command {
        RunsCommand::List {
            db,
            tenant,
            state,
            queue,
            operation,
            since_ms,
            before_ms,
            limit,
            cursor,
        } => {
            let ferry = Ferry::builder(&db.database_url).connect().await?;
            let filter = ferry::RunFilter {
                tenant,
                state,
                queue,
                operation,
                created_from: millis(since_ms)?,
                created_before: millis(before_ms)?,
            };
            let page = ferry.operator().list_runs(&filter, cursor.as_ref(), limit).await?;
            for r in &page.runs {
                println!(
                    "{}  {:<12} {:<16} {:<10} {:<9} job {:<9} attempts {}/{}  created {}  scheduled {}  parent {}  {}",
                    r.run_id,
                    r.tenant,
                    r.operation,
                    r.queue,
                    r.state,
                    r.job_state,
                    r.attempts,
                    r.max_attempts,
                    r.created_at.get(),
                    opt(&r.scheduled_at.map(|m| m.get())),
                    opt(&r.parent_run_id),
                    r.last_error_code.as_deref().unwrap_or("")
                );
            }
            match page.next {
                Some(next) => println!("next page: --cursor {next}"),
                None => println!("({} runs, last page)", page.runs.len()),
            }
        }
        RunsCommand::Show { db, tenant, run } => {
            let ferry = Ferry::builder(&db.database_url).connect().await?;
            let l = ferry.operator().run_lineage(&tenant, run).await?;
            let r = &l.run;
            println!(
                "run {} {} {} version {} queue {} job {} attempts {}/{}",
                r.run_id,
                r.operation,
                r.state,
                r.version,
                l.summary.queue,
                l.summary.job_state,
                l.summary.attempts,
                l.summary.max_attempts
            );
            println!(
                "  created {}  scheduled {}  deadline {}  parent {}  replay of {}",
                r.created_at.get(),
                opt(&r.scheduled_at.map(|m| m.get())),
                opt(&r.deadline_at.map(|m| m.get())),
                opt(&r.parent_run_id),
                opt(&r.replay_of)
            );
            for e in &l.events {
                println!(
                    "  event {:>3} {:<18} at {} {}",
                    e.seq,
                    e.kind,
                    e.created_at.get(),
                    e.body
                );
            }
            for a in &l.attempts {
                println!(
                    "  attempt {} gen {} {} claimed {} {} {}",
                    a.attempt,
                    a.generation,
                    a.worker,
                    a.claimed_at.get(),
                    a.outcome.map_or("running", |o| o.as_str()),
                    a.error_code.as_deref().unwrap_or("")
                );
            }
            for e in &l.effects {
                println!(
                    "  effect {}/{} {:?} gen {} ref {}",
                    e.step,
                    e.operation,
                    e.state,
                    e.generation,
                    opt(&e.provider_ref)
                );
            }
            for o in &l.outbox {
                println!(
                    "  outbox {} {} key {} {} attempts {} delivered {} {}",
                    o.id,
                    o.topic,
                    o.key,
                    o.state,
                    o.publish_attempts,
                    opt(&o.delivered_at.map(|m| m.get())),
                    o.last_error.as_deref().unwrap_or("")
                );
            }
            for c in &l.children {
                println!("  child {} {} {}", c.run_id, c.operation, c.state);
            }
        }
    }
    Ok(())
}

/// Epoch milliseconds from the command line as an instant (`invalid_input`
/// when out of range).
pub(super) fn millis(ms: Option<i64>) -> Result<Option<ferry::Millis>, CliError> {
    Ok(ms.map(ferry::Millis::new).transpose()?)
}
