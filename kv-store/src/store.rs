//! The partition's store: index, RedN mirror and entries in one registered memory region, its
//! single writer ([`Store`]) and the lock-free local reader ([`lookup`]).
//!
//! Every word that readers may see changing is written with an 8-byte atomic store
//! ([`netstack::mem::Region::store_u64`], [`netstack::mem::Region::write_words`]): the memory
//! region module is where the `unsafe` is.

use crate::layout::{self, Invalid, Scan, Slot, BUCKET_LEN, CLASSES, SLOTS, SLOT_LEN};
use crate::KvError;
use netstack::mem::Region;
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Where things are in the region; clients get it (with the region's address and rkey) when
/// they connect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Geometry {
    /// Main buckets (a power of two); overflow buckets follow them.
    pub buckets: u64,
    /// Overflow buckets.
    pub overflow: u64,
    /// Byte offset and bucket count (a power of two) of the RedN mirror: 16-byte buckets
    /// `{key word, entry address}`.
    pub mirror_off: u64,
    /// Buckets of the RedN mirror.
    pub mirror_buckets: u64,
    /// The entry class the mirror serves (RedN sends a fixed length).
    pub redn_class: usize,
    /// Byte offset and length of the data area.
    pub data_off: u64,
    /// Length of the data area in bytes.
    pub data_len: u64,
}

impl Geometry {
    /// The geometry for about `capacity` keys with `data_len` bytes of entries.
    pub fn for_capacity(capacity: u64, data_len: u64, redn_value_len: usize) -> Result<Geometry, KvError> {
        if capacity == 0 || data_len < 4096 {
            return Err(KvError::Config("capacity must be > 0 and data at least 4 KiB".into()));
        }
        let buckets = (capacity / 2).max(16).next_power_of_two();
        let overflow = buckets / 2;
        let mirror_buckets = (capacity * 2).max(64).next_power_of_two();
        let mirror_off = (buckets + overflow) * BUCKET_LEN as u64;
        let data_off = (mirror_off + mirror_buckets * 16).next_multiple_of(4096);
        let redn_class = layout::class_for(8, redn_value_len)
            .ok_or_else(|| KvError::Config(format!("RedN value length {redn_value_len} too large")))?;
        Ok(Geometry {
            buckets,
            overflow,
            mirror_off,
            mirror_buckets,
            redn_class,
            data_off,
            data_len: data_len.next_multiple_of(64),
        })
    }
    /// Bytes of the whole region.
    pub fn region_len(&self) -> usize {
        (self.data_off + self.data_len) as usize
    }
    /// Byte offset of bucket `b` (main or overflow).
    pub fn bucket_off(&self, b: u64) -> u64 {
        b * BUCKET_LEN as u64
    }
    /// Byte offset of an entry at data offset `o`.
    pub fn entry_off(&self, o: u64) -> u64 {
        self.data_off + o
    }
}

/// Memory a lookup reads from: the region itself or an offload handler's DMA.
pub trait ReadMem {
    /// Copies `buf.len()` bytes at region offset `off`.
    fn read(&self, off: u64, buf: &mut [u8]) -> Result<(), KvError>;
}

impl ReadMem for Region {
    fn read(&self, off: u64, buf: &mut [u8]) -> Result<(), KvError> {
        let end = off.checked_add(buf.len() as u64).filter(|&e| e <= self.len() as u64);
        if end.is_none() {
            return Err(KvError::Corrupt(format!(
                "read of {} bytes at {off:#x} out of the region",
                buf.len()
            )));
        }
        if off.is_multiple_of(8) && buf.len().is_multiple_of(8) {
            self.read_words(off as usize, buf)
                .ok_or_else(|| KvError::Corrupt("unaligned read".into()))
        } else {
            Region::read(self, off as usize, buf);
            Ok(())
        }
    }
}

/// A found entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    /// The value.
    pub value: Vec<u8>,
    /// Data-area offset, class and incarnation of the entry, and its version.
    pub offset: u64,
    /// Size class of the entry.
    pub class: usize,
    /// Incarnation of the entry.
    pub inc: u16,
    /// Version of the entry.
    pub version: u64,
}

