//! Batches of transfer requests and their status: per request (task) and for the whole batch.
//! A request is cut into slices; it completes when all of its slices have, and it fails with
//! the first slice failure's message (naming the peer, the path and the cause).

use parking_lot::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// READ copies remote memory into the local `source`; WRITE copies `source` to the remote.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Opcode {
    /// Copy from the target's memory into the local buffer.
    Read,
    /// Copy the local buffer into the target's memory.
    Write,
}

/// A handle of a segment opened with [`crate::TransferEngine::open_segment`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SegmentHandle(pub(crate) u64);

/// One transfer request (Mooncake's `TransferRequest`).
#[derive(Debug, Clone, Copy)]
pub struct TransferRequest {
    /// READ or WRITE.
    pub opcode: Opcode,
    /// Local address inside a registered buffer (the source of a WRITE, the destination of a READ).
    pub source: u64,
    /// The target segment (from `TransferEngine::open_segment`).
    pub target: SegmentHandle,
    /// Remote virtual address inside one of the target segment's registered buffers.
    pub target_offset: u64,
    /// Bytes to move.
    pub length: u64,
}

/// The state of a request or batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransferState {
    /// Allocated, not yet submitted.
    Waiting,
    /// Submitted, slices in flight.
    Pending,
    /// All data placed and visible at the target (WRITE) or here (READ).
    Completed,
    /// Failed; the message names the peer, the path and the cause.
    Failed(String),
    /// Not done within the transfer timeout; the message says what was outstanding where.
    TimedOut(String),
}

impl TransferState {
    /// Whether the state can no longer change (completed, failed or timed out).
    pub fn is_final(&self) -> bool {
        !matches!(self, TransferState::Waiting | TransferState::Pending)
    }
}

/// A request's (or a batch's) state and how many bytes are known to be transferred.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferStatus {
    /// Where the request (or batch) stands.
    pub state: TransferState,
    /// A lower bound while pending; the request's length once completed.
    pub transferred_bytes: u64,
}

/// A small message delivered to the target engine with (after) a batch: "these KV blocks have
/// landed". `name` says who sent it or what it is about; `msg` is the payload.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Notification {
    /// Who sent the notification or what it is about (e.g. a request id).
    pub name: String,
    /// The payload (e.g. the block ids that landed).
    pub msg: String,
}

/// Largest encoded notification (it travels in one message).
pub const MAX_NOTIFY_BYTES: usize = 3072;

pub(crate) struct Task {
    pub state: TransferState,
    pub len: u64,
    pub done: u64,
    pub slices_left: u32,
    pub deadline: Instant,
    /// The peer's name and address, for messages.
    pub peer: String,
    /// The last slice error (retried), for the timeout message.
    pub last_error: Option<String>,
}

#[derive(Default)]
pub(crate) struct BatchInner {
    pub tasks: Vec<Task>,
    pub capacity: usize,
    /// The batch's notification until it is delivered (or given up): the target segment's
    /// name and the encoded notification.
    pub notify_pending: Option<(String, Vec<u8>)>,
    /// The notification is on its way (taken, not yet acknowledged).
    pub notify_inflight: bool,
    /// GPU destinations of READs: mirror ranges copied to the device once the batch completed.
    pub gpu_after: Vec<(
        std::sync::Arc<crate::gpu::Device>,
        std::sync::Arc<netstack::mem::Region>,
        usize,
        usize,
    )>,
    pub notify_error: Option<String>,
}

/// A batch shared between the API and the transports' completion paths.
pub(crate) struct Batch {
    pub inner: Mutex<BatchInner>,
    pub cv: Condvar,
}

impl Batch {
    pub(crate) fn new(capacity: usize) -> Batch {
        Batch {
            inner: Mutex::new(BatchInner {
                capacity,
                ..Default::default()
            }),
            cv: Condvar::new(),
        }
    }

