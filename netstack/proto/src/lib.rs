//! flexns' protocol core: everything about the protocols that needs no I/O. It takes packets,
//! posted work requests and the current time from its driver, and returns packets to send,
//! completions and deadlines; it never reads a clock, opens a socket, starts a thread, takes a
//! lock or holds `unsafe` code. netstack's engine drives it over UDP or shared memory, and the
//! deterministic simulator drives it over a simulated network and clock (the shape of
//! quinn-proto and smoltcp).
//!
//! - [`wire`]: RoCEv2 headers, the ICRC, a checked zero-copy packet view.
//! - [`work`]: work requests and completions with ibverbs' names.
//! - [`memory`]: what a transport needs of registered memory ([`memory::KeyTable`],
//!   [`memory::SharedRegion`]); netstack's `mem` implements it.
//! - [`cc`]: per-packet programmable congestion control (DCQCN, TIMELY, HPCC, Swift, Homa).
//! - [`path`]: multipath: spray policies, per-path RTT, loss and health with probing.
//! - [`rtt`]: the RTT estimator (RFC 6298) that RC, the paths and Solar share.
//! - [`transport`]: the RC transport (requester, responder, selective repeat, offload
//!   requests), Solar's client and server, and the pacer.
//!
//! The lints in `clippy.toml` beside this crate refuse clocks, threads, locks, sockets and
//! iteration over unordered maps; `unsafe` is forbidden outright.

#![forbid(unsafe_code)]
#![deny(clippy::disallowed_methods, clippy::disallowed_types)]
#![warn(unreachable_pub, missing_docs)]

pub mod cc;
pub mod memory;
pub mod path;
pub mod rtt;
pub mod transport;
pub mod wire;
pub mod work;
