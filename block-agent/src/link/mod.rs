//! The agent's link to one storage node, over one of two carriers:
//! - `solar`: a Solar client endpoint on a netstack context's data core (the
//!   [`netstack::transport::solar`] protocol; each path one of the core's source ports, its own
//!   ECMP flow), shared by the process's links;
//! - `tcp`: the plain block protocol ([`crate::tcp_proto`]) over one kernel TCP
//!   connection: whole requests, many in flight, no Solar layer (the reference), run by one
//!   task on the runtime the link is opened on, as the Solar link's core is.
//!
//! Callers submit block reads and writes from any thread and get a [`Reply`], a future of the
//! answer. A link follows its storage node to a new address ([`Link::retarget`]).

mod solar;
mod tcp;

use netstack::cc::CcKind;
pub use netstack::transport::solar::client::Target;
use netstack::transport::solar::client::{ClientConfig, ClientStats, IoError, SubmitError};
use netstack::transport::solar::wire::BLOCK;
use netstack::verbs::solar::SolarError;
use parking_lot::Mutex;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::sync::oneshot;

/// How the blocks travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Carrier {
    /// Solar over UDP with this many paths (source ports).
    Udp {
        /// Paths (source ports), 1 or more.
        paths: u16,
    },
    /// The plain block protocol over one kernel TCP connection.
    Tcp,
}

/// Settings of a link.
#[derive(Debug, Clone)]
pub struct LinkConfig {
    /// The storage node's address.
    pub server: SocketAddr,
    /// How the blocks travel.
    pub carrier: Carrier,
    /// The Solar client's settings (`paths` is taken from the carrier); the TCP link takes
    /// its request ids (`rpc_base`) and I/O timeout from here too.
    pub client: ClientConfig,
    /// Congestion control of the link (one window across its paths).
    pub cc: CcKind,
    /// Swift's base target delay (network share of the RTT; loopback on a busy 2-core machine
    /// queues in the scheduler, so not the tens of microseconds of a real fabric).
    pub cc_target_ns: u64,
    /// Swift's smallest window in packets. A storage link keeps at least a couple of blocks in
    /// flight: below one packet Swift paces, and a window of 0.01 packets left writes waiting
    /// for a hundred RTTs behind a scheduler hiccup on a loaded host.
    pub cc_min_window: f64,
    /// How the Solar data core waits for work (the first link of a context sets it).
    pub poll_mode: netstack::verbs::PollMode,
    /// Who runs the Solar data core (the first link of a context sets it):
    /// [`netstack::verbs::Drive::Runtime`], a task on the runtime the link is opened on (the
    /// agent's: the NBD side and the link's receives run on one thread, no hand-off per
    /// answer), or [`netstack::verbs::Drive::Threads`], a data-core thread. A link opened
    /// outside a runtime, or whose `poll_mode` spins, gets a thread.
    pub drive: netstack::verbs::Drive,
}

impl LinkConfig {
    /// Defaults toward `server`: 4 UDP paths, Swift congestion control, request ids seeded
    /// from the wall clock (so they keep increasing across agent restarts).
    pub fn new(server: SocketAddr, carrier: Carrier) -> LinkConfig {
        let rpc_base = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        LinkConfig {
            server,
            carrier,
            client: ClientConfig {
                rpc_base,
                initial_rto_ns: 20_000_000,
                min_rto_ns: 2_000_000,
                window_bytes: 1024 * BLOCK as u64,
                ..ClientConfig::default()
            },
            cc: CcKind::Swift,
            cc_target_ns: 500_000,
            cc_min_window: 2.0,
            poll_mode: netstack::verbs::PollMode::Sleep,
            drive: netstack::verbs::Drive::Runtime,
        }
    }
}

/// Why a link request failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LinkError {
    /// A request failed in transit (the node's address, the error).
    #[error("storage node {0}: {1}")]
    Io(SocketAddr, IoError),
    /// A request could not be submitted (the node's address, why).
    #[error("storage node {0}: {1}")]
    Submit(SocketAddr, SubmitError),
    /// The link's thread has stopped (the node's address).
    #[error("storage node {0}: the link stopped")]
    Stopped(SocketAddr),
    /// The link could not be set up (the node's address, why).
    #[error("storage node {0}: {1}")]
    Setup(SocketAddr, String),
}

/// What a read answers: the blocks, in order.
pub type ReadResult = Result<Vec<u8>, LinkError>;

/// What a link reports about itself.
#[derive(Debug, Clone, Default)]
pub struct LinkStatus {
    /// The link's client counters (packets, blocks, resends).
    pub stats: ClientStats,
    /// Paths the link uses (1 over TCP).
    pub paths: u16,
    /// Paths up now.
    pub paths_up: u16,
    /// Per path (Solar): up, sent, delivered, lost, RTT. Empty over TCP.
    pub path_stats: Vec<netstack::path::PathStats>,
    /// Requests in flight now.
    pub outstanding: usize,
}

/// The answer to a link request, as a future: `Err(RecvError)` when the link dropped it
/// unanswered.
pub struct Reply<T>(ReplyFrom<T>);

enum ReplyFrom<T> {
    /// From the TCP link's task.
    Link(oneshot::Receiver<Result<T, LinkError>>),
    /// From the Solar client's data core, toward this storage node.
    Solar(oneshot::Receiver<Result<T, SolarError>>, SocketAddr),
}

