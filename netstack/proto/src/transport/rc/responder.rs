//! The responder half of an RC QP: the expected PSN, placement of SEND and WRITE payloads,
//! READ responses, atomics with a replay cache, receive-side completions, ACK/NAK generation.

use super::offload::{response_packets, OffloadJob, OffloadStatus, Outcome, MAX_OFFLOAD_RESP};
use super::{RcConfig, RcQp, Recovery, RESPONDER_RD_ATOMIC};
use crate::memory::{Access, KeyTable, SharedRegion};
use crate::transport::{psn_unwrap, PayloadPart, TxPacket};
use crate::wire::*;
use crate::work::*;
use smallvec::SmallVec;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

/// Atomic results kept for replaying duplicate atomic requests.
const ATOMIC_CACHE: usize = 64;
/// Offload jobs kept for answering duplicate offload requests (never run twice).
const OFFLOAD_CACHE: usize = 32;
/// The most READs a responder remembers, whatever `max_rd_atomic` says (ibverbs' attribute
/// is 8 bits wide).
const MAX_READ_LOG: usize = 1024;

struct RecvWqe {
    wr_id: u64,
    sg: SgList,
    total: u64,
}

/// What remains to be done for a request packet once every earlier PSN has been processed.
#[derive(Debug, Clone)]
enum Action {
    /// A data packet that ends no message.
    Placed,
    /// The last packet of a message: complete it (and its receive WQE when it consumes one).
    Complete {
        consumes_recv: bool,
        write: bool,
        imm: Option<u32>,
        len: u32,
    },
    Read(Reth),
    Atomic {
        eth: AtomicEth,
        cas: bool,
    },
    /// An offload request: started when it is in order; its response takes `n` PSNs.
    Offload {
        job: Arc<OffloadJob>,
        n: u32,
    },
}

/// In-order message state (go-back-N): where the next MIDDLE/LAST packet goes.
#[derive(Debug, Clone, Copy)]
struct CurMsg {
    write: bool,
    offset: u64,
    va: u64,
    rkey: u32,
    len: u64,
}

enum Resp<R> {
    Read {
        first: u64,
        region: Option<Arc<R>>,
        off: usize,
        len: u64,
        n: u32,
        next: u32,
    },
    Atomic {
        psn: u64,
        orig: u64,
    },
    /// An offload response: waits at the head of the queue until its job has an outcome.
    Offload {
        first: u64,
        n: u32,
        next: u32,
        job: Arc<OffloadJob>,
        data: Option<OffloadAnswer<R>>,
    },
}

/// What an offload response carries: the status, the length and the bytes (none when empty).
struct OffloadAnswer<R> {
    status: OffloadStatus,
    len: u32,
    bytes: Option<Arc<R>>,
}

/// A NAK to send: its syndrome, at this PSN.
#[derive(Debug, Clone, Copy)]
struct PendingNak {
    syndrome: Syndrome,
    psn: u64,
}

/// An executed atomic's result, kept to answer a duplicate of its request (one with the same
/// PSN, opcode and header).
#[derive(Debug, Clone, Copy)]
struct AtomicResult {
    psn: u64,
    eth: AtomicEth,
    cas: bool,
    orig: u64,
}

/// A READ this responder accepted: a duplicate is answered again only within it.
#[derive(Debug, Clone, Copy)]
struct ReadRecord {
    /// Its first PSN and the PSNs its response takes.
    psn: u64,
    n: u32,
    va: u64,
    len: u64,
    rkey: u32,
}

impl ReadRecord {
    /// Whether `reth` at PSN `p` asks again for (part of) this READ: from one of its response
    /// PSNs, at the address that PSN's data starts at, with the same R_Key, for no more than
    /// the rest (a requester asks again from the first response packet it is missing, IBA
    /// 9.7.4.1.2 / o9-25).
    fn covers(&self, p: u64, reth: &Reth, mtu: u32) -> bool {
        if p < self.psn || p >= self.psn + self.n as u64 {
            return false;
        }
        let off = (p - self.psn) * mtu as u64;
        let rest = self.len.saturating_sub(off);
        reth.rkey == self.rkey && reth.va == self.va.wrapping_add(off) && reth.dma_len as u64 <= rest
    }
}

/// An offload request answered or in progress, kept to answer its duplicates from (a handler
/// never runs twice): its first PSN, its response's packets, the job and its outcome once known.
struct CachedJob {
    psn: u64,
    n: u32,
    job: Arc<OffloadJob>,
    outcome: Option<Outcome>,
}

/// Why a request packet could not be processed.
enum Reject {
    Nak(NakCode),
    Rnr,
    /// Silently dropped (out-of-order packet that cannot be handled yet).
    Drop,
}

