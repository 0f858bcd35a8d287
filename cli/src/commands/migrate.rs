//! `ferry migrate`: applies the embedded migrations of the database's engine.

use super::DbArgs;
use crate::error::CliError;

/// Applies the migrations.
pub(super) async fn run(db: DbArgs) -> Result<(), CliError> {
    let pool = ferry::connect(&db.database_url).await?;
    ferry::migrate(&pool).await?;
    println!("migrations applied");
    Ok(())
}
