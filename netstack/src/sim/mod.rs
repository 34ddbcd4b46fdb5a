//! A deterministic discrete-event network simulator that runs the real transport and
//! congestion-control state machines (they are sans-IO): hosts with RC QPs and a NIC that
//! serializes their packets at line rate, links with a rate and a propagation delay, and
//! output-queued switches with a per-port buffer, ECN marking (RED between `kmin` and `kmax`,
//! evaluated at dequeue as in the HPCC ns-3 model), HPCC INT stamping at dequeue, and ECMP.
//!
//! Packets are real wire bytes (headers, CC header, payload, ICRC), so a switch rewrites the INT
//! stack in place exactly where the testbed's eBPF program does. Runs are reproducible from a
//! seed (RED's coin flips are the only randomness).
//!
//! Used by `flexns ccsim` (the congestion-control experiments) and by the tests.

mod host;

pub use host::{FlowId, FlowResult, FlowSpec};

use crate::cc::header::{IntHop, IntStack, INT_STACK_LEN};
use crate::cc::CcParams;
use crate::transport::rc::RcConfig;
use crate::wire::Opcode;
use host::Host;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};

/// A node: a host or a switch.
pub type NodeId = usize;

/// Bytes a packet occupies on a link beyond its UDP payload (Ethernet + FCS + IPv4 + UDP).
pub const WIRE_OVERHEAD: u64 = 14 + 4 + 20 + 8;

/// A link's rate and one-way propagation delay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct LinkSpec {
    /// Bits per second.
    pub rate_bps: u64,
    /// One-way propagation delay.
    pub delay_ns: u64,
}

/// RED-style ECN marking of a switch egress queue (bytes).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct EcnSpec {
    /// Below this queue no packet is marked.
    pub kmin: u64,
    /// Above this queue every packet is marked.
    pub kmax: u64,
    /// The marking probability at `kmax` (linear from `kmin`).
    pub pmax: f64,
}

/// A switch's buffer, marking and telemetry.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct SwitchSpec {
    /// Buffer per egress port in bytes; arrivals beyond it are dropped.
    pub buffer_bytes: u64,
    /// ECN marking (None: no marks).
    pub ecn: Option<EcnSpec>,
    /// Stamp HPCC INT records into packets that carry an INT stack.
    pub int: bool,
}

/// Counters and samples of one egress port.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct PortStats {
    /// Bytes sent.
    pub tx_bytes: u64,
    /// Packets sent.
    pub tx_packets: u64,
    /// Packets dropped (buffer full).
    pub drops: u64,
    /// Packets marked CE.
    pub ce_marks: u64,
    /// The longest queue in bytes.
    pub max_queue: u64,
    /// Queue length in bytes at every sampling tick (see [`Network::monitor`]).
    pub queue_samples: Vec<u64>,
}

/// A packet in flight: its wire bytes and what the network layer knows of it.
#[derive(Debug)]
pub(crate) struct Packet {
    pub data: Vec<u8>,
    pub dst: NodeId,
    pub ce: bool,
    pub hash: u64,
}

impl Packet {
    fn wire_len(&self) -> u64 {
        self.data.len() as u64 + WIRE_OVERHEAD
    }
}

/// One egress port: its link to a peer and its FIFO queue.
#[derive(Debug)]
pub(crate) struct Port {
    pub peer: (NodeId, usize),
    pub link: LinkSpec,
    pub queue: VecDeque<Packet>,
    pub qbytes: u64,
    pub busy: bool,
    /// A link that is down loses what is sent on it (a cut fiber: the sender does not know).
    pub up: bool,
    pub stats: PortStats,
}

impl Port {
    fn ser_ns(&self, bytes: u64) -> u64 {
        (bytes as u128 * 8_000_000_000 / self.link.rate_bps as u128) as u64
    }
}

struct Switch {
    spec: SwitchSpec,
    ports: Vec<Port>,
    /// Destination host -> the ports on its shortest paths (ECMP group).
    routes: HashMap<NodeId, Vec<usize>>,
}

enum Node {
    Host(Box<Host>),
    Switch(Switch),
}

