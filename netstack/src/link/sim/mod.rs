//! A deterministic simulated network for the whole stack: the engine's real data cores send
//! and receive through [`SimLink`]s attached to one [`SimNet`], which carries datagrams between
//! addresses with a propagation delay, a line rate per port and seeded faults, and keeps the
//! simulated clock the engines read. Nothing runs on its own: [`SimNet::step`] runs every
//! attached core at the current time until none has work, then moves the clock to the next
//! event (a datagram's arrival or a core's deadline). One thread, one seed, one outcome: two
//! runs of the same seed deliver the same datagrams at the same times, which
//! [`SimNet::trace_hash`] condenses.
//!
//! Faults: random loss, duplication, corruption (one flipped bit, which the ICRC catches) and
//! reordering (a random extra delay per datagram, `jitter_ns`), ECN CE marks on datagrams that
//! queued for their port's line past a threshold (or on every datagram of a source,
//! [`SimNet::set_ce_marking`]), hosts that take their datagrams in late with the arrival time as
//! the receive timestamp ([`SimNet::set_host_wait`]), partitions between two hosts
//! and cuts of one path (datagrams from one source port), each for a stretch of simulated
//! time; paths of their own length ([`SimNet::set_path_delay`]) and paths gone black both ways
//! until brought back ([`SimNet::set_down`]). [`SimNet::pcap`] records what is delivered as
//! Ethernet/IPv4/UDP frames for tshark or Wireshark, and [`SimNet::record`] keeps what is sent
//! and what is dropped for a test's checks.
//!
//! The network is one big switch with a line per sending port, or a fabric of output-queued
//! switches with ECN marking, INT stamping and ECMP between the hosts attached to it
//! ([`SimNet::add_switch`], [`SimNet::attach_host`], [`SimNet::connect`]; the `fabric` module).
//!
//! Two ways to drive it: engines' cores attached as [`Node`]s and run by [`SimNet::step`]
//! (the whole stack; [`SimNet::step_until`] when the driver has events of its own), or a
//! driver that runs sans-IO endpoints itself and moves datagrams with [`SimNet::send`],
//! [`SimNet::recv`] and [`SimNet::advance`] (the congestion-control experiments' hosts in
//! `crate::sim`).

mod fabric;

pub use fabric::{EcnSpec, LinkSpec, PortId, PortStats, SwitchId, SwitchSpec, WIRE_OVERHEAD};

use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};
use std::io::{self, Write};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::sys::{OutMsg, RecvBatch, SendScratch};

/// Datagrams an address may have waiting before more are dropped (a socket's receive buffer).
const INBOX_LIMIT: usize = 4096;

/// The random faults of a simulated network and its timing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Faults {
    /// Probability that a datagram is lost.
    pub loss: f64,
    /// Probability that a datagram is delivered twice.
    pub duplicate: f64,
    /// Probability that a datagram has one bit flipped.
    pub corrupt: f64,
    /// One-way propagation delay (ns).
    pub delay_ns: u64,
    /// Up to this much extra delay per datagram, drawn uniformly (ns): datagrams overtake one
    /// another when it exceeds their spacing.
    pub jitter_ns: u64,
    /// Line rate of each port in bits per second (0: unlimited).
    pub rate_bps: u64,
    /// The IP MTU of every route.
    pub mtu: u32,
    /// A datagram that waits longer than this for its port's line (ns) arrives marked
    /// congestion experienced (ECN CE), as a switch marks above a queue threshold; 0: never.
    pub ecn_mark_ns: u64,
}

impl Default for Faults {
    fn default() -> Faults {
        Faults {
            loss: 0.0,
            duplicate: 0.0,
            corrupt: 0.0,
            delay_ns: 5_000,
            jitter_ns: 0,
            rate_bps: 25_000_000_000,
            mtu: 1500,
            ecn_mark_ns: 0,
        }
    }
}

/// What the network did, counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimStats {
    /// Datagrams handed to the network.
    pub sent: u64,
    /// Datagrams delivered to an address (duplicates included).
    pub delivered: u64,
    /// Lost at random.
    pub lost: u64,
    /// Delivered a second time.
    pub duplicated: u64,
    /// Delivered with a bit flipped.
    pub corrupted: u64,
    /// Dropped by a partition or a path cut.
    pub blocked: u64,
    /// Sent to an address nobody holds, or to a full inbox.
    pub unroutable: u64,
    /// Marked congestion experienced (by a port's line wait or a fabric's switch).
    pub ce_marked: u64,
    /// Lost in a fabric: a switch buffer full, a link down, no route.
    pub fabric_drops: u64,
}

