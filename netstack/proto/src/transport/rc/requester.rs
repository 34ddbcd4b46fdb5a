//! The requester half of an RC QP: the send queue, PSN assignment, segmentation, the
//! acknowledgement window, retransmission (go-back-N or selective) and send-side completions.

use super::{QpState, RcConfig, RcQp, Recovery};
use crate::cc::TxMeta;
use crate::memory::{Access, KeyTable, SharedRegion};
use crate::path::{PathSet, NO_PATH};
use crate::transport::ledger::{Flight, Leave, SendTime, SentLedger};
use crate::transport::pacing::Pacer;
use crate::transport::{psn_unwrap, PayloadPart, TxPacket};
use crate::wire::*;
use crate::work::*;
use smallvec::SmallVec;
use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;

/// Smallest reordering window of selective repeat (a quarter of the smoothed RTT otherwise).
const MIN_REORDER_NS: u64 = 2_000;
/// Most quarter RTTs the reordering window widens to after spurious retransmissions.
const MAX_REO_STEPS: u32 = 16;
/// Most timeouts in a row that count as a path's failure rather than a retry (about half a
/// second at the default timeout); past them a packet no path delivers spends the retry budget.
const MAX_PATH_TIMEOUTS: u32 = 32;

/// Every this many packets of a long message carries AckReq.
const ACKREQ_EVERY: u32 = 16;

/// RNR timer codes (IBA Table 45) in nanoseconds.
pub fn rnr_delay_ns(code: u8) -> u64 {
    const US_X100: [u64; 32] = [
        65536, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072,
        4096, 6144, 8192, 12288, 16384, 24576, 32768, 49152,
    ];
    US_X100[(code & 31) as usize] * 10_000
}

#[derive(Debug, Clone)]
struct Seg<R> {
    region: Arc<R>,
    off: usize,
    len: usize,
}

#[derive(Debug)]
struct SendWqe<R> {
    wr_id: u64,
    op: WrOpcode,
    signaled: bool,
    fence: bool,
    solicited: bool,
    total: u64,
    segs: SmallVec<[Seg<R>; 2]>,
    /// Set when the local memory check failed at post time.
    bad: Option<WcStatus>,
    remote_addr: u64,
    rkey: u32,
    imm: u32,
    compare_add: u64,
    swap: u64,
    recv_seq: u32,
    first_psn: Option<u64>,
    npkts: u32,
    /// OFFLOAD: the request bytes; the response buffer is `segs` (`total` bytes).
    req: Option<Arc<R>>,
    /// OFFLOAD: the result the response's last packet carried (status, length).
    result: Option<OffloadResult>,
}

impl<R: SharedRegion> SendWqe<R> {
    fn is_rd_atomic(&self) -> bool {
        matches!(
            self.op,
            WrOpcode::RdmaRead | WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd | WrOpcode::Offload
        )
    }
    fn contains(&self, psn: u64) -> bool {
        self.first_psn.is_some_and(|f| psn >= f && psn < f + self.npkts as u64)
    }
    fn wc(&self, status: WcStatus, qpn: u32, dest: u32) -> Wc {
        let mut wc = Wc {
            wr_id: self.wr_id,
            status,
            opcode: WcOpcode::from_wr(self.op),
            byte_len: if status == WcStatus::Success {
                self.total as u32
            } else {
                0
            },
            imm_data: None,
            qp_num: qpn,
            src_qp: dest,
            vendor_err: 0,
        };
        if let (Some(r), WcStatus::Success) = (self.result, status) {
            // an offload that failed at the peer fails this request only; the QP stays usable
            wc.byte_len = if r.status == 0 { r.len } else { 0 };
            if r.status != 0 {
                wc.status = WcStatus::RemOpErr;
                wc.vendor_err = r.status as u32;
            }
        }
        wc
    }
}

/// A WC with WR_FLUSH_ERR for a WR posted to a QP in ERR.
pub(super) fn flush_wc(wr: &SendWr, qpn: u32, dest: u32) -> Wc {
    Wc {
        wr_id: wr.wr_id,
        status: WcStatus::WrFlushErr,
        opcode: WcOpcode::from_wr(wr.opcode),
        byte_len: 0,
        imm_data: None,
        qp_num: qpn,
        src_qp: dest,
        vendor_err: 0,
    }
}

/// Bytes a packet occupies on the wire above UDP (headers, payload, pad, ICRC).
/// The congestion-control view of packet `k` of a SEND or WRITE (none for other operations).
fn tx_meta<R: SharedRegion>(
    w: &SendWqe<R>,
    k: u32,
    pkt: &TxPacket<R>,
    retransmit: bool,
    cfg: &RcConfig,
) -> Option<TxMeta> {
    if !matches!(
        w.op,
        WrOpcode::Send | WrOpcode::SendWithImm | WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm
    ) {
        return None;
    }
    let payload = pkt.payload_len() as u64;
    let end = (k as u64 * cfg.mtu as u64 + payload).min(w.total);
    Some(TxMeta {
        opcode: pkt.hdr.as_bytes()[0],
        bytes: wire_bytes(pkt) as u32,
        payload: payload as u32,
        first: k == 0,
        msg_bytes: w.total,
        msg_remaining: w.total - end,
        retransmit,
    })
}

fn wire_bytes<R: SharedRegion>(p: &TxPacket<R>) -> u64 {
    (p.hdr.len() + p.payload_len() + p.hdr.bth().pad as usize + 4) as u64
}

fn gather<R>(segs: &[Seg<R>], mut off: usize, mut len: usize) -> SmallVec<[PayloadPart<R>; 2]> {
    let mut out = SmallVec::new();
    for s in segs {
        if len == 0 {
            break;
        }
        if off >= s.len {
            off -= s.len;
            continue;
        }
        let n = (s.len - off).min(len);
        out.push(PayloadPart {
            region: s.region.clone(),
            off: s.off + off,
            len: n,
        });
        len -= n;
        off = 0;
    }
    out
}

/// Places response data into the WQE's segments; returns the bytes copied.
fn scatter<R: SharedRegion>(segs: &[Seg<R>], mut off: usize, mut data: &[u8]) -> u64 {
    let mut copied = 0;
    for s in segs {
        if data.is_empty() {
            break;
        }
        if off >= s.len {
            off -= s.len;
            continue;
        }
        let n = (s.len - off).min(data.len());
        s.region.write(s.off + off, &data[..n]);
        copied += n as u64;
        data = &data[n..];
        off = 0;
    }
    copied
}

