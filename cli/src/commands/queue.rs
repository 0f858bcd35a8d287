//! `ferry queue list|pause|resume|limits|events`: queue settings, each
//! change audited.

use ferry::Ferry;

use super::DbArgs;
use crate::error::CliError;

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
    /// List the queues with settings: paused, limits, tokens, live leases,
    /// and whether their run events are published.
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
    /// Say whether a queue's run events go to Kafka (the default): with
    /// `--publish false` its runs' events are kept in the run history but
    /// get no outbox row, so no consumer sees them.
    Events {
        /// Database.
        #[command(flatten)]
        db: DbArgs,
        /// The queue.
        #[arg(long)]
        queue: String,
        /// `true` to publish the queue's run events, `false` to keep them out of Kafka.
        #[arg(long, action = clap::ArgAction::Set)]
        publish: bool,
        /// Actor and reason.
        #[command(flatten)]
        audited: Audited,
    },
}

/// Runs a `queue` subcommand.
pub(super) async fn run(command: QueueCommand) -> Result<(), CliError> {
    match command {
        QueueCommand::List { db } => {
            let ferry = Ferry::builder(&db.database_url).connect().await?;
            for q in ferry.operator().list_queues().await? {
                println!(
                    "{:<20} {:<7} leased {:<5} {}{}{}",
                    q.queue,
                    if q.paused { "paused" } else { "running" },
                    q.leased,
                    q.limits.describe(),
                    q.limits.rate.map_or(String::new(), |_| format!(" tokens={}", q.tokens)),
                    if q.publish_events { "" } else { " events=unpublished" }
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
        QueueCommand::Events {
            db,
            queue,
            publish,
            audited,
        } => {
            let ferry = Ferry::builder(&db.database_url).connect().await?;
            ferry
                .operator()
                .set_queue_publish_events(&queue, publish, &audited.actor, &audited.reason)
                .await?;
            println!("{queue}: publish_events={publish}");
        }
    }
    Ok(())
}
