//! The kernel-TCP transport (Mooncake's fallback, here only when configured): per peer a pool
//! of connections ("lanes", `tcp_lanes`), each a pipeline of up to `slices_in_flight` requests:
//! a 32-byte header plus the payload streamed straight from or into registered memory. A
//! lane's sender thread writes requests while its window allows; its receiver thread reads the
//! replies, which the peer sends in request order, and completes them. A WRITE's reply is sent
//! after its payload is placed ("Completed means applied", Mooncake's v2 framing), a READ's
//! reply carries the data. The receiver checks every range against its registered buffers and
//! answers an error (draining the payload) instead of touching other memory. A broken
//! connection sends every request in flight on it again (up to `slice_attempts`) and the lane
//! reconnects, or retires when the peer is gone.
//!
//! Frame header (little endian): magic `KVT1` u32, op u8, status u8, reserved u16, len u32,
//! reserved u32, id u64, addr u64. Ops: HELLO (addr = the instance the caller expects; the
//! reply's addr = the live instance; its payload = the caller's engine name), WRITE, READ,
//! NOTIFY (payload = a notification). A reply with status ≠ 0 carries an error message of `len`
//! bytes. A NOTIFY is answered after the receiver queued it, or with an error when it refuses
//! it (malformed, or the caller's share of its notification queue is full): the sender's
//! notification, and so its batch, fails with that cause.

use super::{Notifies, Slice};
use crate::batch::{Batch, Opcode, MAX_NOTIFY_BYTES};
use crate::memory::Memory;
use crate::TransferError;
use parking_lot::{Condvar, Mutex};
use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

const MAGIC: u32 = 0x3154_564B; // "KVT1"
pub(crate) const HDR: usize = 32;
const OP_HELLO: u8 = 1;
const OP_WRITE: u8 = 2;
const OP_READ: u8 = 3;
const OP_NOTIFY: u8 = 4;
/// Largest payload of one frame (a slice).
const MAX_FRAME: u32 = 64 << 20;
/// Payloads up to this size go out in one write with their header.
const COALESCE: usize = 16 << 10;
/// A lone request up to this size is sent from the submitting thread when a lane is idle.
const INLINE_MAX: usize = 64 << 10;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Header {
    op: u8,
    status: u8,
    len: u32,
    id: u64,
    addr: u64,
}

impl Header {
    fn encode(&self) -> [u8; HDR] {
        let mut b = [0u8; HDR];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = self.op;
        b[5] = self.status;
        b[8..12].copy_from_slice(&self.len.to_le_bytes());
        b[16..24].copy_from_slice(&self.id.to_le_bytes());
        b[24..32].copy_from_slice(&self.addr.to_le_bytes());
        b
    }

    pub(crate) fn decode(b: &[u8; HDR]) -> Result<Header, String> {
        let magic = u32::from_le_bytes(b[0..4].try_into().expect("4 bytes"));
        if magic != MAGIC {
            return Err(format!("bad frame magic {magic:#x}"));
        }
        let h = Header {
            op: b[4],
            status: b[5],
            len: u32::from_le_bytes(b[8..12].try_into().expect("4 bytes")),
            id: u64::from_le_bytes(b[16..24].try_into().expect("8 bytes")),
            addr: u64::from_le_bytes(b[24..32].try_into().expect("8 bytes")),
        };
        if h.len > MAX_FRAME {
            return Err(format!("frame of {} B exceeds {MAX_FRAME}", h.len));
        }
        Ok(h)
    }
}