/// How long a lookup keeps rereading a torn entry before giving up. A writer can be preempted
/// in the middle of an update (its thread descheduled for a time slice), so a reader yields
/// between rereads and waits this long before it calls the entry corrupt.
pub const MAX_TORN_WAIT: Duration = Duration::from_millis(25);

/// Looks `key` up: walks its bucket chain, copies the entry, validates, retries torn copies.
/// Returns the entry and the number of buckets visited.
pub fn lookup<M: ReadMem + ?Sized>(m: &M, g: &Geometry, key: &[u8]) -> Result<(Option<Found>, u32), KvError> {
    lookup_within(m, g, key, MAX_TORN_WAIT)
}

/// [`lookup`], rereading a torn entry for at most `torn_wait` (zero: a torn entry is an error
/// at once, for a caller that must not wait for a writer).
pub fn lookup_within<M: ReadMem + ?Sized>(
    m: &M,
    g: &Geometry,
    key: &[u8],
    torn_wait: Duration,
) -> Result<(Option<Found>, u32), KvError> {
    let word = layout::key_word(key);
    let mut bucket = [0u8; BUCKET_LEN];
    let mut entry = Vec::new();
    let mut visited = 0;
    let mut torn = 0u32;
    let mut torn_since = None;
    'restart: loop {
        let mut b = layout::bucket_of(word, g.buckets);
        let mut skip = 0;
        let mut hops = 0;
        loop {
            m.read(g.bucket_off(b), &mut bucket)?;
            visited += 1;
            match layout::scan_bucket(&bucket, word, skip) {
                Scan::Absent => return Ok((None, visited)),
                Scan::Next(n) => {
                    if n < g.buckets || n >= g.buckets + g.overflow || hops >= layout::MAX_CHAIN {
                        return Err(KvError::Corrupt(format!("bad overflow link {n} in bucket {b}")));
                    }
                    b = n;
                    skip = 0;
                    hops += 1;
                }
                Scan::Entry { offset, class, inc } => {
                    let len = layout::class_len(class);
                    if offset + len as u64 > g.data_len {
                        return Err(KvError::Corrupt(format!(
                            "entry {offset:#x} of class {class} out of range"
                        )));
                    }
                    entry.resize(len, 0);
                    m.read(g.entry_off(offset), &mut entry)?;
                    match layout::validate(&entry, key, Some(inc)) {
                        Ok(v) => {
                            return Ok((
                                Some(Found {
                                    value: v.value.to_vec(),
                                    offset,
                                    class,
                                    inc,
                                    version: v.version,
                                }),
                                visited,
                            ))
                        }
                        Err(Invalid::Moved) if layout::entry_inc(&entry) == inc => {
                            // a consistent entry of another key with the same word: look at
                            // the next slot with this word
                            skip += 1;
                        }
                        // torn, or a stale slot (the entry was retired or reused): read the
                        // chain again from its first bucket
                        Err(why) => {
                            skip = 0;
                            torn += 1;
                            let since = *torn_since.get_or_insert_with(Instant::now);
                            if since.elapsed() >= torn_wait {
                                return Err(KvError::Corrupt(format!(
                                    "entry {offset:#x} still inconsistent ({why:?}, versions {} and {}) after {torn} reads in {torn_wait:?}",
                                    layout::entry_version(&entry),
                                    layout::entry_version(&entry[entry.len() - 8..]),
                                )));
                            }
                            if torn.is_multiple_of(8) {
                                std::thread::yield_now();
                            }
                        }
                    }
                    if skip == 0 {
                        continue 'restart;
                    }
                }
            }
        }
    }
}

/// Counters of the writer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreStats {
    /// Keys stored.
    pub keys: u64,
    /// Inserts done.
    pub inserts: u64,
    /// Updates done.
    pub updates: u64,
    /// Deletes done.
    pub deletes: u64,
    /// Updates written in place (the new value fitted the entry).
    pub in_place: u64,
    /// Entries waiting out the grace period before reuse.
    pub deferred: u64,
    /// Bytes of the data area in use.
    pub data_used: u64,
    /// Overflow buckets in use.
    pub overflow_used: u64,
    /// Keys the RedN mirror holds, and keys it could not place.
    pub mirrored: u64,
    /// Keys the mirror could not place.
    pub mirror_misses: u64,
}

