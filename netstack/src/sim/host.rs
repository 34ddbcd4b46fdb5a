//! Simulated hosts: RC QPs behind a NIC that sends their packets round-robin, one at a time
//! as its line frees, and flows (an application that keeps WRITEs outstanding until its bytes
//! are acknowledged).

use super::{Network, Node, NodeId};
use crate::cc::{CcEnv, CcKind, CcParams};
use crate::link::sim::{SimLink, SimNet};
use crate::mem::{Access, MrTable, Region};
use crate::transport::rc::{RcConfig, RcQp, RcStats};
use crate::wire::{Opcode, PacketView, ROCEV2_PORT};
use crate::work::{SendWr, Sge, WcStatus, WrOpcode};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, VecDeque};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::Arc;

/// Index of a flow in its network.
pub type FlowId = usize;

/// Largest WRITE a flow posts; flows post several, `DEPTH` at a time.
const CHUNK: u64 = 64 << 10;
const DEPTH: u32 = 4;

/// A flow: `bytes` from `src` to `dst` with congestion control `cc`, starting at `start` (ns).
/// `bytes == u64::MAX` with a `stop` time is a long-running flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct FlowSpec {
    /// The sending host.
    pub src: NodeId,
    /// The receiving host.
    pub dst: NodeId,
    /// Bytes to send (`u64::MAX`: until `stop`).
    pub bytes: u64,
    /// When it starts (ns).
    pub start: u64,
    /// When a long-running flow stops (ns).
    pub stop: Option<u64>,
    /// Its congestion control.
    pub cc: CcKind,
}

/// What a flow did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FlowResult {
    /// What it was asked to do.
    pub spec: FlowSpec,
    /// Payload bytes acknowledged.
    pub completed: u64,
    /// When the last byte was acknowledged (ns).
    pub done_at: Option<u64>,
    /// Its flow completion time (ns).
    pub fct_ns: Option<u64>,
    /// Payload bytes the receiver got per [`Network::rate_bin_ns`] bin from time 0.
    pub rx_bins: Vec<u64>,
    /// Why its QP failed, if it did.
    pub failed: Option<String>,
    /// Packets sent again.
    pub retransmitted_packets: u64,
    /// Retransmissions whose first copy had arrived.
    pub spurious_retransmissions: u64,
    /// Retransmission timeouts.
    pub timeouts: u64,
    /// Congestion notification packets the sender received.
    pub cnps: u64,
    /// Why its congestion control could not run, if so.
    pub cc_fault: Option<&'static str>,
    /// The sender's paths at the end (see [`Network::set_flow_paths`]).
    pub paths: Vec<crate::path::PathStats>,
    /// Times one of its paths left the rotation.
    pub path_downs: u64,
}

pub(super) struct Flow {
    spec: FlowSpec,
    qps: Option<(u32, u32)>,
    posted: u64,
    completed: u64,
    outstanding: u32,
    pub(super) done_at: Option<u64>,
    rx_bins: Vec<u64>,
    failed: Option<String>,
    stats: RcStats,
    fault: Option<&'static str>,
    pub(super) paths: Option<(usize, crate::path::SprayPolicy)>,
    path_stats: Vec<crate::path::PathStats>,
}

impl Flow {
    pub(super) fn new(spec: FlowSpec) -> Flow {
        Flow {
            spec,
            qps: None,
            posted: 0,
            completed: 0,
            outstanding: 0,
            done_at: None,
            rx_bins: Vec::new(),
            failed: None,
            stats: RcStats::default(),
            fault: None,
            paths: None,
            path_stats: Vec::new(),
        }
    }

    pub(super) fn result(&self) -> FlowResult {
        FlowResult {
            spec: self.spec,
            completed: self.completed,
            done_at: self.done_at,
            fct_ns: self.done_at.map(|d| d - self.spec.start),
            rx_bins: self.rx_bins.clone(),
            failed: self.failed.clone(),
            retransmitted_packets: self.stats.retransmitted_packets,
            spurious_retransmissions: self.stats.spurious_retransmissions,
            timeouts: self.stats.timeouts,
            cnps: self.stats.cnps_received,
            cc_fault: self.fault,
            paths: self.path_stats.clone(),
            path_downs: self.stats.path_downs,
        }
    }
}