fn read_header(s: &mut TcpStream) -> io::Result<Header> {
    let mut b = [0u8; HDR];
    s.read_exact(&mut b)?;
    Header::decode(&b).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

fn reply_err(s: &mut TcpStream, h: &Header, msg: &str) -> io::Result<()> {
    let m = msg.as_bytes();
    let r = Header {
        op: h.op,
        status: 1,
        len: m.len() as u32,
        id: h.id,
        addr: 0,
    };
    let mut v = r.encode().to_vec();
    v.extend_from_slice(m);
    s.write_all(&v)
}

fn reply_ok(s: &mut TcpStream, h: &Header, addr: u64) -> io::Result<()> {
    s.write_all(
        &Header {
            op: h.op,
            status: 0,
            len: 0,
            id: h.id,
            addr,
        }
        .encode(),
    )
}

fn drain(s: &mut TcpStream, mut n: u64) -> io::Result<()> {
    let mut scratch = [0u8; 16 << 10];
    while n > 0 {
        let k = n.min(scratch.len() as u64) as usize;
        s.read_exact(&mut scratch[..k])?;
        n -= k as u64;
    }
    Ok(())
}

/// State the server side and the lanes share.
pub(crate) struct Shared {
    pub name: String,
    pub memory: Arc<Memory>,
    pub notifies: Arc<Notifies>,
    pub instance: u64,
    pub stop: AtomicBool,
    /// Malformed frames received (counted, then the connection is closed).
    pub malformed: std::sync::atomic::AtomicU64,
    /// Connected peers by segment name.
    pub peers: Mutex<HashMap<String, Arc<TcpPeer>>>,
}

/// Serves one accepted connection until it closes or sends garbage.
fn serve_conn(mut s: TcpStream, sh: Arc<Shared>) -> io::Result<()> {
    s.set_nodelay(true)?;
    let h = match read_header(&mut s) {
        Ok(h) => h,
        Err(e) if e.kind() == io::ErrorKind::InvalidData => {
            sh.malformed.fetch_add(1, Ordering::Relaxed);
            return reply_err(&mut s, &Header::default(), &e.to_string());
        }
        Err(e) => return Err(e),
    };
    if h.op != OP_HELLO || h.len > 256 {
        sh.malformed.fetch_add(1, Ordering::Relaxed);
        return reply_err(&mut s, &h, "expected HELLO");
    }
    // the caller's name: its notifications are bounded under it (see `Notifies`)
    let mut from = vec![0u8; h.len as usize];
    s.read_exact(&mut from)?;
    let from = String::from_utf8_lossy(&from).into_owned();
    reply_ok(&mut s, &h, sh.instance)?;
    loop {
        let h = match read_header(&mut s) {
            Ok(h) => h,
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                sh.malformed.fetch_add(1, Ordering::Relaxed);
                return reply_err(&mut s, &Header::default(), &e.to_string());
            }
            Err(e) => return Err(e),
        };
        let range = || {
            sh.memory
                .find(h.addr, h.len as u64)
                .filter(|(b, _)| b.remote)
                .ok_or_else(|| {
                    format!(
                        "range {:#x}+{} is not inside a registered buffer of segment {}",
                        h.addr, h.len, sh.name
                    )
                })
        };
        match h.op {
            OP_WRITE => match range() {
                Ok((b, off)) => {
                    b.region.recv_exact(off, h.len as usize, s.as_fd())?;
                    reply_ok(&mut s, &h, 0)?;
                }
                Err(m) => {
                    drain(&mut s, h.len as u64)?;
                    reply_err(&mut s, &h, &m)?;
                }
            },
            OP_READ => match range() {
                Ok((b, off)) => {
                    let r = Header { status: 0, ..h };
                    let n = h.len as usize;
                    if n <= COALESCE {
                        let mut v = r.encode().to_vec();
                        b.region.append_to(off, n, &mut v);
                        s.write_all(&v)?;
                    } else {
                        s.write_all(&r.encode())?;
                        b.region.send_all(off, n, s.as_fd())?;
                    }
                }
                Err(m) => reply_err(&mut s, &h, &m)?,
            },
            OP_NOTIFY if h.len as usize <= MAX_NOTIFY_BYTES => {
                let mut v = vec![0u8; h.len as usize];
                s.read_exact(&mut v)?;
                match sh.notifies.push_encoded(&from, &v) {
                    Ok(()) => reply_ok(&mut s, &h, 0)?,
                    Err(m) => reply_err(&mut s, &h, &m)?,
                }
            }
            op => {
                sh.malformed.fetch_add(1, Ordering::Relaxed);
                return reply_err(&mut s, &h, &format!("unknown op {op} or oversized payload"));
            }
        }
    }
}

