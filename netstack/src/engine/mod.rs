//! The engine: a data-core thread that owns a link and drives the QPs' transport state machines
//! (receive, dispatch, timers, transmit) and delivers completions to completion queues.
//!
//! Applications reach it only through QP handles and completion queues. A data core is the
//! only owner of its QPs' transport state: work requests and every other operation on a QP
//! (state changes, path and congestion-control settings, statistics, offload results, RedN
//! doorbells) reach the core as slots or [`Command`]s through its send queue, in the order they
//! were issued, and answers travel back in a channel. Whichever thread holds the core's cell
//! (its own thread, an application thread running it to completion, or a low-latency poster)
//! runs one pass; there is no lock on a QP. Payload bytes move once: from registered memory to
//! the socket as an iovec on transmit, from the receive buffer into registered memory on
//! receive.

mod chains;
mod cq;
mod deadlines;
pub(crate) mod drive;
mod lateness;
pub(crate) mod protocol;
mod rx;
pub(crate) mod sq;
mod stats;
mod task;
mod timers;
mod tx;

use rx::Delayed;
use tx::Outgoing;

pub(crate) use cq::CqShared;
pub use stats::StatsSnapshot;
pub(crate) use stats::{Counter, EngineStats};

use crate::config::ContextConfig;
use crate::config::LinkMode;
pub use crate::config::{Drive, PollMode};
use crate::link::shm::ShmLink;
use crate::link::sim::SimNet;
use crate::link::sys::{self, EventFd, OutMsg, RecvBatch, SendScratch};
use crate::link::udp::{UdpLink, UdpPorts};
use crate::link::Link;
use crate::mem::MrTable;
use crate::pipe::{self, Consumer, Producer};
use crate::transport::rc::validation::{challenge_route, wire_len, CHALLENGE};
use crate::transport::rc::{QpState, RcQp};
use crate::transport::TxPacket;
use crate::wire::opcode::Opcode;
use crate::wire::{icrc, PacketView, MAX_DATAGRAM, PAD_ZEROS};
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet, VecDeque};
use std::net::SocketAddrV4;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often a data core reads every QP's deadline afresh (nanoseconds): a safety net only. It
/// learns deadlines from the QPs it touches (every command and work request touches its QP).
/// At 1 ms, 10,000 QPs spent the core on scanning.
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

/// The hasher of a core's QP maps and sets: fixed keys, so that the order they iterate in
/// (which QP transmits first) follows from the QPNs and the order they were inserted in, and a
/// simulated run replays exactly. QPNs are the stack's own, so fixed keys offer no one a way to
/// collide them.
type Ordered = std::hash::BuildHasherDefault<std::hash::DefaultHasher>;

/// What an application handle may read about its QP without asking its core: its state and
/// how many send and receive WQEs have left their queues. The core refreshes it after every
/// change.
#[derive(Default)]
pub(crate) struct QpMirror {
    pub state: AtomicU8,
    pub retired: AtomicU64,
    /// Receive WRs the core took from the send queue and no longer holds (consumed, flushed
    /// or refused): with a count of posts, the receive queue's depth.
    pub recv_retired: AtomicU64,
    /// The application dropped its handle: the QP is gone for same-host peers at once (its
    /// core removes it later).
    pub dropped: std::sync::atomic::AtomicBool,
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
    /// Multipath: the routes the QP's paths may take, each the data core's socket it leaves
    /// from (an index into [`EngineShared::link`]) and the peer's address it goes to: path `k`
    /// starts on route `k`, and one that looks cut moves to a spare (`PathSet::port`); empty
    /// means path 0 only (the core's main socket to `remote`).
    pub routes: Vec<(usize, SocketAddrV4)>,
    /// Other addresses the peer sends this QP's packets from (its path sockets).
    pub peer_sources: Vec<SocketAddrV4>,
    /// Per path, the route its responses (ACKs, READ responses, CNPs) leave on: the one whose
    /// socket has the index of the peer's socket the latest request on that path came from,
    /// so a peer that moved a path to a spare port (a fresh ECMP hash one way) also gets its
    /// answers on a fresh hash back; with the source it was found for (the lookup runs again
    /// only when a path's requests come from another socket). `None` until a request came.
    pub reply_routes: Vec<Option<(SocketAddrV4, u8)>>,
    pub send_cq: Arc<CqShared>,
    pub recv_cq: Arc<CqShared>,
    pub mirror: Arc<QpMirror>,
    /// A managed QP's fetch state (RedN programs); `None` for ordinary QPs.
    pub chain: Option<crate::chain::ChainRunner>,
    /// Receive WRs taken from the send queue so far.
    pub recvs_taken: u64,
    /// The context's same-host export, where this QP's entry is kept current
    /// ([`crate::samehost`]).
    pub export: Option<Arc<crate::samehost::Export>>,
    /// The peer's export and QP number, when the peer is a same-host context this QP copies
    /// to directly.
    pub same_host: Option<(Arc<crate::samehost::PeerExport>, u32)>,
}

impl Drop for QpSlot {
    fn drop(&mut self) {
        if let Some(x) = &self.export {
            x.set_qp(self.qp.qpn(), self.qp.pd(), 0, true);
        }
    }
}

impl QpSlot {
    /// The port (index into the core's `link`) and destination of path `path`.
    pub(crate) fn route(&self, path: u8) -> Option<(usize, SocketAddrV4)> {
        // the path's current route (a path that looked cut moves to a spare one)
        let port = self.qp.paths().port(path);
        match self.routes.get(port as usize).or(self.routes.first()) {
            Some(&r) => Some(r),
            None => self.remote.map(|r| (0, r)),
        }
    }

    /// The ICRC mode the QP's connection runs: what was negotiated when it connected
    /// (`rtr` in `verbs::qp`), `icrc` before.
    pub(crate) fn icrc_mode(&self) -> crate::transport::rc::IcrcMode {
        if self.remote.is_some() {
            self.qp.config().icrc
        } else {
            crate::transport::rc::IcrcMode::Icrc
        }
    }

