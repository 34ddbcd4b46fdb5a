//! RC opcodes of the InfiniBand transport (BTH byte 0, transport class RC = 0b000).

/// An RC opcode. Values follow IBA Table 38 (RC column) as carried by RoCEv2.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    /// SEND: the first packet of a multi-packet message.
    SendFirst = 0x00,
    /// SEND: a middle packet.
    SendMiddle = 0x01,
    /// SEND: the last packet.
    SendLast = 0x02,
    /// SEND: the last packet, with immediate data.
    SendLastWithImm = 0x03,
    /// SEND: a one-packet message.
    SendOnly = 0x04,
    /// SEND: a one-packet message with immediate data.
    SendOnlyWithImm = 0x05,
    /// RDMA WRITE: the first packet (carries the RETH).
    WriteFirst = 0x06,
    /// RDMA WRITE: a middle packet.
    WriteMiddle = 0x07,
    /// RDMA WRITE: the last packet.
    WriteLast = 0x08,
    /// RDMA WRITE: the last packet, with immediate data (consumes a receive).
    WriteLastWithImm = 0x09,
    /// RDMA WRITE: a one-packet message (carries the RETH).
    WriteOnly = 0x0A,
    /// RDMA WRITE: a one-packet message with immediate data.
    WriteOnlyWithImm = 0x0B,
    /// RDMA READ request (RETH: address, rkey, length).
    ReadRequest = 0x0C,
    /// RDMA READ response: the first packet (AETH).
    ReadResponseFirst = 0x0D,
    /// RDMA READ response: a middle packet.
    ReadResponseMiddle = 0x0E,
    /// RDMA READ response: the last packet (AETH).
    ReadResponseLast = 0x0F,
    /// RDMA READ response: a one-packet response (AETH).
    ReadResponseOnly = 0x10,
    /// ACK or NAK (AETH syndrome).
    Acknowledge = 0x11,
    /// The answer to an atomic (AETH and AtomicAckETH: the original value).
    AtomicAcknowledge = 0x12,
    /// ATOMIC compare-and-swap request (AtomicETH).
    CompareSwap = 0x13,
    /// ATOMIC fetch-and-add request (AtomicETH).
    FetchAdd = 0x14,
    /// SEND: the last packet, invalidating an rkey at the responder (IETH).
    SendLastWithInvalidate = 0x16,
    /// SEND: a one-packet message invalidating an rkey (IETH).
    SendOnlyWithInvalidate = 0x17,
    /// RoCEv2 congestion notification packet (BTH + 16 reserved bytes), sent by the notification
    /// point of DCQCN to the QP whose packets were ECN-marked.
    Cnp = 0x81,
    /// A receiver-driven credit grant (SwCC's GRANT type), sent by a receiver-paced congestion
    /// control such as Homa; the grant itself travels in the congestion-control header.
    Grant = 0x83,
    /// A multipath probe: asks the peer's QP to answer on whatever path it uses, so a path that
    /// was taken out of the rotation is found healthy again. The PSN field carries the path.
    Probe = 0x84,
    /// The answer to a [`Opcode::Probe`], echoing its PSN field.
    ProbeReply = 0x85,
    /// flexns offload request (manufacturer-specific range): [`super::OffloadReqHdr`] + request.
    OffloadRequest = 0xC0,
    /// flexns offload response: the first packet (AETH).
    OffloadResponseFirst = 0xC1,
    /// flexns offload response: a middle packet.
    OffloadResponseMiddle = 0xC2,
    /// Carries [`super::OffloadResult`] before its data, as does ONLY.
    OffloadResponseLast = 0xC3,
    /// flexns offload response: a one-packet response ([`super::OffloadResult`] first).
    OffloadResponseOnly = 0xC4,
}

/// Which extension headers follow the BTH for an opcode, in wire order.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HeaderSet {
    /// RDMA extended transport header (address, rkey, length).
    pub reth: bool,
    /// ACK extended transport header (syndrome, MSN).
    pub aeth: bool,
    /// Atomic extended transport header (address, rkey, operands).
    pub atomic_eth: bool,
    /// Atomic ACK extended transport header (the original value).
    pub atomic_ack_eth: bool,
    /// Immediate data.
    pub imm: bool,
    /// Invalidate extended transport header (the rkey).
    pub ieth: bool,
    /// The opcode carries payload bytes.
    pub payload: bool,
}

