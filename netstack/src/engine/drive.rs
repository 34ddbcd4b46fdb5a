//! The cores as the application side runs them: run to completion by its threads (below), or
//! by a task per core on its runtime ([`crate::config::Drive::Runtime`], [`super::task`]),
//! both with a backstop thread per core.
//!
//! Run-to-completion ([`crate::config::Drive::Application`]): the application thread that posts, polls or
//! waits runs its context's data cores itself, in its own call, with no hand-off to another
//! thread (eRPC's discipline). A packet's receive, the transport's work and the completion all
//! happen in the thread that then reads the completion.
//!
//! A core's state sits behind a mutex that callers only ever `try_lock`: whoever holds it runs
//! one pass ([`DataCore::poll_app`]: it sends what is pending, then receives, so a completion
//! reaches the application before the system call that acknowledges it, and that ACK leaves
//! with what the application posts next); a caller that finds it held skips it (the holder's
//! pass does the work), so a handler running on the core that posts again cannot deadlock.
//!
//! A **backstop** thread per core keeps the context alive when the application stops calling:
//! while an application thread ran the core within the last [`HANDOFF_NS`] it sleeps on a timer
//! (no descriptor, so a packet the application receives does not wake it too); after that, or at
//! once when the application blocks in [`AppDrive::release`], it runs the core as a data-core
//! thread would (the same poll mode), releasing the core's lock whenever it sleeps. The target
//! of one-sided operations that never polls, retransmission timers and blocked waiters all keep
//! working.

use super::{DataCore, EngineShared};
use crate::config::Drive;
use crate::link::sys::{self, EventFd};
use parking_lot::Mutex;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// How long after an application thread last ran a core its backstop thread leaves it alone.
pub(crate) const HANDOFF_NS: u64 = 1_000_000;

/// Run to completion, a datagram that arrives while the application has not run the core for
/// this long is taken in by the backstop at once, as an RNIC places a WRITE without the program
/// calling anything (a program that spins on the last byte of its buffer, as `ib_write_lat`
/// does, waits for it). An application that ran the core more recently is given until this
/// long after its last call to call again; if it does, it is polling and receives its own
/// arrivals.
pub(crate) const ARRIVAL_GRACE_NS: u64 = 20_000;

/// After the backstop found the application polling (or running the core), it stops watching
/// arrivals for this long, doubled each time it finds it polling again (up to the hand-off
/// time) and back to this after it took in an arrival itself: a program that polls all along
/// costs a few wake-ups per hand-off time, one that stops calling waits at most this long more.
pub(crate) const CALM_MIN_NS: u64 = 50_000;

/// The data cores of a run-to-completion context, shared by its application threads and its
/// backstop threads.
pub(crate) struct AppDrive {
    cores: Vec<Arc<Mutex<DataCore>>>,
    shared: Vec<Arc<EngineShared>>,
    /// Engine-clock time an application thread last ran the cores; 0 when it released them.
    last: AtomicU64,
    /// Per core: an application call found it held by another thread and skipped it.
    skipped: Vec<AtomicBool>,
    /// Rung by [`AppDrive::release`]: the backstops take over at once.
    released: EventFd,
    /// Who drives the cores ([`Drive::Application`] or [`Drive::Runtime`]), and so how long
    /// the backstops wait before they take over.
    drive: Drive,
}

impl AppDrive {
    pub(super) fn new(cores: Vec<Arc<Mutex<DataCore>>>, drive: Drive) -> std::io::Result<AppDrive> {
        Ok(AppDrive {
            shared: cores.iter().map(|c| c.lock().shared.clone()).collect(),
            skipped: cores.iter().map(|_| AtomicBool::new(false)).collect(),
            cores,
            last: AtomicU64::new(0),
            released: EventFd::new()?,
            drive,
        })
    }

    /// Core `i` and its shared state (for its driver task).
    pub(super) fn core(&self, i: usize) -> (&Arc<Mutex<DataCore>>, &Arc<EngineShared>) {
        (&self.cores[i], &self.shared[i])
    }

    /// The application side ran the cores (or, a driver task, is alive and watching them) at
    /// engine time `now`.
    pub(super) fn touch(&self, now: u64) {
        self.last.store(now.max(1), Ordering::Relaxed);
    }

    /// Whether an application call found core `i` held by another thread (and so skipped it)
    /// since the last time this was asked.
    pub(super) fn take_skipped(&self, i: usize) -> bool {
        self.skipped.get(i).is_some_and(|s| s.swap(false, Ordering::Relaxed))
    }

    /// Wakes the backstops (the engine stops).
    pub(super) fn stopping(&self) {
        self.released.notify();
    }

    /// Who drives the cores.
    pub(super) fn drive(&self) -> Drive {
        self.drive
    }

    fn handoff_ns(&self) -> u64 {
        match self.drive {
            Drive::Runtime => super::task::HANDOFF_NS,
            _ => HANDOFF_NS,
        }
    }

