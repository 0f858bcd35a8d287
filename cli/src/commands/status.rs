//! `ferry status`: the outbox backlog, dead rows and lane owners.

use ferry::Ferry;

use super::DbArgs;
use crate::error::CliError;

/// Prints the status report.
pub(super) async fn run(db: DbArgs) -> Result<(), CliError> {
    let ferry = Ferry::builder(&db.database_url).connect().await?;
    print!("{}", ferry.operator().status_report().await?);
    Ok(())
}
