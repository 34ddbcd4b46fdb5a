//! kvcache-engine: Mooncake-style KVCache transfer between LLM prefill and decode nodes, over
//! the flexns stack (or kernel TCP, when configured).
//!
//! The model is Mooncake's Transfer Engine, in Rust:
//! - one [`TransferEngine`] per process, named; its memory is a **segment** that peers open by
//!   name ([`TransferEngine::open_segment`]);
//! - buffers are registered ([`TransferEngine::register_memory`], GPU memory through
//!   [`gpu`] with the `gpu` feature) and addressed by virtual address;
//! - data moves in **batches** of READ/WRITE [`TransferRequest`]s with per-request and
//!   per-batch [`TransferStatus`], or synchronously ([`TransferEngine::transfer_sync_write`]);
//! - a [`Notification`] travels with (after) a batch, so a decode node learns its KV blocks
//!   landed ([`TransferEngine::get_notifies`]).
//!
//! What it fixes from Mooncake users' complaints: the configured transport is the one used (no
//! silent fallback; a peer on another transport is an error saying so); the advertised address
//! is chosen deliberately ([`netaddr`]); errors name the peer, the queue pair, its paths and the
//! cause; a WRITE completes only once the data is placed and visible at the target; stale
//! descriptors of restarted peers are detected and refreshed; etcd keys have a prefix.
//!
//! [`kvcache::PagedKvLayout`] maps vLLM-style paged KV blocks to requests, and [`daemon`] is
//! the `kvcache-engine` process (a decode node's KV pool, serving until stopped).

#![warn(unreachable_pub, missing_docs)]

pub mod batch;
pub mod config;
pub mod daemon;
pub mod engine;
mod error;
pub mod gpu;
pub mod hostmem;
pub mod kvcache;
mod memory;
mod metadata;
pub mod netaddr;
pub mod rpc;
pub mod segment;
mod transport;

pub use batch::{
    Notification, Opcode, SegmentHandle, TransferRequest, TransferState, TransferStatus, MAX_NOTIFY_BYTES,
};
pub use config::{EngineConfig, MetadataConfig, TransportKind};
pub use engine::{BatchId, TransferEngine};
pub use error::TransferError;
pub use segment::{BufferDesc, Location, SegmentDesc};

/// Entry points for the fuzz targets in `fuzz/`: the decoders of what peers send over the tcp
/// transport. Not an API.
#[doc(hidden)]
pub mod fuzzing {
    /// Bytes of a tcp transport frame header.
    pub const TCP_FRAME_HEADER: usize = crate::transport::tcp::HDR;

    /// Decodes a tcp transport frame header as a receiver does.
    pub fn tcp_frame_header(b: &[u8; TCP_FRAME_HEADER]) -> Result<(), String> {
        crate::transport::tcp::Header::decode(b).map(|_| ())
    }

    /// Decodes a notification as a receiver does (tcp frame payload or flexns SEND).
    pub fn notification(b: &[u8]) -> Result<(), String> {
        crate::transport::decode_notify(b).map(|_| ())
    }
}