/// A receive-side completion that carries no data (errors and flushes).
pub(super) fn recv_error_wc(wr_id: u64, status: WcStatus, qpn: u32, dest: u32) -> Wc {
    Wc {
        wr_id,
        status,
        opcode: WcOpcode::Recv,
        byte_len: 0,
        imm_data: None,
        qp_num: qpn,
        src_qp: dest,
        vendor_err: 0,
    }
}

/// A WC with WR_FLUSH_ERR for a receive posted to a QP in ERR.
pub(super) fn flush_recv_wc(wr: &RecvWr, qpn: u32, dest: u32) -> Wc {
    recv_error_wc(wr.wr_id, WcStatus::WrFlushErr, qpn, dest)
}

pub(super) struct Responder<R> {
    epsn: u64,
    msn: u32,
    rq: VecDeque<RecvWqe>,
    rq_head_seq: u32,
    cur: Option<CurMsg>,
    ooo: BTreeMap<u64, Action>,
    resp_q: VecDeque<Resp<R>>,
    atomic_cache: VecDeque<AtomicResult>,
    /// The READs accepted last (see [`RESPONDER_RD_ATOMIC`]).
    read_log: VecDeque<ReadRecord>,
    offload_cache: VecDeque<CachedJob>,
    ack_pending: bool,
    ack_deadline: Option<u64>,
    unacked: u32,
    nak: Option<PendingNak>,
    seq_nak_sent: bool,
    /// A packet arrived twice since the last SACK (reported like TCP's DSACK, so the
    /// requester learns that its resend was spurious and widens its reordering window).
    dup_seen: bool,
}

impl<R: SharedRegion> Responder<R> {
    pub(super) fn new(psn: u64) -> Responder<R> {
        Responder {
            epsn: psn,
            msn: 0,
            rq: VecDeque::new(),
            rq_head_seq: 0,
            cur: None,
            ooo: BTreeMap::new(),
            resp_q: VecDeque::new(),
            atomic_cache: VecDeque::new(),
            read_log: VecDeque::new(),
            offload_cache: VecDeque::new(),
            ack_pending: false,
            ack_deadline: None,
            unacked: 0,
            nak: None,
            seq_nak_sent: false,
            dup_seen: false,
        }
    }

    pub(super) fn reset_psn(&mut self, psn: u64) {
        self.epsn = psn;
    }

    pub(super) fn rq_len(&self) -> usize {
        self.rq.len()
    }

    pub(super) fn heap_bytes(&self) -> usize {
        self.rq.capacity() * std::mem::size_of::<RecvWqe>()
            + self.ooo.len() * 48
            + self.resp_q.capacity() * std::mem::size_of::<Resp<R>>()
            + self.atomic_cache.capacity() * std::mem::size_of::<AtomicResult>()
            + self.read_log.capacity() * std::mem::size_of::<ReadRecord>()
    }

    pub(super) fn post(&mut self, wr: RecvWr) {
        let total = wr.sg_list.iter().map(|s| s.length as u64).sum();
        self.rq.push_back(RecvWqe {
            wr_id: wr.wr_id,
            sg: wr.sg_list,
            total,
        });
    }

    pub(super) fn flush(&mut self, qpn: u32, dest: u32) -> Vec<Wc> {
        self.resp_q.clear();
        self.offload_cache.clear();
        self.read_log.clear();
        self.ooo.clear();
        self.nak = None;
        self.ack_pending = false;
        self.ack_deadline = None;
        self.rq
            .drain(..)
            .map(|w| recv_error_wc(w.wr_id, WcStatus::WrFlushErr, qpn, dest))
            .collect()
    }

    pub(super) fn deadline(&self) -> Option<u64> {
        match (self.ack_deadline, self.blocked_offload()) {
            (Some(a), Some(d)) => Some(a.min(d)),
            (a, d) => a.or(d),
        }
    }

    /// The deadline of the unfinished offload job at the head of the response queue, if one
    /// blocks it (later responses, ACKs and NAKs wait behind it, in order).
    fn blocked_offload(&self) -> Option<u64> {
        match self.resp_q.front() {
            Some(Resp::Offload { job, data: None, .. }) => Some(job.deadline),
            _ => None,
        }
    }

