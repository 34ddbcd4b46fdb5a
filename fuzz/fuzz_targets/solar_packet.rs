//! Solar storage-transport packets: arbitrary 64-byte headers with the right magic, version
//! and (most of the time) a correct header CRC, so the parser's deeper checks are reached.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use netstack::transport::solar::wire::{packet_len, Header, HDR};

#[derive(Debug, Arbitrary)]
struct Input {
    header: [u8; HDR],
    block: Vec<u8>,
    fix_magic: bool,
    fix_crc: bool,
}

fuzz_target!(|i: Input| {
    let mut p = i.header.to_vec();
    if i.fix_magic {
        p[0] = 0x53;
        p[1] = 1;
    }
    p.extend_from_slice(&i.block);
    if i.fix_crc {
        // CRC32C of the header without its CRC field (bytes 52..56), as the format defines
        let c = crc32c::crc32c_append(crc32c::crc32c(&p[..52]), &p[56..HDR]);
        p[52..56].copy_from_slice(&c.to_be_bytes());
    }
    let _ = packet_len(&p);
    let _ = Header::decode(&p);
});
