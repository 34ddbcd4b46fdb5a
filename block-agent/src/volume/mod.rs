//! A replicated volume as the agent sees it: byte-addressed reads and writes turned into block
//! requests on the [`Link`]s of the volume's replicas.
//!
//! - **Versions.** Every copy of a write carries the same version ([`Volume::next_versions`]),
//!   which the storage node stores with the block; a volume attached anew compares the
//!   replicas by them and copies the newest copy of each block where it is missing before
//!   serving (`reconcile`).
//! - **Epochs (fencing).** Each attachment of a volume has an epoch, higher than any before
//!   (the controller's); every request carries it, and before its first I/O the agent fences
//!   every replica at it (`reconcile.rs`). A storage node refuses requests of a lower epoch
//!   (`WrongEpoch`), so an agent the volume was taken from can neither write nor read it: its
//!   I/O fails at once with [`VolumeError::Fenced`]. Versions are epoch-major (the epoch in
//!   their upper bits), so a write such an agent got onto a replica not yet fenced is older
//!   than every write of the new attachment.
//! - **Writes** go to every replica that is up and complete when a **quorum** of them has the
//!   blocks durable (a majority by default, so 2 of 3 replicas give degraded writes; the
//!   volume's own quorum from the controller, else [`VolumeConfig::write_quorum`], the
//!   agent's `--write-quorum`, override it). While the
//!   quorum is not reached the write waits (the links resend on other paths and probe dead
//!   ones) up to the link's I/O timeout, then fails with EIO ("stall, don't fail"), or at once
//!   with ENOSPC when a replica it needs answered that its storage is full.
//! - **Dirty regions.** Per replica the volume keeps which 1 MiB regions it may lack: writes
//!   acknowledged without its copy yet (still in flight to it: `pending`), and writes it missed
//!   (failed, or not answered within [`VolumeConfig::replica_timeout`] after the quorum, or
//!   not sent because it is down: `missed`). A write that failed (no quorum) yet landed on
//!   some replica is missed by the ones it failed on too, so replicas that differ are never
//!   shown in sync. A replica that misses a write is **down**: new writes skip it (while a
//!   quorum of others is up) and only mark their regions missed. Its failed writes are logged
//!   once per failure episode and counted (`flexns_volume_replica_write_failures_total`).
//! - **Reads** go only to a replica clean over the range (no pending or missed region there),
//!   so a read never returns data older than the last acknowledged write; a range no single
//!   replica has clean is read region by region.
//! - **Resync.** A background task per volume rewrites a down replica's missed regions from a
//!   clean copy, region by region under the range lock, at most
//!   [`VolumeConfig::resync_bytes_per_sec`]. The first region that lands brings the replica up
//!   (new writes reach it again; its remaining missed regions still keep reads away); the last
//!   one makes it in sync. A write still in flight to it from before carries an older version
//!   than the resync's, and the storage node drops it as stale (or never places it over the
//!   newer block).
//! - **QoS**: every read and write first passes the volume's token buckets
//!   ([`crate::qos`]: provisioned IOPS and bandwidth with a burst), changeable online.
//! - Overlapping writes are **serialized** here (a range lock per volume), so an old write can
//!   never be applied after a newer one; the storage node drops stale retransmissions too.
//!   Unaligned writes read-modify-write their first and last block under the same lock.
//! - **Reads** go to one replica (round-robin) and fail over to the next on a timeout, a CRC
//!   error or a corrupt stored block. A replica that answered with bad data is **repaired**:
//!   under the range lock the good copy is read again and written to it.

mod reconcile;

pub use reconcile::{Answer, LocalStores, NodeQueries};

use crate::episode::{Episode, Logged, SUMMARY_EVERY as FAILURE_SUMMARY_EVERY};
use crate::link::{Link, LinkError, Target};
use futures_util::stream::{FuturesUnordered, StreamExt};
use netstack::transport::solar::client::IoError;
use netstack::transport::solar::wire::Status;
use parking_lot::Mutex;
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;

/// Bytes of a block.
pub const BLOCK: u64 = 4096;
/// Most blocks one link request carries.
const CHUNK_BLOCKS: u64 = 4096;
/// Blocks of a dirty-tracking region (1 MiB).
const REGION_BLOCKS: u64 = 256;

/// Why a volume request failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum VolumeError {
    /// The request reaches past the volume's end.
    #[error("volume {volume}: {offset}+{len} is outside its {size} bytes")]
    OutOfRange {
        /// The volume.
        volume: u32,
        /// Byte offset of the request.
        offset: u64,
        /// Bytes of the request.
        len: u64,
        /// The volume's size in bytes.
        size: u64,
    },
    /// A replica failed the request.
    #[error("volume {volume}: replica {replica}: {source}")]
    Replica {
        /// The volume.
        volume: u32,
        /// The replica's index.
        replica: usize,
        /// The link's error.
        #[source]
        source: LinkError,
    },
    /// No replica answered a read.
    #[error("volume {volume}: no replica answered the read ({last})")]
    AllReplicasFailed {
        /// The volume.
        volume: u32,
        /// The last replica's error.
        last: String,
    },
    /// The volume was attached elsewhere since: a storage node refused this attachment's epoch.
    #[error(
        "volume {volume} was attached elsewhere since: a storage node refused this attachment's epoch {epoch}; \
         it is fenced (detach it)"
    )]
    Fenced {
        /// The volume.
        volume: u32,
        /// This attachment's epoch, which the node refused.
        epoch: u32,
    },
}

impl VolumeError {
    /// Whether a replica refused the request because its storage is full (`ENOSPC`).
    pub fn is_no_space(&self) -> bool {
        matches!(
            self,
            VolumeError::Replica {
                source: LinkError::Io(_, IoError::Status(Status::NoSpace, _)),
                ..
            }
        )
    }
}

