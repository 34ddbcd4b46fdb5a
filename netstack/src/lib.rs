//! flexns netstack: a software-programmable RDMA network stack.
//!
//! Layers, bottom up (see `docs/ARCHITECTURE.md`):
//! - [`wire`]: RoCEv2 headers, the ICRC, a checked zero-copy packet view.
//! - [`mem`]: registered memory regions and the key table.
//! - [`work`]: work requests and completions with ibverbs' names.
//! - `pipe` (internal): SPSC notification pipes of 64-byte slots between application and engine
//!   threads (public with the `bench-internals` feature, for its criterion bench only).
//! - [`transport`]: sans-IO transports ([`transport::rc`]).
//! - [`link`]: what a data core sends and receives through: UDP sockets with batched
//!   `sendmmsg`/`recvmmsg`, or a deterministic simulated network and clock.
//! - `chain` (internal): the engine's side of RedN: managed work queues and the chain runner.
//! - `engine` (internal): the data-core threads that drive transports over a link.
//! - [`verbs`]: the application API (`Context`, `Pd`, `Mr`, `Cq`, `Qp`), on an in-process engine
//!   or attached to `flexnsd` (the stack as its own process: [`verbs::attach`], its control
//!   protocol, shared-memory rings and client).
//! - [`offload`]: the programmable offloading engine (handlers on offload threads, DMA).
//! - [`redn`]: RedN work-request programs on managed QPs (WAIT, ENABLE, self-modifying chains):
//!   the model, the chain builder and the programs, over [`verbs`] and `chain`.
//! - [`cm`]: connection management over gRPC.
//! - `cli` (feature `cli`): the command-line flags every binary flattens, mapped to a
//!   [`config::ContextConfig`] in one place.
//! - [`path`]: multipath: spray policies, per-path RTT, loss and health with probing.
//! - `rtt` (internal): the RTT estimator (RFC 6298) RC, the paths and Solar share.
//! - [`cc`]: per-packet programmable congestion control (DCQCN, TIMELY, HPCC, Swift, Homa).
//! - [`sim`]: a deterministic network simulator that runs the real transport and CC.

//!
//! The internal modules are private: what applications and the services need of them is
//! re-exported by [`verbs`] (engine statistics, drive and poll modes, Solar endpoints),
//! [`redn`] and [`config`] (RedN's managed queues and guards). `unreachable_pub` keeps every
//! other item of theirs crate-visible only, and `missing_docs` every public item documented.

#![warn(unreachable_pub, missing_docs)]

pub mod cc;
mod chain;
#[cfg(feature = "cli")]
pub mod cli;
pub mod cm;
pub mod config;
mod engine;
pub mod link;
pub mod mem;
pub mod offload;
pub use flexns_proto::path;
#[cfg(feature = "bench-internals")]
pub mod pipe;
// its items are `pub` so that the `bench-internals` build can show them to the pipe bench
#[cfg(not(feature = "bench-internals"))]
#[allow(unreachable_pub)]
mod pipe;
pub mod redn;
pub mod samehost;
pub mod sim;
pub mod telemetry;
pub mod transport;
pub mod verbs;
pub use flexns_proto::{wire, work};
