//! Registered memory: regions and the key table that checks every access.
//!
//! # Safety model (the stack's one `unsafe` module besides the socket syscalls in `link::sys`)
//!
//! A [`Region`] is a span of bytes that remote peers may read and write at any time, exactly as a
//! NIC would by DMA. All access from safe code goes through the copy and atomic methods here,
//! each bounds-checked; application threads that want a plain slice must use the `unsafe`
//! accessors and take on the same obligation they have with RDMA memory (do not read what a peer
//! may be writing). Atomics use `AtomicU64` on 8-byte-aligned words, so remote CMP_AND_SWP and
//! FETCH_AND_ADD are atomic against each other and against local atomics on the same word.

use parking_lot::RwLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Memory access rights of a memory region, with ibverbs' bit values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Access(pub u32);

impl Access {
    pub const LOCAL_WRITE: Access = Access(1);
    pub const REMOTE_WRITE: Access = Access(2);
    pub const REMOTE_READ: Access = Access(4);
    pub const REMOTE_ATOMIC: Access = Access(8);
    /// All of the above.
    pub const ALL: Access = Access(15);
    pub fn contains(self, o: Access) -> bool {
        self.0 & o.0 == o.0
    }
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, o: Access) -> Access {
        Access(self.0 | o.0)
    }
}

#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u8; 64]);

/// A span of registerable memory.
pub struct Region {
    ptr: *mut u8,
    len: usize,
    _owned: Option<Box<[Line]>>,
}

// SAFETY: a Region is a raw span shared with remote peers; every access through it is either a
// bounds-checked copy or an atomic, and the owner guarantees the memory outlives the Region.
unsafe impl Send for Region {}
unsafe impl Sync for Region {}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Region({:#x}, {} bytes)", self.ptr as usize, self.len)
    }
}

impl Region {
    /// Allocates `len` zeroed bytes, 64-byte aligned.
    pub fn alloc(len: usize) -> Region {
        let lines = len.div_ceil(64).max(1);
        let mut b = vec![Line([0; 64]); lines].into_boxed_slice();
        let ptr = b.as_mut_ptr() as *mut u8;
        Region {
            ptr,
            len,
            _owned: Some(b),
        }
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
        Region { ptr, len, _owned: None }
    }

    /// The virtual address of the first byte (what a peer puts in a RETH).
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn check(&self, off: usize, n: usize) {
        assert!(
            off.checked_add(n).is_some_and(|e| e <= self.len),
            "region access out of bounds"
        );
    }

    /// Copies `dst.len()` bytes at `off` into `dst`. Panics when out of bounds (callers check
    /// remote ranges with [`MrTable::check`] first).
    pub fn read(&self, off: usize, dst: &mut [u8]) {
        self.check(off, dst.len());
        // SAFETY: bounds checked above; src and dst cannot overlap (dst is a &mut we own).
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(off), dst.as_mut_ptr(), dst.len()) }
    }

    /// Copies `src` into the region at `off`.
    pub fn write(&self, off: usize, src: &[u8]) {
        self.check(off, src.len());
        // SAFETY: bounds checked above; `src` is a shared borrow, so it is not this region's
        // memory being written through a &mut elsewhere.
        unsafe { std::ptr::copy(src.as_ptr(), self.ptr.add(off), src.len()) }
    }

    /// Fills `n` bytes at `off` with `v`.
    pub fn fill(&self, off: usize, n: usize, v: u8) {
        self.check(off, n);
        // SAFETY: bounds checked above.
        unsafe { std::ptr::write_bytes(self.ptr.add(off), v, n) }
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

    /// Runs `f` over bytes `off..off+n` in place (checksumming and sending without a copy).
    /// Like a NIC's DMA read, the view may observe a concurrent remote write to the same bytes;
    /// the transport never sends from memory it is placing into.
    pub fn with_slice<R>(&self, off: usize, n: usize, f: impl FnOnce(&[u8]) -> R) -> R {
        self.check(off, n);
        // SAFETY: bounds checked above; the memory lives as long as &self.
        f(unsafe { std::slice::from_raw_parts(self.ptr.add(off), n) })
    }

    /// Raw pointer to `off` for scatter-gather I/O; `off..off+n` must be in bounds.
    pub fn ptr_at(&self, off: usize, n: usize) -> *const u8 {
        self.check(off, n);
        // SAFETY: bounds checked above.
        unsafe { self.ptr.add(off) }
    }

    /// Mutable raw pointer to `off` for receiving straight into the region.
    pub fn mut_ptr_at(&self, off: usize, n: usize) -> *mut u8 {
        self.check(off, n);
        // SAFETY: bounds checked above.
        unsafe { self.ptr.add(off) }
    }

    /// The region as a slice.
    ///
    /// # Safety
    /// No peer or engine thread may write the region while the slice lives.
    pub unsafe fn as_slice(&self) -> &[u8] {
        std::slice::from_raw_parts(self.ptr, self.len)
    }
}

