//! The whole stack in one deterministic simulator: real contexts (one or two data cores each,
//! send queues, commands, completion queues, the hairpin path, congestion control) on a
//! simulated network and clock, under
//! seeded faults (loss, duplication, corruption, reordering, partitions, and cuts of one path
//! of QPs that spray over two); a quarter of the seeds cross a leaf-spine fabric instead of one
//! big switch (small buffers that drop, RED ECN marks, INT for HPCC, ECMP over two spines, one
//! spine link sometimes down for a while). A random workload of
//! WRITEs, READs, SENDs and offloads (the batched READ and a handler that counts its runs, both
//! inline on the receiving core) runs on several connections, one of them a loopback on one host;
//! checkers run after every step against the workload's own record:
//! - every work request completes exactly once, successfully, in the order it was posted;
//! - nothing completes before its data is in place: at a WRITE's completion the target holds
//!   the new bytes, at a READ's the local buffer does, and at a SEND's the receiver has
//!   already completed the receive;
//! - receives complete in order with the bytes and length that were sent;
//! - an offload completes with its handler's response, and each request's handler ran once;
//! - data is new at its target (fresh random bytes per operation).
//!
//! Every seed runs twice and the two traces (every delivered datagram with its time, every
//! completion with its time) must hash the same. `SIM_SEED=n` replays one seed (with
//! `SIM_PCAP=file` it writes that run's datagrams as a pcap); `SIM_SEEDS=n` sets how many run
//! (default 10,000). Seeds are spread over the available cores.
//!
//! A second test runs RedN's hash get (recycled chains on managed QPs, executed by the
//! server's data core) under the same faults: every get answered once with its value
//! (`SIM_REDN_SEEDS`, default 10,000). A third runs Solar between an agent and a storage
//! server, sprayed over 1-4 paths with one sometimes cut: every write acknowledged and applied
//! once, every read the last acknowledged data (`SIM_SOLAR_SEEDS`, default 10,000).

use netstack::link::sim::{EcnSpec, Faults, LinkSpec, PortId, SimNet, SimStats, SwitchSpec};
use netstack::offload::{builtin, OffloadCall, OffloadError, QpFilter};
use netstack::path::SprayPolicy;
use netstack::verbs::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, VecDeque};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::Arc;
use std::sync::Mutex;

const MR_LEN: usize = 1 << 20;
/// Steps a seed may take (a livelock of tiny deadlines would otherwise run for ever).
const MAX_STEPS: u64 = 200_000;
/// Simulated time a seed's workload must finish in.
const BOUND_NS: u64 = 20_000_000_000;

struct Host {
    ctx: Context,
    _pd: Pd,
    /// The offload handlers this host serves (inline) and the region they may read.
    _offloads: Vec<netstack::offload::Registered>,
    _dma: netstack::offload::DmaRegionHandle,
    /// How many times the counting handler ran for each request id.
    runs: Arc<Mutex<BTreeMap<u64, u32>>>,
    send_cq: Cq,
    recv_cq: Cq,
    mr: Mr,
    /// Next free byte of `mr` (every operation gets ranges of its own).
    next: usize,
}

impl Host {
    fn take(&mut self, len: usize) -> usize {
        let at = self.next;
        self.next += len.max(1);
        assert!(self.next <= MR_LEN, "workload outgrew the region");
        at
    }
}

#[derive(Debug)]
enum Kind {
    Write {
        remote: usize,
    },
    Read {
        local: usize,
    },
    Send,
    /// An offload whose response lands at `local` (`data` is the expected response).
    Offload {
        local: usize,
    },
}

/// The counting handler's opcode: it answers its 8-byte request id twice and records the run.
const COUNTED: u16 = 0x0C01;

#[derive(Debug)]
struct Op {
    wr_id: u64,
    kind: Kind,
    data: Vec<u8>,
}

/// One connection: a requester QP on host `a`, its responder on host `b` (the same host for
/// the loopback connection).
struct Conn {
    a: usize,
    b: usize,
    qa: Qp,
    qb: Qp,
    /// Posted, not yet completed, in post order.
    pending: VecDeque<Op>,
    /// SENDs whose receive has not completed yet, in order.
    sends: VecDeque<Vec<u8>>,
    /// Posted receives: (wr_id, offset in `b`'s region), in order.
    recvs: VecDeque<(u64, usize)>,
    next_recv_id: u64,
    /// Receives completed, and SEND completions seen.
    received: u64,
    sends_completed: u64,
    depth: usize,
}

struct World {
    net: Arc<SimNet>,
    hosts: Vec<Host>,
    conns: Vec<Conn>,
    rng: StdRng,
    /// Hash of every completion (time, QP, id, status, length).
    trace: u64,
    /// Whether QPs spray over two paths.
    spray: bool,
    /// On a fabric: the two ports of the link between host 0's leaf and the first spine.
    spine_link: Option<[PortId; 2]>,
    completions: u64,
}

