//! A switched fabric inside a [`SimNet`](super::SimNet): hosts' addresses attached to
//! output-queued switches, and links between switches. Each link has a rate and a one-way
//! propagation delay; each switch egress port a FIFO with a byte limit, RED ECN marking
//! evaluated at dequeue (as in the HPCC ns-3 model), HPCC INT stamped at dequeue into packets
//! that carry an INT stack (the bytes the testbed's eBPF program rewrites), and ECMP over all
//! shortest paths by a hash of the datagram's addresses and ports (so each source port of a
//! sprayed QP is its own flow). A host's NIC serializes its datagrams at its link's rate.
//!
//! Without a fabric a [`SimNet`](super::SimNet) is one big switch with a line per sending port;
//! with one, datagrams between attached hosts cross the switches, queue and are marked there,
//! after the network's random faults (loss, duplication, corruption, jitter) were drawn at the
//! sending host.

use flexns_proto::cc::header::{IntHop, IntStack, INT_STACK_LEN};
use flexns_proto::wire::Opcode;
use rand::rngs::StdRng;
use rand::Rng;
use std::collections::{BTreeMap, VecDeque};
use std::net::Ipv4Addr;

use super::{Datagram, Ev, Schedule};

/// Bytes a datagram occupies on a link beyond its UDP payload (Ethernet + FCS + IPv4 + UDP).
pub const WIRE_OVERHEAD: u64 = 14 + 4 + 20 + 8;

/// A switch of a fabric (its index, in the order added).
pub type SwitchId = usize;

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
    /// Bytes sent (with [`WIRE_OVERHEAD`]).
    pub tx_bytes: u64,
    /// Datagrams sent.
    pub tx_packets: u64,
    /// Datagrams dropped (buffer full, or the link is down).
    pub drops: u64,
    /// Datagrams marked CE.
    pub ce_marks: u64,
    /// The longest queue in bytes.
    pub max_queue: u64,
    /// Queue length in bytes at every sampling tick (see [`SimNet::monitor`](super::SimNet::monitor)).
    pub queue_samples: Vec<u64>,
}

/// An egress port of the fabric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortId {
    /// A switch's port (in the order its links were connected).
    Switch(SwitchId, usize),
    /// An attached host's NIC (its one link, toward its switch).
    Host(Ipv4Addr),
}

/// What is at the other end of a link.
#[derive(Debug, Clone, Copy)]
enum Peer {
    Switch(SwitchId),
    Host,
}

#[derive(Debug)]
struct Port {
    peer: Peer,
    link: LinkSpec,
    queue: VecDeque<Datagram>,
    qbytes: u64,
    busy: bool,
    /// A link that is down loses what is sent on it (a cut fiber: the sender does not know).
    up: bool,
    stats: PortStats,
}

impl Port {
    fn new(peer: Peer, link: LinkSpec) -> Port {
        Port {
            peer,
            link,
            queue: VecDeque::new(),
            qbytes: 0,
            busy: false,
            up: true,
            stats: PortStats::default(),
        }
    }

    fn ser_ns(&self, bytes: u64) -> u64 {
        ser_ns(self.link, bytes)
    }
}

/// How long `bytes` take to serialize on `link`.
fn ser_ns(link: LinkSpec, bytes: u64) -> u64 {
    (bytes as u128 * 8_000_000_000 / link.rate_bps.max(1) as u128) as u64
}

/// A host's attachment: its NIC, whose datagrams queue implicitly behind `free_at` (the host
/// sends one when its line frees), and the switch its link leads to.
#[derive(Debug)]
struct Nic {
    switch: SwitchId,
    link: LinkSpec,
    /// A NIC whose link is down loses what it sends.
    up: bool,
    stats: PortStats,
    /// When its line is free again.
    free_at: u64,
}

#[derive(Debug)]
struct Switch {
    spec: SwitchSpec,
    ports: Vec<Port>,
    /// Destination host -> the ports on its shortest paths (ECMP group).
    routes: BTreeMap<Ipv4Addr, Vec<usize>>,
}

/// The fabric's switches, links and attached hosts.
#[derive(Debug, Default)]
pub(super) struct Fabric {
    switches: Vec<Switch>,
    hosts: BTreeMap<Ipv4Addr, Nic>,
    monitored: Vec<(SwitchId, usize)>,
    sample_ns: u64,
    /// Datagrams lost in the fabric: a full buffer, a link down, no route.
    pub(super) drops: u64,
    /// Datagrams its switches marked CE.
    pub(super) marks: u64,
    /// Mixed into every ECMP hash (a switch vendor's hash seed).
    pub(super) ecmp_seed: u64,
}

fn wire_len(d: &Datagram) -> u64 {
    d.data.len() as u64 + WIRE_OVERHEAD
}

