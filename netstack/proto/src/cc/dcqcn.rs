//! DCQCN (Zhu et al., SIGCOMM'15): the receiver (notification point) turns ECN CE marks into at
//! most one CNP per `cnp_interval`; the sender (reaction point) cuts its rate on a CNP by
//! alpha/2 and recovers by timer and byte-counter stages (fast recovery, additive, hyper).
//! Defaults are the paper's (Zhu et al., SIGCOMM'15, §5's parameter table).

use super::{CcAlgorithm, CcOutput, Generate, RxKind, RxMeta, StartInfo, Traced, TxMeta, Verdict};
use std::sync::Arc;

pub use super::params::DcqcnParams;

/// The per-QP DCQCN context.
#[derive(Debug)]
pub struct Dcqcn {
    p: Arc<DcqcnParams>,
    rc: f64,
    rt: f64,
    alpha: f64,
    t_cnt: u32,
    bc_cnt: u32,
    byte_ctr: u64,
    next_alpha: u64,
    next_rate: u64,
    /// Receiver side: when the last CNP was generated.
    last_cnp: Option<u64>,
    /// Sender side: a CNP has been received since the last alpha update.
    cnp_seen: bool,
}

impl Dcqcn {
    /// A flow starting at line rate (DCQCN's start: no slow start).
    pub fn new(p: Arc<DcqcnParams>) -> Dcqcn {
        let c = p.line_rate as f64;
        Dcqcn {
            p,
            rc: c,
            rt: c,
            alpha: 1.0,
            t_cnt: 0,
            bc_cnt: 0,
            byte_ctr: 0,
            next_alpha: 0,
            next_rate: 0,
            last_cnp: None,
            cnp_seen: false,
        }
    }

    /// Current rate R_c in bytes per second.
    pub fn rate(&self) -> u64 {
        self.rc as u64
    }
    /// Target rate R_t in bytes per second (what recovery climbs back to).
    pub fn target_rate(&self) -> u64 {
        self.rt as u64
    }
    /// The congestion estimate alpha (0..=1).
    pub fn alpha(&self) -> f64 {
        self.alpha
    }

    fn emit(&self, out: &mut CcOutput) {
        out.rate = Some(Some(self.rc as u64));
        out.timer = Some(self.next_alpha.min(self.next_rate));
    }

    fn increase(&mut self) {
        let f = self.p.fast_recovery;
        if self.t_cnt.max(self.bc_cnt) < f {
            // fast recovery: halve the distance to the target
        } else if self.t_cnt.min(self.bc_cnt) >= f {
            let i = (self.t_cnt.min(self.bc_cnt) - f + 1) as f64;
            self.rt += i * self.p.rate_hai as f64;
        } else {
            self.rt += self.p.rate_ai as f64;
        }
        let c = self.p.line_rate as f64;
        self.rt = self.rt.min(c);
        self.rc = ((self.rt + self.rc) / 2.0).min(c);
    }
}

