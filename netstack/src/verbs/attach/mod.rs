//! Attaching to `flexnsd`, the stack as its own process (docs/FLEXNSD.md): the control
//! protocol over a Unix socket ([`proto`]), the shared-memory rings ([`shm`]), the system calls
//! both sides make ([`sys`]) and the application's side ([`client`]). The daemon (crate
//! `flexnsd`) serves the other side of the same modules.
//!
//! [`crate::verbs::Context`] opens a [`client::Attachment`] instead of an engine when its
//! configuration names a daemon (`flexnsd` in [`crate::config::ContextConfig`], or the
//! environment's `FLEXNS_FLEXNSD`), so that code written against the verbs API runs either way.
//!
//! `unsafe` lives in two of these modules only: [`sys`] (system calls: sockets with
//! `SCM_RIGHTS`, eventfds, memfds, `poll`) and [`shm`] (mappings of shared memory, accessed by
//! atomics).

pub mod client;
pub mod proto;
pub mod shm;
pub mod sys;
