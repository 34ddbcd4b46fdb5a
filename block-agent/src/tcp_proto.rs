//! The plain block protocol over kernel TCP: the reference the Solar transport is measured
//! against, shaped like what a user would otherwise run (NBD, iSCSI, NVMe/TCP): whole block
//! requests of up to 32 MiB on one connection, many in flight, answered by id in any order,
//! with no windows, per-block acknowledgements or resends of its own (TCP delivers in order and
//! retransmits).
//!
//! A request is a 48-byte header, followed for WRITE by its blocks; a reply is a 48-byte header
//! with the request's id, followed for a successful READ by its blocks. Little endian:
//!
//! | bytes | field |
//! | --- | --- |
//! | 0..4 | magic `TBK2` |
//! | 4 | op: 1 READ, 2 WRITE, 3 WRITE_ZEROES (no payload: the blocks are zeroed, deallocated) |
//! | 5 | flags: 1 FUA (writes are durable when answered anyway) |
//! | 6 | status (replies): 0 OK, else a Solar [`Status`] code (no volume, out of range, I/O error...) |
//! | 7 | reserved, 0 |
//! | 8..12 | volume |
//! | 12..16 | blocks |
//! | 16..24 | request id (chosen by the client) |
//! | 24..32 | first block (lba) |
//! | 32..40 | version (WRITE: orders writes to a block, as Solar's request ids do) |
//! | 40..44 | epoch: the sender's attachment epoch of the volume; a node fenced at a higher one refuses the request (`WrongEpoch`) |
//! | 44..48 | reserved, 0 |

use netstack::transport::solar::wire::Status;

/// Bytes of a header.
pub const HDR: usize = 48;
/// Bytes of a block.
pub const BLOCK: usize = 4096;
/// The most blocks one request carries (32 MiB, NBD's largest request).
pub const MAX_BLOCKS: u32 = 8192;
const MAGIC: u32 = u32::from_le_bytes(*b"TBK2");

/// Operations.
pub const READ: u8 = 1;
/// Operation: write the blocks that follow the header.
pub const WRITE: u8 = 2;
/// Operation: zero (deallocate) the blocks; no payload.
pub const WRITE_ZEROES: u8 = 3;
/// Flags.
pub const FUA: u8 = 1;

/// A request or reply header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Header {
    /// `READ`, `WRITE` or `WRITE_ZEROES`.
    pub op: u8,
    /// Flags (`FUA`).
    pub flags: u8,
    /// 0 = OK (replies).
    pub status: u8,
    /// The volume.
    pub volume: u32,
    /// Blocks of the request (1 to [`MAX_BLOCKS`]).
    pub blocks: u32,
    /// The request id (chosen by the client, echoed in the reply).
    pub id: u64,
    /// First block (lba).
    pub lba: u64,
    /// Write version (orders writes to a block).
    pub version: u64,
    /// The sender's attachment epoch of the volume (a node fenced at a higher one refuses).
    pub epoch: u32,
}

/// Why a header was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    /// The magic is not `TBK2` (the value read).
    #[error("bad magic {0:#x} (not the plain block protocol)")]
    Magic(u32),
    /// The op is not one of `READ`, `WRITE`, `WRITE_ZEROES`.
    #[error("unknown op {0}")]
    Op(u8),
    /// The block count is 0 or above [`MAX_BLOCKS`].
    #[error("{0} blocks: 1 to {MAX_BLOCKS} per request")]
    Blocks(u32),
    /// The range (lba, blocks) overflows.
    #[error("lba {0} + {1} blocks overflows")]
    Range(u64, u32),
}

impl Header {
    /// The header's 48 bytes on the wire.
    pub fn encode(&self) -> [u8; HDR] {
        let mut b = [0u8; HDR];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = self.op;
        b[5] = self.flags;
        b[6] = self.status;
        b[8..12].copy_from_slice(&self.volume.to_le_bytes());
        b[12..16].copy_from_slice(&self.blocks.to_le_bytes());
        b[16..24].copy_from_slice(&self.id.to_le_bytes());
        b[24..32].copy_from_slice(&self.lba.to_le_bytes());
        b[32..40].copy_from_slice(&self.version.to_le_bytes());
        b[40..44].copy_from_slice(&self.epoch.to_le_bytes());
        b
    }

    /// Decodes and checks a header (a request's or a reply's).
    pub fn decode(b: &[u8; HDR]) -> Result<Header, HeaderError> {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        if u32_at(0) != MAGIC {
            return Err(HeaderError::Magic(u32_at(0)));
        }
        let h = Header {
            op: b[4],
            flags: b[5],
            status: b[6],
            volume: u32_at(8),
            blocks: u32_at(12),
            id: u64_at(16),
            lba: u64_at(24),
            version: u64_at(32),
            epoch: u32_at(40),
        };
        if !matches!(h.op, READ | WRITE | WRITE_ZEROES) {
            return Err(HeaderError::Op(h.op));
        }
        if h.blocks == 0 || h.blocks > MAX_BLOCKS {
            return Err(HeaderError::Blocks(h.blocks));
        }
        if h.lba.checked_add(h.blocks as u64).is_none() {
            return Err(HeaderError::Range(h.lba, h.blocks));
        }
        Ok(h)
    }

    /// The reply to this request with `status`.
    pub fn reply(&self, status: Status) -> Header {
        Header {
            status: status as u16 as u8,
            ..*self
        }
    }

    /// A reply's status.
    pub fn status(&self) -> Status {
        Status::from_u16(self.status as u16).unwrap_or(Status::IoError)
    }

    /// Payload bytes that follow this header: a WRITE request's blocks, or a successful READ
    /// reply's.
    pub fn payload(&self, reply: bool) -> usize {
        let carries = if reply {
            self.op == READ && self.status == 0
        } else {
            self.op == WRITE
        };
        if carries {
            self.blocks as usize * BLOCK
        } else {
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_bad_ones_are_refused() {
        let h = Header {
            op: WRITE,
            flags: FUA,
            status: 0,
            volume: 7,
            blocks: 3,
            id: 99,
            lba: 1 << 40,
            version: 12345,
            epoch: 6,
        };
        assert_eq!(Header::decode(&h.encode()), Ok(h));
        assert_eq!(h.payload(false), 3 * BLOCK);
        assert_eq!(h.payload(true), 0);
        let r = h.reply(Status::NoVolume);
        assert_eq!(Header::decode(&r.encode()).unwrap().status(), Status::NoVolume);
        let mut b = h.encode();
        b[0] ^= 1;
        assert!(matches!(Header::decode(&b), Err(HeaderError::Magic(_))));
        for (blocks, op, lba) in [
            (0, WRITE, 0),
            (MAX_BLOCKS + 1, WRITE, 0),
            (1, 9, 0),
            (2, READ, u64::MAX),
        ] {
            let x = Header { blocks, op, lba, ..h };
            assert!(Header::decode(&x.encode()).is_err(), "{x:?}");
        }
    }
}
