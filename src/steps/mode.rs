//! The layer's steps mode, seen from the request flow: claiming a key and, once the handler
//! returned, finishing or releasing it. The flow (`service/steps.rs`) knows the store only as
//! an [`IdempotencyStore`](crate::store::IdempotencyStore); these objects carry the
//! [`StepStore`] it was configured with.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use super::backend::{Acquired, Claim, StepStore};
use super::handle::{Granted, Steps};
use crate::error::Error;
use crate::store::NewRecord;

pub(crate) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// The steps mode of a layer: its store and lease.
#[derive(Clone)]
pub(crate) struct StepsMode {
    pub(crate) lease: Duration,
    pub(crate) claimer: Arc<dyn Claimer>,
}

/// Claims keys on the configured store.
pub(crate) trait Claimer: Send + Sync {
    fn claim(&self, claim: Claim, lease: Duration) -> BoxFuture<Result<Claimed, Error>>;
}

/// A claim's outcome: the key's handle, or what
/// [`acquire`](crate::steps::sealed::StepProtocol::acquire) said instead.
pub(crate) enum Claimed {
    Owned(Box<dyn Owned>),
    Not(Acquired),
}

/// What the request's steps did, read when the handler returned.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Flags {
    pub(crate) transient: bool,
    pub(crate) lease_lost: bool,
    pub(crate) in_doubt: bool,
    pub(crate) terminal: bool,
    pub(crate) changed: bool,
}

/// A claimed key, type-erased: its handle for the request extensions, then its end.
pub(crate) trait Owned: Send + Sync {
    fn insert_into(&self, extensions: &mut http::Extensions);
    fn flags(&self) -> Flags;
    fn finish(&self, record: NewRecord) -> BoxFuture<Result<(), Error>>;
    fn release(&self) -> BoxFuture<Result<(), Error>>;
    /// A fresh handle on the same claim for running the handler again after a commit the
    /// database threw away, if the request may run again (see `Steps::rerun`).
    fn rerun(&self) -> Option<Box<dyn Owned>>;
}

pub(crate) struct StoreClaimer<St>(pub(crate) St);

impl<St: StepStore> Claimer for StoreClaimer<St> {
    fn claim(&self, claim: Claim, lease: Duration) -> BoxFuture<Result<Claimed, Error>> {
        let store = self.0.clone();
        Box::pin(async move {
            match store.acquire(&claim).await? {
                Acquired::Owned {
                    generation,
                    run,
                    steps,
                } => {
                    let granted = Granted {
                        scope: claim.scope,
                        generation,
                        run,
                        steps,
                        lease,
                        lease_until: claim.lease_until,
                        wait: claim.wait,
                    };
                    Ok(Claimed::Owned(Box::new(Steps::new(store, granted))))
                }
                other => Ok(Claimed::Not(other)),
            }
        })
    }
}

impl<St: StepStore> Owned for Steps<St> {
    fn insert_into(&self, extensions: &mut http::Extensions) {
        extensions.insert(self.clone());
    }

    fn flags(&self) -> Flags {
        let state = self.state();
        Flags {
            transient: state.transient,
            lease_lost: state.lease_lost,
            in_doubt: state.in_doubt,
            terminal: state.terminal,
            changed: state.changed,
        }
    }

    fn finish(&self, record: NewRecord) -> BoxFuture<Result<(), Error>> {
        let (store, lease) = (self.store().clone(), self.lease());
        Box::pin(async move { store.finish(&lease, &record).await })
    }

    fn release(&self) -> BoxFuture<Result<(), Error>> {
        let (store, lease) = (self.store().clone(), self.lease());
        Box::pin(async move { store.release(&lease).await })
    }

    fn rerun(&self) -> Option<Box<dyn Owned>> {
        Steps::rerun(self).map(|steps| Box::new(steps) as Box<dyn Owned>)
    }
}

/// A fresh claim's owner id.
pub(crate) fn owner() -> Arc<str> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    Arc::from(format!(
        "{}-{nanos:x}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ))
}
