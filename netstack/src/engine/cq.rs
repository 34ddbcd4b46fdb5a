//! Completion queues over notification pipes: one pipe per data core, whose thread is that
//! pipe's only producer; the application side polls all of them (consumers serialize on a lock,
//! as `ibv_poll_cq` callers do). Completions of one QP come from one core, so they stay in
//! order; completions of QPs on different cores have no order between them, as with ibverbs.

use crate::link::sys;
use crate::pipe::{pipe, Consumer, Producer};
use crate::work::Wc;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A completion queue's pipes, with blocking and async waiting.
pub(crate) struct CqShared {
    /// `producers[i]` is written only by data core `i` (the lock is never contended).
    producers: Vec<Mutex<Producer<Wc>>>,
    consumers: Mutex<Vec<Consumer<Wc>>>,
    /// An async waiter is parked: producers notify it.
    async_waiting: AtomicBool,
    notify: tokio::sync::Notify,
    overruns: AtomicU64,
    /// Completions produced so far (what a RedN WAIT counts; never reset by polling).
    produced: Arc<AtomicU64>,
    /// A full queue drops new completions (counting them as produced) instead of keeping them
    /// in their QP: for queues only WAITs look at (`IGNORE_OVERRUN` in ibverbs).
    ignore_overrun: bool,
}

impl CqShared {
    /// A CQ with room for `cap` completions per data core, for `cores` data cores; with
    /// `ignore_overrun` a full queue drops completions.
    pub(crate) fn with_overrun(cap: usize, cores: usize, ignore_overrun: bool) -> std::io::Result<CqShared> {
        let mut producers = Vec::new();
        let mut consumers = Vec::new();
        for _ in 0..cores.max(1) {
            let (p, c) = pipe::<Wc>(cap.max(2), 16)?;
            producers.push(Mutex::new(p));
            consumers.push(c);
        }
        Ok(CqShared {
            producers,
            consumers: Mutex::new(consumers),
            async_waiting: AtomicBool::new(false),
            notify: tokio::sync::Notify::new(),
            overruns: AtomicU64::new(0),
            produced: Arc::new(AtomicU64::new(0)),
            ignore_overrun,
        })
    }

    /// Adds completions from data core `core`; returns how many fit (the rest stay with the
    /// caller, which retries: a full CQ loses nothing).
    pub(crate) fn push(&self, core: usize, wcs: impl IntoIterator<Item = Wc>) -> usize {
        let mut p = self.producers[core % self.producers.len()].lock();
        let mut n = 0;
        for wc in wcs {
            if p.try_push(wc).is_err() {
                self.overruns.fetch_add(1, Ordering::Relaxed);
                if !self.ignore_overrun {
                    break;
                }
            }
            n += 1;
        }
        p.notify();
        drop(p);
        self.produced.fetch_add(n as u64, Ordering::AcqRel);
        if n > 0 && self.async_waiting.load(Ordering::SeqCst) {
            self.notify.notify_one();
        }
        n
    }

    /// Completions waiting to be polled, and the room there is for them (over all pipes; a
    /// consumer publishes its position every few slots, so this may run a little high).
    pub(crate) fn occupancy(&self) -> (usize, usize) {
        self.producers.iter().fold((0, 0), |(used, cap), p| {
            let mut p = p.lock();
            let c = p.capacity();
            (used + c - p.free(), cap + c)
        })
    }

    /// Moves up to `out.len()` completions into `out`; returns how many.
    pub(crate) fn poll(&self, out: &mut [Wc]) -> usize {
        let mut cs = self.consumers.lock();
        let mut n = 0;
        for c in cs.iter_mut() {
            while n < out.len() {
                match c.pop() {
                    Some(w) => {
                        out[n] = w;
                        n += 1;
                    }
                    None => break,
                }
            }
        }
        n
    }

    /// Whether a completion is waiting.
    pub(crate) fn any_ready(&self) -> bool {
        self.consumers.lock().iter().any(|c| c.has_data())
    }

    /// Blocks until at least one completion is queued or `timeout` passes; returns whether one is.
    pub(crate) fn wait(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let fds = {
                let mut cs = self.consumers.lock();
                let mut fds = Vec::with_capacity(cs.len());
                for c in cs.iter_mut() {
                    if !c.prepare_sleep() {
                        // data arrived: undo the other sleeping flags
                        for c in cs.iter_mut() {
                            c.woke();
                        }
                        return true;
                    }
                    fds.push(c.wake_fd());
                }
                fds
            };
            let left = deadline.saturating_duration_since(Instant::now());
            if !left.is_zero() {
                let _ = sys::ppoll_readable(&fds, left.as_nanos() as u64);
            }
            let mut cs = self.consumers.lock();
            for c in cs.iter_mut() {
                c.woke();
            }
            if cs.iter().any(|c| c.has_data()) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
        }
    }

    /// Waits asynchronously until a completion is queued.
    pub(crate) async fn wait_async(&self) {
        loop {
            let n = self.notify.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            self.async_waiting.store(true, Ordering::SeqCst);
            if self.any_ready() {
                self.async_waiting.store(false, Ordering::SeqCst);
                return;
            }
            n.await;
            self.async_waiting.store(false, Ordering::SeqCst);
        }
    }

    /// Times a completion found its pipe full (it was kept and delivered later, or dropped
    /// when the queue ignores overruns).
    pub(crate) fn overruns(&self) -> u64 {
        self.overruns.load(Ordering::Relaxed)
    }

    /// Completions produced so far.
    pub(crate) fn produced(&self) -> &Arc<AtomicU64> {
        &self.produced
    }
}
