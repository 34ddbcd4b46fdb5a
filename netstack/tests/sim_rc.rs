//! Deterministic simulation of two RC QPs over a lossy, reordering, duplicating, corrupting link:
//! the real engine (a simulated context per host, its data core, send queue, completion queue
//! and congestion control) over the stack's simulated network (`link::sim::SimNet`), whose
//! clock the test steps. The QPs are reached only through the verbs.
//!
//! Every scenario is a seed. `SIM_SEED=N cargo test -p netstack --test sim_rc` replays one seed
//! (with `SIM_PCAP=file` it writes the datagrams delivered as a pcap); `SIM_SCENARIOS=N`
//! changes how many run. Seeds are spread over the available cores.

use netstack::cc::{
    CcAlgorithm, CcEnv, CcKind, CcOutput, HeaderSpec, OpcodeSet, RxMeta, StartInfo, Traced, TxMeta, Verdict,
};
use netstack::link::sim::{Faults, SimNet};
use netstack::offload::{OffloadCall, OffloadError, QpFilter};
use netstack::verbs::*;
use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, HashMap};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq)]
struct LinkCfg {
    loss: f64,
    reorder: f64,
    dup: f64,
    corrupt: f64,
    delay_ns: u64,
    jitter_ns: u64,
    /// Time a sending port takes per 1500-byte frame (its line rate).
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
            rate_bps: (1500 * 8 * 1_000_000_000u64).checked_div(self.gap_ns).unwrap_or(0),
            // room for a 4 KiB MTU's packets
            mtu: 9000,
            ecn_mark_ns: 0,
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

/// One host: a simulated context with one QP, its completion queue and its regions.
struct Node {
    ctx: Context,
    pd: Pd,
    cq: Cq,
    qp: Qp,
    mr: HashMap<&'static str, Mr>,
    addr: SocketAddrV4,
}

impl Node {
    fn sge(&self, name: &str, off: usize, len: usize) -> Sge {
        self.mr[name].sge(off, len)
    }
    /// The remote address and rkey of byte `off` of region `name`.
    fn remote(&self, name: &str, off: usize) -> (u64, u32) {
        let m = &self.mr[name];
        (m.addr() + off as u64, m.rkey())
    }
    fn bytes(&self, name: &str, off: usize, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.mr[name].read(off, &mut v);
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
    seed: u64,
    rng: StdRng,
    /// The link's faults; a test changes them with [`Scenario::set_link`].
    link: LinkCfg,
    nodes: [Node; 2],
    net: Arc<SimNet>,
    /// Each node's completions so far, with the time of the step that produced them.
    wcs: [Vec<(u64, Wc)>; 2],
    /// Hash of every completion (time, node, id, status, opcode, length).
    trace: u64,
    steps: u64,
}

const MR: usize = 1 << 17;
/// Steps a run may take (a livelock of tiny deadlines would otherwise run for ever).
const MAX_STEPS: u64 = 5_000_000;

fn fnv(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// A scenario's transport parameters and link, drawn from its seed (the rest of the seed's
/// stream draws its memory and workload).
fn draw(seed: u64, cc: CcKind) -> (RcConfig, LinkCfg, StdRng) {
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
    (cfg, link, rng)
}

impl Scenario {
    fn new(seed: u64) -> Scenario {
        Scenario::new_with(seed, CcKind::None)
    }

    fn new_with(seed: u64, cc: CcKind) -> Scenario {
        Scenario::build(seed, cc, None)
    }

    /// Seed `seed`'s scenario on `link` (from the start: the connection's first packets too)
    /// rather than the seed's own.
    fn on(seed: u64, cc: CcKind, link: LinkCfg) -> Scenario {
        Scenario::build(seed, cc, Some(link))
    }

    fn build(seed: u64, cc: CcKind, link: Option<LinkCfg>) -> Scenario {
        let (cfg, drawn, mut rng) = draw(seed, cc);
        let link = link.unwrap_or(drawn);
        let net = SimNet::new(rng.random(), link.faults());
        if let Ok(p) = std::env::var("SIM_PCAP") {
            net.pcap(std::path::Path::new(&p)).expect("SIM_PCAP: a writable file");
        }
        let mut node = |h: u8| {
            let addr = SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, h), 4791);
            let ctx = Context::open_simulated(
                ContextConfig {
                    bind: addr,
                    data_cores: 1,
                    path_ports: 1,
                    gso: false,
                    rx_staging_bytes: 256 << 10,
                    qp: cfg,
                    ..ContextConfig::default()
                },
                &net,
            )
            .expect("simulated context");
            let pd = ctx.alloc_pd();
            let cq = ctx.create_cq(4096).expect("CQ");
            let qp = ctx.create_qp(&pd, &cq, &cq, QpInitAttr::default()).expect("QP");
            let mut mr = HashMap::new();
            for (name, len) in [("src", MR), ("dst", MR), ("recv", MR), ("atomic", 64)] {
                let m = pd.reg_mr(len, Access::ALL).expect("MR");
                let mut data = vec![0u8; len];
                if name != "atomic" {
                    rng.fill(&mut data[..]);
                }
                m.write(0, &data);
                mr.insert(name, m);
            }
            Node {
                ctx,
                pd,
                cq,
                qp,
                mr,
                addr,
            }
        };
        let (a, b) = (node(1), node(2));
        a.qp.connect(&b.qp.local_endpoint()).expect("connect");
        b.qp.connect(&a.qp.local_endpoint()).expect("connect");
        Scenario {
            seed,
            rng,
            link,
            nodes: [a, b],
            net,
            wcs: [Vec::new(), Vec::new()],
            trace: 0xcbf2_9ce4_8422_2325,
            steps: 0,
        }
    }

