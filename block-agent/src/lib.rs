//! block-agent: cloud block volumes over the Solar storage transport, exported to NBD clients
//! and stored durably on storage nodes.
//!
//! - [`store`]: the storage node's durable block store (data and metadata files, a write-ahead
//!   log with group commit, CRC32C per block checked on every read, replay after a crash).
//! - [`storage_node`]: the `block-server` daemon: volumes served over Solar on UDP, and over
//!   the plain block protocol on TCP (the reference).
//! - [`tcp_proto`]: the plain block protocol over kernel TCP (whole requests, no Solar layer).
//! - [`link`]: the agent's link to one storage node (a thread driving the sans-IO Solar client
//!   of `netstack::transport::solar` over UDP paths, or the plain protocol over one TCP
//!   connection).
//! - [`volume`]: a replicated volume (writes to every replica, reads with failover and repair,
//!   overlapping writes serialized).
//! - [`nbd`]: the NBD server that exports volumes to real clients.
//! - [`agent`]: the attached volumes of one host and their links.
//! - [`control`]: the control plane's gRPC services (storage node admin, agent admin, the
//!   controller with placement and its metadata in a file or etcd).
//! - [`daemon`]: the daemons (`block-server`, `block-agent`, `block-control`) as functions.

#![warn(unreachable_pub, missing_docs)]

pub mod agent;
pub mod control;
pub mod daemon;
mod episode;
pub mod link;
pub mod nbd;
pub mod qos;
pub mod storage_node;
pub mod store;
pub mod tcp_proto;
pub mod volume;
