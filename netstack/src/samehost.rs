//! The same-host one-copy path: an RDMA WRITE or READ between two contexts on one host is one
//! copy from the source to the destination by the requester's data core, with the checks the
//! responder would make, and no packet, no ICRC.
//!
//! # How it works
//! - A context on the `shm` link (with `same_host_copy` on) keeps an *export*: a `memfd`
//!   holding a table of its registered memory regions (rkey, protection domain, rights,
//!   address range, and where the memory is: a `memfd` of its own, or caller memory at its
//!   address in the process) and of its QPs (number, state, protection domain). Its
//!   [`crate::mem::MrTable`] updates the table on every registration and deregistration; each
//!   QP's data core updates its QP entry on every state change.
//! - A QP's [`crate::verbs::Endpoint`] names the export ([`SameHostDesc`]: process id,
//!   descriptor, inode, nonce). A QP connecting to an endpoint that names one opens
//!   `/proc/<pid>/fd/<fd>` (the kernel lets only the same user, or root, do that), checks the
//!   inode and the nonce in the file (so a reused process id or descriptor is never taken for
//!   the peer), and maps it. Any failure leaves the QP on the packet path.
//! - A WRITE or READ posted on such a QP while nothing of the QP is in flight on the packet
//!   path (so the copy cannot overtake an earlier request) is executed by the data core: the
//!   local SGEs are checked in the context's own table, the rkey, the protection domain of the
//!   peer's QP, its state, the rights and the bounds in the peer's export, and the bytes are
//!   copied into (or out of) the peer's memory through a mapping of its `memfd`, or with
//!   `process_vm_writev`/`process_vm_readv` (CMA, one kernel copy) for caller memory. The
//!   completion follows the copy. Whatever the path cannot decide (no entry, a key it does not
//!   know, a failed check, a denied CMA) goes by packets instead, where the peer's own checks
//!   answer with the NAK it always would: this path never invents an error of its own.
//!
//! # Deregistration
//! Each MR entry holds a sequence word and an in-use count. A requester increments the count,
//! then checks the sequence word again; the owner, deregistering, makes the sequence word odd
//! and waits for the count to reach 0 (both sequentially consistent: one of them sees the
//! other). So once `deregister` returns, no peer touches the memory through this path, as
//! with a NIC. A peer that died in the middle of a copy is waited for at most
//! [`REVOKE_WAIT`].
//!
//! # Trust
//! The kernel lets a process open another's `/proc/<pid>/fd/<n>` only if it may read that
//! process's state (same user, or root; a non-dumpable process refuses everyone): the peers
//! that pass are those a POSIX shared-memory segment of the exporter would be open to, which is
//! the model of Mooncake's and UCX's shared-memory transports. The requester makes the checks
//! the responder would (a bad rkey still fails), which keeps well-behaved peers correct; they
//! are not a wall against a hostile same-user process, which can open any of the exporter's
//! memfds. Under Yama's `ptrace_scope = 1` such a process could not otherwise reach the memory
//! (it may not attach), so where that matters run the context with `same_host_copy = false` (or
//! `link = "udp"`). CMA needs the right to attach, so Yama keeps caller memory on packets.
//! Large requests are copied whole by the data core: a 64 MiB WRITE holds it for a few
//! milliseconds, during which its other QPs wait (the services cut transfers into slices of a
//! few MiB).
//!
//! This is one of the documented `unsafe` modules (docs/ARCHITECTURE.md, "Unsafe inventory"):
//! `mmap`/`munmap` of the export and of peers' memory, `AtomicU64::from_ptr` over the export,
//! the copy (`copy_raw`) and CMA over raw pointers.

use crate::mem::{Access, MrExport, MrTable, Region};
use crate::work::{SendWr, WrOpcode};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// MR entries an export holds: registrations whose table index is below this are reachable.
pub const MR_SLOTS: usize = 1 << 16;
/// QP entries an export holds (indexed by QPN modulo this; a QP whose entry another holds is
/// reached by packets).
pub const QP_SLOTS: usize = 1 << 16;
/// How long a deregistration waits for a peer's copy in progress.
pub const REVOKE_WAIT: Duration = Duration::from_secs(1);
/// Mappings of a peer's memory one attachment keeps before it drops the idle ones.
const MAX_MAPPINGS: usize = 1024;
/// A copy checks between pieces of this size that its entry was not withdrawn (so a
/// deregistration waits for one piece at most) and stops if it was.
pub const COPY_PIECE: usize = 1 << 20;
/// Requests between two sweeps of an attachment's mappings for regions the peer withdrew.
const SWEEP_EVERY: u64 = 4096;

