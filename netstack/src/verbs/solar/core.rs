//! Solar endpoints on a data core: storage-agent clients ([`SolarClient`]) and a storage server
//! ([`SolarServer`]) run beside the RC QPs, on the core's sockets, in the core's loop. The core
//! is their only owner: application threads reach them through commands
//! ([`SolarHost::command`]) and learn results through one-shot channels, published status
//! snapshots, and the storage handler the core calls. The engine knows them only as a
//! [`CoreProtocol`], registered for every core when the context opens ([`SolarFactory`]).
//!
//! A datagram is Solar when it starts with Solar's magic and version (`0x53 0x01`); a RoCEv2
//! BTH never does here, because `0x53` is a Reliable Datagram opcode, which flexns does not
//! speak. Requests (WRITE, READ_REQ, PROBE, CHALLENGE_REPLY) go to the core's server; answers
//! (CHALLENGE included) go to the client whose storage server sent them. A client's path `p`
//! leaves from the core's source-port socket `p` (its own ECMP flow) and is answered there, so
//! a core with clients also receives on its path sockets.

use crate::engine::protocol::{CoreProtocol, Datagram, ProtocolFactory, Transmitter};
use crate::engine::EngineShared;
use crate::link::sys::OutMsg;
use crate::transport::solar::client::{
    ClientConfig, ClientEvent, ClientStats, IoError, IoId, SolarClient, SubmitError, Target,
};
use crate::transport::solar::server::{Request, ServerStats, SolarServer, Token};
use crate::transport::solar::wire::{self, Op, Status, BLOCK};
use crate::transport::solar::Transmit;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::sync::oneshot;

/// How often a core publishes its endpoints' status snapshots (ns).
const PUBLISH_NS: u64 = 5_000_000;

/// Why a Solar request failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SolarError {
    /// The request failed (a server status, a timeout, CRC failures).
    #[error(transparent)]
    Io(#[from] IoError),
    /// The request was refused before it was sent.
    #[error(transparent)]
    Submit(#[from] SubmitError),
    /// The endpoint closed before it finished.
    #[error("the Solar endpoint was closed")]
    Stopped,
}

/// What a Solar client endpoint reports about itself (refreshed every few milliseconds).
#[derive(Debug, Clone, Default)]
pub struct AgentStatus {
    /// The client's counters.
    pub stats: ClientStats,
    /// Paths toward the storage server.
    pub paths: u16,
    /// How many of them are up.
    pub paths_up: u16,
    /// What each path sent, delivered and lost, its RTT, whether it is up.
    pub path_stats: Vec<crate::path::PathStats>,
    /// Requests in flight.
    pub outstanding: usize,
    /// The window in effect, bytes in flight allowed over all paths: the congestion control's,
    /// or the configured `window_bytes` without one.
    pub window_bytes: u64,
}

/// One block of a WRITE the core hands to the storage handler.
#[derive(Debug)]
pub struct WriteBlock<'a> {
    /// The volume written.
    pub volume: u32,
    /// The block (the first, when `zero`).
    pub lba: u64,
    /// The block, in the core's receive buffer: copy what must outlive the call. Empty when
    /// `zero`.
    pub data: &'a [u8],
    /// Its CRC32C, checked by the server against the data.
    pub crc: u32,
    /// The agent asked for force unit access.
    pub fua: bool,
    /// Zeros, to be deallocated (TRIM, WRITE_ZEROES), over `count` blocks from `lba`: `data` is
    /// empty.
    pub zero: bool,
    /// Blocks: 1 for data, up to [`crate::transport::solar::wire::MAX_ZERO_BLOCKS`] for zeros.
    pub count: u32,
    /// The write's request id: the block's version (see [`SolarServer::note_version`]).
    pub rpc: u64,
}

/// A READ the core hands to the storage handler.
#[derive(Debug, Clone, Copy)]
pub struct ReadBlocks {
    /// The volume read.
    pub volume: u32,
    /// The first block.
    pub lba: u64,
    /// Blocks to read.
    pub count: u16,
}

