//! A failure episode, logged once: something that fails on every request (a full disk, a dead
//! replica) would otherwise log a line per request. The first failure of an episode is
//! logged; later ones are counted silently until a success ends the episode (one line says
//! how many) or every [`SUMMARY_EVERY`] (one summary line). The caller logs; this only says
//! what is due ([`Logged`]) and keeps the total for a counter.

use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How often an episode that goes on logs a summary of the failures it counted.
pub(crate) const SUMMARY_EVERY: Duration = Duration::from_secs(10);

/// What a failure calls for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Logged {
    /// The episode's first failure: log it.
    First,
    /// Counted silently.
    Counted,
    /// A summary of this many failures in the last [`SUMMARY_EVERY`] (this one included).
    Summary(u64),
}

/// One episode's state and the running total.
#[derive(Debug, Default)]
pub(crate) struct Episode {
    /// An episode is on (the fast path of [`Episode::end`] reads only this).
    failing: AtomicBool,
    /// Failures counted since the last line, and when that line was logged (None: no episode).
    quiet: Mutex<(u64, Option<Instant>)>,
    /// Every failure, for a counter.
    total: AtomicU64,
}

impl Episode {
    /// Counts a failure at `now`; says whether to log it.
    pub(crate) fn fail(&self, now: Instant) -> Logged {
        self.total.fetch_add(1, Ordering::Relaxed);
        let mut q = self.quiet.lock();
        match q.1 {
            None => {
                *q = (0, Some(now));
                self.failing.store(true, Ordering::Relaxed);
                Logged::First
            }
            Some(at) if now.duration_since(at) >= SUMMARY_EVERY => {
                let n = q.0 + 1;
                *q = (0, Some(now));
                Logged::Summary(n)
            }
            Some(_) => {
                q.0 += 1;
                Logged::Counted
            }
        }
    }

    /// A success: ends the episode. The failures counted since its last line (None when no
    /// episode was on).
    pub(crate) fn end(&self) -> Option<u64> {
        if !self.failing.load(Ordering::Relaxed) {
            return None;
        }
        let mut q = self.quiet.lock();
        q.1?;
        let n = q.0;
        *q = (0, None);
        self.failing.store(false, Ordering::Relaxed);
        Some(n)
    }

    /// Failures counted in all.
    pub(crate) fn total(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }
}
