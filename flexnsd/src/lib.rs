//! flexnsd: the flexns stack as its own process (docs/FLEXNSD.md). The daemon owns one engine
//! context; applications attach over a Unix socket ([`proto`]) and post work through
//! shared-memory rings ([`shm`]), with the [`client`] library.
//!
//! `unsafe` lives in two modules only: [`sys`] (system calls: sockets with `SCM_RIGHTS`,
//! eventfds, memfds, `poll`) and [`shm`] (mappings of shared memory, accessed by atomics).

#![warn(unreachable_pub, missing_docs)]

pub mod client;
pub mod daemon;
pub mod proto;
pub mod shm;
pub mod sys;
