//! Deterministic simulation of two RC QPs over a lossy, reordering, duplicating, corrupting link:
//! the stack's simulated network (`link::sim::SimNet`), which the test drives itself.
//!
//! Every scenario is a seed. `SIM_SEED=N cargo test -p netstack --test sim_rc` replays one seed
//! (with `SIM_TRACE=1` it prints each packet); `SIM_SCENARIOS=N` changes how many run.

use netstack::cc::CcKind;
use netstack::link::sim::{Faults, SimLink, SimNet};
use netstack::mem::{Access, MrTable, Region};
use netstack::transport::rc::{QpState, RcConfig, RcQp, Recovery};
use netstack::wire::PacketView;
use netstack::work::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::net::SocketAddrV4;
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq)]
struct LinkCfg {
    loss: f64,
    reorder: f64,
    dup: f64,
    corrupt: f64,
    delay_ns: u64,
    jitter_ns: u64,
    gap_ns: u64,
}

impl LinkCfg {
    /// The network's faults for this link. Reordering is a random extra delay on every
    /// datagram, with the mean of the `reorder` share delayed by up to 4 delays.
    fn faults(&self) -> Faults {
        let reorder_ns = (4.0 * self.delay_ns as f64 * self.reorder) as u64;
        Faults {
            loss: self.loss,
            duplicate: self.dup,
            corrupt: self.corrupt,
            delay_ns: self.delay_ns,
            jitter_ns: self.jitter_ns.max(reorder_ns),
            rate_bps: 0,
            ecn_mark_ns: 0,
            ..Faults::default()
        }
    }

    /// A link that loses, reorders, duplicates and corrupts nothing (reordering only through
    /// `jitter_ns`).
    fn clean(delay_ns: u64, jitter_ns: u64, gap_ns: u64) -> LinkCfg {
        LinkCfg {
            loss: 0.0,
            reorder: 0.0,
            dup: 0.0,
            corrupt: 0.0,
            delay_ns,
            jitter_ns,
            gap_ns,
        }
    }
}

struct Node {
    qp: RcQp,
    mrs: MrTable,
    addr: SocketAddrV4,
    next_free: u64,
    dead: bool,
    /// Each region with its rkey and its lkey.
    mr: HashMap<&'static str, (Arc<Region>, u32, u32)>,
}

impl Node {
    fn new(qpn: u32, addr: &str, cfg: RcConfig, key_seed: u64) -> Node {
        let mut qp = RcQp::new(qpn, 1, cfg);
        qp.modify_to_init().unwrap();
        Node {
            qp,
            mrs: MrTable::seeded(key_seed),
            addr: addr.parse().unwrap(),
            next_free: 0,
            dead: false,
            mr: HashMap::new(),
        }
    }
    fn reg(&mut self, name: &'static str, len: usize, rng: &mut StdRng) {
        let r = Arc::new(Region::alloc(len));
        let mut data = vec![0u8; len];
        rng.fill(&mut data[..]);
        r.write(0, &data);
        let e = self.mrs.register(r.clone(), 1, Access::ALL).unwrap();
        self.mr.insert(name, (r, e.rkey, e.lkey));
    }
    fn sge(&self, name: &str, off: usize, len: usize) -> Sge {
        let (r, _, lkey) = &self.mr[name];
        Sge {
            addr: r.addr() + off as u64,
            length: len as u32,
            lkey: *lkey,
        }
    }
    fn bytes(&self, name: &str, off: usize, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.mr[name].0.read(off, &mut v);
        v
    }
}

/// What the requester side expects of one work request.
#[derive(Debug, Clone)]
enum Expect {
    Write {
        dst_off: usize,
        src_off: usize,
        len: usize,
    },
    WriteImm {
        dst_off: usize,
        src_off: usize,
        len: usize,
        imm: u32,
    },
    Send {
        src_off: usize,
        len: usize,
        recv_off: usize,
    },
    Read {
        src_off: usize,
        dst_off: usize,
        len: usize,
    },
    Faa {
        add: u64,
    },
    Cas,
}

struct Scenario {
    rng: StdRng,
    /// The link's faults; a test may change them between steps. `applied` is what the
    /// network has.
    link: LinkCfg,
    applied: LinkCfg,
    nodes: [Node; 2],
    net: Arc<SimNet>,
    _ports: SimLink,
    /// Time since the scenario started (the network's clock less [`BASE`]).
    now: u64,
    trace: bool,
    delivered: u64,
    corrupted_dropped: u64,
    /// Bytes each node put on the link (headers, payload, pad, ICRC).
    sent_bytes: [u64; 2],
    /// Mark ECN CE on data packets sent by node 0 (a congested queue on the path to node 1).
    mark_ce: bool,
    /// How long before its delivery each packet reached its host (the driver's receive
    /// timestamp; a thread waiting for a core in between).
    host_wait_ns: u64,
}

const MR: usize = 1 << 17;
/// The simulated network's clock when a scenario starts.
const BASE: u64 = 1_000_000_000;

impl Scenario {
    fn new(seed: u64) -> Scenario {
        Scenario::new_with(seed, CcKind::None)
    }

