//! A volume's snapshots, copy-on-write, and what a clone reads through.
//!
//! - A snapshot is two files beside the volume's: `vol-N.snap-S.meta`, the volume's metadata
//!   (per block CRC32C, written flag, version) as it was when the snapshot was taken, and
//!   `vol-N.snap-S.data`, sparse, which receives a block's old contents the first time the
//!   volume overwrites it afterwards. Byte 5 of a snapshot's metadata entry says the block was
//!   so preserved. Taking a snapshot copies metadata only (16 bytes per 4 KiB block).
//! - `vol-N.snaps` lists the snapshots, oldest first; it is written whole (temporary file,
//!   sync, rename), so it is the commit mark of a create and of a delete. Snapshot files it
//!   does not list are leftovers of one that a crash cut short and are removed at open.
//! - Only the newest snapshot receives copies: a block that changed after an older snapshot
//!   but before the newer one was copied into the older one then; a block not preserved in
//!   snapshot `i` is the same in `i + 1`, so a read walks from `i` to newer snapshots and then
//!   to the volume's data file, and is checked against snapshot `i`'s CRC.
//! - Order on disk: a block's copy and its preserved flag are synced before the new contents
//!   may reach the data file, so after a crash a block not marked preserved still holds the
//!   snapshot's contents. The volume's write path (and its log replay) calls
//!   [`Snapshots::preserve`] before it places a batch.
//! - A clone is a volume whose blocks never written read through to a snapshot of another
//!   volume on the same node (its *base*, named in `vol-N.base`).

use super::{sync_dir, StoreError, BLOCK, DATA, META, UNWRITTEN, ZEROED};
use parking_lot::Mutex;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Bit of a snapshot's in-memory block flags: the block held written data at the snapshot
/// (a zeroed block needs no copy: the snapshot reads it as zeros).
const WRITTEN: u8 = 1;
/// Bit: the block's snapshot contents are in the snapshot's data file.
const PRESERVED: u8 = 2;
/// Metadata bytes copied or read at a time.
const CHUNK: u64 = 1 << 20;

/// One snapshot of a volume.
pub(super) struct Snap {
    pub(super) id: u32,
    /// The volume's size in blocks when it was taken.
    pub(super) blocks: u64,
    meta: File,
    data: File,
    /// Per block: [`WRITTEN`], [`PRESERVED`].
    flags: Mutex<Vec<u8>>,
}

fn snap_paths(dir: &Path, volume: u32, id: u32) -> (PathBuf, PathBuf) {
    (
        dir.join(format!("vol-{volume}.snap-{id}.meta")),
        dir.join(format!("vol-{volume}.snap-{id}.data")),
    )
}

fn manifest_path(dir: &Path, volume: u32) -> PathBuf {
    dir.join(format!("vol-{volume}.snaps"))
}

/// The file naming a clone's base.
pub(super) fn base_path(dir: &Path, volume: u32) -> PathBuf {
    dir.join(format!("vol-{volume}.base"))
}

fn io_err(volume: u32, what: impl Into<String>) -> impl FnOnce(std::io::Error) -> StoreError {
    let what = what.into();
    move |source| StoreError::Io { volume, what, source }
}

/// Removes `p`; a file already gone is fine.
fn remove(p: &Path, volume: u32) -> Result<(), StoreError> {
    match std::fs::remove_file(p) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(io_err(volume, format!("removing {}", p.display()))(e))
        }
        _ => Ok(()),
    }
}

/// The snapshots of one volume, oldest first.
pub(super) struct Snapshots {
    volume: u32,
    dir: PathBuf,
    pub(super) list: Vec<Snap>,
}

impl Snap {
    /// Reads a snapshot's flags from its metadata file.
    fn load(meta: &File, blocks: u64, volume: u32) -> Result<Vec<u8>, StoreError> {
        let mut flags = vec![0u8; blocks as usize];
        let mut buf = vec![0u8; CHUNK as usize];
        let mut lba = 0u64;
        while lba < blocks {
            let n = (CHUNK / META).min(blocks - lba);
            let b = &mut buf[..(n * META) as usize];
            meta.read_exact_at(b, lba * META)
                .map_err(io_err(volume, "reading a snapshot's metadata"))?;
            for (k, e) in b.chunks_exact(META as usize).enumerate() {
                flags[lba as usize + k] =
                    if e[4] == DATA { WRITTEN } else { 0 } | if e[5] != 0 { PRESERVED } else { 0 };
            }
            lba += n;
        }
        Ok(flags)
    }