/// The storage behind a Solar server endpoint. The core calls it for each request, on the core.
pub trait StorageHandler: Send + Sync {
    /// A block to make durable: copy it, and finish `done` once it is (from any thread).
    fn write(&self, block: WriteBlock<'_>, done: WriteDone);
    /// Blocks to read: answer each through `answer` before returning (reads are bounded: the
    /// core waits for them, as a NIC's built-in handler would).
    fn read(&self, req: ReadBlocks, answer: &mut ReadAnswer<'_>);
}

/// The answer to one WRITE block, finished from any thread. Dropped unfinished, it answers
/// `Busy` (the agent sends the block again).
pub struct WriteDone {
    host: Arc<SolarHost>,
    token: Token,
    arrived: u64,
    finished: bool,
}

impl WriteDone {
    /// The block is durable (`Status::Ok`) or failed with `status`.
    pub fn finish(mut self, status: Status) {
        self.finished = true;
        self.send(status);
    }

    fn send(&self, status: Status) {
        let service_ns = self.host.now().saturating_sub(self.arrived);
        self.host.command(SolarCmd::WriteDone {
            token: self.token,
            status,
            service_ns,
        });
    }
}

impl Drop for WriteDone {
    fn drop(&mut self) {
        if !self.finished {
            self.send(Status::Busy);
        }
    }
}

/// Answers the blocks of one READ, on the core.
pub struct ReadAnswer<'a> {
    server: &'a mut SolarServer,
    token: Token,
}

impl ReadAnswer<'_> {
    /// Block `k` of the read is `data[off..off + 4096]`, stored with CRC `crc` (the agent checks
    /// it end to end).
    pub fn block(&mut self, k: u16, data: Arc<[u8]>, off: usize, crc: u32) {
        self.server.read_block(self.token, k, data, off, crc);
    }

    /// Block `k` could not be read.
    pub fn failed(&mut self, k: u16, status: Status) {
        self.server.read_failed(self.token, k, status);
    }
}

/// A command to a core's Solar endpoints.
pub(crate) enum SolarCmd {
    AddClient {
        id: u64,
        server: SocketAddrV4,
        client: Box<SolarClient>,
        status: Arc<Mutex<AgentStatus>>,
    },
    /// `data: None`: zeros over `blocks` blocks, deallocated (TRIM). `version`: the caller's
    /// (else the client numbers it). `epoch`: the caller's (else the client's configured one).
    Write {
        id: u64,
        volume: u32,
        lba: u64,
        epoch: Option<u32>,
        data: Option<Arc<[u8]>>,
        blocks: u16,
        fua: bool,
        version: Option<u64>,
        done: oneshot::Sender<Result<(), SolarError>>,
    },
    Read {
        id: u64,
        volume: u32,
        lba: u64,
        epoch: Option<u32>,
        blocks: u16,
        done: oneshot::Sender<Result<Vec<u8>, SolarError>>,
    },
    /// Fences `volume` at `epoch` in the server ([`SolarServer::fence`]); `done` gets the
    /// fence in effect once requests arriving from now on are checked against it (None: this
    /// core serves no Solar).
    Fence {
        volume: u32,
        epoch: u32,
        done: oneshot::Sender<Option<u32>>,
    },
    Retarget {
        id: u64,
        server: SocketAddrV4,
    },
    CloseClient {
        id: u64,
    },
    Serve {
        server: Box<SolarServer>,
        handler: Arc<dyn StorageHandler>,
        stats: Arc<Mutex<ServerStats>>,
    },
    WriteDone {
        token: Token,
        status: Status,
        service_ns: u64,
    },
    CloseServer,
}

/// The application threads' side of a core's Solar endpoints: their command queue and the
/// core it goes to.
pub(crate) struct SolarHost {
    core: Arc<EngineShared>,
    cmds: Mutex<Vec<SolarCmd>>,
    /// The core said it sleeps: a command must ring its eventfd.
    sleeping: AtomicBool,
    /// Requests of the core's clients awaiting their answers, as of the core's last pass.
    outstanding: AtomicUsize,
}

impl SolarHost {
    fn new(core: Arc<EngineShared>) -> SolarHost {
        SolarHost {
            core,
            cmds: Mutex::new(Vec::new()),
            sleeping: AtomicBool::new(false),
            outstanding: AtomicUsize::new(0),
        }
    }

    /// The core's clock (ns).
    pub(crate) fn now(&self) -> u64 {
        self.core.now()
    }

