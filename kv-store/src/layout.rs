//! The memory layout shared by the server and every get path: buckets, slots, entries, and how
//! a reader validates what it copied.
//!
//! # Index
//! A cluster-chaining hash of [`BUCKET_LEN`]-byte buckets, each [`SLOTS`] slots of 16 bytes:
//!
//! | word | bits | meaning |
//! | --- | --- | --- |
//! | 0 | 64 | the key word ([`key_word`]: xxHash64 of the key bytes) |
//! | 1 | 63..62 | type: 0 empty, 1 entry, 2 link to an overflow bucket |
//! | 1 | 61..48 | incarnation of the entry (14 bits, lossy) |
//! | 1 | 47..0 | entry: byte offset in the data area, 64-aligned, size class in bits 3..0; link: overflow bucket number |
//!
//! Main buckets come first, overflow buckets after them. When a bucket is full its last slot
//! becomes a link, so a chained bucket holds 3 entries and the link.
//!
//! # Entries
//! In the data area, 64-byte aligned, in power-of-two size classes ([`class_len`]):
//!
//! | offset | field |
//! | --- | --- |
//! | 0 | head version (u64) |
//! | 8 | key word (u64) |
//! | 16 | incarnation (u32, low 14 bits) |
//! | 20 | key length (u16) |
//! | 22 | reserved (u16) |
//! | 24 | value length (u32) |
//! | 28 | CRC32C of version, key word, incarnation, lengths, key and value (u32) |
//! | 32 | key bytes, then value bytes |
//! | class − 8 | tail version (u64) |
//!
//! A writer updating in place stores `tail = v+1`, then the body, then `head = v+2`, then
//! `tail = v+2` (each an 8-byte atomic store). A reader accepts a copy only if head and tail are
//! equal and even, the CRC matches, and key and incarnation are the ones it looked for. The CRC
//! makes the check independent of the order in which a copy touched the words (the engine's
//! READ is a plain memory copy, like a NIC's DMA); the versions catch an update that rewrote
//! the same bytes.

use std::hash::Hasher;

/// Bytes per bucket.
pub const BUCKET_LEN: usize = 64;
/// Slots per bucket.
pub const SLOTS: usize = 4;
/// Bytes per slot.
pub const SLOT_LEN: usize = 16;
/// Entry header bytes before the key.
pub const ENTRY_HEADER: usize = 32;
/// Smallest entry class.
pub const MIN_CLASS: usize = 64;
/// Number of size classes (64 B .. 2 MiB).
pub const CLASSES: usize = 16;
/// Longest key.
pub const MAX_KEY: usize = 250;
/// Longest value a server accepts (the largest class minus header, key and tail).
pub const MAX_VALUE: usize = 64 * 1024;
/// Most buckets one lookup visits (its bucket and the overflow chain).
pub const MAX_CHAIN: usize = 64;

const HASH_SEED: u64 = 0x6b76_2d73_746f_7265; // "kv-store"

/// Slot types.
pub const SLOT_EMPTY: u64 = 0;
/// Slot type: an entry.
pub const SLOT_ENTRY: u64 = 1;
/// Slot type: a link to an overflow bucket.
pub const SLOT_LINK: u64 = 2;

const INC_MASK: u64 = 0x3fff;
const OFF_MASK: u64 = (1 << 48) - 1;

/// The 64-bit word a key is indexed by.
pub fn key_word(key: &[u8]) -> u64 {
    let mut h = twox_hash::XxHash64::with_seed(HASH_SEED);
    h.write(key);
    h.finish()
}

/// The main bucket of a key word in a table of `buckets` (a power of two) buckets.
pub fn bucket_of(word: u64, buckets: u64) -> u64 {
    word & (buckets - 1)
}

/// The two candidate buckets of a key word in the RedN mirror of `buckets` buckets.
pub fn mirror_candidates(word: u64, buckets: u64) -> [u64; 2] {
    let a = (word >> 17) & (buckets - 1);
    let mut b = word.rotate_left(29).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 20 & (buckets - 1);
    if a == b && buckets > 1 {
        b = a ^ 1;
    }
    [a, b]
}

/// The bytes of entry class `c`.
pub fn class_len(c: usize) -> usize {
    MIN_CLASS << c
}

/// The smallest class that holds a key of `klen` and a value of `vlen` bytes.
pub fn class_for(klen: usize, vlen: usize) -> Option<usize> {
    let need = ENTRY_HEADER + klen + vlen + 8;
    (0..CLASSES).find(|&c| class_len(c) >= need)
}

/// A decoded slot word 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// An unused slot.
    Empty,
    /// An entry at byte `offset` of the data area, of class `class`, with incarnation `inc`.
    Entry {
        /// Byte offset of the entry in the data area.
        offset: u64,
        /// Size class of the entry.
        class: usize,
        /// Incarnation of the entry (low 14 bits).
        inc: u16,
    },
    /// A link to overflow bucket `bucket` (numbered after the main buckets).
    Link {
        /// Overflow bucket number.
        bucket: u64,
    },
}

