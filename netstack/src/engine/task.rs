//! [`crate::config::Drive::Runtime`]: a task on the application's tokio runtime runs each data
//! core. The task waits where a data-core thread would (the core's sockets, its send queue's
//! and wake-up eventfds, its timer), but in the runtime's own `epoll`, so the thread that
//! receives an answer, completes its one-shot channel and runs the task awaiting it is one
//! runtime thread: no eventfd write, no second thread woken, per answer. A service whose
//! requests come in on the same runtime (the block agent's NBD connections) then sleeps in one
//! place and wakes once per event.
//!
//! The task holds the core's lock only during a pass, as a data-core thread does, so a lone
//! request to a protocol still leaves from the thread that hands it in
//! ([`super::EngineShared::run_here`]). After a pass that did work it yields, so the tasks
//! the pass completed run before the next pass (their replies go out, their next requests
//! come in and leave together).
//!
//! The core's backstop thread ([`super::drive::AppDrive::backstop`]) stays asleep on a timer
//! while the task is alive: the task marks itself alive at least every [`HEARTBEAT_NS`],
//! and the backstop takes over only after [`HANDOFF_NS`] without a mark (a runtime blocked or
//! shut down). It then runs the core as a data-core thread until the task comes back.

use super::drive::AppDrive;
use super::rx::ReadyFds;
use super::Fds;
use std::future::poll_fn;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// The longest a driver task waits without a pass (it marks itself alive then).
const HEARTBEAT_NS: u64 = 10_000_000;

/// How long after the driver task's last mark the backstop takes the core over.
pub(super) const HANDOFF_NS: u64 = 50_000_000;

/// A descriptor the engine owns, watched by the runtime's reactor (never closed through this).
struct Watched(RawFd);

impl AsRawFd for Watched {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// Starts the driver task of each core of `d` on the runtime of the calling thread.
pub(super) fn spawn(d: &Arc<AppDrive>, cores: usize) -> std::io::Result<()> {
    let rt = tokio::runtime::Handle::try_current()
        .map_err(|_| std::io::Error::other("drive = runtime: open the context on a tokio runtime's thread"))?;
    for i in 0..cores {
        rt.spawn(run(d.clone(), i));
    }
    Ok(())
}

/// What one turn of a driver task found.
enum Step {
    /// Another thread runs a pass: its pass does the work.
    Busy,
    /// The pass did work: more may be waiting.
    Worked,
    /// A post raced with the sleep: go round again.
    Again,
    /// Nothing to do: wait on these descriptors, until this engine time at the latest.
    Sleep(Fds, u64),
}

/// One turn of core `i`, receiving on the ports in `ready` (synchronous: the core's lock is
/// never held across an await).
fn step(d: &AppDrive, i: usize, ready: &mut ReadyFds) -> Step {
    let (cell, shared) = d.core(i);
    let now = shared.now();
    d.touch(now);
    let Some(mut core) = cell.try_lock() else {
        return Step::Busy;
    };
    // `ready` was read just now (`take_ready`): what the ports it leaves out had by now is
    // nothing, so the timers' receive horizon moves here too (`lateness`), not only at a wake
    core.late.ready_as_of(now);
    let pass = core.poll_ready(now, &*shared.link, Some(ready));
    if pass.work {
        shared.stats.task_passes.inc();
        return Step::Worked;
    }
    let Some((fds, wait)) = core.prepare_sleep(pass.next_deadline) else {
        return Step::Again;
    };
    let until = shared.now() + wait.min(HEARTBEAT_NS);
    shared.sleeping_until.store(until, Ordering::Release);
    shared.timer.arm_at(until);
    Step::Sleep(fds, until)
}

/// Core `i`'s driver: passes while there is work, then a wait on its descriptors.
async fn run(d: Arc<AppDrive>, i: usize) {
    let shared = d.core(i).1.clone();
    // declared after `d`, so dropped before it: the descriptors it watches, which `d` keeps
    // open, outlive their registrations
    let mut watched: Vec<AsyncFd<Watched>> = Vec::new();
    let mut ready = ReadyFds::default();
    while !shared.stop.load(Ordering::Relaxed) {
        take_ready(&watched, &mut ready);
        let (fds, until) = match step(&d, i, &mut ready) {
            Step::Busy | Step::Worked => {
                // the tasks the pass completed run first (their replies go out, their next
                // requests are handed in and leave with the next pass)
                tokio::task::yield_now().await;
                continue;
            }
            Step::Again => {
                // traffic the descriptors do not show (a shared-memory ring): every port once
                ready.all = true;
                continue;
            }
            Step::Sleep(fds, until) => (fds, until),
        };
        match watch(&mut watched, &fds, &mut ready) {
            Ok(()) => readable(&watched).await,
            Err(e) => {
                // no reactor registration (descriptor limit): wait out the deadline
                tracing::warn!("engine driver task: watching the core's descriptors: {e}");
                tokio::time::sleep(std::time::Duration::from_nanos(until.saturating_sub(shared.now()))).await;
            }
        }
        take_ready(&watched, &mut ready);
        shared.sleeping_until.store(0, Ordering::Release);
        d.core(i).0.lock().woke(Some(&ready.ready));
    }
}

/// Registers `fds` with the reactor, in place of what was registered before, when they changed
/// (a multipath client's path moved to another port, a client came or went).
fn watch(watched: &mut Vec<AsyncFd<Watched>>, fds: &[RawFd], ready: &mut ReadyFds) -> std::io::Result<()> {
    if watched.len() == fds.len() && watched.iter().zip(fds).all(|(w, &fd)| w.get_ref().0 == fd) {
        return Ok(());
    }
    watched.clear();
    // until registered, a descriptor is received on in every pass (and a new registration
    // reports one that is readable already)
    ready.watched.clear();
    for &fd in fds {
        // SAFETY: `fd` is one of the core's descriptors (its sockets, eventfds and timer),
        // which the engine's shared state and the core keep open while the driver task holds
        // its `AppDrive`; the task drops `watched` first (see `run`), and `Watched` always
        // returns this descriptor.
        let w = unsafe { AsyncFd::register_with_interest(Watched(fd), Interest::READABLE) };
        watched.push(w.map_err(|e| e.into_parts().1)?);
    }
    ready.watched.extend_from_slice(fds);
    Ok(())
}

/// Adds to `ready` the descriptors the reactor reported readable since the last look, and
/// clears that readiness: a datagram that arrives after this is either received by the pass
/// that follows or makes its descriptor ready again (the reactor is edge-triggered).
fn take_ready(watched: &[AsyncFd<Watched>], ready: &mut ReadyFds) {
    let mut cx = Context::from_waker(Waker::noop());
    for w in watched {
        if let Poll::Ready(Ok(mut guard)) = w.poll_read_ready(&mut cx) {
            guard.clear_ready();
            let fd = w.get_ref().0;
            if !ready.ready.contains(&fd) {
                ready.ready.push(fd);
            }
        }
    }
}

/// Waits until one of `watched` is readable (its readiness is taken by [`take_ready`]).
async fn readable(watched: &[AsyncFd<Watched>]) {
    poll_fn(|cx| {
        let mut ready = false;
        for w in watched {
            ready |= w.poll_read_ready(cx).is_ready();
        }
        if ready {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
    .await
}
