//! RESP (the redis protocol kv-server speaks): arrays of bulk strings and inline commands, from
//! the front of a client's byte stream.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|b: &[u8]| {
    let _ = kv_store::resp::parse(b);
});
