//! A replicated volume as the agent sees it: byte-addressed reads and writes turned into block
//! requests on the [`Link`]s of the volume's replicas.
//!
//! - **Writes** go to every replica and complete when all of them have the blocks durable. A
//!   replica that does not answer makes the write wait (the links resend on other paths and
//!   probe dead ones) until the link's I/O timeout, then the write fails with EIO: this agent
//!   never acknowledges a write that is not on every replica, so any one replica can serve
//!   every read afterwards without a catch-up protocol. (A degraded mode that acknowledges on
//!   a quorum needs a resync log for the missing replica; it is not built.)
//! - Overlapping writes are **serialized** here (a range lock per volume), so an old write can
//!   never be applied after a newer one; the storage node drops stale retransmissions too.
//!   Unaligned writes read-modify-write their first and last block under the same lock.
//! - **Reads** go to one replica (round-robin) and fail over to the next on a timeout, a CRC
//!   error or a corrupt stored block. A replica that answered with bad data is **repaired**:
//!   under the range lock the good copy is read again and written to it.

use crate::link::{Link, LinkError};
use netstack::transport::solar::client::IoError;
use netstack::transport::solar::wire::Status;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;

/// Bytes of a block.
pub const BLOCK: u64 = 4096;
/// Most blocks one link request carries.
const CHUNK_BLOCKS: u64 = 4096;

/// Why a volume request failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum VolumeError {
    #[error("volume {volume}: {offset}+{len} is outside its {size} bytes")]
    OutOfRange {
        volume: u32,
        offset: u64,
        len: u64,
        size: u64,
    },
    #[error("volume {volume}: replica {replica}: {source}")]
    Replica {
        volume: u32,
        replica: usize,
        #[source]
        source: LinkError,
    },
    #[error("volume {volume}: no replica answered the read ({last})")]
    AllReplicasFailed { volume: u32, last: String },
}

/// Settings of a volume's I/O.
#[derive(Debug, Clone)]
pub struct VolumeConfig {
    /// A replica that has not answered a read in this long is skipped for the next one.
    pub read_failover_after: Duration,
}

impl Default for VolumeConfig {
    fn default() -> Self {
        VolumeConfig {
            read_failover_after: Duration::from_secs(2),
        }
    }
}

/// Counters of a volume.
#[derive(Debug, Default)]
pub struct VolumeCounters {
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub read_failovers: AtomicU64,
    pub repairs: AtomicU64,
    pub repair_failures: AtomicU64,
}

/// Block ranges being written, so overlapping writes take turns.
#[derive(Default)]
struct RangeLocks {
    held: Mutex<Vec<(u64, u64, u64)>>,
    next: AtomicU64,
    freed: Notify,
}

struct RangeGuard<'a> {
    locks: &'a RangeLocks,
    id: u64,
}

impl RangeLocks {
    async fn lock(&self, start: u64, end: u64) -> RangeGuard<'_> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            {
                let mut h = self.held.lock();
                if !h.iter().any(|&(s, e, _)| s < end && start < e) {
                    h.push((start, end, id));
                    return RangeGuard { locks: self, id };
                }
            }
            freed.await;
        }
    }
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        self.locks.held.lock().retain(|&(_, _, i)| i != self.id);
        self.locks.freed.notify_waiters();
    }
}

/// A volume attached to this agent.
pub struct Volume {
    id: u32,
    size: u64,
    replicas: Vec<Arc<Link>>,
    cfg: VolumeConfig,
    locks: RangeLocks,
    rr: AtomicUsize,
    counters: VolumeCounters,
    /// Per replica: until when reads try it last (it failed or did not answer a read), in
    /// milliseconds since `epoch`; 0 when it is in good standing. A replica that is down then
    /// costs one failover wait per [`SUSPECT_FOR`], not one per read that happens to start
    /// there.
    suspect_until: Vec<AtomicU64>,
    epoch: std::time::Instant,
}

/// How long reads try a replica that failed one last.
const SUSPECT_FOR: Duration = Duration::from_secs(3);

fn is_data_error(e: &LinkError) -> bool {
    matches!(
        e,
        LinkError::Io(_, IoError::Crc(..)) | LinkError::Io(_, IoError::Status(Status::IoError, _))
    )
}

impl Volume {
    /// Volume `id` of `size` bytes (a multiple of 4096) on `replicas` (at least one).
    pub fn new(id: u32, size: u64, replicas: Vec<Arc<Link>>, cfg: VolumeConfig) -> Arc<Volume> {
        assert!(!replicas.is_empty(), "a volume needs a replica");
        let replicas_len = replicas.len();
        Arc::new(Volume {
            id,
            size,
            replicas,
            cfg,
            locks: RangeLocks::default(),
            rr: AtomicUsize::new(0),
            counters: VolumeCounters::default(),
            suspect_until: (0..replicas_len).map(|_| AtomicU64::new(0)).collect(),
            epoch: std::time::Instant::now(),
        })
    }

