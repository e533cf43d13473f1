//! Sets `cfg(pg_tests)` when `TEST_DATABASE_URL` names a PostgreSQL server and `cfg(mysql_tests)`
//! when `TEST_MYSQL_URL` names a MySQL or MariaDB server. The crate itself never reads them: the
//! test suites that need a server are marked `#[cfg_attr(not(pg_tests), ignore = "...")]`, so that
//! `cargo test` without a server reports them as ignored, not as passed.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(pg_tests)");
    println!("cargo::rustc-check-cfg=cfg(mysql_tests)");
    for (variable, cfg) in [
        ("TEST_DATABASE_URL", "pg_tests"),
        ("TEST_MYSQL_URL", "mysql_tests"),
    ] {
        println!("cargo::rerun-if-env-changed={variable}");
        if std::env::var(variable).is_ok_and(|url| !url.trim().is_empty()) {
            println!("cargo::rustc-cfg={cfg}");
        }
    }
}
