//! HPCC (Li et al., SIGCOMM'19): window control from in-band network telemetry. Each switch
//! egress stamps its queue length, transmitted bytes, clock and link rate into the data packet's
//! INT stack ([`super::header::IntStack`]); the receiver echoes the stack in its ACKs; the sender
//! estimates the utilisation `U` of the most loaded hop and sets the window to keep it at `eta`,
//! updating its reference window once per base RTT and reacting to every ACK in between
//! ("fast react"). The pacing rate is `W / T`. Defaults: eta 95 %, 5 additive stages, W_AI from
//! 50 Mbit/s × T (the HPCC paper's evaluation setting, Li et al., SIGCOMM'19 §5).
//!
//! HPCC needs telemetry: [`NO_INT_ACKS`] ACKs in a row that echo an empty stack mean no switch
//! on the path stamps INT, and the algorithm reports a fault rather than guess. A single
//! unstamped packet (a switch that skipped one under overload) is ignored, not a fault.

use super::header::{IntHop, IntStack, INT_STACK_LEN, MAX_HOPS};
use super::{CcAlgorithm, CcOutput, HeaderSpec, RxKind, RxMeta, StartInfo, Traced};
use std::sync::Arc;

pub use super::params::HpccParams;

/// What an ACK with no INT records means.
pub const NO_INT: &str = "HPCC needs INT telemetry and this path has none (no switch stamped the packets); \
                          use a path with INT switches or another algorithm";

/// Consecutive ACKs with an empty INT stack after which the path counts as having no INT.
pub const NO_INT_ACKS: u8 = 8;

/// The per-QP HPCC context.
#[derive(Debug)]
pub struct Hpcc {
    p: Arc<HpccParams>,
    w: f64,
    wc: f64,
    u: f64,
    w_init: f64,
    w_min: f64,
    inc_stage: u32,
    next_update: u64,
    /// The previous ACK's hops (L in the paper).
    last: [IntHop; MAX_HOPS],
    nlast: u8,
    /// ACKs in a row whose INT stack was empty.
    unstamped: u8,
}

impl Hpcc {
    /// A flow starting at a window of one bandwidth-delay product.
    pub fn new(p: Arc<HpccParams>) -> Hpcc {
        let w_init = p.line_rate as f64 * p.base_rtt_ns as f64 / 1e9;
        Hpcc {
            p,
            w: w_init,
            wc: w_init,
            u: 0.0,
            w_init,
            w_min: 4096.0,
            inc_stage: 0,
            next_update: 0,
            last: [IntHop::default(); MAX_HOPS],
            nlast: 0,
            unstamped: 0,
        }
    }

    /// Current window in bytes.
    pub fn window(&self) -> u64 {
        self.w as u64
    }
    /// Current utilisation estimate.
    pub fn utilisation(&self) -> f64 {
        self.u
    }

    fn measure_inflight(&mut self, hops: &[IntHop]) -> f64 {
        let t = self.p.base_rtt_ns as f64;
        let (mut u, mut tau) = (0.0f64, 0.0f64);
        for (h, l) in hops.iter().zip(&self.last) {
            let dt = h.ts_ns.wrapping_sub(l.ts_ns) as f64;
            if dt <= 0.0 || h.rate_mbps == 0 {
                continue;
            }
            let b = h.rate_mbps as f64 * 1e6 / 8.0 / 1e9; // bytes per ns
            let tx_rate = h.tx_bytes.wrapping_sub(l.tx_bytes) as f64 / dt;
            let ui = h.qlen.min(l.qlen) as f64 / (b * t) + tx_rate / b;
            if ui > u {
                u = ui;
                tau = dt;
            }
        }
        let tau = tau.min(t);
        self.u = (1.0 - tau / t) * self.u + tau / t * u;
        self.u
    }

    fn compute_window(&mut self, u: f64, update: bool) {
        let w_ai = self.p.rate_ai as f64 * self.p.base_rtt_ns as f64 / 1e9;
        let w = if u >= self.p.eta || self.inc_stage >= self.p.max_stage {
            if update {
                self.inc_stage = 0;
            }
            self.wc / (u / self.p.eta).max(1e-3) + w_ai
        } else {
            if update {
                self.inc_stage += 1;
            }
            self.wc + w_ai
        };
        self.w = w.clamp(self.w_min, self.w_init);
        if update {
            self.wc = self.w;
        }
    }

    fn emit(&self, out: &mut CcOutput) {
        out.window = Some(Some(self.w as u64));
        out.rate = Some(Some((self.w * 1e9 / self.p.base_rtt_ns as f64) as u64));
    }
}

