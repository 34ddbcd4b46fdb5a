//! The two data transports behind the engine: [`flexns`] (one-sided READ/WRITE on RC queue
//! pairs of the flexns stack, spraying over paths) and [`tcp`] (kernel TCP lanes). Both take
//! [`Slice`]s, place data, report each slice to its [`Batch`], retry a failed slice on another
//! queue pair or lane, and deliver a batch's notification after its data.

pub(crate) mod flexns;
pub(crate) mod tcp;

use crate::batch::{Batch, Notification, Opcode, TransferState, MAX_NOTIFY_BYTES};
use parking_lot::{Condvar, Mutex};
use std::collections::{HashMap, VecDeque};
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
    pub(crate) fn retry_or_fail(mut self, max: u32, error: String) -> Option<Slice> {
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
    pub(crate) fn fail(self, error: String) {
        self.batch.fail(self.task, TransferState::Failed(error));
    }

    pub(crate) fn describe(&self) -> String {
        let op = match self.op {
            Opcode::Read => "READ",
            Opcode::Write => "WRITE",
        };
        format!("{op} of {} B at remote {:#x}", self.len, self.remote)
    }
}

/// Most notifications kept for the application from all peers together (at most 3 KiB each:
/// 192 MiB), so peers cannot grow an engine's memory when its application stops taking them.
pub(crate) const MAX_QUEUED_NOTIFIES: usize = 1 << 16;

/// Most notifications kept for the application from one peer engine: a peer whose
/// notifications the application has not taken is refused past it (its transfer fails with the
/// cause) while every other peer's notifications are still queued.
pub(crate) const MAX_NOTIFIES_PER_PEER: usize = 1024;

/// What the queue holds of one peer.
#[derive(Default)]
struct PeerNotifies {
    /// Its notifications in the queue.
    queued: usize,
    /// Notifications refused since its last one was queued (a refusal episode while > 0).
    refused: u64,
}

#[derive(Default)]
struct Queue {
    /// Oldest first, with the name of the peer engine that sent each.
    q: VecDeque<(Arc<str>, Notification)>,
    peers: HashMap<Arc<str>, PeerNotifies>,
}

impl Queue {
    fn pop(&mut self) -> Option<Notification> {
        let (from, n) = self.q.pop_front()?;
        if let Some(p) = self.peers.get_mut(&from) {
            p.queued = p.queued.saturating_sub(1);
            if p.queued == 0 && p.refused == 0 {
                self.peers.remove(&from);
            }
        }
        Some(n)
    }
}

/// Notifications received by this engine, oldest first, bounded per peer engine and in all.
pub(crate) struct Notifies {
    q: Mutex<Queue>,
    cv: Condvar,
    /// `flexns_kvcache_notifies_refused_total{transport, reason}` handles.
    refused_full: metrics::Counter,
    refused_malformed: metrics::Counter,
}

impl Notifies {
    /// An empty queue; `transport` labels its metrics.
    pub(crate) fn new(transport: &'static str) -> Notifies {
        let c = |reason: &'static str| metrics::counter!("flexns_kvcache_notifies_refused_total", "transport" => transport, "reason" => reason);
        Notifies {
            q: Mutex::new(Queue::default()),
            cv: Condvar::new(),
            refused_full: c("full"),
            refused_malformed: c("malformed"),
        }
    }

