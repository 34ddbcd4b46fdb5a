//! Built-in offload handlers: batched READ, linked-list traversal and hash-bucket-chain lookup.
//! Register them with any opcode ([`super::OffloadEngine::register_opcode`]); their request and
//! response formats (little-endian) are below, with client-side encoders.

use super::{DmaOp, OffloadCall, OffloadError};

/// Conventional opcode of the batched READ (any free opcode works).
pub const BATCH_READ: u16 = 0x0B01;
/// Conventional opcode of the linked-list walk.
pub const LIST_WALK: u16 = 0x0B02;
/// Conventional opcode of the hash lookup.
pub const HASH_LOOKUP: u16 = 0x0B03;

/// Lookup result code (first word of a list-walk or hash-lookup response): the key was found.
pub const FOUND: u32 = 0;
/// Lookup result code: the key is not there.
pub const NOT_FOUND: u32 = 1;
/// The walk stopped at its hop bound before finding the key or the end.
pub const HOP_LIMIT: u32 = 2;

fn u32_at(b: &[u8], off: usize) -> Result<u32, OffloadError> {
    b.get(off..off + 4)
        .map(|s| u32::from_le_bytes(s.try_into().unwrap_or_default()))
        .ok_or_else(|| OffloadError::BadRequest(format!("request shorter than {} bytes", off + 4)))
}

fn u64_at(b: &[u8], off: usize) -> Result<u64, OffloadError> {
    b.get(off..off + 8)
        .map(|s| u64::from_le_bytes(s.try_into().unwrap_or_default()))
        .ok_or_else(|| OffloadError::BadRequest(format!("request shorter than {} bytes", off + 8)))
}

/// Batched READ request: `count: u32, 0: u32`, then `count` entries of
/// `{addr: u64, len: u32, rkey: u32}`. The response is the `count` ranges back to back. Each
/// range is checked as a READ with its rkey from the requesting QP would be.
///
/// Encodes a request for `ranges` (host address, length), all reached with `rkey`.
pub fn encode_batch_read(rkey: u32, ranges: &[(u64, u32)]) -> Vec<u8> {
    let mut v = Vec::with_capacity(8 + 16 * ranges.len());
    v.extend_from_slice(&(ranges.len() as u32).to_le_bytes());
    v.extend_from_slice(&0u32.to_le_bytes());
    for &(a, l) in ranges {
        v.extend_from_slice(&a.to_le_bytes());
        v.extend_from_slice(&l.to_le_bytes());
        v.extend_from_slice(&rkey.to_le_bytes());
    }
    v
}

/// The batched READ handler (FlexiNS Appendix A.3): one DMA per range into one response.
pub fn batch_read() -> impl super::OffloadHandler {
    |mut call: OffloadCall| async move {
        let req = call.request();
        let n = u32_at(req, 0)? as usize;
        if req.len() != 8 + 16 * n {
            return Err(OffloadError::BadRequest(format!(
                "{n} ranges need {} request bytes, got {}",
                8 + 16 * n,
                req.len()
            )));
        }
        let mut ranges = Vec::with_capacity(n);
        let mut total = 0usize;
        for i in 0..n {
            let (a, l, k) = (
                u64_at(req, 8 + 16 * i)?,
                u32_at(req, 16 + 16 * i)? as usize,
                u32_at(req, 20 + 16 * i)?,
            );
            ranges.push((a, k, total, l));
            total += l;
        }
        call.alloc_resp(total)?;
        let mut last = None;
        for (a, k, off, l) in ranges {
            last = Some(call.submit_dma(DmaOp::Read, k, a, off, l)?);
        }
        if let Some(id) = last {
            call.wait_dma(id).await?;
        }
        call.submit_resp()
    }
}

/// Node layout of a linked list in host memory: the key (u64) at `key_off`, the host address
/// of the next node (u64, 0 ends the list) at `next_off`, and `value_len` value bytes at
/// `value_off`, all within `node_len` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListLayout {
    /// Bytes of a node.
    pub node_len: usize,
    /// Where its key is.
    pub key_off: usize,
    /// Where its next pointer is.
    pub next_off: usize,
    /// Where its value is.
    pub value_off: usize,
    /// Bytes of value.
    pub value_len: usize,
}

