//! The engine: a data-core thread that owns a link and drives the QPs' transport state machines
//! (receive, dispatch, timers, transmit) and delivers completions to completion queues.
//!
//! Applications reach it only through QP handles (posting marks a QP active and wakes the engine
//! if it said it sleeps) and completion queues. Payload bytes move once: from registered memory
//! to the socket as an iovec on transmit, from the receive buffer into registered memory on
//! receive.

mod cq;
mod deadlines;
pub(crate) mod drive;
pub(crate) mod solar;
pub(crate) mod sq;
mod stats;

pub(crate) use cq::CqShared;
pub use stats::StatsSnapshot;
pub(crate) use stats::{Counter, EngineStats};

use crate::config::ContextConfig;
pub use crate::config::{Drive, PollMode};
use crate::link::sys::{self, EventFd, OutMsg, RecvBatch};
use crate::link::udp::UdpLink;
use crate::mem::MrTable;
use crate::pipe::{self, Consumer, Producer};
use crate::transport::rc::{QpState, RcQp};
use crate::transport::TxPacket;
use crate::wire::{icrc, PacketView, MAX_DATAGRAM, PAD_ZEROS};
use parking_lot::{Mutex, RwLock};
use std::collections::{HashMap, HashSet, VecDeque};
use std::net::SocketAddrV4;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often a data core reads every QP's deadline afresh (nanoseconds): a safety net only. It
/// learns deadlines from the QPs it touches, and from `EngineShared::rearm`, where application
/// and offload threads leave every QP whose timers they may have changed (sends, control
/// operations). A scan locks every QP: at 1 ms, 10,000 QPs spent the core on scanning.
const DEADLINE_SCAN_NS: u64 = 100_000_000;

/// Receive buffers per recvmmsg call (at most).
pub(crate) const BATCH: usize = 64;
/// Deadlines closer than this are waited for without sleeping (adaptive mode). A sleep with
/// the data cores' 1 µs timer slack wakes within a few microseconds of its deadline; spinning
/// longer than this would take the CPU from the threads that have work (a congestion-control
/// timer every 55 µs would otherwise keep an idle core spinning).
const NEAR_DEADLINE_NS: u64 = 20_000;
/// Slots of each data core's shared send queue.
pub(crate) const SQ_SLOTS: usize = 8192;
/// Work requests moved from the send queue per engine loop.
const SQ_DRAIN: usize = 256;
/// Packets gathered before a send (several GSO messages of up to 15 packets of 4 KiB).
pub(crate) const TX_BATCH: usize = 256;

/// What an application handle may read about its QP without taking the QP's lock: its state
/// and how many send WQEs have left the send queue. The engine refreshes it after every change.
#[derive(Default)]
pub(crate) struct QpMirror {
    pub state: AtomicU8,
    pub retired: AtomicU64,
}

impl QpMirror {
    pub(crate) fn state(&self) -> QpState {
        match self.state.load(Ordering::Acquire) {
            0 => QpState::Reset,
            1 => QpState::Init,
            2 => QpState::Rtr,
            3 => QpState::Rts,
            _ => QpState::Err,
        }
    }
}

/// A QP as the engine holds it.
pub(crate) struct QpSlot {
    pub qp: RcQp,
    pub remote: Option<SocketAddrV4>,
    /// Multipath: for each of the QP's paths, the data core's socket it leaves from (an index
    /// into [`EngineShared::tx_links`]) and the peer's address it goes to; empty means path 0
    /// only (the core's main socket to `remote`).
    pub routes: Vec<(usize, SocketAddrV4)>,
    /// Other addresses the peer sends this QP's packets from (its path sockets).
    pub peer_sources: Vec<SocketAddrV4>,
    pub send_cq: Arc<CqShared>,
    pub recv_cq: Arc<CqShared>,
    pub mirror: Arc<QpMirror>,
    /// A managed QP's fetch state (RedN programs); `None` for ordinary QPs.
    pub chain: Option<crate::chain::ChainRunner>,
}

impl QpSlot {
    /// The socket (index into the core's `tx_links`) and destination of path `path`.
    pub(crate) fn route(&self, path: u8) -> Option<(usize, SocketAddrV4)> {
        match self.routes.get(path as usize).or(self.routes.first()) {
            Some(&r) => Some(r),
            None => self.remote.map(|r| (0, r)),
        }
    }

    /// Whether a packet from `src` may be this QP's peer.
    pub(crate) fn accepts(&self, src: SocketAddrV4) -> bool {
        self.remote == Some(src) || self.peer_sources.contains(&src)
    }

    /// Refreshes the mirror the application reads (state, retired WQEs). Any thread may call it.
    pub(crate) fn sync_mirror(&self) {
        let st = match self.qp.state() {
            QpState::Reset => 0,
            QpState::Init => 1,
            QpState::Rtr => 2,
            QpState::Rts => 3,
            QpState::Err => 4,
        };
        self.mirror.state.store(st, Ordering::Release);
        self.mirror.retired.store(self.qp.retired_sends(), Ordering::Release);
    }

    /// Moves the transport's completions into the completion queues' pipes of data core
    /// `core`. Only that core's thread calls it. Returns false when a CQ was full: the rest
    /// stays in the transport, in order, for a later call.
    pub(crate) fn deliver_completions(&mut self, core: usize) -> bool {
        self.sync_mirror();
        while let Some(wc) = self.qp.peek_completion() {
            let recv = matches!(
                wc.opcode,
                crate::work::WcOpcode::Recv | crate::work::WcOpcode::RecvRdmaWithImm
            );
            let cq = if recv { &self.recv_cq } else { &self.send_cq };
            if cq.push(core, std::iter::once(wc)) == 0 {
                return false;
            }
            self.qp.poll_completion();
        }
        true
    }
}

