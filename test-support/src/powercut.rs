//! A disk that loses power: a FUSE file system, mounted by the test process, that keeps two
//! images of everything it holds, what programs see now and what a power cut would leave.
//!
//! The durability model is the strict one POSIX promises and no more:
//! - a file's bytes and size become durable only when the file is `fsync`ed or `fdatasync`ed
//!   (through any handle); a write, `ftruncate` or `set_len` before that is lost at a cut;
//! - a directory entry (create, mkdir, unlink, rmdir, rename into or out of the directory)
//!   becomes durable only when that directory is `fsync`ed; a file created and synced but whose
//!   directory was never synced is gone after a cut, and an entry that names it comes back with
//!   the file's durable bytes (empty if it never synced).
//!
//! [`Disk::power_cut`] turns the power off: from that instant every operation fails with `EIO`
//! (nothing more reaches the platter), the mount goes away, and the visible image becomes the
//! durable one. [`Disk::power_on`] mounts the surviving image again at the same place.
//!
//! **Faults** ([`Disk::inject`]): the Nth `fsync`/`fdatasync` or write of a file (of any file,
//! or of those whose name starts with a prefix) fails with `EIO`, once or from then on until
//! [`Disk::heal`]. A failed file sync does what Linux does after a writeback error
//! (PostgreSQL's "fsyncgate"): the file's dirty pages are dropped, so the visible image goes
//! back to the durable one for those pages (zeros where the durable file is shorter), and they
//! are clean: a later sync of the file succeeds without making the lost bytes durable. A failed
//! write changes nothing.
//!
//! Files are held in memory and opened with `FOPEN_DIRECT_IO` and zero attribute and entry
//! lifetimes, so the kernel caches nothing that could outlive the cut. Locks (`flock`) are the
//! kernel's local emulation. Needs root and `/dev/fuse`: see [`Disk::available`].

use fuser::{
    BackgroundSession, Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    LockOwner, MountOption, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty,
    ReplyEntry, ReplyOpen, ReplyWrite, Request, TimeOrNow, WriteFlags,
};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

const PAGE: u64 = 4096;
const TTL: Duration = Duration::ZERO;

/// What one inode holds, as seen now and as it would survive a cut.
enum Body {
    File {
        live: Vec<u8>,
        durable: Vec<u8>,
        /// Pages written since the last sync (the size is compared whole).
        dirty: BTreeSet<u64>,
    },
    Dir {
        live: BTreeMap<OsString, u64>,
        durable: BTreeMap<OsString, u64>,
    },
}

struct Inode {
    perm: u16,
    body: Body,
}

/// What a cut threw away.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CutReport {
    /// Files whose visible bytes or size differed from their durable ones.
    pub files_reverted: u64,
    /// Pages (4 KiB) written but never synced.
    pub pages_lost: u64,
    /// Directory entries added, removed or renamed but never synced.
    pub entries_lost: u64,
}

/// Counts of what reached the disk, for a test to show its workload synced at all.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DiskStats {
    /// Write calls.
    pub writes: u64,
    /// `fsync`/`fdatasync` calls on files.
    pub file_syncs: u64,
    /// `fsync` calls on directories.
    pub dir_syncs: u64,
    /// File syncs failed by an injected fault ([`Disk::inject`]).
    pub failed_syncs: u64,
    /// Writes failed by an injected fault.
    pub failed_writes: u64,
    /// Dirty pages a failed sync dropped (the visible image went back to the durable one).
    pub pages_dropped: u64,
}

/// The calls a [`Fault`] fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultOp {
    /// `fsync` and `fdatasync` of a file (not of a directory).
    Sync,
    /// Writes to a file.
    Write,
}

/// A fault the disk injects: the `nth` matching call after [`Disk::inject`] (1: the next one)
/// fails with `EIO`, and with `sticky` every matching call after it too, until
/// [`Disk::heal`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    /// Which calls.
    pub op: FaultOp,
    /// Only calls on a file with a name that starts with this (`None`: any file).
    pub file_prefix: Option<String>,
    /// Which matching call fails first (counted from 1).
    pub nth: u64,
    /// Every matching call after the `nth` fails too.
    pub sticky: bool,
}

impl Fault {
    /// The `nth` sync of a file whose name starts with `prefix` (any file: `None`) fails, once.
    pub fn sync(prefix: Option<&str>, nth: u64) -> Fault {
        Fault {
            op: FaultOp::Sync,
            file_prefix: prefix.map(str::to_string),
            nth,
            sticky: false,
        }
    }