    /// Records the outcome of offload job `id` (the first outcome wins; one for a job this QP
    /// no longer knows is dropped). Returns whether it was taken.
    pub(super) fn offload_finished(&mut self, id: u64, outcome: Outcome) -> bool {
        let cached = self.offload_cache.iter_mut().find(|c| c.job.id == id);
        if cached.as_ref().is_some_and(|c| c.outcome.is_some()) {
            return false;
        }
        // (a job still queued stays in `resp_q` even when the cache has moved past it)
        let mut cap = cached.as_ref().map(|c| c.job.resp_cap);
        let mut waiting = false;
        for r in self.resp_q.iter() {
            if let Resp::Offload { job, data: None, .. } = r {
                if job.id == id {
                    cap = Some(job.resp_cap);
                    waiting = true;
                }
            }
        }
        let Some(cap) = cap else {
            return false;
        };
        if cached.is_none() && !waiting {
            return false;
        }
        let outcome = within(outcome, cap);
        if let Some(c) = cached {
            c.outcome = Some(outcome.clone());
        }
        for r in self.resp_q.iter_mut() {
            if let Resp::Offload { job, data, .. } = r {
                if job.id == id && data.is_none() {
                    *data = Some(response_data(&outcome));
                }
            }
        }
        true
    }

    /// Acknowledges what arrived at the next transmit opportunity (congestion control asked).
    pub(super) fn ack_now(&mut self) {
        if self.unacked > 0 {
            self.ack_pending = true;
        }
    }

    pub(super) fn wants_transmit(&self, now: u64) -> bool {
        if self.blocked_offload().is_some_and(|d| now < d) {
            return false;
        }
        !self.resp_q.is_empty() || self.nak.is_some() || self.ack_pending || self.ack_deadline.is_some_and(|d| d <= now)
    }

    pub(super) fn handle_timeout(&mut self, now: u64) {
        if self.ack_deadline.is_some_and(|d| d <= now) {
            self.ack_pending = true;
            self.ack_deadline = None;
        }
    }

    /// See [`RcQp::write_placement`].
    pub(super) fn write_placement(
        qp: &RcQp<R>,
        pkt: &PacketView<'_>,
        mrs: &impl KeyTable<Region = R>,
    ) -> Option<(Arc<R>, usize)> {
        let op = pkt.opcode;
        if qp.cfg.recovery != Recovery::GoBackN || !op.is_write() || op.is_first() {
            return None;
        }
        let s = &qp.resp;
        let c = s.cur.filter(|c| c.write)?;
        if psn_unwrap(s.epsn, pkt.bth.psn) != s.epsn {
            return None;
        }
        // the length rules `process` applies; a packet that breaks one is NAKed unplaced
        let (n, mtu) = (pkt.payload.len() as u64, qp.cfg.mtu as u64);
        let end = c.offset + n;
        if c.len == 0 || n > mtu || end > c.len || (op.is_last() != (end == c.len)) || (!op.is_last() && n != mtu) {
            return None;
        }
        let (region, off) = mrs.check(c.rkey, qp.pd, c.va, c.len, Access::REMOTE_WRITE).ok()?;
        Some((region, off + c.offset as usize))
    }

    pub(super) fn handle(
        qp: &mut RcQp<R>,
        now: u64,
        pkt: &PacketView<'_>,
        mrs: &impl KeyTable<Region = R>,
        placed: bool,
    ) {
        let cfg = qp.cfg;
        let s = &mut qp.resp;
        let p = psn_unwrap(s.epsn, pkt.bth.psn);
        if p < s.epsn {
            if Self::duplicate(qp, p, pkt, mrs) {
                qp.stats.duplicate_requests += 1;
                qp.resp.dup_seen = true;
            } else {
                qp.stats.duplicate_requests_refused += 1;
            }
            return;
        }
        if p > s.epsn {
            qp.stats.out_of_order_packets += 1;
            match cfg.recovery {
                Recovery::GoBackN => {
                    if !s.seq_nak_sent {
                        s.nak = Some(PendingNak {
                            syndrome: Syndrome::Nak(NakCode::PsnSequenceError),
                            psn: s.epsn,
                        });
                        s.seq_nak_sent = true;
                        qp.stats.seq_naks_sent += 1;
                    }
                }
                Recovery::SelectiveRepeat => {
                    if s.ooo.contains_key(&p) {
                        qp.stats.duplicate_requests += 1;
                        s.dup_seen = true;
                    } else if p - s.epsn < 2 * cfg.window_pkts as u64 {
                        match Self::process(qp, now, p, pkt, mrs, false, false) {
                            Ok(a) => {
                                qp.resp.ooo.insert(p, a);
                            }
                            Err(_) => qp.stats.dropped_packets += 1,
                        }
                    }
                    qp.resp.ack_pending = true;
                }
            }
            return;
        }
        let res = Self::process(qp, now, p, pkt, mrs, true, placed).and_then(|a| Self::execute(qp, p, a, mrs));
        match res {
            Ok(()) => {
                // drain packets that arrived early and are now in order
                while let Some((&q, a)) = qp.resp.ooo.first_key_value() {
                    let a = a.clone();
                    if q != qp.resp.epsn {
                        if q < qp.resp.epsn {
                            qp.resp.ooo.pop_first();
                            continue;
                        }
                        break;
                    }
                    qp.resp.ooo.pop_first();
                    if let Err(e) = Self::execute(qp, q, a, mrs) {
                        Self::reject(qp, q, e);
                        break;
                    }
                }
                let s = &mut qp.resp;
                s.seq_nak_sent = false;
                s.unacked += 1;
                if pkt.bth.ack_req || s.unacked >= cfg.ack_every {
                    s.ack_pending = true;
                } else {
                    s.ack_deadline.get_or_insert(now + cfg.ack_delay_ns);
                }
            }
            Err(e) => Self::reject(qp, p, e),
        }
    }

