//! RedN work-request programs: managed QPs whose send queue is a ring of work-queue entries in
//! registrable memory ([`wqe`] has the layout), executed by the data core only as far as an
//! ENABLE allows, with WAIT, ENABLE and NOOP; and a builder for the `if` and `while`
//! constructs ([`builder`]).
//!
//! # Execution model
//! The engine fetches a managed QP's entry `i` (reads its 64 bytes from the ring) only when
//! `i < enabled` and every earlier entry was fetched, so RECV scatter, WRITE, READ and CAS that
//! land in the ring before then change what executes (self-modifying chains). Fetching stops
//! at a WAIT until its completion queue has produced the WAIT's count of completions; nothing
//! after a WAIT is fetched before, so a WAIT is also the instruction barrier that RedN gets from
//! WAIT + ENABLE on a NIC that prefetches. A WAIT's and an ENABLE's fields are read when they
//! are fetched. ENABLE raises another (or the same) managed QP's `enabled` index; indices count
//! posts since the QP was created and never wrap, so a ring is re-executed (WQ recycling) by
//! enabling indices past the posted ones: index `i` executes entry `i mod slots`.
//!
//! The verbs a chain runs (SEND, WRITE, READ, CAS, FETCH_ADD, NOOP) go through the QP's normal
//! RC transport. Chains that operate on the server's own memory use a QP connected to another
//! QP of the same data core (a loopback peer): the engine executes their READ, WRITE, atomics
//! and NOOPs on memory directly, with the peer's access checks and in-order completions, as a
//! NIC executes loopback traffic internally; their other packets (and those of loopback QPs
//! on different cores of the context) are delivered in memory (hairpin), never through a
//! socket.
//!
//! # Guards
//! Per managed QP ([`RednGuards`]): at most `max_wr_per_sec` entries per second (a token
//! bucket checked when the QP starts fetching after a WAIT or when new entries are enabled, so
//! a segment between WAITs runs whole), and at most `max_wr_per_chain` entries per chain; a
//! chain ends when the QP waits on another QP's completions or runs out of enabled entries, so a
//! loop that only waits on itself is one chain and is aborted at the limit (the QP enters ERR).

pub mod builder;
pub mod programs;

pub use crate::chain::{wqe, ManagedWq, RednGuards, RednStats};