const MAGIC: u64 = u64::from_le_bytes(*b"flexnsX1");
const HEADER: usize = 4096;
/// Words of an MR entry: sequence, rkey, pd, rights | fd << 32, iova, length, inode, in-use.
const MR_WORDS: usize = 8;
/// Words of a QP entry: (qpn + 1) << 8 | state, pd, the QP number it is connected to + 1, and
/// the export nonce of the context it is connected to.
const QP_WORDS: usize = 4;
const FILE_LEN: usize = HEADER + MR_SLOTS * MR_WORDS * 8 + QP_SLOTS * QP_WORDS * 8;
/// The fd word of an entry whose memory is caller memory, reached by CMA at its address.
const FD_CMA: u64 = 0xFFFF_FFFF;
/// QP states an entry may hold that accept requests (RTR, RTS).
const QP_RTR: u64 = 2;
const QP_RTS: u64 = 3;

// Header words: 0 magic, 1 nonce, 2 pid, 3 rbase, 4 closed (set when the context drops it),
// 5 bytes peers wrote into the context's memory, 6 bytes peers read from it (added by them).

/// Where a context's export is: what a QP's endpoint carries so that a peer on the same host
/// can map it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SameHostDesc {
    /// The exporting process.
    pub pid: u32,
    /// The export's descriptor in that process.
    pub fd: i32,
    /// The export file's inode.
    pub ino: u64,
    /// A random number the file holds: a process id or descriptor reused since is not taken
    /// for the exporter.
    pub nonce: u64,
}

/// A shared, read-write mapping of the first bytes of a file (a `memfd`), unmapped on drop.
///
/// Its bytes are shared with other processes that map the same file and may change at any
/// time, so no Rust reference to them is ever formed: words are reached as atomics
/// ([`Mapping::word`]) and bulk bytes only by raw copies at [`Mapping::as_ptr`]. The export
/// tables here use it, and so does flexnsd for its rings.
pub struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is shared memory accessed only by atomics and raw copies (the module's
// model); the pointer stays valid until drop.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps the first `len` bytes of `file` shared, readable and writable. The caller makes
    /// sure the file has at least `len` bytes for as long as it is mapped (a file another
    /// process holds must be sealed against shrinking): touching a page past its end raises
    /// `SIGBUS`. Fails with `InvalidInput` for `len` 0, and with the OS error of `mmap`.
    pub fn map(file: &File, len: usize) -> std::io::Result<Mapping> {
        if len == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "len: 0 bytes"));
        }
        // SAFETY: a new shared mapping of `len` bytes of an open file at an address the kernel
        // picks; no Rust reference to it is ever formed.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Mapping {
            ptr: ptr as *mut u8,
            len,
        })
    }

    /// The 8-byte word `i` of the mapping (bytes `8 * i ..`) as an atomic.
    ///
    /// # Panics
    /// If the word passes the end of the mapping: callers index with validated values, so
    /// that is a bug of the caller, never of the process on the other side.
    pub fn word(&self, i: usize) -> &AtomicU64 {
        // `i < len / 8`, not `(i + 1) * 8 <= len`: that product wraps for a huge `i`
        assert!(i < self.len / 8, "word {i} outside a {}-byte mapping", self.len);
        // SAFETY: in bounds (checked), 8-aligned (a page-aligned mapping), valid while `self`
        // is, and only ever accessed atomically by every process that maps it.
        unsafe { AtomicU64::from_ptr(self.ptr.add(i * 8) as *mut u64) }
    }

    /// The address of the first byte in this process (for raw copies; never make a
    /// reference from it).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Its length in bytes (never 0).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no bytes: never (`map` refuses 0).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping `map` made; nothing holds a pointer into it any more.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

fn mr_word(i: usize, w: usize) -> usize {
    HEADER / 8 + i * MR_WORDS + w
}

fn qp_word(i: usize, w: usize) -> usize {
    HEADER / 8 + MR_SLOTS * MR_WORDS + i * QP_WORDS + w
}

/// A context's own export (the owner's side).
pub struct Export {
    /// The export's memfd: held open so that peers can open it through `/proc/<pid>/fd`.
    _file: File,
    map: Mapping,
    desc: SameHostDesc,
}

