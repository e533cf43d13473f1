//! Writes `$OUT_DIR/doc_links.md`, the link definitions of the crate root's docs and the
//! guide's for items of features that may be off ([`DOC_LINKS`]).
//!
//! It reads nothing else: what the tests need (`TEST_DATABASE_URL`, `TEST_MYSQL_URL`, the
//! PostgreSQL server programs) the test binaries look for when they start
//! (`tests/support/harness.rs`), so setting or unsetting those rebuilds nothing.

use std::path::PathBuf;

/// Links to items of features that may be off, shared by the crate root's docs and the guide
/// (both include `$OUT_DIR/doc_links.md`): with any of its features on, a link is the item's
/// path in the crate (an intra-doc link: docs.rs builds every feature); without, the item's
/// page on docs.rs, so that no build has a broken link. Each: the label, the features (any of
/// them), the path in the crate, and the page under the crate's docs.rs root.
#[rustfmt::skip]
const DOC_LINKS: &[(&str, &[&str], &str, &str)] = &[
    ("admin", &["sqlite", "tokio-postgres", "sqlx-postgres", "sqlx-mysql", "sqlx-sqlite"], "crate::admin", "admin/index.html"),
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
    ("sqlx_sqlite", &["sqlx-sqlite"], "crate::store::sqlx_sqlite", "store/sqlx_sqlite/index.html"),
    ("document", &["utoipa"], "crate::IdempotencyLayer::document", "struct.IdempotencyLayer.html#method.document"),
];

fn main() {
    // Without a `rerun-if` line Cargo would run this again after a change to any file of the
    // package; the features are part of the build's fingerprint already.
    println!("cargo::rerun-if-changed=build.rs");
    let feature = |name: &str| std::env::var_os(format!("CARGO_FEATURE_{name}")).is_some();
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