/// What a write did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Written {
    /// The key was absent and is now stored.
    Inserted,
    /// The key was present and its value replaced.
    Updated,
}

/// The single writer of a partition (serialize access with a lock or own it in one thread).
pub struct Store {
    region: Arc<Region>,
    g: Geometry,
    next_overflow: u64,
    bump: u64,
    free: [Vec<u64>; CLASSES],
    deferred: VecDeque<(Instant, u64, usize)>,
    grace: Duration,
    mirror_of: HashMap<u64, u64>,
    stats: StoreStats,
}

/// How long a freed entry waits before reuse: longer than any READ stays in flight on a live
/// connection (retransmissions included); a reader that still sees reuse detects it by the
/// incarnation and key and rereads.
pub const DEFAULT_GRACE: Duration = Duration::from_millis(500);

struct Loc {
    /// Region offset of the slot, its key word and decoded word 1.
    slot_off: u64,
    slot: Slot,
}

impl Store {
    /// A store over `region` (zeroed, at least `g.region_len()` bytes).
    pub fn new(region: Arc<Region>, g: Geometry) -> Result<Store, KvError> {
        if region.len() < g.region_len() {
            return Err(KvError::Config(format!(
                "region of {} bytes, geometry needs {}",
                region.len(),
                g.region_len()
            )));
        }
        Ok(Store {
            region,
            g,
            next_overflow: 0,
            bump: 0,
            free: Default::default(),
            deferred: VecDeque::new(),
            grace: DEFAULT_GRACE,
            mirror_of: HashMap::new(),
            stats: StoreStats::default(),
        })
    }

    /// Sets the reuse grace period.
    pub fn set_grace(&mut self, d: Duration) {
        self.grace = d;
    }
    /// The store's layout in its region.
    pub fn geometry(&self) -> &Geometry {
        &self.g
    }
    /// The registered region holding the store.
    pub fn region(&self) -> &Arc<Region> {
        &self.region
    }
    /// The writer's counters so far.
    pub fn stats(&self) -> StoreStats {
        StoreStats {
            deferred: self.deferred.len() as u64,
            mirrored: self.mirror_of.len() as u64,
            ..self.stats
        }
    }

    fn load(&self, off: u64) -> u64 {
        self.region.load_u64(off as usize).unwrap_or(0)
    }
    fn store(&self, off: u64, v: u64) {
        let ok = self.region.store_u64(off as usize, v);
        debug_assert!(ok.is_some(), "store at {off:#x}");
    }

    /// Finds the slot of `key`, or `None`.
    fn find(&self, key: &[u8], word: u64) -> Result<Option<Loc>, KvError> {
        let mut b = layout::bucket_of(word, self.g.buckets);
        let mut buf = vec![0u8; 0];
        for _ in 0..=layout::MAX_CHAIN {
            let bo = self.g.bucket_off(b);
            let mut next = None;
            for i in 0..SLOTS {
                let so = bo + (i * SLOT_LEN) as u64;
                let slot = Slot::decode(self.load(so + 8));
                match slot {
                    Slot::Entry { offset, class, .. } if self.load(so) == word => {
                        buf.resize(layout::class_len(class), 0);
                        ReadMem::read(&*self.region, self.g.entry_off(offset), &mut buf)?;
                        if layout::validate(&buf, key, None).is_ok() {
                            return Ok(Some(Loc { slot_off: so, slot }));
                        }
                    }
                    Slot::Link { bucket } => next = Some(bucket),
                    _ => {}
                }
            }
            match next {
                Some(n) => b = n,
                None => return Ok(None),
            }
        }
        Err(KvError::Corrupt(format!("bucket chain of {word:#x} too long")))
    }

