//! Solar: the storage transport (after Alibaba's Solar in EBS), sans-IO like the RC transport.
//!
//! One 4 KiB block per packet, each packet self-describing (request id, volume, block address,
//! index within the request, flags, the block's CRC32C), so blocks are placed independently,
//! in any order, with no reassembly buffer. Every block is acknowledged on its own; only lost
//! blocks are resent, on another path. Requests spray over all paths (UDP source ports) with
//! per-path health; congestion control comes from [`crate::cc`] (one window per destination,
//! across its paths). A storage server drops a write older than one it already took for the
//! same block (request ids increase per volume), so a late retransmission never overtakes a
//! newer write.
//!
//! - [`wire`]: the 64-byte header.
//! - [`client`]: the storage agent's side toward one storage server.
//! - [`server`]: the storage server's side (the storage itself is the driver's).
//! - [`validation`]: the server's address validation (a forged source address gets no more
//!   than three times what it sent).
//!
//! Neither side does I/O or reads a clock: the driver hands in packets and the time, and sends
//! what [`client::SolarClient::poll_transmit`] / [`server::SolarServer::poll_transmit`] give.

pub mod client;
pub mod server;
pub mod validation;
pub mod wire;

use std::sync::Arc;

/// A packet to send: the header and, for WRITE and READ_DATA, a block referenced in place.
#[derive(Debug, Clone)]
pub struct Transmit {
    /// The path (the header carries it; answers echo it).
    pub path: u16,
    /// The driver's source port (index) the packet leaves from: the client path's current
    /// one (a path that looked cut moves to a spare, see [`crate::path::PathSet::set_ports`]);
    /// a server answers from its port 0.
    pub port: u16,
    /// The driver's token of the peer (servers answer many agents; clients use 0).
    pub peer: u64,
    /// The encoded header.
    pub header: [u8; wire::HDR],
    /// The block that follows it (WRITE, READ_DATA).
    pub block: Option<BlockRef>,
}

/// A block inside a shared buffer.
#[derive(Debug, Clone)]
pub struct BlockRef {
    /// The buffer.
    pub data: Arc<[u8]>,
    /// Where the block starts in it.
    pub off: usize,
}

impl BlockRef {
    /// The block's 4 KiB.
    pub fn bytes(&self) -> &[u8] {
        &self.data[self.off..self.off + wire::BLOCK]
    }
}

impl Transmit {
    /// The whole packet in one buffer (a copy; drivers may send header and block as iovecs).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = self.header.to_vec();
        if let Some(b) = &self.block {
            v.extend_from_slice(b.bytes());
        }
        v
    }
}