/// Settings of a volume's I/O.
#[derive(Debug, Clone)]
pub struct VolumeConfig {
    /// A replica that has not answered a read in this long is skipped for the next one.
    pub read_failover_after: Duration,
    /// Replicas that must have a write durable before it is acknowledged; None: a majority
    /// (2 of 3: degraded writes). What a replica missed is in the agent's memory; an agent
    /// that attaches a volume anew (a restart) first reconciles the replicas block by block
    /// ([`Volume::start_reconcile`]), so no stale copy is ever read. A volume's own quorum
    /// ([`Volume::set_write_quorum`], from the controller) takes precedence.
    pub write_quorum: Option<usize>,
    /// A replica that has not answered a write this long after the quorum did is down.
    pub replica_timeout: Duration,
    /// Bytes per second the resync of a down replica may write to it.
    pub resync_bytes_per_sec: u64,
    /// How often the resync looks at down replicas.
    pub resync_interval: Duration,
}

impl Default for VolumeConfig {
    fn default() -> Self {
        VolumeConfig {
            read_failover_after: Duration::from_secs(2),
            write_quorum: None,
            replica_timeout: Duration::from_secs(2),
            resync_bytes_per_sec: 64 << 20,
            resync_interval: Duration::from_millis(500),
        }
    }
}

/// Where a replica stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaState {
    /// It has every acknowledged write (or will: `pending` ones are in flight to it).
    InSync,
    /// It gets new writes again; regions it missed are being rewritten from a good copy.
    CatchingUp,
    /// It missed a write: new writes skip it until the resync reaches it.
    Down,
}

/// One replica's dirty regions (see the module's doc).
#[derive(Debug, Default)]
struct ReplicaHealth {
    down: bool,
    /// It did not answer when the volume was attached: what it lacks is not known until it is
    /// compared with a clean replica (the resync does that when it answers again).
    unverified: bool,
    /// Region -> writes acknowledged without this replica's copy, still in flight to it.
    pending: HashMap<u64, u32>,
    /// Regions it missed: rewritten by the resync.
    missed: BTreeSet<u64>,
    /// Bumped when the replica is replaced: what copies sent to the old one did no longer
    /// counts.
    generation: u64,
}

impl ReplicaHealth {
    fn clean(&self, regions: std::ops::Range<u64>) -> bool {
        !self.unverified
            && self.missed.range(regions.clone()).next().is_none()
            && regions.into_iter().all(|r| !self.pending.contains_key(&r))
    }

    fn state(&self) -> ReplicaState {
        match (self.down || self.unverified, self.missed.is_empty()) {
            (true, _) => ReplicaState::Down,
            (false, false) => ReplicaState::CatchingUp,
            (false, true) => ReplicaState::InSync,
        }
    }
}

fn regions(lba: u64, n: u64) -> std::ops::Range<u64> {
    lba / REGION_BLOCKS..(lba + n).div_ceil(REGION_BLOCKS)
}

/// Counters of a volume.
#[derive(Debug, Default)]
pub struct VolumeCounters {
    /// Read requests served.
    pub reads: AtomicU64,
    /// Write requests served.
    pub writes: AtomicU64,
    /// Reads that failed over to another replica.
    pub read_failovers: AtomicU64,
    /// Repair writes to a replica whose read failed or returned corrupt data.
    pub repairs: AtomicU64,
    /// Repairs that failed.
    pub repair_failures: AtomicU64,
    /// Writes acknowledged before every replica had them (a quorum did).
    pub degraded_writes: AtomicU64,
    /// Times a replica went down (it missed a write).
    pub replica_downs: AtomicU64,
    /// Regions the resync rewrote on a replica that missed them.
    pub resynced_regions: AtomicU64,
    /// Blocks the reconciliation at attach copied to a replica that lacked their newest write.
    pub reconciled_blocks: AtomicU64,
}

/// One replica's failed writes, logged once per failure episode ([`crate::episode`]): a
/// replica whose disk is full fails every write sent to it, and a line for each would flood
/// the agent's log. Its total is `flexns_volume_replica_write_failures_total`.
#[derive(Debug, Default)]
struct WriteFailures(Episode);

impl WriteFailures {
    /// Counts a write that failed on replica `i` of volume `volume` (`what` says which and
    /// why) and logs it if it starts an episode or is due for a summary.
    fn failed(&self, volume: u32, i: usize, what: &dyn std::fmt::Display, now: std::time::Instant) -> Logged {
        let logged = self.0.fail(now);
        match logged {
            Logged::First => tracing::error!(
                "volume {volume}: replica {i}: {what} (its later write failures are counted until a write to it \
                 lands)"
            ),
            Logged::Summary(n) => tracing::error!(
                "volume {volume}: replica {i}: {n} writes failed in the last {} s or more; the latest: {what}",
                FAILURE_SUMMARY_EVERY.as_secs()
            ),
            Logged::Counted => {}
        }
        logged
    }

    /// A write to replica `i` landed: ends its failure episode, with one line for the failures
    /// it counted. Returns that count (None when no episode was on).
    fn landed(&self, volume: u32, i: usize) -> Option<u64> {
        let n = self.0.end()?;
        if n > 0 {
            tracing::warn!("volume {volume}: replica {i} takes writes again; {n} more failed since the last line");
        } else {
            tracing::info!("volume {volume}: replica {i} takes writes again");
        }
        Some(n)
    }
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

/// Bits of a version below its epoch: versions are `epoch << EPOCH_SHIFT | sequence`.
const EPOCH_SHIFT: u32 = 48;

/// The first version of attachment epoch `epoch`: above every version of the epochs before.
/// Epoch 0 (a volume attached without a controller) starts at the wall clock in nanoseconds,
/// so an agent that restarts goes on above the versions it wrote before.
fn first_version(epoch: u32) -> u64 {
    if epoch == 0 {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64);
        return now.max(1);
    }
    (epoch as u64) << EPOCH_SHIFT | 1
}

/// Replicas' admin addresses and the way to ask them.
type Admins = (Vec<String>, Option<Arc<dyn NodeQueries>>);

/// Most blocks one allocation query covers (64 MiB).
const MAP_BLOCKS: u64 = 16384;

/// What a write puts in its blocks.
enum Payload {
    Data(Arc<[u8]>),
    /// Zeros over this many blocks, deallocated.
    Zeroes(u64),
}

