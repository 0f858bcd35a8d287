//! The `ferry` command line: `migrate`, `status`, `dead list|replay`,
//! `doctor`, `jobs list|inspect|cancel|replay-dead`, `runs list|show`,
//! `schedules list|remove`, `queue list|pause|resume|limits`, `console`,
//! `console-token` and `demo`.
#![allow(clippy::print_stdout)]

use ferry::Ferry;

use crate::error::CliError;

/// `ferry-relay`.
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
        #[arg(long, value_parser = ferry::time::parse_duration, default_value = "5m")]
        stuck_after: std::time::Duration,
        /// Exit non-zero when a warning or critical finding has items.
        #[arg(long)]
        strict: bool,
        /// WAL an inactive capture slot may hold back, in bytes, before
        /// `wal_slot_inactive_lag` warns.
        #[arg(long, default_value_t = 1 << 30)]
        inactive_slot_lag_bytes: i64,
    },
    /// Inspect and repair jobs (every change is audited).
    Jobs {
        /// What to do.
        #[command(subcommand)]
        command: JobsCommand,
    },
    /// Pause, resume and limit queues (every change is audited).
    Queue {
        /// What to do.
        #[command(subcommand)]
        command: QueueCommand,
    },
    /// Serve the operator web console (binds 127.0.0.1 unless told otherwise).
    Console(ConsoleArgs),
    /// Print a new random console token and its token-file line.
    ConsoleToken {
        /// The token's name (the actor in the audit trail).
        #[arg(long)]
        name: String,
        /// Scope the token to this tenant (repeat for several; none: every tenant).
        #[arg(long = "tenant")]
        tenants: Vec<String>,
        /// Allow the token to see payloads.
        #[arg(long)]
        payloads: bool,
    },
    /// List runs page by page and show a run's lineage.
    Runs {
        /// What to do.
        #[command(subcommand)]
        command: RunsCommand,
    },
    /// Periodic schedules (changes are audited).
    Schedules {
        /// What to do.
        #[command(subcommand)]
        command: SchedulesCommand,
    },
}

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

/// Who changes a queue, and why: both go to the audit trail.
#[derive(Debug, clap::Args)]
pub struct Audited {
    /// Who asks.
    #[arg(long, env = "USER")]
    pub actor: String,
    /// Why.
    #[arg(long)]
    pub reason: String,
}

/// `queue` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum QueueCommand {
    /// List the queues with settings: paused, limits, tokens, live leases.
    List {
        /// Database.
        #[command(flatten)]
        db: DbArgs,
    },
    /// Stop claiming a queue's jobs; leases already taken run on.
    Pause {
        /// Database.
        #[command(flatten)]
        db: DbArgs,
        /// The queue.
        #[arg(long)]
        queue: String,
        /// Actor and reason.
        #[command(flatten)]
        audited: Audited,
    },
    /// Claim a paused queue's jobs again.
    Resume {
        /// Database.
        #[command(flatten)]
        db: DbArgs,
        /// The queue.
        #[arg(long)]
        queue: String,
        /// Actor and reason.
        #[command(flatten)]
        audited: Audited,
    },
    /// Replace a queue's limits (a limit left out is lifted).
    Limits {
        /// Database.
        #[command(flatten)]
        db: DbArgs,
        /// The queue.
        #[arg(long)]
        queue: String,
        /// At most this many jobs of the queue leased at once.
        #[arg(long)]
        max_leased: Option<u32>,
        /// At most this many jobs of one tenant leased at once.
        #[arg(long)]
        max_leased_per_tenant: Option<u32>,
        /// Rate limit: claims that may come at once (the bucket size).
        #[arg(long, requires = "rate_every")]
        rate_burst: Option<u32>,
        /// Rate limit: one more claim per this interval (e.g. `200ms`, `1s`).
        #[arg(long, requires = "rate_burst", value_parser = ferry::time::parse_duration)]
        rate_every: Option<std::time::Duration>,
        /// Actor and reason.
        #[command(flatten)]
        audited: Audited,
    },
}

