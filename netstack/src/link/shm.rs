//! The shared-memory link: peers on the same host exchange datagrams through rings in shared
//! memory, with no system call on the data path; every other peer is reached over the UDP
//! sockets underneath (config `link = "shm"`).
//!
//! # How two links find each other
//! - The first datagram a port sends to an address of this host creates a ring: a file in
//!   `/dev/shm` (mode 0600) holding a header and [`SLOTS`] slots of one datagram or one GSO
//!   message each. The port sends a HELLO naming the file and a random nonce over UDP, and
//!   keeps sending over UDP.
//! - A shm link receiving the HELLO maps the file, checks its owner, size, nonce and both
//!   addresses, and answers ACK over UDP. A plain UDP peer counts the HELLO as a malformed
//!   packet and drops it, so the sender stays on UDP (after [`HELLOS`] unanswered HELLOs, at
//!   most one a millisecond, and [`HELLO_PATIENCE`] after the first, it stops asking and
//!   removes the file).
//! - On the ACK the sender removes the file's name (both ends keep their mappings) and from
//!   then on writes that peer's datagrams into the ring. Datagrams sent over UDP before may
//!   arrive after ring ones; the transports tolerate reordering.
//!
//! # The ring
//! One producer (the sending port) and one consumer (the receiving port): the producer writes
//! a slot (length, GSO segment size, bytes) and then publishes it with a Release store of the
//! tail; the consumer reads the tail with Acquire, copies slots out and publishes the head.
//! The memory is writable by another process, so it is never behind a Rust reference: header
//! words are `AtomicU64`s and slot bytes move by byte-wise atomic copies
//! (`mem::load_bytes`, `mem::copy_shared`). A peer that writes garbage can
//! only make its own datagrams malformed: lengths are checked against the slot, and a ring
//! whose indices make no sense is dropped.
//!
//! # Sleeping
//! A core about to sleep sets the `sleeping` word of each ring it receives from and checks the
//! rings once more (a sequentially consistent fence on each side); a producer that publishes
//! and finds the word set clears it and sends a one-datagram doorbell over UDP, which wakes
//! the core through its socket. A busy core never makes a system call for ring traffic; it
//! reads its UDP socket every [`UDP_EVERY`] polls (and after every wake-up).
//!
//! # Ends
//! A link that is dropped marks its rings closed; a sender whose receiver closed or died (seen
//! when the ring is full) forgets the ring and handshakes again on the next datagram, and a
//! receiver drops a ring once its sender has closed it or died and it is empty. A process
//! killed between creating a ring and its ACK leaves the file behind in `/dev/shm` until the
//! next shm link on the host starts: it removes the ring files whose creating process (named
//! in the file's name) is gone.
//!
//! This is one of the documented `unsafe` modules (docs/ARCHITECTURE.md, "Unsafe inventory"):
//! `mmap`/`munmap`, `AtomicU64::from_ptr` over the mapping, the atomic copies, and `kill(pid,
//! 0)`/`getpid`/`geteuid`.

use super::sys::{OutMsg, RecvBatch, SendScratch};
use super::udp::UdpPorts;
use super::{Link, LinkStats};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::atomic::{fence, AtomicU64, Ordering};

/// Slots of a ring.
pub const SLOTS: u64 = 128;
/// The largest message a slot holds: a whole GSO message (the kernel's limit is 64 KiB).
pub const SLOT_DATA: usize = 1 << 16;
/// Bytes before a slot's data: its length word, padded to a cache line.
const SLOT_HDR: usize = 64;
const SLOT: usize = SLOT_HDR + SLOT_DATA;
/// Bytes of the ring header.
const HEADER: usize = 4096;
/// The size of a ring file.
const RING_BYTES: usize = HEADER + SLOTS as usize * SLOT;
/// Where ring files live, and how their names start (then the creating process's id).
const PREFIX: &str = "/dev/shm/flexns-shm-";
/// "flexnsR1": the header's first word (the layout's version is its last byte).
const RING_MAGIC: u64 = u64::from_le_bytes(*b"flexnsR1");
/// The first bytes of a control datagram (HELLO, ACK, doorbell). A RoCEv2 packet starts with
/// its BTH opcode, and `F` (0x46) is a Reliable Datagram opcode, which flexns does not speak;
/// a Solar packet starts with `S`.
const CTRL_MAGIC: [u8; 8] = *b"FLXSHM\x00\x01";
const HELLO: u8 = 1;
const ACK: u8 = 2;
const DOORBELL: u8 = 3;
/// Unanswered HELLOs after which (and [`HELLO_PATIENCE`] after the first) a sender stays on
/// UDP for that peer.
pub const HELLOS: u32 = 8;
/// How long a sender keeps offering a ring to a peer that has not answered: a peer process
/// that a loaded host leaves unscheduled for some milliseconds must not lose its rings for
/// good (counted in sends alone, 8 HELLOs passed in a few milliseconds at 17 Gbit/s).
pub const HELLO_PATIENCE: std::time::Duration = std::time::Duration::from_secs(1);
/// Datagrams sent over UDP to a pending peer between two HELLOs.
const SENDS_PER_HELLO: u32 = 64;
/// The shortest time between two HELLOs to one peer (a fast sender reaches
/// [`SENDS_PER_HELLO`] in microseconds).
const HELLO_EVERY: std::time::Duration = std::time::Duration::from_millis(1);
/// Polls between two reads of the UDP socket while rings are attached.
pub const UDP_EVERY: u32 = 32;
/// Rings a port keeps, each way: a peer past this stays on UDP (sending) or is not answered
/// (receiving), so no number of peers makes a link map unbounded memory.
pub const MAX_RINGS: usize = 64;

