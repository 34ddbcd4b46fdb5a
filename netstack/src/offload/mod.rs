//! The programmable offloading engine (FlexiNS §3.5, Table 2) in async Rust.
//!
//! A server registers handlers for 16-bit offload opcodes ([`OffloadEngine::register_opcode`])
//! and the memory they may touch ([`OffloadEngine::register_dma_region`]). A client sends a
//! request with [`crate::verbs::Qp::post_offload`]; the server's responder hands it to the
//! engine, which runs the handler as a task on its **offload threads** (a tokio runtime of
//! `offload.threads` workers, separate from the data cores). The handler follows Table 2:
//!
//! ```no_run
//! # use netstack::offload::*;
//! async fn batch_of_two(mut call: OffloadCall) -> Result<OffloadReply, OffloadError> {
//!     let req = call.request().to_vec();
//!     let a = u64::from_le_bytes(req[0..8].try_into().unwrap());
//!     let b = u64::from_le_bytes(req[8..16].try_into().unwrap());
//!     let rkey = u32::from_le_bytes(req[16..20].try_into().unwrap());
//!     call.alloc_resp(128)?;                                  // alloc_resp
//!     let x = call.submit_dma(DmaOp::Read, rkey, a, 0, 64)?; // submit_dma
//!     let y = call.submit_dma(DmaOp::Read, rkey, b, 64, 64)?;
//!     call.wait_dma(x).await?;                                // wait_dma_finish
//!     call.wait_dma(y).await?;
//!     call.submit_resp()                                      // submit_resp
//! }
//! ```
//!
//! Handlers of bounded cost that do not block (the [`builtin`] ones, a key-value get) may be
//! registered to run **inline** ([`OffloadEngine::register_inline`]): on the data core that
//! received the request, inside the pass that received it, so the response leaves in that pass
//! with no hand-off to another thread. An inline handler that waits on something not ready
//! goes on from there on the offload threads.
//!
//! Isolation: other handlers never run on a data core, so a slow one cannot stall packet
//! processing; each has a time budget (`offload.budget_us`, or per registration) after which
//! the responder answers TIMEOUT and the handler's task is dropped at its next await; a panic is
//! caught and answered PANICKED; every failure reaches the client as a completion with
//! `RemOpErr` and the [`OffloadStatus`] in `vendor_err`, and the QP stays usable.
//!
//! Protection: handlers touch host memory only by DMA, and every DMA is checked exactly as a
//! remote READ (or WRITE) from the requesting QP: it names an rkey, which must be live, of the
//! QP's protection domain, grant the access and cover the range, and its region must be opted
//! in with [`OffloadEngine::register_dma_region`]. A failed check is DMA_FAULT, touching no
//! memory; a handler registered for a [`QpFilter`] runs only for that filter's QPs.
//!
//! The software DMA engine executes a call's submitted copies in submission order when the
//! handler waits for them, on the handler's offload thread.

pub mod builtin;
mod dma;

pub use crate::transport::rc::offload::{OffloadJob, OffloadSink, OffloadStatus, Outcome, MAX_OFFLOAD_RESP};
use dma::Grant;
pub use dma::{DmaId, DmaOp, DmaRegionHandle, DmaSpace};

use futures_util::FutureExt;
use parking_lot::{Mutex, RwLock};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

/// Offload engine settings (`[offload]` in the context configuration).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OffloadConfig {
    /// Offload threads (workers of the handlers' runtime), 1..=64; started when the first
    /// handler is registered.
    pub threads: usize,
    /// Default time budget of a handler, in microseconds (50 ms: room for a handler whose
    /// thread is descheduled on a loaded host). A request still running after the clients' ACK
    /// timeout (16.8 ms by default) is resent by them; the resend is recognised as a duplicate
    /// and never run twice.
    pub budget_us: u64,
    /// Most requests in progress at once; more are answered OVERLOADED.
    pub max_inflight: usize,
    /// Microseconds an idle offload thread keeps polling for the next request before it
    /// sleeps (0: sleep at once). Waking a sleeping thread costs tens of microseconds on a
    /// busy host, more than a short handler runs; like the data cores' `spin_us`.
    pub spin_us: u64,
}

