//! Registered memory: regions and the key table that checks every access.
//!
//! # Memory model (one of the documented `unsafe` modules: docs/ARCHITECTURE.md, "Unsafe
//! inventory")
//!
//! A [`Region`] is a span of bytes that remote peers, engine threads and the application may
//! read and write at any moment, exactly as a NIC does by DMA. Rust calls a data race on
//! non-atomic memory undefined behaviour, so region memory is never behind a `&[u8]` or
//! `&mut [u8]`, and no byte of it is accessed non-atomically:
//! - copies in and out ([`Region::read`], [`Region::write`], [`Region::copy_to`],
//!   [`Region::chunks`]) are byte-wise atomic memcpys (C++ P1478: Relaxed `AtomicU64` loads
//!   and stores where aligned, `AtomicU8` at the edges, with an Acquire fence after a copy out
//!   and a Release fence before a copy in). A copy that
//!   races with a writer returns, for each byte, an old or a new value (a torn copy, which the
//!   readers that need consistency detect: versions, CRCs), never undefined behaviour;
//! - word operations ([`Region::compare_swap`], [`Region::fetch_add`], [`Region::load_u64`],
//!   [`Region::store_u64`], [`Region::write_words`], [`Region::read_words`]) are `AtomicU64`;
//! - the kernel reads and writes region memory by raw pointer ([`Region::ptr_at`] for
//!   scatter-gather sends, [`Region::recv_exact`] and [`Region::send_all`] for stream sockets);
//!   no Rust reference to the memory is formed.
//!
//! A word accessed with 8-byte atomics by one thread and through a copy whose range starts or
//! ends inside that word (byte atomics at the edge) by another is a mixed-size race, which the
//! model leaves unspecified; the stack's own users race only on 8-byte-aligned ranges.
pub use flexns_proto::memory::{Access, AccessError};