// header words (byte offsets); the indices and flags each have their own cache line
const H_MAGIC: usize = 0;
const H_NONCE: usize = 8;
const H_SRC: usize = 16;
const H_DST: usize = 24;
const H_TX_PID: usize = 32;
const H_RX_PID: usize = 40;
const H_TAIL: usize = 64;
const H_HEAD: usize = 128;
const H_SLEEPING: usize = 192;
const H_TX_CLOSED: usize = 256;
const H_RX_CLOSED: usize = 320;

fn pack(a: SocketAddrV4) -> u64 {
    (u64::from(u32::from(*a.ip())) << 16) | u64::from(a.port())
}

fn pid() -> u64 {
    u64::from(std::process::id())
}

/// Whether process `pid` is gone (`kill(pid, 0)` says ESRCH).
fn is_dead(pid: u64) -> bool {
    let Ok(p) = libc::pid_t::try_from(pid) else {
        return true;
    };
    if p <= 0 {
        return true;
    }
    // SAFETY: signal 0 delivers nothing; it only checks that the process exists.
    let r = unsafe { libc::kill(p, 0) };
    r == -1 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}

/// Removes the ring files in `/dev/shm` whose creating process is gone (one killed between
/// creating a ring and its ACK leaves the file behind); returns how many. Runs when a link
/// starts.
fn sweep_stale_files() -> usize {
    let (dir, start) = PREFIX.rsplit_once('/').expect("PREFIX is a path");
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(start)) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u64>().ok()) else {
            continue;
        };
        if is_dead(pid) && std::fs::remove_file(e.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// A shared mapping of one ring file.
struct Mapping {
    ptr: *mut u8,
}

// SAFETY: the mapping is touched only through atomics and byte-wise atomic copies, which any
// thread may do; it is unmapped once, in `Drop`.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    fn map(file: &File) -> io::Result<Mapping> {
        // SAFETY: a fresh shared mapping of a file at least RING_BYTES long (both callers check
        // or set the length); nothing else in this process refers to the range.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                RING_BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping { ptr: ptr as *mut u8 })
    }

    /// Header word at byte `off`.
    fn word(&self, off: usize) -> &AtomicU64 {
        assert!(off.is_multiple_of(8) && off + 8 <= HEADER);
        // SAFETY: 8-aligned (the mapping is page-aligned), inside the mapping, which lives as
        // long as `self`; every process touches these words only atomically.
        unsafe { AtomicU64::from_ptr(self.ptr.add(off) as *mut u64) }
    }

    /// The length word of slot `i`.
    fn slot_word(&self, i: u64) -> &AtomicU64 {
        let off = HEADER + (i % SLOTS) as usize * SLOT;
        // SAFETY: as in `word`: slot starts are 64-aligned and inside the mapping.
        unsafe { AtomicU64::from_ptr(self.ptr.add(off) as *mut u64) }
    }

    /// The data of slot `i` (SLOT_DATA bytes, shared: touched only by atomic copies).
    fn slot_data(&self, i: u64) -> *mut u8 {
        let off = HEADER + (i % SLOTS) as usize * SLOT + SLOT_HDR;
        // SAFETY: `off + SLOT_DATA <= RING_BYTES`: an address inside the mapping.
        unsafe { self.ptr.add(off) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the range was mapped by `map` and nothing refers to it past this point (the
        // words handed out borrow `self`).
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, RING_BYTES) };
    }
}