impl Default for OffloadConfig {
    fn default() -> Self {
        OffloadConfig {
            threads: 1,
            budget_us: 50_000,
            max_inflight: 4096,
            spin_us: 50,
        }
    }
}

impl OffloadConfig {
    /// Checks the fields; the error names the bad one.
    pub fn validate(&self) -> Result<(), String> {
        if self.threads == 0 || self.threads > 64 {
            return Err(format!("threads: {} not in 1..=64", self.threads));
        }
        if self.budget_us == 0 || self.budget_us > 60_000_000 {
            return Err(format!("budget_us: {} not in 1..=60000000", self.budget_us));
        }
        if self.max_inflight == 0 {
            return Err("max_inflight: must be > 0".into());
        }
        if self.spin_us > 10_000 {
            return Err(format!("spin_us: {} > 10000", self.spin_us));
        }
        Ok(())
    }
}

/// Why a handler failed (what the client sees in `vendor_err`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OffloadError {
    /// The request is malformed (the handler says how).
    #[error("bad request: {0}")]
    BadRequest(String),
    /// The handler failed.
    #[error("handler error: {0}")]
    Handler(String),
    /// The response does not fit the requester's buffer.
    #[error("response of {len} bytes exceeds the requester's buffer of {cap}")]
    ResponseTooLong {
        /// The response's bytes.
        len: usize,
        /// What the requester can take.
        cap: usize,
    },
    /// A DMA failed its rkey, PD, bounds or access check.
    #[error("DMA fault: {0}")]
    DmaFault(String),
    /// Registering a handler: the opcode is reserved or taken for an overlapping QP filter.
    #[error("opcode {0:#x} is reserved or already registered for an overlapping QP filter")]
    Opcode(u16),
    /// The offload threads could not be started.
    #[error("offload threads: {0}")]
    Runtime(String),
    /// This context has no offloading engine of its own (why: it is attached to `flexnsd`).
    #[error("no offloading engine here: {0}")]
    Unavailable(&'static str),
}

impl OffloadError {
    fn status(&self) -> OffloadStatus {
        match self {
            OffloadError::BadRequest(_) => OffloadStatus::BadRequest,
            OffloadError::ResponseTooLong { .. } => OffloadStatus::ResponseTooLong,
            OffloadError::DmaFault(_) => OffloadStatus::DmaFault,
            _ => OffloadStatus::HandlerError,
        }
    }
}

/// The future a handler returns.
pub type HandlerFuture = Pin<Box<dyn Future<Output = Result<OffloadReply, OffloadError>> + Send>>;

/// An offload handler: called once per request, on an offload thread (or, registered inline,
/// first on the data core that received the request).
pub trait OffloadHandler: Send + Sync + 'static {
    /// Serves one request; the future runs on an offload thread within the handler's budget.
    fn call(&self, call: OffloadCall) -> HandlerFuture;
}

impl<F, Fut> OffloadHandler for F
where
    F: Fn(OffloadCall) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<OffloadReply, OffloadError>> + Send + 'static,
{
    fn call(&self, call: OffloadCall) -> HandlerFuture {
        Box::pin(self(call))
    }
}

/// Which QPs a registration serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QpFilter {
    /// Every QP of the context.
    Any,
    /// These QP numbers.
    Qpns(Vec<u32>),
}

impl QpFilter {
    fn admits(&self, qpn: u32) -> bool {
        match self {
            QpFilter::Any => true,
            QpFilter::Qpns(v) => v.contains(&qpn),
        }
    }
    fn overlaps(&self, o: &QpFilter) -> bool {
        match (self, o) {
            (QpFilter::Qpns(a), QpFilter::Qpns(b)) => a.iter().any(|q| b.contains(q)),
            _ => true,
        }
    }
}

