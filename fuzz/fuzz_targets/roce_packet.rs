//! RoCEv2 packets as they arrive in a UDP datagram: the base header with a valid version and a
//! congestion-control header length in range (so inputs get past the first checks), any
//! opcode, then arbitrary extended headers, payload and trailer; also the raw bytes as they are.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use netstack::wire::headers::Bth;
use netstack::wire::packet::PacketView;

#[derive(Debug, Arbitrary)]
struct Input {
    opcode: u8,
    cc_words: u8,
    dest_qp: u32,
    psn: u32,
    pad: u8,
    flags: u8,
    path: u8,
    rest: Vec<u8>,
    raw: bool,
}

fuzz_target!(|i: Input| {
    if i.raw {
        let _ = PacketView::parse(&i.rest);
        return;
    }
    let mut b = Bth::new(i.opcode, i.dest_qp, i.psn);
    b.cc_words = i.cc_words % 17;
    b.pad = i.pad & 3;
    b.ack_req = i.flags & 1 != 0;
    b.fecn = i.flags & 2 != 0;
    b.becn = i.flags & 4 != 0;
    b.path = i.path & 0x7F;
    let mut d = vec![0u8; Bth::LEN];
    b.emit(&mut d);
    d.extend_from_slice(&i.rest);
    if let Ok(v) = PacketView::parse(&d) {
        // every view the parser returns is within the datagram
        assert!(v.payload.len() + v.trailer.len() <= d.len());
    }
});