pub(super) struct Requester<R> {
    sq: VecDeque<SendWqe<R>>,
    /// Index in `sq` of the WQE being transmitted, and the packet within it.
    cursor: usize,
    cursor_pkt: u32,
    /// The record of every PSN from the oldest unacknowledged one (`una`) to the next one to
    /// assign (`next_psn`): send time, path, acknowledged.
    ledger: SentLedger<()>,
    /// One past the highest PSN ever sent.
    sent_max: u64,
    /// An RTT sample taken by the last ACK, for congestion control.
    pub(super) rtt_sample: Option<u64>,
    /// What congestion control sees of the data packet `poll_transmit` returned last.
    pub(super) last_meta: Option<TxMeta>,
    /// Selective repeat: PSNs to resend, and the PSN below which holes were already resent.
    retx: BTreeSet<u64>,
    retx_done_up_to: u64,
    /// Selective repeat: resent PSNs not yet acknowledged, with when they were resent, so RACK
    /// finds a lost retransmission too (a packet sent after it was delivered) instead of
    /// leaving it to the retransmission timer.
    resent: std::collections::BTreeMap<u64, Resend>,
    /// PSNs queued for resending by RACK's reordering rule (not by a timeout or a dead path):
    /// only their resends tell whether the reordering window is too small.
    rack_marked: BTreeSet<u64>,
    /// Selective repeat (RACK): one past the highest PSN a SACK reported, the smoothed RTT, the
    /// send time and RTT of the most recently sent packet known delivered, and when the oldest
    /// hole that was too young to call lost (it may be reordered) becomes old enough.
    sack_high: u64,
    rtt: crate::rtt::RttEstimator,
    rack_xmit: u64,
    rack_rtt: u64,
    /// RACK's reordering window is `(1 + reo_steps)` quarter RTTs (plus the path spread):
    /// a spurious retransmission (its packet was acknowledged sooner after the resend than the
    /// network can answer) widens it a step, up to 16; 1024 packets acknowledged without one
    /// narrow it a step.
    reo_steps: u32,
    reo_clean: u32,
    /// Smallest RTT sample seen.
    min_rtt: u64,
    /// Retransmissions found spurious so far.
    pub(super) spurious: u64,
    reorder_deadline: Option<u64>,
    deadline: Option<u64>,
    retries: u32,
    /// Timeouts in a row while another path delivered (see `handle_timeout`).
    path_timeouts: u32,
    /// When the retransmission timer last fired (ns).
    last_timeout: u64,
    rnr_retries: u32,
    rnr_until: Option<u64>,
    rnr_psn: u64,
    last_rewind: Option<u64>,
    rd_outstanding: u32,
    next_recv_seq: u32,
    /// WQEs removed from the send queue (completed, failed or flushed) so far.
    retired: u64,
    /// Rate and window limits (driven by congestion control).
    pub(super) pacer: Pacer,
    /// The QP's paths (each PSN's is in the ledger).
    pub(super) paths: PathSet,
    /// Routes the driver has for the paths (see [`RcQp::set_source_ports`]).
    pub(super) source_ports: usize,
}

/// A selective-repeat resend not yet acknowledged.
#[derive(Debug, Clone, Copy)]
struct Resend {
    /// When it was resent.
    at: u64,
    /// Whether RACK's reordering rule called the first copy lost (rather than a timeout or a
    /// dead path): only then does an early acknowledgement mean the resend was spurious.
    by_rack: bool,
    /// The path the first copy went on ([`NO_PATH`] if unknown).
    first_path: u8,
}

impl<R: SharedRegion> Requester<R> {
    pub(super) fn new(psn: u64) -> Requester<R> {
        Requester {
            sq: VecDeque::new(),
            cursor: 0,
            cursor_pkt: 0,
            ledger: SentLedger::new(psn),
            sent_max: psn,
            rtt_sample: None,
            last_meta: None,
            retx: BTreeSet::new(),
            retx_done_up_to: psn,
            resent: Default::default(),
            rack_marked: BTreeSet::new(),
            sack_high: psn,
            rtt: Default::default(),
            rack_xmit: 0,
            rack_rtt: 0,
            reo_steps: 0,
            reo_clean: 0,
            min_rtt: u64::MAX,
            spurious: 0,
            reorder_deadline: None,
            deadline: None,
            retries: 0,
            path_timeouts: 0,
            last_timeout: 0,
            rnr_retries: 0,
            rnr_until: None,
            rnr_psn: 0,
            last_rewind: None,
            rd_outstanding: 0,
            next_recv_seq: 0,
            retired: 0,
            pacer: Pacer::default(),
            paths: PathSet::default(),
            source_ports: 0,
        }
    }

    pub(super) fn reset_psn(&mut self, psn: u64) {
        let sq = std::mem::take(&mut self.sq);
        let retired = self.retired;
        let pacer = std::mem::take(&mut self.pacer);
        let paths = std::mem::take(&mut self.paths);
        *self = Requester::new(psn);
        self.sq = sq;
        self.retired = retired;
        self.pacer = pacer;
        self.paths = paths;
    }

    pub(super) fn retired(&self) -> u64 {
        self.retired
    }

    /// Counts a WR that was answered without entering the send queue.
    pub(super) fn retire_unqueued(&mut self) {
        self.retired += 1;
    }

    pub(super) fn outstanding(&self) -> usize {
        self.sq.len()
    }

    /// The oldest unacknowledged PSN.
    pub(super) fn una(&self) -> u64 {
        self.ledger.base()
    }

    /// The next PSN to assign.
    fn next_psn(&self) -> u64 {
        self.ledger.end()
    }

    pub(super) fn heap_bytes(&self) -> usize {
        self.sq.capacity() * std::mem::size_of::<SendWqe<R>>() + self.ledger.heap_bytes() + self.retx.len() * 24
    }

