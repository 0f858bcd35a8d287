//! Renders `sql/*.sql` (the doctor's investigations) for both engines,
//! with the library's outbox fragments (pending rows read through the
//! delivered-ranges ledger).
fn main() {
    ferry_sqlgen::generate_sharing("sql", "ferry::store::PerEngine", &["../sql/outbox_delivered.sql"]);
}