/// State of one data core shared between its thread and application handles.
pub(crate) struct EngineShared {
    pub mrs: Arc<MrTable>,
    pub qps: RwLock<HashMap<u32, Arc<Mutex<QpSlot>>>>,
    /// The shared send queue of this core (producers serialize on the lock).
    pub sq: Mutex<Producer<sq::Slot>>,
    /// Every socket the core sends from: for each local address (`bind`, then `extra_addrs`),
    /// its main socket followed by `path_ports - 1` sockets on free ports (source-port entropy
    /// for ECMP). Index `addr * path_ports + port`.
    pub tx_links: Vec<Arc<UdpLink>>,
    /// Source ports per local address (`path_ports`).
    pub path_ports: usize,
    /// Wakes the thread for control events (stop).
    wake: EventFd,
    stop: AtomicBool,
    pub stats: EngineStats,
    /// CQ counters and managed QPs of the context (shared by its cores), and the guards.
    pub redn: Arc<crate::chain::RednRegistry>,
    pub guards: crate::config::RednGuards,
    /// Managed QPs this core runs.
    pub managed: Mutex<Vec<u32>>,
    /// QPs that sent from an application or offload thread ([`EngineShared::transmit_now`]):
    /// the data core arms their timers.
    rearm: Mutex<Vec<u32>>,
    /// Commands to the core's Solar endpoints ([`EngineShared::solar_command`]).
    solar: solar::SolarHost,
    local: SocketAddrV4,
    epoch: Instant,
    /// CLOCK_MONOTONIC at `epoch`, so the transports' clock is the host's monotonic clock.
    epoch_ns: u64,
}

impl EngineShared {
    /// Asks the data core to deliver the completions an application thread left in `qpn`'s
    /// transport (only data-core threads write completion pipes).
    pub(crate) fn poke(&self, qpn: u32) {
        let mut slots = Vec::with_capacity(1);
        sq::encode_poke(qpn, &mut slots);
        let mut q = self.sq.lock();
        while !sq::push_all(&mut q, &slots) {
            q.notify();
            std::thread::yield_now();
        }
        q.notify();
    }

    /// Sends what `slot`'s QP has to send right now from the calling thread (the low-latency
    /// path: no handoff to the data core). The caller holds the QP's lock, so the QP's packets
    /// leave in order; whatever the socket does not take is left to the data core's timers.
    pub(crate) fn transmit_now(&self, slot: &mut QpSlot) -> usize {
        if slot.remote.is_none() {
            return 0;
        }
        let now = self.now();
        let mut total = 0;
        // everything the window allows, 16 packets per system call; later packets are sent by
        // the data core as acknowledgements open the window
        loop {
            let mut out: smallvec::SmallVec<[Outgoing; 16]> = smallvec::SmallVec::new();
            while out.len() < 16 {
                match slot.qp.poll_transmit(now) {
                    Some(p) => {
                        let Some((link, dst)) = slot.route(p.path) else { break };
                        out.push(Outgoing::new(
                            p,
                            link,
                            self.tx_links[link].local_addr(),
                            dst,
                            &self.stats,
                        ))
                    }
                    None => break,
                }
            }
            // one system call per run of packets from one socket
            if out.is_empty() {
                if total > 0 {
                    // the retransmission timer the packets armed is the data core's to run
                    self.rearm(slot.qp.qpn());
                }
                return total;
            }
            let mut msgs: smallvec::SmallVec<[OutMsg; 16]> = out
                .iter()
                .map(|o| {
                    let mut m = OutMsg::new(&o.dst);
                    // SAFETY: `out` is borrowed, neither moved nor changed, until `msgs` is sent
                    // below and dropped at the end of this pass.
                    unsafe { o.push_spans(&mut m) };
                    m
                })
                .collect();
            let mut sent = 0;
            let mut full = false;
            for run in out.chunk_by(|a, b| a.link == b.link) {
                let k = run.len();
                let n = self.tx_links[run[0].link]
                    .send_batch(&mut msgs[sent..sent + k])
                    .unwrap_or(0);
                for o in &run[..n] {
                    self.stats.tx_packets.inc();
                    self.stats.tx_messages.inc();
                    self.stats.tx_bytes.add(o.wire_len() as u64);
                }
                sent += k;
                total += n;
                full |= n < k;
            }
            if full {
                // a socket is full: the transport's retransmission timer recovers the rest
                self.rearm(slot.qp.qpn());
                return total;
            }
        }
    }

    /// QP `qpn`'s timers may have changed outside this core (a control operation of an
    /// application thread): the core reads its deadline at its next pass.
    pub(crate) fn rearm(&self, qpn: u32) {
        self.rearm.lock().push(qpn);
    }

    /// The transports' clock: CLOCK_MONOTONIC in nanoseconds (shared by all processes on the
    /// host, so a CNP's CE timestamp can be compared by its receiver).
    pub(crate) fn now(&self) -> u64 {
        self.epoch_ns + self.epoch.elapsed().as_nanos() as u64
    }
    pub(crate) fn local_addr(&self) -> SocketAddrV4 {
        self.local
    }
}

/// A running engine thread.
pub(crate) struct Engine {
    cores: Vec<Arc<EngineShared>>,
    threads: Vec<std::thread::JoinHandle<()>>,
    /// The cores, when application threads run them ([`Drive::Application`]).
    drive: Option<Arc<drive::AppDrive>>,
}