    /// Whether the QP's packets go without an ICRC: sent with the field 0, received without
    /// checking it (the UDP checksum protects them; see [`crate::transport::rc::IcrcMode`]).
    /// Once connected, as negotiated; before, as configured: a QP that is not connected sends
    /// nothing and accepts nothing (every packet is dropped as from a wrong source), so a
    /// peer that connected first and sends early is not counted as sending bad ICRCs.
    pub(crate) fn no_icrc(&self) -> bool {
        self.qp.config().icrc == crate::transport::rc::IcrcMode::None
    }

    /// Whether a packet from `src` may be this QP's peer.
    pub(crate) fn accepts(&self, src: SocketAddrV4) -> bool {
        self.remote == Some(src) || self.peer_sources.contains(&src)
    }

    /// A request on `path` came from the peer's socket at `src`: that path's responses leave
    /// from this side's socket of the same index (the peer's sockets are its `remote` and
    /// then its `peer_sources`, in its link's order, as this side's routes are numbered).
    pub(crate) fn note_request_source(&mut self, path: u8, src: SocketAddrV4) {
        let path = path as usize;
        if self
            .reply_routes
            .get(path)
            .is_some_and(|r| r.is_some_and(|(a, _)| a == src))
        {
            return;
        }
        let peer_socket = if self.remote == Some(src) {
            0
        } else {
            match self.peer_sources.iter().position(|&a| a == src) {
                Some(i) => i + 1,
                None => return,
            }
        };
        let Some(route) = self.routes.iter().position(|r| r.0 == peer_socket) else {
            return;
        };
        if self.reply_routes.len() <= path {
            self.reply_routes.resize(path + 1, None);
        }
        self.reply_routes[path] = Some((src, route as u8));
    }

    /// The port and destination of `pkt`: a response takes the route its path's requests
    /// came on ([`QpSlot::note_request_source`]), the rest [`QpSlot::route`]. (A QP that has
    /// answered no request does not look at the opcode.)
    pub(crate) fn route_of(&self, pkt: &TxPacket) -> Option<(usize, SocketAddrV4)> {
        let bth = pkt.hdr.bth();
        if bth.opcode == Opcode::Probe as u8 && bth.psn & CHALLENGE != 0 {
            // a challenge names the peer address it validates (the QP's "route" k is its k-th
            // distinct destination); it leaves on the route a path takes there now (the peer
            // answers from its socket of the same index, QpSlot::note_request_source: a path that
            // moved off a port whose way back is cut takes its challenge's answer along), else
            // on the first route there
            let dst = *self.peer_addrs().get(challenge_route(bth.psn))?;
            let on_path = (0..self.qp.paths().len()).find_map(|p| self.route(p as u8).filter(|r| r.1 == dst));
            return on_path
                .or_else(|| self.routes.iter().copied().find(|r| r.1 == dst))
                .or(Some((0, dst)));
        }
        if let Some((_, k)) = self.reply_routes.get(pkt.path as usize).copied().flatten() {
            // a path probe tests its own path's route, like a request
            let op = Opcode::from_u8(pkt.hdr.bth().opcode);
            let response = !op.is_some_and(|o| o.is_request() || o == Opcode::Probe);
            if let (true, Some(&r)) = (response, self.routes.get(k as usize)) {
                return Some(r);
            }
        }
        self.route(pkt.path)
    }

    /// The peer's addresses this QP sends to, each once: `remote` first, then the other
    /// destinations of its routes in route order. Validation is per address (which socket of
    /// this side a packet leaves from does not matter to whoever receives it).
    pub(crate) fn peer_addrs(&self) -> smallvec::SmallVec<[SocketAddrV4; 4]> {
        let mut v: smallvec::SmallVec<[SocketAddrV4; 4]> = self.remote.into_iter().collect();
        for &(_, d) in &self.routes {
            if !v.contains(&d) {
                v.push(d);
            }
        }
        v
    }

    /// Whether `pkt`, about to leave on `route`, may: a route not validated yet takes what
    /// fits in the peer's allowance, and drops the rest (route 0's packets were held back by
    /// the QP itself; challenges always go).
    pub(crate) fn may_send(&mut self, pkt: &TxPacket, route: (usize, SocketAddrV4)) -> bool {
        if self.qp.peer_validated() {
            return true;
        }
        let bth = pkt.hdr.bth();
        if bth.opcode == Opcode::Probe as u8 && bth.psn & CHALLENGE != 0 {
            return true;
        }
        let k = self
            .peer_addrs()
            .iter()
            .position(|&d| d == route.1)
            .unwrap_or(usize::MAX);
        // route 0's packets were held to its allowance by the QP itself
        k == 0 || self.qp.spend_unvalidated(k, wire_len(pkt) as usize)
    }

