//! block-agent: cloud block volumes over the Solar storage transport, exported to NBD clients
//! and stored durably on storage nodes.
//!
//! Built so far: [`store`], the storage node's durable block store (data and metadata files,
//! a write-ahead log with group commit, CRC32C per block checked on every read, replay after a
//! crash). The Solar transport itself is `netstack::transport::solar`. Still to build (the
//! block-agent issue): the `block-server` daemon on the store and Solar, the NBD-exporting
//! agent with 3-way replication, the control plane (`blkctl`) and the benchmarks.

pub mod store;
