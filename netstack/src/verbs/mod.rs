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

mod qp;

pub use crate::config::ContextConfig;
pub use crate::engine::{Drive, PollMode, StatsSnapshot};
pub use crate::mem::{Access, AccessError};
pub use crate::transport::rc::{IcrcMode, QpState, RcConfig, RcStats, Recovery};
pub use crate::work::*;
pub use qp::{Endpoint, Qp, QpInitAttr};

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

/// An open device context: one engine (data core) with its link and memory-region table.
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<CtxInner>,
}

impl Context {
    /// Opens a context: binds the data-path socket and starts the engine.
    pub fn open(cfg: ContextConfig) -> Result<Context, VerbsError> {
        Context::open_on(cfg, LinkKind::Udp)
    }

    /// Opens a context on a simulated network: its data cores send and receive through `net`
    /// at the address `cfg.bind` (port 0 picks one), read the network's clock, and run only
    /// when the network runs them ([`SimNet::step`]), in the thread that steps it. Everything
    /// it does follows from the network's seed and the calls made on it: QPNs, PSNs and keys
    /// do not depend on the process.
    pub fn open_simulated(cfg: ContextConfig, net: &Arc<SimNet>) -> Result<Context, VerbsError> {
        Context::open_on(cfg, LinkKind::Sim(net.clone()))
    }

