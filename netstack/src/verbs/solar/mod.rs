//! Solar endpoints on a context: the storage agent's client toward one storage server
//! ([`SolarAgent`]) and the storage server ([`SolarService`]). They run on the context's data
//! cores beside its QPs, on the same sockets, batching (GSO, `sendmmsg`/`recvmmsg`) and
//! polling discipline; the core is their only owner, and these handles send it commands.
//!
//! ```no_run
//! use netstack::verbs::{Context, ContextConfig};
//! use netstack::transport::solar::client::ClientConfig;
//! use std::sync::Arc;
//! let ctx = Context::open(ContextConfig::default()).unwrap();
//! let agent = ctx.solar_client("127.0.0.1:7000".parse().unwrap(), ClientConfig::default(), None).unwrap();
//! let done = agent.write(1, 0, Arc::from(vec![7u8; 4096]), true);
//! // done.blocking_recv() (or .await) answers once the block is durable on the server
//! ```

mod core;

use self::core::{check_client_config, SolarCmd};
pub use self::core::{AgentStatus, ReadAnswer, ReadBlocks, SolarError, StorageHandler, WriteBlock, WriteDone};
pub(crate) use self::core::{SolarFactory, SolarHost};
use super::{Context, VerbsError};
use crate::transport::solar::client::{ClientConfig, SolarClient, Target};
use crate::transport::solar::server::{ServerStats, SolarServer};
use crate::transport::solar::validation::{NonceSource, ValidationConfig};
use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::net::SocketAddrV4;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::oneshot;

/// The smallest IP MTU Solar runs over: IP and UDP headers, Solar's header and one block.
pub const SOLAR_MIN_MTU: u32 =
    (20 + 8 + crate::transport::solar::wire::HDR + crate::transport::solar::wire::BLOCK) as u32;

/// Which storage servers a context's clients talk to (one client per server address, since
/// answers are told apart by their source), whether it serves, and each data core's Solar
/// command queue.
pub(crate) struct SolarRegistry {
    servers: Mutex<std::collections::HashMap<SocketAddrV4, u64>>,
    serving: std::sync::atomic::AtomicBool,
    next_id: AtomicU64,
    hosts: Vec<Arc<SolarHost>>,
}

impl SolarRegistry {
    /// The registry of a context whose cores' Solar endpoints `hosts` reach (in core order).
    pub(crate) fn new(hosts: Vec<Arc<SolarHost>>) -> SolarRegistry {
        SolarRegistry {
            servers: Mutex::new(std::collections::HashMap::new()),
            serving: std::sync::atomic::AtomicBool::new(false),
            next_id: AtomicU64::new(0),
            hosts,
        }
    }
}

impl Context {
    /// Opens a Solar client toward the storage server at `server`, on one of this context's
    /// data cores (its path `p` leaves from the core's source port `p`); `cc` is its
    /// congestion control, one window across its paths. `cfg.paths` must not exceed the
    /// context's `path_ports`; one client per server address and context. Solar carries a
    /// whole 4 KiB block per datagram, unfragmented: the route toward `server` must take
    /// [`SOLAR_MIN_MTU`]-byte IP packets (a storage fabric's jumbo frames).
    pub fn solar_client(
        &self,
        server: SocketAddrV4,
        cfg: ClientConfig,
        cc: Option<Box<dyn crate::cc::CcAlgorithm>>,
    ) -> Result<SolarAgent, VerbsError> {
        let inner = self.engine("Solar")?.inner.clone();
        check_client_config(&cfg, inner.cfg.path_ports.max(1) as usize).map_err(VerbsError::Invalid)?;
        // the context's link knows its routes (the kernel's, or a simulated network's)
        let mtu = inner.engine.cores()[0]
            .link
            .route_mtu(server)
            .ok_or_else(|| VerbsError::Invalid(format!("no route toward {server} (its MTU could not be read)")))?;
        if mtu < SOLAR_MIN_MTU {
            return Err(VerbsError::Invalid(format!(
                "the route toward {server} has MTU {mtu}: Solar sends a 4 KiB block per datagram \
                 without fragmenting it, which needs an MTU of at least {SOLAR_MIN_MTU} (jumbo frames)"
            )));
        }
        let reg = &inner.solar;
        let id = reg.next_id.fetch_add(1, Ordering::Relaxed);
        {
            let mut servers = reg.servers.lock();
            if servers.contains_key(&server) {
                return Err(VerbsError::Invalid(format!(
                    "this context already has a Solar client toward {server}"
                )));
            }
            servers.insert(server, id);
        }
        let core = reg.hosts[id as usize % reg.hosts.len()].clone();
        let status = Arc::new(Mutex::new(AgentStatus::default()));
        let client = SolarClient::new(cfg, cc, core.now());
        core.command(SolarCmd::AddClient {
            id,
            server,
            client: Box::new(client),
            status: status.clone(),
        });
        Ok(SolarAgent {
            inner,
            core,
            id,
            server: Mutex::new(server),
            status,
        })
    }

