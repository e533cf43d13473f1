//! How often a store's recent first attempts were retries (their key already had a record):
//! [`RetryShare`], learnt from every outcome. Stores use it to decide where a request looks for
//! its record. The row-lock stores read before the transaction only while retries are frequent
//! ([`ReplayCheck::Adaptive`](super::replay_check::ReplayCheck::Adaptive)); SQLite skips its
//! read before a new key's transaction while they are rare and the writer is idle.

use std::sync::atomic::{AtomicU32, Ordering};

use super::RunOutcome;
use crate::error::Error;

/// How much one outcome moves the estimate: an exponential moving average over about the
/// last 16 first attempts.
const SHIFT: u32 = 4;
/// The estimate's scale: `ONE` is "every first attempt was a retry".
pub(crate) const ONE: u32 = 1 << 16;
/// From this share of retries on (one in eight), retries are frequent. For the row-lock
/// stores, the read saves a retry two round trips on a write connection and costs a new key
/// one, so it pays from one in three; from one in eight, retries stay off the write
/// connections unless they are rare.
const FREQUENT_FROM: u32 = ONE / 8;

/// The share of recent first attempts whose key had a record (shared by a store's clones).
#[derive(Debug, Default)]
pub(crate) struct RetryShare {
    /// In `1 / ONE`.
    found: AtomicU32,
}

impl RetryShare {
    /// Whether one in eight or more of the recent first attempts were retries.
    pub(crate) fn frequent(&self) -> bool {
        self.found.load(Ordering::Relaxed) >= FREQUENT_FROM
    }

    /// The estimate, in `1 / ONE`.
    #[cfg(test)]
    pub(crate) fn get(&self) -> u32 {
        self.found.load(Ordering::Relaxed)
    }

    /// Learns from a first attempt's outcome whether its key had a record (an error teaches
    /// nothing). Concurrent updates may lose one another's step: the estimate only needs to
    /// follow the trend.
    pub(crate) fn observe<T>(&self, outcome: &Result<RunOutcome<T>, Error>) {
        let had_record = match outcome {
            Ok(RunOutcome::Found { .. } | RunOutcome::Existing { .. }) => true,
            Ok(RunOutcome::Ran { .. }) => false,
            Err(_) => return,
        };
        let found = self.found.load(Ordering::Relaxed);
        let target = if had_record { ONE } else { 0 };
        // found + (target - found) / 2^SHIFT, rounded towards the target so that it reaches it.
        let next = if target > found {
            found + (target - found).div_ceil(1 << SHIFT)
        } else {
            found - (found - target).div_ceil(1 << SHIFT)
        };
        self.found.store(next, Ordering::Relaxed);
    }
}
