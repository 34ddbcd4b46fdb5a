//! TIMELY (Mittal et al., SIGCOMM'15): rate control from RTT samples and their gradient. Below
//! `t_low` the rate grows additively; above `t_high` it falls towards `t_high`; in between a
//! negative or zero gradient grows it (five times faster after `hai_thresh` such steps) and a
//! positive gradient cuts it by `beta × gradient`. One update per `min_rtt` at most. Defaults
//! from the HPCC ns-3 setup, except the EWMA weight: the TIMELY authors' reference value 0.02
//! (ns-3 uses 0.875, which turns the tens of microseconds of scheduling jitter of a software
//! stack into steep gradients and collapses the rate; the HPCC artifact is
//! github.com/alibaba-edu/High-Precision-Congestion-Control, `rdma-hw.cc`).

use super::{CcAlgorithm, CcOutput, RxKind, RxMeta, StartInfo, Traced};
use std::sync::Arc;

pub use super::params::TimelyParams;

/// The per-QP TIMELY context.
#[derive(Debug)]
pub struct Timely {
    p: Arc<TimelyParams>,
    rate: f64,
    prev_rtt: u64,
    rtt_diff: f64,
    inc_stage: u32,
    last_update: u64,
}

impl Timely {
    /// A flow starting at line rate.
    pub fn new(p: Arc<TimelyParams>) -> Timely {
        let rate = p.line_rate as f64;
        Timely {
            p,
            rate,
            prev_rtt: 0,
            rtt_diff: 0.0,
            inc_stage: 0,
            last_update: 0,
        }
    }

    /// Current rate, bytes per second.
    pub fn rate(&self) -> u64 {
        self.rate as u64
    }

    fn update(&mut self, rtt: u64) {
        let p = &self.p;
        if self.prev_rtt == 0 {
            self.prev_rtt = rtt;
            return;
        }
        let new_diff = rtt as f64 - self.prev_rtt as f64;
        self.prev_rtt = rtt;
        self.rtt_diff = (1.0 - p.ewma) * self.rtt_diff + p.ewma * new_diff;
        let grad = self.rtt_diff / p.min_rtt_ns as f64;
        let step = if self.inc_stage >= p.hai_thresh { 5.0 } else { 1.0 } * p.delta as f64;
        if rtt < p.t_low_ns {
            self.rate += step;
            self.inc_stage += 1;
        } else if rtt > p.t_high_ns {
            self.rate *= 1.0 - p.beta * (1.0 - p.t_high_ns as f64 / rtt as f64);
            self.inc_stage = 0;
        } else if grad <= 0.0 {
            self.rate += step;
            self.inc_stage += 1;
        } else {
            self.rate *= (1.0 - p.beta * grad).max(0.0);
            self.inc_stage = 0;
        }
        self.rate = self.rate.clamp(p.min_rate as f64, p.line_rate as f64);
    }
}

impl CcAlgorithm for Timely {
    fn name(&self) -> &'static str {
        "timely"
    }

    fn traced(&self) -> Traced {
        Traced {
            rx_ack: true,
            ..Traced::default()
        }
    }

    fn on_start(&mut self, _now: u64, _info: &StartInfo, out: &mut CcOutput) {
        out.rate = Some(Some(self.rate as u64));
    }

    fn on_rx(&mut self, now: u64, pkt: &RxMeta<'_>, out: &mut CcOutput) {
        let (RxKind::Ack, Some(rtt)) = (pkt.kind, pkt.rtt_ns) else {
            return;
        };
        if self.last_update != 0 && now.saturating_sub(self.last_update) < self.p.min_rtt_ns {
            return;
        }
        self.last_update = now.max(1);
        self.update(rtt);
        out.rate = Some(Some(self.rate as u64));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ack(rtt: u64) -> RxMeta<'static> {
        RxMeta {
            kind: RxKind::Ack,
            bytes: 16,
            payload: 0,
            cc: &[],
            ce: false,
            rtt_ns: Some(rtt),
            host_delay_ns: None,
        }
    }

    fn feed(t: &mut Timely, now: &mut u64, rtt: u64, n: usize) {
        for _ in 0..n {
            *now += 30_000;
            t.on_rx(*now, &ack(rtt), &mut CcOutput::default());
        }
    }

    #[test]
    fn context_fits_the_budget() {
        assert!(Timely::new(Arc::new(TimelyParams::default())).context_bytes() <= 128);
    }

    #[test]
    fn high_rtt_cuts_rising_rtt_cuts_low_rtt_grows() {
        // little smoothing (ns-3's weight), so each step shows in the gradient at once
        let p = Arc::new(TimelyParams {
            ewma: 0.875,
            ..TimelyParams::default()
        });
        let mut t = Timely::new(p.clone());
        let mut now = 0;
        // RTT far above T_high: multiplicative decrease towards T_high
        feed(&mut t, &mut now, 2_000_000, 2);
        let high = t.rate();
        assert!(high < p.line_rate / 2, "{high}");
        // between the thresholds with a rising RTT: the gradient cuts further
        let mut rtt = 100_000;
        let before = t.rate();
        for _ in 0..5 {
            rtt += 20_000;
            feed(&mut t, &mut now, rtt, 1);
        }
        assert!(t.rate() < before);
        // below T_low: additive increase, then hyper-active after 5 steps
        let low = t.rate();
        feed(&mut t, &mut now, 10_000, 5);
        let after5 = t.rate();
        assert_eq!(after5, low + 5 * p.delta);
        feed(&mut t, &mut now, 10_000, 1);
        assert_eq!(t.rate(), after5 + 5 * p.delta);
        // samples closer than min_rtt are ignored; retransmitted packets give none
        let r = t.rate();
        t.on_rx(now + 1, &ack(10_000), &mut CcOutput::default());
        t.on_rx(
            now + 40_000,
            &RxMeta { rtt_ns: None, ..ack(0) },
            &mut CcOutput::default(),
        );
        assert_eq!(t.rate(), r);
    }

    #[test]
    fn default_smoothing_rides_out_a_jitter_spike() {
        let p = Arc::new(TimelyParams::default());
        let mut t = Timely::new(p.clone());
        let mut now = 0;
        feed(&mut t, &mut now, 60_000, 20); // steady RTT between the thresholds
        let steady = t.rate();
        feed(&mut t, &mut now, 130_000, 1); // one scheduling hiccup
        feed(&mut t, &mut now, 60_000, 1);
        assert!(t.rate() as f64 > steady as f64 * 0.9, "{} vs {steady}", t.rate());
    }
}
