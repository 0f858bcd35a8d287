//! Renders `sql/*.sql` (the doctor's investigations) for both engines.
fn main() {
    ferry_sqlgen::generate("sql", "ferry::store::PerEngine");
}
