//! The gets served inside the stack: offload handlers registered with the context's offload
//! engine, running next to the data (on the data core, or the engine's offload threads), with
//! no application thread involved.
//!
//! - [`get_handler`] ([`OFFLOAD_GET`]): walks the key's bucket chain with engine DMA reads,
//!   validates the entry (versions, CRC, key, incarnation), rereads a torn copy locally, and
//!   replies with the value: one round trip. It and the multi-get are registered inline: they
//!   run on the data core that received the request, and only a torn entry (a write in
//!   progress) moves them to the offload threads to be reread there.
//! - [`hybrid_handler`] ([`OFFLOAD_HYBRID_GET`], DrTM-KV A4+A5): a bounded [`HotCache`] of
//!   values answers hot keys directly; for any other key the handler walks only the index and
//!   answers with the entry's address, which the client READs (the value stays in host memory
//!   and never crosses the offload threads).

use crate::layout::{self, Scan, BUCKET_LEN};
use crate::proto::*;
use crate::store::{self, Geometry, ReadMem};
use crate::KvError;
use netstack::offload::{OffloadCall, OffloadError, OffloadHandler};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

/// The store's region as handlers reach it: its address and the rkey every DMA names (checked
/// against the requesting QP's protection domain, as that QP's own READ would be).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapped {
    /// Address of the store's region.
    pub base: u64,
    /// The rkey of the store's region.
    pub rkey: u32,
}

/// DMA reads through an offload call, at region offsets.
struct DmaMem<'a> {
    call: &'a OffloadCall,
    at: Mapped,
}

impl ReadMem for DmaMem<'_> {
    fn read(&self, off: u64, buf: &mut [u8]) -> Result<(), KvError> {
        self.call
            .dma_read(self.at.rkey, self.at.base + off, buf)
            .map_err(|e| KvError::Corrupt(e.to_string()))
    }
}

fn key_of(call: &OffloadCall) -> Result<Vec<u8>, OffloadError> {
    let k = call.request();
    if k.is_empty() || k.len() > layout::MAX_KEY {
        return Err(OffloadError::BadRequest(format!(
            "key of {} bytes (1 to {})",
            k.len(),
            layout::MAX_KEY
        )));
    }
    Ok(k.to_vec())
}

fn reply(mut call: OffloadCall, r: GetReply, payload: &[u8]) -> Result<netstack::offload::OffloadReply, OffloadError> {
    call.alloc_resp(GET_REPLY_HEADER + payload.len())?;
    let out = call.resp_mut();
    r.encode(&mut out[..GET_REPLY_HEADER]);
    out[GET_REPLY_HEADER..].copy_from_slice(payload);
    call.submit_resp()
}

/// Looks `key` up from a handler. An inline handler runs on a data core, where waiting for a
/// writer would stall the core's other QPs: the first lookup does not reread a torn entry (a
/// write in progress); then the handler yields, which moves it to the offload threads, and
/// looks up again there, rereading for up to [`store::MAX_TORN_WAIT`].
async fn lookup(
    call: &OffloadCall,
    at: Mapped,
    g: &Geometry,
    key: &[u8],
) -> Result<Option<store::Found>, OffloadError> {
    let mem = DmaMem { call, at };
    if let Ok((found, _)) = store::lookup_within(&mem, g, key, std::time::Duration::ZERO) {
        return Ok(found);
    }
    tokio::task::yield_now().await;
    Ok(store::lookup(&mem, g, key)
        .map_err(|e| OffloadError::Handler(e.to_string()))?
        .0)
}

/// The offloaded get of the store at `at`.
pub fn get_handler(at: Mapped, g: Geometry) -> impl OffloadHandler {
    move |call: OffloadCall| async move {
        let key = key_of(&call)?;
        let found = lookup(&call, at, &g, &key).await?;
        match found {
            Some(f) => reply(
                call,
                GetReply {
                    status: GET_FOUND,
                    len: f.value.len() as u32,
                    arg: f.version,
                },
                &f.value,
            ),
            None => reply(
                call,
                GetReply {
                    status: GET_NOT_FOUND,
                    len: 0,
                    arg: 0,
                },
                &[],
            ),
        }
    }
}