    /// Whether overwriting `lba` must first copy it here.
    fn needs_copy(&self, lba: u64) -> bool {
        self.flags.lock().get(lba as usize).is_some_and(|&f| f == WRITTEN)
    }

    fn preserved(&self, lba: u64) -> bool {
        self.flags.lock().get(lba as usize).is_some_and(|&f| f & PRESERVED != 0)
    }

    /// Writes `block` as this snapshot's copy of `lba` and marks it preserved (not synced).
    fn keep(&self, lba: u64, block: &[u8], volume: u32) -> Result<(), StoreError> {
        self.data
            .write_all_at(block, lba * BLOCK as u64)
            .map_err(io_err(volume, format!("copying block {lba} into snapshot {}", self.id)))?;
        self.meta
            .write_all_at(&[1], lba * META + 5)
            .map_err(io_err(volume, format!("marking block {lba} in snapshot {}", self.id)))?;
        self.flags.lock()[lba as usize] |= PRESERVED;
        Ok(())
    }

    fn sync(&self, volume: u32) -> Result<(), StoreError> {
        self.data
            .sync_data()
            .and_then(|()| self.meta.sync_data())
            .map_err(io_err(volume, format!("syncing snapshot {}", self.id)))
    }

    /// This snapshot's metadata entry of `lba`: (its flag, CRC).
    fn entry(&self, lba: u64, volume: u32) -> Result<(u8, u32), StoreError> {
        let m = self.raw_entry(lba, volume)?;
        Ok((m[4], u32::from_le_bytes(m[0..4].try_into().expect("4 bytes"))))
    }

    /// Block `lba`'s metadata entry in this snapshot, as stored.
    fn raw_entry(&self, lba: u64, volume: u32) -> Result<[u8; META as usize], StoreError> {
        let mut m = [0u8; META as usize];
        self.meta.read_exact_at(&mut m, lba * META).map_err(io_err(
            volume,
            format!("reading block {lba}'s metadata in snapshot {}", self.id),
        ))?;
        Ok(m)
    }
}

/// Where a snapshot read of a block finds its contents.
pub(super) enum Source {
    /// Never written at the snapshot: zeros, or the clone's base.
    Unwritten,
    /// Zeroed (TRIM) at the snapshot.
    Zeroed,
    /// In this snapshot's (or a newer one's) data file, with the CRC it must have.
    Kept { data: Vec<u8>, crc: u32 },
    /// Still in the volume's data file, with the CRC it must have.
    Volume { crc: u32 },
}

impl Snapshots {
    /// Opens the snapshots `vol-N.snaps` lists and removes snapshot files it does not.
    pub(super) fn open(dir: &Path, volume: u32) -> Result<Snapshots, StoreError> {
        let ids = read_manifest(dir, volume)?;
        let prefix = format!("vol-{volume}.snap-");
        for e in std::fs::read_dir(dir).map_err(io_err(volume, format!("listing {}", dir.display())))? {
            let e = e.map_err(io_err(volume, format!("listing {}", dir.display())))?;
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(rest) = name.strip_prefix(&prefix) else {
                continue;
            };
            let id = rest.split('.').next().and_then(|s| s.parse::<u32>().ok());
            if id.is_none_or(|id| !ids.contains(&id)) {
                tracing::info!("volume {volume}: removing {name}, left by a snapshot that did not complete");
                remove(&e.path(), volume)?;
            }
        }
        let mut list = Vec::new();
        for id in ids {
            let (m, d) = snap_paths(dir, volume, id);
            let open = |p: &Path| {
                OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(p)
                    .map_err(io_err(volume, format!("opening {}", p.display())))
            };
            let (meta, data) = (open(&m)?, open(&d)?);
            let len = meta.metadata().map_err(io_err(volume, "stat"))?.len();
            let blocks = len / META;
            let flags = Snap::load(&meta, blocks, volume)?;
            list.push(Snap {
                id,
                blocks,
                meta,
                data,
                flags: Mutex::new(flags),
            });
        }
        Ok(Snapshots {
            volume,
            dir: dir.to_path_buf(),
            list,
        })
    }