    /// Queues a WR. `inline` carries the payload of an INLINE WR that was copied out of the
    /// caller's buffers already (the engine's send queue carries it in the WQE slots); without
    /// it an INLINE WR's payload is copied from its SGEs now.
    pub(super) fn post(
        &mut self,
        wr: SendWr,
        inline: Option<&[u8]>,
        pd: u32,
        cfg: &RcConfig,
        mrs: &impl KeyTable<Region = R>,
    ) -> Result<(), super::PostError> {
        crate::work::validate_send(&wr).map_err(super::PostError::Invalid)?;
        let atomic = matches!(wr.opcode, WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd);
        let need = if matches!(wr.opcode, WrOpcode::RdmaRead) || atomic {
            Access::LOCAL_WRITE
        } else {
            Access(0)
        };
        let mut segs: SmallVec<[Seg<R>; 2]> = SmallVec::new();
        let mut bad = None;
        let mut total = wr.total_len();
        let mut req = None;
        if wr.opcode == WrOpcode::Offload {
            let data = inline.unwrap_or_default();
            if data.len() + OffloadReqHdr::LEN > cfg.mtu as usize {
                return Err(super::PostError::Invalid(
                    "offload request longer than the MTU less 8 bytes",
                ));
            }
            if total > super::offload::MAX_OFFLOAD_RESP as u64 {
                return Err(super::PostError::Invalid("offload response buffer larger than 1 MiB"));
            }
            req = Some(Arc::new(R::from_bytes(data)));
            for s in &wr.sg_list {
                match mrs.check(s.lkey, pd, s.addr, s.length as u64, Access::LOCAL_WRITE) {
                    Ok((region, off)) => segs.push(Seg {
                        region,
                        off,
                        len: s.length as usize,
                    }),
                    Err(_) => bad = Some(WcStatus::LocProtErr),
                }
            }
        } else if matches!(wr.opcode, WrOpcode::Wait | WrOpcode::Enable) {
            return Err(super::PostError::Invalid(
                "WAIT and ENABLE are executed by managed QPs only",
            ));
        } else if wr.opcode == WrOpcode::Noop {
            // a NOOP's fields (a RedN placeholder's future WRITE) are not used
            total = 0;
        } else if let Some(data) = inline {
            segs.push(Seg {
                region: Arc::new(R::from_bytes(data)),
                off: 0,
                len: data.len(),
            });
            total = data.len() as u64;
        } else {
            for s in &wr.sg_list {
                match mrs.check(s.lkey, pd, s.addr, s.length as u64, need) {
                    Ok((region, off)) => segs.push(Seg {
                        region,
                        off,
                        len: s.length as usize,
                    }),
                    Err(_) => bad = Some(WcStatus::LocProtErr),
                }
            }
            if wr.flags.contains(SendFlags::INLINE) && bad.is_none() {
                // copy the payload now, so the caller may reuse its buffer as soon as post returns
                let mut data = Vec::with_capacity(total as usize);
                for s in &segs {
                    s.region.append_to(s.off, s.len, &mut data);
                }
                segs = SmallVec::new();
                segs.push(Seg {
                    region: Arc::new(R::from_bytes(&data)),
                    off: 0,
                    len: data.len(),
                });
            }
        }
        let consumes_recv = matches!(
            wr.opcode,
            WrOpcode::Send | WrOpcode::SendWithImm | WrOpcode::RdmaWriteWithImm
        );
        let recv_seq = self.next_recv_seq;
        if consumes_recv {
            self.next_recv_seq = self.next_recv_seq.wrapping_add(1);
        }
        let mtu = cfg.mtu as u64;
        let npkts = match wr.opcode {
            _ if atomic => 1,
            WrOpcode::Offload => super::offload::response_packets(total as u32, cfg.mtu),
            WrOpcode::Noop => 0,
            _ => total.div_ceil(mtu).max(1) as u32,
        };
        self.sq.push_back(SendWqe {
            wr_id: wr.wr_id,
            op: wr.opcode,
            signaled: wr.flags.contains(SendFlags::SIGNALED),
            fence: wr.flags.contains(SendFlags::FENCE),
            solicited: wr.flags.contains(SendFlags::SOLICITED),
            total,
            segs,
            bad,
            remote_addr: wr.remote_addr,
            rkey: wr.rkey,
            imm: wr.imm_data,
            compare_add: wr.compare_add,
            swap: wr.swap,
            recv_seq,
            first_psn: None,
            npkts,
            req,
            result: None,
        });
        Ok(())
    }

    /// The RTT of the packet with PSN `psn`, acknowledged now (none for a resent packet).
    fn rtt_of(&self, psn: u64, now: u64) -> Option<u64> {
        self.ledger.rtt_of(psn, now)
    }

    fn is_acked(&self, psn: u64) -> bool {
        self.ledger.is_acked(psn)
    }

    fn mark(&mut self, psn: u64, now: u64) {
        if psn >= self.una() {
            self.ledger.set_acked(psn);
            self.ledger.take_off(psn, Leave::Delivered(now), &mut self.paths);
            if !self.resent.is_empty() {
                if let Some(Resend {
                    at: t,
                    by_rack,
                    first_path,
                }) = self.resent.remove(&psn)
                {
                    // acknowledged sooner after the resend than half the smallest RTT: the
                    // first copy arrived, it was only overtaken
                    let age = now.saturating_sub(t);
                    if by_rack && self.min_rtt != u64::MAX && age < self.min_rtt / 2 {
                        self.spurious += 1;
                        self.widen_reordering_window();
                        // the path it was first sent on delivered it after all
                        self.paths.on_late_delivery(first_path, now);
                    } else if self.min_rtt != u64::MAX && age >= self.min_rtt {
                        // the resend itself arrived: RACK's newest delivered send time moves
                        // on, so a lost resend sent before it is found without a timeout
                        self.rack_xmit = self.rack_xmit.max(t);
                    }
                }
            }
            if self.reo_steps > 0 {
                self.reo_clean += 1;
                if self.reo_clean >= 1024 {
                    self.reo_clean = 0;
                    self.reo_steps -= 1;
                }
            }
        }
    }

    /// A spurious retransmission: RACK's reordering window grows a quarter RTT (up to
    /// [`MAX_REO_STEPS`]).
    fn widen_reordering_window(&mut self) {
        self.reo_steps = (self.reo_steps + 1).min(MAX_REO_STEPS);
        self.reo_clean = 0;
    }

    /// The path PSN `psn` was last sent on.
    fn path_of(&self, psn: u64) -> Option<u8> {
        self.ledger.get(psn)?.flight.path()
    }

    /// Records that `psn` left on a path the policy picks now (avoiding the path a resent
    /// packet was lost on) and returns the path. A resend (`resend`) gives no RTT sample.
    fn send_on_path(&mut self, psn: u64, now: u64, resend: bool) -> u8 {
        let Some(s) = self.ledger.get(psn) else {
            return self.paths.first_up();
        };
        let avoid = s.flight.path();
        // resent while the earlier copy still counts in flight (go-back-N): forget it
        self.ledger.take_off(psn, Leave::Forgotten, &mut self.paths);
        let path = self.paths.pick(avoid);
        self.ledger.put_on(psn, path, now, resend, &mut self.paths);
        path
    }

    /// PSN `psn` is presumed lost: it leaves its path's flight (counted as that path's loss)
    /// and is queued for retransmission.
    fn presume_lost(&mut self, psn: u64) {
        self.ledger.take_off(psn, Leave::Lost, &mut self.paths);
        self.retx.insert(psn);
    }

    /// At a retransmission timeout: a path with a packet out for longer than the path's RTO
    /// moves to another route if the packet left from its current one (ECMP may hash every
    /// path onto a cut link: then none delivers, none goes down, and only a fresh hash helps).
    fn repath_timed_out(&mut self, now: u64) {
        let mut latest: SmallVec<[(u8, u64); 8]> = SmallVec::new();
        for (_, s) in self.ledger.in_flight() {
            let (Some(p), Some(t)) = (s.flight.path(), s.time.last()) else {
                continue;
            };
            if s.acked || now < t.saturating_add(self.paths.rto(p)) {
                continue;
            }
            match latest.iter_mut().find(|(q, _)| *q == p) {
                Some(e) => e.1 = e.1.max(t),
                None => latest.push((p, t)),
            }
        }
        for (p, t) in latest {
            self.paths.on_timeout(p, t, now);
        }
    }

