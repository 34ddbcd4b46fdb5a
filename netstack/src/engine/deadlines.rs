//! A data core's QP deadlines (retransmission, pacing, probes, delayed acknowledgements) in
//! time order: a binary heap with lazy deletion, so a loop pays for the QPs whose deadline has
//! come rather than locking every QP to ask it.
//!
//! A QP is armed with its next deadline whenever the core has touched it. Arming earlier than
//! the QP's armed entry pushes a new entry and leaves the old one stale; arming later than it
//! is left for when that entry comes due, when the caller reads the QP's deadline afresh and
//! arms it again. So a due entry may find its QP with a later deadline (or none): the caller
//! checks before acting.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// The armed deadlines of one data core's QPs.
#[derive(Default)]
pub(super) struct Deadlines {
    heap: BinaryHeap<Reverse<(u64, u32)>>,
    /// Each armed QP's live entry; heap entries that differ from it are stale.
    armed: HashMap<u32, u64>,
}

impl Deadlines {
    /// QP `qpn` has a deadline at `t` (nanoseconds on the engine's clock).
    pub(super) fn arm(&mut self, qpn: u32, t: u64) {
        if self.armed.get(&qpn).is_some_and(|&a| a <= t) {
            return; // an entry at or before `t` will bring the QP up
        }
        self.armed.insert(qpn, t);
        self.heap.push(Reverse((t, qpn)));
        // stale entries are dropped as they come due; rebuild if they pile up first
        if self.heap.len() > 4 * self.armed.len() + 1024 {
            self.heap = self.armed.iter().map(|(&q, &t)| Reverse((t, q))).collect();
        }
    }

    /// The next QP whose armed deadline is at or before `now`, its entry consumed (arm it
    /// again with whatever deadline it has after being handled).
    pub(super) fn pop_due(&mut self, now: u64) -> Option<u32> {
        while let Some(&Reverse((t, qpn))) = self.heap.peek() {
            if t > now {
                return None;
            }
            self.heap.pop();
            if self.armed.get(&qpn) == Some(&t) {
                self.armed.remove(&qpn);
                return Some(qpn);
            }
        }
        None
    }

    /// The earliest armed deadline.
    pub(super) fn next(&mut self) -> Option<u64> {
        while let Some(&Reverse((t, qpn))) = self.heap.peek() {
            if self.armed.get(&qpn) == Some(&t) {
                return Some(t);
            }
            self.heap.pop(); // stale
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::Deadlines;

    fn due(d: &mut Deadlines, now: u64) -> Vec<u32> {
        std::iter::from_fn(|| d.pop_due(now)).collect()
    }

    #[test]
    fn qps_come_due_in_time_order_once() {
        let mut d = Deadlines::default();
        d.arm(1, 300);
        d.arm(2, 100);
        d.arm(3, 200);
        assert_eq!(d.next(), Some(100));
        assert_eq!(due(&mut d, 50), Vec::<u32>::new());
        assert_eq!(due(&mut d, 250), vec![2, 3]);
        assert_eq!(d.next(), Some(300));
        assert_eq!(due(&mut d, 1000), vec![1]);
        assert_eq!(d.next(), None);
    }

    #[test]
    fn arming_earlier_replaces_and_later_waits_for_the_armed_entry() {
        let mut d = Deadlines::default();
        d.arm(7, 500);
        d.arm(7, 100); // earlier: the 500 entry is stale now
        assert_eq!(d.next(), Some(100));
        d.arm(7, 900); // later: the 100 entry stands
        assert_eq!(due(&mut d, 100), vec![7]);
        // the QP is read afresh by the caller and armed again; the stale 500 entry never fires
        assert_eq!(due(&mut d, 600), Vec::<u32>::new());
        assert_eq!(d.next(), None);
        d.arm(7, 900);
        assert_eq!(due(&mut d, 900), vec![7]);
    }

    #[test]
    fn stale_entries_do_not_pile_up() {
        let mut d = Deadlines::default();
        for t in (0..100_000u64).rev() {
            d.arm(1, t + 1_000_000); // each earlier than the last: one stale entry per arm
        }
        assert!(d.heap.len() <= 4 + 1024 + 1, "{} entries for one QP", d.heap.len());
        assert_eq!(d.next(), Some(1_000_000));
        assert_eq!(due(&mut d, u64::MAX), vec![1]);
    }
}
