//! Homa-style receiver-driven credit (Montazeri et al., SIGCOMM'18). A sender sends the first
//! `rtt_bytes` of each message unscheduled; further bytes wait for GRANTs (the TX verdict is
//! `Hold` without credit). The receiver ranks the QPs sending to it by the bytes their current
//! messages have left (SRPT, through the host's [`SrptRanking`]) and grants the `overcommit`
//! shortest one RTT of bytes ahead of what arrived, with the rank as priority; the others wait,
//! re-checking on a timer. Defaults from HomaModule's `homa_init()` (github.com/PlatformLab/HomaModule).
//!
//! Not modelled: switch priority queues (priorities travel in the GRANT but the simulator's
//! switches and the testbed's bottleneck are single FIFOs), RESEND/BUSY (the RC transport's own
//! retransmission recovers losses, and retransmissions need no credit).

use super::header::{GrantHdr, HomaDataHdr};
use super::{CcAlgorithm, CcOutput, Generate, HeaderSpec, RxKind, RxMeta, StartInfo, Traced, TxMeta, Verdict};
use std::sync::Arc;

pub use super::params::HomaParams;

/// A receiving host's SRPT ranking of its inbound messages, shared by the host's QPs on
/// whatever core runs them. The protocol core holds no lock, so the driver supplies it
/// (netstack's `cc::HomaScheduler`).
pub trait SrptRanking: Send + Sync + std::fmt::Debug {
    /// A new id for a QP's inbound messages.
    fn register(&self) -> u64;
    /// Records that QP `id` has `remaining` bytes to come and returns its SRPT rank (0 = the
    /// fewest bytes left); a finished message (`remaining` 0) leaves the ranking.
    fn update(&self, id: u64, remaining: u64) -> u32;
    /// QP `id` is gone.
    fn remove(&self, id: u64);
}

/// SRPT ranking over the inbound messages `inbound` (QP id, bytes left): records that QP `id`
/// has `remaining` bytes to come and returns its rank (0 = the fewest bytes left, ties by id);
/// a finished message (`remaining` 0) leaves the list. What an [`SrptRanking`] computes under
/// whatever sharing it uses.
pub fn srpt_rank(inbound: &mut Vec<(u64, u64)>, id: u64, remaining: u64) -> u32 {
    inbound.retain(|e| e.0 != id);
    if remaining == 0 {
        return 0;
    }
    inbound.push((id, remaining));
    inbound.iter().filter(|e| (e.1, e.0) < (remaining, id)).count() as u32
}

/// The ranking of a QP that shares it with no other: its message always ranks first. QPs made
/// outside an engine start with it; the engine installs its host's shared ranking.
#[derive(Debug, Default, Clone, Copy)]
pub struct Unshared;

impl SrptRanking for Unshared {
    fn register(&self) -> u64 {
        0
    }
    fn update(&self, _: u64, _: u64) -> u32 {
        0
    }
    fn remove(&self, _: u64) {}
}

/// The per-QP Homa context: the sending half's credit and the receiving half's grant state.
#[derive(Debug)]
pub struct Homa {
    p: Arc<HomaParams>,
    sched: Arc<dyn SrptRanking>,
    id: u64,
    /// Sender: payload bytes sent (first transmissions) and the most it may have sent.
    sent: u64,
    allowed: u64,
    /// Receiver: the sender's stream position seen so far, bytes left in its current message,
    /// the offset granted.
    received: u64,
    remaining: u64,
    granted: u64,
}

impl Homa {
    /// A sender and receiver of one QP, ranked by the host's scheduler `sched`.
    pub fn new(p: Arc<HomaParams>, sched: Arc<dyn SrptRanking>) -> Homa {
        let id = sched.register();
        Homa {
            p,
            sched,
            id,
            sent: 0,
            allowed: 0,
            received: 0,
            remaining: 0,
            granted: 0,
        }
    }