    /// The `nth` write to a file whose name starts with `prefix` (any file: `None`) fails,
    /// once.
    pub fn write(prefix: Option<&str>, nth: u64) -> Fault {
        Fault {
            op: FaultOp::Write,
            file_prefix: prefix.map(str::to_string),
            nth,
            sticky: false,
        }
    }

    /// The same fault, failing every matching call from the `nth` on.
    pub fn sticky(self) -> Fault {
        Fault { sticky: true, ..self }
    }
}

/// An injected fault and how many matching calls it has seen.
struct Armed {
    fault: Fault,
    seen: u64,
}

struct State {
    inodes: HashMap<u64, Inode>,
    next_ino: u64,
    powered: bool,
    /// Which mount may act: a session left over from before a cut (its thread outlives the
    /// lazy unmount while files stay open) answers `EIO` for good.
    life: u64,
    stats: DiskStats,
    faults: Vec<Armed>,
}

impl State {
    fn new() -> State {
        let root = Inode {
            perm: 0o755,
            body: Body::Dir {
                live: BTreeMap::new(),
                durable: BTreeMap::new(),
            },
        };
        State {
            inodes: HashMap::from([(INodeNo::ROOT.0, root)]),
            next_ino: 2,
            powered: true,
            life: 0,
            stats: DiskStats::default(),
            faults: Vec::new(),
        }
    }