/// The offloaded multi-get: every key of the request looked up next to the data, the replies
/// back to back (`GetReply` and value each); a value that no longer fits the client's buffer is
/// answered `GET_NO_ROOM`.
pub fn multi_get_handler(at: Mapped, g: Geometry) -> impl OffloadHandler {
    move |mut call: OffloadCall| async move {
        let keys: Vec<Vec<u8>> = decode_multi_get(call.request())
            .map_err(OffloadError::BadRequest)?
            .into_iter()
            .map(|k| k.to_vec())
            .collect();
        let cap = call.resp_capacity();
        let mut out = Vec::with_capacity(cap.min(64 * 1024));
        for k in &keys {
            let found = lookup(&call, at, &g, k).await?;
            // room for this reply and a header for each key after it
            let after = (keys.len() - 1) * GET_REPLY_HEADER;
            let (r, v): (GetReply, &[u8]) = match &found {
                Some(f) if out.len() + GET_REPLY_HEADER + f.value.len() + after <= cap => (
                    GetReply {
                        status: GET_FOUND,
                        len: f.value.len() as u32,
                        arg: f.version,
                    },
                    &f.value,
                ),
                Some(_) => (
                    GetReply {
                        status: GET_NO_ROOM,
                        len: 0,
                        arg: 0,
                    },
                    &[],
                ),
                None => (not_found(), &[]),
            };
            let mut h = [0u8; GET_REPLY_HEADER];
            r.encode(&mut h);
            out.extend_from_slice(&h);
            out.extend_from_slice(v);
        }
        call.alloc_resp(out.len())?;
        call.resp_mut().copy_from_slice(&out);
        call.submit_resp()
    }
}

struct Hot {
    key: Box<[u8]>,
    value: Arc<[u8]>,
    /// Region offset and version of the entry the value was copied from: a hit is served only
    /// while the entry still has this version (one 8-byte load next to the data).
    entry_off: u64,
    version: u64,
    last: u64,
}

/// Counters of the hot-value cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct HotStats {
    /// Gets served from the cache.
    pub hits: u64,
    /// Gets not found in the cache.
    pub misses: u64,
    /// Hits refused because the entry changed since it was cached.
    pub stale: u64,
    /// Values copied into the cache.
    pub admitted: u64,
    /// Values dropped from the cache to make room.
    pub evicted: u64,
    /// Values in the cache now.
    pub entries: u64,
}

/// A bounded cache of hot values in the engine (DrTM-KV A5). Keys are admitted once a small
/// counting sketch has seen them `admit_after` times (the counts halve periodically, so the
/// cache follows a changing hot set); when full, the least recently used of a sample is evicted.
pub struct HotCache {
    cap: usize,
    admit_after: u8,
    map: Mutex<HashMap<u64, Hot>>,
    sketch: Box<[AtomicU8]>,
    clock: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    stale: AtomicU64,
    admitted: AtomicU64,
    evicted: AtomicU64,
}

impl HotCache {
    /// A cache of at most `cap` values (0 disables it: every hybrid get answers an address).
    pub fn new(cap: usize, admit_after: u8) -> HotCache {
        let slots = (cap * 16).max(1024).next_power_of_two();
        HotCache {
            cap,
            admit_after: admit_after.max(1),
            map: Mutex::new(HashMap::with_capacity(cap)),
            sketch: (0..slots).map(|_| AtomicU8::new(0)).collect(),
            clock: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            stale: AtomicU64::new(0),
            admitted: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
        }
    }

    /// The cache's counters so far.
    pub fn stats(&self) -> HotStats {
        HotStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            stale: self.stale.load(Ordering::Relaxed),
            admitted: self.admitted.load(Ordering::Relaxed),
            evicted: self.evicted.load(Ordering::Relaxed),
            entries: self.map.lock().len() as u64,
        }
    }

    fn tick(&self) -> u64 {
        let t = self.clock.fetch_add(1, Ordering::Relaxed);
        if t > 0 && t.is_multiple_of(self.sketch.len() as u64 * 4) {
            for c in self.sketch.iter() {
                c.store(c.load(Ordering::Relaxed) / 2, Ordering::Relaxed);
            }
        }
        t
    }

    /// Counts an access; true when the key is hot enough to admit.
    fn count(&self, word: u64) -> bool {
        if self.cap == 0 {
            return false;
        }
        let c = &self.sketch[(word.rotate_right(13) as usize) & (self.sketch.len() - 1)];
        let n = c.load(Ordering::Relaxed).saturating_add(1);
        c.store(n, Ordering::Relaxed);
        n >= self.admit_after
    }

    /// The cached value of `key` if its entry still has the cached version.
    fn get(&self, word: u64, key: &[u8], now: u64, version_of: impl Fn(u64) -> Option<u64>) -> Option<Arc<[u8]>> {
        let mut m = self.map.lock();
        let h = m.get_mut(&word)?;
        if &*h.key != key {
            return None;
        }
        if version_of(h.entry_off) != Some(h.version) {
            m.remove(&word);
            self.stale.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        h.last = now;
        Some(h.value.clone())
    }

    fn admit(&self, word: u64, key: &[u8], f: &store::Found, g: &Geometry, now: u64) {
        let mut m = self.map.lock();
        if m.len() >= self.cap && !m.contains_key(&word) {
            // evict the least recently used of a sample
            let victim = m.iter().take(16).min_by_key(|(_, h)| h.last).map(|(&w, _)| w);
            if let Some(v) = victim {
                m.remove(&v);
                self.evicted.fetch_add(1, Ordering::Relaxed);
            }
        }
        m.insert(
            word,
            Hot {
                key: key.into(),
                value: f.value.as_slice().into(),
                entry_off: g.entry_off(f.offset),
                version: f.version,
                last: now,
            },
        );
        self.admitted.fetch_add(1, Ordering::Relaxed);
    }
}