impl std::ops::AddAssign for SimStats {
    /// Adds another network's counts (totals over many runs).
    fn add_assign(&mut self, o: SimStats) {
        self.sent += o.sent;
        self.delivered += o.delivered;
        self.lost += o.lost;
        self.duplicated += o.duplicated;
        self.corrupted += o.corrupted;
        self.blocked += o.blocked;
        self.unroutable += o.unroutable;
        self.ce_marked += o.ce_marked;
        self.fabric_drops += o.fabric_drops;
    }
}

/// A core attached to the network: [`SimNet::step`] runs it.
pub trait Node: Send {
    /// Runs one pass (at the network's current time, which the core reads from its clock):
    /// whether it did anything, and the time it must run again by.
    fn run(&mut self) -> (bool, Option<u64>);
    /// Whether it still exists (a node whose context was dropped is detached).
    fn alive(&self) -> bool;
}

/// A datagram on its way.
#[derive(Debug)]
struct Datagram {
    src: SocketAddrV4,
    dst: SocketAddrV4,
    /// The IP TOS byte it carries (its low two bits: ECN).
    tos: u8,
    /// When it reached its destination host, once it has and waits there to be taken in
    /// ([`SimNet::set_host_wait`]).
    arrived: Option<u64>,
    data: Vec<u8>,
}

/// What happens at a moment of simulated time.
#[derive(Debug)]
enum Ev {
    /// A datagram reaches its destination address.
    Deliver(Datagram),
    /// A datagram reaches a fabric switch.
    AtSwitch(SwitchId, Datagram),
    /// A fabric switch's port finished sending a datagram.
    PortFree(SwitchId, usize),
    /// The monitored queues are sampled.
    Sample,
}

struct Timed {
    at: u64,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Timed {
    fn eq(&self, o: &Timed) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Timed {}
impl PartialOrd for Timed {
    fn partial_cmp(&self, o: &Timed) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Timed {
    fn cmp(&self, o: &Timed) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(o.at, o.seq))
    }
}

/// The events to come, in time order (ties in the order they were scheduled).
#[derive(Default)]
struct Schedule {
    seq: u64,
    heap: BinaryHeap<Reverse<Timed>>,
}

impl Schedule {
    fn at(&mut self, at: u64, ev: Ev) {
        self.seq += 1;
        self.heap.push(Reverse(Timed { at, seq: self.seq, ev }));
    }

    fn next_at(&self) -> Option<u64> {
        self.heap.peek().map(|t| t.0.at)
    }
}

/// A stretch of time during which some datagrams are dropped.
#[derive(Debug, Clone, Copy)]
enum Block {
    /// Between two hosts, both ways.
    Partition(Ipv4Addr, Ipv4Addr, u64),
    /// From one source address (one path of a sprayed QP).
    Cut(SocketAddrV4, u64),
    /// From and to one address (a path gone black, both ways), until lifted.
    Down(SocketAddrV4),
}

/// What [`SimNet::record`] keeps: every datagram put on the wire, and those the network
/// dropped (loss, a partition, a cut, a path down), each as (source, destination, bytes).
#[derive(Debug, Default, Clone)]
pub struct Records {
    /// Sent, before any fault.
    pub sent: Vec<(SocketAddrV4, SocketAddrV4, Vec<u8>)>,
    /// Dropped.
    pub dropped: Vec<(SocketAddrV4, SocketAddrV4, Vec<u8>)>,
}

/// A datagram in an address's inbox: its source, IP TOS byte, when it arrived (0 unless its
/// host takes datagrams in late, [`SimNet::set_host_wait`]) and its bytes.
type Waiting = (SocketAddrV4, u8, u64, Vec<u8>);

struct NetState {
    rng: StdRng,
    faults: Faults,
    events: Schedule,
    fabric: fabric::Fabric,
    /// Each linked address's datagrams waiting.
    inboxes: BTreeMap<SocketAddrV4, VecDeque<Waiting>>,
    /// When each sending port's line is free again (serialization at `rate_bps`).
    line_free: BTreeMap<SocketAddrV4, u64>,
    blocks: Vec<Block>,
    /// Extra one-way delay of datagrams from or to an address (a longer path).
    extra_delay: BTreeMap<SocketAddrV4, u64>,
    /// Sources whose every datagram arrives marked congestion experienced.
    ce_from: std::collections::BTreeSet<SocketAddrV4>,
    /// How long datagrams wait at their destination address before it takes them in.
    host_wait: BTreeMap<SocketAddrV4, u64>,
    records: Option<Records>,
    stats: SimStats,
    trace: u64,
    pcap: Option<io::BufWriter<std::fs::File>>,
}

/// The simulated network and clock. Shared (`Arc`) by the links attached to it.
pub struct SimNet {
    /// Simulated time (ns). Starts at 1 s, so that no deadline is 0.
    clock: AtomicU64,
    state: Mutex<NetState>,
    nodes: Mutex<Vec<Box<dyn Node>>>,
    /// The seed it was made with (what simulated contexts derive their identifiers from).
    seed: u64,
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

fn fnv(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(FNV_PRIME);
    }
    h
}

fn addr_bytes(a: SocketAddrV4) -> [u8; 6] {
    let [a0, a1, a2, a3] = a.ip().octets();
    let [p0, p1] = a.port().to_be_bytes();
    [a0, a1, a2, a3, p0, p1]
}

impl SimNet {
    /// A network whose random choices all come from `seed`.
    pub fn new(seed: u64, faults: Faults) -> Arc<SimNet> {
        Arc::new(SimNet {
            clock: AtomicU64::new(1_000_000_000),
            state: Mutex::new(NetState {
                rng: StdRng::seed_from_u64(seed),
                faults,
                events: Schedule::default(),
                fabric: fabric::Fabric::default(),
                inboxes: BTreeMap::new(),
                line_free: BTreeMap::new(),
                blocks: Vec::new(),
                extra_delay: BTreeMap::new(),
                ce_from: Default::default(),
                host_wait: BTreeMap::new(),
                records: None,
                stats: SimStats::default(),
                trace: FNV_OFFSET,
                pcap: None,
            }),
            nodes: Mutex::new(Vec::new()),
            seed,
        })
    }

