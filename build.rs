//! Sets two names for sets of the crate's own features, so that the code says once what a
//! feature list means: `cfg(row_lock_store)` with any store whose reservation is a row lock
//! (`tokio-postgres`, `sqlx-postgres`, `sqlx-mysql`), and `cfg(sql_store)` with any store at all
//! (those and `sqlite`). Public items keep the feature lists themselves, so that their docs
//! name the features.
//!
//! It reads nothing else: what the tests need (`TEST_DATABASE_URL`, `TEST_MYSQL_URL`, the
//! PostgreSQL server programs) the test binaries look for when they start
//! (`tests/support/harness.rs`), so setting or unsetting those rebuilds nothing.

fn main() {
    // Without a `rerun-if` line Cargo would run this again after a change to any file of the
    // package; the features are part of the build's fingerprint already.
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rustc-check-cfg=cfg(row_lock_store)");
    println!("cargo::rustc-check-cfg=cfg(sql_store)");
    let feature = |name: &str| std::env::var_os(format!("CARGO_FEATURE_{name}")).is_some();
    let row_lock_store = ["TOKIO_POSTGRES", "SQLX_POSTGRES", "SQLX_MYSQL"]
        .iter()
        .any(|name| feature(name));
    if row_lock_store {
        println!("cargo::rustc-cfg=row_lock_store");
    }
    if row_lock_store || feature("SQLITE") {
        println!("cargo::rustc-cfg=sql_store");
    }
}
