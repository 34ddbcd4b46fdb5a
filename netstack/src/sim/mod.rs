//! The congestion-control experiments' harness: hosts whose RC QPs run flows (an application
//! that keeps WRITEs outstanding until its bytes are acknowledged) over a switched fabric of
//! the one simulated network, [`SimNet`] (`link::sim`): output-queued switches with a buffer
//! per port, ECN marking (RED between `kmin` and `kmax`, evaluated at dequeue as in the HPCC
//! ns-3 model), HPCC INT stamping at dequeue, and ECMP by each datagram's addresses and ports.
//! A host's NIC serializes its QPs' packets round-robin at its link's rate; each path of a
//! sprayed QP is a source port of its own, so the switches hash it onto its own route.
//!
//! The transport and congestion-control state machines are the real ones (they are sans-IO)
//! and the packets are their wire bytes (headers, CC header, payload, ICRC), so a switch
//! rewrites the INT stack in place exactly where the testbed's eBPF program does. Runs are
//! reproducible from a seed (RED's coin flips are the only randomness, and the network's
//! faults when a caller sets some with [`Network::set_faults`]).
//!
//! Used by `flexns ccsim` (the congestion-control experiments) and by the tests.

mod host;

pub use crate::link::sim::{EcnSpec, LinkSpec, PortStats, SwitchSpec, WIRE_OVERHEAD};
pub use host::{FlowId, FlowResult, FlowSpec};

use crate::cc::CcParams;
use crate::link::sim::{Faults, PortId, SimNet, SwitchId};
use crate::transport::rc::RcConfig;
use host::Host;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Arc;

/// A node: a host or a switch.
pub type NodeId = usize;

enum Node {
    Host(Box<Host>),
    Switch(SwitchId),
}

/// The simulated network of an experiment: its nodes, flows and the [`SimNet`] they run on.
pub struct Network {
    net: Arc<SimNet>,
    /// The network's clock when this was made: an experiment's times count from it.
    base: u64,
    nodes: Vec<Node>,
    flows: Vec<host::Flow>,
    /// Flows not started yet, by start time.
    starts: BinaryHeap<Reverse<(u64, FlowId)>>,
    /// Bin width of per-flow received-byte series (0 = not recorded).
    pub rate_bin_ns: u64,
}

impl Network {
    /// An empty network; `seed` drives RED's marking decisions.
    pub fn new(seed: u64) -> Network {
        let faults = Faults {
            delay_ns: 0,
            rate_bps: 0,
            ..Faults::default()
        };
        let net = SimNet::new(seed, faults);
        Network {
            base: net.now(),
            net,
            nodes: Vec::new(),
            flows: Vec::new(),
            starts: BinaryHeap::new(),
            rate_bin_ns: 0,
        }
    }

    /// The simulated time (ns) since the network was made.
    pub fn now(&self) -> u64 {
        self.net.now() - self.base
    }

    /// The network it runs on (its statistics, pcap, faults).
    pub fn sim(&self) -> &Arc<SimNet> {
        &self.net
    }

    /// Random faults (loss, duplication, corruption, jitter) drawn at the sending hosts for
    /// what they send from now on; the fabric's links keep their own rates and delays.
    pub fn set_faults(&self, loss: f64, duplicate: f64, corrupt: f64, jitter_ns: u64) {
        self.net.set_faults(Faults {
            loss,
            duplicate,
            corrupt,
            jitter_ns,
            ..self.net.faults()
        });
    }

    /// Adds a host whose QPs use `qp` as their configuration (with the flow's algorithm) and
    /// `cc` as their algorithms' parameters. It joins the fabric when connected to a switch.
    pub fn add_host(&mut self, qp: RcConfig, cc: &CcParams) -> NodeId {
        let id = self.nodes.len();
        let host = Host::new(id, &self.net, qp, cc);
        self.nodes.push(Node::Host(Box::new(host)));
        id
    }

    /// Adds a switch.
    pub fn add_switch(&mut self, spec: SwitchSpec) -> NodeId {
        self.nodes.push(Node::Switch(self.net.add_switch(spec)));
        self.nodes.len() - 1
    }