enum Ev {
    Arrive { node: NodeId, pkt: Packet },
    PortFree { node: NodeId, port: usize },
    HostWake { node: NodeId },
    FlowStart { flow: FlowId },
    Sample,
}

struct Timed(Reverse<(u64, u64)>, Ev);
impl PartialEq for Timed {
    fn eq(&self, o: &Self) -> bool {
        self.0 == o.0
    }
}
impl Eq for Timed {}
impl PartialOrd for Timed {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Timed {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.0.cmp(&o.0)
    }
}

/// The simulated network.
pub struct Network {
    now: u64,
    seq: u64,
    events: BinaryHeap<Timed>,
    nodes: Vec<Node>,
    rng: StdRng,
    flows: Vec<host::Flow>,
    monitored: Vec<(NodeId, usize)>,
    sample_ns: u64,
    /// Bin width of per-flow received-byte series (0 = not recorded).
    pub rate_bin_ns: u64,
}

impl Network {
    /// An empty network; `seed` drives RED's marking decisions.
    pub fn new(seed: u64) -> Network {
        Network {
            now: 0,
            seq: 0,
            events: BinaryHeap::new(),
            nodes: Vec::new(),
            rng: StdRng::seed_from_u64(seed),
            flows: Vec::new(),
            monitored: Vec::new(),
            sample_ns: 0,
            rate_bin_ns: 0,
        }
    }

    /// The simulated time (ns).
    pub fn now(&self) -> u64 {
        self.now
    }

    /// Adds a host whose QPs use `qp` as their configuration (with the flow's algorithm) and
    /// `cc` as their algorithms' parameters.
    pub fn add_host(&mut self, qp: RcConfig, cc: &CcParams) -> NodeId {
        let id = self.nodes.len();
        self.nodes.push(Node::Host(Box::new(Host::new(id, qp, cc))));
        id
    }

    /// Adds a switch.
    pub fn add_switch(&mut self, spec: SwitchSpec) -> NodeId {
        self.nodes.push(Node::Switch(Switch {
            spec,
            ports: Vec::new(),
            routes: HashMap::new(),
        }));
        self.nodes.len() - 1
    }

    /// Connects two nodes with a full-duplex link; returns the port index on each side.
    pub fn connect(&mut self, a: NodeId, b: NodeId, link: LinkSpec) -> (usize, usize) {
        let pa = self.ports_of(a).len();
        let pb = self.ports_of(b).len() + usize::from(a == b);
        let port = |peer| Port {
            peer,
            link,
            queue: VecDeque::new(),
            qbytes: 0,
            busy: false,
            up: true,
            stats: PortStats::default(),
        };
        self.ports_mut(a).push(port((b, pb)));
        self.ports_mut(b).push(port((a, pa)));
        (pa, pb)
    }

    fn ports_of(&self, n: NodeId) -> &Vec<Port> {
        match &self.nodes[n] {
            Node::Host(h) => &h.ports,
            Node::Switch(s) => &s.ports,
        }
    }
    fn ports_mut(&mut self, n: NodeId) -> &mut Vec<Port> {
        match &mut self.nodes[n] {
            Node::Host(h) => &mut h.ports,
            Node::Switch(s) => &mut s.ports,
        }
    }

    /// Computes ECMP routes (all shortest paths) from every switch to every host. Call after
    /// the last `connect`.
    pub fn build_routes(&mut self) {
        let hosts: Vec<NodeId> = (0..self.nodes.len())
            .filter(|&n| matches!(self.nodes[n], Node::Host(_)))
            .collect();
        for &h in &hosts {
            // BFS distances to h
            let mut dist = vec![usize::MAX; self.nodes.len()];
            dist[h] = 0;
            let mut q = VecDeque::from([h]);
            while let Some(n) = q.pop_front() {
                for p in self.ports_of(n) {
                    let m = p.peer.0;
                    if dist[m] == usize::MAX {
                        dist[m] = dist[n] + 1;
                        // hosts do not forward
                        if matches!(self.nodes[m], Node::Switch(_)) {
                            q.push_back(m);
                        }
                    }
                }
            }
            for n in 0..self.nodes.len() {
                let next: Vec<usize> = self
                    .ports_of(n)
                    .iter()
                    .enumerate()
                    .filter(|(_, p)| dist[n] != usize::MAX && dist[p.peer.0] + 1 == dist[n])
                    .map(|(i, _)| i)
                    .collect();
                if let Node::Switch(s) = &mut self.nodes[n] {
                    s.routes.insert(h, next);
                }
            }
        }
    }

