//! Renders `sql/*.sql` (the console's read-only queries) for both engines.
fn main() {
    ferry_sqlgen::generate("sql", "ferry::store::PerEngine");
}
