//! Wire formats between kv clients and servers: the connection handshake (JSON private data of
//! the connection manager), the two-sided RPC messages, the offloaded-get request and reply,
//! and the shard map.

use crate::layout;
use crate::store::Geometry;
use crate::KvError;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;

/// Offload opcode of the offloaded get: walks the chain next to the data, validates, replies
/// with the value.
pub const OFFLOAD_GET: u16 = 0x0B10;
/// Offload opcode of the hybrid get (DrTM A4+A5): the hot-value cache answers hot keys; any
/// other key is answered with its entry's address, which the client READs.
pub const OFFLOAD_HYBRID_GET: u16 = 0x0B11;

/// Offload opcode of the offloaded multi-get: several keys in one request, their replies back
/// to back in one response (the client library's batching; memcached's multi-get, redis MGET).
pub const OFFLOAD_MULTI_GET: u16 = 0x0B12;

/// Reply statuses of offloaded gets (first word of [`GetReply`]).
pub const GET_FOUND: u32 = 0;
/// Not found (the chain ended without the key).
pub const GET_NOT_FOUND: u32 = 1;
/// Found in the hot-value cache.
pub const GET_HOT: u32 = 2;
/// Hybrid get: not cached; `arg` is the entry's region offset, `len` its class length, and
/// the payload its incarnation (u64).
pub const GET_ADDRESS: u32 = 3;

/// Multi-get: this key's value did not fit in the response buffer; get it alone.
pub const GET_NO_ROOM: u32 = 4;

/// Bytes of a get reply header.
pub const GET_REPLY_HEADER: usize = 16;

/// An offloaded get's reply header: `status: u32, len: u32, arg: u64`, then the payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GetReply {
    /// One of the `GET_*` statuses.
    pub status: u32,
    /// Payload bytes that follow (or, for [`GET_ADDRESS`], the entry's class length).
    pub len: u32,
    /// Status-specific argument (for [`GET_ADDRESS`], the entry's region offset).
    pub arg: u64,
}

impl GetReply {
    /// Writes the 16-byte header into `out[..GET_REPLY_HEADER]`.
    pub fn encode(&self, out: &mut [u8]) {
        out[0..4].copy_from_slice(&self.status.to_le_bytes());
        out[4..8].copy_from_slice(&self.len.to_le_bytes());
        out[8..16].copy_from_slice(&self.arg.to_le_bytes());
    }
    /// Reads a header from `b`; `None` when `b` is shorter than [`GET_REPLY_HEADER`].
    pub fn decode(b: &[u8]) -> Option<GetReply> {
        Some(GetReply {
            status: u32::from_le_bytes(b.get(0..4)?.try_into().ok()?),
            len: u32::from_le_bytes(b.get(4..8)?.try_into().ok()?),
            arg: u64::from_le_bytes(b.get(8..16)?.try_into().ok()?),
        })
    }
}

/// A multi-get request: `count: u16`, then per key `len: u16` and the key.
pub fn encode_multi_get<'a>(out: &mut Vec<u8>, keys: impl Iterator<Item = &'a [u8]>) {
    out.clear();
    out.extend_from_slice(&0u16.to_le_bytes());
    let mut n = 0u16;
    for k in keys {
        out.extend_from_slice(&(k.len() as u16).to_le_bytes());
        out.extend_from_slice(k);
        n += 1;
    }
    out[..2].copy_from_slice(&n.to_le_bytes());
}

/// Decodes a multi-get request into its keys; the error says what is wrong.
pub fn decode_multi_get(b: &[u8]) -> Result<Vec<&[u8]>, String> {
    let n = u16::from_le_bytes(
        b.get(..2)
            .ok_or("multi-get shorter than its count")?
            .try_into()
            .unwrap_or_default(),
    );
    let mut keys = Vec::with_capacity(n as usize);
    let mut at = 2;
    for i in 0..n {
        let l = b
            .get(at..at + 2)
            .map(|x| u16::from_le_bytes([x[0], x[1]]) as usize)
            .ok_or_else(|| format!("key {i} of {n}: length missing"))?;
        let k = b
            .get(at + 2..at + 2 + l)
            .ok_or_else(|| format!("key {i} of {n}: {l} bytes missing"))?;
        if k.is_empty() || k.len() > layout::MAX_KEY {
            return Err(format!("key {i} of {n}: {l} bytes (1 to {})", layout::MAX_KEY));
        }
        keys.push(k);
        at += 2 + l;
    }
    if at != b.len() {
        return Err(format!("{} bytes after {n} keys", b.len() - at));
    }
    Ok(keys)
}

