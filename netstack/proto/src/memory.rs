//! How the transports reach registered memory. The memory itself (raw spans that the
//! application and remote peers read and write concurrently, so never behind `&[u8]`) lives
//! in the driver's crate, whose `unsafe` is documented there; this crate names only what a
//! transport does with it: check a key, copy bytes in and out, and run an atomic. Both traits
//! are implemented by netstack's `mem::Region` and `mem::MrTable`.

use std::fmt;
use std::sync::Arc;

/// A span of registered memory as a transport uses it: every access copies, so no reference
/// into memory that a peer may be writing ever exists.
pub trait SharedRegion: Send + Sync + fmt::Debug + 'static {
    /// A private region holding a copy of `data` (inline payloads, offload requests and
    /// responses, which the transport keeps until they are acknowledged).
    fn from_bytes(data: &[u8]) -> Self
    where
        Self: Sized;
    /// Its length in bytes.
    fn len(&self) -> usize;
    /// Whether it is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies `dst.len()` bytes at `off` into `dst`. Panics outside the region.
    fn read(&self, off: usize, dst: &mut [u8]);
    /// Copies `src` to `off`. Panics outside the region.
    fn write(&self, off: usize, src: &[u8]);
    /// Appends `n` bytes at `off` to `out`. Panics outside the region.
    fn append_to(&self, off: usize, n: usize, out: &mut Vec<u8>);
    /// Atomically replaces the 8 bytes at `off` with `swap` if they equal `compare`; returns
    /// the old value, or `None` when `off` is not 8-byte aligned or out of range.
    fn compare_swap(&self, off: usize, compare: u64, swap: u64) -> Option<u64>;
    /// Atomically adds `add` to the 8 bytes at `off`; returns the old value, or `None` when
    /// `off` is not 8-byte aligned or out of range.
    fn fetch_add(&self, off: usize, add: u64) -> Option<u64>;
}

/// A context's table of memory registrations: the rkey/lkey, protection domain, bounds and
/// access checks every local and remote access passes before it touches a byte.
pub trait KeyTable {
    /// The memory the table's keys name.
    type Region: SharedRegion;
    /// Checks an access of `len` bytes at virtual address `va` with `key`, in protection domain
    /// `pd`, needing `need`; returns the region and the offset of `va` in it. When `need` holds
    /// a remote right ([`Access::is_remote`]: a peer's READ, WRITE or atomic) `key` is an
    /// rkey, otherwise an lkey; a region's two keys differ and each names it only in its role.
    fn check(
        &self,
        key: u32,
        pd: u32,
        va: u64,
        len: u64,
        need: Access,
    ) -> Result<(Arc<Self::Region>, usize), AccessError>;
}

/// Memory access rights of a memory region, with ibverbs' bit values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Access(pub u32);

impl Access {
    /// The local side may write it (receives, READ responses, atomics' results).
    pub const LOCAL_WRITE: Access = Access(1);
    /// Peers may RDMA WRITE it.
    pub const REMOTE_WRITE: Access = Access(2);
    /// Peers may RDMA READ it.
    pub const REMOTE_READ: Access = Access(4);
    /// Peers may run atomics on it.
    pub const REMOTE_ATOMIC: Access = Access(8);
    /// All of the above.
    pub const ALL: Access = Access(15);
    /// Whether every right of `o` is granted.
    pub fn contains(self, o: Access) -> bool {
        self.0 & o.0 == o.0
    }
    /// Whether it holds a right only peers use (remote write, read or atomic): an access that
    /// needs one names its region by rkey.
    pub fn is_remote(self) -> bool {
        self.0 & (Access::REMOTE_WRITE.0 | Access::REMOTE_READ.0 | Access::REMOTE_ATOMIC.0) != 0
    }
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, o: Access) -> Access {
        Access(self.0 | o.0)
    }
}

/// Why an access was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AccessError {
    /// No region has this key (never registered, deregistered, or invalidated).
    #[error("unknown or invalidated key {0:#x}")]
    BadKey(u32),
    /// The key's region is in another protection domain.
    #[error("key {0:#x} belongs to another protection domain")]
    WrongPd(u32),
    /// The range does not lie inside the region.
    #[error("range {va:#x}+{len} is outside the memory region")]
    OutOfBounds {
        /// Start address asked for.
        va: u64,
        /// Bytes asked for.
        len: u64,
    },
    /// The region does not grant the right.
    #[error("memory region lacks the access right {0:?}")]
    NoPermission(Access),
}
