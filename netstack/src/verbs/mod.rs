//! The verbs API: [`Context`], [`Pd`], [`Mr`], [`Cq`], [`Qp`], named after ibverbs so an RDMA
//! engineer finds `post_send`, `post_recv`, `poll`, `lkey`/`rkey` and the QP state machine
//! where they expect them.
//!
//! ```no_run
//! use netstack::verbs::*;
//! let ctx = Context::open(ContextConfig::default()).unwrap();
//! let pd = ctx.alloc_pd();
//! let mr = pd.reg_mr(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE).unwrap();
//! let cq = ctx.create_cq(256).unwrap();
//! let qp = ctx.create_qp(&pd, &cq, &cq, QpInitAttr::default()).unwrap();
//! // exchange qp.local_endpoint() with the peer (see `netstack::cm`), then:
//! # let remote = qp.local_endpoint();
//! qp.connect(&remote).unwrap();
//! qp.post_send(SendWr::new(1, WrOpcode::RdmaWrite).sge(mr.sge(0, 4096)).remote(0x1000, 0x1234)).unwrap();
//! ```

mod engine_qp;
mod qp;

pub use crate::config::ContextConfig;
pub use crate::engine::{Drive, PollMode, StatsSnapshot};
pub use crate::mem::{Access, AccessError};
pub use crate::transport::rc::{IcrcMode, QpState, RcConfig, RcStats, Recovery};
pub use crate::work::*;
pub use qp::{Endpoint, Qp, QpInitAttr};

pub mod attach;
mod attached;
mod metrics;
pub mod solar;

