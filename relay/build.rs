//! Renders `sql/*.sql` for both engines into the relay's typed queries,
//! borrowing the library's delivered-ranges fragments (the ledger's lock).
fn main() {
    ferry_sqlgen::generate_sharing("sql", "ferry::store::PerEngine", &["../sql/outbox_delivered.sql"]);
}
