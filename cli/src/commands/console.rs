//! `ferry console`: serves the operator web console over the database.

use ferry::Ferry;

use super::DbArgs;
use crate::error::CliError;

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

/// Serves the console until a shutdown signal.
pub(super) async fn run(args: ConsoleArgs) -> Result<(), CliError> {
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