fn fnv(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

const RECV_LEN: usize = 4096;
const RECVS: usize = 8;

fn faults_for(rng: &mut StdRng) -> Faults {
    Faults {
        loss: [0.0, 0.0, 0.01, 0.05][rng.random_range(0..4)],
        duplicate: [0.0, 0.02][rng.random_range(0..2)],
        corrupt: [0.0, 0.01][rng.random_range(0..2)],
        delay_ns: rng.random_range(1_000..20_000),
        jitter_ns: [0, 5_000, 30_000][rng.random_range(0..3)],
        rate_bps: [10_000_000_000, 100_000_000_000][rng.random_range(0..2)],
        mtu: 1500,
        ecn_mark_ns: [0, 0, 2_000, 20_000][rng.random_range(0..4)],
    }
}

impl World {
    fn new(seed: u64) -> World {
        let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed_5eed);
        let faults = faults_for(&mut rng);
        let net = SimNet::new(seed, faults);
        // a quarter of the seeds: each host on a leaf of its own, two spines, links of the
        // drawn rate, switches with RED ECN marking, INT, and buffers from tiny (drops) to ample
        let spine_link = rng.random_bool(0.25).then(|| {
            let link = LinkSpec {
                rate_bps: faults.rate_bps,
                delay_ns: faults.delay_ns / 2,
            };
            let sw = SwitchSpec {
                buffer_bytes: [16 << 10, 64 << 10, 1 << 20][rng.random_range(0..3)],
                ecn: Some(EcnSpec {
                    kmin: 8 << 10,
                    kmax: 32 << 10,
                    pmax: 0.2,
                }),
                int: true,
            };
            let spines = [net.add_switch(sw), net.add_switch(sw)];
            let mut first = None;
            for h in 0..2u8 {
                let leaf = net.add_switch(sw);
                for &spine in &spines {
                    let (pl, ps) = net.connect(leaf, spine, link);
                    first.get_or_insert([PortId::Switch(leaf, pl), PortId::Switch(spine, ps)]);
                }
                net.attach_host(Ipv4Addr::new(10, 0, 0, h + 1), leaf, link);
            }
            net.build_routes();
            net.set_ecmp_seed(seed);
            first.expect("two spines")
        });
        // a third of the seeds spray every QP over two paths (source ports), one of which
        // may be cut; spraying needs selective repeat
        let spray = [None, None, Some(SprayPolicy::RoundRobin), Some(SprayPolicy::Weighted)][rng.random_range(0..4)];
        let recovery = if spray.is_none() && rng.random_bool(0.5) {
            Recovery::GoBackN
        } else {
            Recovery::SelectiveRepeat
        };
        let mtu = [256, 1024][rng.random_range(0..2)];
        let gso = rng.random_bool(0.5);
        // one data core or two (QPs sharded across them, completions merged per CQ), and a
        // congestion control, or none (HPCC only where switches stamp INT)
        let cores = rng.random_range(1..=2usize);
        let algorithms = [
            netstack::cc::CcKind::None,
            netstack::cc::CcKind::None,
            netstack::cc::CcKind::Dcqcn,
            netstack::cc::CcKind::Timely,
            netstack::cc::CcKind::Swift,
            netstack::cc::CcKind::Hpcc,
        ];
        let cc = algorithms[rng.random_range(0..algorithms.len() - usize::from(spine_link.is_none()))];
        let mut hosts = Vec::new();
        for h in 0..2u8 {
            let cfg = ContextConfig {
                bind: SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, h + 1), 4791),
                data_cores: cores,
                path_ports: if spray.is_some() { 2 } else { 1 },
                gso,
                rx_staging_bytes: 64 << 10,
                qp: RcConfig {
                    recovery,
                    mtu,
                    cc,
                    ..RcConfig::default()
                },
                ..ContextConfig::default()
            };
            let ctx = Context::open_simulated(cfg, &net).expect("simulated context");
            let pd = ctx.alloc_pd();
            let send_cq = ctx.create_cq(256).unwrap();
            let recv_cq = ctx.create_cq(256).unwrap();
            let mr = pd.reg_mr(MR_LEN, Access::ALL).unwrap();
            // offloads served on the data core (inline): the batched READ, and a handler that
            // counts its runs (a resent request must be answered from the cache, not rerun)
            let off = ctx.offload();
            let runs: Arc<Mutex<BTreeMap<u64, u32>>> = Arc::default();
            let r = runs.clone();
            let offloads = vec![
                off.register_inline(builtin::BATCH_READ, QpFilter::Any, builtin::batch_read())
                    .unwrap(),
                off.register_inline(COUNTED, QpFilter::Any, move |mut call: OffloadCall| {
                    let r = r.clone();
                    async move {
                        let id = call.request().to_vec();
                        let key = u64::from_le_bytes(
                            id[..8]
                                .try_into()
                                .map_err(|_| OffloadError::BadRequest("short".into()))?,
                        );
                        *r.lock().unwrap().entry(key).or_default() += 1;
                        call.alloc_resp(16)?;
                        call.resp_mut()[..8].copy_from_slice(&id);
                        call.resp_mut()[8..].copy_from_slice(&id);
                        call.submit_resp()
                    }
                })
                .unwrap(),
            ];
            let dma = off.register_dma_region(&mr, false);
            hosts.push(Host {
                ctx,
                _pd: pd,
                _offloads: offloads,
                _dma: dma,
                runs,
                send_cq,
                recv_cq,
                mr,
                next: 0,
            });
        }
        let mut w = World {
            net,
            hosts,
            conns: Vec::new(),
            rng,
            spray: spray.is_some(),
            spine_link,
            trace: 0xcbf2_9ce4_8422_2325,
            completions: 0,
        };
        // two connections host 0 -> host 1, one back, one loopback on host 0 (hairpin)
        for (a, b) in [(0, 1), (0, 1), (1, 0), (0, 0)] {
            let low_latency = w.rng.random_bool(0.3);
            // a host's loopback crosses no switch, so no INT: HPCC refuses such a path, and
            // the loopback runs DCQCN instead
            let config = (a == b && cc == netstack::cc::CcKind::Hpcc).then_some(RcConfig {
                recovery,
                mtu,
                cc: netstack::cc::CcKind::Dcqcn,
                ..RcConfig::default()
            });
            let attr = QpInitAttr {
                low_latency,
                config,
                ..QpInitAttr::default()
            };
            let ha = &w.hosts[a];
            let qa = ha.ctx.create_qp(&ha.mr_pd(), &ha.send_cq, &ha.recv_cq, attr).unwrap();
            let hb = &w.hosts[b];
            let qb = hb.ctx.create_qp(&hb.mr_pd(), &hb.send_cq, &hb.recv_cq, attr).unwrap();
            if let Some(policy) = spray {
                qa.set_paths(2, policy).unwrap();
            }
            qa.connect(&qb.local_endpoint()).unwrap();
            qb.connect(&qa.local_endpoint()).unwrap();
            let depth = w.rng.random_range(1..=8);
            w.conns.push(Conn {
                a,
                b,
                qa,
                qb,
                pending: VecDeque::new(),
                sends: VecDeque::new(),
                recvs: VecDeque::new(),
                next_recv_id: 1,
                received: 0,
                sends_completed: 0,
                depth,
            });
        }
        for c in 0..w.conns.len() {
            for _ in 0..RECVS {
                w.post_recv(c);
            }
        }
        w
    }

    fn post_recv(&mut self, c: usize) {
        let b = self.conns[c].b;
        let off = self.hosts[b].take(RECV_LEN);
        // stale bytes, so a receive that wrote nothing is seen
        self.hosts[b].mr.region().fill(off, RECV_LEN, 0xEE);
        let conn = &mut self.conns[c];
        let id = conn.next_recv_id;
        conn.next_recv_id += 1;
        let sge = self.hosts[b].mr.sge(off, RECV_LEN);
        conn.qb
            .post_recv(RecvWr {
                wr_id: id,
                sg_list: std::iter::once(sge).collect(),
            })
            .expect("post_recv");
        conn.recvs.push_back((id, off));
    }

    /// Posts one random operation on connection `c`.
    fn post(&mut self, c: usize, wr_id: u64) {
        let max = 3 * 1024 + 100;
        let len = match self.rng.random_range(0..4) {
            0 => self.rng.random_range(0..64),
            _ => self.rng.random_range(1..max),
        };
        let mut data = vec![0u8; len];
        self.rng.fill(&mut data[..]);
        let (a, b) = (self.conns[c].a, self.conns[c].b);
        let pick = self.rng.random_range(0..5);
        let outstanding_sends = self.conns[c].sends.len();
        let op = match pick {
            0 | 1 => {
                // the data at its source, stale bytes at its destination
                let (local, remote) = (self.hosts[a].take(len), self.hosts[b].take(len));
                let write = pick == 0;
                let (src, dst) = if write { (a, b) } else { (b, a) };
                let (src_off, dst_off) = if write { (local, remote) } else { (remote, local) };
                self.hosts[src].mr.write(src_off, &data);
                self.hosts[dst].mr.region().fill(dst_off, len, 0xEE);
                let opcode = if write { WrOpcode::RdmaWrite } else { WrOpcode::RdmaRead };
                let wr = SendWr::new(wr_id, opcode)
                    .sge(self.hosts[a].mr.sge(local, len))
                    .remote(self.hosts[b].mr.addr() + remote as u64, self.hosts[b].mr.rkey());
                self.conns[c].qa.post_send(wr).expect("post WRITE or READ");
                let kind = if write {
                    Kind::Write { remote }
                } else {
                    Kind::Read { local }
                };
                Op { wr_id, kind, data }
            }
            3 => {
                // a batched READ of 1-4 fresh ranges of the responder's memory, served inline
                let n = self.rng.random_range(1..=4);
                let mut ranges = Vec::new();
                let mut expect = Vec::new();
                for _ in 0..n {
                    let l = self.rng.random_range(1..400);
                    let at = self.hosts[b].take(l);
                    let mut d = vec![0u8; l];
                    self.rng.fill(&mut d[..]);
                    self.hosts[b].mr.write(at, &d);
                    ranges.push((self.hosts[b].mr.addr() + at as u64, l as u32));
                    expect.extend_from_slice(&d);
                }
                let local = self.hosts[a].take(expect.len());
                self.hosts[a].mr.region().fill(local, expect.len(), 0xEE);
                let req = builtin::encode_batch_read(self.hosts[b].mr.rkey(), &ranges);
                let sge = self.hosts[a].mr.sge(local, expect.len());
                self.conns[c]
                    .qa
                    .post_offload(wr_id, builtin::BATCH_READ, &req, sge)
                    .expect("post offload");
                Op {
                    wr_id,
                    kind: Kind::Offload { local },
                    data: expect,
                }
            }
            4 => {
                // the counting handler: the id is unique in the run (connection, wr_id)
                let id = ((c as u64) << 32) | wr_id;
                let local = self.hosts[a].take(16);
                self.hosts[a].mr.region().fill(local, 16, 0xEE);
                let sge = self.hosts[a].mr.sge(local, 16);
                self.conns[c]
                    .qa
                    .post_offload(wr_id, COUNTED, &id.to_le_bytes(), sge)
                    .expect("post offload");
                let mut expect = id.to_le_bytes().to_vec();
                expect.extend_from_slice(&id.to_le_bytes());
                Op {
                    wr_id,
                    kind: Kind::Offload { local },
                    data: expect,
                }
            }
            _ if outstanding_sends < RECVS => {
                let len = len.min(RECV_LEN);
                data.truncate(len);
                let src = self.hosts[a].take(len);
                self.hosts[a].mr.write(src, &data);
                let wr = SendWr::new(wr_id, WrOpcode::Send).sge(self.hosts[a].mr.sge(src, len));
                self.conns[c].qa.post_send(wr).expect("post SEND");
                self.conns[c].sends.push_back(data.clone());
                Op {
                    wr_id,
                    kind: Kind::Send,
                    data,
                }
            }
            _ => return self.post_write_zero(c, wr_id),
        };
        self.conns[c].pending.push_back(op);
    }

    /// A zero-length WRITE (when every receive is spoken for).
    fn post_write_zero(&mut self, c: usize, wr_id: u64) {
        let b = self.conns[c].b;
        let remote = self.hosts[b].take(1);
        let wr = SendWr::new(wr_id, WrOpcode::RdmaWrite)
            .remote(self.hosts[b].mr.addr() + remote as u64, self.hosts[b].mr.rkey());
        self.conns[c].qa.post_send(wr).expect("post WRITE");
        self.conns[c].pending.push_back(Op {
            wr_id,
            kind: Kind::Write { remote },
            data: Vec::new(),
        });
    }

    fn note(&mut self, wc: &Wc) {
        let now = self.net.now();
        let mut h = fnv(self.trace, &now.to_le_bytes());
        h = fnv(h, &wc.qp_num.to_le_bytes());
        h = fnv(h, &wc.wr_id.to_le_bytes());
        h = fnv(h, &[wc.status as u8]);
        self.trace = fnv(h, &wc.byte_len.to_le_bytes());
        self.completions += 1;
    }

    /// Polls every CQ and checks each completion. Receivers first: a SEND's receive completes
    /// before the ACK that completes the SEND leaves the receiver.
    fn check(&mut self) -> Result<(), String> {
        let mut wcs = [EMPTY_WC; 32];
        for h in 0..self.hosts.len() {
            loop {
                let n = self.hosts[h].recv_cq.poll(&mut wcs);
                if n == 0 {
                    break;
                }
                for wc in &wcs[..n] {
                    self.note(wc);
                    let c = self
                        .conns
                        .iter()
                        .position(|c| c.b == h && c.qb.qp_num() == wc.qp_num)
                        .ok_or_else(|| format!("receive completion on an unknown QP: {wc:?}"))?;
                    if wc.status != WcStatus::Success {
                        return Err(format!("receive failed: {wc:?}"));
                    }
                    let conn = &mut self.conns[c];
                    let (id, off) = conn
                        .recvs
                        .pop_front()
                        .ok_or_else(|| format!("a receive completed twice: {wc:?}"))?;
                    if wc.wr_id != id {
                        return Err(format!("receive {} completed before {id} (out of order)", wc.wr_id));
                    }
                    let sent = conn
                        .sends
                        .pop_front()
                        .ok_or_else(|| format!("a receive completed with no SEND outstanding: {wc:?}"))?;
                    if wc.byte_len as usize != sent.len() {
                        return Err(format!("receive {id}: {} bytes, {} were sent", wc.byte_len, sent.len()));
                    }
                    let mut got = vec![0u8; sent.len()];
                    self.hosts[h].mr.read(off, &mut got);
                    if got != sent {
                        return Err(format!("receive {id}: the bytes differ from the SEND's"));
                    }
                    conn.received += 1;
                    self.post_recv(c);
                }
            }
        }
        for h in 0..self.hosts.len() {
            loop {
                let n = self.hosts[h].send_cq.poll(&mut wcs);
                if n == 0 {
                    break;
                }
                for wc in &wcs[..n] {
                    self.note(wc);
                    let c = self
                        .conns
                        .iter()
                        .position(|c| c.a == h && c.qa.qp_num() == wc.qp_num)
                        .ok_or_else(|| format!("completion on an unknown QP: {wc:?}"))?;
                    let b = self.conns[c].b;
                    let op = self.conns[c]
                        .pending
                        .pop_front()
                        .ok_or_else(|| format!("completion with nothing outstanding (twice?): {wc:?}"))?;
                    if wc.wr_id != op.wr_id {
                        return Err(format!(
                            "{} completed while {} was first (out of order or twice)",
                            wc.wr_id, op.wr_id
                        ));
                    }
                    if wc.status != WcStatus::Success {
                        let c = &self.conns[c];
                        return Err(format!(
                            "{:?} of {} bytes failed: {wc:?}; requester {:?}; responder {:?}; faults {:?}; network {:?}",
                            op.kind,
                            op.data.len(),
                            c.qa.stats(),
                            c.qb.stats(),
                            self.net.faults(),
                            self.net.stats()
                        ));
                    }
                    let mut got = vec![0u8; op.data.len()];
                    match op.kind {
                        Kind::Write { remote } => {
                            self.hosts[b].mr.read(remote, &mut got);
                            if got != op.data {
                                return Err(format!(
                                    "WRITE {} completed before its data was at the target",
                                    op.wr_id
                                ));
                            }
                        }
                        Kind::Read { local } => {
                            self.hosts[h].mr.read(local, &mut got);
                            if got != op.data {
                                return Err(format!("READ {} completed without the remote bytes", op.wr_id));
                            }
                        }
                        Kind::Offload { local } => {
                            if wc.byte_len as usize != op.data.len() {
                                return Err(format!(
                                    "offload {}: {} response bytes, {} expected",
                                    op.wr_id,
                                    wc.byte_len,
                                    op.data.len()
                                ));
                            }
                            self.hosts[h].mr.read(local, &mut got);
                            if got != op.data {
                                return Err(format!("offload {} completed without its response", op.wr_id));
                            }
                        }
                        Kind::Send => {
                            let conn = &mut self.conns[c];
                            conn.sends_completed += 1;
                            if conn.received < conn.sends_completed {
                                return Err(format!("SEND {} completed before its receive did", op.wr_id));
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

impl Host {
    fn mr_pd(&self) -> Pd {
        self._pd.clone()
    }
}

struct Outcome {
    trace: u64,
    net_trace: u64,
    completions: u64,
    stats: SimStats,
}

impl Outcome {
    /// A finished run: the workload's trace hash and completions, and what `net` carried.
    fn of(net: &SimNet, trace: u64, completions: u64) -> Outcome {
        Outcome {
            trace,
            net_trace: net.trace_hash(),
            completions,
            stats: net.stats(),
        }
    }
}

fn run_seed(seed: u64, pcap: Option<&std::path::Path>) -> Result<Outcome, String> {
    let mut w = World::new(seed);
    if let Some(p) = pcap {
        w.net.pcap(p).map_err(|e| format!("pcap: {e}"))?;
    }
    let start = w.net.now();
    // a partition between the two hosts for a while, sometimes
    let partition = w.rng.random_bool(0.2).then(|| {
        (
            start + w.rng.random_range(0..2_000_000),
            w.rng.random_range(100_000..20_000_000),
        )
    });
    // one path of a sprayed QP cut for a while, sometimes (the second source port of a host)
    let cut = (w.spray && w.rng.random_bool(0.5)).then(|| {
        let host = w.rng.random_range(0..2);
        let sources = w
            .conns
            .iter()
            .find(|c| c.a == host)
            .map(|c| c.qa.local_endpoint().sources);
        let src = sources
            .and_then(|s| s.first().copied())
            .expect("a sprayed QP has a second source");
        (
            src,
            start + w.rng.random_range(0..2_000_000),
            w.rng.random_range(100_000..20_000_000),
        )
    });
    let mut was_cut = false;
    // on a fabric, the link from host 0's leaf to the first spine down for a while, sometimes
    // (the flows ECMP hashed onto it are black-holed until it returns)
    let spine_down = w.spine_link.filter(|_| w.rng.random_bool(0.5)).map(|ports| {
        let at = start + w.rng.random_range(0..2_000_000);
        (ports, at, at + w.rng.random_range(100_000..20_000_000))
    });
    let mut spine_state = 0;
    let ops_per_conn = w.rng.random_range(4..24);
    let mut posted = vec![0u64; w.conns.len()];
    let mut partitioned = false;
    let mut steps = 0u64;
    loop {
        // keep every connection at its depth until its operations are all posted
        for (c, n) in posted.iter_mut().enumerate() {
            while *n < ops_per_conn && w.conns[c].pending.len() < w.conns[c].depth {
                *n += 1;
                w.post(c, *n);
            }
        }
        if let Some((at, len)) = partition {
            if !partitioned && w.net.now() >= at {
                partitioned = true;
                w.net
                    .partition(Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 2), len);
            }
        }
        if let Some((src, at, len)) = cut {
            if !was_cut && w.net.now() >= at {
                was_cut = true;
                w.net.cut(src, len);
            }
        }
        if let Some((ports, down, up)) = spine_down {
            let now = w.net.now();
            if (spine_state == 0 && now >= down) || (spine_state == 1 && now >= up) {
                spine_state += 1;
                for p in ports {
                    w.net.set_port_up(p, spine_state == 2);
                }
            }
        }
        let done = w
            .conns
            .iter()
            .enumerate()
            .all(|(c, k)| posted[c] == ops_per_conn && k.pending.is_empty());
        if done {
            break;
        }
        if w.net.now() - start > BOUND_NS {
            let left: Vec<_> = w.conns.iter().map(|c| c.pending.len()).collect();
            return Err(format!(
                "not done in {} s of simulated time: outstanding {left:?}",
                BOUND_NS / 1_000_000_000
            ));
        }
        steps += 1;
        if steps > MAX_STEPS {
            let left: Vec<_> = w.conns.iter().map(|c| c.pending.len()).collect();
            return Err(format!(
                "{MAX_STEPS} steps reached {} us of simulated time: outstanding {left:?}, network {:?}",
                (w.net.now() - start) / 1000,
                w.net.stats()
            ));
        }
        let more = w.net.step();
        w.check()?;
        // nothing scheduled while work requests are outstanding: nothing will ever complete them
        if !more && w.conns.iter().any(|k| !k.pending.is_empty()) {
            let state: Vec<String> = w
                .conns
                .iter()
                .map(|c| {
                    format!(
                        "{}->{} pending {:?} sends {} recvs {}: requester {:?} {:?}; responder {:?} {:?}",
                        c.a,
                        c.b,
                        c.pending
                            .iter()
                            .map(|o| (o.wr_id, &o.kind, o.data.len()))
                            .collect::<Vec<_>>(),
                        c.sends.len(),
                        c.recvs.len(),
                        c.qa.state(),
                        c.qa.stats(),
                        c.qb.state(),
                        c.qb.stats()
                    )
                })
                .collect();
            return Err(format!(
                "the simulation stopped with work outstanding (no deadline, nothing in flight):\n{}",
                state.join("\n")
            ));
        }
    }
    // exactly once: nothing completes after the workload is done
    let seen = w.completions;
    w.net.run_until(50_000_000, || false);
    w.check()?;
    let receives_left: usize = w.conns.iter().map(|c| c.sends.len()).sum();
    if w.completions != seen || receives_left != 0 {
        return Err(format!(
            "{} completions after the workload finished; {receives_left} SENDs never received",
            w.completions - seen
        ));
    }
    // every counted offload ran exactly once, however often its request was resent
    for h in &w.hosts {
        if let Some((id, n)) = h.runs.lock().unwrap().iter().find(|(_, &n)| n != 1) {
            return Err(format!("offload request {id:#x} ran {n} times"));
        }
    }
    Ok(Outcome::of(&w.net, w.trace, w.completions))
}

/// Runs seed `seed` twice with `run`; the two runs' traces (datagrams and completions with
/// their times) must hash the same. Returns the first run's outcome.
fn twice(seed: u64, run: impl Fn(u64) -> Result<Outcome, String>) -> Result<Outcome, String> {
    let first = run(seed).map_err(|e| format!("seed {seed}: {e} (replay: SIM_SEED={seed})"))?;
    let second = run(seed).map_err(|e| format!("seed {seed}, second run: {e}"))?;
    if (first.trace, first.net_trace) != (second.trace, second.net_trace) {
        return Err(format!(
            "seed {seed}: two runs differ (completions {:x} vs {:x}, datagrams {:x} vs {:x})",
            first.trace, second.trace, first.net_trace, second.net_trace
        ));
    }
    Ok(first)
}

/// The seeds a test runs: `SIM_SEED` alone, or as many as the variable `count` says (else
/// `default`), from 0.
fn seeds(count: &str, default: u64) -> std::ops::Range<u64> {
    if let Ok(s) = std::env::var("SIM_SEED") {
        let s: u64 = s.parse().expect("SIM_SEED must be a number");
        return s..s + 1;
    }
    0..std::env::var(count)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// Runs every seed of `seeds` twice with `run` ([`twice`]), spread over the machine's cores;
/// panics with the first failure. Returns the completions and what the networks did, summed.
fn run_all(seeds: std::ops::Range<u64>, run: impl Fn(u64) -> Result<Outcome, String> + Sync) -> (u64, SimStats) {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    let totals = std::thread::scope(|s| {
        let (run, seeds) = (&run, &seeds);
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn(move || {
                    let mut sum = SimStats::default();
                    let mut completions = 0;
                    let mut seed = seeds.start + t;
                    while seed < seeds.end {
                        let o = twice(seed, run).unwrap_or_else(|e| panic!("{e}"));
                        completions += o.completions;
                        sum += o.stats;
                        seed += threads;
                    }
                    (completions, sum)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    let mut sum = SimStats::default();
    for &(_, t) in &totals {
        sum += t;
    }
    (totals.iter().map(|t| t.0).sum(), sum)
}

#[test]
fn seeded_runs_of_the_whole_stack_are_exactly_once_in_order_and_replay_identically() {
    let seeds = seeds("SIM_SEEDS", 10_000);
    let n = seeds.end - seeds.start;
    let pcap = std::env::var("SIM_PCAP").ok().map(std::path::PathBuf::from);
    let started = std::time::Instant::now();
    let (completions, net) = run_all(seeds, |s| run_seed(s, pcap.as_deref()));
    eprintln!(
        "{n} seeds, each run twice, in {:.1} s: {completions} completions; {} datagrams, {} lost, \
         {} duplicated, {} corrupted, {} partitioned or cut, {} marked CE, {} dropped in a fabric",
        started.elapsed().as_secs_f64(),
        net.sent,
        net.lost,
        net.duplicated,
        net.corrupted,
        net.blocked,
        net.ce_marked,
        net.fabric_drops
    );
    // the faults did happen (a simulator that injects nothing proves nothing)
    if n >= 100 {
        assert!(
            net.lost > 0
                && net.duplicated > 0
                && net.corrupted > 0
                && net.blocked > 0
                && net.ce_marked > 0
                && net.fabric_drops > 0,
            "faults were not injected: {net:?}"
        );
    }
}

/// RedN's hash get (Fig. 9, a recycled chain per candidate bucket on managed QPs) served by the
/// server's data core on the simulated network, under the same seeded faults: every get is
/// answered once, with its id and the key's value, and nothing else arrives.
fn run_redn_seed(seed: u64) -> Result<Outcome, String> {
    use netstack::redn::programs::{hash_get_request, insert_bucket, ClientBuffer, HashGetServer};
    let mut rng = StdRng::seed_from_u64(seed ^ 0x4ed4_4ed4);
    let mut faults = faults_for(&mut rng);
    // a miss is silence, so a lost answer would look like one: RC recovers every loss, but
    // keep the run short
    faults.loss = faults.loss.min(0.02);
    let net = SimNet::new(seed, faults);
    let open = |h: u8| {
        Context::open_simulated(
            ContextConfig {
                bind: SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, h), 4791),
                rx_staging_bytes: 64 << 10,
                ..ContextConfig::default()
            },
            &net,
        )
        .map_err(|e| format!("context: {e}"))
    };
    let (sctx, cctx) = (open(2)?, open(1)?);
    let (spd, cpd) = (sctx.alloc_pd(), cctx.alloc_pd());
    let err = |e: VerbsError| e.to_string();
    let table = spd.reg_mr(64 * 16, Access::ALL).map_err(err)?;
    let values = spd.reg_mr(64 * 64, Access::ALL).map_err(err)?;
    let qcq = sctx.create_cq_ignore_overrun(64).map_err(err)?;
    let rcq = sctx.create_cq_ignore_overrun(64).map_err(err)?;
    let ccq = cctx.create_cq(1024).map_err(err)?;
    let cbuf = cpd.reg_mr(4096, Access::ALL).map_err(err)?;
    let mut qs = Vec::new();
    let mut cs = Vec::new();
    for _ in 0..2 {
        let attr = QpInitAttr {
            managed_slots: 1,
            ..Default::default()
        };
        let q = sctx.create_qp(&spd, &qcq, &rcq, attr).map_err(err)?;
        let c = cctx.create_qp(&cpd, &ccq, &ccq, QpInitAttr::default()).map_err(err)?;
        c.connect(&q.local_endpoint()).map_err(err)?;
        q.connect(&c.local_endpoint()).map_err(err)?;
        qs.push(q);
        cs.push(c);
    }
    let h1 = |k: u64| k % 64;
    let h2 = |k: u64| (k * 7 + 3) % 64;
    let mut stored = Vec::new();
    for k in 1..=40u64 {
        let at = values.addr() + 64 * stored.len() as u64;
        if insert_bucket(&table, &[h1(k), h2(k)], k, at).is_none() {
            continue;
        }
        let mut v = [0u8; 64];
        rng.fill(&mut v[..]);
        values.write(64 * stored.len(), &v);
        stored.push((k, v));
    }
    let server = HashGetServer::new(
        &sctx,
        &spd,
        &[&qs[0], &qs[1]],
        &rcq,
        table.rkey(),
        values.lkey(),
        64,
        ClientBuffer {
            addr: cbuf.addr() + 512,
            rkey: cbuf.rkey(),
        },
    )
    .map_err(err)?;
    let gets = rng.random_range(4..24usize);
    server.post_recvs(&qs[0], gets + 8).map_err(err)?;
    for c in &cs {
        for i in 0..gets {
            c.post_recv(RecvWr {
                wr_id: i as u64,
                sg_list: [cbuf.sge(3000, 4)].into_iter().collect(),
            })
            .map_err(err)?;
        }
    }
    let start = net.now();
    let mut trace = 0xcbf2_9ce4_8422_2325u64;
    let mut completions = 0;
    let mut wcs = [EMPTY_WC; 16];
    for n in 0..gets {
        let (k, v) = stored[rng.random_range(0..stored.len())];
        let msg = hash_get_request(k, n as u32, &[table.addr() + h1(k) * 16, table.addr() + h2(k) * 16]);
        cbuf.write(0, &msg);
        cbuf.region().fill(512, 64, 0xEE);
        cs[0]
            .post_send(SendWr::new(n as u64, WrOpcode::Send).sge(cbuf.sge(0, msg.len())))
            .map_err(err)?;
        let mut answered = false;
        let mut steps = 0u64;
        while !answered {
            steps += 1;
            if steps > MAX_STEPS || net.now() - start > BOUND_NS {
                return Err(format!("get {n} of key {k}: no answer; network {:?}", net.stats()));
            }
            let more = net.step();
            let got = ccq.poll(&mut wcs);
            for wc in &wcs[..got] {
                completions += 1;
                let mut h = fnv(trace, &net.now().to_le_bytes());
                h = fnv(h, &wc.wr_id.to_le_bytes());
                trace = fnv(h, &[wc.status as u8, wc.opcode as u8]);
                if wc.status != WcStatus::Success {
                    return Err(format!("get {n}: {wc:?}"));
                }
                if wc.opcode == WcOpcode::RecvRdmaWithImm {
                    if answered || wc.imm_data != Some(n as u32) {
                        return Err(format!("get {n} of key {k}: an answer for {:?} ({wc:?})", wc.imm_data));
                    }
                    let mut got = [0u8; 64];
                    cbuf.read(512, &mut got);
                    if got != v {
                        return Err(format!("get {n} of key {k}: the answer is not the key's value"));
                    }
                    answered = true;
                }
            }
            if !more && !answered {
                return Err(format!("get {n} of key {k}: the simulation stopped unanswered"));
            }
        }
    }
    // nothing more arrives: each get was answered once
    net.run_until(50_000_000, || false);
    while let n @ 1.. = ccq.poll(&mut wcs) {
        if let Some(wc) = wcs[..n].iter().find(|w| w.opcode == WcOpcode::RecvRdmaWithImm) {
            return Err(format!("an extra answer after the last get: {wc:?}"));
        }
    }
    drop(server);
    Ok(Outcome::of(&net, trace, completions))
}

#[test]
fn redn_hash_gets_on_the_simulated_network_answer_each_get_once_and_replay_identically() {
    let (completions, _) = run_all(seeds("SIM_REDN_SEEDS", 10_000), run_redn_seed);
    eprintln!("RedN hash get: {completions} client completions");
}

/// A storage handler for the Solar runs: blocks in memory, each write made durable at once
/// (on the server's core), and a count of how often each (lba, content) was applied.
#[derive(Default)]
struct SimStore {
    blocks: Mutex<BTreeMap<u64, (Vec<u8>, u32)>>,
    applied: Mutex<BTreeMap<(u64, u64), u32>>,
}

impl netstack::verbs::solar::StorageHandler for SimStore {
    fn write(&self, b: netstack::verbs::solar::WriteBlock<'_>, done: netstack::verbs::solar::WriteDone) {
        self.blocks.lock().unwrap().insert(b.lba, (b.data.to_vec(), b.crc));
        *self.applied.lock().unwrap().entry((b.lba, fnv(0, b.data))).or_default() += 1;
        done.finish(netstack::transport::solar::wire::Status::Ok);
    }
    fn read(&self, r: netstack::verbs::solar::ReadBlocks, answer: &mut netstack::verbs::solar::ReadAnswer<'_>) {
        let blocks = self.blocks.lock().unwrap();
        for k in 0..r.count {
            match blocks.get(&(r.lba + k as u64)) {
                Some((d, crc)) => answer.block(k, Arc::from(d.as_slice()), 0, *crc),
                None => answer.failed(k, netstack::transport::solar::wire::Status::OutOfRange),
            }
        }
    }
}

/// Solar (the storage transport, sprayed over 1-4 paths) between an agent's context and a
/// storage server's on the simulated network, under the seeded faults and a path cut: every
/// write is acknowledged once and applied once, reads return the last acknowledged data.
fn run_solar_seed(seed: u64) -> Result<Outcome, String> {
    use netstack::transport::solar::client::ClientConfig;
    use netstack::transport::solar::server::SolarServer;
    use netstack::transport::solar::wire::BLOCK;
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5017_a400);
    let mut faults = faults_for(&mut rng);
    faults.mtu = 9000; // Solar sends a whole 4 KiB block per datagram
    let net = SimNet::new(seed, faults);
    let open = |h: u8, path_ports: u8| {
        Context::open_simulated(
            ContextConfig {
                bind: SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, h), 4791),
                path_ports,
                rx_staging_bytes: 256 << 10,
                ..ContextConfig::default()
            },
            &net,
        )
        .map_err(|e| format!("context: {e}"))
    };
    let (sctx, actx) = (open(2, 1)?, open(1, 4)?);
    let store = Arc::new(SimStore::default());
    let service = sctx
        .solar_server(SolarServer::new(), store.clone())
        .map_err(|e| e.to_string())?;
    let paths = rng.random_range(1..=4u16);
    let agent = actx
        .solar_client(
            service.local_addr(),
            ClientConfig {
                paths,
                ..ClientConfig::default()
            },
            None,
        )
        .map_err(|e| e.to_string())?;
    let start = net.now();
    // one path cut for a while, sometimes
    if paths > 1 && rng.random_bool(0.5) {
        // the agent's path p leaves from its core's source port p: the simulated network gives
        // the ports after the main one numbers from 40,000
        let port = rng.random_range(1..paths);
        let cut = SocketAddrV4::new(*actx.local_addr().ip(), 40_000 + port - 1);
        net.cut(cut, rng.random_range(100_000..20_000_000));
    }
    // the model: what an acknowledged write left at each block
    let mut model: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
    let mut trace = 0xcbf2_9ce4_8422_2325u64;
    let ops = rng.random_range(4..24);
    let mut completions = 0u64;
    for i in 0..ops {
        // a few writes in flight at once, on blocks apart, then a read of written blocks
        let mut pending = Vec::new();
        for w in 0..rng.random_range(1..=4u64) {
            let lba = 64 * w + rng.random_range(0..32);
            let n = rng.random_range(1..=8usize);
            let mut data = vec![0u8; n * BLOCK];
            rng.fill(&mut data[..]);
            let rx = agent.write(1, lba, Arc::from(data.as_slice()), rng.random_bool(0.5));
            pending.push((lba, data, rx));
        }
        let mut steps = 0u64;
        while !pending.is_empty() {
            steps += 1;
            if steps > MAX_STEPS || net.now() - start > BOUND_NS {
                return Err(format!("round {i}: writes unanswered; network {:?}", net.stats()));
            }
            let more = net.step();
            let mut k = 0;
            while k < pending.len() {
                match pending[k].2.try_recv() {
                    Ok(r) => {
                        r.map_err(|e| format!("round {i}: write at {} failed: {e:?}", pending[k].0))?;
                        let (lba, data, _) = pending.swap_remove(k);
                        completions += 1;
                        trace = fnv(fnv(trace, &net.now().to_le_bytes()), &lba.to_le_bytes());
                        for (b, chunk) in data.chunks(BLOCK).enumerate() {
                            model.insert(lba + b as u64, chunk.to_vec());
                        }
                    }
                    Err(tokio::sync::oneshot::error::TryRecvError::Empty) => k += 1,
                    Err(e) => return Err(format!("round {i}: write answer lost: {e}")),
                }
            }
            if !more && !pending.is_empty() {
                return Err(format!("round {i}: the simulation stopped with writes unanswered"));
            }
        }
        // read back a run of written blocks
        let (&first, _) = model.iter().nth(rng.random_range(0..model.len())).expect("written");
        let mut n = 1u16;
        while n < 16 && model.contains_key(&(first + n as u64)) {
            n += 1;
        }
        let mut rx = agent.read(1, first, n);
        let mut steps = 0u64;
        let got = loop {
            steps += 1;
            if steps > MAX_STEPS {
                return Err(format!("round {i}: read unanswered"));
            }
            let more = net.step();
            match rx.try_recv() {
                Ok(r) => break r.map_err(|e| format!("round {i}: read of {n} at {first} failed: {e:?}"))?,
                Err(tokio::sync::oneshot::error::TryRecvError::Empty) if more => {}
                Err(e) => return Err(format!("round {i}: read unanswered ({e})")),
            }
        };
        completions += 1;
        trace = fnv(fnv(trace, &net.now().to_le_bytes()), &got);
        for b in 0..n as u64 {
            let at = b as usize * BLOCK;
            if got[at..at + BLOCK] != model[&(first + b)][..] {
                return Err(format!(
                    "round {i}: block {} read back other data than was acknowledged",
                    first + b
                ));
            }
        }
    }
    if let Some(((lba, _), n)) = store.applied.lock().unwrap().iter().find(|(_, &n)| n != 1) {
        return Err(format!("a write of block {lba} was applied {n} times"));
    }
    drop(agent);
    Ok(Outcome::of(&net, trace, completions))
}

#[test]
fn solar_on_the_simulated_network_acknowledges_and_applies_each_write_once() {
    let seeds = seeds("SIM_SOLAR_SEEDS", 10_000);
    let n = seeds.end - seeds.start;
    let (completions, net) = run_all(seeds, run_solar_seed);
    let (lost, blocked) = (net.lost, net.blocked);
    eprintln!("Solar: {completions} writes and reads; {lost} datagrams lost, {blocked} on cut paths");
    if n >= 100 {
        assert!(lost > 0 && blocked > 0, "faults were not injected");
    }
}

/// Two simulated hosts, 10.0.0.1 and 10.0.0.2 (port 4791), with `ports` source ports each,
/// and a connected QP on each (the first with `paths` paths); each with 1 MiB of memory.
struct SimPair {
    net: Arc<SimNet>,
    ctx: [Context; 2],
    cq: Cq,
    qp: Qp,
    mr: [Mr; 2],
    _peer: Qp,
}

/// A [`SimPair`] with selective repeat on a fault-free network, for the cuts.
fn cut_pair(seed: u64, ports: [u8; 2], paths: usize) -> SimPair {
    let faults = Faults {
        delay_ns: 10_000,
        ..Faults::default()
    };
    sim_pair(seed, ports, paths, Recovery::SelectiveRepeat, faults)
}

fn sim_pair(seed: u64, ports: [u8; 2], paths: usize, recovery: Recovery, faults: Faults) -> SimPair {
    let net = SimNet::new(seed, faults);
    let open = |h: u8| {
        Context::open_simulated(
            ContextConfig {
                bind: SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, h), 4791),
                path_ports: ports[h as usize - 1],
                qp: RcConfig {
                    recovery,
                    ..RcConfig::default()
                },
                ..ContextConfig::default()
            },
            &net,
        )
        .expect("simulated context")
    };
    let (a, b) = (open(1), open(2));
    let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
    let (ca, cb) = (a.create_cq(64).unwrap(), b.create_cq(64).unwrap());
    let mr = [
        pa.reg_mr(1 << 20, Access::ALL).unwrap(),
        pb.reg_mr(1 << 20, Access::ALL).unwrap(),
    ];
    let qa = a.create_qp(&pa, &ca, &ca, QpInitAttr::default()).unwrap();
    let qb = b.create_qp(&pb, &cb, &cb, QpInitAttr::default()).unwrap();
    if paths > 1 {
        qa.set_paths(paths, SprayPolicy::RoundRobin).unwrap();
    }
    qa.connect(&qb.local_endpoint()).unwrap();
    qb.connect(&qa.local_endpoint()).unwrap();
    SimPair {
        net,
        ctx: [a, b],
        cq: ca,
        qp: qa,
        mr,
        _peer: qb,
    }
}

impl SimPair {
    /// Posts `n` WRITEs of 4 KiB of fresh bytes from the first host to the second and steps
    /// the network until they complete, each successfully, within `limit_ns` of `start`;
    /// checks the bytes at the target.
    fn writes_done_within(&self, n: usize, start: u64, limit_ns: u64, what: &str) {
        let mut rng = StdRng::seed_from_u64(n as u64);
        let mut data = vec![0u8; n * 4096];
        rng.fill(&mut data[..]);
        self.mr[0].write(0, &data);
        for i in 0..n {
            let wr = SendWr::new(i as u64, WrOpcode::RdmaWrite)
                .sge(self.mr[0].sge(i * 4096, 4096))
                .remote(self.mr[1].addr() + (i * 4096) as u64, self.mr[1].rkey());
            self.qp.post_send(wr).unwrap();
        }
        let mut wcs = [EMPTY_WC; 16];
        let mut done = 0;
        while done < n {
            assert!(
                self.net.now() - start < limit_ns,
                "{done} of {n} WRITEs done {} ms into {what}: {:?}",
                limit_ns / 1_000_000,
                self.qp.path_stats()
            );
            self.net.step();
            let k = self.cq.poll(&mut wcs);
            for wc in &wcs[..k] {
                assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
                done += 1;
            }
        }
        let mut got = vec![0u8; n * 4096];
        self.mr[1].read(0, &mut got);
        assert!(got == data, "every WRITE's bytes at the target");
        eprintln!(
            "done {} us into {what}: {:?}",
            (self.net.now() - start) / 1000,
            self.qp.path_stats()
        );
    }
}

/// ECMP hashes the two directions of a flow apart: here only the way back fails (every
/// datagram the responder's main port sends is dropped for a second), so the requests arrive
/// and every ACK is lost. The requester's timeout moves its one path to a spare port; the
/// responder answers a request from the peer's spare port `k` from its own port `k`, a fresh
/// hash back, and the WRITEs complete long before the cut ends.
#[test]
fn a_qp_whose_way_back_is_cut_gets_its_answers_on_the_port_it_moved_to() {
    let p = cut_pair(12, [4, 4], 1);
    let start = p.net.now();
    p.net
        .cut(SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 2), 4791), 1_000_000_000);
    p.writes_done_within(8, start, 200_000_000, "a 1 s cut of the way back");
    let st = p.qp.path_stats();
    assert!(st[0].port >= 1 && st[0].repaths >= 1, "the path left its port: {st:?}");
}

/// ECMP may hash every path of a sprayed RC QP onto the link that fails: here every source
/// port its two paths start on is cut (host 1's main port and its first extra port) for a
/// second. None delivers, so none can go down; the retransmission timeouts move the paths to
/// the context's spare ports (a fresh hash), and the WRITEs complete long before the cut ends.
#[test]
fn a_sprayed_qp_whose_every_starting_port_is_cut_moves_to_spare_ports() {
    let p = cut_pair(11, [4, 1], 2);
    let start = p.net.now();
    p.net
        .cut(SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 1), 4791), 1_000_000_000);
    p.net
        .cut(SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 1), 40_000), 1_000_000_000);
    p.writes_done_within(16, start, 200_000_000, "a 1 s cut");
    let st = p.qp.path_stats();
    assert!(
        st.iter().all(|p| p.port >= 2) && st.iter().map(|p| p.repaths).sum::<u32>() >= 2,
        "both paths left their cut ports: {st:?}"
    );
}

