//! The storage node's durable block store for one volume: a data file (block `lba` at
//! `lba × 4096`), a metadata file (per block 16 bytes: CRC32C, flags, version) and a
//! write-ahead log.
//!
//! - A write is acknowledged once its log record is durable. Writers that arrive while a
//!   commit is running wait for the next one: the committer appends every waiting record and
//!   makes them all durable with one `fdatasync` (group commit), so durability does not cost a
//!   sync per I/O. Then it places the blocks into the data and metadata files (no sync) and
//!   releases the writers.
//! - Restart replays the log into the files. Records carry their own CRC32C; replay stops at
//!   the first torn or damaged record (one that was never acknowledged: its sync never
//!   returned). So a `kill -9` at any instant loses no acknowledged write, and a torn block in
//!   the data file is rewritten from the log. Replay reads a log a chunk at a time
//!   (`logread`), so memory at restart does not grow with `log_limit`.
//! - **A failed write or sync poisons the store** ([`StoreError::Poisoned`]): a failed
//!   append to the log or `fdatasync` of it, a failed write or sync of the data or metadata
//!   files in a checkpoint, or a failed log switch. After a failed sync the kernel may have
//!   dropped the dirty pages (PostgreSQL's "fsyncgate"), so the log past the last durable
//!   record may hold zeros or an older generation's records, and replay would stop there:
//!   anything appended after it and acknowledged would be lost at the next crash. So from then
//!   on the store appends and acknowledges nothing (every write not durable yet fails, and
//!   every later one) and serves no read either (a dropped page of the data file would read as
//!   its older contents, which match the dropped metadata's CRC). The node answers `IoError`,
//!   which the agent takes as a failed replica; a restart replays what was durable (it stops at
//!   the first record that is torn or of another generation) and the agent resyncs it.
//! - The log is two files used in turn (`vol-N.log`, `vol-N.log2`), each starting with a
//!   header carrying its generation. When the active one passes `log_limit`, commits move to
//!   the other (empty) file under the next generation, and a background thread checkpoints the
//!   full one: it syncs the data and metadata files (every record of that log was placed there
//!   before the switch; their dirty pages go to the device a range at a time first, so the log
//!   syncs meanwhile do not queue behind all of them: `writeback`) and only then empties it,
//!   to be the next switch's target. So writers
//!   wait for a checkpoint only when the new log fills before the old one's is done. Replay
//!   applies both files' records, older generation first.
//! - **Log files are recycled, not truncated.** Emptying one overwrites its header (zeros, or
//!   the next generation's), and the records after it stay on disk; each record carries its
//!   log's generation (low 32 bits), and replay stops at the first record of another one. A
//!   commit into a recycled file overwrites blocks the file system has allocated and
//!   initialized already, so its `fdatasync` writes the records and no file-system journal
//!   commit (an append changes the file's size and extents, which costs one): on this
//!   project's VM that halved a 128 KiB commit's sync (590 to 270 us); end to end the gain is
//!   small (docs/ARCHITECTURE.md has the figures). The cost is space: each log file keeps
//!   about `log_limit` bytes once it filled once. Opening a volume truncates both (replay has placed everything), so records of the
//!   format before generations (`SLOG`/`SLZR` magic, never recycled) only appear in logs from
//!   before an upgrade, and replay accepts them there.
//! - Every read checks the block against its CRC; a mismatch is reported
//!   ([`StoreError::Corrupt`]), never returned as data. Blocks never written read as zeros.
//! - Each block keeps the version (request id) of the write that put it there, so the Solar
//!   server can drop stale writes after a restart (`SolarServer::note_version`).
//! - **Snapshots** are copy-on-write (`snapshot`): taking one checkpoints the volume and
//!   copies its metadata; the first overwrite of a block afterwards copies the old block into
//!   the newest snapshot first. A **clone** is a volume whose unwritten blocks read through to
//!   a snapshot of another volume ([`Base`]), usable at once.

mod fence;
mod logread;
mod snapshot;
mod writeback;

pub use snapshot::{read_base, Base};

use parking_lot::{Condvar, Mutex, RwLock};
use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Bytes of a block.
pub const BLOCK: usize = 4096;
/// Bytes of a block's metadata entry: CRC32C (4), written flag (1), a snapshot's preserved
/// flag (1), reserved (2), version (8).
const META: u64 = 16;
/// A data record of the format before log generations (no generation in its header).
const REC_MAGIC: u32 = 0x534C_4F47; // "SLOG"
/// A record of a run of zeroed blocks of the format before log generations.
const ZERO_MAGIC: u32 = 0x534C_5A52; // "SLZR"
/// A data record: header (magic, block CRC, lba, version, record CRC, log generation) and the
/// block. The record CRC covers the header's first 24 bytes and the block; the generation is
/// stamped when its commit is written ([`stamp_generation`]) and checked on its own.
const REC_MAGIC2: u32 = 0x534C_4F32; // "SLO2"
/// A record of a run of zeroed (deallocated) blocks: the header alone, its block count where a
/// data record has the block's CRC.
const ZERO_MAGIC2: u32 = 0x534C_5A32; // "SLZ2"
const REC_HDR: usize = 32;
/// Metadata flag (byte 4) of a block never written: zeros, or a clone's base.
const UNWRITTEN: u8 = 0;
/// Metadata flag of a block holding written data.
const DATA: u8 = 1;
/// Metadata flag of a block zeroed by TRIM or WRITE_ZEROES: zeros, its space given back.
const ZEROED: u8 = 2;
/// Allocation state of a block ([`VolumeStore::allocation`]): data.
pub const ALLOC_DATA: u8 = 0;
/// Allocation state: reads as zeros and holds no space (NBD's HOLE and ZERO).
pub const ALLOC_HOLE: u8 = 3;
/// A log file's header: magic, generation, CRC32C of the two (and reserved), 32 bytes.
const LOG_MAGIC: u32 = 0x534C_4748; // "SLGH"
const LOG_HDR: usize = 32;
const STRIPES: usize = 64;
/// Records whose blocks replay copies into the newest snapshot at a time (one sync per batch
/// that copied any).
const PRESERVE_BATCH: usize = 4096;

/// Errors of the store; each names the volume and, where it applies, the block.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A file operation failed.
    #[error("volume {volume}: {what}: {source}")]
    Io {
        /// The volume.
        volume: u32,
        /// What was being done.
        what: String,
        /// The error.
        source: std::io::Error,
    },
    /// A stored block's data does not match its stored CRC32C.
    #[error("volume {volume}: block {lba} is corrupt (stored CRC {stored:#010x}, data CRC {actual:#010x})")]
    Corrupt {
        /// The volume.
        volume: u32,
        /// The block.
        lba: u64,
        /// The CRC32C stored with the block.
        stored: u32,
        /// The CRC32C of the data read.
        actual: u32,
    },
    /// A block past the volume's end.
    #[error("volume {volume}: block {lba} is outside its {blocks} blocks")]
    OutOfRange {
        /// The volume.
        volume: u32,
        /// The block asked for.
        lba: u64,
        /// The volume's size in blocks.
        blocks: u64,
    },
    /// A written block's CRC32C does not match its data.
    #[error("volume {volume}: the block's CRC {given:#010x} does not match its data ({actual:#010x})")]
    BadCrc {
        /// The volume.
        volume: u32,
        /// The CRC32C the writer sent.
        given: u32,
        /// The CRC32C of the data received.
        actual: u32,
    },
    /// A request or file content is invalid (what, and the volume).
    #[error("volume {volume}: {0}", volume = .1)]
    Invalid(String, u32),
    /// A background checkpoint failed; its log is kept.
    #[error("volume {volume}: a background checkpoint failed (its log is kept): {what}")]
    Checkpoint {
        /// The volume.
        volume: u32,
        /// What failed.
        what: String,
    },
    /// A write or sync of the log, or of the data or metadata files in a checkpoint, or a log
    /// switch failed: after a failed sync the kernel may have dropped the dirty pages, so
    /// nothing past the last durable record can be trusted. The store refuses every request
    /// (writes, and reads too: a dropped page of the data file would read back as its older
    /// contents, matching the dropped metadata's CRC) until the node restarts and replays what
    /// was durable. See [`VolumeStore::poisoned`].
    #[error("volume {volume}: the store failed and refuses all I/O until the node restarts: {cause}")]
    Poisoned {
        /// The volume.
        volume: u32,
        /// The failure that poisoned the store.
        cause: String,
        /// The failure was the file system being full (`ENOSPC`).
        no_space: bool,
    },
}

/// Whether `e` is the file system being full (`ENOSPC`).
fn io_no_space(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::StorageFull || e.raw_os_error() == Some(libc::ENOSPC)
}

impl StoreError {
    /// Whether the error is, or a poisoned store's cause was, the file system being full
    /// (`ENOSPC`): the storage node answers it as such, and the NBD client sees `ENOSPC`.
    pub fn is_no_space(&self) -> bool {
        match self {
            StoreError::Io { source, .. } => io_no_space(source),
            StoreError::Poisoned { no_space, .. } => *no_space,
            _ => false,
        }
    }
}

/// Why a store failed (see [`StoreError::Poisoned`]): set once, shared with the background
/// checkpoint thread.
struct Poison {
    volume: u32,
    /// The cause, and whether it was the file system being full.
    cause: std::sync::OnceLock<(String, bool)>,
}

impl Poison {
    /// [`Poison::set_as`] because of the error `e`, keeping whether it was `ENOSPC`.
    fn set_err(&self, what: &str, e: &StoreError) {
        self.set_as(format!("{what}{e}"), e.is_no_space());
    }

    /// Marks the store failed because of `cause` (the first cause stays; logged once);
    /// `no_space`: the cause was the file system being full.
    fn set_as(&self, cause: String, no_space: bool) {
        let mut first = false;
        self.cause.get_or_init(|| {
            first = true;
            (cause.clone(), no_space)
        });
        if first {
            tracing::error!(
                "volume {}: the store failed ({cause}); it refuses all I/O from now on, and the agent treats \
                 this replica as failed until the node restarts and it is resynced",
                self.volume
            );
        }
    }

