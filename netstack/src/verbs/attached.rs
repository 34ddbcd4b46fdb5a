//! The verbs of a context attached to `flexnsd` ([`attach`]): the same calls as the
//! in-process engine's, made through the daemon's Unix socket (control) and the shared-memory
//! rings (posts and completions). What only an in-process engine has is refused with
//! [`VerbsError::Unsupported`], naming it.

use super::qp::{Endpoint, QpInitAttr};
use super::{ContextConfig, StatsSnapshot, VerbsError};
use crate::mem::{Access, Region};
use crate::transport::rc::{IcrcMode, QpState, RcConfig, RcStats};
use crate::verbs::attach::client::{self, ClientError};
use crate::verbs::attach::proto::ModifyStep;
use crate::work::{RecvWr, SendWr, Wc};
use std::net::SocketAddrV4;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// A context's attachment to a daemon.
pub(super) struct AttachedCtx {
    att: client::Attachment,
    cfg: ContextConfig,
    addr: SocketAddrV4,
    /// Refuses every handler: they run beside the engine, in the daemon's process.
    offload: crate::offload::OffloadEngine,
}

impl AttachedCtx {
    /// Attaches to the daemon at `cfg.flexnsd`, named after this program and process.
    pub(super) fn open(cfg: ContextConfig) -> Result<AttachedCtx, VerbsError> {
        let path = cfg
            .flexnsd
            .clone()
            .ok_or_else(|| VerbsError::Invalid("flexnsd: no socket given".into()))?;
        let program = std::env::current_exe()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "flexns".into());
        let name = format!("{program}[{}]", std::process::id());
        let att = client::Attachment::connect(&path, &name)
            .map_err(|e| VerbsError::Invalid(format!("flexnsd: cannot attach to {}: {e}", path.display())))?;
        let addr = att.daemon_addr().unwrap_or(cfg.bind);
        Ok(AttachedCtx {
            att,
            offload: crate::offload::OffloadEngine::unavailable(
                "offload handlers run in the process that owns the engine; this context is \
                 attached to flexnsd",
            ),
            cfg,
            addr,
        })
    }

    pub(super) fn local_addr(&self) -> SocketAddrV4 {
        self.addr
    }

    pub(super) fn config(&self) -> &ContextConfig {
        &self.cfg
    }

    pub(super) fn offload(&self) -> &crate::offload::OffloadEngine {
        &self.offload
    }

    /// The daemon engine's counters, all its attachments together.
    pub(super) fn stats(&self) -> StatsSnapshot {
        self.att.engine_stats().unwrap_or_else(|e| {
            tracing::debug!("flexnsd engine counters: {e}");
            StatsSnapshot::default()
        })
    }

    pub(super) fn create_cq(&self, cqe: usize) -> Result<client::Cq, VerbsError> {
        Ok(self.att.create_cq(cqe)?)
    }

    pub(super) fn create_qp(
        self: &Arc<Self>,
        pd: &Arc<AttachedPd>,
        send_cq: &Arc<client::Cq>,
        recv_cq: &Arc<client::Cq>,
        attr: QpInitAttr,
    ) -> Result<AttachedQp, VerbsError> {
        if attr.managed_slots > 0 {
            return Err(VerbsError::Unsupported(
                "managed_slots: a managed QP (RedN) runs only in an in-process engine".into(),
            ));
        }
        if attr.low_latency {
            return Err(VerbsError::Unsupported(
                "low_latency: the poster cannot run the daemon's data core; flexnsd's polling \
                 decides when a request leaves"
                    .into(),
            ));
        }
        let cfg = attr.config.unwrap_or(self.cfg.qp);
        cfg.validate()
            .map_err(|e| VerbsError::Invalid(format!("qp config field {e}")))?;
        // one ring carries the QP's sends and receives, and holds as many of each outstanding
        let want = cfg.max_send_wr.max(cfg.max_recv_wr).max(64) as usize;
        let slots = want
            .checked_next_power_of_two()
            .unwrap_or(usize::MAX)
            .min(crate::verbs::attach::shm::MAX_SLOTS);
        let qp = self.att.create_qp(
            pd.get()?,
            send_cq,
            recv_cq,
            client::QpInitAttr {
                sq_slots: slots as u32,
                config: Some(cfg),
            },
        )?;
        let endpoint = qp.local_endpoint()?;
        Ok(AttachedQp {
            qp,
            endpoint,
            cfg,
            state: AtomicU8::new(STATE_INIT),
            cc_refused: AtomicBool::new(false),
            inline: OnceLock::new(),
            inline_slot: (self.cfg.max_inline as usize).max(1).next_multiple_of(64),
            send_cq: send_cq.clone(),
            _recv_cq: recv_cq.clone(),
            _pd: pd.clone(),
        })
    }
}

