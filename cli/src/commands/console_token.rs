//! `ferry console-token`: a new random console token and its token-file
//! line (the token itself is not stored).

use crate::error::CliError;

/// `ferry console-token`.
#[derive(Debug, clap::Args)]
pub struct TokenArgs {
    /// The token's name (the actor in the audit trail).
    #[arg(long)]
    pub name: String,
    /// Scope the token to this tenant (repeat for several; none: every tenant).
    #[arg(long = "tenant")]
    pub tenants: Vec<String>,
    /// Allow the token to see payloads.
    #[arg(long)]
    pub payloads: bool,
}

/// Prints a new token and its token-file line.
pub(super) async fn run(args: TokenArgs) -> Result<(), CliError> {
    let TokenArgs {
        name,
        tenants,
        payloads,
    } = args;
    let token = ferry_console::Tokens::generate_token();
    let scope = (!tenants.is_empty()).then_some(tenants.as_slice());
    let line = ferry_console::Tokens::line_for(&name, &token, scope, payloads);
    ferry_console::Tokens::parse(&line)?;
    println!("token (give it to {name}; it is not stored): {token}");
    println!("token file line: {line}");
    Ok(())
}