    pub(super) fn ids(&self) -> Vec<u32> {
        self.list.iter().map(|s| s.id).collect()
    }

    /// Takes snapshot `id` of a volume whose metadata file is `vol_meta` (`blocks` blocks), every
    /// write placed and synced: copies the metadata, makes an empty data file, then lists it.
    pub(super) fn create(&mut self, id: u32, vol_meta: &File, blocks: u64) -> Result<(), StoreError> {
        let volume = self.volume;
        if self.list.iter().any(|s| s.id == id) {
            return Err(StoreError::Invalid(format!("snapshot {id} exists"), volume));
        }
        let (m, d) = snap_paths(&self.dir, volume, id);
        let mk = |p: &Path| {
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(p)
                .map_err(io_err(volume, format!("creating {}", p.display())))
        };
        let (meta, data) = (mk(&m)?, mk(&d)?);
        let mut buf = vec![0u8; CHUNK as usize];
        let mut at = 0u64;
        let len = blocks * META;
        while at < len {
            let n = CHUNK.min(len - at);
            let b = &mut buf[..n as usize];
            vol_meta
                .read_exact_at(b, at)
                .map_err(io_err(volume, "reading the metadata"))?;
            // byte 5 (preserved) starts clear: the volume's metadata never sets it
            for e in b.chunks_exact_mut(META as usize) {
                e[5] = 0;
            }
            meta.write_all_at(b, at)
                .map_err(io_err(volume, format!("writing {}", m.display())))?;
            at += n;
        }
        meta.set_len(len).map_err(io_err(volume, "sizing"))?;
        data.set_len(blocks * BLOCK as u64).map_err(io_err(volume, "sizing"))?;
        meta.sync_all()
            .and_then(|()| data.sync_all())
            .map_err(io_err(volume, format!("syncing snapshot {id}")))?;
        let flags = Snap::load(&meta, blocks, volume)?;
        let mut ids = self.ids();
        ids.push(id);
        write_manifest(&self.dir, volume, &ids)?;
        self.list.push(Snap {
            id,
            blocks,
            meta,
            data,
            flags: Mutex::new(flags),
        });
        Ok(())
    }

    /// Copies into the newest snapshot each of `lbas` that it still shares with the volume,
    /// reading the current contents with `read`, and syncs the copies: only then may the
    /// caller place new contents over them.
    pub(super) fn preserve(
        &self,
        lbas: impl Iterator<Item = u64>,
        mut read: impl FnMut(u64, &mut [u8]) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let Some(s) = self.list.last() else { return Ok(()) };
        let mut buf = vec![0u8; BLOCK];
        let mut copied = false;
        for lba in lbas {
            if s.needs_copy(lba) {
                read(lba, &mut buf)?;
                s.keep(lba, &buf, self.volume)?;
                copied = true;
            }
        }
        if copied {
            s.sync(self.volume)?;
        }
        Ok(())
    }

    /// Snapshot `id`'s metadata flag of `lba` (None: past its end, or no such snapshot).
    pub(super) fn state(&self, id: u32, lba: u64) -> Result<Option<u8>, StoreError> {
        match self.list.iter().find(|s| s.id == id) {
            Some(s) if lba < s.blocks => Ok(Some(s.entry(lba, self.volume)?.0)),
            _ => Ok(None),
        }
    }

    /// Whether block `lba` is the same in snapshots `id` and `since`: both cover it and their
    /// metadata entries agree on its CRC, written flag and version (a version names one write,
    /// so equal versions are equal contents). `None` when either snapshot does not exist.
    pub(super) fn unchanged(&self, id: u32, since: u32, lba: u64) -> Result<Option<bool>, StoreError> {
        let (Some(a), Some(b)) = (
            self.list.iter().find(|s| s.id == id),
            self.list.iter().find(|s| s.id == since),
        ) else {
            return Ok(None);
        };
        if lba >= a.blocks || lba >= b.blocks {
            return Ok(Some(false));
        }
        let (x, y) = (a.raw_entry(lba, self.volume)?, b.raw_entry(lba, self.volume)?);
        // byte 5 (preserved) differs between snapshots of the same contents; 6..8 are reserved
        Ok(Some(x[..5] == y[..5] && x[8..] == y[8..]))
    }

