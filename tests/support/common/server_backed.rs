//! What the test databases on a server (PostgreSQL on either driver, MySQL) share: the order
//! app served on a store the test opened, the fresh name of a database or schema, and its
//! removal when dropped (`tests/support/pg_common`, `tests/support/mysql_common`).

use std::collections::BTreeSet;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::Request;
use axum::response::IntoResponse;
use axum::routing::Route;
use tower::{Layer, Service};
use tower_idempotency::IdempotencyLayer;

use super::{AppBuilder, AppOf, Guarded, HookFor, InsertOrder, OrderCallOf, Outcome, Serving};

/// A running order app on 127.0.0.1, on the store `S` whose handle is `T`, and its store.
pub struct OrderServer<S, T, O> {
    pub addr: SocketAddr,
    pub store: S,
    pub app: Arc<AppOf<T, O>>,
    serving: Serving,
}

impl<S, T, O> OrderServer<S, T, O> {
    /// Stops serving (gracefully, bounded).
    pub async fn shutdown(self) {
        self.serving.stop().await;
    }
}

impl<S: Clone + 'static, T: InsertOrder, O: Outcome, X>
    AppBuilder<S, HookFor<OrderCallOf<T>, O>, X>
{
    /// Serves the order routes on `store` (a store of its own: several servers on one
    /// database are several app instances sharing it).
    pub async fn serve_on(&self, store: S) -> OrderServer<S, T, O>
    where
        IdempotencyLayer<S>: Layer<Route> + Clone + Send + Sync + 'static,
        Guarded<S>: Service<Request, Error = Infallible> + Clone + Send + Sync + 'static,
        <Guarded<S> as Service<Request>>::Response: IntoResponse + 'static,
        <Guarded<S> as Service<Request>>::Future: Send + 'static,
    {
        let (app, serving) = self.serve_orders(&store).await;
        OrderServer {
            addr: serving.addr,
            store,
            app,
            serving,
        }
    }
}

/// The name of a fresh database (or schema) of a suite on the server that `variable` names:
/// `<prefix><unix seconds>_<pid>_<n>`.
pub struct FreshName {
    /// The server's URL, from `variable`.
    pub url: String,
    pub name: String,
    /// When it was made, in unix seconds.
    pub now: u64,
    /// Whether this is the process's first with this prefix: the one that sweeps what earlier
    /// runs left.
    pub first: bool,
}

impl FreshName {
    /// `None` (after saying so on both streams: `--nocapture` shows stdout, a failing run shows
    /// both) when `variable` is not set.
    pub fn new(variable: &str, what: &str, prefix: &str) -> Option<FreshName> {
        let Some(url) = std::env::var(variable)
            .ok()
            .filter(|url| !url.trim().is_empty())
        else {
            println!("skipped: {variable} is not set ({what} tests need it)");
            eprintln!("skipped: {variable} is not set ({what} tests need it)");
            return None;
        };
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        static SWEPT: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| since.as_secs());
        let name = format!(
            "{prefix}{now}_{}_{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::SeqCst)
        );
        let first = SWEPT
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(prefix.to_owned());
        Some(FreshName {
            url,
            name,
            now,
            first,
        })
    }

    /// Whether `name`, made by a suite with `prefix`, is more than an hour old.
    pub fn is_stale(name: &str, prefix: &str, now: u64) -> bool {
        name.strip_prefix(prefix)
            .and_then(|rest| rest.split('_').next())
            .and_then(|secs| secs.parse::<u64>().ok())
            .is_some_and(|made| made + 3600 < now)
    }
}

/// Runs the future of `cleanup` to its end on a thread of its own, with a runtime of its own:
/// how the `Drop` of a test database (which cannot await) removes it. Without a runtime it does
/// nothing (the database is left behind, for a later run's sweep).
pub fn run_on_a_thread_of_its_own<F: Future<Output = ()>>(
    cleanup: impl FnOnce() -> F + Send + 'static,
) {
    let thread = std::thread::spawn(move || {
        if let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            runtime.block_on(cleanup());
        }
    });
    let _ = thread.join();
}