impl std::fmt::Debug for Export {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Export({:?})", self.desc)
    }
}

impl Export {
    /// A fresh export for a table whose rkeys' index parts count from `rbase`.
    pub fn create(rbase: u32) -> std::io::Result<Export> {
        use std::os::fd::FromRawFd;
        // SAFETY: a C string literal; a close-on-exec anonymous file.
        let fd = unsafe { libc::memfd_create(c"flexns-export".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: the descriptor just created, owned by nothing else.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(FILE_LEN as u64)?;
        let map = Mapping::map(&file, FILE_LEN)?;
        let nonce: u64 = rand::random();
        map.word(1).store(nonce, Ordering::Relaxed);
        map.word(2).store(std::process::id() as u64, Ordering::Relaxed);
        map.word(3).store(rbase as u64, Ordering::Relaxed);
        map.word(0).store(MAGIC, Ordering::Release);
        let desc = SameHostDesc {
            pid: std::process::id(),
            fd,
            ino: file.metadata()?.ino(),
            nonce,
        };
        Ok(Export { _file: file, map, desc })
    }

    /// Bytes same-host peers wrote into (`.0`) and read from (`.1`) this context's memory by
    /// the copy path: what the responder of a NIC would count as received and sent, which no
    /// packet here shows (the peers count them in the export as they copy).
    pub fn peer_bytes(&self) -> (u64, u64) {
        (
            self.map.word(5).load(Ordering::Relaxed),
            self.map.word(6).load(Ordering::Relaxed),
        )
    }

    /// What endpoints carry.
    pub fn desc(&self) -> SameHostDesc {
        self.desc
    }

    /// Sets QP `qpn`'s entry: `state` 0-4 as [`crate::verbs::QpState`] (Reset, Init, RTR, RTS,
    /// Err); a QP whose slot another QP holds is not exported. `gone` clears it.
    pub(crate) fn set_qp(&self, qpn: u32, pd: u32, state: u64, gone: bool) {
        let i = qpn as usize % QP_SLOTS;
        let w0 = self.map.word(qp_word(i, 0));
        let cur = w0.load(Ordering::Relaxed);
        let mine = (qpn as u64 + 1) << 8;
        if cur != 0 && cur >> 8 != mine >> 8 {
            return; // another live QP holds the slot
        }
        if gone {
            w0.store(0, Ordering::Release);
            self.map.word(qp_word(i, 2)).store(0, Ordering::Relaxed);
            self.map.word(qp_word(i, 3)).store(0, Ordering::Relaxed);
            return;
        }
        if cur == 0 {
            // a new holder: no peer until it connects
            self.map.word(qp_word(i, 2)).store(0, Ordering::Relaxed);
            self.map.word(qp_word(i, 3)).store(0, Ordering::Relaxed);
        }
        self.map.word(qp_word(i, 1)).store(pd as u64, Ordering::Relaxed);
        w0.store(mine | state, Ordering::Release);
    }

    /// Records whom QP `qpn` connects to: the peer's QP number and the nonce of the peer
    /// context's export (0: it has none). A requester copies into this context's memory only
    /// through a QP connected to that very requester QP, in that very context, as a NIC's
    /// responder QP takes requests only from its own peer: without this, a caller that handed
    /// a server this context's export and QP number in a forged endpoint would have the server
    /// write into memory this context exposed to someone else. Called before the QP's state
    /// leaves Init (its core publishes RTR afterwards, with a Release store).
    pub(crate) fn set_qp_peer(&self, qpn: u32, dest_qpn: u32, peer_nonce: u64) {
        let i = qpn as usize % QP_SLOTS;
        if self.map.word(qp_word(i, 0)).load(Ordering::Relaxed) >> 8 != qpn as u64 + 1 {
            return; // another QP holds the slot: this one is not exported
        }
        self.map
            .word(qp_word(i, 2))
            .store(dest_qpn as u64 + 1, Ordering::Relaxed);
        self.map.word(qp_word(i, 3)).store(peer_nonce, Ordering::Relaxed);
    }
}

impl MrExport for Export {
    /// Publishes registration `idx` (its table index): reachable if its memory is a memfd or
    /// caller memory, and the index fits. Called under the table's write lock.
    fn publish_mr(&self, idx: usize, rkey: u32, pd: u32, access: Access, region: &Region) {
        if idx >= MR_SLOTS || !access.is_remote() {
            return;
        }
        let (fd, ino) = match region.shared_file() {
            Some((fd, ino)) => (fd as u32 as u64, ino),
            None if region.is_process_memory() => (FD_CMA, 0),
            None => return,
        };
        let w = |k| self.map.word(mr_word(idx, k));
        let seq = w(0).load(Ordering::Relaxed);
        let odd = seq | 1;
        w(0).store(odd, Ordering::Relaxed);
        fence(Ordering::Release);
        w(1).store(rkey as u64, Ordering::Relaxed);
        w(2).store(pd as u64, Ordering::Relaxed);
        w(3).store(access.0 as u64 | fd << 32, Ordering::Relaxed);
        w(4).store(region.addr(), Ordering::Relaxed);
        w(5).store(region.len() as u64, Ordering::Relaxed);
        w(6).store(ino, Ordering::Relaxed);
        w(0).store(odd + 1, Ordering::Release);
    }

    /// Withdraws registration `idx`: when this returns true, no peer copies to or from its
    /// memory through this path (see the module's "Deregistration"). A copy in progress stops
    /// at its next piece ([`COPY_PIECE`]), so a live peer lets go within a millisecond or so.
    /// False: a peer still held the entry after [`REVOKE_WAIT`] (stopped, or dead in the
    /// middle of a copy); the entry stays withdrawn (odd) for good, and the table must not
    /// reuse its index. Called under the table's write lock.
    fn revoke_mr(&self, idx: usize) -> bool {
        if idx >= MR_SLOTS {
            return true;
        }
        let w = |k| self.map.word(mr_word(idx, k));
        let seq = w(0).load(Ordering::Relaxed);
        if w(1).load(Ordering::Relaxed) == 0 {
            return true; // never published
        }
        let odd = seq | 1;
        w(0).store(odd, Ordering::SeqCst);
        let start = Instant::now();
        while w(7).load(Ordering::SeqCst) != 0 {
            if start.elapsed() > REVOKE_WAIT {
                tracing::error!(
                    "deregistration: a same-host peer still held MR slot {idx} after {REVOKE_WAIT:?} (stopped, or \
                     dead in the middle of a copy); the slot is retired for good"
                );
                return false;
            }
            std::hint::spin_loop();
            std::thread::yield_now();
        }
        w(1).store(0, Ordering::Relaxed);
        w(0).store(odd + 1, Ordering::Release);
        true
    }
}

impl Drop for Export {
    fn drop(&mut self) {
        // peers that still map it see it closed and go by packets
        self.map.word(4).store(1, Ordering::Release);
    }
}

/// What a copy moves through: a mapping of the peer's memfd, or CMA at an address.
enum Target {
    Mapped(Arc<Mapping>),
    Cma(u64),
}

/// A mapping of a peer region's memfd: the descriptor and inode it was opened by, the entry's
/// sequence word it was made under (a changed word: the peer withdrew or replaced the
/// registration, and the mapping only keeps its pages alive), and the mapping.
type RegionMap = (u64, u64, u64, Arc<Mapping>);

/// A peer's export, mapped (the requester's side).
pub struct PeerExport {
    desc: SameHostDesc,
    map: Mapping,
    /// Mappings of the peer's region memfds, by MR slot.
    regions: Mutex<HashMap<usize, RegionMap>>,
    /// CMA was refused (no ptrace permission): caller memory goes by packets.
    cma_denied: std::sync::atomic::AtomicBool,
    /// The exporting process (a pidfd, opened before the export was checked, so it names the
    /// process that holds the export even if its id is reused later); `None` for this
    /// process. A peer that died is written to by packets, which time out as they would on a
    /// NIC, never "completed" into memory no one reads.
    pidfd: Option<std::os::fd::OwnedFd>,
    /// Requests executed (paces the sweeps of `regions`).
    ops: AtomicU64,
}

impl std::fmt::Debug for PeerExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PeerExport({:?})", self.desc)
    }
}