/// What a lane carries.
pub(crate) enum TcpWork {
    Slice(Slice),
    /// A notification: for a batch (reported to it) or a standalone one (reported on the channel).
    Notify {
        payload: Vec<u8>,
        batch: Option<Arc<Batch>>,
        done: Option<std::sync::mpsc::Sender<Result<(), String>>>,
    },
}

impl TcpWork {
    fn fail(self, msg: String) {
        match self {
            TcpWork::Slice(s) => s.fail(msg),
            TcpWork::Notify { batch, done, .. } => {
                if let Some(b) = batch {
                    b.notify_done(Err(msg.clone()));
                }
                if let Some(d) = done {
                    let _ = d.send(Err(msg));
                }
            }
        }
    }
}

pub(crate) struct TcpPeer {
    name: String,
    addr: SocketAddr,
    instance: u64,
    queue: Mutex<VecDeque<TcpWork>>,
    cv: Condvar,
    alive: AtomicUsize,
    closed: AtomicBool,
    lanes: Vec<Arc<Lane>>,
}

/// A request sent on a lane and not yet answered, with where a READ's data goes.
struct InFlight {
    work: TcpWork,
    /// READ: the local region and offset its reply's payload is placed at.
    into: Option<(Arc<netstack::mem::Region>, usize, usize)>,
}

/// One connection's pipeline: requests written by the lane's sender (or a caller with a small
/// lone request), answered in order to its receiver.
struct Lane {
    /// The write half (None once retired); held while a request is written, so one request's
    /// frame is never interleaved with another's.
    tx: Mutex<Option<TcpStream>>,
    /// Sent, not yet answered, in order.
    pending: Mutex<VecDeque<InFlight>>,
    /// Signalled when an answer frees window room or the connection breaks.
    room: Condvar,
    /// The connection failed: the sender tears the session down and reconnects.
    broken: AtomicBool,
    window: usize,
}

/// The most requests any lane had in flight at once (a pipeline measure for tests and tools).
static PEAK_IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);

impl Lane {
    fn new(s: TcpStream, window: usize) -> Lane {
        Lane {
            tx: Mutex::new(Some(s)),
            pending: Mutex::new(VecDeque::new()),
            room: Condvar::new(),
            broken: AtomicBool::new(false),
            window,
        }
    }

    /// Marks the connection broken and wakes both threads (the receiver's read fails).
    fn break_conn(&self, s: Option<&TcpStream>) {
        self.broken.store(true, Ordering::SeqCst);
        if let Some(s) = s {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        let _g = self.pending.lock();
        self.room.notify_all();
    }
}

impl TcpPeer {
    /// The next queued work; None when the peer is closed or `stop` says to give up.
    fn pop_or(&self, stop: impl Fn() -> bool) -> Option<TcpWork> {
        let mut q = self.queue.lock();
        loop {
            if self.closed.load(Ordering::Relaxed) || stop() {
                return None;
            }
            if let Some(w) = q.pop_front() {
                return Some(w);
            }
            self.cv.wait_for(&mut q, Duration::from_millis(200));
        }
    }

    fn push(&self, w: impl IntoIterator<Item = TcpWork>, front: bool) {
        let mut q = self.queue.lock();
        for w in w {
            if front {
                q.push_front(w);
            } else {
                q.push_back(w);
            }
        }
        drop(q);
        self.cv.notify_all();
    }

    fn who(&self) -> String {
        format!("peer {} ({} over tcp)", self.name, self.addr)
    }
}

/// The tcp transport of one engine.
pub(crate) struct TcpPath {
    sh: Arc<Shared>,
    data_addr: SocketAddr,
    lanes: usize,
    /// Requests in flight per lane.
    window: usize,
    attempts: u32,
}

/// Connects one lane and says HELLO; returns the stream and the live instance.
fn dial(addr: SocketAddr, me: &str, expect: u64) -> io::Result<(TcpStream, u64)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(3))?;
    s.set_nodelay(true)?;
    let me = me.as_bytes();
    let h = Header {
        op: OP_HELLO,
        len: me.len().min(256) as u32,
        addr: expect,
        ..Default::default()
    };
    let mut v = h.encode().to_vec();
    v.extend_from_slice(&me[..h.len as usize]);
    s.write_all(&v)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    let r = read_header(&mut s)?;
    s.set_read_timeout(None)?;
    if r.status != 0 {
        let mut m = vec![0u8; r.len as usize];
        s.read_exact(&mut m)?;
        return Err(io::Error::other(String::from_utf8_lossy(&m).into_owned()));
    }
    Ok((s, r.addr))
}

