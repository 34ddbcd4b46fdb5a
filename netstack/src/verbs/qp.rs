//! Queue pairs: creation, the RESET/INIT/RTR/RTS/ERR transitions, posting.

use super::{Context, VerbsError};
use crate::engine::{sq, CqShared, EngineShared, QpMirror, QpSlot};
use crate::mem::Access;
use crate::transport::rc::PostError;
use crate::transport::rc::{QpState, RcConfig, RcQp, RcStats, Recovery};
use crate::work::{RecvWr, SendFlags, SendWr};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::net::SocketAddrV4;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Creation attributes of a QP.
#[derive(Debug, Clone, Copy, Default)]
pub struct QpInitAttr {
    /// Transport parameters; `None` takes the context's defaults.
    pub config: Option<RcConfig>,
    /// Low-latency QP (FlexiNS §3.4): `post_send` runs the transport and sends from the posting
    /// thread instead of handing the request to the data core, saving a thread handoff per
    /// message. Meant for small (one-MTU), often INLINE, two-sided messages; receives are still
    /// processed by the data core. Costs the posting thread a system call per post.
    pub low_latency: bool,
}

/// What a peer needs to connect to a QP (exchanged by the connection manager).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoint {
    pub qpn: u32,
    /// First PSN this QP sends (the peer's expected PSN).
    pub psn: u32,
    pub addr: SocketAddrV4,
    pub mtu: u32,
    pub recovery: Recovery,
    /// The congestion control this QP runs (`None` adopts the peer's when connecting).
    #[serde(default)]
    pub cc: crate::cc::CcKind,
}

/// An RC queue pair. Destroyed (removed from the engine) on drop.
pub struct Qp {
    ctx: Context,
    qpn: u32,
    psn: u32,
    slot: Arc<Mutex<QpSlot>>,
    /// The data core that owns this QP.
    core: Arc<EngineShared>,
    pd: u32,
    /// State and retired-WQE count as the engine last published them.
    mirror: Arc<QpMirror>,
    /// Send WRs posted so far (with `mirror.retired`, the send queue's depth).
    posted: AtomicU64,
    max_send_wr: u32,
    low_latency: bool,
}

impl Qp {
    pub(super) fn create(
        ctx: Context,
        pd: u32,
        qpn: u32,
        send_cq: Arc<CqShared>,
        recv_cq: Arc<CqShared>,
        attr: QpInitAttr,
    ) -> Result<Qp, VerbsError> {
        let cfg = attr.config.unwrap_or(ctx.inner.cfg.qp);
        cfg.validate()
            .map_err(|e| VerbsError::Invalid(format!("qp config field {e}")))?;
        let mut qp = RcQp::new(qpn, pd, cfg);
        qp.set_cc_env(ctx.inner.cc_env.clone());
        qp.modify_to_init()?;
        let mirror = Arc::new(QpMirror::default());
        let qs = QpSlot {
            qp,
            remote: None,
            send_cq,
            recv_cq,
            mirror: mirror.clone(),
        };
        qs.sync_mirror();
        let slot = Arc::new(Mutex::new(qs));
        let core = ctx.inner.engine.core_for(qpn).clone();
        core.qps.write().insert(qpn, slot.clone());
        // a random-ish initial PSN, as NICs pick one
        let psn = (qpn.wrapping_mul(0x9E37_79B9) ^ std::process::id()) & crate::wire::MASK24;
        Ok(Qp {
            ctx,
            qpn,
            psn,
            pd,
            slot,
            core,
            mirror,
            posted: AtomicU64::new(0),
            max_send_wr: cfg.max_send_wr,
            low_latency: attr.low_latency,
        })
    }

    pub fn qp_num(&self) -> u32 {
        self.qpn
    }

    /// The QP state (as the engine last published it; no lock taken).
    pub fn state(&self) -> QpState {
        self.mirror.state()
    }

    /// Runs a congestion-control algorithm of the caller's on this QP from now on (after
    /// connecting): SwCC's programmability for algorithms beyond the built-in five. The peer must
    /// run a matching receiving half, if the algorithm needs one.
    pub fn install_cc(&self, alg: Box<dyn crate::cc::CcAlgorithm>) {
        self.slot.lock().qp.install_cc(alg);
    }

