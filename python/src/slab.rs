//! Managed buffers (`allocate_managed_buffer`) carved from slabs of registered memory: one
//! registration and one descriptor publication per slab, not per buffer, as Mooncake's
//! allocator carves them from one registered pool. A slab is grown by a new registration only
//! when no free range of the existing ones fits; a freed buffer returns to its slab's free list
//! (merged with free neighbours) for the next allocation. Slabs stay registered until the
//! engine closes.

use netstack::mem::Region;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Buffers start on this boundary (a cache line), and their lengths are rounded up to it.
pub(crate) const ALIGN: u64 = 64;
/// Bytes of a slab, unless a single buffer needs more (the slab is then that buffer's size).
pub(crate) const SLAB_BYTES: usize = 64 << 20;

struct Slab {
    region: Arc<Region>,
    base: u64,
    /// Free ranges: offset in the slab -> length.
    free: BTreeMap<u64, u64>,
}

/// The slabs and the buffers handed out from them.
#[derive(Default)]
pub(crate) struct Slabs {
    slabs: Vec<Slab>,
    /// Buffer address -> (slab index, length asked for, length taken).
    allocs: BTreeMap<u64, (usize, u64, u64)>,
}

/// `len` rounded up to [`ALIGN`]; None on overflow.
pub(crate) fn rounded(len: u64) -> Option<u64> {
    len.checked_add(ALIGN - 1).map(|l| l & !(ALIGN - 1))
}

impl Slabs {
    /// Takes `len` bytes (> 0) from a free range of an existing slab (first fit); None when
    /// none fits (the caller then adds a slab).
    pub(crate) fn alloc(&mut self, len: u64) -> Option<u64> {
        let want = rounded(len)?;
        for (i, s) in self.slabs.iter_mut().enumerate() {
            let Some((&off, &n)) = s.free.iter().find(|(_, &n)| n >= want) else {
                continue;
            };
            s.free.remove(&off);
            if n > want {
                s.free.insert(off + want, n - want);
            }
            let addr = s.base + off;
            self.allocs.insert(addr, (i, len, want));
            return Some(addr);
        }
        None
    }

    /// Adds a registered slab (its base is the region's address) with all of it free.
    pub(crate) fn add_slab(&mut self, region: Arc<Region>) {
        let base = region.addr();
        let n = region.len() as u64 & !(ALIGN - 1);
        let mut free = BTreeMap::new();
        free.insert(0, n);
        self.slabs.push(Slab { region, base, free });
    }

    /// Returns a buffer to its slab; Some(the length it was allocated with), or None if
    /// `addr` is not a buffer handed out here.
    pub(crate) fn free(&mut self, addr: u64) -> Option<u64> {
        let (i, len, taken) = self.allocs.remove(&addr)?;
        let s = &mut self.slabs[i];
        let mut off = addr - s.base;
        let mut n = taken;
        if let Some((&p, &pn)) = s.free.range(..off).next_back() {
            if p + pn == off {
                s.free.remove(&p);
                off = p;
                n += pn;
            }
        }
        if let Some(nn) = s.free.remove(&(off + n)) {
            n += nn;
        }
        s.free.insert(off, n);
        Some(len)
    }

    /// The slab region holding `[addr, addr+len)` inside one handed-out buffer, and the
    /// offset in the region.
    pub(crate) fn region_at(&self, addr: u64, len: usize) -> Option<(Arc<Region>, usize)> {
        let (&b, &(i, blen, _)) = self.allocs.range(..=addr).next_back()?;
        if addr.checked_add(len as u64)? > b + blen {
            return None;
        }
        let s = &self.slabs[i];
        Some((s.region.clone(), (addr - s.base) as usize))
    }

    /// Slabs registered so far.
    pub(crate) fn slab_count(&self) -> usize {
        self.slabs.len()
    }

    /// Buffers handed out and not freed.
    pub(crate) fn live(&self) -> usize {
        self.allocs.len()
    }
}