impl TcpPath {
    /// Binds the data port on `bind` and starts accepting peers.
    pub(crate) fn start(
        bind: SocketAddr,
        sh: Shared,
        lanes: usize,
        window: usize,
        attempts: u32,
    ) -> Result<TcpPath, TransferError> {
        let l = TcpListener::bind(bind).map_err(|e| TransferError::Io(format!("tcp data port {bind}: {e}")))?;
        let data_addr = l.local_addr()?;
        let sh = Arc::new(sh);
        let s2 = sh.clone();
        std::thread::Builder::new()
            .name("kvc-tcp-accept".into())
            .spawn(move || {
                for c in l.incoming() {
                    if s2.stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let Ok(c) = c else { continue };
                    let s3 = s2.clone();
                    let _ = std::thread::Builder::new().name("kvc-tcp-conn".into()).spawn(move || {
                        if let Err(e) = serve_conn(c, s3) {
                            tracing::debug!("tcp transport connection ended: {e}");
                        }
                    });
                }
            })?;
        Ok(TcpPath {
            sh,
            data_addr,
            lanes,
            window: window.max(1),
            attempts,
        })
    }

    pub(crate) fn data_addr(&self) -> SocketAddr {
        self.data_addr
    }

    pub(crate) fn malformed(&self) -> u64 {
        self.sh.malformed.load(Ordering::Relaxed)
    }

    /// The most requests one lane of this process had in flight at once.
    pub(crate) fn peak_in_flight() -> usize {
        PEAK_IN_FLIGHT.load(Ordering::Relaxed)
    }

    /// Connects `lanes` connections to a peer's data port, checking it is `instance`.
    pub(crate) fn connect(&self, name: &str, addr: SocketAddr, instance: u64) -> Result<(), TransferError> {
        if let Some(p) = self.sh.peers.lock().get(name) {
            if p.instance == instance && p.addr == addr && p.alive.load(Ordering::Relaxed) > 0 {
                return Ok(());
            }
        }
        let peer_err = |m: String| TransferError::Peer {
            peer: format!("{name} ({addr} over tcp)"),
            message: m,
        };
        let mut streams = Vec::new();
        for _ in 0..self.lanes {
            let (s, live) = dial(addr, &self.sh.name, instance).map_err(|e| peer_err(format!("connecting: {e}")))?;
            if live != instance {
                return Err(TransferError::StaleDescriptor {
                    segment: name.to_string(),
                    published: instance,
                    live,
                });
            }
            streams.push(s);
        }
        let peer = Arc::new(TcpPeer {
            name: name.to_string(),
            addr,
            instance,
            queue: Mutex::new(VecDeque::new()),
            cv: Condvar::new(),
            alive: AtomicUsize::new(streams.len()),
            closed: AtomicBool::new(false),
            lanes: streams
                .into_iter()
                .map(|s| Arc::new(Lane::new(s, self.window)))
                .collect(),
        });
        for i in 0..peer.lanes.len() {
            let (p, sh, attempts) = (peer.clone(), self.sh.clone(), self.attempts);
            std::thread::Builder::new()
                .name(format!("kvc-tcp-lane{i}"))
                .spawn(move || lane(p, sh, i, attempts))?;
        }
        if let Some(old) = self.sh.peers.lock().insert(name.to_string(), peer) {
            old.closed.store(true, Ordering::Relaxed);
            old.cv.notify_all();
        }
        Ok(())
    }

    fn peer(&self, name: &str) -> Result<Arc<TcpPeer>, TransferError> {
        let p = self.sh.peers.lock().get(name).cloned();
        match p {
            Some(p) if p.alive.load(Ordering::Relaxed) > 0 => Ok(p),
            Some(p) => {
                // every lane died: reconnect (the peer may be back) or say why not
                self.connect(&p.name, p.addr, p.instance)?;
                self.peer(name)
            }
            None => Err(TransferError::Invalid(format!("segment {name} is not open"))),
        }
    }

