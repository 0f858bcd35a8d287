//! Renders `sql/*.sql` for both engines into a typed struct (see `ferry-sqlgen`).
fn main() {
    ferry_sqlgen::generate("sql", "crate::store::PerEngine");
}
