//! Fixed-size RoCEv2 / InfiniBand transport headers, big-endian on the wire.
//!
//! Each header has a `LEN`, a `parse` that reads exactly `LEN` bytes from a slice the caller has
//! length-checked (see [`super::packet::PacketView::parse`], which does that once for the whole
//! packet), and an `emit` into a buffer of at least `LEN` bytes.

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}
fn be24(b: &[u8]) -> u32 {
    u32::from_be_bytes([0, b[0], b[1], b[2]])
}
fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}
fn be64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}
fn put24(b: &mut [u8], v: u32) {
    b[..3].copy_from_slice(&v.to_be_bytes()[1..]);
}

/// The default partition key (full membership, default partition).
pub const DEFAULT_PKEY: u16 = 0xFFFF;
/// A 24-bit PSN or QPN mask.
pub const MASK24: u32 = 0x00FF_FFFF;

/// Base Transport Header (12 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bth {
    /// The opcode ([`super::Opcode`]).
    pub opcode: u8,
    /// Solicited event: the receiver's CQ raises an event for it.
    pub solicited: bool,
    /// Migration request (set, as RoCEv2 NICs send it).
    pub mig_req: bool,
    /// Pad bytes at the end of the payload (0..=3).
    pub pad: u8,
    /// Transport header version (0).
    pub tver: u8,
    /// Partition key.
    pub pkey: u16,
    /// Forward explicit congestion notification.
    pub fecn: bool,
    /// Backward explicit congestion notification.
    pub becn: bool,
    /// Length of the congestion-control header that follows the BTH, in 4-byte words (0..=16;
    /// a flexns extension in the low five reserved bits of byte 4, negotiated per QP).
    pub cc_words: u8,
    /// The destination QP number (24 bits).
    pub dest_qp: u32,
    /// Acknowledge request: the responder answers this packet with an ACK.
    pub ack_req: bool,
    /// The multipath path the packet was sent on (0..=127; a flexns extension in the seven
    /// reserved bits of byte 8), so a responder answers on the path its request came on.
    pub path: u8,
    /// Packet sequence number (24 bits).
    pub psn: u32,
}

impl Bth {
    /// Bytes on the wire.
    pub const LEN: usize = 12;

    /// A BTH with the defaults this stack sends (MigReq set as RoCEv2 NICs do, TVer 0, default P_Key).
    pub fn new(opcode: u8, dest_qp: u32, psn: u32) -> Bth {
        Bth {
            opcode,
            solicited: false,
            mig_req: true,
            pad: 0,
            tver: 0,
            pkey: DEFAULT_PKEY,
            fecn: false,
            becn: false,
            cc_words: 0,
            dest_qp: dest_qp & MASK24,
            ack_req: false,
            path: 0,
            psn: psn & MASK24,
        }
    }

    /// Reads one from the start of `b`, which holds at least [`Self::LEN`] bytes.
    pub fn parse(b: &[u8]) -> Bth {
        Bth {
            opcode: b[0],
            solicited: b[1] & 0x80 != 0,
            mig_req: b[1] & 0x40 != 0,
            pad: (b[1] >> 4) & 0x3,
            tver: b[1] & 0x0F,
            pkey: be16(&b[2..]),
            fecn: b[4] & 0x80 != 0,
            becn: b[4] & 0x40 != 0,
            cc_words: b[4] & 0x1F,
            dest_qp: be24(&b[5..]),
            ack_req: b[8] & 0x80 != 0,
            path: b[8] & 0x7F,
            psn: be24(&b[9..]),
        }
    }

    /// Writes it to the first [`Self::LEN`] bytes of `b`.
    pub fn emit(&self, b: &mut [u8]) {
        b[0] = self.opcode;
        b[1] = (u8::from(self.solicited) << 7)
            | (u8::from(self.mig_req) << 6)
            | ((self.pad & 3) << 4)
            | (self.tver & 0x0F);
        b[2..4].copy_from_slice(&self.pkey.to_be_bytes());
        b[4] = (u8::from(self.fecn) << 7) | (u8::from(self.becn) << 6) | (self.cc_words & 0x1F);
        put24(&mut b[5..], self.dest_qp);
        b[8] = (u8::from(self.ack_req) << 7) | (self.path & 0x7F);
        put24(&mut b[9..], self.psn);
    }
}

/// RDMA Extended Transport Header (16 bytes): WRITE FIRST/ONLY, READ request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Reth {
    /// The remote virtual address.
    pub va: u64,
    /// The remote key it is accessed with.
    pub rkey: u32,
    /// The message's length in bytes.
    pub dma_len: u32,
}