    /// Err when the store failed.
    fn check(&self) -> Result<(), StoreError> {
        match self.cause.get() {
            None => Ok(()),
            Some((c, no_space)) => Err(StoreError::Poisoned {
                volume: self.volume,
                cause: c.clone(),
                no_space: *no_space,
            }),
        }
    }
}

/// Counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Blocks written.
    pub writes: u64,
    /// Log syncs (each commits a group of writes).
    pub syncs: u64,
    /// Checkpoints done (the log folded into the data and metadata files).
    pub checkpoints: u64,
    /// Blocks read.
    pub reads: u64,
    /// Reads that found a block whose data did not match its CRC.
    pub corrupt_reads: u64,
    /// Records replayed at open.
    pub replayed: u64,
    /// Writes not placed because the block already held a newer version (made durable in
    /// the other order by two writer threads).
    pub superseded: u64,
}

struct Commit {
    /// Encoded records waiting for the next commit, with their sequence numbers.
    waiting: Vec<u8>,
    waiting_last: u64,
    next_seq: u64,
    durable_seq: u64,
    committing: bool,
    /// Queued writes ([`VolumeStore::submit_blocks`]): the sequence number of each, its
    /// blocks and what runs once it is durable; a commit's leader runs them.
    queued: Vec<(u64, u64, Durable)>,
    /// A queued write asked for a leader ([`VolumeStore::lead_commits`]) not yet run.
    kicked: bool,
}

/// What runs once a queued write is durable, or its commit failed.
pub type Durable = Box<dyn FnOnce(Result<(), StoreError>) + Send>;

/// The log file commits append to.
struct ActiveLog {
    file: File,
    /// Its generation (in its header).
    generation: u64,
}

/// The other log file: taken by the background checkpoint of the records it holds, given back
/// empty. `file` is None while that runs.
#[derive(Default)]
struct Spare {
    file: Option<File>,
    /// The last background checkpoint failed: the log it was for keeps its records.
    failed: Option<String>,
    checkpoints: u64,
}

/// One volume's store.
pub struct VolumeStore {
    volume: u32,
    blocks: std::sync::atomic::AtomicU64,
    dir: PathBuf,
    data: std::sync::Arc<File>,
    meta: std::sync::Arc<File>,
    log: Mutex<ActiveLog>,
    spare: std::sync::Arc<(Mutex<Spare>, Condvar)>,
    log_len: Mutex<u64>,
    log_limit: u64,
    commit: Mutex<Commit>,
    cv: Condvar,
    stripes: Vec<RwLock<()>>,
    stats: Mutex<StoreStats>,
    /// Its snapshots; written (taking or deleting one) only with commits held off.
    snaps: RwLock<snapshot::Snapshots>,
    /// A clone's base.
    base: Option<Base>,
    /// The lowest attachment epoch whose requests the node serves ([`VolumeStore::fence`]).
    fence: fence::Fence,
    /// Where each log sync's duration goes ([`VolumeStore::observe_log_syncs`]).
    sync_latency: std::sync::OnceLock<metrics::Histogram>,
    /// Set when a log write or sync, a checkpoint or a log switch failed: every request is
    /// refused from then on ([`StoreError::Poisoned`]).
    poison: std::sync::Arc<Poison>,
}

/// Makes `dir`'s entries (files created, renamed or removed in it) durable.
pub(crate) fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

fn paths(dir: &Path, volume: u32) -> (PathBuf, PathBuf, PathBuf) {
    (
        dir.join(format!("vol-{volume}.data")),
        dir.join(format!("vol-{volume}.meta")),
        dir.join(format!("vol-{volume}.log")),
    )
}

/// The second log file of a volume (see the module's doc).
fn log2_path(dir: &Path, volume: u32) -> PathBuf {
    dir.join(format!("vol-{volume}.log2"))
}

fn log_header(generation: u64) -> [u8; LOG_HDR] {
    let mut h = [0u8; LOG_HDR];
    h[0..4].copy_from_slice(&LOG_MAGIC.to_le_bytes());
    h[8..16].copy_from_slice(&generation.to_le_bytes());
    let c = crc32c::crc32c(&h[..16]);
    h[16..20].copy_from_slice(&c.to_le_bytes());
    h
}

/// A log file's generation and where its records start: a header gives both; a file of the
/// old single-log format (records from byte 0) is generation 0; anything else holds nothing.
fn log_start(buf: &[u8]) -> Option<(u64, usize)> {
    let u32at = |i: usize| {
        buf.get(i..i + 4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
    };
    match u32at(0)? {
        LOG_MAGIC if buf.len() >= LOG_HDR => {
            (u32at(16)? == crc32c::crc32c(&buf[..16])).then_some(())?;
            Some((u64::from_le_bytes(buf[8..16].try_into().expect("8 bytes")), LOG_HDR))
        }
        REC_MAGIC => Some((0, 0)),
        _ => None,
    }
}

/// Empties a log file and gives it a header of `generation` (made durable with the first
/// records appended after it, by their commit's sync). The file keeps its length: the records
/// after the header belong to an older generation, and replay stops at the first of them.
fn reset_log(f: &mut File, generation: u64) -> std::io::Result<()> {
    f.seek(SeekFrom::Start(0))?;
    f.write_all(&log_header(generation))
}

/// Sets the generation (low 32 bits) in every record of `batch`, a run of whole records
/// encoded here, before it is written to the log of that generation.
fn stamp_generation(batch: &mut [u8], generation: u64) {
    let tag = (generation as u32).to_le_bytes();
    let mut off = 0;
    while off + REC_HDR <= batch.len() {
        let magic = u32::from_le_bytes(batch[off..off + 4].try_into().expect("4 bytes"));
        debug_assert!(magic == REC_MAGIC2 || magic == ZERO_MAGIC2, "a record encoded here");
        batch[off + 28..off + 32].copy_from_slice(&tag);
        off += if magic == ZERO_MAGIC2 { REC_HDR } else { REC_HDR + BLOCK };
    }
}

/// How [`records`] checks what it reads.
#[derive(Clone, Copy)]
enum Check {
    /// A log of this generation: every CRC, and the generation of each record that has one.
    Log(u64),
    /// A batch encoded here and not yet written: whole records, nothing to verify.
    Encoded,
}

/// The version in metadata entry `k` of `m`.
fn entry_version(m: &[u8], k: u64) -> u64 {
    let at = (k * META) as usize + 8;
    u64::from_le_bytes(m[at..at + 8].try_into().expect("8 bytes"))
}

/// CRC32C of a block of zeros.
fn zero_crc() -> u32 {
    crc32c::crc32c(&[0u8; BLOCK])
}

/// Appends a zero record: `count` blocks from `lba` zeroed as `version`.
fn encode_zero_record(out: &mut Vec<u8>, lba: u64, count: u32, version: u64) {
    let start = out.len();
    out.extend_from_slice(&ZERO_MAGIC2.to_le_bytes());
    out.extend_from_slice(&count.to_le_bytes());
    out.extend_from_slice(&lba.to_le_bytes());
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&[0u8; 8]);
    let rc = crc32c::crc32c(&out[start..start + 24]);
    out[start + 24..start + 28].copy_from_slice(&rc.to_le_bytes());
}

/// A log record.
enum Rec<'a> {
    Data {
        lba: u64,
        version: u64,
        crc: u32,
        data: &'a [u8],
    },
    Zero {
        lba: u64,
        count: u32,
        version: u64,
    },
}

impl Rec<'_> {
    /// The blocks it covers.
    fn lbas(&self) -> std::ops::Range<u64> {
        match *self {
            Rec::Data { lba, .. } => lba..lba + 1,
            Rec::Zero { lba, count, .. } => lba..lba.saturating_add(count as u64),
        }
    }
}

/// The whole, intact records at the start of `buf`, in order (of generation `check`'s, in a
/// log).
fn records(buf: &[u8], check: Check) -> impl Iterator<Item = Rec<'_>> {
    let mut off = 0;
    std::iter::from_fn(move || {
        let (r, len) = decode_any(&buf[off..], check)?;
        off += len;
        Some(r)
    })
}

/// One record and its length, if it is whole and intact (and of the log's generation).
fn decode_any(r: &[u8], check: Check) -> Option<(Rec<'_>, usize)> {
    if r.len() < REC_HDR {
        return None;
    }
    let u32at = |i: usize| u32::from_le_bytes(r[i..i + 4].try_into().expect("4 bytes"));
    let magic = u32at(0);
    if let (Check::Log(generation), REC_MAGIC2 | ZERO_MAGIC2) = (check, magic) {
        if u32at(28) != generation as u32 {
            return None;
        }
    }
    if magic == ZERO_MAGIC || magic == ZERO_MAGIC2 {
        let u64at = |i: usize| u64::from_le_bytes(r[i..i + 8].try_into().expect("8 bytes"));
        if matches!(check, Check::Log(_)) && crc32c::crc32c(&r[..24]) != u32at(24) {
            return None;
        }
        let rec = Rec::Zero {
            lba: u64at(8),
            count: u32at(4),
            version: u64at(16),
        };
        return Some((rec, REC_HDR));
    }
    let (lba, version, crc, data) = decode_record(r, matches!(check, Check::Log(_)))?;
    Some((
        Rec::Data {
            lba,
            version,
            crc,
            data,
        },
        REC_HDR + BLOCK,
    ))
}

/// Appends a data record of block `lba` (`crc` its CRC32C) as `version`; its generation is
/// stamped when its commit is written.
fn encode_record(out: &mut Vec<u8>, lba: u64, version: u64, crc: u32, data: &[u8]) {
    let start = out.len();
    out.extend_from_slice(&REC_MAGIC2.to_le_bytes());
    out.extend_from_slice(&crc.to_le_bytes());
    out.extend_from_slice(&lba.to_le_bytes());
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&[0u8; 8]); // record CRC (4) + generation (4)
    out.extend_from_slice(data);
    let rc = crc32c::crc32c_append(crc32c::crc32c(&out[start..start + 24]), data);
    out[start + 24..start + 28].copy_from_slice(&rc.to_le_bytes());
}

