//! The KV-cache engine's tcp transport as a receiver sees it: frame headers (valid magic most of
//! the time, so the length checks are reached) and notification payloads.
#![no_main]

use arbitrary::Arbitrary;
use kvcache_engine::fuzzing::{notification, tcp_frame_header, TCP_FRAME_HEADER};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
struct Input {
    header: [u8; TCP_FRAME_HEADER],
    fix_magic: bool,
    payload: Vec<u8>,
}

fuzz_target!(|i: Input| {
    let mut h = i.header;
    if i.fix_magic {
        // the frame magic ("KVT1", little-endian u32 0x3154564B)
        h[..4].copy_from_slice(b"KVT1");
    }
    let _ = tcp_frame_header(&h);
    let _ = notification(&i.payload);
});