    /// Serves Solar on this context's first data core: requests arriving at its address go to
    /// `server` (seeded by the caller, e.g. with stored block versions) and the storage behind
    /// it, `handler`, which the core calls. One server per context. Source addresses are
    /// validated before they are served in full
    /// ([`crate::transport::solar::validation`], nonces from the OS's randomness, or on a
    /// simulated network from its seed), with the default bounds unless the caller set its own
    /// ([`SolarServer::require_validation`]).
    pub fn solar_server(
        &self,
        mut server: SolarServer,
        handler: Arc<dyn StorageHandler>,
    ) -> Result<SolarService, VerbsError> {
        let inner = self.engine("Solar")?.inner.clone();
        if !server.validating() {
            // a simulated context's nonces follow the network's seed (a seed replays), like its
            // QPNs; a real one's come from the OS-seeded thread generator
            let nonces: NonceSource = if inner.iovas.is_some() {
                let mut rng = StdRng::seed_from_u64(inner.ids.lock().rng.random());
                Box::new(move || rng.random())
            } else {
                Box::new(rand::random::<u64>)
            };
            server
                .require_validation(ValidationConfig::default(), nonces)
                .map_err(VerbsError::Invalid)?;
        }
        if inner.solar.serving.swap(true, Ordering::SeqCst) {
            return Err(VerbsError::Invalid("this context already serves Solar".into()));
        }
        let core = inner.solar.hosts[0].clone();
        let stats = Arc::new(Mutex::new(server.stats()));
        core.command(SolarCmd::Serve {
            server: Box::new(server),
            handler,
            stats: stats.clone(),
        });
        Ok(SolarService {
            ctx: self.clone(),
            inner,
            core,
            stats,
        })
    }
}

/// A Solar client toward one storage server; dropping it closes it (requests in flight fail
/// with [`SolarError::Stopped`]).
pub struct SolarAgent {
    /// Its context's engine (the context is an in-process one: Solar runs only there).
    inner: Arc<super::CtxInner>,
    core: Arc<SolarHost>,
    id: u64,
    server: Mutex<SocketAddrV4>,
    status: Arc<Mutex<AgentStatus>>,
}

impl SolarAgent {
    /// Writes `data` (whole 4 KiB blocks) at block `lba` of `volume`; answered once every
    /// block is durable on the server.
    pub fn write(
        &self,
        volume: u32,
        lba: u64,
        data: Arc<[u8]>,
        fua: bool,
    ) -> oneshot::Receiver<Result<(), SolarError>> {
        let blocks = (data.len() / crate::transport::solar::wire::BLOCK).min(u16::MAX as usize) as u16;
        self.submit_write((volume, lba, None), Some(data), blocks, fua, None)
    }

    /// Writes `data`, or zeros over `blocks` blocks when `data` is None (deallocated on the
    /// server: header-only packets), at `target` as `version` (see
    /// [`crate::transport::solar::client::SolarClient::write_versioned`]: one increasing
    /// sequence per writer, the same version on every replica of a write); answered once
    /// every block is durable.
    pub fn write_versioned(
        &self,
        target: Target,
        data: Option<Arc<[u8]>>,
        blocks: u16,
        fua: bool,
        version: u64,
    ) -> oneshot::Receiver<Result<(), SolarError>> {
        self.submit_write(
            (target.volume, target.lba, Some(target.epoch)),
            data,
            blocks,
            fua,
            Some(version),
        )
    }

