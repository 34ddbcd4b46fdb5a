//! A data core's timers: the QPs' due deadlines run, the next one found.

use super::*;

impl DataCore {
    /// Runs the QPs' due timers; returns the earliest deadline of the QPs and the delay line.
    pub(super) fn rc_deadline(&mut self, now: u64) -> Option<u64> {
        earliest(self.timers(now), self.delayed.front().map(|d| d.due))
    }

    /// Runs the timers that are due; returns the earliest deadline left.
    pub(super) fn timers(&mut self, now: u64) -> Option<u64> {
        if now >= self.next_scan {
            self.next_scan = now + DEADLINE_SCAN_NS;
            for (&qpn, s) in &self.qps {
                if let Some(t) = s.qp.poll_timeout() {
                    self.deadlines.arm(qpn, t);
                }
            }
        }
        // deadlines still due after their QP's timeout ran wait for the next loop
        let mut again = Vec::new();
        while let Some(qpn) = self.deadlines.pop_due(now) {
            let Some(s) = self.qps.get_mut(&qpn) else {
                continue;
            };
            match s.qp.poll_timeout() {
                Some(t) if t <= now => {
                    s.qp.handle_timeout(now);
                    if !s.deliver_completions(self.index) {
                        self.stuck.insert(qpn);
                    }
                    self.active.insert(qpn);
                    if let Some(t2) = s.qp.poll_timeout() {
                        again.push((qpn, t2));
                    }
                }
                Some(t) => again.push((qpn, t)),
                None => {}
            }
        }
        for (qpn, t) in again {
            self.deadlines.arm(qpn, t);
        }
        self.deadlines.next()
    }
}
