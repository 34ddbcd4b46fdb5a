//! Links: what a data core sends and receives RoCEv2 (and Solar) datagrams through. A link has
//! one or more ports, each with its own local address (the main socket of each local address,
//! then the extra source ports multipath sprays over). Three implementations:
//! - [`udp`]: kernel UDP sockets with batched `sendmmsg`/`recvmmsg`, GSO, GRO and ECN (the
//!   default);
//! - [`shm`]: shared-memory rings to peers on the same host that run it too (no system call on
//!   the data path), the UDP sockets for every other peer;
//! - [`sim`]: a deterministic simulated network in one process, with a simulated clock and
//!   fault injection (loss, duplication, reordering, corruption, partitions, path cuts) and a
//!   pcap writer: the whole stack runs on it in the simulator tests.

pub mod shm;
pub mod sim;
pub mod sys;
pub mod udp;

use std::io;
use std::net::SocketAddrV4;
use std::os::fd::RawFd;
use sys::{OutMsg, RecvBatch, SendScratch};

/// The ports a data core sends and receives through. Every method is nonblocking.
pub trait Link: Send + Sync {
    /// How many ports it has.
    fn ports(&self) -> usize;
    /// The local address of port `port` (the source of what it sends).
    fn local_addr(&self, port: usize) -> SocketAddrV4;
    /// Sends a batch from `port` (`scratch` is space the caller reuses across batches); returns
    /// how many messages were taken. A message with a GSO size is cut into datagrams of that size.
    fn send(&self, port: usize, msgs: &mut [OutMsg], scratch: &mut SendScratch) -> io::Result<usize>;
    /// Receives what has arrived at `port` into `batch`; returns how many receives it holds.
    fn recv(&self, port: usize, batch: &mut RecvBatch) -> io::Result<usize>;
    /// A descriptor that becomes readable when `port` has datagrams, for a core that sleeps;
    /// `None` when nothing needs waking (a simulated link's driver runs the core itself).
    fn wait_fd(&self, port: usize) -> Option<RawFd>;
    /// The IP MTU of the route to `to`, when the link knows it.
    fn route_mtu(&self, to: SocketAddrV4) -> Option<u32>;
    /// The core is about to sleep on [`Link::wait_fd`]: arranges to be woken through it for
    /// traffic that does not pass the descriptor, and returns false (arranging nothing) when
    /// such traffic is already waiting.
    fn prepare_sleep(&self, _port: usize) -> bool {
        true
    }
    /// The core woke (or did not sleep after [`Link::prepare_sleep`] said it could).
    fn woke(&self, _port: usize) {}
    /// What the link counted itself, over all its ports.
    fn stats(&self) -> LinkStats {
        LinkStats::default()
    }
}

/// Counters a link keeps itself (the engine counts everything else).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkStats {
    /// Messages sent through shared-memory rings.
    pub ring_tx_messages: u64,
    /// Messages received from shared-memory rings.
    pub ring_rx_messages: u64,
    /// Peers sent to through a ring now.
    pub ring_peers: u64,
    /// Doorbells sent: datagrams that woke a peer sleeping on its socket after a ring send.
    pub ring_doorbells: u64,
}