/// What a push into a ring did.
enum Push {
    Pushed,
    /// No free slot: the datagram waits in the engine, as for a full socket buffer.
    Full,
    /// The receiver closed or died: forget the ring.
    Gone,
    /// Larger than a slot: send it over UDP.
    TooLarge,
}

/// The producer end of a ring.
struct OutRing {
    map: Mapping,
    tail: u64,
    head_seen: u64,
}

impl OutRing {
    /// Creates the ring file from `src` to `dst`; returns the ring, its path and nonce.
    fn create(src: SocketAddrV4, dst: SocketAddrV4) -> io::Result<(OutRing, PathBuf, u64)> {
        let nonce: u64 = rand::random();
        let path = PathBuf::from(format!(
            "{PREFIX}{}-{}-{}-{}-{nonce:016x}",
            pid(),
            src.port(),
            dst.ip(),
            dst.port()
        ));
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)?;
        let made = f.set_len(RING_BYTES as u64).and_then(|_| Mapping::map(&f));
        let map = match made {
            Ok(m) => m,
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                return Err(e);
            }
        };
        map.word(H_NONCE).store(nonce, Ordering::Relaxed);
        map.word(H_SRC).store(pack(src), Ordering::Relaxed);
        map.word(H_DST).store(pack(dst), Ordering::Relaxed);
        map.word(H_TX_PID).store(pid(), Ordering::Relaxed);
        map.word(H_MAGIC).store(RING_MAGIC, Ordering::Release);
        Ok((
            OutRing {
                map,
                tail: 0,
                head_seen: 0,
            },
            path,
            nonce,
        ))
    }

    fn push(&mut self, msg: &OutMsg) -> Push {
        if self.map.word(H_RX_CLOSED).load(Ordering::Acquire) != 0 {
            return Push::Gone;
        }
        let len: usize = msg.iov[..msg.iovcnt].iter().map(|v| v.iov_len).sum();
        if len > SLOT_DATA {
            return Push::TooLarge;
        }
        if self.tail - self.head_seen >= SLOTS {
            self.head_seen = self.map.word(H_HEAD).load(Ordering::Acquire);
            if self.head_seen > self.tail || self.tail - self.head_seen > SLOTS {
                return Push::Gone; // the receiver wrote nonsense
            }
            if self.tail - self.head_seen == SLOTS {
                let rx = self.map.word(H_RX_PID).load(Ordering::Relaxed);
                return if is_dead(rx) { Push::Gone } else { Push::Full };
            }
        }
        let data = self.map.slot_data(self.tail);
        let mut off = 0;
        for v in &msg.iov[..msg.iovcnt] {
            // SAFETY: the span is valid for reads until the message is sent (`OutMsg::push`'s
            // contract); `off + len <= SLOT_DATA`, inside the slot, which the consumer does not
            // read until the tail below publishes it.
            unsafe { crate::mem::copy_shared(v.iov_base as *const u8, data.add(off), v.iov_len) };
            off += v.iov_len;
        }
        self.map
            .slot_word(self.tail)
            .store(len as u64 | (u64::from(msg.gso) << 32), Ordering::Relaxed);
        self.tail += 1;
        self.map.word(H_TAIL).store(self.tail, Ordering::Release);
        Push::Pushed
    }

    /// After publishing: whether the consumer sleeps and needs a doorbell (clears the flag).
    fn needs_doorbell(&self) -> bool {
        // pairs with the consumer's fence between setting `sleeping` and reading the tail
        fence(Ordering::SeqCst);
        let w = self.map.word(H_SLEEPING);
        w.load(Ordering::Relaxed) != 0 && w.swap(0, Ordering::AcqRel) != 0
    }
}

impl Drop for OutRing {
    fn drop(&mut self) {
        self.map.word(H_TX_CLOSED).store(1, Ordering::Release);
    }
}

/// The consumer end of a ring.
struct InRing {
    map: Mapping,
    head: u64,
    src: SocketAddrV4,
    nonce: u64,
}