    /// Where snapshot `id`'s block `lba` is (`None`: no such snapshot).
    pub(super) fn locate(&self, id: u32, lba: u64) -> Result<Option<Source>, StoreError> {
        let Some(i) = self.list.iter().position(|s| s.id == id) else {
            return Ok(None);
        };
        let s = &self.list[i];
        if lba >= s.blocks {
            return Ok(Some(Source::Unwritten));
        }
        let (flag, crc) = s.entry(lba, self.volume)?;
        match flag {
            UNWRITTEN => return Ok(Some(Source::Unwritten)),
            ZEROED => return Ok(Some(Source::Zeroed)),
            _ => {}
        }
        for t in &self.list[i..] {
            if t.preserved(lba) {
                let mut data = vec![0u8; BLOCK];
                t.data
                    .read_exact_at(&mut data, lba * BLOCK as u64)
                    .map_err(io_err(self.volume, format!("reading block {lba} of snapshot {}", t.id)))?;
                return Ok(Some(Source::Kept { data, crc }));
            }
        }
        Ok(Some(Source::Volume { crc }))
    }

    /// Removes snapshot `id`. The blocks it kept that the next older snapshot still shares
    /// with it move there first (synced), then the list drops it, then its files go.
    /// The caller holds the volume's writes and the snapshot reads off (`&mut`).
    pub(super) fn delete(&mut self, id: u32) -> Result<(), StoreError> {
        let volume = self.volume;
        let i = self
            .list
            .iter()
            .position(|s| s.id == id)
            .ok_or_else(|| StoreError::Invalid(format!("no snapshot {id}"), volume))?;
        if i > 0 {
            let (older, s) = (&self.list[i - 1], &self.list[i]);
            let mut buf = vec![0u8; BLOCK];
            let mut moved = false;
            for lba in 0..s.blocks.min(older.blocks) {
                if s.preserved(lba) && older.needs_copy(lba) {
                    s.data
                        .read_exact_at(&mut buf, lba * BLOCK as u64)
                        .map_err(io_err(volume, format!("reading block {lba} of snapshot {id}")))?;
                    older.keep(lba, &buf, volume)?;
                    moved = true;
                }
            }
            if moved {
                older.sync(volume)?;
            }
        }
        let mut ids = self.ids();
        ids.retain(|&x| x != id);
        write_manifest(&self.dir, volume, &ids)?;
        self.list.remove(i);
        let (m, d) = snap_paths(&self.dir, volume, id);
        remove(&d, volume)?;
        remove(&m, volume)
    }

    /// Removes every snapshot file and the list (the volume is being removed).
    pub(super) fn remove_all(dir: &Path, volume: u32) -> Result<(), StoreError> {
        for id in read_manifest(dir, volume)? {
            let (m, d) = snap_paths(dir, volume, id);
            remove(&d, volume)?;
            remove(&m, volume)?;
        }
        remove(&manifest_path(dir, volume), volume)
    }
}

/// The snapshot ids `vol-N.snaps` lists (none when it is absent).
fn read_manifest(dir: &Path, volume: u32) -> Result<Vec<u32>, StoreError> {
    let p = manifest_path(dir, volume);
    let text = match std::fs::read_to_string(&p) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(volume, format!("reading {}", p.display()))(e)),
    };
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            l.trim()
                .parse()
                .map_err(|_| StoreError::Invalid(format!("{}: {l:?} is not a snapshot id", p.display()), volume))
        })
        .collect()
}

/// Writes the snapshot list whole: a temporary file, synced, renamed over the old one.
fn write_manifest(dir: &Path, volume: u32, ids: &[u32]) -> Result<(), StoreError> {
    let p = manifest_path(dir, volume);
    let tmp = p.with_extension("snaps.new");
    let text: String = ids.iter().map(|i| format!("{i}\n")).collect();
    let err = io_err(volume, format!("writing {}", p.display()));
    (|| {
        use std::io::Write;
        let mut f = File::create(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, &p)?;
        sync_dir(dir)
    })()
    .map_err(err)
}