    /// The seed the network was made with: simulated contexts derive their QPNs, initial PSNs
    /// and memory keys from it (and their address), never from the OS, so a seed replays.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The simulated clock (ns).
    pub fn now(&self) -> u64 {
        self.clock.load(Ordering::Acquire)
    }

    /// The faults in force.
    pub fn faults(&self) -> Faults {
        self.state.lock().faults
    }

    /// Drops every datagram between hosts `a` and `b` for the next `ns` nanoseconds.
    pub fn partition(&self, a: Ipv4Addr, b: Ipv4Addr, ns: u64) {
        let until = self.now() + ns;
        self.state.lock().blocks.push(Block::Partition(a, b, until));
    }

    /// Drops every datagram sent from `src` (one path) for the next `ns` nanoseconds.
    pub fn cut(&self, src: SocketAddrV4, ns: u64) {
        let until = self.now() + ns;
        self.state.lock().blocks.push(Block::Cut(src, until));
    }

    /// What the network did so far.
    pub fn stats(&self) -> SimStats {
        let s = self.state.lock();
        SimStats {
            fabric_drops: s.fabric.drops,
            ce_marked: s.stats.ce_marked + s.fabric.marks,
            ..s.stats
        }
    }

    /// Adds a switch to the fabric.
    pub fn add_switch(&self, spec: SwitchSpec) -> SwitchId {
        self.state.lock().fabric.add_switch(spec)
    }

    /// Attaches host `ip` to switch `sw` over a link: from then on every datagram from an
    /// address of `ip` leaves through its NIC at the link's rate and crosses the fabric to its
    /// destination host (which must be attached too). Returns the switch's port toward it.
    pub fn attach_host(&self, ip: Ipv4Addr, sw: SwitchId, link: LinkSpec) -> usize {
        self.state.lock().fabric.attach(ip, sw, link)
    }

    /// Links two switches; returns the port index on each side.
    pub fn connect(&self, a: SwitchId, b: SwitchId, link: LinkSpec) -> (usize, usize) {
        self.state.lock().fabric.connect(a, b, link)
    }

    /// Seeds the fabric's ECMP hash (0 unless set): which route each flow takes changes with
    /// it, as between two switch vendors' hash functions.
    pub fn set_ecmp_seed(&self, seed: u64) {
        self.state.lock().fabric.ecmp_seed = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }

    /// Computes the fabric's ECMP routes (all shortest paths) toward every attached host.
    /// Call after the last [`SimNet::attach_host`] and [`SimNet::connect`].
    pub fn build_routes(&self) {
        self.state.lock().fabric.build_routes();
    }