impl Opcode {
    /// Decodes an RC opcode byte; `None` for reserved or non-RC values.
    pub fn from_u8(v: u8) -> Option<Opcode> {
        use Opcode::*;
        Some(match v {
            0x00 => SendFirst,
            0x01 => SendMiddle,
            0x02 => SendLast,
            0x03 => SendLastWithImm,
            0x04 => SendOnly,
            0x05 => SendOnlyWithImm,
            0x06 => WriteFirst,
            0x07 => WriteMiddle,
            0x08 => WriteLast,
            0x09 => WriteLastWithImm,
            0x0A => WriteOnly,
            0x0B => WriteOnlyWithImm,
            0x0C => ReadRequest,
            0x0D => ReadResponseFirst,
            0x0E => ReadResponseMiddle,
            0x0F => ReadResponseLast,
            0x10 => ReadResponseOnly,
            0x11 => Acknowledge,
            0x12 => AtomicAcknowledge,
            0x13 => CompareSwap,
            0x14 => FetchAdd,
            0x16 => SendLastWithInvalidate,
            0x17 => SendOnlyWithInvalidate,
            0x81 => Cnp,
            0x83 => Grant,
            0x84 => Probe,
            0x85 => ProbeReply,
            0xC0 => OffloadRequest,
            0xC1 => OffloadResponseFirst,
            0xC2 => OffloadResponseMiddle,
            0xC3 => OffloadResponseLast,
            0xC4 => OffloadResponseOnly,
            _ => return None,
        })
    }

    /// The extension headers this opcode carries (IBA 9.2 / Table 38).
    pub fn headers(self) -> HeaderSet {
        use Opcode::*;
        let mut h = HeaderSet::default();
        match self {
            SendFirst | SendMiddle | SendLast | SendOnly => h.payload = true,
            SendLastWithImm | SendOnlyWithImm => {
                h.imm = true;
                h.payload = true
            }
            SendLastWithInvalidate | SendOnlyWithInvalidate => {
                h.ieth = true;
                h.payload = true
            }
            WriteFirst | WriteOnly => {
                h.reth = true;
                h.payload = true
            }
            WriteMiddle | WriteLast => h.payload = true,
            WriteLastWithImm => {
                h.imm = true;
                h.payload = true
            }
            WriteOnlyWithImm => {
                h.reth = true;
                h.imm = true;
                h.payload = true
            }
            ReadRequest => h.reth = true,
            ReadResponseFirst | ReadResponseLast | ReadResponseOnly => {
                h.aeth = true;
                h.payload = true
            }
            ReadResponseMiddle => h.payload = true,
            Acknowledge => h.aeth = true,
            AtomicAcknowledge => {
                h.aeth = true;
                h.atomic_ack_eth = true
            }
            CompareSwap | FetchAdd => h.atomic_eth = true,
            Cnp | Grant | Probe | ProbeReply => {}
            OffloadRequest | OffloadResponseMiddle => h.payload = true,
            OffloadResponseFirst | OffloadResponseLast | OffloadResponseOnly => {
                h.aeth = true;
                h.payload = true
            }
        }
        h
    }

    /// A request sent by a requester (as opposed to a response from a responder, or a CNP).
    pub fn is_request(self) -> bool {
        !matches!(
            self,
            Opcode::Cnp
                | Opcode::Grant
                | Opcode::Probe
                | Opcode::ProbeReply
                | Opcode::ReadResponseFirst
                | Opcode::ReadResponseMiddle
                | Opcode::ReadResponseLast
                | Opcode::ReadResponseOnly
                | Opcode::Acknowledge
                | Opcode::AtomicAcknowledge
                | Opcode::OffloadResponseFirst
                | Opcode::OffloadResponseMiddle
                | Opcode::OffloadResponseLast
                | Opcode::OffloadResponseOnly
        )
    }

    /// First packet of a message (FIRST or ONLY variants).
    pub fn is_first(self) -> bool {
        use Opcode::*;
        matches!(
            self,
            SendFirst
                | SendOnly
                | SendOnlyWithImm
                | SendOnlyWithInvalidate
                | WriteFirst
                | WriteOnly
                | WriteOnlyWithImm
                | ReadResponseFirst
                | ReadResponseOnly
        )
    }