/// A clone's base: a snapshot of another volume of the same node.
#[derive(Clone)]
pub struct Base {
    /// The volume the snapshot belongs to.
    pub store: Arc<super::VolumeStore>,
    /// The snapshot's id.
    pub snapshot: u32,
}

/// The `(volume, snapshot)` a clone's `vol-N.base` names, if the volume is a clone.
pub fn read_base(dir: &Path, volume: u32) -> Result<Option<(u32, u32)>, StoreError> {
    let p = base_path(dir, volume);
    let text = match std::fs::read_to_string(&p) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(volume, format!("reading {}", p.display()))(e)),
    };
    let mut it = text.split_whitespace().map(str::parse::<u32>);
    match (it.next(), it.next()) {
        (Some(Ok(v)), Some(Ok(s))) => Ok(Some((v, s))),
        _ => Err(StoreError::Invalid(
            format!("{}: {text:?} is not \"VOLUME SNAPSHOT\"", p.display()),
            volume,
        )),
    }
}

/// Writes a clone's `vol-N.base` (synced; the directory entry is synced by the create).
pub(super) fn write_base(dir: &Path, volume: u32, base: (u32, u32)) -> Result<(), StoreError> {
    let p = base_path(dir, volume);
    (|| {
        use std::io::Write;
        let mut f = File::create(&p)?;
        f.write_all(format!("{} {}\n", base.0, base.1).as_bytes())?;
        f.sync_all()
    })()
    .map_err(io_err(volume, format!("writing {}", p.display())))
}

#[cfg(test)]
mod tests {
    use super::super::{encode_record, log_start, stamp_generation, VolumeStore};
    use super::*;

    fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("snapstore-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn block(seed: u8, lba: u64) -> Vec<u8> {
        (0..BLOCK)
            .map(|i| (i as u8).wrapping_mul(seed) ^ seed ^ lba as u8)
            .collect()
    }

    fn put(s: &VolumeStore, lbas: std::ops::Range<u64>, seed: u8, version: u64) {
        for lba in lbas {
            let b = block(seed, lba);
            s.write(lba, &b, crc32c::crc32c(&b), version).unwrap();
        }
    }

    /// `want[lba]`: the seed a block must hold (0: zeros).
    fn expect(what: &str, read: impl Fn(u64) -> Vec<u8>, want: &[(u64, u8)]) {
        for &(lba, seed) in want {
            let got = read(lba);
            let w = if seed == 0 { vec![0u8; BLOCK] } else { block(seed, lba) };
            assert!(got == w, "{what}: block {lba} should hold seed {seed}");
        }
    }

    #[test]
    fn snapshots_keep_their_point_in_time_through_overwrites_restarts_and_deletes() {
        let d = dir("pit");
        let limit = 1 << 30;
        let s = VolumeStore::create(&d, 1, 64, limit).unwrap();
        put(&s, 0..8, 1, 1);
        s.snapshot(1).unwrap();
        put(&s, 0..4, 2, 2);
        s.snapshot(2).unwrap();
        put(&s, 2..6, 3, 3);
        put(&s, 10..11, 4, 3);
        let snap1 = [(0, 1), (3, 1), (5, 1), (7, 1), (10, 0)];
        let snap2 = [(0, 2), (3, 2), (4, 1), (5, 1), (10, 0)];
        let now = [(0, 2), (2, 3), (5, 3), (6, 1), (10, 4)];
        let check = |s: &VolumeStore| {
            expect("snapshot 1", |l| s.read_snapshot(1, l).unwrap(), &snap1);
            expect("snapshot 2", |l| s.read_snapshot(2, l).unwrap(), &snap2);
            expect("the volume", |l| s.read(l).unwrap().0, &now);
        };
        check(&s);
        assert_eq!(s.snapshots(), vec![1, 2]);
        assert!(s.snapshot(2).is_err(), "an id is taken once");
        drop(s); // the writes after snapshot 2 live in the log
        let s = VolumeStore::open(&d, 1, limit).unwrap();
        check(&s);
        // a crash after a write's log record was durable and before it was placed: the
        // replay copies the old block into the snapshot before placing the record over it
        s.snapshot(3).unwrap();
        drop(s);
        let mut log = OpenOptions::new().append(true).open(d.join("vol-1.log")).unwrap();
        let b = block(5, 7);
        let mut rec = Vec::new();
        encode_record(&mut rec, 7, 9, crc32c::crc32c(&b), &b);
        let (generation, _) = log_start(&std::fs::read(d.join("vol-1.log")).unwrap()).unwrap();
        stamp_generation(&mut rec, generation);
        std::io::Write::write_all(&mut log, &rec).unwrap();
        drop(log);
        let s = VolumeStore::open(&d, 1, limit).unwrap();
        assert_eq!(s.stats().replayed, 1);
        expect("after replay", |l| s.read(l).unwrap().0, &[(7, 5)]);
        expect(
            "snapshot 3",
            |l| s.read_snapshot(3, l).unwrap(),
            &[(7, 1), (2, 3), (10, 4)],
        );
        check_after_deletes(&s, &snap1);
        drop(s);
        let _ = std::fs::remove_dir_all(&d);
    }

