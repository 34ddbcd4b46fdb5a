//! Congestion control: the protocol core's algorithms ([`flexns_proto::cc`]), and what a host
//! shares between its QPs, which needs a lock and so lives on this side: Homa's SRPT ranking of
//! the host's inbound messages ([`HomaScheduler`]).

pub use flexns_proto::cc::*;

use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A receiving host's view of its inbound messages: bytes left per QP, for SRPT ranking. The
/// host's QPs run on any of its data cores, so the ranking is behind a lock; a command to one
/// owner would serialize every grant decision of the host on one core.
#[derive(Debug, Default)]
pub struct HomaScheduler {
    next_id: AtomicU64,
    inbound: Mutex<Vec<(u64, u64)>>,
}

impl HomaScheduler {
    /// Inbound messages being tracked.
    pub fn inbound(&self) -> usize {
        self.inbound.lock().len()
    }
}

impl homa::SrptRanking for HomaScheduler {
    fn register(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn update(&self, id: u64, remaining: u64) -> u32 {
        homa::srpt_rank(&mut self.inbound.lock(), id, remaining)
    }

    fn remove(&self, id: u64) {
        self.inbound.lock().retain(|e| e.0 != id);
    }
}

/// The shared congestion-control state of one host's QPs for parameters `p`: the parameters
/// and a [`HomaScheduler`] of its own.
pub fn host_env(p: &CcParams) -> Arc<CcEnv> {
    CcEnv::new(p, Arc::new(HomaScheduler::default()))
}

#[cfg(test)]
mod tests {
    use super::homa::SrptRanking;
    use super::*;

    #[test]
    fn ranks_by_bytes_left_and_forgets_finished_and_removed_messages() {
        let s = HomaScheduler::default();
        let (a, b, c) = (s.register(), s.register(), s.register());
        assert_eq!(s.update(a, 90_000), 0);
        assert_eq!(s.update(b, 5_000), 0);
        assert_eq!(s.update(a, 89_000), 1);
        assert_eq!(s.update(c, 20_000), 1);
        assert_eq!(s.update(a, 88_000), 2);
        assert_eq!(s.update(b, 0), 0);
        assert_eq!(s.update(a, 87_000), 1);
        s.remove(c);
        assert_eq!(s.update(a, 86_000), 0);
        assert_eq!(s.inbound(), 1);
        s.remove(a);
        assert_eq!(s.inbound(), 0);
    }
}
