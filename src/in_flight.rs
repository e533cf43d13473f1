//! What a duplicate gets while the request it repeats is still running: [`InFlight`].
//!
//! Under [`InFlight::Wait`] (the default) the store decides: the duplicate waits for the key
//! (behind the write lock, up to the lock timeout) and then replays the saved response. The
//! other policies need to know that a request of the same scope is running before they reach
//! the store: the layer keeps the scopes its requests are running in a set of its own
//! ([`Running`]), shared by every clone of the layer. A request running on another instance is
//! not in that set: the store learns the policy
//! ([`IdempotencyStore::bound_duplicate_wait`](crate::store::IdempotencyStore::bound_duplicate_wait)) and
//! bounds its wait on the key's row by it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::error::Rejection;
use crate::store::Scope;

/// What the layer does with a request whose `(tenant, operation, key)` is held by another
/// request still running. Set with
/// [`IdempotencyLayer::with_in_flight`](crate::IdempotencyLayer::with_in_flight).
///
/// [`Reject`](Self::Reject) and [`WaitUpTo`](Self::WaitUpTo) see the requests running through
/// the same layer in this process, on every store. A duplicate of a request running on another
/// process or instance sharing the database meets it on the key's row: the PostgreSQL stores
/// and the MySQL/MariaDB store bound that wait by the policy and answer `409` too (on MySQL
/// and MariaDB the bound counts whole seconds, rounded up; under `Reject` MariaDB does not
/// wait, MySQL waits one second). On SQLite (either store) the reservation is the file's write lock: such a
/// duplicate waits as under [`Wait`](Self::Wait), and gets `503` with `Retry-After` past the
/// lock timeout.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum InFlight {
    /// Wait for the first request to finish (up to the lock timeout, then `503`), then replay
    /// its response, or run afresh if it failed. The default.
    #[default]
    Wait,
    /// Answer `409 Conflict` with `Retry-After` at once, as the IETF draft says a server
    /// SHOULD ([`Rejection::InFlight`]). The handler does not run, nothing is stored.
    Reject,
    /// Wait up to this long for the first request to finish; then as [`Wait`](Self::Wait)
    /// (replay, or run afresh), or `409` with `Retry-After` if it is still running.
    WaitUpTo(Duration),
}

/// The scopes the requests of one layer are running, each with what wakes its waiters.
#[derive(Debug, Default)]
pub(crate) struct Running {
    scopes: Mutex<HashMap<Scope, Arc<Notify>>>,
}

/// A scope held by a running request; dropping it lets the waiting duplicates go.
pub(crate) struct Claim {
    running: Arc<Running>,
    scope: Scope,
    done: Arc<Notify>,
}

impl Drop for Claim {
    fn drop(&mut self) {
        if let Ok(mut scopes) = self.running.scopes.lock() {
            scopes.remove(&self.scope);
        }
        self.done.notify_waiters();
    }
}

impl Running {
    /// Holds `scope`, or returns what its holder's end will notify.
    fn try_claim(self: &Arc<Self>, scope: &Scope) -> Result<Claim, Arc<Notify>> {
        // A poisoned set only means a panic elsewhere while it was held: the map is whole.
        let mut scopes = self.scopes.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(done) = scopes.get(scope) {
            return Err(done.clone());
        }
        let done = Arc::new(Notify::new());
        scopes.insert(scope.clone(), done.clone());
        Ok(Claim {
            running: self.clone(),
            scope: scope.clone(),
            done,
        })
    }

    /// Whether `scope` is still held by the holder whose end notifies `done`.
    fn held_by(&self, scope: &Scope, done: &Arc<Notify>) -> bool {
        let scopes = self.scopes.lock().unwrap_or_else(|e| e.into_inner());
        scopes
            .get(scope)
            .is_some_and(|held| Arc::ptr_eq(held, done))
    }

    /// Applies `policy` to a request for `scope`: `Ok(Some(claim))` to go on holding the
    /// scope, `Ok(None)` to go on without (under [`InFlight::Wait`] the store decides), or
    /// [`Rejection::InFlight`].
    pub(crate) async fn claim(
        self: &Arc<Self>,
        scope: &Scope,
        policy: InFlight,
    ) -> Result<Option<Claim>, Rejection> {
        let bound = match policy {
            InFlight::Wait => return Ok(None),
            InFlight::Reject => Duration::ZERO,
            InFlight::WaitUpTo(bound) => bound,
        };
        let deadline = Instant::now()
            .checked_add(bound)
            .unwrap_or_else(Instant::now);
        loop {
            let done = match self.try_claim(scope) {
                Ok(claim) => return Ok(Some(claim)),
                Err(done) => done,
            };
            if Instant::now() >= deadline {
                return Err(Rejection::InFlight);
            }
            let ended = done.notified();
            let mut ended = std::pin::pin!(ended);
            // Registered before the check below, so that an end between the two still wakes it.
            ended.as_mut().enable();
            if !self.held_by(scope, &done) {
                continue;
            }
            if tokio::time::timeout_at(deadline, ended).await.is_err() {
                return Err(Rejection::InFlight);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scope(key: &str) -> Scope {
        Scope::new(
            "tenant",
            "op",
            crate::key::IdempotencyKey::parse(key.as_bytes(), 128).unwrap(),
        )
    }

    #[tokio::test]
    async fn a_claim_is_exclusive_until_dropped() {
        let running = Arc::new(Running::default());
        let first = running.claim(&scope("a"), InFlight::Reject).await.unwrap();
        assert!(first.is_some());
        assert!(matches!(
            running.claim(&scope("a"), InFlight::Reject).await,
            Err(Rejection::InFlight)
        ));
        // Another key, and the default policy, are not held back.
        assert!(running.claim(&scope("b"), InFlight::Reject).await.is_ok());
        assert!(running
            .claim(&scope("a"), InFlight::Wait)
            .await
            .unwrap()
            .is_none());
        drop(first);
        assert!(running.claim(&scope("a"), InFlight::Reject).await.is_ok());
    }

    #[tokio::test]
    async fn a_bounded_wait_goes_on_when_the_holder_ends_in_time() {
        let running = Arc::new(Running::default());
        let first = running.claim(&scope("a"), InFlight::Reject).await.unwrap();
        let waiter = {
            let running = running.clone();
            tokio::spawn(async move {
                running
                    .claim(&scope("a"), InFlight::WaitUpTo(Duration::from_secs(10)))
                    .await
                    .map(|claim| claim.is_some())
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(first);
        assert!(matches!(waiter.await.unwrap(), Ok(true)));
        let held = running.claim(&scope("a"), InFlight::Reject).await.unwrap();
        let short = running
            .claim(&scope("a"), InFlight::WaitUpTo(Duration::from_millis(50)))
            .await;
        assert!(matches!(short, Err(Rejection::InFlight)));
        drop(held);
    }
}