    /// At a retransmission timeout: what is still in flight on a path silent for longer than
    /// its RTO counts as that path's loss. The resend that follows would otherwise only forget
    /// those copies, leaving a dead path with nothing in flight and no loss, which the path
    /// detector can never take down (new data kept going into a cut link for seconds).
    fn presume_silent_paths_lost(&mut self) {
        let silent: SmallVec<[u64; 16]> = self
            .ledger
            .in_flight()
            .filter(|(_, s)| !s.acked && s.flight.path().is_some_and(|p| self.paths.is_silent(p)))
            .map(|(q, _)| q)
            .collect();
        for q in silent {
            self.ledger.take_off(q, Leave::Lost, &mut self.paths);
        }
    }

    /// Go-back-N resends everything from `psn`: earlier copies stop counting in flight.
    fn forget_from(&mut self, psn: u64) {
        let from: SmallVec<[u64; 16]> = self
            .ledger
            .iter_from(psn)
            .filter(|(_, s)| matches!(s.flight, Flight::On(_)))
            .map(|(q, _)| q)
            .collect();
        for q in from {
            self.ledger.take_off(q, Leave::Forgotten, &mut self.paths);
        }
    }

    /// Path `path` went down: what is in flight on it is resent on the others (selective
    /// repeat) or everything from its oldest packet is (go-back-N).
    pub(super) fn path_down(&mut self, path: u8, cfg: &RcConfig) {
        let lost: Vec<u64> = self
            .ledger
            .in_flight()
            .filter(|(_, s)| s.flight == Flight::On(path))
            .map(|(q, _)| q)
            .collect();
        match cfg.recovery {
            Recovery::SelectiveRepeat => {
                for p in lost {
                    if !self.is_acked(p) {
                        self.presume_lost(p);
                    }
                }
            }
            Recovery::GoBackN => {
                if let Some(&first) = lost.first() {
                    self.forget_from(first);
                    self.rewind(first, false);
                }
            }
        }
    }

    fn find(&self, psn: u64) -> Option<usize> {
        // WQEs are in PSN order; started ones precede unstarted ones.
        let started = self.sq.partition_point(|w| w.first_psn.is_some());
        let idx = self
            .sq
            .partition_point(|w| w.first_psn.is_some_and(|f| f + w.npkts as u64 <= psn));
        (idx < started && self.sq[idx].contains(psn)).then_some(idx)
    }

    fn cursor_psn(&self) -> Option<u64> {
        self.sq
            .get(self.cursor)
            .and_then(|w| w.first_psn)
            .map(|f| f + self.cursor_pkt as u64)
    }

    fn rewind(&mut self, psn: u64, guarded: bool) {
        if guarded && self.last_rewind == Some(psn) && self.cursor_psn().is_none_or(|c| c > psn) {
            return;
        }
        if let Some(i) = self.find(psn) {
            self.cursor = i;
            self.cursor_pkt = (psn - self.sq[i].first_psn.unwrap_or(psn)) as u32;
            self.last_rewind = Some(psn);
        }
    }

    pub(super) fn deadline(&self) -> Option<u64> {
        // a paced QP with something to send wakes when its next packet conforms
        let paced = if self.rnr_until.is_none() && self.has_pending() {
            self.pacer.next_conforming()
        } else {
            None
        };
        [self.deadline, self.rnr_until, paced, self.reorder_deadline]
            .into_iter()
            .flatten()
            .min()
    }

    fn has_pending(&self) -> bool {
        !self.retx.is_empty() || self.cursor < self.sq.len()
    }

    /// Payload bytes in flight, in whole packets (an upper bound).
    fn inflight_bytes(&self, cfg: &RcConfig) -> u64 {
        self.sent_max.saturating_sub(self.una()) * cfg.mtu as u64
    }

    /// Packets this QP may have in flight: its window, its CC window, and its pacing rate over
    /// one smoothed RTT, whichever is smallest.
    fn window_pkts(&self, cfg: &RcConfig) -> u32 {
        let mtu = cfg.mtu.max(1) as u64;
        let mut w = cfg.window_pkts as u64;
        if let Some(b) = self.pacer.window() {
            w = w.min(b / mtu);
        }
        if let (Some(rate), true) = (self.pacer.rate(), self.rtt.srtt_ns() > 0) {
            w = w.min((rate as u128 * self.rtt.srtt_ns() as u128 / 1_000_000_000 / mtu as u128) as u64);
        }
        w.max(1) as u32
    }

    /// Whether the window lets a packet of new data go. Retransmissions are exempt: a resent
    /// packet replaces one presumed lost, and the lost ones still count in `inflight_bytes`, so
    /// gating them would deadlock a QP whose window shrank below its losses (the rate still
    /// paces them).
    fn window_ok(&self, cfg: &RcConfig) -> bool {
        self.pacer.window_open(self.inflight_bytes(cfg))
    }

    pub(super) fn wants_transmit(&self, now: u64, cfg: &RcConfig) -> bool {
        if self.rnr_until.is_some() || self.pacer.ready_at(now).is_some() {
            return false;
        }
        if !self.retx.is_empty() {
            return true;
        }
        match self.sq.get(self.cursor) {
            None => false,
            Some(w) => {
                let psn = w
                    .first_psn
                    .map(|f| f + self.cursor_pkt as u64)
                    .unwrap_or(self.next_psn());
                w.bad.is_none()
                    && psn < self.una() + cfg.window_pkts as u64
                    && (psn < self.sent_max || self.window_ok(cfg))
            }
        }
    }

    pub(super) fn flush(&mut self, qpn: u32, dest: u32) -> Vec<Wc> {
        self.retired += self.sq.len() as u64;
        let v = self
            .sq
            .drain(..)
            .map(|w| w.wc(WcStatus::WrFlushErr, qpn, dest))
            .collect();
        self.cursor = 0;
        self.cursor_pkt = 0;
        self.retx.clear();
        self.deadline = None;
        self.rnr_until = None;
        v
    }

