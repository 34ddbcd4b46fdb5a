//! The kernel-TCP transport (Mooncake's fallback, here only when configured): per peer a pool
//! of connections ("lanes", `tcp_lanes`), each carrying one request at a time as a 32-byte
//! header plus the payload streamed straight from or into registered memory. A WRITE's reply is
//! sent after its payload is placed ("Completed means applied", Mooncake's v2 framing), a READ's
//! reply carries the data. The receiver checks every range against its registered buffers and
//! answers an error (draining the payload) instead of touching other memory.
//!
//! Frame header (little endian): magic `KVT1` u32, op u8, status u8, reserved u16, len u32,
//! reserved u32, id u64, addr u64. Ops: HELLO (addr = the instance the caller expects; the
//! reply's addr = the live instance), WRITE, READ, NOTIFY (payload = a notification). A reply
//! with status ≠ 0 carries an error message of `len` bytes.

use super::{Notifies, Slice};
use crate::batch::{Batch, Opcode, MAX_NOTIFY_BYTES};
use crate::memory::{with_region_bytes_mut, Memory};
use crate::TransferError;
use parking_lot::{Condvar, Mutex};
use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

const MAGIC: u32 = 0x3154_564B; // "KVT1"
const HDR: usize = 32;
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
struct Header {
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