    /// An empty slot for a new key in the chain of `word`'s bucket, adding an overflow bucket
    /// when the chain is full.
    fn free_slot(&mut self, word: u64) -> Result<u64, KvError> {
        let mut b = layout::bucket_of(word, self.g.buckets);
        for _ in 0..=layout::MAX_CHAIN {
            let bo = self.g.bucket_off(b);
            let mut next = None;
            for i in 0..SLOTS {
                let so = bo + (i * SLOT_LEN) as u64;
                match Slot::decode(self.load(so + 8)) {
                    Slot::Empty => return Ok(so),
                    Slot::Link { bucket } => next = Some(bucket),
                    Slot::Entry { .. } => {}
                }
            }
            match next {
                Some(n) => b = n,
                None => {
                    // chain full: a new overflow bucket takes the last slot's entry, then the
                    // last slot becomes the link (one atomic store publishes it)
                    if self.next_overflow >= self.g.overflow {
                        return Err(KvError::Full("overflow buckets".into()));
                    }
                    let nb = self.g.buckets + self.next_overflow;
                    self.next_overflow += 1;
                    self.stats.overflow_used = self.next_overflow;
                    let last = bo + ((SLOTS - 1) * SLOT_LEN) as u64;
                    let nbo = self.g.bucket_off(nb);
                    self.store(nbo, self.load(last));
                    self.store(nbo + 8, self.load(last + 8));
                    self.store(last + 8, Slot::Link { bucket: nb }.encode());
                    return Ok(nbo + SLOT_LEN as u64);
                }
            }
        }
        Err(KvError::Corrupt(format!("bucket chain of {word:#x} too long")))
    }

    fn reclaim(&mut self) {
        while let Some(&(t, off, class)) = self.deferred.front() {
            if t.elapsed() < self.grace {
                break;
            }
            self.deferred.pop_front();
            self.free[class].push(off);
        }
    }

    fn alloc(&mut self, class: usize) -> Result<u64, KvError> {
        self.reclaim();
        if let Some(o) = self.free[class].pop() {
            return Ok(o);
        }
        let len = layout::class_len(class) as u64;
        if self.bump + len > self.g.data_len {
            return Err(KvError::Full(format!(
                "data area ({} bytes; {} waiting out the grace period)",
                self.g.data_len,
                self.deferred.len()
            )));
        }
        let o = self.bump;
        self.bump += len;
        self.stats.data_used = self.bump;
        Ok(o)
    }

    /// Writes an entry at data offset `o` of `class` under the version protocol: tail odd, body,
    /// head, tail. Returns the new version.
    fn write_entry(&self, o: u64, class: usize, inc: u16, key: &[u8], value: &[u8]) -> u64 {
        let len = layout::class_len(class);
        let eo = self.g.entry_off(o);
        let v = self.load(eo) & !1;
        let nv = v + 2;
        let mut buf = vec![0u8; len];
        layout::encode_entry(&mut buf, nv, inc, key, value);
        self.store(eo + len as u64 - 8, v + 1);
        let ok = self.region.write_words(eo as usize + 8, &buf[8..len - 8]);
        debug_assert!(ok.is_some());
        self.store(eo, nv);
        self.store(eo + len as u64 - 8, nv);
        nv
    }

    /// Bumps the incarnation of a retired entry (in-flight readers holding its slot now see
    /// `Moved`) and queues it for reuse after the grace period.
    fn retire(&mut self, o: u64, class: usize) {
        let len = layout::class_len(class);
        let mut buf = vec![0u8; len];
        let eo = self.g.entry_off(o);
        let _ = ReadMem::read(&*self.region, eo, &mut buf);
        let inc = u32::from_le_bytes(buf[16..20].try_into().unwrap_or_default()) as u16;
        // keep the entry self-consistent (a valid copy of nothing) with the new incarnation
        self.write_entry(o, class, (inc + 1) & 0x3fff, &[], &[]);
        self.deferred.push_back((Instant::now(), o, class));
    }

    fn next_inc(&self, o: u64) -> u16 {
        let w = self.load(self.g.entry_off(o) + 16);
        ((w as u32 as u16) + 1) & 0x3fff
    }

