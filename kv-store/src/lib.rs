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
    #[error("key of {0} bytes: keys are 1 to 250 bytes")]
    BadKey(usize),
    #[error("value of {0} bytes is larger than the largest entry (64 KiB)")]
    TooLarge(usize),
    #[error("key not found")]
    NotFound,
    #[error("key exists")]
    Exists,
    #[error("store full: {0}")]
    Full(String),
    #[error("corrupt store: {0}")]
    Corrupt(String),
    #[error("bad configuration: {0}")]
    Config(String),
    #[error("server error: {0}")]
    Server(String),
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("timed out: {0}")]
    Timeout(String),
    #[error("shard unavailable: {0}")]
    Unavailable(String),
    #[error(transparent)]
    Verbs(#[from] netstack::verbs::VerbsError),
    #[error(transparent)]
    Cm(#[from] netstack::cm::CmError),
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}