    /// Takes a fabric port's link down (what is sent on it is lost; the sender does not know)
    /// or brings it back. One direction: the peer's port is another [`PortId`].
    pub fn set_port_up(&self, port: PortId, up: bool) {
        self.state.lock().fabric.set_up(port, up);
    }

    /// A fabric port's counters and queue samples (default for a port that does not exist).
    pub fn port_stats(&self, port: PortId) -> PortStats {
        self.state.lock().fabric.stats(port).cloned().unwrap_or_default()
    }

    /// The first port of switch `sw`'s ECMP group toward host `ip`.
    pub fn route(&self, sw: SwitchId, ip: Ipv4Addr) -> Option<usize> {
        self.state.lock().fabric.route(sw, ip)
    }

    /// Records the queue length of switch `sw`'s `port` every `every_ns` from now on.
    pub fn monitor(&self, sw: SwitchId, port: usize, every_ns: u64) {
        let now = self.now();
        let mut s = self.state.lock();
        if s.fabric.monitor(sw, port, every_ns) {
            s.events.at(now, Ev::Sample);
        }
    }

    /// When the line that datagrams from `src` leave on is free: its host's NIC in a fabric,
    /// else the port's own line (now or earlier: free).
    pub fn line_free_at(&self, src: SocketAddrV4) -> u64 {
        let s = self.state.lock();
        s.fabric
            .line_free(src.ip())
            .unwrap_or_else(|| s.line_free.get(&src).copied().unwrap_or(0))
    }

    /// A hash of every delivery so far (time, source, destination, bytes): two runs of one
    /// seed must end with the same hash.
    pub fn trace_hash(&self) -> u64 {
        self.state.lock().trace
    }

    /// Records every datagram delivered from now on to a pcap file at `path`.
    pub fn pcap(&self, path: &std::path::Path) -> io::Result<()> {
        let mut w = io::BufWriter::new(std::fs::File::create(path)?);
        // classic pcap, microsecond timestamps, Ethernet frames
        w.write_all(&0xa1b2_c3d4u32.to_le_bytes())?;
        w.write_all(&2u16.to_le_bytes())?;
        w.write_all(&4u16.to_le_bytes())?;
        w.write_all(&[0; 8])?;
        w.write_all(&65_535u32.to_le_bytes())?;
        w.write_all(&1u32.to_le_bytes())?;
        self.state.lock().pcap = Some(w);
        Ok(())
    }