    /// Last packet of a message (LAST or ONLY variants).
    pub fn is_last(self) -> bool {
        use Opcode::*;
        matches!(
            self,
            SendLast
                | SendLastWithImm
                | SendLastWithInvalidate
                | SendOnly
                | SendOnlyWithImm
                | SendOnlyWithInvalidate
                | WriteLast
                | WriteLastWithImm
                | WriteOnly
                | WriteOnlyWithImm
                | ReadResponseLast
                | ReadResponseOnly
        )
    }

    /// A SEND-family opcode (consumes a receive WQE).
    pub fn is_send(self) -> bool {
        (self as u8) <= 0x05 || matches!(self, Opcode::SendLastWithInvalidate | Opcode::SendOnlyWithInvalidate)
    }

    /// A WRITE-family opcode.
    pub fn is_write(self) -> bool {
        (0x06..=0x0B).contains(&(self as u8))
    }

    /// A READ response opcode.
    pub fn is_read_response(self) -> bool {
        (0x0D..=0x10).contains(&(self as u8))
    }

    /// An offload response opcode.
    pub fn is_offload_response(self) -> bool {
        (0xC1..=0xC4).contains(&(self as u8))
    }

    /// Offload response opcode for packet `idx` of `n`.
    pub fn offload_response(idx: u32, n: u32) -> Opcode {
        match (idx == 0, idx + 1 == n) {
            (true, true) => Opcode::OffloadResponseOnly,
            (true, false) => Opcode::OffloadResponseFirst,
            (false, true) => Opcode::OffloadResponseLast,
            (false, false) => Opcode::OffloadResponseMiddle,
        }
    }

    /// An atomic request opcode.
    pub fn is_atomic(self) -> bool {
        matches!(self, Opcode::CompareSwap | Opcode::FetchAdd)
    }

    /// Opcode for a SEND or WRITE packet at a given position of its message.
    pub fn for_position(write: bool, first: bool, last: bool, imm: bool) -> Opcode {
        use Opcode::*;
        match (write, first, last, imm) {
            (false, true, true, false) => SendOnly,
            (false, true, true, true) => SendOnlyWithImm,
            (false, true, false, _) => SendFirst,
            (false, false, false, _) => SendMiddle,
            (false, false, true, false) => SendLast,
            (false, false, true, true) => SendLastWithImm,
            (true, true, true, false) => WriteOnly,
            (true, true, true, true) => WriteOnlyWithImm,
            (true, true, false, _) => WriteFirst,
            (true, false, false, _) => WriteMiddle,
            (true, false, true, false) => WriteLast,
            (true, false, true, true) => WriteLastWithImm,
        }
    }

    /// READ response opcode for packet `idx` of `n`.
    pub fn read_response(idx: u32, n: u32) -> Opcode {
        match (idx == 0, idx + 1 == n) {
            (true, true) => Opcode::ReadResponseOnly,
            (true, false) => Opcode::ReadResponseFirst,
            (false, true) => Opcode::ReadResponseLast,
            (false, false) => Opcode::ReadResponseMiddle,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rc_opcode_round_trips() {
        let mut n = 0;
        for v in 0u8..=0xFF {
            if let Some(op) = Opcode::from_u8(v) {
                assert_eq!(op as u8, v);
                n += 1;
            }
        }
        assert_eq!(
            n, 32,
            "23 RC opcodes, the RoCEv2 CNP and the flexns GRANT, PROBE, PROBE_REPLY, offload request and responses"
        );
        assert!(Opcode::from_u8(0x15).is_none());
        assert!(Opcode::from_u8(0x18).is_none());
    }

    #[test]
    fn positions() {
        assert_eq!(Opcode::for_position(true, true, false, true), Opcode::WriteFirst);
        assert_eq!(Opcode::for_position(false, false, true, true), Opcode::SendLastWithImm);
        assert_eq!(Opcode::read_response(0, 1), Opcode::ReadResponseOnly);
        assert_eq!(Opcode::read_response(2, 3), Opcode::ReadResponseLast);
        assert!(Opcode::SendOnlyWithInvalidate.is_send());
        assert!(!Opcode::WriteFirst.is_send());
    }
}