impl Engine {
    /// Binds one link per data core and starts the data-core threads (or, run to completion,
    /// the backstop threads). Core `i` binds the configured address with port `port + i` (or a
    /// free port when the port is 0).
    pub(crate) fn start(cfg: &ContextConfig, mrs: Arc<MrTable>) -> std::io::Result<Engine> {
        let redn = Arc::new(crate::chain::RednRegistry::default());
        let epoch = Instant::now();
        let epoch_ns = sys::monotonic_ns();
        let mut e = Engine {
            cores: Vec::new(),
            threads: Vec::new(),
            drive: None,
        };
        let mut app_cores = Vec::new();
        for i in 0..cfg.data_cores.max(1) {
            let mut bind = cfg.bind;
            if bind.port() != 0 {
                bind.set_port(bind.port() + i as u16);
            }
            let ports = cfg.path_ports.max(1) as usize;
            let mut tx_links = Vec::new();
            for ip in std::iter::once(*bind.ip()).chain(cfg.extra_addrs.iter().copied()) {
                for j in 0..ports {
                    // the main socket on the configured port, the others on free ports
                    let port = if j == 0 { bind.port() } else { 0 };
                    let l = UdpLink::bind(SocketAddrV4::new(ip, port))?;
                    if cfg.gro && j == 0 {
                        l.set_gro(true)?;
                    }
                    if cfg.ecn {
                        l.set_ecn()?;
                    }
                    if !cfg.udp_checksum {
                        l.set_no_checksum()?;
                    }
                    tx_links.push(Arc::new(l));
                }
            }
            let link = tx_links[0].clone();
            let (sq_tx, sq_rx) = pipe::pipe::<sq::Slot>(SQ_SLOTS, 32)?;
            let shared = Arc::new(EngineShared {
                mrs: mrs.clone(),
                qps: RwLock::new(HashMap::new()),
                sq: Mutex::new(sq_tx),
                tx_links: tx_links.clone(),
                path_ports: ports,
                wake: EventFd::new()?,
                stop: AtomicBool::new(false),
                stats: EngineStats::default(),
                redn: redn.clone(),
                guards: cfg.redn,
                managed: Mutex::new(Vec::new()),
                rearm: Mutex::new(Vec::new()),
                solar: solar::SolarHost::default(),
                local: link.local_addr(),
                epoch,
                epoch_ns,
            });
            let s2 = shared.clone();
            let opts = CoreOptions {
                index: i,
                mode: cfg.poll_mode,
                spin: Duration::from_micros(cfg.spin_us),
                gso: cfg.gso,
                gro: cfg.gro,
                staging: cfg.rx_staging_bytes,
                rx_delay_ns: cfg.rx_delay_us * 1000,
            };
            e.cores.push(shared);
            if cfg.drive == Drive::Application {
                app_cores.push(DataCore::new(s2, sq_rx, &opts));
                continue;
            }
            // started threads are joined by Engine's drop if a later core fails to start
            let thread = std::thread::Builder::new()
                .name(format!("flexns-core{i}-{}", link.local_addr().port()))
                .spawn(move || DataCore::new(s2, sq_rx, &opts).run())?;
            e.threads.push(thread);
        }
        if cfg.drive == Drive::Application {
            let d = Arc::new(drive::AppDrive::new(app_cores)?);
            for (i, c) in e.cores.iter().enumerate() {
                let d = d.clone();
                let thread = std::thread::Builder::new()
                    .name(format!("flexns-backstop{i}-{}", c.local_addr().port()))
                    .spawn(move || d.backstop(i))?;
                e.threads.push(thread);
            }
            e.drive = Some(d);
        }
        Ok(e)
    }

    /// The cores' run-to-completion handle, when application threads run them.
    pub(crate) fn drive(&self) -> Option<&Arc<drive::AppDrive>> {
        self.drive.as_ref()
    }

    /// The data core that owns QP `qpn` (QPs are sharded by QPN).
    pub(crate) fn core_for(&self, qpn: u32) -> &Arc<EngineShared> {
        &self.cores[qpn as usize % self.cores.len()]
    }

    /// All data cores.
    pub(crate) fn cores(&self) -> &[Arc<EngineShared>] {
        &self.cores
    }