    fn check_after_deletes(s: &VolumeStore, snap1: &[(u64, u8)]) {
        // deleting the middle snapshot moves what only it kept for snapshot 1 there
        s.delete_snapshot(2).unwrap();
        expect("snapshot 1 after deleting 2", |l| s.read_snapshot(1, l).unwrap(), snap1);
        put(s, 0..1, 6, 10);
        expect("snapshot 3", |l| s.read_snapshot(3, l).unwrap(), &[(0, 2), (7, 1)]);
        s.delete_snapshot(3).unwrap();
        expect("snapshot 1 after deleting 3", |l| s.read_snapshot(1, l).unwrap(), snap1);
        assert_eq!(s.snapshots(), vec![1]);
        assert!(s.read_snapshot(3, 0).is_err(), "a deleted snapshot reads as an error");
    }

    #[test]
    fn a_clone_reads_through_to_its_snapshot_until_written_and_reopens_with_its_base() {
        let d = dir("clone");
        let parent = Arc::new(VolumeStore::create(&d, 1, 32, 1 << 20).unwrap());
        put(&parent, 0..4, 1, 1);
        parent.snapshot(7).unwrap();
        put(&parent, 0..2, 2, 2);
        let base = Base {
            store: parent.clone(),
            snapshot: 7,
        };
        assert!(
            VolumeStore::create_clone(
                &d,
                2,
                1 << 20,
                Base {
                    snapshot: 8,
                    ..base.clone()
                }
            )
            .is_err(),
            "a clone of a snapshot that does not exist"
        );
        let c = VolumeStore::create_clone(&d, 2, 1 << 20, base.clone()).unwrap();
        assert_eq!((c.blocks(), c.base()), (32, Some((1, 7))));
        expect("the clone", |l| c.read(l).unwrap().0, &[(0, 1), (1, 1), (3, 1), (5, 0)]);
        put(&c, 1..2, 3, 1);
        expect("the clone", |l| c.read(l).unwrap().0, &[(0, 1), (1, 3)]);
        expect("the parent", |l| parent.read(l).unwrap().0, &[(0, 2), (1, 2), (3, 1)]);
        expect("the snapshot", |l| parent.read_snapshot(7, l).unwrap(), &[(1, 1)]);
        // a snapshot of the clone reads through the clone's base as the clone does
        c.snapshot(1).unwrap();
        put(&c, 0..1, 4, 2);
        expect(
            "the clone's snapshot",
            |l| c.read_snapshot(1, l).unwrap(),
            &[(0, 1), (1, 3), (2, 1)],
        );
        drop(c);
        assert_eq!(read_base(&d, 2).unwrap(), Some((1, 7)));
        assert!(VolumeStore::open(&d, 2, 1 << 20).is_err(), "a clone needs its base");
        let c = VolumeStore::open_with(&d, 2, 1 << 20, Some(base)).unwrap();
        expect(
            "the reopened clone",
            |l| c.read(l).unwrap().0,
            &[(0, 4), (1, 3), (2, 1), (9, 0)],
        );
        drop(c);
        VolumeStore::remove(&d, 2).unwrap();
        assert!(!base_path(&d, 2).exists() && !d.join("vol-2.snaps").exists());
        drop(parent);
        let _ = std::fs::remove_dir_all(&d);
    }
}