/// RPC operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum RpcOp {
    /// Read a key's value.
    Get = 1,
    /// Insert or update a key.
    Put = 2,
    /// Insert a key that must be absent.
    Insert = 3,
    /// Update a key that must be present.
    Update = 4,
    /// Delete a key.
    Delete = 5,
    /// The client is leaving: the server drops the connection and the RedN pairs it owns (no
    /// reply). Clients that vanish without it are found by the server's keepalive.
    Bye = 6,
}

impl RpcOp {
    fn from_u8(v: u8) -> Option<RpcOp> {
        Some(match v {
            1 => RpcOp::Get,
            2 => RpcOp::Put,
            3 => RpcOp::Insert,
            4 => RpcOp::Update,
            5 => RpcOp::Delete,
            6 => RpcOp::Bye,
            _ => return None,
        })
    }
}

/// RPC reply statuses.
pub const RPC_OK: u8 = 0;
/// The key is absent.
pub const RPC_NOT_FOUND: u8 = 1;
/// The key exists (an insert refused).
pub const RPC_EXISTS: u8 = 2;
/// The payload is an error message.
pub const RPC_ERROR: u8 = 3;

/// Bytes of an RPC header (request and reply).
pub const RPC_HEADER: usize = 16;
/// The largest RPC message (header, longest key, largest value): the receive slot size.
pub const RPC_SLOT: usize = RPC_HEADER + layout::MAX_KEY + layout::MAX_VALUE + 6;

/// An RPC request: `op: u8, 0: u8, klen: u16, vlen: u32, id: u64`, key, value.
pub fn encode_request(out: &mut Vec<u8>, op: RpcOp, id: u64, key: &[u8], value: &[u8]) {
    out.clear();
    out.push(op as u8);
    out.push(0);
    out.extend_from_slice(&(key.len() as u16).to_le_bytes());
    out.extend_from_slice(&(value.len() as u32).to_le_bytes());
    out.extend_from_slice(&id.to_le_bytes());
    out.extend_from_slice(key);
    out.extend_from_slice(value);
}

/// A decoded RPC request.
#[derive(Debug, PartialEq, Eq)]
pub struct Request<'a> {
    /// What the request does.
    pub op: RpcOp,
    /// The client's request id, echoed in the reply.
    pub id: u64,
    /// The key.
    pub key: &'a [u8],
    /// The value (empty for gets and deletes).
    pub value: &'a [u8],
}

/// Decodes an RPC request; the error names what is wrong (the id, if readable, comes with it).
pub fn decode_request(b: &[u8]) -> Result<Request<'_>, (u64, String)> {
    if b.len() < RPC_HEADER {
        return Err((0, format!("request of {} bytes is shorter than its header", b.len())));
    }
    let id = u64::from_le_bytes(b[8..16].try_into().unwrap_or_default());
    let op = RpcOp::from_u8(b[0]).ok_or((id, format!("unknown operation {}", b[0])))?;
    let klen = u16::from_le_bytes([b[2], b[3]]) as usize;
    let vlen = u32::from_le_bytes(b[4..8].try_into().unwrap_or_default()) as usize;
    if RPC_HEADER + klen + vlen != b.len() {
        return Err((
            id,
            format!(
                "key {klen} + value {vlen} bytes do not match a {}-byte request",
                b.len()
            ),
        ));
    }
    Ok(Request {
        op,
        id,
        key: &b[RPC_HEADER..RPC_HEADER + klen],
        value: &b[RPC_HEADER + klen..],
    })
}

/// An RPC reply: `status: u8, 0: u8, 0: u16, len: u32, id: u64`, payload.
pub fn encode_reply(out: &mut [u8], status: u8, id: u64, payload: &[u8]) -> usize {
    let n = (RPC_HEADER + payload.len()).min(out.len());
    out[0] = status;
    out[1..4].fill(0);
    out[4..8].copy_from_slice(&((n - RPC_HEADER) as u32).to_le_bytes());
    out[8..16].copy_from_slice(&id.to_le_bytes());
    out[RPC_HEADER..n].copy_from_slice(&payload[..n - RPC_HEADER]);
    n
}

/// A decoded RPC reply: status, id, payload.
pub fn decode_reply(b: &[u8]) -> Option<(u8, u64, &[u8])> {
    if b.len() < RPC_HEADER {
        return None;
    }
    let len = u32::from_le_bytes(b[4..8].try_into().ok()?) as usize;
    let id = u64::from_le_bytes(b[8..16].try_into().ok()?);
    Some((b[0], id, b.get(RPC_HEADER..RPC_HEADER + len)?))
}