impl Reth {
    /// Bytes on the wire.
    pub const LEN: usize = 16;
    /// Reads one from the start of `b`, which holds at least [`Self::LEN`] bytes.
    pub fn parse(b: &[u8]) -> Reth {
        Reth {
            va: be64(b),
            rkey: be32(&b[8..]),
            dma_len: be32(&b[12..]),
        }
    }
    /// Writes it to the first [`Self::LEN`] bytes of `b`.
    pub fn emit(&self, b: &mut [u8]) {
        b[..8].copy_from_slice(&self.va.to_be_bytes());
        b[8..12].copy_from_slice(&self.rkey.to_be_bytes());
        b[12..16].copy_from_slice(&self.dma_len.to_be_bytes());
    }
}

/// NAK codes carried in the AETH syndrome (IBA Table 43).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NakCode {
    /// A PSN ahead of the expected one: resend from the NAK's PSN.
    PsnSequenceError = 0,
    /// A request the responder cannot carry out (bad opcode, too long for the receive).
    InvalidRequest = 1,
    /// A remote access that failed the rkey, PD, bounds or access check.
    RemoteAccessError = 2,
    /// The responder failed carrying it out.
    RemoteOperationalError = 3,
    /// An invalid RD request (not used by RC; decoded for completeness).
    InvalidRdRequest = 4,
}

/// Decoded AETH syndrome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Syndrome {
    /// Positive ACK with a credit count (0x1F: credits not used).
    Ack {
        /// The credit count.
        credits: u8,
    },
    /// Receiver-not-ready NAK with the 5-bit RNR timer code.
    Rnr {
        /// The RNR timer code (IBA Table 45).
        timer: u8,
    },
    /// NAK with a code.
    Nak(NakCode),
    /// A reserved encoding (counted and ignored by receivers).
    Reserved(u8),
}

impl Syndrome {
    /// The AETH syndrome byte.
    pub fn to_u8(self) -> u8 {
        match self {
            Syndrome::Ack { credits } => credits & 0x1F,
            Syndrome::Rnr { timer } => 0x20 | (timer & 0x1F),
            Syndrome::Nak(c) => 0x60 | c as u8,
            Syndrome::Reserved(v) => v,
        }
    }
    /// The syndrome a byte encodes.
    pub fn from_u8(v: u8) -> Syndrome {
        match (v >> 5) & 3 {
            0 => Syndrome::Ack { credits: v & 0x1F },
            1 => Syndrome::Rnr { timer: v & 0x1F },
            3 => match v & 0x1F {
                0 => Syndrome::Nak(NakCode::PsnSequenceError),
                1 => Syndrome::Nak(NakCode::InvalidRequest),
                2 => Syndrome::Nak(NakCode::RemoteAccessError),
                3 => Syndrome::Nak(NakCode::RemoteOperationalError),
                4 => Syndrome::Nak(NakCode::InvalidRdRequest),
                _ => Syndrome::Reserved(v),
            },
            _ => Syndrome::Reserved(v),
        }
    }
}

/// ACK Extended Transport Header (4 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Aeth {
    /// ACK, RNR NAK or NAK.
    pub syndrome: Syndrome,
    /// Message sequence number: messages the responder completed (24 bits).
    pub msn: u32,
}

impl Aeth {
    /// Bytes on the wire.
    pub const LEN: usize = 4;
    /// Reads one from the start of `b`, which holds at least [`Self::LEN`] bytes.
    pub fn parse(b: &[u8]) -> Aeth {
        Aeth {
            syndrome: Syndrome::from_u8(b[0]),
            msn: be24(&b[1..]),
        }
    }
    /// Writes it to the first [`Self::LEN`] bytes of `b`.
    pub fn emit(&self, b: &mut [u8]) {
        b[0] = self.syndrome.to_u8();
        put24(&mut b[1..], self.msn);
    }
}

/// Atomic Extended Transport Header (28 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AtomicEth {
    /// The remote address (8-byte aligned).
    pub va: u64,
    /// The remote key.
    pub rkey: u32,
    /// The value to swap in (compare-and-swap) or to add (fetch-and-add).
    pub swap_add: u64,
    /// The value to compare with (compare-and-swap).
    pub compare: u64,
}

impl AtomicEth {
    /// Bytes on the wire.
    pub const LEN: usize = 28;
    /// Reads one from the start of `b`, which holds at least [`Self::LEN`] bytes.
    pub fn parse(b: &[u8]) -> AtomicEth {
        AtomicEth {
            va: be64(b),
            rkey: be32(&b[8..]),
            swap_add: be64(&b[12..]),
            compare: be64(&b[20..]),
        }
    }
    /// Writes it to the first [`Self::LEN`] bytes of `b`.
    pub fn emit(&self, b: &mut [u8]) {
        b[..8].copy_from_slice(&self.va.to_be_bytes());
        b[8..12].copy_from_slice(&self.rkey.to_be_bytes());
        b[12..20].copy_from_slice(&self.swap_add.to_be_bytes());
        b[20..28].copy_from_slice(&self.compare.to_be_bytes());
    }
}