    fn attr(&self, ino: u64) -> Option<FileAttr> {
        let i = self.inodes.get(&ino)?;
        let (kind, size, nlink) = match &i.body {
            Body::File { live, .. } => (FileType::RegularFile, live.len() as u64, 1),
            Body::Dir { .. } => (FileType::Directory, 0, 2),
        };
        let t = SystemTime::UNIX_EPOCH;
        Some(FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: t,
            mtime: t,
            ctime: t,
            crtime: t,
            kind,
            perm: i.perm,
            nlink,
            uid: 0,
            gid: 0,
            rdev: 0,
            blksize: PAGE as u32,
            flags: 0,
        })
    }

    fn dir(&mut self, ino: u64) -> Result<&mut BTreeMap<OsString, u64>, Errno> {
        match self.inodes.get_mut(&ino).map(|i| &mut i.body) {
            Some(Body::Dir { live, .. }) => Ok(live),
            Some(Body::File { .. }) => Err(Errno::ENOTDIR),
            None => Err(Errno::ENOENT),
        }
    }

    fn file(&mut self, ino: u64) -> Result<(&mut Vec<u8>, &mut BTreeSet<u64>), Errno> {
        match self.inodes.get_mut(&ino).map(|i| &mut i.body) {
            Some(Body::File { live, dirty, .. }) => Ok((live, dirty)),
            Some(Body::Dir { .. }) => Err(Errno::EISDIR),
            None => Err(Errno::ENOENT),
        }
    }

    fn lookup(&mut self, parent: u64, name: &OsStr) -> Result<u64, Errno> {
        self.dir(parent)?.get(name).copied().ok_or(Errno::ENOENT)
    }

    fn add(&mut self, parent: u64, name: &OsStr, perm: u16, body: Body) -> Result<u64, Errno> {
        if self.dir(parent)?.contains_key(name) {
            return Err(Errno::EEXIST);
        }
        let ino = self.next_ino;
        self.next_ino += 1;
        self.inodes.insert(ino, Inode { perm, body });
        self.dir(parent)?.insert(name.to_owned(), ino);
        Ok(ino)
    }

    fn is_empty_dir(&self, ino: u64) -> bool {
        matches!(self.inodes.get(&ino).map(|i| &i.body), Some(Body::Dir { live, .. }) if live.is_empty())
    }

    /// The names file `ino` has in the visible directories.
    fn names(&self, ino: u64) -> Vec<&OsStr> {
        self.inodes
            .values()
            .filter_map(|i| match &i.body {
                Body::Dir { live, .. } => Some(live),
                Body::File { .. } => None,
            })
            .flat_map(|d| d.iter().filter(|&(_, &c)| c == ino).map(|(n, _)| n.as_os_str()))
            .collect()
    }

    /// Whether an injected fault fails this `op` call on file `ino` (counting it).
    fn fault(&mut self, op: FaultOp, ino: u64) -> bool {
        if !self.faults.iter().any(|a| a.fault.op == op) {
            return false;
        }
        let names: Vec<Vec<u8>> = self
            .names(ino)
            .into_iter()
            .map(|n| n.as_encoded_bytes().to_vec())
            .collect();
        let mut fail = false;
        for a in self.faults.iter_mut().filter(|a| a.fault.op == op) {
            let matches = match &a.fault.file_prefix {
                None => true,
                Some(p) => names.iter().any(|n| n.starts_with(p.as_bytes())),
            };
            if matches {
                a.seen += 1;
                fail |= a.seen == a.fault.nth || a.fault.sticky && a.seen > a.fault.nth;
            }
        }
        fail
    }

    /// A failed sync of file `ino`: its dirty pages are dropped (visible again as the durable
    /// image has them, zeros past its end) and clean; the size stays.
    fn drop_dirty(&mut self, ino: u64) {
        let Some(Body::File { live, durable, dirty }) = self.inodes.get_mut(&ino).map(|i| &mut i.body) else {
            return;
        };
        let n = dirty.len() as u64;
        for p in std::mem::take(dirty) {
            let a = ((p * PAGE) as usize).min(live.len());
            let b = (a + PAGE as usize).min(live.len());
            for (k, byte) in live[a..b].iter_mut().enumerate() {
                *byte = durable.get(a + k).copied().unwrap_or(0);
            }
        }
        self.stats.failed_syncs += 1;
        self.stats.pages_dropped += n;
    }

    fn sync_file(&mut self, ino: u64) -> Result<(), Errno> {
        if matches!(self.inodes.get(&ino).map(|i| &i.body), Some(Body::File { .. })) && self.fault(FaultOp::Sync, ino) {
            self.drop_dirty(ino);
            return Err(Errno::EIO);
        }
        match self.inodes.get_mut(&ino).map(|i| &mut i.body) {
            Some(Body::File { live, durable, dirty }) => {
                durable.resize(live.len(), 0);
                for p in std::mem::take(dirty) {
                    let a = (p * PAGE) as usize;
                    if a < live.len() {
                        let b = (a + PAGE as usize).min(live.len());
                        durable[a..b].copy_from_slice(&live[a..b]);
                    }
                }
                self.stats.file_syncs += 1;
                Ok(())
            }
            Some(Body::Dir { .. }) => self.sync_dir(ino),
            None => Err(Errno::ENOENT),
        }
    }

    fn sync_dir(&mut self, ino: u64) -> Result<(), Errno> {
        match self.inodes.get_mut(&ino).map(|i| &mut i.body) {
            Some(Body::Dir { live, durable }) => {
                durable.clone_from(live);
                self.stats.dir_syncs += 1;
                Ok(())
            }
            Some(Body::File { .. }) => Err(Errno::ENOTDIR),
            None => Err(Errno::ENOENT),
        }
    }

    /// Reverts every inode to its durable image and forgets the ones no durable entry reaches.
    fn cut(&mut self) -> CutReport {
        let mut r = CutReport::default();
        for i in self.inodes.values_mut() {
            match &mut i.body {
                Body::File { live, durable, dirty } => {
                    if live != durable {
                        r.files_reverted += 1;
                        r.pages_lost += dirty.len() as u64;
                    }
                    live.clone_from(durable);
                    dirty.clear();
                }
                Body::Dir { live, durable } => {
                    let changed = live.iter().filter(|(k, v)| durable.get(*k) != Some(*v)).count()
                        + durable.keys().filter(|k| !live.contains_key(*k)).count();
                    r.entries_lost += changed as u64;
                    live.clone_from(durable);
                }
            }
        }
        let mut reached = BTreeSet::from([INodeNo::ROOT.0]);
        let mut todo = vec![INodeNo::ROOT.0];
        while let Some(ino) = todo.pop() {
            if let Some(Inode {
                body: Body::Dir { live, .. },
                ..
            }) = self.inodes.get(&ino)
            {
                for &c in live.values() {
                    if reached.insert(c) {
                        todo.push(c);
                    }
                }
            }
        }
        self.inodes.retain(|ino, _| reached.contains(ino));
        r
    }
}

/// The FUSE side of one mount: every request takes the state's lock and answers from memory.
struct Fs {
    state: Arc<Mutex<State>>,
    life: u64,
}

impl Fs {
    /// The state, or `EIO` once the power is off (or this mount's life ended).
    fn on(&self) -> Result<MutexGuard<'_, State>, Errno> {
        let s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.powered && s.life == self.life {
            Ok(s)
        } else {
            Err(Errno::EIO)
        }
    }
}

fn perm(mode: u32) -> u16 {
    (mode & 0o7777) as u16
}