/// What a client asks for when it connects a QP.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Hello {
    /// The general connection (RPC, one-sided READs, offloaded gets) with `depth` requests in
    /// flight at most.
    Kv {
        /// Requests in flight at most.
        depth: u32,
    },
    /// One of the two response QPs of a RedN get pair: the server builds the chains when both
    /// parts are connected; the responses go to the client's buffer `resp_addr`/`resp_rkey`.
    Redn {
        /// The server's QP number of the client's general connection (its welcome's `conn`):
        /// the pair lives as long as that connection.
        conn: u32,
        /// The client's id of the pair.
        pair: u64,
        /// Which of the pair's two QPs this is (0 or 1).
        part: u8,
        /// Address of the client's response buffer.
        resp_addr: u64,
        /// The rkey of the client's response buffer.
        resp_rkey: u32,
    },
}

/// What the server answers.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Welcome {
    /// This server's shard and the map it knows (connection-manager addresses by shard; empty
    /// when the server was started without one).
    pub shard: u32,
    /// How many shards there are.
    pub shards: u32,
    /// Connection-manager addresses by shard.
    pub map: Vec<SocketAddr>,
    /// The store's region: its address, rkey and layout.
    pub region_addr: u64,
    /// The rkey of the store's region.
    pub rkey: u32,
    /// The store's layout in its region.
    pub geometry: Geometry,
    /// Receives the server keeps posted for this connection's RPCs.
    pub rpc_slots: u32,
    /// The server's QP number of this connection (RedN pairs name it).
    #[serde(default)]
    pub conn: u32,
}

/// Which shard of `shards` a key belongs to (high bits of the key word, independent of the
/// bucket bits).
pub fn shard_of(key: &[u8], shards: u32) -> u32 {
    ((layout::key_word(key) >> 40) % shards.max(1) as u64) as u32
}

/// Parses a shard map given as `ADDR[,ADDR...]` (shard 0 first).
pub fn parse_map(s: &str) -> Result<Vec<SocketAddr>, KvError> {
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            p.trim()
                .parse()
                .map_err(|e| KvError::Config(format!("shard map: {p:?} is not an address: {e}")))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_and_bad_ones_are_named() {
        let mut b = Vec::new();
        encode_request(&mut b, RpcOp::Put, 42, b"key", b"value");
        let r = decode_request(&b).unwrap();
        assert_eq!(
            (r.op, r.id, r.key, r.value),
            (RpcOp::Put, 42, &b"key"[..], &b"value"[..])
        );
        let e = decode_request(&b[..b.len() - 1]).unwrap_err();
        assert_eq!(e.0, 42);
        assert!(e.1.contains("do not match"), "{}", e.1);
        let mut bad = b.clone();
        bad[0] = 99;
        assert!(decode_request(&bad).unwrap_err().1.contains("unknown operation 99"));
        assert!(decode_request(&b[..3]).is_err());
    }

    #[test]
    fn multi_gets_round_trip_and_bad_ones_are_named() {
        let mut b = Vec::new();
        encode_multi_get(&mut b, [&b"a"[..], b"bcd"].into_iter());
        assert_eq!(decode_multi_get(&b).unwrap(), vec![&b"a"[..], b"bcd"]);
        assert!(decode_multi_get(&b[..b.len() - 1]).unwrap_err().contains("key 1 of 2"));
        let mut extra = b.clone();
        extra.push(0);
        assert!(decode_multi_get(&extra).unwrap_err().contains("after"));
        assert!(decode_multi_get(&[1, 0, 0, 0]).unwrap_err().contains("0 bytes"));
        assert!(decode_multi_get(&[]).is_err());
    }

    #[test]
    fn replies_round_trip() {
        let mut out = vec![0u8; 64];
        let n = encode_reply(&mut out, RPC_OK, 7, b"abc");
        assert_eq!(decode_reply(&out[..n]), Some((RPC_OK, 7, &b"abc"[..])));
        assert_eq!(decode_reply(&out[..n - 1]), None);
        let g = GetReply {
            status: GET_ADDRESS,
            len: 128,
            arg: 4096,
        };
        let mut h = [0u8; GET_REPLY_HEADER];
        g.encode(&mut h);
        assert_eq!(GetReply::decode(&h), Some(g));
    }

    #[test]
    fn shards_spread_keys() {
        let mut n = [0u32; 4];
        for i in 0..4000u32 {
            n[shard_of(&i.to_le_bytes(), 4) as usize] += 1;
        }
        assert!(n.iter().all(|&c| c > 800), "{n:?}");
        assert!(parse_map("127.0.0.1:1,127.0.0.1:2").unwrap().len() == 2);
        assert!(parse_map("nope").unwrap_err().to_string().contains("nope"));
    }
}
