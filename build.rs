//! Sets `cfg(pg_tests)` when `TEST_DATABASE_URL` names a PostgreSQL server and `cfg(mysql_tests)`
//! when `TEST_MYSQL_URL` names a MySQL or MariaDB server. The crate itself never reads them: the
//! test suites that need a server are marked `#[cfg_attr(not(pg_tests), ignore = "...")]`, so that
//! `cargo test` without a server reports them as ignored, not as passed.
//!
//! Sets `cfg(pg_cluster_tests)` when the PostgreSQL server programs (`initdb`, `pg_ctl`,
//! `pg_basebackup`) are installed: in `PG_BINDIR`, or in `/usr/lib/postgresql/<version>/bin`.
//! The failover tests build a primary and a standby from them; without them they are reported
//! as ignored.
//!
//! Sets two names for sets of the crate's own features, so that the code says once what a
//! feature list means: `cfg(row_lock_store)` with any store whose reservation is a row lock
//! (`tokio-postgres`, `sqlx-postgres`, `sqlx-mysql`), and `cfg(sql_store)` with any store at all
//! (those and `sqlite`). Public items keep the feature lists themselves, so that their docs
//! name the features.

use std::path::{Path, PathBuf};

fn main() {
    println!("cargo::rustc-check-cfg=cfg(pg_tests)");
    println!("cargo::rustc-check-cfg=cfg(mysql_tests)");
    println!("cargo::rustc-check-cfg=cfg(pg_cluster_tests)");
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
    for (variable, cfg) in [
        ("TEST_DATABASE_URL", "pg_tests"),
        ("TEST_MYSQL_URL", "mysql_tests"),
    ] {
        println!("cargo::rerun-if-env-changed={variable}");
        if std::env::var(variable).is_ok_and(|url| !url.trim().is_empty()) {
            println!("cargo::rustc-cfg={cfg}");
        }
    }
    println!("cargo::rerun-if-env-changed=PG_BINDIR");
    println!("cargo::rerun-if-changed=/usr/lib/postgresql");
    if let Some(bindir) = postgres_bindir() {
        println!("cargo::rustc-cfg=pg_cluster_tests");
        // The tests start the servers from here (`tests/support/cluster/mod.rs`).
        println!("cargo::rustc-env=PG_CLUSTER_BINDIR={}", bindir.display());
    }
}

/// The directory of the PostgreSQL server programs: `PG_BINDIR`, else the newest
/// `/usr/lib/postgresql/<version>/bin` (the layout of Debian and Ubuntu packages).
fn postgres_bindir() -> Option<PathBuf> {
    let complete = |dir: &Path| {
        ["initdb", "pg_ctl", "pg_basebackup", "postgres"]
            .iter()
            .all(|program| dir.join(program).is_file())
    };
    if let Some(dir) = std::env::var_os("PG_BINDIR") {
        return Some(PathBuf::from(dir)).filter(|dir| complete(dir));
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let version = entry.file_name().to_str()?.parse().ok()?;
            Some((version, entry.path().join("bin")))
        })
        .filter(|(_, dir)| complete(dir))
        .collect();
    versions.sort();
    versions.pop().map(|(_, dir)| dir)
}