    /// Builds packet `k` of WQE `w`; for a READ, the request covers packets `k..end`.
    fn build(w: &SendWqe<R>, k: u32, end: u32, cfg: &RcConfig, dest_qpn: u32) -> TxPacket<R> {
        let first = w.first_psn.unwrap_or(0);
        let psn = (first + k as u64) as u32;
        let mtu = cfg.mtu as u64;
        match w.op {
            WrOpcode::Offload => {
                // one request packet at the first PSN; a lost response is asked for again whole
                let mut bth = Bth::new(Opcode::OffloadRequest as u8, dest_qpn, first as u32);
                bth.ack_req = true;
                let mut hdr = HeaderBuf::with_bth(&bth);
                hdr.push_u32((w.imm & 0xFFFF) << 16).push_u32(w.total as u32);
                let len = w.req.as_ref().map_or(0, |r| r.len());
                hdr.set_pad_for(OffloadReqHdr::LEN + len);
                let mut payload = SmallVec::new();
                if let (Some(r), true) = (w.req.as_ref(), len > 0) {
                    payload.push(PayloadPart {
                        region: r.clone(),
                        off: 0,
                        len,
                    });
                }
                TxPacket { path: 0, hdr, payload }
            }
            WrOpcode::RdmaRead => {
                let off = k as u64 * mtu;
                let len = (end as u64 * mtu).min(w.total) - off.min(w.total);
                let mut bth = Bth::new(Opcode::ReadRequest as u8, dest_qpn, psn);
                bth.ack_req = true;
                let mut hdr = HeaderBuf::with_bth(&bth);
                hdr.push_reth(&Reth {
                    va: w.remote_addr.wrapping_add(off),
                    rkey: w.rkey,
                    dma_len: len as u32,
                });
                TxPacket {
                    path: 0,
                    hdr,
                    payload: SmallVec::new(),
                }
            }
            WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd => {
                let cas = w.op == WrOpcode::AtomicCmpAndSwp;
                let op = if cas { Opcode::CompareSwap } else { Opcode::FetchAdd };
                let mut bth = Bth::new(op as u8, dest_qpn, psn);
                bth.ack_req = true;
                let mut hdr = HeaderBuf::with_bth(&bth);
                let (swap_add, compare) = if cas {
                    (w.swap, w.compare_add)
                } else {
                    (w.compare_add, 0)
                };
                hdr.push_atomic(&AtomicEth {
                    va: w.remote_addr,
                    rkey: w.rkey,
                    swap_add,
                    compare,
                });
                TxPacket {
                    path: 0,
                    hdr,
                    payload: SmallVec::new(),
                }
            }
            _ => {
                let write = matches!(w.op, WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm);
                let imm = matches!(w.op, WrOpcode::SendWithImm | WrOpcode::RdmaWriteWithImm);
                let off = k as u64 * mtu;
                let len = (w.total - off.min(w.total)).min(mtu) as usize;
                let (is_first, is_last) = (k == 0, k + 1 == w.npkts);
                let mut bth = Bth::new(Opcode::for_position(write, is_first, is_last, imm) as u8, dest_qpn, psn);
                // an unsignaled message asks for no immediate ACK (the responder's coalescing
                // covers it), so a reply the peer sends at once is not queued behind one
                bth.ack_req = (is_last && w.signaled) || k % ACKREQ_EVERY == ACKREQ_EVERY - 1;
                bth.solicited = is_last && w.solicited;
                let mut hdr = HeaderBuf::with_bth(&bth);
                if write && is_first {
                    hdr.push_reth(&Reth {
                        va: w.remote_addr,
                        rkey: w.rkey,
                        dma_len: w.total as u32,
                    });
                }
                if imm && is_last {
                    hdr.push_u32(w.imm);
                }
                let mut ext_len = 0;
                if cfg.recovery == Recovery::SelectiveRepeat {
                    hdr.push_sr(&SrExt {
                        msg_offset: off as u32,
                        recv_seq: w.recv_seq,
                        va: if write { w.remote_addr } else { 0 },
                        rkey: if write { w.rkey } else { 0 },
                        msg_len: w.total as u32,
                    });
                    ext_len = SrExt::LEN;
                }
                hdr.set_pad_for(len + ext_len);
                TxPacket {
                    path: 0,
                    hdr,
                    payload: gather(&w.segs, off as usize, len),
                }
            }
        }
    }

    pub(super) fn poll_transmit(qp: &mut RcQp<R>, now: u64) -> Option<TxPacket<R>> {
        let cfg = qp.cfg;
        let dest = qp.dest_qpn;
        let r = &mut qp.req;
        if r.rnr_until.is_some() || r.pacer.ready_at(now).is_some() {
            return None;
        }
        while let Some(p) = r.retx.pop_first() {
            if r.is_acked(p) {
                continue;
            }
            let Some(i) = r.find(p) else { continue };
            let w = &r.sq[i];
            let mut k = (p - w.first_psn.unwrap_or(p)) as u32;
            let mut end = k + 1;
            let mut p = p;
            if w.op == WrOpcode::Offload {
                // the request is resent whole; the responder answers a duplicate from its job
                let f = w.first_psn.unwrap_or(p);
                for q in f..f + w.npkts as u64 {
                    r.retx.remove(&q);
                }
                (p, k, end) = (f, 0, w.npkts);
            } else if w.op == WrOpcode::RdmaRead {
                let f = w.first_psn.unwrap_or(p);
                while end < w.npkts && !r.is_acked(f + end as u64) {
                    r.retx.remove(&(f + end as u64));
                    end += 1;
                }
            }
            let mut pkt = Self::build(&r.sq[i], k, end, &cfg, dest);
            r.last_meta = tx_meta(&r.sq[i], k, &pkt, true, &cfg);
            let first_path = r.path_of(p).unwrap_or(NO_PATH);
            pkt.path = r.send_on_path(p, now, true);
            let by_rack = r.rack_marked.remove(&p);
            r.resent.insert(
                p,
                Resend {
                    at: now,
                    by_rack,
                    first_path,
                },
            );
            qp.stats.retransmitted_packets += 1;
            let r = &mut qp.req;
            r.deadline.get_or_insert(now + cfg.timeout_ns + r.paths.host_delay());
            r.pacer.on_send(now, wire_bytes(&pkt));
            return Some(pkt);
        }
        // NOOPs take no PSN and send nothing; they complete in order with the WQEs around them
        let mut noop = false;
        while let Some(w) = r.sq.get(r.cursor) {
            if w.op != WrOpcode::Noop || (w.first_psn.is_none() && w.fence && r.rd_outstanding > 0) {
                break;
            }
            let next = r.next_psn();
            r.sq[r.cursor].first_psn.get_or_insert(next);
            r.cursor += 1;
            r.cursor_pkt = 0;
            noop = true;
        }
        if noop {
            Self::progress(qp);
        }
        let r = &mut qp.req;
        let w = r.sq.get(r.cursor)?;
        if w.op == WrOpcode::Noop {
            return None; // fenced
        }
        let resending = w.first_psn.is_some_and(|f| f + (r.cursor_pkt as u64) < r.sent_max);
        if !resending && !r.window_ok(&cfg) {
            return None;
        }
        if w.first_psn.is_none() {
            if w.bad.is_some()
                || (w.fence && r.rd_outstanding > 0)
                || (w.is_rd_atomic() && r.rd_outstanding >= cfg.max_rd_atomic)
                || r.next_psn() >= r.una() + cfg.window_pkts as u64
            {
                return None;
            }
            let n = w.npkts;
            let rd = w.is_rd_atomic();
            let first = r.next_psn();
            r.sq[r.cursor].first_psn = Some(first);
            for _ in 0..n {
                r.ledger.push(());
            }
            if rd {
                r.rd_outstanding += 1;
            }
            r.cursor_pkt = 0;
        }
        let w = &r.sq[r.cursor];
        let first = w.first_psn.unwrap_or(0);
        let psn = first + r.cursor_pkt as u64;
        if psn >= r.una() + cfg.window_pkts as u64 {
            return None;
        }
        let (k, end) = if matches!(w.op, WrOpcode::RdmaRead | WrOpcode::Offload) {
            (r.cursor_pkt, w.npkts)
        } else {
            (r.cursor_pkt, r.cursor_pkt + 1)
        };
        let mut pkt = Self::build(w, k, end, &cfg, dest);
        let resent = psn < r.sent_max;
        r.last_meta = tx_meta(w, k, &pkt, resent, &cfg);
        let npkts = w.npkts;
        if end >= npkts {
            r.cursor += 1;
            r.cursor_pkt = 0;
        } else {
            r.cursor_pkt = end;
        }
        if resent {
            qp.stats.retransmitted_packets += 1;
        }
        let r = &mut qp.req;
        if r.paths.len() > 1 {
            r.paths.set_window_hint(r.window_pkts(&cfg));
        }
        pkt.path = r.send_on_path(psn, now, resent);
        r.sent_max = r.sent_max.max(first + end as u64);
        r.deadline.get_or_insert(now + cfg.timeout_ns + r.paths.host_delay());
        r.pacer.on_send(now, wire_bytes(&pkt));
        Some(pkt)
    }

