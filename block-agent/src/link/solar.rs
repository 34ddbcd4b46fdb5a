//! The Solar link: a thread that drives a sans-IO [`SolarClient`] over UDP, one socket per
//! path (each path its own source port and ECMP flow). It sleeps in `epoll` on its sockets and
//! a waker, and is woken by a submission only when it sleeps. Read blocks are placed into the
//! request's buffer as they arrive, in any order.

use super::{Carrier, Cmd, LinkConfig, LinkError, LinkStatus, ReadResult};
use netstack::cc::{CcEnv, CcParams};
use netstack::transport::solar::client::{ClientEvent, IoError, IoId, SolarClient};
use netstack::transport::solar::wire::{BLOCK, HDR};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

enum Pending {
    Write(oneshot::Sender<Result<(), LinkError>>),
    Read(Vec<u8>, oneshot::Sender<ReadResult>),
}

struct Shared {
    queue: Mutex<Vec<Cmd>>,
    sleeping: AtomicBool,
    stop: AtomicBool,
    waker: mio::Waker,
    status: Mutex<LinkStatus>,
}

/// A Solar link; dropping it stops its thread (requests in flight fail).
pub(super) struct SolarLink {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

const WAKER: mio::Token = mio::Token(usize::MAX);

impl SolarLink {
    /// Opens the path sockets and starts the link's thread.
    pub(super) fn start(cfg: LinkConfig) -> Result<SolarLink, LinkError> {
        let server = cfg.server;
        let setup = |what: &str, e: std::io::Error| LinkError::Setup(server, format!("{what}: {e}"));
        let poll = mio::Poll::new().map_err(|e| setup("epoll", e))?;
        let waker = mio::Waker::new(poll.registry(), WAKER).map_err(|e| setup("waker", e))?;
        let sockets = open_paths(&cfg, &poll).map_err(|e| setup("sockets", e))?;
        let shared = Arc::new(Shared {
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
        Ok(SolarLink {
            shared,
            thread: Some(thread),
        })
    }

    pub(super) fn submit(&self, c: Cmd) {
        self.shared.queue.lock().push(c);
        if self.shared.sleeping.swap(false, Ordering::SeqCst) {
            let _ = self.shared.waker.wake();
        }
    }

    /// Counters and path health (refreshed every few milliseconds by the link's thread).
    pub(super) fn status(&self) -> LinkStatus {
        *self.shared.status.lock()
    }
}

impl Drop for SolarLink {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        let _ = self.shared.waker.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One connected UDP socket per path, registered with `poll` by path index.
fn open_paths(cfg: &LinkConfig, poll: &mio::Poll) -> std::io::Result<Vec<mio::net::UdpSocket>> {
    let paths = match cfg.carrier {
        Carrier::Udp { paths } => paths.max(1),
        Carrier::Tcp => 1,
    };
    let local: SocketAddr = if cfg.server.is_ipv4() {
        "0.0.0.0:0".parse().expect("address")
    } else {
        "[::]:0".parse().expect("address")
    };
    let mut v = Vec::new();
    for i in 0..paths {
        let mut s = mio::net::UdpSocket::bind(local)?;
        s.connect(cfg.server)?;
        poll.registry()
            .register(&mut s, mio::Token(i as usize), mio::Interest::READABLE)?;
        v.push(s);
    }
    Ok(v)
}

struct Driver {
    server: SocketAddr,
    client: SolarClient,
    /// One connected UDP socket per path.
    sockets: Vec<mio::net::UdpSocket>,
    poll: mio::Poll,
    shared: Arc<Shared>,
    epoch: Instant,
    pending: HashMap<IoId, Pending>,
    last_status: Instant,
}

impl Driver {
    fn new(cfg: LinkConfig, sockets: Vec<mio::net::UdpSocket>, poll: mio::Poll, shared: Arc<Shared>) -> Driver {
        let mut ccfg = cfg.client.clone();
        ccfg.paths = sockets.len() as u16;
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
                let t = self
                    .client
                    .next_timeout()
                    .map(|t| Duration::from_nanos(t.saturating_sub(self.now())));
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
            }
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
                for s in &self.sockets {
                    if let Err(e) = s.connect(addr) {
                        tracing::warn!("link: pointing a path at {addr}: {e}");
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
            let n = HDR + t.block.as_ref().map_or(0, |_| BLOCK);
            buf[..HDR].copy_from_slice(&t.header);
            if let Some(b) = &t.block {
                buf[HDR..n].copy_from_slice(b.bytes());
            }
            if let Some(s) = self.sockets.get(t.path as usize) {
                // a failed send is a lost packet: the block's timer resends it
                let _ = s.send(&buf[..n]);
            }
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
        let Some(s) = self.sockets.get(token) else { return };
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