    /// Inserts or updates `key` (YCSB update and insert, redis SET).
    pub fn put(&mut self, key: &[u8], value: &[u8]) -> Result<Written, KvError> {
        check_kv(key, value)?;
        let word = layout::key_word(key);
        let class = layout::class_for(key.len(), value.len()).ok_or_else(|| KvError::TooLarge(value.len()))?;
        if let Some(loc) = self.find(key, word)? {
            let Slot::Entry {
                offset,
                class: old,
                inc,
            } = loc.slot
            else {
                return Err(KvError::Corrupt("found slot is not an entry".into()));
            };
            if old == class {
                self.write_entry(offset, class, inc, key, value);
                self.stats.in_place += 1;
            } else {
                let o = self.alloc(class)?;
                let ninc = self.next_inc(o);
                self.write_entry(o, class, ninc, key, value);
                self.store(
                    loc.slot_off + 8,
                    Slot::Entry {
                        offset: o,
                        class,
                        inc: ninc,
                    }
                    .encode(),
                );
                self.retire(offset, old);
                self.mirror_update(word, class, o);
            }
            self.stats.updates += 1;
            return Ok(Written::Updated);
        }
        let o = self.alloc(class)?;
        let so = match self.free_slot(word) {
            Ok(so) => so,
            Err(e) => {
                self.free[class].push(o);
                return Err(e);
            }
        };
        let inc = self.next_inc(o);
        self.write_entry(o, class, inc, key, value);
        self.store(so, word);
        self.store(so + 8, Slot::Entry { offset: o, class, inc }.encode());
        self.mirror_update(word, class, o);
        self.stats.inserts += 1;
        self.stats.keys += 1;
        Ok(Written::Inserted)
    }

    /// Inserts `key`; fails with [`KvError::Exists`] when it is there.
    pub fn insert(&mut self, key: &[u8], value: &[u8]) -> Result<(), KvError> {
        check_kv(key, value)?;
        if self.find(key, layout::key_word(key))?.is_some() {
            return Err(KvError::Exists);
        }
        self.put(key, value).map(|_| ())
    }

    /// Updates `key`; fails with [`KvError::NotFound`] when it is absent.
    pub fn update(&mut self, key: &[u8], value: &[u8]) -> Result<(), KvError> {
        check_kv(key, value)?;
        if self.find(key, layout::key_word(key))?.is_none() {
            return Err(KvError::NotFound);
        }
        self.put(key, value).map(|_| ())
    }

    /// Deletes `key`; returns whether it was there.
    pub fn delete(&mut self, key: &[u8]) -> Result<bool, KvError> {
        check_kv(key, &[])?;
        let word = layout::key_word(key);
        let Some(loc) = self.find(key, word)? else {
            return Ok(false);
        };
        let Slot::Entry { offset, class, .. } = loc.slot else {
            return Err(KvError::Corrupt("found slot is not an entry".into()));
        };
        self.mirror_remove(word);
        self.store(loc.slot_off + 8, Slot::Empty.encode());
        self.retire(offset, class);
        self.stats.deletes += 1;
        self.stats.keys -= 1;
        Ok(true)
    }

    /// Reads `key` (the writer's own view; other threads use [`lookup`] on the region).
    pub fn get(&self, key: &[u8]) -> Result<Option<Found>, KvError> {
        check_kv(key, &[])?;
        Ok(lookup(&*self.region, &self.g, key)?.0)
    }

    // ---- the RedN mirror: `{key word, entry address}` buckets, two candidates per key ----

    fn mirror_bucket_off(&self, b: u64) -> u64 {
        self.g.mirror_off + 16 * b
    }

    fn mirror_set(&mut self, b: u64, word: u64, entry_addr: u64) {
        let o = self.mirror_bucket_off(b);
        // the address before the key: a chain that matches the key finds the address valid
        self.store(o, 0);
        self.store(o + 8, entry_addr);
        self.store(o, word);
        self.mirror_of.insert(word, b);
    }