impl ListLayout {
    /// `{key, next, value[value_len]}`, the layout of the benchmarks (8 B key, 64 B value).
    pub fn packed(value_len: usize) -> ListLayout {
        ListLayout {
            node_len: 16 + value_len,
            key_off: 0,
            next_off: 8,
            value_off: 16,
            value_len,
        }
    }
    fn check(&self) -> Result<(), OffloadError> {
        let ok = self.key_off + 8 <= self.node_len
            && self.next_off + 8 <= self.node_len
            && self.value_off + self.value_len <= self.node_len
            && self.node_len <= 1 << 16;
        if ok {
            Ok(())
        } else {
            Err(OffloadError::BadRequest(format!("inconsistent list layout {self:?}")))
        }
    }
}

/// List-walk request: `key: u64, head: u64 (host address), max_hops: u32, rkey: u32` (the key
/// every node is read with).
/// Response: `status: u32 (FOUND, NOT_FOUND, HOP_LIMIT), hops: u32`, then the value if found.
pub fn encode_list_walk(key: u64, head: u64, max_hops: u32, rkey: u32) -> Vec<u8> {
    let mut v = Vec::with_capacity(24);
    v.extend_from_slice(&key.to_le_bytes());
    v.extend_from_slice(&head.to_le_bytes());
    v.extend_from_slice(&max_hops.to_le_bytes());
    v.extend_from_slice(&rkey.to_le_bytes());
    v
}

/// The linked-list traversal handler: one DMA per node, next to the data.
pub fn list_walk(layout: ListLayout) -> impl super::OffloadHandler {
    move |mut call: OffloadCall| async move {
        layout.check()?;
        let req = call.request();
        let (key, mut node, max_hops, rkey) = (u64_at(req, 0)?, u64_at(req, 8)?, u32_at(req, 16)?, u32_at(req, 20)?);
        let mut buf = vec![0u8; layout.node_len];
        let mut hops = 0u32;
        let status = loop {
            if node == 0 {
                break NOT_FOUND;
            }
            if hops == max_hops {
                break HOP_LIMIT;
            }
            call.dma_read(rkey, node, &mut buf)?;
            hops += 1;
            let k = u64::from_le_bytes(buf[layout.key_off..layout.key_off + 8].try_into().unwrap_or_default());
            if k == key {
                break FOUND;
            }
            node = u64::from_le_bytes(buf[layout.next_off..layout.next_off + 8].try_into().unwrap_or_default());
        };
        let vlen = if status == FOUND { layout.value_len } else { 0 };
        call.alloc_resp(8 + vlen)?;
        let r = call.resp_mut();
        r[..4].copy_from_slice(&status.to_le_bytes());
        r[4..8].copy_from_slice(&hops.to_le_bytes());
        r[8..].copy_from_slice(&buf[layout.value_off..layout.value_off + vlen]);
        call.submit_resp()
    }
}

/// Layout of a chained hash table in host memory (DrTM-style cluster chaining).
///
/// `buckets` buckets of `bucket_len` bytes from `table_addr`; each holds `slots` slots of
/// `slot_len` bytes with the key (u64, 0 = empty) at `key_off` and an entry word (u64) at
/// `ptr_off`; the entry's host address is `data_base + (word & ptr_mask)`. The bucket's u64 at
/// `link_off` is the host address of its overflow bucket (0 = none). An entry holds its value
/// length (u32) at `len_off` and the value at `value_off`, at most `max_value` bytes. The
/// table and the entries are read with `rkey` (checked against each requesting QP as its own
/// READ would be).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HashLayout {
    /// The key the table and the entries are read with.
    pub rkey: u32,
    /// Host address of bucket 0.
    pub table_addr: u64,
    /// Buckets in the table.
    pub buckets: u64,
    /// Bytes of a bucket.
    pub bucket_len: usize,
    /// Slots per bucket.
    pub slots: usize,
    /// Bytes of a slot.
    pub slot_len: usize,
    /// Where a slot's key is.
    pub key_off: usize,
    /// Where a slot's entry word is.
    pub ptr_off: usize,
    /// Where a bucket's overflow link is.
    pub link_off: usize,
    /// Host address entry words are relative to.
    pub data_base: u64,
    /// The bits of an entry word that are its offset.
    pub ptr_mask: u64,
    /// Where an entry's value length is.
    pub len_off: usize,
    /// Where an entry's value is.
    pub value_off: usize,
    /// Largest value.
    pub max_value: usize,
    /// Most buckets visited per lookup (the bucket and its overflow chain).
    pub max_chain: u32,
}