/// A volume attached to this agent.
pub struct Volume {
    id: u32,
    /// This attachment's epoch: every request carries it ([`Volume::attached`]).
    epoch: u32,
    /// The next write version (see [`Volume::next_versions`]).
    versions: AtomicU64,
    /// A storage node refused this attachment's epoch: it is fenced and fails all I/O.
    fenced: AtomicBool,
    /// Bytes; grows online ([`Volume::grow`]).
    size: AtomicU64,
    /// Per replica its link; one is swapped when the controller replaces the replica.
    replicas: Vec<parking_lot::RwLock<Arc<Link>>>,
    cfg: VolumeConfig,
    locks: RangeLocks,
    rr: AtomicUsize,
    counters: VolumeCounters,
    /// Per replica: until when reads try it last (it failed or did not answer a read), in
    /// milliseconds since `started`; 0 when it is in good standing. A replica that is down then
    /// costs one failover wait per [`SUSPECT_FOR`], not one per read that happens to start
    /// there.
    suspect_until: Vec<AtomicU64>,
    started: std::time::Instant,
    health: Mutex<Vec<ReplicaHealth>>,
    qos: Mutex<crate::qos::Qos>,
    /// The resync task was started.
    resyncing: AtomicBool,
    /// Writes hold it shared; [`Volume::quiesced`] holds it alone (it is fair: once a
    /// snapshot waits, new writes queue behind it).
    gate: Arc<tokio::sync::RwLock<()>>,
    /// Its replicas' storage-node admin addresses ("" when not known) and how to ask them.
    admins: Mutex<Admins>,
    /// Set once the replicas are reconciled (or none needed it): reads wait for it, writes
    /// for the gate, which the reconciliation holds.
    reconciled: AtomicBool,
    reconciled_cv: Notify,
    /// The volume's own write quorum (0: the configuration's).
    quorum: AtomicUsize,
    /// Per replica: its failed writes, logged once per failure episode.
    failures: Vec<WriteFailures>,
}

/// How long reads try a replica that failed one last.
const SUSPECT_FOR: Duration = Duration::from_secs(3);

fn is_data_error(e: &LinkError) -> bool {
    matches!(
        e,
        LinkError::Io(_, IoError::Crc(..)) | LinkError::Io(_, IoError::Status(Status::IoError | Status::NoSpace, _))
    )
}

impl Volume {
    /// Volume `id` of `size` bytes (a multiple of 4096) on `replicas` (at least one), attached
    /// without an epoch (0: no fencing). The resync task starts when a replica first goes down
    /// and runs while the volume lives.
    pub fn new(id: u32, size: u64, replicas: Vec<Arc<Link>>, cfg: VolumeConfig) -> Arc<Volume> {
        Self::attached(id, size, replicas, cfg, 0)
    }

    /// [`Volume::new`] for an attachment of epoch `epoch` (the controller's): its requests
    /// carry it, its write versions start above every earlier epoch's, and the replicas are
    /// fenced at it when it is reconciled ([`Volume::start_reconcile`]).
    pub fn attached(id: u32, size: u64, replicas: Vec<Arc<Link>>, cfg: VolumeConfig, epoch: u32) -> Arc<Volume> {
        assert!(!replicas.is_empty(), "a volume needs a replica");
        let replicas_len = replicas.len();
        Arc::new(Volume {
            id,
            epoch,
            versions: AtomicU64::new(first_version(epoch)),
            fenced: AtomicBool::new(false),
            size: AtomicU64::new(size),
            replicas: replicas.into_iter().map(parking_lot::RwLock::new).collect(),
            cfg,
            locks: RangeLocks::default(),
            rr: AtomicUsize::new(0),
            counters: VolumeCounters::default(),
            suspect_until: (0..replicas_len).map(|_| AtomicU64::new(0)).collect(),
            started: std::time::Instant::now(),
            health: Mutex::new((0..replicas_len).map(|_| ReplicaHealth::default()).collect()),
            qos: Mutex::new(crate::qos::Qos::default()),
            resyncing: AtomicBool::new(false),
            gate: Arc::new(tokio::sync::RwLock::new(())),
            admins: Mutex::new((Vec::new(), None)),
            reconciled: AtomicBool::new(true),
            reconciled_cv: Notify::new(),
            quorum: AtomicUsize::new(0),
            failures: (0..replicas_len).map(|_| WriteFailures::default()).collect(),
        })
    }

    /// This attachment's epoch.
    pub fn epoch(&self) -> u32 {
        self.epoch
    }

    /// When this attachment was made.
    pub fn attached_at(&self) -> std::time::Instant {
        self.started
    }

    /// Blocks from `lba` under this attachment's epoch: where a link request goes.
    fn at(&self, lba: u64) -> Target {
        Target {
            volume: self.id,
            lba,
            epoch: self.epoch(),
        }
    }

    /// Reserves `n` consecutive write versions; returns the first. Every write of the volume
    /// takes its versions from this one increasing sequence, and each replica's copy of a
    /// write carries the same version: the storage nodes order writes to a block by it
    /// (dropping an older one that arrives late) and store it with the block, so replicas can
    /// be compared block by block and the newest copy found.
    pub fn next_versions(&self, n: u64) -> u64 {
        self.versions.fetch_add(n.max(1), Ordering::Relaxed)
    }

    /// Makes every version drawn from now on at least `floor` (the comparison of replicas at
    /// attach raises it above the highest version any replica holds).
    pub fn raise_versions(&self, floor: u64) {
        self.versions.fetch_max(floor, Ordering::Relaxed);
    }

    /// Err once a storage node refused this attachment's epoch.
    fn check_fenced(&self) -> Result<(), VolumeError> {
        if !self.is_fenced() {
            return Ok(());
        }
        Err(VolumeError::Fenced {
            volume: self.id,
            epoch: self.epoch,
        })
    }

    /// Notes that a storage node refused this attachment's epoch, if `e` says so; the error
    /// the request fails with then.
    fn fenced_by(&self, e: &LinkError) -> Option<VolumeError> {
        if !matches!(e, LinkError::Io(_, IoError::Status(Status::WrongEpoch, _))) {
            return None;
        }
        self.mark_fenced(&e.to_string());
        self.check_fenced().err()
    }