impl InRing {
    /// Maps the ring file a HELLO from `src` to `local` named, after checking it.
    fn attach(path: &str, nonce: u64, src: SocketAddrV4, local: SocketAddrV4) -> io::Result<InRing> {
        let bad = |why: &str| io::Error::new(io::ErrorKind::InvalidData, format!("shm ring {path}: {why}"));
        let name = path.strip_prefix(PREFIX).ok_or_else(|| bad("not a flexns ring path"))?;
        if name.is_empty() || name.len() > 128 || name.contains('/') || name.contains("..") {
            return Err(bad("not a flexns ring name"));
        }
        let f = OpenOptions::new().read(true).write(true).open(path)?;
        let md = f.metadata()?;
        // SAFETY: geteuid has no preconditions and cannot fail.
        let me = unsafe { libc::geteuid() };
        if md.uid() != me {
            return Err(bad("owned by another user"));
        }
        if md.len() != RING_BYTES as u64 {
            return Err(bad("wrong size"));
        }
        let map = Mapping::map(&f)?;
        let w = |o| map.word(o).load(Ordering::Acquire);
        if w(H_MAGIC) != RING_MAGIC || w(H_NONCE) != nonce || w(H_SRC) != pack(src) || w(H_DST) != pack(local) {
            return Err(bad("header does not match the HELLO"));
        }
        let head = w(H_HEAD);
        map.word(H_RX_PID).store(pid(), Ordering::Release);
        Ok(InRing { map, head, src, nonce })
    }

    /// Copies published slots into `batch` from slot `n` on; returns the new count, or `None`
    /// when the ring's indices make no sense (drop it).
    fn drain(&mut self, batch: &mut RecvBatch, mut n: usize) -> Option<usize> {
        let tail = self.map.word(H_TAIL).load(Ordering::Acquire);
        if tail < self.head || tail - self.head > SLOTS {
            return None;
        }
        let cap = batch.capacity();
        let buf = batch.buffer_len();
        while self.head != tail && n < cap {
            let w = self.map.slot_word(self.head).load(Ordering::Relaxed);
            let len = (w & 0xffff_ffff) as usize;
            let seg = ((w >> 32) & 0xffff) as usize;
            let p = self.map.slot_data(self.head);
            if len > SLOT_DATA || (len > buf && (seg == 0 || seg > buf)) {
                batch.put_truncated(n, self.src);
                n += 1;
            } else if len <= buf {
                let seg = if seg >= len { 0 } else { seg };
                // SAFETY: `len <= SLOT_DATA`: inside the slot, published by the tail read above.
                unsafe { batch.put_shared(n, self.src, 0, seg, p, len) };
                n += 1;
            } else {
                // a GSO message larger than a receive buffer: one receive per segment
                let k = len.div_ceil(seg);
                if n + k > cap {
                    break;
                }
                for s in 0..k {
                    let o = s * seg;
                    // SAFETY: `o + min(seg, len - o) <= len <= SLOT_DATA`: inside the slot.
                    unsafe { batch.put_shared(n, self.src, 0, 0, p.add(o), seg.min(len - o)) };
                    n += 1;
                }
            }
            self.head += 1;
        }
        self.map.word(H_HEAD).store(self.head, Ordering::Release);
        Some(n)
    }

    fn is_empty(&self) -> bool {
        self.map.word(H_TAIL).load(Ordering::Acquire) == self.head
    }

    /// Whether the sender closed it (or died) and nothing is left in it.
    fn finished(&self, check_pid: bool) -> bool {
        self.is_empty()
            && (self.map.word(H_TX_CLOSED).load(Ordering::Acquire) != 0
                || (check_pid && is_dead(self.map.word(H_TX_PID).load(Ordering::Relaxed))))
    }
}

impl Drop for InRing {
    fn drop(&mut self) {
        self.map.word(H_RX_CLOSED).store(1, Ordering::Release);
    }
}

/// A ring being offered to a peer that has not answered yet.
struct Pending {
    ring: Option<OutRing>,
    path: PathBuf,
    nonce: u64,
    sends: u32,
    hellos: u32,
    /// When the first HELLO and the last one went.
    first_hello: std::time::Instant,
    last_hello: std::time::Instant,
}

impl Drop for Pending {
    fn drop(&mut self) {
        // answered or not, the name goes: an attached peer keeps its mapping
        let _ = std::fs::remove_file(&self.path);
    }
}

enum Peer {
    /// Not on this host, not a shm link, or past the ring limit: UDP.
    Udp,
    Pending(Pending),
    Ring(OutRing),
}

#[derive(Default)]
struct PortState {
    out: HashMap<SocketAddrV4, Peer>,
    rings_out: usize,
    inbound: Vec<InRing>,
    polls: u32,
    sweeps: u32,
    read_udp: bool,
    tx_messages: u64,
    rx_messages: u64,
    doorbells: u64,
    /// The core received on this port itself since [`ShmLink::answers_on`] last looked (a
    /// Solar client's path moved to it, and its server answers there).
    received: bool,
}