/// Opcodes 0xFF00..=0xFFFF are reserved for flexns.
pub const RESERVED_OPCODES: std::ops::RangeInclusive<u16> = 0xFF00..=0xFFFF;

struct Registration {
    id: u64,
    opcode: u16,
    filter: QpFilter,
    handler: Arc<dyn OffloadHandler>,
    budget_ns: u64,
    /// Runs on the receiving data core until it first waits ([`OffloadEngine::register_inline`]).
    inline: bool,
    /// `flexns_offload_handler_duration_seconds{opcode}`: each call's time, inline or on its
    /// offload thread (a handle taken at registration: serve metrics before registering
    /// handlers).
    latency: metrics::Histogram,
}

/// Counters of an offload engine.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct OffloadStats {
    /// Requests received.
    pub requests: u64,
    /// Answered by their handler.
    pub ok: u64,
    /// For an opcode with no handler on the QP.
    pub no_handler: u64,
    /// Handlers that returned an error.
    pub errors: u64,
    /// Handlers that panicked (caught).
    pub panics: u64,
    /// Handlers past their time budget.
    pub timeouts: u64,
    /// Refused: too many in flight.
    pub overloaded: u64,
    /// DMA operations the handlers ran.
    pub dma_ops: u64,
    /// Bytes they moved.
    pub dma_bytes: u64,
}

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    ok: AtomicU64,
    no_handler: AtomicU64,
    errors: AtomicU64,
    panics: AtomicU64,
    timeouts: AtomicU64,
    overloaded: AtomicU64,
}

pub(crate) struct Inner {
    cfg: OffloadConfig,
    rt: OnceLock<tokio::runtime::Runtime>,
    handlers: RwLock<Vec<Registration>>,
    next_id: AtomicU64,
    dma: Arc<DmaSpace>,
    inflight: AtomicUsize,
    /// Requests handed to the runtime so far (an idle thread polls it before sleeping).
    submitted: Arc<AtomicU64>,
    counters: Counters,
    /// Serializes runtime start-up.
    start: Mutex<()>,
    /// Why this engine refuses every handler (a context attached to `flexnsd`), if it does.
    unavailable: Option<&'static str>,
}

/// A context's offloading engine (see the module docs). Cheap to clone.
#[derive(Clone)]
pub struct OffloadEngine {
    pub(crate) inner: Arc<Inner>,
}

/// Unregisters its handler when dropped.
pub struct Registered {
    engine: Weak<Inner>,
    id: u64,
}

impl Drop for Registered {
    fn drop(&mut self) {
        if let Some(e) = self.engine.upgrade() {
            e.handlers.write().retain(|r| r.id != self.id);
        }
    }
}

impl OffloadEngine {
    pub(crate) fn new(cfg: OffloadConfig, mrs: Arc<crate::mem::MrTable>) -> OffloadEngine {
        OffloadEngine::build(cfg, mrs, None)
    }

    /// An engine that refuses every registration with [`OffloadError::Unavailable`]`(why)`:
    /// what a context attached to `flexnsd` has, whose QPs' requests reach the daemon's engine.
    pub(crate) fn unavailable(why: &'static str) -> OffloadEngine {
        OffloadEngine::build(
            OffloadConfig::default(),
            Arc::new(crate::mem::MrTable::new()),
            Some(why),
        )
    }

    fn build(cfg: OffloadConfig, mrs: Arc<crate::mem::MrTable>, unavailable: Option<&'static str>) -> OffloadEngine {
        OffloadEngine {
            inner: Arc::new(Inner {
                cfg,
                rt: OnceLock::new(),
                handlers: RwLock::new(Vec::new()),
                next_id: AtomicU64::new(1),
                dma: Arc::new(DmaSpace::new(mrs)),
                inflight: AtomicUsize::new(0),
                submitted: Arc::new(AtomicU64::new(0)),
                counters: Counters::default(),
                start: Mutex::new(()),
                unavailable,
            }),
        }
    }