    /// Runs one pass of every core no other thread is running; returns whether any did work.
    /// Called by posts, polls and waits of the context's application threads.
    pub(crate) fn progress(&self) -> bool {
        self.touch(self.shared[0].now());
        let mut work = false;
        for (i, (c, shared)) in self.cores.iter().zip(&self.shared).enumerate() {
            if let Some(mut core) = c.try_lock() {
                if core.poll_app(shared.now(), &*shared.link) {
                    core.shared.stats.application_passes.inc();
                    work = true;
                }
            } else if !self.skipped[i].swap(true, Ordering::Relaxed) {
                // the thread holding the core may have asked `take_skipped` already and be
                // about to wait until the hand-off time: wake it, so the missed pass runs now
                // (once per flag set, so threads that keep finding the core held cost one
                // eventfd write until the flag is taken)
                shared.wake.notify();
            }
        }
        work
    }

    /// The application thread is about to block: its backstop threads run the cores from now.
    pub(crate) fn release(&self) {
        self.last.store(0, Ordering::Relaxed);
        self.released.notify();
    }

    /// Whether the application drove the cores within the hand-off time ([`HANDOFF_NS`], or
    /// a driver task's [`super::task::HANDOFF_NS`]) of `now`; if so, until when.
    pub(super) fn driven_until(&self, now: u64) -> Option<u64> {
        let last = self.last.load(Ordering::Relaxed);
        let until = last + self.handoff_ns();
        (last != 0 && now < until).then_some(until)
    }

    /// While the application drives the cores: waits until it stops (at the hand-off time, or
    /// at once when it blocks in [`AppDrive::release`]) or the engine is told to stop. A
    /// driver task watches the core's wake-up eventfd itself: the backstop leaves it alone,
    /// or every command at depth would wake this thread too.
    ///
    /// Run to completion, the wait also watches `arrivals` (the core's receive descriptors;
    /// `None` when the application held the core, so is running it now) and returns true when
    /// a datagram waits that the application does not take in: it has not run the core for
    /// [`ARRIVAL_GRACE_NS`]. The caller then runs one pass. `calm` is how long the wait leaves
    /// arrivals unwatched after it finds the application polling ([`CALM_MIN_NS`]; the caller
    /// keeps it between waits).
    pub(super) fn wait_while_driven(
        &self,
        shared: &EngineShared,
        until: u64,
        now: u64,
        arrivals: Option<&[RawFd]>,
        calm: &mut u64,
    ) -> bool {
        if self.drive == Drive::Runtime {
            let _ = sys::ppoll_readable(&[self.released.fd()], until - now);
            self.released.drain();
            return false;
        }
        let controls = [self.released.fd(), shared.wake.fd()];
        let Some(arrivals) = arrivals.filter(|a| !a.is_empty()) else {
            // the application is running the core this moment
            self.calm_down(shared, &controls, until, calm);
            return false;
        };
        let mut fds: smallvec::SmallVec<[RawFd; 8]> = controls.iter().copied().collect();
        fds.extend_from_slice(arrivals);
        let ready = sys::ppoll_ready(&fds, until - now).unwrap_or_default();
        if ready.contains(&shared.wake.fd()) {
            shared.wake.drain();
        }
        if ready.contains(&self.released.fd()) {
            self.released.drain();
            return false;
        }
        if !ready.iter().any(|fd| arrivals.contains(fd)) {
            return false;
        }
        // a datagram waits: is the application polling (it will take it in), or not calling?
        let seen = self.last.load(Ordering::Relaxed);
        let t = shared.now();
        let grace_end = seen.saturating_add(ARRIVAL_GRACE_NS);
        if seen != 0 && t < grace_end {
            self.wait_controls(shared, &controls, grace_end - t);
            if self.last.load(Ordering::Relaxed) != seen {
                self.calm_down(shared, &controls, until, calm);
                return false;
            }
        }
        *calm = CALM_MIN_NS;
        true
    }

    /// The application polls: arrivals are left to it for `calm` (at most until `until`), and
    /// the next such wait is twice as long, up to the hand-off time.
    fn calm_down(&self, shared: &EngineShared, controls: &[RawFd], until: u64, calm: &mut u64) {
        let t = shared.now();
        if t < until {
            self.wait_controls(shared, controls, (until - t).min(*calm));
        }
        *calm = (*calm * 2).min(self.handoff_ns());
    }

    /// Waits up to `ns` on the control eventfds alone.
    fn wait_controls(&self, shared: &EngineShared, controls: &[RawFd], ns: u64) {
        let _ = sys::ppoll_readable(controls, ns);
        shared.wake.drain();
        self.released.drain();
    }

    /// The backstop thread of core `i`: runs it while the application does not.
    pub(super) fn backstop(&self, i: usize) {
        DataCore::run(self.cores[i].clone(), Some(self));
    }
}