use crate::engine::drive::AppDrive;
use crate::engine::{CqShared, Engine, LinkKind};
use crate::link::sim::SimNet;
use crate::mem::{MrEntry, MrTable, Region};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashSet;
use std::net::SocketAddrV4;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Errors of the verbs API.
#[derive(Debug, thiserror::Error)]
pub enum VerbsError {
    /// A socket or thread failed.
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The context's configuration is bad.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// A work request was refused.
    #[error(transparent)]
    Post(#[from] crate::transport::rc::PostError),
    /// A QP state change was refused.
    #[error(transparent)]
    Modify(#[from] crate::transport::rc::ModifyError),
    /// An INLINE payload longer than the QP takes.
    #[error("INLINE payload of {len} bytes exceeds max_inline {max}")]
    InlineTooLong {
        /// Its bytes.
        len: u64,
        /// The QP's `max_inline`.
        max: u32,
    },
    /// A peer description is unusable (why).
    #[error("peer {0}")]
    Peer(String),
    /// An argument is invalid (which, and why).
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// The QP's data core stopped before it answered (its context is shutting down).
    #[error("the engine stopped")]
    Gone,
    /// The context's memory-region table is full.
    #[error(transparent)]
    TableFull(#[from] crate::mem::TableFull),
    /// What was asked runs only in an in-process engine, and this context is attached to
    /// `flexnsd` (what, and why).
    #[error("not available through flexnsd: {0}")]
    Unsupported(String),
    /// The `flexnsd` this context is attached to refused a command or is gone.
    #[error("flexnsd: {0}")]
    Daemon(#[from] crate::verbs::attach::client::ClientError),
}

/// QP numbers a context never gives: 0 and 1 (IB's SMI and GSI QPs) and 0xFFFFFF (multicast).
const RESERVED_QPNS: usize = 3;

/// Where a context draws its QPNs and initial PSNs: a CSPRNG seeded by the OS, or, on a
/// simulated network, by the network's seed and the context's address.
struct Ids {
    rng: StdRng,
    /// The QPNs of the context's live QPs (a drawn QPN that collides is drawn again).
    live: HashSet<u32>,
}

impl Ids {
    /// A fresh QPN (24 bits, not reserved, not live) and a random initial send PSN.
    fn draw(&mut self) -> Result<(u32, u32), VerbsError> {
        if self.live.len() >= (1 << 24) - RESERVED_QPNS {
            return Err(VerbsError::Invalid(format!(
                "qpn: all {} QP numbers are in use",
                (1 << 24) - RESERVED_QPNS
            )));
        }
        let qpn = loop {
            let q = self.rng.random::<u32>() & crate::wire::MASK24;
            if q > 1 && q != crate::wire::MASK24 && self.live.insert(q) {
                break q;
            }
        };
        Ok((qpn, self.rng.random::<u32>() & crate::wire::MASK24))
    }
}

/// A seed for one kind (`tag`) of a simulated context's identifiers: the network's seed and
/// the context's address mixed (splitmix64's finalizer).
fn sim_seed(seed: u64, addr: SocketAddrV4, tag: u64) -> u64 {
    let mut z = seed
        ^ (u64::from(u32::from(*addr.ip())) << 16 | u64::from(addr.port())).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ tag.wrapping_mul(0xD1B5_4A32_D192_ED03);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

pub(crate) struct CtxInner {
    pub(crate) engine: Engine,
    pub(crate) cfg: ContextConfig,
    /// Congestion-control parameters and host-wide CC state shared by this context's QPs.
    pub(crate) cc_env: Arc<crate::cc::CcEnv>,
    /// QPNs and initial PSNs.
    ids: parking_lot::Mutex<Ids>,
    /// On a simulated network, the next I/O virtual address to give memory the context
    /// allocates (see [`Region::at_iova`]); `None` names memory by its pointer.
    iovas: Option<std::sync::atomic::AtomicU64>,
    next_pd: AtomicU32,
    next_cq: AtomicU32,
    /// The offloading engine whose handlers serve this context's QPs.
    pub(crate) offload: crate::offload::OffloadEngine,
    /// The context's Solar endpoints (see [`solar`]).
    pub(crate) solar: solar::SolarRegistry,
    /// The same-host one-copy path ([`crate::samehost`]): this context's export, and the
    /// peers' exports its QPs attached (by process id and nonce), while one is used.
    pub(crate) same_host: Option<SameHost>,
}

/// A context's side of the same-host path.
pub(crate) struct SameHost {
    pub(crate) export: Arc<crate::samehost::Export>,
    peers: parking_lot::Mutex<std::collections::HashMap<(u32, u64), std::sync::Weak<crate::samehost::PeerExport>>>,
}

impl SameHost {
    /// The peer export `d` names, mapped (one mapping per peer context, shared by its QPs).
    pub(crate) fn attach(&self, d: crate::samehost::SameHostDesc) -> std::io::Result<Arc<crate::samehost::PeerExport>> {
        let mut peers = self.peers.lock();
        if let Some(p) = peers.get(&(d.pid, d.nonce)).and_then(|w| w.upgrade()) {
            return Ok(p);
        }
        peers.retain(|_, w| w.strong_count() > 0);
        let p = Arc::new(crate::samehost::PeerExport::attach(d)?);
        peers.insert((d.pid, d.nonce), Arc::downgrade(&p));
        Ok(p)
    }
}

impl CtxInner {
    /// `len` zeroed bytes of memory for the context to register: named by a deterministic
    /// I/O virtual address on a simulated network, by its pointer otherwise.
    /// Draws a new QP's number and initial send PSN.
    fn draw_qp_ids(&self) -> Result<(u32, u32), VerbsError> {
        self.ids.lock().draw()
    }

    /// `n` nonces for a QP's peer-address challenges, from the same source as its QPNs (a
    /// simulated context's follow the seed).
    pub(crate) fn draw_nonces(&self, n: usize) -> Vec<u64> {
        let mut ids = self.ids.lock();
        (0..n).map(|_| ids.rng.random()).collect()
    }

    /// Gives back the number of a QP that is gone.
    pub(crate) fn release_qpn(&self, qpn: u32) {
        self.ids.lock().live.remove(&qpn);
    }

    pub(crate) fn alloc_region(&self, len: usize) -> Region {
        // memory a same-host peer may map, where the context offers that path
        let r = if self.same_host.is_some() {
            Region::alloc_shareable(len)
        } else {
            Region::alloc(len)
        };
        match &self.iovas {
            // 1 TiB apart: past any region's end
            Some(next) => r.at_iova(next.fetch_add(1 << 40, Ordering::Relaxed)),
            None => r,
        }
    }
}

/// The in-process engine's side of a [`Context`]: its data cores with their links, the
/// memory-region table, the offloading engine and the Solar endpoints.
#[derive(Clone)]
pub(crate) struct EngineCtx {
    pub(crate) inner: Arc<CtxInner>,
}

impl EngineCtx {
    fn open_on(cfg: ContextConfig, kind: LinkKind) -> Result<EngineCtx, VerbsError> {
        cfg.validate()?;
        // memory keys, QPNs and initial PSNs are drawn at random (a guessed or earlier-seen one
        // must not reach another context's memory or QPs); on a simulated network from its seed
        // and the context's address, so that a seed replays
        let sim_seed_of = match &kind {
            LinkKind::Sim(net) => Some(net.seed()),
            _ => None,
        };
        let mrs = Arc::new(match sim_seed_of {
            Some(seed) => MrTable::seeded(sim_seed(seed, cfg.bind, 1)),
            None => MrTable::new(),
        });
        let simulated = sim_seed_of.is_some();
        let same_host = match (&kind, cfg.link, cfg.same_host_copy) {
            (LinkKind::Udp, crate::config::LinkMode::Shm, true) => match crate::samehost::Export::create(mrs.rbase()) {
                Ok(export) => {
                    let export = Arc::new(export);
                    mrs.set_export(export.clone());
                    Some(SameHost {
                        export,
                        peers: Default::default(),
                    })
                }
                Err(e) => {
                    tracing::warn!("same-host copy path off: cannot create the export: {e}");
                    None
                }
            },
            _ => None,
        };
        // the protocols each data core carries beside RC: Solar
        let solar = solar::SolarFactory::default();
        let engine = Engine::start(&cfg, mrs.clone(), kind, &solar)?;
        let local = engine.cores()[0].local_addr();
        let rng = match sim_seed_of {
            Some(seed) => StdRng::seed_from_u64(sim_seed(seed, local, 2)),
            None => StdRng::from_os_rng(),
        };
        let offload = crate::offload::OffloadEngine::new(cfg.offload, mrs);
        let ctx = EngineCtx {
            inner: Arc::new(CtxInner {
                engine,
                cc_env: crate::cc::host_env(&cfg.cc),
                cfg,
                ids: parking_lot::Mutex::new(Ids {
                    rng,
                    live: HashSet::new(),
                }),
                iovas: simulated.then(|| std::sync::atomic::AtomicU64::new(1 << 40)),
                next_pd: AtomicU32::new(1),
                next_cq: AtomicU32::new(1),
                offload,
                solar: solar::SolarRegistry::new(solar.into_hosts()),
                same_host,
            }),
        };
        let weak: std::sync::Weak<dyn crate::telemetry::Collect> = Arc::downgrade(&ctx.inner) as _;
        crate::telemetry::register(weak);
        Ok(ctx)
    }

    fn new_cq(&self, cqe: usize, ignore_overrun: bool) -> Result<EngineCq, VerbsError> {
        let shared = Arc::new(CqShared::with_overrun(
            cqe.max(1),
            self.inner.engine.cores().len(),
            ignore_overrun,
        )?);
        let num = self.inner.next_cq.fetch_add(1, Ordering::Relaxed);
        self.inner.engine.cores()[0].redn.add_cq(num, shared.produced());
        Ok(EngineCq {
            shared,
            num,
            drive: self.inner.engine.drive().cloned(),
            wait: (self.inner.cfg.poll_mode, Duration::from_micros(self.inner.cfg.spin_us)),
        })
    }

    pub(crate) fn mrs(&self) -> &Arc<MrTable> {
        &self.inner.engine.cores()[0].mrs
    }
}

/// An open device context: an in-process engine (data cores with their links and
/// memory-region table), or an attachment to `flexnsd`, the stack as its own process, when
/// the configuration names one ([`ContextConfig::flexnsd`]). The same calls work on both;
/// what only an in-process engine has (offload handlers, RedN's managed QPs, Solar, installed
/// congestion-control algorithms, several paths per QP, caller memory outside a memfd) is
/// refused through `flexnsd` with [`VerbsError::Unsupported`].
#[derive(Clone)]
pub struct Context {
    kind: CtxKind,
}

#[derive(Clone)]
enum CtxKind {
    Engine(EngineCtx),
    Attached(Arc<attached::AttachedCtx>),
}

impl Context {
    /// Opens a context: binds the data-path socket and starts the engine, or, when
    /// `cfg.flexnsd` names a daemon's socket, attaches to that daemon (whose own
    /// configuration then governs the data path: links, data cores, addresses).
    pub fn open(cfg: ContextConfig) -> Result<Context, VerbsError> {
        cfg.validate()?;
        if cfg.flexnsd.is_some() {
            return Ok(Context {
                kind: CtxKind::Attached(Arc::new(attached::AttachedCtx::open(cfg)?)),
            });
        }
        Ok(Context {
            kind: CtxKind::Engine(EngineCtx::open_on(cfg, LinkKind::Udp)?),
        })
    }

    /// Opens a context on a simulated network: its data cores send and receive through `net`
    /// at the address `cfg.bind` (port 0 picks one), read the network's clock, and run only
    /// when the network runs them ([`SimNet::step`]), in the thread that steps it. Everything
    /// it does follows from the network's seed and the calls made on it: QPNs, PSNs and keys
    /// do not depend on the process.
    pub fn open_simulated(cfg: ContextConfig, net: &Arc<SimNet>) -> Result<Context, VerbsError> {
        if cfg.flexnsd.is_some() {
            return Err(VerbsError::Invalid(
                "flexnsd: a simulated context runs its own engine; leave flexnsd unset".into(),
            ));
        }
        Ok(Context {
            kind: CtxKind::Engine(EngineCtx::open_on(cfg, LinkKind::Sim(net.clone()))?),
        })
    }

    /// Whether this context is attached to `flexnsd` (not running an engine of its own).
    pub fn is_attached(&self) -> bool {
        matches!(self.kind, CtxKind::Attached(_))
    }

    /// The in-process engine, or [`VerbsError::Unsupported`] naming `what` through flexnsd.
    pub(crate) fn engine(&self, what: &str) -> Result<&EngineCtx, VerbsError> {
        match &self.kind {
            CtxKind::Engine(e) => Ok(e),
            CtxKind::Attached(_) => Err(VerbsError::Unsupported(format!(
                "{what} runs only in an in-process engine (leave flexnsd unset)"
            ))),
        }
    }

    /// The data-path address of the first data core (each QP's own is in its endpoint);
    /// attached, the daemon's.
    pub fn local_addr(&self) -> SocketAddrV4 {
        match &self.kind {
            CtxKind::Engine(e) => e.inner.engine.cores()[0].local_addr(),
            CtxKind::Attached(a) => a.local_addr(),
        }
    }

    /// Its configuration.
    pub fn config(&self) -> &ContextConfig {
        match &self.kind {
            CtxKind::Engine(e) => &e.inner.cfg,
            CtxKind::Attached(a) => a.config(),
        }
    }

    /// Allocates a protection domain (attached, the daemon's PD is made at its first use).
    pub fn alloc_pd(&self) -> Pd {
        match &self.kind {
            CtxKind::Engine(e) => Pd {
                kind: PdKind::Engine {
                    ctx: e.clone(),
                    id: e.inner.next_pd.fetch_add(1, Ordering::Relaxed),
                },
            },
            CtxKind::Attached(a) => Pd {
                kind: PdKind::Attached(attached::AttachedPd::new(a)),
            },
        }
    }

    /// Creates a completion queue with room for `cqe` completions per data core (a completion
    /// that finds it full waits in its QP and is delivered later; `Cq::overruns` counts that).
    pub fn create_cq(&self, cqe: usize) -> Result<Cq, VerbsError> {
        let kind = match &self.kind {
            CtxKind::Engine(e) => CqKind::Engine(e.new_cq(cqe, false)?),
            CtxKind::Attached(a) => CqKind::Attached(Arc::new(a.create_cq(cqe)?)),
        };
        Ok(Cq { kind })
    }

    /// A completion queue that drops completions when full instead of keeping them (still
    /// counting them): for queues only RedN WAITs look at, which no thread polls.
    pub fn create_cq_ignore_overrun(&self, cqe: usize) -> Result<Cq, VerbsError> {
        let e = self.engine("a CQ for RedN WAITs (create_cq_ignore_overrun)")?;
        Ok(Cq {
            kind: CqKind::Engine(e.new_cq(cqe, true)?),
        })
    }

    /// The offloading engine: register handlers and DMA regions here. Attached to flexnsd,
    /// every registration is refused ([`crate::offload::OffloadError::Unavailable`]): handlers
    /// run beside the engine, in its process.
    pub fn offload(&self) -> &crate::offload::OffloadEngine {
        match &self.kind {
            CtxKind::Engine(e) => &e.inner.offload,
            CtxKind::Attached(a) => a.offload(),
        }
    }

    /// Counters of the context's RedN programs (chains, steps, aborts); attached, none run
    /// (managed QPs are refused), so all are 0.
    pub fn redn_stats(&self) -> crate::chain::RednStats {
        match &self.kind {
            CtxKind::Engine(e) => e.inner.engine.cores()[0].redn.stats(),
            CtxKind::Attached(_) => Default::default(),
        }
    }

    /// Creates an RC queue pair, already in INIT so receives can be posted before connecting.
    pub fn create_qp(&self, pd: &Pd, send_cq: &Cq, recv_cq: &Cq, attr: QpInitAttr) -> Result<Qp, VerbsError> {
        match (&self.kind, &pd.kind, &send_cq.kind, &recv_cq.kind) {
            (CtxKind::Engine(e), PdKind::Engine { id, .. }, CqKind::Engine(scq), CqKind::Engine(rcq)) => {
                let (qpn, psn) = e.inner.draw_qp_ids()?;
                engine_qp::EngineQp::create(e.clone(), *id, (qpn, psn), scq, rcq.shared.clone(), attr)
                    .inspect_err(|_| e.inner.release_qpn(qpn))
                    .map(Qp::engine)
            }
            (CtxKind::Attached(a), PdKind::Attached(pd), CqKind::Attached(scq), CqKind::Attached(rcq)) => {
                Ok(Qp::attached(a.create_qp(pd, scq, rcq, attr)?))
            }
            _ => Err(VerbsError::Invalid(
                "pd, send_cq and recv_cq must belong to this context".into(),
            )),
        }
    }

    /// Engine counters (malformed packets, bytes, staging memory...); attached, the daemon
    /// engine's, all its applications together (zeros if the daemon cannot answer).
    pub fn stats(&self) -> StatsSnapshot {
        match &self.kind {
            CtxKind::Engine(e) => e.inner.engine.stats(),
            CtxKind::Attached(a) => a.stats(),
        }
    }
}

/// A protection domain: memory regions and QPs of one PD only see each other.
#[derive(Clone)]
pub struct Pd {
    kind: PdKind,
}

#[derive(Clone)]
enum PdKind {
    Engine { ctx: EngineCtx, id: u32 },
    Attached(Arc<attached::AttachedPd>),
}

impl Pd {
    /// Allocates `len` zeroed bytes and registers them (attached: in a memfd the daemon maps).
    pub fn reg_mr(&self, len: usize, access: Access) -> Result<Mr, VerbsError> {
        match &self.kind {
            PdKind::Engine { ctx, .. } => self.register(Arc::new(ctx.inner.alloc_region(len)), access),
            PdKind::Attached(pd) => Ok(Mr {
                kind: MrKind::Attached(pd.reg_mr(len, access)?),
            }),
        }
    }

    /// Registers caller memory. Attached to flexnsd, its pages are first moved into a memfd in
    /// place ([`Region::share_in_place`]: the same addresses and bytes, now a shared mapping
    /// the daemon maps too).
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay valid until the returned [`Mr`] and every work request using
    /// it are gone, and must not be accessed through Rust references while peers may access it.
    /// Attached, it must also be readable and writable, and no other thread may write it while
    /// this call runs.
    pub unsafe fn reg_mr_raw(&self, ptr: *mut u8, len: usize, access: Access) -> Result<Mr, VerbsError> {
        if let PdKind::Attached(pd) = &self.kind {
            // SAFETY: the caller's contract, which includes share_in_place's.
            let mr = unsafe { pd.reg_raw(ptr, len, access) }?;
            return Ok(Mr {
                kind: MrKind::Attached(mr),
            });
        }
        // SAFETY: the caller's contract is `Region::from_raw`'s.
        self.register(Arc::new(unsafe { Region::from_raw(ptr, len) }), access)
    }

    /// Registers a region the caller already holds (several contexts may register one region,
    /// e.g. a buffer exposed on two engines). Attached to flexnsd, a region that is not in a
    /// memfd has its pages moved into one in place first ([`Region::share_in_place`]; no other
    /// thread may write it meanwhile), since the daemon maps only memfds; one named by an I/O
    /// virtual address is refused.
    pub fn reg_region(&self, region: Arc<Region>, access: Access) -> Result<Mr, VerbsError> {
        match &self.kind {
            PdKind::Engine { .. } => self.register(region, access),
            PdKind::Attached(pd) => Ok(Mr {
                kind: MrKind::Attached(pd.reg_region(region, access)?),
            }),
        }
    }

    /// Registers `region`: its keys are drawn at random, the rkey unlike the lkey (see
    /// [`MrTable`]). Fails only when the context's table is full.
    pub(crate) fn register(&self, region: Arc<Region>, access: Access) -> Result<Mr, VerbsError> {
        match &self.kind {
            PdKind::Engine { ctx, id } => {
                let entry = ctx.mrs().register(region, *id, access)?;
                Ok(Mr {
                    kind: MrKind::Engine {
                        entry,
                        table: ctx.mrs().clone(),
                    },
                })
            }
            PdKind::Attached(pd) => Ok(Mr {
                kind: MrKind::Attached(pd.reg_region(region, access)?),
            }),
        }
    }

    /// Its number (what memory regions and QPs are checked against); attached, the daemon's
    /// handle of it (0 until its first MR or QP makes it).
    pub fn id(&self) -> u32 {
        match &self.kind {
            PdKind::Engine { id, .. } => *id,
            PdKind::Attached(pd) => pd.handle(),
        }
    }
}

/// A registered memory region. Deregistered on drop.
pub struct Mr {
    kind: MrKind,
}

enum MrKind {
    Engine { entry: MrEntry, table: Arc<MrTable> },
    Attached(attached::AttachedMr),
}

impl Mr {
    /// Its local key (for SGEs).
    pub fn lkey(&self) -> u32 {
        match &self.kind {
            MrKind::Engine { entry, .. } => entry.lkey,
            MrKind::Attached(m) => m.lkey(),
        }
    }
    /// Its remote key (for peers' RETHs).
    pub fn rkey(&self) -> u32 {
        match &self.kind {
            MrKind::Engine { entry, .. } => entry.rkey,
            MrKind::Attached(m) => m.rkey(),
        }
    }
    /// Virtual address of the first byte (for RETHs and SGEs).
    pub fn addr(&self) -> u64 {
        self.region().addr()
    }
    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.region().len()
    }
    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// A scatter-gather element over `len` bytes at offset `off`.
    pub fn sge(&self, off: usize, len: usize) -> Sge {
        Sge {
            addr: self.addr() + off as u64,
            length: len as u32,
            lkey: self.lkey(),
        }
    }
    /// Copies bytes out of the region.
    pub fn read(&self, off: usize, dst: &mut [u8]) {
        self.region().read(off, dst)
    }
    /// Copies bytes into the region.
    pub fn write(&self, off: usize, src: &[u8]) {
        self.region().write(off, src)
    }
    /// Atomic load of an aligned 8-byte word.
    pub fn load_u64(&self, off: usize) -> Option<u64> {
        self.region().load_u64(off)
    }
    /// The underlying region.
    pub fn region(&self) -> &Arc<Region> {
        match &self.kind {
            MrKind::Engine { entry, .. } => &entry.region,
            MrKind::Attached(m) => m.region(),
        }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // attached, the client's MR deregisters itself with the daemon
        if let MrKind::Engine { entry, table } = &self.kind {
            table.deregister(entry.lkey);
        }
    }
}

/// A completion queue.
#[derive(Clone)]
pub struct Cq {
    kind: CqKind,
}

#[derive(Clone)]
enum CqKind {
    Engine(EngineCq),
    Attached(Arc<crate::verbs::attach::client::Cq>),
}

/// A completion queue of the in-process engine.
#[derive(Clone)]
pub(crate) struct EngineCq {
    pub(crate) shared: Arc<CqShared>,
    num: u32,
    /// Run to completion: polling and waiting run the context's cores.
    drive: Option<Arc<AppDrive>>,
    /// How a waiting thread that runs the cores waits: the context's poll mode and spin time.
    wait: (PollMode, Duration),
}

impl Cq {
    /// The CQ's number in its context (what a WAIT work request names); attached, the
    /// daemon's handle of it.
    pub fn cq_num(&self) -> u32 {
        match &self.kind {
            CqKind::Engine(c) => c.num,
            CqKind::Attached(c) => c.handle(),
        }
    }
    /// Completions produced so far (polling does not lower it; WAIT counts compare with it).
    pub fn produced(&self) -> u64 {
        match &self.kind {
            CqKind::Engine(c) => c.shared.produced().load(Ordering::Acquire),
            CqKind::Attached(c) => c.produced(),
        }
    }
    /// Moves up to `wc.len()` completions into `wc` (like `ibv_poll_cq`); returns how many.
    /// Run to completion, a poll that finds none runs the context's cores once and looks again.
    /// Attached, a daemon that died leaves its last completions, then a `WR_FLUSH_ERR` for
    /// every work request still outstanding.
    pub fn poll(&self, wc: &mut [Wc]) -> usize {
        match &self.kind {
            CqKind::Engine(c) => c.poll(wc),
            CqKind::Attached(c) => attached::poll(c, wc),
        }
    }
    /// Blocks until a completion is available or `timeout` passes. Run to completion, the
    /// caller runs the cores while it waits (spinning as the context's poll mode says: forever
    /// when busy-polling, `spin_us` when adaptive), then leaves them to the backstop and sleeps.
    /// Attached, it spins briefly on the completion ring, then sleeps on the CQ's eventfd; once
    /// the daemon is gone and nothing is left to deliver it returns `false` at once.
    pub fn wait(&self, timeout: Duration) -> bool {
        match &self.kind {
            CqKind::Engine(c) => c.wait(timeout),
            CqKind::Attached(c) => attached::wait(c, timeout),
        }
    }
    /// Waits asynchronously until a completion is available (run to completion, the cores'
    /// backstop runs them meanwhile).
    pub async fn wait_async(&self) {
        match &self.kind {
            CqKind::Engine(c) => c.wait_async().await,
            CqKind::Attached(c) => attached::wait_async(c).await,
        }
    }
    /// Polls one completion, blocking up to `timeout`.
    pub fn next(&self, timeout: Duration) -> Option<Wc> {
        let deadline = std::time::Instant::now() + timeout;
        let mut wc = [EMPTY_WC];
        loop {
            if self.poll(&mut wc) == 1 {
                return Some(wc[0]);
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return None;
            }
            if !self.wait(left) && self.is_dead() {
                return None;
            }
        }
    }
    /// Attached, whether the daemon is gone and nothing more will come.
    fn is_dead(&self) -> bool {
        match &self.kind {
            CqKind::Engine(_) => false,
            CqKind::Attached(c) => attached::drained(c),
        }
    }
    /// Completions that arrived while the queue was full (attached: the daemon holds a
    /// completion until the ring has room, so none).
    pub fn overruns(&self) -> u64 {
        match &self.kind {
            CqKind::Engine(c) => c.shared.overruns(),
            CqKind::Attached(_) => 0,
        }
    }
}

impl EngineCq {
    pub(crate) fn cq_num(&self) -> u32 {
        self.num
    }

    fn poll(&self, wc: &mut [Wc]) -> usize {
        let n = self.shared.poll(wc);
        match &self.drive {
            Some(d) if n == 0 && !wc.is_empty() => {
                d.progress();
                self.shared.poll(wc)
            }
            _ => n,
        }
    }

    fn wait(&self, timeout: Duration) -> bool {
        let Some(d) = &self.drive else {
            return self.shared.wait(timeout);
        };
        let start = std::time::Instant::now();
        let deadline = start + timeout;
        let (mode, spin) = self.wait;
        loop {
            d.progress();
            if self.shared.any_ready() {
                return true;
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                return false;
            }
            match mode {
                PollMode::BusyPoll => std::hint::spin_loop(),
                PollMode::Adaptive if now - start < spin => std::hint::spin_loop(),
                _ => break,
            }
        }
        d.release();
        self.shared
            .wait(deadline.saturating_duration_since(std::time::Instant::now()))
    }

    async fn wait_async(&self) {
        if let Some(d) = &self.drive {
            d.progress();
            if self.shared.any_ready() {
                return;
            }
            d.release();
        }
        self.shared.wait_async().await
    }
}

/// A placeholder completion for initializing arrays passed to [`Cq::poll`].
pub const EMPTY_WC: Wc = Wc {
    wr_id: 0,
    status: WcStatus::Success,
    opcode: WcOpcode::Send,
    byte_len: 0,
    imm_data: None,
    qp_num: 0,
    src_qp: 0,
    vendor_err: 0,
};

// The offload engine's DMA opt-in takes a verbs memory region; it lives here so that the
// offload module does not depend on the verbs above it.
impl crate::offload::OffloadEngine {
    /// Lets handlers DMA to and from `mr` (`writable`: also into it) on behalf of QPs that
    /// may access it themselves: each DMA names `mr`'s rkey and is checked against the
    /// requesting QP's protection domain and `mr`'s access flags, as a READ or WRITE would be.
    /// Dropping the handle revokes it.
    pub fn register_dma_region(&self, mr: &Mr, writable: bool) -> crate::offload::DmaRegionHandle {
        self.register_dma_key(mr.rkey(), writable)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A drawn QPN that a live QP already has is not given again: the context draws another.
    #[test]
    fn a_drawn_qpn_that_is_live_is_drawn_again() {
        let seed = 42;
        let first = StdRng::seed_from_u64(seed).random::<u32>() & crate::wire::MASK24;
        assert!(
            first > 1 && first != crate::wire::MASK24,
            "seed draws an unreserved QPN first"
        );
        let mut ids = Ids {
            rng: StdRng::seed_from_u64(seed),
            live: HashSet::from([first]),
        };
        let (q, _) = ids.draw().unwrap();
        assert_ne!(q, first);
        assert!(q > 1 && q != crate::wire::MASK24);
        assert_eq!(ids.live, HashSet::from([first, q]));
        // without the collision, the same generator gives the first number
        let mut fresh = Ids {
            rng: StdRng::seed_from_u64(seed),
            live: HashSet::new(),
        };
        assert_eq!(fresh.draw().unwrap().0, first);
    }
}
