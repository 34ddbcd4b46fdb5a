//! Transports as sans-IO state machines: they take packets, posted work requests and the
//! current time, and return packets to send, completions and timer deadlines. They never touch
//! sockets or clocks; the engine drives them, and so does the deterministic simulator in tests.

pub mod ledger;
pub mod pacing;
pub mod rc;
pub mod solar;

use crate::memory::SharedRegion;
use crate::wire::{HeaderBuf, MASK24};
use smallvec::SmallVec;
use std::net::SocketAddrV4;
use std::sync::Arc;

/// A slice of registered memory that is the payload (or part of it) of an outgoing packet.
#[derive(Debug)]
pub struct PayloadPart<R> {
    /// The registered region it lies in.
    pub region: Arc<R>,
    /// Its offset in the region.
    pub off: usize,
    /// Its length in bytes.
    pub len: usize,
}

/// An outgoing packet: headers built in a small buffer, payload referenced in place
/// (header-only TX). The link appends pad and ICRC.
#[derive(Debug)]
pub struct TxPacket<R> {
    /// The packet's headers (BTH and extension headers).
    pub hdr: HeaderBuf,
    /// The payload, in place, in order.
    pub payload: SmallVec<[PayloadPart<R>; 2]>,
    /// Which of the QP's paths ([`crate::path`]) carries it; the engine maps it to a socket and
    /// a destination.
    pub path: u8,
}

impl<R> Clone for PayloadPart<R> {
    fn clone(&self) -> Self {
        PayloadPart {
            region: self.region.clone(),
            off: self.off,
            len: self.len,
        }
    }
}

impl<R> Clone for TxPacket<R> {
    fn clone(&self) -> Self {
        TxPacket {
            hdr: self.hdr,
            payload: self.payload.clone(),
            path: self.path,
        }
    }
}

impl<R> Default for TxPacket<R> {
    fn default() -> Self {
        TxPacket {
            hdr: HeaderBuf::default(),
            payload: SmallVec::new(),
            path: 0,
        }
    }
}

impl<R: SharedRegion> TxPacket<R> {
    /// Payload bytes (excluding pad).
    pub fn payload_len(&self) -> usize {
        self.payload.iter().map(|p| p.len).sum()
    }

    /// Serializes the packet with pad and ICRC (simulator and tests; the engine uses iovecs).
    pub fn encode(&self, src: SocketAddrV4, dst: SocketAddrV4, out: &mut Vec<u8>) {
        let mut bufs: SmallVec<[Vec<u8>; 2]> = SmallVec::new();
        for p in &self.payload {
            let mut v = vec![0u8; p.len];
            p.region.read(p.off, &mut v);
            bufs.push(v);
        }
        let parts: SmallVec<[&[u8]; 2]> = bufs.iter().map(|b| b.as_slice()).collect();
        crate::wire::encode_into(out, &self.hdr, &parts, src, dst);
    }
}

/// Extends a 24-bit PSN to the 64-bit sequence space nearest to `reference`.
pub fn psn_unwrap(reference: u64, psn24: u32) -> u64 {
    let r24 = (reference & MASK24 as u64) as u32;
    let diff = psn24.wrapping_sub(r24) & MASK24;
    // sign-extend the 24-bit difference
    let d = if diff & 0x80_0000 != 0 {
        diff as i64 - (1 << 24)
    } else {
        diff as i64
    };
    (reference as i64 + d).max(0) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psn_unwrap_wraps() {
        assert_eq!(psn_unwrap(5, 7), 7);
        assert_eq!(psn_unwrap(5, 3), 3);
        let r = (1u64 << 24) - 2; // near a wrap
        assert_eq!(psn_unwrap(r, 1), (1 << 24) + 1);
        assert_eq!(psn_unwrap((1 << 24) + 1, 0xFF_FFFE), (1 << 24) - 2);
    }
}