    fn submit_write(
        &self,
        (volume, lba, epoch): (u32, u64, Option<u32>),
        data: Option<Arc<[u8]>>,
        blocks: u16,
        fua: bool,
        version: Option<u64>,
    ) -> oneshot::Receiver<Result<(), SolarError>> {
        let (done, rx) = oneshot::channel();
        self.core.command(SolarCmd::Write {
            id: self.id,
            volume,
            lba,
            epoch,
            data,
            blocks,
            fua,
            version,
            done,
        });
        rx
    }

    /// Reads `blocks` blocks at `lba` of `volume`, each checked against its stored CRC.
    pub fn read(&self, volume: u32, lba: u64, blocks: u16) -> oneshot::Receiver<Result<Vec<u8>, SolarError>> {
        self.submit_read((volume, lba, None), blocks)
    }

    /// Reads `blocks` blocks at `target`, under its epoch; see [`Self::read`].
    pub fn read_at(&self, target: Target, blocks: u16) -> oneshot::Receiver<Result<Vec<u8>, SolarError>> {
        self.submit_read((target.volume, target.lba, Some(target.epoch)), blocks)
    }

    fn submit_read(
        &self,
        (volume, lba, epoch): (u32, u64, Option<u32>),
        blocks: u16,
    ) -> oneshot::Receiver<Result<Vec<u8>, SolarError>> {
        let (done, rx) = oneshot::channel();
        self.core.command(SolarCmd::Read {
            id: self.id,
            volume,
            lba,
            epoch,
            blocks,
            done,
        });
        rx
    }

    /// The storage server's address.
    pub fn server(&self) -> SocketAddrV4 {
        *self.server.lock()
    }

    /// Follows the storage server to `addr` (it restarted there): requests go there from now
    /// on, and blocks in flight are resent there when their timers fire. Refused when another
    /// client of this context talks to `addr`.
    pub fn retarget(&self, addr: SocketAddrV4) -> Result<(), VerbsError> {
        let mut cur = self.server.lock();
        if *cur == addr {
            return Ok(());
        }
        {
            let mut servers = self.inner.solar.servers.lock();
            if servers.contains_key(&addr) {
                return Err(VerbsError::Invalid(format!(
                    "this context already has a Solar client toward {addr}"
                )));
            }
            servers.remove(&*cur);
            servers.insert(addr, self.id);
        }
        *cur = addr;
        self.core.command(SolarCmd::Retarget {
            id: self.id,
            server: addr,
        });
        Ok(())
    }

    /// Counters and path health (refreshed every few milliseconds by the core).
    pub fn status(&self) -> AgentStatus {
        self.status.lock().clone()
    }
}

impl Drop for SolarAgent {
    fn drop(&mut self) {
        self.core.command(SolarCmd::CloseClient { id: self.id });
        let server = *self.server.lock();
        let mut servers = self.inner.solar.servers.lock();
        if servers.get(&server) == Some(&self.id) {
            servers.remove(&server);
        }
    }
}

/// A context's Solar server; dropping it stops serving (and releases the handler).
pub struct SolarService {
    ctx: Context,
    /// Its context's engine.
    inner: Arc<super::CtxInner>,
    core: Arc<SolarHost>,
    stats: Arc<Mutex<ServerStats>>,
}

impl SolarService {
    /// The address agents send to.
    pub fn local_addr(&self) -> SocketAddrV4 {
        self.core.local_addr()
    }

    /// The server's counters (refreshed every few milliseconds by the core).
    pub fn stats(&self) -> ServerStats {
        *self.stats.lock()
    }

    /// Fences `volume` at `epoch`: its requests of a lower epoch are refused (`WrongEpoch`)
    /// from the moment the answer, the fence in effect (it only rises), arrives.
    /// The command is queued when this is called; the future waits for the core.
    pub fn fence(
        &self,
        volume: u32,
        epoch: u32,
    ) -> impl std::future::Future<Output = Result<u32, VerbsError>> + Send + 'static {
        let (done, rx) = oneshot::channel();
        self.core.command(SolarCmd::Fence { volume, epoch, done });
        async move {
            match rx.await {
                Ok(Some(f)) => Ok(f),
                _ => Err(VerbsError::Invalid("the Solar server stopped".into())),
            }
        }
    }

    /// The context it runs on.
    pub fn context(&self) -> &Context {
        &self.ctx
    }
}

impl Drop for SolarService {
    fn drop(&mut self) {
        self.core.command(SolarCmd::CloseServer);
        self.inner.solar.serving.store(false, Ordering::SeqCst);
    }
}
