//! `ferry`: the operator binary. It parses the command line and hands over to
//! [`ferry_cli::commands::run`].

use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = ferry_cli::commands::Cli::parse();
    // The demo prints a summary; only warnings would interrupt it.
    let level = if matches!(cli.command, ferry_cli::commands::Command::Demo(_)) {
        "warn"
    } else {
        "info"
    };
    let _telemetry = ferry::telemetry::init("ferry", level);
    match ferry_cli::commands::run(cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(code = e.code(), "{e}");
            eprintln!("ferry: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