    fn new_with(seed: u64, cc: CcKind) -> Scenario {
        let mut rng = StdRng::seed_from_u64(seed);
        let mtu = [256, 1024, 4096][rng.random_range(0..3)];
        let recovery = if rng.random_bool(0.5) {
            Recovery::GoBackN
        } else {
            Recovery::SelectiveRepeat
        };
        let cfg = RcConfig {
            mtu,
            recovery,
            timeout_ns: 200_000,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 1,
            window_pkts: rng.random_range(4..128),
            ack_every: rng.random_range(1..16),
            ack_delay_ns: 5_000,
            cc,
            ..RcConfig::default()
        };
        let lossy = rng.random_bool(0.8);
        let link = LinkCfg {
            loss: if lossy { rng.random_range(0.0..0.10) } else { 0.0 },
            reorder: if lossy { rng.random_range(0.0..0.2) } else { 0.0 },
            dup: if lossy { rng.random_range(0.0..0.05) } else { 0.0 },
            corrupt: if lossy { rng.random_range(0.0..0.05) } else { 0.0 },
            delay_ns: rng.random_range(1_000..20_000),
            jitter_ns: rng.random_range(0..5_000),
            gap_ns: rng.random_range(100..2_000),
        };
        // keys from the seed, as a simulated context's: the scenario replays
        let mut a = Node::new(0x11, "10.0.0.1:4791", cfg, seed ^ 0xA);
        let mut b = Node::new(0x22, "10.0.0.2:4791", cfg, seed ^ 0xB);
        let (pa, pb) = (rng.random_range(0..1 << 24), rng.random_range(0..1 << 24));
        a.qp.modify_to_rtr(0x22, pb, cfg).unwrap();
        b.qp.modify_to_rtr(0x11, pa, cfg).unwrap();
        a.qp.modify_to_rts(pa).unwrap();
        b.qp.modify_to_rts(pb).unwrap();
        for n in [&mut a, &mut b] {
            n.reg("src", MR, &mut rng);
            n.reg("dst", MR, &mut rng);
            n.reg("recv", MR, &mut rng);
            n.reg("atomic", 64, &mut rng);
        }
        for n in [&mut a, &mut b] {
            n.mr["atomic"].0.fill(0, 64, 0);
        }
        let net = SimNet::new(rng.random(), link.faults());
        assert_eq!(net.now(), BASE);
        let ports = net.link(&[a.addr, b.addr]).expect("free simulated addresses");
        Scenario {
            rng,
            link,
            applied: link,
            nodes: [a, b],
            net,
            _ports: ports,
            now: 0,
            trace: std::env::var("SIM_TRACE").is_ok(),
            delivered: 0,
            corrupted_dropped: 0,
            sent_bytes: [0; 2],
            mark_ce: false,
            host_wait_ns: 0,
        }
    }

    /// Generates a random workload from node `s` to node `1-s`; returns its record: each WR's
    /// id, whether it was posted signaled, and what it must do.
    fn workload(&mut self, s: usize, n: usize) -> Vec<(u64, bool, Expect)> {
        let d = 1 - s;
        let mut out = Vec::new();
        let (mut dst_cur, mut recv_cur, mut rd_cur) = (0usize, 0usize, 0usize);
        let mut cas_n = 0u64;
        for i in 0..n {
            let wr_id = (s as u64) << 32 | i as u64;
            let kind = self.rng.random_range(0..7);
            let len = match self.rng.random_range(0..4) {
                0 => 0,
                1 => self.rng.random_range(1..64),
                2 => self.rng.random_range(64..4096),
                _ => self.rng.random_range(4096..12_000),
            };
            if dst_cur + len > MR / 2 || recv_cur + len > MR || rd_cur + len > MR / 2 {
                break;
            }
            let src_off = self.rng.random_range(0..MR - len.max(1));
            let signaled = self.rng.random_bool(0.7) || kind >= 4;
            let flags = if signaled { SendFlags::SIGNALED } else { SendFlags(0) };
            let fence = if self.rng.random_bool(0.1) {
                SendFlags::FENCE
            } else {
                SendFlags(0)
            };
            let (wr, exp) = match kind {
                0 | 1 => {
                    let (rr, rk) = (self.nodes[d].mr["dst"].0.addr(), self.nodes[d].mr["dst"].1);
                    let mut wr = SendWr::new(wr_id, WrOpcode::RdmaWrite)
                        .remote(rr + dst_cur as u64, rk)
                        .flags(flags | fence);
                    if len > 0 {
                        wr = wr.sge(self.nodes[s].sge("src", src_off, len));
                    }
                    let e = Expect::Write {
                        dst_off: dst_cur,
                        src_off,
                        len,
                    };
                    dst_cur += len;
                    (wr, e)
                }
                2 => {
                    let (rr, rk) = (self.nodes[d].mr["dst"].0.addr(), self.nodes[d].mr["dst"].1);
                    let imm = self.rng.random();
                    let mut wr = SendWr::new(wr_id, WrOpcode::RdmaWriteWithImm)
                        .remote(rr + dst_cur as u64, rk)
                        .imm(imm)
                        .flags(flags);
                    if len > 0 {
                        wr = wr.sge(self.nodes[s].sge("src", src_off, len));
                    }
                    let e = Expect::WriteImm {
                        dst_off: dst_cur,
                        src_off,
                        len,
                        imm,
                    };
                    dst_cur += len;
                    (wr, e)
                }
                3 => {
                    // split the SEND over two SGEs sometimes
                    let mut wr = SendWr::new(wr_id, WrOpcode::Send).flags(flags | fence);
                    if len > 1 && self.rng.random_bool(0.3) {
                        let h = len / 2;
                        wr = wr.sge(self.nodes[s].sge("src", src_off, h)).sge(self.nodes[s].sge(
                            "src",
                            src_off + h,
                            len - h,
                        ));
                    } else if len > 0 {
                        wr = wr.sge(self.nodes[s].sge("src", src_off, len));
                    }
                    let e = Expect::Send {
                        src_off,
                        len,
                        recv_off: recv_cur,
                    };
                    recv_cur += len;
                    (wr, e)
                }
                4 | 5 => {
                    let (rr, rk) = (self.nodes[d].mr["src"].0.addr(), self.nodes[d].mr["src"].1);
                    let mut wr = SendWr::new(wr_id, WrOpcode::RdmaRead)
                        .remote(rr + src_off as u64, rk)
                        .flags(flags | fence);
                    if len > 0 {
                        wr = wr.sge(self.nodes[s].sge("dst", MR / 2 + rd_cur, len));
                    }
                    let e = Expect::Read {
                        src_off,
                        dst_off: MR / 2 + rd_cur,
                        len,
                    };
                    rd_cur += len;
                    (wr, e)
                }
                _ => {
                    let (rr, rk) = (self.nodes[d].mr["atomic"].0.addr(), self.nodes[d].mr["atomic"].1);
                    let res = self.nodes[s].sge("atomic", 16 + 8 * (i % 4), 8);
                    if self.rng.random_bool(0.5) {
                        let add = self.rng.random_range(1..1000);
                        (
                            SendWr::new(wr_id, WrOpcode::AtomicFetchAndAdd)
                                .remote(rr, rk)
                                .atomic(add, 0)
                                .sge(res)
                                .flags(flags),
                            Expect::Faa { add },
                        )
                    } else {
                        let w = SendWr::new(wr_id, WrOpcode::AtomicCmpAndSwp)
                            .remote(rr + 8, rk)
                            .atomic(cas_n, cas_n + 1)
                            .sge(res)
                            .flags(flags);
                        cas_n += 1;
                        (w, Expect::Cas)
                    }
                }
            };
            if let Expect::Send { len, recv_off, .. }
            | Expect::WriteImm {
                len, dst_off: recv_off, ..
            } = exp
            {
                // post a receive for every message that consumes one (WRITE_IMM needs no buffer)
                let sg = if matches!(exp, Expect::Send { .. }) && len > 0 {
                    [self.nodes[d].sge("recv", recv_off, len)].into_iter().collect()
                } else {
                    SgList::new()
                };
                self.nodes[d]
                    .qp
                    .post_recv(RecvWr {
                        wr_id: wr_id | 1 << 40,
                        sg_list: sg,
                    })
                    .unwrap();
            }
            let node = &mut self.nodes[s];
            node.qp.post_send(wr, &node.mrs).unwrap();
            out.push((wr_id, signaled, exp));
        }
        out
    }