/// Which way a copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dir {
    /// Local memory into the peer's (WRITE).
    Out,
    /// The peer's memory into local memory (READ).
    In,
}

/// What the path did with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Done {
    /// Copied, this many bytes, through a mapping of the peer's memory.
    Mapped(u64),
    /// Copied, this many bytes, by CMA.
    Cma(u64),
}

impl PeerExport {
    /// Maps the export `desc` names, if this process may open it and it is the one named.
    pub fn attach(desc: SameHostDesc) -> std::io::Result<PeerExport> {
        let bad = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_string());
        let pidfd = if desc.pid == std::process::id() {
            None
        } else {
            use std::os::fd::FromRawFd;
            // SAFETY: pidfd_open(2) with no flags returns a new descriptor or -1.
            let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, desc.pid as libc::pid_t, 0) };
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // SAFETY: the descriptor just returned, owned by nothing else.
            Some(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
        };
        let file = open_fd(desc.pid, desc.fd, desc.ino)?;
        let md = file.metadata()?;
        if md.len() < FILE_LEN as u64 {
            return Err(bad("the descriptor names another file"));
        }
        let map = Mapping::map(&file, FILE_LEN)?;
        if map.word(0).load(Ordering::Acquire) != MAGIC
            || map.word(1).load(Ordering::Relaxed) != desc.nonce
            || map.word(2).load(Ordering::Relaxed) != desc.pid as u64
        {
            return Err(bad("the file is not the export named (magic, nonce or process)"));
        }
        Ok(PeerExport {
            desc,
            map,
            regions: Mutex::new(HashMap::new()),
            cma_denied: Default::default(),
            pidfd,
            ops: AtomicU64::new(0),
        })
    }

    /// Whether the exporter still runs and its context is open.
    fn alive(&self) -> bool {
        if self.map.word(4).load(Ordering::Acquire) != 0 {
            return false; // its context closed the export
        }
        let Some(fd) = &self.pidfd else {
            return true;
        };
        let mut p = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, no wait; a pidfd is readable once its process exited.
        let r = unsafe { libc::poll(&mut p, 1, 0) };
        r == 0
    }

    /// The export it maps.
    pub fn desc(&self) -> SameHostDesc {
        self.desc
    }

    /// Executes `wr` (a WRITE or READ of QP `me` = (its number, its context's export nonce),
    /// in protection domain `pd`, whose local SGEs `mrs` checks) against the peer's QP
    /// `dest_qpn`; `None` when the packet path must take it (an opcode, key, state, peer or
    /// range this path does not decide).
    pub(crate) fn execute(&self, wr: &SendWr, mrs: &MrTable, pd: u32, me: (u32, u64), dest_qpn: u32) -> Option<Done> {
        let (dir, need_local, need_remote) = match wr.opcode {
            WrOpcode::RdmaWrite => (Dir::Out, Access(0), Access::REMOTE_WRITE),
            WrOpcode::RdmaRead => (Dir::In, Access::LOCAL_WRITE, Access::REMOTE_READ),
            _ => return None,
        };
        let mut local: smallvec::SmallVec<[(Arc<Region>, usize, usize); 2]> = smallvec::SmallVec::new();
        let mut total: u64 = 0;
        for sge in &wr.sg_list {
            let (r, off) = mrs.check(sge.lkey, pd, sge.addr, sge.length as u64, need_local).ok()?;
            local.push((r, off, sge.length as usize));
            total += sge.length as u64;
        }
        if total > 1 << 31 || crate::work::validate_send(wr).is_err() || !self.alive() {
            return None;
        }
        // the peer's QP: there, in RTR/RTS, and its protection domain
        let qi = dest_qpn as usize % QP_SLOTS;
        let q0 = self.map.word(qp_word(qi, 0)).load(Ordering::Acquire);
        if q0 >> 8 != dest_qpn as u64 + 1 || !matches!(q0 & 0xFF, QP_RTR | QP_RTS) {
            return None;
        }
        let peer_pd = self.map.word(qp_word(qi, 1)).load(Ordering::Relaxed);
        // ... connected to this very QP of this very context
        if self.map.word(qp_word(qi, 2)).load(Ordering::Relaxed) != me.0 as u64 + 1
            || self.map.word(qp_word(qi, 3)).load(Ordering::Relaxed) != me.1
        {
            return None;
        }
        // the rkey's entry
        let rbase = self.map.word(3).load(Ordering::Relaxed) as u32;
        let idx = ((wr.rkey >> 8).wrapping_sub(rbase) & 0xFF_FFFF) as usize;
        if idx >= MR_SLOTS {
            return None;
        }
        let w = |k| self.map.word(mr_word(idx, k));
        let s1 = w(0).load(Ordering::Acquire);
        if s1 & 1 == 1 || s1 == 0 {
            return None;
        }
        let rkey = w(1).load(Ordering::Relaxed);
        let mr_pd = w(2).load(Ordering::Relaxed);
        let af = w(3).load(Ordering::Relaxed);
        let iova = w(4).load(Ordering::Relaxed);
        let len = w(5).load(Ordering::Relaxed);
        let ino = w(6).load(Ordering::Relaxed);
        let (access, fd) = (Access(af as u32), af >> 32);
        // hold the entry, then make sure it did not change since it was read
        w(7).fetch_add(1, Ordering::SeqCst);
        let release = || w(7).fetch_sub(1, Ordering::Release);
        if w(0).load(Ordering::SeqCst) != s1 {
            release();
            return None;
        }
        let end = wr.remote_addr.checked_add(total);
        let ok = rkey == wr.rkey as u64
            && mr_pd == peer_pd
            && access.contains(need_remote)
            && wr.remote_addr >= iova
            && end.is_some_and(|e| iova.checked_add(len).is_some_and(|top| e <= top));
        if !ok {
            release();
            return None;
        }
        let off = (wr.remote_addr - iova) as usize;
        if self.desc.pid == std::process::id() && overlaps_itself(&local, fd, ino, off, wr.remote_addr) {
            // a copy within the same memory whose ranges overlap: the packet path snapshots
            release();
            return None;
        }
        let target = if fd == FD_CMA {
            if self.cma_denied.load(Ordering::Relaxed) {
                release();
                return None;
            }
            Target::Cma(wr.remote_addr)
        } else {
            match self.region(idx, (fd, ino, s1), len) {
                Some(m) => Target::Mapped(m),
                None => {
                    release();
                    return None;
                }
            }
        };
        // between pieces: stop if the owner withdrew the entry meanwhile (the packet path then
        // retries the request, and the owner's NAK fails it, as a NIC's would)
        let valid = || w(0).load(Ordering::SeqCst) == s1;
        let done = match &target {
            Target::Mapped(m) => {
                let mut at = off;
                let mut whole = true;
                'sges: for (r, loff, n) in &local {
                    let mut k = 0;
                    while k < *n {
                        if !valid() {
                            whole = false;
                            break 'sges;
                        }
                        let piece = (*n - k).min(COPY_PIECE);
                        let lp = r.mut_ptr_at(*loff + k, piece);
                        // SAFETY: `at + piece <= off + total <= len <= m.len` (the bounds check
                        // above; the mapping covers the region's length); the local range is
                        // checked by the table; both are shared memory no Rust reference
                        // points into, and distinct mappings (a region of this process mapped
                        // twice aliases only where `overlaps_itself` said no overlap).
                        unsafe {
                            let rp = m.ptr.add(at);
                            match dir {
                                Dir::Out => copy_raw(lp, rp, piece),
                                Dir::In => copy_raw(rp, lp, piece),
                            }
                        }
                        at += piece;
                        k += piece;
                    }
                }
                whole.then_some(Done::Mapped(total))
            }
            Target::Cma(addr) => match cma(self.desc.pid, dir, &local, *addr, &valid) {
                Ok(true) => Some(Done::Cma(total)),
                Ok(false) => None,
                Err(e) => {
                    // no right to attach: every later one would fail too; anything else (a
                    // range unmapped there meanwhile) fails only this request
                    if e.raw_os_error() == Some(libc::EPERM) {
                        tracing::info!(
                            "same-host path: CMA to process {} refused ({e}); its caller memory goes by packets",
                            self.desc.pid
                        );
                        self.cma_denied.store(true, Ordering::Relaxed);
                    }
                    None
                }
            },
        };
        release();
        if done.is_some() {
            // the owner's count of what peers moved in and out of its memory
            let word = if dir == Dir::Out { 5 } else { 6 };
            self.map.word(word).fetch_add(total, Ordering::Relaxed);
        }
        if self.ops.fetch_add(1, Ordering::Relaxed) % SWEEP_EVERY == SWEEP_EVERY - 1 {
            self.sweep();
        }
        done
    }

    /// The mapping of the memfd of MR slot `idx` (descriptor, inode and the entry's sequence
    /// word; at least `len` bytes), made on first use.
    fn region(&self, idx: usize, (fd, ino, seq): (u64, u64, u64), len: u64) -> Option<Arc<Mapping>> {
        let mut regions = self.regions.lock();
        if let Some((f, i, _, m)) = regions.get(&idx) {
            if *f == fd && *i == ino && m.len as u64 >= len {
                return Some(m.clone());
            }
        }
        let file = open_fd(self.desc.pid, fd as i32, ino).ok()?;
        let md = file.metadata().ok()?;
        if md.len() < len {
            return None;
        }
        let m = Arc::new(Mapping::map(&file, md.len() as usize).ok()?);
        if regions.len() >= MAX_MAPPINGS {
            regions.retain(|_, (_, _, _, m)| Arc::strong_count(m) > 1);
        }
        regions.insert(idx, (fd, ino, seq, m.clone()));
        drop(regions);
        self.sweep();
        Some(m)
    }

    /// Unmaps the peer regions whose entry changed since they were mapped (withdrawn or
    /// replaced): their pages are the peer's memory no more, and a mapping would keep them
    /// alive (a freed 10 GiB pool would stay in RAM). Runs on every new mapping and every
    /// [`SWEEP_EVERY`] requests.
    fn sweep(&self) {
        self.regions.lock().retain(|&idx, (_, _, seq, m)| {
            Arc::strong_count(m) > 1 || self.map.word(mr_word(idx, 0)).load(Ordering::Acquire) == *seq
        });
    }
}

