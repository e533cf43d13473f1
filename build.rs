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
//!
//! Writes `$OUT_DIR/doc_links.md`, the link definitions of the crate root's docs and the
//! guide's for items of features that may be off ([`DOC_LINKS`]).

use std::path::{Path, PathBuf};

/// Links to items of features that may be off, shared by the crate root's docs and the guide
/// (both include `$OUT_DIR/doc_links.md`): with any of its features on, a link is the item's
/// path in the crate (an intra-doc link: docs.rs builds every feature); without, the item's
/// page on docs.rs, so that no build has a broken link. Each: the label, the features (any of
/// them), the path in the crate, and the page under the crate's docs.rs root.
#[rustfmt::skip]
const DOC_LINKS: &[(&str, &[&str], &str, &str)] = &[
    ("admin", &["sqlite", "tokio-postgres", "sqlx-postgres", "sqlx-mysql"], "crate::admin", "admin/index.html"),
    ("sqlite", &["sqlite"], "crate::store::sqlite", "store/sqlite/index.html"),
    ("SqliteHandle", &["sqlite"], "crate::store::sqlite::SqliteHandle", "store/sqlite/struct.SqliteHandle.html"),
    ("SqliteHandle::run", &["sqlite"], "crate::store::sqlite::SqliteHandle::run", "store/sqlite/struct.SqliteHandle.html#method.run"),
    ("SqliteStore::write", &["sqlite"], "crate::store::sqlite::SqliteStore::write", "store/sqlite/struct.SqliteStore.html#method.write"),
    ("Tx", &["axum"], "crate::extract::Tx", "extract/struct.Tx.html"),
    ("outbox", &["outbox"], "crate::outbox", "outbox/index.html"),
    ("client", &["client"], "crate::client", "client/index.html"),
    ("postgres", &["tokio-postgres"], "crate::store::tokio_postgres", "store/tokio_postgres/index.html"),
    ("sqlx_postgres", &["sqlx-postgres"], "crate::store::sqlx_postgres", "store/sqlx_postgres/index.html"),
    ("sqlx_mysql", &["sqlx-mysql"], "crate::store::sqlx_mysql", "store/sqlx_mysql/index.html"),
    ("document", &["utoipa"], "crate::IdempotencyLayer::document", "struct.IdempotencyLayer.html#method.document"),
];

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
    write_doc_links(&feature);
}

/// Writes [`DOC_LINKS`] for this build's features to `$OUT_DIR/doc_links.md`, one definition
/// a line.
fn write_doc_links(feature: &dyn Fn(&str) -> bool) {
    let mut links = String::new();
    for (label, features, path, page) in DOC_LINKS {
        let on = features
            .iter()
            .any(|name| feature(&name.to_uppercase().replace('-', "_")));
        let target = if on {
            path.to_string()
        } else {
            format!("https://docs.rs/tower-idempotency/latest/tower_idempotency/{page}")
        };
        links.push_str(&format!("[{label}]: {target}\n"));
    }
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    std::fs::write(out.join("doc_links.md"), links).expect("write doc_links.md");
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