/// UDP sockets with shared-memory rings to the peers on this host that run a shm link too.
pub struct ShmLink {
    udp: UdpPorts,
    local_ips: Vec<Ipv4Addr>,
    ports: Vec<Mutex<PortState>>,
    /// Every `stride`-th port is received on.
    stride: usize,
    /// Receive buffers for reading send-only ports.
    scratch: Mutex<RecvBatch>,
}

fn control(kind: u8, nonce: u64, path: &str) -> Vec<u8> {
    let mut m = Vec::with_capacity(26 + path.len());
    m.extend_from_slice(&CTRL_MAGIC);
    m.push(kind);
    m.extend_from_slice(&[0; 7]);
    m.extend_from_slice(&nonce.to_le_bytes());
    m.extend_from_slice(&(path.len() as u16).to_le_bytes());
    m.extend_from_slice(path.as_bytes());
    m
}

/// A control datagram's kind, nonce and path; `None` for any other datagram.
fn parse_control(d: &[u8]) -> Option<(u8, u64, &[u8])> {
    if d.len() < 26 || d[..8] != CTRL_MAGIC {
        return None;
    }
    let nonce = u64::from_le_bytes(d[16..24].try_into().ok()?);
    let n = u16::from_le_bytes([d[24], d[25]]) as usize;
    Some((d[8], nonce, d.get(26..26 + n).unwrap_or(&[])))
}

impl ShmLink {
    /// Layers rings over `udp`'s ports, of which every `stride`-th is received on (the others
    /// are multipath's extra source ports: only send, and read here for handshake answers).
    pub fn new(udp: UdpPorts, stride: usize) -> ShmLink {
        let mut local_ips: Vec<Ipv4Addr> = super::sys::interfaces().into_iter().map(|(_, ip)| ip).collect();
        local_ips.sort();
        local_ips.dedup();
        let stale = sweep_stale_files();
        if stale > 0 {
            tracing::info!("shm link: removed {stale} ring files of processes that are gone");
        }
        let ports = (0..udp.0.len()).map(|_| Mutex::new(PortState::default())).collect();
        ShmLink {
            udp,
            local_ips,
            ports,
            stride: stride.max(1),
            scratch: Mutex::new(RecvBatch::new(8, 2048)),
        }
    }

    /// Reads the socket of send-only port `q` for answers to its pending handshakes (anything
    /// else arriving there is dropped, as it would be with nothing reading that socket). A
    /// port the core receives on itself is left to it: its datagrams are the core's, and its
    /// receive handles the handshake answers among them.
    fn answers_on(&self, q: usize) {
        let mut st = self.ports[q].lock();
        if std::mem::take(&mut st.received) || !st.out.values().any(|p| matches!(p, Peer::Pending(_))) {
            return;
        }
        let mut b = self.scratch.lock();
        let n = self.udp.recv(q, &mut b).unwrap_or(0);
        for i in 0..n {
            if let (Some(d), src, _) = b.get(i) {
                if let Some((kind, nonce, path)) = parse_control(d) {
                    self.on_control(q, &mut st, src, kind, nonce, path);
                }
            }
        }
    }

    fn on_this_host(&self, ip: &Ipv4Addr) -> bool {
        ip.is_loopback() || self.local_ips.contains(ip)
    }

    /// How datagrams from `port` to `dst` go now: `true` through its ring. Starts or repeats
    /// the handshake for a peer of this host.
    fn route(&self, port: usize, st: &mut PortState, dst: SocketAddrV4) -> bool {
        let local = self.udp.0[port].local_addr();
        if !st.out.contains_key(&dst) {
            let peer = if !self.on_this_host(dst.ip()) || st.rings_out >= MAX_RINGS || dst == local {
                Peer::Udp
            } else {
                match OutRing::create(local, dst) {
                    Ok((ring, path, nonce)) => {
                        st.rings_out += 1;
                        let p = Pending {
                            ring: Some(ring),
                            path,
                            nonce,
                            sends: 0,
                            hellos: 0,
                            first_hello: std::time::Instant::now(),
                            last_hello: std::time::Instant::now(),
                        };
                        self.hello(port, dst, &p);
                        Peer::Pending(p)
                    }
                    Err(e) => {
                        tracing::debug!("shm link: no ring to {dst} ({e}); using UDP");
                        Peer::Udp
                    }
                }
            };
            st.out.insert(dst, peer);
        }
        let give_up = match st.out.get_mut(&dst) {
            Some(Peer::Ring(_)) => return true,
            Some(Peer::Pending(p)) => {
                p.sends += 1;
                if p.sends.is_multiple_of(SENDS_PER_HELLO) && p.last_hello.elapsed() >= HELLO_EVERY {
                    p.hellos += 1;
                    p.last_hello = std::time::Instant::now();
                    self.hello(port, dst, p);
                }
                p.hellos >= HELLOS && p.first_hello.elapsed() >= HELLO_PATIENCE
            }
            _ => false,
        };
        if give_up {
            st.out.insert(dst, Peer::Udp);
            st.rings_out -= 1;
        }
        false
    }