    /// The core's address (where its server answers).
    pub(crate) fn local_addr(&self) -> SocketAddrV4 {
        self.core.local_addr()
    }

    /// Hands a command to this core's Solar endpoints. A lone request (none other awaiting
    /// its answer) to a core that sleeps does not wake it: the core's send side runs from
    /// this thread ([`EngineShared::run_here`]), so the request leaves in this call, one
    /// system call in place of the eventfd write and the core's wake-up (QD1 latency).
    /// Otherwise the core takes the command in its next pass, batched with the others that
    /// arrive meanwhile (one `sendmmsg` for many requests at depth, or for the answers of a
    /// storage node's group commit, which come as one command per block).
    pub(crate) fn command(&self, c: SolarCmd) {
        let request = matches!(c, SolarCmd::Write { .. } | SolarCmd::Read { .. });
        self.cmds.lock().push(c);
        if request
            && self.outstanding.load(Ordering::Relaxed) == 0
            && self.sleeping.load(Ordering::SeqCst)
            && self.core.run_here()
        {
            return;
        }
        if self.sleeping.swap(false, Ordering::SeqCst) {
            self.core.notify();
        }
    }
}

/// Registers Solar with each data core as the engine starts it, and keeps each core's
/// [`SolarHost`] for the context's Solar handles.
#[derive(Default)]
pub(crate) struct SolarFactory {
    hosts: Mutex<Vec<Arc<SolarHost>>>,
}

impl SolarFactory {
    /// The hosts of the cores made so far, in core order.
    pub(crate) fn into_hosts(self) -> Vec<Arc<SolarHost>> {
        self.hosts.into_inner()
    }
}

impl ProtocolFactory for SolarFactory {
    fn for_core(&self, index: usize, shared: &Arc<EngineShared>) -> Vec<Box<dyn CoreProtocol>> {
        let host = Arc::new(SolarHost::new(shared.clone()));
        let mut hosts = self.hosts.lock();
        debug_assert_eq!(hosts.len(), index, "cores are made in order");
        hosts.push(host.clone());
        vec![Box::new(SolarCore::new(host))]
    }
}

/// The peer token of an address (what [`SolarServer`] answers to).
fn peer_token(a: SocketAddrV4) -> u64 {
    (u32::from(*a.ip()) as u64) << 16 | a.port() as u64
}

fn token_addr(t: u64) -> SocketAddrV4 {
    SocketAddrV4::new(Ipv4Addr::from((t >> 16) as u32), t as u16)
}

enum Pending {
    Write(oneshot::Sender<Result<(), SolarError>>),
    Read(Vec<u8>, oneshot::Sender<Result<Vec<u8>, SolarError>>),
}

impl Pending {
    fn fail(self, e: SolarError) {
        match self {
            Pending::Write(d) => {
                let _ = d.send(Err(e));
            }
            Pending::Read(_, d) => {
                let _ = d.send(Err(e));
            }
        }
    }
}

struct ClientEp {
    id: u64,
    server: SocketAddrV4,
    client: Box<SolarClient>,
    pending: HashMap<IoId, Pending>,
    status: Arc<Mutex<AgentStatus>>,
}

struct ServerEp {
    server: Box<SolarServer>,
    handler: Arc<dyn StorageHandler>,
    stats: Arc<Mutex<ServerStats>>,
}

/// A Solar packet on its way out.
struct SolarOut {
    t: Transmit,
    /// The core's port it leaves from (`EngineShared::link`).
    link: usize,
    dst: SocketAddrV4,
}

impl Datagram for SolarOut {
    fn link(&self) -> usize {
        self.link
    }
    fn dst(&self) -> SocketAddrV4 {
        self.dst
    }
    fn wire_len(&self) -> usize {
        wire::HDR + self.t.block.as_ref().map_or(0, |_| BLOCK)
    }
    fn spans(&self) -> usize {
        1 + self.t.block.is_some() as usize
    }
    unsafe fn push_spans(&self, m: &mut OutMsg) {
        // SAFETY: the header lives in `self`, the block in the `Arc` `self` holds; the caller
        // keeps `self` alive and in place until `m` is sent. `bytes()` bounds-checks the block.
        unsafe {
            m.push(self.t.header.as_ptr(), wire::HDR);
            if let Some(b) = &self.t.block {
                let bytes = b.bytes();
                m.push(bytes.as_ptr(), bytes.len());
            }
        }
    }
}

