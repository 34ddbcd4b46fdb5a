//! kv-store: a DrTM-style key-value store whose gets are served inside the flexns stack.
//!
//! - [`layout`]: buckets, slots and versioned entries in registered memory, and validation.
//! - [`store`]: the partition's single writer and the lock-free local lookup.
//! - [`offload`]: gets served by offload handlers next to the data (one round trip), and the
//!   hybrid get with its hot-value cache (DrTM-KV A4+A5).
//! - [`proto`]: the handshake, RPC messages, offloaded-get replies, the shard map.
//! - [`server`]: a `kv-server` partition: the stack, the store, RPC, RedN chains, RESP.
//! - [`client`]: the client library with the five get paths and batching.
//! - [`resp`]: the RESP (redis protocol) front door.
//! - [`shardmap`]: the shard map in etcd (the embedded default needs none).
//! - [`cli`]: the `kv-server` command line.

#![warn(unreachable_pub, missing_docs)]

pub mod cli;
pub mod client;
pub mod layout;
pub mod offload;
pub mod proto;
pub mod resp;
pub mod server;
pub mod shardmap;
pub mod store;

/// Errors of the store, its server and its clients.
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    /// A key outside 1..=250 bytes (its length).
    #[error("key of {0} bytes: keys are 1 to 250 bytes")]
    BadKey(usize),
    /// A value larger than the largest entry (its length).
    #[error("value of {0} bytes is larger than the largest entry (64 KiB)")]
    TooLarge(usize),
    /// The key is not in the store.
    #[error("key not found")]
    NotFound,
    /// An insert found the key already there.
    #[error("key exists")]
    Exists,
    /// No free entry or slot for the write (what ran out).
    #[error("store full: {0}")]
    Full(String),
    /// The store's memory failed validation (what was wrong).
    #[error("corrupt store: {0}")]
    Corrupt(String),
    /// A configuration value is invalid (names the field).
    #[error("bad configuration: {0}")]
    Config(String),
    /// The server answered a request with an error.
    #[error("server error: {0}")]
    Server(String),
    /// A message broke the wire protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// A request got no answer in time (what was waited for).
    #[error("timed out: {0}")]
    Timeout(String),
    /// The shard that owns the key cannot be reached.
    #[error("shard unavailable: {0}")]
    Unavailable(String),
    /// A verbs call of the flexns stack failed.
    #[error(transparent)]
    Verbs(#[from] netstack::verbs::VerbsError),
    /// The flexns connection manager failed (connect, accept).
    #[error(transparent)]
    Cm(#[from] netstack::cm::CmError),
    /// A socket or file operation failed.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}