    /// Refreshes the mirror the application reads (state, retired WQEs).
    pub(crate) fn sync_mirror(&self) {
        let st = match self.qp.state() {
            QpState::Reset => 0,
            QpState::Init => 1,
            QpState::Rtr => 2,
            QpState::Rts => 3,
            QpState::Err => 4,
        };
        self.mirror.state.store(st, Ordering::Release);
        if let Some(x) = &self.export {
            // against a handle dropped meanwhile (`Qp::drop` clears the entry after setting
            // `dropped`): whichever clears last, the entry ends cleared
            if !self.mirror.dropped.load(Ordering::SeqCst) {
                x.set_qp(self.qp.qpn(), self.qp.pd(), st as u64, false);
                if self.mirror.dropped.load(Ordering::SeqCst) {
                    x.set_qp(self.qp.qpn(), self.qp.pd(), 0, true);
                }
            }
        }
        self.mirror.retired.store(self.qp.retired_sends(), Ordering::Release);
        let held = self.qp.recv_queue_len() as u64;
        self.mirror
            .recv_retired
            .store(self.recvs_taken.saturating_sub(held), Ordering::Release);
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

/// An operation another thread asks a data core to apply to the QPs it owns. Its answer, if
/// it has one, travels in a channel the function captured; a command for a QP the core does
/// not hold is dropped unapplied (its channel then reports the disconnection).
pub(crate) enum Command {
    /// The core owns this QP from now on.
    Add(Box<QpSlot>),
    /// The QP's handle was dropped.
    Remove(u32),
    /// Applies a function to one QP; the core then delivers its completions, transmits what it
    /// has to send and arms its timer.
    Qp(u32, Box<dyn FnOnce(&mut QpSlot) + Send>),
    /// Reads every QP of the core (statistics).
    Each(Box<dyn FnOnce(&mut QpIter<'_>) + Send>),
}

/// The QPs of a core, as [`Command::Each`] reads them.
pub(crate) type QpIter<'a> = dyn Iterator<Item = &'a QpSlot> + 'a;

/// State of one data core shared between its thread and application handles.
pub(crate) struct EngineShared {
    pub mrs: Arc<MrTable>,
    /// The shared send queue of this core (producers serialize on the lock).
    pub sq: Mutex<Producer<sq::Slot>>,
    /// Commands behind the send queue's command markers, in order (pushed under `sq`'s lock).
    commands: Mutex<VecDeque<Command>>,
    /// The core itself, for threads that run a pass of it when nobody else does.
    cell: std::sync::OnceLock<std::sync::Weak<Mutex<DataCore>>>,
    /// The engine-clock time until which the core's own thread sleeps (0 while it is awake): a
    /// pass run by another thread that leaves an earlier deadline arms `timer` for it.
    sleeping_until: AtomicU64,
    /// The ports the core sends from: for each local address (`bind`, then `extra_addrs`),
    /// its main port followed by `path_ports - 1` ports on free port numbers (source-port
    /// entropy for ECMP). Index `addr * path_ports + port`.
    pub link: Box<dyn Link>,
    /// Source ports per local address (`path_ports`).
    pub path_ports: usize,
    /// Wakes the thread for control events (stop).
    wake: EventFd,
    /// Wakes the sleeping thread at a deadline a pass run by another thread left earlier
    /// than the one it sleeps until.
    timer: sys::TimerFd,
    stop: AtomicBool,
    pub stats: EngineStats,
    /// CQ counters and managed QPs of the context (shared by its cores), and the guards.
    pub redn: Arc<crate::chain::RednRegistry>,
    pub guards: crate::config::RednGuards,
    local: SocketAddrV4,
    clock: Clock,
}

/// Where a core's time comes from.
enum Clock {
    /// The host's: CLOCK_MONOTONIC at `epoch` plus the time elapsed since.
    Host { epoch: Instant, epoch_ns: u64 },
    /// A simulated network's.
    Sim(Arc<SimNet>),
}

/// What the engine's cores send and receive through.
#[derive(Clone)]
pub(crate) enum LinkKind {
    /// Kernel UDP sockets, one set per core.
    Udp,
    /// A simulated network: no threads; the network's [`SimNet::step`] runs the cores.
    Sim(Arc<SimNet>),
}

impl EngineShared {
    /// Queues `cmd` for the core behind everything posted before it, and wakes the core if it
    /// sleeps.
    pub(crate) fn command(&self, cmd: Command) {
        let mut q = self.sq.lock();
        self.commands.lock().push_back(cmd);
        while !sq::push_all(&mut q, &[sq::COMMAND]) {
            q.notify();
            std::thread::yield_now();
        }
        q.notify();
    }

    /// Has the core look at QP `qpn` (an offload job of it finished, a RedN doorbell rang).
    pub(crate) fn visit(&self, qpn: u32) {
        self.command(Command::Qp(qpn, Box::new(|_| {})));
    }

    /// Applies `f` to QP `qpn` on its core and returns its answer; `None` when the core does
    /// not hold the QP. Runs the core from this thread when nobody else does, so the answer
    /// costs no wake-up of the core's thread. Never call it while running a core.
    pub(crate) fn call<R: Send + 'static>(
        &self,
        qpn: u32,
        f: impl FnOnce(&mut QpSlot) -> R + Send + 'static,
    ) -> Option<R> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.command(Command::Qp(
            qpn,
            Box::new(move |s| {
                let r = f(s);
                // the caller reads the mirror next (a post after `modify_to_rts`)
                s.sync_mirror();
                let _ = tx.send(r);
            }),
        ));
        self.answer(rx)
    }

    /// Reads every QP of the core with `f` and returns its answer.
    pub(crate) fn call_each<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut QpIter<'_>) -> R + Send + 'static,
    ) -> Option<R> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.command(Command::Each(Box::new(move |it| {
            let _ = tx.send(f(it));
        })));
        self.answer(rx)
    }

    /// Waits for a command's answer, running the core from this thread whenever it is free.
    fn answer<R>(&self, rx: std::sync::mpsc::Receiver<R>) -> Option<R> {
        use std::sync::mpsc::{RecvTimeoutError, TryRecvError};
        loop {
            self.run_here();
            match rx.try_recv() {
                Ok(r) => return Some(r),
                Err(TryRecvError::Disconnected) => return None,
                Err(TryRecvError::Empty) => {}
            }
            // another thread runs the core: its pass answers
            match rx.recv_timeout(Duration::from_micros(200)) {
                Ok(r) => return Some(r),
                Err(RecvTimeoutError::Disconnected) => return None,
                Err(RecvTimeoutError::Timeout) if self.stop.load(Ordering::Relaxed) => return None,
                Err(RecvTimeoutError::Timeout) => {}
            }
        }
    }

    /// Runs the core's send side once from the calling thread if no other thread is running
    /// it ([`DataCore::post_pass`]; the low-latency path: a post leaves in the poster's own
    /// call). A deadline the pass left earlier than the one the core's thread sleeps until
    /// moves that thread's timer; a send queue it could not empty wakes the thread. Returns
    /// whether it ran.
    pub(crate) fn run_here(&self) -> bool {
        let Some(cell) = self.cell.get().and_then(|w| w.upgrade()) else {
            return false;
        };
        let Some(mut core) = cell.try_lock() else {
            return false;
        };
        let pass = core.post_pass(self.now(), &*self.link);
        // more than one pass takes (a long send queue) is left to the core's thread, and so
        // is receiving on ports it does not watch yet
        let more = core.sq.has_data() || core.rx_ports_stale();
        drop(core);
        if pass.work {
            self.stats.application_passes.inc();
        }
        if more && self.sleeping_until.load(Ordering::Acquire) != 0 {
            self.wake.notify();
        } else if let Some(d) = pass.next_deadline {
            // an earlier deadline moves the sleeper's timer, without waking it now (a wake-up
            // per post costs a context switch on a loaded machine)
            let until = self.sleeping_until.fetch_min(d.max(1), Ordering::AcqRel);
            if until != 0 && d < until {
                self.timer.arm_at(d);
            }
        }
        true
    }