/// A core's Solar endpoints, owned by the core.
struct SolarCore {
    host: Arc<SolarHost>,
    clients: Vec<ClientEp>,
    server: Option<ServerEp>,
    out: Vec<SolarOut>,
    next_publish: u64,
    cmd_buf: Vec<SolarCmd>,
    /// Clients added or closed so far (a part of [`SolarCore::ports_generation`]).
    client_changes: u64,
    /// The host delay the clients were last given (a new client starts with it).
    host_delay: u64,
}

impl SolarCore {
    fn new(host: Arc<SolarHost>) -> SolarCore {
        SolarCore {
            host,
            clients: Vec::new(),
            server: None,
            out: Vec::new(),
            next_publish: 0,
            cmd_buf: Vec::new(),
            client_changes: 0,
            host_delay: 0,
        }
    }

    fn has_clients(&self) -> bool {
        !self.clients.is_empty()
    }

    fn client(&mut self, id: u64) -> Option<&mut ClientEp> {
        self.clients.iter_mut().find(|c| c.id == id)
    }

    fn apply(&mut self, c: SolarCmd, now: u64) {
        match c {
            SolarCmd::AddClient {
                id,
                server,
                mut client,
                status,
            } => {
                self.client_changes += 1;
                client.set_host_delay(self.host_delay);
                self.clients.push(ClientEp {
                    id,
                    server,
                    client,
                    pending: HashMap::new(),
                    status,
                });
            }
            SolarCmd::Write {
                id,
                volume,
                lba,
                epoch,
                data,
                blocks,
                fua,
                version,
                done,
            } => {
                let Some(ep) = self.client(id) else {
                    let _ = done.send(Err(SolarError::Stopped));
                    return;
                };
                let epoch = epoch.unwrap_or(ep.client.epoch());
                let submitted = match (data, version) {
                    (Some(data), None) => ep.client.write(now, volume, lba, data, fua),
                    (data, Some(v)) => {
                        ep.client
                            .write_versioned(now, Target { volume, lba, epoch }, data, blocks, fua, v)
                    }
                    (None, None) => Err(crate::transport::solar::client::SubmitError::Version(0)),
                };
                match submitted {
                    Ok(io) => {
                        ep.pending.insert(io, Pending::Write(done));
                    }
                    Err(e) => {
                        let _ = done.send(Err(e.into()));
                    }
                }
            }
            SolarCmd::Read {
                id,
                volume,
                lba,
                epoch,
                blocks,
                done,
            } => {
                let Some(ep) = self.client(id) else {
                    let _ = done.send(Err(SolarError::Stopped));
                    return;
                };
                let epoch = epoch.unwrap_or(ep.client.epoch());
                match ep.client.read_at(now, Target { volume, lba, epoch }, blocks) {
                    Ok(io) => {
                        let buf = vec![0u8; blocks as usize * BLOCK];
                        ep.pending.insert(io, Pending::Read(buf, done));
                    }
                    Err(e) => {
                        let _ = done.send(Err(e.into()));
                    }
                }
            }
            SolarCmd::Retarget { id, server } => {
                if let Some(ep) = self.client(id) {
                    // blocks in flight to the old address time out and go to the new one
                    ep.server = server;
                }
            }
            SolarCmd::CloseClient { id } => {
                if let Some(i) = self.clients.iter().position(|c| c.id == id) {
                    self.client_changes += 1;
                    let ep = self.clients.swap_remove(i);
                    for (_, p) in ep.pending {
                        p.fail(SolarError::Stopped);
                    }
                }
            }
            SolarCmd::Serve { server, handler, stats } => self.server = Some(ServerEp { server, handler, stats }),
            SolarCmd::Fence { volume, epoch, done } => {
                let _ = done.send(self.server.as_mut().map(|s| s.server.fence(volume, epoch)));
            }
            SolarCmd::WriteDone {
                token,
                status,
                service_ns,
            } => {
                if let Some(s) = &mut self.server {
                    s.server.write_done_after(token, status, service_ns);
                }
            }
            SolarCmd::CloseServer => {
                if let Some(s) = self.server.take() {
                    *s.stats.lock() = s.server.stats();
                }
            }
        }
    }

