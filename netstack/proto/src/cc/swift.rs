//! Swift (Kumar et al., SIGCOMM'20): a delay-based congestion window. Below the target delay the
//! window grows additively (`ai` packets per window of ACKs); above it the window shrinks in
//! proportion to the excess, at most once per RTT and by at most `max_mdf`. The target grows with
//! the hop count and, for small windows, by flow scaling (`fs_*`), so many small flows share a
//! queue fairly. Below one packet of window the QP is paced at `cwnd × MTU / RTT`. A
//! retransmission timeout cuts the window by `max_mdf`; `retx_reset` in a row reset it to the
//! minimum. Defaults from Google's isekai/Falcon simulator (`Swift::DefaultConfiguration()`).
//!
//! The window reacts to the fabric delay: the transport's RTT sample less the time the packet
//! and its ACK waited at the two hosts ([`RxMeta::host_delay_ns`]: kernel receive timestamp to
//! processing at each end, plus the responder's ACK coalescing), as Swift subtracts the endpoint
//! delays its NIC timestamps measure. So a busy host, whose threads wait for a core, does not
//! read as a congested network: counting that wait cut the window to its floor on a loaded
//! 2-core machine and paced the flow at `min_cwnd × MTU / RTT`, seconds per packet. Swift's
//! second window, which reacts to the endpoint delay against a target of its own (never below
//! one packet), is not built: a receiver that cannot keep up loses packets from its socket
//! buffer, and loss recovery and the RTO cut handle that. The wait before a packet leaves its
//! sender (the engine stamps the send time before the system call) is not measured and counts
//! as fabric delay. Without a host-delay report (a peer without it) the whole RTT counts.

use super::{CcAlgorithm, CcOutput, HeaderSpec, RxKind, RxMeta, StartInfo, Traced};
use std::sync::Arc;

pub use super::params::SwiftParams;

/// The per-QP Swift context.
#[derive(Debug)]
pub struct Swift {
    p: Arc<SwiftParams>,
    cwnd: f64,
    srtt: f64,
    t_last_decrease: u64,
    retx: u32,
    mtu: u32,
}

impl Swift {
    /// A flow starting at the configured initial window.
    pub fn new(p: Arc<SwiftParams>) -> Swift {
        let cwnd = p.init_cwnd.clamp(p.min_cwnd, p.max_cwnd);
        Swift {
            p,
            cwnd,
            srtt: 0.0,
            t_last_decrease: 0,
            retx: 0,
            mtu: 4096,
        }
    }

    /// Congestion window in packets.
    pub fn cwnd(&self) -> f64 {
        self.cwnd
    }

    /// The target delay for the current window (base + hops + flow scaling).
    pub fn target_ns(&self) -> f64 {
        let p = &self.p;
        let alpha = p.fs_range_ns as f64 / (1.0 / p.fs_min_cwnd.sqrt() - 1.0 / p.fs_max_cwnd.sqrt());
        let beta = -alpha / p.fs_max_cwnd.sqrt();
        let fs = (alpha / self.cwnd.sqrt() + beta).clamp(0.0, p.fs_range_ns as f64);
        p.base_target_ns as f64 + (p.hops as u64 * p.per_hop_ns) as f64 + fs
    }

    fn can_decrease(&self, now: u64) -> bool {
        now.saturating_sub(self.t_last_decrease) as f64 >= self.srtt
    }

    fn set_cwnd(&mut self, now: u64, c: f64, out: &mut CcOutput) {
        let c = c.clamp(self.p.min_cwnd, self.p.max_cwnd);
        if c < self.cwnd {
            self.t_last_decrease = now;
        }
        self.cwnd = c;
        let mtu = self.mtu as f64;
        out.window = Some(Some((c.max(1.0) * mtu) as u64));
        out.rate = Some(if c < 1.0 && self.srtt > 0.0 {
            Some(((c * mtu * 1e9 / self.srtt) as u64).clamp(1, self.p.line_rate))
        } else {
            None
        });
    }
}

