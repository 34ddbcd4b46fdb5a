//! The agent's link to one storage node: a thread that drives a sans-IO
//! [`SolarClient`] over UDP (one socket per path, so each path is its own source port and ECMP
//! flow) or over one TCP connection (`--transport tcp`, the kernel-stack baseline carrying the
//! very same packets).
//!
//! Callers submit block reads and writes from any thread and get a [`tokio::sync::oneshot`]
//! answer; the link thread sleeps in `epoll` on its sockets and a waker, and is woken by a
//! submission only when it sleeps. Read blocks are placed into the request's buffer as they
//! arrive, in any order.

use netstack::cc::{CcEnv, CcKind, CcParams};
use netstack::transport::solar::client::{
    ClientConfig, ClientEvent, ClientStats, IoError, IoId, SolarClient, SubmitError,
};
use netstack::transport::solar::wire::{self, BLOCK, HDR};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// How the packets travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Carrier {
    /// Solar over UDP with this many paths (source ports).
    Udp { paths: u16 },
    /// The same packets over one kernel TCP connection.
    Tcp,
}

/// Settings of a link.
#[derive(Debug, Clone)]
pub struct LinkConfig {
    pub server: SocketAddr,
    pub carrier: Carrier,
    /// The Solar client's settings (`paths` is taken from the carrier).
    pub client: ClientConfig,
    /// Congestion control of the link (one window across its paths).
    pub cc: CcKind,
    /// Swift's base target delay (network share of the RTT; loopback on a busy 2-core machine
    /// queues in the scheduler, so not the tens of microseconds of a real fabric).
    pub cc_target_ns: u64,
    /// Swift's smallest window in packets. A storage link keeps at least a couple of blocks in
    /// flight: below one packet Swift paces, and a window of 0.01 packets left writes waiting
    /// for a hundred RTTs behind a scheduler hiccup on a loaded host.
    pub cc_min_window: f64,
}

impl LinkConfig {
    /// Defaults toward `server`: 4 UDP paths, Swift congestion control, request ids seeded
    /// from the wall clock (so they keep increasing across agent restarts).
    pub fn new(server: SocketAddr, carrier: Carrier) -> LinkConfig {
        let rpc_base = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        LinkConfig {
            server,
            carrier,
            client: ClientConfig {
                rpc_base,
                initial_rto_ns: 20_000_000,
                min_rto_ns: 2_000_000,
                window_bytes: 1024 * BLOCK as u64,
                ..ClientConfig::default()
            },
            cc: CcKind::Swift,
            cc_target_ns: 500_000,
            cc_min_window: 2.0,
        }
    }
}

/// Why a link request failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LinkError {
    #[error("storage node {0}: {1}")]
    Io(SocketAddr, IoError),
    #[error("storage node {0}: {1}")]
    Submit(SocketAddr, SubmitError),
    #[error("storage node {0}: the link stopped")]
    Stopped(SocketAddr),
    #[error("storage node {0}: {1}")]
    Setup(SocketAddr, String),
}

/// What a read answers: the blocks, in order.
pub type ReadResult = Result<Vec<u8>, LinkError>;

enum Cmd {
    Write {
        volume: u32,
        lba: u64,
        data: Arc<[u8]>,
        fua: bool,
        done: oneshot::Sender<Result<(), LinkError>>,
    },
    Read {
        volume: u32,
        lba: u64,
        blocks: u16,
        done: oneshot::Sender<ReadResult>,
    },
    /// The storage node now serves at this address (it restarted elsewhere).
    Retarget(SocketAddr),
}

enum Pending {
    Write(oneshot::Sender<Result<(), LinkError>>),
    Read(Vec<u8>, oneshot::Sender<ReadResult>),
}

/// What a link reports about itself.
#[derive(Debug, Clone, Copy, Default)]
pub struct LinkStatus {
    pub stats: ClientStats,
    pub paths: u16,
    pub paths_up: u16,
    pub outstanding: usize,
}

struct Shared {
    /// The storage node's current address.
    server: Mutex<SocketAddr>,
    queue: Mutex<Vec<Cmd>>,
    sleeping: AtomicBool,
    stop: AtomicBool,
    waker: mio::Waker,
    status: Mutex<LinkStatus>,
}