    /// This attachment is fenced from now on (`why`: who said so): all I/O fails.
    fn mark_fenced(&self, why: &str) {
        if !self.fenced.swap(true, Ordering::AcqRel) {
            tracing::error!(
                "volume {}: attached elsewhere since (epoch {} refused: {why}); this attachment is fenced and \
                 fails all I/O",
                self.id,
                self.epoch()
            );
        }
    }

    /// Whether a storage node refused this attachment's epoch.
    pub fn is_fenced(&self) -> bool {
        self.fenced.load(Ordering::Acquire)
    }

    /// Sets the volume's QoS limits (online: requests after this see them).
    pub fn set_qos(&self, limits: crate::qos::QosLimits) {
        self.qos.lock().set(limits, std::time::Instant::now());
    }

    /// The QoS limits, and the requests they held back and for how long in total.
    pub fn qos(&self) -> (crate::qos::QosLimits, u64, Duration) {
        let q = self.qos.lock();
        (q.limits(), q.throttled, Duration::from_nanos(q.throttled_ns))
    }

    /// Waits until the QoS buckets admit a request of `bytes`.
    async fn admit(&self, bytes: u64) {
        let wait = self.qos.lock().admit(bytes, std::time::Instant::now());
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }

    /// Replicas whose durable copy acknowledges a write: the volume's own quorum, else the
    /// configuration's, else a majority.
    pub fn write_quorum(&self) -> usize {
        let r = self.replicas.len();
        match self.quorum.load(Ordering::Relaxed) {
            0 => self.cfg.write_quorum.unwrap_or(r / 2 + 1),
            q => q,
        }
        .clamp(1, r)
    }

    /// Sets the volume's own write quorum (0: the configuration's, else a majority).
    pub fn set_write_quorum(&self, q: usize) {
        self.quorum.store(q, Ordering::Relaxed);
    }

    /// Waits until the replicas are reconciled (at once unless a reconciliation runs).
    async fn wait_reconciled(&self) {
        loop {
            let n = self.reconciled_cv.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if self.reconciled.load(Ordering::Acquire) {
                return;
            }
            n.await;
        }
    }

    /// Each replica's state, and how many regions it has yet to catch up.
    pub fn replica_states(&self) -> Vec<(ReplicaState, usize)> {
        self.health.lock().iter().map(|h| (h.state(), h.missed.len())).collect()
    }

    /// The volume's id.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// Bytes.
    pub fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    /// Grows the volume to `size` bytes (the storage nodes grew it first): the same volume
    /// goes on, so open connections keep one range lock, one dirty-region log and one QoS
    /// bucket with new ones, and requests are checked against the new size. Shrinking is
    /// ignored.
    pub fn grow(&self, size: u64) {
        self.size.fetch_max(size, Ordering::AcqRel);
    }

    /// The links to its replicas, in replica order.
    pub fn replicas(&self) -> Vec<Arc<Link>> {
        self.replicas.iter().map(|r| r.read().clone()).collect()
    }

    /// Replica `i`'s link.
    fn link(&self, i: usize) -> Arc<Link> {
        self.replicas[i].read().clone()
    }

    /// Puts `link` in place of replica `i`: the controller replaced that replica with a new,
    /// empty one on another node. The new replica is down with every region missed: writes
    /// reach it once the resync has written its first region, reads only regions it has been
    /// given; the resync copies every region to it from a clean replica, at most
    /// [`VolumeConfig::resync_bytes_per_sec`]. Writes in flight to the old one finish or fail
    /// as they would have.
    pub fn replace_replica(self: &Arc<Self>, i: usize, link: Arc<Link>) {
        let regions = (self.size() / BLOCK).div_ceil(REGION_BLOCKS);
        tracing::warn!(
            "volume {}: replica {i} is now {} (replaced): rebuilding its {regions} regions from the others",
            self.id,
            link.server()
        );
        *self.replicas[i].write() = link;
        {
            let mut h = self.health.lock();
            h[i] = ReplicaHealth {
                down: true,
                missed: (0..regions).collect(),
                generation: h[i].generation + 1,
                ..ReplicaHealth::default()
            };
        }
        self.counters.replica_downs.fetch_add(1, Ordering::Relaxed);
        if !self.resyncing.swap(true, Ordering::Relaxed) {
            tokio::spawn(resync(Arc::downgrade(self)));
        }
    }

    /// The volume's counters.
    pub fn counters(&self) -> &VolumeCounters {
        &self.counters
    }

    /// Per replica, the writes that failed on it or that it did not answer in time
    /// (`flexns_volume_replica_write_failures_total`; logged once per failure episode).
    pub fn replica_write_failures(&self) -> Vec<u64> {
        self.failures.iter().map(|f| f.0.total()).collect()
    }

    fn check(&self, offset: u64, len: u64) -> Result<(), VolumeError> {
        let size = self.size();
        if offset.checked_add(len).is_none_or(|e| e > size) {
            return Err(VolumeError::OutOfRange {
                volume: self.id,
                offset,
                len,
                size,
            });
        }
        Ok(())
    }

    /// Reads `len` bytes at `offset` (any alignment).
    pub async fn read(self: &Arc<Self>, offset: u64, len: u64) -> Result<Vec<u8>, VolumeError> {
        self.check(offset, len)?;
        self.check_fenced()?;
        if len == 0 {
            return Ok(Vec::new());
        }
        self.admit(len).await;
        self.wait_reconciled().await;
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
        let whole = !self.clean_replicas(lba, n).is_empty();
        if n <= CHUNK_BLOCKS && whole {
            return self.read_chunk(lba, n as u16).await;
        }
        // link-sized pieces; region-sized ones when no replica has the whole range clean
        let by_region = n > REGION_BLOCKS && !whole;
        let mut out = Vec::with_capacity((n * BLOCK) as usize);
        let mut at = lba;
        while at < lba + n {
            let step = if by_region {
                REGION_BLOCKS - at % REGION_BLOCKS
            } else {
                CHUNK_BLOCKS
            };
            let k = step.min(lba + n - at);
            out.extend_from_slice(&self.read_chunk(at, k as u16).await?);
            at += k;
        }
        Ok(out)
    }

