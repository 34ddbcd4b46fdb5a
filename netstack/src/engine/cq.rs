//! Completion queue storage shared by the engine (producer) and the application (consumer).

use crate::work::Wc;
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A completion queue's ring, with blocking and async waiting.
pub struct CqShared {
    q: Mutex<VecDeque<Wc>>,
    cv: Condvar,
    notify: tokio::sync::Notify,
    cap: usize,
    overflows: AtomicU64,
}

impl CqShared {
    pub fn new(cap: usize) -> CqShared {
        CqShared {
            q: Mutex::new(VecDeque::with_capacity(cap.min(1 << 16))),
            cv: Condvar::new(),
            notify: tokio::sync::Notify::new(),
            cap,
            overflows: AtomicU64::new(0),
        }
    }

    /// Adds a completion. A full queue keeps the completion and counts an overrun (ibverbs would
    /// raise a CQ error event; losing a completion would lose track of a buffer).
    pub fn push(&self, wc: Wc) {
        let mut q = self.q.lock();
        if q.len() >= self.cap {
            self.overflows.fetch_add(1, Ordering::Relaxed);
        }
        q.push_back(wc);
        drop(q);
        self.cv.notify_all();
        self.notify.notify_one();
    }

    /// Moves up to `out.len()` completions into `out`; returns how many.
    pub fn poll(&self, out: &mut [Wc]) -> usize {
        let mut q = self.q.lock();
        let n = out.len().min(q.len());
        for (o, w) in out.iter_mut().zip(q.drain(..n)) {
            *o = w;
        }
        n
    }

    /// Blocks until at least one completion is queued or `timeout` passes; returns whether one is.
    pub fn wait(&self, timeout: Duration) -> bool {
        let mut q = self.q.lock();
        if q.is_empty() {
            self.cv.wait_for(&mut q, timeout);
        }
        !q.is_empty()
    }

    /// Waits asynchronously until a completion is queued.
    pub async fn wait_async(&self) {
        loop {
            let n = self.notify.notified();
            if !self.q.lock().is_empty() {
                return;
            }
            n.await;
        }
    }

    pub fn len(&self) -> usize {
        self.q.lock().len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Times completions arrived while the queue held `cap` or more.
    pub fn overruns(&self) -> u64 {
        self.overflows.load(Ordering::Relaxed)
    }
}
