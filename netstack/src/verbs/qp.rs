//! Queue pairs, as applications see them: [`Qp`] runs in the context's in-process engine
//! (`engine_qp`) or in the `flexnsd` the context is attached to (`attached`), with the same
//! calls; [`QpInitAttr`] and [`Endpoint`] are shared by both.

use super::attached::AttachedQp;
use super::engine_qp::EngineQp;
use super::{Mr, Pd, VerbsError};
use crate::mem::Access;
use crate::transport::rc::{IcrcMode, QpState, RcConfig, RcStats, Recovery};
use crate::work::{RecvWr, SendWr, Sge};
use serde::{Deserialize, Serialize};
use std::net::SocketAddrV4;

/// Creation attributes of a QP.
#[derive(Debug, Clone, Copy, Default)]
pub struct QpInitAttr {
    /// Transport parameters; `None` takes the context's defaults.
    pub config: Option<RcConfig>,
    /// Low-latency QP (FlexiNS §3.4): `post_send` runs the QP's data core from the posting
    /// thread when no other thread is running it, so the request is sent in the poster's own
    /// call instead of after a hand-off to the core's thread (which only runs it when busy).
    /// Meant for small (one-MTU), often INLINE, two-sided messages. Costs the posting thread
    /// the core's pass (its receives, timers and system calls) per post.
    pub low_latency: bool,
    /// A managed QP (RedN): its send queue is a ring of this many 64-byte entries in memory
    /// ([`crate::redn::wqe`]) that the engine fetches only as far as an ENABLE allows; 0 for an
    /// ordinary QP.
    pub managed_slots: usize,
}

/// What a peer needs to connect to a QP (exchanged by the connection manager).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoint {
    /// Its QP number.
    pub qpn: u32,
    /// First PSN this QP sends (the peer's expected PSN).
    pub psn: u32,
    /// The data-path address its packets go to.
    pub addr: SocketAddrV4,
    /// Its path MTU.
    pub mtu: u32,
    /// Its loss recovery (both ends must agree).
    pub recovery: Recovery,
    /// The congestion control this QP runs (`None` adopts the peer's when connecting).
    #[serde(default)]
    pub cc: crate::cc::CcKind,
    /// Multipath: how many paths the QP uses and how it sprays over them (see
    /// [`Qp::set_paths`]); a QP with one path adopts the peer's when connecting.
    #[serde(default = "one_path")]
    pub paths: u8,
    /// How it spreads packets over its paths.
    #[serde(default)]
    pub spray: crate::path::SprayPolicy,
    /// The QP's data-path address on each of its host's other local addresses (multi-NIC),
    /// after `addr`: paths pair them with the peer's.
    #[serde(default)]
    pub extra_addrs: Vec<SocketAddrV4>,
    /// The other addresses its paths send from (the peer accepts packets from them).
    #[serde(default)]
    pub sources: Vec<SocketAddrV4>,
    /// Where its context's memory table is exported to same-host peers, if it is
    /// ([`crate::samehost`]): a QP that connects to this endpoint from the same host executes
    /// its WRITEs and READs by one copy.
    #[serde(default)]
    pub same_host: Option<crate::samehost::SameHostDesc>,
    /// The ICRC mode the QP offers: `none` only when its configuration asks for it and its
    /// context sends UDP checksums. The connection runs `none` when both ends offer it.
    #[serde(default)]
    pub icrc: crate::transport::rc::IcrcMode,
}

fn one_path() -> u8 {
    1
}

/// An RC queue pair. Destroyed (removed from its engine) on drop.
pub struct Qp {
    kind: QpKind,
}

enum QpKind {
    Engine(EngineQp),
    Attached(Box<AttachedQp>),
}

impl Qp {
    pub(super) fn engine(q: EngineQp) -> Qp {
        Qp {
            kind: QpKind::Engine(q),
        }
    }

    pub(super) fn attached(q: AttachedQp) -> Qp {
        Qp {
            kind: QpKind::Attached(Box::new(q)),
        }
    }

    /// The in-process QP, or [`VerbsError::Unsupported`] naming `what` through flexnsd.
    fn engine_only(&self, what: &str) -> Result<&EngineQp, VerbsError> {
        match &self.kind {
            QpKind::Engine(q) => Ok(q),
            QpKind::Attached(_) => Err(VerbsError::Unsupported(format!(
                "{what} runs only in an in-process engine"
            ))),
        }
    }