/// Atomic ACK Extended Transport Header (8 bytes): the original remote value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AtomicAckEth {
    /// The remote value before the atomic.
    pub orig: u64,
}

impl AtomicAckEth {
    /// Bytes on the wire.
    pub const LEN: usize = 8;
    /// Reads one from the start of `b`, which holds at least [`Self::LEN`] bytes.
    pub fn parse(b: &[u8]) -> AtomicAckEth {
        AtomicAckEth { orig: be64(b) }
    }
    /// Writes it to the first [`Self::LEN`] bytes of `b`.
    pub fn emit(&self, b: &mut [u8]) {
        b[..8].copy_from_slice(&self.orig.to_be_bytes());
    }
}

/// Immediate data (4 bytes), carried opaque in network order.
pub const IMM_LEN: usize = 4;
/// Invalidate ETH (4 bytes): the R_Key to invalidate.
pub const IETH_LEN: usize = 4;

/// Selective-repeat extension (24 bytes), sent at the start of the payload of every SEND and WRITE
/// packet of a QP that negotiated [`crate::transport::rc::Recovery::SelectiveRepeat`] (IRN-style).
///
/// It makes each packet self-describing so the responder can place it straight into memory when
/// it arrives out of order: the byte offset in the message, the message's receive sequence number
/// (which receive WQE it consumes), and for WRITEs the message's target VA and R_Key. It is not an
/// IBA header: QPs in go-back-N mode never send it, so standard decoders see standard packets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SrExt {
    /// This packet's byte offset in its message.
    pub msg_offset: u32,
    /// The message's receive sequence number (which receive WQE a SEND consumes).
    pub recv_seq: u32,
    /// A WRITE's target address (of the message's first byte).
    pub va: u64,
    /// A WRITE's remote key.
    pub rkey: u32,
    /// The message's length in bytes.
    pub msg_len: u32,
}

impl SrExt {
    /// Bytes on the wire.
    pub const LEN: usize = 24;
    /// Reads one from the start of `b`, which holds at least [`Self::LEN`] bytes.
    pub fn parse(b: &[u8]) -> SrExt {
        SrExt {
            msg_offset: be32(b),
            recv_seq: be32(&b[4..]),
            va: be64(&b[8..]),
            rkey: be32(&b[16..]),
            msg_len: be32(&b[20..]),
        }
    }
    /// Writes it to the first [`Self::LEN`] bytes of `b`.
    pub fn emit(&self, b: &mut [u8]) {
        b[..4].copy_from_slice(&self.msg_offset.to_be_bytes());
        b[4..8].copy_from_slice(&self.recv_seq.to_be_bytes());
        b[8..16].copy_from_slice(&self.va.to_be_bytes());
        b[16..20].copy_from_slice(&self.rkey.to_be_bytes());
        b[20..24].copy_from_slice(&self.msg_len.to_be_bytes());
    }
}

/// Offload request header (8 bytes) at the start of an OFFLOAD_REQUEST's payload: the handler's
/// opcode, flags (none defined, sent as 0), and how many response bytes the requester's buffer
/// holds (the response may be shorter). The request bytes follow. A flexns extension in the
/// manufacturer-specific opcode range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OffloadReqHdr {
    /// The handler's opcode.
    pub opcode: u16,
    /// None defined (0).
    pub flags: u16,
    /// Response bytes the requester's buffer holds.
    pub resp_cap: u32,
}

impl OffloadReqHdr {
    /// Bytes on the wire.
    pub const LEN: usize = 8;
    /// Reads one from the start of `b`, which holds at least [`Self::LEN`] bytes.
    pub fn parse(b: &[u8]) -> OffloadReqHdr {
        OffloadReqHdr {
            opcode: u16::from_be_bytes([b[0], b[1]]),
            flags: u16::from_be_bytes([b[2], b[3]]),
            resp_cap: be32(&b[4..]),
        }
    }
    /// Writes it to the first [`Self::LEN`] bytes of `b`.
    pub fn emit(&self, b: &mut [u8]) {
        b[..2].copy_from_slice(&self.opcode.to_be_bytes());
        b[2..4].copy_from_slice(&self.flags.to_be_bytes());
        b[4..8].copy_from_slice(&self.resp_cap.to_be_bytes());
    }
}