    fn hello(&self, port: usize, dst: SocketAddrV4, p: &Pending) {
        let m = control(HELLO, p.nonce, &p.path.to_string_lossy());
        let _ = self.udp.0[port].send_to(&m, dst);
    }

    /// Handles a control datagram from `src` arriving at `port`.
    fn on_control(&self, port: usize, st: &mut PortState, src: SocketAddrV4, kind: u8, nonce: u64, path: &[u8]) {
        match kind {
            HELLO => {
                let local = self.udp.0[port].local_addr();
                let known = st.inbound.iter().any(|r| r.nonce == nonce && r.src == src);
                if !known {
                    if st.inbound.len() >= MAX_RINGS {
                        tracing::warn!("shm link {local}: {MAX_RINGS} rings attached; {src} stays on UDP");
                        return;
                    }
                    let Ok(path) = std::str::from_utf8(path) else {
                        return;
                    };
                    match InRing::attach(path, nonce, src, local) {
                        Ok(r) => st.inbound.push(r),
                        Err(e) => {
                            tracing::debug!("shm link {local}: HELLO from {src} refused: {e}");
                            return;
                        }
                    }
                }
                let _ = self.udp.0[port].send_to(&control(ACK, nonce, ""), src);
            }
            ACK => {
                if let Some(Peer::Pending(p)) = st.out.get_mut(&src) {
                    if p.nonce == nonce {
                        if let Some(ring) = p.ring.take() {
                            st.out.insert(src, Peer::Ring(ring));
                        }
                    }
                }
            }
            _ => {} // a doorbell: it woke the core, which is all it is for
        }
    }
}

impl Link for ShmLink {
    fn ports(&self) -> usize {
        self.udp.ports()
    }

    fn local_addr(&self, port: usize) -> SocketAddrV4 {
        self.udp.local_addr(port)
    }

    fn send(&self, port: usize, msgs: &mut [OutMsg], scratch: &mut SendScratch) -> io::Result<usize> {
        let mut st = self.ports[port].lock();
        let mut done = 0;
        let mut rang: smallvec::SmallVec<[SocketAddrV4; 4]> = smallvec::SmallVec::new();
        let result = loop {
            // the run of datagrams that go over UDP
            let mut end = done;
            while end < msgs.len() && !self.route(port, &mut st, msgs[end].destination()) {
                end += 1;
            }
            if end > done {
                match self.udp.send(port, &mut msgs[done..end], scratch) {
                    Ok(took) => {
                        done += took;
                        if done < end {
                            break Ok(done);
                        }
                    }
                    Err(e) if done == 0 => break Err(e),
                    Err(_) => break Ok(done),
                }
            }
            if done == msgs.len() {
                break Ok(done);
            }
            // msgs[done] goes through its ring
            let dst = msgs[done].destination();
            let Some(Peer::Ring(ring)) = st.out.get_mut(&dst) else {
                unreachable!("route said ring");
            };
            match ring.push(&msgs[done]) {
                Push::Pushed => {
                    st.tx_messages += 1;
                    if !rang.contains(&dst) {
                        rang.push(dst);
                    }
                    done += 1;
                }
                Push::Full => break Ok(done),
                Push::Gone => {
                    // handshake again with whatever listens there now
                    st.out.remove(&dst);
                    st.rings_out -= 1;
                }
                Push::TooLarge => match self.udp.send(port, &mut msgs[done..done + 1], scratch) {
                    Ok(1) => done += 1,
                    Ok(_) => break Ok(done),
                    Err(e) if done == 0 => break Err(e),
                    Err(_) => break Ok(done),
                },
            }
        };
        for dst in rang {
            if let Some(Peer::Ring(r)) = st.out.get(&dst) {
                if r.needs_doorbell() {
                    st.doorbells += 1;
                    let _ = self.udp.0[port].send_to(&control(DOORBELL, 0, ""), dst);
                }
            }
        }
        result
    }