/// Walks the index only: the slot of `key`'s word (the client validates the entry it READs).
fn locate<M: ReadMem>(m: &M, g: &Geometry, word: u64) -> Result<Option<(u64, usize, u16)>, KvError> {
    let mut b = layout::bucket_of(word, g.buckets);
    let mut bucket = [0u8; BUCKET_LEN];
    for _ in 0..=layout::MAX_CHAIN {
        m.read(g.bucket_off(b), &mut bucket)?;
        match layout::scan_bucket(&bucket, word, 0) {
            Scan::Entry { offset, class, inc } => return Ok(Some((g.entry_off(offset), class, inc))),
            Scan::Next(n) if n >= g.buckets && n < g.buckets + g.overflow => b = n,
            Scan::Next(n) => return Err(KvError::Corrupt(format!("bad overflow link {n}"))),
            Scan::Absent => return Ok(None),
        }
    }
    Err(KvError::Corrupt("bucket chain too long".into()))
}

/// The hybrid get (A4+A5) of the store at `at`.
pub fn hybrid_handler(at: Mapped, g: Geometry, cache: Arc<HotCache>) -> impl OffloadHandler {
    move |call: OffloadCall| {
        let cache = cache.clone();
        async move {
            let key = key_of(&call)?;
            let word = layout::key_word(&key);
            let now = cache.tick();
            let mem = DmaMem { call: &call, at };
            let version_of = |off: u64| call.dma_load_u64(at.rkey, at.base + off).ok();
            if let Some(v) = cache.get(word, &key, now, version_of) {
                cache.hits.fetch_add(1, Ordering::Relaxed);
                let r = GetReply {
                    status: GET_HOT,
                    len: v.len() as u32,
                    arg: 0,
                };
                return reply(call, r, &v);
            }
            cache.misses.fetch_add(1, Ordering::Relaxed);
            let err = |e: KvError| OffloadError::Handler(e.to_string());
            if cache.count(word) {
                // hot: copy the value once (validated), cache it, and answer with it
                let found = store::lookup(&mem, &g, &key).map_err(err)?.0;
                return match found {
                    Some(f) => {
                        cache.admit(word, &key, &f, &g, now);
                        let r = GetReply {
                            status: GET_FOUND,
                            len: f.value.len() as u32,
                            arg: f.version,
                        };
                        reply(call, r, &f.value)
                    }
                    None => reply(call, not_found(), &[]),
                };
            }
            match locate(&mem, &g, word).map_err(err)? {
                Some((entry_off, class, inc)) => {
                    let r = GetReply {
                        status: GET_ADDRESS,
                        len: layout::class_len(class) as u32,
                        arg: entry_off,
                    };
                    reply(call, r, &(inc as u64).to_le_bytes())
                }
                None => reply(call, not_found(), &[]),
            }
        }
    }
}

fn not_found() -> GetReply {
    GetReply {
        status: GET_NOT_FOUND,
        len: 0,
        arg: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admission_needs_repeated_access_and_hits_check_the_version() {
        let c = HotCache::new(2, 3);
        let w = 77;
        assert!(!c.count(w));
        assert!(!c.count(w));
        assert!(c.count(w));
        let g = Geometry::for_capacity(16, 4096, 64).unwrap();
        let f = store::Found {
            value: vec![1, 2, 3],
            offset: 0,
            class: 1,
            inc: 1,
            version: 4,
        };
        c.admit(w, b"k", &f, &g, 1);
        assert_eq!(c.get(w, b"k", 2, |_| Some(4)).as_deref(), Some(&[1u8, 2, 3][..]));
        assert!(c.get(w, b"other", 2, |_| Some(4)).is_none());
        // the entry changed: the cached value is dropped, not served
        assert!(c.get(w, b"k", 3, |_| Some(6)).is_none());
        assert_eq!(c.stats().stale, 1);
        assert!(c.get(w, b"k", 3, |_| Some(4)).is_none());
        // bounded
        for i in 0..10u64 {
            c.admit(100 + i, b"x", &f, &g, 10 + i);
        }
        assert!(c.stats().entries <= 2);
        assert!(HotCache::new(0, 1).count(5).eq(&false));
    }
}