    fn send_from(&mut self, i: usize) {
        // the test may have changed the link since the last step
        if self.link != self.applied {
            self.applied = self.link;
            self.net.set_faults(self.link.faults());
        }
        loop {
            let n = &mut self.nodes[i];
            if n.dead || n.next_free > self.now {
                return;
            }
            let Some(p) = n.qp.poll_transmit(self.now) else {
                return;
            };
            let mut bytes = Vec::new();
            p.encode(n.addr, self.nodes[1 - i].addr, &mut bytes);
            self.sent_bytes[i] += bytes.len() as u64;
            self.nodes[i].next_free = self.now + self.link.gap_ns;
            if self.trace {
                let v = PacketView::parse(&bytes).unwrap();
                eprintln!(
                    "t={} {}->{} {:?} psn={} ack_req={} len={} aeth={:?}",
                    self.now,
                    i,
                    1 - i,
                    v.opcode,
                    v.bth.psn,
                    v.bth.ack_req,
                    v.payload.len(),
                    v.aeth.map(|a| a.syndrome)
                );
            }
            self.net.send(self.nodes[i].addr, self.nodes[1 - i].addr, bytes);
        }
    }

    fn deliver(&mut self, to: usize, bytes: &[u8]) {
        let from = self.nodes[1 - to].addr;
        let n = &mut self.nodes[to];
        if n.dead {
            return;
        }
        let Ok(v) = PacketView::parse(bytes) else {
            self.corrupted_dropped += 1;
            return;
        };
        if PacketView::verify_icrc(bytes, from, n.addr).is_err() || v.bth.dest_qp != n.qp.qpn() {
            self.corrupted_dropped += 1;
            return;
        }
        self.delivered += 1;
        // a congested queue on the path to node 1 marks node 0's data packets
        let ce = self.mark_ce && to == 1 && !v.payload.is_empty();
        let arrived = self.now.saturating_sub(self.host_wait_ns);
        n.qp.handle_received(self.now, arrived, &v, ce, &n.mrs, false);
    }

    /// Runs until both QPs are idle or `limit` ns of simulated time pass.
    fn run(&mut self, limit: u64, mut on_step: impl FnMut(&mut Scenario)) {
        while self.now < limit {
            for to in 0..2 {
                while let Some((_, b)) = self.net.recv(self.nodes[to].addr) {
                    self.deliver(to, &b);
                }
            }
            for i in 0..2 {
                if !self.nodes[i].dead {
                    self.nodes[i].qp.handle_timeout(self.now);
                }
                self.send_from(i);
            }
            on_step(self);
            // next event
            let mut next = u64::MAX;
            if let Some(t) = self.net.next_arrival() {
                next = next.min(t - BASE);
            }
            for n in &self.nodes {
                if n.dead {
                    continue;
                }
                if let Some(t) = n.qp.poll_timeout() {
                    next = next.min(t);
                }
                if n.qp.wants_transmit(self.now) {
                    next = next.min(n.next_free.max(self.now + 1));
                }
            }
            if next == u64::MAX {
                return;
            }
            self.now = next.max(self.now + 1);
            self.net.advance(BASE + self.now);
        }
    }
}