/// Whether a copy between the local SGEs and the peer's range (at offset `off` of the memfd
/// with inode `ino`, or at address `addr` for caller memory) of this same process would copy
/// bytes onto themselves shifted (which a forward copy garbles).
fn overlaps_itself(local: &[(Arc<Region>, usize, usize)], fd: u64, ino: u64, off: usize, addr: u64) -> bool {
    let total: usize = local.iter().map(|l| l.2).sum();
    let mut at = 0;
    local.iter().any(|(r, loff, n)| {
        let (lo, ro) = if fd == FD_CMA {
            (r.ptr_at(*loff, *n) as u64, addr + at as u64)
        } else {
            match r.shared_file() {
                Some((_, i)) if i == ino => (*loff as u64, (off + at) as u64),
                _ => {
                    at += n;
                    return false;
                }
            }
        };
        at += n;
        lo < ro + total as u64 && ro < lo + *n as u64
    })
}

/// Opens the file descriptor `fd` of process `pid` names, if it is a regular file (a memfd)
/// with inode `ino`: checked by `stat` through the link before anything is opened, so a
/// descriptor a peer names that is a terminal, a device or a pipe is never opened (an open
/// can block, or act, there); opened without becoming a controlling terminal or blocking.
fn open_fd(pid: u32, fd: i32, ino: u64) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = format!("/proc/{pid}/fd/{fd}");
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "the descriptor names another file");
    let md = std::fs::metadata(&path)?;
    if !md.is_file() || md.ino() != ino {
        return Err(bad());
    }
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOCTTY | libc::O_NONBLOCK)
        .open(&path)?;
    let md = f.metadata()?;
    if !md.is_file() || md.ino() != ino {
        return Err(bad());
    }
    Ok(f)
}