/// A link to one storage node; dropping it stops its thread (requests in flight fail).
pub struct Link {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

const WAKER: mio::Token = mio::Token(usize::MAX);

impl Link {
    /// Opens the sockets (connects, for TCP) and starts the link's thread.
    pub fn start(cfg: LinkConfig) -> Result<Link, LinkError> {
        let server = cfg.server;
        let setup = |what: &str, e: std::io::Error| LinkError::Setup(server, format!("{what}: {e}"));
        let poll = mio::Poll::new().map_err(|e| setup("epoll", e))?;
        let waker = mio::Waker::new(poll.registry(), WAKER).map_err(|e| setup("waker", e))?;
        let sockets = Sockets::open(&cfg, &poll).map_err(|e| setup("sockets", e))?;
        let shared = Arc::new(Shared {
            server: Mutex::new(server),
            queue: Mutex::new(Vec::new()),
            sleeping: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            waker,
            status: Mutex::new(LinkStatus::default()),
        });
        let s2 = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("solar-{server}"))
            .spawn(move || Driver::new(cfg, sockets, poll, s2).run())
            .map_err(|e| setup("thread", e))?;
        Ok(Link {
            shared,
            thread: Some(thread),
        })
    }

    /// The storage node's address.
    pub fn server(&self) -> SocketAddr {
        *self.shared.server.lock()
    }

    /// Follows the storage node to `addr` (it restarted on another address): the sockets
    /// point there from now on, and blocks in flight to the old address are resent there when
    /// their timers fire (down paths come back at their next probe's answer).
    pub fn retarget(&self, addr: SocketAddr) {
        let mut cur = self.shared.server.lock();
        if *cur == addr {
            return;
        }
        tracing::info!("link to storage node {} now at {addr}", *cur);
        *cur = addr;
        drop(cur);
        self.submit(Cmd::Retarget(addr));
    }

    fn submit(&self, c: Cmd) {
        self.shared.queue.lock().push(c);
        if self.shared.sleeping.swap(false, Ordering::SeqCst) {
            let _ = self.shared.waker.wake();
        }
    }

    /// Writes `data` (whole blocks) at block `lba` of `volume`; answered once every block is
    /// durable on the node.
    pub fn write(&self, volume: u32, lba: u64, data: Arc<[u8]>, fua: bool) -> oneshot::Receiver<Result<(), LinkError>> {
        let (done, rx) = oneshot::channel();
        self.submit(Cmd::Write {
            volume,
            lba,
            data,
            fua,
            done,
        });
        rx
    }

    /// Reads `blocks` blocks at `lba` of `volume` (each checked against its stored CRC).
    pub fn read(&self, volume: u32, lba: u64, blocks: u16) -> oneshot::Receiver<ReadResult> {
        let (done, rx) = oneshot::channel();
        self.submit(Cmd::Read {
            volume,
            lba,
            blocks,
            done,
        });
        rx
    }