    fn runtime(&self) -> Result<&tokio::runtime::Runtime, OffloadError> {
        if let Some(rt) = self.inner.rt.get() {
            return Ok(rt);
        }
        let _g = self.inner.start.lock();
        if self.inner.rt.get().is_none() {
            let (submitted, spin) = (
                self.inner.submitted.clone(),
                Duration::from_micros(self.inner.cfg.spin_us),
            );
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(self.inner.cfg.threads)
                .thread_name("flexns-offload")
                .enable_time()
                // adaptive polling: before a worker sleeps, it watches for a new request for
                // `spin_us`; a request spawned meanwhile finds it awake (its park returns at
                // once) instead of paying a wake-up
                .on_thread_park(move || {
                    if spin.is_zero() {
                        return;
                    }
                    let seen = submitted.load(Ordering::Acquire);
                    let until = std::time::Instant::now() + spin;
                    let mut i = 0u32;
                    while submitted.load(Ordering::Acquire) == seen && std::time::Instant::now() < until {
                        i += 1;
                        if i.is_multiple_of(64) {
                            std::thread::yield_now();
                        } else {
                            std::hint::spin_loop();
                        }
                    }
                })
                .build()
                .map_err(|e| OffloadError::Runtime(e.to_string()))?;
            let _ = self.inner.rt.set(rt);
        }
        self.inner
            .rt
            .get()
            .ok_or_else(|| OffloadError::Runtime("not started".into()))
    }

    /// Registers `handler` for `opcode` on the QPs `filter` admits, with the default time
    /// budget. Keep the returned guard: dropping it unregisters the handler.
    pub fn register_opcode(
        &self,
        opcode: u16,
        filter: QpFilter,
        handler: impl OffloadHandler,
    ) -> Result<Registered, OffloadError> {
        self.register_with_budget(opcode, filter, handler, Duration::from_micros(self.inner.cfg.budget_us))
    }

    /// Registers a handler of bounded cost that does not block (the [`builtin`] ones, a
    /// key-value get) to run **inline**: on the data core that received the request, inside
    /// the pass that received it, so its response leaves in that pass with no hand-off to an
    /// offload thread. It runs until it first waits on something that is not ready (a DMA wait
    /// is ready at once); from there it goes on on the offload threads, within the default
    /// time budget. While it runs on the core nothing preempts it: a handler that loops or
    /// blocks there stalls every QP of that core, so register such handlers with
    /// [`OffloadEngine::register_opcode`]. A panic is caught and answered PANICKED, as on the
    /// offload threads.
    pub fn register_inline(
        &self,
        opcode: u16,
        filter: QpFilter,
        handler: impl OffloadHandler,
    ) -> Result<Registered, OffloadError> {
        let budget = Duration::from_micros(self.inner.cfg.budget_us);
        self.register(opcode, filter, Arc::new(handler), budget, true)
    }

    /// [`OffloadEngine::register_opcode`] with a time budget of its own.
    pub fn register_with_budget(
        &self,
        opcode: u16,
        filter: QpFilter,
        handler: impl OffloadHandler,
        budget: Duration,
    ) -> Result<Registered, OffloadError> {
        self.register(opcode, filter, Arc::new(handler), budget, false)
    }

    fn register(
        &self,
        opcode: u16,
        filter: QpFilter,
        handler: Arc<dyn OffloadHandler>,
        budget: Duration,
        inline: bool,
    ) -> Result<Registered, OffloadError> {
        if let Some(why) = self.inner.unavailable {
            return Err(OffloadError::Unavailable(why));
        }
        if RESERVED_OPCODES.contains(&opcode) {
            return Err(OffloadError::Opcode(opcode));
        }
        self.runtime()?;
        let mut hs = self.inner.handlers.write();
        if hs.iter().any(|r| r.opcode == opcode && r.filter.overlaps(&filter)) {
            return Err(OffloadError::Opcode(opcode));
        }
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        hs.push(Registration {
            id,
            opcode,
            filter,
            handler,
            budget_ns: budget.as_nanos().clamp(1, u64::MAX as u128) as u64,
            inline,
            latency: metrics::histogram!(
                "flexns_offload_handler_duration_seconds",
                "opcode" => format!("{opcode:#06x}")
            ),
        });
        Ok(Registered {
            engine: Arc::downgrade(&self.inner),
            id,
        })
    }