    fn publish(&self) {
        for ep in &self.clients {
            *ep.status.lock() = AgentStatus {
                stats: ep.client.stats(),
                paths: ep.client.paths().len() as u16,
                paths_up: ep.client.paths_up(),
                path_stats: ep.client.path_stats(),
                outstanding: ep.client.outstanding(),
                window_bytes: ep.client.window(),
            };
        }
        if let Some(s) = &self.server {
            *s.stats.lock() = s.server.stats();
        }
    }
}

impl CoreProtocol for SolarCore {
    /// A datagram is Solar when it starts with Solar's magic and version (see the module).
    fn claims(&self, d: &[u8]) -> bool {
        wire::is_solar_packet(d)
    }

    /// One received Solar datagram from `src`; `ce`: its IP header carried ECN CE.
    fn on_packet(&mut self, shared: &Arc<EngineShared>, now: u64, d: &[u8], src: SocketAddrV4, ce: bool) {
        let request = matches!(d.get(2), Some(&op) if op == Op::Write as u8
            || op == Op::ReadReq as u8
            || op == Op::Probe as u8
            || op == Op::ChallengeReply as u8);
        if request {
            let Some(s) = &mut self.server else {
                shared.stats.rx_unknown_qp.inc();
                return;
            };
            match s.server.on_packet_at(now, peer_token(src), d, ce) {
                Err(e) => tracing::debug!("Solar request from {src}: {e}"),
                Ok(None) => {}
                Ok(Some(Request::Write {
                    token,
                    volume,
                    lba,
                    data,
                    crc,
                    fua,
                    zero,
                    count,
                    rpc,
                })) => {
                    let done = WriteDone {
                        host: self.host.clone(),
                        token,
                        arrived: now,
                        finished: false,
                    };
                    let block = WriteBlock {
                        volume,
                        lba,
                        data,
                        crc,
                        fua,
                        zero,
                        count,
                        rpc,
                    };
                    s.handler.write(block, done);
                }
                Ok(Some(Request::Read {
                    token,
                    volume,
                    lba,
                    count,
                })) => {
                    let handler = s.handler.clone();
                    let mut answer = ReadAnswer {
                        server: &mut s.server,
                        token,
                    };
                    handler.read(ReadBlocks { volume, lba, count }, &mut answer);
                    s.server.read_finished(token);
                }
            }
            return;
        }
        let Some(ep) = self.clients.iter_mut().find(|c| c.server == src) else {
            shared.stats.rx_unknown_qp.inc();
            return;
        };
        match ep.client.on_packet(now, d) {
            Err(e) => tracing::debug!("Solar answer from {src}: {e}"),
            Ok(None) => {}
            Ok(Some(p)) => {
                if let Some(Pending::Read(buf, _)) = ep.pending.get_mut(&p.io) {
                    let off = p.idx as usize * BLOCK;
                    if let Some(dst) = buf.get_mut(off..off + BLOCK) {
                        // the one copy of a read block: from the receive buffer into the
                        // request's buffer, in whatever order blocks arrive
                        dst.copy_from_slice(p.data);
                        shared.stats.rx_payload_copy_bytes.add(BLOCK as u64);
                    }
                }
            }
        }
    }

    /// Applies the commands queued for this core; returns whether there were any.
    fn commands(&mut self, now: u64) -> bool {
        std::mem::swap(&mut *self.host.cmds.lock(), &mut self.cmd_buf);
        if self.cmd_buf.is_empty() {
            return false;
        }
        let mut cmds = std::mem::take(&mut self.cmd_buf);
        for c in cmds.drain(..) {
            self.apply(c, now);
        }
        self.cmd_buf = cmds;
        true
    }

    /// Runs the clients' due timers; returns the earliest deadline left.
    fn timers(&mut self, now: u64) -> Option<u64> {
        let mut next: Option<u64> = None;
        for ep in &mut self.clients {
            if ep.client.next_timeout().is_some_and(|t| t <= now) {
                ep.client.on_timer(now);
            }
            if let Some(t) = ep.client.next_timeout() {
                next = Some(next.map_or(t, |n| n.min(t)));
            }
        }
        if self.has_clients() || self.server.is_some() {
            next = Some(next.map_or(self.next_publish, |n| n.min(self.next_publish)));
        }
        next
    }

