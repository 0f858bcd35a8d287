//! The sidecar's command line: `run`, plus `migrate` and `status`, which the
//! deployment files call before and beside it. The operator tools (`dead`,
//! `doctor`, `jobs`, `demo`) are in the `ferry` binary (`ferry-cli`).
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
    /// Publish the outbox until SIGTERM.
    Run(Box<RelayConfig>),
    /// Apply the database migrations (the same as `ferry migrate`).
    Migrate(DbArgs),
    /// Backlog, dead rows and lane owners (the same as `ferry status`).
    Status(DbArgs),
}

/// Where the database is.
#[derive(Debug, clap::Args)]
pub struct DbArgs {
    /// `postgres://…` or `sqlite://…`.
    #[arg(long, env = "DATABASE_URL")]
    pub database_url: String,
}

/// Runs a parsed command; `run` stops when `shutdown` resolves.
pub async fn run(cli: Cli, shutdown: impl Future<Output = ()>) -> Result<(), RelayError> {
    match cli.command {
        Command::Run(cfg) => {
            cfg.validate()?;
            let ferry = crate::service::connect(&cfg.database_url).await?;
            crate::service::run(*cfg, ferry, shutdown).await
        }
        Command::Migrate(db) => {
            let pool = ferry::connect(&db.database_url).await?;
            ferry::migrate(&pool).await?;
            println!("migrations applied");
            Ok(())
        }
        Command::Status(db) => {
            let ferry = Ferry::builder(&db.database_url).connect().await?;
            print!("{}", ferry.operator().status_report().await?);
            Ok(())
        }
    }
}
