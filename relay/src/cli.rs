//! The command line: `run`, `migrate`, `status`, `dead list`, `dead replay`, `demo`.
#![allow(clippy::print_stdout)]

use std::future::Future;

use ferry::Ferry;

use crate::config::RelayConfig;
use crate::error::RelayError;

/// `ferry-relay`.
#[derive(Debug, clap::Parser)]
#[command(
    name = "ferry-relay",
    version,
    about = "Publishes Ferry's transactional outbox to Kafka"
)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Run the relay until SIGTERM or Ctrl-C.
    Run(RelayConfig),
    /// Apply the embedded migrations.
    Migrate(DbArgs),
    /// Print the backlog, dead rows and lane owners.
    Status(DbArgs),
    /// Dead (poison) rows.
    Dead {
        /// What to do with them.
        #[command(subcommand)]
        command: DeadCommand,
    },
    /// Run the whole pipeline on embedded defaults and print a summary.
    Demo(crate::demo::DemoArgs),
    /// Run the failure investigations and print findings with actions.
    Doctor {
        /// Database.
        #[command(flatten)]
        db: DbArgs,
        /// How long past expiry a lease may sit before it counts as stuck.
        #[arg(long, value_parser = crate::config::parse_duration, default_value = "5m")]
        stuck_after: std::time::Duration,
        /// Exit non-zero when a warning or critical finding has items.
        #[arg(long)]
        strict: bool,
    },
    /// Inspect and repair jobs (every change is audited).
    Jobs {
        /// What to do.
        #[command(subcommand)]
        command: JobsCommand,
    },
}

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
        state: Option<String>,
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

/// Just a database.
#[derive(Debug, clap::Args)]
pub struct DbArgs {
    /// Database URL.
    #[arg(long, env = "DATABASE_URL")]
    pub database_url: String,
}

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

/// Resolves on SIGTERM or Ctrl-C.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Runs a parsed command.
pub async fn run(cli: Cli, shutdown: impl Future<Output = ()>) -> Result<(), RelayError> {
    match cli.command {
        Command::Run(cfg) => {
            cfg.validate()?;
            let ferry = Ferry::builder(&cfg.database_url).connect().await?;
            crate::service::run(cfg, ferry, shutdown).await
        }
        Command::Migrate(db) => {
            let pool = ferry::connect(&db.database_url).await?;
            ferry::migrate(&pool).await?;
            println!("migrations applied");
            Ok(())
        }
        Command::Status(db) => {
            let ferry = Ferry::builder(&db.database_url).connect().await?;
            let b = ferry.outbox_backlog().await?;
            println!("pending rows        {}", b.pending);
            println!("oldest pending age  {:.1}s", b.oldest_age_ms() as f64 / 1000.0);
            println!("dead rows           {}", ferry.outbox_dead_count().await?);
            let mut by_owner = std::collections::BTreeMap::<String, Vec<i32>>::new();
            for l in ferry.lane_owners().await? {
                let live = l.lease_expires_at.is_some_and(|e| e > b.now);
                let who = match (&l.owner, live) {
                    (Some(o), true) => o.clone(),
                    _ => "(unowned)".into(),
                };
                by_owner.entry(who).or_default().push(l.lane);
            }
            for (owner, lanes) in by_owner {
                println!("{owner:<40} {} lanes", lanes.len());
            }
            Ok(())
        }
        Command::Dead { command } => match command {
            DeadCommand::List { db, limit } => {
                let ferry = Ferry::builder(&db.database_url).connect().await?;
                for r in ferry.list_dead_outbox(limit).await? {
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
                let ids = ferry.replay_dead_outbox(id, &actor, &reason).await?;
                println!("{} rows back to pending", ids.len());
                Ok(())
            }
        },
        Command::Demo(args) => crate::demo::run(args).await,
        Command::Doctor {
            db,
            stuck_after,
            strict,
        } => {
            let ferry = Ferry::builder(&db.database_url).connect().await?;
            let findings = ferry.doctor(stuck_after, 20).await?;
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
                if !f.items.is_empty() && f.severity != ferry::doctor::Severity::Info {
                    bad += 1;
                    println!("    action: {}", f.action);
                }
            }
            if strict && bad > 0 {
                return Err(RelayError::Lost(format!("{bad} checks found problems")));
            }
            Ok(())
        }
        Command::Jobs { command } => jobs(command).await,
    }
}

async fn jobs(command: JobsCommand) -> Result<(), RelayError> {
    match command {
        JobsCommand::List {
            db,
            tenant,
            state,
            limit,
        } => {
            let ferry = Ferry::builder(&db.database_url).connect().await?;
            for j in ferry.list_jobs(&tenant, state.as_deref(), limit).await? {
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
            for a in ferry.list_attempts(&tenant, run).await? {
                println!(
                    "  attempt {} gen {} {} {} {}",
                    a.attempt,
                    a.generation,
                    a.worker,
                    a.outcome.as_deref().unwrap_or("running"),
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
            let mut tx = ferry.begin().await?;
            let done = async {
                ferry.cancel_in(tx.conn(), &tenant, run, None, &actor, &reason).await?;
                ferry
                    .audit_in(tx.conn(), &actor, "jobs.cancel", &format!("{tenant}/{run}"), &reason)
                    .await
            }
            .await;
            match done {
                Ok(()) => tx.commit().await?,
                Err(e) => {
                    tx.rollback().await?;
                    return Err(e.into());
                }
            }
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
            let mut tx = ferry.begin().await?;
            let done = async {
                let a = ferry
                    .replay_dead_in(tx.conn(), &tenant, run, &actor, &reason, force)
                    .await?;
                ferry
                    .audit_in(
                        tx.conn(),
                        &actor,
                        "jobs.replay_dead",
                        &format!("{tenant}/{run}"),
                        &reason,
                    )
                    .await?;
                Ok::<_, ferry::Error>(a)
            }
            .await;
            match done {
                Ok(a) => {
                    tx.commit().await?;
                    println!("replayed {run} as {}", a.run.run_id);
                }
                Err(e) => {
                    tx.rollback().await?;
                    return Err(e.into());
                }
            }
        }
    }
    Ok(())
}