impl CcAlgorithm for Dcqcn {
    fn name(&self) -> &'static str {
        "dcqcn"
    }

    fn traced(&self) -> Traced {
        Traced {
            tx_data: true,
            rx_data: true,
            rx_cnp: true,
            ..Traced::default()
        }
    }

    fn on_start(&mut self, now: u64, _info: &StartInfo, out: &mut CcOutput) {
        self.next_alpha = now + self.p.alpha_period_ns;
        self.next_rate = now + self.p.rate_timer_ns;
        self.emit(out);
    }

    fn on_tx(&mut self, _now: u64, pkt: &TxMeta, out: &mut CcOutput) -> Verdict {
        // rate-based: the pacer defers packets; the TX function only runs the byte counter
        self.byte_ctr += pkt.bytes as u64;
        if self.byte_ctr >= self.p.byte_counter {
            self.byte_ctr = 0;
            self.bc_cnt += 1;
            self.increase();
            out.rate = Some(Some(self.rc as u64));
        }
        Verdict::Send
    }

    fn on_rx(&mut self, now: u64, pkt: &RxMeta<'_>, out: &mut CcOutput) {
        match pkt.kind {
            // notification point: one CNP per interval for CE-marked data
            RxKind::Data
                if pkt.ce
                    && self
                        .last_cnp
                        .is_none_or(|t| now.saturating_sub(t) >= self.p.cnp_interval_ns) =>
            {
                self.last_cnp = Some(now);
                out.generate = Some(Generate::Cnp);
            }
            // reaction point
            RxKind::Cnp => {
                self.rt = self.rc;
                self.rc = (self.rc * (1.0 - self.alpha / 2.0)).max(self.p.min_rate as f64);
                self.alpha = (1.0 - self.p.g) * self.alpha + self.p.g;
                self.cnp_seen = true;
                self.t_cnt = 0;
                self.bc_cnt = 0;
                self.byte_ctr = 0;
                self.next_alpha = now + self.p.alpha_period_ns;
                self.next_rate = now + self.p.rate_timer_ns;
                self.emit(out);
            }
            _ => {}
        }
    }

    fn on_timer(&mut self, now: u64, out: &mut CcOutput) {
        if now >= self.next_alpha {
            if !self.cnp_seen {
                self.alpha *= 1.0 - self.p.g;
            }
            self.cnp_seen = false;
            self.next_alpha = now + self.p.alpha_period_ns;
        }
        if now >= self.next_rate {
            self.t_cnt += 1;
            self.increase();
            self.next_rate = now + self.p.rate_timer_ns;
        }
        self.emit(out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tx(bytes: u32) -> TxMeta {
        TxMeta {
            opcode: 0x07,
            bytes,
            payload: bytes,
            first: false,
            msg_bytes: 1 << 20,
            msg_remaining: 1 << 19,
            retransmit: false,
        }
    }

    fn dcqcn() -> Dcqcn {
        let mut d = Dcqcn::new(Arc::new(DcqcnParams::default()));
        d.on_start(0, &StartInfo { mtu: 4096 }, &mut CcOutput::default());
        d
    }

    #[test]
    fn context_fits_the_budget() {
        assert!(dcqcn().context_bytes() <= 128, "{}", dcqcn().context_bytes());
    }

    #[test]
    fn cnp_cuts_the_rate_by_alpha_over_two() {
        let mut d = dcqcn();
        let c = d.p.line_rate;
        let mut out = CcOutput::default();
        d.on_rx(1000, &RxMeta::plain(RxKind::Cnp, 0), &mut out);
        assert_eq!(d.rate(), c / 2, "alpha starts at 1");
        assert_eq!(out.rate, Some(Some(c / 2)));
        assert_eq!(d.target_rate(), c);
        let a = d.alpha();
        d.on_rx(2000, &RxMeta::plain(RxKind::Cnp, 0), &mut out);
        assert!((d.rate() as f64 - c as f64 / 2.0 * (1.0 - a / 2.0)).abs() < 2.0);
        // floor
        for t in 0..200 {
            d.on_rx(3000 + t, &RxMeta::plain(RxKind::Cnp, 0), &mut out);
        }
        assert_eq!(d.rate(), d.p.min_rate);
    }

    #[test]
    fn recovery_goes_fast_then_additive_then_hyper() {
        let mut d = dcqcn();
        let p = d.p.clone();
        let mut out = CcOutput::default();
        d.on_rx(0, &RxMeta::plain(RxKind::Cnp, 0), &mut out);
        let target = d.target_rate();
        let mut now = 0;
        // F timer stages of fast recovery: the rate approaches the unchanged target
        for _ in 0..p.fast_recovery {
            now += p.rate_timer_ns;
            d.on_timer(now, &mut out);
            assert_eq!(d.target_rate(), target);
        }
        assert!(d.rate() > p.line_rate / 2 && d.rate() < target);
        // then the target grows (additive while the byte counter lags)
        now += p.rate_timer_ns;
        d.on_timer(now, &mut out);
        assert_eq!(d.target_rate(), (target + p.rate_ai).min(p.line_rate));
        // alpha decays without CNPs
        let a = d.alpha();
        now += p.alpha_period_ns;
        d.on_timer(now, &mut out);
        assert!(d.alpha() < a);
        // and the rate gets back to line rate eventually
        for _ in 0..10_000 {
            now += p.rate_timer_ns;
            d.on_timer(now, &mut out);
            d.on_tx(now, &tx(4096), &mut out);
        }
        assert_eq!(d.rate(), p.line_rate);
    }

    #[test]
    fn receiver_sends_at_most_one_cnp_per_interval() {
        let mut d = dcqcn();
        let iv = d.p.cnp_interval_ns;
        let mut cnps = 0;
        for t in (0..10 * iv).step_by(1000) {
            let mut out = CcOutput::default();
            d.on_rx(
                t,
                &RxMeta {
                    ce: true,
                    ..RxMeta::plain(RxKind::Data, 4096)
                },
                &mut out,
            );
            cnps += out.generate.is_some() as u32;
            // unmarked packets never generate one
            let mut out = CcOutput::default();
            d.on_rx(
                t,
                &RxMeta {
                    ce: false,
                    ..RxMeta::plain(RxKind::Data, 4096)
                },
                &mut out,
            );
            assert!(out.generate.is_none());
        }
        assert_eq!(cnps, 10);
    }
}