    /// Connects two nodes with a full-duplex link; returns the port index on each side (a
    /// host has one port, 0).
    ///
    /// # Panics
    ///
    /// When both are hosts (hosts connect through switches), or a host is connected twice.
    pub fn connect(&mut self, a: NodeId, b: NodeId, link: LinkSpec) -> (usize, usize) {
        match (&self.nodes[a], &self.nodes[b]) {
            (Node::Switch(x), Node::Switch(y)) => self.net.connect(*x, *y, link),
            (Node::Host(h), Node::Switch(s)) => {
                assert!(!h.attached, "host {a} is connected already");
                let p = self.net.attach_host(*h.addr().ip(), *s, link);
                host::host(self, a).attached = true;
                (0, p)
            }
            (Node::Switch(_), Node::Host(_)) => {
                let (h, s) = self.connect(b, a, link);
                (s, h)
            }
            (Node::Host(_), Node::Host(_)) => panic!("hosts {a} and {b}: hosts connect through switches"),
        }
    }

    /// Computes ECMP routes (all shortest paths) from every switch to every host. Call after
    /// the last `connect`.
    pub fn build_routes(&mut self) {
        self.net.build_routes();
    }

    fn port(&self, node: NodeId, port: usize) -> PortId {
        match &self.nodes[node] {
            Node::Switch(s) => PortId::Switch(*s, port),
            Node::Host(h) => PortId::Host(*h.addr().ip()),
        }
    }

    /// Cuts (`up = false`) or restores the link from `node`'s `port` towards its peer (one
    /// direction: call it for the peer's port too to cut both).
    pub fn set_port_up(&mut self, node: NodeId, port: usize, up: bool) {
        self.net.set_port_up(self.port(node, port), up);
    }

    /// Records the queue length of switch `node`'s egress `port` every `every_ns`.
    pub fn monitor(&mut self, node: NodeId, port: usize, every_ns: u64) {
        if let Node::Switch(s) = self.nodes[node] {
            self.net.monitor(s, port, every_ns);
        }
    }

    /// The counters and queue samples of an egress port.
    pub fn port_stats(&self, node: NodeId, port: usize) -> PortStats {
        self.net.port_stats(self.port(node, port))
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
        self.flows.push(host::Flow::new(spec));
        self.starts.push(Reverse((spec.start, id)));
        id
    }

    /// Packets the hosts dropped: a bad ICRC (corrupted on the way), malformed, or for a QP
    /// whose flow has ended (a late duplicate).
    pub fn dropped_packets(&self) -> u64 {
        (self.nodes.iter())
            .map(|n| match n {
                Node::Host(h) => h.dropped,
                Node::Switch(_) => 0,
            })
            .sum()
    }

    /// What every flow did so far.
    pub fn flow_results(&self) -> Vec<FlowResult> {
        self.flows.iter().map(|f| f.result()).collect()
    }

    /// Runs up to time `until` (ns since the network was made); returns false if nothing was
    /// left to do.
    pub fn run_until(&mut self, until: u64) -> bool {
        let end = self.base + until;
        loop {
            let now = self.net.now();
            while let Some(&Reverse((start, id))) = self.starts.peek() {
                if self.base + start > now {
                    break;
                }
                self.starts.pop();
                self.flow_start(id);
            }
            self.run_hosts(now);
            let wake = self.nodes.iter().filter_map(|n| match n {
                Node::Host(h) => h.next_at,
                Node::Switch(_) => None,
            });
            let next = wake
                .chain(self.net.next_arrival())
                .chain(self.starts.peek().map(|Reverse((t, _))| self.base + t))
                .min();
            match next {
                Some(t) if t <= end => self.net.advance(t.max(now + 1)),
                other => {
                    self.net.advance(end);
                    return other.is_some();
                }
            }
        }
    }

    /// Runs until every flow finished or `limit` passed; returns whether all finished.
    pub fn run_flows(&mut self, limit: u64) -> bool {
        let step = 100_000;
        while self.now() < limit {
            let t = (self.now() + step).min(limit);
            self.run_until(t);
            if self.flows.iter().all(|f| f.done_at.is_some()) {
                return true;
            }
        }
        false
    }

    /// Runs the hosts that have datagrams waiting or a deadline due at `now`.
    fn run_hosts(&mut self, now: u64) {
        let ready = self.net.ready();
        for n in 0..self.nodes.len() {
            let Node::Host(h) = &self.nodes[n] else { continue };
            if h.next_at.is_some_and(|t| t <= now) || ready.binary_search(&h.addr()).is_ok() {
                self.host_run(n, now);
            }
        }
    }
}

/// Topologies the experiments and tests use.
pub mod topo {
    use super::{CcParams, LinkSpec, Network, Node, NodeId, RcConfig, SwitchSpec};

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
        match (&net.nodes[sw], &net.nodes[h]) {
            (Node::Switch(s), Node::Host(h)) => net.net.route(*s, *h.addr().ip()),
            _ => None,
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