    pub(crate) fn submit(&self, peer: &str, mut slices: Vec<Slice>) -> Result<(), TransferError> {
        let p = self.peer(peer)?;
        if slices.len() == 1 && slices[0].len as usize <= INLINE_MAX {
            // one small request: written from this thread on an idle lane (no hand-off to the
            // sender); the lane's receiver completes it
            for l in &p.lanes {
                if l.broken.load(Ordering::Relaxed) || !l.pending.lock().is_empty() {
                    continue;
                }
                let Some(mut g) = l.tx.try_lock() else { continue };
                let Some(stream) = g.as_mut() else { continue };
                let sl = slices.pop().expect("one slice");
                match send(l, stream, TcpWork::Slice(sl), &self.sh.memory) {
                    Ok(()) => {}
                    Err(SendError::Local(w, m)) => w.fail(format!("{}: {m}", p.who())),
                    // the lane's sender finds the broken connection and resends what it held
                    Err(SendError::Io(_)) => l.break_conn(Some(stream)),
                }
                return Ok(());
            }
        }
        p.push(slices.into_iter().map(TcpWork::Slice), false);
        Ok(())
    }

    /// Queues a batch's notification behind its data (every slice has completed).
    pub(crate) fn notify_batch(&self, peer: &str, payload: Vec<u8>, batch: Arc<Batch>) {
        notify_batch(&self.sh, peer, payload, batch)
    }

    /// Sends a notification and waits for the peer to have queued it.
    pub(crate) fn notify(&self, peer: &str, payload: Vec<u8>, timeout: Duration) -> Result<(), TransferError> {
        let p = self.peer(peer)?;
        let (tx, rx) = std::sync::mpsc::channel();
        p.push(
            [TcpWork::Notify {
                payload,
                batch: None,
                done: Some(tx),
            }],
            false,
        );
        match rx.recv_timeout(timeout) {
            Ok(r) => r.map_err(TransferError::Failed),
            Err(_) => Err(TransferError::TimedOut(format!("notification to {}", p.who()))),
        }
    }

    pub(crate) fn close(&self, peer: &str) {
        if let Some(p) = self.sh.peers.lock().remove(peer) {
            p.closed.store(true, Ordering::Relaxed);
            p.cv.notify_all();
        }
    }

    pub(crate) fn shutdown(&self) {
        self.sh.stop.store(true, Ordering::Relaxed);
        for (_, p) in self.sh.peers.lock().drain() {
            p.closed.store(true, Ordering::Relaxed);
            p.cv.notify_all();
        }
        let _ = TcpStream::connect_timeout(&self.data_addr, Duration::from_millis(200));
        // wake accept
    }
}

/// Reads the error message of a reply with status ≠ 0.
fn read_error(s: &mut TcpStream, r: &Header) -> io::Result<String> {
    let mut m = vec![0u8; r.len as usize];
    s.read_exact(&mut m)?;
    Ok(String::from_utf8_lossy(&m).into_owned())
}

/// Why a request could not be sent.
enum SendError {
    /// Its local range is gone: the request fails, the connection is fine.
    Local(TcpWork, String),
    /// The connection broke; the request stays in flight and the session's teardown resends it.
    Io(io::Error),
}

/// Writes one request's frame on a lane and records it in flight (before writing: the reply
/// may come before the write returns).
fn send(lane: &Lane, s: &mut TcpStream, w: TcpWork, mem: &Memory) -> Result<(), SendError> {
    match w {
        TcpWork::Slice(sl) => {
            let n = sl.len as usize;
            let Some((b, off)) = mem.find(sl.local, n as u64) else {
                let m = format!("local range {:#x}+{n} is no longer registered", sl.local);
                return Err(SendError::Local(TcpWork::Slice(sl), m));
            };
            let write = sl.op == Opcode::Write;
            let h = Header {
                op: if write { OP_WRITE } else { OP_READ },
                len: sl.len,
                addr: sl.remote,
                ..Default::default()
            };
            let into = (!write).then(|| (b.region.clone(), off, n));
            {
                let mut p = lane.pending.lock();
                p.push_back(InFlight {
                    work: TcpWork::Slice(sl),
                    into,
                });
                PEAK_IN_FLIGHT.fetch_max(p.len(), Ordering::Relaxed);
            }
            let r = if !write {
                s.write_all(&h.encode())
            } else if n <= COALESCE {
                let mut v = h.encode().to_vec();
                b.region.append_to(off, n, &mut v);
                s.write_all(&v)
            } else {
                s.write_all(&h.encode())
                    .and_then(|()| b.region.send_all(off, n, s.as_fd()))
            };
            r.map_err(SendError::Io)
        }
        TcpWork::Notify { payload, batch, done } => {
            let h = Header {
                op: OP_NOTIFY,
                len: payload.len() as u32,
                ..Default::default()
            };
            let mut v = h.encode().to_vec();
            v.extend_from_slice(&payload);
            lane.pending.lock().push_back(InFlight {
                work: TcpWork::Notify { payload, batch, done },
                into: None,
            });
            s.write_all(&v).map_err(SendError::Io)
        }
    }
}