    fn mirror_clear(&mut self, b: u64) {
        let o = self.mirror_bucket_off(b);
        self.store(o, 0);
        self.store(o + 8, 0);
    }

    fn mirror_remove(&mut self, word: u64) {
        if let Some(b) = self.mirror_of.remove(&word) {
            self.mirror_clear(b);
        }
    }

    /// Mirrors `word` → the entry at data offset `o` if it is of the RedN class (a key whose
    /// word's low 48 bits are zero cannot be told from an empty mirror bucket and stays out).
    fn mirror_update(&mut self, word: u64, class: usize, o: u64) {
        if class != self.g.redn_class || word & ((1 << 48) - 1) == 0 {
            self.mirror_remove(word);
            return;
        }
        let addr = self.region.addr() + self.g.entry_off(o);
        if let Some(&b) = self.mirror_of.get(&word) {
            self.mirror_set(b, word, addr);
            return;
        }
        // cuckoo placement with a bounded number of moves
        let (mut w, mut a) = (word, addr);
        let mut from = u64::MAX;
        for _ in 0..32 {
            let c = layout::mirror_candidates(w, self.g.mirror_buckets);
            for &b in &c {
                if self.load(self.mirror_bucket_off(b)) == 0 {
                    self.mirror_set(b, w, a);
                    return;
                }
            }
            // evict the occupant of a candidate other than the bucket we just came from
            let b = if c[0] != from { c[0] } else { c[1] };
            let o = self.mirror_bucket_off(b);
            let (ow, oa) = (self.load(o), self.load(o + 8));
            self.mirror_of.remove(&ow);
            self.mirror_set(b, w, a);
            (w, a, from) = (ow, oa, b);
        }
        // the last evicted key stays out of the mirror: its RedN gets go unanswered and the
        // client falls back to the offloaded get
        self.stats.mirror_misses += 1;
    }
}

