//! The KV-cache layer: a paged KV-cache pool laid out like vLLM's (layers × K/V × blocks of
//! `block_tokens` tokens × KV heads × head dim), and the requests that move exactly one LLM
//! request's blocks from a prefill node's pool into a decode node's pre-allocated blocks in one
//! batch, with a notification naming the blocks that landed.

use crate::batch::{Notification, Opcode, SegmentHandle, TransferRequest};
use crate::TransferError;

/// How blocks sit in the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum BlockOrder {
    /// vLLM's per-layer tensors `[2 (K, V)][num_blocks][block_tokens][kv_heads][head_dim]`,
    /// one after the other: a block is `2 × layers` chunks, one per layer and K/V.
    LayerMajor,
    /// `[num_blocks][layers][2][block_tokens][kv_heads][head_dim]`: a block is contiguous.
    BlockMajor,
}

/// Geometry of a paged KV-cache pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PagedKvLayout {
    /// Transformer layers (one K and one V tensor each).
    pub layers: usize,
    /// KV heads per layer.
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Tokens per block (vLLM's `block_size`, typically 16).
    pub block_tokens: usize,
    /// Bytes per element (2 for fp16/bf16, 1 for fp8).
    pub dtype_bytes: usize,
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// How blocks sit in the pool.
    pub order: BlockOrder,
}

impl PagedKvLayout {
    /// Checks the geometry; the error names the field.
    pub fn validate(&self) -> Result<(), TransferError> {
        for (f, v) in [
            ("layers", self.layers),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("block_tokens", self.block_tokens),
            ("dtype_bytes", self.dtype_bytes),
            ("num_blocks", self.num_blocks),
        ] {
            if v == 0 {
                return Err(TransferError::Config(format!("kv layout {f}: must be > 0")));
            }
        }
        let total = (self.layers as u128)
            * 2
            * self.num_blocks as u128
            * self.block_tokens as u128
            * self.kv_heads as u128
            * self.head_dim as u128
            * self.dtype_bytes as u128;
        if total > 1 << 44 {
            return Err(TransferError::Config(format!(
                "kv layout: {total} bytes is more than 16 TiB"
            )));
        }
        Ok(())
    }

    /// Bytes of one block of one layer's K (or V).
    pub fn chunk_bytes(&self) -> u64 {
        (self.block_tokens * self.kv_heads * self.head_dim * self.dtype_bytes) as u64
    }

    /// Bytes of one block over all layers, K and V.
    pub fn block_bytes(&self) -> u64 {
        self.chunk_bytes() * 2 * self.layers as u64
    }

    /// Bytes of the whole pool.
    pub fn pool_bytes(&self) -> u64 {
        self.block_bytes() * self.num_blocks as u64
    }

    /// Blocks needed for `tokens` tokens.
    pub fn blocks_for_tokens(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_tokens)
    }

    /// The byte ranges `(offset, len)` of `block` in the pool, in a fixed order (layer, K/V).
    pub fn chunks(&self, block: u32) -> Vec<(u64, u64)> {
        let c = self.chunk_bytes();
        let b = block as u64;
        match self.order {
            BlockOrder::BlockMajor => vec![(b * self.block_bytes(), self.block_bytes())],
            BlockOrder::LayerMajor => {
                let per_kv = c * self.num_blocks as u64; // one layer's K (or V) tensor
                (0..self.layers as u64 * 2).map(|t| (t * per_kv + b * c, c)).collect()
            }
        }
    }

    /// Requests moving `src_blocks` of the local pool at `src_base` into `dst_blocks` of the
    /// pool at `dst_base` in segment `target` (same geometry both sides), pair by pair.
    /// Ranges that are contiguous on both sides are merged, so consecutive blocks travel as one
    /// request per layer and K/V (or one request in all, block-major).
    pub fn transfer_requests(
        &self,
        opcode: Opcode,
        src_base: u64,
        src_blocks: &[u32],
        target: SegmentHandle,
        dst_base: u64,
        dst_blocks: &[u32],
    ) -> Result<Vec<TransferRequest>, TransferError> {
        self.validate()?;
        if src_blocks.len() != dst_blocks.len() {
            return Err(TransferError::Invalid(format!(
                "kv transfer: {} source blocks for {} destination blocks",
                src_blocks.len(),
                dst_blocks.len()
            )));
        }
        if let Some(b) = src_blocks
            .iter()
            .chain(dst_blocks)
            .find(|&&b| b as usize >= self.num_blocks)
        {
            return Err(TransferError::Invalid(format!(
                "kv transfer: block {b} outside a pool of {} blocks",
                self.num_blocks
            )));
        }
        // (chunk index, src off, dst off, len), merged per chunk index when both sides continue
        let mut out: Vec<(usize, u64, u64, u64)> = Vec::new();
        let mut last_of_chunk: Vec<Option<usize>> = Vec::new();
        for (&s, &d) in src_blocks.iter().zip(dst_blocks) {
            for (k, ((so, len), (dof, _))) in self.chunks(s).into_iter().zip(self.chunks(d)).enumerate() {
                if last_of_chunk.len() <= k {
                    last_of_chunk.resize(k + 1, None);
                }
                if let Some(i) = last_of_chunk[k] {
                    let r = &mut out[i];
                    if r.1 + r.3 == so && r.2 + r.3 == dof {
                        r.3 += len;
                        continue;
                    }
                }
                last_of_chunk[k] = Some(out.len());
                out.push((k, so, dof, len));
            }
        }
        Ok(out
            .into_iter()
            .map(|(_, so, dof, len)| TransferRequest {
                opcode,
                source: src_base + so,
                target,
                target_offset: dst_base + dof,
                length: len,
            })
            .collect())
    }
}

