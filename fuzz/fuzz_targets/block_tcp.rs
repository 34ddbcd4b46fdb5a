//! The block service's TCP storage protocol header (the agent's `--transport tcp` reference).
#![no_main]

use block_agent::tcp_proto::{Header, HDR};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|b: [u8; HDR]| {
    let _ = Header::decode(&b);
});