impl Slot {
    /// Decodes slot word 1.
    pub fn decode(w: u64) -> Slot {
        match w >> 62 {
            SLOT_ENTRY => Slot::Entry {
                offset: w & OFF_MASK & !63,
                class: (w & 15) as usize,
                inc: ((w >> 48) & INC_MASK) as u16,
            },
            SLOT_LINK => Slot::Link { bucket: w & OFF_MASK },
            _ => Slot::Empty,
        }
    }

    /// Encodes slot word 1.
    pub fn encode(self) -> u64 {
        match self {
            Slot::Empty => 0,
            Slot::Entry { offset, class, inc } => {
                debug_assert!(offset.is_multiple_of(64) && class < CLASSES);
                SLOT_ENTRY << 62 | (inc as u64 & INC_MASK) << 48 | (offset & OFF_MASK) | class as u64
            }
            Slot::Link { bucket } => SLOT_LINK << 62 | (bucket & OFF_MASK),
        }
    }
}

/// One slot of a bucket: the key word and the decoded word 1.
pub fn bucket_slot(bucket: &[u8], i: usize) -> (u64, Slot) {
    let o = i * SLOT_LEN;
    let w0 = u64::from_le_bytes(bucket[o..o + 8].try_into().unwrap_or_default());
    let w1 = u64::from_le_bytes(bucket[o + 8..o + 16].try_into().unwrap_or_default());
    (w0, Slot::decode(w1))
}

/// What a lookup does next after scanning one bucket copy for `word`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scan {
    /// A slot with the key word: read this entry.
    Entry {
        /// Byte offset of the entry in the data area.
        offset: u64,
        /// Size class of the entry.
        class: usize,
        /// Incarnation of the entry (low 14 bits).
        inc: u16,
    },
    /// Not here: follow the link to this overflow bucket.
    Next(u64),
    /// The chain ends without the key.
    Absent,
}

/// Scans a bucket copy for `word`; `skip` slots with a matching word are passed over (a
/// candidate whose entry turned out to hold another key with the same word).
pub fn scan_bucket(bucket: &[u8], word: u64, skip: usize) -> Scan {
    let mut skipped = 0;
    let mut next = None;
    for i in 0..SLOTS {
        match bucket_slot(bucket, i) {
            (w, Slot::Entry { offset, class, inc }) if w == word => {
                if skipped == skip {
                    return Scan::Entry { offset, class, inc };
                }
                skipped += 1;
            }
            (_, Slot::Link { bucket }) => next = Some(bucket),
            _ => {}
        }
    }
    next.map_or(Scan::Absent, Scan::Next)
}

/// Why an entry copy was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Invalid {
    /// Versions differ or are odd, lengths are out of range, or the CRC fails: an update was in
    /// progress during the copy; read it again.
    Torn,
    /// A consistent entry of another key or incarnation: the slot was stale (the entry was
    /// freed or reused); read the bucket again.
    Moved,
}

/// A validated entry copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntryView<'a> {
    /// The entry's version (head and tail agreed, even).
    pub version: u64,
    /// Incarnation of the entry (low 14 bits).
    pub inc: u16,
    /// The value bytes.
    pub value: &'a [u8],
}

fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().unwrap_or_default())
}
fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().unwrap_or_default())
}

fn entry_crc(version: u64, word: u64, inc: u32, klen: u16, vlen: u32, key: &[u8], value: &[u8]) -> u32 {
    let mut h = [0u8; 26];
    h[..8].copy_from_slice(&version.to_le_bytes());
    h[8..16].copy_from_slice(&word.to_le_bytes());
    h[16..20].copy_from_slice(&inc.to_le_bytes());
    h[20..22].copy_from_slice(&klen.to_le_bytes());
    h[22..26].copy_from_slice(&vlen.to_le_bytes());
    let c = crc32c::crc32c(&h);
    let c = crc32c::crc32c_append(c, key);
    crc32c::crc32c_append(c, value)
}

/// Encodes an entry of `len` bytes (its class) at version `version` (even) into `out`, with the
/// tail version set to `version` as well (the writer stores the versions separately).
pub fn encode_entry(out: &mut [u8], version: u64, inc: u16, key: &[u8], value: &[u8]) {
    let len = out.len();
    out.fill(0);
    let word = key_word(key);
    let crc = entry_crc(
        version,
        word,
        inc as u32,
        key.len() as u16,
        value.len() as u32,
        key,
        value,
    );
    out[0..8].copy_from_slice(&version.to_le_bytes());
    out[8..16].copy_from_slice(&word.to_le_bytes());
    out[16..20].copy_from_slice(&(inc as u32).to_le_bytes());
    out[20..22].copy_from_slice(&(key.len() as u16).to_le_bytes());
    out[24..28].copy_from_slice(&(value.len() as u32).to_le_bytes());
    out[28..32].copy_from_slice(&crc.to_le_bytes());
    out[ENTRY_HEADER..ENTRY_HEADER + key.len()].copy_from_slice(key);
    out[ENTRY_HEADER + key.len()..ENTRY_HEADER + key.len() + value.len()].copy_from_slice(value);
    out[len - 8..].copy_from_slice(&version.to_le_bytes());
}

