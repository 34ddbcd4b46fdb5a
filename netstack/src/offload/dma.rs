//! The memory offload handlers may touch, checked exactly as a remote READ or WRITE is: every
//! DMA names an rkey, and the key's memory region must be live, in the requesting QP's
//! protection domain, grant the remote access (REMOTE_READ, or REMOTE_WRITE for a DMA into host
//! memory) and hold the whole range. The server opts a region in with
//! [`super::OffloadEngine::register_dma_region`] (handlers reach no other region, whatever key
//! a request names), and may register it read-only for handlers even where clients may WRITE.

use super::OffloadError;
use crate::mem::{Access, MrTable, Region};
use parking_lot::RwLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

/// Direction of a DMA copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DmaOp {
    /// Host memory into the response buffer.
    Read,
    /// The response buffer into host memory (the region must be registered writable).
    Write,
}

/// What one DMA may touch: memory reachable with `rkey` from protection domain `pd` (the
/// requesting QP's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Grant {
    pub(super) pd: u32,
    pub(super) rkey: u32,
}

/// A submitted DMA copy (monotonic per call).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct DmaId(pub(super) u64);

struct Entry {
    id: u64,
    rkey: u32,
    writable: bool,
}

/// The memory regions an offload engine's handlers may DMA, by rkey.
pub struct DmaSpace {
    mrs: Arc<MrTable>,
    regions: RwLock<Vec<Entry>>,
    next: AtomicU64,
    ops: AtomicU64,
    bytes: AtomicU64,
}

/// Keeps a DMA region registered; dropping it revokes the handlers' access.
pub struct DmaRegionHandle {
    space: Weak<DmaSpace>,
    id: u64,
}

impl Drop for DmaRegionHandle {
    fn drop(&mut self) {
        if let Some(s) = self.space.upgrade() {
            s.regions.write().retain(|e| e.id != self.id);
        }
    }
}

impl DmaSpace {
    pub(super) fn new(mrs: Arc<MrTable>) -> DmaSpace {
        DmaSpace {
            mrs,
            regions: RwLock::new(Vec::new()),
            next: AtomicU64::new(0),
            ops: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
        }
    }

    pub(super) fn register(self: &Arc<Self>, rkey: u32, writable: bool) -> DmaRegionHandle {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.regions.write().push(Entry { id, rkey, writable });
        DmaRegionHandle {
            space: Arc::downgrade(self),
            id,
        }
    }

    /// Checks a DMA of `len` bytes at `addr` with `rkey` for a QP of protection domain `pd`
    /// (`write`: into host memory); returns the region and the offset of `addr` in it.
    fn find(&self, g: Grant, addr: u64, len: usize, write: bool) -> Result<(Arc<Region>, usize), OffloadError> {
        let rkey = g.rkey;
        let writable = self
            .regions
            .read()
            .iter()
            .filter(|e| e.rkey == rkey)
            .map(|e| e.writable)
            .reduce(|a, b| a || b)
            .ok_or_else(|| OffloadError::DmaFault(format!("rkey {rkey:#x} is not registered for offload DMA")))?;
        if write && !writable {
            return Err(OffloadError::DmaFault(format!(
                "DMA write to {addr:#x}: rkey {rkey:#x} is registered read-only for offloads"
            )));
        }
        let need = if write {
            Access::REMOTE_WRITE
        } else {
            Access::REMOTE_READ
        };
        self.mrs
            .check(rkey, g.pd, addr, len as u64, need)
            .map_err(|e| OffloadError::DmaFault(format!("{len} bytes at {addr:#x} with rkey {rkey:#x}: {e}")))
    }

    pub(super) fn check(&self, g: Grant, addr: u64, len: usize, write: bool) -> Result<(), OffloadError> {
        self.find(g, addr, len, write).map(|_| ())
    }

    pub(super) fn read(&self, g: Grant, addr: u64, buf: &mut [u8]) -> Result<(), OffloadError> {
        let (r, off) = self.find(g, addr, buf.len(), false)?;
        r.read(off, buf);
        self.count(buf.len());
        Ok(())
    }

    pub(super) fn write(&self, g: Grant, addr: u64, buf: &[u8]) -> Result<(), OffloadError> {
        let (r, off) = self.find(g, addr, buf.len(), true)?;
        r.write(off, buf);
        self.count(buf.len());
        Ok(())
    }

    pub(super) fn load_u64(&self, g: Grant, addr: u64) -> Result<u64, OffloadError> {
        let (r, off) = self.find(g, addr, 8, false)?;
        self.count(8);
        r.load_u64(off)
            .ok_or_else(|| OffloadError::DmaFault(format!("word load at {addr:#x} is not 8-byte aligned")))
    }

    fn count(&self, n: usize) {
        self.ops.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub(super) fn counters(&self) -> (u64, u64) {
        (self.ops.load(Ordering::Relaxed), self.bytes.load(Ordering::Relaxed))
    }
}
