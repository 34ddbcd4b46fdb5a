//! flexnsd: the flexns stack as its own process (docs/FLEXNSD.md). The daemon owns one engine
//! context; applications attach over a Unix socket ([`proto`]) and post work through
//! shared-memory rings ([`shm`]). The protocol, the rings and the application's side
//! ([`client`]) live in netstack ([`netstack::verbs::attach`]), so that netstack's verbs API can attach
//! to a daemon itself; they are re-exported here under their old names.

#![warn(unreachable_pub, missing_docs)]

pub mod daemon;
pub use netstack::verbs::attach::{client, proto, shm, sys};
