//! Solar's packet: a 64-byte header, then (WRITE and READ_DATA only) exactly one 4 KiB block;
//! a WRITE with the ZERO flag carries none: its block is zeros, to be deallocated (TRIM).
//!
//! Layout (network byte order):
//!
//! | bytes | field | |
//! | --- | --- | --- |
//! | 0..2 | magic `0x53` + version `1` | |
//! | 2 | opcode | WRITE, WRITE_ACK, READ_REQ, READ_DATA, NACK, PROBE, PROBE_ACK, CHALLENGE, CHALLENGE_REPLY |
//! | 3 | flags | FUA, RETX, ECN echo, LAST, ZERO |
//! | 4..6 | path id | the path the packet (or the packet it answers) took |
//! | 6..8 | status | in acknowledgements and NACKs |
//! | 8..12 | volume id | |
//! | 12..20 | rpc id | the request; increases per volume (stale-write ordering) |
//! | 20..22 | block index | within the request |
//! | 22..24 | block count | of the request |
//! | 24..32 | lba | in 4 KiB blocks, of this block (READ_REQ: of the first) |
//! | 32..36 | epoch | the sender's attachment epoch of the volume (fencing) |
//! | 36..40 | psn | per-path sequence number, echoed in the answer |
//! | 40..48 | timestamp | sender's clock, echoed (RTT) |
//! | 48..52 | block CRC32C | WRITE, READ_DATA |
//! | 52..56 | header CRC32C | over bytes 0..52 and 56..64 |
//! | 56..60 | service time | in acknowledgements: microseconds the server held the block |
//! | 60..64 | zero count | a WRITE with ZERO: the blocks from lba it zeroes (0 means 1) |
//!
//! Every packet is self-describing: a block is placed from its own header, in any order.
//!
//! CHALLENGE and CHALLENGE_REPLY (address validation, see [`super::server`]) came later within
//! version 1: a server's CHALLENGE carries a nonce in the rpc id field and the path id of the
//! request that made it; the agent answers with a CHALLENGE_REPLY of the same path and rpc id
//! from that path's port. A receiver that predates them counts them as malformed (an unknown
//! opcode), so an agent of before them is served only three times what it sends by a server
//! that validates addresses.

/// Bytes of a block, the unit of every packet.
pub const BLOCK: usize = 4096;
/// Bytes of the header.
pub const HDR: usize = 64;
/// The most blocks one ZERO WRITE zeroes (16 MiB).
pub const MAX_ZERO_BLOCKS: u32 = 4096;
const MAGIC: u8 = 0x53;
const VERSION: u8 = 1;

/// Packet types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// One block of a write (or, with ZERO, a run of zeroed blocks), agent to server.
    Write = 1,
    /// The server's answer to a WRITE: `Accepted` on arrival, then `Ok` (or an error) once
    /// durable.
    WriteAck = 2,
    /// A read of `blk_cnt - blk_idx` blocks from `lba`, agent to server.
    ReadReq = 3,
    /// One block of a read, server to agent (a zero block with a status when it failed).
    ReadData = 4,
    /// A refusal of a READ_REQ as a whole (wrong epoch).
    Nack = 5,
    /// A path health probe, agent to server.
    Probe = 6,
    /// The server's answer to a probe, on the probed path.
    ProbeAck = 7,
    /// Server to agent: prove you receive at this address by echoing the nonce (the rpc id
    /// field) in a CHALLENGE_REPLY.
    Challenge = 8,
    /// Agent to server: a CHALLENGE's nonce echoed, from the address it was sent to.
    ChallengeReply = 9,
}

impl Op {
    fn from_u8(v: u8) -> Option<Op> {
        Some(match v {
            1 => Op::Write,
            2 => Op::WriteAck,
            3 => Op::ReadReq,
            4 => Op::ReadData,
            5 => Op::Nack,
            6 => Op::Probe,
            7 => Op::ProbeAck,
            8 => Op::Challenge,
            9 => Op::ChallengeReply,
            _ => return None,
        })
    }

    /// Whether packets of this type carry a block.
    pub fn has_block(self) -> bool {
        matches!(self, Op::Write | Op::ReadData)
    }
}

