//! Renders `sql/*.sql` for both engines into a typed struct (see `ferry-sqlgen`).
fn main() {
    ferry_sqlgen::generate("sql", "crate::store::PerEngine");
    // `sqlx::migrate!` embeds migrations/ at compile time but does not tell
    // Cargo to watch it: without this a new migration is missed by an
    // incremental build (what `sqlx migrate build-script` writes).
    println!("cargo:rerun-if-changed=migrations");
}