/// The ECMP hash of a datagram: its addresses and ports with a seed (SplitMix64's finalizer
/// over them).
fn flow_hash(d: &Datagram, seed: u64) -> u64 {
    let mut z = ((u32::from(*d.src.ip()) as u64) << 32 | u32::from(*d.dst.ip()) as u64) ^ seed;
    z ^= ((d.src.port() as u64) << 16 | d.dst.port() as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Fabric {
    pub(super) fn add_switch(&mut self, spec: SwitchSpec) -> SwitchId {
        self.switches.push(Switch {
            spec,
            ports: Vec::new(),
            routes: BTreeMap::new(),
        });
        self.switches.len() - 1
    }

    /// Attaches host `ip` to switch `sw`; returns the switch's port toward it.
    pub(super) fn attach(&mut self, ip: Ipv4Addr, sw: SwitchId, link: LinkSpec) -> usize {
        let s = &mut self.switches[sw];
        s.ports.push(Port::new(Peer::Host, link));
        let port = s.ports.len() - 1;
        self.hosts.insert(
            ip,
            Nic {
                switch: sw,
                link,
                up: true,
                stats: PortStats::default(),
                free_at: 0,
            },
        );
        // the switch's port toward the host is found by the host's address
        self.switches[sw].routes.insert(ip, vec![port]);
        port
    }

    /// Links two switches; returns the port index on each side.
    pub(super) fn connect(&mut self, a: SwitchId, b: SwitchId, link: LinkSpec) -> (usize, usize) {
        let pa = self.switches[a].ports.len();
        self.switches[a].ports.push(Port::new(Peer::Switch(b), link));
        let pb = self.switches[b].ports.len();
        self.switches[b].ports.push(Port::new(Peer::Switch(a), link));
        (pa, pb)
    }

    /// Computes the ECMP groups (all shortest paths) of every switch toward every host.
    pub(super) fn build_routes(&mut self) {
        let hosts: Vec<(Ipv4Addr, SwitchId)> = self.hosts.iter().map(|(&ip, n)| (ip, n.switch)).collect();
        for (ip, home) in hosts {
            // switch hops to the host's switch
            let mut dist = vec![usize::MAX; self.switches.len()];
            dist[home] = 0;
            let mut q = VecDeque::from([home]);
            while let Some(s) = q.pop_front() {
                for p in &self.switches[s].ports {
                    if let Peer::Switch(m) = p.peer {
                        if dist[m] == usize::MAX {
                            dist[m] = dist[s] + 1;
                            q.push_back(m);
                        }
                    }
                }
            }
            for s in 0..self.switches.len() {
                if s == home || dist[s] == usize::MAX {
                    continue;
                }
                let next: Vec<usize> = (self.switches[s].ports.iter().enumerate())
                    .filter(|(_, p)| matches!(p.peer, Peer::Switch(m) if dist[m] + 1 == dist[s]))
                    .map(|(i, _)| i)
                    .collect();
                self.switches[s].routes.insert(ip, next);
            }
        }
    }

    pub(super) fn is_host(&self, ip: &Ipv4Addr) -> bool {
        self.hosts.contains_key(ip)
    }

    pub(super) fn set_up(&mut self, p: PortId, up: bool) {
        let flag = match p {
            PortId::Switch(s, i) => self
                .switches
                .get_mut(s)
                .and_then(|s| s.ports.get_mut(i))
                .map(|p| &mut p.up),
            PortId::Host(ip) => self.hosts.get_mut(&ip).map(|n| &mut n.up),
        };
        if let Some(f) = flag {
            *f = up;
        }
    }

    pub(super) fn stats(&self, p: PortId) -> Option<&PortStats> {
        match p {
            PortId::Switch(s, i) => self.switches.get(s)?.ports.get(i).map(|p| &p.stats),
            PortId::Host(ip) => self.hosts.get(&ip).map(|n| &n.stats),
        }
    }

    /// The first port of switch `sw`'s ECMP group toward host `ip`.
    pub(super) fn route(&self, sw: SwitchId, ip: Ipv4Addr) -> Option<usize> {
        self.switches.get(sw)?.routes.get(&ip)?.first().copied()
    }

    /// Samples the queue of switch `sw`'s `port` every `every_ns`; true for the first monitored
    /// port (the caller schedules the first sample).
    pub(super) fn monitor(&mut self, sw: SwitchId, port: usize, every_ns: u64) -> bool {
        self.monitored.push((sw, port));
        self.sample_ns = every_ns.max(1);
        self.monitored.len() == 1
    }

    pub(super) fn sample(&mut self, now: u64, sched: &mut Schedule) {
        for &(s, p) in &self.monitored {
            let port = &mut self.switches[s].ports[p];
            port.stats.queue_samples.push(port.qbytes);
        }
        sched.at(now + self.sample_ns, Ev::Sample);
    }

    /// When host `ip`'s line is free again (None: not attached).
    pub(super) fn line_free(&self, ip: &Ipv4Addr) -> Option<u64> {
        self.hosts.get(ip).map(|n| n.free_at)
    }

    /// Sends a datagram from its host's NIC at `now` (behind what the NIC is still sending);
    /// it reaches the host's switch after serialization, `extra_ns` and propagation, or is
    /// lost when the NIC's link is down.
    pub(super) fn send_from_host(&mut self, now: u64, d: Datagram, extra_ns: u64, sched: &mut Schedule) {
        let Some(nic) = self.hosts.get_mut(d.src.ip()) else {
            self.drops += 1;
            return;
        };
        let len = wire_len(&d);
        let depart = nic.free_at.max(now) + ser_ns(nic.link, len);
        nic.free_at = depart;
        nic.stats.tx_bytes += len;
        nic.stats.tx_packets += 1;
        if !nic.up {
            nic.stats.drops += 1;
            self.drops += 1;
            return;
        }
        sched.at(depart + nic.link.delay_ns + extra_ns, Ev::AtSwitch(nic.switch, d));
    }

    /// A datagram reaches switch `sw`: it takes one of the ports of its destination's ECMP
    /// group (by its flow hash), or is dropped when there is none.
    pub(super) fn arrive(&mut self, now: u64, sw: SwitchId, d: Datagram, sched: &mut Schedule, rng: &mut StdRng) {
        let Some(ports) = self.switches[sw].routes.get(d.dst.ip()).filter(|p| !p.is_empty()) else {
            self.drops += 1;
            return;
        };
        let port = ports[(flow_hash(&d, self.ecmp_seed) % ports.len() as u64) as usize];
        let s = &mut self.switches[sw];
        let buffer = s.spec.buffer_bytes;
        let p = &mut s.ports[port];
        if !p.busy {
            self.start_tx(now, sw, port, d, sched, rng);
            return;
        }
        if p.qbytes + wire_len(&d) > buffer {
            p.stats.drops += 1;
            self.drops += 1;
            return;
        }
        p.qbytes += wire_len(&d);
        p.stats.max_queue = p.stats.max_queue.max(p.qbytes);
        p.queue.push_back(d);
    }

    /// Switch `sw`'s `port` finished a datagram: the next one in its queue goes.
    pub(super) fn port_free(&mut self, now: u64, sw: SwitchId, port: usize, sched: &mut Schedule, rng: &mut StdRng) {
        let p = &mut self.switches[sw].ports[port];
        p.busy = false;
        if let Some(d) = p.queue.pop_front() {
            p.qbytes -= wire_len(&d);
            self.start_tx(now, sw, port, d, sched, rng);
        }
    }

    /// Puts a datagram on the wire of switch `sw`'s `port`: marked and stamped here (dequeue
    /// time), it reaches the peer after serialization and propagation.
    fn start_tx(
        &mut self,
        now: u64,
        sw: SwitchId,
        port: usize,
        mut d: Datagram,
        sched: &mut Schedule,
        rng: &mut StdRng,
    ) {
        let s = &mut self.switches[sw];
        let p = &mut s.ports[port];
        let q = p.qbytes;
        let mark = match s.spec.ecn {
            Some(e) if q > e.kmax => true,
            Some(e) if q > e.kmin => {
                let prob = e.pmax * (q - e.kmin) as f64 / (e.kmax - e.kmin).max(1) as f64;
                rng.random::<f64>() < prob
            }
            _ => false,
        };
        // ECN-capable (ECT) datagrams are marked; not-ECT ones pass unmarked
        if mark && d.tos & 3 != 0 && d.tos & 3 != 3 {
            d.tos |= 3;
            p.stats.ce_marks += 1;
            self.marks += 1;
        }
        let len = wire_len(&d);
        if s.spec.int {
            // data-carrying requests (SEND/WRITE opcodes) only: not the ACKs that echo a stack
            let words = d.data.get(4).map_or(0, |b| b & 0x1F) as usize;
            let data = d.data.first().is_some_and(|&op| op <= Opcode::WriteOnlyWithImm as u8);
            if data && words * 4 == INT_STACK_LEN && d.data.len() >= 12 + INT_STACK_LEN {
                let hop = IntHop {
                    qlen: q.min(u32::MAX as u64) as u32,
                    tx_bytes: (p.stats.tx_bytes + len) as u32,
                    ts_ns: now as u32,
                    rate_mbps: (p.link.rate_bps / 1_000_000) as u32,
                };
                IntStack::push_hop(&mut d.data[12..12 + INT_STACK_LEN], &hop);
            }
        }
        p.busy = true;
        p.stats.tx_bytes += len;
        p.stats.tx_packets += 1;
        let done = now + p.ser_ns(len);
        sched.at(done, Ev::PortFree(sw, port));
        if !p.up {
            p.stats.drops += 1;
            self.drops += 1;
            return;
        }
        let at = done + p.link.delay_ns;
        match p.peer {
            Peer::Switch(m) => sched.at(at, Ev::AtSwitch(m, d)),
            Peer::Host => sched.at(at, Ev::Deliver(d)),
        }
    }
}
