//! The connection manager's messages as a server receives them: a batch of connect requests
//! (protobuf from any TCP peer), each endpoint checked as the server checks it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use netstack::cm::pb::{ConnectBatch, ConnectRequest};
use netstack::verbs::Endpoint;
use prost::Message;

fuzz_target!(|b: &[u8]| {
    if let Ok(batch) = ConnectBatch::decode(b) {
        for r in batch.requests {
            let _ = Endpoint::try_from(r.endpoint);
        }
    }
    if let Ok(r) = ConnectRequest::decode(b) {
        let _ = Endpoint::try_from(r.endpoint);
    }
});