    /// Cuts (`up = false`) or restores the link from `node`'s `port` towards its peer (one
    /// direction: call it for the peer's port too to cut both).
    pub fn set_port_up(&mut self, node: NodeId, port: usize, up: bool) {
        self.ports_mut(node)[port].up = up;
    }

    /// Records the queue length of `node`'s egress `port` every `every_ns`.
    pub fn monitor(&mut self, node: NodeId, port: usize, every_ns: u64) {
        if self.monitored.is_empty() {
            self.schedule(0, Ev::Sample);
        }
        self.monitored.push((node, port));
        self.sample_ns = every_ns;
    }

    /// The counters and queue samples of an egress port.
    pub fn port_stats(&self, node: NodeId, port: usize) -> &PortStats {
        &self.ports_of(node)[port].stats
    }

    /// Delays the congestion feedback (CNPs, ACKs, GRANTs) a host receives by `ns`: added
    /// control-loop delay.
    pub fn set_feedback_delay(&mut self, host: NodeId, ns: u64) {
        if let Node::Host(h) = &mut self.nodes[host] {
            h.feedback_delay = ns;
        }
    }

    /// Makes flow `flow` (not started yet) use `n` paths with `policy` on both of its QPs.
    pub fn set_flow_paths(&mut self, flow: FlowId, n: usize, policy: crate::path::SprayPolicy) {
        self.flows[flow].paths = Some((n, policy));
    }

    /// Schedules a flow; it starts at `spec.start`.
    pub fn add_flow(&mut self, spec: FlowSpec) -> FlowId {
        let id = self.flows.len();
        let start = spec.start;
        self.flows.push(host::Flow::new(spec));
        self.schedule(start, Ev::FlowStart { flow: id });
        id
    }

    /// What every flow did so far.
    pub fn flow_results(&self) -> Vec<FlowResult> {
        self.flows.iter().map(|f| f.result()).collect()
    }

    fn schedule(&mut self, t: u64, ev: Ev) {
        self.seq += 1;
        self.events.push(Timed(Reverse((t, self.seq)), ev));
    }

    /// Runs events up to time `until` (ns); returns false if nothing was left to do.
    pub fn run_until(&mut self, until: u64) -> bool {
        while let Some(t) = self.events.peek() {
            let t = t.0 .0 .0;
            if t > until {
                self.now = until;
                return true;
            }
            let Some(Timed(_, ev)) = self.events.pop() else { break };
            self.now = t;
            self.handle(ev);
        }
        self.now = until;
        false
    }

    /// Runs until every flow finished or `limit` passed; returns whether all finished.
    pub fn run_flows(&mut self, limit: u64) -> bool {
        let step = 100_000;
        while self.now < limit {
            let t = (self.now + step).min(limit);
            self.run_until(t);
            if self.flows.iter().all(|f| f.done_at.is_some()) {
                return true;
            }
        }
        false
    }

    fn handle(&mut self, ev: Ev) {
        let now = self.now;
        match ev {
            Ev::Arrive { node, pkt } => match &mut self.nodes[node] {
                Node::Switch(s) => {
                    let Some(ports) = s.routes.get(&pkt.dst).filter(|p| !p.is_empty()) else {
                        return;
                    };
                    let port = ports[(pkt.hash % ports.len() as u64) as usize];
                    self.enqueue(node, port, pkt);
                }
                Node::Host(_) => self.host_receive(node, pkt),
            },
            Ev::PortFree { node, port } => {
                let p = &mut self.ports_mut(node)[port];
                p.busy = false;
                if let Some(pkt) = p.queue.pop_front() {
                    p.qbytes -= pkt.wire_len();
                    self.start_tx(node, port, pkt);
                } else if matches!(self.nodes[node], Node::Host(_)) {
                    self.host_pump(node);
                }
            }
            Ev::HostWake { node } => {
                if let Node::Host(h) = &mut self.nodes[node] {
                    if h.wake_at != Some(now) {
                        return;
                    }
                    h.wake_at = None;
                }
                self.host_timers(node);
                self.host_pump(node);
            }
            Ev::FlowStart { flow } => self.flow_start(flow),
            Ev::Sample => {
                for i in 0..self.monitored.len() {
                    let (n, p) = self.monitored[i];
                    let port = &mut self.ports_mut(n)[p];
                    port.stats.queue_samples.push(port.qbytes);
                }
                let next = now + self.sample_ns;
                self.schedule(next, Ev::Sample);
            }
        }
    }