    /// Marks PSNs `una..=a` acknowledged: an acknowledgement of PSN `a` acknowledges every
    /// request before it (coalesced acknowledges, IBA Vol 1 Release 1.5, 9.7.5.1.2). PSNs of
    /// READs and atomics are only acknowledged by their responses: an ACK beyond one that has no
    /// response means the response was lost. Returns the first such PSN.
    fn cum_ack(&mut self, a: u64, now: u64) -> Option<u64> {
        if a < self.una() || a >= self.next_psn() {
            return None;
        }
        let mut missing = None;
        let mut i = self.find(self.una())?;
        while let Some(w) = self.sq.get(i) {
            let Some(f) = w.first_psn else { break };
            if f > a {
                break;
            }
            let end = (f + w.npkts as u64 - 1).min(a);
            if w.is_rd_atomic() {
                if let Some(p) = (f.max(self.una())..=end).find(|&p| !self.is_acked(p)) {
                    missing = Some(p);
                    break;
                }
            } else {
                for p in f.max(self.una())..=end {
                    self.mark(p, now);
                }
            }
            i += 1;
        }
        missing
    }

    fn advance(&mut self, now: u64, cfg: &RcConfig) -> bool {
        let mut moved = false;
        if self.ledger.pop_acked() > 0 {
            moved = true;
        }
        if moved {
            self.retries = 0;
            self.path_timeouts = 0;
            self.rnr_retries = 0;
            self.last_rewind = None;
            self.retx_done_up_to = self.retx_done_up_to.max(self.una());
            if !self.resent.is_empty() {
                self.resent = self.resent.split_off(&self.una());
            }
            if !self.rack_marked.is_empty() {
                self.rack_marked = self.rack_marked.split_off(&self.una());
            }
            self.deadline = (self.una() < self.sent_max).then_some(now + cfg.timeout_ns + self.paths.host_delay());
        }
        moved
    }

    /// Go-back-N: a READ, atomic or offload response at `p` acknowledges every request before
    /// it (the responder executes in order); when an earlier response is missing, the requester
    /// asks again from there and this packet is dropped (returns true).
    fn gbn_response_gap(&mut self, p: u64, now: u64, cfg: &RcConfig) -> bool {
        if cfg.recovery != Recovery::GoBackN || p == self.una() {
            return false;
        }
        match self.cum_ack(p - 1, now) {
            Some(m) => {
                self.advance(now, cfg);
                self.rewind(m, true);
                true
            }
            None => false,
        }
    }

    fn retx_all_from(&mut self, psn: u64) {
        for p in psn.max(self.una())..self.sent_max {
            if !self.is_acked(p) {
                // counted against its path: a path that delivers keeps resetting its run of
                // losses, one that stopped does not (and a path never goes down while no
                // path delivers at all)
                self.presume_lost(p);
            }
        }
    }

    fn recover(&mut self, psn: u64, cfg: &RcConfig, guarded: bool) {
        match cfg.recovery {
            Recovery::GoBackN => self.rewind(psn, guarded),
            Recovery::SelectiveRepeat => {
                self.presume_lost(psn);
            }
        }
    }