    /// A link with one port per address of `addrs`; a port of 0 picks a free one. Fails with
    /// `AddrInUse` for an address another link holds.
    pub fn link(self: &Arc<SimNet>, addrs: &[SocketAddrV4]) -> io::Result<SimLink> {
        let mut s = self.state.lock();
        let mut taken = Vec::new();
        for &a in addrs {
            let mut a = a;
            if a.port() == 0 {
                let mut port = 40_000u16;
                while s.inboxes.contains_key(&SocketAddrV4::new(*a.ip(), port))
                    || taken.contains(&SocketAddrV4::new(*a.ip(), port))
                {
                    port = port
                        .checked_add(1)
                        .ok_or_else(|| io::Error::new(io::ErrorKind::AddrInUse, "no free simulated port"))?;
                }
                a.set_port(port);
            } else if s.inboxes.contains_key(&a) || taken.contains(&a) {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!("simulated address {a} is held"),
                ));
            }
            taken.push(a);
        }
        for &a in &taken {
            s.inboxes.insert(a, VecDeque::new());
        }
        Ok(SimLink {
            net: self.clone(),
            addrs: taken,
        })
    }

    /// Changes the faults and timing for datagrams sent from now on (those in flight keep
    /// theirs).
    pub fn set_faults(&self, faults: Faults) {
        self.state.lock().faults = faults;
    }

    /// Datagrams from or to `addr` take `ns` longer on their way (a longer path; 0: none).
    pub fn set_path_delay(&self, addr: SocketAddrV4, ns: u64) {
        self.state.lock().extra_delay.insert(addr, ns);
    }

    /// Marks every datagram sent from `src` congestion experienced (ECN CE) while `on`: a queue
    /// on its path that stays above its marking threshold, however slowly `src` sends. Counted
    /// in [`SimStats::ce_marked`].
    pub fn set_ce_marking(&self, src: SocketAddrV4, on: bool) {
        let mut s = self.state.lock();
        if on {
            s.ce_from.insert(src);
        } else {
            s.ce_from.remove(&src);
        }
    }

    /// Datagrams that arrive at `addr` are taken in by its receiver `ns` later (0: at once),
    /// with their arrival time as the receive timestamp ([`RecvBatch::arrived`]): a host that
    /// runs its receive path late (a thread waiting for a core), as a kernel's timestamps show.
    pub fn set_host_wait(&self, addr: SocketAddrV4, ns: u64) {
        self.state.lock().host_wait.insert(addr, ns);
    }

    /// Drops every datagram from or to `addr` (a path gone black, both ways) while `down`.
    pub fn set_down(&self, addr: SocketAddrV4, down: bool) {
        let mut s = self.state.lock();
        s.blocks.retain(|b| !matches!(*b, Block::Down(a) if a == addr));
        if down {
            s.blocks.push(Block::Down(addr));
        }
    }

    /// Starts keeping [`Records`] of what is sent and dropped from now on.
    pub fn record(&self) {
        self.state.lock().records.get_or_insert_with(Records::default);
    }

    /// What was recorded since [`SimNet::record`] (empty when not recording).
    pub fn records(&self) -> Records {
        self.state.lock().records.clone().unwrap_or_default()
    }

    /// Puts one datagram from `src` to `dst` on the wire now, for a driver that sends without
    /// a [`SimLink`] (a sans-IO endpoint driven by a test). `dst` must be a linked address.
    pub fn send(&self, src: SocketAddrV4, dst: SocketAddrV4, data: Vec<u8>) {
        self.transmit(src, dst, data);
    }

    /// The next datagram delivered to `at` (a linked address), with its source.
    pub fn recv(&self, at: SocketAddrV4) -> Option<(SocketAddrV4, Vec<u8>)> {
        self.recv_ecn(at).map(|(src, _, d)| (src, d))
    }

    /// The next datagram delivered to `at` (a linked address), with its source and whether it
    /// arrived marked congestion experienced.
    pub fn recv_ecn(&self, at: SocketAddrV4) -> Option<(SocketAddrV4, bool, Vec<u8>)> {
        let mut s = self.state.lock();
        s.inboxes
            .get_mut(&at)?
            .pop_front()
            .map(|(src, tos, _, d)| (src, tos & 3 == 3, d))
    }

    /// The linked addresses that have datagrams waiting, in address order.
    pub fn ready(&self) -> Vec<SocketAddrV4> {
        let s = self.state.lock();
        s.inboxes
            .iter()
            .filter(|(_, q)| !q.is_empty())
            .map(|(&a, _)| a)
            .collect()
    }

    /// When the next event happens: a datagram's arrival, or a fabric's own step (a switch
    /// port finishing a datagram, a queue sample).
    pub fn next_arrival(&self) -> Option<u64> {
        self.state.lock().events.next_at()
    }

    /// Moves the clock to `t` (never back) and delivers what has arrived by then, for a driver
    /// that runs its endpoints itself rather than through [`SimNet::step`].
    pub fn advance(&self, t: u64) {
        let now = self.clock.fetch_max(t, Ordering::AcqRel).max(t);
        self.deliver_due(now);
    }

    /// Attaches a core: [`SimNet::step`] runs it from now on.
    pub fn attach(&self, node: Box<dyn Node>) {
        self.nodes.lock().push(node);
    }

    /// Runs every attached core at the current time until none has work and no datagram is
    /// due, then moves the clock to the next event. Returns false when nothing is left to
    /// happen (no datagram in flight, no deadline).
    pub fn step(&self) -> bool {
        self.step_capped(None)
    }

    /// [`SimNet::step`], but the clock moves at most to `deadline` (and to it when nothing is
    /// scheduled before): a driver's own events, such as a storage node's group commit or a
    /// test's next action, then happen on time. Returns whether a datagram or a core's deadline
    /// is still scheduled.
    pub fn step_until(&self, deadline: u64) -> bool {
        self.step_capped(Some(deadline))
    }

    /// One step; with `cap`, the clock moves no further than it.
    fn step_capped(&self, cap: Option<u64>) -> bool {
        let now = self.now();
        let mut nodes = self.nodes.lock();
        nodes.retain(|n| n.alive());
        let mut next = None;
        for _ in 0..10_000 {
            let delivered = self.deliver_due(now);
            let mut work = false;
            next = None;
            for n in nodes.iter_mut() {
                let (w, d) = n.run();
                work |= w;
                next = earliest(next, d);
            }
            if !work && !delivered {
                break;
            }
        }
        drop(nodes);
        let arrival = self.state.lock().events.next_at();
        let scheduled = earliest(next, arrival);
        if let Some(t) = earliest(scheduled, cap) {
            self.clock.store(t.max(now + 1), Ordering::Release);
        }
        scheduled.is_some()
    }

    /// Steps until `until` returns true or `ns` of simulated time pass; returns whether
    /// `until` held.
    pub fn run_until(&self, ns: u64, mut until: impl FnMut() -> bool) -> bool {
        let end = self.now() + ns;
        loop {
            if until() {
                return true;
            }
            if self.now() >= end {
                return false;
            }
            if !self.step() {
                // nothing scheduled: time passes to the end
                self.clock.fetch_max(end, Ordering::AcqRel);
            }
        }
    }

    /// Runs the events whose time has come: datagrams into their inboxes, fabric steps;
    /// returns whether a datagram was delivered.
    fn deliver_due(&self, now: u64) -> bool {
        let mut s = self.state.lock();
        let s = &mut *s;
        let mut any = false;
        while s.events.next_at().is_some_and(|t| t <= now) {
            let Some(Reverse(Timed { at, ev, .. })) = s.events.heap.pop() else {
                break;
            };
            let f = match ev {
                Ev::Deliver(mut d) => {
                    // a host that takes its datagrams in late: it arrived now, it is read later
                    let wait = s.host_wait.get(&d.dst).copied().unwrap_or(0);
                    if wait > 0 && d.arrived.is_none() {
                        d.arrived = Some(at);
                        s.events.at(at + wait, Ev::Deliver(d));
                        continue;
                    }
                    d
                }
                Ev::AtSwitch(sw, d) => {
                    s.fabric.arrive(at, sw, d, &mut s.events, &mut s.rng);
                    continue;
                }
                Ev::PortFree(sw, port) => {
                    s.fabric.port_free(at, sw, port, &mut s.events, &mut s.rng);
                    continue;
                }
                Ev::Sample => {
                    s.fabric.sample(at, &mut s.events);
                    continue;
                }
            };
            any = true;
            let mut h = fnv(s.trace, &at.to_le_bytes());
            h = fnv(h, &addr_bytes(f.src));
            h = fnv(h, &addr_bytes(f.dst));
            h = fnv(h, &[f.tos]);
            s.trace = fnv(h, &f.data);
            if let Some(w) = s.pcap.as_mut() {
                let _ = write_frame(w, at, f.src, f.dst, &f.data);
            }
            match s.inboxes.get_mut(&f.dst) {
                Some(q) if q.len() < INBOX_LIMIT => {
                    q.push_back((f.src, f.tos, f.arrived.unwrap_or(0), f.data));
                    s.stats.delivered += 1;
                }
                _ => s.stats.unroutable += 1,
            }
        }
        any
    }

    /// Puts one datagram on the wire at `now`, with the faults drawn for it.
    fn transmit(&self, src: SocketAddrV4, dst: SocketAddrV4, data: Vec<u8>) {
        let now = self.now();
        let mut s = self.state.lock();
        let s = &mut *s;
        s.stats.sent += 1;
        s.blocks.retain(|b| match *b {
            Block::Partition(_, _, until) | Block::Cut(_, until) => until > now,
            Block::Down(_) => true,
        });
        let blocked = s.blocks.iter().any(|b| match *b {
            Block::Partition(a, b, _) => (*src.ip() == a && *dst.ip() == b) || (*src.ip() == b && *dst.ip() == a),
            Block::Cut(c, _) => c == src,
            Block::Down(d) => d == src || d == dst,
        });
        if let Some(r) = s.records.as_mut() {
            r.sent.push((src, dst, data.clone()));
        }
        let f = s.faults;
        let fabric = s.fabric.is_host(src.ip());
        // without a fabric: serialization on the sending port's line, then propagation (a
        // fabric host's NIC serializes in the fabric, after the faults below)
        let (waited, depart) = if fabric {
            (0, now)
        } else {
            let wire = (data.len() as u64 + WIRE_OVERHEAD) * 8;
            let tx_ns = (wire * 1_000_000_000).checked_div(f.rate_bps).unwrap_or(0);
            let free = s.line_free.entry(src).or_insert(0);
            let waited = (*free).saturating_sub(now);
            let depart = (*free).max(now) + tx_ns;
            *free = depart;
            (waited, depart)
        };
        // ECT(0), or CE past the marking threshold (or from a source marked always)
        let tos = if (f.ecn_mark_ns > 0 && waited > f.ecn_mark_ns) || s.ce_from.contains(&src) {
            s.stats.ce_marked += 1;
            3
        } else {
            2
        };
        if blocked {
            s.stats.blocked += 1;
            if let Some(r) = s.records.as_mut() {
                r.dropped.push((src, dst, data));
            }
            return;
        }
        if s.rng.random_bool(f.loss.clamp(0.0, 1.0)) {
            s.stats.lost += 1;
            if let Some(r) = s.records.as_mut() {
                r.dropped.push((src, dst, data));
            }
            return;
        }
        let mut data = data;
        if !data.is_empty() && s.rng.random_bool(f.corrupt.clamp(0.0, 1.0)) {
            let bit = s.rng.random_range(0..data.len() * 8);
            data[bit / 8] ^= 1 << (bit % 8);
            s.stats.corrupted += 1;
        }
        let copies = if s.rng.random_bool(f.duplicate.clamp(0.0, 1.0)) {
            s.stats.duplicated += 1;
            2
        } else {
            1
        };
        for k in 0..copies {
            let jitter = if f.jitter_ns > 0 {
                s.rng.random_range(0..=f.jitter_ns)
            } else {
                0
            };
            let extra = s.extra_delay.get(&src).copied().unwrap_or(0) + s.extra_delay.get(&dst).copied().unwrap_or(0);
            let d = Datagram {
                src,
                dst,
                tos,
                arrived: None,
                data: if k + 1 == copies {
                    std::mem::take(&mut data)
                } else {
                    data.clone()
                },
            };
            if fabric {
                // the fabric's own propagation delays replace the network's
                s.fabric.send_from_host(now, d, extra + jitter, &mut s.events);
            } else {
                s.events.at(depart + f.delay_ns + extra + jitter, Ev::Deliver(d));
            }
        }
    }
}

