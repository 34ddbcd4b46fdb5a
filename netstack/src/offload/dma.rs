//! The memory offload handlers may touch: registered DMA regions, looked up by host address.

use super::OffloadError;
use crate::mem::Region;
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

/// A submitted DMA copy (monotonic per call).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct DmaId(pub(super) u64);

struct Entry {
    id: u64,
    start: u64,
    region: Arc<Region>,
    writable: bool,
}

/// The registered DMA regions of an offload engine.
#[derive(Default)]
pub struct DmaSpace {
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
    pub(super) fn register(self: &Arc<Self>, region: Arc<Region>, writable: bool) -> DmaRegionHandle {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let mut v = self.regions.write();
        v.push(Entry {
            id,
            start: region.addr(),
            region,
            writable,
        });
        v.sort_by_key(|e| e.start);
        DmaRegionHandle {
            space: Arc::downgrade(self),
            id,
        }
    }

    /// The region holding `addr..addr+len` and the offset of `addr` in it.
    fn find(&self, addr: u64, len: usize, write: bool) -> Result<(Arc<Region>, usize), OffloadError> {
        let v = self.regions.read();
        let i = v.partition_point(|e| e.start <= addr);
        let fault = || OffloadError::DmaFault(format!("{len} bytes at {addr:#x} are not in a registered DMA region"));
        let e = i.checked_sub(1).map(|i| &v[i]).ok_or_else(fault)?;
        let off = (addr - e.start) as usize;
        if off.checked_add(len).is_none_or(|end| end > e.region.len()) {
            return Err(fault());
        }
        if write && !e.writable {
            return Err(OffloadError::DmaFault(format!(
                "DMA write to {addr:#x}: the region is registered read-only"
            )));
        }
        Ok((e.region.clone(), off))
    }

    pub(super) fn check(&self, addr: u64, len: usize, write: bool) -> Result<(), OffloadError> {
        self.find(addr, len, write).map(|_| ())
    }

    pub(super) fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), OffloadError> {
        let (r, off) = self.find(addr, buf.len(), false)?;
        r.read(off, buf);
        self.count(buf.len());
        Ok(())
    }

    pub(super) fn write(&self, addr: u64, buf: &[u8]) -> Result<(), OffloadError> {
        let (r, off) = self.find(addr, buf.len(), true)?;
        r.write(off, buf);
        self.count(buf.len());
        Ok(())
    }

    pub(super) fn load_u64(&self, addr: u64) -> Result<u64, OffloadError> {
        let (r, off) = self.find(addr, 8, false)?;
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