/// Header flags.
pub mod flags {
    /// Force unit access: durable before acknowledged (every write is, here; carried for the
    /// storage node's accounting).
    pub const FUA: u8 = 1;
    /// A retransmission.
    pub const RETX: u8 = 2;
    /// The acknowledged packet arrived with ECN CE.
    pub const ECN_ECHO: u8 = 4;
    /// The last block of a request.
    pub const LAST: u8 = 8;
    /// WRITE: zeros and no payload; the server deallocates the header's `count` blocks from
    /// its lba (TRIM, WRITE_ZEROES): one packet for up to [`super::MAX_ZERO_BLOCKS`] blocks.
    /// Its CRC field is 0.
    pub const ZERO: u8 = 16;
}

/// Status codes of acknowledgements and NACKs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum Status {
    /// Done: the block is durable (WRITE_ACK) or read (READ_DATA).
    Ok = 0,
    /// The block's CRC did not match: resend it.
    CrcError = 1,
    /// An older write to a block a newer one already reached: dropped, nothing to resend.
    Stale = 2,
    /// The block is outside the volume.
    OutOfRange = 3,
    /// The volume is not on this server.
    NoVolume = 4,
    /// The volume is fenced at a higher epoch than the request's (it was attached elsewhere
    /// since).
    WrongEpoch = 5,
    /// The storage failed (I/O error, a corrupt stored block on read).
    IoError = 6,
    /// The server is busy: resend later.
    Busy = 7,
    /// A WRITE_ACK sent on arrival: the block reached the server, whose answer `Ok` follows
    /// when it is durable. It frees the packet's place in the window and gives an RTT sample
    /// that does not include the disk.
    Accepted = 8,
    /// The storage is full (`ENOSPC`): the write was not made durable.
    NoSpace = 9,
}

impl Status {
    /// The status a header's code stands for (None: unknown).
    pub fn from_u16(v: u16) -> Option<Status> {
        Some(match v {
            0 => Status::Ok,
            1 => Status::CrcError,
            2 => Status::Stale,
            3 => Status::OutOfRange,
            4 => Status::NoVolume,
            5 => Status::WrongEpoch,
            6 => Status::IoError,
            7 => Status::Busy,
            8 => Status::Accepted,
            9 => Status::NoSpace,
            _ => return None,
        })
    }

    /// Whether resending the block may succeed.
    pub fn retryable(self) -> bool {
        matches!(self, Status::CrcError | Status::Busy)
    }
}

/// A decoded header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The packet type.
    pub op: Op,
    /// [`flags`] bits.
    pub flags: u8,
    /// The path the packet took (answers echo the request's).
    pub path: u16,
    /// A [`Status`] code (answers).
    pub status: u16,
    /// The volume addressed.
    pub volume: u32,
    /// The request id: a write's version, unique per volume; reads use the upper half.
    pub rpc: u64,
    /// This block's index within its request.
    pub blk_idx: u16,
    /// The request's block count (a READ_REQ: the index one past its last block).
    pub blk_cnt: u16,
    /// The block address, in 4 KiB blocks, of this block (READ_REQ: of its first).
    pub lba: u64,
    /// The sender's attachment epoch of the volume; a server fenced higher refuses it.
    pub epoch: u32,
    /// Per-path sequence number, echoed in the answer (loss detection).
    pub psn: u32,
    /// The sender's clock when sent (ns), echoed (RTT).
    pub ts: u64,
    /// CRC32C of the block (WRITE, READ_DATA).
    pub crc: u32,
    /// In acknowledgements: microseconds the server held the block (making it durable), so
    /// the sender's congestion control sees the network's share of the RTT, not the disk's
    /// (Swift's split of fabric and endpoint delay).
    pub service_us: u32,
    /// A WRITE with ZERO: the blocks it zeroes from `lba` (0 means 1; at most
    /// [`MAX_ZERO_BLOCKS`]). Echoed in its acknowledgements.
    pub count: u32,
}

/// Why a packet was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Fewer bytes than a header.
    #[error("packet of {0} bytes is shorter than the header")]
    Short(usize),
    /// Not a Solar packet of this version.
    #[error("bad magic or version")]
    Magic,
    /// An opcode this version does not know, or one the receiver never gets.
    #[error("unknown opcode {0}")]
    Opcode(u8),
    /// The header's CRC32C does not match.
    #[error("header CRC mismatch")]
    HeaderCrc,
    /// A payload of the wrong size for the opcode.
    #[error("{0:?} with {1} payload bytes")]
    Length(Op, usize),
    /// A block index outside its request, or a request that does not fit.
    #[error("block index {0} not below the count {1}")]
    Index(u16, u16),
    /// A zero count where none may be, or above [`MAX_ZERO_BLOCKS`].
    #[error("a zero count of {0} (more than 1 only on a ZERO WRITE and its answers, at most 4096)")]
    Count(u32),
}