/// CMA calls of at most [`COPY_PIECE`] bytes, `process_vm_writev` (out) or
/// `process_vm_readv` (in), at the peer's `addr` onwards, checking `valid` before each; false:
/// stopped because it no longer held.
fn cma(
    pid: u32,
    dir: Dir,
    local: &[(Arc<Region>, usize, usize)],
    addr: u64,
    valid: &dyn Fn() -> bool,
) -> std::io::Result<bool> {
    let mut at = addr;
    for (r, off, n) in local {
        let mut done = 0;
        while done < *n {
            if !valid() {
                return Ok(false);
            }
            let piece = (n - done).min(COPY_PIECE);
            let liov = libc::iovec {
                iov_base: r.mut_ptr_at(off + done, piece) as *mut libc::c_void,
                iov_len: piece,
            };
            let riov = libc::iovec {
                iov_base: (at + done as u64) as *mut libc::c_void,
                iov_len: piece,
            };
            // SAFETY: the local iovec lies in a checked range of a live region; the remote one
            // is checked against the peer's registration (the kernel checks it is mapped
            // there); the kernel copies, no Rust reference is involved.
            let r = unsafe {
                match dir {
                    Dir::Out => libc::process_vm_writev(pid as i32, &liov, 1, &riov, 1, 0),
                    Dir::In => libc::process_vm_readv(pid as i32, &liov, 1, &riov, 1, 0),
                }
            };
            if r <= 0 {
                return Err(if r == 0 {
                    std::io::ErrorKind::WriteZero.into()
                } else {
                    std::io::Error::last_os_error()
                });
            }
            done += r as usize;
        }
        at += *n as u64;
    }
    Ok(true)
}