struct HostQp {
    qp: RcQp,
    peer: NodeId,
    flow: FlowId,
    sender: bool,
}

pub(super) struct Host {
    addr: SocketAddrV4,
    /// Holds the host's address (its inbox) on the network.
    _link: SimLink,
    pub(super) attached: bool,
    qp_cfg: RcConfig,
    env: Arc<CcEnv>,
    mrs: MrTable,
    region: Arc<Region>,
    /// The region's keys: (lkey, rkey).
    key: (u32, u32),
    qps: BTreeMap<u32, HostQp>,
    /// QPNs count up from 0x100: a QP's number picks its UDP source ports and so its ECMP
    /// routes, which the fabric experiments were calibrated with.
    next_qpn: u32,
    /// Draws initial PSNs; seeded by the network's seed and the host's number.
    rng: StdRng,
    rr: u32,
    /// When it must run again (a QP's deadline, its line free for the next packet, delayed
    /// feedback due).
    pub(super) next_at: Option<u64>,
    pub(super) feedback_delay: u64,
    /// Feedback held back by `feedback_delay`: when it is due, its CE mark, its bytes.
    delayed: VecDeque<(u64, bool, Vec<u8>)>,
    /// Packets dropped: a bad ICRC, malformed, or for a QP that no longer exists.
    pub(super) dropped: u64,
}

/// The address of host `id`: 10.x.y.z from its node number, the RoCEv2 port.
fn addr_of(id: NodeId) -> SocketAddrV4 {
    SocketAddrV4::new(
        Ipv4Addr::new(10, (id >> 16) as u8, (id >> 8) as u8, id as u8),
        ROCEV2_PORT,
    )
}

/// The UDP source port of QP `qpn`'s packets on `path`: each path its own flow for ECMP.
fn source_port(qpn: u32, path: u8) -> u16 {
    0xC000 | ((qpn.wrapping_mul(64) + path as u32) & 0x3FFF) as u16
}

impl Host {
    pub(super) fn new(id: NodeId, net: &Arc<SimNet>, qp_cfg: RcConfig, cc: &CcParams) -> Host {
        // keys and PSNs from the network's seed, never the OS: a seed replays byte for byte
        let seed = net.seed() ^ (id as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let mrs = MrTable::seeded(seed);
        // named by an address that depends only on the host, not on the process's heap: the
        // WRITEs carry it, so two runs of a seed send the same bytes
        let region = Arc::new(Region::alloc(CHUNK as usize).at_iova(0x1_0000_0000 * (id as u64 + 1)));
        let e = mrs
            .register(region.clone(), 1, Access::ALL)
            .expect("a new table has room for one region");
        let key = (e.lkey, e.rkey);
        let addr = addr_of(id);
        Host {
            addr,
            _link: net.link(&[addr]).expect("a new host's address is free"),
            attached: false,
            qp_cfg,
            env: crate::cc::host_env(cc),
            mrs,
            region,
            key,
            qps: BTreeMap::new(),
            next_qpn: 0x100,
            rng: StdRng::seed_from_u64(seed ^ 0x5053_4E00),
            rr: 0,
            next_at: None,
            feedback_delay: 0,
            delayed: VecDeque::new(),
            dropped: 0,
        }
    }

    pub(super) fn addr(&self) -> SocketAddrV4 {
        self.addr
    }

    /// A new QP: its number and initial send PSN (drawn from the host's seeded generator).
    fn new_qp(&mut self, cc: CcKind) -> (u32, u32, RcQp) {
        let qpn = self.next_qpn;
        self.next_qpn += 1;
        let mut qp = RcQp::new(qpn, 1, RcConfig { cc, ..self.qp_cfg });
        qp.set_cc_env(self.env.clone());
        let _ = qp.modify_to_init();
        (qpn, self.rng.random::<u32>() & crate::wire::MASK24, qp)
    }
}

pub(super) fn host(net: &mut Network, n: NodeId) -> &mut Host {
    match &mut net.nodes[n] {
        Node::Host(h) => h,
        Node::Switch(_) => unreachable!("node {n} is a switch"),
    }
}

fn is_feedback(op: u8) -> bool {
    op == Opcode::Acknowledge as u8 || op == Opcode::Cnp as u8 || op == Opcode::Grant as u8
}

impl Network {
    pub(super) fn flow_start(&mut self, id: FlowId) {
        let now = self.net.now();
        let spec = self.flows[id].spec;
        let cfg_cc = spec.cc;
        let (sq, spsn, mut sqp) = host(self, spec.src).new_qp(cfg_cc);
        let (rq, rpsn, mut rqp) = host(self, spec.dst).new_qp(cfg_cc);
        let (scfg, rcfg) = (*sqp.config(), *rqp.config());
        if let Some((n, policy)) = self.flows[id].paths {
            let p = crate::path::PathParams::default();
            for qp in [&mut sqp, &mut rqp] {
                if let Err(e) = qp.set_paths(n, policy, p) {
                    self.flows[id].failed = Some(e);
                }
            }
        }
        let _ = sqp.modify_to_rtr(rq, rpsn, scfg);
        let _ = sqp.modify_to_rts(spsn);
        let _ = rqp.modify_to_rtr(sq, spsn, rcfg);
        let _ = rqp.modify_to_rts(rpsn);
        let qp = |qp, peer, sender| HostQp {
            qp,
            peer,
            flow: id,
            sender,
        };
        host(self, spec.src).qps.insert(sq, qp(sqp, spec.dst, true));
        host(self, spec.dst).qps.insert(rq, qp(rqp, spec.src, false));
        self.flows[id].qps = Some((sq, rq));
        self.flow_post(id);
        self.host_pump(spec.src, now);
    }

