//! Renders `sql/*.sql` for both engines into the consumer's typed queries.
fn main() {
    ferry_sqlgen::generate("sql", "ferry::store::PerEngine");
}