/// The payload of the next expected packet of a WRITE in progress is copied into the WRITE's
/// checked range in the pass that verifies its ICRC, so a corrupt one lands there before it is
/// found out. Here 5 % of datagrams have a bit flipped (go-back-N, 1 KiB MTU, 16 KiB WRITEs with
/// never-written guard bytes between their ranges): every WRITE completes with its bytes, the
/// corrupt packets were dropped, most payload went through the fused copy, and no byte outside
/// a WRITE's range changed.
#[test]
fn writes_placed_in_the_icrc_pass_survive_corruption_and_touch_nothing_outside_their_range() {
    let faults = Faults {
        corrupt: 0.05,
        delay_ns: 10_000,
        ..Faults::default()
    };
    let p = sim_pair(5, [1, 1], 1, Recovery::GoBackN, faults);
    const LEN: usize = 16 << 10;
    const STRIDE: usize = 20 << 10;
    let n = (1 << 20) / STRIDE;
    let mut rng = StdRng::seed_from_u64(5);
    let mut data = vec![0u8; n * LEN];
    rng.fill(&mut data[..]);
    p.mr[0].write(0, &data);
    let guard = vec![0xA5u8; 1 << 20];
    p.mr[1].write(0, &guard);
    for i in 0..n {
        let wr = SendWr::new(i as u64, WrOpcode::RdmaWrite)
            .sge(p.mr[0].sge(i * LEN, LEN))
            .remote(p.mr[1].addr() + (i * STRIDE) as u64, p.mr[1].rkey());
        p.qp.post_send(wr).unwrap();
    }
    let mut wcs = [EMPTY_WC; 16];
    let mut done = 0;
    let start = p.net.now();
    while done < n {
        assert!(
            p.net.now() - start < 10_000_000_000,
            "{done} of {n} WRITEs done in 10 s"
        );
        p.net.step();
        let k = p.cq.poll(&mut wcs);
        for wc in &wcs[..k] {
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
            // at its completion a WRITE's bytes are in place
            let i = wc.wr_id as usize;
            let mut got = vec![0u8; LEN];
            p.mr[1].read(i * STRIDE, &mut got);
            assert!(
                got == data[i * LEN..(i + 1) * LEN],
                "WRITE {i}'s bytes at its completion"
            );
            done += 1;
        }
    }
    let mut after = vec![0u8; 1 << 20];
    p.mr[1].read(0, &mut after);
    for (i, b) in after.iter().enumerate() {
        if i % STRIDE >= LEN || i / STRIDE >= n {
            assert_eq!(*b, 0xA5, "byte {i}, outside every WRITE's range, changed");
        }
    }
    let st = p.ctx[1].stats();
    eprintln!(
        "{n} WRITEs: {} corrupt datagrams dropped by the responder, {} of {} payload bytes placed in the ICRC pass",
        st.rx_bad_icrc, st.rx_fused_copy_bytes, st.rx_payload_copy_bytes
    );
    assert!(st.rx_bad_icrc > 0, "corruption was injected: {st:?}");
    assert!(
        st.rx_fused_copy_bytes * 2 > st.rx_payload_copy_bytes,
        "most payload was placed in the ICRC's pass: {st:?}"
    );
}