    fn reject(qp: &mut RcQp<R>, p: u64, e: Reject) {
        match e {
            Reject::Nak(code) => {
                qp.resp.nak = Some(PendingNak {
                    syndrome: Syndrome::Nak(code),
                    psn: p,
                })
            }
            Reject::Rnr => {
                qp.resp.nak = Some(PendingNak {
                    syndrome: Syndrome::Rnr {
                        timer: qp.cfg.min_rnr_timer,
                    },
                    psn: p,
                });
                qp.stats.rnr_naks_sent += 1;
            }
            Reject::Drop => qp.stats.dropped_packets += 1,
        }
    }

    /// Answers a request whose PSN is behind the expected one; returns false when it was
    /// refused (dropped unanswered).
    fn duplicate(qp: &mut RcQp<R>, p: u64, pkt: &PacketView<'_>, mrs: &impl KeyTable<Region = R>) -> bool {
        match pkt.opcode {
            Opcode::ReadRequest => {
                // IBA: a duplicate READ is executed again from its PSN, but only one this QP
                // accepted lately, asked for again within its range: any other (a forged or
                // replayed RETH) would make this host send memory to the peer's address that
                // nobody asked for, as much as the region holds for one small packet
                let mtu = qp.cfg.mtu;
                let Some(reth) = pkt
                    .reth
                    .filter(|r| qp.resp.read_log.iter().any(|l| l.covers(p, r, mtu)))
                else {
                    return false;
                };
                // a response from that PSN still waiting to start answers this copy too
                let queued = qp
                    .resp
                    .resp_q
                    .iter()
                    .any(|r| matches!(r, Resp::Read { first, next: 0, .. } if *first == p));
                if !queued {
                    match Self::read_resp(qp, p, &reth, mrs) {
                        Ok(r) => qp.resp.resp_q.push_back(r),
                        // the region went away since the READ was accepted (deregistered): the
                        // peer's retry gets the access error, as the first request would now,
                        // not silence until its retries run out
                        Err(e) => Self::reject(qp, p, e),
                    }
                }
            }
            Opcode::OffloadRequest => {
                // answer again from the job (never run a handler twice); one still running
                // or still queued answers by itself
                let s = &mut qp.resp;
                let queued = s
                    .resp_q
                    .iter()
                    .any(|r| matches!(r, Resp::Offload { first, .. } if *first == p));
                match s.offload_cache.iter().find(|c| c.psn == p) {
                    Some(c) if !queued => s.resp_q.push_back(Resp::Offload {
                        first: p,
                        n: c.n,
                        next: 0,
                        job: c.job.clone(),
                        data: c.outcome.as_ref().map(response_data),
                    }),
                    Some(_) => {}
                    None => return false,
                }
            }
            Opcode::CompareSwap | Opcode::FetchAdd => {
                // replay the saved result of the same request; never execute an atomic twice
                let cas = pkt.opcode == Opcode::CompareSwap;
                let saved = qp
                    .resp
                    .atomic_cache
                    .iter()
                    .find(|a| a.psn == p && a.cas == cas && pkt.atomic == Some(a.eth));
                let Some(&AtomicResult { orig, .. }) = saved else {
                    return false;
                };
                qp.resp.resp_q.push_back(Resp::Atomic { psn: p, orig });
            }
            _ => qp.resp.ack_pending = true,
        }
        true
    }