    /// Opts the region of `rkey` in for handlers' DMA (see `register_dma_region`, with the
    /// verbs).
    pub(crate) fn register_dma_key(&self, rkey: u32, writable: bool) -> DmaRegionHandle {
        self.inner.dma.register(rkey, writable)
    }

    /// The engine's counters.
    pub fn stats(&self) -> OffloadStats {
        let c = &self.inner.counters;
        let (dma_ops, dma_bytes) = self.inner.dma.counters();
        OffloadStats {
            requests: c.requests.load(Ordering::Relaxed),
            ok: c.ok.load(Ordering::Relaxed),
            no_handler: c.no_handler.load(Ordering::Relaxed),
            errors: c.errors.load(Ordering::Relaxed),
            panics: c.panics.load(Ordering::Relaxed),
            timeouts: c.timeouts.load(Ordering::Relaxed),
            overloaded: c.overloaded.load(Ordering::Relaxed),
            dma_ops,
            dma_bytes,
        }
    }

    /// The sink a QP on data core `core` hands its offload requests to.
    pub(crate) fn port(&self, core: Weak<dyn JobDone>) -> Arc<dyn OffloadSink> {
        Arc::new(OffloadPort {
            engine: self.clone(),
            core,
        })
    }

    fn lookup(&self, qpn: u32, opcode: u16) -> Option<Found> {
        self.inner
            .handlers
            .read()
            .iter()
            .find(|r| r.opcode == opcode && r.filter.admits(qpn))
            .map(|r| Found {
                handler: r.handler.clone(),
                budget_ns: r.budget_ns,
                inline: r.inline,
                latency: r.latency.clone(),
            })
    }
}

/// The registration serving a request.
struct Found {
    handler: Arc<dyn OffloadHandler>,
    budget_ns: u64,
    inline: bool,
    latency: metrics::Histogram,
}

/// What running a handler's future came to: its result, a caught panic, or the budget passed.
type Ran =
    Result<Result<Result<OffloadReply, OffloadError>, Box<dyn std::any::Any + Send>>, tokio::time::error::Elapsed>;

impl Inner {
    /// Counts how a job of `opcode` on QP `qpn` ended and turns it into its outcome.
    fn outcome(&self, qpn: u32, opcode: u16, ran: Ran) -> crate::transport::rc::offload::Outcome {
        let c = &self.counters;
        match ran {
            Ok(Ok(Ok(reply))) => {
                c.ok.fetch_add(1, Ordering::Relaxed);
                Outcome::new(OffloadStatus::Ok, reply.data)
            }
            Ok(Ok(Err(e))) => {
                tracing::debug!("offload opcode {opcode:#x} on QP {qpn:#x}: {e}");
                c.errors.fetch_add(1, Ordering::Relaxed);
                Outcome::empty(e.status())
            }
            Ok(Err(_)) => {
                tracing::warn!("offload handler for opcode {opcode:#x} panicked (caught)");
                c.panics.fetch_add(1, Ordering::Relaxed);
                Outcome::empty(OffloadStatus::Panicked)
            }
            Err(_) => {
                c.timeouts.fetch_add(1, Ordering::Relaxed);
                Outcome::empty(OffloadStatus::Timeout)
            }
        }
    }
}

/// A QP's data core as the offload engine sees it (the engine implements it).
pub(crate) trait JobDone: Send + Sync {
    /// Job `id` of QP `qpn` ended with `outcome`: the core records it in the QP and sends
    /// the response.
    fn job_finished(&self, qpn: u32, id: u64, outcome: crate::transport::rc::offload::Outcome);
}

/// A QP's way into the engine: starts jobs and tells the QP's data core when one finishes.
struct OffloadPort {
    engine: OffloadEngine,
    core: Weak<dyn JobDone>,
}