    fn decode(b: &[u8; HDR]) -> Result<Header, String> {
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
    drain(&mut s, h.len as u64)?; // the caller's name (for logs only)
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
                    with_region_bytes_mut(&b.region, off, h.len as usize, |d| s.read_exact(d))?;
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
                        b.region.with_slice(off, n, |d| v.extend_from_slice(d));
                        s.write_all(&v)?;
                    } else {
                        s.write_all(&r.encode())?;
                        b.region.with_slice(off, n, |d| s.write_all(d))?;
                    }
                }
                Err(m) => reply_err(&mut s, &h, &m)?,
            },
            OP_NOTIFY if h.len as usize <= MAX_NOTIFY_BYTES => {
                let mut v = vec![0u8; h.len as usize];
                s.read_exact(&mut v)?;
                match sh.notifies.push_encoded(&v) {
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
    /// The lanes' connections (None once a lane retired). A lane thread holds its lock per
    /// request; a small request finding a lane idle is sent from the caller's thread instead.
    streams: Vec<Arc<Mutex<Option<TcpStream>>>>,
}

impl TcpPeer {
    fn pop(&self) -> Option<TcpWork> {
        let mut q = self.queue.lock();
        loop {
            if self.closed.load(Ordering::Relaxed) {
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
    pub fn start(bind: SocketAddr, sh: Shared, lanes: usize, attempts: u32) -> Result<TcpPath, TransferError> {
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
            attempts,
        })
    }

    pub fn data_addr(&self) -> SocketAddr {
        self.data_addr
    }

    pub fn malformed(&self) -> u64 {
        self.sh.malformed.load(Ordering::Relaxed)
    }

    /// Connects `lanes` connections to a peer's data port, checking it is `instance`.
    pub fn connect(&self, name: &str, addr: SocketAddr, instance: u64) -> Result<(), TransferError> {
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
            streams: streams.into_iter().map(|s| Arc::new(Mutex::new(Some(s)))).collect(),
        });
        for i in 0..peer.streams.len() {
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

    pub fn submit(&self, peer: &str, mut slices: Vec<Slice>) -> Result<(), TransferError> {
        let p = self.peer(peer)?;
        if slices.len() == 1 && slices[0].len as usize <= INLINE_MAX {
            // one small request: send it from this thread on an idle lane (no hand-off)
            for st in &p.streams {
                let Some(mut g) = st.try_lock() else { continue };
                let Some(stream) = g.as_mut() else { continue };
                let sl = slices.pop().expect("one slice");
                match do_slice(stream, &sl, &self.sh.memory) {
                    Ok(()) => slice_done(&self.sh, sl),
                    Err(LaneError::Remote(m)) => sl.fail(format!("{}: {m}", p.who())),
                    // the lane finds the broken connection on its next request and reconnects
                    Err(LaneError::Io(_)) => {
                        drop(g);
                        p.push([TcpWork::Slice(sl)], true);
                    }
                }
                return Ok(());
            }
        }
        p.push(slices.into_iter().map(TcpWork::Slice), false);
        Ok(())
    }

    /// Queues a batch's notification behind its data (every slice has completed).
    pub fn notify_batch(&self, peer: &str, payload: Vec<u8>, batch: Arc<Batch>) {
        notify_batch(&self.sh, peer, payload, batch)
    }

    /// Sends a notification and waits for the peer to have queued it.
    pub fn notify(&self, peer: &str, payload: Vec<u8>, timeout: Duration) -> Result<(), TransferError> {
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

    pub fn close(&self, peer: &str) {
        if let Some(p) = self.sh.peers.lock().remove(peer) {
            p.closed.store(true, Ordering::Relaxed);
            p.cv.notify_all();
        }
    }

    pub fn shutdown(&self) {
        self.sh.stop.store(true, Ordering::Relaxed);
        for (_, p) in self.sh.peers.lock().drain() {
            p.closed.store(true, Ordering::Relaxed);
            p.cv.notify_all();
        }
        let _ = TcpStream::connect_timeout(&self.data_addr, Duration::from_millis(200));
        // wake accept
    }
}

/// Why one request on a lane did not complete.
enum LaneError {
    /// The peer answered an error: the request fails, the connection is fine.
    Remote(String),
    /// The connection broke: retry elsewhere.
    Io(io::Error),
}

impl From<io::Error> for LaneError {
    fn from(e: io::Error) -> Self {
        LaneError::Io(e)
    }
}

fn read_status(s: &mut TcpStream) -> Result<Header, LaneError> {
    let r = read_header(s)?;
    if r.status != 0 {
        let mut m = vec![0u8; r.len as usize];
        s.read_exact(&mut m)?;
        return Err(LaneError::Remote(String::from_utf8_lossy(&m).into_owned()));
    }
    Ok(r)
}

fn do_slice(s: &mut TcpStream, sl: &Slice, mem: &Memory) -> Result<(), LaneError> {
    let n = sl.len as usize;
    let (b, off) = mem
        .find(sl.local, n as u64)
        .ok_or_else(|| LaneError::Remote(format!("local range {:#x}+{n} is no longer registered", sl.local)))?;
    let op = if sl.op == Opcode::Write { OP_WRITE } else { OP_READ };
    let h = Header {
        op,
        len: sl.len,
        addr: sl.remote,
        ..Default::default()
    };
    if sl.op == Opcode::Write {
        if n <= COALESCE {
            let mut v = h.encode().to_vec();
            b.region.with_slice(off, n, |d| v.extend_from_slice(d));
            s.write_all(&v)?;
        } else {
            s.write_all(&h.encode())?;
            b.region.with_slice(off, n, |d| s.write_all(d))?;
        }
        read_status(s)?;
    } else {
        s.write_all(&h.encode())?;
        let r = read_status(s)?;
        if r.len != sl.len {
            return Err(LaneError::Io(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("READ reply of {} B for {n}", r.len),
            )));
        }
        with_region_bytes_mut(&b.region, off, n, |d| s.read_exact(d))?;
    }
    Ok(())
}

fn do_notify(s: &mut TcpStream, payload: &[u8]) -> Result<(), LaneError> {
    let h = Header {
        op: OP_NOTIFY,
        len: payload.len() as u32,
        ..Default::default()
    };
    let mut v = h.encode().to_vec();
    v.extend_from_slice(payload);
    s.write_all(&v)?;
    read_status(s)?;
    Ok(())
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

/// One lane: takes work from the peer's queue, one request at a time.
fn lane(peer: Arc<TcpPeer>, sh: Arc<Shared>, i: usize, attempts: u32) {
    let stream = peer.streams[i].clone();
    while let Some(w) = peer.pop() {
        let mut g = stream.lock();
        let Some(s) = g.as_mut() else { return };
        let r = match &w {
            TcpWork::Slice(sl) => do_slice(s, sl, &sh.memory),
            TcpWork::Notify { payload, .. } => do_notify(s, payload),
        };
        match (r, w) {
            (Ok(()), TcpWork::Slice(sl)) => slice_done(&sh, sl),
            (Ok(()), TcpWork::Notify { batch, done, .. }) => {
                if let Some(b) = batch {
                    b.notify_done(Ok(()));
                }
                if let Some(d) = done {
                    let _ = d.send(Ok(()));
                }
            }
            (Err(LaneError::Remote(m)), w) => w.fail(format!("{}: {m}", peer.who())),
            (Err(LaneError::Io(e)), w) => {
                let msg = format!("{} lane {i}: {e}", peer.who());
                match w {
                    TcpWork::Slice(sl) => {
                        let what = sl.describe();
                        if let Some(sl) = sl.retry_or_fail(attempts, format!("{msg} during {what}")) {
                            peer.push([TcpWork::Slice(sl)], true);
                        }
                    }
                    w => peer.push([w], true),
                }
                // reconnect this lane, or retire it
                match dial(peer.addr, &sh.name, peer.instance) {
                    Ok((ns, live)) if live == peer.instance => {
                        *g = Some(ns);
                        continue;
                    }
                    Ok((_, live)) => {
                        *g = None;
                        drop(g);
                        retire(&peer, format!("{msg}; the peer restarted (instance {live:#x})"))
                    }
                    Err(e) => {
                        *g = None;
                        drop(g);
                        retire(&peer, format!("{msg}; reconnecting: {e}"))
                    }
                }
                return;
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