    /// Validates a request packet and places its payload (unless `placed`: the driver copied it
    /// to where [`Responder::write_placement`] said); returns what is left to do in PSN order
    /// (the responder's checks of a received request: IBA Vol 1 Release 1.5, 9.7.4.1).
    #[allow(clippy::too_many_arguments)]
    fn process(
        qp: &mut RcQp<R>,
        now: u64,
        p: u64,
        pkt: &PacketView<'_>,
        mrs: &impl KeyTable<Region = R>,
        in_order: bool,
        placed: bool,
    ) -> Result<Action, Reject> {
        let op = pkt.opcode;
        if op == Opcode::ReadRequest {
            return pkt.reth.map(Action::Read).ok_or(Reject::Nak(NakCode::InvalidRequest));
        }
        if op == Opcode::OffloadRequest {
            if pkt.payload.len() < OffloadReqHdr::LEN || pkt.payload.len() > qp.cfg.mtu as usize {
                return Err(Reject::Nak(NakCode::InvalidRequest));
            }
            let h = OffloadReqHdr::parse(pkt.payload);
            if h.resp_cap > MAX_OFFLOAD_RESP {
                return Err(Reject::Nak(NakCode::InvalidRequest));
            }
            let budget = qp.offload.as_ref().map_or(0, |o| o.budget_ns(qp.qpn, h.opcode));
            let job = OffloadJob {
                id: p,
                qpn: qp.qpn,
                pd: qp.pd,
                opcode: h.opcode,
                request: pkt.payload[OffloadReqHdr::LEN..].to_vec(),
                resp_cap: h.resp_cap,
                deadline: now.saturating_add(budget),
            };
            return Ok(Action::Offload {
                job: Arc::new(job),
                n: response_packets(h.resp_cap, qp.cfg.mtu),
            });
        }
        if op.is_atomic() {
            let eth = pkt.atomic.ok_or(Reject::Nak(NakCode::InvalidRequest))?;
            return Ok(Action::Atomic {
                eth,
                cas: op == Opcode::CompareSwap,
            });
        }
        if matches!(op, Opcode::SendLastWithInvalidate | Opcode::SendOnlyWithInvalidate) {
            return Err(Reject::Nak(NakCode::InvalidRequest));
        }
        let cfg = qp.cfg;
        let pd = qp.pd;
        let s = &mut qp.resp;
        let write = op.is_write();
        let (first, last) = (op.is_first(), op.is_last());
        // where this packet goes: (offset in message, receive sequence, va, rkey, message length if known)
        let (offset, recv_seq, va, rkey, msg_len, data) = match cfg.recovery {
            Recovery::SelectiveRepeat => {
                if pkt.payload.len() < SrExt::LEN {
                    return Err(if in_order {
                        Reject::Nak(NakCode::InvalidRequest)
                    } else {
                        Reject::Drop
                    });
                }
                let e = SrExt::parse(pkt.payload);
                (
                    e.msg_offset as u64,
                    e.recv_seq,
                    e.va,
                    e.rkey,
                    Some(e.msg_len as u64),
                    &pkt.payload[SrExt::LEN..],
                )
            }
            Recovery::GoBackN => {
                let ctx = if first {
                    if s.cur.is_some() {
                        return Err(Reject::Nak(NakCode::InvalidRequest));
                    }
                    match (write, pkt.reth) {
                        (true, Some(r)) => CurMsg {
                            write,
                            offset: 0,
                            va: r.va,
                            rkey: r.rkey,
                            len: r.dma_len as u64,
                        },
                        (true, None) => return Err(Reject::Nak(NakCode::InvalidRequest)),
                        (false, _) => CurMsg {
                            write,
                            offset: 0,
                            va: 0,
                            rkey: 0,
                            len: 0,
                        },
                    }
                } else {
                    match s.cur {
                        Some(c) if c.write == write => c,
                        _ => return Err(Reject::Nak(NakCode::InvalidRequest)),
                    }
                };
                (
                    ctx.offset,
                    s.rq_head_seq,
                    ctx.va,
                    ctx.rkey,
                    write.then_some(ctx.len),
                    pkt.payload,
                )
            }
        };
        if (!last && data.len() != cfg.mtu as usize) || data.len() > cfg.mtu as usize {
            return Err(Reject::Nak(NakCode::InvalidRequest));
        }
        let end = offset + data.len() as u64;
        let consumes_recv = !write || pkt.imm.is_some();
        let idx = recv_seq.wrapping_sub(s.rq_head_seq) as usize;
        if consumes_recv && idx >= s.rq.len() {
            return Err(if in_order { Reject::Rnr } else { Reject::Drop });
        }
        if write {
            let len = msg_len.unwrap_or(0);
            if end > len || (last && end != len) {
                return Err(Reject::Nak(NakCode::InvalidRequest));
            }
            // the whole message range is checked on every packet, so a bad access never
            // writes a byte, whichever of its packets arrives first (R_Key, protection domain,
            // bounds and access rights: IBA 9.7.4.1.5, C9-88; a zero-length WRITE checks none);
            // a placed packet's range passed the same check in `write_placement`, in this pass
            if len > 0 && !placed {
                let (region, off) = mrs
                    .check(rkey, pd, va, len, Access::REMOTE_WRITE)
                    .map_err(|_| Reject::Nak(NakCode::RemoteAccessError))?;
                region.write(off + offset as usize, data);
            }
        } else {
            let w = &s.rq[idx];
            if end > w.total || msg_len.is_some_and(|l| end > l || (last && end != l)) {
                if in_order {
                    // IBA: a message longer than the receive buffer fails the receive WQE
                    let w = s.rq.pop_front().expect("checked above");
                    s.rq_head_seq = s.rq_head_seq.wrapping_add(1);
                    s.cur = None;
                    qp.completions
                        .push_back(recv_error_wc(w.wr_id, WcStatus::LocLenErr, qp.qpn, qp.dest_qpn));
                    return Err(Reject::Nak(NakCode::InvalidRequest));
                }
                return Err(Reject::Drop);
            }
            if !data.is_empty() {
                Self::scatter_recv(&w.sg, offset as usize, data, pd, mrs)
                    .map_err(|_| Reject::Nak(NakCode::RemoteOperationalError))?;
            }
        }
        // the payload went from the receive buffer into registered memory: one copy
        qp.stats.payload_copy_bytes += data.len() as u64;
        if cfg.recovery == Recovery::GoBackN {
            let s = &mut qp.resp;
            s.cur = if last {
                None
            } else {
                let mut c = s.cur.unwrap_or(CurMsg {
                    write,
                    offset: 0,
                    va,
                    rkey,
                    len: msg_len.unwrap_or(0),
                });
                c.offset = end;
                Some(c)
            };
        }
        Ok(if last {
            Action::Complete {
                consumes_recv,
                write,
                imm: pkt.imm,
                len: end as u32,
            }
        } else {
            Action::Placed
        })
    }