    /// A slice of `task` finished placing `bytes`.
    pub(crate) fn slice_done(&self, task: usize, bytes: u64) -> bool {
        let mut b = self.inner.lock();
        let t = &mut b.tasks[task];
        if t.state != TransferState::Pending {
            return false;
        }
        t.done += bytes;
        t.slices_left -= 1;
        if t.slices_left == 0 {
            t.state = TransferState::Completed;
            t.done = t.len;
            metrics::counter!("flexns_kvcache_requests_total", "result" => "completed").increment(1);
            metrics::counter!("flexns_kvcache_bytes_total").increment(t.len);
        }
        let all = b.tasks.iter().all(|t| t.state.is_final());
        drop(b);
        if all {
            self.cv.notify_all();
        }
        all
    }

    /// Notes a retried slice error of `task` (for the timeout message).
    pub(crate) fn note_error(&self, task: usize, e: &str) {
        self.inner.lock().tasks[task].last_error = Some(e.to_string());
    }

    /// Takes the notification to send once every task is final: `Some` only when all completed
    /// (a failed batch's notification is not sent, and the batch says why).
    pub(crate) fn take_notify(&self) -> Option<(String, Vec<u8>)> {
        let mut b = self.inner.lock();
        if !b.tasks.iter().all(|t| t.state.is_final()) {
            return None;
        }
        let n = b.notify_pending.take()?;
        if b.tasks.iter().all(|t| t.state == TransferState::Completed) {
            b.notify_inflight = true;
            Some(n)
        } else {
            b.notify_error = Some("notification not sent: a request of the batch did not complete".into());
            drop(b);
            self.cv.notify_all();
            None
        }
    }

    /// The notification was delivered (`Ok`) or could not be (`Err` with the reason).
    pub(crate) fn notify_done(&self, r: Result<(), String>) {
        let mut b = self.inner.lock();
        b.notify_inflight = false;
        if let Err(e) = r {
            b.notify_error = Some(e);
        }
        drop(b);
        self.cv.notify_all();
    }

    /// `task` failed (the first failure wins).
    pub(crate) fn fail(&self, task: usize, state: TransferState) {
        let mut b = self.inner.lock();
        if b.tasks[task].state == TransferState::Pending {
            let cause = match &state {
                TransferState::TimedOut(_) => "timed_out",
                _ => "failed",
            };
            metrics::counter!("flexns_kvcache_requests_total", "result" => cause).increment(1);
            b.tasks[task].state = state;
        }
        drop(b);
        self.cv.notify_all();
    }

    /// Whether every task is final.
    pub(crate) fn data_done(&self) -> bool {
        self.inner.lock().tasks.iter().all(|t| t.state.is_final())
    }

    pub(crate) fn task_status(&self, task: usize) -> Option<TransferStatus> {
        let b = self.inner.lock();
        b.tasks.get(task).map(|t| TransferStatus {
            state: t.state.clone(),
            transferred_bytes: t.done,
        })
    }

    /// The batch as a whole: Completed when every task is (and the notification delivered),
    /// else the first failure or timeout, else Pending (Waiting before any submit).
    pub(crate) fn status(&self) -> TransferStatus {
        let b = self.inner.lock();
        let bytes = b.tasks.iter().map(|t| t.done).sum();
        let st = |state| TransferStatus {
            state,
            transferred_bytes: bytes,
        };
        if b.tasks.is_empty() {
            return st(TransferState::Waiting);
        }
        if let Some(t) = b.tasks.iter().find(|t| matches!(t.state, TransferState::Failed(_))) {
            return st(t.state.clone());
        }
        if let Some(t) = b.tasks.iter().find(|t| matches!(t.state, TransferState::TimedOut(_))) {
            return st(t.state.clone());
        }
        if b.tasks.iter().any(|t| !t.state.is_final()) || b.notify_pending.is_some() || b.notify_inflight {
            return st(TransferState::Pending);
        }
        if let Some(e) = &b.notify_error {
            return st(TransferState::Failed(e.clone()));
        }
        st(TransferState::Completed)
    }