impl CcAlgorithm for Swift {
    fn name(&self) -> &'static str {
        "swift"
    }

    fn traced(&self) -> Traced {
        Traced {
            rx_ack: true,
            timeout: true,
            ..Traced::default()
        }
    }

    fn header(&self) -> HeaderSpec {
        HeaderSpec {
            host_delay: true,
            ..HeaderSpec::default()
        }
    }

    fn on_start(&mut self, now: u64, info: &StartInfo, out: &mut CcOutput) {
        self.mtu = info.mtu;
        self.set_cwnd(now, self.cwnd, out);
    }

    fn on_rx(&mut self, now: u64, pkt: &RxMeta<'_>, out: &mut CcOutput) {
        match (pkt.kind, pkt.rtt_ns) {
            (RxKind::Ack, Some(rtt)) => {
                self.retx = 0;
                // the RTT paces a window below one packet and spaces the cuts; the fabric
                // delay decides them
                let r = rtt as f64;
                self.srtt = if self.srtt == 0.0 {
                    r
                } else {
                    0.75 * self.srtt + 0.25 * r
                };
                let d = rtt.saturating_sub(pkt.host_delay_ns.unwrap_or(0)) as f64;
                // one ACK stands for the packets it acknowledges
                let acked = (pkt.payload.max(1) as f64 / self.mtu as f64).max(1.0);
                let target = self.target_ns();
                let c = self.cwnd;
                if d < target {
                    let inc = if c >= 1.0 {
                        self.p.ai * acked / c
                    } else {
                        self.p.ai * acked
                    };
                    self.set_cwnd(now, c + inc, out);
                } else if self.can_decrease(now) && d > 0.0 {
                    let f = (1.0 - self.p.beta * (d - target) / d).max(1.0 - self.p.max_mdf);
                    self.set_cwnd(now, c * f, out);
                }
            }
            (RxKind::Timeout, _) => {
                self.retx += 1;
                if self.retx >= self.p.retx_reset {
                    self.set_cwnd(now, self.p.min_cwnd, out);
                } else if self.can_decrease(now) {
                    self.set_cwnd(now, self.cwnd * (1.0 - self.p.max_mdf), out);
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ack(rtt: u64) -> RxMeta<'static> {
        RxMeta {
            rtt_ns: Some(rtt),
            payload: 4096,
            ..RxMeta::plain(RxKind::Ack, 64)
        }
    }

    fn swift() -> Swift {
        let mut s = Swift::new(Arc::new(SwiftParams::default()));
        s.on_start(0, &StartInfo { mtu: 4096 }, &mut CcOutput::default());
        s
    }

    #[test]
    fn context_fits_the_budget() {
        assert!(swift().context_bytes() <= 128);
    }

    #[test]
    fn low_delay_grows_high_delay_cuts_once_per_rtt() {
        let mut s = swift();
        let c0 = s.cwnd();
        let mut now = 0;
        for _ in 0..100 {
            now += 5_000;
            s.on_rx(now, &ack(10_000), &mut CcOutput::default());
        }
        let grown = s.cwnd();
        assert!(grown > c0 + 3.0, "{c0} -> {grown}");
        // delay far above target: one cut per RTT, never below 1 - max_mdf per cut
        now += 5_000;
        s.on_rx(now, &ack(400_000), &mut CcOutput::default());
        let cut = s.cwnd();
        assert!(cut < grown && cut >= grown * 0.5 - 1e-9, "{grown} -> {cut}");
        s.on_rx(now + 1_000, &ack(400_000), &mut CcOutput::default());
        assert_eq!(s.cwnd(), cut, "a second cut within one RTT");
    }

    #[test]
    fn host_delay_is_not_congestion() {
        // 5 ms round trips, 4.99 ms of them spent waiting at the hosts: the fabric delay is
        // 10 us, below the target, so the window grows as it would on an idle host
        let busy_host = |s: &mut Swift, now: u64| {
            let m = RxMeta {
                host_delay_ns: Some(4_990_000),
                ..ack(5_000_000)
            };
            s.on_rx(now, &m, &mut CcOutput::default());
        };
        let mut s = swift();
        let c0 = s.cwnd();
        for i in 1..=50 {
            busy_host(&mut s, i * 5_000_000);
        }
        assert!(s.cwnd() > c0 + 3.0, "{c0} -> {}", s.cwnd());
        // the same round trips spent in the network cut the window to below a packet
        let mut s = swift();
        for i in 1..=50 {
            s.on_rx(i * 5_000_000, &ack(5_000_000), &mut CcOutput::default());
        }
        assert!(s.cwnd() < 1.0, "{}", s.cwnd());
        // a report larger than the RTT (clock skew between the stamps) is no delay at all
        let mut s = swift();
        let m = RxMeta {
            host_delay_ns: Some(9_000_000),
            ..ack(5_000_000)
        };
        s.on_rx(1, &m, &mut CcOutput::default());
        assert!(s.cwnd() > c0, "{c0} -> {}", s.cwnd());
    }

    #[test]
    fn small_windows_pace_and_timeouts_reset() {
        let mut s = swift();
        let mut now = 0;
        let mut out = CcOutput::default();
        for _ in 0..40 {
            now += 1_000_000;
            s.on_rx(now, &ack(2_000_000), &mut out);
        }
        assert!(s.cwnd() < 1.0, "{}", s.cwnd());
        assert!(matches!(out.rate, Some(Some(_))), "paced below one packet");
        assert_eq!(out.window, Some(Some(4096)));
        for _ in 0..3 {
            now += 10_000_000;
            s.on_rx(now, &RxMeta::plain(RxKind::Timeout, 0), &mut out);
        }
        assert_eq!(s.cwnd(), s.p.min_cwnd);
    }

    #[test]
    fn flow_scaling_raises_the_target_for_small_windows() {
        let mut s = swift();
        let big = s.target_ns();
        s.cwnd = 0.5;
        assert!(s.target_ns() > big + 10_000.0);
    }
}