impl Filesystem for Fs {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let r = self.on().and_then(|mut s| {
            let ino = s.lookup(parent.0, name)?;
            s.attr(ino).ok_or(Errno::ENOENT)
        });
        match r {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.on().and_then(|s| s.attr(ino.0).ok_or(Errno::ENOENT)) {
            Ok(a) => reply.attr(&TTL, &a),
            Err(e) => reply.error(e),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let r = self.on().and_then(|mut s| {
            if let Some(m) = mode {
                s.inodes.get_mut(&ino.0).ok_or(Errno::ENOENT)?.perm = perm(m);
            }
            if let Some(len) = size {
                let (live, dirty) = s.file(ino.0)?;
                let old = live.len() as u64;
                live.resize(len as usize, 0);
                // the pages between the two sizes changed (zeroed or cut off)
                let (a, b) = (old.min(len), old.max(len));
                dirty.extend(a / PAGE..b.div_ceil(PAGE));
            }
            s.attr(ino.0).ok_or(Errno::ENOENT)
        });
        match r {
            Ok(a) => reply.attr(&TTL, &a),
            Err(e) => reply.error(e),
        }
    }

    fn mkdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, mode: u32, _umask: u32, reply: ReplyEntry) {
        let r = self.on().and_then(|mut s| {
            let body = Body::Dir {
                live: BTreeMap::new(),
                durable: BTreeMap::new(),
            };
            let ino = s.add(parent.0, name, perm(mode), body)?;
            s.attr(ino).ok_or(Errno::ENOENT)
        });
        match r {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn create(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        let r = self.on().and_then(|mut s| {
            let body = Body::File {
                live: Vec::new(),
                durable: Vec::new(),
                dirty: BTreeSet::new(),
            };
            let ino = s.add(parent.0, name, perm(mode), body)?;
            s.attr(ino).ok_or(Errno::ENOENT)
        });
        match r {
            Ok(a) => reply.created(&TTL, &a, Generation(0), FileHandle(0), FopenFlags::FOPEN_DIRECT_IO),
            Err(e) => reply.error(e),
        }
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let r = self.on().and_then(|mut s| {
            let ino = s.lookup(parent.0, name)?;
            if matches!(s.inodes.get(&ino).map(|i| &i.body), Some(Body::Dir { .. })) {
                return Err(Errno::EISDIR);
            }
            s.dir(parent.0)?.remove(name);
            Ok(())
        });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let r = self.on().and_then(|mut s| {
            let ino = s.lookup(parent.0, name)?;
            s.dir(ino)?;
            if !s.is_empty_dir(ino) {
                return Err(Errno::ENOTEMPTY);
            }
            s.dir(parent.0)?.remove(name);
            Ok(())
        });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let r = self.on().and_then(|mut s| {
            if !(flags - RenameFlags::RENAME_NOREPLACE).is_empty() {
                return Err(Errno::EINVAL);
            }
            let ino = s.lookup(parent.0, name)?;
            if let Ok(old) = s.lookup(newparent.0, newname) {
                if flags.contains(RenameFlags::RENAME_NOREPLACE) {
                    return Err(Errno::EEXIST);
                }
                let (src_dir, dst_dir) = (s.dir(ino).is_ok(), s.dir(old).is_ok());
                match (src_dir, dst_dir) {
                    (false, true) => return Err(Errno::EISDIR),
                    (true, false) => return Err(Errno::ENOTDIR),
                    (true, true) if !s.is_empty_dir(old) => return Err(Errno::ENOTEMPTY),
                    _ => {}
                }
            }
            s.dir(parent.0)?.remove(name);
            s.dir(newparent.0)?.insert(newname.to_owned(), ino);
            Ok(())
        });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.on().and_then(|s| s.attr(ino.0).ok_or(Errno::ENOENT)) {
            Ok(_) => reply.opened(FileHandle(0), FopenFlags::FOPEN_DIRECT_IO),
            Err(e) => reply.error(e),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let r = self.on().and_then(|mut s| {
            let (live, _) = s.file(ino.0)?;
            let a = (offset as usize).min(live.len());
            let b = (a + size as usize).min(live.len());
            Ok(live[a..b].to_vec())
        });
        match r {
            Ok(d) => reply.data(&d),
            Err(e) => reply.error(e),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let r = self.on().and_then(|mut s| {
            s.stats.writes += 1;
            s.file(ino.0)?;
            if s.fault(FaultOp::Write, ino.0) {
                s.stats.failed_writes += 1;
                return Err(Errno::EIO);
            }
            let (live, dirty) = s.file(ino.0)?;
            let end = offset + data.len() as u64;
            if live.len() < end as usize {
                let old = live.len() as u64;
                live.resize(end as usize, 0);
                dirty.extend(old / PAGE..end.div_ceil(PAGE));
            }
            live[offset as usize..end as usize].copy_from_slice(data);
            if !data.is_empty() {
                dirty.extend(offset / PAGE..end.div_ceil(PAGE));
            }
            Ok(data.len() as u32)
        });
        match r {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(e),
        }
    }

    fn flush(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _owner: LockOwner, reply: ReplyEmpty) {
        // close(2) makes nothing durable
        match self.on() {
            Ok(_) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn fsync(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        match self.on().and_then(|mut s| s.sync_file(ino.0)) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.on().and_then(|mut s| s.dir(ino.0).map(|_| ())) {
            Ok(()) => reply.opened(FileHandle(0), FopenFlags::empty()),
            Err(e) => reply.error(e),
        }
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        let r = self.on().and_then(|mut s| {
            let entries: Vec<(OsString, u64)> = s.dir(ino.0)?.iter().map(|(k, v)| (k.clone(), *v)).collect();
            let mut all = vec![(OsString::from("."), ino.0, FileType::Directory)];
            all.push((OsString::from(".."), ino.0, FileType::Directory));
            for (name, c) in entries {
                let kind = match s.inodes.get(&c).map(|i| &i.body) {
                    Some(Body::Dir { .. }) => FileType::Directory,
                    _ => FileType::RegularFile,
                };
                all.push((name, c, kind));
            }
            Ok(all)
        });
        match r {
            Ok(all) => {
                for (i, (name, c, kind)) in all.into_iter().enumerate().skip(offset as usize) {
                    if reply.add(INodeNo(c), i as u64 + 1, kind, &name) {
                        break;
                    }
                }
                reply.ok()
            }
            Err(e) => reply.error(e),
        }
    }

    fn fsyncdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        match self.on().and_then(|mut s| s.sync_dir(ino.0)) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }
}

/// A mounted disk that can lose power. Dropping it unmounts it.
pub struct Disk {
    state: Arc<Mutex<State>>,
    at: PathBuf,
    session: Option<BackgroundSession>,
}

impl Disk {
    /// Whether a disk can be mounted here: `Err` names what is missing (root, `/dev/fuse`).
    pub fn available() -> Result<(), String> {
        if !crate::is_root() {
            return Err("mounting a FUSE file system needs root".into());
        }
        if !Path::new("/dev/fuse").exists() {
            return Err("/dev/fuse does not exist here".into());
        }
        Ok(())
    }

    /// Mounts an empty disk at `at` (created if missing).
    pub fn mount(at: impl Into<PathBuf>) -> std::io::Result<Disk> {
        let at = at.into();
        std::fs::create_dir_all(&at)?;
        let mut d = Disk {
            state: Arc::new(Mutex::new(State::new())),
            at,
            session: None,
        };
        d.power_on()?;
        Ok(d)
    }

    /// Where the disk is mounted.
    pub fn path(&self) -> &Path {
        &self.at
    }

    /// What reached the disk so far.
    pub fn stats(&self) -> DiskStats {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).stats
    }

    /// Injects `fault` (beside those injected before): see the module's doc.
    pub fn inject(&self, fault: Fault) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.faults.push(Armed { fault, seen: 0 });
    }

    /// Removes every injected fault: the disk works again (what a failed sync dropped stays
    /// lost).
    pub fn heal(&self) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).faults.clear();
    }

    /// Cuts the power: every later operation fails with `EIO`, the visible image becomes the
    /// durable one, and the file system is unmounted (lazily: open files keep failing).
    pub fn power_cut(&mut self) -> CutReport {
        let report = {
            let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
            s.powered = false;
            s.cut()
        };
        // a lazy unmount: files open on the old mount stay attached to it (and fail), new opens
        // see whatever is mounted next; fuser's own unmount on drop would be refused as busy
        if let Err(e) = rustix::mount::unmount(&self.at, rustix::mount::UnmountFlags::DETACH) {
            eprintln!("powercut: unmounting {}: {e}", self.at.display());
        }
        self.session = None;
        report
    }

    /// Mounts what survived at the same place, with the power on.
    pub fn power_on(&mut self) -> std::io::Result<()> {
        self.session = None;
        let life = {
            let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
            s.powered = true;
            s.life += 1;
            s.life
        };
        let mut cfg = Config::default();
        cfg.mount_options = vec![
            MountOption::FSName("flexns-powercut".into()),
            MountOption::Subtype("powercut".into()),
            MountOption::DefaultPermissions,
        ];
        let fs = Fs {
            state: self.state.clone(),
            life,
        };
        self.session = Some(fuser::spawn_mount(fs, &self.at, &cfg)?);
        Ok(())
    }
}

impl Drop for Disk {
    fn drop(&mut self) {
        if self.session.is_some() {
            let _ = rustix::mount::unmount(&self.at, rustix::mount::UnmountFlags::DETACH);
            self.session = None;
        }
    }
}