    fn recv(&self, port: usize, batch: &mut RecvBatch) -> io::Result<usize> {
        let mut st = self.ports[port].lock();
        st.polls = st.polls.wrapping_add(1);
        st.received = true;
        let mut n = 0;
        if st.inbound.is_empty() || st.read_udp || st.polls.is_multiple_of(UDP_EVERY) {
            st.read_udp = false;
            n = self.udp.recv(port, batch)?;
            let st = &mut *st;
            n = batch.retain(n, |d, src| match parse_control(d) {
                Some((kind, nonce, path)) => {
                    self.on_control(port, st, src, kind, nonce, path);
                    false
                }
                None => true,
            });
            st.sweeps = st.sweeps.wrapping_add(1);
            let check_pid = st.sweeps.is_multiple_of(1024);
            st.inbound.retain(|r| !r.finished(check_pid));
            for q in port + 1..(port + self.stride).min(self.ports.len()) {
                self.answers_on(q);
            }
        }
        let mut i = 0;
        while i < st.inbound.len() {
            let before = st.inbound[i].head;
            match st.inbound[i].drain(batch, n) {
                Some(k) => {
                    n = k;
                    st.rx_messages += st.inbound[i].head - before;
                    i += 1;
                }
                None => {
                    tracing::warn!("shm link: ring from {} is corrupt; dropped", st.inbound[i].src);
                    st.inbound.swap_remove(i);
                }
            }
        }
        Ok(n)
    }

    fn wait_fd(&self, port: usize) -> Option<RawFd> {
        self.udp.wait_fd(port)
    }

    fn route_mtu(&self, to: SocketAddrV4) -> Option<u32> {
        self.udp.route_mtu(to)
    }

    fn prepare_sleep(&self, port: usize) -> bool {
        let st = self.ports[port].lock();
        for r in &st.inbound {
            r.map.word(H_SLEEPING).store(1, Ordering::SeqCst);
        }
        // pairs with the producer's fence between publishing and reading `sleeping`
        fence(Ordering::SeqCst);
        if st.inbound.iter().all(|r| r.is_empty()) {
            return true;
        }
        for r in &st.inbound {
            r.map.word(H_SLEEPING).store(0, Ordering::Relaxed);
        }
        false
    }

    fn stats(&self) -> LinkStats {
        let mut t = LinkStats::default();
        for p in &self.ports {
            let st = p.lock();
            t.ring_tx_messages += st.tx_messages;
            t.ring_rx_messages += st.rx_messages;
            t.ring_doorbells += st.doorbells;
            t.ring_peers += st.out.values().filter(|p| matches!(p, Peer::Ring(_))).count() as u64;
        }
        t
    }

