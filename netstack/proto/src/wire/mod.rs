//! RoCEv2 wire format: RC opcodes, the BTH and its extension headers, the ICRC, and a checked
//! zero-copy packet view. Decoders take untrusted input and return a [`WireError`], never panic.

pub mod headers;
pub mod icrc;
pub mod opcode;
pub mod packet;

pub use headers::*;
pub use opcode::Opcode;
pub use packet::{
    encode_into, HeaderBuf, PacketView, MAX_CC_HDR_LEN, MAX_DATAGRAM, MAX_HDR_LEN, MAX_MTU, PAD_ZEROS, PLACE_PIECE,
};

/// The IANA-assigned RoCEv2 UDP destination port.
pub const ROCEV2_PORT: u16 = 4791;

/// Why a received datagram was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Shorter than its headers say.
    #[error("truncated packet: need {need} bytes, have {have}")]
    Truncated {
        /// Bytes the headers need.
        need: usize,
        /// Bytes received.
        have: usize,
    },
    /// Larger than any packet of this stack.
    #[error("oversized datagram of {len} bytes")]
    Oversized {
        /// Its length.
        len: usize,
    },
    /// An opcode this stack does not know, or not of the RC class.
    #[error("unknown or non-RC opcode {0:#04x}")]
    UnknownOpcode(u8),
    /// A BTH transport header version other than 0.
    #[error("unsupported transport header version {0}")]
    BadVersion(u8),
    /// More pad bytes than payload.
    #[error("pad count {pad} larger than the {len} payload bytes")]
    BadPad {
        /// The BTH's pad count.
        pad: u8,
        /// The payload bytes.
        len: usize,
    },
    /// A congestion-control header longer than allowed.
    #[error("congestion-control header of {words} words (at most 16)")]
    BadCcHeader {
        /// Its length in 4-byte words.
        words: u8,
    },
    /// The invariant CRC does not match (corrupted in flight).
    #[error("bad ICRC: computed {want:#010x}, packet carries {got:#010x}")]
    BadIcrc {
        /// Computed over the packet.
        want: u32,
        /// Carried by it.
        got: u32,
    },
}

impl WireError {
    /// A short stable name for counters.
    pub fn kind(&self) -> &'static str {
        match self {
            WireError::Truncated { .. } => "truncated",
            WireError::Oversized { .. } => "oversized",
            WireError::UnknownOpcode(_) => "unknown_opcode",
            WireError::BadVersion(_) => "bad_version",
            WireError::BadPad { .. } => "bad_pad",
            WireError::BadCcHeader { .. } => "bad_cc_header",
            WireError::BadIcrc { .. } => "bad_icrc",
        }
    }
}