    /// Counters and path health (refreshed every few milliseconds by the link's thread).
    pub fn status(&self) -> LinkStatus {
        *self.shared.status.lock()
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        let _ = self.shared.waker.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The link's sockets.
enum Sockets {
    Udp(Vec<mio::net::UdpSocket>),
    Tcp(TcpConn),
}

struct TcpConn {
    server: SocketAddr,
    stream: Option<mio::net::TcpStream>,
    out: Vec<u8>,
    out_off: usize,
    inbuf: Vec<u8>,
    writable_wanted: bool,
    retry_at: Option<Instant>,
}

impl Sockets {
    fn open(cfg: &LinkConfig, poll: &mio::Poll) -> std::io::Result<Sockets> {
        match cfg.carrier {
            Carrier::Udp { paths } => {
                let local: SocketAddr = if cfg.server.is_ipv4() {
                    "0.0.0.0:0".parse().expect("address")
                } else {
                    "[::]:0".parse().expect("address")
                };
                let mut v = Vec::new();
                for i in 0..paths.max(1) {
                    let mut s = mio::net::UdpSocket::bind(local)?;
                    s.connect(cfg.server)?;
                    poll.registry()
                        .register(&mut s, mio::Token(i as usize), mio::Interest::READABLE)?;
                    v.push(s);
                }
                Ok(Sockets::Udp(v))
            }
            Carrier::Tcp => {
                let mut c = TcpConn {
                    server: cfg.server,
                    stream: None,
                    out: Vec::new(),
                    out_off: 0,
                    inbuf: Vec::with_capacity(1 << 20),
                    writable_wanted: false,
                    retry_at: None,
                };
                c.connect(poll)?;
                Ok(Sockets::Tcp(c))
            }
        }
    }
}

impl TcpConn {
    fn connect(&mut self, poll: &mio::Poll) -> std::io::Result<()> {
        let s = std::net::TcpStream::connect_timeout(&self.server, Duration::from_secs(1))?;
        s.set_nodelay(true)?;
        s.set_nonblocking(true)?;
        let mut s = mio::net::TcpStream::from_std(s);
        poll.registry()
            .register(&mut s, mio::Token(0), mio::Interest::READABLE)?;
        self.stream = Some(s);
        self.out.clear();
        self.out_off = 0;
        self.inbuf.clear();
        self.writable_wanted = false;
        Ok(())
    }

    fn broken(&mut self, poll: &mio::Poll, why: &std::io::Error) {
        if let Some(mut s) = self.stream.take() {
            tracing::warn!("TCP link to {}: {why}; reconnecting", self.server);
            let _ = poll.registry().deregister(&mut s);
        }
        self.retry_at = Some(Instant::now() + Duration::from_millis(50));
    }

    /// Writes what is buffered; asks for writability when the socket is full.
    fn flush(&mut self, poll: &mio::Poll) {
        let Some(s) = self.stream.as_mut() else {
            self.out.clear();
            self.out_off = 0;
            return;
        };
        while self.out_off < self.out.len() {
            match s.write(&self.out[self.out_off..]) {
                Ok(0) => break,
                Ok(n) => self.out_off += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.broken(poll, &e);
                    return;
                }
            }
        }
        if self.out_off == self.out.len() {
            self.out.clear();
            self.out_off = 0;
        }
        let want = self.out_off < self.out.len();
        if want != self.writable_wanted {
            if let Some(s) = self.stream.as_mut() {
                let i = if want {
                    mio::Interest::READABLE | mio::Interest::WRITABLE
                } else {
                    mio::Interest::READABLE
                };
                let _ = poll.registry().reregister(s, mio::Token(0), i);
            }
            self.writable_wanted = want;
        }
    }
}

struct Driver {
    server: SocketAddr,
    client: SolarClient,
    sockets: Sockets,
    poll: mio::Poll,
    shared: Arc<Shared>,
    epoch: Instant,
    pending: HashMap<IoId, Pending>,
    last_status: Instant,
}

impl Driver {
    fn new(cfg: LinkConfig, sockets: Sockets, poll: mio::Poll, shared: Arc<Shared>) -> Driver {
        let mut ccfg = cfg.client.clone();
        ccfg.paths = match cfg.carrier {
            Carrier::Udp { paths } => paths.max(1),
            Carrier::Tcp => 1,
        };
        let mut p = CcParams::default();
        p.swift.base_target_ns = cfg.cc_target_ns;
        p.swift.min_cwnd = cfg.cc_min_window;
        p.swift.fs_min_cwnd = p.swift.fs_min_cwnd.max(cfg.cc_min_window);
        let cc = cfg.cc.build(&CcEnv::new(&p));
        Driver {
            server: cfg.server,
            client: SolarClient::new(ccfg, cc, 1),
            sockets,
            poll,
            shared,
            epoch: Instant::now(),
            pending: HashMap::new(),
            last_status: Instant::now(),
        }
    }

    fn now(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64 + 1
    }