    pub(super) fn handle(qp: &mut RcQp<R>, now: u64, pkt: &PacketView<'_>) {
        let cfg = qp.cfg;
        let r = &mut qp.req;
        let p = psn_unwrap(r.una(), pkt.bth.psn);
        // Only a PSN in [una, sent_max) names an outstanding request; anything else is a
        // ghost (IBA 9.7.5.1): dropped, never acted on, whatever it says. A positive ACK
        // behind una is the responder repeating what it acknowledged (a duplicate, whose
        // SACK still counts); a response behind una answers a request already completed.
        if p < r.una() || p >= r.sent_max {
            let ack = pkt.opcode == Opcode::Acknowledge;
            let positive = pkt.aeth.is_some_and(|a| matches!(a.syndrome, Syndrome::Ack { .. }));
            match (ack, positive, p < r.una()) {
                (true, true, true) => {} // a duplicate ACK: handled below
                (true, true, false) => {
                    qp.stats.ghost_acks += 1;
                    return;
                }
                (true, false, _) => {
                    qp.stats.ghost_naks += 1;
                    return;
                }
                (false, _, true) => {
                    qp.stats.stale_responses += 1;
                    return;
                }
                (false, _, false) => {
                    qp.stats.ghost_responses += 1;
                    return;
                }
            }
        }
        match pkt.opcode {
            Opcode::Acknowledge => {
                let Some(aeth) = pkt.aeth else { return };
                match aeth.syndrome {
                    Syndrome::Ack { .. } => {
                        if p < r.una() {
                            qp.stats.stale_responses += 1;
                        }
                        r.rtt_sample = r.rtt_of(p, now);
                        r.delivered(p, now);
                        if let Some(m) = r.cum_ack(p, now) {
                            r.recover(m, &cfg, true);
                        }
                        if cfg.recovery == Recovery::SelectiveRepeat && pkt.trailer.len() >= SackExt::LEN {
                            r.sack(&SackExt::parse(pkt.trailer), now);
                        }
                    }
                    Syndrome::Rnr { timer } => {
                        qp.stats.rnr_naks_received += 1;
                        r.cum_ack(p.saturating_sub(1), now);
                        r.advance(now, &cfg);
                        if cfg.rnr_retry != 7 {
                            r.rnr_retries += 1;
                            if r.rnr_retries > cfg.rnr_retry as u32 {
                                return Self::fail_at(qp, p, WcStatus::RnrRetryExcErr);
                            }
                        }
                        r.rnr_until = Some(now + rnr_delay_ns(timer));
                        r.rnr_psn = p;
                        r.deadline = None;
                    }
                    Syndrome::Nak(NakCode::PsnSequenceError) => {
                        r.cum_ack(p.saturating_sub(1), now);
                        r.recover(p, &cfg, true);
                    }
                    Syndrome::Nak(code) => {
                        r.cum_ack(p.saturating_sub(1), now);
                        r.advance(now, &cfg);
                        let st = match code {
                            NakCode::RemoteAccessError => WcStatus::RemAccessErr,
                            NakCode::RemoteOperationalError => WcStatus::RemOpErr,
                            _ => WcStatus::RemInvReqErr,
                        };
                        Self::progress(qp);
                        return Self::fail_at(qp, p, st);
                    }
                    Syndrome::Reserved(_) => {
                        qp.stats.dropped_packets += 1;
                        return;
                    }
                }
            }
            op if op.is_read_response() => {
                let Some(i) = r.find(p) else {
                    qp.stats.stale_responses += 1;
                    return;
                };
                let w = &r.sq[i];
                let f = w.first_psn.unwrap_or(p);
                let k = (p - f) as u32;
                let off = k as u64 * cfg.mtu as u64;
                let want = (w.total - off.min(w.total)).min(cfg.mtu as u64) as usize;
                // a re-requested tail of a READ is answered FIRST..LAST relative to the new
                // request, so only the payload length of this PSN is checked, not the position
                if w.op != WrOpcode::RdmaRead || pkt.payload.len() != want {
                    qp.stats.dropped_packets += 1;
                    return;
                }
                if r.is_acked(p) {
                    qp.stats.stale_responses += 1;
                    return;
                }
                if r.gbn_response_gap(p, now, &cfg) {
                    qp.stats.out_of_order_packets += 1;
                    return;
                }
                qp.stats.payload_copy_bytes += scatter(&r.sq[i].segs, off as usize, pkt.payload);
                r.cum_ack(p.saturating_sub(1), now);
                r.mark(p, now);
            }
            op if op.is_offload_response() => {
                let Some(i) = r.find(p) else {
                    qp.stats.stale_responses += 1;
                    return;
                };
                let w = &r.sq[i];
                let f = w.first_psn.unwrap_or(p);
                let k = (p - f) as u32;
                let last = k + 1 == w.npkts;
                let off = k as u64 * cfg.mtu as u64;
                let (result, data) = if last {
                    if pkt.payload.len() < OffloadResult::LEN {
                        qp.stats.dropped_packets += 1;
                        return;
                    }
                    (
                        Some(OffloadResult::parse(pkt.payload)),
                        &pkt.payload[OffloadResult::LEN..],
                    )
                } else {
                    (None, pkt.payload)
                };
                // the LAST packet gives 8 bytes to the result, so with a buffer just short of a
                // multiple of the MTU it carries no data and starts past the buffer's end
                let fits = data.is_empty() || (off + data.len() as u64 <= w.total && data.len() <= cfg.mtu as usize);
                let len_ok = result.is_none_or(|r| r.len as u64 <= w.total);
                if w.op != WrOpcode::Offload
                    || last != matches!(op, Opcode::OffloadResponseLast | Opcode::OffloadResponseOnly)
                    || !fits
                    || !len_ok
                {
                    qp.stats.dropped_packets += 1;
                    return;
                }
                if r.is_acked(p) {
                    qp.stats.stale_responses += 1;
                    return;
                }
                if r.gbn_response_gap(p, now, &cfg) {
                    qp.stats.out_of_order_packets += 1;
                    return;
                }
                qp.stats.payload_copy_bytes += scatter(&r.sq[i].segs, off as usize, data);
                if result.is_some() {
                    r.sq[i].result = result;
                }
                r.cum_ack(p.saturating_sub(1), now);
                r.mark(p, now);
            }
            Opcode::AtomicAcknowledge => {
                let (Some(i), Some(ack)) = (r.find(p), pkt.atomic_ack) else {
                    qp.stats.stale_responses += 1;
                    return;
                };
                let w = &r.sq[i];
                if !matches!(w.op, WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd) || r.is_acked(p) {
                    qp.stats.stale_responses += 1;
                    return;
                }
                if r.gbn_response_gap(p, now, &cfg) {
                    qp.stats.out_of_order_packets += 1;
                    return;
                }
                scatter(&r.sq[i].segs, 0, &ack.orig.to_le_bytes());
                r.cum_ack(p.saturating_sub(1), now);
                r.mark(p, now);
            }
            _ => {
                qp.stats.dropped_packets += 1;
                return;
            }
        }
        qp.req.advance(now, &cfg);
        Self::progress(qp);
    }

    fn sack(&mut self, s: &SackExt, now: u64) {
        if s.dup && !self.resent.is_empty() {
            // the peer got a packet twice: a resend was spurious, packets are being overtaken
            // by more than the reordering window
            self.spurious += 1;
            self.widen_reordering_window();
        }
        let base = psn_unwrap(self.una(), s.base);
        let mut highest = None;
        for i in 0..64u64 {
            if s.bitmap & (1 << i) != 0 {
                let p = base + 1 + i;
                if p >= self.next_psn() {
                    break;
                }
                if let Some(j) = self.find(p) {
                    if !self.sq[j].is_rd_atomic() {
                        self.mark(p, now);
                    }
                }
                self.sack_high = self.sack_high.max(p + 1);
                highest = Some(p);
            }
        }
        if let Some(h) = highest {
            self.delivered(h, now);
        }
        // the highest PSN received, beyond the bitmap: delivered, and the newest send time RACK
        // compares holes against (the PSNs between stay unknown, so they are not holes yet)
        let high = psn_unwrap(self.una(), s.high);
        if high > base + 64
            && high >= self.una()
            && high < self.next_psn()
            && self.find(high).is_some_and(|j| !self.sq[j].is_rd_atomic())
        {
            if let Some(sent) = self.ledger.get(high).and_then(|s| s.time.once()) {
                if sent >= self.rack_xmit {
                    self.rack_xmit = sent;
                }
            }
            self.mark(high, now);
        }
        self.resend_old_holes(now);
    }

    /// Records that PSN `p` (sent once) was delivered: RTT samples for the smoothed RTT, and the
    /// newest delivered send time for RACK.
    fn delivered(&mut self, p: u64, now: u64) {
        let Some(rtt) = self.rtt_of(p, now) else { return };
        self.min_rtt = self.min_rtt.min(rtt);
        if let Some(path) = self.path_of(p) {
            self.paths.on_rtt(path, rtt, now);
        }
        self.rtt.sample(rtt);
        let sent = now - rtt;
        if sent >= self.rack_xmit {
            self.rack_xmit = sent;
            self.rack_rtt = rtt;
        }
    }