    /// Replicas with no pending or missed region over `lba..lba+n`: those a read may use.
    fn clean_replicas(&self, lba: u64, n: u64) -> Vec<usize> {
        let h = self.health.lock();
        (0..h.len()).filter(|&i| h[i].clean(regions(lba, n))).collect()
    }

    /// One link-sized read with failover across the replicas clean over the range, and repair
    /// of a bad copy.
    async fn read_chunk(self: &Arc<Self>, lba: u64, n: u16) -> Result<Vec<u8>, VolumeError> {
        let r = self.replicas.len();
        let clean = self.clean_replicas(lba, n as u64);
        if clean.is_empty() {
            return Err(VolumeError::AllReplicasFailed {
                volume: self.id,
                last: format!("no replica has blocks {lba}..{} in sync", lba + n as u64),
            });
        }
        let start = self.rr.fetch_add(1, Ordering::Relaxed) % r;
        let mut bad = Vec::new();
        let mut last = String::new();
        // round robin over the replicas in good standing, then the suspect ones
        // (which replicas are suspect is read once: one that fails now is not tried twice)
        let now = self.started.elapsed().as_millis() as u64;
        let suspects = (0..r.min(64))
            .filter(|&i| self.suspect_until[i].load(Ordering::Relaxed) > now)
            .fold(0u64, |m, i| m | 1 << i);
        let clean = &clean;
        let order = [false, true].into_iter().flat_map(|last| {
            (0..r)
                .map(move |k| (start + k) % r)
                .filter(move |i| clean.contains(i))
                .filter(move |&i| (i < 64 && suspects >> i & 1 == 1) == last)
        });
        for i in order {
            let rx = self.link(i).read(self.at(lba), n);
            let res = if clean.len() > 1 {
                match tokio::time::timeout(self.cfg.read_failover_after, rx).await {
                    Ok(x) => x,
                    Err(_) => {
                        last = format!(
                            "replica {i} ({}) did not answer in {:?}",
                            self.link(i).server(),
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
                    if let Some(f) = self.fenced_by(&e) {
                        return Err(f);
                    }
                    tracing::warn!("volume {}: read of {n} blocks at {lba} from replica {i}: {e}", self.id);
                    if is_data_error(&e) {
                        bad.push(i);
                    }
                    last = e.to_string();
                    self.suspect(i);
                    if clean.len() == 1 {
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
        let until = (self.started.elapsed() + SUSPECT_FOR).as_millis() as u64;
        self.suspect_until[i].store(until, Ordering::Relaxed);
    }

    /// Rewrites blocks `lba..lba+n` on the `bad` replicas from replica `good`, under the range
    /// lock (so no write to those blocks runs meanwhile; the good copy is read again under it).
    fn spawn_repair(self: &Arc<Self>, lba: u64, n: u16, good: usize, bad: Vec<usize>) {
        let v = self.clone();
        tokio::spawn(async move {
            let _g = v.locks.lock(lba, lba + n as u64).await;
            let data = match v.link(good).read(v.at(lba), n).await {
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
                match v.link(b).write(v.at(lba), data.clone(), true, v.next_versions(1)).await {
                    Ok(Ok(())) => {
                        v.counters.repairs.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(
                            "volume {}: repaired {n} blocks at {lba} on replica {b} ({}) from replica {good}",
                            v.id,
                            v.link(b).server()
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
        self.check_fenced()?;
        if len == 0 {
            return Ok(());
        }
        self.admit(len).await;
        let _gate = self.gate.read().await;
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
        self.write_blocks(first, Payload::Data(blocks), fua).await
    }

    /// Runs `f` with the volume's writes held off, every replica holding every acknowledged
    /// write: writes in progress finish, new ones wait until `f` is done, and copies of
    /// acknowledged writes still in flight to a replica land first (up to the replica
    /// timeout). So `f` can take a snapshot on every replica that holds the same writes on
    /// each. Refused while a replica is down or catching up: its snapshot would lack writes.
    pub async fn quiesced<T>(self: &Arc<Self>, f: impl std::future::Future<Output = T>) -> Result<T, String> {
        let _all = self.gate.write().await;
        let until = tokio::time::Instant::now() + self.cfg.replica_timeout;
        loop {
            let (behind, in_flight) = {
                let h = self.health.lock();
                let behind = h
                    .iter()
                    .enumerate()
                    .find(|(_, r)| r.down || !r.missed.is_empty())
                    .map(|(i, r)| (i, r.state(), r.missed.len()));
                (behind, h.iter().any(|r| !r.pending.is_empty()))
            };
            if let Some((i, state, regions)) = behind {
                return Err(format!(
                    "volume {}: replica {i} ({}) is {state:?} with {regions} regions behind: a snapshot now would lack \
                     writes it missed; retry once describe shows it in sync",
                    self.id,
                    self.link(i).server()
                ));
            }
            if !in_flight {
                break;
            }
            if tokio::time::Instant::now() >= until {
                return Err(format!(
                    "volume {}: acknowledged writes are still in flight to a replica after {:?}",
                    self.id, self.cfg.replica_timeout
                ));
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        Ok(f.await)
    }

    /// Writes zeros over `len` bytes at `offset` (NBD WRITE_ZEROES and TRIM). With
    /// `deallocate` the whole blocks in the range are zeroed on the storage nodes, which give
    /// their space back (only headers cross the network); partial blocks at either end, and
    /// the whole range without it (NBD's NO_HOLE), are written with zeros.
    pub async fn write_zeroes(self: &Arc<Self>, offset: u64, len: u64, deallocate: bool) -> Result<(), VolumeError> {
        self.check(offset, len)?;
        self.check_fenced()?;
        let end = offset + len;
        let (first, last) = (offset.div_ceil(BLOCK), end / BLOCK);
        if !deallocate || first >= last {
            return self.write_zero_bytes(offset, end).await;
        }
        self.write_zero_bytes(offset, first * BLOCK).await?;
        let mut lba = first;
        while lba < last {
            let n = CHUNK_BLOCKS.min(last - lba);
            self.admit(n * BLOCK).await;
            let _gate = self.gate.read().await;
            self.counters.writes.fetch_add(1, Ordering::Relaxed);
            let _g = self.locks.lock(lba, lba + n).await;
            self.write_blocks(lba, Payload::Zeroes(n), false).await?;
            lba += n;
        }
        self.write_zero_bytes(last * BLOCK, end).await
    }

    /// Writes zeros (as data) over `start..end`.
    async fn write_zero_bytes(self: &Arc<Self>, start: u64, end: u64) -> Result<(), VolumeError> {
        let step = CHUNK_BLOCKS * BLOCK;
        let mut at = start;
        while at < end {
            let k = step.min(end - at);
            self.write(at, &vec![0u8; k as usize], false).await?;
            at += k;
        }
        Ok(())
    }

    /// The allocation of `len` bytes at `offset` as a clean replica's storage node has it:
    /// runs of (bytes, [`crate::store::ALLOC_DATA`] or [`crate::store::ALLOC_HOLE`]) covering
    /// the range, block by block (NBD BLOCK_STATUS). Asked over the node's admin service.
    pub async fn allocation(self: &Arc<Self>, offset: u64, len: u64) -> Result<Vec<(u64, u8)>, VolumeError> {
        self.check(offset, len)?;
        self.check_fenced()?;
        if len == 0 {
            return Ok(Vec::new());
        }
        self.wait_reconciled().await;
        let (first, last) = (offset / BLOCK, (offset + len).div_ceil(BLOCK));
        let n = (last - first).min(MAP_BLOCKS);
        let (admins, source) = self.admins.lock().clone();
        let Some(source) = source else {
            return Err(VolumeError::AllReplicasFailed {
                volume: self.id,
                last: "no allocation source is set (the volume was not attached by a controller)".into(),
            });
        };
        let mut last_err = String::from("no replica is clean over the range");
        for i in self.clean_replicas(first, n) {
            let Some(admin) = admins.get(i).filter(|a| !a.is_empty()) else {
                last_err = format!("replica {i}'s storage node admin address is not known");
                continue;
            };
            match source.allocation(admin, self.id, first, n).await {
                Ok(states) if states.len() as u64 == n => {
                    let mut runs: Vec<(u64, u8)> = Vec::new();
                    for (k, &st) in states.iter().enumerate() {
                        let b0 = ((first + k as u64) * BLOCK).max(offset);
                        let b1 = ((first + k as u64 + 1) * BLOCK).min(offset + len);
                        match runs.last_mut() {
                            Some((bytes, s)) if *s == st => *bytes += b1 - b0,
                            _ => runs.push((b1 - b0, st)),
                        }
                    }
                    return Ok(runs);
                }
                Ok(states) => last_err = format!("{admin} answered {} states for {n} blocks", states.len()),
                Err(e) => last_err = format!("{admin}: {e}"),
            }
        }
        Err(VolumeError::AllReplicasFailed {
            volume: self.id,
            last: last_err,
        })
    }

    /// Replica `i`'s allocation of `n` blocks from `lba` as its node reports it (None when
    /// it cannot be asked or does not answer).
    async fn node_allocation(&self, i: usize, lba: u64, n: u64) -> Option<Vec<u8>> {
        let (admin, q) = self.node(i).ok()?;
        let ask = q.allocation(&admin, self.id, lba, n);
        match tokio::time::timeout(self.cfg.replica_timeout, ask).await {
            Ok(Ok(states)) if states.len() as u64 == n => Some(states),
            _ => None,
        }
    }

    /// Tells the volume its replicas' storage-node admin addresses, in replica order, and how
    /// to ask them (for [`Volume::allocation`]).
    pub fn set_admins(&self, admins: Vec<String>, source: Arc<dyn NodeQueries>) {
        *self.admins.lock() = (admins, Some(source));
    }

    /// Writes whole blocks on the replicas that are up (all of them when fewer than a quorum
    /// are); returns once a quorum has them durable. The others finish in the background: a
    /// straggler past [`VolumeConfig::replica_timeout`], or one that fails, is down and its
    /// regions missed.
    async fn write_blocks(self: &Arc<Self>, lba: u64, payload: Payload, fua: bool) -> Result<(), VolumeError> {
        let n = match &payload {
            Payload::Data(d) => d.len() as u64 / BLOCK,
            Payload::Zeroes(n) => *n,
        };
        let zero_run = matches!(payload, Payload::Zeroes(_));
        let span = regions(lba, n);
        let quorum = self.write_quorum();
        let (targets, gens): (Vec<usize>, Vec<u64>) = {
            let mut h = self.health.lock();
            let up: Vec<usize> = (0..h.len()).filter(|&i| !h[i].down).collect();
            let targets = if up.len() >= quorum { up } else { (0..h.len()).collect() };
            for (i, r) in h.iter_mut().enumerate() {
                if !targets.contains(&i) {
                    r.missed.extend(span.clone());
                }
            }
            (targets, h.iter().map(|r| r.generation).collect())
        };
        // one version per link request, the same on every replica
        let first_version = self.next_versions(n.div_ceil(CHUNK_BLOCKS));
        let mut replies = FuturesUnordered::new();
        for &i in &targets {
            let mut waits = Vec::new();
            let mut at = 0u64;
            while at < n {
                let k = CHUNK_BLOCKS.min(n - at);
                let version = first_version + at / CHUNK_BLOCKS;
                waits.push(match &payload {
                    Payload::Data(data) => {
                        let part: Arc<[u8]> = if k == n {
                            data.clone()
                        } else {
                            Arc::from(&data[(at * BLOCK) as usize..((at + k) * BLOCK) as usize])
                        };
                        self.link(i).write(self.at(lba + at), part, fua, version)
                    }
                    Payload::Zeroes(_) => self.link(i).write_zeroes(self.at(lba + at), k as u16, version),
                });
                at += k;
            }
            let server = self.link(i).server();
            replies.push(async move {
                for w in waits {
                    match w.await {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => return (i, Err(e)),
                        Err(_) => return (i, Err(LinkError::Stopped(server))),
                    }
                }
                (i, Ok(()))
            });
        }
        let mut left = targets.clone();
        let (mut done, mut failed, mut first_err) = (0usize, Vec::new(), None);
        while let Some((i, r)) = replies.next().await {
            left.retain(|&k| k != i);
            match r {
                Ok(()) => {
                    done += 1;
                    self.failures[i].landed(self.id, i);
                }
                Err(e) => {
                    if let Some(f) = self.fenced_by(&e) {
                        // not a replica failure: this attachment lost the volume
                        return Err(f);
                    }
                    let what = format_args!("write of {n} blocks at {lba}: {e}");
                    self.failures[i].failed(self.id, i, &what, std::time::Instant::now());
                    failed.push(i);
                    first_err.get_or_insert(VolumeError::Replica {
                        volume: self.id,
                        replica: i,
                        source: e,
                    });
                }
            }
            if done >= quorum || done + left.len() < quorum {
                break;
            }
        }
        let acked = done >= quorum;
        // a copy that failed misses the write when it was acknowledged, and also when it failed
        // but landed on another replica: the replicas then differ over its range, and the
        // resync makes them equal again (a landing that comes later marks it then)
        for &i in &failed {
            self.settle(i, gens[i], span.clone(), false, acked || done > 0, false);
        }
        if !left.is_empty() {
            if acked {
                self.counters.degraded_writes.fetch_add(1, Ordering::Relaxed);
                // answered without these replicas' copies: reads keep away from them over its
                // regions until their copies land
                let mut h = self.health.lock();
                for &i in &left {
                    if h[i].generation != gens[i] {
                        continue;
                    }
                    for g in span.clone() {
                        *h[i].pending.entry(g).or_insert(0) += 1;
                    }
                }
            }
            // each straggler lands, fails, or is given up on (down) after the timeout; a zero
            // run waits for them under the range lock (a replica drops a zero run that a newer
            // write to any of its blocks overtook, so none may be issued meanwhile)
            let (v, timeout) = (self.clone(), self.cfg.replica_timeout);
            // whether the write landed on some replica, and the copies that failed before one did
            let (mut landed_any, mut behind) = (done > 0, if done > 0 { Vec::new() } else { failed });
            let stragglers = async move {
                let all_answered = tokio::time::timeout(timeout, async {
                    while let Some((i, r)) = replies.next().await {
                        left.retain(|&k| k != i);
                        match &r {
                            Ok(()) => {
                                v.failures[i].landed(v.id, i);
                                if !landed_any {
                                    // the copies that failed before lack what this one has
                                    landed_any = true;
                                    for k in behind.drain(..) {
                                        v.settle(k, gens[k], span.clone(), false, true, false);
                                    }
                                }
                            }
                            Err(e) => {
                                let what = format_args!("write of {n} blocks at {lba}: {e}");
                                v.failures[i].failed(v.id, i, &what, std::time::Instant::now());
                                if !landed_any {
                                    behind.push(i);
                                }
                            }
                        }
                        v.settle(i, gens[i], span.clone(), r.is_ok(), acked || landed_any, acked);
                    }
                })
                .await;
                if all_answered.is_err() {
                    drop(replies);
                    for i in left {
                        let what = format_args!(
                            "did not answer a write of {n} blocks at {lba} within {timeout:?} of the quorum ({})",
                            v.link(i).server()
                        );
                        v.failures[i].failed(v.id, i, &what, std::time::Instant::now());
                        v.settle(i, gens[i], span.clone(), false, acked || landed_any, acked);
                    }
                }
            };
            if zero_run {
                stragglers.await;
            } else {
                tokio::spawn(stragglers);
            }
        }
        if acked {
            Ok(())
        } else {
            Err(first_err.unwrap_or(VolumeError::AllReplicasFailed {
                volume: self.id,
                last: format!("{done} of the {quorum} replicas a write needs answered"),
            }))
        }
    }

    /// Replica `i`'s copy of a write over `span` landed (`ok`) or not; `counted` when it was
    /// counted in flight (the write was answered before it came). A copy that did not land
    /// takes the replica down, and when another replica has the write (`missed`: it was
    /// acknowledged, or it failed yet landed somewhere) leaves its regions missed, so the
    /// replicas are never shown in sync while they differ and the resync makes them equal.
    /// A write that landed on no replica leaves its range as it was on every one, as a failed
    /// write does on a disk: nothing to catch up. One replica has nothing to catch up from: no
    /// tracking.
    /// A copy sent to a replica since replaced (`generation` older than its current one) no
    /// longer counts.
    fn settle(
        self: &Arc<Self>,
        i: usize,
        generation: u64,
        span: std::ops::Range<u64>,
        ok: bool,
        missed: bool,
        counted: bool,
    ) {
        if self.replicas.len() == 1 {
            return;
        }
        let mut h = self.health.lock();
        let r = &mut h[i];
        if r.generation != generation {
            return;
        }
        for g in span.clone().filter(|_| counted) {
            if let Some(c) = r.pending.get_mut(&g) {
                *c -= 1;
                if *c == 0 {
                    r.pending.remove(&g);
                }
            }
        }
        if !ok {
            if missed {
                r.missed.extend(span);
            }
            if !r.down {
                r.down = true;
                self.counters.replica_downs.fetch_add(1, Ordering::Relaxed);
                if !self.resyncing.swap(true, Ordering::Relaxed) {
                    tokio::spawn(resync(Arc::downgrade(self)));
                }
                tracing::warn!(
                    "volume {}: replica {i} ({}) missed a write: down until the resync catches it up",
                    self.id,
                    self.link(i).server()
                );
            }
        }
    }

    /// One resync step for replica `i`: rewrites its first missed region from a replica clean
    /// there, under the range lock. Ok(false) when it has none left.
    async fn resync_region(self: &Arc<Self>, i: usize) -> Result<bool, String> {
        let Some(g) = self.health.lock()[i].missed.first().copied() else {
            return Ok(false);
        };
        let lba = g * REGION_BLOCKS;
        let n = REGION_BLOCKS.min(self.size() / BLOCK - lba);
        if self.health.lock()[i].down {
            // a down replica answers a one-block read first, without the range lock: a dead
            // one must not hold up the writes to the region for the replica timeout
            match tokio::time::timeout(self.cfg.replica_timeout, self.link(i).read(self.at(lba), 1)).await {
                Ok(Ok(Ok(_))) => {}
                other => return Err(format!("replica {i} does not answer: {other:?}")),
            }
        }
        let _g = self.locks.lock(lba, lba + n).await;
        let source = self
            .clean_replicas(lba, n)
            .into_iter()
            .find(|&k| k != i)
            .ok_or_else(|| format!("no replica has region {g} in sync"))?;
        let data = match tokio::time::timeout(self.cfg.replica_timeout, self.link(source).read(self.at(lba), n as u16))
            .await
        {
            Ok(Ok(Ok(d))) => Arc::<[u8]>::from(d),
            other => return Err(format!("reading region {g} from replica {source}: {other:?}")),
        };
        // the source's holes go as zero runs (deallocated: a rebuilt replica of a sparse
        // volume stays sparse), its data as data
        let holes = match self.node_allocation(source, lba, n).await {
            Some(states) => states.iter().map(|&s| s == crate::store::ALLOC_HOLE).collect(),
            // no map: a region of zeros is one hole
            None => vec![data.iter().all(|&b| b == 0); n as usize],
        };
        for (at, k, hole) in runs(&holes) {
            let version = self.next_versions(1);
            let target = self.at(lba + at);
            let copy = if hole {
                self.link(i).write_zeroes(target, k as u16, version)
            } else {
                let part = Arc::from(&data[(at * BLOCK) as usize..((at + k) * BLOCK) as usize]);
                self.link(i).write(target, part, true, version)
            };
            match tokio::time::timeout(self.cfg.replica_timeout, copy).await {
                Ok(Ok(Ok(()))) => {}
                other => return Err(format!("writing region {g}: {other:?}")),
            }
        }
        // its writes land again: a failure episode of it ends here
        self.failures[i].landed(self.id, i);
        let mut h = self.health.lock();
        h[i].missed.remove(&g);
        if h[i].down {
            // it answers: new writes reach it again
            h[i].down = false;
            tracing::info!(
                "volume {}: replica {i} ({}) answers again: catching up {} regions",
                self.id,
                self.link(i).server(),
                h[i].missed.len()
            );
        }
        if h[i].missed.is_empty() {
            tracing::info!("volume {}: replica {i} ({}) is in sync", self.id, self.link(i).server());
        }
        self.counters.resynced_regions.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }
}

/// Runs of equal flags: (first index, length, flag), in order.
fn runs(flags: &[bool]) -> Vec<(u64, u64, bool)> {
    let mut out: Vec<(u64, u64, bool)> = Vec::new();
    for (k, &f) in flags.iter().enumerate() {
        match out.last_mut() {
            Some((_, len, g)) if *g == f => *len += 1,
            _ => out.push((k as u64, 1, f)),
        }
    }
    out
}

/// The resync task of a volume: while it lives, catches up its down replicas (see the
/// module's doc).
async fn resync(v: std::sync::Weak<Volume>) {
    loop {
        let interval = match v.upgrade() {
            Some(v) => v.cfg.resync_interval,
            None => return,
        };
        tokio::time::sleep(interval).await;
        let Some(v) = v.upgrade() else { return };
        if v.is_fenced() {
            return;
        }
        let behind: Vec<usize> = {
            let h = v.health.lock();
            (0..h.len())
                .filter(|&i| h[i].down || h[i].unverified || !h[i].missed.is_empty())
                .collect()
        };
        for i in behind {
            if v.health.lock()[i].unverified {
                match v.verify_returned(i).await {
                    Ok(true) => {}
                    Ok(false) => continue,
                    Err(e) => {
                        tracing::debug!("volume {}: comparing replica {i}: {e}", v.id);
                        continue;
                    }
                }
            }
            loop {
                let t = std::time::Instant::now();
                match v.resync_region(i).await {
                    Ok(true) => {
                        // bounded bandwidth: a region's bytes at the configured rate
                        let budget = Duration::from_secs_f64(
                            (REGION_BLOCKS * BLOCK) as f64 / v.cfg.resync_bytes_per_sec.max(1) as f64,
                        );
                        tokio::time::sleep(budget.saturating_sub(t.elapsed())).await;
                    }
                    Ok(false) => {
                        // nothing missed: a down replica with no missed region is up again
                        v.health.lock()[i].down = false;
                        break;
                    }
                    Err(e) => {
                        tracing::debug!("volume {}: resync of replica {i}: {e}", v.id);
                        break;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_write_failures_log_once_per_episode() {
        let f = WriteFailures::default();
        let t0 = std::time::Instant::now();
        let what = "write of 16 blocks at 0: no space";
        assert_eq!(f.landed(1, 0), None, "no episode yet");
        // a replica whose disk is full fails every write sent to it: one line
        let logged: Vec<Logged> = (0..20).map(|_| f.failed(1, 0, &what, t0)).collect();
        assert_eq!(logged[0], Logged::First);
        assert!(logged[1..].iter().all(|l| *l == Logged::Counted), "{logged:?}");
        assert_eq!(f.landed(1, 0), Some(19), "a landing ends the episode with its count");
        assert_eq!(f.landed(1, 0), None);
        // a long episode: a summary every FAILURE_SUMMARY_EVERY
        assert_eq!(f.failed(1, 0, &what, t0), Logged::First);
        assert_eq!(f.failed(1, 0, &what, t0 + Duration::from_secs(1)), Logged::Counted);
        assert_eq!(f.failed(1, 0, &what, t0 + FAILURE_SUMMARY_EVERY), Logged::Summary(2));
        assert_eq!(f.failed(1, 0, &what, t0 + FAILURE_SUMMARY_EVERY), Logged::Counted);
        assert_eq!(f.landed(1, 0), Some(1));
        assert_eq!(f.0.total(), 24, "every failure is counted");
    }
}