fn check_scenario(seed: u64) -> Result<(), String> {
    let mut sc = Scenario::new(seed);
    let n_ops = sc.rng.random_range(1..24);
    let exp_a = sc.workload(0, n_ops);
    let n_ops_b = sc.rng.random_range(0..8);
    let exp_b = sc.workload(1, n_ops_b);
    let mut wcs: [Vec<Wc>; 2] = [Vec::new(), Vec::new()];
    sc.run(60_000_000_000, |sc| {
        for (i, w) in wcs.iter_mut().enumerate() {
            while let Some(c) = sc.nodes[i].qp.poll_completion() {
                w.push(c);
            }
        }
    });
    let ctx = format!("seed {seed} link {:?} cfg {:?}", sc.link, sc.nodes[0].qp.config());
    for (s, exp) in [(0usize, &exp_a), (1, &exp_b)] {
        let d = 1 - s;
        let send_wcs: Vec<&Wc> = wcs[s]
            .iter()
            .filter(|w| w.opcode != WcOpcode::Recv && w.opcode != WcOpcode::RecvRdmaWithImm)
            .collect();
        let recv_wcs: Vec<&Wc> = wcs[d]
            .iter()
            .filter(|w| w.opcode == WcOpcode::Recv || w.opcode == WcOpcode::RecvRdmaWithImm)
            .collect();
        // exactly once, in order, success (unsignaled ones produce nothing)
        let mut it = send_wcs.iter();
        let mut faa_sum = 0u64;
        let mut recv_i = 0;
        for (wr_id, signaled, e) in exp.iter() {
            // the workload's own record says which WRs were signaled: a lost completion fails
            if *signaled {
                let w = it
                    .next()
                    .ok_or_else(|| format!("{ctx}: missing completion for {wr_id:#x} ({e:?})"))?;
                if w.wr_id != *wr_id {
                    return Err(format!("{ctx}: completion order: got {:#x}, want {wr_id:#x}", w.wr_id));
                }
                if w.status != WcStatus::Success {
                    return Err(format!("{ctx}: {wr_id:#x} status {:?}", w.status));
                }
            }
            match e {
                Expect::Write { dst_off, src_off, len } => {
                    if sc.nodes[d].bytes("dst", *dst_off, *len) != sc.nodes[s].bytes("src", *src_off, *len) {
                        return Err(format!("{ctx}: WRITE {wr_id:#x} data mismatch"));
                    }
                }
                Expect::WriteImm {
                    dst_off,
                    src_off,
                    len,
                    imm,
                } => {
                    if sc.nodes[d].bytes("dst", *dst_off, *len) != sc.nodes[s].bytes("src", *src_off, *len) {
                        return Err(format!("{ctx}: WRITE_IMM {wr_id:#x} data mismatch"));
                    }
                    let r = recv_wcs.get(recv_i).ok_or(format!("{ctx}: missing recv completion"))?;
                    recv_i += 1;
                    if r.imm_data != Some(*imm) || r.byte_len as usize != *len || r.opcode != WcOpcode::RecvRdmaWithImm
                    {
                        return Err(format!("{ctx}: WRITE_IMM recv completion {r:?}"));
                    }
                }
                Expect::Send { src_off, len, recv_off } => {
                    let r = recv_wcs.get(recv_i).ok_or(format!("{ctx}: missing recv completion"))?;
                    recv_i += 1;
                    if r.status != WcStatus::Success || r.byte_len as usize != *len || r.opcode != WcOpcode::Recv {
                        return Err(format!("{ctx}: SEND recv completion {r:?}"));
                    }
                    if sc.nodes[d].bytes("recv", *recv_off, *len) != sc.nodes[s].bytes("src", *src_off, *len) {
                        return Err(format!("{ctx}: SEND {wr_id:#x} data mismatch"));
                    }
                }
                Expect::Read { src_off, dst_off, len } => {
                    if sc.nodes[s].bytes("dst", *dst_off, *len) != sc.nodes[d].bytes("src", *src_off, *len) {
                        return Err(format!("{ctx}: READ {wr_id:#x} data mismatch"));
                    }
                }
                Expect::Faa { add } => faa_sum += add,
                Expect::Cas => {}
            }
        }
        if let Some(w) = it.next() {
            return Err(format!("{ctx}: extra completion {w:?}"));
        }
        if recv_i != recv_wcs.len() {
            return Err(format!("{ctx}: {} recv completions, expected {recv_i}", recv_wcs.len()));
        }
        // atomics executed exactly once
        let fa = sc.nodes[d].mr["atomic"].0.load_u64(0).unwrap();
        if fa != faa_sum {
            return Err(format!(
                "{ctx}: FETCH_ADD total {fa}, expected {faa_sum} (an atomic ran twice or never)"
            ));
        }
        let cas_n = exp.iter().filter(|(_, _, e)| matches!(e, Expect::Cas)).count() as u64;
        let cv = sc.nodes[d].mr["atomic"].0.load_u64(8).unwrap();
        if cv != cas_n {
            return Err(format!("{ctx}: CAS chain reached {cv}, expected {cas_n}"));
        }
    }
    for n in &sc.nodes {
        if n.qp.state() != QpState::Rts {
            let errs: Vec<_> = wcs
                .iter()
                .flatten()
                .filter(|w| w.status != WcStatus::Success)
                .take(3)
                .collect();
            return Err(format!(
                "{ctx}: QP {:#x} ended in {:?}; first errors {errs:?}",
                n.qp.qpn(),
                n.qp.state()
            ));
        }
    }
    Ok(())
}