fn check_kv(key: &[u8], value: &[u8]) -> Result<(), KvError> {
    if key.is_empty() || key.len() > layout::MAX_KEY {
        return Err(KvError::BadKey(key.len()));
    }
    if value.len() > layout::MAX_VALUE {
        return Err(KvError::TooLarge(value.len()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(cap: u64) -> Store {
        let g = Geometry::for_capacity(cap, 1 << 20, 64).unwrap();
        Store::new(Arc::new(Region::alloc(g.region_len())), g).unwrap()
    }

    #[test]
    fn put_get_update_delete() {
        let mut s = store(64);
        assert_eq!(s.put(b"a", b"1").unwrap(), Written::Inserted);
        assert_eq!(s.put(b"a", b"22").unwrap(), Written::Updated);
        assert_eq!(s.get(b"a").unwrap().unwrap().value, b"22");
        // a class change moves the entry
        let big = vec![9u8; 500];
        s.put(b"a", &big).unwrap();
        assert_eq!(s.get(b"a").unwrap().unwrap().value, big);
        assert!(matches!(s.insert(b"a", b"x"), Err(KvError::Exists)));
        assert!(matches!(s.update(b"b", b"x"), Err(KvError::NotFound)));
        assert!(s.delete(b"a").unwrap());
        assert!(!s.delete(b"a").unwrap());
        assert_eq!(s.get(b"a").unwrap(), None);
        assert!(matches!(s.put(b"", b"x"), Err(KvError::BadKey(0))));
        assert!(matches!(
            s.put(b"k", &vec![0; layout::MAX_VALUE + 1]),
            Err(KvError::TooLarge(_))
        ));
    }

    #[test]
    fn chains_overflow_and_everything_stays_reachable() {
        let mut s = store(64); // 32 buckets for 100 keys: chains
        for i in 0..100u32 {
            s.put(&i.to_le_bytes(), &[i as u8; 64]).unwrap();
        }
        assert!(s.stats().overflow_used > 0);
        for i in 0..100u32 {
            assert_eq!(
                s.get(&i.to_le_bytes()).unwrap().unwrap().value,
                [i as u8; 64],
                "key {i}"
            );
        }
        for i in (0..100u32).step_by(2) {
            assert!(s.delete(&i.to_le_bytes()).unwrap());
        }
        for i in 0..100u32 {
            assert_eq!(s.get(&i.to_le_bytes()).unwrap().is_some(), i % 2 == 1);
        }
        assert_eq!(s.stats().keys, 50);
    }

    #[test]
    fn freed_entries_wait_out_the_grace_period() {
        let mut s = store(64);
        s.set_grace(Duration::from_millis(30));
        s.put(b"k", &[1; 64]).unwrap();
        let first = s.get(b"k").unwrap().unwrap();
        s.delete(b"k").unwrap();
        s.put(b"j", &[2; 64]).unwrap();
        assert_ne!(
            s.get(b"j").unwrap().unwrap().offset,
            first.offset,
            "reused before grace"
        );
        std::thread::sleep(Duration::from_millis(40));
        s.put(b"i", &[3; 64]).unwrap();
        let i = s.get(b"i").unwrap().unwrap();
        assert_eq!(i.offset, first.offset, "reused after grace");
        assert_ne!(i.inc, first.inc, "a reused entry has a new incarnation");
    }

    #[test]
    fn full_store_says_so() {
        let g = Geometry::for_capacity(16, 4096, 64).unwrap();
        let mut s = Store::new(Arc::new(Region::alloc(g.region_len())), g).unwrap();
        let mut err = None;
        for i in 0..100u32 {
            if let Err(e) = s.put(&i.to_le_bytes(), &[0; 64]) {
                err = Some(e);
                break;
            }
        }
        assert!(matches!(err, Some(KvError::Full(_))), "{err:?}");
    }

    #[test]
    fn mirror_holds_redn_class_keys_at_their_entries() {
        let mut s = store(1024);
        for i in 0..1000u32 {
            s.put(&i.to_le_bytes(), &[7; 64]).unwrap();
        }
        let st = s.stats();
        assert_eq!(st.mirrored + st.mirror_misses, 1000);
        assert!(st.mirror_misses < 5, "{st:?}");
        let g = *s.geometry();
        for i in 0..1000u32 {
            let k = i.to_le_bytes();
            let w = layout::key_word(&k);
            let Some(&b) = s.mirror_of.get(&w) else { continue };
            assert!(layout::mirror_candidates(w, g.mirror_buckets).contains(&b));
            let o = g.mirror_off + 16 * b;
            assert_eq!(s.load(o), w);
            let f = s.get(&k).unwrap().unwrap();
            assert_eq!(s.load(o + 8), s.region.addr() + g.entry_off(f.offset));
        }
        // a value of another class leaves the mirror
        let k = 5u32.to_le_bytes();
        s.put(&k, &[1; 300]).unwrap();
        assert!(!s.mirror_of.contains_key(&layout::key_word(&k)));
    }
}

#[cfg(test)]
mod race_tests {
    use super::*;

    #[test]
    fn local_lookups_succeed_while_the_writer_rewrites_in_place() {
        let g = Geometry::for_capacity(64, 1 << 16, 64).unwrap();
        let region = Arc::new(Region::alloc(g.region_len()));
        let mut s = Store::new(region.clone(), g).unwrap();
        s.put(b"k", &[0; 64]).unwrap();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let w = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut i = 0u8;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    i = i.wrapping_add(1);
                    s.put(b"k", &[i; 64]).unwrap();
                }
            })
        };
        struct Memcpy(Arc<Region>);
        impl ReadMem for Memcpy {
            fn read(&self, off: u64, buf: &mut [u8]) -> Result<(), KvError> {
                self.0.read(off as usize, buf);
                Ok(())
            }
        }
        let dma = Memcpy(region.clone());
        for i in 0..200_000 {
            let (f, _) = if i % 2 == 0 {
                lookup(&*region, &g, b"k").unwrap()
            } else {
                lookup(&dma, &g, b"k").unwrap()
            };
            let v = f.unwrap().value;
            assert!(v.iter().all(|&b| b == v[0]), "torn value {v:?}");
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        w.join().unwrap();
    }
}