/// Copies `n` bytes from `src` to `dst`, both shared memory that other threads or processes
/// may access at the same time (registered memory, a peer's mapping): `rep movsb` on x86-64,
/// an instruction sequence the compiler cannot see into, so no Rust-level access (and no data
/// race in the language's model) happens; racing bytes come out old or new, as with a NIC's
/// DMA. Elsewhere, byte-wise atomic copies ([`crate::mem`]).
///
/// # Safety
/// `src..src+n` must be valid for reads and `dst..dst+n` for writes for the whole copy; the
/// ranges may overlap only if they are the same bytes (then the result is unspecified bytes of
/// either).
pub(crate) unsafe fn copy_raw(src: *const u8, dst: *mut u8, n: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the caller's ranges; `rep movsb` reads [rsi, rsi+rcx) and writes [rdi,
    // rdi+rcx) with the direction flag clear (the ABI's guarantee at any call).
    unsafe {
        std::arch::asm!(
            "rep movsb",
            inout("rcx") n => _,
            inout("rsi") src => _,
            inout("rdi") dst => _,
            options(nostack, preserves_flags)
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: the caller's ranges, shared memory accessed atomically by the helper.
    unsafe {
        crate::mem::copy_shared(src, dst, n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An index whose byte offset wraps `usize` is refused like any other past the end (the
    /// old `(i + 1) * 8 <= len` check wrapped to a small number and let it through in release).
    #[test]
    #[should_panic(expected = "outside")]
    fn a_word_index_whose_offset_wraps_is_refused() {
        let x = Export::create(5).unwrap();
        let _ = x.map.word(usize::MAX / 8 + 1);
    }

    #[test]
    fn copy_raw_copies_at_any_alignment() {
        let a: Vec<u8> = (0..5000).map(|i| (i * 7 + 1) as u8).collect();
        for (so, d_o, n) in [(0, 0, 0), (1, 3, 1), (3, 0, 4093), (7, 5, 4990)] {
            let mut b = vec![0u8; 5000];
            // SAFETY: in bounds of both vectors, which do not overlap.
            unsafe { copy_raw(a.as_ptr().add(so), b.as_mut_ptr().add(d_o), n) };
            assert_eq!(&b[d_o..d_o + n], &a[so..so + n]);
            assert!(b[..d_o].iter().all(|&x| x == 0) && b[d_o + n..].iter().all(|&x| x == 0));
        }
    }

    /// A deregistration that a peer's copy does not let go of within REVOKE_WAIT leaves the
    /// entry withdrawn and the holder's count as it is, and the table never hands that index
    /// out again (a peer that wakes up later must not write into a successor's memory).
    #[test]
    fn a_slot_held_past_the_wait_is_retired_not_reused() {
        let t = MrTable::new();
        let x = Arc::new(Export::create(t.rbase()).unwrap());
        t.set_export(x.clone());
        let r = Arc::new(Region::alloc_shareable(1 << 20));
        let e = t.register(r.clone(), 1, Access::ALL).unwrap();
        let idx = ((e.rkey >> 8).wrapping_sub(t.rbase()) & 0xFF_FFFF) as usize;
        let held = x.map.word(mr_word(idx, 7));
        held.fetch_add(1, Ordering::SeqCst); // a peer in the middle of a copy
        let start = Instant::now();
        assert!(t.deregister(e.lkey));
        assert!(start.elapsed() >= REVOKE_WAIT);
        assert_eq!(x.map.word(mr_word(idx, 0)).load(Ordering::SeqCst) & 1, 1, "withdrawn");
        assert_eq!(held.load(Ordering::SeqCst), 1, "the holder's count is left alone");
        let e2 = t.register(r, 1, Access::ALL).unwrap();
        let idx2 = ((e2.rkey >> 8).wrapping_sub(t.rbase()) & 0xFF_FFFF) as usize;
        assert_ne!(idx2, idx, "a retired index is not handed out again");
    }

    #[test]
    fn an_export_attaches_only_with_its_own_nonce_and_inode() {
        let x = Export::create(5).unwrap();
        let d = x.desc();
        assert!(PeerExport::attach(d).is_ok());
        assert!(PeerExport::attach(SameHostDesc {
            nonce: d.nonce ^ 1,
            ..d
        })
        .is_err());
        assert!(PeerExport::attach(SameHostDesc { ino: d.ino + 1, ..d }).is_err());
        assert!(PeerExport::attach(SameHostDesc { fd: 999_999, ..d }).is_err());
    }
}
