//! Layouts of the congestion-control headers carried after the BTH (big-endian, like the rest
//! of the transport headers). Decoders take untrusted bytes and return `None` on a short or
//! inconsistent header, never panic.
//!
//! - [`IntStack`]: HPCC's in-band telemetry. The sender reserves it empty; every switch egress
//!   (the simulator's, or the testbed's eBPF program) appends one [`IntHop`] at dequeue; the
//!   receiver echoes the stack in its ACKs. 4 bytes (`nhop`, 3 reserved) + 16 per hop, at most
//!   [`MAX_HOPS`] hops: 52 bytes.
//! - [`GrantHdr`]: a receiver's credit grant (Homa), 12 bytes.
//! - [`HomaDataHdr`]: what a Homa sender tells the receiver's scheduler, 12 bytes.

/// Most INT hops a stack holds.
pub const MAX_HOPS: usize = 3;
/// Bytes of one INT hop record.
pub const HOP_LEN: usize = 16;
/// Bytes of an INT stack with room for [`MAX_HOPS`] hops.
pub const INT_STACK_LEN: usize = 4 + MAX_HOPS * HOP_LEN;

/// One switch egress port's telemetry at the moment it sent the packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IntHop {
    /// Egress queue length in bytes.
    pub qlen: u32,
    /// Bytes the port has sent, wrapping (rates come from differences).
    pub tx_bytes: u32,
    /// The port's clock in nanoseconds, wrapping.
    pub ts_ns: u32,
    /// Egress link rate in Mbit/s.
    pub rate_mbps: u32,
}

impl IntHop {
    fn emit(&self, b: &mut [u8]) {
        b[0..4].copy_from_slice(&self.qlen.to_be_bytes());
        b[4..8].copy_from_slice(&self.tx_bytes.to_be_bytes());
        b[8..12].copy_from_slice(&self.ts_ns.to_be_bytes());
        b[12..16].copy_from_slice(&self.rate_mbps.to_be_bytes());
    }
    fn parse(b: &[u8]) -> IntHop {
        let w = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        IntHop {
            qlen: w(0),
            tx_bytes: w(4),
            ts_ns: w(8),
            rate_mbps: w(12),
        }
    }
}

/// An INT stack as read from a CC header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IntStack {
    /// Hops recorded (at most [`MAX_HOPS`]).
    pub nhop: u8,
    /// Their records; the first `nhop` count.
    pub hops: [IntHop; MAX_HOPS],
}

impl IntStack {
    /// Decodes a stack; `None` if `b` is too short for the hop count it claims.
    pub fn parse(b: &[u8]) -> Option<IntStack> {
        let nhop = *b.first()?;
        if nhop as usize > MAX_HOPS || b.len() < 4 + nhop as usize * HOP_LEN {
            return None;
        }
        let mut s = IntStack {
            nhop,
            ..IntStack::default()
        };
        for i in 0..nhop as usize {
            s.hops[i] = IntHop::parse(&b[4 + i * HOP_LEN..]);
        }
        Some(s)
    }

    /// The recorded hops.
    pub fn hops(&self) -> &[IntHop] {
        &self.hops[..self.nhop as usize]
    }

    /// Appends a hop to the stack in `hdr` in place (what a switch does); false when the stack
    /// is full or `hdr` holds no stack.
    pub fn push_hop(hdr: &mut [u8], hop: &IntHop) -> bool {
        let Some(&n) = hdr.first() else { return false };
        let n = n as usize;
        if n >= MAX_HOPS || hdr.len() < 4 + (n + 1) * HOP_LEN {
            return false;
        }
        hop.emit(&mut hdr[4 + n * HOP_LEN..4 + (n + 1) * HOP_LEN]);
        hdr[0] = n as u8 + 1;
        true
    }
}

/// A credit grant: the sender may send up to byte `offset` of its stream, at priority `prio`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrantHdr {
    /// The sender may send up to this byte of its stream.
    pub offset: u64,
    /// The priority its scheduled packets take.
    pub prio: u8,
}

impl GrantHdr {
    /// Bytes on the wire.
    pub const LEN: usize = 12;
    /// Writes it to the first [`Self::LEN`] bytes of `b`.
    pub fn emit(&self, b: &mut [u8]) {
        b[0..8].copy_from_slice(&self.offset.to_be_bytes());
        b[8] = self.prio;
        b[9..12].fill(0);
    }
    /// Reads one (None: too short).
    pub fn parse(b: &[u8]) -> Option<GrantHdr> {
        let o: [u8; 8] = b.get(0..8)?.try_into().ok()?;
        Some(GrantHdr {
            offset: u64::from_be_bytes(o),
            prio: *b.get(8)?,
        })
    }
}

/// A Homa data packet's header: bytes of the message still to come after this packet, and the
/// sender's stream position after it (first transmissions counted), so the receiver's grants
/// are in the sender's own byte count whatever the framing overhead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HomaDataHdr {
    /// Bytes of the message after this packet.
    pub remaining: u32,
    /// The sender's stream position after this packet.
    pub sent_end: u64,
}

impl HomaDataHdr {
    /// Bytes on the wire.
    pub const LEN: usize = 12;
    /// Writes it to the first [`Self::LEN`] bytes of `b`.
    pub fn emit(&self, b: &mut [u8]) {
        b[0..4].copy_from_slice(&self.remaining.to_be_bytes());
        b[4..12].copy_from_slice(&self.sent_end.to_be_bytes());
    }
    /// Reads one (None: too short).
    pub fn parse(b: &[u8]) -> Option<HomaDataHdr> {
        let r: [u8; 4] = b.get(0..4)?.try_into().ok()?;
        let e: [u8; 8] = b.get(4..12)?.try_into().ok()?;
        Some(HomaDataHdr {
            remaining: u32::from_be_bytes(r),
            sent_end: u64::from_be_bytes(e),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int_stack_push_and_parse() {
        let mut hdr = [0u8; INT_STACK_LEN];
        assert_eq!(IntStack::parse(&hdr).unwrap().hops(), &[]);
        let h = |q| IntHop {
            qlen: q,
            tx_bytes: 7,
            ts_ns: 9,
            rate_mbps: 10_000,
        };
        for q in 0..MAX_HOPS as u32 {
            assert!(IntStack::push_hop(&mut hdr, &h(q)));
        }
        assert!(!IntStack::push_hop(&mut hdr, &h(99)), "full");
        let s = IntStack::parse(&hdr).unwrap();
        assert_eq!(s.hops().len(), MAX_HOPS);
        assert_eq!(s.hops()[2], h(2));
        // a hop count the bytes cannot hold is rejected
        assert!(IntStack::parse(&hdr[..20]).is_none());
        hdr[0] = 200;
        assert!(IntStack::parse(&hdr).is_none());
        assert!(IntStack::parse(&[]).is_none());
    }

    #[test]
    fn grant_round_trip() {
        let mut b = [0u8; GrantHdr::LEN];
        let g = GrantHdr {
            offset: 1 << 40,
            prio: 3,
        };
        g.emit(&mut b);
        assert_eq!(GrantHdr::parse(&b), Some(g));
        assert_eq!(GrantHdr::parse(&b[..5]), None);
    }
}