    /// Wakes the core's thread if it sleeps (a protocol's command for its next pass).
    pub(crate) fn notify(&self) {
        self.wake.notify();
    }

    /// The transports' clock: CLOCK_MONOTONIC in nanoseconds (shared by all processes on the
    /// host, so a CNP's CE timestamp can be compared by its receiver), or the simulated one.
    pub(crate) fn now(&self) -> u64 {
        match &self.clock {
            Clock::Host { epoch, epoch_ns } => epoch_ns + epoch.elapsed().as_nanos() as u64,
            Clock::Sim(net) => net.now(),
        }
    }
    pub(crate) fn local_addr(&self) -> SocketAddrV4 {
        self.local
    }
}

/// A running engine thread.
pub(crate) struct Engine {
    cores: Vec<Arc<EngineShared>>,
    threads: Vec<std::thread::JoinHandle<()>>,
    /// The cores, when application threads ([`Drive::Application`]) or tasks on the
    /// application's runtime ([`Drive::Runtime`]) run them, with backstop threads.
    drive: Option<Arc<drive::AppDrive>>,
    /// The cores, on a simulated network (which holds them only weakly).
    sim_cells: Vec<Arc<Mutex<DataCore>>>,
}

/// A core on a simulated network, as the network's driver runs it.
struct SimCore(std::sync::Weak<Mutex<DataCore>>);

impl crate::link::sim::Node for SimCore {
    fn run(&mut self) -> (bool, Option<u64>) {
        let Some(cell) = self.0.upgrade() else {
            return (false, None);
        };
        // the simulation is one thread: nobody else holds the core while the network runs it
        let Some(mut core) = cell.try_lock() else {
            return (true, None);
        };
        // the simulated clock and network: the engine clock of a simulated context is the
        // network's
        let shared = core.shared.clone();
        let pass = core.poll(shared.now(), &*shared.link);
        (pass.work, pass.next_deadline)
    }
    fn alive(&self) -> bool {
        self.0.strong_count() > 0
    }
}