/// A slice placed: tell its batch, and send the batch's notification if it was the last.
fn slice_done(sh: &Shared, sl: Slice) {
    let len = sl.len as u64;
    if sl.batch.slice_done(sl.task, len) {
        if let Some((to, payload)) = sl.batch.take_notify() {
            notify_batch(sh, &to, payload, sl.batch.clone());
        }
    }
}

/// A request answered: completes it (a slice placed, a notification queued) or fails it with
/// the peer's error.
fn answered(sh: &Shared, peer: &TcpPeer, w: TcpWork, r: Result<(), String>) {
    match (r, w) {
        (Ok(()), TcpWork::Slice(sl)) => slice_done(sh, sl),
        (Ok(()), TcpWork::Notify { batch, done, .. }) => {
            if let Some(b) = batch {
                b.notify_done(Ok(()));
            }
            if let Some(d) = done {
                let _ = d.send(Ok(()));
            }
        }
        (Err(m), w @ TcpWork::Notify { .. }) => w.fail(format!("{}: notification refused: {m}", peer.who())),
        (Err(m), w) => w.fail(format!("{}: {m}", peer.who())),
    }
}

/// A lane's receiver: reads replies in order and completes what they answer, until the
/// connection breaks.
fn receiver(peer: Arc<TcpPeer>, sh: Arc<Shared>, lane: Arc<Lane>, mut s: TcpStream) {
    if let Err(e) = receive_replies(&peer, &sh, &lane, &mut s) {
        tracing::debug!("{}: reading replies: {e}", peer.who());
        lane.break_conn(Some(&s));
    }
}

fn receive_replies(peer: &TcpPeer, sh: &Shared, lane: &Lane, s: &mut TcpStream) -> io::Result<()> {
    let bad = |m: String| io::Error::new(io::ErrorKind::InvalidData, m);
    loop {
        let r = read_header(s)?;
        let Some(into) = lane.pending.lock().front().map(|f| f.into.clone()) else {
            return Err(bad("a reply to no request".into()));
        };
        let res = if r.status != 0 {
            Err(read_error(s, &r)?)
        } else if let Some((region, off, n)) = into {
            if r.len as usize != n {
                return Err(bad(format!("READ reply of {} B for {n}", r.len)));
            }
            region.recv_exact(off, n, s.as_fd())?;
            Ok(())
        } else {
            Ok(())
        };
        let done = {
            let mut p = lane.pending.lock();
            let d = p.pop_front();
            lane.room.notify_all();
            d
        };
        if let Some(d) = done {
            answered(sh, peer, d.work, res);
        }
    }
}

