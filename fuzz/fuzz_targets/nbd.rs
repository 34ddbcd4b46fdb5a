//! NBD from a client: transmission request headers (checked against an export of arbitrary
//! size and negotiated features) and the option payloads of INFO/GO and LIST/SET_META_CONTEXT.
#![no_main]

use arbitrary::Arbitrary;
use block_agent::nbd::proto::{parse_go, parse_meta, Request, REQUEST_MAGIC};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
struct Input {
    header: [u8; 28],
    fix_magic: bool,
    size: u64,
    structured: bool,
    meta: bool,
    option: Vec<u8>,
}

fuzz_target!(|i: Input| {
    let mut h = i.header;
    if i.fix_magic {
        h[..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    }
    if let Ok(r) = Request::parse(&h) {
        let _ = r.check(i.size, i.structured, i.meta);
    }
    let _ = parse_go(&i.option);
    let _ = parse_meta(&i.option);
});
