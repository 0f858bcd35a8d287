//! What an operator command fails with, with a stable [`CliError::code`].

use ferry_consumer::ConsumerError;
use ferry_relay::error::RelayError;

/// Everything an operator command can fail with.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// A library call failed (database, invalid input, a refused transition).
    #[error(transparent)]
    Ferry(#[from] ferry::Error),
    /// The relay's store or the demo's relay failed.
    #[error(transparent)]
    Relay(#[from] RelayError),
    /// The demo's consumer failed.
    #[error(transparent)]
    Consumer(#[from] ConsumerError),
    /// The web console could not start or serve.
    #[error(transparent)]
    Console(#[from] ferry_console::ConsoleError),
    /// `doctor --strict` found problems (the count of failing checks).
    #[error("{0} checks found problems")]
    DoctorFindings(usize),
}

impl CliError {
    /// The stable machine-readable code (the inner error's code).
    pub fn code(&self) -> &'static str {
        match self {
            CliError::Ferry(e) => e.code(),
            CliError::Relay(e) => e.code(),
            CliError::Consumer(e) => e.code(),
            CliError::Console(e) => e.code(),
            CliError::DoctorFindings(_) => "doctor_findings",
        }
    }
}