/// The head version of an entry copy.
pub fn entry_version(e: &[u8]) -> u64 {
    u64_at(e, 0)
}

/// The incarnation field of an entry copy.
pub fn entry_inc(e: &[u8]) -> u16 {
    e.get(16..20).map_or(u16::MAX, |b| {
        u32::from_le_bytes(b.try_into().unwrap_or_default()) as u16
    })
}

/// Validates an entry copy (its whole class) for `key`, and for incarnation `inc` when the
/// reader got one from a slot.
pub fn validate<'a>(e: &'a [u8], key: &[u8], inc: Option<u16>) -> Result<EntryView<'a>, Invalid> {
    if e.len() < ENTRY_HEADER + 8 {
        return Err(Invalid::Torn);
    }
    let (head, tail) = (u64_at(e, 0), u64_at(e, e.len() - 8));
    if head != tail || head & 1 == 1 {
        return Err(Invalid::Torn);
    }
    let word = u64_at(e, 8);
    let einc = u32_at(e, 16);
    let klen = u16::from_le_bytes([e[20], e[21]]);
    let vlen = u32_at(e, 24);
    let crc = u32_at(e, 28);
    let kend = ENTRY_HEADER + klen as usize;
    let vend = kend + vlen as usize;
    if vend + 8 > e.len() || einc > INC_MASK as u32 {
        return Err(Invalid::Torn);
    }
    let (k, v) = (&e[ENTRY_HEADER..kend], &e[kend..vend]);
    if entry_crc(head, word, einc, klen, vlen, k, v) != crc {
        return Err(Invalid::Torn);
    }
    if k != key || inc.is_some_and(|i| i as u32 != einc) {
        return Err(Invalid::Moved);
    }
    Ok(EntryView {
        version: head,
        inc: einc as u16,
        value: v,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_round_trip() {
        for s in [
            Slot::Empty,
            Slot::Entry {
                offset: 64 * 12345,
                class: 3,
                inc: 0x3fff,
            },
            Slot::Link { bucket: 77 },
        ] {
            assert_eq!(Slot::decode(s.encode()), s);
        }
    }

    #[test]
    fn entries_validate_and_detect_tearing() {
        let (key, value) = (b"user0001".as_slice(), [7u8; 64]);
        let c = class_for(key.len(), value.len()).unwrap();
        assert_eq!(class_len(c), 128);
        let mut e = vec![0u8; class_len(c)];
        encode_entry(&mut e, 4, 9, key, &value);
        let v = validate(&e, key, Some(9)).unwrap();
        assert_eq!((v.version, v.value), (4, &value[..]));
        assert_eq!(validate(&e, key, Some(8)), Err(Invalid::Moved));
        assert_eq!(validate(&e, b"user0002", None), Err(Invalid::Moved));
        // a torn copy: new value bytes, old versions/CRC
        let mut t = e.clone();
        t[ENTRY_HEADER + 8 + 5] ^= 1;
        assert_eq!(validate(&t, key, None), Err(Invalid::Torn));
        // an update in progress: tail odd
        let mut t = e.clone();
        let n = t.len();
        t[n - 8..].copy_from_slice(&5u64.to_le_bytes());
        assert_eq!(validate(&t, key, None), Err(Invalid::Torn));
        // garbage lengths never panic
        let mut t = e.clone();
        t[24..28].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(validate(&t, key, None), Err(Invalid::Torn));
        assert_eq!(validate(&e[..16], key, None), Err(Invalid::Torn));
    }

    #[test]
    fn scan_finds_skips_and_follows() {
        let mut b = [0u8; BUCKET_LEN];
        let put = |b: &mut [u8; BUCKET_LEN], i: usize, w0: u64, s: Slot| {
            b[i * 16..i * 16 + 8].copy_from_slice(&w0.to_le_bytes());
            b[i * 16 + 8..i * 16 + 16].copy_from_slice(&s.encode().to_le_bytes());
        };
        let e = |o| Slot::Entry {
            offset: o,
            class: 1,
            inc: 2,
        };
        put(&mut b, 0, 5, e(64));
        put(&mut b, 1, 9, e(128));
        put(&mut b, 2, 9, e(192));
        assert_eq!(
            scan_bucket(&b, 9, 0),
            Scan::Entry {
                offset: 128,
                class: 1,
                inc: 2
            }
        );
        assert_eq!(
            scan_bucket(&b, 9, 1),
            Scan::Entry {
                offset: 192,
                class: 1,
                inc: 2
            }
        );
        assert_eq!(scan_bucket(&b, 9, 2), Scan::Absent);
        put(&mut b, 3, 0, Slot::Link { bucket: 40 });
        assert_eq!(scan_bucket(&b, 11, 0), Scan::Next(40));
    }

    #[test]
    fn mirror_candidates_differ() {
        for w in [0u64, 1, u64::MAX, 0xdead_beef] {
            let [a, b] = mirror_candidates(key_word(&w.to_le_bytes()), 1024);
            assert_ne!(a, b);
            assert!(a < 1024 && b < 1024);
        }
    }
}