impl Header {
    /// A header with everything but the opcode zero.
    pub fn new(op: Op) -> Header {
        Header {
            op,
            flags: 0,
            path: 0,
            status: 0,
            volume: 0,
            rpc: 0,
            blk_idx: 0,
            blk_cnt: 1,
            lba: 0,
            epoch: 0,
            psn: 0,
            ts: 0,
            crc: 0,
            service_us: 0,
            count: 0,
        }
    }

    /// Writes the header into `b[..HDR]`, with its header CRC.
    pub fn encode(&self, b: &mut [u8]) {
        let b = &mut b[..HDR];
        b[0] = MAGIC;
        b[1] = VERSION;
        b[2] = self.op as u8;
        b[3] = self.flags;
        b[4..6].copy_from_slice(&self.path.to_be_bytes());
        b[6..8].copy_from_slice(&self.status.to_be_bytes());
        b[8..12].copy_from_slice(&self.volume.to_be_bytes());
        b[12..20].copy_from_slice(&self.rpc.to_be_bytes());
        b[20..22].copy_from_slice(&self.blk_idx.to_be_bytes());
        b[22..24].copy_from_slice(&self.blk_cnt.to_be_bytes());
        b[24..32].copy_from_slice(&self.lba.to_be_bytes());
        b[32..36].copy_from_slice(&self.epoch.to_be_bytes());
        b[36..40].copy_from_slice(&self.psn.to_be_bytes());
        b[40..48].copy_from_slice(&self.ts.to_be_bytes());
        b[48..52].copy_from_slice(&self.crc.to_be_bytes());
        b[56..60].copy_from_slice(&self.service_us.to_be_bytes());
        b[60..64].copy_from_slice(&self.count.to_be_bytes());
        let hc = header_crc(b);
        b[52..56].copy_from_slice(&hc.to_be_bytes());
    }

    /// A whole packet: this header and `block` (which must be `BLOCK` bytes for WRITE and
    /// READ_DATA, empty otherwise).
    pub fn packet(&self, block: &[u8]) -> Vec<u8> {
        let mut v = vec![0u8; HDR + block.len()];
        self.encode(&mut v);
        v[HDR..].copy_from_slice(block);
        v
    }

    /// Parses and checks a packet; returns the header and the block (empty when none).
    pub fn decode(p: &[u8]) -> Result<(Header, &[u8]), WireError> {
        if p.len() < HDR {
            return Err(WireError::Short(p.len()));
        }
        if p[0] != MAGIC || p[1] != VERSION {
            return Err(WireError::Magic);
        }
        let op = Op::from_u8(p[2]).ok_or(WireError::Opcode(p[2]))?;
        let be16 = |i: usize| u16::from_be_bytes([p[i], p[i + 1]]);
        let be32 = |i: usize| u32::from_be_bytes(p[i..i + 4].try_into().expect("4 bytes"));
        let be64 = |i: usize| u64::from_be_bytes(p[i..i + 8].try_into().expect("8 bytes"));
        if header_crc(p) != be32(52) {
            return Err(WireError::HeaderCrc);
        }
        let payload = &p[HDR..];
        let want = if carries_block(op, p[3]) { BLOCK } else { 0 };
        if payload.len() != want {
            return Err(WireError::Length(op, payload.len()));
        }
        let h = Header {
            op,
            flags: p[3],
            path: be16(4),
            status: be16(6),
            volume: be32(8),
            rpc: be64(12),
            blk_idx: be16(20),
            blk_cnt: be16(22),
            lba: be64(24),
            epoch: be32(32),
            psn: be32(36),
            ts: be64(40),
            crc: be32(48),
            service_us: be32(56),
            count: be32(60),
        };
        let zero_write = op == Op::Write && h.flags & flags::ZERO != 0;
        if h.count > MAX_ZERO_BLOCKS || (h.count > 1 && !zero_write && op != Op::WriteAck) {
            return Err(WireError::Count(h.count));
        }
        if matches!(op, Op::Write | Op::ReadData | Op::WriteAck) && h.blk_idx >= h.blk_cnt {
            return Err(WireError::Index(h.blk_idx, h.blk_cnt));
        }
        Ok((h, payload))
    }
}