    /// Queues an encoded notification from peer engine `from`, or refuses it with the reason
    /// (for the sender): malformed, or `from`'s share of the queue (or the whole queue) is full.
    /// A refusal is counted; the first of an episode is logged, and the episode's end.
    pub(crate) fn push_encoded(&self, from: &str, bytes: &[u8]) -> Result<(), String> {
        let n = match decode_notify(bytes) {
            Ok(n) => n,
            Err(e) => {
                self.refused_malformed.increment(1);
                tracing::warn!("refusing a notification from {from}: {e}");
                return Err(e);
            }
        };
        let mut q = self.q.lock();
        let total = q.q.len();
        let key: Arc<str> = match q.peers.get_key_value(from) {
            Some((k, _)) => k.clone(),
            None => from.into(),
        };
        let p = q.peers.entry(key.clone()).or_default();
        let full = if p.queued >= MAX_NOTIFIES_PER_PEER {
            Some(format!(
                "its notification queue for {from} is full: {} notifications its application has not taken \
                 (at most {MAX_NOTIFIES_PER_PEER} per peer)",
                p.queued
            ))
        } else if total >= MAX_QUEUED_NOTIFIES {
            Some(format!(
                "its notification queue is full: {total} notifications its application has not taken \
                 (at most {MAX_QUEUED_NOTIFIES} from all peers)"
            ))
        } else {
            None
        };
        if let Some(why) = full {
            p.refused += 1;
            let first = p.refused == 1;
            drop(q);
            self.refused_full.increment(1);
            if first {
                tracing::warn!("refusing notifications from {from} until the application takes some: {why}");
            }
            return Err(why);
        }
        p.queued += 1;
        if p.refused > 0 {
            tracing::info!(
                "queueing notifications from {from} again, after refusing {} of them",
                p.refused
            );
            p.refused = 0;
        }
        q.q.push_back((key, n));
        drop(q);
        self.cv.notify_all();
        Ok(())
    }

    pub(crate) fn take_all(&self) -> Vec<Notification> {
        let mut q = self.q.lock();
        let all = q.q.drain(..).map(|(_, n)| n).collect();
        q.peers.retain(|_, p| {
            p.queued = 0;
            p.refused > 0
        });
        all
    }

    pub(crate) fn wait_one(&self, timeout: Duration) -> Option<Notification> {
        let until = std::time::Instant::now() + timeout;
        let mut q = self.q.lock();
        loop {
            if let Some(n) = q.pop() {
                return Some(n);
            }
            if self.cv.wait_until(&mut q, until).timed_out() {
                return q.pop();
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
    fn the_notification_queue_is_bounded_per_peer_and_frees_up_when_taken() {
        let q = Notifies::new("tcp");
        let n = Notification {
            name: "prefill-0".into(),
            msg: "layer 3 ready".into(),
        };
        let b = encode_notify(&n).unwrap();
        for _ in 0..MAX_NOTIFIES_PER_PEER {
            q.push_encoded("a", &b).unwrap();
        }
        let e = q.push_encoded("a", &b).unwrap_err();
        assert!(e.contains("queue for a is full") && e.contains("not taken"), "{e}");
        // another peer is still queued
        let m = Notification {
            name: "prefill-1".into(),
            msg: "b".into(),
        };
        q.push_encoded("b", &encode_notify(&m).unwrap()).unwrap();
        assert!(q.push_encoded("b", b"{").unwrap_err().contains("malformed"));
        // taking one makes room for one more of a's
        assert_eq!(q.wait_one(Duration::from_millis(1)), Some(n.clone()));
        q.push_encoded("a", &b).unwrap();
        assert!(q.push_encoded("a", &b).is_err());
        let all = q.take_all();
        assert_eq!(all.len(), MAX_NOTIFIES_PER_PEER + 1);
        assert_eq!(all[MAX_NOTIFIES_PER_PEER - 1], m, "b's is in arrival order");
        q.push_encoded("a", &b).unwrap();
        assert_eq!(q.wait_one(Duration::from_millis(1)), Some(n));
    }

    #[test]
    fn the_whole_queue_is_bounded_too() {
        let q = Notifies::new("tcp");
        let b = encode_notify(&Notification {
            name: "n".into(),
            msg: String::new(),
        })
        .unwrap();
        for i in 0..MAX_QUEUED_NOTIFIES {
            q.push_encoded(&format!("p{}", i / MAX_NOTIFIES_PER_PEER), &b).unwrap();
        }
        assert!(q.push_encoded("late", &b).unwrap_err().contains("from all peers"));
        assert_eq!(q.take_all().len(), MAX_QUEUED_NOTIFIES);
        q.push_encoded("late", &b).unwrap();
    }
}