/// A protection domain in the daemon, made when its first MR or QP needs it (allocating a PD
/// cannot fail in the verbs API; a command to the daemon can).
pub(super) struct AttachedPd {
    ctx: Arc<AttachedCtx>,
    pd: OnceLock<client::Pd>,
    making: Mutex<()>,
}

impl AttachedPd {
    pub(super) fn new(ctx: &Arc<AttachedCtx>) -> Arc<AttachedPd> {
        Arc::new(AttachedPd {
            ctx: ctx.clone(),
            pd: OnceLock::new(),
            making: Mutex::new(()),
        })
    }

    /// The daemon's PD, made now if it was not yet.
    fn get(&self) -> Result<&client::Pd, VerbsError> {
        if let Some(pd) = self.pd.get() {
            return Ok(pd);
        }
        let _g = self.making.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(pd) = self.pd.get() {
            return Ok(pd);
        }
        let pd = self.ctx.att.alloc_pd()?;
        Ok(self.pd.get_or_init(|| pd))
    }

    /// The daemon's handle of the PD (0 until it is made).
    pub(super) fn handle(&self) -> u32 {
        self.pd.get().map_or(0, |p| p.handle())
    }

    pub(super) fn reg_mr(self: &Arc<Self>, len: usize, access: Access) -> Result<AttachedMr, VerbsError> {
        Ok(AttachedMr {
            mr: self.get()?.reg_mr(len, access)?,
            _origin: None,
            _pd: self.clone(),
        })
    }

    /// Registers `region`: memory in a memfd as it is; other memory of this process (heap,
    /// caller memory) after moving its pages into a memfd in place
    /// ([`Region::share_in_place`]), since the daemon maps only memfds.
    pub(super) fn reg_region(self: &Arc<Self>, region: Arc<Region>, access: Access) -> Result<AttachedMr, VerbsError> {
        if region.memfd().is_some() || !region.is_process_memory() {
            let mr = self.get()?.reg_region(region, access).map_err(|e| match e {
                ClientError::Invalid(why) => VerbsError::Unsupported(why),
                e => e.into(),
            })?;
            return Ok(AttachedMr {
                mr,
                _origin: None,
                _pd: self.clone(),
            });
        }
        // SAFETY: `region` is this process's memory (its address is its pointer), valid while
        // the returned MR holds it (`_origin`); registering it promises, as `reg_mr_raw` and
        // `Region::from_raw` do, that no other thread writes it while it is registered here.
        let adopted =
            unsafe { Region::share_in_place(region.mut_ptr_at(0, region.len()), region.len()) }.map_err(|e| {
                VerbsError::Unsupported(format!("moving {} bytes into a memfd for flexnsd: {e}", region.len()))
            })?;
        let mut mr = self.reg_shared(Arc::new(adopted), access)?;
        mr._origin = Some(region);
        Ok(mr)
    }

    /// Registers caller memory `ptr..ptr+len`, moved into a memfd in place.
    ///
    /// # Safety
    /// [`Region::share_in_place`]'s contract.
    pub(super) unsafe fn reg_raw(
        self: &Arc<Self>,
        ptr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<AttachedMr, VerbsError> {
        // SAFETY: the caller's contract.
        let adopted = unsafe { Region::share_in_place(ptr, len) }.map_err(|e| {
            VerbsError::Unsupported(format!("moving {len} bytes at {ptr:p} into a memfd for flexnsd: {e}"))
        })?;
        self.reg_shared(Arc::new(adopted), access)
    }

    fn reg_shared(self: &Arc<Self>, region: Arc<Region>, access: Access) -> Result<AttachedMr, VerbsError> {
        Ok(AttachedMr {
            mr: self.get()?.reg_region(region, access)?,
            _origin: None,
            _pd: self.clone(),
        })
    }
}

/// A memory region registered with the daemon; keeps its PD (the daemon refuses to free a PD
/// that still has MRs).
pub(super) struct AttachedMr {
    mr: client::Mr,
    /// The region the caller registered, when its pages were moved into a memfd in place
    /// (the MR's region then names the same memory, and this keeps it allocated).
    _origin: Option<Arc<Region>>,
    _pd: Arc<AttachedPd>,
}

impl AttachedMr {
    pub(super) fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    pub(super) fn rkey(&self) -> u32 {
        self.mr.rkey()
    }