    fn scatter_recv(
        sg: &SgList,
        mut off: usize,
        mut data: &[u8],
        pd: u32,
        mrs: &impl KeyTable<Region = R>,
    ) -> Result<(), ()> {
        for s in sg {
            if data.is_empty() {
                break;
            }
            let l = s.length as usize;
            if off >= l {
                off -= l;
                continue;
            }
            let n = (l - off).min(data.len());
            let (region, roff) = mrs
                .check(s.lkey, pd, s.addr + off as u64, n as u64, Access::LOCAL_WRITE)
                .map_err(|_| ())?;
            region.write(roff, &data[..n]);
            data = &data[n..];
            off = 0;
        }
        Ok(())
    }

    fn read_resp(qp: &RcQp<R>, p: u64, reth: &Reth, mrs: &impl KeyTable<Region = R>) -> Result<Resp<R>, Reject> {
        let len = reth.dma_len as u64;
        if len > 1 << 31 {
            return Err(Reject::Nak(NakCode::InvalidRequest));
        }
        // a zero-length READ validates no R_Key (IBA 9.7.4.1.5, C9-88)
        let (region, off) = if len == 0 {
            (None, 0)
        } else {
            let (r, o) = mrs
                .check(reth.rkey, qp.pd, reth.va, len, Access::REMOTE_READ)
                .map_err(|_| Reject::Nak(NakCode::RemoteAccessError))?;
            (Some(r), o)
        };
        let n = len.div_ceil(qp.cfg.mtu as u64).max(1) as u32;
        Ok(Resp::Read {
            first: p,
            region,
            off,
            len,
            n,
            next: 0,
        })
    }