    /// Delivers finished requests, gathers what the endpoints have to send into `self.out`,
    /// and publishes status when due; returns whether anything happened.
    fn collect(&mut self, shared: &EngineShared, now: u64) -> bool {
        let mut any = false;
        let ports = shared.path_ports;
        for ep in &mut self.clients {
            while let Some(ClientEvent::Done { io, result }) = ep.client.poll_event() {
                any = true;
                let Some(p) = ep.pending.remove(&io) else { continue };
                match (p, result) {
                    (Pending::Write(d), r) => {
                        let _ = d.send(r.map_err(SolarError::Io));
                    }
                    (Pending::Read(buf, d), r) => {
                        let _ = d.send(r.map(|()| buf).map_err(SolarError::Io));
                    }
                }
            }
            while let Some(t) = ep.client.poll_transmit(now) {
                any = true;
                // the path's current source port (a path that looked cut moves to a spare)
                let link = t.port as usize % ports;
                self.out.push(SolarOut {
                    t,
                    link,
                    dst: ep.server,
                });
            }
        }
        if let Some(s) = &mut self.server {
            while let Some(t) = s.server.poll_transmit() {
                any = true;
                let dst = token_addr(t.peer);
                let link = t.port as usize;
                self.out.push(SolarOut { t, link, dst });
            }
        }
        let outstanding = self.clients.iter().map(|ep| ep.pending.len()).sum();
        self.host.outstanding.store(outstanding, Ordering::Relaxed);
        if now >= self.next_publish {
            self.next_publish = now + PUBLISH_NS;
            self.publish();
        }
        any
    }

    fn flush(&mut self, tx: &mut Transmitter<'_>) -> bool {
        tx.send(&mut self.out)
    }

    /// Says the core is about to sleep; false when a command raced in (then it must not).
    fn prepare_sleep(&self) -> bool {
        self.host.sleeping.store(true, Ordering::SeqCst);
        if !self.host.cmds.lock().is_empty() {
            self.host.sleeping.store(false, Ordering::SeqCst);
            return false;
        }
        true
    }

    fn woke(&self) {
        self.host.sleeping.store(false, Ordering::SeqCst);
    }

    /// Changes whenever the source ports the clients' paths leave from may have changed (a
    /// client came or went, a path moved to a spare port).
    fn ports_generation(&self) -> (u64, u64) {
        let moves = self.clients.iter().map(|ep| ep.client.paths().repaths()).sum();
        (self.client_changes, moves)
    }

    /// Adds the source ports (link indexes below `path_ports`) the clients' paths leave from
    /// now, where their storage servers answer.
    fn rx_ports(&self, path_ports: usize, out: &mut Vec<usize>) {
        for ep in &self.clients {
            let paths = ep.client.paths();
            out.extend((0..paths.len()).map(|i| paths.port(i as u8) as usize % path_ports));
        }
    }

    /// Hands every client a new host-delay estimate (how late the core runs, which the engine
    /// measures; see `CoreProtocol::set_host_delay`).
    fn set_host_delay(&mut self, ns: u64) {
        self.host_delay = ns;
        for ep in &mut self.clients {
            ep.client.set_host_delay(ns);
        }
    }
}

impl Drop for SolarCore {
    fn drop(&mut self) {
        for ep in self.clients.drain(..) {
            for (_, p) in ep.pending {
                p.fail(SolarError::Stopped);
            }
        }
    }
}

/// A client endpoint's settings, checked against the context (`paths` at most its path ports).
pub(crate) fn check_client_config(cfg: &ClientConfig, path_ports: usize) -> Result<(), String> {
    if cfg.source_ports as usize > path_ports {
        return Err(format!(
            "source_ports: {} exceeds the context's path_ports ({path_ports})",
            cfg.source_ports
        ));
    }
    if cfg.paths == 0 || cfg.paths as usize > path_ports {
        return Err(format!(
            "paths: {} not in 1..={path_ports} (the context's path_ports: a path is a source port)",
            cfg.paths
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_tokens_round_trip() {
        let a: SocketAddrV4 = "10.1.2.3:4567".parse().unwrap();
        assert_eq!(token_addr(peer_token(a)), a);
    }
}