    /// Selective repeat: resends the holes below the highest SACKed PSN that RACK's rule calls
    /// lost: a packet sent more than a reordering window (a quarter RTT, plus the spread of the
    /// path RTTs when spraying) after the hole was
    /// delivered, or the hole is older than two RTTs plus the window. A
    /// younger hole may be a packet that took a slower path and is still on its way: it is looked
    /// at again at the next SACK or when it becomes old enough. Each hole is resent once this way;
    /// a resent packet lost again is the retransmission timer's.
    fn resend_old_holes(&mut self, now: u64) {
        // widened by the paths' RTT spread when spraying
        let wnd =
            (self.rtt.srtt_ns() / 4 * (1 + self.reo_steps as u64)).max(MIN_REORDER_NS) + self.paths.delay_spread();
        let from = self.una().max(self.retx_done_up_to);
        let mut done_to = self.sack_high;
        self.reorder_deadline = None;
        for p in from..self.sack_high {
            if self.is_acked(p) {
                continue;
            }
            if let Some(j) = self.find(p) {
                let w = &self.sq[j];
                // only the request PSN of a READ/atomic is a hole; its response PSNs are not sent by us
                if w.is_rd_atomic() && w.first_psn != Some(p) {
                    continue;
                }
            }
            let sent = match self.ledger.get(p).map_or(SendTime::NotYet, |s| s.time) {
                SendTime::Resent(_) => continue,
                SendTime::Once(t) => t,
                SendTime::NotYet => 0,
            };
            // without newer deliveries, a hole is given two RTTs before it counts as lost
            let due = sent + 2 * self.rack_rtt.max(self.rtt.srtt_ns()) + wnd;
            let lost = sent.saturating_add(wnd) < self.rack_xmit || now >= due;
            if !lost {
                done_to = done_to.min(p);
                self.reorder_deadline = Some(self.reorder_deadline.map_or(due, |d| d.min(due)));
                continue;
            }
            self.presume_lost(p);
            self.rack_marked.insert(p);
        }
        self.retx_done_up_to = self.retx_done_up_to.max(done_to);
        // a resent packet is lost too once a packet sent a reordering window after it arrived
        if !self.resent.is_empty() {
            let lost: SmallVec<[u64; 8]> = self
                .resent
                .iter()
                .filter(|&(_, r)| r.at.saturating_add(wnd) < self.rack_xmit)
                .map(|(&p, _)| p)
                .collect();
            for p in lost {
                self.resent.remove(&p);
                if !self.is_acked(p) && !self.retx.contains(&p) {
                    self.presume_lost(p);
                }
            }
        }
    }

    fn fail_at(qp: &mut RcQp<R>, psn: u64, status: WcStatus) {
        let (qpn, dest) = (qp.qpn, qp.dest_qpn);
        let r = &mut qp.req;
        let i = r.find(psn).unwrap_or(0);
        // WQEs before the failed one completed (their PSNs were acknowledged)
        for _ in 0..i {
            if let Some(w) = r.sq.pop_front() {
                r.retired += 1;
                if w.signaled {
                    qp.completions.push_back(w.wc(WcStatus::Success, qpn, dest));
                }
            }
        }
        if let Some(w) = qp.req.sq.pop_front() {
            qp.req.retired += 1;
            qp.complete_error(w.wc(status, qpn, dest));
        } else {
            qp.enter_error(super::QpErrorCause::of_status(status));
        }
    }

    pub(super) fn handle_timeout(qp: &mut RcQp<R>, now: u64) {
        let cfg = qp.cfg;
        let r = &mut qp.req;
        if r.reorder_deadline.is_some_and(|t| t <= now) {
            r.resend_old_holes(now);
        }
        if let Some(t) = r.rnr_until {
            if now >= t {
                r.rnr_until = None;
                let p = r.rnr_psn;
                match cfg.recovery {
                    Recovery::GoBackN => r.rewind(p, false),
                    Recovery::SelectiveRepeat => r.retx_all_from(p),
                }
                r.deadline = Some(now + cfg.timeout_ns + r.paths.host_delay());
            }
        }
        let Some(d) = r.deadline else { return };
        if now < d {
            return;
        }
        if r.una() >= r.sent_max {
            r.deadline = None;
            return;
        }
        // the pacer has held everything back since the last timeout (congestion control cut
        // the rate below a packet per RTO): what that timeout queued was not resent, the peer
        // was not asked again, so this is no retry; the timer runs again from when the pacer
        // lets the resend go
        if r.last_timeout > 0 && r.pacer.last_send() < r.last_timeout {
            if let Some(t) = r.pacer.ready_at(now) {
                r.deadline = Some(t + cfg.timeout_ns + r.paths.host_delay());
                return;
            }
        }
        qp.stats.timeouts += 1;
        r.repath_timed_out(now);
        // With several paths, a timeout while another path delivered since the last one is a
        // path's failure, not the peer's: the path detector takes that path out and the resend
        // goes elsewhere, so the timer neither backs off nor spends the retry budget (backing
        // off there stalled a sprayed QP for half a second when a link was cut). Bounded, so a
        // packet no path can carry still fails the QP.
        let peer_alive = r.paths.len() > 1 && r.paths.last_delivery() > r.last_timeout;
        r.last_timeout = now;
        if peer_alive && r.path_timeouts < MAX_PATH_TIMEOUTS {
            r.path_timeouts += 1;
        } else {
            r.retries += 1;
        }
        if r.retries > cfg.retry_cnt as u32 {
            let una = r.una();
            return Self::fail_at(qp, una, WcStatus::RetryExcErr);
        }
        r.deadline = Some(now + (cfg.timeout_ns << r.retries.min(cfg.max_backoff_shift as u32)) + r.paths.host_delay());
        tracing::debug!(
            qpn = qp.qpn,
            una = r.una(),
            sent_max = r.sent_max,
            retries = r.retries,
            path_timeouts = r.path_timeouts,
            "retransmission timeout"
        );
        let una = r.una();
        match cfg.recovery {
            Recovery::GoBackN => r.rewind(una, false),
            Recovery::SelectiveRepeat => {
                r.retx_done_up_to = una;
                r.presume_silent_paths_lost();
                r.retx_all_from(una);
            }
        }
    }

    /// Completes finished WQEs in order; a WQE whose local check failed completes with its
    /// error when it reaches the head, and the QP enters ERR.
    pub(super) fn progress(qp: &mut RcQp<R>) {
        let (qpn, dest) = (qp.qpn, qp.dest_qpn);
        loop {
            let r = &mut qp.req;
            let Some(w) = r.sq.front() else { break };
            if w.first_psn.is_none() {
                if let Some(st) = w.bad {
                    if r.cursor == 0 {
                        let w = r.sq.pop_front().expect("front exists");
                        r.retired += 1;
                        qp.complete_error(w.wc(st, qpn, dest));
                    }
                }
                break;
            }
            let f = w.first_psn.unwrap_or(0);
            if f + w.npkts as u64 > r.una() {
                break;
            }
            let w = r.sq.pop_front().expect("front exists");
            r.retired += 1;
            if r.cursor == 0 {
                // the cursor was resending this (now acknowledged) WQE: move to the next one
                r.cursor_pkt = 0;
            } else {
                r.cursor -= 1;
            }
            if w.is_rd_atomic() {
                r.rd_outstanding -= 1;
            }
            // a failed offload reports its failure even when unsignaled
            if w.signaled || w.result.is_some_and(|r| r.status != 0) {
                qp.completions.push_back(w.wc(WcStatus::Success, qpn, dest));
            }
        }
        debug_assert!(qp.state != QpState::Rts || qp.req.cursor <= qp.req.sq.len());
    }
}