/// Whether a packet of `op` with `flags` carries a block.
fn carries_block(op: Op, flags: u8) -> bool {
    op.has_block() && !(op == Op::Write && flags & flags::ZERO != 0)
}

/// CRC32C of the header without its own CRC field (bytes 52..56).
fn header_crc(b: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(&b[..52]), &b[56..HDR])
}

/// The length of the packet whose header starts `hdr` (at least [`HDR`] bytes): for carrying
/// Solar packets over a byte stream (the agent's `--transport tcp`). Checks magic, version and
/// opcode; the whole packet is checked by [`Header::decode`].
pub fn packet_len(hdr: &[u8]) -> Result<usize, WireError> {
    if hdr.len() < HDR {
        return Err(WireError::Short(hdr.len()));
    }
    if hdr[0] != MAGIC || hdr[1] != VERSION {
        return Err(WireError::Magic);
    }
    let op = Op::from_u8(hdr[2]).ok_or(WireError::Opcode(hdr[2]))?;
    Ok(HDR + if carries_block(op, hdr[3]) { BLOCK } else { 0 })
}

/// Whether a datagram looks like a Solar packet (magic and version; [`Header::decode`] checks
/// the rest). A RoCEv2 packet never does: its first byte is the BTH opcode, and `0x53` is a
/// Reliable Datagram opcode, which flexns does not speak.
pub fn is_solar_packet(d: &[u8]) -> bool {
    d.len() >= 2 && d[0] == MAGIC && d[1] == VERSION
}

/// CRC32C of a block.
pub fn block_crc(b: &[u8]) -> u32 {
    crc32c::crc32c(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_damage_is_caught() {
        let mut h = Header::new(Op::Write);
        h.flags = flags::FUA | flags::LAST;
        h.path = 3;
        h.volume = 7;
        h.rpc = 0x0102_0304_0506_0708;
        h.blk_idx = 4;
        h.blk_cnt = 5;
        h.lba = 1 << 40;
        h.epoch = 9;
        h.psn = 77;
        h.ts = 123_456_789;
        let block = vec![0xA5u8; BLOCK];
        h.crc = block_crc(&block);
        let p = h.packet(&block);
        assert_eq!(p.len(), HDR + BLOCK);
        let (back, payload) = Header::decode(&p).unwrap();
        assert_eq!(back, h);
        assert_eq!(payload, &block[..]);
        for i in (0..52).chain(56..64) {
            let mut q = p.clone();
            q[i] ^= 0x10;
            assert!(Header::decode(&q).is_err(), "a flip in byte {i} is caught");
        }
        assert_eq!(Header::decode(&p[..HDR + 100]), Err(WireError::Length(Op::Write, 100)));
        assert_eq!(Header::decode(&p[..10]), Err(WireError::Short(10)));
        assert_eq!(packet_len(&p), Ok(HDR + BLOCK));
        // a zeroed block's WRITE is the header alone; with a payload it is refused
        h.flags |= flags::ZERO;
        let z = h.packet(&[]);
        assert_eq!((Header::decode(&z).unwrap().1.len(), packet_len(&z)), (0, Ok(HDR)));
        assert_eq!(
            Header::decode(&h.packet(&block)),
            Err(WireError::Length(Op::Write, BLOCK))
        );
        // one zero packet covers up to MAX_ZERO_BLOCKS blocks; a count elsewhere is refused
        h.count = MAX_ZERO_BLOCKS;
        assert_eq!(Header::decode(&h.packet(&[])).unwrap().0.count, MAX_ZERO_BLOCKS);
        h.count = MAX_ZERO_BLOCKS + 1;
        assert_eq!(
            Header::decode(&h.packet(&[])),
            Err(WireError::Count(MAX_ZERO_BLOCKS + 1))
        );
        h.flags &= !flags::ZERO;
        h.count = 2;
        assert_eq!(Header::decode(&h.packet(&block)), Err(WireError::Count(2)));
        assert_eq!(packet_len(&p[..10]), Err(WireError::Short(10)));
        let ack = Header::new(Op::WriteAck).packet(&[]);
        assert_eq!(packet_len(&ack), Ok(HDR));
        assert!(Header::decode(&ack).is_ok());
        let mut bad = Header::new(Op::WriteAck);
        bad.blk_idx = 1;
        assert_eq!(Header::decode(&bad.packet(&[])), Err(WireError::Index(1, 1)));
    }
}
