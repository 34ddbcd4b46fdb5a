//! Run-to-completion ([`crate::config::Drive::Application`]): the application thread that posts, polls or
//! waits runs its context's data cores itself, in its own call, with no hand-off to another
//! thread (eRPC's discipline). A packet's receive, the transport's work and the completion all
//! happen in the thread that then reads the completion.
//!
//! A core's state sits behind a mutex that callers only ever `try_lock`: whoever holds it runs
//! one pass ([`DataCore::pass`]); a caller that finds it held skips it (the holder's pass does
//! the work), so a handler running on the core that posts again cannot deadlock.
//!
//! A **backstop** thread per core keeps the context alive when the application stops calling:
//! while an application thread ran the core within the last [`HANDOFF_NS`] it sleeps on a timer
//! (no descriptor, so a packet the application receives does not wake it too); after that, or at
//! once when the application blocks in [`AppDrive::release`], it runs the core as a data-core
//! thread would (the same poll mode), releasing the core's lock whenever it sleeps. The target
//! of one-sided operations that never polls, retransmission timers and blocked waiters all keep
//! working.

use super::{DataCore, EngineShared, Idle};
use crate::link::sys::{self, EventFd};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// How long after an application thread last ran a core its backstop thread leaves it alone.
pub(crate) const HANDOFF_NS: u64 = 1_000_000;

/// The data cores of a run-to-completion context, shared by its application threads and its
/// backstop threads.
pub(crate) struct AppDrive {
    cores: Vec<Arc<Mutex<DataCore>>>,
    shared: Vec<Arc<EngineShared>>,
    /// Engine-clock time an application thread last ran the cores; 0 when it released them.
    last: AtomicU64,
    /// Rung by [`AppDrive::release`]: the backstops take over at once.
    released: EventFd,
}

impl AppDrive {
    pub(super) fn new(cores: Vec<Arc<Mutex<DataCore>>>) -> std::io::Result<AppDrive> {
        Ok(AppDrive {
            shared: cores.iter().map(|c| c.lock().shared.clone()).collect(),
            cores,
            last: AtomicU64::new(0),
            released: EventFd::new()?,
        })
    }

    /// Runs one pass of every core no other thread is running; returns whether any did work.
    /// Called by posts, polls and waits of the context's application threads.
    pub(crate) fn progress(&self) -> bool {
        self.last.store(self.shared[0].now().max(1), Ordering::Relaxed);
        let mut work = false;
        for c in &self.cores {
            if let Some(mut core) = c.try_lock() {
                if core.pass().work {
                    core.shared.stats.application_passes.inc();
                    work = true;
                }
            }
        }
        work
    }

    /// The application thread is about to block: its backstop threads run the cores from now.
    pub(crate) fn release(&self) {
        self.last.store(0, Ordering::Relaxed);
        self.released.notify();
    }

    /// Whether the application drove the cores within [`HANDOFF_NS`] of `now`; if so, until when.
    fn driven_until(&self, now: u64) -> Option<u64> {
        let last = self.last.load(Ordering::Relaxed);
        (last != 0 && now < last + HANDOFF_NS).then_some(last + HANDOFF_NS)
    }

    /// The backstop thread of core `i`: runs it while the application does not.
    pub(super) fn backstop(&self, i: usize) {
        sys::set_timer_slack_ns(1_000);
        let shared = &self.shared[i];
        let mut idle_since: Option<Instant> = None;
        while !shared.stop.load(Ordering::Relaxed) {
            let now = shared.now();
            if let Some(until) = self.driven_until(now) {
                idle_since = None;
                let _ = sys::ppoll_readable(&[self.released.fd(), shared.wake.fd()], until - now);
                self.released.drain();
                shared.wake.drain();
                continue;
            }
            let Some(mut core) = self.cores[i].try_lock() else {
                std::thread::yield_now();
                continue;
            };
            let pass = core.pass();
            if pass.work {
                shared.stats.engine_thread_passes.inc();
                idle_since = None;
                continue;
            }
            let since = *idle_since.get_or_insert_with(Instant::now);
            match core.idle(pass.next_deadline, since) {
                Idle::Spin => {
                    drop(core);
                    std::hint::spin_loop()
                }
                Idle::Yield => {
                    drop(core);
                    std::thread::yield_now()
                }
                Idle::Sleep => {
                    // sleep without the lock, so an application thread that comes back runs
                    // the core at once; the eventfd `release` rings is not watched here (the
                    // core is already ours)
                    let Some((fds, wait)) = core.prepare_sleep(pass.next_deadline) else {
                        continue;
                    };
                    drop(core);
                    let _ = sys::ppoll_readable(&fds, wait);
                    self.cores[i].lock().woke();
                }
            }
        }
    }
}