fn earliest(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    [a, b].into_iter().flatten().min()
}

/// One pcap record: the datagram in an Ethernet/IPv4/UDP frame (zero MACs, DF set, no UDP
/// checksum: RoCEv2's ICRC covers the payload).
fn write_frame(w: &mut impl Write, at: u64, src: SocketAddrV4, dst: SocketAddrV4, data: &[u8]) -> io::Result<()> {
    let ip_len = 20 + 8 + data.len();
    let frame = 14 + ip_len;
    w.write_all(&((at / 1_000_000_000) as u32).to_le_bytes())?;
    w.write_all(&(((at % 1_000_000_000) / 1_000) as u32).to_le_bytes())?;
    w.write_all(&(frame as u32).to_le_bytes())?;
    w.write_all(&(frame as u32).to_le_bytes())?;
    let mut eth = [0u8; 14];
    eth[12..].copy_from_slice(&0x0800u16.to_be_bytes());
    w.write_all(&eth)?;
    let mut ip = [0u8; 20];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&(ip_len as u16).to_be_bytes());
    ip[6] = 0x40; // don't fragment
    ip[8] = 64;
    ip[9] = 17;
    ip[12..16].copy_from_slice(&src.ip().octets());
    ip[16..20].copy_from_slice(&dst.ip().octets());
    let mut sum: u32 = ip.chunks(2).map(|c| u16::from_be_bytes([c[0], c[1]]) as u32).sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    ip[10..12].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    w.write_all(&ip)?;
    w.write_all(&src.port().to_be_bytes())?;
    w.write_all(&dst.port().to_be_bytes())?;
    w.write_all(&((8 + data.len()) as u16).to_be_bytes())?;
    w.write_all(&[0, 0])?;
    w.write_all(data)?;
    w.flush()
}

