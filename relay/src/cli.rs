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

/// Logs to stderr, filtered by `RUST_LOG` (default `default_level`).
pub fn init_tracing(default_level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default_level.into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
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
    }
}