    /// Keeps `DEPTH` WRITEs outstanding while the flow has bytes left (and has not stopped).
    fn flow_post(&mut self, id: FlowId) {
        let now = self.now();
        let f = &self.flows[id];
        let (Some((sq, _)), spec) = (f.qps, f.spec) else { return };
        let (raddr, rkey) = {
            let d = host(self, spec.dst);
            (d.region.addr(), d.key.1)
        };
        loop {
            let f = &self.flows[id];
            let stopped = spec.stop.is_some_and(|s| now >= s);
            if f.outstanding >= DEPTH || f.posted >= spec.bytes || stopped {
                break;
            }
            let len = (spec.bytes - f.posted).min(CHUNK);
            let h = host(self, spec.src);
            let sge = Sge {
                addr: h.region.addr(),
                length: len as u32,
                lkey: h.key.0,
            };
            let wr = SendWr::new(len, WrOpcode::RdmaWrite).sge(sge).remote(raddr, rkey);
            let Some(e) = h.qps.get_mut(&sq) else { return };
            if e.qp.post_send(wr, &h.mrs).is_err() {
                break;
            }
            let f = &mut self.flows[id];
            f.posted += len;
            f.outstanding += 1;
        }
    }

    /// Handles the completions of `qpn` on host `n`.
    fn drain_completions(&mut self, n: NodeId, qpn: u32) {
        let now = self.now();
        let Some(e) = host(self, n).qps.get_mut(&qpn) else {
            return;
        };
        let (flow, sender) = (e.flow, e.sender);
        let mut done = Vec::new();
        while let Some(wc) = e.qp.poll_completion() {
            done.push(wc);
        }
        let fault = e.qp.cc_fault();
        if !sender {
            return;
        }
        for wc in done {
            let f = &mut self.flows[flow];
            f.outstanding = f.outstanding.saturating_sub(1);
            if wc.status == WcStatus::Success {
                f.completed += wc.wr_id;
            } else if f.failed.is_none() {
                f.failed = Some(format!("{:?}", wc.status));
            }
        }
        let f = &self.flows[flow];
        if f.done_at.is_some() {
            return;
        }
        let stopped = f.spec.stop.is_some_and(|s| now >= s);
        let finished = f.completed >= f.spec.bytes || f.failed.is_some() || (stopped && f.outstanding == 0);
        if finished {
            self.flow_finish(flow, fault);
        } else {
            self.flow_post(flow);
        }
    }

    fn flow_finish(&mut self, id: FlowId, fault: Option<&'static str>) {
        let now = self.now();
        let spec = self.flows[id].spec;
        let Some((sq, rq)) = self.flows[id].qps.take() else {
            return;
        };
        let sender = host(self, spec.src).qps.remove(&sq);
        let stats = sender.as_ref().map(|e| e.qp.stats());
        host(self, spec.dst).qps.remove(&rq);
        let f = &mut self.flows[id];
        f.path_stats = sender.map(|e| e.qp.path_stats()).unwrap_or_default();
        f.done_at = Some(now);
        f.stats = stats.unwrap_or_default();
        f.fault = fault;
    }