    pub(super) fn region(&self) -> &Arc<Region> {
        self.mr.region()
    }
}

const STATE_INIT: u8 = 1;
const STATE_RTR: u8 = 2;
const STATE_RTS: u8 = 3;
const STATE_ERR: u8 = 4;

/// A QP of the daemon, with what this process knows of it. Keeps its CQs and PD (the daemon
/// refuses to destroy a CQ or PD a QP uses); the QP is declared first so that it goes first.
pub(crate) struct AttachedQp {
    qp: client::Qp,
    /// Its half of a connection exchange, as the daemon gave it at creation.
    endpoint: Endpoint,
    cfg: RcConfig,
    /// The last state this process moved it to (ERR also once a completion failed).
    state: AtomicU8,
    /// `install_cc` was called (and refused).
    cc_refused: AtomicBool,
    /// Where INLINE payloads are copied at post time (made at the first), a slot of
    /// `inline_slot` bytes per send-ring entry.
    inline: OnceLock<client::Mr>,
    inline_slot: usize,
    send_cq: Arc<client::Cq>,
    _recv_cq: Arc<client::Cq>,
    _pd: Arc<AttachedPd>,
}

impl AttachedQp {
    pub(super) fn qp_num(&self) -> u32 {
        self.qp.qp_num()
    }

    pub(super) fn send_cq_num(&self) -> u32 {
        self.send_cq.handle()
    }

    pub(super) fn local_endpoint(&self) -> Endpoint {
        self.endpoint.clone()
    }

    pub(super) fn config(&self) -> RcConfig {
        self.cfg
    }

    pub(super) fn state(&self) -> QpState {
        if self.qp.failed() || self.qp.ring_fault().is_some() {
            return QpState::Err;
        }
        match self.state.load(Ordering::Acquire) {
            STATE_RTR => QpState::Rtr,
            STATE_RTS => QpState::Rts,
            STATE_ERR => QpState::Err,
            _ => QpState::Init,
        }
    }

    fn daemon_stats(&self) -> Option<crate::verbs::attach::proto::QpStats> {
        self.qp
            .stats()
            .inspect_err(|e| tracing::debug!("qp {:#x}: flexnsd counters: {e}", self.qp_num()))
            .ok()
    }

    pub(super) fn stats(&self) -> RcStats {
        self.daemon_stats().map(|s| s.rc).unwrap_or_default()
    }

    pub(super) fn icrc_mode(&self) -> IcrcMode {
        self.daemon_stats().map(|s| s.icrc).unwrap_or_default()
    }

    pub(super) fn refuse_cc(&self, alg: Box<dyn crate::cc::CcAlgorithm>) {
        tracing::warn!(
            "qp {:#x}: congestion-control algorithm {} not installed: through flexnsd the \
             daemon's configured algorithm runs",
            self.qp_num(),
            alg.name()
        );
        self.cc_refused.store(true, Ordering::Relaxed);
    }

    pub(super) fn cc_fault(&self) -> Option<&'static str> {
        self.cc_refused
            .load(Ordering::Relaxed)
            .then_some("install_cc: an algorithm cannot be installed through flexnsd")
    }

    pub(super) fn rtr(&self, remote: &Endpoint, accept: bool) -> Result<(), VerbsError> {
        self.qp.modify(ModifyStep::Rtr {
            remote: remote.clone(),
            accept,
        })?;
        self.state.store(STATE_RTR, Ordering::Release);
        Ok(())
    }

    pub(super) fn rts(&self, sq_psn: Option<u32>) -> Result<(), VerbsError> {
        if sq_psn.is_some_and(|p| p > crate::wire::MASK24) {
            return Err(VerbsError::Invalid(format!(
                "sq_psn: {:#x} is wider than 24 bits",
                sq_psn.unwrap_or_default()
            )));
        }
        self.qp.modify(ModifyStep::Rts { sq_psn })?;
        self.state.store(STATE_RTS, Ordering::Release);
        Ok(())
    }

    pub(super) fn to_err(&self) {
        if let Err(e) = self.qp.modify(ModifyStep::Err) {
            tracing::warn!("qp {:#x}: -> ERR through flexnsd: {e}", self.qp_num());
        }
        self.state.store(STATE_ERR, Ordering::Release);
    }