    /// Blocks until the batch is final or `timeout` passes; returns its status.
    pub(crate) fn wait(&self, timeout: Duration) -> TransferStatus {
        let until = Instant::now() + timeout;
        loop {
            let s = self.status();
            if s.state.is_final() {
                return s;
            }
            let mut b = self.inner.lock();
            if b.tasks.is_empty() {
                drop(b);
                return self.status(); // never submitted: Waiting
            }
            let busy = b.tasks.iter().any(|t| !t.state.is_final()) || b.notify_pending.is_some() || b.notify_inflight;
            if !busy {
                continue;
            }
            if self.cv.wait_until(&mut b, until).timed_out() {
                drop(b);
                return self.status();
            }
        }
    }

    /// Marks tasks still pending past their deadline TimedOut, naming the peer, how long it
    /// was given and the last (retried) error; returns whether any expired.
    pub(crate) fn expire(&self, now: Instant, timeout: Duration) -> bool {
        let mut b = self.inner.lock();
        let mut any = false;
        for t in b.tasks.iter_mut() {
            if t.state == TransferState::Pending && now >= t.deadline {
                let last = t.last_error.as_deref().unwrap_or("none (no completion, no error)");
                t.state = TransferState::TimedOut(format!(
                    "{}: {} of {} B not transferred within {timeout:?}; last error: {last}",
                    t.peer,
                    t.len - t.done,
                    t.len
                ));
                any = true;
            }
        }
        drop(b);
        if any {
            self.cv.notify_all();
        }
        any
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(lens: &[u64], slices: u32, deadline: Instant) -> Batch {
        let b = Batch::new(lens.len());
        b.inner.lock().tasks = lens
            .iter()
            .map(|&len| Task {
                state: TransferState::Pending,
                len,
                done: 0,
                slices_left: slices,
                deadline,
                peer: "peer decode-0 (10.0.0.2:15000 over flexns)".into(),
                last_error: None,
            })
            .collect();
        b
    }

    #[test]
    fn statuses_follow_slices_failures_and_notifications() {
        let far = Instant::now() + Duration::from_secs(60);
        assert_eq!(Batch::new(2).status().state, TransferState::Waiting);
        let b = batch(&[100, 50], 2, far);
        assert!(!b.slice_done(0, 60));
        assert_eq!(b.task_status(0).unwrap().transferred_bytes, 60);
        assert_eq!(b.status().state, TransferState::Pending);
        b.slice_done(0, 40);
        b.slice_done(1, 25);
        assert!(b.slice_done(1, 25), "the last slice completes the batch");
        assert_eq!(b.status().state, TransferState::Completed);
        assert_eq!(b.status().transferred_bytes, 150);
        // with a notification the batch stays pending until it is delivered
        let b = batch(&[10], 1, far);
        b.inner.lock().notify_pending = Some(("decode-0".into(), b"{}".to_vec()));
        assert!(b.slice_done(0, 10));
        assert_eq!(b.status().state, TransferState::Pending);
        assert!(b.take_notify().is_some());
        assert_eq!(b.status().state, TransferState::Pending, "in flight");
        b.notify_done(Ok(()));
        assert_eq!(b.status().state, TransferState::Completed);
        // a failed request: the notification is not sent and the batch says why
        let b = batch(&[10, 10], 1, far);
        b.inner.lock().notify_pending = Some(("decode-0".into(), b"{}".to_vec()));
        b.fail(0, TransferState::Failed("peer gone".into()));
        b.slice_done(1, 10);
        assert!(b.take_notify().is_none());
        assert_eq!(b.status().state, TransferState::Failed("peer gone".into()));
    }

    #[test]
    fn overdue_requests_time_out_naming_the_peer_and_last_error() {
        let b = batch(&[4096], 1, Instant::now());
        b.note_error(0, "qp 0x12 (paths 0:down 1:up): WRITE of 4096 B: retrying");
        assert!(b.expire(Instant::now(), Duration::from_secs(30)));
        match b.status().state {
            TransferState::TimedOut(m) => {
                assert!(
                    m.contains("decode-0") && m.contains("30s") && m.contains("paths 0:down"),
                    "{m}"
                )
            }
            s => panic!("{s:?}"),
        }
        assert!(!b.slice_done(0, 4096), "a late completion changes nothing");
        assert!(matches!(
            b.wait(Duration::from_millis(1)).state,
            TransferState::TimedOut(_)
        ));
    }
}