    pub fn id(&self) -> u32 {
        self.id
    }

    /// Bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn replicas(&self) -> &[Arc<Link>] {
        &self.replicas
    }

    pub fn counters(&self) -> &VolumeCounters {
        &self.counters
    }

    fn check(&self, offset: u64, len: u64) -> Result<(), VolumeError> {
        if offset.checked_add(len).is_none_or(|e| e > self.size) {
            return Err(VolumeError::OutOfRange {
                volume: self.id,
                offset,
                len,
                size: self.size,
            });
        }
        Ok(())
    }

    /// Reads `len` bytes at `offset` (any alignment).
    pub async fn read(self: &Arc<Self>, offset: u64, len: u64) -> Result<Vec<u8>, VolumeError> {
        self.check(offset, len)?;
        if len == 0 {
            return Ok(Vec::new());
        }
        self.counters.reads.fetch_add(1, Ordering::Relaxed);
        let first = offset / BLOCK;
        let last = (offset + len).div_ceil(BLOCK);
        let mut data = self.read_blocks(first, last - first).await?;
        let head = (offset - first * BLOCK) as usize;
        if head > 0 || data.len() as u64 != len {
            data.drain(..head);
            data.truncate(len as usize);
        }
        Ok(data)
    }

    async fn read_blocks(self: &Arc<Self>, lba: u64, n: u64) -> Result<Vec<u8>, VolumeError> {
        if n <= CHUNK_BLOCKS {
            return self.read_chunk(lba, n as u16).await;
        }
        let mut out = Vec::with_capacity((n * BLOCK) as usize);
        let mut at = lba;
        while at < lba + n {
            let k = CHUNK_BLOCKS.min(lba + n - at);
            out.extend_from_slice(&self.read_chunk(at, k as u16).await?);
            at += k;
        }
        Ok(out)
    }

    /// One link-sized read with failover across replicas and repair of a bad copy.
    async fn read_chunk(self: &Arc<Self>, lba: u64, n: u16) -> Result<Vec<u8>, VolumeError> {
        let r = self.replicas.len();
        let start = self.rr.fetch_add(1, Ordering::Relaxed) % r;
        let mut bad = Vec::new();
        let mut last = String::new();
        // round robin over the replicas in good standing, then the suspect ones
        // (which replicas are suspect is read once: one that fails now is not tried twice)
        let now = self.epoch.elapsed().as_millis() as u64;
        let suspects = (0..r.min(64))
            .filter(|&i| self.suspect_until[i].load(Ordering::Relaxed) > now)
            .fold(0u64, |m, i| m | 1 << i);
        let order = [false, true].into_iter().flat_map(|last| {
            (0..r)
                .map(move |k| (start + k) % r)
                .filter(move |&i| (i < 64 && suspects >> i & 1 == 1) == last)
        });
        for i in order {
            let rx = self.replicas[i].read(self.id, lba, n);
            let res = if r > 1 {
                match tokio::time::timeout(self.cfg.read_failover_after, rx).await {
                    Ok(x) => x,
                    Err(_) => {
                        last = format!(
                            "replica {i} ({}) did not answer in {:?}",
                            self.replicas[i].server(),
                            self.cfg.read_failover_after
                        );
                        tracing::warn!("volume {}: {last}; trying the next", self.id);
                        self.suspect(i);
                        self.counters.read_failovers.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                }
            } else {
                rx.await
            };
            match res {
                Ok(Ok(data)) => {
                    self.suspect_until[i].store(0, Ordering::Relaxed);
                    if !bad.is_empty() {
                        self.spawn_repair(lba, n, i, bad);
                    }
                    return Ok(data);
                }
                Ok(Err(e)) => {
                    tracing::warn!("volume {}: read of {n} blocks at {lba} from replica {i}: {e}", self.id);
                    if is_data_error(&e) {
                        bad.push(i);
                    }
                    last = e.to_string();
                    self.suspect(i);
                    if r == 1 {
                        return Err(VolumeError::Replica {
                            volume: self.id,
                            replica: i,
                            source: e,
                        });
                    }
                    self.counters.read_failovers.fetch_add(1, Ordering::Relaxed);
                }
                Err(_) => {
                    last = format!("replica {i}: the link stopped");
                    self.suspect(i);
                }
            }
        }
        Err(VolumeError::AllReplicasFailed { volume: self.id, last })
    }

    /// Reads try replica `i` last for a while.
    fn suspect(&self, i: usize) {
        let until = (self.epoch.elapsed() + SUSPECT_FOR).as_millis() as u64;
        self.suspect_until[i].store(until, Ordering::Relaxed);
    }

    /// Rewrites blocks `lba..lba+n` on the `bad` replicas from replica `good`, under the range
    /// lock (so no write to those blocks runs meanwhile; the good copy is read again under it).
    fn spawn_repair(self: &Arc<Self>, lba: u64, n: u16, good: usize, bad: Vec<usize>) {
        let v = self.clone();
        tokio::spawn(async move {
            let _g = v.locks.lock(lba, lba + n as u64).await;
            let data = match v.replicas[good].read(v.id, lba, n).await {
                Ok(Ok(d)) => Arc::<[u8]>::from(d),
                other => {
                    v.counters.repair_failures.fetch_add(1, Ordering::Relaxed);
                    tracing::error!(
                        "volume {}: repair of {n} blocks at {lba}: re-reading replica {good} failed: {other:?}",
                        v.id
                    );
                    return;
                }
            };
            for b in bad {
                match v.replicas[b].write(v.id, lba, data.clone(), true).await {
                    Ok(Ok(())) => {
                        v.counters.repairs.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(
                            "volume {}: repaired {n} blocks at {lba} on replica {b} ({}) from replica {good}",
                            v.id,
                            v.replicas[b].server()
                        );
                    }
                    other => {
                        v.counters.repair_failures.fetch_add(1, Ordering::Relaxed);
                        tracing::error!(
                            "volume {}: repair of {n} blocks at {lba} on replica {b} failed: {other:?}",
                            v.id
                        );
                    }
                }
            }
        });
    }

    /// Writes `data` at `offset` (any alignment) on every replica; returns once all have it
    /// durable.
    pub async fn write(self: &Arc<Self>, offset: u64, data: &[u8], fua: bool) -> Result<(), VolumeError> {
        let len = data.len() as u64;
        self.check(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        self.counters.writes.fetch_add(1, Ordering::Relaxed);
        let first = offset / BLOCK;
        let last = (offset + len).div_ceil(BLOCK);
        let _g = self.locks.lock(first, last).await;
        let head = offset - first * BLOCK;
        let aligned = head == 0 && len.is_multiple_of(BLOCK);
        let blocks: Arc<[u8]> = if aligned {
            Arc::from(data)
        } else {
            // read-modify-write of the partial first and last blocks
            let mut buf = vec![0u8; ((last - first) * BLOCK) as usize];
            let fb = self.read_chunk(first, 1).await?;
            buf[..BLOCK as usize].copy_from_slice(&fb);
            if last - 1 > first && !(offset + len).is_multiple_of(BLOCK) {
                let lb = self.read_chunk(last - 1, 1).await?;
                let at = ((last - 1 - first) * BLOCK) as usize;
                buf[at..at + BLOCK as usize].copy_from_slice(&lb);
            }
            buf[head as usize..(head + len) as usize].copy_from_slice(data);
            Arc::from(buf)
        };
        self.write_blocks(first, blocks, fua).await
    }

    /// Writes zeros over `len` bytes at `offset` (NBD WRITE_ZEROES and TRIM).
    pub async fn write_zeroes(self: &Arc<Self>, offset: u64, len: u64) -> Result<(), VolumeError> {
        self.check(offset, len)?;
        let step = CHUNK_BLOCKS * BLOCK;
        let mut at = offset;
        while at < offset + len {
            let k = step.min(offset + len - at);
            self.write(at, &vec![0u8; k as usize], false).await?;
            at += k;
        }
        Ok(())
    }

    async fn write_blocks(&self, lba: u64, data: Arc<[u8]>, fua: bool) -> Result<(), VolumeError> {
        let n = data.len() as u64 / BLOCK;
        let mut waits = Vec::new();
        let mut at = 0u64;
        while at < n {
            let k = CHUNK_BLOCKS.min(n - at);
            let part: Arc<[u8]> = if k == n {
                data.clone()
            } else {
                Arc::from(&data[(at * BLOCK) as usize..((at + k) * BLOCK) as usize])
            };
            for (i, l) in self.replicas.iter().enumerate() {
                waits.push((i, l.write(self.id, lba + at, part.clone(), fua)));
            }
            at += k;
        }
        let mut first_err = None;
        for (i, w) in waits {
            let r = match w.await {
                Ok(r) => r,
                Err(_) => Err(LinkError::Stopped(self.replicas[i].server())),
            };
            if let Err(e) = r {
                tracing::error!("volume {}: write of {n} blocks at {lba}: replica {i}: {e}", self.id);
                first_err.get_or_insert(VolumeError::Replica {
                    volume: self.id,
                    replica: i,
                    source: e,
                });
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}