    fn run(mut self) {
        let mut events = mio::Events::with_capacity(256);
        let mut cmds = Vec::new();
        let mut pkt = vec![0u8; 65536];
        loop {
            if self.shared.stop.load(Ordering::SeqCst) {
                break;
            }
            std::mem::swap(&mut cmds, &mut *self.shared.queue.lock());
            for c in cmds.drain(..) {
                self.submit(c);
            }
            self.transmit();
            self.events();
            // sleep until a packet, a submission or the next timer
            self.shared.sleeping.store(true, Ordering::SeqCst);
            let timeout = if !self.shared.queue.lock().is_empty() {
                Some(Duration::ZERO)
            } else {
                let mut t = self
                    .client
                    .next_timeout()
                    .map(|t| Duration::from_nanos(t.saturating_sub(self.now())));
                if let Sockets::Tcp(c) = &self.sockets {
                    if c.retry_at.is_some() {
                        t = Some(t.map_or(Duration::from_millis(50), |t| t.min(Duration::from_millis(50))));
                    }
                }
                t.map(|t| t.min(Duration::from_millis(100)))
                    .or(Some(Duration::from_millis(100)))
            };
            let r = self.poll.poll(&mut events, timeout);
            self.shared.sleeping.store(false, Ordering::SeqCst);
            if let Err(e) = r {
                if e.kind() != std::io::ErrorKind::Interrupted {
                    tracing::error!("link to {}: epoll: {e}", self.server);
                    break;
                }
            }
            for ev in events.iter() {
                if ev.token() == WAKER {
                    continue;
                }
                self.receive(ev.token().0, &mut pkt);
                if ev.is_writable() {
                    if let Sockets::Tcp(c) = &mut self.sockets {
                        c.flush(&self.poll);
                    }
                }
            }
            self.reconnect();
            let now = self.now();
            if self.client.next_timeout().is_some_and(|t| t <= now) {
                self.client.on_timer(now);
            }
            if self.last_status.elapsed() >= Duration::from_millis(5) {
                self.publish_status();
            }
        }
        // fail whatever is left
        for (_, p) in self.pending.drain() {
            match p {
                Pending::Write(d) => {
                    let _ = d.send(Err(LinkError::Stopped(self.server)));
                }
                Pending::Read(_, d) => {
                    let _ = d.send(Err(LinkError::Stopped(self.server)));
                }
            }
        }
    }

    fn publish_status(&mut self) {
        self.last_status = Instant::now();
        *self.shared.status.lock() = LinkStatus {
            stats: self.client.stats(),
            paths: self.client.paths().len() as u16,
            paths_up: self.client.paths_up(),
            outstanding: self.client.outstanding(),
        };
    }

    fn submit(&mut self, c: Cmd) {
        let now = self.now();
        match c {
            Cmd::Retarget(addr) => {
                self.server = addr;
                match &mut self.sockets {
                    Sockets::Udp(socks) => {
                        for s in socks.iter() {
                            if let Err(e) = s.connect(addr) {
                                tracing::warn!("link: pointing a path at {addr}: {e}");
                            }
                        }
                    }
                    Sockets::Tcp(c) => {
                        c.server = addr;
                        let why = std::io::Error::other(format!("the storage node moved to {addr}"));
                        c.broken(&self.poll, &why);
                        c.retry_at = Some(Instant::now());
                    }
                }
            }
            Cmd::Write {
                volume,
                lba,
                data,
                fua,
                done,
            } => match self.client.write(now, volume, lba, data, fua) {
                Ok(io) => {
                    self.pending.insert(io, Pending::Write(done));
                }
                Err(e) => {
                    let _ = done.send(Err(LinkError::Submit(self.server, e)));
                }
            },
            Cmd::Read {
                volume,
                lba,
                blocks,
                done,
            } => match self.client.read(now, volume, lba, blocks) {
                Ok(io) => {
                    self.pending
                        .insert(io, Pending::Read(vec![0u8; blocks as usize * BLOCK], done));
                }
                Err(e) => {
                    let _ = done.send(Err(LinkError::Submit(self.server, e)));
                }
            },
        }
    }