/// A data core's ports on a [`SimNet`].
pub struct SimLink {
    net: Arc<SimNet>,
    addrs: Vec<SocketAddrV4>,
}

impl Drop for SimLink {
    fn drop(&mut self) {
        let mut s = self.net.state.lock();
        for a in &self.addrs {
            s.inboxes.remove(a);
        }
    }
}

impl super::Link for SimLink {
    fn ports(&self) -> usize {
        self.addrs.len()
    }
    fn local_addr(&self, port: usize) -> SocketAddrV4 {
        self.addrs[port]
    }
    fn send(&self, port: usize, msgs: &mut [OutMsg], _scratch: &mut SendScratch) -> io::Result<usize> {
        let src = self.addrs[port];
        for m in msgs.iter() {
            let mut bytes = Vec::new();
            m.gather(&mut bytes);
            let dst = m.destination();
            if m.gso == 0 {
                self.net.transmit(src, dst, bytes);
            } else {
                for seg in bytes.chunks(m.gso as usize) {
                    self.net.transmit(src, dst, seg.to_vec());
                }
            }
        }
        Ok(msgs.len())
    }
    fn recv(&self, port: usize, batch: &mut RecvBatch) -> io::Result<usize> {
        let mut s = self.net.state.lock();
        let Some(q) = s.inboxes.get_mut(&self.addrs[port]) else {
            return Ok(0);
        };
        let k = q.len().min(batch.capacity());
        let n = batch.fill(
            q.iter()
                .take(k)
                .map(|(src, tos, at, d)| (*src, *tos, *at, d.as_slice())),
        );
        q.drain(..n);
        Ok(n)
    }
    fn wait_fd(&self, _port: usize) -> Option<RawFd> {
        None
    }
    fn route_mtu(&self, _to: SocketAddrV4) -> Option<u32> {
        Some(self.net.state.lock().faults.mtu)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::Link;

    fn addr(s: &str) -> SocketAddrV4 {
        s.parse().expect("an address")
    }

    fn quiet() -> Faults {
        Faults {
            delay_ns: 1_000,
            rate_bps: 0,
            ..Faults::default()
        }
    }

    #[test]
    fn a_source_marked_always_arrives_ce_until_unmarked() {
        let net = SimNet::new(1, quiet());
        let (a, b) = (addr("10.0.0.1:1"), addr("10.0.0.2:1"));
        let _ports = net.link(&[a, b]).unwrap();
        let t0 = net.now();
        net.set_ce_marking(a, true);
        net.send(a, b, vec![1]);
        net.send(b, a, vec![2]);
        net.advance(t0 + 1_000);
        assert_eq!(net.recv_ecn(b), Some((a, true, vec![1])), "from the marked source");
        assert_eq!(net.recv_ecn(a), Some((b, false, vec![2])), "the other way: unmarked");
        net.set_ce_marking(a, false);
        net.send(a, b, vec![3]);
        net.advance(t0 + 2_000);
        assert_eq!(net.recv_ecn(b), Some((a, false, vec![3])));
        assert_eq!(net.stats().ce_marked, 1);
    }

    #[test]
    fn a_capped_step_stops_the_clock_at_its_deadline() {
        let net = SimNet::new(3, quiet());
        let (a, b) = (addr("10.0.0.1:1"), addr("10.0.0.2:1"));
        let _ports = net.link(&[a, b]).unwrap();
        let t0 = net.now();
        net.send(a, b, vec![9]);
        // the datagram arrives at t0 + 1 us: a step capped before stops there, undelivered
        assert!(net.step_until(t0 + 400), "the datagram is still in flight");
        assert_eq!(net.now(), t0 + 400);
        assert_eq!(net.recv(b), None);
        // capped after: the clock goes to the arrival, not to the cap
        assert!(net.step_until(t0 + 50_000));
        assert_eq!(net.now(), t0 + 1_000);
        // the next step delivers it; nothing is left, so the clock goes to the cap
        assert!(!net.step_until(t0 + 50_000), "nothing scheduled");
        assert_eq!(net.now(), t0 + 50_000);
        assert_eq!(net.recv(b), Some((a, vec![9])));
        // uncapped, a step with nothing scheduled leaves the clock alone
        assert!(!net.step());
        assert_eq!(net.now(), t0 + 50_000);
    }

    #[test]
    fn a_host_that_waits_takes_datagrams_in_late_with_their_arrival_time() {
        let net = SimNet::new(2, quiet());
        let (a, b) = (addr("10.0.0.1:1"), addr("10.0.0.2:1"));
        let ports = net.link(&[a, b]).unwrap();
        net.set_host_wait(b, 5_000);
        let t0 = net.now();
        net.send(a, b, vec![7; 10]);
        net.send(b, a, vec![8; 10]);
        // arrived at 1 us: the waiting host has nothing to read yet, the other reads its own
        net.advance(t0 + 1_000);
        let mut batch = RecvBatch::new(4, 2048);
        assert_eq!(ports.recv(1, &mut batch).unwrap(), 0, "taken in only after the wait");
        assert_eq!(ports.recv(0, &mut batch).unwrap(), 1);
        assert_eq!(batch.arrived(0), None, "no wait, no timestamp: read at once");
        assert_eq!(net.next_arrival(), Some(t0 + 6_000), "the late read is an event");
        net.advance(t0 + 6_000);
        assert_eq!(ports.recv(1, &mut batch).unwrap(), 1);
        assert_eq!(batch.get(0).0, Some(&[7u8; 10][..]));
        assert_eq!(batch.arrived(0), Some(t0 + 1_000), "stamped when it arrived");
        assert_eq!(net.stats().delivered, 2);
    }
}
