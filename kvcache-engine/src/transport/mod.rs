//! The two data transports behind the engine: [`flexns`] (one-sided READ/WRITE on RC queue
//! pairs of the flexns stack, spraying over paths) and [`tcp`] (kernel TCP lanes). Both take
//! [`Slice`]s, place data, report each slice to its [`Batch`], retry a failed slice on another
//! queue pair or lane, and deliver a batch's notification after its data.

pub mod flexns;
pub mod tcp;

use crate::batch::{Batch, Notification, Opcode, TransferState, MAX_NOTIFY_BYTES};
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

/// One slice of a request: at most `slice_size` bytes, placed independently.
pub(crate) struct Slice {
    pub batch: Arc<Batch>,
    pub task: usize,
    pub op: Opcode,
    /// Local address (registered) and its lkey (flexns).
    pub local: u64,
    pub lkey: u32,
    /// Remote address and the rkey of the buffer holding it (flexns).
    pub remote: u64,
    pub rkey: u32,
    pub len: u32,
    /// Attempts made so far.
    pub attempts: u32,
}

impl Slice {
    /// Retries the slice (returns it) or fails its request when `max` attempts are spent.
    pub fn retry_or_fail(mut self, max: u32, error: String) -> Option<Slice> {
        self.attempts += 1;
        if self.attempts >= max {
            self.batch.fail(
                self.task,
                TransferState::Failed(format!("{error} (after {} attempts)", self.attempts)),
            );
            None
        } else {
            self.batch.note_error(self.task, &error);
            tracing::debug!("retrying a slice: {error}");
            Some(self)
        }
    }

    /// Fails the slice's request now (an error no retry can fix).
    pub fn fail(self, error: String) {
        self.batch.fail(self.task, TransferState::Failed(error));
    }

    pub fn describe(&self) -> String {
        let op = match self.op {
            Opcode::Read => "READ",
            Opcode::Write => "WRITE",
        };
        format!("{op} of {} B at remote {:#x}", self.len, self.remote)
    }
}

/// Most notifications kept for the application (at most 3 KiB each: 192 MiB); a peer's
/// notification past it is refused with an error (the tcp sender sees it; the flexns receiver
/// logs it), so peers cannot grow an engine's memory when its application stops taking them.
pub(crate) const MAX_QUEUED_NOTIFIES: usize = 1 << 16;

/// Notifications received by this engine, oldest first.
#[derive(Default)]
pub(crate) struct Notifies {
    q: Mutex<VecDeque<Notification>>,
    cv: Condvar,
}

impl Notifies {
    pub fn push_encoded(&self, bytes: &[u8]) -> Result<(), String> {
        let n = decode_notify(bytes)?;
        let mut q = self.q.lock();
        if q.len() >= MAX_QUEUED_NOTIFIES {
            return Err(format!(
                "the receiver holds {} notifications its application has not taken",
                q.len()
            ));
        }
        q.push_back(n);
        drop(q);
        self.cv.notify_all();
        Ok(())
    }

    pub fn take_all(&self) -> Vec<Notification> {
        self.q.lock().drain(..).collect()
    }

    pub fn wait_one(&self, timeout: Duration) -> Option<Notification> {
        let until = std::time::Instant::now() + timeout;
        let mut q = self.q.lock();
        loop {
            if let Some(n) = q.pop_front() {
                return Some(n);
            }
            if self.cv.wait_until(&mut q, until).timed_out() {
                return q.pop_front();
            }
        }
    }
}

pub(crate) fn encode_notify(n: &Notification) -> Result<Vec<u8>, String> {
    let v = serde_json::to_vec(n).expect("notifications serialize");
    if v.len() > MAX_NOTIFY_BYTES {
        return Err(format!(
            "notification of {} B encoded exceeds {MAX_NOTIFY_BYTES} B",
            v.len()
        ));
    }
    Ok(v)
}

pub(crate) fn decode_notify(b: &[u8]) -> Result<Notification, String> {
    if b.len() > MAX_NOTIFY_BYTES {
        return Err(format!("notification of {} B", b.len()));
    }
    serde_json::from_slice(b).map_err(|e| format!("malformed notification: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_notification_queue_is_bounded_and_frees_up_when_taken() {
        let q = Notifies::default();
        let n = Notification {
            name: "prefill-0".into(),
            msg: "layer 3 ready".into(),
        };
        let b = encode_notify(&n).unwrap();
        for _ in 0..MAX_QUEUED_NOTIFIES {
            q.push_encoded(&b).unwrap();
        }
        assert!(q.push_encoded(&b).unwrap_err().contains("not taken"));
        assert_eq!(q.take_all().len(), MAX_QUEUED_NOTIFIES);
        q.push_encoded(&b).unwrap();
        assert_eq!(q.wait_one(Duration::from_millis(1)), Some(n));
    }
}