    /// Whether this is a managed QP (RedN).
    pub fn is_managed(&self) -> bool {
        match &self.kind {
            QpKind::Engine(q) => q.is_managed(),
            QpKind::Attached(_) => false,
        }
    }

    /// Managed QP: writes `wr` into the ring at the next index with `operand` in the 48-bit
    /// operand field of its word 0 (what a RedN `if` compares); returns the index. Nothing runs
    /// until an ENABLE covers the index.
    pub fn post_managed(&self, wr: &SendWr, operand: u64) -> Result<u64, VerbsError> {
        self.engine_only("a managed QP (RedN)")?.post_managed(wr, operand)
    }

    /// Managed QP: the index the next [`Qp::post_managed`] writes (0 for any other QP).
    pub fn next_index(&self) -> u64 {
        match &self.kind {
            QpKind::Engine(q) => q.next_index(),
            QpKind::Attached(_) => 0,
        }
    }

    /// Managed QP: lets the engine fetch the ring up to `index` (exclusive), as an ENABLE
    /// work request of another QP would.
    pub fn enable(&self, index: u64) -> Result<(), VerbsError> {
        self.engine_only("a managed QP (RedN)")?.enable(index)
    }

    /// Managed QP: the address of ring entry `i` (what a RedN program's WRITEs patch).
    pub fn wqe_addr(&self, i: u64) -> Result<u64, VerbsError> {
        self.engine_only("a managed QP (RedN)")?.wqe_addr(i)
    }

    /// Managed QP: registers its ring in `pd` (so that RDMA WRITEs can rewrite entries).
    pub fn reg_wq_mr(&self, pd: &Pd, access: Access) -> Result<Mr, VerbsError> {
        self.engine_only("a managed QP (RedN)")?.reg_wq_mr(pd, access)
    }

    /// The number of the CQ its send completions go to.
    pub fn send_cq_num(&self) -> u32 {
        match &self.kind {
            QpKind::Engine(q) => q.send_cq_num(),
            QpKind::Attached(q) => q.send_cq_num(),
        }
    }

    /// Posts an offload request (`opcode`, `request` bytes) whose response the peer's handler
    /// writes into `resp`; completes like a READ.
    pub fn post_offload(&self, wr_id: u64, opcode: u16, request: &[u8], resp: Sge) -> Result<(), VerbsError> {
        self.engine_only("an offload request (post_offload)")?
            .post_offload(wr_id, opcode, request, resp)
    }

    /// Its QP number.
    pub fn qp_num(&self) -> u32 {
        match &self.kind {
            QpKind::Engine(q) => q.qp_num(),
            QpKind::Attached(q) => q.qp_num(),
        }
    }

    /// Its state (as its data core last published it; attached, as this process knows it:
    /// the steps it asked for, and ERR once a completion failed or the daemon is gone).
    pub fn state(&self) -> QpState {
        match &self.kind {
            QpKind::Engine(q) => q.state(),
            QpKind::Attached(q) => q.state(),
        }
    }

    /// Installs a congestion-control algorithm on the QP (replacing the configured one).
    /// Attached to flexnsd none can be installed (the algorithm would run in the daemon):
    /// [`Qp::cc_fault`] then says so.
    pub fn install_cc(&self, alg: Box<dyn crate::cc::CcAlgorithm>) {
        match &self.kind {
            QpKind::Engine(q) => q.install_cc(alg),
            QpKind::Attached(q) => q.refuse_cc(alg),
        }
    }