fn seeds() -> Vec<u64> {
    if let Ok(s) = std::env::var("SIM_SEED") {
        return vec![s.parse().expect("SIM_SEED is a number")];
    }
    let n: u64 = std::env::var("SIM_SCENARIOS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    (0..n).collect()
}

#[test]
fn seeded_scenarios_complete_exactly_once_with_right_data() {
    let mut failures = Vec::new();
    let seeds = seeds();
    for &seed in &seeds {
        if let Err(e) = check_scenario(seed) {
            failures.push(e);
        }
    }
    if !failures.is_empty() {
        panic!(
            "{} of {} scenarios failed; first: {}\n(replay: SIM_SEED=<seed> SIM_TRACE=1)",
            failures.len(),
            seeds.len(),
            failures[0]
        );
    }
    eprintln!("{} scenarios passed", seeds.len());
}

#[test]
fn vanished_peer_ends_in_retry_exc_err_within_bound() {
    for seed in 0..200u64 {
        let mut sc = Scenario::new(seed);
        let n_ops = 4;
        let exp = sc.workload(0, n_ops);
        let kill_at = sc.rng.random_range(0..200_000);
        let cfg = *sc.nodes[0].qp.config();
        let mut first_err = None;
        let mut wcs = Vec::new();
        sc.run(10_000_000_000, |sc| {
            if sc.now >= kill_at {
                sc.nodes[1].dead = true;
            }
            while let Some(c) = sc.nodes[0].qp.poll_completion() {
                if c.status != WcStatus::Success && first_err.is_none() {
                    first_err = Some(sc.now);
                }
                wcs.push(c);
            }
        });
        if first_err.is_none() {
            // no error: then everything must have finished before the peer vanished. A QP left
            // holding work with no error (hung, never giving up) fails here: every signaled WR
            // of the record completed successfully, in order, and the send queue is empty.
            let want: Vec<u64> = exp.iter().filter(|(_, sig, _)| *sig).map(|(id, _, _)| *id).collect();
            let got: Vec<u64> = wcs.iter().map(|w| w.wr_id).collect();
            assert_eq!(got, want, "seed {seed}: completions without an error");
            assert!(
                sc.nodes[0].qp.send_queue_idle(),
                "seed {seed}: work left and no error: hung"
            );
            assert_eq!(sc.nodes[0].qp.state(), QpState::Rts, "seed {seed}");
            continue;
        }
        let st = sc.nodes[0].qp.state();
        assert_eq!(st, QpState::Err, "seed {seed}: QP should be in ERR");
        let errs: Vec<_> = wcs.iter().filter(|w| w.status != WcStatus::Success).collect();
        assert_eq!(errs[0].status, WcStatus::RetryExcErr, "seed {seed}: {wcs:?}");
        assert!(
            errs[1..].iter().all(|w| w.status == WcStatus::WrFlushErr),
            "seed {seed}: {wcs:?}"
        );
        let t = first_err.unwrap();
        // bound: the retry budget after the last progress (which is at most the kill time plus one RTT)
        let bound = kill_at + cfg.retry_bound_ns() + cfg.timeout_ns + 1_000_000;
        assert!(t <= bound, "seed {seed}: RETRY_EXC_ERR at {t} ns, bound {bound}");
        // every WR completed exactly once
        let mut ids: Vec<u64> = wcs.iter().map(|w| w.wr_id).collect();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), wcs.len(), "seed {seed}: duplicate completions");
    }
}

#[test]
fn rnr_then_recv_posted_completes() {
    // a SEND with no receive posted gets RNR NAKs until the receive appears
    let mut sc = Scenario::new(7);
    sc.link = LinkCfg::clean(1000, 0, 100);
    let sge = sc.nodes[0].sge("src", 0, 100);
    let n = &mut sc.nodes[0];
    n.qp.post_send(SendWr::new(1, WrOpcode::Send).sge(sge), &n.mrs).unwrap();
    let mut posted = false;
    let mut done = None;
    sc.run(1_000_000_000, |sc| {
        if sc.now > 50_000_000 && !posted {
            posted = true;
            let sge = sc.nodes[1].sge("recv", 0, 100);
            sc.nodes[1]
                .qp
                .post_recv(RecvWr {
                    wr_id: 9,
                    sg_list: [sge].into_iter().collect(),
                })
                .unwrap();
        }
        if let Some(c) = sc.nodes[0].qp.poll_completion() {
            done = Some(c);
        }
    });
    let c = done.expect("completion");
    assert_eq!(c.status, WcStatus::Success);
    assert!(sc.nodes[0].qp.stats().rnr_naks_received > 0);
    assert_eq!(sc.nodes[1].qp.poll_completion().unwrap().wr_id, 9);
}

#[test]
fn paced_qp_sends_at_its_rate() {
    // scenarios whose window (packets x MTU) is large enough not to be the limit at 1 GB/s
    let seeds = (0u64..).filter(|&s| {
        let c = *Scenario::new(s).nodes[0].qp.config();
        c.window_pkts as u64 * c.mtu as u64 >= 256 << 10
    });
    for (seed, rate) in seeds.zip([50_000_000u64, 200_000_000, 1_000_000_000]) {
        let mut sc = Scenario::new(seed);
        sc.link = LinkCfg::clean(5_000, 0, 50);
        sc.nodes[0].qp.set_rate(Some(rate), 0);
        let (rr, rk) = (sc.nodes[1].mr["dst"].0.addr(), sc.nodes[1].mr["dst"].1);
        for i in 0..32 {
            let sge = sc.nodes[0].sge("src", 0, 65536);
            let n = &mut sc.nodes[0];
            n.qp.post_send(SendWr::new(i, WrOpcode::RdmaWrite).sge(sge).remote(rr, rk), &n.mrs)
                .unwrap();
        }
        let mut done_at = 0;
        let mut completions = 0;
        sc.run(10_000_000_000, |sc| {
            while sc.nodes[0].qp.poll_completion().is_some() {
                completions += 1;
                done_at = sc.now;
            }
        });
        assert_eq!(completions, 32, "seed {seed}");
        // wire bytes the pacer counted: headers, payload, pad and ICRC of every packet
        let wire = sc.sent_bytes[0];
        let want = wire as f64 * 1e9 / rate as f64;
        // the last packet leaves at `want`, then needs one link delay and an ACK back
        let got = done_at as f64 - 2.0 * sc.link.delay_ns as f64;
        assert!(
            (got - want).abs() / want < 0.02,
            "seed {seed} rate {rate}: finished after {got} ns, expected {want} ns"
        );
    }
}