/// `ferry console`.
#[derive(Debug, clap::Args)]
pub struct ConsoleArgs {
    /// Database.
    #[command(flatten)]
    pub db: DbArgs,
    /// Address to serve on. The default is loopback only.
    #[arg(long, default_value = "127.0.0.1:8088")]
    pub listen: std::net::SocketAddr,
    /// The token file (one JSON line per token: name, sha256, tenants,
    /// payloads). Without it the token lines are read from
    /// `FERRY_CONSOLE_TOKENS`.
    #[arg(long, env = "FERRY_CONSOLE_TOKEN_FILE")]
    pub token_file: Option<std::path::PathBuf>,
    /// How often the overview's backlog and throughput are sampled.
    #[arg(long, value_parser = ferry::time::parse_duration, default_value = "5s")]
    pub sample_every: std::time::Duration,
    /// Mark the session cookie `Secure` (when TLS is terminated in front).
    #[arg(long)]
    pub secure_cookie: bool,
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

/// Runs a parsed command.
pub async fn run(cli: Cli) -> Result<(), CliError> {
    match cli.command {
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
        Command::Dead { command } => match command {
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
        },
        Command::Demo(args) => Ok(crate::demo::run(args).await?),
        Command::Doctor {
            db,
            stuck_after,
            strict,
            inactive_slot_lag_bytes,
        } => {
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
        Command::Jobs { command } => jobs(command).await,
        Command::Queue { command } => queue(command).await,
        Command::Console(args) => console(args).await,
        Command::ConsoleToken {
            name,
            tenants,
            payloads,
        } => {
            let token = ferry_console::Tokens::generate_token();
            let scope = (!tenants.is_empty()).then_some(tenants.as_slice());
            let line = ferry_console::Tokens::line_for(&name, &token, scope, payloads);
            ferry_console::Tokens::parse(&line)?;
            println!("token (give it to {name}; it is not stored): {token}");
            println!("token file line: {line}");
            Ok(())
        }
        Command::Runs { command } => runs(command).await,
        Command::Schedules { command } => schedules(command).await,
    }
}

fn millis(ms: Option<i64>) -> Result<Option<ferry::Millis>, CliError> {
    Ok(ms.map(ferry::Millis::new).transpose()?)
}

fn opt<T: std::fmt::Display>(v: &Option<T>) -> String {
    v.as_ref().map_or_else(|| "-".to_owned(), T::to_string)
}

async fn runs(command: RunsCommand) -> Result<(), CliError> {
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

async fn schedules(command: SchedulesCommand) -> Result<(), CliError> {
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

async fn queue(command: QueueCommand) -> Result<(), CliError> {
    match command {
        QueueCommand::List { db } => {
            let ferry = Ferry::builder(&db.database_url).connect().await?;
            for q in ferry.operator().list_queues().await? {
                println!(
                    "{:<20} {:<7} leased {:<5} {}{}",
                    q.queue,
                    if q.paused { "paused" } else { "running" },
                    q.leased,
                    q.limits.describe(),
                    q.limits.rate.map_or(String::new(), |_| format!(" tokens={}", q.tokens))
                );
            }
        }
        QueueCommand::Pause { db, queue, audited } => {
            let ferry = Ferry::builder(&db.database_url).connect().await?;
            ferry
                .operator()
                .pause_queue(&queue, &audited.actor, &audited.reason)
                .await?;
            println!("paused {queue}");
        }
        QueueCommand::Resume { db, queue, audited } => {
            let ferry = Ferry::builder(&db.database_url).connect().await?;
            ferry
                .operator()
                .resume_queue(&queue, &audited.actor, &audited.reason)
                .await?;
            println!("resumed {queue}");
        }
        QueueCommand::Limits {
            db,
            queue,
            max_leased,
            max_leased_per_tenant,
            rate_burst,
            rate_every,
            audited,
        } => {
            let limits = ferry::QueueLimits {
                max_leased,
                max_leased_per_tenant,
                rate: rate_burst
                    .zip(rate_every)
                    .map(|(burst, every)| ferry::RateLimit { burst, every }),
            };
            let ferry = Ferry::builder(&db.database_url).connect().await?;
            ferry
                .operator()
                .set_queue_limits(&queue, limits, &audited.actor, &audited.reason)
                .await?;
            println!("{queue}: {}", limits.describe());
        }
    }
    Ok(())
}

async fn console(args: ConsoleArgs) -> Result<(), CliError> {
    let text = match &args.token_file {
        Some(path) => std::fs::read_to_string(path).map_err(ferry_console::ConsoleError::from)?,
        None => std::env::var("FERRY_CONSOLE_TOKENS").map_err(|_| {
            ferry_console::ConsoleError::TokenFile("give --token-file or set FERRY_CONSOLE_TOKENS".into())
        })?,
    };
    let mut config = ferry_console::ConsoleConfig::new(ferry_console::Tokens::parse(&text)?);
    config.sample_every = args.sample_every;
    config.secure_cookie = args.secure_cookie;
    let ferry = Ferry::builder(&args.db.database_url).connect().await?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(ferry_console::ConsoleError::from)?;
    if !args.listen.ip().is_loopback() {
        tracing::warn!(listen = %args.listen, "the console listens beyond loopback: keep it inside the cluster");
    }
    ferry_console::Console::new(ferry, config)?
        .serve(listener, ferry::signal::shutdown_signal())
        .await
        .map_err(ferry_console::ConsoleError::from)?;
    Ok(())
}

async fn jobs(command: JobsCommand) -> Result<(), CliError> {
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

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};
    use proptest::prelude::*;

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
                Command::Doctor { stuck_after, .. } => {
                    prop_assert!(ferry::time::duration_ms(stuck_after).is_ok());
                }
                Command::Console(c) => prop_assert!(c.sample_every <= ferry::time::MAX_DURATION),
                _ => {}
            }
        }
    }
}