    /// Why its congestion-control algorithm was taken off (it faulted), if it was.
    pub fn cc_fault(&self) -> Option<&'static str> {
        match &self.kind {
            QpKind::Engine(q) => q.cc_fault(),
            QpKind::Attached(q) => q.cc_fault(),
        }
    }

    /// The name of the QP's congestion-control algorithm and the bytes of its state.
    pub fn cc_info(&self) -> Option<(&'static str, usize)> {
        match &self.kind {
            QpKind::Engine(q) => q.cc_info(),
            QpKind::Attached(_) => None,
        }
    }

    /// The control-loop delays (ns) its congestion control recorded since the last call.
    pub fn take_control_loop_samples(&self) -> Vec<u32> {
        match &self.kind {
            QpKind::Engine(q) => q.take_control_loop_samples(),
            QpKind::Attached(_) => Vec::new(),
        }
    }

    /// Its transport counters (attached, from the daemon; zeros if it cannot answer).
    pub fn stats(&self) -> RcStats {
        match &self.kind {
            QpKind::Engine(q) => q.stats(),
            QpKind::Attached(q) => q.stats(),
        }
    }

    /// Bytes of transport state the QP holds in this process (attached: none, the daemon
    /// holds it).
    pub fn state_bytes(&self) -> usize {
        match &self.kind {
            QpKind::Engine(q) => q.state_bytes(),
            QpKind::Attached(_) => 0,
        }
    }

    /// Its transport parameters.
    pub fn config(&self) -> RcConfig {
        match &self.kind {
            QpKind::Engine(q) => q.config(),
            QpKind::Attached(q) => q.config(),
        }
    }

    /// Sprays the QP over `n` paths with `policy` (before connecting). Attached, only one path.
    pub fn set_paths(&self, n: usize, policy: crate::path::SprayPolicy) -> Result<(), VerbsError> {
        match &self.kind {
            QpKind::Engine(q) => q.set_paths(n, policy),
            QpKind::Attached(_) if n == 1 => Ok(()),
            QpKind::Attached(_) => Err(VerbsError::Unsupported(format!(
                "paths: {n}: a QP through flexnsd has one path"
            ))),
        }
    }

    /// Per-path counters (attached: none, its one path is in the QP's counters).
    pub fn path_stats(&self) -> Vec<crate::path::PathStats> {
        match &self.kind {
            QpKind::Engine(q) => q.path_stats(),
            QpKind::Attached(_) => Vec::new(),
        }
    }

    /// This QP's half of a connection exchange.
    pub fn local_endpoint(&self) -> Endpoint {
        match &self.kind {
            QpKind::Engine(q) => q.local_endpoint(),
            QpKind::Attached(q) => q.local_endpoint(),
        }
    }

    /// The ICRC mode the connection runs (`icrc` until it is connected).
    pub fn icrc_mode(&self) -> IcrcMode {
        match &self.kind {
            QpKind::Engine(q) => q.icrc_mode(),
            QpKind::Attached(q) => q.icrc_mode(),
        }
    }

    /// INIT -> RTR towards `remote`: the path MTU is the smaller of both; the loss-recovery
    /// modes must match. Congestion control is negotiated: a QP without one adopts the peer's
    /// (so the receiver's half of the algorithm, CNPs, grants or the INT echo, runs on the other
    /// end); two different algorithms are refused.
    pub fn modify_to_rtr(&self, remote: &Endpoint) -> Result<(), VerbsError> {
        match &self.kind {
            QpKind::Engine(q) => q.modify_to_rtr(remote),
            QpKind::Attached(q) => q.rtr(remote, false),
        }
    }

    /// [`Qp::modify_to_rtr`] for `remote` as a peer's connection request named it: its
    /// addresses are the peer's word, so the QP challenges them once unpaid and then only as
    /// what the peer sends pays for ([`crate::transport::rc::validation::Chooser::Remote`]).
    pub fn accept_rtr(&self, remote: &Endpoint) -> Result<(), VerbsError> {
        match &self.kind {
            QpKind::Engine(q) => q.accept_rtr(remote),
            QpKind::Attached(q) => q.rtr(remote, true),
        }
    }

    /// [`Qp::connect`] for a peer's connection request (what a connection manager's acceptor
    /// does): [`Qp::accept_rtr`], then RTS.
    pub fn accept(&self, remote: &Endpoint) -> Result<(), VerbsError> {
        self.accept_rtr(remote)?;
        self.modify_to_rts()
    }

    /// RTR -> RTS.
    pub fn modify_to_rts(&self) -> Result<(), VerbsError> {
        match &self.kind {
            QpKind::Engine(q) => q.modify_to_rts(),
            QpKind::Attached(q) => q.rts(None),
        }
    }

    /// RTR -> RTS sending from `sq_psn` (24 bits) instead of the PSN drawn at creation: for a
    /// caller that chose its own and told the peer (`ibv_modify_qp`'s `IBV_QP_SQ_PSN`).
    pub fn modify_to_rts_at(&self, sq_psn: u32) -> Result<(), VerbsError> {
        match &self.kind {
            QpKind::Engine(q) => q.modify_to_rts_at(sq_psn),
            QpKind::Attached(q) => q.rts(Some(sq_psn)),
        }
    }

    /// -> ERR: outstanding work requests complete with WR_FLUSH_ERR.
    pub fn modify_to_err(&self) {
        match &self.kind {
            QpKind::Engine(q) => q.modify_to_err(),
            QpKind::Attached(q) => q.to_err(),
        }
    }

    /// INIT -> RTR -> RTS in one call.
    pub fn connect(&self, remote: &Endpoint) -> Result<(), VerbsError> {
        match &self.kind {
            QpKind::Engine(q) => q.connect(remote),
            QpKind::Attached(q) => q.connect(remote),
        }
    }

    /// Limits the QP's sending rate (bytes per second, with a burst) or lifts the limit with
    /// `None`; like `ibv_modify_qp_rate_limit`. Congestion control drives the same hook.
    pub fn set_rate_limit(&self, bytes_per_sec: Option<u64>, burst_bytes: u64) {
        match &self.kind {
            QpKind::Engine(q) => q.set_rate_limit(bytes_per_sec, burst_bytes),
            QpKind::Attached(q) => q.set_rate_limit(bytes_per_sec, burst_bytes),
        }
    }

    /// Limits the payload bytes in flight, or lifts the limit with `None`.
    pub fn set_window_limit(&self, bytes: Option<u64>) {
        match &self.kind {
            QpKind::Engine(q) => q.set_window_limit(bytes),
            QpKind::Attached(q) => q.set_window_limit(bytes),
        }
    }

    /// Posts a send work request (`ibv_post_send`): the request is checked, encoded into the
    /// data core's shared send queue (INLINE payload inside the slots) and the core is woken if
    /// it sleeps (a low-latency QP's poster runs the core itself when it can). Attached, it is
    /// written into the QP's send ring in shared memory (INLINE is refused there: the daemon
    /// reads the payload after the post returns).
    pub fn post_send(&self, wr: SendWr) -> Result<(), VerbsError> {
        self.post_send_batch(std::iter::once(wr)).map(|_| ())
    }

    /// Posts several send work requests; stops at the first refused one and returns how many
    /// were posted before it in the error's absence.
    pub fn post_send_batch(&self, wrs: impl IntoIterator<Item = SendWr>) -> Result<usize, VerbsError> {
        match &self.kind {
            QpKind::Engine(q) => q.post_send_batch(wrs),
            QpKind::Attached(q) => q.post_send_batch(wrs),
        }
    }

    /// Posts a send whose INLINE payload the caller has gathered itself (`ibv_post_send` with
    /// `IBV_SEND_INLINE`, which reads the SGEs' bytes at post time without checking their
    /// lkeys): `data` is the payload, `wr`'s scatter list only its description.
    /// Attached, the bytes are copied into a per-QP bounce buffer the daemon maps, and the
    /// send names it.
    pub fn post_send_inline(&self, wr: SendWr, data: &[u8]) -> Result<(), VerbsError> {
        match &self.kind {
            QpKind::Engine(q) => q.post_send_inline(wr, data),
            QpKind::Attached(q) => q.post_send_inline(wr, data),
        }
    }

    /// Destroys the QP and returns once its engine has removed it (dropping it only queues the
    /// removal): from then on the engine neither delivers to its receive buffers nor reads its
    /// send requests' memory on its behalf, except packets already built, which hold their
    /// region (`Arc`) until sent. Attached, the daemon has removed it when this returns.
    pub fn destroy(self) {
        match self.kind {
            QpKind::Engine(q) => q.destroy(),
            QpKind::Attached(q) => drop(q),
        }
    }

    /// Posts a receive work request (`ibv_post_recv`): checked against the QP's state and
    /// receive queue depth as its core last published them, then queued for the core behind
    /// the QP's earlier posts.
    pub fn post_recv(&self, wr: RecvWr) -> Result<(), VerbsError> {
        match &self.kind {
            QpKind::Engine(q) => q.post_recv(wr),
            QpKind::Attached(q) => q.post_recv(wr),
        }
    }
}