/// One lane's sender: runs a session per connection (a receiver thread beside it), writing the
/// peer's queued requests while the window has room; when the connection breaks, resends what
/// was in flight (through the queue, up to the attempts) and reconnects, or retires the lane.
fn lane(peer: Arc<TcpPeer>, sh: Arc<Shared>, i: usize, attempts: u32) {
    let lane = peer.lanes[i].clone();
    loop {
        let Some(rx) = lane.tx.lock().as_ref().and_then(|s| s.try_clone().ok()) else {
            return retire(
                &peer,
                format!("{} lane {i}: cannot read from the connection", peer.who()),
            );
        };
        lane.broken.store(false, Ordering::SeqCst);
        let recv = {
            let (p, sh, l) = (peer.clone(), sh.clone(), lane.clone());
            std::thread::Builder::new()
                .name(format!("kvc-tcp-rx{i}"))
                .spawn(move || receiver(p, sh, l, rx))
        };
        let Ok(recv) = recv else {
            return retire(&peer, format!("{} lane {i}: cannot start its receiver", peer.who()));
        };
        let why = session(&peer, &sh, &lane);
        let _ = recv.join();
        if peer.closed.load(Ordering::Relaxed) {
            return;
        }
        let msg = format!("{} lane {i}: {why}", peer.who());
        // resend what the broken connection held, first
        let lost: Vec<InFlight> = lane.pending.lock().drain(..).collect();
        let mut again = Vec::new();
        for f in lost {
            match f.work {
                TcpWork::Slice(sl) => {
                    let what = sl.describe();
                    if let Some(sl) = sl.retry_or_fail(attempts, format!("{msg} during {what}")) {
                        again.push(TcpWork::Slice(sl));
                    }
                }
                w => again.push(w),
            }
        }
        peer.push(again.into_iter().rev(), true);
        // reconnect this lane, or retire it
        let mut g = lane.tx.lock();
        match dial(peer.addr, &sh.name, peer.instance) {
            Ok((ns, live)) if live == peer.instance => *g = Some(ns),
            Ok((_, live)) => {
                *g = None;
                drop(g);
                return retire(&peer, format!("{msg}; the peer restarted (instance {live:#x})"));
            }
            Err(e) => {
                *g = None;
                drop(g);
                return retire(&peer, format!("{msg}; reconnecting: {e}"));
            }
        }
    }
}

/// Writes queued requests on the lane's connection until it breaks (returns why) or the peer
/// is closed.
fn session(peer: &TcpPeer, sh: &Shared, lane: &Lane) -> String {
    loop {
        if lane.broken.load(Ordering::SeqCst) {
            return "the connection broke".into();
        }
        let Some(w) = peer.pop_or(|| lane.broken.load(Ordering::SeqCst)) else {
            if peer.closed.load(Ordering::Relaxed) {
                if let Some(s) = lane.tx.lock().as_ref() {
                    let _ = s.shutdown(std::net::Shutdown::Both);
                }
                return "closed".into();
            }
            return "the connection broke".into();
        };
        // wait for window room
        {
            let mut p = lane.pending.lock();
            while p.len() >= lane.window && !lane.broken.load(Ordering::SeqCst) {
                lane.room.wait_for(&mut p, Duration::from_millis(200));
            }
        }
        if lane.broken.load(Ordering::SeqCst) {
            peer.push([w], true);
            return "the connection broke".into();
        }
        let mut g = lane.tx.lock();
        let Some(s) = g.as_mut() else {
            drop(g);
            peer.push([w], true);
            return "the lane has no connection".into();
        };
        match send(lane, s, w, &sh.memory) {
            Ok(()) => {}
            Err(SendError::Local(w, m)) => w.fail(format!("{}: {m}", peer.who())),
            Err(SendError::Io(e)) => {
                lane.break_conn(Some(s));
                return format!("writing: {e}");
            }
        }
    }
}

/// A lane gave up; the last one fails everything still queued with `why`.
fn retire(peer: &TcpPeer, why: String) {
    if peer.alive.fetch_sub(1, Ordering::AcqRel) == 1 {
        let q: Vec<TcpWork> = peer.queue.lock().drain(..).collect();
        for w in q {
            w.fail(why.clone());
        }
    }
}

/// Queues a batch's notification on the target peer's lanes, behind nothing: every slice of the
/// batch has completed.
fn notify_batch(sh: &Shared, peer: &str, payload: Vec<u8>, batch: Arc<Batch>) {
    let p = sh.peers.lock().get(peer).cloned();
    match p {
        Some(p) if p.alive.load(Ordering::Relaxed) > 0 => p.push(
            [TcpWork::Notify {
                payload,
                batch: Some(batch),
                done: None,
            }],
            false,
        ),
        _ => batch.notify_done(Err(format!("notification: segment {peer} has no live connection"))),
    }
}