    /// Runs host `n` at `now`: what arrived, the feedback now due, its QPs' deadlines, then
    /// its NIC.
    pub(super) fn host_run(&mut self, n: NodeId, now: u64) {
        let addr = host(self, n).addr;
        while let Some((src, ce, data)) = self.net.recv_ecn(addr) {
            let h = host(self, n);
            // the ICRC, as the engine checks it: a corrupted datagram is counted and dropped
            if PacketView::verify_icrc(&data, src, addr).is_err() {
                h.dropped += 1;
                continue;
            }
            if h.feedback_delay > 0 && data.first().is_some_and(|&op| is_feedback(op)) {
                h.delayed.push_back((now + h.feedback_delay, ce, data));
                continue;
            }
            self.host_receive(n, now, ce, &data);
        }
        while host(self, n).delayed.front().is_some_and(|d| d.0 <= now) {
            let Some((_, ce, data)) = host(self, n).delayed.pop_front() else {
                break;
            };
            self.host_receive(n, now, ce, &data);
        }
        self.host_timers(n, now);
        self.host_pump(n, now);
    }

    fn host_receive(&mut self, n: NodeId, now: u64, ce: bool, data: &[u8]) {
        let (bin, rel) = (self.rate_bin_ns, self.now());
        let h = host(self, n);
        let Ok(v) = PacketView::parse(data) else {
            h.dropped += 1;
            return;
        };
        let qpn = v.bth.dest_qp;
        let Some(e) = h.qps.get_mut(&qpn) else {
            h.dropped += 1;
            return;
        };
        e.qp.handle_packet_ecn(now, &v, ce, &h.mrs);
        let (flow, data) = (e.flow, v.opcode.is_request() && !v.payload.is_empty());
        let payload = v.payload.len() as u64;
        if data && bin > 0 {
            let bins = &mut self.flows[flow].rx_bins;
            let i = (rel / bin) as usize;
            if bins.len() <= i {
                bins.resize(i + 1, 0);
            }
            bins[i] += payload;
        }
        self.drain_completions(n, qpn);
    }

    fn host_timers(&mut self, n: NodeId, now: u64) {
        let due: Vec<u32> = host(self, n)
            .qps
            .iter()
            .filter(|(_, e)| e.qp.poll_timeout().is_some_and(|t| t <= now))
            .map(|(&q, _)| q)
            .collect();
        for q in due {
            if let Some(e) = host(self, n).qps.get_mut(&q) {
                e.qp.handle_timeout(now);
            }
            self.drain_completions(n, q);
        }
    }

    /// Sends the next packet (round robin over QPs) if the NIC's line is free, and sets when
    /// the host must run again.
    fn host_pump(&mut self, n: NodeId, now: u64) {
        let net = self.net.clone();
        let h = host(self, n);
        let mut line = net.line_free_at(h.addr);
        if line <= now {
            let order: Vec<u32> = h
                .qps
                .range(h.rr + 1..)
                .chain(h.qps.range(..=h.rr))
                .map(|(&q, _)| q)
                .collect();
            for q in order {
                let Some(e) = h.qps.get_mut(&q) else { continue };
                if !e.qp.wants_transmit(now) {
                    continue;
                }
                let Some(p) = e.qp.poll_transmit(now) else { continue };
                let dst = addr_of(e.peer);
                let src = SocketAddrV4::new(*h.addr.ip(), source_port(q, p.path));
                let mut data = Vec::with_capacity(p.hdr.len() + p.payload_len() + 8);
                p.encode(src, dst, &mut data);
                h.rr = q;
                net.send(src, dst, data);
                line = net.line_free_at(h.addr);
                break;
            }
        }
        // its line frees (the next packet), a QP's deadline, feedback due
        let busy = (line > now).then_some(line);
        let next = (h.qps.values().filter_map(|e| e.qp.poll_timeout()))
            .chain(busy)
            .chain(h.delayed.front().map(|d| d.0))
            .min();
        h.next_at = next.map(|t| t.max(now + 1));
    }
}