impl CcAlgorithm for Hpcc {
    fn name(&self) -> &'static str {
        "hpcc"
    }

    fn traced(&self) -> Traced {
        Traced {
            rx_ack: true,
            ..Traced::default()
        }
    }

    fn header(&self) -> HeaderSpec {
        HeaderSpec {
            data_bytes: INT_STACK_LEN as u8,
            echo_in_ack: true,
            host_delay: false,
        }
    }

    fn on_start(&mut self, _now: u64, info: &StartInfo, out: &mut CcOutput) {
        self.w_min = info.mtu as f64;
        self.emit(out);
    }

    fn on_rx(&mut self, now: u64, pkt: &RxMeta<'_>, out: &mut CcOutput) {
        if pkt.kind != RxKind::Ack || pkt.cc.is_empty() {
            return;
        }
        let Some(stack) = IntStack::parse(pkt.cc) else { return };
        if stack.nhop == 0 {
            self.unstamped = self.unstamped.saturating_add(1);
            if self.unstamped >= NO_INT_ACKS {
                out.fault = Some(NO_INT);
            }
            return;
        }
        self.unstamped = 0;
        if stack.nhop != self.nlast {
            // first ACK, or the path changed: remember the hops, measure from the next ACK
            self.last = stack.hops;
            self.nlast = stack.nhop;
            self.next_update = now + self.p.base_rtt_ns;
            return;
        }
        let u = self.measure_inflight(stack.hops());
        let update = now >= self.next_update;
        if update {
            self.next_update = now + self.p.base_rtt_ns;
        }
        self.compute_window(u, update);
        self.last = stack.hops;
        self.emit(out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ack_with(hops: &[IntHop]) -> Vec<u8> {
        let mut b = vec![0u8; INT_STACK_LEN];
        for h in hops {
            assert!(IntStack::push_hop(&mut b, h));
        }
        b
    }

    fn rx<'a>(cc: &'a [u8]) -> RxMeta<'a> {
        RxMeta {
            cc,
            ..RxMeta::plain(RxKind::Ack, 64)
        }
    }

    /// A 10 Gbit/s hop seen every microsecond, sending at `util` of its rate with `qlen` queued.
    fn run(h: &mut Hpcc, util: f64, qlen: u32, steps: u64) -> CcOutput {
        let mut out = CcOutput::default();
        for i in 0..steps {
            let ns = i * 1000;
            let hop = IntHop {
                qlen,
                tx_bytes: (ns as f64 * 1.25 * util) as u32,
                ts_ns: ns as u32,
                rate_mbps: 10_000,
            };
            h.on_rx(ns, &rx(&ack_with(&[hop])), &mut out);
        }
        out
    }

    fn hpcc() -> Hpcc {
        let mut h = Hpcc::new(Arc::new(HpccParams {
            line_rate: 10_000_000_000 / 8,
            ..HpccParams::default()
        }));
        h.on_start(0, &StartInfo { mtu: 1024 }, &mut CcOutput::default());
        h
    }

    #[test]
    fn context_fits_the_budget() {
        assert!(hpcc().context_bytes() <= 128, "{}", hpcc().context_bytes());
    }

    #[test]
    fn a_queue_shrinks_the_window_an_idle_link_grows_it() {
        let mut h = hpcc();
        let w0 = h.window();
        // saturated link with a standing queue of 2 BDPs: U ≈ 3, the window falls to ~eta/U
        run(&mut h, 1.0, 25_000, 200);
        assert!(h.utilisation() > 2.0, "U {}", h.utilisation());
        assert!(h.window() < w0 / 2, "{} vs {}", h.window(), w0);
        // the queue drains and the link runs at half rate: the window grows back to the cap
        run(&mut h, 0.5, 0, 2000);
        assert!(h.utilisation() < 0.7, "U {}", h.utilisation());
        assert_eq!(h.window(), w0);
    }

    #[test]
    fn no_int_is_a_fault_not_a_guess() {
        let mut h = hpcc();
        let w0 = h.window();
        let mut out = CcOutput::default();
        for i in 1..NO_INT_ACKS as u64 {
            h.on_rx(i, &rx(&[0u8; INT_STACK_LEN]), &mut out);
            assert_eq!(out.fault, None, "one unstamped ACK is not yet a path without INT");
        }
        h.on_rx(NO_INT_ACKS as u64, &rx(&[0u8; INT_STACK_LEN]), &mut out);
        assert_eq!(out.fault, Some(NO_INT));
        assert_eq!(h.window(), w0);
    }
}