    /// Performs the in-order part of a request at PSN `p == epsn` and advances `epsn`.
    fn execute(qp: &mut RcQp<R>, p: u64, a: Action, mrs: &impl KeyTable<Region = R>) -> Result<(), Reject> {
        match a {
            Action::Placed => qp.resp.epsn = p + 1,
            Action::Complete {
                consumes_recv,
                write,
                imm,
                len,
            } => {
                let s = &mut qp.resp;
                if consumes_recv {
                    let Some(w) = s.rq.pop_front() else {
                        return Err(Reject::Rnr);
                    };
                    s.rq_head_seq = s.rq_head_seq.wrapping_add(1);
                    let opcode = if write {
                        WcOpcode::RecvRdmaWithImm
                    } else {
                        WcOpcode::Recv
                    };
                    let wc = Wc {
                        wr_id: w.wr_id,
                        status: WcStatus::Success,
                        opcode,
                        byte_len: len,
                        imm_data: imm,
                        qp_num: qp.qpn,
                        src_qp: qp.dest_qpn,
                        vendor_err: 0,
                    };
                    qp.completions.push_back(wc);
                }
                let s = &mut qp.resp;
                s.msn = (s.msn + 1) & MASK24;
                s.epsn = p + 1;
            }
            Action::Read(reth) => {
                let r = Self::read_resp(qp, p, &reth, mrs)?;
                let n = match &r {
                    Resp::Read { n, .. } | Resp::Offload { n, .. } => *n,
                    Resp::Atomic { .. } => 1,
                };
                let depth = RESPONDER_RD_ATOMIC.max(qp.cfg.max_rd_atomic as usize).min(MAX_READ_LOG);
                let s = &mut qp.resp;
                if s.read_log.len() >= depth {
                    s.read_log.pop_front();
                }
                s.read_log.push_back(ReadRecord {
                    psn: p,
                    n,
                    va: reth.va,
                    len: reth.dma_len as u64,
                    rkey: reth.rkey,
                });
                s.resp_q.push_back(r);
                s.msn = (s.msn + 1) & MASK24;
                s.epsn = p + n as u64;
            }
            Action::Offload { job, n } => {
                let outcome: Option<Outcome> = match &qp.offload {
                    Some(sink) => sink.submit(job.clone()),
                    None => Some(Outcome::empty(OffloadStatus::NoHandler)),
                }
                .map(|o| within(o, job.resp_cap));
                let s = &mut qp.resp;
                if s.offload_cache.len() == OFFLOAD_CACHE {
                    s.offload_cache.pop_front();
                }
                s.offload_cache.push_back(CachedJob {
                    psn: p,
                    n,
                    job: job.clone(),
                    outcome: outcome.clone(),
                });
                s.resp_q.push_back(Resp::Offload {
                    first: p,
                    n,
                    next: 0,
                    job,
                    data: outcome.as_ref().map(response_data),
                });
                s.msn = (s.msn + 1) & MASK24;
                s.epsn = p + n as u64;
            }
            Action::Atomic { eth, cas } => {
                if eth.va % 8 != 0 {
                    return Err(Reject::Nak(NakCode::InvalidRequest));
                }
                let (region, off) = mrs
                    .check(eth.rkey, qp.pd, eth.va, 8, Access::REMOTE_ATOMIC)
                    .map_err(|_| Reject::Nak(NakCode::RemoteAccessError))?;
                let orig = if cas {
                    region.compare_swap(off, eth.compare, eth.swap_add)
                } else {
                    region.fetch_add(off, eth.swap_add)
                };
                let orig = orig.ok_or(Reject::Nak(NakCode::InvalidRequest))?;
                let s = &mut qp.resp;
                if s.atomic_cache.len() == ATOMIC_CACHE {
                    s.atomic_cache.pop_front();
                }
                s.atomic_cache.push_back(AtomicResult { psn: p, eth, cas, orig });
                s.resp_q.push_back(Resp::Atomic { psn: p, orig });
                s.msn = (s.msn + 1) & MASK24;
                s.epsn = p + 1;
            }
        }
        Ok(())
    }

    fn aeth(&self, syndrome: Syndrome) -> Aeth {
        Aeth {
            syndrome,
            msn: self.msn,
        }
    }