/// Offload result (8 bytes) at the start of the payload of the LAST or ONLY packet of an offload
/// response: the status (0 = the handler answered; else an
/// [`crate::transport::rc::offload::OffloadStatus`] code) and the response's length in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OffloadResult {
    /// 0, or an offload status code.
    pub status: u8,
    /// The response's length in bytes.
    pub len: u32,
}

impl OffloadResult {
    /// Bytes on the wire.
    pub const LEN: usize = 8;
    /// Reads one from the start of `b`, which holds at least [`Self::LEN`] bytes.
    pub fn parse(b: &[u8]) -> OffloadResult {
        OffloadResult {
            status: b[0],
            len: be32(&b[4..]),
        }
    }
    /// Writes it to the first [`Self::LEN`] bytes of `b`.
    pub fn emit(&self, b: &mut [u8]) {
        b[0] = self.status;
        b[1..4].fill(0);
        b[4..8].copy_from_slice(&self.len.to_be_bytes());
    }
}

/// Selective ACK extension (12 bytes) after the AETH of an ACK in selective-repeat mode.
/// `bitmap` bit `i` set means PSN `base + 1 + i` was received (`base` is the first missing PSN,
/// so the AETH's cumulative ACK is `base - 1`); `high` is the highest PSN received, which may lie
/// beyond the bitmap when spraying reorders deeply (the sender's loss detection uses its send time);
/// `dup` (the top bit of that word) says a packet arrived twice since the previous SACK, like
/// TCP's DSACK: a retransmission was spurious.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SackExt {
    /// The first missing PSN.
    pub base: u32,
    /// Bit `i`: PSN `base + 1 + i` was received.
    pub bitmap: u64,
    /// The highest PSN received.
    pub high: u32,
    /// A packet arrived twice since the previous SACK.
    pub dup: bool,
}

impl SackExt {
    /// Bytes on the wire.
    pub const LEN: usize = 16;
    /// Reads one from the start of `b`, which holds at least [`Self::LEN`] bytes.
    pub fn parse(b: &[u8]) -> SackExt {
        SackExt {
            base: be32(b) & MASK24,
            bitmap: be64(&b[4..]),
            high: be32(&b[12..]) & MASK24,
            dup: b[12] & 0x80 != 0,
        }
    }
    /// Writes it to the first [`Self::LEN`] bytes of `b`.
    pub fn emit(&self, b: &mut [u8]) {
        b[..4].copy_from_slice(&(self.base & MASK24).to_be_bytes());
        b[4..12].copy_from_slice(&self.bitmap.to_be_bytes());
        b[12..16].copy_from_slice(&((self.high & MASK24) | (u32::from(self.dup) << 31)).to_be_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bth_round_trip() {
        let mut b = Bth::new(0x0A, 0x123456, 0xABCDEF);
        b.ack_req = true;
        b.pad = 3;
        b.solicited = true;
        let mut buf = [0u8; 12];
        b.emit(&mut buf);
        assert_eq!(buf[0], 0x0A);
        assert_eq!(&buf[5..8], &[0x12, 0x34, 0x56]);
        assert_eq!(&buf[9..12], &[0xAB, 0xCD, 0xEF]);
        assert_eq!(Bth::parse(&buf), b);
    }

    #[test]
    fn syndromes() {
        for v in 0u8..=0x7F {
            assert_eq!(Syndrome::from_u8(v).to_u8(), v);
        }
        assert_eq!(Syndrome::from_u8(0x62), Syndrome::Nak(NakCode::RemoteAccessError));
        assert_eq!(Syndrome::from_u8(0x3F), Syndrome::Rnr { timer: 0x1F });
    }

    #[test]
    fn ext_round_trips() {
        let mut buf = [0u8; 32];
        let r = Reth {
            va: 0x1122334455667788,
            rkey: 0xdeadbeef,
            dma_len: 65536,
        };
        r.emit(&mut buf);
        assert_eq!(Reth::parse(&buf), r);
        let a = AtomicEth {
            va: 8,
            rkey: 9,
            swap_add: 10,
            compare: 11,
        };
        a.emit(&mut buf);
        assert_eq!(AtomicEth::parse(&buf), a);
        let s = SrExt {
            msg_offset: 4096,
            recv_seq: 7,
            va: 99,
            rkey: 5,
            msg_len: 1 << 20,
        };
        s.emit(&mut buf);
        assert_eq!(SrExt::parse(&buf), s);
        let k = SackExt {
            base: 0xFFFFFF,
            bitmap: 0x8000_0000_0000_0001,
            high: 0x12345,
            dup: true,
        };
        k.emit(&mut buf);
        assert_eq!(SackExt::parse(&buf), k);
    }
}
