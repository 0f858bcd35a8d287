//! The `ferry` command line: the top-level parser and the dispatch. Each
//! command is one file of this folder holding its clap arguments and its
//! handler (the demo's are in [`crate::demo`]).
#![allow(clippy::print_stdout)]

mod console;
mod console_token;
mod dead;
mod doctor;
mod jobs;
mod migrate;
mod queue;
mod runs;
mod schedules;
mod status;

pub use console::ConsoleArgs;
pub use console_token::TokenArgs;
pub use dead::DeadCommand;
pub use doctor::DoctorArgs;
pub use jobs::JobsCommand;
pub use queue::{Audited, QueueCommand};
pub use runs::RunsCommand;
pub use schedules::SchedulesCommand;

use crate::error::CliError;

/// The `ferry` command line.
#[derive(Debug, clap::Parser)]
#[command(
    name = "ferry",
    version,
    about = "Operates Ferry: migrations, outbox status and dead rows, jobs, the doctor, the demo"
)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Apply the embedded migrations.
    Migrate(DbArgs),
    /// Print the backlog, dead rows and lane owners.
    Status(DbArgs),
    /// Dead (poison) rows.
    Dead {
        /// What to do with them.
        #[command(subcommand)]
        command: dead::DeadCommand,
    },
    /// Run the whole pipeline on embedded defaults and print a summary.
    Demo(crate::demo::DemoArgs),
    /// Run the failure investigations and print findings with actions.
    Doctor(doctor::DoctorArgs),
    /// Inspect and repair jobs (every change is audited).
    Jobs {
        /// What to do.
        #[command(subcommand)]
        command: jobs::JobsCommand,
    },
    /// Pause, resume and limit queues (every change is audited).
    Queue {
        /// What to do.
        #[command(subcommand)]
        command: queue::QueueCommand,
    },
    /// Serve the operator web console (binds 127.0.0.1 unless told otherwise).
    Console(console::ConsoleArgs),
    /// Print a new random console token and its token-file line.
    ConsoleToken(console_token::TokenArgs),
    /// List runs page by page and show a run's lineage.
    Runs {
        /// What to do.
        #[command(subcommand)]
        command: runs::RunsCommand,
    },
    /// Periodic schedules (changes are audited).
    Schedules {
        /// What to do.
        #[command(subcommand)]
        command: schedules::SchedulesCommand,
    },
}

/// Just a database.
#[derive(Debug, clap::Args)]
pub struct DbArgs {
    /// Database URL.
    #[arg(long, env = "DATABASE_URL")]
    pub database_url: String,
}

/// Runs a parsed command.
pub async fn run(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Migrate(db) => migrate::run(db).await,
        Command::Status(db) => status::run(db).await,
        Command::Dead { command } => dead::run(command).await,
        Command::Demo(args) => Ok(crate::demo::run(args).await?),
        Command::Doctor(args) => doctor::run(args).await,
        Command::Jobs { command } => jobs::run(command).await,
        Command::Queue { command } => queue::run(command).await,
        Command::Console(args) => console::run(args).await,
        Command::ConsoleToken(args) => console_token::run(args).await,
        Command::Runs { command } => runs::run(command).await,
        Command::Schedules { command } => schedules::run(command).await,
    }
}

/// A value, or `-` when absent.
fn opt<T: std::fmt::Display>(v: &Option<T>) -> String {
    v.as_ref().map_or_else(|| "-".to_owned(), T::to_string)
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};
    use proptest::prelude::*;

    use super::runs::millis;
    use super::*;

    /// Each subcommand's required arguments, and the flags that take a
    /// value there (the positional run id of `runs show` as `""`).
    const FLAGS: [(&str, &[&str]); 11] = [
        (
            "runs list",
            &[
                "--tenant",
                "--state",
                "--queue",
                "--operation",
                "--since-ms",
                "--before-ms",
                "--limit",
                "--cursor",
            ],
        ),
        ("runs show --tenant acme", &[""]),
        ("jobs list --tenant acme", &["--state", "--limit"]),
        ("jobs inspect --tenant acme", &["--run"]),
        ("jobs replay-dead --tenant acme --actor a --reason r", &["--run"]),
        (
            "queue limits --queue q --actor a --reason r",
            &[
                "--max-leased",
                "--max-leased-per-tenant",
                "--rate-burst",
                "--rate-every",
            ],
        ),
        ("doctor", &["--stuck-after"]),
        ("console", &["--listen", "--sample-every"]),
        ("dead list", &["--limit"]),
        ("dead replay --actor a --reason r", &["--id"]),
        ("demo", &["--runs", "--timeout"]),
    ];

    /// Values an operator could type, absurd ones weighted in.
    fn value() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<String>(),
            "[+-]?[0-9]{1,25}",
            "[0-9]{1,22}(ms|s|m|h|d)",
            "r2\\.[+-]?[0-9]{1,20}\\.[0-9a-f]{30,34}\\.[a-z:.]{0,6}",
            "(queued|succeeded|failed|cancelled|leased|dead)",
            "[0-9a-f-]{30,40}",
            "[0-9.:\\[\\]]{1,30}",
        ]
    }

    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
    }

    proptest! {
        /// Every flag that takes a value, with any value (twice, in any
        /// order), is parsed by clap or refused with a typed clap error,
        /// and what it parsed converts to the library's types or is
        /// `invalid_input`: never a panic, never a wrapped number.
        #[test]
        fn any_flag_value_parses_or_is_refused(
            command in prop::sample::select(FLAGS.to_vec()),
            values in prop::collection::vec((any::<prop::sample::Index>(), value()), 1..3),
        ) {
            let (words, flags) = command;
            let mut args = vec!["ferry".to_owned()];
            args.extend(words.split(' ').map(str::to_owned));
            if words != "demo" {
                args.extend(["--database-url".to_owned(), "postgres://x".to_owned()]);
            }
            for (i, v) in &values {
                match *i.get(flags) {
                    "" => args.extend(["--".to_owned(), v.clone()]),
                    flag => args.push(format!("{flag}={v}")),
                }
            }
            // A refusal is a typed `clap::Error` (its `kind()`).
            let Ok(cli) = Cli::try_parse_from(&args) else {
                return Ok(());
            };
            match cli.command {
                Command::Runs { command: RunsCommand::List { since_ms, before_ms, .. } } => {
                    for ms in [since_ms, before_ms] {
                        match millis(ms) {
                            Ok(m) => prop_assert_eq!(m.map(ferry::Millis::get), ms),
                            Err(e) => prop_assert_eq!(e.code(), "invalid_input"),
                        }
                    }
                }
                Command::Doctor(d) => {
                    prop_assert!(ferry::time::duration_ms(d.stuck_after).is_ok());
                }
                Command::Console(c) => prop_assert!(c.sample_every <= ferry::time::MAX_DURATION),
                _ => {}
            }
        }
    }
}