    pub(super) fn connect(&self, remote: &Endpoint) -> Result<(), VerbsError> {
        self.qp.connect(remote)?;
        self.state.store(STATE_RTS, Ordering::Release);
        Ok(())
    }

    pub(super) fn set_rate_limit(&self, bytes_per_sec: Option<u64>, burst: u64) {
        if let Err(e) = self.qp.set_rate_limit(bytes_per_sec, burst) {
            tracing::warn!("qp {:#x}: rate limit through flexnsd: {e}", self.qp_num());
        }
    }

    pub(super) fn set_window_limit(&self, bytes: Option<u64>) {
        if let Err(e) = self.qp.set_window_limit(bytes) {
            tracing::warn!("qp {:#x}: window limit through flexnsd: {e}", self.qp_num());
        }
    }

    pub(super) fn post_send_batch(&self, wrs: impl IntoIterator<Item = SendWr>) -> Result<usize, VerbsError> {
        let mut n = 0;
        for wr in wrs {
            self.qp.post_send(wr).map_err(post_error)?;
            n += 1;
        }
        Ok(n)
    }

    /// An INLINE send: `data` copied now into this QP's bounce memory (registered with the
    /// daemon at the first INLINE post), which the send then names.
    pub(super) fn post_send_inline(&self, wr: SendWr, data: &[u8]) -> Result<(), VerbsError> {
        if data.len() as u64 != wr.total_len() {
            return Err(VerbsError::Invalid(format!(
                "INLINE payload of {} bytes where the scatter list describes {}",
                data.len(),
                wr.total_len()
            )));
        }
        if data.len() > self.inline_slot {
            return Err(VerbsError::InlineTooLong {
                len: data.len() as u64,
                max: self.inline_slot as u32,
            });
        }
        let bounce = match self.inline.get() {
            Some(b) => b,
            None => {
                let b = self
                    ._pd
                    .get()?
                    .reg_mr(self.qp.slots() * self.inline_slot, Access::LOCAL_WRITE)?;
                self.inline.get_or_init(|| b)
            }
        };
        self.qp
            .post_send_inline(wr, data, bounce, self.inline_slot)
            .map_err(post_error)
    }

    pub(super) fn post_recv(&self, wr: RecvWr) -> Result<(), VerbsError> {
        self.qp.post_recv(wr).map_err(post_error)
    }
}

/// A refused post as the in-process engine reports it: a full queue is `PostError::QueueFull`
/// (callers back off on it), the rest as the daemon's errors.
fn post_error(e: ClientError) -> VerbsError {
    match e {
        ClientError::QueueFull(n) => crate::transport::rc::PostError::QueueFull(n as u32).into(),
        e => e.into(),
    }
}

/// A CQ ring that reads wrong (a broken daemon) was reported once.
static RING_ERROR_LOGGED: AtomicBool = AtomicBool::new(false);

/// [`super::Cq::poll`] of an attached CQ.
pub(super) fn poll(cq: &client::Cq, wc: &mut [Wc]) -> usize {
    match cq.poll(wc) {
        Ok(n) => n,
        Err(e) => {
            if !RING_ERROR_LOGGED.swap(true, Ordering::Relaxed) {
                tracing::error!("flexnsd completion queue {}: {e}", cq.handle());
            }
            0
        }
    }
}

/// [`super::Cq::wait`] of an attached CQ.
pub(super) fn wait(cq: &client::Cq, timeout: Duration) -> bool {
    match cq.wait(timeout) {
        Ok(ready) => ready,
        Err(ClientError::DaemonGone) => false,
        Err(e) => {
            tracing::warn!("flexnsd completion queue {}: waiting: {e}", cq.handle());
            false
        }
    }
}

/// Whether the daemon is gone and the CQ has nothing left to deliver.
pub(super) fn drained(cq: &client::Cq) -> bool {
    cq.is_finished()
}

/// [`super::Cq::wait_async`] of an attached CQ: waits on a blocking thread, a slice at a time.
pub(super) async fn wait_async(cq: &Arc<client::Cq>) {
    loop {
        let c = cq.clone();
        match tokio::task::spawn_blocking(move || c.wait(Duration::from_millis(100))).await {
            Ok(Ok(true)) => return,
            Ok(Ok(false)) => continue,
            // the daemon is gone (or the thread could not run): the caller's poll says what
            // is left; not at once, or a caller that loops on this would spin
            _ => {
                tokio::time::sleep(Duration::from_millis(10)).await;
                return;
            }
        }
    }
}