    fn open_on(cfg: ContextConfig, kind: LinkKind) -> Result<Context, VerbsError> {
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
        let ctx = Context {
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

    /// The data-path address of the first data core (each QP's own is in its endpoint).
    /// The address of its first data core (where peers send).
    pub fn local_addr(&self) -> SocketAddrV4 {
        self.inner.engine.cores()[0].local_addr()
    }

    /// Its configuration.
    pub fn config(&self) -> &ContextConfig {
        &self.inner.cfg
    }

    /// Allocates a protection domain.
    pub fn alloc_pd(&self) -> Pd {
        Pd {
            ctx: self.clone(),
            id: self.inner.next_pd.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// Creates a completion queue with room for `cqe` completions per data core (a completion
    /// that finds it full waits in its QP and is delivered later; `Cq::overruns` counts that).
    pub fn create_cq(&self, cqe: usize) -> Result<Cq, VerbsError> {
        self.new_cq(cqe, false)
    }

    /// A completion queue that drops completions when full instead of keeping them (still
    /// counting them): for queues only RedN WAITs look at, which no thread polls.
    pub fn create_cq_ignore_overrun(&self, cqe: usize) -> Result<Cq, VerbsError> {
        self.new_cq(cqe, true)
    }

    fn new_cq(&self, cqe: usize, ignore_overrun: bool) -> Result<Cq, VerbsError> {
        let shared = Arc::new(CqShared::with_overrun(
            cqe.max(1),
            self.inner.engine.cores().len(),
            ignore_overrun,
        )?);
        let num = self.inner.next_cq.fetch_add(1, Ordering::Relaxed);
        self.inner.engine.cores()[0].redn.add_cq(num, shared.produced());
        Ok(Cq {
            shared,
            num,
            drive: self.inner.engine.drive().cloned(),
            wait: (self.inner.cfg.poll_mode, Duration::from_micros(self.inner.cfg.spin_us)),
        })
    }

    /// The offloading engine: register handlers and DMA regions here.
    pub fn offload(&self) -> &crate::offload::OffloadEngine {
        &self.inner.offload
    }

    /// Counters of the context's RedN programs (chains, steps, aborts).
    pub fn redn_stats(&self) -> crate::chain::RednStats {
        self.inner.engine.cores()[0].redn.stats()
    }

    /// Creates an RC queue pair, already in INIT so receives can be posted before connecting.
    pub fn create_qp(&self, pd: &Pd, send_cq: &Cq, recv_cq: &Cq, attr: QpInitAttr) -> Result<Qp, VerbsError> {
        let (qpn, psn) = self.inner.draw_qp_ids()?;
        Qp::create(self.clone(), pd.id, (qpn, psn), send_cq, recv_cq.shared.clone(), attr)
            .inspect_err(|_| self.inner.release_qpn(qpn))
    }

    /// Engine counters (malformed packets, bytes, staging memory...).
    pub fn stats(&self) -> StatsSnapshot {
        self.inner.engine.stats()
    }

    pub(crate) fn mrs(&self) -> &Arc<MrTable> {
        &self.inner.engine.cores()[0].mrs
    }
}

/// A protection domain: memory regions and QPs of one PD only see each other.
#[derive(Clone)]
pub struct Pd {
    ctx: Context,
    id: u32,
}

impl Pd {
    /// Allocates `len` zeroed bytes and registers them.
    pub fn reg_mr(&self, len: usize, access: Access) -> Result<Mr, VerbsError> {
        self.register(Arc::new(self.ctx.inner.alloc_region(len)), access)
    }

    /// Registers caller memory.
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay valid until the returned [`Mr`] and every work request using
    /// it are gone, and must not be accessed through Rust references while peers may access it.
    pub unsafe fn reg_mr_raw(&self, ptr: *mut u8, len: usize, access: Access) -> Result<Mr, VerbsError> {
        // SAFETY: the caller's contract is `Region::from_raw`'s.
        self.register(Arc::new(unsafe { Region::from_raw(ptr, len) }), access)
    }

    /// Registers a region the caller already holds (several contexts may register one region,
    /// e.g. a buffer exposed on two engines).
    pub fn reg_region(&self, region: Arc<Region>, access: Access) -> Result<Mr, VerbsError> {
        self.register(region, access)
    }

    /// Registers `region`: its keys are drawn at random, the rkey unlike the lkey (see
    /// [`MrTable`]). Fails only when the context's table is full.
    pub(crate) fn register(&self, region: Arc<Region>, access: Access) -> Result<Mr, VerbsError> {
        let entry = self.ctx.mrs().register(region, self.id, access)?;
        Ok(Mr {
            entry,
            table: self.ctx.mrs().clone(),
        })
    }

    /// Its number (what memory regions and QPs are checked against).
    pub fn id(&self) -> u32 {
        self.id
    }
}

/// A registered memory region. Deregistered on drop.
pub struct Mr {
    entry: MrEntry,
    table: Arc<MrTable>,
}

impl Mr {
    /// Its local key (for SGEs).
    pub fn lkey(&self) -> u32 {
        self.entry.lkey
    }
    /// Its remote key (for peers' RETHs).
    pub fn rkey(&self) -> u32 {
        self.entry.rkey
    }
    /// Virtual address of the first byte (for RETHs and SGEs).
    pub fn addr(&self) -> u64 {
        self.entry.region.addr()
    }
    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.entry.region.len()
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
        self.entry.region.read(off, dst)
    }
    /// Copies bytes into the region.
    pub fn write(&self, off: usize, src: &[u8]) {
        self.entry.region.write(off, src)
    }
    /// Atomic load of an aligned 8-byte word.
    pub fn load_u64(&self, off: usize) -> Option<u64> {
        self.entry.region.load_u64(off)
    }
    /// The underlying region.
    pub fn region(&self) -> &Arc<Region> {
        &self.entry.region
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        self.table.deregister(self.entry.lkey);
    }
}

/// A completion queue.
#[derive(Clone)]
pub struct Cq {
    shared: Arc<CqShared>,
    num: u32,
    /// Run to completion: polling and waiting run the context's cores.
    drive: Option<Arc<AppDrive>>,
    /// How a waiting thread that runs the cores waits: the context's poll mode and spin time.
    wait: (PollMode, Duration),
}

impl Cq {
    /// The CQ's number in its context (what a WAIT work request names).
    pub fn cq_num(&self) -> u32 {
        self.num
    }
    /// Completions produced so far (polling does not lower it; WAIT counts compare with it).
    pub fn produced(&self) -> u64 {
        self.shared.produced().load(Ordering::Acquire)
    }
    /// Moves up to `wc.len()` completions into `wc` (like `ibv_poll_cq`); returns how many.
    /// Run to completion, a poll that finds none runs the context's cores once and looks again.
    pub fn poll(&self, wc: &mut [Wc]) -> usize {
        let n = self.shared.poll(wc);
        match &self.drive {
            Some(d) if n == 0 && !wc.is_empty() => {
                d.progress();
                self.shared.poll(wc)
            }
            _ => n,
        }
    }
    /// Blocks until a completion is available or `timeout` passes. Run to completion, the
    /// caller runs the cores while it waits (spinning as the context's poll mode says: forever
    /// when busy-polling, `spin_us` when adaptive), then leaves them to the backstop and sleeps.
    pub fn wait(&self, timeout: Duration) -> bool {
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
    /// Waits asynchronously until a completion is available (run to completion, the cores'
    /// backstop runs them meanwhile).
    pub async fn wait_async(&self) {
        if let Some(d) = &self.drive {
            d.progress();
            if self.shared.any_ready() {
                return;
            }
            d.release();
        }
        self.shared.wait_async().await
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
            self.wait(left);
        }
    }
    /// Completions that arrived while the queue was full.
    pub fn overruns(&self) -> u64 {
        self.shared.overruns()
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