    pub(super) fn poll_transmit(qp: &mut RcQp<R>, now: u64) -> Option<TxPacket<R>> {
        let cfg: RcConfig = qp.cfg;
        let dest = qp.dest_qpn;
        let s = &mut qp.resp;
        let ack = Syndrome::Ack { credits: 0x1F };
        if let Some(front) = s.resp_q.front_mut() {
            let (pkt, done, last_psn) = match front {
                Resp::Read {
                    first,
                    region,
                    off,
                    len,
                    n,
                    next,
                } => {
                    let k = *next;
                    let op = Opcode::read_response(k, *n);
                    let bth = Bth::new(op as u8, dest, (*first + k as u64) as u32);
                    let mut hdr = HeaderBuf::with_bth(&bth);
                    if op.headers().aeth {
                        hdr.push_aeth(&Aeth {
                            syndrome: ack,
                            msn: s.msn,
                        });
                    }
                    let poff = k as u64 * cfg.mtu as u64;
                    let plen = (*len - poff.min(*len)).min(cfg.mtu as u64) as usize;
                    hdr.set_pad_for(plen);
                    let mut payload = SmallVec::new();
                    if let (Some(r), true) = (region.as_ref(), plen > 0) {
                        payload.push(PayloadPart {
                            region: r.clone(),
                            off: *off + poff as usize,
                            len: plen,
                        });
                    }
                    *next += 1;
                    (TxPacket { hdr, payload, path: 0 }, *next == *n, *first + k as u64)
                }
                Resp::Offload {
                    first,
                    n,
                    next,
                    job,
                    data,
                } => {
                    if data.is_none() {
                        // no outcome by its deadline: the responder answers TIMEOUT, once for
                        // the job and its duplicates
                        if now < job.deadline {
                            return None;
                        }
                        let timeout = Outcome::empty(OffloadStatus::Timeout);
                        *data = Some(response_data(&timeout));
                        if let Some(c) = s.offload_cache.iter_mut().find(|c| c.job.id == job.id) {
                            c.outcome.get_or_insert(timeout);
                        }
                    }
                    let OffloadAnswer {
                        status,
                        len,
                        bytes: region,
                    } = data.as_ref()?;
                    let k = *next;
                    let last = k + 1 == *n;
                    let op = Opcode::offload_response(k, *n);
                    let bth = Bth::new(op as u8, dest, (*first + k as u64) as u32);
                    let mut hdr = HeaderBuf::with_bth(&bth);
                    if op.headers().aeth {
                        hdr.push_aeth(&Aeth {
                            syndrome: ack,
                            msn: s.msn,
                        });
                    }
                    if last {
                        hdr.push_u32((*status as u32) << 24).push_u32(*len);
                    }
                    let poff = (k as u64 * cfg.mtu as u64).min(*len as u64);
                    let plen = (*len as u64 - poff).min(cfg.mtu as u64) as usize;
                    hdr.set_pad_for(plen + if last { OffloadResult::LEN } else { 0 });
                    let mut payload = SmallVec::new();
                    if let (Some(r), true) = (region.as_ref(), plen > 0) {
                        payload.push(PayloadPart {
                            region: r.clone(),
                            off: poff as usize,
                            len: plen,
                        });
                    }
                    *next += 1;
                    (TxPacket { hdr, payload, path: 0 }, last, *first + k as u64)
                }
                Resp::Atomic { psn, orig } => {
                    let mut hdr = HeaderBuf::with_bth(&Bth::new(Opcode::AtomicAcknowledge as u8, dest, *psn as u32));
                    hdr.push_aeth(&Aeth {
                        syndrome: ack,
                        msn: s.msn,
                    })
                    .push_atomic_ack(&AtomicAckEth { orig: *orig });
                    (
                        TxPacket {
                            path: 0,
                            hdr,
                            payload: SmallVec::new(),
                        },
                        true,
                        *psn,
                    )
                }
            };
            if done {
                s.resp_q.pop_front();
                if s.resp_q.is_empty() && last_psn + 1 == s.epsn && s.ooo.is_empty() {
                    // the response acknowledged everything received
                    s.ack_pending = false;
                    s.ack_deadline = None;
                    s.unacked = 0;
                }
            }
            return Some(pkt);
        }
        if let Some(PendingNak { syndrome: syn, psn }) = s.nak.take() {
            let mut hdr = HeaderBuf::with_bth(&Bth::new(Opcode::Acknowledge as u8, dest, psn as u32));
            hdr.push_aeth(&s.aeth(syn));
            return Some(TxPacket {
                path: 0,
                hdr,
                payload: SmallVec::new(),
            });
        }
        if s.ack_pending || s.ack_deadline.is_some_and(|d| d <= now) {
            s.ack_pending = false;
            s.ack_deadline = None;
            s.unacked = 0;
            let mut hdr = HeaderBuf::with_bth(&Bth::new(
                Opcode::Acknowledge as u8,
                dest,
                (s.epsn.wrapping_sub(1)) as u32,
            ));
            hdr.push_aeth(&s.aeth(ack));
            if cfg.recovery == Recovery::SelectiveRepeat {
                let mut bitmap = 0u64;
                for (&q, _) in s.ooo.range(s.epsn + 1..s.epsn + 65) {
                    bitmap |= 1 << (q - s.epsn - 1);
                }
                let high = s.ooo.last_key_value().map_or(s.epsn.wrapping_sub(1), |(&q, _)| q);
                hdr.push_sack(&SackExt {
                    base: s.epsn as u32,
                    bitmap,
                    high: high as u32,
                    dup: std::mem::take(&mut s.dup_seen),
                });
            }
            qp.stats.acks_sent += 1;
            return Some(TxPacket {
                path: 0,
                hdr,
                payload: SmallVec::new(),
            });
        }
        None
    }
}

/// An offload response's status, length and payload (as a region the packets reference).
/// `o`, or RESPONSE_TOO_LONG when its bytes exceed the requester's `cap`.
fn within(o: Outcome, cap: u32) -> Outcome {
    if o.response.len() > cap as usize {
        Outcome::empty(OffloadStatus::ResponseTooLong)
    } else {
        o
    }
}

fn response_data<R: SharedRegion>(o: &Outcome) -> OffloadAnswer<R> {
    let Outcome {
        status,
        response: bytes,
    } = o;
    OffloadAnswer {
        status: *status,
        len: bytes.len() as u32,
        bytes: (!bytes.is_empty()).then(|| Arc::new(R::from_bytes(bytes))),
    }
}