impl<T> Future for Reply<T> {
    type Output = Result<Result<T, LinkError>, oneshot::error::RecvError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.get_mut().0 {
            ReplyFrom::Link(rx) => Pin::new(rx).poll(cx),
            ReplyFrom::Solar(rx, server) => Pin::new(rx).poll(cx).map(|r| {
                r.map(|r| {
                    r.map_err(|e| match e {
                        SolarError::Io(e) => LinkError::Io(*server, e),
                        SolarError::Submit(e) => LinkError::Submit(*server, e),
                        SolarError::Stopped => LinkError::Stopped(*server),
                    })
                })
            }),
        }
    }
}

/// A request to a link's driver.
enum Cmd {
    Write {
        target: Target,
        data: Arc<[u8]>,
        fua: bool,
        version: u64,
        done: oneshot::Sender<Result<(), LinkError>>,
    },
    Read {
        target: Target,
        blocks: u16,
        done: oneshot::Sender<ReadResult>,
    },
    /// Zeroes (deallocates) blocks: no payload.
    WriteZeroes {
        target: Target,
        blocks: u16,
        version: u64,
        done: oneshot::Sender<Result<(), LinkError>>,
    },
    /// The storage node now serves at this address (it restarted elsewhere).
    Retarget(SocketAddr),
}

enum Driver {
    Solar(solar::SolarLink),
    Tcp(tcp::TcpLink),
}

/// A link to one storage node; dropping it stops its threads (requests in flight fail).
pub struct Link {
    /// The storage node's current address.
    server: Mutex<SocketAddr>,
    driver: Driver,
}

impl Link {
    /// Opens the sockets and starts the link's threads.
    pub fn start(cfg: LinkConfig) -> Result<Link, LinkError> {
        let server = Mutex::new(cfg.server);
        let driver = match cfg.carrier {
            Carrier::Udp { .. } => Driver::Solar(solar::SolarLink::start(cfg)?),
            Carrier::Tcp => Driver::Tcp(tcp::TcpLink::start(cfg)?),
        };
        Ok(Link { server, driver })
    }

    /// The storage node's address.
    pub fn server(&self) -> SocketAddr {
        *self.server.lock()
    }

    /// Follows the storage node to `addr` (it restarted on another address): requests go there
    /// from now on, and those in flight to the old address are sent again there.
    pub fn retarget(&self, addr: SocketAddr) {
        let mut cur = self.server.lock();
        if *cur == addr {
            return;
        }
        tracing::info!("link to storage node {} now at {addr}", *cur);
        *cur = addr;
        drop(cur);
        match &self.driver {
            Driver::Solar(l) => l.retarget(addr),
            Driver::Tcp(l) => l.submit(Cmd::Retarget(addr)),
        }
    }

    /// Writes `data` (whole blocks) at `target` as `version` (the node orders writes to a
    /// block by it and stores it: one increasing sequence per volume, the same on every
    /// replica, see [`crate::volume::Volume`]); answered once every block is durable on the
    /// node. A node that fenced the volume at a higher epoch than the target's refuses it
    /// (`WrongEpoch`).
    pub fn write(&self, target: Target, data: Arc<[u8]>, fua: bool, version: u64) -> Reply<()> {
        match &self.driver {
            Driver::Solar(l) => Reply(ReplyFrom::Solar(
                l.write(target, Some(data), 0, fua, version),
                self.server(),
            )),
            Driver::Tcp(l) => {
                let (done, rx) = oneshot::channel();
                l.submit(Cmd::Write {
                    target,
                    data,
                    fua,
                    version,
                    done,
                });
                Reply(ReplyFrom::Link(rx))
            }
        }
    }

    /// Zeroes `blocks` blocks at `target` (TRIM, WRITE_ZEROES): nothing but headers cross the
    /// network, and the node gives the blocks' space back; answered once durable.
    pub fn write_zeroes(&self, target: Target, blocks: u16, version: u64) -> Reply<()> {
        match &self.driver {
            Driver::Solar(l) => Reply(ReplyFrom::Solar(
                l.write(target, None, blocks, false, version),
                self.server(),
            )),
            Driver::Tcp(l) => {
                let (done, rx) = oneshot::channel();
                l.submit(Cmd::WriteZeroes {
                    target,
                    blocks,
                    version,
                    done,
                });
                Reply(ReplyFrom::Link(rx))
            }
        }
    }

    /// Reads `blocks` blocks at `target` (each checked against its stored CRC).
    pub fn read(&self, target: Target, blocks: u16) -> Reply<Vec<u8>> {
        match &self.driver {
            Driver::Solar(l) => Reply(ReplyFrom::Solar(l.read(target, blocks), self.server())),
            Driver::Tcp(l) => {
                let (done, rx) = oneshot::channel();
                l.submit(Cmd::Read { target, blocks, done });
                Reply(ReplyFrom::Link(rx))
            }
        }
    }

    /// Counters and path health (refreshed every few milliseconds by the link's thread).
    pub fn status(&self) -> LinkStatus {
        match &self.driver {
            Driver::Solar(l) => l.status(),
            Driver::Tcp(l) => l.status(),
        }
    }
}