    /// Queues a packet on a switch egress port (or drops it when the buffer is full).
    fn enqueue(&mut self, node: NodeId, port: usize, pkt: Packet) {
        let Node::Switch(s) = &mut self.nodes[node] else { return };
        if !s.ports[port].busy {
            self.start_tx(node, port, pkt);
            return;
        }
        let Node::Switch(s) = &mut self.nodes[node] else { return };
        let buffer = s.spec.buffer_bytes;
        let p = &mut s.ports[port];
        if p.qbytes + pkt.wire_len() > buffer {
            p.stats.drops += 1;
            return;
        }
        p.qbytes += pkt.wire_len();
        p.stats.max_queue = p.stats.max_queue.max(p.qbytes);
        p.queue.push_back(pkt);
    }

    /// Puts a packet on the wire of `node`'s `port`: a switch marks ECN and stamps INT here
    /// (dequeue time); the packet arrives at the peer after serialization and propagation.
    fn start_tx(&mut self, node: NodeId, port: usize, mut pkt: Packet) {
        let now = self.now;
        let mark = match &self.nodes[node] {
            Node::Switch(s) => {
                let q = s.ports[port].qbytes;
                match s.spec.ecn {
                    Some(e) if q > e.kmax => true,
                    Some(e) if q > e.kmin => {
                        let p = e.pmax * (q - e.kmin) as f64 / (e.kmax - e.kmin).max(1) as f64;
                        self.rng.random::<f64>() < p
                    }
                    _ => false,
                }
            }
            Node::Host(_) => false,
        };
        let (int, spec_int) = match &self.nodes[node] {
            Node::Switch(s) => (true, s.spec.int),
            Node::Host(_) => (false, false),
        };
        let p = &mut self.ports_mut(node)[port];
        if mark && !pkt.ce {
            pkt.ce = true;
            p.stats.ce_marks += 1;
        }
        let len = pkt.wire_len();
        if int && spec_int {
            // data-carrying requests (SEND/WRITE opcodes) only: not the ACKs that echo a stack
            let words = pkt.data.get(4).map_or(0, |b| b & 0x1F) as usize;
            let data = pkt.data.first().is_some_and(|&op| op <= Opcode::WriteOnlyWithImm as u8);
            if data && words * 4 == INT_STACK_LEN && pkt.data.len() >= 12 + INT_STACK_LEN {
                let hop = IntHop {
                    qlen: p.qbytes.min(u32::MAX as u64) as u32,
                    tx_bytes: (p.stats.tx_bytes + len) as u32,
                    ts_ns: now as u32,
                    rate_mbps: (p.link.rate_bps / 1_000_000) as u32,
                };
                IntStack::push_hop(&mut pkt.data[12..12 + INT_STACK_LEN], &hop);
            }
        }
        p.busy = true;
        p.stats.tx_bytes += len;
        p.stats.tx_packets += 1;
        let ser = p.ser_ns(len);
        let (peer, delay, up) = (p.peer.0, p.link.delay_ns, p.up);
        if !up {
            p.stats.drops += 1;
        }
        self.schedule(now + ser, Ev::PortFree { node, port });
        if up {
            self.schedule(now + ser + delay, Ev::Arrive { node: peer, pkt });
        }
    }
}

/// Topologies the experiments and tests use.
pub mod topo {
    use super::*;

    /// `n` hosts on one switch (a dumbbell's bottleneck is the port towards the receiver).
    pub fn star(
        net: &mut Network,
        n: usize,
        link: LinkSpec,
        sw: SwitchSpec,
        qp: RcConfig,
        cc: &CcParams,
    ) -> (Vec<NodeId>, NodeId) {
        let s = net.add_switch(sw);
        let hosts: Vec<NodeId> = (0..n)
            .map(|_| {
                let h = net.add_host(qp, cc);
                net.connect(h, s, link);
                h
            })
            .collect();
        net.build_routes();
        (hosts, s)
    }

