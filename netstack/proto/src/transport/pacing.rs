//! The pacing hook: a per-QP rate limiter and in-flight window that congestion control drives.
//!
//! The rate limiter is a token bucket in its GCRA form: a theoretical next-send time advanced by
//! each packet's transmission time at the configured rate, with a burst allowance. Time is in
//! nanoseconds and the division remainder is carried from packet to packet, so a long run sends
//! exactly `rate × time` bytes (within one packet and the burst), whatever the packet sizes.

/// Rate and window limits of one QP's requester.
#[derive(Debug, Clone, Default)]
pub struct Pacer {
    /// Bytes per second; `None` = unlimited.
    rate: Option<u64>,
    /// Burst allowance in nanoseconds of transmission at `rate`.
    burst_ns: u64,
    /// Theoretical time at which the next packet conforms.
    tat: u64,
    /// Carried remainder of `bytes * 1e9 / rate` (in units of 1/rate ns).
    rem: u64,
    /// Most payload bytes in flight (sent, not acknowledged); `None` = unlimited.
    window: Option<u64>,
    /// When the last packet was sent.
    last_send: u64,
}

impl Pacer {
    /// Sets the rate in bytes per second (`None` removes the limit) and the burst in bytes.
    ///
    /// When the rate at least doubles, the wait still owed for what was sent under the old
    /// rate is re-priced at the new one: a packet charged at a rate congestion control had cut
    /// to kilobytes per second must not hold the QP back for seconds after the rate recovers (a
    /// sprayed QP stalled 2.5 s that way when a cut link returned). Smaller steps (DCQCN's
    /// increases) and cuts apply from the next packet on, and without a rate nothing is owed.
    pub fn set_rate(&mut self, bytes_per_sec: Option<u64>, burst_bytes: u64) {
        let new = bytes_per_sec.filter(|r| *r > 0);
        match (self.rate, new) {
            (Some(old), Some(new)) if new / 2 >= old && self.tat > self.last_send => {
                let owed = (self.tat - self.last_send) as u128 * old as u128 / new as u128;
                self.tat = self.last_send.saturating_add(owed.min(u64::MAX as u128) as u64);
            }
            (_, None) => self.tat = self.tat.min(self.last_send),
            _ => {}
        }
        self.rate = new;
        self.burst_ns = match self.rate {
            Some(r) => (burst_bytes as u128 * 1_000_000_000 / r as u128) as u64,
            None => 0,
        };
        self.rem = 0;
    }

    /// Sets the in-flight window in bytes (`None` removes it).
    pub fn set_window(&mut self, bytes: Option<u64>) {
        self.window = bytes;
    }

    /// The pacing rate in bytes per second (None: not paced).
    pub fn rate(&self) -> Option<u64> {
        self.rate
    }
    /// The window in bytes (None: no window).
    pub fn window(&self) -> Option<u64> {
        self.window
    }
    /// When the last packet was sent (ns; 0 before the first).
    pub(crate) fn last_send(&self) -> u64 {
        self.last_send
    }

    /// When a packet may be sent: `None` now, `Some(t)` not before `t`.
    pub fn ready_at(&self, now: u64) -> Option<u64> {
        self.rate?;
        let earliest = self.tat.saturating_sub(self.burst_ns);
        (earliest > now).then_some(earliest)
    }

    /// The next time a packet conforms to the rate, if the rate held the last packet back (a
    /// timer is needed only then: otherwise the QP can send as soon as anything else lets it).
    pub fn next_conforming(&self) -> Option<u64> {
        self.rate?;
        let t = self.tat.saturating_sub(self.burst_ns);
        (t > self.last_send).then_some(t)
    }

    /// Whether `inflight` bytes leave room for more under the window.
    pub fn window_open(&self, inflight: u64) -> bool {
        self.window.is_none_or(|w| inflight < w)
    }

    /// Accounts a packet of `bytes` sent at `now`.
    pub fn on_send(&mut self, now: u64, bytes: u64) {
        self.last_send = now;
        let Some(rate) = self.rate else { return };
        // 64-bit division while it cannot overflow (any packet below 16 GiB at any rate below
        // 1 TB/s), 128-bit otherwise
        let (ns, rem) = if bytes < 1 << 34 && self.rem < 1 << 40 {
            let num = bytes * 1_000_000_000 + self.rem;
            (num / rate, num % rate)
        } else {
            let num = bytes as u128 * 1_000_000_000 + self.rem as u128;
            ((num / rate as u128) as u64, (num % rate as u128) as u64)
        };
        self.rem = rem;
        self.tat = self.tat.max(now) + ns;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sends_exactly_the_rate_over_time() {
        let mut p = Pacer::default();
        let rate = 123_456_789; // bytes/s, not a round number
        p.set_rate(Some(rate), 9000);
        let (mut now, mut sent) = (0u64, 0u64);
        let end = 2_000_000_000; // 2 s
        let mut sizes = [4096u64, 1, 4096, 777, 4096, 64].iter().cycle();
        loop {
            match p.ready_at(now) {
                None => {
                    if now >= end {
                        break;
                    }
                    let b = *sizes.next().unwrap();
                    p.on_send(now, b);
                    sent += b;
                }
                Some(t) => now = t,
            }
        }
        let want = rate as f64 * end as f64 / 1e9;
        assert!(
            (sent as f64 - want).abs() <= 4096.0 + 9000.0,
            "sent {sent}, want {want}"
        );
    }

    #[test]
    fn a_rate_change_reprices_the_wait_still_owed() {
        let mut p = Pacer::default();
        // 4 KiB charged at 4 KiB/s: the next packet is owed a second from now
        p.set_rate(Some(4096), 0);
        p.on_send(1_000, 4096);
        assert_eq!(p.ready_at(1_000), Some(1_000_001_000));
        // the rate recovers a thousandfold: the wait shrinks with it
        p.set_rate(Some(4_096_000), 0);
        assert_eq!(p.ready_at(1_000), Some(1_001_000));
        // a cut applies to the next packet, not to the one already charged, and so does a
        // rise of less than double
        p.set_rate(Some(2_048_000), 0);
        assert_eq!(p.ready_at(1_000), Some(1_001_000));
        p.set_rate(Some(3_000_000), 0);
        assert_eq!(p.ready_at(1_000), Some(1_001_000));
        p.set_rate(Some(2_048_000), 0);
        p.on_send(1_001_000, 2048);
        assert_eq!(p.ready_at(1_001_000), Some(2_001_000));
        // no limit: nothing owed, also once a limit returns
        p.set_rate(None, 0);
        assert_eq!(p.ready_at(1_001_000), None);
        p.set_rate(Some(4096), 0);
        assert_eq!(p.ready_at(1_001_000), None);
    }

    #[test]
    fn unlimited_and_window() {
        let mut p = Pacer::default();
        assert_eq!(p.ready_at(5), None);
        p.on_send(5, 1 << 30);
        assert_eq!(p.ready_at(5), None);
        p.set_window(Some(8192));
        assert!(p.window_open(4096));
        assert!(!p.window_open(8192));
        p.set_rate(Some(1_000_000_000), 0); // 1 GB/s: 1 ns per byte
        p.on_send(100, 1000);
        assert_eq!(p.ready_at(100), Some(1100));
        assert_eq!(p.next_conforming(), Some(1100), "held back: a timer is needed");
        assert_eq!(p.ready_at(1100), None);
        // well under the rate, within the burst: nothing to wait for, no timer
        p.set_rate(Some(1_000_000_000), 1000);
        p.on_send(5000, 10);
        assert_eq!(p.next_conforming(), None);
    }
}