#[test]
fn a_resend_held_by_the_pacer_spends_no_retries() {
    // congestion control can pace a QP below one packet per retransmission timeout (Swift at
    // its minimum window paces at kilobytes per second): a lost packet's resend then waits for
    // the pacer through several timeouts, and those must not count as unanswered retries
    let mut resent = 0;
    for seed in 0..24u64 {
        let mut sc = Scenario::new(seed);
        sc.link = LinkCfg {
            loss: 0.2,
            ..LinkCfg::clean(5_000, 0, 50)
        };
        // 20 kB/s: a packet every 13 to 205 ms, against a 0.2 ms timeout (16 ms of retries)
        sc.nodes[0].qp.set_rate(Some(20_000), 0);
        let (rr, rk) = (sc.nodes[1].mr["dst"].0.addr(), sc.nodes[1].mr["dst"].1);
        for i in 0..4 {
            let sge = sc.nodes[0].sge("src", 4096 * i as usize, 4096);
            let n = &mut sc.nodes[0];
            let wr = SendWr::new(i, WrOpcode::RdmaWrite).sge(sge).remote(rr + 4096 * i, rk);
            n.qp.post_send(wr, &n.mrs).unwrap();
        }
        let mut wcs = Vec::new();
        sc.run(60_000_000_000, |sc| {
            while let Some(c) = sc.nodes[0].qp.poll_completion() {
                wcs.push(c);
            }
        });
        let st: Vec<WcStatus> = wcs.iter().map(|c| c.status).collect();
        assert_eq!(st, [WcStatus::Success; 4], "seed {seed}");
        assert_eq!(
            sc.nodes[1].bytes("dst", 0, 16384),
            sc.nodes[0].bytes("src", 0, 16384),
            "seed {seed}"
        );
        resent += sc.nodes[0].qp.stats().retransmitted_packets;
    }
    assert!(resent > 0, "the link lost nothing: the test tests nothing");
}

/// Posts `n` unsignaled `len`-byte WRITEs from node 0 to node 1's `dst` region.
fn post_writes(sc: &mut Scenario, n: u64, len: usize) {
    let (rr, rk) = (sc.nodes[1].mr["dst"].0.addr(), sc.nodes[1].mr["dst"].1);
    for i in 0..n {
        let sge = sc.nodes[0].sge("src", 0, len);
        let node = &mut sc.nodes[0];
        let wr = SendWr::new(i, WrOpcode::RdmaWrite)
            .sge(sge)
            .remote(rr, rk)
            .flags(SendFlags(0));
        node.qp.post_send(wr, &node.mrs).unwrap();
    }
}

#[test]
fn dcqcn_slows_a_marked_sender_and_recovers() {
    let mut sc = Scenario::new_with(11, CcKind::Dcqcn);
    sc.link = LinkCfg::clean(2_000, 0, 100);
    let line = netstack::cc::dcqcn::DcqcnParams::default().line_rate;
    let post = |sc: &mut Scenario, n: u64| post_writes(sc, n, 65536);
    // congested: every data packet is marked for 20 ms
    sc.mark_ce = true;
    post(&mut sc, 200);
    sc.run(20_000_000, |_| {});
    let slowed = sc.nodes[0].qp.pacer().rate().expect("DCQCN sets a rate");
    let cnps = sc.nodes[1].qp.stats().cnps_sent;
    assert!(
        slowed < line / 10,
        "rate {slowed} should be far below line rate {line} after 20 ms of marks"
    );
    assert!(
        cnps > 0 && cnps <= 20_000_000 / 50_000 + 1,
        "{cnps} CNPs: at most one per 50 us"
    );
    assert_eq!(sc.nodes[0].qp.stats().cnps_received, cnps);
    // congestion clears: the sender recovers towards line rate
    sc.mark_ce = false;
    post(&mut sc, 2000);
    sc.run(sc.now + 200_000_000, |_| {});
    let recovered = sc.nodes[0].qp.pacer().rate().unwrap();
    assert!(recovered > line / 2, "rate {recovered} should recover towards {line}");
    // a QP without congestion control never sends CNPs, marks or not
    let mut plain = Scenario::new(11);
    plain.mark_ce = true;
    post(&mut plain, 10);
    plain.run(1_000_000_000, |_| {});
    assert_eq!(plain.nodes[1].qp.stats().cnps_sent, 0);
    assert!(plain.nodes[0].qp.pacer().rate().is_none());
}

#[test]
fn timely_follows_the_rtt() {
    let mut sc = Scenario::new_with(12, CcKind::Timely);
    let line = netstack::cc::timely::TimelyParams::default().line_rate;
    let post = |sc: &mut Scenario, n: u64| post_writes(sc, n, 16384);
    // short path: RTT far below T_low, the rate stays at line rate
    sc.link = LinkCfg::clean(2_000, 0, 100);
    post(&mut sc, 50);
    sc.run(50_000_000, |_| {});
    assert_eq!(sc.nodes[0].qp.pacer().rate(), Some(line));
    // queues build: the RTT rises step by step (kept under this scenario's 200 us RTO, so
    // packets are not resent and every ACK gives a sample); positive gradients cut the rate
    let mut slow = line;
    for d in [10_000, 25_000, 40_000, 55_000, 70_000] {
        sc.link.delay_ns = d;
        post(&mut sc, 20);
        sc.run(sc.now + 2_000_000, |sc| {
            slow = slow.min(sc.nodes[0].qp.pacer().rate().unwrap())
        });
    }
    assert!(slow < line / 2, "rate {slow} while the RTT rises");
    // and short again: the rate climbs back (additive, then hyper-active)
    sc.link.delay_ns = 2_000;
    post(&mut sc, 400);
    sc.run(sc.now + 500_000_000, |_| {});
    let back = sc.nodes[0].qp.pacer().rate().unwrap();
    assert!(back > slow, "rate {back} should grow again from {slow}");
    assert!(
        sc.nodes[0].qp.stats().retransmitted_packets == 0,
        "samples came from first transmissions"
    );
}

