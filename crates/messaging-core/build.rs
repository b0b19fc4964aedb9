//! `sqlx::migrate!` embeds `migrations/` when this crate compiles, and Cargo does not see a new
//! file there as a change: without this, a new migration leaves the binaries and the tests
//! migrating to the schema of the previous build. (The build script sqlx recommends.)
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