    fn transmit(&mut self) {
        let now = self.now();
        let mut buf = [0u8; HDR + BLOCK];
        while let Some(t) = self.client.poll_transmit(now) {
            match &mut self.sockets {
                Sockets::Udp(socks) => {
                    let n = HDR + t.block.as_ref().map_or(0, |_| BLOCK);
                    buf[..HDR].copy_from_slice(&t.header);
                    if let Some(b) = &t.block {
                        buf[HDR..n].copy_from_slice(b.bytes());
                    }
                    if let Some(s) = socks.get(t.path as usize) {
                        // a failed send is a lost packet: the block's timer resends it
                        let _ = s.send(&buf[..n]);
                    }
                }
                Sockets::Tcp(c) => {
                    if c.stream.is_some() {
                        c.out.extend_from_slice(&t.header);
                        if let Some(b) = &t.block {
                            c.out.extend_from_slice(b.bytes());
                        }
                    }
                }
            }
        }
        if let Sockets::Tcp(c) = &mut self.sockets {
            c.flush(&self.poll);
        }
    }

    fn events(&mut self) {
        while let Some(ClientEvent::Done { io, result }) = self.client.poll_event() {
            let Some(p) = self.pending.remove(&io) else { continue };
            let err = |e: IoError| LinkError::Io(self.server, e);
            match p {
                Pending::Write(d) => {
                    let _ = d.send(result.map_err(err));
                }
                Pending::Read(buf, d) => {
                    let _ = d.send(result.map(|()| buf).map_err(err));
                }
            }
        }
    }

    fn receive(&mut self, token: usize, pkt: &mut [u8]) {
        match &mut self.sockets {
            Sockets::Udp(socks) => {
                let Some(s) = socks.get(token) else { return };
                // read what is queued on this socket, then let the others have a turn
                loop {
                    match s.recv(pkt) {
                        Ok(n) => place(&mut self.client, &mut self.pending, self.epoch, &pkt[..n]),
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(_) => break, // ICMP unreachable and the like: the timers cope
                    }
                }
            }
            Sockets::Tcp(c) => {
                let Some(s) = c.stream.as_mut() else { return };
                let mut failed = None;
                loop {
                    match s.read(pkt) {
                        Ok(0) => {
                            failed = Some(std::io::Error::new(
                                std::io::ErrorKind::UnexpectedEof,
                                "closed by the node",
                            ));
                            break;
                        }
                        Ok(n) => c.inbuf.extend_from_slice(&pkt[..n]),
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => {
                            failed = Some(e);
                            break;
                        }
                    }
                }
                let mut off = 0;
                while c.inbuf.len() - off >= HDR {
                    let len = match wire::packet_len(&c.inbuf[off..]) {
                        Ok(l) => l,
                        Err(e) => {
                            // a byte stream cannot be resynchronised: start a new connection
                            failed = Some(std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()));
                            off = c.inbuf.len();
                            break;
                        }
                    };
                    if c.inbuf.len() - off < len {
                        break;
                    }
                    place(
                        &mut self.client,
                        &mut self.pending,
                        self.epoch,
                        &c.inbuf[off..off + len],
                    );
                    off += len;
                }
                c.inbuf.drain(..off);
                if let Some(e) = failed {
                    c.broken(&self.poll, &e);
                }
            }
        }
    }

    fn reconnect(&mut self) {
        if let Sockets::Tcp(c) = &mut self.sockets {
            if c.stream.is_none() && c.retry_at.is_some_and(|t| Instant::now() >= t) {
                match c.connect(&self.poll) {
                    Ok(()) => {
                        c.retry_at = None;
                        tracing::info!("TCP link to {} reconnected", c.server);
                    }
                    Err(e) => {
                        tracing::debug!("TCP link to {}: {e}", c.server);
                        c.retry_at = Some(Instant::now() + Duration::from_millis(200));
                    }
                }
            }
        }
    }
}

/// Hands a packet to the client and places a read block into its request's buffer.
fn place(client: &mut SolarClient, pending: &mut HashMap<IoId, Pending>, epoch: Instant, pkt: &[u8]) {
    let now = epoch.elapsed().as_nanos() as u64 + 1;
    if let Ok(Some(p)) = client.on_packet(now, pkt) {
        if let Some(Pending::Read(buf, _)) = pending.get_mut(&p.io) {
            let off = p.idx as usize * BLOCK;
            if off + BLOCK <= buf.len() {
                buf[off..off + BLOCK].copy_from_slice(p.data);
            }
        }
    }
}