    /// Sender: bytes of credit left.
    pub fn credit(&self) -> u64 {
        self.allowed.saturating_sub(self.sent)
    }

    /// Receiver: grants the current message up to one RTT ahead if it ranks among the
    /// `overcommit` shortest; otherwise re-checks on the timer.
    fn maybe_grant(&mut self, now: u64, out: &mut CcOutput) {
        let rank = self.sched.update(self.id, self.remaining);
        if self.remaining == 0 {
            return;
        }
        if rank >= self.p.overcommit {
            out.timer = Some(now + self.p.grant_timer_ns);
            return;
        }
        let offset = self.received + self.remaining.min(self.p.rtt_bytes);
        if offset > self.granted {
            self.granted = offset;
            out.generate = Some(Generate::Grant {
                offset,
                prio: rank.min(7) as u8,
            });
        }
    }
}

impl Drop for Homa {
    fn drop(&mut self) {
        self.sched.remove(self.id);
    }
}

impl CcAlgorithm for Homa {
    fn name(&self) -> &'static str {
        "homa"
    }

    fn traced(&self) -> Traced {
        Traced {
            tx_data: true,
            rx_data: true,
            rx_grant: true,
            ..Traced::default()
        }
    }

    fn header(&self) -> HeaderSpec {
        HeaderSpec {
            data_bytes: HomaDataHdr::LEN as u8,
            echo_in_ack: false,
            host_delay: false,
        }
    }

    fn on_start(&mut self, _now: u64, _info: &StartInfo, _out: &mut CcOutput) {}

    fn on_tx(&mut self, _now: u64, pkt: &TxMeta, _out: &mut CcOutput) -> Verdict {
        if pkt.retransmit {
            return Verdict::Send;
        }
        if pkt.first {
            // a new message: its first RTT of bytes goes unscheduled
            self.allowed = self.allowed.max(self.sent + pkt.msg_bytes.min(self.p.rtt_bytes));
        }
        if self.sent < self.allowed {
            self.sent += pkt.payload as u64;
            Verdict::Send
        } else {
            Verdict::Hold
        }
    }

    fn write_header(&mut self, _now: u64, pkt: &TxMeta, hdr: &mut [u8]) {
        let remaining = pkt.msg_remaining.min(u32::MAX as u64) as u32;
        HomaDataHdr {
            remaining,
            sent_end: self.sent,
        }
        .emit(hdr);
    }

    fn on_rx(&mut self, now: u64, pkt: &RxMeta<'_>, out: &mut CcOutput) {
        match pkt.kind {
            RxKind::Grant => {
                if let Some(g) = GrantHdr::parse(pkt.cc) {
                    self.allowed = self.allowed.max(g.offset);
                }
            }
            RxKind::Data => {
                let Some(h) = HomaDataHdr::parse(pkt.cc) else { return };
                if h.sent_end < self.received {
                    return; // a retransmission or a reordered packet: nothing new
                }
                self.received = h.sent_end;
                self.remaining = h.remaining as u64;
                if self.granted < self.received {
                    // the unscheduled part counts as granted
                    self.granted = self.received;
                }
                self.maybe_grant(now, out);
            }
            _ => {}
        }
    }

    fn on_timer(&mut self, now: u64, out: &mut CcOutput) {
        self.maybe_grant(now, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tx(first: bool, msg: u64, payload: u32) -> TxMeta {
        TxMeta {
            opcode: 0x07,
            bytes: payload + 40,
            payload,
            first,
            msg_bytes: msg,
            msg_remaining: msg - payload as u64,
            retransmit: false,
        }
    }

    fn rx_data(h: &mut Homa, now: u64, remaining: u32) -> CcOutput {
        let mut cc = vec![0u8; HomaDataHdr::LEN];
        let sent_end = h.received + 1000;
        HomaDataHdr { remaining, sent_end }.emit(&mut cc);
        let payload = 1000;
        let mut out = CcOutput::default();
        h.on_rx(
            now,
            &RxMeta {
                cc: &cc,
                payload,
                ..RxMeta::plain(RxKind::Data, 1040)
            },
            &mut out,
        );
        out
    }

    #[test]
    fn context_fits_the_budget() {
        let h = Homa::new(Arc::new(HomaParams::default()), Arc::new(Unshared));
        assert!(h.context_bytes() <= 128);
    }

    #[test]
    fn sender_holds_after_the_unscheduled_bytes_until_granted() {
        let p = Arc::new(HomaParams {
            rtt_bytes: 3000,
            ..HomaParams::default()
        });
        let mut h = Homa::new(p, Arc::new(Unshared));
        let mut out = CcOutput::default();
        assert_eq!(h.on_tx(0, &tx(true, 10_000, 1000), &mut out), Verdict::Send);
        assert_eq!(h.on_tx(0, &tx(false, 10_000, 1000), &mut out), Verdict::Send);
        assert_eq!(h.on_tx(0, &tx(false, 10_000, 1000), &mut out), Verdict::Send);
        assert_eq!(h.on_tx(0, &tx(false, 10_000, 1000), &mut out), Verdict::Hold);
        let mut g = [0u8; GrantHdr::LEN];
        GrantHdr { offset: 5000, prio: 0 }.emit(&mut g);
        h.on_rx(
            1,
            &RxMeta {
                cc: &g,
                ..RxMeta::plain(RxKind::Grant, 40)
            },
            &mut out,
        );
        assert_eq!(h.credit(), 2000);
        assert_eq!(h.on_tx(2, &tx(false, 10_000, 1000), &mut out), Verdict::Send);
        // retransmissions never wait for credit
        let mut r = tx(false, 10_000, 1000);
        r.retransmit = true;
        h.sent = h.allowed;
        assert_eq!(h.on_tx(3, &r, &mut out), Verdict::Send);
    }

    /// A shared ranking for the test (the driver's real one lives in netstack).
    #[derive(Debug, Default)]
    struct TestRanking(
        #[expect(
            clippy::disallowed_types,
            reason = "a test's stand-in for the driver's shared ranking"
        )]
        std::sync::Mutex<Vec<(u64, u64)>>,
        std::sync::atomic::AtomicU64,
    );

    impl SrptRanking for TestRanking {
        fn register(&self) -> u64 {
            self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        }
        fn update(&self, id: u64, remaining: u64) -> u32 {
            srpt_rank(&mut self.0.lock().unwrap(), id, remaining)
        }
        fn remove(&self, id: u64) {
            self.0.lock().unwrap().retain(|e| e.0 != id);
        }
    }

    #[test]
    fn receiver_grants_the_shortest_messages_first() {
        let sched = Arc::new(TestRanking::default());
        let p = Arc::new(HomaParams {
            rtt_bytes: 4000,
            overcommit: 1,
            grant_timer_ns: 1000,
        });
        let mut long = Homa::new(p.clone(), sched.clone());
        let mut short = Homa::new(p.clone(), sched.clone());
        let o = rx_data(&mut long, 0, 90_000);
        assert_eq!(o.generate, Some(Generate::Grant { offset: 5000, prio: 0 }));
        // a shorter message arrives: it ranks first, the long one stops being granted
        let o = rx_data(&mut short, 1, 5_000);
        assert_eq!(o.generate, Some(Generate::Grant { offset: 5000, prio: 0 }));
        let o = rx_data(&mut long, 2, 89_000);
        assert_eq!(o.generate, None);
        assert_eq!(o.timer, Some(2 + 1000));
        // the short one finishes; the long one's timer finds it first again
        rx_data(&mut short, 3, 0);
        let mut o = CcOutput::default();
        long.on_timer(1002, &mut o);
        assert_eq!(o.generate, Some(Generate::Grant { offset: 6000, prio: 0 }));
        drop(long);
        drop(short);
        assert!(sched.0.lock().unwrap().is_empty());
    }
}