/// One data record: (lba, version, crc, data) if it is whole and (when `verify`) intact.
fn decode_record(r: &[u8], verify: bool) -> Option<(u64, u64, u32, &[u8])> {
    if r.len() < REC_HDR + BLOCK {
        return None;
    }
    let u32at = |i: usize| u32::from_le_bytes(r[i..i + 4].try_into().expect("4 bytes"));
    let u64at = |i: usize| u64::from_le_bytes(r[i..i + 8].try_into().expect("8 bytes"));
    if u32at(0) != REC_MAGIC && u32at(0) != REC_MAGIC2 {
        return None;
    }
    let data = &r[REC_HDR..REC_HDR + BLOCK];
    if verify && crc32c::crc32c_append(crc32c::crc32c(&r[..24]), data) != u32at(24) {
        return None;
    }
    Some((u64at(8), u64at(16), u32at(4), data))
}

impl VolumeStore {
    fn io(&self, what: impl Into<String>) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
        let what = what.into();
        move |source| StoreError::Io {
            volume: self.volume,
            what,
            source,
        }
    }

    /// Creates a volume of `blocks` blocks in `dir` (refused if it exists), durably: when this
    /// returns, a power cut leaves the whole volume; before, none of it. The data file is the
    /// volume's commit mark: it is named last, after the other files are sized, synced and
    /// named, and leftovers of a create the power cut short are removed first.
    pub fn create(dir: &Path, volume: u32, blocks: u64, log_limit: u64) -> Result<VolumeStore, StoreError> {
        Self::create_with(dir, volume, blocks, log_limit, None)
    }

    /// Creates a clone: volume `volume` whose blocks read as snapshot `base.snapshot` of
    /// `base.store` until written, of that snapshot's size. Usable at once (nothing is copied).
    pub fn create_clone(dir: &Path, volume: u32, log_limit: u64, base: Base) -> Result<VolumeStore, StoreError> {
        let blocks = base.store.snapshot_blocks(base.snapshot).ok_or_else(|| {
            StoreError::Invalid(
                format!("volume {} has no snapshot {}", base.store.volume, base.snapshot),
                volume,
            )
        })?;
        Self::create_with(dir, volume, blocks, log_limit, Some(base))
    }

    fn create_with(
        dir: &Path,
        volume: u32,
        blocks: u64,
        log_limit: u64,
        base: Option<Base>,
    ) -> Result<VolumeStore, StoreError> {
        let (d, m, l) = paths(dir, volume);
        let err = |what: &str| {
            let what = what.to_string();
            move |source| StoreError::Io { volume, what, source }
        };
        std::fs::create_dir_all(dir).map_err(err("creating the directory"))?;
        if d.exists() {
            return Err(StoreError::Io {
                volume,
                what: format!("creating {}", d.display()),
                source: std::io::ErrorKind::AlreadyExists.into(),
            });
        }
        let pending = d.with_extension("data.new");
        snapshot::Snapshots::remove_all(dir, volume)?;
        for p in [&m, &l, &pending, &snapshot::base_path(dir, volume)] {
            match std::fs::remove_file(p) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(err(&format!("removing {}", p.display()))(e))
                }
                _ => {}
            }
        }
        let mk = |p: &Path, len: u64| -> Result<(), StoreError> {
            let f = OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(p)
                .map_err(err(&format!("creating {}", p.display())))?;
            f.set_len(len).map_err(err("sizing"))?;
            f.sync_all().map_err(err("syncing"))
        };
        mk(&m, blocks * META)?;
        mk(&l, 0)?;
        let l2 = log2_path(dir, volume);
        match std::fs::remove_file(&l2) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(err(&format!("removing {}", l2.display()))(e))
            }
            _ => {}
        }
        mk(&l2, 0)?;
        mk(&pending, blocks * BLOCK as u64)?;
        if let Some(b) = &base {
            snapshot::write_base(dir, volume, (b.store.volume, b.snapshot))?;
        }
        sync_dir(dir).map_err(err("syncing the directory"))?;
        std::fs::rename(&pending, &d).map_err(err(&format!("renaming to {}", d.display())))?;
        sync_dir(dir).map_err(err("syncing the directory"))?;
        Self::open_with(dir, volume, log_limit, base)
    }

    /// Removes a volume's files from `dir` with its snapshots, durably (the data file, its
    /// commit mark, first).
    pub fn remove(dir: &Path, volume: u32) -> Result<(), StoreError> {
        let (d, m, l) = paths(dir, volume);
        let l2 = log2_path(dir, volume);
        for p in [
            &d,
            &m,
            &l,
            &l2,
            &snapshot::base_path(dir, volume),
            &fence::path(dir, volume),
        ] {
            match std::fs::remove_file(p) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(StoreError::Io {
                        volume,
                        what: format!("removing {}", p.display()),
                        source: e,
                    })
                }
                _ => {}
            }
            if p == &d {
                sync_dir(dir).map_err(|source| StoreError::Io {
                    volume,
                    what: "syncing the directory".into(),
                    source,
                })?;
            }
        }
        snapshot::Snapshots::remove_all(dir, volume)
    }

    /// Opens a volume, replaying its log (after a crash: every acknowledged write comes back).
    /// A clone is refused: it opens with [`VolumeStore::open_with`] and its base.
    pub fn open(dir: &Path, volume: u32, log_limit: u64) -> Result<VolumeStore, StoreError> {
        Self::open_with(dir, volume, log_limit, None)
    }

    /// Opens a volume; `base` must be what its `vol-N.base` names ([`read_base`]), open.
    pub fn open_with(dir: &Path, volume: u32, log_limit: u64, base: Option<Base>) -> Result<VolumeStore, StoreError> {
        let named = read_base(dir, volume)?;
        let given = base.as_ref().map(|b| (b.store.volume, b.snapshot));
        if named != given {
            return Err(StoreError::Invalid(
                format!("its base is {named:?} (volume, snapshot), opened with {given:?}"),
                volume,
            ));
        }
        if let Some(b) = &base {
            if b.store.snapshot_blocks(b.snapshot).is_none() {
                return Err(StoreError::Invalid(
                    format!(
                        "its base, volume {} snapshot {}, does not exist",
                        b.store.volume, b.snapshot
                    ),
                    volume,
                ));
            }
        }
        let (d, m, l) = paths(dir, volume);
        let err = |what: String| move |source| StoreError::Io { volume, what, source };
        let l2 = log2_path(dir, volume);
        let open = |p: &Path| {
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(p == l.as_path() || p == l2.as_path())
                .truncate(false)
                .open(p)
                .map_err(err(format!("opening {}", p.display())))
        };
        let had_logs = l.exists() && l2.exists();
        let (data, meta, log, log2) = (open(&d)?, open(&m)?, open(&l)?, open(&l2)?);
        if !had_logs {
            sync_dir(dir).map_err(err("syncing the directory".into()))?;
        }
        let size = data.metadata().map_err(err("stat".into()))?.len();
        if size % BLOCK as u64 != 0 {
            return Err(StoreError::Invalid(
                format!("data file of {size} bytes is not whole blocks"),
                volume,
            ));
        }
        let s = VolumeStore {
            volume,
            blocks: std::sync::atomic::AtomicU64::new(size / BLOCK as u64),
            dir: dir.to_path_buf(),
            data: std::sync::Arc::new(data),
            meta: std::sync::Arc::new(meta),
            log: Mutex::new(ActiveLog {
                file: log,
                generation: 0,
            }),
            spare: std::sync::Arc::new((
                Mutex::new(Spare {
                    file: Some(log2),
                    ..Spare::default()
                }),
                Condvar::new(),
            )),
            log_len: Mutex::new(0),
            log_limit: log_limit.max((REC_HDR + BLOCK) as u64),
            commit: Mutex::new(Commit {
                waiting: Vec::new(),
                waiting_last: 0,
                next_seq: 1,
                durable_seq: 0,
                committing: false,
                queued: Vec::new(),
                kicked: false,
            }),
            cv: Condvar::new(),
            stripes: (0..STRIPES).map(|_| RwLock::new(())).collect(),
            stats: Mutex::new(StoreStats::default()),
            snaps: RwLock::new(snapshot::Snapshots::open(dir, volume)?),
            base,
            fence: fence::Fence::load(dir, volume)?,
            sync_latency: std::sync::OnceLock::new(),
            poison: std::sync::Arc::new(Poison {
                volume,
                cause: std::sync::OnceLock::new(),
            }),
        };
        s.replay()?;
        Ok(s)
    }

    /// The volume's id.
    pub fn volume(&self) -> u32 {
        self.volume
    }

    /// Fences the volume at attachment epoch `epoch`, durably: the node refuses requests of
    /// a lower epoch from now on (a fence only rises; a lower `epoch` changes nothing).
    /// Returns the fence in effect. See `fence.rs`.
    pub fn fence(&self, epoch: u32) -> Result<u32, StoreError> {
        self.fence.raise(&self.dir, self.volume, epoch)
    }

    /// The lowest attachment epoch the node serves (0: not fenced).
    pub fn fenced_at(&self) -> u32 {
        self.fence.epoch()
    }

    /// The volume's size in blocks.
    pub fn blocks(&self) -> u64 {
        self.blocks.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Grows the volume to `blocks` blocks (the new blocks read as zeros). Shrinking is
    /// refused: it would destroy data a client may still address.
    pub fn grow(&self, blocks: u64) -> Result<(), StoreError> {
        let _c = self.commit.lock();
        let now = self.blocks();
        if blocks < now {
            return Err(StoreError::Invalid(
                format!("shrinking from {now} to {blocks} blocks is refused"),
                self.volume,
            ));
        }
        self.poison.check()?;
        // metadata first: a crash in between leaves a data file of the old size, which is
        // what the volume is opened with (the extra metadata is zeros: never written)
        self.grow_files(blocks)
    }

    /// [`VolumeStore::grow`]'s resizes and syncs (commits are held off). A resize the file
    /// system refuses (a size past its limit: `EFBIG`) is the request's error and changes
    /// nothing the volume uses (a metadata file longer than the data file is what a crash
    /// between the two leaves, and is opened at the data file's size); a failed sync may have
    /// dropped dirty pages of either file and poisons the store.
    fn grow_files(&self, blocks: u64) -> Result<(), StoreError> {
        let synced = |r: std::io::Result<()>, what: &'static str| {
            r.map_err(|e| {
                let e = self.io(what)(e);
                self.poison.set_err("growing the volume failed: ", &e);
                e
            })
        };
        self.meta
            .set_len(blocks * META)
            .map_err(self.io("growing the metadata file"))?;
        synced(self.meta.sync_all(), "syncing the metadata file")?;
        self.data
            .set_len(blocks * BLOCK as u64)
            .map_err(self.io("growing the data file"))?;
        synced(self.data.sync_all(), "syncing the data file")?;
        self.blocks.store(blocks, std::sync::atomic::Ordering::Release);
        Ok(())
    }

    /// The directory holding the volume's files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Records every later log sync's duration (the batch's write and its `fdatasync`: what
    /// a write waits for, beside the queue for its group) in `h`. The disk's latency spikes
    /// show there, as in etcd's `wal_fsync_duration`; a second call is ignored.
    pub fn observe_log_syncs(&self, h: metrics::Histogram) {
        let _ = self.sync_latency.set(h);
    }

    /// Why the store failed, if it did ([`StoreError::Poisoned`]): it then refuses every
    /// request until the node restarts (the node reports it in its volume list and metrics).
    pub fn poisoned(&self) -> Option<String> {
        self.poison.cause.get().map(|(c, _)| c.clone())
    }

    /// The store's counters so far.
    pub fn stats(&self) -> StoreStats {
        let mut s = *self.stats.lock();
        s.checkpoints += self.spare.0.lock().checkpoints;
        s
    }

    fn replay(&self) -> Result<(), StoreError> {
        let mut log = self.log.lock();
        let mut spare = self.spare.0.lock();
        let spare_file = spare
            .file
            .as_ref()
            .expect("no checkpoint runs before the store is open");
        let files = [&log.file, spare_file];
        // each log's generation and where its records start, from its header (an emptied
        // log, recycled and about `log_limit` long, is not read further). The records are
        // read a chunk at a time (`logread`), twice when the volume has snapshots
        let mut logs = Vec::new();
        for (i, f) in files.iter().enumerate() {
            let mut hdr = [0u8; LOG_HDR];
            let got = logread::read_full_at(f, &mut hdr, 0).map_err(self.io("reading the log"))?;
            let Some((generation, start)) = log_start(&hdr[..got]) else {
                continue;
            };
            logs.push((generation, start as u64, i));
        }
        // the older log's records first: a block written in both ends with the newer
        logs.sort_by_key(|&(g, ..)| g);
        // every record is newer than the newest snapshot (taking one empties the logs): what
        // they overwrite goes there first, a batch of records at a time
        if !self.snapshots().is_empty() {
            let blocks = self.blocks();
            let mut pending: Vec<std::ops::Range<u64>> = Vec::new();
            let flush = |pending: &mut Vec<std::ops::Range<u64>>| {
                self.preserve(pending.drain(..).flatten().filter(|&l| l < blocks))
            };
            for &(g, start, i) in &logs {
                logread::for_each_record(files[i], start, Check::Log(g), logread::CHUNK, self.volume, |r| {
                    pending.push(r.lbas());
                    if pending.len() >= PRESERVE_BATCH {
                        flush(&mut pending)?;
                    }
                    Ok(())
                })?;
            }
            flush(&mut pending)?;
        }
        let mut n = 0;
        for &(g, start, i) in &logs {
            n += logread::for_each_record(files[i], start, Check::Log(g), logread::CHUNK, self.volume, |r| {
                self.apply(r)
            })?;
        }
        // what follows the last whole record of a log was never acknowledged
        self.data.sync_data().map_err(self.io("syncing the data file"))?;
        self.meta.sync_data().map_err(self.io("syncing the metadata file"))?;
        let generation = logs.iter().map(|&(g, ..)| g).max().unwrap_or(0) + 1;
        // both logs start empty: no record of a generation before this format's (or of a
        // log replayed just now) is left to recycle
        let spare_file = spare.file.as_mut().expect("kept above");
        spare_file.set_len(0).map_err(self.io("truncating the log"))?;
        spare_file.sync_all().map_err(self.io("syncing the log"))?;
        log.file.set_len(0).map_err(self.io("truncating the log"))?;
        reset_log(&mut log.file, generation).map_err(self.io("starting the log"))?;
        log.file.sync_all().map_err(self.io("syncing the log"))?;
        log.generation = generation;
        self.stats.lock().replayed += n;
        if n > 0 {
            tracing::info!("volume {}: replayed {n} logged writes", self.volume);
        }
        Ok(())
    }

    /// Places a record into the data and metadata files (blocks past the end ignored: a
    /// replayed record of a volume whose growth did not survive).
    fn apply(&self, r: &Rec<'_>) -> Result<(), StoreError> {
        let blocks = self.blocks();
        match *r {
            Rec::Data {
                lba,
                version,
                crc,
                data,
            } if lba < blocks => self.place(lba, version, crc, data),
            Rec::Zero { lba, count, version } if lba < blocks => {
                self.place_zeroes(lba, (count as u64).min(blocks - lba), version)
            }
            _ => Ok(()),
        }
    }

    /// Zeroes `count` blocks from `lba`: their space is given back to the file system (a hole
    /// punched in the data file), their metadata says zeroed, with `version`.
    fn place_zeroes(&self, lba: u64, count: u64, version: u64) -> Result<(), StoreError> {
        let mut stripes: Vec<usize> = (lba..lba + count.min(STRIPES as u64))
            .map(|l| l as usize % STRIPES)
            .collect();
        stripes.sort_unstable();
        let _g: Vec<_> = stripes.iter().map(|&i| self.stripes[i].write()).collect();
        let mut cur = vec![0u8; (count * META) as usize];
        self.meta
            .read_exact_at(&mut cur, lba * META)
            .map_err(self.io(format!("reading blocks {lba}+{count}'s metadata")))?;
        let mut m = [0u8; META as usize];
        m[0..4].copy_from_slice(&zero_crc().to_le_bytes());
        m[4] = ZEROED;
        m[8..16].copy_from_slice(&version.to_le_bytes());
        // runs of the blocks no newer write reached (see `place`)
        let mut k = 0u64;
        while k < count {
            if entry_version(&cur, k) > version {
                k += 1;
                continue;
            }
            let start = k;
            while k < count && entry_version(&cur, k) <= version {
                k += 1;
            }
            let (at, n) = (lba + start, k - start);
            rustix::fs::fallocate(
                &*self.data,
                rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE,
                at * BLOCK as u64,
                n * BLOCK as u64,
            )
            .map_err(|e| self.io(format!("deallocating blocks {at}+{n}"))(e.into()))?;
            let buf: Vec<u8> = (0..n).flat_map(|_| m).collect();
            self.meta
                .write_all_at(&buf, at * META)
                .map_err(self.io(format!("writing blocks {at}+{n}'s metadata")))?;
        }
        Ok(())
    }

    /// Places a block unless the block holds a newer version already: the storage node's
    /// writer threads may make two writes to one block durable in either order (an agent with
    /// a majority quorum sends the next write to a block before a straggling replica has the
    /// previous one), and the newer must stay.
    fn place(&self, lba: u64, version: u64, crc: u32, data: &[u8]) -> Result<(), StoreError> {
        let _g = self.stripes[lba as usize % STRIPES].write();
        let mut cur = [0u8; META as usize];
        self.meta
            .read_exact_at(&mut cur, lba * META)
            .map_err(self.io(format!("reading block {lba}'s metadata")))?;
        if entry_version(&cur, 0) > version {
            self.stats.lock().superseded += 1;
            return Ok(());
        }
        self.data
            .write_all_at(data, lba * BLOCK as u64)
            .map_err(self.io(format!("writing block {lba}")))?;
        let mut m = [0u8; META as usize];
        m[0..4].copy_from_slice(&crc.to_le_bytes());
        m[4] = DATA;
        m[8..16].copy_from_slice(&version.to_le_bytes());
        self.meta
            .write_all_at(&m, lba * META)
            .map_err(self.io(format!("writing block {lba}'s metadata")))
    }

    fn check(&self, lba: u64) -> Result<(), StoreError> {
        if lba >= self.blocks() {
            return Err(StoreError::OutOfRange {
                volume: self.volume,
                lba,
                blocks: self.blocks(),
            });
        }
        Ok(())
    }

    /// Writes one block (`crc` is the sender's CRC32C of it, checked here) as `version`;
    /// returns once its log record is durable. Concurrent writers share log syncs.
    pub fn write(&self, lba: u64, data: &[u8], crc: u32, version: u64) -> Result<(), StoreError> {
        self.write_blocks(lba, &[(data, crc)], version)
    }

    /// Writes consecutive blocks from `lba` (each with the sender's CRC32C, checked here), all
    /// as `version`; returns once every record is durable (one wait for the group commit that
    /// covers them all). Nothing is written when a block is refused.
    pub fn write_blocks(&self, lba: u64, blocks: &[(&[u8], u32)], version: u64) -> Result<(), StoreError> {
        self.check_blocks(lba, blocks)?;
        if blocks.is_empty() {
            return Ok(());
        }
        self.commit_records(blocks.len() as u64, |out| {
            for (k, (data, crc)) in blocks.iter().enumerate() {
                encode_record(out, lba + k as u64, version, *crc, data);
            }
        })
    }

    /// [`VolumeStore::write_blocks`] without waiting: the records join the next group commit
    /// and `done` runs once they are durable, on the thread that leads that commit (or at
    /// once with the error when a block is refused). Returns true when no commit runs or
    /// was asked for: the caller must then have a thread call [`VolumeStore::lead_commits`].
    /// A storage node's data core queues its writes so, and no thread waits per write: one
    /// wake-up leads a group and its leader finishes every write in it.
    pub fn submit_blocks(&self, lba: u64, blocks: &[(&[u8], u32)], version: u64, done: Durable) -> bool {
        if let Err(e) = self.check_blocks(lba, blocks) {
            done(Err(e));
            return false;
        }
        if blocks.is_empty() {
            // nothing to make durable, as `write_blocks` answers it
            done(Ok(()));
            return false;
        }
        let mut c = self.commit.lock();
        // checked under the lock a failed commit's leader poisons the store under: a write
        // queued before it is failed by that leader, one after it here
        if let Err(e) = self.poison.check() {
            drop(c);
            done(Err(e));
            return false;
        }
        let seq = c.next_seq;
        c.next_seq += 1;
        for (k, (data, crc)) in blocks.iter().enumerate() {
            encode_record(&mut c.waiting, lba + k as u64, version, *crc, data);
        }
        c.waiting_last = seq;
        c.queued.push((seq, blocks.len() as u64, done));
        let kick = !c.committing && !c.kicked;
        c.kicked |= kick;
        kick
    }

    /// Commits what is queued until nothing is (see [`VolumeStore::submit_blocks`]); returns
    /// at once when another thread leads (it commits these too).
    pub fn lead_commits(&self) {
        let mut c = self.commit.lock();
        c.kicked = false;
        while !c.committing && !c.waiting.is_empty() {
            c = self.lead_one(c);
        }
    }

    /// Checks blocks to be written at `lba`: in the volume, whole, and with the CRC32C their
    /// sender gave.
    fn check_blocks(&self, lba: u64, blocks: &[(&[u8], u32)]) -> Result<(), StoreError> {
        for (k, (data, crc)) in blocks.iter().enumerate() {
            self.check(lba + k as u64)?;
            if data.len() != BLOCK {
                return Err(StoreError::Invalid(
                    format!("a block of {} bytes", data.len()),
                    self.volume,
                ));
            }
            let actual = crc32c::crc32c(data);
            if actual != *crc {
                return Err(StoreError::BadCrc {
                    volume: self.volume,
                    given: *crc,
                    actual,
                });
            }
        }
        Ok(())
    }

    /// Zeroes `count` blocks from `lba` as `version` (TRIM, WRITE_ZEROES): they read as zeros
    /// and their space is given back (a hole in the data file); returns once that is durable
    /// (one small log record).
    pub fn write_zeroes(&self, lba: u64, count: u64, version: u64) -> Result<(), StoreError> {
        if count == 0 {
            return Ok(());
        }
        self.check(lba)?;
        self.check(lba.saturating_add(count - 1))?;
        self.commit_records(count, |out| {
            let mut at = 0;
            while at < count {
                // bounded runs: placing one reads its metadata at once
                let k = (count - at).min(1 << 16);
                encode_zero_record(out, lba + at, k as u32, version);
                at += k;
            }
        })
    }

    /// Queues the records `encode` appends for the next group commit and waits until they
    /// are durable (leading that commit when none runs); `blocks` is what they cover.
    fn commit_records(&self, blocks: u64, encode: impl FnOnce(&mut Vec<u8>)) -> Result<(), StoreError> {
        self.poison.check()?;
        let mut c = self.commit.lock();
        let seq = c.next_seq;
        c.next_seq += 1;
        encode(&mut c.waiting);
        c.waiting_last = seq;
        loop {
            if c.durable_seq >= seq {
                self.stats.lock().writes += blocks;
                return Ok(());
            }
            // not durable, and nothing is made durable after a failure
            self.poison.check()?;
            if c.committing {
                self.cv.wait(&mut c);
                continue;
            }
            c = self.lead_one(c);
            // queued writes have no thread waiting: a leader leaves none behind
            while c.durable_seq >= seq && !c.committing && !c.queued.is_empty() {
                c = self.lead_one(c);
            }
        }
    }

    /// Leads one commit of everything waiting (the caller holds the lock and no commit
    /// runs), wakes the writers waiting on it and runs the queued writes' `done`s it covers.
    ///
    /// A failed commit poisons the store ([`StoreError::Poisoned`]): after a failed write or
    /// `fdatasync` the kernel may have dropped the log's dirty pages, so a later record
    /// appended after them would sit behind a hole that stops replay, and be lost at the next
    /// crash although acknowledged. So nothing is appended or acknowledged after it: every
    /// write not durable yet, waiting or queued, fails, and so does every later one.
    fn lead_one<'a>(&'a self, mut c: parking_lot::MutexGuard<'a, Commit>) -> parking_lot::MutexGuard<'a, Commit> {
        c.committing = true;
        let mut batch = std::mem::take(&mut c.waiting);
        let last = c.waiting_last;
        drop(c);
        let r = self.poison.check().and_then(|()| self.commit_batch(&mut batch));
        let mut c = self.commit.lock();
        c.committing = false;
        // a background checkpoint that failed meanwhile poisoned the store too: nothing more
        // is acknowledged
        let ok = match r.and_then(|()| self.poison.check()) {
            Ok(()) => {
                c.durable_seq = last;
                true
            }
            Err(e) => {
                self.poison.set_err("", &e);
                // the records of writers still waiting are never written: they see the poison
                c.waiting.clear();
                false
            }
        };
        self.cv.notify_all();
        let split = if ok {
            c.queued.partition_point(|q| q.0 <= last)
        } else {
            c.queued.len()
        };
        if split == 0 {
            return c;
        }
        let done: Vec<_> = c.queued.drain(..split).collect();
        drop(c);
        if ok {
            self.stats.lock().writes += done.iter().map(|q| q.1).sum::<u64>();
        }
        for (_, _, d) in done {
            d(if ok { Ok(()) } else { self.poison.check() });
        }
        self.commit.lock()
    }

    fn commit_batch(&self, batch: &mut [u8]) -> Result<(), StoreError> {
        {
            let mut log = self.log.lock();
            stamp_generation(batch, log.generation);
            let t = std::time::Instant::now();
            log.file.write_all(batch).map_err(self.io("appending to the log"))?;
            log.file.sync_data().map_err(self.io("syncing the log"))?;
            if let Some(h) = self.sync_latency.get() {
                h.record(t.elapsed());
            }
        }
        self.stats.lock().syncs += 1;
        self.preserve(records(batch, Check::Encoded).flat_map(|r| r.lbas()))?;
        for r in records(batch, Check::Encoded) {
            self.apply(&r)?;
        }
        let mut len = self.log_len.lock();
        *len += batch.len() as u64;
        if *len >= self.log_limit {
            self.switch_logs(*len)?;
            *len = 0;
        }
        Ok(())
    }

    /// The spare log file, once its background checkpoint is done (waits for it).
    fn take_spare(&self) -> Result<File, StoreError> {
        let (m, cv) = &*self.spare;
        let mut sp = m.lock();
        loop {
            if let Some(e) = &sp.failed {
                return Err(StoreError::Checkpoint {
                    volume: self.volume,
                    what: e.clone(),
                });
            }
            if let Some(f) = sp.file.take() {
                return Ok(f);
            }
            cv.wait(&mut sp);
        }
    }

    /// Moves commits to the spare log (every record of the active one is placed: the commit
    /// leader calls this after placing its batch) and checkpoints the full one in the
    /// background. `placed` is about how many bytes its records placed.
    fn switch_logs(&self, placed: u64) -> Result<(), StoreError> {
        let mut next = self.take_spare()?;
        let mut log = self.log.lock();
        let generation = log.generation + 1;
        if let Err(e) = reset_log(&mut next, generation) {
            self.spare.0.lock().file = Some(next);
            return Err(self.io("starting the next log")(e));
        }
        let full = std::mem::replace(&mut log.file, next);
        log.generation = generation;
        drop(log);
        let (data, meta, spare, volume) = (self.data.clone(), self.meta.clone(), self.spare.clone(), self.volume);
        let poison = self.poison.clone();
        let run = move || {
            // the files first: only then may the records leave the log. It is emptied by its
            // header (the file is recycled: see the module's doc). Their dirty pages go to
            // the device a range at a time first, so the log's syncs meanwhile do not queue
            // behind all of them (see `writeback`); the syncs alone make them durable
            for f in [&data, &meta] {
                if let Err(e) = writeback::write_back(f, placed) {
                    tracing::warn!("volume {volume}: checkpoint: writing back in ranges: {e}");
                }
            }
            let r = data
                .sync_data()
                .and_then(|()| meta.sync_data())
                .and_then(|()| full.write_all_at(&[0u8; LOG_HDR], 0))
                .and_then(|()| full.sync_data());
            let (m, cv) = &*spare;
            let mut sp = m.lock();
            match r {
                Ok(()) => sp.checkpoints += 1,
                Err(e) => {
                    // the files' dirty pages may be gone: nothing more is served
                    poison.set_as(format!("a background checkpoint failed: {e}"), io_no_space(&e));
                    sp.failed = Some(e.to_string());
                }
            }
            sp.file = Some(full);
            cv.notify_all();
        };
        if let Err(e) = std::thread::Builder::new()
            .name(format!("ckpt-vol{}", self.volume))
            .spawn(run)
        {
            return Err(self.io("starting a checkpoint thread")(e));
        }
        Ok(())
    }

    /// Reads a block with its stored CRC and version, checked: a block that does not match its
    /// CRC is [`StoreError::Corrupt`]. A block never written is zeros, version 0.
    pub fn read(&self, lba: u64) -> Result<(Vec<u8>, u32, u64), StoreError> {
        self.poison.check()?;
        self.check(lba)?;
        let _g = self.stripes[lba as usize % STRIPES].read();
        let mut m = [0u8; META as usize];
        self.meta
            .read_exact_at(&mut m, lba * META)
            .map_err(self.io(format!("reading block {lba}'s metadata")))?;
        let mut data = vec![0u8; BLOCK];
        self.data
            .read_exact_at(&mut data, lba * BLOCK as u64)
            .map_err(self.io(format!("reading block {lba}")))?;
        self.stats.lock().reads += 1;
        let actual = crc32c::crc32c(&data);
        if m[4] == UNWRITTEN {
            // never written: zeros (anything else there is damage), or a clone's base
            if data.iter().any(|&b| b != 0) {
                self.stats.lock().corrupt_reads += 1;
                return Err(StoreError::Corrupt {
                    volume: self.volume,
                    lba,
                    stored: crc32c::crc32c(&[0u8; BLOCK]),
                    actual,
                });
            }
            drop(_g);
            if let Some(b) = &self.base {
                let data = b.store.read_snapshot(b.snapshot, lba)?;
                let crc = crc32c::crc32c(&data);
                return Ok((data, crc, 0));
            }
            return Ok((data, actual, 0));
        }
        let stored = u32::from_le_bytes(m[0..4].try_into().expect("4 bytes"));
        let version = u64::from_le_bytes(m[8..16].try_into().expect("8 bytes"));
        if stored != actual {
            self.stats.lock().corrupt_reads += 1;
            return Err(StoreError::Corrupt {
                volume: self.volume,
                lba,
                stored,
                actual,
            });
        }
        Ok((data, stored, version))
    }

    /// The allocation state of `count` blocks from `lba` ([`ALLOC_DATA`] or [`ALLOC_HOLE`]):
    /// blocks never written or zeroed are holes; a clone's unwritten blocks are as its base
    /// snapshot has them.
    pub fn allocation(&self, lba: u64, count: u64) -> Result<Vec<u8>, StoreError> {
        self.poison.check()?;
        if count == 0 {
            return Ok(Vec::new());
        }
        self.check(lba)?;
        let count = count.min(self.blocks() - lba);
        let mut m = vec![0u8; (count * META) as usize];
        self.meta
            .read_exact_at(&mut m, lba * META)
            .map_err(self.io("reading the metadata"))?;
        m.chunks_exact(META as usize)
            .enumerate()
            .map(|(k, e)| match (e[4], &self.base) {
                (DATA, _) => Ok(ALLOC_DATA),
                (UNWRITTEN, Some(b)) => b.store.snapshot_allocation(b.snapshot, lba + k as u64),
                _ => Ok(ALLOC_HOLE),
            })
            .collect()
    }

    /// Whether block `lba` is the same in snapshots `id` and `since` (the same write, or
    /// unwritten or zeroed alike in both); `None` when either snapshot does not exist. A block
    /// past either snapshot's end is not the same.
    pub fn snapshot_unchanged(&self, id: u32, since: u32, lba: u64) -> Result<Option<bool>, StoreError> {
        self.poison.check()?;
        self.snaps.read().unchanged(id, since, lba)
    }

    /// Whether block `lba` of snapshot `id` of this clone reads through to the clone's base
    /// (the clone had never written it by the snapshot); false for a volume that is no clone.
    pub fn snapshot_reads_base(&self, id: u32, lba: u64) -> Result<bool, StoreError> {
        self.poison.check()?;
        Ok(self.base.is_some() && self.snaps.read().state(id, lba)? == Some(UNWRITTEN))
    }

    /// The allocation state of block `lba` in snapshot `id` ([`ALLOC_DATA`] or
    /// [`ALLOC_HOLE`]).
    pub fn snapshot_allocation(&self, id: u32, lba: u64) -> Result<u8, StoreError> {
        self.poison.check()?;
        let state = self.snaps.read().state(id, lba)?;
        match (state, &self.base) {
            (Some(DATA), _) => Ok(ALLOC_DATA),
            (Some(UNWRITTEN), Some(b)) => b.store.snapshot_allocation(b.snapshot, lba),
            _ => Ok(ALLOC_HOLE),
        }
    }

    /// The versions of `count` blocks from `lba` (0: never written), as stored: replicas of a
    /// volume are written with the same versions, so comparing them finds the newest copy.
    pub fn block_versions(&self, lba: u64, count: u64) -> Result<Vec<u64>, StoreError> {
        let m = self.meta_range(lba, count)?;
        Ok(m.chunks_exact(META as usize)
            .map(|e| u64::from_le_bytes(e[8..16].try_into().expect("8 bytes")))
            .collect())
    }

    /// A digest of each of `count` regions of `region_blocks` blocks from region `first`: of
    /// every block's written flag and version. Two replicas whose digests of a region are
    /// equal hold the same writes there. Also the highest version in them.
    pub fn region_digests(&self, first: u64, count: u64, region_blocks: u64) -> Result<(Vec<u64>, u64), StoreError> {
        let region_blocks = region_blocks.max(1);
        let lba = first.saturating_mul(region_blocks);
        let m = self.meta_range(lba, count.saturating_mul(region_blocks))?;
        let mut highest = 0;
        let digests = m
            .chunks(META as usize * region_blocks as usize)
            .map(|r| {
                let mut crc = 0u32;
                let mut max = 0u64;
                for e in r.chunks_exact(META as usize) {
                    crc = crc32c::crc32c_append(crc, &e[4..5]);
                    crc = crc32c::crc32c_append(crc, &e[8..16]);
                    max = max.max(u64::from_le_bytes(e[8..16].try_into().expect("8 bytes")));
                }
                highest = highest.max(max);
                (crc as u64) << 32 ^ max
            })
            .collect();
        Ok((digests, highest))
    }

    /// The metadata entries of up to `count` blocks from `lba` (clamped to the volume).
    fn meta_range(&self, lba: u64, count: u64) -> Result<Vec<u8>, StoreError> {
        self.poison.check()?;
        self.check(lba)?;
        let count = count.min(self.blocks() - lba);
        let mut m = vec![0u8; (count * META) as usize];
        self.meta
            .read_exact_at(&mut m, lba * META)
            .map_err(self.io("reading the metadata"))?;
        Ok(m)
    }

    /// `(lba, version)` of every written block (to seed the Solar server's stale-write check).
    pub fn versions(&self) -> Result<Vec<(u64, u64)>, StoreError> {
        self.poison.check()?;
        let mut out = Vec::new();
        let mut m = vec![0u8; (self.blocks() * META) as usize];
        self.meta
            .read_exact_at(&mut m, 0)
            .map_err(self.io("reading the metadata"))?;
        for (lba, e) in m.chunks_exact(META as usize).enumerate() {
            if e[4] != UNWRITTEN {
                out.push((lba as u64, u64::from_le_bytes(e[8..16].try_into().expect("8 bytes"))));
            }
        }
        Ok(out)
    }

    /// Makes everything written durable in the files and empties the logs (NBD FLUSH is
    /// free: every acknowledged write already is durable; this bounds replay time). Waits for
    /// running commits and a background checkpoint; commits wait for it.
    pub fn checkpoint(&self) -> Result<(), StoreError> {
        self.exclusive(|| self.checkpoint_held())
    }

    /// Runs `f` with commits held off (running ones finished, new ones waiting).
    fn exclusive<T>(&self, f: impl FnOnce() -> Result<T, StoreError>) -> Result<T, StoreError> {
        let mut c = self.commit.lock();
        while c.committing {
            self.cv.wait(&mut c);
        }
        c.committing = true;
        drop(c);
        let r = f();
        self.commit.lock().committing = false;
        self.cv.notify_all();
        r
    }

    /// [`VolumeStore::checkpoint`]'s work; commits are held off.
    fn checkpoint_held(&self) -> Result<(), StoreError> {
        self.poison.check()?;
        let r = self.checkpoint_files();
        if let Err(e) = &r {
            self.poison.set_err("a checkpoint failed: ", e);
        }
        r
    }

    /// [`VolumeStore::checkpoint_held`]'s syncs and log reset.
    fn checkpoint_files(&self) -> Result<(), StoreError> {
        {
            let spare = self.take_spare()?;
            self.spare.0.lock().file = Some(spare);
            self.data.sync_data().map_err(self.io("syncing the data file"))?;
            self.meta.sync_data().map_err(self.io("syncing the metadata file"))?;
            let mut log = self.log.lock();
            // the next generation: the records left after the header are not replayed
            let generation = log.generation + 1;
            reset_log(&mut log.file, generation).map_err(self.io("emptying the log"))?;
            log.file.sync_data().map_err(self.io("syncing the log"))?;
            log.generation = generation;
            *self.log_len.lock() = 0;
            self.spare.0.lock().checkpoints += 1;
            Ok(())
        }
    }

    /// Copies into the newest snapshot the blocks of `lbas` it still shares with the volume,
    /// synced, before new contents are placed over them.
    fn preserve(&self, lbas: impl Iterator<Item = u64>) -> Result<(), StoreError> {
        let snaps = self.snaps.read();
        snaps.preserve(lbas, |lba, buf| {
            self.data
                .read_exact_at(buf, lba * BLOCK as u64)
                .map_err(self.io(format!("reading block {lba} for a snapshot")))
        })
    }

    /// Takes snapshot `id` (a number the caller chooses, unique in this volume): a
    /// point-in-time image of every write acknowledged before this call; writes wait while it
    /// is taken (a checkpoint and a copy of the metadata, 16 bytes per block).
    pub fn snapshot(&self, id: u32) -> Result<(), StoreError> {
        self.exclusive(|| {
            if self.snaps.read().ids().contains(&id) {
                return Err(StoreError::Invalid(format!("snapshot {id} exists"), self.volume));
            }
            self.checkpoint_held()?;
            self.snaps.write().create(id, &self.meta, self.blocks())
        })
    }

    /// Deletes snapshot `id`; the blocks only it kept for an older snapshot move there first.
    pub fn delete_snapshot(&self, id: u32) -> Result<(), StoreError> {
        self.poison.check()?;
        self.exclusive(|| self.snaps.write().delete(id))
    }

    /// The snapshots' ids, oldest first.
    pub fn snapshots(&self) -> Vec<u32> {
        self.snaps.read().ids()
    }

    /// The size of snapshot `id` in blocks, if it exists.
    pub fn snapshot_blocks(&self, id: u32) -> Option<u64> {
        self.snaps.read().list.iter().find(|s| s.id == id).map(|s| s.blocks)
    }

    /// The `(volume, snapshot)` this clone reads through to, if it is a clone.
    pub fn base(&self) -> Option<(u32, u32)> {
        self.base.as_ref().map(|b| (b.store.volume, b.snapshot))
    }

    /// Block `lba` as it was when snapshot `id` was taken, checked against the CRC it had then.
    pub fn read_snapshot(&self, id: u32, lba: u64) -> Result<Vec<u8>, StoreError> {
        self.poison.check()?;
        let snaps = self.snaps.read();
        let _g = self.stripes[lba as usize % STRIPES].read();
        let src = snaps
            .locate(id, lba)?
            .ok_or_else(|| StoreError::Invalid(format!("no snapshot {id}"), self.volume))?;
        let (data, crc) = match src {
            snapshot::Source::Unwritten => {
                drop(_g);
                drop(snaps);
                return match &self.base {
                    Some(b) if lba < b.store.snapshot_blocks(b.snapshot).unwrap_or(0) => {
                        b.store.read_snapshot(b.snapshot, lba)
                    }
                    _ => Ok(vec![0u8; BLOCK]),
                };
            }
            snapshot::Source::Zeroed => return Ok(vec![0u8; BLOCK]),
            snapshot::Source::Kept { data, crc } => (data, crc),
            snapshot::Source::Volume { crc } => {
                let mut data = vec![0u8; BLOCK];
                self.data
                    .read_exact_at(&mut data, lba * BLOCK as u64)
                    .map_err(self.io(format!("reading block {lba}")))?;
                (data, crc)
            }
        };
        let actual = crc32c::crc32c(&data);
        if actual != crc {
            self.stats.lock().corrupt_reads += 1;
            return Err(StoreError::Corrupt {
                volume: self.volume,
                lba,
                stored: crc,
                actual,
            });
        }
        Ok(data)
    }
}

