//! Property tests: the packet decoder never panics on arbitrary bytes, and what the header
//! builder emits parses back to the same fields.

use flexns_proto::wire::*;
use proptest::prelude::*;
use std::net::SocketAddrV4;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    #[test]
    fn parse_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..5000)) {
        if let Ok(v) = PacketView::parse(&bytes) {
            // a parsed view's slices lie within the datagram
            prop_assert!(v.payload.len() + v.trailer.len() <= bytes.len());
        }
        let s: SocketAddrV4 = "127.0.0.1:1".parse().unwrap();
        let _ = PacketView::verify_icrc(&bytes, s, s);
    }

    #[test]
    fn emitted_headers_parse_back(op in 0u8..0x18, qp in 0u32..(1 << 24), psn in 0u32..(1 << 24),
                                  va in any::<u64>(), rkey in any::<u32>(), len in 0usize..4096,
                                  imm in any::<u32>(), ack in any::<bool>()) {
        let Some(opcode) = Opcode::from_u8(op) else { return Ok(()) };
        let hs = opcode.headers();
        let mut bth = Bth::new(op, qp, psn);
        bth.ack_req = ack;
        let mut h = HeaderBuf::with_bth(&bth);
        if hs.reth { h.push_reth(&Reth { va, rkey, dma_len: len as u32 }); }
        if hs.aeth { h.push_aeth(&Aeth { syndrome: Syndrome::Ack { credits: 0x1F }, msn: psn }); }
        if hs.atomic_eth { h.push_atomic(&AtomicEth { va, rkey, swap_add: va ^ 1, compare: va ^ 2 }); }
        if hs.atomic_ack_eth { h.push_atomic_ack(&AtomicAckEth { orig: va }); }
        if hs.imm { h.push_u32(imm); }
        if hs.ieth { h.push_u32(rkey); }
        let payload = if hs.payload { vec![0xA5u8; len] } else { Vec::new() };
        h.set_pad_for(payload.len());
        let (s, d): (SocketAddrV4, SocketAddrV4) = ("10.1.1.1:50000".parse().unwrap(), "10.1.1.2:4791".parse().unwrap());
        let mut out = Vec::new();
        encode_into(&mut out, &h, &[&payload], s, d);
        let v = PacketView::parse(&out).unwrap();
        prop_assert_eq!(v.opcode, opcode);
        prop_assert_eq!(v.bth.dest_qp, qp);
        prop_assert_eq!(v.bth.psn, psn);
        prop_assert_eq!(v.bth.ack_req, ack);
        prop_assert_eq!(v.payload, &payload[..]);
        if hs.reth { prop_assert_eq!(v.reth.unwrap(), Reth { va, rkey, dma_len: len as u32 }); }
        if hs.imm { prop_assert_eq!(v.imm, Some(imm)); }
        prop_assert!(PacketView::verify_icrc(&out, s, d).is_ok());
        // any single bit flip is caught by the ICRC (or makes the packet unparsable)
        let bit = (psn as usize) % (out.len() * 8);
        let mut bad = out.clone();
        bad[bit / 8] ^= 1 << (bit % 8);
        let masked = bit / 8 == 4; // BTH byte 4 is outside the ICRC by design
        if !masked {
            prop_assert!(PacketView::verify_icrc(&bad, s, d).is_err());
        }
    }
}
