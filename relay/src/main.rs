//! `ferry-relay` binary: parses the command line and hands over to the library.

use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = ferry_relay::cli::Cli::parse();
    let _telemetry = ferry::telemetry::init("ferry-relay", "info");
    match ferry_relay::cli::run(cli, ferry::signal::shutdown_signal()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(code = e.code(), "{e}");
            eprintln!("ferry-relay: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