    fn woke(&self, port: usize) {
        let mut st = self.ports[port].lock();
        for r in &st.inbound {
            r.map.word(H_SLEEPING).store(0, Ordering::Relaxed);
        }
        st.read_udp = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn addr(port: u16) -> SocketAddrV4 {
        SocketAddrV4::new(Ipv4Addr::LOCALHOST, port)
    }

    /// A producer and a consumer of one ring in this process (the file's name removed).
    fn ring() -> (OutRing, InRing) {
        let (src, dst) = (addr(40001), addr(40002));
        let (out, path, nonce) = OutRing::create(src, dst).unwrap();
        let inr = InRing::attach(&path.to_string_lossy(), nonce, src, dst).unwrap();
        std::fs::remove_file(&path).unwrap();
        (out, inr)
    }

    fn msg(bytes: &[u8], gso: u16) -> OutMsg {
        let mut m = OutMsg::new(&addr(40002));
        // SAFETY: `bytes` outlives every push of the message in these tests.
        assert!(unsafe { m.push(bytes.as_ptr(), bytes.len()) });
        m.gso = gso;
        m
    }

    #[test]
    fn datagrams_and_gso_messages_cross_a_ring_in_order() {
        let (mut out, mut inr) = ring();
        let a: Vec<u8> = (0..100u8).collect();
        let b: Vec<u8> = (0..3000).map(|i| (i % 251) as u8).collect();
        assert!(matches!(out.push(&msg(&a, 0)), Push::Pushed));
        assert!(matches!(out.push(&msg(&b, 1000)), Push::Pushed));
        // buffers smaller than the GSO message: one receive per segment
        let mut batch = RecvBatch::new(8, 1500);
        assert_eq!(inr.drain(&mut batch, 0), Some(4));
        let got: Vec<Vec<u8>> = (0..4).map(|i| batch.get(i).0.unwrap().to_vec()).collect();
        assert_eq!(got[0], a);
        assert_eq!(got[1..].concat(), b);
        assert!(got[1..].iter().all(|s| s.len() == 1000));
        assert_eq!(batch.get(0).1, addr(40001), "the source is the sender's port");
        assert!(inr.is_empty());
    }

    #[test]
    fn a_full_ring_pushes_back_and_frees_up_when_drained() {
        let (mut out, mut inr) = ring();
        let d = [7u8; 64];
        for _ in 0..SLOTS {
            assert!(matches!(out.push(&msg(&d, 0)), Push::Pushed));
        }
        assert!(matches!(out.push(&msg(&d, 0)), Push::Full), "the consumer lives: wait");
        let mut batch = RecvBatch::new(SLOTS as usize, 128);
        assert_eq!(inr.drain(&mut batch, 0), Some(SLOTS as usize));
        assert!(matches!(out.push(&msg(&d, 0)), Push::Pushed));
        // a consumer that goes away is seen by the producer
        drop(inr);
        assert!(matches!(out.push(&msg(&d, 0)), Push::Gone));
    }

    #[test]
    fn garbage_from_the_other_process_is_dropped_not_trusted() {
        let (mut out, mut inr) = ring();
        let d = [1u8; 200];
        assert!(matches!(out.push(&msg(&d, 0)), Push::Pushed));
        assert!(matches!(out.push(&msg(&d, 0)), Push::Pushed));
        // the peer rewrites a published slot's length past the slot: a truncated receive
        inr.map.slot_word(0).store(u64::MAX >> 8, Ordering::Relaxed);
        let mut batch = RecvBatch::new(8, 2048);
        assert_eq!(inr.drain(&mut batch, 0), Some(2));
        assert!(
            batch.get(0).0.is_none(),
            "an impossible length is reported as truncated"
        );
        assert_eq!(batch.get(1).0.unwrap(), &d[..]);
        // a tail that runs more than a ring ahead, or behind the head: the ring is dropped
        inr.map.word(H_TAIL).store(2 + SLOTS + 1, Ordering::Release);
        assert_eq!(inr.drain(&mut batch, 0), None);
        inr.map.word(H_TAIL).store(1, Ordering::Release);
        assert_eq!(inr.drain(&mut batch, 0), None);
        // a head the consumer moved backwards or past the tail: the producer gives up on it
        out.map.word(H_HEAD).store(1 << 40, Ordering::Release);
        for _ in 0..SLOTS {
            if let Push::Gone = out.push(&msg(&d, 0)) {
                return;
            }
        }
        panic!("a nonsensical head was trusted");
    }

    #[test]
    fn a_hello_naming_another_file_or_the_wrong_addresses_is_refused() {
        let (src, dst) = (addr(40011), addr(40012));
        let (_out, path, nonce) = OutRing::create(src, dst).unwrap();
        let p = path.to_string_lossy().into_owned();
        for (path, nonce, src, dst) in [
            ("/etc/passwd".to_string(), nonce, src, dst),
            (format!("{PREFIX}../x"), nonce, src, dst),
            (p.clone(), nonce ^ 1, src, dst),
            (p.clone(), nonce, addr(1), dst),
            (p.clone(), nonce, src, addr(2)),
        ] {
            assert!(
                InRing::attach(&path, nonce, src, dst).is_err(),
                "{path} {nonce:x} {src} {dst}"
            );
        }
        assert!(InRing::attach(&p, nonce, src, dst).is_ok());
        std::fs::remove_file(&path).unwrap();
        assert!(parse_control(b"FLXSHM\x00\x01short").is_none());
        assert!(parse_control(&[0u8; 64]).is_none());
        let m = control(HELLO, 9, "/dev/shm/x");
        assert_eq!(parse_control(&m), Some((HELLO, 9, &b"/dev/shm/x"[..])));
    }

    #[test]
    fn ring_files_of_processes_that_are_gone_are_swept() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let gone = child.id();
        child.wait().unwrap();
        let stale = format!("{PREFIX}{gone}-1-127.0.0.1-2-00000000000000aa");
        let mine = format!("{PREFIX}{}-1-127.0.0.1-2-00000000000000ab", std::process::id());
        std::fs::write(&stale, b"").unwrap();
        std::fs::write(&mine, b"").unwrap();
        assert!(sweep_stale_files() >= 1);
        assert!(!std::path::Path::new(&stale).exists(), "the dead process's file stays");
        assert!(
            std::path::Path::new(&mine).exists(),
            "a live process's file was removed"
        );
        std::fs::remove_file(&mine).unwrap();
    }
}