    /// Counters summed over the data cores.
    pub(crate) fn stats(&self) -> StatsSnapshot {
        let mut t = StatsSnapshot::default();
        for c in &self.cores {
            t.add(&c.stats.snapshot());
        }
        t
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        for c in &self.cores {
            c.stop.store(true, Ordering::SeqCst);
            c.wake.notify();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// One outgoing datagram being assembled: the packet (holding its payload regions alive), the
/// destination, and the pad + ICRC trailer.
struct Outgoing {
    pkt: TxPacket,
    /// Index of the socket it leaves from (`EngineShared::tx_links`).
    link: usize,
    dst: SocketAddrV4,
    trailer: [u8; 8],
    trailer_len: usize,
}

/// A packet a core sends: the socket it leaves from, where it goes, and its bytes as spans.
trait Datagram {
    /// Index of the socket it leaves from (`EngineShared::tx_links`).
    fn link(&self) -> usize;
    fn dst(&self) -> SocketAddrV4;
    /// Bytes on the wire (the UDP payload).
    fn wire_len(&self) -> usize;
    /// Spans [`Datagram::push_spans`] adds.
    fn spans(&self) -> usize;
    /// Adds this packet's spans to `m`.
    ///
    /// # Safety
    /// `self` must stay alive and unmoved until `m` has been sent (or is never sent): the
    /// spans point into it and into the buffers it keeps alive.
    unsafe fn push_spans(&self, m: &mut OutMsg);
}

/// What a data core needs from the context configuration.
struct CoreOptions {
    index: usize,
    mode: PollMode,
    spin: Duration,
    gso: bool,
    gro: bool,
    staging: usize,
    rx_delay_ns: u64,
}

/// What one turn of a data core's loop did.
struct Pass {
    work: bool,
    next_deadline: Option<u64>,
}

/// How an idle data core waits for work.
enum Idle {
    Spin,
    Yield,
    Sleep,
}

/// The descriptors a sleeping data core waits on.
type Fds = smallvec::SmallVec<[std::os::fd::RawFd; 4]>;

/// A received datagram waiting out the emulated propagation delay.
struct Delayed {
    due: u64,
    data: Vec<u8>,
    src: SocketAddrV4,
    /// The address it was received on.
    local: SocketAddrV4,
    ce: bool,
}

struct DataCore {
    /// This core's index (its pipe in every CQ).
    index: usize,
    /// QPs whose completions did not fit in a full CQ; retried every loop.
    stuck: HashSet<u32>,
    shared: Arc<EngineShared>,
    /// The sockets the core receives on: the main socket of each local address.
    rx_links: Vec<Arc<UdpLink>>,
    sq: Consumer<sq::Slot>,
    mode: PollMode,
    spin: Duration,
    gso: bool,
    active: HashSet<u32>,
    rx: RecvBatch,
    out: Vec<Outgoing>,
    /// Send buffers reused across batches (messages, packets per message, kernel headers).
    tx_msgs: Vec<OutMsg>,
    tx_per_msg: Vec<usize>,
    tx_hdrs: Vec<libc::mmsghdr>,
    /// Emulated propagation delay of received packets (0 = none), the delay line in arrival
    /// order, and its recycled buffers.
    rx_delay: u64,
    delayed: VecDeque<Delayed>,
    spare: Vec<Vec<u8>>,
    /// The addresses this core receives on; packets to them are delivered in memory (hairpin),
    /// as a NIC loops back traffic between its own QPs.
    local_addrs: Vec<SocketAddrV4>,
    hairpin: VecDeque<(Vec<u8>, SocketAddrV4, SocketAddrV4)>,
    /// The QPs' deadlines in time order, and when every QP's is next read afresh.
    deadlines: deadlines::Deadlines,
    next_scan: u64,
    /// `EngineShared::rearm`'s entries, taken each loop.
    rearm_buf: Vec<u32>,
    /// The core's Solar endpoints (storage clients and server).
    solar: solar::SolarCore,
}

// SAFETY: the raw pointers a core holds are in its reusable system-call buffers (`rx`'s
// headers and iovecs point into `rx`'s own heap buffers; `tx_msgs` and `tx_hdrs` are rebuilt
// from `out` before every send and never read after it). They point only into memory the core
// owns, which moves with it, and only the thread running the core's pass uses them: a core
// moved to its thread, or handed between threads under `AppDrive`'s mutex, stays sound.
unsafe impl Send for DataCore {}

impl DataCore {
    fn new(shared: Arc<EngineShared>, sq: Consumer<sq::Slot>, o: &CoreOptions) -> DataCore {
        let rx_links = shared.tx_links.iter().step_by(shared.path_ports).cloned().collect();
        // with GRO one receive may hold up to 64 KiB of coalesced datagrams
        let buf = if o.gro { 1 << 16 } else { MAX_DATAGRAM + 64 };
        let rx = RecvBatch::new((o.staging / buf).clamp(1, BATCH), buf);
        shared.stats.set_staging_bytes(rx.staging_bytes() as u64);
        DataCore {
            index: o.index,
            stuck: HashSet::new(),
            shared,
            rx_links,
            sq,
            mode: o.mode,
            spin: o.spin,
            gso: o.gso,
            active: HashSet::new(),
            rx,
            out: Vec::with_capacity(TX_BATCH),
            tx_msgs: Vec::with_capacity(TX_BATCH),
            tx_per_msg: Vec::with_capacity(TX_BATCH),
            tx_hdrs: Vec::with_capacity(TX_BATCH),
            rx_delay: o.rx_delay_ns,
            delayed: VecDeque::new(),
            spare: Vec::new(),
            local_addrs: Vec::new(),
            hairpin: VecDeque::new(),
            deadlines: deadlines::Deadlines::default(),
            next_scan: 0,
            rearm_buf: Vec::new(),
            solar: solar::SolarCore::default(),
        }
        .with_local_addrs()
    }

    fn with_local_addrs(mut self) -> Self {
        self.local_addrs = self.rx_links.iter().map(|l| l.local_addr()).collect();
        self
    }

    fn run(mut self) {
        // sleeps end within a microsecond of their deadline, not the default 50 us slack
        sys::set_timer_slack_ns(1_000);
        let mut idle_since: Option<Instant> = None;
        while !self.shared.stop.load(Ordering::Relaxed) {
            let pass = self.pass();
            if pass.work {
                self.shared.stats.engine_thread_passes.inc();
                idle_since = None;
                continue;
            }
            let since = *idle_since.get_or_insert_with(Instant::now);
            match self.idle(pass.next_deadline, since) {
                Idle::Spin => std::hint::spin_loop(),
                Idle::Yield => std::thread::yield_now(),
                Idle::Sleep => self.sleep(pass.next_deadline),
            }
        }
    }

    /// One turn of the loop: the send queue, receives, RedN chains, timers and transmits.
    /// Returns whether it did anything and the next deadline (engine clock) it must run by.
    fn pass(&mut self) -> Pass {
        let now = self.shared.now();
        let mut work = false;
        work |= self.solar_commands(now);
        work |= self.drain_sq(now);
        self.retry_stuck();
        work |= self.receive(now);
        work |= self.release_delayed(now);
        work |= self.receive_hairpin(now);
        let chains_retry = self.run_chains(now, &mut work);
        let next_deadline = match (self.timers(now), self.delayed.front()) {
            (t, Some(d)) => Some(t.map_or(d.due, |t| t.min(d.due))),
            (t, None) => t,
        };
        let next_deadline = match (next_deadline, chains_retry) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let next_deadline = match (next_deadline, self.solar.timers(now)) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        work |= self.solar.collect(&self.shared, now);
        // packets this core sends to itself (RedN chains on loopback QPs) are processed at
        // once, so a chain advances several steps per loop without a system call; the
        // packets for the network go out together afterwards
        work |= self.transmit(now, false);
        for _ in 0..64 {
            if self.hairpin.is_empty() {
                break;
            }
            self.receive_hairpin(now);
            let mut w = false;
            self.run_chains(now, &mut w);
            self.transmit(now, false);
        }
        work |= self.flush();
        work |= self.flush_solar();
        Pass { work, next_deadline }
    }

    /// How an idle core waits, idle since `since`: a deadline closer than a sleep's wake-up
    /// cost (pacing, delayed ACKs) is waited for awake, or the sleep would overshoot it.
    fn idle(&self, next_deadline: Option<u64>, since: Instant) -> Idle {
        let near = next_deadline.is_some_and(|d| d.saturating_sub(self.shared.now()) < NEAR_DEADLINE_NS);
        match self.mode {
            PollMode::BusyPoll => Idle::Spin,
            PollMode::Adaptive if near || since.elapsed() < self.spin => Idle::Yield,
            _ => Idle::Sleep,
        }
    }

    fn sleep(&mut self, next_deadline: Option<u64>) {
        if let Some((fds, wait)) = self.prepare_sleep(next_deadline) {
            let _ = sys::ppoll_readable(&fds, wait);
            self.woke();
        }
    }

    /// Says this core sleeps, and returns what to wait on (its sockets, its send queue's and
    /// its control eventfds) and for how long (ns); `None` when a post raced in and there is
    /// work. The caller waits, then calls [`DataCore::woke`].
    fn prepare_sleep(&mut self, next_deadline: Option<u64>) -> Option<(Fds, u64)> {
        // the send queue's consumer says it sleeps, then checks once more, so a post racing
        // with this either is seen now or rings the queue's eventfd
        if !self.sq.prepare_sleep() {
            return None;
        }
        if !self.solar.prepare_sleep(&self.shared) {
            self.sq.woke();
            return None;
        }
        let now = self.shared.now();
        let wait = next_deadline
            .map(|d| d.saturating_sub(now))
            .unwrap_or(100_000_000)
            .min(100_000_000);
        let mut fds: Fds = self.rx_links.iter().map(|l| l.fd()).collect();
        fds.extend([self.sq.wake_fd(), self.shared.wake.fd()]);
        Some((fds, wait.max(1_000)))
    }

    fn woke(&mut self) {
        self.sq.woke();
        self.solar.woke(&self.shared);
        self.shared.wake.drain();
    }

    /// Delivers completions that found their CQ full earlier.
    fn retry_stuck(&mut self) {
        if self.stuck.is_empty() {
            return;
        }
        let stuck: Vec<u32> = self.stuck.drain().collect();
        for qpn in stuck {
            if let Some(slot) = self.shared.qps.read().get(&qpn).cloned() {
                if !slot.lock().deliver_completions(self.index) {
                    self.stuck.insert(qpn);
                }
            }
        }
    }

    /// Moves posted work requests from the shared send queue into their QPs.
    fn drain_sq(&mut self, _now: u64) -> bool {
        let mut n = 0;
        while n < SQ_DRAIN {
            let Some(req) = sq::pop_request(&mut self.sq) else {
                break;
            };
            n += 1;
            let qpn = match &req {
                sq::Request::Send { qpn, .. } | sq::Request::Poke { qpn } => *qpn,
            };
            let Some(slot) = self.shared.qps.read().get(&qpn).cloned() else {
                continue;
            };
            let mut s = slot.lock();
            match req {
                sq::Request::Send { wr, inline, .. } => {
                    if let Some(d) = &inline {
                        // out of the slots, then into the WQE's own buffer
                        self.shared.stats.tx_payload_copy_bytes.add(2 * d.len() as u64);
                    }
                    if let Err(e) =
                        s.qp.post_send_with_inline(wr.clone(), inline.as_deref(), &self.shared.mrs)
                    {
                        // the application checked state and depth when it posted; a QP that
                        // changed since answers with an error completion
                        tracing::debug!("QP {qpn:#x}: queued work request refused: {e}");
                        s.qp.reject_send(&wr, crate::work::WcStatus::LocQpOpErr);
                    }
                }
                // an application thread left completions in the transport: deliver them
                sq::Request::Poke { .. } => {}
            }
            if !s.deliver_completions(self.index) {
                self.stuck.insert(qpn);
            }
            self.active.insert(qpn);
        }
        n > 0
    }

    fn receive(&mut self, now: u64) -> bool {
        let mut any = false;
        for i in 0..self.rx_links.len() {
            any |= self.receive_on(i, now);
        }
        any
    }

    fn receive_on(&mut self, link: usize, now: u64) -> bool {
        let n = match self.rx_links[link].recv_batch(&mut self.rx) {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!("receive failed: {e}");
                return false;
            }
        };
        let local = self.rx_links[link].local_addr();
        let mut staged = 0u64;
        for i in 0..n {
            let (d, src, seg) = self.rx.get(i);
            staged += d.map_or(0, |d| d.len() as u64);
            let Some(d) = d else {
                self.shared.stats.rx_datagrams.inc();
                self.shared.stats.rx_malformed("oversized");
                continue;
            };
            self.shared.stats.staging_fills.inc();
            // GRO coalesces only datagrams with identical IP headers, so one TOS covers all
            let ce = self.rx.tos(i) & 3 == 3;
            if ce {
                self.shared.stats.rx_ce.inc();
            }
            for dgram in sys::segments(d, seg) {
                if self.rx_delay > 0 {
                    let mut data = self.spare.pop().unwrap_or_default();
                    data.clear();
                    data.extend_from_slice(dgram);
                    self.delayed.push_back(Delayed {
                        due: now + self.rx_delay,
                        data,
                        src,
                        local,
                        ce,
                    });
                    continue;
                }
                if crate::transport::solar::wire::is_solar_packet(dgram) {
                    self.shared.stats.rx_datagrams.inc();
                    self.shared.stats.rx_bytes.add(dgram.len() as u64);
                    self.solar.on_packet(&self.shared, now, dgram, src, ce);
                    continue;
                }
                if let Some((qpn, delivered)) = Self::dispatch(&self.shared, self.index, now, dgram, src, local, ce) {
                    self.active.insert(qpn);
                    if !delivered {
                        self.stuck.insert(qpn);
                    }
                }
            }
        }
        self.shared.stats.note_staged(staged);
        n > 0
    }

    /// Processes the packets this core sent to itself.
    fn receive_hairpin(&mut self, now: u64) -> bool {
        let mut any = false;
        while let Some((data, src, dst)) = self.hairpin.pop_front() {
            any = true;
            if let Some((qpn, delivered)) = Self::dispatch(&self.shared, self.index, now, &data, src, dst, false) {
                self.active.insert(qpn);
                if !delivered {
                    self.stuck.insert(qpn);
                }
            }
            self.spare.push(data);
        }
        any
    }

    /// Runs the managed QPs' RedN chains; returns when a throttled one may go on.
    fn run_chains(&mut self, now: u64, work: &mut bool) -> Option<u64> {
        let managed = self.shared.managed.lock().clone();
        if managed.is_empty() {
            return None;
        }
        let mut retry: Option<u64> = None;
        // an ENABLE may release a QP visited earlier in the round: go round while one moves
        for _ in 0..8 {
            let mut moved = false;
            for &qpn in &managed {
                let Some(slot) = self.shared.qps.read().get(&qpn).cloned() else {
                    continue;
                };
                let peer_pd = self.local_peer_pd(&slot, qpn);
                let mut g = slot.lock();
                let s = &mut *g;
                // a chain whose operations complete at once runs on after its completions are
                // delivered (its WAITs count delivered completions)
                for _ in 0..64 {
                    let Some(chain) = s.chain.as_mut() else { break };
                    let copied = s.qp.payload_copy_bytes();
                    let pass = chain.pass(
                        &mut s.qp,
                        &self.shared.mrs,
                        &self.shared.redn,
                        &self.shared.guards,
                        now,
                        peer_pd,
                    );
                    self.shared
                        .stats
                        .rx_payload_copy_bytes
                        .add(s.qp.payload_copy_bytes() - copied);
                    if let Some(t) = pass.retry_at {
                        retry = Some(retry.map_or(t, |r| r.min(t)));
                    }
                    if !pass.progressed {
                        break;
                    }
                    moved = true;
                    self.active.insert(qpn);
                    let had = s.qp.has_completions();
                    if !s.deliver_completions(self.index) {
                        self.stuck.insert(qpn);
                        break;
                    }
                    if !had {
                        break;
                    }
                }
            }
            if !moved {
                break;
            }
            *work = true;
        }
        retry
    }

    /// The protection domain of a QP's peer when the peer is a QP of this core (a loopback
    /// peer whose operations the engine may execute on memory directly).
    fn local_peer_pd(&self, slot: &Arc<Mutex<QpSlot>>, qpn: u32) -> Option<u32> {
        let (remote, dest) = {
            let s = slot.lock();
            (s.remote?, s.qp.dest_qpn())
        };
        if !self.local_addrs.contains(&remote) {
            return None;
        }
        if dest == qpn {
            return Some(slot.lock().qp.pd());
        }
        let peer = self.shared.qps.read().get(&dest).cloned()?;
        let p = peer.lock();
        (p.qp.state() == QpState::Rts && p.qp.dest_qpn() == qpn).then(|| p.qp.pd())
    }

    /// Processes the delayed datagrams whose delay has passed.
    fn release_delayed(&mut self, now: u64) -> bool {
        let mut any = false;
        while self.delayed.front().is_some_and(|d| d.due <= now) {
            let Some(d) = self.delayed.pop_front() else { break };
            any = true;
            if crate::transport::solar::wire::is_solar_packet(&d.data) {
                self.shared.stats.rx_datagrams.inc();
                self.shared.stats.rx_bytes.add(d.data.len() as u64);
                self.solar.on_packet(&self.shared, now, &d.data, d.src, d.ce);
                self.spare.push(d.data);
                continue;
            }
            if let Some((qpn, delivered)) = Self::dispatch(&self.shared, self.index, now, &d.data, d.src, d.local, d.ce)
            {
                self.active.insert(qpn);
                if !delivered {
                    self.stuck.insert(qpn);
                }
            }
            self.spare.push(d.data);
        }
        any
    }

    /// Checks one datagram and hands it to its QP; returns the QPN it went to and whether its
    /// completions all fit in their CQs.
    fn dispatch(
        shared: &EngineShared,
        core: usize,
        now: u64,
        d: &[u8],
        src: SocketAddrV4,
        local: SocketAddrV4,
        ce: bool,
    ) -> Option<(u32, bool)> {
        let stats = &shared.stats;
        stats.rx_datagrams.inc();
        stats.rx_bytes.add(d.len() as u64);
        let v = match PacketView::parse(d) {
            Ok(v) => v,
            Err(e) => {
                stats.rx_malformed(e.kind());
                return None;
            }
        };
        if let Err(e) = PacketView::verify_icrc(d, src, local) {
            stats.rx_malformed(e.kind());
            return None;
        }
        let qpn = v.bth.dest_qp;
        let Some(slot) = shared.qps.read().get(&qpn).cloned() else {
            stats.rx_unknown_qp.inc();
            return None;
        };
        let mut s = slot.lock();
        if !s.accepts(src) {
            stats.rx_wrong_source.inc();
            return None;
        }
        let copied = s.qp.payload_copy_bytes();
        s.qp.handle_packet_ecn(now, &v, ce, &shared.mrs);
        stats.rx_payload_copy_bytes.add(s.qp.payload_copy_bytes() - copied);
        Some((qpn, s.deliver_completions(core)))
    }

    /// Runs the timers that are due; returns the earliest deadline left.
    fn timers(&mut self, now: u64) -> Option<u64> {
        if now >= self.next_scan {
            self.next_scan = now + DEADLINE_SCAN_NS;
            let slots: Vec<(u32, Arc<Mutex<QpSlot>>)> =
                self.shared.qps.read().iter().map(|(&q, s)| (q, s.clone())).collect();
            for (qpn, slot) in slots {
                let t = slot.lock().qp.poll_timeout();
                if let Some(t) = t {
                    self.deadlines.arm(qpn, t);
                }
            }
        }
        // (swapped with a buffer this core keeps: neither side allocates once both have grown)
        std::mem::swap(&mut *self.shared.rearm.lock(), &mut self.rearm_buf);
        for i in 0..self.rearm_buf.len() {
            let qpn = self.rearm_buf[i];
            let Some(slot) = self.shared.qps.read().get(&qpn).cloned() else {
                continue;
            };
            let t = slot.lock().qp.poll_timeout();
            if let Some(t) = t {
                self.deadlines.arm(qpn, t);
            }
        }
        self.rearm_buf.clear();
        // deadlines still due after their QP's timeout ran wait for the next loop
        let mut again = Vec::new();
        while let Some(qpn) = self.deadlines.pop_due(now) {
            let Some(slot) = self.shared.qps.read().get(&qpn).cloned() else {
                continue;
            };
            let mut s = slot.lock();
            match s.qp.poll_timeout() {
                Some(t) if t <= now => {
                    s.qp.handle_timeout(now);
                    if !s.deliver_completions(self.index) {
                        self.stuck.insert(qpn);
                    }
                    self.active.insert(qpn);
                    if let Some(t2) = s.qp.poll_timeout() {
                        again.push((qpn, t2));
                    }
                }
                Some(t) => again.push((qpn, t)),
                None => {}
            }
        }
        for (qpn, t) in again {
            self.deadlines.arm(qpn, t);
        }
        self.deadlines.next()
    }

    /// Polls the active QPs for packets; sends them when `flush` (or the batch is full).
    fn transmit(&mut self, now: u64, flush: bool) -> bool {
        let mut sent_any = false;
        let active: Vec<u32> = self.active.iter().copied().collect();
        for qpn in active {
            let Some(slot) = self.shared.qps.read().get(&qpn).cloned() else {
                self.active.remove(&qpn);
                continue;
            };
            let mut s = slot.lock();
            if s.remote.is_none() {
                self.active.remove(&qpn);
                continue;
            }
            while self.out.len() < TX_BATCH {
                match s.qp.poll_transmit(now) {
                    Some(pkt) => {
                        let Some((link, dst)) = s.route(pkt.path) else { break };
                        if self.local_addrs.contains(&dst) {
                            self.loop_back(&pkt, link, dst);
                            sent_any = true;
                            continue;
                        }
                        self.out.push(self.finish(pkt, link, dst));
                    }
                    None => break,
                }
            }
            if !s.deliver_completions(self.index) {
                self.stuck.insert(qpn);
            }
            if !s.qp.wants_transmit(now) {
                self.active.remove(&qpn);
            }
            let deadline = s.qp.poll_timeout();
            drop(s);
            if let Some(t) = deadline {
                self.deadlines.arm(qpn, t);
            }
            if self.out.len() >= TX_BATCH {
                sent_any |= self.flush();
            }
        }
        if flush {
            sent_any |= self.flush();
        }
        sent_any
    }

    /// Queues a packet for this core itself (hairpin): serialized with its ICRC, no system call.
    fn loop_back(&mut self, pkt: &TxPacket, link: usize, dst: SocketAddrV4) {
        let src = self.shared.tx_links[link].local_addr();
        let mut d = self.spare.pop().unwrap_or_default();
        d.clear();
        d.extend_from_slice(pkt.hdr.as_bytes());
        for p in &pkt.payload {
            p.region.append_to(p.off, p.len, &mut d);
        }
        // a hairpin packet is serialized: its payload is copied once
        self.shared.stats.tx_payload_copy_bytes.add(pkt.payload_len() as u64);
        d.extend_from_slice(&PAD_ZEROS[..pkt.hdr.bth().pad as usize]);
        let c = icrc::compute(src, dst, &[d.as_slice()]);
        d.extend_from_slice(&c.to_le_bytes());
        let stats = &self.shared.stats;
        stats.tx_packets.inc();
        stats.tx_bytes.add(d.len() as u64);
        stats.hairpin_packets.inc();
        self.hairpin.push_back((d, src, dst));
    }

    fn finish(&self, pkt: TxPacket, link: usize, dst: SocketAddrV4) -> Outgoing {
        Outgoing::new(
            pkt,
            link,
            self.shared.tx_links[link].local_addr(),
            dst,
            &self.shared.stats,
        )
    }

    /// Sends the batch of RC packets (see [`send_batch`]).
    fn flush(&mut self) -> bool {
        send_batch(
            &mut self.out,
            self.gso,
            &self.shared,
            &mut self.tx_msgs,
            &mut self.tx_per_msg,
            &mut self.tx_hdrs,
        )
    }

    /// Sends the batch of Solar packets (see [`send_batch`]).
    fn flush_solar(&mut self) -> bool {
        send_batch(
            &mut self.solar.out,
            self.gso,
            &self.shared,
            &mut self.tx_msgs,
            &mut self.tx_per_msg,
            &mut self.tx_hdrs,
        )
    }

    /// Applies the commands to this core's Solar endpoints. A core with Solar clients also
    /// receives on its path sockets, where their storage servers answer.
    fn solar_commands(&mut self, now: u64) -> bool {
        let had = self.solar.has_clients();
        let any = self.solar.commands(&self.shared, now);
        if !had && self.solar.has_clients() {
            self.rx_links = self.shared.tx_links.clone();
        }
        any
    }
}

/// Sends `out` from the core's sockets and removes what the kernel took; what it did not take
/// (a socket buffer full) is kept for the next round. With GSO, runs of packets to one
/// destination with the same length (the last of a run may be shorter) go out as one message
/// the kernel segments. The message buffers are reused: no allocation per batch.
fn send_batch<T: Datagram>(
    out: &mut Vec<T>,
    gso: bool,
    shared: &EngineShared,
    msgs: &mut Vec<OutMsg>,
    per_msg: &mut Vec<usize>,
    hdrs: &mut Vec<libc::mmsghdr>,
) -> bool {
    if out.is_empty() {
        return false;
    }
    // sprayed packets leave from several sockets: each run of packets from one socket is a
    // sendmmsg (sprayed in bursts, so runs are whole GSO messages), in order, so the
    // receiver of a loopback or single-link path sees no reordering
    msgs.clear();
    per_msg.clear();
    let mut i = 0;
    while i < out.len() {
        let o = &out[i];
        let seg = o.wire_len();
        let mut m = OutMsg::new(&o.dst());
        // SAFETY: `out` is neither changed nor moved until the batch is sent below; `msgs` is
        // cleared before the next batch is built.
        unsafe { o.push_spans(&mut m) };
        let mut n = 1;
        if gso {
            let max = sys::MAX_GSO_SEGMENTS.min(sys::MAX_GSO_BYTES / seg);
            while n < max {
                let Some(p) = out.get(i + n) else { break };
                let l = p.wire_len();
                if p.dst() != o.dst() || p.link() != o.link() || l > seg || m.room() < p.spans() {
                    break;
                }
                // SAFETY: as for the first packet of the message, above.
                unsafe { p.push_spans(&mut m) };
                n += 1;
                if l < seg {
                    break; // only the last segment may be shorter
                }
            }
            if n > 1 {
                m.gso = seg as u16;
            }
        }
        msgs.push(m);
        per_msg.push(n);
        i += n;
    }
    // one sendmmsg per socket run; a socket that takes less stops the batch there
    let mut sent_msgs = 0;
    let mut pkt = 0;
    while sent_msgs < msgs.len() {
        let link = out[pkt].link();
        let mut k = 0;
        let mut pk = pkt;
        while sent_msgs + k < msgs.len() && out[pk].link() == link {
            pk += per_msg[sent_msgs + k];
            k += 1;
        }
        let run = &mut msgs[sent_msgs..sent_msgs + k];
        let took = match shared.tx_links[link].send_batch_with(run, hdrs) {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!("send failed: {e}");
                shared.stats.tx_errors.inc();
                k // drop the run; the transport retransmits
            }
        };
        pkt += per_msg[sent_msgs..sent_msgs + took].iter().sum::<usize>();
        sent_msgs += took;
        if took < k {
            break;
        }
    }
    let n = pkt;
    let stats = &shared.stats;
    for o in &out[..n] {
        stats.tx_packets.inc();
        stats.tx_bytes.add(o.wire_len() as u64);
    }
    stats.tx_messages.add(sent_msgs as u64);
    out.drain(..n);
    // the spans pointed into the packets just removed
    msgs.clear();
    n > 0
}

impl crate::offload::JobDone for EngineShared {
    /// The job's response goes out from the offload thread that finished it when the QP is
    /// free (no hand-off back to the data core, the way a low-latency QP sends); when the data
    /// core holds the QP, or the transport has completions or timers to look after, the data
    /// core is poked to do it.
    fn job_finished(&self, qpn: u32) {
        let slot = self.qps.read().get(&qpn).cloned();
        if let Some(slot) = slot {
            if let Some(mut s) = slot.try_lock() {
                self.transmit_now(&mut s);
                s.sync_mirror();
                let now = self.now();
                if !s.qp.has_completions() && !s.qp.wants_transmit(now) {
                    return;
                }
            }
        }
        self.poke(qpn);
    }
}

/// A READ response carries memory that the responder's own application may be writing at this
/// moment (a key-value store rewriting an entry that clients READ). Checksummed in place and
/// copied by the kernel later, such a packet could carry bytes other than those its ICRC
/// covers: the requester drops it as corrupt, and again on every retransmission while the
/// writes go on, until the READ fails with RETRY_EXC_ERR. Like a NIC, which DMA-reads the
/// payload once and checksums what it read, the engine copies a READ response's payload first,
/// so the READ completes with whatever the memory held (torn data is the reader's to detect).
/// Small payloads of any opcode are copied too (cheaper than the system call they ride in):
/// a RedN chain's response WRITE sources memory the store's writer owns. Larger SEND and WRITE
/// payloads stay zero-copy: their memory is the poster's, not to be modified while the request
/// is outstanding (the verbs rule).
///
/// The payload is copied out chunk by chunk; each chunk is checksummed into `crc` (which has
/// seen the header) and written to the snapshot, so one pass does both. Returns false (and
/// touches neither) when the payload is sent from its memory instead.
fn snapshot_read_payload(pkt: &mut TxPacket, stats: &EngineStats, crc: &mut icrc::Icrc) -> bool {
    /// Payloads up to this many bytes are always copied.
    const SNAPSHOT_SMALL_PAYLOAD: usize = 512;
    use crate::wire::opcode::Opcode;
    let read_resp = matches!(
        Opcode::from_u8(pkt.hdr.bth().opcode),
        Some(
            Opcode::ReadResponseFirst
                | Opcode::ReadResponseMiddle
                | Opcode::ReadResponseLast
                | Opcode::ReadResponseOnly
        )
    );
    let len = pkt.payload_len();
    if len == 0 || !read_resp && len > SNAPSHOT_SMALL_PAYLOAD {
        return false;
    }
    stats.tx_payload_copy_bytes.add(len as u64);
    let snap = snapshot_buffer(len);
    let mut at = 0;
    for p in &pkt.payload {
        p.region.chunks(p.off, p.len, |k, c| {
            crc.update(c);
            snap.write(at + k, c);
        });
        at += p.len;
    }
    pkt.payload.clear();
    pkt.payload.push(crate::transport::PayloadPart {
        region: snap,
        off: 0,
        len,
    });
    true
}

thread_local! {
    /// Snapshot buffers of this thread (a data core, or an offload or application thread that
    /// sends directly), reused once no packet holds them: a READ response costs one copy, not
    /// an allocation and a zero-fill as well.
    static SNAPSHOTS: std::cell::RefCell<(Vec<Arc<crate::mem::Region>>, usize)> =
        const { std::cell::RefCell::new((Vec::new(), 0)) };
}

/// A buffer of at least `len` bytes that no packet is using.
fn snapshot_buffer(len: usize) -> Arc<crate::mem::Region> {
    /// Buffers kept per thread (a window of packets in flight between copy and send).
    const POOL: usize = 512;
    /// Pooled buffers hold a full packet's payload.
    const SIZE: usize = 4096;
    if len > SIZE {
        return Arc::new(crate::mem::Region::alloc(len));
    }
    SNAPSHOTS.with(|p| {
        let (pool, next) = &mut *p.borrow_mut();
        // look from where the last search ended: buffers are freed roughly in the order they
        // were taken (packets leave in order)
        for k in 0..pool.len() {
            let i = (*next + k) % pool.len();
            if Arc::strong_count(&pool[i]) == 1 {
                *next = i + 1;
                return pool[i].clone();
            }
        }
        let r = Arc::new(crate::mem::Region::alloc(SIZE));
        if pool.len() < POOL {
            pool.push(r.clone());
        }
        r
    })
}

impl Outgoing {
    /// Computes pad and ICRC over the header buffer and the payload, which the kernel then
    /// sends from its memory (the ICRC reads it through private chunks, see
    /// [`crate::mem::Region::chunks`]); READ responses and small payloads are snapshotted in
    /// the same pass (see [`snapshot_read_payload`]).
    fn new(mut pkt: TxPacket, link: usize, src: SocketAddrV4, dst: SocketAddrV4, stats: &EngineStats) -> Outgoing {
        let pad = pkt.hdr.bth().pad as usize;
        let body = pkt.hdr.len() + pkt.payload_len() + pad;
        let mut c = icrc::Icrc::new(src, dst, body);
        c.update(pkt.hdr.as_bytes());
        if !snapshot_read_payload(&mut pkt, stats, &mut c) {
            for p in &pkt.payload {
                p.region.chunks(p.off, p.len, |_, s| c.update(s));
            }
        }
        c.update(&PAD_ZEROS[..pad]);
        let mut trailer = [0u8; 8];
        trailer[pad..pad + 4].copy_from_slice(&c.finish().to_le_bytes());
        Outgoing {
            pkt,
            link,
            dst,
            trailer,
            trailer_len: pad + 4,
        }
    }
}

impl Datagram for Outgoing {
    fn link(&self) -> usize {
        self.link
    }
    fn dst(&self) -> SocketAddrV4 {
        self.dst
    }
    fn wire_len(&self) -> usize {
        self.pkt.hdr.len() + self.pkt.payload_len() + self.trailer_len
    }
    fn spans(&self) -> usize {
        2 + self.pkt.payload.len()
    }
    /// Adds this packet's header, payload spans and trailer to `m`.
    unsafe fn push_spans(&self, m: &mut OutMsg) {
        // SAFETY: the header, trailer and payload regions live in `self`, which the caller
        // keeps alive and in place until `m` is sent; `ptr_at` bounds-checks each payload span.
        unsafe {
            m.push(self.pkt.hdr.as_bytes().as_ptr(), self.pkt.hdr.len());
            for p in &self.pkt.payload {
                m.push(p.region.ptr_at(p.off, p.len), p.len);
            }
            m.push(self.trailer.as_ptr(), self.trailer_len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_buffers_are_reused_once_no_packet_holds_them() {
        let a = snapshot_buffer(100);
        let a_addr = a.addr();
        let b = snapshot_buffer(4096);
        assert_ne!(b.addr(), a_addr, "a buffer in use is not handed out again");
        drop(a);
        let c = snapshot_buffer(2000);
        assert_eq!(c.addr(), a_addr, "a freed buffer is reused");
        let big = snapshot_buffer(10_000);
        assert!(big.len() >= 10_000, "larger payloads get a buffer of their own");
        drop((b, c, big));
    }
}
