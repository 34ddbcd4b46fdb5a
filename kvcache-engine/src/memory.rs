//! The engine's registered local memory: buffers by address, each a region the transports read
//! from and place into, with its flexns registration (lkey/rkey) when that transport runs.

use crate::segment::{BufferDesc, Location};
use crate::TransferError;
use netstack::mem::Region;
use netstack::verbs::Mr;
use parking_lot::RwLock;
use std::collections::BTreeMap;
use std::sync::Arc;

/// One registered buffer.
pub(crate) struct LocalBuffer {
    pub region: Arc<Region>,
    pub location: Location,
    /// The flexns registration (None with the tcp transport).
    pub mr: Option<Mr>,
    /// Remotely accessible (published in the descriptor) or a local-only source/destination.
    pub remote: bool,
}

impl LocalBuffer {
    pub(crate) fn addr(&self) -> u64 {
        self.region.addr()
    }
    pub(crate) fn len(&self) -> u64 {
        self.region.len() as u64
    }
    pub(crate) fn desc(&self) -> BufferDesc {
        BufferDesc {
            addr: self.addr(),
            len: self.len(),
            rkey: self.mr.as_ref().map_or(0, |m| m.rkey()),
            location: self.location,
        }
    }
}

/// Registered buffers by start address; ranges never overlap.
#[derive(Default)]
pub(crate) struct Memory {
    map: RwLock<BTreeMap<u64, Arc<LocalBuffer>>>,
}

impl Memory {
    pub(crate) fn insert(&self, b: LocalBuffer) -> Result<u64, TransferError> {
        let (addr, len) = (b.addr(), b.len());
        if len == 0 {
            return Err(TransferError::Invalid("register_memory: an empty buffer".into()));
        }
        let mut m = self.map.write();
        let below = m.range(..addr + len).next_back();
        if let Some((&a, o)) = below {
            if a + o.len() > addr {
                return Err(TransferError::Invalid(format!(
                    "register_memory: {addr:#x}+{len} overlaps the buffer registered at {a:#x}+{}",
                    o.len()
                )));
            }
        }
        m.insert(addr, Arc::new(b));
        Ok(addr)
    }

    pub(crate) fn remove(&self, addr: u64) -> Option<Arc<LocalBuffer>> {
        self.map.write().remove(&addr)
    }

    /// The buffer holding `[addr, addr+len)` and the offset of `addr` in it.
    pub(crate) fn find(&self, addr: u64, len: u64) -> Option<(Arc<LocalBuffer>, usize)> {
        let m = self.map.read();
        let (&a, b) = m.range(..=addr).next_back()?;
        let end = addr.checked_add(len)?;
        (end <= a + b.len()).then(|| (b.clone(), (addr - a) as usize))
    }

    /// Descriptors of the remotely accessible buffers.
    pub(crate) fn descs(&self) -> Vec<BufferDesc> {
        self.map
            .read()
            .values()
            .filter(|b| b.remote)
            .map(|b| b.desc())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buf(len: usize) -> LocalBuffer {
        LocalBuffer {
            region: Arc::new(Region::alloc(len)),
            location: Location::Cpu(0),
            mr: None,
            remote: true,
        }
    }

    #[test]
    fn lookups_are_bounded_by_the_buffer() {
        let m = Memory::default();
        let b = buf(8192);
        let a = b.addr();
        m.insert(b).unwrap();
        assert_eq!(m.find(a + 4096, 4096).unwrap().1, 4096);
        assert!(m.find(a + 4096, 4097).is_none());
        assert!(m.find(a.wrapping_sub(1), 2).is_none());
        assert!(m.find(u64::MAX, 1).is_none());
        assert_eq!(m.descs().len(), 1);
        assert!(m.remove(a).is_some());
        assert!(m.find(a, 1).is_none());
    }
}
