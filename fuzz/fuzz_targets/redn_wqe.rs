//! RedN work requests as a managed work queue reads them from registered memory (which a
//! remote peer may have written): eight words decoded into a send work request.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|w: [u64; 8]| {
    let _ = netstack::redn::wqe::decode(&w);
});
