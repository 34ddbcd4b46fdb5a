//! Queue pairs: creation, the RESET/INIT/RTR/RTS/ERR transitions, posting.

use super::{Context, VerbsError};
use crate::engine::{CqShared, EngineShared, QpSlot};
use crate::transport::rc::{QpState, RcConfig, RcQp, RcStats, Recovery};
use crate::work::{RecvWr, SendFlags, SendWr};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::net::SocketAddrV4;
use std::sync::Arc;

/// Creation attributes of a QP.
#[derive(Debug, Clone, Copy, Default)]
pub struct QpInitAttr {
    /// Transport parameters; `None` takes the context's defaults.
    pub config: Option<RcConfig>,
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
}

/// An RC queue pair. Destroyed (removed from the engine) on drop.
pub struct Qp {
    ctx: Context,
    qpn: u32,
    psn: u32,
    slot: Arc<Mutex<QpSlot>>,
    /// The data core that owns this QP.
    core: Arc<EngineShared>,
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
        qp.modify_to_init()?;
        let slot = Arc::new(Mutex::new(QpSlot {
            qp,
            remote: None,
            send_cq,
            recv_cq,
        }));
        let core = ctx.inner.engine.core_for(qpn).clone();
        core.qps.write().insert(qpn, slot.clone());
        // a random-ish initial PSN, as NICs pick one
        let psn = (qpn.wrapping_mul(0x9E37_79B9) ^ std::process::id()) & crate::wire::MASK24;
        Ok(Qp {
            ctx,
            qpn,
            psn,
            slot,
            core,
        })
    }

    pub fn qp_num(&self) -> u32 {
        self.qpn
    }

    pub fn state(&self) -> QpState {
        self.slot.lock().qp.state()
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
        }
    }

    /// INIT -> RTR towards `remote`: the path MTU is the smaller of both; the loss-recovery
    /// modes must match.
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
        cfg.validate()
            .map_err(|e| VerbsError::Peer(format!("offers an invalid {e}")))?;
        s.qp.modify_to_rtr(remote.qpn, remote.psn, cfg)?;
        s.remote = Some(remote.addr);
        Ok(())
    }

    /// RTR -> RTS.
    pub fn modify_to_rts(&self) -> Result<(), VerbsError> {
        self.slot.lock().qp.modify_to_rts(self.psn)?;
        Ok(())
    }

    /// -> ERR: outstanding work requests complete with WR_FLUSH_ERR.
    pub fn modify_to_err(&self) {
        let mut s = self.slot.lock();
        s.qp.modify_to_err();
        s.deliver_completions();
    }

    /// INIT -> RTR -> RTS in one call.
    pub fn connect(&self, remote: &Endpoint) -> Result<(), VerbsError> {
        self.modify_to_rtr(remote)?;
        self.modify_to_rts()
    }

    /// Posts a send work request (`ibv_post_send`).
    pub fn post_send(&self, wr: SendWr) -> Result<(), VerbsError> {
        if wr.flags.contains(SendFlags::INLINE) && wr.total_len() > self.ctx.inner.cfg.max_inline as u64 {
            return Err(VerbsError::InlineTooLong {
                len: wr.total_len(),
                max: self.ctx.inner.cfg.max_inline,
            });
        }
        {
            let mut s = self.slot.lock();
            s.qp.post_send(wr, self.ctx.mrs())?;
            s.deliver_completions();
        }
        self.core.kick(self.qpn);
        Ok(())
    }

    /// Posts several send work requests; stops at the first refused one.
    pub fn post_send_batch(&self, wrs: impl IntoIterator<Item = SendWr>) -> Result<usize, VerbsError> {
        let mut n = 0;
        {
            let mut s = self.slot.lock();
            for wr in wrs {
                if wr.flags.contains(SendFlags::INLINE) && wr.total_len() > self.ctx.inner.cfg.max_inline as u64 {
                    return Err(VerbsError::InlineTooLong {
                        len: wr.total_len(),
                        max: self.ctx.inner.cfg.max_inline,
                    });
                }
                s.qp.post_send(wr, self.ctx.mrs())?;
                n += 1;
            }
            s.deliver_completions();
        }
        self.core.kick(self.qpn);
        Ok(n)
    }

    /// Posts a receive work request (`ibv_post_recv`).
    pub fn post_recv(&self, wr: RecvWr) -> Result<(), VerbsError> {
        let mut s = self.slot.lock();
        s.qp.post_recv(wr)?;
        s.deliver_completions();
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