impl Engine {
    /// Binds one link per data core and starts the data-core threads (or, run to completion,
    /// the backstop threads). Core `i` binds the configured address with port `port + i` (or a
    /// free port when the port is 0).
    pub(crate) fn start(
        cfg: &ContextConfig,
        mrs: Arc<MrTable>,
        kind: LinkKind,
        protocols: &dyn protocol::ProtocolFactory,
    ) -> std::io::Result<Engine> {
        let redn = Arc::new(crate::chain::RednRegistry::default());
        let epoch = Instant::now();
        let epoch_ns = sys::monotonic_ns();
        let mut e = Engine {
            cores: Vec::new(),
            threads: Vec::new(),
            drive: None,
            sim_cells: Vec::new(),
        };
        let mut app_cores = Vec::new();
        for i in 0..cfg.data_cores.max(1) {
            let mut bind = cfg.bind;
            if bind.port() != 0 {
                bind.set_port(bind.port() + i as u16);
            }
            let ports = cfg.path_ports.max(1) as usize;
            // the main port of each address on the configured port number, the others on free
            // ones
            let addrs: Vec<SocketAddrV4> = std::iter::once(*bind.ip())
                .chain(cfg.extra_addrs.iter().copied())
                .flat_map(|ip| (0..ports).map(move |j| SocketAddrV4::new(ip, if j == 0 { bind.port() } else { 0 })))
                .collect();
            let (link, clock): (Box<dyn Link>, Clock) = match &kind {
                LinkKind::Udp => {
                    let mut socks = Vec::new();
                    for (j, &a) in addrs.iter().enumerate() {
                        let l = UdpLink::bind(a)?;
                        if cfg.gro && j % ports == 0 {
                            l.set_gro(true)?;
                        }
                        if cfg.ecn {
                            l.set_ecn()?;
                        }
                        l.set_rx_timestamps()?;
                        if !cfg.udp_checksum {
                            l.set_no_checksum()?;
                        }
                        socks.push(l);
                    }
                    let link: Box<dyn Link> = match cfg.link {
                        LinkMode::Udp => Box::new(UdpPorts(socks)),
                        LinkMode::Shm => Box::new(ShmLink::new(UdpPorts(socks), ports)),
                    };
                    (link, Clock::Host { epoch, epoch_ns })
                }
                LinkKind::Sim(net) => (Box::new(net.link(&addrs)?), Clock::Sim(net.clone())),
            };
            let local = link.local_addr(0);
            let (sq_tx, sq_rx) = pipe::pipe::<sq::Slot>(SQ_SLOTS, 32)?;
            let shared = Arc::new(EngineShared {
                mrs: mrs.clone(),
                sq: Mutex::new(sq_tx),
                commands: Mutex::new(VecDeque::new()),
                cell: std::sync::OnceLock::new(),
                sleeping_until: AtomicU64::new(0),
                link,
                path_ports: ports,
                wake: EventFd::new()?,
                timer: sys::TimerFd::new()?,
                stop: AtomicBool::new(false),
                stats: EngineStats::default(),
                redn: redn.clone(),
                guards: cfg.redn,
                local,
                clock,
            });
            let s2 = shared.clone();
            let opts = CoreOptions {
                index: i,
                mode: cfg.poll_mode,
                spin: Duration::from_micros(cfg.spin_us),
                // the kernel refuses a UDP GSO send on a socket without checksums (EINVAL)
                gso: cfg.gso && cfg.udp_checksum,
                gro: cfg.gro,
                staging: cfg.rx_staging_bytes,
                rx_delay_ns: cfg.rx_delay_us * 1000,
            };
            let protos = protocol::Protocols::new(protocols.for_core(i, &shared));
            let cell = Arc::new(Mutex::new(DataCore::new(s2, sq_rx, &opts, protos)));
            let _ = shared.cell.set(Arc::downgrade(&cell));
            e.cores.push(shared);
            if let LinkKind::Sim(net) = &kind {
                // the network's driver runs the core: no thread
                net.attach(Box::new(SimCore(Arc::downgrade(&cell))));
                e.sim_cells.push(cell);
                continue;
            }
            if cfg.drive != Drive::Threads {
                app_cores.push(cell);
                continue;
            }
            // started threads are joined by Engine's drop if a later core fails to start
            let thread = std::thread::Builder::new()
                .name(format!("flexns-core{i}-{}", local.port()))
                .spawn(move || DataCore::run(cell, None))?;
            e.threads.push(thread);
        }
        if !app_cores.is_empty() {
            let d = Arc::new(drive::AppDrive::new(app_cores, cfg.drive)?);
            if cfg.drive == Drive::Runtime {
                // the tasks first: without a runtime the context fails to open, threadless
                task::spawn(&d, e.cores.len())?;
            }
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
        // a runtime's tasks run the cores themselves: posts do not
        self.drive.as_ref().filter(|d| d.drive() == Drive::Application)
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
            t.add(&c.stats.snapshot(c.link.stats()));
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
        if let Some(d) = &self.drive {
            d.stopping();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
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
type Fds = smallvec::SmallVec<[std::os::fd::RawFd; 8]>;

struct DataCore {
    /// This core's index (its pipe in every CQ).
    index: usize,
    /// QPs whose completions did not fit in a full CQ; retried every loop.
    stuck: HashSet<u32, Ordered>,
    shared: Arc<EngineShared>,
    /// The QPs this core owns (it is their only writer), and its managed ones (RedN).
    qps: HashMap<u32, QpSlot, Ordered>,
    managed: Vec<u32>,
    /// The ports the core receives on: the main port of each local address, and the source
    /// ports the protocols' multipath clients send from now (where their servers answer).
    rx_ports: Vec<usize>,
    /// The protocols' port generations `rx_ports` was built for.
    rx_ports_gen: Vec<(u64, u64)>,
    sq: Consumer<sq::Slot>,
    mode: PollMode,
    spin: Duration,
    gso: bool,
    active: HashSet<u32, Ordered>,
    rx: RecvBatch,
    out: Vec<Outgoing>,
    /// Send buffers reused across batches (messages, packets per message, kernel headers).
    tx_msgs: Vec<OutMsg>,
    tx_per_msg: Vec<usize>,
    tx_hdrs: SendScratch,
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
    /// The protocols the core carries beside RC ([`protocol::CoreProtocol`]).
    protocols: protocol::Protocols,
    /// How late this core has lately been: its flows' host delay and its timers' horizon.
    late: lateness::Lateness,
}

// SAFETY: the raw pointers a core holds are in its reusable system-call buffers (`rx`'s
// headers and iovecs point into `rx`'s own heap buffers; `tx_msgs` is rebuilt from `out` before
// every send and never read after it, as are the headers in `tx_hdrs`, a `SendScratch`). They point only into memory the core
// owns, which moves with it, and only the thread running the core's pass uses them: a core
// moved to its thread, or handed between threads under `AppDrive`'s mutex, stays sound.
unsafe impl Send for DataCore {}

impl DataCore {
    fn new(
        shared: Arc<EngineShared>,
        sq: Consumer<sq::Slot>,
        o: &CoreOptions,
        protocols: protocol::Protocols,
    ) -> DataCore {
        let rx_ports = (0..shared.link.ports()).step_by(shared.path_ports).collect();
        // with GRO one receive may hold up to 64 KiB of coalesced datagrams
        let buf = if o.gro { 1 << 16 } else { MAX_DATAGRAM + 64 };
        let rx = RecvBatch::new((o.staging / buf).clamp(1, BATCH), buf);
        shared.stats.set_staging_bytes(rx.staging_bytes() as u64);
        DataCore {
            index: o.index,
            stuck: HashSet::default(),
            shared,
            qps: HashMap::default(),
            managed: Vec::new(),
            rx_ports,
            rx_ports_gen: Vec::new(),
            sq,
            mode: o.mode,
            spin: o.spin,
            gso: o.gso,
            active: HashSet::default(),
            rx,
            out: Vec::with_capacity(TX_BATCH),
            tx_msgs: Vec::with_capacity(TX_BATCH),
            tx_per_msg: Vec::with_capacity(TX_BATCH),
            tx_hdrs: SendScratch::with_capacity(TX_BATCH),
            rx_delay: o.rx_delay_ns,
            delayed: VecDeque::new(),
            spare: Vec::new(),
            local_addrs: Vec::new(),
            hairpin: VecDeque::new(),
            deadlines: deadlines::Deadlines::default(),
            next_scan: 0,
            protocols,
            late: lateness::Lateness::default(),
        }
        .with_local_addrs()
    }

    fn with_local_addrs(mut self) -> Self {
        self.local_addrs = self.rx_ports.iter().map(|&p| self.shared.link.local_addr(p)).collect();
        self
    }

    /// The data-core thread, or with `app` a run-to-completion context's backstop thread:
    /// runs the core until the engine stops, holding its cell while it works or spins and
    /// letting go of it while it yields or sleeps, so that a low-latency poster or a control
    /// call may run a pass in the meantime. A backstop leaves the core alone while an
    /// application thread drives it, and lets go of it even to spin, so that the application
    /// finds it free.
    fn run(cell: Arc<Mutex<DataCore>>, app: Option<&drive::AppDrive>) {
        // sleeps end within a microsecond of their deadline, not the default 50 us slack
        sys::set_timer_slack_ns(1_000);
        let (shared, index) = {
            let c = cell.lock();
            (c.shared.clone(), c.index)
        };
        let driven = |now| app.and_then(|a| a.driven_until(now).map(|until| (a, until)));
        let mut idle_since: Option<Instant> = None;
        // how long a backstop leaves arrivals to an application it found polling
        let mut calm = drive::CALM_MIN_NS;
        // after a wait, the descriptors it reported readable: the ports to receive on
        let mut only: Option<rx::ReadyFds> = None;
        while !shared.stop.load(Ordering::Relaxed) {
            let now = shared.now();
            if let Some((a, until)) = driven(now) {
                idle_since = None;
                only = None;
                // the receive descriptors, watched for arrivals the application does not take
                // in; none while it holds the core (it is running it now)
                let arrivals = cell.try_lock().map(|c| c.arrival_fds());
                let pass = || {
                    if let Some(mut core) = cell.try_lock() {
                        if core.poll_app(shared.now(), &*shared.link) {
                            shared.stats.engine_thread_passes.inc();
                        }
                    }
                };
                // an application call that came while this thread held the core skipped it
                // (its post did not leave): this thread runs the pass it missed, then waits
                // as ever (at most one such pass per wait)
                if a.take_skipped(index) {
                    pass();
                }
                if a.wait_while_driven(&shared, until, now, arrivals.as_deref(), &mut calm) {
                    pass();
                }
                continue;
            }
            // another thread running a pass is never waited for: yield until it is done
            let Some(mut core) = cell.try_lock() else {
                std::thread::yield_now();
                continue;
            };
            while !shared.stop.load(Ordering::Relaxed) {
                // what the wait reported is fresh for the pass after it and the one after
                // that (which finds a QD1 exchange done); a core that keeps working (a
                // sender streaming into its window) receives everywhere from then on, or
                // its ACKs would wait for the window to close
                if only.as_ref().is_some_and(|o| o.passes >= 2) {
                    only = None;
                }
                let pass = core.poll_ready(shared.now(), &*shared.link, only.as_mut());
                if pass.work {
                    shared.stats.engine_thread_passes.inc();
                    idle_since = None;
                    if app.is_some() {
                        break;
                    }
                    continue;
                }
                let since = *idle_since.get_or_insert_with(Instant::now);
                let idle = core.idle(pass.next_deadline, since);
                if !matches!(idle, Idle::Sleep) {
                    // no wait says what is readable: every port, every pass
                    only = None;
                }
                match idle {
                    Idle::Spin if app.is_none() => std::hint::spin_loop(),
                    Idle::Spin => {
                        drop(core);
                        std::hint::spin_loop();
                        break;
                    }
                    Idle::Yield => {
                        drop(core);
                        std::thread::yield_now();
                        break;
                    }
                    Idle::Sleep => {
                        // sleep without the cell, so a thread that comes to run the core
                        // finds it free (and the `released` eventfd is not watched: the core
                        // is already this thread's)
                        let Some((fds, wait)) = core.prepare_sleep(pass.next_deadline) else {
                            // traffic the descriptors do not show (a shared-memory ring)
                            only = None;
                            continue;
                        };
                        shared.sleeping_until.store(shared.now() + wait, Ordering::Release);
                        drop(core);
                        let ready = sys::ppoll_ready(&fds, wait).ok();
                        shared.sleeping_until.store(0, Ordering::Release);
                        cell.lock().woke(ready.as_deref());
                        // the passes until the next wait receive on what it reported (ppoll
                        // is level-triggered: a datagram that comes later ends the next wait
                        // at once)
                        only = ready.map(|ready| rx::ReadyFds {
                            watched: fds,
                            ready,
                            all: false,
                            passes: 0,
                        });
                        break;
                    }
                }
            }
        }
    }

    /// One turn of the core at time `now` (engine clock, ns) over `link`: the send queue,
    /// receives, RedN chains, timers and transmits. Returns whether it did anything and the
    /// next deadline it must run by. The core reads no clock and owns no socket: its drivers
    /// (its thread, an application thread running it to completion, the simulator) say what
    /// time it is and which link it runs over.
    pub(super) fn poll(&mut self, now: u64, link: &dyn Link) -> Pass {
        self.poll_ready(now, link, None)
    }

    /// [`DataCore::poll`], receiving with `only` on the ports it lists as ready alone.
    pub(super) fn poll_ready(&mut self, now: u64, link: &dyn Link, only: Option<&mut rx::ReadyFds>) -> Pass {
        let mut work = self.take_requests(now);
        let chains_retry = self.take_arrivals(now, link, only, &mut work);
        // timers are judged at what has been taken in (`lateness`): one due after a horizon
        // behind the clock (a full batch) stays due, and the next pass receives the rest
        let at = self.late.timer_now(now);
        let next_deadline = earliest(earliest(self.rc_deadline(at), chains_retry), self.protocols.timers(at));
        work |= self.protocols.collect(&self.shared, now);
        // once per pass, after the commands (new clients) and the timers (paths that moved):
        // no answer can come on a port before the first packet leaves from it, below
        self.sync_rx_ports(link);
        work |= self.send_all(now, link);
        Pass { work, next_deadline }
    }

    /// The first step of a pass: the protocols' commands, the send queue (posts and commands), and
    /// completions that found their CQ full earlier. Whether any of it was work.
    fn take_requests(&mut self, now: u64) -> bool {
        let work = self.protocols.commands(now) | self.drain_sq(now);
        self.retry_stuck();
        work
    }

    /// The receive step of a pass: the link's datagrams, the delay line, hairpin packets, and
    /// the RedN chains they advance; returns when the chains want another look.
    fn take_arrivals(
        &mut self,
        now: u64,
        link: &dyn Link,
        only: Option<&mut rx::ReadyFds>,
        work: &mut bool,
    ) -> Option<u64> {
        *work |= self.receive(now, link, only);
        *work |= self.release_delayed(now);
        *work |= self.receive_hairpin(now);
        self.run_chains(now, work)
    }

    /// What the QPs and the other protocols have to send, sent: packets this core sends to itself
    /// (RedN chains on loopback QPs) are processed at once, so a chain advances several steps
    /// per loop without a system call; the packets for the network go out together afterwards.
    fn send_all(&mut self, now: u64, link: &dyn Link) -> bool {
        let mut work = self.transmit(now, false, link);
        for _ in 0..64 {
            if self.hairpin.is_empty() {
                break;
            }
            self.receive_hairpin(now);
            let mut w = false;
            self.run_chains(now, &mut w);
            self.transmit(now, false, link);
        }
        work |= self.flush(link);
        work |= self.flush_protocols(link);
        work
    }

    /// [`DataCore::poll`] as an application thread runs it (run to completion); returns
    /// whether it did anything. What earlier passes and the application's posts left to send
    /// goes out first, then the receive, whose answers (ACKs, READ responses) wait for the
    /// application's next call. So a completion reaches the application before a system call
    /// sends its acknowledgement, and the
    /// acknowledgement leaves in the same `sendmmsg` as what the application posts in reply (a
    /// ping-pong's SEND: one system call per side per round trip, not two). An answer waits at
    /// most until that call, or [`drive::HANDOFF_NS`] (1 ms, far below RC's 16.8 ms ACK
    /// timeout) when the application stops calling and the backstop, which runs
    /// [`DataCore::poll`], takes over; at once when it blocks.
    pub(super) fn poll_app(&mut self, now: u64, link: &dyn Link) -> bool {
        let mut work = self.take_requests(now);
        // the timers due run now; later ones wait for a later call (the application calls
        // again, or the backstop takes over), so their deadlines are not needed here
        let at = self.late.timer_now(now);
        self.rc_deadline(at);
        self.protocols.timers(at);
        // before anything leaves: a port a moved path sends from is received on
        self.sync_rx_ports(link);
        work |= self.send_all(now, link);
        // chains to retry are retried by the next call too
        let _ = self.take_arrivals(now, link, None, &mut work);
        work | self.protocols.collect(&self.shared, now)
    }

    /// The send side of a pass, run by a thread that posted or sent a command: the send queue
    /// (work requests and commands), then what the QPs have to send, sent at once. Receiving
    /// stays with the core's own thread, so a poster pays no receive system calls.
    fn post_pass(&mut self, now: u64, link: &dyn Link) -> Pass {
        let mut work = self.take_requests(now);
        work |= self.transmit(now, true, link);
        // a protocol's lone request leaves from the thread that handed it in, with no wake-up
        // of the core's thread (`EngineShared::run_here`)
        // this pass receives nothing: its timers are judged at what the core's receives took in
        let at = self.late.timer_now(now);
        let protocols = self.protocols.timers(at);
        work |= self.protocols.collect(&self.shared, now);
        work |= self.flush_protocols(link);
        // packets to this core itself are its thread's to receive, but they must not wait
        // for a sleeping thread's deadline
        let hairpin = (!self.hairpin.is_empty()).then_some(now);
        Pass {
            work,
            next_deadline: earliest(earliest(self.rc_deadline(at), hairpin), protocols),
        }
    }

    /// Whether the ports this core must receive on changed since its thread last looked (a
    /// pass run by another thread added a protocol's endpoint or moved a path): a sleeping
    /// thread waits on the old set and must be woken.
    fn rx_ports_stale(&self) -> bool {
        self.protocols.ports_changed(&self.rx_ports_gen)
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

    /// The descriptors datagrams for this core arrive on (what a backstop watches while the
    /// application drives the core).
    fn arrival_fds(&self) -> Fds {
        self.rx_ports
            .iter()
            .filter_map(|&p| self.shared.link.wait_fd(p))
            .collect()
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
        if !self.protocols.prepare_sleep() {
            self.sq.woke();
            return None;
        }
        for (k, &p) in self.rx_ports.iter().enumerate() {
            if !self.shared.link.prepare_sleep(p) {
                for &q in &self.rx_ports[..k] {
                    self.shared.link.woke(q);
                }
                self.protocols.woke();
                self.sq.woke();
                return None;
            }
        }
        let now = self.shared.now();
        self.late.sleeping(now, next_deadline);
        let wait = next_deadline
            .map(|d| d.saturating_sub(now))
            .unwrap_or(100_000_000)
            .min(100_000_000);
        let mut fds: Fds = self
            .rx_ports
            .iter()
            .filter_map(|&p| self.shared.link.wait_fd(p))
            .collect();
        fds.extend([self.sq.wake_fd(), self.shared.wake.fd(), self.shared.timer.fd()]);
        Some((fds, wait.max(1_000)))
    }

    /// The core woke from a wait that reported `ready` readable (`None`: not known). The
    /// eventfds it reported are drained; the others were not written, and a read of them would
    /// be a system call for nothing.
    fn woke(&mut self, ready: Option<&[std::os::fd::RawFd]>) {
        self.late.woke(self.shared.now());
        let rung = |fd| ready.is_none_or(|r| r.contains(&fd));
        for &p in &self.rx_ports {
            self.shared.link.woke(p);
        }
        self.sq.woke_ready(rung(self.sq.wake_fd()));
        self.protocols.woke();
        if rung(self.shared.wake.fd()) {
            self.shared.wake.drain();
        }
        if rung(self.shared.timer.fd()) {
            self.shared.timer.drain();
        }
    }

    /// Delivers completions that found their CQ full earlier.
    fn retry_stuck(&mut self) {
        if self.stuck.is_empty() {
            return;
        }
        let stuck: Vec<u32> = self.stuck.drain().collect();
        for qpn in stuck {
            if let Some(s) = self.qps.get_mut(&qpn) {
                if !s.deliver_completions(self.index) {
                    self.stuck.insert(qpn);
                }
            }
        }
    }

    /// Moves posted work requests from the shared send queue into their QPs, and applies the
    /// commands queued among them.
    fn drain_sq(&mut self, now: u64) -> bool {
        let mut n = 0;
        while n < SQ_DRAIN {
            let Some(req) = sq::pop_request(&mut self.sq) else {
                break;
            };
            n += 1;
            let qpn = match req {
                sq::Request::Send { qpn, .. } | sq::Request::Recv { qpn, .. } => qpn,
                sq::Request::Command => {
                    // pushed before its marker, under the producers' lock
                    let cmd = self.shared.commands.lock().pop_front();
                    if let Some(c) = cmd {
                        self.apply(c, now);
                    }
                    continue;
                }
            };
            let Some(s) = self.qps.get_mut(&qpn) else {
                continue;
            };
            match req {
                sq::Request::Command => {}
                sq::Request::Send { wr, inline, .. } if inline.is_none() && copied_same_host(s, &wr, &self.shared) => {}
                sq::Request::Send { wr, inline, .. } => {
                    if let Some(d) = &inline {
                        // out of the slots, then into the WQE's own buffer
                        self.shared.stats.tx_payload_copy_bytes.add(2 * d.len() as u64);
                    }
                    if let Err(e) =
                        s.qp.post_send_with_inline(wr.clone(), inline.as_deref(), &*self.shared.mrs)
                    {
                        // the application checked state and depth when it posted; a QP that
                        // changed since answers with an error completion
                        tracing::debug!("QP {qpn:#x}: queued work request refused: {e}");
                        s.qp.reject_send(&wr, crate::work::WcStatus::LocQpOpErr);
                    }
                }
                sq::Request::Recv { wr, .. } => {
                    s.recvs_taken += 1;
                    let wr_id = wr.wr_id;
                    if let Err(e) = s.qp.post_recv(wr) {
                        // the application checked state and depth when it posted
                        tracing::debug!("QP {qpn:#x}: queued receive refused: {e}");
                        s.qp.reject_recv(wr_id, crate::work::WcStatus::LocQpOpErr);
                    }
                }
            }
            if !s.deliver_completions(self.index) {
                self.stuck.insert(qpn);
            }
            self.active.insert(qpn);
        }
        n > 0
    }

    /// Applies a command; a QP it changed is visited: completions delivered, marked active
    /// (it may have something to send), its timer armed.
    fn apply(&mut self, cmd: Command, now: u64) {
        let qpn = match cmd {
            Command::Add(slot) => {
                let qpn = slot.qp.qpn();
                if slot.chain.is_some() {
                    self.managed.push(qpn);
                }
                let mut slot = *slot;
                slot.qp.set_host_delay(self.late.applied());
                self.qps.insert(qpn, slot);
                qpn
            }
            Command::Remove(qpn) => {
                if let Some(s) = self.qps.remove(&qpn) {
                    let errors = s.qp.stats().qp_errors;
                    for (c, n) in self.shared.stats.removed_qp_errors.iter().zip(errors) {
                        c.add(n);
                    }
                }
                self.managed.retain(|&q| q != qpn);
                self.active.remove(&qpn);
                self.stuck.remove(&qpn);
                return;
            }
            Command::Qp(qpn, f) => {
                let Some(s) = self.qps.get_mut(&qpn) else {
                    return;
                };
                f(s);
                qpn
            }
            Command::Each(f) => {
                f(&mut self.qps.values());
                return;
            }
        };
        let Some(s) = self.qps.get_mut(&qpn) else {
            return;
        };
        if !s.deliver_completions(self.index) {
            self.stuck.insert(qpn);
        }
        if s.qp.wants_transmit(now) {
            self.active.insert(qpn);
        }
        if let Some(t) = s.qp.poll_timeout() {
            self.deadlines.arm(qpn, t);
        }
    }

    /// A core also receives on the source ports its protocols name (a multipath client's
    /// paths, where its server answers): only those (each port received on costs a system
    /// call per pass), so a spare port is watched once a path moves to it.
    fn sync_rx_ports(&mut self, link: &dyn Link) {
        if !self.protocols.ports_changed(&self.rx_ports_gen) {
            return;
        }
        self.protocols.ports_generations(&mut self.rx_ports_gen);
        let ports = self.shared.path_ports;
        let mut rx: Vec<usize> = (0..link.ports()).step_by(ports).collect();
        self.protocols.rx_ports(ports, &mut rx);
        rx.sort_unstable();
        rx.dedup();
        self.rx_ports = rx;
    }
}

/// The earlier of two optional deadlines.
/// Executes `wr` on the same-host path if the QP has one and nothing of it is in flight on
/// the packet path ([`crate::samehost`]): the copy, then its completion. False: the packet
/// path takes it.
fn copied_same_host(s: &mut QpSlot, wr: &crate::work::SendWr, shared: &EngineShared) -> bool {
    let Some((peer, dest)) = &s.same_host else {
        return false;
    };
    if s.qp.state() != QpState::Rts || !s.qp.send_queue_idle() || s.chain.is_some() {
        return false;
    }
    let Some(own) = &s.export else {
        return false;
    };
    let me = (s.qp.qpn(), own.desc().nonce);
    let done = peer.execute(wr, &shared.mrs, s.qp.pd(), me, *dest);
    let n = match done {
        None => return false,
        Some(crate::samehost::Done::Mapped(n)) => {
            shared.stats.same_host_copy_bytes.add(n);
            n
        }
        Some(crate::samehost::Done::Cma(n)) => {
            shared.stats.same_host_cma_bytes.add(n);
            n
        }
    };
    shared.stats.same_host_ops.inc();
    let len = if wr.opcode == crate::work::WrOpcode::RdmaRead {
        n as u32
    } else {
        0
    };
    s.qp.complete_local(wr, crate::work::WcStatus::Success, len);
    true
}

fn earliest(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

impl crate::offload::JobDone for EngineShared {
    /// The outcome travels to the QP's core as a command (an event through its send queue);
    /// the offload thread that finished the job then runs the core itself if no other thread
    /// does, so the response leaves without a hand-off back to the core's thread.
    fn job_finished(&self, qpn: u32, id: u64, outcome: crate::transport::rc::offload::Outcome) {
        self.command(Command::Qp(
            qpn,
            Box::new(move |s| {
                s.qp.offload_finished(id, outcome);
            }),
        ));
        self.run_here();
    }
}

thread_local! {
    /// Snapshot buffers of this thread (a data core, or an offload or application thread that
    /// sends directly), reused once no packet holds them: a READ response costs one copy, not
    /// an allocation and a zero-fill as well.
    static SNAPSHOTS: std::cell::RefCell<(Vec<Arc<crate::mem::Region>>, usize)> =
        const { std::cell::RefCell::new((Vec::new(), 0)) };
}