    /// Why congestion control stopped this QP, if it did (HPCC on a path without INT).
    pub fn cc_fault(&self) -> Option<&'static str> {
        self.slot.lock().qp.cc_fault()
    }

    /// The congestion-control algorithm and its per-QP context bytes, if one runs.
    pub fn cc_info(&self) -> Option<(&'static str, usize)> {
        self.slot.lock().qp.cc_info()
    }

    /// Takes the control-loop delay samples (ns from a CE mark's arrival at the receiver to the
    /// rate change it caused here) collected since the last call.
    pub fn take_control_loop_samples(&self) -> Vec<u32> {
        self.slot.lock().qp.take_control_loop_samples()
    }

    pub fn stats(&self) -> RcStats {
        self.slot.lock().qp.stats()
    }

    /// Bytes of transport state this QP holds.
    pub fn state_bytes(&self) -> usize {
        self.slot.lock().qp.state_bytes()
    }

    pub fn config(&self) -> RcConfig {
        *self.slot.lock().qp.config()
    }

    /// This QP's half of a connection exchange.
    pub fn local_endpoint(&self) -> Endpoint {
        let cfg = self.config();
        Endpoint {
            qpn: self.qpn,
            psn: self.psn,
            addr: self.core.local_addr(),
            mtu: cfg.mtu,
            recovery: cfg.recovery,
            cc: cfg.cc,
        }
    }

    /// INIT -> RTR towards `remote`: the path MTU is the smaller of both; the loss-recovery
    /// modes must match. Congestion control is negotiated: a QP without one adopts the peer's
    /// (so the receiver's half of the algorithm, CNPs, grants or the INT echo, runs on the other
    /// end); two different algorithms are refused.
    pub fn modify_to_rtr(&self, remote: &Endpoint) -> Result<(), VerbsError> {
        let mut s = self.slot.lock();
        let mut cfg = *s.qp.config();
        if cfg.recovery != remote.recovery {
            return Err(VerbsError::Peer(format!(
                "uses {:?} loss recovery, this QP {:?}",
                remote.recovery, cfg.recovery
            )));
        }
        if remote.addr.ip().is_unspecified() || remote.addr.port() == 0 {
            return Err(VerbsError::Invalid(format!(
                "remote address {} is not routable",
                remote.addr
            )));
        }
        cfg.mtu = cfg.mtu.min(remote.mtu);
        match (cfg.cc, remote.cc) {
            (crate::cc::CcKind::None, theirs) => cfg.cc = theirs,
            (ours, crate::cc::CcKind::None) => cfg.cc = ours,
            (ours, theirs) if ours != theirs => {
                return Err(VerbsError::Peer(format!(
                    "runs congestion control {theirs}, this QP {ours}"
                )))
            }
            _ => {}
        }
        cfg.validate()
            .map_err(|e| VerbsError::Peer(format!("offers an invalid {e}")))?;
        s.qp.modify_to_rtr(remote.qpn, remote.psn, cfg)?;
        s.remote = Some(remote.addr);
        s.sync_mirror();
        Ok(())
    }

    /// RTR -> RTS.
    pub fn modify_to_rts(&self) -> Result<(), VerbsError> {
        let mut s = self.slot.lock();
        s.qp.modify_to_rts(self.psn)?;
        s.sync_mirror();
        Ok(())
    }

    /// -> ERR: outstanding work requests complete with WR_FLUSH_ERR.
    pub fn modify_to_err(&self) {
        let mut s = self.slot.lock();
        s.qp.modify_to_err();
        self.settle(&s);
    }

    /// INIT -> RTR -> RTS in one call.
    pub fn connect(&self, remote: &Endpoint) -> Result<(), VerbsError> {
        self.modify_to_rtr(remote)?;
        self.modify_to_rts()
    }

    /// Limits the QP's sending rate (bytes per second, with a burst) or lifts the limit with
    /// `None`; like `ibv_modify_qp_rate_limit`. Congestion control drives the same hook.
    pub fn set_rate_limit(&self, bytes_per_sec: Option<u64>, burst_bytes: u64) {
        self.slot.lock().qp.set_rate(bytes_per_sec, burst_bytes);
    }

    /// Limits the payload bytes in flight, or lifts the limit with `None`.
    pub fn set_window_limit(&self, bytes: Option<u64>) {
        self.slot.lock().qp.set_window_bytes(bytes);
    }

    /// Posts a send work request (`ibv_post_send`): the request is checked, encoded into the
    /// data core's shared send queue (INLINE payload inside the slots) and the core is woken if
    /// it sleeps. The QP's lock is not taken.
    pub fn post_send(&self, wr: SendWr) -> Result<(), VerbsError> {
        self.post_send_batch(std::iter::once(wr)).map(|_| ())
    }

    /// Posts several send work requests; stops at the first refused one and returns how many
    /// were posted before it in the error's absence.
    pub fn post_send_batch(&self, wrs: impl IntoIterator<Item = SendWr>) -> Result<usize, VerbsError> {
        if self.low_latency {
            return self.post_send_direct(wrs);
        }
        let mut slots = Vec::with_capacity(sq::MAX_SLOTS);
        let mut n = 0;
        let mut q = self.core.sq.lock();
        let mut res = Ok(());
        for wr in wrs {
            if let Err(e) = self.encode(&wr, &mut slots) {
                res = Err(e);
                break;
            }
            // the engine drains the queue continuously; wait briefly for room
            let deadline = std::time::Instant::now() + std::time::Duration::from_millis(100);
            while !sq::push_all(&mut q, &slots) {
                q.notify();
                if std::time::Instant::now() > deadline {
                    res = Err(PostError::QueueFull(sq::MAX_SLOTS as u32).into());
                    break;
                }
                std::thread::yield_now();
            }
            if res.is_err() {
                break;
            }
            self.posted.fetch_add(1, Ordering::Relaxed);
            n += 1;
        }
        q.notify();
        res.map(|_| n)
    }

    /// After an application-thread operation on the transport: refresh the mirror, and have the
    /// data core deliver any completions it produced (only core threads write CQ pipes, which
    /// keeps each QP's completions in order).
    fn settle(&self, s: &QpSlot) {
        s.sync_mirror();
        if s.qp.has_completions() {
            self.core.poke(self.qpn);
        }
    }

    /// The low-latency path: post into the transport and transmit from this thread.
    fn post_send_direct(&self, wrs: impl IntoIterator<Item = SendWr>) -> Result<usize, VerbsError> {
        let mut s = self.slot.lock();
        let mut n = 0;
        let mut res = Ok(());
        for wr in wrs {
            if wr.flags.contains(SendFlags::INLINE) && wr.total_len() > self.ctx.inner.cfg.max_inline as u64 {
                res = Err(VerbsError::InlineTooLong {
                    len: wr.total_len(),
                    max: self.ctx.inner.cfg.max_inline,
                });
                break;
            }
            if let Err(e) = s.qp.post_send(wr, self.ctx.mrs()) {
                res = Err(e.into());
                break;
            }
            n += 1;
        }
        self.core.transmit_now(&mut s);
        self.settle(&s);
        res.map(|_| n)
    }

    /// Checks a WR against what the application side knows and encodes it.
    fn encode(&self, wr: &SendWr, slots: &mut Vec<sq::Slot>) -> Result<(), VerbsError> {
        crate::work::validate_send(wr).map_err(PostError::Invalid)?;
        match self.mirror.state() {
            QpState::Rts | QpState::Err => {}
            st => return Err(PostError::InvalidState(st).into()),
        }
        let depth = self
            .posted
            .load(Ordering::Relaxed)
            .saturating_sub(self.mirror.retired.load(Ordering::Acquire));
        if depth >= self.max_send_wr as u64 {
            return Err(PostError::QueueFull(self.max_send_wr).into());
        }
        if wr.sg_list.len() > sq::MAX_SGE {
            return Err(VerbsError::Invalid(format!(
                "{} SGEs, at most {} per work request",
                wr.sg_list.len(),
                sq::MAX_SGE
            )));
        }
        if wr.flags.contains(SendFlags::INLINE) {
            let max = self.ctx.inner.cfg.max_inline;
            if wr.total_len() > max as u64 {
                return Err(VerbsError::InlineTooLong {
                    len: wr.total_len(),
                    max,
                });
            }
            // INLINE: the payload is copied now, into the WQE slots
            let mut data = Vec::with_capacity(wr.total_len() as usize);
            for g in &wr.sg_list {
                let (region, off) = self
                    .ctx
                    .mrs()
                    .check(g.lkey, self.pd, g.addr, g.length as u64, Access(0))
                    .map_err(|e| VerbsError::Invalid(format!("INLINE scatter-gather element: {e}")))?;
                region.with_slice(off, g.length as usize, |b| data.extend_from_slice(b));
            }
            sq::encode_send(self.qpn, wr, Some(&data), slots);
        } else {
            sq::encode_send(self.qpn, wr, None, slots);
        }
        Ok(())
    }

    /// Posts a receive work request (`ibv_post_recv`).
    pub fn post_recv(&self, wr: RecvWr) -> Result<(), VerbsError> {
        let mut s = self.slot.lock();
        s.qp.post_recv(wr)?;
        self.settle(&s);
        drop(s);
        // a receive may unblock an RNR'd peer only by its retry; nothing to send now, but the
        // engine must see ERR flushes delivered, which happened above
        Ok(())
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        self.core.qps.write().remove(&self.qpn);
    }
}