/// The notification telling a decode node that an LLM request's KV blocks have landed.
pub fn blocks_landed(request_id: &str, dst_blocks: &[u32]) -> Notification {
    Notification {
        name: "kv-blocks".into(),
        msg: serde_json::json!({"request": request_id, "blocks": dst_blocks}).to_string(),
    }
}

/// Reads a [`blocks_landed`] notification: the request id and its blocks.
pub fn parse_blocks_landed(n: &Notification) -> Option<(String, Vec<u32>)> {
    if n.name != "kv-blocks" {
        return None;
    }
    let v: serde_json::Value = serde_json::from_str(&n.msg).ok()?;
    let id = v["request"].as_str()?.to_string();
    let blocks = v["blocks"]
        .as_array()?
        .iter()
        .map(|b| b.as_u64().and_then(|b| u32::try_from(b).ok()))
        .collect::<Option<Vec<u32>>>()?;
    Some((id, blocks))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(order: BlockOrder) -> PagedKvLayout {
        PagedKvLayout {
            layers: 4,
            kv_heads: 2,
            head_dim: 8,
            block_tokens: 16,
            dtype_bytes: 2,
            num_blocks: 10,
            order,
        }
    }

    #[test]
    fn layer_major_blocks_are_one_chunk_per_layer_and_kv() {
        let l = layout(BlockOrder::LayerMajor);
        assert_eq!(l.chunk_bytes(), 16 * 2 * 8 * 2);
        assert_eq!(l.pool_bytes(), l.chunk_bytes() * 2 * 4 * 10);
        let c = l.chunks(3);
        assert_eq!(c.len(), 8);
        assert_eq!(c[0], (3 * 512, 512));
        assert_eq!(c[1], (10 * 512 + 3 * 512, 512)); // next layer/kv tensor
                                                     // every chunk of every block is disjoint and inside the pool
        let mut all: Vec<(u64, u64)> = (0..10).flat_map(|b| l.chunks(b)).collect();
        all.sort();
        for w in all.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0);
        }
        assert!(all.iter().all(|(o, n)| o + n <= l.pool_bytes()));
    }

    #[test]
    fn consecutive_blocks_merge_and_scattered_ones_do_not() {
        let h = SegmentHandle(1);
        let l = layout(BlockOrder::LayerMajor);
        let r = l
            .transfer_requests(Opcode::Write, 0, &[0, 1, 2], h, 1 << 20, &[5, 6, 7])
            .unwrap();
        assert_eq!(r.len(), 8, "one request per layer and K/V");
        assert!(r.iter().all(|q| q.length == 3 * 512));
        let r = l.transfer_requests(Opcode::Write, 0, &[0, 1], h, 0, &[7, 2]).unwrap();
        assert_eq!(r.len(), 16);
        let b = layout(BlockOrder::BlockMajor);
        let r = b
            .transfer_requests(Opcode::Write, 0, &[4, 5, 6], h, 0, &[0, 1, 2])
            .unwrap();
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].length, 3 * b.block_bytes());
        assert_eq!(r[0].source, 4 * b.block_bytes());
        assert!(b.transfer_requests(Opcode::Write, 0, &[10], h, 0, &[0]).is_err());
        assert!(b.transfer_requests(Opcode::Write, 0, &[1, 2], h, 0, &[0]).is_err());
    }

    #[test]
    fn notifications_round_trip() {
        let n = blocks_landed("req-7", &[3, 9]);
        assert_eq!(parse_blocks_landed(&n), Some(("req-7".into(), vec![3, 9])));
        assert_eq!(
            parse_blocks_landed(&Notification {
                name: "x".into(),
                msg: "{}".into()
            }),
            None
        );
    }
}