    /// The shape of a two-tier leaf-spine.
    #[derive(Debug, Clone, Copy, serde::Serialize)]
    pub struct LeafSpine {
        /// Leaf switches.
        pub leaves: usize,
        /// Hosts per leaf.
        pub per_leaf: usize,
        /// Spine switches.
        pub spines: usize,
        /// Host to leaf links.
        pub host_link: LinkSpec,
        /// Leaf to spine links.
        pub fabric_link: LinkSpec,
        /// Every switch.
        pub switch: SwitchSpec,
    }

    /// A two-tier leaf-spine: `leaves × per_leaf` hosts, every leaf connected to every spine.
    pub fn leaf_spine(net: &mut Network, t: &LeafSpine, qp: RcConfig, cc: &CcParams) -> Vec<NodeId> {
        let spine: Vec<NodeId> = (0..t.spines).map(|_| net.add_switch(t.switch)).collect();
        let mut hosts = Vec::new();
        for _ in 0..t.leaves {
            let leaf = net.add_switch(t.switch);
            for &s in &spine {
                net.connect(leaf, s, t.fabric_link);
            }
            for _ in 0..t.per_leaf {
                let h = net.add_host(qp, cc);
                net.connect(h, leaf, t.host_link);
                hosts.push(h);
            }
        }
        net.build_routes();
        hosts
    }

    /// The egress port of switch `sw` that leads to host `h` (first ECMP choice).
    pub fn port_towards(net: &Network, sw: NodeId, h: NodeId) -> Option<usize> {
        match &net.nodes[sw] {
            Node::Switch(s) => s.routes.get(&h).and_then(|p| p.first().copied()),
            Node::Host(_) => None,
        }
    }
}

/// The experiments' scaled-down HPCC setup: links of `line_bps`, 1 KiB MTU, selective repeat, an
/// ACK per packet,
/// ECN at 40 KB / 160 KB with Pmax 0.2 per 10 Gbit/s (the HPCC ns-3 map, scaled with the rate),
/// a 500 KB buffer per port, INT on; and every algorithm's parameters scaled to the line rate and
/// the base RTT `base_rtt_ns`.
pub fn scaled_setup(line_bps: u64, base_rtt_ns: u64) -> (RcConfig, CcParams, SwitchSpec) {
    let qp = RcConfig {
        mtu: 1024,
        recovery: crate::transport::rc::Recovery::SelectiveRepeat,
        window_pkts: 1024,
        timeout_ns: 1_000_000,
        pacing_burst: 2048,
        // an ACK per packet, as in the HPCC ns-3 setup: delay samples then carry no coalescing
        ack_every: 1,
        ..RcConfig::default()
    };
    let mut cc = CcParams::default();
    let bytes = line_bps / 8;
    cc.set_line_rate(bytes);
    cc.dcqcn.min_rate = bytes / 1000;
    cc.timely.min_rate = bytes / 1000;
    cc.timely.min_rtt_ns = base_rtt_ns;
    cc.timely.t_low_ns = 4 * base_rtt_ns;
    cc.timely.t_high_ns = 40 * base_rtt_ns;
    cc.hpcc.base_rtt_ns = base_rtt_ns;
    // W_AI of 0.5 % of the line rate per RTT (50 Mbit/s at 10 Gbit/s): flows converge within
    // the experiments' milliseconds (the paper's 50 Mbit/s at 100 Gbit/s needs longer runs)
    cc.hpcc.rate_ai = bytes / 200;
    cc.homa.rtt_bytes = bytes * base_rtt_ns / 1_000_000_000;
    let scale = line_bps as f64 / 10e9;
    let sw = SwitchSpec {
        buffer_bytes: 500_000,
        ecn: Some(EcnSpec {
            kmin: (40_000.0 * scale) as u64,
            kmax: (160_000.0 * scale) as u64,
            pmax: 0.2,
        }),
        int: true,
    };
    (qp, cc, sw)
}