/// A new, empty file for a test to read and write, in the temp directory (named by `tag` and
/// the process); the test removes it.
#[cfg(test)]
fn scratch_file(tag: &str) -> (PathBuf, File) {
    let path = std::env::temp_dir().join(format!("blockstore-{tag}-{}", std::process::id()));
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    (path, f)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("blockstore-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn block(seed: u8) -> Vec<u8> {
        (0..BLOCK).map(|i| (i as u8).wrapping_mul(seed) ^ seed).collect()
    }

    /// A resize the file system refuses (an ext4 file ends at 16 TiB: `EFBIG`) is the
    /// request's error: the store is not poisoned and serves on at its old size.
    #[test]
    fn a_resize_the_file_system_refuses_does_not_poison_the_store() {
        let d = dir("efbig");
        let s = VolumeStore::create(&d, 1, 64, 1 << 20).unwrap();
        match s.grow(1 << 40) {
            Err(e) => {
                assert!(matches!(e, StoreError::Io { .. }), "{e}");
                assert_eq!(s.blocks(), 64);
            }
            Ok(()) => eprintln!("this file system takes 4 PiB files: no resize was refused here"),
        }
        let b = block(3);
        s.write(5, &b, crc32c::crc32c(&b), 1).unwrap();
        assert_eq!(s.read(5).unwrap().0, b);
        drop(s);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn blocks_round_trip_and_corruption_is_reported() {
        let d = dir("rt");
        let s = VolumeStore::create(&d, 1, 64, 1 << 20).unwrap();
        let b = block(7);
        s.write(3, &b, crc32c::crc32c(&b), 42).unwrap();
        let (got, crc, v) = s.read(3).unwrap();
        assert_eq!((got == b, crc, v), (true, crc32c::crc32c(&b), 42));
        assert_eq!(s.read(4).unwrap().0, vec![0u8; BLOCK], "never written: zeros");
        assert!(matches!(s.write(64, &b, 0, 1), Err(StoreError::OutOfRange { .. })));
        assert!(matches!(s.write(5, &b, 1, 1), Err(StoreError::BadCrc { .. })));
        assert_eq!(s.versions().unwrap(), vec![(3, 42)]);
        // flip a bit of the block on disk: the read reports it instead of returning it
        s.checkpoint().unwrap();
        let f = OpenOptions::new().write(true).open(d.join("vol-1.data")).unwrap();
        f.write_all_at(&[b[100] ^ 4], 3 * BLOCK as u64 + 100).unwrap();
        let e = s.read(3).unwrap_err().to_string();
        assert!(e.contains("block 3 is corrupt"), "{e}");
        f.write_all_at(&[1], 9 * BLOCK as u64).unwrap();
        assert!(matches!(s.read(9), Err(StoreError::Corrupt { .. })));
        assert_eq!(s.stats().corrupt_reads, 2);
        drop(s);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn zeroed_blocks_read_as_zeros_give_their_space_back_and_survive_a_crash() {
        use std::os::unix::fs::MetadataExt;
        let d = dir("zero");
        let s = VolumeStore::create(&d, 6, 1024, 1 << 30).unwrap();
        for lba in 0..512u64 {
            let b = block(lba as u8 | 1);
            s.write(lba, &b, crc32c::crc32c(&b), 1).unwrap();
        }
        s.checkpoint().unwrap();
        let used = |d: &Path| std::fs::metadata(d.join("vol-6.data")).unwrap().blocks() * 512;
        let full = used(&d);
        assert!(full >= 512 * BLOCK as u64, "{full} bytes allocated");
        s.snapshot(1).unwrap();
        s.write_zeroes(100, 300, 2).unwrap();
        assert!(s.write_zeroes(1000, 30, 2).is_err(), "past the end is refused");
        assert_eq!(s.read(100).unwrap(), (vec![0u8; BLOCK], zero_crc(), 2));
        assert_eq!(s.read(399).unwrap().0, vec![0u8; BLOCK]);
        assert_eq!(s.read(400).unwrap().0, block(400u64 as u8 | 1));
        let map = s.allocation(98, 304).unwrap();
        assert_eq!(&map[..2], &[ALLOC_DATA; 2]);
        assert!(map[2..302].iter().all(|&a| a == ALLOC_HOLE));
        assert_eq!(&map[302..], &[ALLOC_DATA; 2]);
        assert_eq!(s.allocation(600, 10).unwrap(), vec![ALLOC_HOLE; 10], "never written");
        // the snapshot kept the zeroed blocks' old contents
        assert_eq!(s.read_snapshot(1, 250).unwrap(), block(250u64 as u8 | 1));
        s.delete_snapshot(1).unwrap();
        s.checkpoint().unwrap();
        assert!(
            used(&d) <= full - 250 * BLOCK as u64,
            "{} bytes allocated after zeroing 300 blocks (were {full})",
            used(&d)
        );
        // a zero record in the log replays (the data file still holds the old block)
        s.write_zeroes(450, 2, 3).unwrap();
        drop(s);
        let f = OpenOptions::new().write(true).open(d.join("vol-6.data")).unwrap();
        f.write_all_at(&block(9), 450 * BLOCK as u64).unwrap();
        let s = VolumeStore::open(&d, 6, 1 << 30).unwrap();
        assert_eq!(s.stats().replayed, 1);
        assert_eq!(s.read(450).unwrap(), (vec![0u8; BLOCK], zero_crc(), 3));
        assert_eq!(s.read(452).unwrap().0, block(452u64 as u8 | 1));
        assert!(
            s.versions().unwrap().contains(&(450, 3)),
            "a zeroed block keeps its version"
        );
        drop(s);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn an_older_write_made_durable_after_a_newer_one_never_replaces_it() {
        let d = dir("order");
        let s = VolumeStore::create(&d, 8, 64, 1 << 30).unwrap();
        let (old, new) = (block(1), block(2));
        s.write(5, &new, crc32c::crc32c(&new), 20).unwrap();
        s.write(5, &old, crc32c::crc32c(&old), 10).unwrap();
        assert_eq!(s.read(5).unwrap(), (new.clone(), crc32c::crc32c(&new), 20));
        // a zero run older than one of its blocks skips that block
        s.write_zeroes(3, 4, 15).unwrap();
        assert_eq!(s.read(5).unwrap().2, 20);
        assert_eq!(s.read(4).unwrap(), (vec![0u8; BLOCK], zero_crc(), 15));
        assert_eq!(s.stats().superseded, 1);
        drop(s);
        // and the replay of the log in its order ends the same
        let s = VolumeStore::open(&d, 8, 1 << 30).unwrap();
        assert_eq!(s.read(5).unwrap().2, 20);
        assert_eq!(s.read(6).unwrap().2, 15);
        drop(s);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn volumes_grow_and_refuse_to_shrink() {
        let d = dir("grow");
        let s = VolumeStore::create(&d, 3, 8, 1 << 20).unwrap();
        let b = block(3);
        s.write(7, &b, crc32c::crc32c(&b), 5).unwrap();
        assert!(matches!(
            s.write(8, &b, crc32c::crc32c(&b), 6),
            Err(StoreError::OutOfRange { .. })
        ));
        s.grow(16).unwrap();
        assert_eq!(s.blocks(), 16);
        s.write(15, &b, crc32c::crc32c(&b), 6).unwrap();
        assert_eq!(s.read(12).unwrap().0, vec![0u8; BLOCK]);
        assert!(matches!(s.grow(4), Err(StoreError::Invalid(..))));
        drop(s);
        let s = VolumeStore::open(&d, 3, 1 << 20).unwrap();
        assert_eq!(s.blocks(), 16);
        assert_eq!(s.read(7).unwrap().0, b);
        assert_eq!(s.read(15).unwrap().0, b);
        drop(s);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn queued_writes_are_answered_by_their_groups_leader_beside_waiting_writers() {
        let d = dir("queued");
        let s = std::sync::Arc::new(VolumeStore::create(&d, 2, 4096, 64 << 20).unwrap());
        let (tx, rx) = std::sync::mpsc::channel::<Result<u64, String>>();
        // a leader thread per kick, as the storage node's writer pool gives one
        let (lead_tx, lead_rx) = std::sync::mpsc::channel::<()>();
        let leader = {
            let s = s.clone();
            std::thread::spawn(move || {
                while lead_rx.recv().is_ok() {
                    s.lead_commits();
                }
            })
        };
        // synchronous writers at the same time: they lead commits too, and must leave no
        // queued write without a leader
        let waiting: Vec<_> = (0..2u64)
            .map(|t| {
                let s = s.clone();
                std::thread::spawn(move || {
                    for i in 0..50u64 {
                        let b = block(200 + t as u8);
                        s.write(3000 + t * 100 + i, &b, crc32c::crc32c(&b), 1).unwrap();
                    }
                })
            })
            .collect();
        for i in 0..400u64 {
            let b = block(i as u8);
            let tx = tx.clone();
            let kick = s.submit_blocks(
                i,
                &[(&b, crc32c::crc32c(&b))],
                i + 1,
                Box::new(move |r| {
                    let _ = tx.send(r.map(|()| i).map_err(|e| e.to_string()));
                }),
            );
            if kick {
                lead_tx.send(()).unwrap();
            }
        }
        // a refused block is answered at once, and nothing of it is queued
        let bad = block(9);
        let tx2 = tx.clone();
        assert!(!s.submit_blocks(
            5,
            &[(&bad, 0)],
            1,
            Box::new(move |r| {
                let _ = tx2.send(Err(format!("{:?}", r.err())));
            })
        ));
        drop(tx);
        let mut ok = 0;
        let mut refused = 0;
        for r in rx.iter().take(401) {
            match r {
                Ok(_) => ok += 1,
                Err(e) => {
                    assert!(e.contains("BadCrc"), "{e}");
                    refused += 1;
                }
            }
        }
        assert_eq!((ok, refused), (400, 1));
        for t in waiting {
            t.join().unwrap();
        }
        drop(lead_tx);
        leader.join().unwrap();
        let st = s.stats();
        assert_eq!(st.writes, 500);
        assert!(st.syncs < 400, "group commit: {} syncs for 500 writes", st.syncs);
        for i in 0..400u64 {
            assert_eq!(s.read(i).unwrap().0, block(i as u8), "block {i}");
        }
        drop(s);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn concurrent_writers_share_syncs() {
        let d = dir("group");
        let s = std::sync::Arc::new(VolumeStore::create(&d, 2, 4096, 64 << 20).unwrap());
        let threads: Vec<_> = (0..8u64)
            .map(|t| {
                let s = s.clone();
                std::thread::spawn(move || {
                    for i in 0..100u64 {
                        let b = block((t * 100 + i) as u8);
                        s.write(t * 512 + i, &b, crc32c::crc32c(&b), i + 1).unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let st = s.stats();
        assert_eq!(st.writes, 800);
        assert!(st.syncs < 800, "group commit: {} syncs for 800 writes", st.syncs);
        for t in 0..8u64 {
            for i in 0..100u64 {
                assert_eq!(s.read(t * 512 + i).unwrap().0, block((t * 100 + i) as u8));
            }
        }
        drop(s);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn logs_switch_under_concurrent_writers_and_everything_replays() {
        let d = dir("switch");
        // a log of 4 records: a switch every few commits, checkpoints in the background
        let limit = 4 * (REC_HDR + BLOCK) as u64;
        let s = std::sync::Arc::new(VolumeStore::create(&d, 4, 1024, limit).unwrap());
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let s = s.clone();
                std::thread::spawn(move || {
                    for i in 0..200u64 {
                        let lba = t * 256 + i % 64;
                        let b = block((t * 7 + i) as u8);
                        s.write(lba, &b, crc32c::crc32c(&b), 1 + i).unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert!(s.stats().checkpoints > 10, "{:?}", s.stats());
        drop(s); // no final checkpoint: the tail lives in the logs
        let s = VolumeStore::open(&d, 4, limit).unwrap();
        for t in 0..4u64 {
            for i in 136..200u64 {
                let lba = t * 256 + i % 64;
                let (got, _, v) = s.read(lba).unwrap();
                assert!(got == block((t * 7 + i) as u8), "block {lba}");
                assert_eq!(v, 1 + i);
            }
        }
        drop(s);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn replay_takes_the_older_log_first() {
        let d = dir("order");
        drop(VolumeStore::create(&d, 5, 16, 1 << 30).unwrap());
        // a crash during a background checkpoint: both logs hold records of block 2, the older
        // generation in the second file
        let rec = |seed: u8, version: u64, generation: u64| {
            let mut r = Vec::new();
            encode_record(&mut r, 2, version, crc32c::crc32c(&block(seed)), &block(seed));
            stamp_generation(&mut r, generation);
            r
        };
        let mut newer = log_header(8).to_vec();
        newer.extend(rec(2, 20, 8));
        let mut older = log_header(7).to_vec();
        older.extend(rec(1, 10, 7));
        std::fs::write(d.join("vol-5.log"), &newer).unwrap();
        std::fs::write(d.join("vol-5.log2"), &older).unwrap();
        let s = VolumeStore::open(&d, 5, 1 << 30).unwrap();
        let (got, _, v) = s.read(2).unwrap();
        assert!(got == block(2) && v == 20, "the newer generation's write wins");
        assert_eq!(s.stats().replayed, 2);
        drop(s);
        // and the old single-log format (records from byte 0, no generations) still replays
        let mut old = rec(3, 30, 0);
        old[0..4].copy_from_slice(&REC_MAGIC.to_le_bytes());
        let rc = crc32c::crc32c_append(crc32c::crc32c(&old[..24]), &old[REC_HDR..]);
        old[24..28].copy_from_slice(&rc.to_le_bytes());
        std::fs::write(d.join("vol-5.log"), old).unwrap();
        std::fs::write(d.join("vol-5.log2"), b"").unwrap();
        let s = VolumeStore::open(&d, 5, 1 << 30).unwrap();
        assert_eq!(s.read(2).unwrap().2, 30);
        drop(s);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn replay_stops_where_a_failed_sync_left_an_older_generations_records() {
        let d = dir("fsyncgate");
        drop(VolumeStore::create(&d, 7, 16, 1 << 30).unwrap());
        let rec = |lba: u64, version: u64, generation: u64| {
            let mut r = Vec::new();
            encode_record(
                &mut r,
                lba,
                version,
                crc32c::crc32c(&block(lba as u8)),
                &block(lba as u8),
            );
            stamp_generation(&mut r, generation);
            r
        };
        // generation 9's log, recycled: its records 1 and 2 were synced; the sync of record 3
        // failed and the kernel dropped its page, so the file holds what the disk had there,
        // a record of generation 7 (valid, and of a newer version than anything synced); a
        // store that went on after the failure appended record 4 behind it, and acknowledged
        // it, but replay cannot reach it
        let mut log = log_header(9).to_vec();
        log.extend(rec(1, 10, 9));
        log.extend(rec(2, 11, 9));
        log.extend(rec(3, 50, 7));
        log.extend(rec(4, 13, 9));
        std::fs::write(d.join("vol-7.log"), &log).unwrap();
        std::fs::write(d.join("vol-7.log2"), b"").unwrap();
        let s = VolumeStore::open(&d, 7, 1 << 30).unwrap();
        assert_eq!(s.stats().replayed, 2, "only the records before the dropped page");
        assert_eq!(s.read(1).unwrap(), (block(1), crc32c::crc32c(&block(1)), 10));
        assert_eq!(s.read(2).unwrap().2, 11);
        assert_eq!(s.read(3).unwrap().2, 0, "the older generation's record is not replayed");
        assert_eq!(s.read(4).unwrap().2, 0, "nor anything after it");
        drop(s);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_recycled_log_replays_only_its_own_generations_records() {
        let d = dir("recycle");
        // a log of 4 records: single writes switch logs every 4 commits
        let limit = 4 * (REC_HDR + BLOCK) as u64;
        let s = VolumeStore::create(&d, 6, 64, limit).unwrap();
        let put = |s: &VolumeStore, i: u64| {
            let b = block(i as u8);
            s.write(i % 8, &b, crc32c::crc32c(&b), 1 + i).unwrap();
        };
        for i in 0..30 {
            put(&s, i);
        }
        s.write_zeroes(3, 1, 31).unwrap();
        // everything placed and synced; the logs are emptied by their headers alone
        s.checkpoint().unwrap();
        for f in ["vol-6.log", "vol-6.log2"] {
            let len = std::fs::metadata(d.join(f)).unwrap().len();
            assert!(len >= limit, "{f} is recycled, not truncated: {len} bytes");
        }
        for i in 40..43 {
            put(&s, i);
        }
        drop(s);
        // the active log holds 3 records of its generation, then older ones (a zero record
        // among them); the spare log's records are all older
        let s = VolumeStore::open(&d, 6, limit).unwrap();
        assert_eq!(s.stats().replayed, 3, "only the records written after the checkpoint");
        // each block's last write (data, version): 40-42, the zeroing, or the last of 0..30
        let last = |i: u64| (block(i as u8), 1 + i);
        for lba in 0..8u64 {
            let want = match lba {
                0..=2 => last(40 + lba),
                3 => (vec![0u8; BLOCK], 31),
                4 | 5 => last(24 + lba),
                _ => last(16 + lba),
            };
            let (got, _, v) = s.read(lba).unwrap();
            assert!((got, v) == want, "block {lba}: version {v}, want {}", want.1);
        }
        drop(s);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn replay_restores_acknowledged_writes_and_drops_a_torn_tail() {
        let d = dir("replay");
        let s = VolumeStore::create(&d, 3, 128, 1 << 30).unwrap();
        for i in 0..50u64 {
            let b = block(i as u8 + 1);
            s.write(i, &b, crc32c::crc32c(&b), 100 + i).unwrap();
        }
        drop(s); // no checkpoint: the blocks live in the log (and unsynced files)
                 // the crash tore the data file (pages never written back) and left half a record
        let f = OpenOptions::new().write(true).open(d.join("vol-3.data")).unwrap();
        f.write_all_at(&vec![0xEEu8; 10 * BLOCK], 0).unwrap();
        let mut log = OpenOptions::new().append(true).open(d.join("vol-3.log")).unwrap();
        let mut torn = Vec::new();
        encode_record(&mut torn, 60, 999, crc32c::crc32c(&block(9)), &block(9));
        log.write_all(&torn[..1000]).unwrap();
        let s = VolumeStore::open(&d, 3, 1 << 30).unwrap();
        assert_eq!(s.stats().replayed, 50);
        for i in 0..50u64 {
            let (got, _, v) = s.read(i).unwrap();
            assert!(got == block(i as u8 + 1), "block {i}");
            assert_eq!(v, 100 + i);
        }
        assert_eq!(s.read(60).unwrap().2, 0, "the torn record was never acknowledged");
        drop(s);
        let _ = std::fs::remove_dir_all(&d);
    }
}