impl OffloadSink for OffloadPort {
    fn budget_ns(&self, qpn: u32, opcode: u16) -> u64 {
        self.engine
            .lookup(qpn, opcode)
            .map_or(self.engine.inner.cfg.budget_us * 1000, |f| f.budget_ns)
    }

    fn submit(&self, job: Arc<OffloadJob>) -> Option<crate::transport::rc::offload::Outcome> {
        let inner = &self.engine.inner;
        let c = &inner.counters;
        c.requests.fetch_add(1, Ordering::Relaxed);
        let (qpn, opcode) = (job.qpn, job.opcode);
        let refused = |st| Some(Outcome::empty(st));
        let Some(found) = self.engine.lookup(qpn, opcode) else {
            c.no_handler.fetch_add(1, Ordering::Relaxed);
            return refused(OffloadStatus::NoHandler); // answered by the responder in this pass
        };
        let Some(rt) = inner.rt.get() else {
            return refused(OffloadStatus::NoHandler);
        };
        let call = OffloadCall {
            job: job.clone(),
            dma: inner.dma.clone(),
            resp: Vec::new(),
            pending: Vec::new(),
            next_dma: 0,
            done_dma: 0,
        };
        let started = std::time::Instant::now();
        let mut fut = std::panic::AssertUnwindSafe(found.handler.call(call)).catch_unwind();
        if found.inline {
            // one poll on this core, inside the runtime's context (a handler that starts a
            // timer or a task registers it there); the waker is a no-op because a handler
            // that is not done goes to the runtime, which polls it again with its own
            let _rt = rt.enter();
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            if let std::task::Poll::Ready(r) = Pin::new(&mut fut).poll(&mut cx) {
                found.latency.record(started.elapsed().as_secs_f64());
                return Some(inner.outcome(qpn, opcode, Ok(r)));
            }
        }
        if inner.inflight.fetch_add(1, Ordering::AcqRel) >= inner.cfg.max_inflight && !found.inline {
            inner.inflight.fetch_sub(1, Ordering::AcqRel);
            c.overloaded.fetch_add(1, Ordering::Relaxed);
            return refused(OffloadStatus::Overloaded);
        }
        let engine = Arc::downgrade(inner);
        let core = self.core.clone();
        let (budget_ns, latency) = (found.budget_ns, found.latency);
        inner.submitted.fetch_add(1, Ordering::Release);
        rt.spawn(async move {
            let res = tokio::time::timeout(Duration::from_nanos(budget_ns), fut).await;
            latency.record(started.elapsed().as_secs_f64());
            let Some(inner) = engine.upgrade() else { return };
            let outcome = inner.outcome(qpn, opcode, res);
            inner.inflight.fetch_sub(1, Ordering::AcqRel);
            // (the QP's core drops it if the responder already answered TIMEOUT)
            if let Some(c) = core.upgrade() {
                c.job_finished(qpn, job.id, outcome);
            }
        });
        None
    }
}

/// A handler's finished response: made only by [`OffloadCall::submit_resp`].
pub struct OffloadReply {
    data: Arc<[u8]>,
}

/// One offload request as its handler sees it: the request, a response buffer, and the DMA
/// engine (FlexiNS Table 2's `context`).
pub struct OffloadCall {
    job: Arc<OffloadJob>,
    dma: Arc<DmaSpace>,
    resp: Vec<u8>,
    pending: Vec<(DmaOp, u32, u64, usize, usize)>,
    next_dma: u64,
    done_dma: u64,
}

impl OffloadCall {
    /// The handler opcode.
    pub fn opcode(&self) -> u16 {
        self.job.opcode
    }
    /// The QP the request came on.
    pub fn qpn(&self) -> u32 {
        self.job.qpn
    }
    /// The protection domain of the QP the request came on (what every DMA is checked against).
    pub fn pd(&self) -> u32 {
        self.job.pd
    }
    fn grant(&self, rkey: u32) -> Grant {
        Grant { pd: self.job.pd, rkey }
    }
    /// The request bytes.
    pub fn request(&self) -> &[u8] {
        &self.job.request
    }
    /// Most response bytes the requester can take.
    pub fn resp_capacity(&self) -> usize {
        self.job.resp_cap as usize
    }