#[test]
fn selective_repeat_rides_out_reordering_without_spurious_retransmissions() {
    // pure reordering (no loss): every packet's delay varies by up to 2 µs on a 5 µs link, so
    // packets sent 100 ns apart overtake each other, as when they are sprayed over paths of
    // unequal delay. Holes below the highest SACK are resent only once they are older than the
    // RTT plus a reordering window (a quarter RTT), so none is resent.
    let seeds = (0u64..).filter(|&s| Scenario::new(s).nodes[0].qp.config().recovery == Recovery::SelectiveRepeat);
    for seed in seeds.take(3) {
        let mut sc = Scenario::new(seed);
        sc.link = LinkCfg::clean(5_000, 2_000, 100);
        post_writes(&mut sc, 64, 8192);
        sc.run(2_000_000_000, |_| {});
        let (tx, rx) = (sc.nodes[0].qp.stats(), sc.nodes[1].qp.stats());
        assert_eq!(sc.nodes[0].qp.retired_sends(), 64, "seed {seed}: all WRITEs done");
        assert!(rx.out_of_order_packets > 0, "seed {seed}: the link reordered: {rx:?}");
        assert_eq!(tx.retransmitted_packets, 0, "seed {seed}: {tx:?} {rx:?}");
        assert_eq!(rx.duplicate_requests, 0, "seed {seed}: {rx:?}");
    }
}

#[test]
fn a_window_smaller_than_the_losses_still_retransmits() {
    // congestion control shrinks the window to two packets while losses keep the old packets
    // unacknowledged: the holes must still be resent (paced, outside the window), or the QP
    // waits for an ACK that cannot come and ends in RETRY_EXC_ERR
    for recovery in [Recovery::SelectiveRepeat, Recovery::GoBackN] {
        let seed = (0u64..)
            .find(|&s| Scenario::new(s).nodes[0].qp.config().recovery == recovery)
            .unwrap();
        let mut sc = Scenario::new(seed);
        sc.link = LinkCfg {
            loss: 0.05,
            ..LinkCfg::clean(5_000, 0, 100)
        };
        let mtu = sc.nodes[0].qp.config().mtu as u64;
        sc.nodes[0].qp.set_window_bytes(Some(2 * mtu));
        post_writes(&mut sc, 64, 8192);
        sc.run(20_000_000_000, |_| {});
        let tx = sc.nodes[0].qp.stats();
        assert_eq!(sc.nodes[0].qp.retired_sends(), 64, "{recovery:?} seed {seed}: {tx:?}");
        assert!(
            tx.retransmitted_packets > 0,
            "{recovery:?}: the link lost packets: {tx:?}"
        );
        assert!(
            sc.nodes[0].qp.poll_completion().is_none(),
            "{recovery:?}: no error completion"
        );
    }
}

/// A user-written algorithm: counts the events it traces (only the last packet of each WRITE).
#[derive(Debug)]
struct CountLast(Arc<std::sync::atomic::AtomicU64>, Arc<std::sync::atomic::AtomicU64>);

impl netstack::cc::CcAlgorithm for CountLast {
    fn name(&self) -> &'static str {
        "count-last"
    }
    fn traced(&self) -> netstack::cc::Traced {
        use netstack::wire::Opcode;
        netstack::cc::Traced {
            tx_data: true,
            rx_data: true,
            data_opcodes: netstack::cc::OpcodeSet::of(&[Opcode::WriteLast, Opcode::WriteOnly]),
            ..Default::default()
        }
    }
    fn on_start(&mut self, _: u64, _: &netstack::cc::StartInfo, _: &mut netstack::cc::CcOutput) {}
    fn on_tx(&mut self, _: u64, pkt: &netstack::cc::TxMeta, _: &mut netstack::cc::CcOutput) -> netstack::cc::Verdict {
        assert_eq!(pkt.msg_remaining, 0, "only last packets are traced");
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        netstack::cc::Verdict::Send
    }
    fn on_rx(&mut self, _: u64, _: &netstack::cc::RxMeta<'_>, _: &mut netstack::cc::CcOutput) {
        self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

#[test]
fn user_algorithms_see_only_the_opcodes_they_trace() {
    let mut sc = Scenario::new(21);
    sc.link = LinkCfg::clean(2_000, 0, 100);
    let (tx, rx): (Arc<std::sync::atomic::AtomicU64>, Arc<std::sync::atomic::AtomicU64>) = Default::default();
    sc.nodes[0]
        .qp
        .install_cc(Box::new(CountLast(tx.clone(), Arc::default())));
    sc.nodes[1]
        .qp
        .install_cc(Box::new(CountLast(Arc::default(), rx.clone())));
    let mtu = sc.nodes[0].qp.config().mtu as usize;
    post_writes(&mut sc, 20, mtu * 3 + 1); // four packets per WRITE
    sc.run(1_000_000_000, |_| {});
    assert_eq!(sc.nodes[0].qp.retired_sends(), 20);
    let n = |a: &Arc<std::sync::atomic::AtomicU64>| a.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!((n(&tx), n(&rx)), (20, 20), "one TX and one RX event per WRITE");
    assert!(sc.nodes[0].qp.stats().tx_packets >= 80);
}

/// Each ACK's `(now, host_delay_ns)`.
type Reports = Arc<parking_lot::Mutex<Vec<(u64, Option<u64>)>>>;

/// A user-written algorithm that asks for host-delay reports and keeps them.
#[derive(Debug)]
struct HostDelays(Reports);

impl netstack::cc::CcAlgorithm for HostDelays {
    fn name(&self) -> &'static str {
        "host-delays"
    }
    fn traced(&self) -> netstack::cc::Traced {
        netstack::cc::Traced {
            rx_ack: true,
            ..Default::default()
        }
    }
    fn header(&self) -> netstack::cc::HeaderSpec {
        netstack::cc::HeaderSpec {
            host_delay: true,
            ..Default::default()
        }
    }
    fn on_start(&mut self, _: u64, _: &netstack::cc::StartInfo, _: &mut netstack::cc::CcOutput) {}
    fn on_rx(&mut self, now: u64, pkt: &netstack::cc::RxMeta<'_>, _: &mut netstack::cc::CcOutput) {
        assert!(pkt.cc.is_empty(), "the report is taken off the CC header");
        self.0.lock().push((now, pkt.host_delay_ns));
    }
}

