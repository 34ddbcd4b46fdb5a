//! The kv protocol: RPC requests a server decodes, replies a client decodes, multi-get bodies
//! and offloaded-get replies.
#![no_main]

use kv_store::proto::{decode_multi_get, decode_reply, decode_request, GetReply};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|b: &[u8]| {
    let _ = decode_request(b);
    let _ = decode_reply(b);
    let _ = decode_multi_get(b);
    let _ = GetReply::decode(b);
});