impl HashLayout {
    fn check(&self) -> Result<(), OffloadError> {
        let ok = self.buckets > 0
            && self.slots * self.slot_len <= self.bucket_len
            && self.key_off + 8 <= self.slot_len
            && self.ptr_off + 8 <= self.slot_len
            && self.link_off + 8 <= self.bucket_len
            && self.bucket_len <= 4096
            && self.max_value <= super::MAX_OFFLOAD_RESP as usize;
        if ok {
            Ok(())
        } else {
            Err(OffloadError::BadRequest(format!("inconsistent hash layout {self:?}")))
        }
    }
}

/// Hash-lookup request: `key: u64, bucket: u64` (the client hashes). Response: `status: u32,
/// buckets visited: u32`, then the value if found.
pub fn encode_hash_lookup(key: u64, bucket: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(16);
    v.extend_from_slice(&key.to_le_bytes());
    v.extend_from_slice(&bucket.to_le_bytes());
    v
}

/// The hash-bucket-chain lookup handler.
pub fn hash_lookup(layout: HashLayout) -> impl super::OffloadHandler {
    move |mut call: OffloadCall| async move {
        layout.check()?;
        let req = call.request();
        let (key, bucket) = (u64_at(req, 0)?, u64_at(req, 8)?);
        if bucket >= layout.buckets || key == 0 {
            return Err(OffloadError::BadRequest(format!(
                "bucket {bucket} of {} (key {key:#x})",
                layout.buckets
            )));
        }
        let mut addr = layout.table_addr + bucket * layout.bucket_len as u64;
        let mut b = vec![0u8; layout.bucket_len];
        let mut visited = 0u32;
        let mut found = None;
        while addr != 0 && visited < layout.max_chain && found.is_none() {
            call.dma_read(layout.rkey, addr, &mut b)?;
            visited += 1;
            for s in 0..layout.slots {
                let o = s * layout.slot_len;
                let k = u64::from_le_bytes(
                    b[o + layout.key_off..o + layout.key_off + 8]
                        .try_into()
                        .unwrap_or_default(),
                );
                if k == key {
                    let w = u64::from_le_bytes(
                        b[o + layout.ptr_off..o + layout.ptr_off + 8]
                            .try_into()
                            .unwrap_or_default(),
                    );
                    found = Some(layout.data_base.wrapping_add(w & layout.ptr_mask));
                    break;
                }
            }
            addr = u64::from_le_bytes(b[layout.link_off..layout.link_off + 8].try_into().unwrap_or_default());
        }
        let Some(entry) = found else {
            call.alloc_resp(8)?;
            let st = if addr != 0 { HOP_LIMIT } else { NOT_FOUND };
            call.resp_mut()[..4].copy_from_slice(&st.to_le_bytes());
            call.resp_mut()[4..8].copy_from_slice(&visited.to_le_bytes());
            return call.submit_resp();
        };
        let mut lb = [0u8; 4];
        call.dma_read(layout.rkey, entry + layout.len_off as u64, &mut lb)?;
        let len = u32::from_le_bytes(lb) as usize;
        if len > layout.max_value {
            return Err(OffloadError::Handler(format!(
                "entry at {entry:#x} claims {len} bytes (most {})",
                layout.max_value
            )));
        }
        call.alloc_resp(8 + len)?;
        call.resp_mut()[..4].copy_from_slice(&FOUND.to_le_bytes());
        call.resp_mut()[4..8].copy_from_slice(&visited.to_le_bytes());
        let id = call.submit_dma(DmaOp::Read, layout.rkey, entry + layout.value_off as u64, 8, len)?;
        call.wait_dma(id).await?;
        call.submit_resp()
    }
}