    /// Changes the link's faults for the datagrams sent from now on.
    fn set_link(&mut self, link: LinkCfg) {
        self.link = link;
        self.net.set_faults(link.faults());
    }

    /// The simulated clock (ns).
    fn now(&self) -> u64 {
        self.net.now()
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
            let (src, dst) = (&self.nodes[s], &self.nodes[d]);
            let (wr, exp) = match kind {
                0 | 1 => {
                    let (rr, rk) = dst.remote("dst", dst_cur);
                    let mut wr = SendWr::new(wr_id, WrOpcode::RdmaWrite)
                        .remote(rr, rk)
                        .flags(flags | fence);
                    if len > 0 {
                        wr = wr.sge(src.sge("src", src_off, len));
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
                    let (rr, rk) = dst.remote("dst", dst_cur);
                    let imm = self.rng.random();
                    let mut wr = SendWr::new(wr_id, WrOpcode::RdmaWriteWithImm)
                        .remote(rr, rk)
                        .imm(imm)
                        .flags(flags);
                    if len > 0 {
                        wr = wr.sge(src.sge("src", src_off, len));
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
                        wr = wr
                            .sge(src.sge("src", src_off, h))
                            .sge(src.sge("src", src_off + h, len - h));
                    } else if len > 0 {
                        wr = wr.sge(src.sge("src", src_off, len));
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
                    let (rr, rk) = dst.remote("src", src_off);
                    let mut wr = SendWr::new(wr_id, WrOpcode::RdmaRead)
                        .remote(rr, rk)
                        .flags(flags | fence);
                    if len > 0 {
                        wr = wr.sge(src.sge("dst", MR / 2 + rd_cur, len));
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
                    let res = src.sge("atomic", 16 + 8 * (i % 4), 8);
                    if self.rng.random_bool(0.5) {
                        let (rr, rk) = dst.remote("atomic", 0);
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
                        let (rr, rk) = dst.remote("atomic", 8);
                        let w = SendWr::new(wr_id, WrOpcode::AtomicCmpAndSwp)
                            .remote(rr, rk)
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
                    [dst.sge("recv", recv_off, len)].into_iter().collect()
                } else {
                    SgList::new()
                };
                dst.qp
                    .post_recv(RecvWr {
                        wr_id: wr_id | 1 << 40,
                        sg_list: sg,
                    })
                    .expect("post_recv");
            }
            src.qp.post_send(wr).expect("post_send");
            out.push((wr_id, signaled, exp));
        }
        out
    }

    /// Takes the completions both CQs hold, stamped `at`.
    fn poll(&mut self, at: u64) {
        let mut buf = [EMPTY_WC; 32];
        for i in 0..2 {
            loop {
                let n = self.nodes[i].cq.poll(&mut buf);
                if n == 0 {
                    break;
                }
                for wc in &buf[..n] {
                    let mut h = fnv(self.trace, &at.to_le_bytes());
                    h = fnv(h, &[i as u8, wc.status as u8, wc.opcode as u8]);
                    h = fnv(h, &wc.wr_id.to_le_bytes());
                    self.trace = fnv(h, &wc.byte_len.to_le_bytes());
                    self.wcs[i].push((at, *wc));
                }
            }
        }
    }

    /// Steps the network (the engines' cores run at each step's time) until `done` holds, `ns`
    /// of simulated time pass, or nothing is left to happen; returns whether `done` held.
    /// `done` runs after every step, with the completions of that step taken.
    fn run(&mut self, ns: u64, mut done: impl FnMut(&mut Scenario) -> bool) -> bool {
        let end = self.now() + ns;
        loop {
            if done(self) {
                return true;
            }
            if self.now() >= end {
                return false;
            }
            self.steps += 1;
            assert!(
                self.steps < MAX_STEPS,
                "seed {}: {MAX_STEPS} steps, {} us of simulated time",
                self.seed,
                self.now() / 1000
            );
            let at = self.now();
            let more = self.net.step();
            self.poll(at);
            if !more {
                return done(self);
            }
        }
    }

    /// Steps the network for `ns` of simulated time (or until nothing is left to happen),
    /// calling `each` after every step.
    fn run_for(&mut self, ns: u64, mut each: impl FnMut(&mut Scenario)) {
        let end = self.now() + ns;
        self.run(ns, |sc| {
            each(sc);
            sc.now() >= end
        });
    }

    /// Node `i`'s send completions (receives aside) so far.
    fn sends(&self, i: usize) -> Vec<Wc> {
        self.wcs[i]
            .iter()
            .map(|(_, w)| *w)
            .filter(|w| w.opcode != WcOpcode::Recv && w.opcode != WcOpcode::RecvRdmaWithImm)
            .collect()
    }
}

/// Runs one seeded scenario: random work both ways, then every completion and every byte
/// checked against the workload's record. Returns the completions' trace hash.
fn check_scenario(seed: u64) -> Result<u64, String> {
    let mut sc = Scenario::new(seed);
    let n_ops = sc.rng.random_range(1..24);
    let exp_a = sc.workload(0, n_ops);
    let n_ops_b = sc.rng.random_range(0..8);
    let exp_b = sc.workload(1, n_ops_b);
    // every signaled WR and every receive completes (or an error ends the run early)
    let want = |exp: &[(u64, bool, Expect)], peer: &[(u64, bool, Expect)]| {
        exp.iter().filter(|e| e.1).count()
            + peer
                .iter()
                .filter(|e| matches!(e.2, Expect::Send { .. } | Expect::WriteImm { .. }))
                .count()
    };
    let want = [want(&exp_a, &exp_b), want(&exp_b, &exp_a)];
    sc.run(60_000_000_000, |sc| {
        (0..2).all(|i| sc.wcs[i].len() >= want[i])
            || sc.wcs.iter().flatten().any(|(_, w)| w.status != WcStatus::Success)
    });
    // exactly once: nothing completes after the workload
    sc.run_for(50_000_000, |_| {});
    let wcs: [Vec<Wc>; 2] = [0, 1].map(|i| sc.wcs[i].iter().map(|(_, w)| *w).collect());
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
        let (sn, dn) = (&sc.nodes[s], &sc.nodes[d]);
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
                    if dn.bytes("dst", *dst_off, *len) != sn.bytes("src", *src_off, *len) {
                        return Err(format!("{ctx}: WRITE {wr_id:#x} data mismatch"));
                    }
                }
                Expect::WriteImm {
                    dst_off,
                    src_off,
                    len,
                    imm,
                } => {
                    if dn.bytes("dst", *dst_off, *len) != sn.bytes("src", *src_off, *len) {
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
                    if dn.bytes("recv", *recv_off, *len) != sn.bytes("src", *src_off, *len) {
                        return Err(format!("{ctx}: SEND {wr_id:#x} data mismatch"));
                    }
                }
                Expect::Read { src_off, dst_off, len } => {
                    if sn.bytes("dst", *dst_off, *len) != dn.bytes("src", *src_off, *len) {
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
        let fa = dn.mr["atomic"].load_u64(0).expect("aligned");
        if fa != faa_sum {
            return Err(format!(
                "{ctx}: FETCH_ADD total {fa}, expected {faa_sum} (an atomic ran twice or never)"
            ));
        }
        let cas_n = exp.iter().filter(|(_, _, e)| matches!(e, Expect::Cas)).count() as u64;
        let cv = dn.mr["atomic"].load_u64(8).expect("aligned");
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
                "{ctx}: QP {:#x} ended in {:?}; first errors {errs:?}; requester {:?}; responder {:?}",
                n.qp.qp_num(),
                n.qp.state(),
                sc.nodes[0].qp.stats(),
                sc.nodes[1].qp.stats()
            ));
        }
    }
    Ok(fnv(sc.trace, &sc.net.trace_hash().to_le_bytes()))
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

/// Runs `check` on every seed, spread over the machine's cores; returns the failures (seed and
/// message), in seed order.
fn run_all(seeds: &[u64], check: impl Fn(u64) -> Result<u64, String> + Sync) -> Vec<(u64, String)> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut failures: Vec<(u64, String)> = std::thread::scope(|s| {
        let check = &check;
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn(move || {
                    let mut failed = Vec::new();
                    for &seed in seeds.iter().skip(t).step_by(threads) {
                        if let Err(e) = check(seed) {
                            failed.push((seed, e));
                        }
                    }
                    failed
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("a seed's thread panicked"))
            .collect()
    });
    failures.sort_by_key(|f| f.0);
    failures
}

#[test]
fn seeded_scenarios_complete_exactly_once_with_right_data() {
    let seeds = seeds();
    let started = std::time::Instant::now();
    let failures = run_all(&seeds, check_scenario);
    if let Some((seed, first)) = failures.first() {
        panic!(
            "{} of {} scenarios failed; first: {first}\n(replay: SIM_SEED={seed}, SIM_PCAP=<file>)",
            failures.len(),
            seeds.len()
        );
    }
    eprintln!(
        "{} scenarios passed in {:.1} s",
        seeds.len(),
        started.elapsed().as_secs_f64()
    );
}

/// Two runs of a seed hash the same: the completions with their times and every datagram the
/// network delivered with its time.
#[test]
fn a_seed_replays_identically() {
    let seeds: Vec<u64> = seeds().into_iter().take(100).collect();
    let failures = run_all(&seeds, |seed| {
        let first = check_scenario(seed)?;
        let second = check_scenario(seed)?;
        if first != second {
            return Err(format!("two runs differ: {first:x} vs {second:x}"));
        }
        Ok(first)
    });
    assert!(failures.is_empty(), "{failures:?}");
}

#[test]
fn vanished_peer_ends_in_retry_exc_err_within_bound() {
    let gave_up = AtomicU64::new(0);
    let failures = run_all(&(0..200).collect::<Vec<u64>>(), |seed| {
        let mut sc = Scenario::new(seed);
        let mut exp = sc.workload(0, 4);
        // a signaled WRITE last: its success means the send queue holds nothing more
        let (rr, rk) = sc.nodes[1].remote("dst", 0);
        sc.nodes[0]
            .qp
            .post_send(SendWr::new(99, WrOpcode::RdmaWrite).remote(rr, rk))
            .expect("post");
        exp.push((99, true, Expect::Cas));
        let start = sc.now();
        let kill_at = start + sc.rng.random_range(0..200_000);
        let cfg = sc.nodes[0].qp.config();
        let mut killed = false;
        // the peer vanishes: nothing reaches it, nothing leaves it, from `kill_at` on
        let dead = |sc: &mut Scenario| {
            if !killed && sc.now() >= kill_at {
                killed = true;
                sc.net
                    .partition(Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 2), 1 << 50);
            }
            let want = exp.iter().filter(|e| e.1).count();
            sc.wcs[0].len() >= want
                || sc.wcs[0].iter().any(|(_, w)| w.status != WcStatus::Success)
                    && sc.nodes[0].qp.state() == QpState::Err
        };
        sc.run(10_000_000_000, dead);
        // the error's flushes follow it
        sc.run_for(10_000_000, |_| {});
        let wcs: Vec<(u64, Wc)> = sc.wcs[0].clone();
        let first_err = wcs.iter().find(|(_, w)| w.status != WcStatus::Success).map(|(t, _)| *t);
        let Some(t) = first_err else {
            // no error: then everything finished before the peer vanished. A QP left holding
            // work with no error (hung, never giving up) fails here: every signaled WR of the
            // record, the last one too, completed successfully, in order.
            let want: Vec<u64> = exp.iter().filter(|(_, sig, _)| *sig).map(|(id, _, _)| *id).collect();
            let got: Vec<u64> = wcs.iter().map(|(_, w)| w.wr_id).collect();
            if got != want {
                return Err(format!(
                    "seed {seed}: completions without an error: {got:x?}, want {want:x?}"
                ));
            }
            if sc.nodes[0].qp.state() != QpState::Rts {
                return Err(format!(
                    "seed {seed}: {:?} with no error completion",
                    sc.nodes[0].qp.state()
                ));
            }
            return Ok(0);
        };
        if sc.nodes[0].qp.state() != QpState::Err {
            return Err(format!("seed {seed}: QP should be in ERR"));
        }
        let errs: Vec<Wc> = wcs
            .iter()
            .map(|(_, w)| *w)
            .filter(|w| w.status != WcStatus::Success)
            .collect();
        if errs[0].status != WcStatus::RetryExcErr || errs[1..].iter().any(|w| w.status != WcStatus::WrFlushErr) {
            return Err(format!("seed {seed}: {wcs:?}"));
        }
        // bound: the retry budget after the last progress (which is at most the kill time plus
        // one RTT)
        let bound = kill_at + cfg.retry_bound_ns() + cfg.timeout_ns + 1_000_000;
        if t > bound {
            return Err(format!("seed {seed}: RETRY_EXC_ERR at {t} ns, bound {bound}"));
        }
        // every WR completed exactly once, the last one too
        let mut ids: Vec<u64> = wcs.iter().map(|(_, w)| w.wr_id).collect();
        ids.sort();
        ids.dedup();
        if ids.len() != wcs.len() || !ids.contains(&99) {
            return Err(format!("seed {seed}: duplicate or missing completions: {wcs:?}"));
        }
        gave_up.fetch_add(1, Ordering::Relaxed);
        Ok(0)
    });
    assert!(failures.is_empty(), "{failures:?}");
    // most seeds lose their peer with work outstanding (the rest finish first)
    let gave_up = gave_up.load(Ordering::Relaxed);
    eprintln!("{gave_up} of 200 seeds ended in RETRY_EXC_ERR");
    assert!(
        gave_up >= 100,
        "only {gave_up} of 200 seeds lost their peer with work left"
    );
}

#[test]
fn rnr_then_recv_posted_completes() {
    // a SEND with no receive posted gets RNR NAKs until the receive appears
    let mut sc = Scenario::on(7, CcKind::None, LinkCfg::clean(1000, 0, 100));
    let sge = sc.nodes[0].sge("src", 0, 100);
    sc.nodes[0]
        .qp
        .post_send(SendWr::new(1, WrOpcode::Send).sge(sge))
        .expect("post");
    let post_at = sc.now() + 50_000_000;
    let mut posted = false;
    sc.run(1_000_000_000, |sc| {
        if sc.now() > post_at && !posted {
            posted = true;
            let sge = sc.nodes[1].sge("recv", 0, 100);
            sc.nodes[1]
                .qp
                .post_recv(RecvWr {
                    wr_id: 9,
                    sg_list: [sge].into_iter().collect(),
                })
                .expect("post_recv");
        }
        !sc.wcs[0].is_empty() && !sc.wcs[1].is_empty()
    });
    let c = sc.wcs[0].first().expect("completion").1;
    assert_eq!((c.wr_id, c.status), (1, WcStatus::Success));
    assert!(sc.nodes[0].qp.stats().rnr_naks_received > 0);
    let r = sc.wcs[1].first().expect("receive completion").1;
    assert_eq!((r.wr_id, r.status, r.byte_len), (9, WcStatus::Success, 100));
    assert_eq!(sc.nodes[1].bytes("recv", 0, 100), sc.nodes[0].bytes("src", 0, 100));
}

/// Bytes node `i` put on the wire since the network began recording (headers, payload, pad,
/// ICRC of every datagram: what the pacer counts).
fn wire_bytes(sc: &Scenario, i: usize) -> u64 {
    let from = sc.nodes[i].addr;
    sc.net
        .records()
        .sent
        .iter()
        .filter(|(src, _, _)| *src == from)
        .map(|(_, _, d)| d.len() as u64)
        .sum()
}

#[test]
fn paced_qp_sends_at_its_rate() {
    // scenarios whose window (packets x MTU) is large enough not to be the limit at 1 GB/s
    let seeds = (0u64..).filter(|&s| {
        let c = draw(s, CcKind::None).0;
        c.window_pkts as u64 * c.mtu as u64 >= 256 << 10
    });
    for (seed, rate) in seeds.zip([50_000_000u64, 200_000_000, 1_000_000_000]) {
        let mut sc = Scenario::on(seed, CcKind::None, LinkCfg::clean(5_000, 0, 50));
        sc.nodes[0].qp.set_rate_limit(Some(rate), 0);
        sc.net.record();
        let (rr, rk) = sc.nodes[1].remote("dst", 0);
        let start = sc.now();
        for i in 0..32 {
            let sge = sc.nodes[0].sge("src", 0, 65536);
            sc.nodes[0]
                .qp
                .post_send(SendWr::new(i, WrOpcode::RdmaWrite).sge(sge).remote(rr, rk))
                .expect("post");
        }
        sc.run(10_000_000_000, |sc| sc.wcs[0].len() >= 32);
        let wcs = &sc.wcs[0];
        assert_eq!(wcs.len(), 32, "seed {seed}");
        assert!(wcs.iter().all(|(_, w)| w.status == WcStatus::Success), "seed {seed}");
        let done_at = wcs[31].0 - start;
        let wire = wire_bytes(&sc, 0);
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
        let link = LinkCfg {
            loss: 0.2,
            ..LinkCfg::clean(5_000, 0, 50)
        };
        let mut sc = Scenario::on(seed, CcKind::None, link);
        // 20 kB/s: a packet every 13 to 205 ms, against a 0.2 ms timeout (16 ms of retries)
        sc.nodes[0].qp.set_rate_limit(Some(20_000), 0);
        for i in 0..4 {
            let sge = sc.nodes[0].sge("src", 4096 * i as usize, 4096);
            let (rr, rk) = sc.nodes[1].remote("dst", 4096 * i as usize);
            sc.nodes[0]
                .qp
                .post_send(SendWr::new(i, WrOpcode::RdmaWrite).sge(sge).remote(rr, rk))
                .expect("post");
        }
        sc.run(60_000_000_000, |sc| sc.wcs[0].len() >= 4);
        let st: Vec<WcStatus> = sc.wcs[0].iter().map(|(_, c)| c.status).collect();
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

/// Posts `n` `len`-byte WRITEs from node 0 to node 1's `dst` region (unsignaled unless
/// `signaled`).
fn post_writes(sc: &mut Scenario, n: u64, len: usize, signaled: bool) {
    let (rr, rk) = sc.nodes[1].remote("dst", 0);
    let flags = if signaled { SendFlags::SIGNALED } else { SendFlags(0) };
    for i in 0..n {
        let sge = sc.nodes[0].sge("src", 0, len);
        let wr = SendWr::new(i, WrOpcode::RdmaWrite).sge(sge).remote(rr, rk).flags(flags);
        sc.nodes[0].qp.post_send(wr).expect("post");
    }
}

/// A built-in algorithm, run as it is, whose pacing rate the test reads: the rate its last
/// output set (what the QP's pacer holds).
#[derive(Debug)]
struct Watched {
    inner: Box<dyn CcAlgorithm>,
    rate: Arc<Mutex<Option<u64>>>,
}

impl Watched {
    /// `kind`'s algorithm with the default parameters (the contexts'), and its rate.
    fn new(kind: CcKind) -> (Watched, Arc<Mutex<Option<u64>>>) {
        let rate = Arc::new(Mutex::new(None));
        let inner = kind.build(&CcEnv::default_env()).expect("an algorithm");
        (
            Watched {
                inner,
                rate: rate.clone(),
            },
            rate,
        )
    }
    fn note(&self, out: &CcOutput) {
        if let Some(r) = out.rate {
            *self.rate.lock() = r;
        }
    }
}

impl CcAlgorithm for Watched {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn traced(&self) -> Traced {
        self.inner.traced()
    }
    fn header(&self) -> HeaderSpec {
        self.inner.header()
    }
    fn on_start(&mut self, now: u64, info: &StartInfo, out: &mut CcOutput) {
        self.inner.on_start(now, info, out);
        self.note(out);
    }
    fn on_tx(&mut self, now: u64, pkt: &TxMeta, out: &mut CcOutput) -> Verdict {
        let v = self.inner.on_tx(now, pkt, out);
        self.note(out);
        v
    }
    fn write_header(&mut self, now: u64, pkt: &TxMeta, hdr: &mut [u8]) {
        self.inner.write_header(now, pkt, hdr);
    }
    fn on_rx(&mut self, now: u64, pkt: &RxMeta<'_>, out: &mut CcOutput) {
        self.inner.on_rx(now, pkt, out);
        self.note(out);
    }
    fn on_timer(&mut self, now: u64, out: &mut CcOutput) {
        self.inner.on_timer(now, out);
        self.note(out);
    }
}

#[test]
fn dcqcn_slows_a_marked_sender_and_recovers() {
    let mut sc = Scenario::on(11, CcKind::Dcqcn, LinkCfg::clean(2_000, 0, 100));
    let (alg, rate) = Watched::new(CcKind::Dcqcn);
    sc.nodes[0].qp.install_cc(Box::new(alg));
    let line = netstack::cc::dcqcn::DcqcnParams::default().line_rate;
    // congested: every data packet is marked for 20 ms
    let sender = sc.nodes[0].addr;
    sc.net.set_ce_marking(sender, true);
    post_writes(&mut sc, 200, 65536, false);
    let sent = sc.nodes[0].ctx.stats().tx_bytes;
    let mut slowed = line;
    sc.run_for(20_000_000, |_| {
        if let Some(r) = *rate.lock() {
            slowed = slowed.min(r);
        }
    });
    let sent = sc.nodes[0].ctx.stats().tx_bytes - sent;
    let cnps = sc.nodes[1].qp.stats().cnps_sent;
    assert!(
        slowed < line / 10,
        "rate {slowed} should fall far below line rate {line} under 20 ms of marks"
    );
    // what left in those 20 ms: far below line rate too (the pacer enforces the cut rate,
    // bursts included)
    assert!(
        sent < line / 10 * 20 / 1000,
        "{sent} bytes sent in 20 ms of marks at line rate {line}"
    );
    assert!(
        cnps > 0 && cnps <= 20_000_000 / 50_000 + 1,
        "{cnps} CNPs: at most one per 50 us"
    );
    assert_eq!(sc.nodes[0].qp.stats().cnps_received, cnps);
    // congestion clears: the sender recovers towards line rate
    sc.net.set_ce_marking(sender, false);
    post_writes(&mut sc, 2000, 65536, false);
    sc.run_for(200_000_000, |_| {});
    let recovered = rate.lock().expect("DCQCN sets a rate");
    assert!(recovered > line / 2, "rate {recovered} should recover towards {line}");
    // a QP without congestion control never sends CNPs, marks or not
    let mut plain = Scenario::on(11, CcKind::None, LinkCfg::clean(2_000, 0, 100));
    let sender = plain.nodes[0].addr;
    plain.net.set_ce_marking(sender, true);
    post_writes(&mut plain, 10, 65536, true);
    plain.run(1_000_000_000, |sc| sc.wcs[0].len() >= 10);
    assert_eq!(plain.wcs[0].len(), 10);
    assert!(plain.net.stats().ce_marked > 0, "the data arrived marked");
    assert_eq!(plain.nodes[1].qp.stats().cnps_sent, 0);
    assert_eq!(plain.nodes[0].qp.stats().cnps_received, 0);
}

#[test]
fn timely_follows_the_rtt() {
    let mut sc = Scenario::on(12, CcKind::Timely, LinkCfg::clean(2_000, 0, 100));
    let (alg, rate) = Watched::new(CcKind::Timely);
    sc.nodes[0].qp.install_cc(Box::new(alg));
    let line = netstack::cc::timely::TimelyParams::default().line_rate;
    let rate = move || rate.lock().expect("TIMELY sets a rate");
    // short path: RTT far below T_low, the rate stays at line rate
    post_writes(&mut sc, 50, 16384, false);
    sc.run_for(50_000_000, |_| {});
    assert_eq!(rate(), line);
    // queues build: the RTT rises step by step (kept under this scenario's 200 us RTO, so
    // packets are not resent and every ACK gives a sample); positive gradients cut the rate
    let mut slow = line;
    for d in [10_000, 25_000, 40_000, 55_000, 70_000] {
        let link = LinkCfg { delay_ns: d, ..sc.link };
        sc.set_link(link);
        post_writes(&mut sc, 20, 16384, false);
        sc.run_for(2_000_000, |_| slow = slow.min(rate()));
    }
    assert!(slow < line / 2, "rate {slow} while the RTT rises");
    // and short again: the rate climbs back (additive, then hyper-active)
    let link = LinkCfg {
        delay_ns: 2_000,
        ..sc.link
    };
    sc.set_link(link);
    post_writes(&mut sc, 400, 16384, false);
    sc.run_for(500_000_000, |_| {});
    let back = rate();
    assert!(back > slow, "rate {back} should grow again from {slow}");
    assert!(
        sc.nodes[0].qp.stats().retransmitted_packets == 0,
        "samples came from first transmissions"
    );
}

#[test]
fn selective_repeat_rides_out_reordering_without_spurious_retransmissions() {
    // pure reordering (no loss): every packet's delay varies by up to 2 µs on a 5 µs link, so
    // packets sent close together overtake each other, as when they are sprayed over paths of
    // unequal delay. Holes below the highest SACK are resent only once they are older than the
    // RTT plus a reordering window (a quarter RTT), so none is resent.
    let seeds = (0u64..).filter(|&s| draw(s, CcKind::None).0.recovery == Recovery::SelectiveRepeat);
    for seed in seeds.take(6) {
        // first one WRITE in order, which validates each side's route to the other (the
        // responder's challenge): the reordering starts on a connection past its handshake
        let mut sc = Scenario::on(seed, CcKind::None, LinkCfg::clean(5_000, 0, 100));
        post_writes(&mut sc, 1, 8192, true);
        sc.run(1_000_000_000, |sc| !sc.wcs[0].is_empty());
        let (tx0, rx0) = (sc.nodes[0].qp.stats(), sc.nodes[1].qp.stats());
        assert_eq!(tx0.routes_validated, 1, "seed {seed}: {tx0:?}");
        sc.set_link(LinkCfg::clean(5_000, 2_000, 0));
        post_writes(&mut sc, 64, 8192, true);
        sc.run(2_000_000_000, |sc| sc.wcs[0].len() >= 65);
        let (tx, rx) = (sc.nodes[0].qp.stats(), sc.nodes[1].qp.stats());
        let done = sc.wcs[0].iter().filter(|(_, w)| w.status == WcStatus::Success).count();
        assert_eq!(done, 65, "seed {seed}: all WRITEs done");
        assert!(
            rx.out_of_order_packets > rx0.out_of_order_packets,
            "seed {seed}: the link reordered: {rx:?}"
        );
        assert_eq!(
            tx.retransmitted_packets - tx0.retransmitted_packets,
            0,
            "seed {seed}: {tx:?} {rx:?}"
        );
        assert_eq!(rx.duplicate_requests - rx0.duplicate_requests, 0, "seed {seed}: {rx:?}");
    }
}

#[test]
fn a_window_smaller_than_the_losses_still_retransmits() {
    // congestion control shrinks the window to two packets while losses keep the old packets
    // unacknowledged: the holes must still be resent (paced, outside the window), or the QP
    // waits for an ACK that cannot come and ends in RETRY_EXC_ERR
    for recovery in [Recovery::SelectiveRepeat, Recovery::GoBackN] {
        let seed = (0u64..)
            .find(|&s| draw(s, CcKind::None).0.recovery == recovery)
            .expect("a seed");
        let link = LinkCfg {
            loss: 0.05,
            ..LinkCfg::clean(5_000, 0, 100)
        };
        let mut sc = Scenario::on(seed, CcKind::None, link);
        let mtu = sc.nodes[0].qp.config().mtu as u64;
        sc.nodes[0].qp.set_window_limit(Some(2 * mtu));
        post_writes(&mut sc, 64, 8192, true);
        sc.run(20_000_000_000, |sc| sc.wcs[0].len() >= 64);
        let tx = sc.nodes[0].qp.stats();
        let st: Vec<WcStatus> = sc.wcs[0].iter().map(|(_, w)| w.status).collect();
        assert_eq!(st, [WcStatus::Success; 64], "{recovery:?} seed {seed}: {tx:?}");
        assert!(
            tx.retransmitted_packets > 0,
            "{recovery:?}: the link lost packets: {tx:?}"
        );
    }
}

/// A user-written algorithm: counts the events it traces (only the last packet of each WRITE).
#[derive(Debug)]
struct CountLast(Arc<AtomicU64>, Arc<AtomicU64>);

impl CcAlgorithm for CountLast {
    fn name(&self) -> &'static str {
        "count-last"
    }
    fn traced(&self) -> Traced {
        use netstack::wire::Opcode;
        Traced {
            tx_data: true,
            rx_data: true,
            data_opcodes: OpcodeSet::of(&[Opcode::WriteLast, Opcode::WriteOnly]),
            ..Default::default()
        }
    }
    fn on_start(&mut self, _: u64, _: &StartInfo, _: &mut CcOutput) {}
    fn on_tx(&mut self, _: u64, pkt: &TxMeta, _: &mut CcOutput) -> Verdict {
        assert_eq!(pkt.msg_remaining, 0, "only last packets are traced");
        self.0.fetch_add(1, Ordering::Relaxed);
        Verdict::Send
    }
    fn on_rx(&mut self, _: u64, _: &RxMeta<'_>, _: &mut CcOutput) {
        self.1.fetch_add(1, Ordering::Relaxed);
    }
}

#[test]
fn user_algorithms_see_only_the_opcodes_they_trace() {
    let mut sc = Scenario::on(21, CcKind::None, LinkCfg::clean(2_000, 0, 100));
    let (tx, rx): (Arc<AtomicU64>, Arc<AtomicU64>) = Default::default();
    sc.nodes[0]
        .qp
        .install_cc(Box::new(CountLast(tx.clone(), Arc::default())));
    sc.nodes[1]
        .qp
        .install_cc(Box::new(CountLast(Arc::default(), rx.clone())));
    let mtu = sc.nodes[0].qp.config().mtu as usize;
    post_writes(&mut sc, 20, mtu * 3 + 1, true); // four packets per WRITE
    sc.run(1_000_000_000, |sc| sc.wcs[0].len() >= 20);
    assert_eq!(sc.sends(0).len(), 20);
    assert!(sc.sends(0).iter().all(|w| w.status == WcStatus::Success));
    let n = |a: &Arc<AtomicU64>| a.load(Ordering::Relaxed);
    assert_eq!((n(&tx), n(&rx)), (20, 20), "one TX and one RX event per WRITE");
    assert!(sc.nodes[0].qp.stats().tx_packets >= 80);
}

/// Each ACK's `(now, host_delay_ns)`.
type Reports = Arc<Mutex<Vec<(u64, Option<u64>)>>>;

/// A user-written algorithm that asks for host-delay reports and keeps them.
#[derive(Debug)]
struct HostDelays(Reports);

impl CcAlgorithm for HostDelays {
    fn name(&self) -> &'static str {
        "host-delays"
    }
    fn traced(&self) -> Traced {
        Traced {
            rx_ack: true,
            ..Default::default()
        }
    }
    fn header(&self) -> HeaderSpec {
        HeaderSpec {
            host_delay: true,
            ..Default::default()
        }
    }
    fn on_start(&mut self, _: u64, _: &StartInfo, _: &mut CcOutput) {}
    fn on_rx(&mut self, now: u64, pkt: &RxMeta<'_>, _: &mut CcOutput) {
        assert!(pkt.cc.is_empty(), "the report is taken off the CC header");
        self.0.lock().push((now, pkt.host_delay_ns));
    }
}

#[test]
fn acks_report_the_time_packets_waited_at_the_hosts() {
    for wait in [0, 20_000] {
        // 5 us per frame: the 160 packets take about 0.8 ms, most of it after the first waits
        let mut sc = Scenario::on(22, CcKind::None, LinkCfg::clean(2_000, 0, 5_000));
        // each host takes its packets in `wait` after they arrive (its receive timestamps say
        // when they arrived)
        for i in 0..2 {
            let addr = sc.nodes[i].addr;
            sc.net.set_host_wait(addr, wait);
        }
        let seen = Reports::default();
        sc.nodes[0].qp.install_cc(Box::new(HostDelays(seen.clone())));
        sc.nodes[1].qp.install_cc(Box::new(HostDelays(Arc::default())));
        let mtu = sc.nodes[0].qp.config().mtu as usize;
        let start = sc.now();
        post_writes(&mut sc, 40, mtu * 3 + 1, true);
        sc.run(1_000_000_000, |sc| sc.wcs[0].len() >= 40);
        assert_eq!(sc.sends(0).len(), 40);
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
            .filter(|(now, _)| *now > start + 3 * wait)
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

/// The offload opcode of [`offloads_over_a_lossy_link_run_once_and_complete_once`].
const LATE: u16 = 0x0C42;

/// Offloads that finish later, as the test decides, like handlers that wait on something:
/// each request's index, how many times it ran, and the gates of those not finished yet.
#[derive(Default)]
struct LateJobs {
    runs: Mutex<BTreeMap<u32, u32>>,
    waiting: Mutex<Vec<(u32, tokio::sync::oneshot::Sender<()>)>>,
    finished: AtomicU64,
}

/// Offload `i`'s response length and bytes (some responses span packets).
fn late_response(i: u32, mtu: usize) -> Vec<u8> {
    let len = 1 + (i as usize * 397) % (3 * mtu);
    (0..len).map(|k| (k as u8) ^ (i as u8)).collect()
}

#[test]
fn offloads_over_a_lossy_link_run_once_and_complete_once() {
    let mut modes = BTreeMap::new();
    let mut dups = 0;
    for seed in seeds().into_iter().take(24) {
        let (cfg, drawn, _) = draw(seed, CcKind::None);
        let link = LinkCfg {
            loss: drawn.loss.max(0.03),
            ..drawn
        };
        let mut sc = Scenario::on(seed, CcKind::None, link);
        let mtu = cfg.mtu as usize;
        *modes.entry(format!("{:?}", cfg.recovery)).or_insert(0) += 1;
        // the handler runs on the offload threads and waits until the test lets it finish
        let jobs = Arc::new(LateJobs::default());
        let j = jobs.clone();
        let _handler = sc.nodes[1]
            .ctx
            .offload()
            .register_with_budget(
                LATE,
                QpFilter::Any,
                move |mut call: OffloadCall| {
                    let j = j.clone();
                    async move {
                        let i = u32::from_le_bytes(
                            call.request()[..4]
                                .try_into()
                                .map_err(|_| OffloadError::BadRequest("short".into()))?,
                        );
                        *j.runs.lock().entry(i).or_default() += 1;
                        let (tx, rx) = tokio::sync::oneshot::channel();
                        j.waiting.lock().push((i, tx));
                        let _ = rx.await;
                        let data = late_response(i, mtu);
                        call.alloc_resp(data.len())?;
                        call.resp_mut().copy_from_slice(&data);
                        let reply = call.submit_resp();
                        j.finished.fetch_add(1, Ordering::Release);
                        reply
                    }
                },
                std::time::Duration::from_secs(3600),
            )
            .expect("register the handler");
        let n = 40u32;
        let resp = sc.nodes[0].pd.reg_mr(n as usize * 16384, Access::ALL).expect("MR");
        for i in 0..n {
            let len = late_response(i, mtu).len();
            let mut dst = resp.sge(i as usize * 16384, 16384);
            dst.length = len as u32 + (i % 3) * 100;
            sc.nodes[0]
                .qp
                .post_offload(i as u64, LATE, &i.to_le_bytes(), dst)
                .expect("post offload");
        }
        let mut rng = StdRng::seed_from_u64(seed ^ 0xABC);
        let mut released = 0u64;
        // each job finishes at a random time up to two retransmission timeouts after the step
        // that saw it start (its request's copies meanwhile find it running)
        let mut due: Vec<(u64, tokio::sync::oneshot::Sender<()>)> = Vec::new();
        sc.run(60_000_000_000, |sc| {
            let now = sc.now();
            // every request the responder took has reached its handler (on an offload thread)
            let wait = std::time::Instant::now() + std::time::Duration::from_secs(10);
            let took = sc.nodes[1].ctx.offload().stats().requests;
            while jobs.runs.lock().values().map(|&r| r as u64).sum::<u64>() < took && std::time::Instant::now() < wait {
                std::thread::yield_now();
            }
            while jobs.waiting.lock().len() as u64 + due.len() as u64 + released < took
                && std::time::Instant::now() < wait
            {
                std::thread::yield_now();
            }
            for (_, gate) in jobs.waiting.lock().drain(..) {
                due.push((now + rng.random_range(0..2 * cfg.timeout_ns), gate));
            }
            let (go, stay): (Vec<_>, Vec<_>) = std::mem::take(&mut due).into_iter().partition(|(t, _)| *t <= now);
            due = stay;
            for (_, gate) in go {
                released += 1;
                let _ = gate.send(());
            }
            // the handlers answer on the offload threads: wait (real time) for them, so the
            // next step finds their responses
            let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
            let ok = |sc: &Scenario| sc.nodes[1].ctx.offload().stats().ok;
            if ok(sc) < released {
                while ok(sc) < released && std::time::Instant::now() < until {
                    std::thread::yield_now();
                }
                // counted just before the outcome is queued to the responder's core: let it
                // get there, so the next step sends the response
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            sc.wcs[0].len() >= n as usize || sc.wcs[0].iter().any(|(_, w)| w.status != WcStatus::Success)
        });
        let wcs = sc.sends(0);
        assert_eq!(
            wcs.len() as u32,
            n,
            "seed {seed}: every offload completes once: {wcs:?}"
        );
        for (k, wc) in wcs.iter().enumerate() {
            let i = wc.wr_id as usize;
            assert_eq!(
                (k, wc.status, wc.opcode),
                (i, WcStatus::Success, WcOpcode::Offload),
                "seed {seed}: {:?}",
                sc.nodes[0].qp.stats()
            );
            let want = late_response(i as u32, mtu);
            assert_eq!(wc.byte_len as usize, want.len(), "seed {seed} offload {i}");
            let mut got = vec![0u8; want.len()];
            resp.read(i * 16384, &mut got);
            assert!(got == want, "seed {seed} offload {i}");
        }
        dups += sc.nodes[1].qp.stats().duplicate_requests;
        let runs = jobs.runs.lock();
        assert_eq!(runs.len() as u32, n, "seed {seed}: every request reached the handler");
        assert!(
            runs.values().all(|&r| r == 1),
            "seed {seed}: duplicates are answered from the job, never run again: {runs:?}"
        );
    }
    if seeds().len() > 1 {
        assert!(modes.len() == 2, "both recovery modes: {modes:?}");
        assert!(dups > 0, "no request was received twice: the test tests nothing");
    }
}