#[test]
fn acks_report_the_time_packets_waited_at_the_hosts() {
    for wait in [0, 20_000] {
        let mut sc = Scenario::new(22);
        // 5 us per packet: the 160 packets take about 0.8 ms, most of it after the first waits
        sc.link = LinkCfg::clean(2_000, 0, 5_000);
        sc.host_wait_ns = wait;
        let seen = Reports::default();
        sc.nodes[0].qp.install_cc(Box::new(HostDelays(seen.clone())));
        sc.nodes[1].qp.install_cc(Box::new(HostDelays(Arc::default())));
        let mtu = sc.nodes[0].qp.config().mtu as usize;
        post_writes(&mut sc, 40, mtu * 3 + 1);
        sc.run(1_000_000_000, |_| {});
        assert_eq!(sc.nodes[0].qp.retired_sends(), 40);
        let seen = seen.lock();
        assert!(
            seen.iter().all(|(_, host)| host.is_some()),
            "every ACK carries a report"
        );
        // from when both hosts had been up for `wait` on: the responder's wait (the packet's,
        // then its ACK coalescing: the scenario's 5 us ACK delay, a few steps) plus the
        // requester's
        let late: Vec<u64> = seen
            .iter()
            .filter(|(now, _)| *now > 3 * wait)
            .filter_map(|(_, h)| *h)
            .collect();
        assert!(late.len() >= 10, "{seen:?}");
        for host in late {
            assert!(
                host >= 2 * wait && host < 2 * wait + 50_000,
                "wait {wait}: host delay {host}"
            );
        }
    }
}

/// An offload sink that finishes jobs later (from the test loop), like offload threads, and
/// counts how many times each request reached it.
#[derive(Default)]
struct LateSink {
    jobs: parking_lot::Mutex<Vec<Arc<netstack::transport::rc::offload::OffloadJob>>>,
    runs: std::sync::atomic::AtomicU64,
}

impl netstack::transport::rc::offload::OffloadSink for LateSink {
    fn submit(
        &self,
        job: Arc<netstack::transport::rc::offload::OffloadJob>,
    ) -> Option<netstack::transport::rc::offload::Outcome> {
        self.runs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.jobs.lock().push(job);
        None
    }
    fn budget_ns(&self, _: u32, _: u16) -> u64 {
        1 << 40
    }
}

#[test]
fn offloads_over_a_lossy_link_run_once_and_complete_once() {
    use netstack::transport::rc::offload::{OffloadStatus, Outcome};
    for seed in seeds().into_iter().take(24) {
        let mut sc = Scenario::new(seed);
        sc.link.loss = sc.link.loss.max(0.03);
        let sink = Arc::new(LateSink::default());
        sc.nodes[1].qp.set_offload_sink(sink.clone());
        let n = 40u64;
        let mtu = sc.nodes[0].qp.config().mtu as usize;
        let mut rng0 = StdRng::seed_from_u64(seed);
        sc.nodes[0].reg("off", n as usize * 16384, &mut rng0);
        for i in 0..n {
            // the response is the request repeated to fill `len` (some responses span packets)
            let len = 1 + (i as usize * 397) % (3 * mtu);
            let dst = sc.nodes[0].sge("off", i as usize * 16384, 16384);
            let req = (i as u32).to_le_bytes();
            let wr = SendWr::new(i, WrOpcode::Offload).imm(0x42).sge(dst);
            let mut wr = wr;
            wr.sg_list[0].length = len as u32 + (i as u32 % 3) * 100;
            sc.nodes[0]
                .qp
                .post_send_with_inline(wr, Some(&req), &sc.nodes[0].mrs)
                .unwrap();
        }
        let mut wcs = Vec::new();
        let mut rng = StdRng::seed_from_u64(seed ^ 0xABC);
        let s2 = sink.clone();
        sc.run(60_000_000_000, |sc| {
            // finish a random part of the pending jobs each step
            let mut jobs = s2.jobs.lock();
            let server = &mut sc.nodes[1].qp;
            jobs.retain(|j| {
                if !rng.random_bool(0.3) {
                    return true;
                }
                let i = u32::from_le_bytes(j.request[..4].try_into().unwrap()) as usize;
                let len = 1 + (i * 397) % (3 * mtu);
                let data: Vec<u8> = (0..len).map(|k| (k as u8) ^ (i as u8)).collect();
                // the outcome reaches the QP as an event, as the engine delivers it
                server.offload_finished(j.id, Outcome::new(OffloadStatus::Ok, Arc::from(data)));
                false
            });
            drop(jobs);
            while let Some(c) = sc.nodes[0].qp.poll_completion() {
                wcs.push(c);
            }
        });
        assert_eq!(wcs.len() as u64, n, "seed {seed}: every offload completes once");
        for (k, wc) in wcs.iter().enumerate() {
            let i = wc.wr_id as usize;
            assert_eq!(
                (k, wc.status, wc.opcode),
                (i, WcStatus::Success, WcOpcode::Offload),
                "seed {seed}"
            );
            let len = 1 + (i * 397) % (3 * mtu);
            assert_eq!(wc.byte_len as usize, len, "seed {seed} offload {i}");
            let got = sc.nodes[0].bytes("off", i * 16384, len);
            assert!(
                got.iter().enumerate().all(|(k, &b)| b == (k as u8) ^ (i as u8)),
                "seed {seed} offload {i}"
            );
        }
        assert_eq!(
            sink.runs.load(std::sync::atomic::Ordering::Relaxed),
            n,
            "seed {seed}: duplicates are answered from the job, never run again"
        );
    }
}