/// A registered memory region as the key table holds it.
#[derive(Debug, Clone)]
pub struct MrEntry {
    pub region: Arc<Region>,
    pub pd: u32,
    pub access: Access,
    pub lkey: u32,
    pub rkey: u32,
}

/// Why an access was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AccessError {
    #[error("unknown or invalidated key {0:#x}")]
    BadKey(u32),
    #[error("key {0:#x} belongs to another protection domain")]
    WrongPd(u32),
    #[error("range {va:#x}+{len} is outside the memory region")]
    OutOfBounds { va: u64, len: u64 },
    #[error("memory region lacks the access right {0:?}")]
    NoPermission(Access),
}

/// The table of registered memory regions of a context; keys are `index << 8 | generation`.
#[derive(Default)]
pub struct MrTable {
    slots: RwLock<Vec<(u8, Option<MrEntry>)>>,
}

impl MrTable {
    pub fn new() -> MrTable {
        MrTable::default()
    }

    /// Registers a region; returns the entry with its keys.
    pub fn register(&self, region: Arc<Region>, pd: u32, access: Access) -> MrEntry {
        let mut s = self.slots.write();
        let idx = match s.iter().position(|(_, e)| e.is_none()) {
            Some(i) => i,
            None => {
                s.push((0, None));
                s.len() - 1
            }
        };
        let gen = s[idx].0.wrapping_add(1);
        let key = ((idx as u32 + 1) << 8) | gen as u32;
        let e = MrEntry {
            region,
            pd,
            access,
            lkey: key,
            rkey: key,
        };
        s[idx] = (gen, Some(e.clone()));
        e
    }

    /// Removes a registration; later accesses with its keys fail. In-flight packets keep the
    /// memory alive through their `Arc` until they are sent.
    pub fn deregister(&self, key: u32) -> bool {
        let mut s = self.slots.write();
        let idx = (key >> 8) as usize;
        match idx.checked_sub(1).and_then(|i| s.get_mut(i)) {
            Some((g, e)) if *g == key as u8 && e.is_some() => {
                *e = None;
                true
            }
            _ => false,
        }
    }

    /// Looks up a key.
    pub fn get(&self, key: u32) -> Option<MrEntry> {
        let s = self.slots.read();
        let idx = (key >> 8) as usize;
        let (g, e) = s.get(idx.checked_sub(1)?)?;
        if *g != key as u8 {
            return None;
        }
        e.clone()
    }

    /// Checks an access of `len` bytes at virtual address `va` with `key`, in protection domain
    /// `pd`, needing `need`; returns the region and the offset of `va` in it.
    pub fn check(
        &self,
        key: u32,
        pd: u32,
        va: u64,
        len: u64,
        need: Access,
    ) -> Result<(Arc<Region>, usize), AccessError> {
        let e = self.get(key).ok_or(AccessError::BadKey(key))?;
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
        Ok((e.region, (va - base) as usize))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_checks() {
        let t = MrTable::new();
        let r = Arc::new(Region::alloc(4096));
        let e = t.register(r.clone(), 1, Access::REMOTE_READ | Access::LOCAL_WRITE);
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
        assert!(t.deregister(e.rkey));
        assert!(t.check(e.rkey, 1, a, 1, Access::REMOTE_READ).is_err());
        // a new registration in the same slot gets a new key
        let e2 = t.register(r, 1, Access::ALL);
        assert_ne!(e2.rkey, e.rkey);
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