    /// `alloc_resp`: a zeroed response buffer of `size` bytes (at most the requester's).
    pub fn alloc_resp(&mut self, size: usize) -> Result<(), OffloadError> {
        if size > self.resp_capacity() {
            return Err(OffloadError::ResponseTooLong {
                len: size,
                cap: self.resp_capacity(),
            });
        }
        self.resp.clear();
        self.resp.resize(size, 0);
        Ok(())
    }

    /// The response buffer, to fill directly.
    pub fn resp_mut(&mut self) -> &mut [u8] {
        &mut self.resp
    }

    /// Shortens the response to `len` bytes.
    pub fn truncate_resp(&mut self, len: usize) {
        self.resp.truncate(len);
    }

    /// `submit_dma`: queues a copy of `size` bytes between host address `host_addr` (reached
    /// with `rkey`, see the module notes on protection) and offset `resp_off` of the response
    /// buffer. Checked now and again when run by [`OffloadCall::wait_dma`] (the key may have
    /// been deregistered in between).
    pub fn submit_dma(
        &mut self,
        op: DmaOp,
        rkey: u32,
        host_addr: u64,
        resp_off: usize,
        size: usize,
    ) -> Result<DmaId, OffloadError> {
        if resp_off.checked_add(size).is_none_or(|e| e > self.resp.len()) {
            return Err(OffloadError::DmaFault(format!(
                "response range {resp_off}+{size} outside the {}-byte response buffer",
                self.resp.len()
            )));
        }
        self.dma.check(self.grant(rkey), host_addr, size, op == DmaOp::Write)?;
        self.pending.push((op, rkey, host_addr, resp_off, size));
        self.next_dma += 1;
        Ok(DmaId(self.next_dma))
    }

    /// `wait_dma_finish`: runs the queued copies up to and including `id`, in order.
    pub async fn wait_dma(&mut self, id: DmaId) -> Result<(), OffloadError> {
        let n = (id.0.saturating_sub(self.done_dma) as usize).min(self.pending.len());
        let mut bytes = 0;
        let pd = self.job.pd;
        for (op, rkey, addr, off, size) in self.pending.drain(..n) {
            let buf = &mut self.resp[off..off + size];
            let g = Grant { pd, rkey };
            match op {
                DmaOp::Read => self.dma.read(g, addr, buf)?,
                DmaOp::Write => self.dma.write(g, addr, buf)?,
            }
            bytes += size;
        }
        self.done_dma += n as u64;
        if bytes > 256 << 10 {
            // a long copy lets the thread's other handlers run
            tokio::task::yield_now().await;
        }
        Ok(())
    }

    /// Copies host memory at `addr` (reached with `rkey`) into `buf`: a DMA into the
    /// handler's own memory, for traversals that read a node to find the next one.
    pub fn dma_read(&self, rkey: u32, addr: u64, buf: &mut [u8]) -> Result<(), OffloadError> {
        self.dma.read(self.grant(rkey), addr, buf)
    }

    /// An atomic load of the aligned 8-byte word at host address `addr` (reached with `rkey`):
    /// a version or pointer that a concurrent writer updates with one store.
    pub fn dma_load_u64(&self, rkey: u32, addr: u64) -> Result<u64, OffloadError> {
        self.dma.load_u64(self.grant(rkey), addr)
    }

    /// `submit_resp`: the response is the buffer as it stands.
    pub fn submit_resp(self) -> Result<OffloadReply, OffloadError> {
        if !self.pending.is_empty() {
            return Err(OffloadError::Handler(format!(
                "{} submitted DMA copies were never waited for",
                self.pending.len()
            )));
        }
        Ok(OffloadReply {
            data: Arc::from(self.resp),
        })
    }
}