use flexns_proto::memory::{KeyTable, SharedRegion};
use parking_lot::RwLock;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::atomic::{fence, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

/// Bytes of the private buffer [`Region::chunks`] copies through.
pub const CHUNK: usize = 4096;

/// Copies `n` bytes from shared memory at `src` into private memory at `dst`: a byte-wise
/// atomic load in the sense of C++ P1478 (what the `atomic-memcpy` crate implements, here
/// 1.6x faster on cached data): `AtomicU8` loads up to the first 8-byte boundary of `src`,
/// `AtomicU64` loads for the aligned middle, `AtomicU8` loads for the tail, all Relaxed, then
/// an Acquire fence (so the copy sees everything a Release writer published before the values
/// it read).
///
/// # Safety
/// `src..src+n` must be valid for reads for the whole copy and accessed by others only
/// atomically or by the kernel; `dst..dst+n` must be valid for writes, not shared, and not
/// overlap the source.
pub(crate) unsafe fn load_bytes(src: *const u8, dst: *mut u8, n: usize) {
    let head = src.align_offset(8).min(n);
    let words = (n - head) / 8;
    // SAFETY: every address below is inside the caller's ranges; `src + head` is 8-aligned, so
    // the `AtomicU64` views are aligned; the shared bytes are only ever accessed atomically
    // (the caller's contract), and `dst` is private, written with plain (unaligned) stores.
    unsafe {
        for k in 0..head {
            *dst.add(k) = AtomicU8::from_ptr(src.add(k) as *mut u8).load(Ordering::Relaxed);
        }
        for w in 0..words {
            let o = head + 8 * w;
            let v = AtomicU64::from_ptr(src.add(o) as *mut u64).load(Ordering::Relaxed);
            std::ptr::write_unaligned(dst.add(o) as *mut u64, v);
        }
        for k in head + 8 * words..n {
            *dst.add(k) = AtomicU8::from_ptr(src.add(k) as *mut u8).load(Ordering::Relaxed);
        }
    }
    fence(Ordering::Acquire);
}

/// Copies `n` bytes from private memory at `src` into shared memory at `dst`: a byte-wise
/// atomic store (P1478): a Release fence, then Relaxed `AtomicU8` stores up to the first 8-byte
/// boundary of `dst`, `AtomicU64` stores for the aligned middle and `AtomicU8` stores for the
/// tail.
///
/// # Safety
/// `dst..dst+n` must be valid for writes for the whole copy and accessed by others only
/// atomically or by the kernel; `src..src+n` must be valid for reads, not shared, and not
/// overlap the destination.
unsafe fn store_bytes(src: *const u8, dst: *mut u8, n: usize) {
    fence(Ordering::Release);
    let head = dst.align_offset(8).min(n);
    let words = (n - head) / 8;
    // SAFETY: as in `load_bytes`, with the roles of the two ranges swapped.
    unsafe {
        for k in 0..head {
            AtomicU8::from_ptr(dst.add(k)).store(*src.add(k), Ordering::Relaxed);
        }
        for w in 0..words {
            let o = head + 8 * w;
            let v = std::ptr::read_unaligned(src.add(o) as *const u64);
            AtomicU64::from_ptr(dst.add(o) as *mut u64).store(v, Ordering::Relaxed);
        }
        for k in head + 8 * words..n {
            AtomicU8::from_ptr(dst.add(k)).store(*src.add(k), Ordering::Relaxed);
        }
    }
}

/// Copies `n` bytes between two shared ranges (registered memory into a shared-memory ring):
/// byte-wise atomic loads into a private chunk on the stack, then byte-wise atomic stores out
/// of it ([`load_bytes`], [`store_bytes`]), [`CHUNK`] bytes at a time.
///
/// # Safety
/// Both ranges must be valid (`src` for reads, `dst` for writes) for the whole copy, accessed
/// by others only atomically or by the kernel, and must not overlap.
pub(crate) unsafe fn copy_shared(src: *const u8, dst: *mut u8, n: usize) {
    // not zeroed: every byte stored out was loaded in first
    let mut chunk = [std::mem::MaybeUninit::<u8>::uninit(); CHUNK];
    let buf = chunk.as_mut_ptr() as *mut u8;
    let mut done = 0;
    while done < n {
        let k = (n - done).min(CHUNK);
        // SAFETY: `done + k <= n`, inside both ranges (the caller's contract); `chunk` is this
        // function's own buffer and overlaps neither; its first `k` bytes are written by the
        // load before the store reads them.
        unsafe {
            load_bytes(src.add(done), buf, k);
            store_bytes(buf, dst.add(done), k);
        }
        done += k;
    }
}

/// Runs `step(done)` (one `recv` or `send` of the rest) until `n` bytes have moved; a step that
/// moves nothing ends with `zero`, EINTR is retried, other errors end it.
fn stream_all(n: usize, zero: std::io::ErrorKind, mut step: impl FnMut(usize) -> isize) -> std::io::Result<()> {
    let mut done = 0;
    while done < n {
        match step(done) {
            0 => return Err(zero.into()),
            r if r > 0 => done += r as usize,
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}

/// A span of registerable memory.
pub struct Region {
    ptr: *mut u8,
    len: usize,
    /// The address work requests and peers name its first byte by: its pointer, or a virtual
    /// address given to it ([`Region::at_iova`]).
    iova: u64,
    /// The allocation this region owns (None: caller memory, see [`Region::from_raw`]).
    owned: Option<Owned>,
}

/// Memory a [`Region`] allocated and frees on drop.
enum Owned {
    /// From the global allocator, with this layout.
    Heap(std::alloc::Layout),
    /// A `memfd` mapped shared, this many bytes: a process on the same host that may open the
    /// file (`/proc/<pid>/fd/<fd>`, the kernel's ptrace-read check: same user) maps the same
    /// pages ([`crate::samehost`]).
    Memfd { file: std::fs::File, map_len: usize },
    /// Caller memory whose pages were moved into this `memfd` in place
    /// ([`Region::share_in_place`]): the caller's mapping of the file stays when the region
    /// goes (the memory is the caller's); the region keeps the file to pass it on.
    Adopted {
        file: std::fs::File,
        /// The pages moved, `start..end`, as [`ADOPTED`] lists them.
        span: (usize, usize),
    },
}

/// Regions of at least this many bytes are allocated in a `memfd` (smaller ones on the heap:
/// a descriptor and a mapping each are not worth it).
pub const SHARE_MIN: usize = 64 << 10;
/// Live memfd-backed regions a process keeps at most (each holds a file descriptor); past
/// this, regions come from the heap and peers reach them through the packet path.
pub const MAX_SHARED_REGIONS: usize = 512;
static SHARED_REGIONS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
/// Pages moved into a memfd in place ([`Region::share_in_place`]) whose region lives, by
/// start: moving them again would map a second file over the first, which a registration
/// (flexnsd's mapping) still uses, and the two would silently part.
static ADOPTED: std::sync::Mutex<std::collections::BTreeMap<usize, usize>> =
    std::sync::Mutex::new(std::collections::BTreeMap::new());

// SAFETY: a Region is a raw span shared with remote peers and threads; every access through it
// is a bounds-checked atomic copy, a word atomic, or the kernel's (the module's model), and the
// memory outlives the Region (owned, or the `from_raw` caller's promise).
unsafe impl Send for Region {}
// SAFETY: as above: shared access is what the model is for.
unsafe impl Sync for Region {}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Region({:#x}, {} bytes)", self.ptr as usize, self.len)
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        match self.owned.take() {
            // SAFETY: `ptr` came from `alloc_zeroed` with this layout, and no packet or memory
            // region holds the Region any more (they hold it by `Arc`).
            Some(Owned::Heap(l)) => unsafe { std::alloc::dealloc(self.ptr, l) },
            Some(Owned::Memfd { map_len, .. }) => {
                // SAFETY: `ptr..ptr+map_len` is the mapping `map_file` made, which nothing
                // holds any more (as above); peers keep their own mappings of the file.
                unsafe { libc::munmap(self.ptr as *mut libc::c_void, map_len) };
                SHARED_REGIONS.fetch_sub(1, Ordering::Relaxed);
            }
            // the pages are the caller's memory: they stay, private again (as before the move:
            // not shared with a forked child, zeroed by MADV_DONTNEED), with their bytes
            Some(Owned::Adopted { file, span }) => {
                let mut adopted = ADOPTED.lock().unwrap_or_else(|e| e.into_inner());
                restore_private(&file, span);
                adopted.remove(&span.0);
            }
            None => {}
        }
    }
}

/// Maps private anonymous memory back over pages [`Region::share_in_place`] moved into `file`,
/// with the bytes they hold now (read back from the file, which the shared mapping wrote).
/// Best effort: if the kernel refuses, the pages stay a shared mapping of the file, which keeps
/// them and their bytes.
fn restore_private(file: &std::fs::File, (start, end): (usize, usize)) {
    let span = end - start;
    // the bytes, while the shared mapping still holds them
    let mut bytes = vec![0u8; span];
    // SAFETY: `start..end` is mapped (the shared mapping of `file`); the kernel copies out of it.
    let n = unsafe { libc::pread(file.as_raw_fd(), bytes.as_mut_ptr().cast(), span, 0) };
    if n != span as isize {
        return;
    }
    // SAFETY: the pages `start..end` of this process that `share_in_place` moved and that the
    // region, now dropped, was the last registration of; under the caller's contract no other
    // thread writes them while this runs. They become private anonymous memory again.
    let p = unsafe {
        libc::mmap(
            start as *mut libc::c_void,
            span,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return;
    }
    // SAFETY: `start..end` was just mapped writable; `bytes` holds `span` bytes.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), start as *mut u8, span) };
}

impl Region {
    /// Allocates `len` zeroed bytes of heap memory, 64-byte aligned (owned by the region,
    /// freed on drop). Private to this process: after `fork` a child gets its own copy.
    pub fn alloc(len: usize) -> Region {
        Region::alloc_heap(len)
    }

    /// Allocates `len` zeroed bytes for registration that a context on the same host may map
    /// too (the one-copy path of [`crate::samehost`]): from [`SHARE_MIN`] bytes on, a `memfd`
    /// mapped shared, while fewer than [`MAX_SHARED_REGIONS`] such regions live; otherwise
    /// (or where memfd fails) heap memory. Shared mappings stay shared across `fork`: a child
    /// writes the parent's memory. What `Pd::reg_mr` of a context with the same-host path, and
    /// the KV-cache engine's pools, allocate.
    pub fn alloc_shareable(len: usize) -> Region {
        if len >= SHARE_MIN {
            if let Some(r) = Region::alloc_memfd(len) {
                return r;
            }
        }
        Region::alloc_heap(len)
    }

    /// Allocates `len` zeroed bytes in a `memfd` mapped shared, whatever the size: memory that
    /// another process can map (what a context attached to `flexnsd` registers). Fails when
    /// [`MAX_SHARED_REGIONS`] such regions live, or the kernel refuses.
    pub fn alloc_shared(len: usize) -> std::io::Result<Region> {
        Region::alloc_memfd(len).ok_or_else(|| {
            std::io::Error::other(format!(
                "no memfd for {len} bytes (at most {MAX_SHARED_REGIONS} live, or memfd_create failed)"
            ))
        })
    }

    fn alloc_memfd(len: usize) -> Option<Region> {
        use std::os::fd::FromRawFd;
        if SHARED_REGIONS.fetch_add(1, Ordering::Relaxed) >= MAX_SHARED_REGIONS {
            SHARED_REGIONS.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        let undo = || {
            SHARED_REGIONS.fetch_sub(1, Ordering::Relaxed);
            None
        };
        let map_len = len.div_ceil(4096) * 4096;
        // SAFETY: a C string literal; the flags ask for a close-on-exec anonymous file that
        // allows seals (flexnsd seals the memfds applications register against shrinking).
        let fd = unsafe { libc::memfd_create(c"flexns-region".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if fd < 0 {
            return undo();
        }
        // SAFETY: `fd` is the descriptor just created, owned by nothing else.
        let file = unsafe { std::fs::File::from_raw_fd(fd) };
        if file.set_len(map_len as u64).is_err() {
            return undo();
        }
        // the file's pages read as zeros until written
        match Region::map_file(file, len, map_len) {
            Ok(r) => Some(r),
            Err(_) => undo(),
        }
    }

    /// Maps the first `map_len` bytes (whole pages, at least `len`) of `file` shared at an
    /// address the kernel picks, as a region of `len` bytes that owns the mapping and the file.
    /// The caller has counted it in [`SHARED_REGIONS`], which `Drop` uncounts.
    fn map_file(file: std::fs::File, len: usize, map_len: usize) -> std::io::Result<Region> {
        // SAFETY: a fresh shared mapping of the file's first `map_len` bytes; nothing else
        // refers to the address range the kernel returns. Both callers hold a file that covers
        // every page up to byte `len - 1` (the kernel maps the last, partial page whole).
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let ptr = ptr as *mut u8;
        Ok(Region {
            ptr,
            len,
            iova: ptr as u64,
            owned: Some(Owned::Memfd { file, map_len }),
        })
    }

    /// Maps the first `len` bytes of a memory file another process passed (flexnsd registers
    /// an application's memory this way) shared, and owns the mapping and the file: unmapped
    /// and closed when the region is dropped. The caller must make sure the file cannot shrink
    /// below `len` while mapped (flexnsd seals it with `F_SEAL_SHRINK`): touching a page past
    /// the file's end raises `SIGBUS`.
    pub fn from_memfd(file: std::fs::File, len: usize) -> std::io::Result<Region> {
        let size = file.metadata()?.len();
        if len == 0 || (len as u64) > size {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("len: {len} bytes, the file has {size}"),
            ));
        }
        let map_len = len.div_ceil(4096) * 4096;
        // counted like the regions `alloc_memfd` makes, which `Drop` uncounts
        SHARED_REGIONS.fetch_add(1, Ordering::Relaxed);
        Region::map_file(file, len, map_len).inspect_err(|_| {
            SHARED_REGIONS.fetch_sub(1, Ordering::Relaxed);
        })
    }

    /// Moves the pages under caller memory `ptr..ptr+len` into a new `memfd` in place: the
    /// bytes are copied into the file, then the file is mapped shared over the same addresses
    /// (`MAP_FIXED`), so the caller's pointers stay valid and see the same bytes, and another
    /// process that maps the file (flexnsd) reaches the same memory. `ptr` must be on a page
    /// boundary; the rest of the last page moves too (its other bytes unchanged). What a
    /// context attached to flexnsd does
    /// with memory a program registers that is not in a memfd (perftest's buffers, a NumPy
    /// array). The pages become readable and writable; when the region goes they are mapped
    /// private again with the bytes they hold then (the memory is the caller's).
    ///
    /// # Safety
    /// `ptr..ptr+len`, and the rest of its last page, must be mapped, readable and writable
    /// memory of this process that no other thread writes while this runs (a write between the
    /// copy and the remapping would be lost), and stay valid while the region is used, as
    /// [`Region::from_raw`] asks.
    pub unsafe fn share_in_place(ptr: *mut u8, len: usize) -> std::io::Result<Region> {
        use std::os::fd::FromRawFd;
        if len == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "len: 0 bytes"));
        }
        let page = 4096usize;
        // a span that starts inside a page would move the page's first bytes too: another
        // allocation's, which a thread of this process may be writing
        if !(ptr as usize).is_multiple_of(page) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "{ptr:p} is not on a page boundary (allocate page-aligned memory, as posix_memalign(4096) gives)"
                ),
            ));
        }
        let start = ptr as usize;
        let end = (ptr as usize)
            .checked_add(len)
            .and_then(|e| e.checked_next_multiple_of(page))
            .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "ptr + len wraps around"))?;
        let span = end - start;
        let mut adopted = ADOPTED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((&s, &e)) = adopted.range(..end).next_back() {
            if e > start {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    format!(
                        "{ptr:p}: its pages {s:#x}..{e:#x} are registered already (moved into a memfd for \
                         flexnsd); register them once"
                    ),
                ));
            }
        }
        // SAFETY: a C string literal; a close-on-exec memfd that allows seals (flexnsd seals it).
        let fd = unsafe { libc::memfd_create(c"flexns-adopted".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is the descriptor just created, owned by nothing else.
        let file = unsafe { std::fs::File::from_raw_fd(fd) };
        file.set_len(span as u64)?;
        // the pages' bytes into the file: the kernel reads them from our memory (`pwrite` of
        // the mapped span), no Rust reference to memory peers may write is formed
        let mut done = 0usize;
        while done < span {
            // SAFETY: `start+done..end` is mapped readable memory of this process (the caller's
            // contract covers `ptr..ptr+len`, and whole pages of a mapping are mapped).
            let n = unsafe {
                libc::pwrite(
                    file.as_raw_fd(),
                    (start + done) as *const libc::c_void,
                    span - done,
                    done as libc::off_t,
                )
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            done += n as usize;
        }
        // SAFETY: replaces the pages `start..end`, which the caller's contract says are this
        // process's memory that nothing writes meanwhile, by a shared mapping of the file that
        // holds their bytes: every pointer into them reads the same bytes afterwards.
        let p = unsafe {
            libc::mmap(
                start as *mut libc::c_void,
                span,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            let err = std::io::Error::last_os_error();
            // the kernel may have unmapped the span already: put private memory back there with
            // the bytes it held (the file has them), so the caller's pointers stay valid
            // SAFETY: the same span of this process's memory as above, mapped anonymous again.
            let q = unsafe {
                libc::mmap(
                    start as *mut libc::c_void,
                    span,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                    -1,
                    0,
                )
            };
            if q != libc::MAP_FAILED {
                let mut done = 0usize;
                while done < span {
                    // SAFETY: `start+done..end` was just mapped writable; the kernel writes it.
                    let n = unsafe {
                        libc::pread(
                            file.as_raw_fd(),
                            (start + done) as *mut libc::c_void,
                            span - done,
                            done as libc::off_t,
                        )
                    };
                    if n <= 0 {
                        break;
                    }
                    done += n as usize;
                }
            }
            return Err(err);
        }
        adopted.insert(start, end);
        Ok(Region {
            ptr,
            len,
            iova: ptr as u64,
            owned: Some(Owned::Adopted {
                file,
                span: (start, end),
            }),
        })
    }

    /// The `memfd` holding the region from its first byte on, if it lives in one (allocated
    /// there, or moved there in place by [`Region::share_in_place`]).
    pub(crate) fn memfd(&self) -> Option<&std::fs::File> {
        match &self.owned {
            Some(Owned::Memfd { file, .. }) | Some(Owned::Adopted { file, .. }) => Some(file),
            _ => None,
        }
    }

    /// The `memfd` holding the region and its inode number, if it lives in one.
    pub(crate) fn shared_file(&self) -> Option<(i32, u64)> {
        use std::os::unix::fs::MetadataExt;
        match &self.owned {
            Some(Owned::Memfd { file, .. }) => Some((file.as_raw_fd(), file.metadata().ok()?.ino())),
            _ => None,
        }
    }

    /// Whether peers name the region by its address in this process (not an iova given to it:
    /// [`Region::at_iova`]), so that another process reaches it there by CMA.
    pub(crate) fn is_process_memory(&self) -> bool {
        self.iova == self.ptr as u64
    }

    fn alloc_heap(len: usize) -> Region {
        let layout = std::alloc::Layout::from_size_align(len.max(1).div_ceil(64) * 64, 64)
            .expect("a region's size fits the address space");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        Region {
            ptr,
            len,
            iova: ptr as u64,
            owned: Some(Owned::Heap(layout)),
        }
    }

    /// The region with `iova` as the address of its first byte instead of its pointer (an
    /// I/O virtual address, as an IOMMU gives a NIC). A simulated context names its memory
    /// this way, so that the addresses in its packets do not depend on where the allocator put
    /// the memory and a seed replays byte for byte.
    pub fn at_iova(mut self, iova: u64) -> Region {
        self.iova = iova;
        self
    }

    /// Allocates a region holding a copy of `data`.
    pub fn from_bytes(data: &[u8]) -> Region {
        let r = Region::alloc(data.len());
        r.write(0, data);
        r
    }

    /// Wraps caller memory.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be valid for reads and writes for the whole life of the returned
    /// Region (and of every memory region registered over it), and must not be accessed through
    /// Rust references while remote peers may access it.
    pub unsafe fn from_raw(ptr: *mut u8, len: usize) -> Region {
        Region {
            ptr,
            len,
            iova: ptr as u64,
            owned: None,
        }
    }

    /// The virtual address of the first byte (what work requests, rkeys and a peer's RETH
    /// name): its pointer, unless given another ([`Region::at_iova`]).
    pub fn addr(&self) -> u64 {
        self.iova
    }
    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn check(&self, off: usize, n: usize) {
        assert!(
            off.checked_add(n).is_some_and(|e| e <= self.len),
            "region access out of bounds"
        );
    }

    /// Copies `dst.len()` bytes at `off` into `dst` (byte-wise atomic: a copy racing with a
    /// writer may be torn, never undefined). Panics when out of bounds (callers check remote
    /// ranges with [`MrTable::check`] first).
    pub fn read(&self, off: usize, dst: &mut [u8]) {
        self.check(off, dst.len());
        // SAFETY: in bounds (checked), the region outlives `&self`, `dst` is private memory we
        // hold exclusively (region memory is never behind a Rust reference, so it cannot be
        // `dst`), and every other access to the region is atomic or the kernel's.
        unsafe { load_bytes(self.ptr.add(off), dst.as_mut_ptr(), dst.len()) }
    }

    /// The `n` bytes at `off`, copied out (see [`Region::read`]).
    pub fn to_vec(&self, off: usize, n: usize) -> Vec<u8> {
        let mut v = vec![0u8; n];
        self.read(off, &mut v);
        v
    }

    /// Appends the `n` bytes at `off` to `out` (see [`Region::read`]).
    pub fn append_to(&self, off: usize, n: usize, out: &mut Vec<u8>) {
        let at = out.len();
        out.resize(at + n, 0);
        self.read(off, &mut out[at..]);
    }

    /// Copies `src` into the region at `off` (byte-wise atomic).
    pub fn write(&self, off: usize, src: &[u8]) {
        self.check(off, src.len());
        // SAFETY: in bounds (checked); `src` is a Rust slice, so it is not region memory (which
        // is never behind a reference) and cannot overlap the destination.
        unsafe { store_bytes(src.as_ptr(), self.ptr.add(off), src.len()) }
    }

    /// Fills `n` bytes at `off` with `v`.
    pub fn fill(&self, off: usize, n: usize, v: u8) {
        let b = [v; CHUNK];
        let mut done = 0;
        while done < n {
            let k = (n - done).min(CHUNK);
            self.write(off + done, &b[..k]);
            done += k;
        }
    }

    /// Copies `n` bytes at `off` to `dst` at `dst_off` (another region, or this one: the copy
    /// goes through a private buffer, so overlapping ranges are fine).
    pub fn copy_to(&self, off: usize, n: usize, dst: &Region, dst_off: usize) {
        dst.check(dst_off, n);
        self.chunks(off, n, |at, c| dst.write(dst_off + at, c));
    }

    /// Hands the `n` bytes at `off` to `f` in order, [`CHUNK`] bytes at a time, each chunk
    /// copied out first (byte-wise atomic) into a private buffer: the way to checksum, compare
    /// or send region memory without a reference to it. `f` gets each chunk's offset from
    /// `off` and its bytes.
    pub fn chunks(&self, off: usize, n: usize, mut f: impl FnMut(usize, &[u8])) {
        self.check(off, n);
        // not zeroed (a memset per chunk cost as much as the CRC the chunks feed): each chunk's
        // bytes are loaded before the slice over them is formed
        let mut chunk = [std::mem::MaybeUninit::<u8>::uninit(); CHUNK];
        let buf = chunk.as_mut_ptr() as *mut u8;
        let mut at = 0;
        while at < n {
            let k = (n - at).min(CHUNK);
            // SAFETY: `off + at + k <= off + n`, in bounds (checked above); `chunk` is private
            // and at least `k` long; after the load its first `k` bytes are initialized, so the
            // slice over them is valid until the next load (after `f` returns).
            let bytes = unsafe {
                load_bytes(self.ptr.add(off + at), buf, k);
                std::slice::from_raw_parts(buf, k)
            };
            f(at, bytes);
            at += k;
        }
    }

    /// Copies the `n` bytes at `off` into `dst` at `dst_off` (byte-wise atomic loads, as
    /// [`Region::read`]) in pieces of [`crate::wire::icrc::FOLD_CHUNK`] bytes, handing each
    /// piece to `fold` from `dst` right after it landed there, while it is in the L1 cache: the
    /// one copy of a transmit snapshot and its ICRC in one pass over memory (fold-and-copy),
    /// where [`Region::chunks`] then [`Region::write`] copied twice (into a private chunk, then
    /// out of it). `fold` gets each piece's offset from `off` and its bytes.
    ///
    /// # Safety
    /// `dst_off..dst_off + n` of `dst` must be private to the caller for the whole call: no
    /// other thread, peer or kernel operation reads or writes it (a snapshot buffer that no
    /// packet holds, whose last send has returned). That is what lets `fold` see the bytes as a
    /// plain slice. Panics (before touching a byte) when either range is out of bounds or the
    /// two overlap.
    pub unsafe fn copy_folding(
        &self,
        off: usize,
        n: usize,
        dst: &Region,
        dst_off: usize,
        mut fold: impl FnMut(usize, &[u8]),
    ) {
        self.check(off, n);
        dst.check(dst_off, n);
        let (s, d) = (self.ptr as usize + off, dst.ptr as usize + dst_off);
        assert!(n == 0 || s + n <= d || d + n <= s, "copy_folding ranges overlap");
        let piece = crate::wire::icrc::FOLD_CHUNK;
        let mut at = 0;
        while at < n {
            let k = (n - at).min(piece);
            // SAFETY: `off + at + k <= off + n` and `dst_off + at + k <= dst_off + n`, both in
            // bounds (checked above), and the ranges do not overlap (asserted); the source is
            // region memory, which others access only atomically or by the kernel, read with
            // atomic loads; the destination is private (the caller's contract), so the plain
            // stores of `load_bytes` race with nothing and the slice over the `k` bytes just
            // written is valid (initialized, unaliased by writers) until the next piece.
            let bytes = unsafe {
                let to = dst.ptr.add(dst_off + at);
                load_bytes(self.ptr.add(off + at), to, k);
                std::slice::from_raw_parts(to as *const u8, k)
            };
            fold(at, bytes);
            at += k;
        }
    }

    /// Whether the `n` bytes at `off` equal `expect` (copied out chunk by chunk).
    pub fn equals(&self, off: usize, expect: &[u8]) -> bool {
        let mut same = true;
        self.chunks(off, expect.len(), |at, c| same &= c == &expect[at..at + c.len()]);
        same
    }

    /// Receives exactly `n` bytes from the stream socket `fd` straight into `off..off+n`: the
    /// kernel writes the memory, no Rust reference to it exists. Fails (with what arrived placed)
    /// when the stream ends or breaks first.
    pub fn recv_exact(&self, off: usize, n: usize, fd: BorrowedFd<'_>) -> std::io::Result<()> {
        self.check(off, n);
        stream_all(n, std::io::ErrorKind::UnexpectedEof, |done| {
            // SAFETY: the destination is in bounds (checked) and lives as long as `&self`; the
            // kernel writes at most `n - done` bytes there; no Rust reference covers it.
            unsafe {
                libc::recv(
                    fd.as_raw_fd(),
                    self.ptr.add(off + done) as *mut libc::c_void,
                    n - done,
                    0,
                )
            }
        })
    }

    /// Sends the `n` bytes at `off` on the stream socket `fd` (the kernel reads the memory by
    /// pointer, as a NIC's DMA does).
    pub fn send_all(&self, off: usize, n: usize, fd: BorrowedFd<'_>) -> std::io::Result<()> {
        self.check(off, n);
        stream_all(n, std::io::ErrorKind::WriteZero, |done| {
            // SAFETY: the source is in bounds (checked) and lives as long as `&self`; the kernel
            // only reads it.
            unsafe {
                libc::send(
                    fd.as_raw_fd(),
                    self.ptr.add(off + done) as *const libc::c_void,
                    n - done,
                    libc::MSG_NOSIGNAL,
                )
            }
        })
    }

    fn word(&self, off: usize) -> Option<&AtomicU64> {
        if !off.is_multiple_of(8) || !(self.ptr as usize + off).is_multiple_of(8) || off.checked_add(8)? > self.len {
            return None;
        }
        // SAFETY: aligned, in bounds, and the memory lives as long as &self.
        Some(unsafe { AtomicU64::from_ptr(self.ptr.add(off) as *mut u64) })
    }

    /// Atomic compare-and-swap of the 8-byte word at `off`; returns the original value, or `None`
    /// when `off` is not an aligned in-bounds word.
    pub fn compare_swap(&self, off: usize, compare: u64, swap: u64) -> Option<u64> {
        let w = self.word(off)?;
        Some(
            match w.compare_exchange(compare, swap, Ordering::AcqRel, Ordering::Acquire) {
                Ok(v) | Err(v) => v,
            },
        )
    }

    /// Atomic fetch-and-add on the 8-byte word at `off`; returns the original value.
    pub fn fetch_add(&self, off: usize, add: u64) -> Option<u64> {
        Some(self.word(off)?.fetch_add(add, Ordering::AcqRel))
    }

    /// Atomic load of the 8-byte word at `off`.
    pub fn load_u64(&self, off: usize) -> Option<u64> {
        Some(self.word(off)?.load(Ordering::Acquire))
    }

    /// Atomic store of the 8-byte word at `off` (Release: what was written before it is
    /// visible to whoever loads the new value); `None` when `off` is not an aligned in-bounds
    /// word. The publish step of a writer that fills memory first and links it second.
    pub fn store_u64(&self, off: usize, v: u64) -> Option<()> {
        self.word(off)?.store(v, Ordering::Release);
        Some(())
    }

    /// Writes `src` as 8-byte atomic stores, front to back (`off` aligned, `src.len()` a
    /// multiple of 8). The data-race-free way for a local writer to update words that peers and
    /// engine threads read concurrently; a reader that validates what it read (versions, CRC)
    /// sees each word either old or new, never half of one.
    pub fn write_words(&self, off: usize, src: &[u8]) -> Option<()> {
        if !src.len().is_multiple_of(8) {
            return None;
        }
        for (i, c) in src.chunks_exact(8).enumerate() {
            let w = self.word(off + 8 * i)?;
            w.store(u64::from_le_bytes(c.try_into().ok()?), Ordering::Relaxed);
        }
        std::sync::atomic::fence(Ordering::Release);
        Some(())
    }

    /// Reads `dst.len()` bytes (a multiple of 8, `off` aligned) as 8-byte atomic loads, front
    /// to back: the counterpart of [`Region::write_words`] for local readers.
    pub fn read_words(&self, off: usize, dst: &mut [u8]) -> Option<()> {
        if !dst.len().is_multiple_of(8) {
            return None;
        }
        std::sync::atomic::fence(Ordering::Acquire);
        for (i, c) in dst.chunks_exact_mut(8).enumerate() {
            let w = self.word(off + 8 * i)?;
            c.copy_from_slice(&w.load(Ordering::Relaxed).to_le_bytes());
        }
        std::sync::atomic::fence(Ordering::Acquire);
        Some(())
    }

    /// Raw pointer to `off` for scatter-gather I/O by the kernel (`off..off+n` must be in
    /// bounds); dereferencing it in Rust would bypass the model above.
    pub fn ptr_at(&self, off: usize, n: usize) -> *const u8 {
        self.check(off, n);
        // SAFETY: bounds checked above.
        unsafe { self.ptr.add(off) }
    }

    /// Mutable raw pointer to `off` for the kernel or a device to write into (a GPU copy);
    /// dereferencing it in Rust would bypass the model above.
    pub fn mut_ptr_at(&self, off: usize, n: usize) -> *mut u8 {
        self.check(off, n);
        // SAFETY: bounds checked above.
        unsafe { self.ptr.add(off) }
    }
}

/// A registered memory region as the key table holds it.
#[derive(Debug, Clone)]
pub struct MrEntry {
    /// The memory.
    pub region: Arc<Region>,
    /// The protection domain it was registered in.
    pub pd: u32,
    /// The rights granted.
    pub access: Access,
    /// Its local key.
    pub lkey: u32,
    /// Its remote key.
    pub rkey: u32,
}

/// Live registrations a table holds at most: a key's index part has 24 bits.
pub const MAX_MRS: usize = 1 << 24;

/// A registration was refused: the table already holds [`MAX_MRS`] live regions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("memory region table full: {MAX_MRS} live registrations (deregister some first)")]
pub struct TableFull;

/// Which of a registration's two keys a lookup names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyKind {
    /// The local key: SGEs of the context's own work requests.
    Local,
    /// The remote key: what peers put in RETHs and atomic headers.
    Remote,
}

/// One index of the table: the key bytes its last registration drew, and that registration
/// while it lives.
struct Slot {
    lbyte: u8,
    rbyte: u8,
    entry: Option<MrEntry>,
}

struct Slots {
    slots: Vec<Slot>,
    /// Indices of dead slots, reused last-freed first.
    free: Vec<u32>,
    /// Draws the key bytes (and drew the bases).
    rng: StdRng,
    /// The index parts of lkeys and rkeys start at these random 24-bit bases (never equal, so
    /// a region's lkey and rkey always differ).
    lbase: u32,
    rbase: u32,
}

/// The key of slot `idx` in the space starting at `base`, with key byte `byte`.
fn make_key(base: u32, idx: u32, byte: u8) -> u32 {
    ((base.wrapping_add(idx) & MASK24) << 8) | byte as u32
}

/// A key byte for a new registration: never 0 (so no key is 0) and never the slot's previous
/// one (so a stale key of the slot's last region does not name the new one).
fn next_byte(rng: &mut StdRng, old: u8) -> u8 {
    loop {
        let b: u8 = rng.random();
        if b != 0 && b != old {
            return b;
        }
    }
}

const MASK24: u32 = 0xFF_FFFF;

/// The table of registered memory regions of a context. A key is a 24-bit index part and an
/// 8-bit key byte, as an RNIC's: the index parts of lkeys and of rkeys count from two random
/// bases of the table, and every registration draws fresh key bytes, so no key can be guessed
/// from another context's, a region's rkey is not its lkey, and re-registering an index gives
/// new keys (a stale rkey of a freed region is refused, never served by its successor; with
/// 8-bit key bytes a key comes back only after several reuses of its index, with odds
/// 1/255 each, as on an RNIC). A lookup decodes the index from the key: O(1), no scan.
pub struct MrTable {
    slots: RwLock<Slots>,
    /// The table as same-host peers see it, once the context exports it (the same-host
    /// path's export).
    export: std::sync::OnceLock<Arc<dyn MrExport>>,
}

/// Where a table publishes its registrations for same-host peers (the same-host path's
/// export implements it): called under the table's write lock, with the registration's index.
pub(crate) trait MrExport: Send + Sync {
    /// Registration `idx` is live with these keys, rights and memory.
    fn publish_mr(&self, idx: usize, rkey: u32, pd: u32, access: Access, region: &Region);
    /// Registration `idx` is gone: when this returns true, no peer reaches its memory any
    /// more; false, a peer may still hold it, and the index must never be reused.
    fn revoke_mr(&self, idx: usize) -> bool;
}

impl Default for MrTable {
    fn default() -> MrTable {
        MrTable::new()
    }
}

impl MrTable {
    /// An empty table whose keys are drawn from a generator seeded by the OS (a CSPRNG).
    pub fn new() -> MrTable {
        MrTable::with_rng(StdRng::from_os_rng())
    }

    /// An empty table whose keys follow from `seed` alone: for deterministic simulations,
    /// whose runs must replay byte for byte.
    pub fn seeded(seed: u64) -> MrTable {
        MrTable::with_rng(StdRng::seed_from_u64(seed))
    }

    fn with_rng(mut rng: StdRng) -> MrTable {
        let lbase = rng.random::<u32>() & MASK24;
        let rbase = loop {
            let b = rng.random::<u32>() & MASK24;
            if b != lbase {
                break b;
            }
        };
        MrTable {
            slots: RwLock::new(Slots {
                slots: Vec::new(),
                free: Vec::new(),
                rng,
                lbase,
                rbase,
            }),
            export: std::sync::OnceLock::new(),
        }
    }

    /// The random base the index parts of rkeys count from (an export maps an rkey to its
    /// registration's index with it).
    pub(crate) fn rbase(&self) -> u32 {
        self.slots.read().rbase
    }

    /// Publishes every live and future registration to `x` (once: a table has one export).
    pub(crate) fn set_export(&self, x: Arc<dyn MrExport>) {
        let t = self.slots.write();
        if self.export.get().is_some() {
            return;
        }
        for (idx, slot) in t.slots.iter().enumerate() {
            if let Some(e) = &slot.entry {
                x.publish_mr(idx, e.rkey, e.pd, e.access, &e.region);
            }
        }
        let _ = self.export.set(x);
    }

    /// Registers a region; returns the entry with its keys (an lkey and a different rkey, both
    /// unique among the table's live regions), or [`TableFull`] when [`MAX_MRS`] live.
    pub fn register(&self, region: Arc<Region>, pd: u32, access: Access) -> Result<MrEntry, TableFull> {
        let mut guard = self.slots.write();
        let t = &mut *guard;
        let idx = match t.free.pop() {
            Some(i) => i,
            None if t.slots.len() < MAX_MRS => {
                let (lbyte, rbyte) = (t.rng.random(), t.rng.random());
                t.slots.push(Slot {
                    lbyte,
                    rbyte,
                    entry: None,
                });
                (t.slots.len() - 1) as u32
            }
            None => return Err(TableFull),
        };
        let slot = &mut t.slots[idx as usize];
        slot.lbyte = next_byte(&mut t.rng, slot.lbyte);
        slot.rbyte = next_byte(&mut t.rng, slot.rbyte);
        let e = MrEntry {
            region,
            pd,
            access,
            lkey: make_key(t.lbase, idx, slot.lbyte),
            rkey: make_key(t.rbase, idx, slot.rbyte),
        };
        slot.entry = Some(e.clone());
        if let Some(x) = self.export.get() {
            x.publish_mr(idx as usize, e.rkey, e.pd, e.access, &e.region);
        }
        Ok(e)
    }

    /// The slot index `key` names in the space of `kind`, if a live region has that key.
    fn find(t: &Slots, key: u32, kind: KeyKind) -> Option<(usize, &MrEntry)> {
        let base = match kind {
            KeyKind::Local => t.lbase,
            KeyKind::Remote => t.rbase,
        };
        let idx = ((key >> 8).wrapping_sub(base) & MASK24) as usize;
        let e = t.slots.get(idx)?.entry.as_ref()?;
        let k = match kind {
            KeyKind::Local => e.lkey,
            KeyKind::Remote => e.rkey,
        };
        (k == key).then_some((idx, e))
    }

    /// Removes the registration whose lkey is `lkey`; later accesses with either of its keys
    /// fail. In-flight work (packets being built or sent, READ responses, send requests' segments)
    /// keeps its `Arc<Region>` until it finishes: memory the engine owns stays alive, but a
    /// region of the caller's memory (`Region::from_raw`) does nothing on drop, so a caller
    /// that frees such memory must first wait for the `Arc`'s other holders to go (flexns's
    /// `ibv_dereg_mr` waits for its strong count to fall to its own clone).
    pub fn deregister(&self, lkey: u32) -> bool {
        let mut guard = self.slots.write();
        let t = &mut *guard;
        let Some((idx, _)) = MrTable::find(t, lkey, KeyKind::Local) else {
            return false;
        };
        let quiet = self.export.get().is_none_or(|x| x.revoke_mr(idx));
        t.slots[idx].entry = None;
        if quiet {
            t.free.push(idx as u32);
        }
        true
    }

    /// Looks up a live registration by its lkey or its rkey (`kind` says which `key` is).
    pub fn get(&self, key: u32, kind: KeyKind) -> Option<MrEntry> {
        MrTable::find(&self.slots.read(), key, kind).map(|(_, e)| e.clone())
    }

    /// Checks an access of `len` bytes at virtual address `va` with `key`, in protection domain
    /// `pd`, needing `need`; returns the region and the offset of `va` in it. An access that
    /// needs a remote right (a peer's READ, WRITE or atomic) names the region by its rkey; any
    /// other by its lkey.
    pub fn check(
        &self,
        key: u32,
        pd: u32,
        va: u64,
        len: u64,
        need: Access,
    ) -> Result<(Arc<Region>, usize), AccessError> {
        let kind = if need.is_remote() {
            KeyKind::Remote
        } else {
            KeyKind::Local
        };
        let t = self.slots.read();
        let (_, e) = MrTable::find(&t, key, kind).ok_or(AccessError::BadKey(key))?;
        if e.pd != pd {
            return Err(AccessError::WrongPd(key));
        }
        if !e.access.contains(need) {
            return Err(AccessError::NoPermission(need));
        }
        let base = e.region.addr();
        let end = va.checked_add(len).ok_or(AccessError::OutOfBounds { va, len })?;
        if va < base || end > base + e.region.len() as u64 {
            return Err(AccessError::OutOfBounds { va, len });
        }
        Ok((e.region.clone(), (va - base) as usize))
    }
}

/// The protocol core's view of a region: the inherent methods above.
impl SharedRegion for Region {
    fn from_bytes(data: &[u8]) -> Region {
        Region::from_bytes(data)
    }
    fn len(&self) -> usize {
        Region::len(self)
    }
    fn read(&self, off: usize, dst: &mut [u8]) {
        Region::read(self, off, dst)
    }
    fn write(&self, off: usize, src: &[u8]) {
        Region::write(self, off, src)
    }
    fn append_to(&self, off: usize, n: usize, out: &mut Vec<u8>) {
        Region::append_to(self, off, n, out)
    }
    fn compare_swap(&self, off: usize, compare: u64, swap: u64) -> Option<u64> {
        Region::compare_swap(self, off, compare, swap)
    }
    fn fetch_add(&self, off: usize, add: u64) -> Option<u64> {
        Region::fetch_add(self, off, add)
    }
}

/// The protocol core checks keys through [`MrTable::check`].
impl KeyTable for MrTable {
    type Region = Region;
    fn check(&self, key: u32, pd: u32, va: u64, len: u64, need: Access) -> Result<(Arc<Region>, usize), AccessError> {
        MrTable::check(self, key, pd, va, len, need)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fold-and-copy primitive copies every byte once, folds the same bytes in order, in
    /// pieces no larger than `FOLD_CHUNK`, at any alignment; it refuses an out-of-bounds or
    /// overlapping range before touching a byte.
    #[test]
    fn copy_folding_copies_and_folds_the_same_bytes() {
        let piece = crate::wire::icrc::FOLD_CHUNK;
        for n in [0usize, 1, 7, 8, 9, piece - 1, piece, piece + 3, 3 * piece + 17] {
            let src = Region::alloc(n + 16);
            let bytes: Vec<u8> = (0..n).map(|i| (i * 29 + 3) as u8).collect();
            src.write(3, &bytes);
            let dst = Region::alloc(n + 16);
            let mut folded = Vec::new();
            // SAFETY: `dst` is this test's own and reached by nothing else.
            unsafe {
                src.copy_folding(3, n, &dst, 5, |at, c| {
                    assert_eq!(at, folded.len());
                    assert!(c.len() <= piece);
                    folded.extend_from_slice(c);
                })
            };
            assert_eq!(folded, bytes, "n {n}");
            assert!(dst.equals(5, &bytes), "n {n}");
            assert!(
                dst.equals(0, &[0; 5]) && dst.equals(5 + n, &[0; 11]),
                "nothing outside, n {n}"
            );
        }
        let r = Region::alloc(64);
        let caught = |f: &dyn Fn()| std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err();
        let (big, small) = (Region::alloc(64), Region::alloc(16));
        let calls: [(&str, &dyn Fn()); 3] = [
            // SAFETY: `r` is private to this test; the call panics before any access.
            ("overlap", &|| unsafe { r.copy_folding(0, 32, &r, 16, |_, _| {}) }),
            // SAFETY: as above, with `big` private too.
            ("source bounds", &|| unsafe {
                r.copy_folding(40, 32, &big, 0, |_, _| {})
            }),
            // SAFETY: as above, with `small` private too.
            ("destination bounds", &|| unsafe {
                r.copy_folding(0, 32, &small, 0, |_, _| {})
            }),
        ];
        for (what, f) in calls {
            assert!(caught(f), "{what}");
        }
        assert!(big.equals(0, &[0; 64]) && small.equals(0, &[0; 16]), "nothing written");
    }

    #[test]
    fn keys_and_checks() {
        let t = MrTable::new();
        let r = Arc::new(Region::alloc(4096));
        let e = t
            .register(r.clone(), 1, Access::REMOTE_READ | Access::LOCAL_WRITE)
            .unwrap();
        let a = r.addr();
        assert!(t.check(e.rkey, 1, a, 4096, Access::REMOTE_READ).is_ok());
        assert_eq!(
            t.check(e.rkey, 1, a + 1, 4096, Access::REMOTE_READ).unwrap_err(),
            AccessError::OutOfBounds { va: a + 1, len: 4096 }
        );
        assert_eq!(
            t.check(e.rkey, 2, a, 1, Access::REMOTE_READ).unwrap_err(),
            AccessError::WrongPd(e.rkey)
        );
        assert!(matches!(
            t.check(e.rkey, 1, a, 1, Access::REMOTE_WRITE),
            Err(AccessError::NoPermission(_))
        ));
        assert!(matches!(
            t.check(e.rkey ^ 1, 1, a, 1, Access::REMOTE_READ),
            Err(AccessError::BadKey(_))
        ));
        assert!(t.check(e.rkey, 1, u64::MAX, 2, Access::REMOTE_READ).is_err());
        assert!(!t.deregister(e.rkey), "a region is deregistered by its lkey");
        assert!(t.deregister(e.lkey));
        assert!(t.check(e.rkey, 1, a, 1, Access::REMOTE_READ).is_err());
        // a new registration in the same slot gets new keys
        let e2 = t.register(r, 1, Access::ALL).unwrap();
        assert_ne!(e2.rkey, e.rkey);
        assert_ne!(e2.lkey, e.lkey);
    }

    /// A region's rkey is not its lkey, and each names it only in its own role: a peer cannot
    /// reach memory with the lkey, nor a local SGE with the rkey.
    #[test]
    fn lkey_and_rkey_differ_and_keep_to_their_roles() {
        let t = MrTable::new();
        let r = Arc::new(Region::alloc(64));
        let a = r.addr();
        for _ in 0..64 {
            let e = t.register(r.clone(), 1, Access::ALL).unwrap();
            assert_ne!(e.lkey, e.rkey);
            assert_ne!(e.lkey, 0);
            assert_ne!(e.rkey, 0);
            assert!(t.check(e.rkey, 1, a, 8, Access::REMOTE_WRITE).is_ok());
            assert!(t.check(e.lkey, 1, a, 8, Access::LOCAL_WRITE).is_ok());
            assert_eq!(
                t.check(e.lkey, 1, a, 8, Access::REMOTE_WRITE).unwrap_err(),
                AccessError::BadKey(e.lkey)
            );
            assert_eq!(
                t.check(e.rkey, 1, a, 8, Access::LOCAL_WRITE).unwrap_err(),
                AccessError::BadKey(e.rkey)
            );
            assert_eq!(t.get(e.rkey, KeyKind::Remote).map(|x| x.lkey), Some(e.lkey));
            assert!(t.get(e.rkey, KeyKind::Local).is_none());
        }
    }

    /// Two tables (two contexts) draw their keys independently: the first region's keys are
    /// not a constant, and not the same in both.
    #[test]
    fn tables_draw_unpredictable_keys() {
        let r = Arc::new(Region::alloc(64));
        let keys: Vec<(u32, u32)> = (0..4)
            .map(|_| {
                let e = MrTable::new().register(r.clone(), 1, Access::ALL).unwrap();
                (e.lkey, e.rkey)
            })
            .collect();
        for i in 0..keys.len() {
            for j in i + 1..keys.len() {
                // 32 random bits each: equal by chance with odds 2^-32
                assert_ne!(keys[i].1, keys[j].1, "two tables' first rkeys: {keys:x?}");
                assert_ne!(keys[i].0, keys[j].0, "two tables' first lkeys: {keys:x?}");
            }
        }
        // a seeded table replays its keys, another seed gives others
        let seeded = |s| {
            let t = MrTable::seeded(s);
            (0..8)
                .map(|_| t.register(r.clone(), 1, Access::ALL).unwrap().rkey)
                .collect::<Vec<_>>()
        };
        assert_eq!(seeded(7), seeded(7));
        assert_ne!(seeded(7), seeded(8));
    }

    /// Deregistering and registering the same index again, over and over: every registration
    /// gets an rkey unlike its predecessor's, whose stale rkey is refused; the live keys stay
    /// unique and each finds its own region.
    #[test]
    fn reregistration_gives_new_keys_and_stale_ones_fail() {
        let t = MrTable::seeded(1);
        let r = Arc::new(Region::alloc(64));
        let a = r.addr();
        let mut prev = t.register(r.clone(), 1, Access::ALL).unwrap();
        for _ in 0..1000 {
            assert!(t.deregister(prev.lkey));
            let e = t.register(r.clone(), 1, Access::ALL).unwrap();
            assert_eq!(e.rkey >> 8, prev.rkey >> 8, "the same slot again");
            assert_ne!(e.rkey, prev.rkey);
            assert_ne!(e.lkey, prev.lkey);
            assert_eq!(
                t.check(prev.rkey, 1, a, 8, Access::REMOTE_READ).unwrap_err(),
                AccessError::BadKey(prev.rkey)
            );
            assert!(t.check(e.rkey, 1, a, 8, Access::REMOTE_READ).is_ok());
            prev = e;
        }
        let regions: Vec<Arc<Region>> = (0..500).map(|_| Arc::new(Region::alloc(8))).collect();
        let live: Vec<MrEntry> = regions
            .iter()
            .map(|r| t.register(r.clone(), 1, Access::ALL).unwrap())
            .collect();
        let mut keys: Vec<u32> = live.iter().flat_map(|e| [e.lkey, e.rkey]).collect();
        keys.push(prev.lkey);
        keys.push(prev.rkey);
        keys.sort_unstable();
        keys.dedup();
        assert_eq!(keys.len(), 2 * (live.len() + 1), "keys of live regions are unique");
        for (e, r) in live.iter().zip(&regions) {
            let (got, off) = t.check(e.rkey, 1, r.addr(), 8, Access::REMOTE_READ).unwrap();
            assert!(Arc::ptr_eq(&got, r) && off == 0);
        }
    }

    /// Copies in and out at every alignment and length around the word size land exactly
    /// where they should, and nothing else changes.
    #[test]
    fn copies_at_every_alignment() {
        let r = Region::alloc(128);
        for off in 0..17 {
            for n in 0..41 {
                let base: Vec<u8> = (0..128u32).map(|i| (i * 3 + 1) as u8).collect();
                r.write(0, &base);
                let src: Vec<u8> = (0..n as u32).map(|i| 200u8.wrapping_add(i as u8)).collect();
                r.write(off, &src);
                let mut want = base.clone();
                want[off..off + n].copy_from_slice(&src);
                assert_eq!(r.to_vec(0, 128), want, "write at {off}+{n}");
                let mut out = vec![0u8; n];
                r.read(off, &mut out);
                assert_eq!(out, src, "read at {off}+{n}");
            }
        }
    }

    #[test]
    fn atomics() {
        let r = Region::alloc(64);
        assert_eq!(r.compare_swap(8, 0, 5), Some(0));
        assert_eq!(r.compare_swap(8, 0, 7), Some(5));
        assert_eq!(r.fetch_add(8, 10), Some(5));
        assert_eq!(r.load_u64(8), Some(15));
        assert_eq!(r.fetch_add(4, 1), None);
        assert_eq!(r.fetch_add(64, 1), None);
    }
}
