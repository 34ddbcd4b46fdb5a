//! The in-process engine's queue pairs: creation, the RESET/INIT/RTR/RTS/ERR transitions,
//! posting.
//!
//! A QP's transport state belongs to its data core. A handle never touches it: work requests
//! travel to the core through its send queue, and every other operation (state changes,
//! settings, statistics) is a command the core applies in order with them, answering through a
//! channel ([`EngineShared::call`]); what a post must check at once (state, queue depths) it
//! reads from the mirror the core publishes.

use super::qp::{Endpoint, QpInitAttr};
use super::{EngineCtx, VerbsError};
use crate::engine::{sq, Command, CqShared, EngineShared, QpMirror, QpSlot};
use crate::mem::Access;
use crate::transport::rc::validation::Chooser;
use crate::transport::rc::PostError;
use crate::transport::rc::{IcrcMode, QpState, RcConfig, RcQp, RcStats};
use crate::work::{RecvWr, SendFlags, SendWr, Sge};
use std::net::SocketAddrV4;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The in-process engine's side of a [`Qp`].
pub(crate) struct EngineQp {
    ctx: EngineCtx,
    qpn: u32,
    psn: u32,
    /// The data core that owns this QP.
    core: Arc<EngineShared>,
    pd: u32,
    /// State and retired-WQE count as the engine last published them.
    mirror: Arc<QpMirror>,
    /// Send WRs posted so far (with `mirror.retired`, the send queue's depth).
    posted: AtomicU64,
    max_send_wr: u32,
    /// Receive WRs posted so far (with `mirror.recv_retired`, the receive queue's depth).
    posted_recvs: AtomicU64,
    max_recv_wr: u32,
    low_latency: bool,
    /// The ring of a managed QP.
    managed: Option<Arc<crate::chain::ManagedWq>>,
    send_cq_num: u32,
}

impl EngineQp {
    pub(super) fn create(
        ctx: EngineCtx,
        pd: u32,
        (qpn, psn): (u32, u32),
        send_cq: &super::EngineCq,
        recv_cq: Arc<CqShared>,
        attr: QpInitAttr,
    ) -> Result<EngineQp, VerbsError> {
        let cfg = attr.config.unwrap_or(ctx.inner.cfg.qp);
        cfg.validate()
            .map_err(|e| VerbsError::Invalid(format!("qp config field {e}")))?;
        if attr.managed_slots > 1 << 16 || (attr.managed_slots > 0 && attr.low_latency) {
            return Err(VerbsError::Invalid(
                "managed_slots: at most 65536, and a managed QP cannot be low-latency".into(),
            ));
        }
        let core = ctx.inner.engine.core_for(qpn).clone();
        let mut qp = RcQp::new(qpn, pd, cfg);
        qp.set_cc_env(ctx.inner.cc_env.clone());
        let weak = Arc::downgrade(&core);
        let job_done: std::sync::Weak<dyn crate::offload::JobDone> = weak;
        qp.set_offload_sink(ctx.inner.offload.port(job_done));
        qp.modify_to_init()?;
        let mirror = Arc::new(QpMirror::default());
        let managed = (attr.managed_slots > 0).then(|| {
            Arc::new(crate::chain::ManagedWq::new(
                attr.managed_slots,
                ctx.inner
                    .alloc_region(attr.managed_slots * crate::chain::wqe::WQE_BYTES),
            ))
        });
        let chain = managed.as_ref().map(|wq| {
            let c = Arc::downgrade(&core);
            let _ = wq.wake.set(Box::new(move || {
                if let Some(c) = c.upgrade() {
                    c.visit(qpn);
                }
            }));
            core.redn.add_wq(qpn, wq);
            crate::chain::ChainRunner::new(wq.clone(), send_cq.cq_num(), core.now(), &core.guards)
        });
        let send_cq_num = send_cq.cq_num();
        let send_cq = send_cq.shared.clone();
        let qs = QpSlot {
            qp,
            remote: None,
            routes: Vec::new(),
            peer_sources: Vec::new(),
            reply_routes: Vec::new(),
            send_cq,
            recv_cq,
            mirror: mirror.clone(),
            chain,
            recvs_taken: 0,
            export: ctx.inner.same_host.as_ref().map(|h| h.export.clone()),
            same_host: None,
        };
        qs.sync_mirror();
        // from here on the core owns it; the posts that follow queue behind this
        core.command(Command::Add(Box::new(qs)));
        Ok(EngineQp {
            ctx,
            qpn,
            psn,
            pd,
            core,
            mirror,
            posted: AtomicU64::new(0),
            max_send_wr: cfg.max_send_wr,
            posted_recvs: AtomicU64::new(0),
            max_recv_wr: cfg.max_recv_wr,
            low_latency: attr.low_latency,
            managed,
            send_cq_num,
        })
    }

    /// Whether this is a managed QP (RedN).
    pub(crate) fn is_managed(&self) -> bool {
        self.managed.is_some()
    }

    fn ring(&self) -> Result<&Arc<crate::chain::ManagedWq>, VerbsError> {
        self.managed
            .as_ref()
            .ok_or_else(|| VerbsError::Invalid("not a managed QP (QpInitAttr::managed_slots = 0)".into()))
    }

    /// Managed QP: writes `wr` into the ring at the next index with `operand` in the 48-bit
    /// operand field of its word 0 (what a RedN `if` compares); returns the index. Nothing runs
    /// until an ENABLE covers the index.
    pub(crate) fn post_managed(&self, wr: &SendWr, operand: u64) -> Result<u64, VerbsError> {
        let ring = self.ring()?;
        crate::work::validate_send(wr).map_err(PostError::Invalid)?;
        let words = crate::chain::wqe::encode(wr, operand).map_err(PostError::Invalid)?;
        ring.post(&words).map_err(|e| VerbsError::Invalid(e.into()))
    }

    /// Managed QP: the index the next post gets (indices never wrap).
    pub(crate) fn next_index(&self) -> u64 {
        self.managed.as_ref().map_or(0, |r| r.posted.load(Ordering::Acquire))
    }

    /// Managed QP: lets the engine fetch entries with index below `index` (the CPU's doorbell;
    /// an ENABLE work request does the same from a chain).
    pub(crate) fn enable(&self, index: u64) -> Result<(), VerbsError> {
        self.ring()?.enable(index);
        Ok(())
    }

    /// Managed QP: the host address of index `i`'s entry in the ring (see
    /// [`crate::redn::wqe::off`] for its fields).
    pub(crate) fn wqe_addr(&self, i: u64) -> Result<u64, VerbsError> {
        let r = self.ring()?;
        Ok(r.ring.addr() + r.offset(i) as u64)
    }

    /// Managed QP: registers the ring as a memory region in `pd`, so RECV scatter, WRITE, READ
    /// and CAS can change entries before they are fetched.
    pub(crate) fn reg_wq_mr(&self, pd: &super::Pd, access: crate::mem::Access) -> Result<super::Mr, VerbsError> {
        pd.register(self.ring()?.ring.clone(), access)
    }

    /// The number of this QP's send completion queue.
    pub(crate) fn send_cq_num(&self) -> u32 {
        self.send_cq_num
    }

    /// Sends an offload request (see [`crate::offload`]): the peer's handler for `opcode` gets
    /// `request` (at most MTU - 8 bytes) and its response lands in `resp` (at most 1 MiB). It
    /// completes like a READ, with `WcOpcode::Offload` and the response's length in `byte_len`;
    /// a handler failure completes with `RemOpErr` and the
    /// [`crate::offload::OffloadStatus`] in `vendor_err`, leaving the QP usable.
    pub(crate) fn post_offload(&self, wr_id: u64, opcode: u16, request: &[u8], resp: Sge) -> Result<(), VerbsError> {
        if self.managed.is_some() {
            return Err(VerbsError::Invalid(
                "offload requests cannot be posted to a managed QP".into(),
            ));
        }
        let wr = SendWr::new(wr_id, crate::work::WrOpcode::Offload)
            .imm(opcode as u32)
            .sge(resp);
        crate::work::validate_send(&wr).map_err(PostError::Invalid)?;
        match self.mirror.state() {
            QpState::Rts | QpState::Err => {}
            st => return Err(PostError::InvalidState(st).into()),
        }
        // the request is copied into the command (it may be longer than the send queue's
        // inline payload), which its core copies into the work request
        let request = request.to_vec();
        self.core.stats.tx_payload_copy_bytes.add(2 * request.len() as u64);
        let mrs = self.core.mrs.clone();
        let posted = self
            .core
            .call(self.qpn, move |s| s.qp.post_send_with_inline(wr, Some(&request), &*mrs))
            .ok_or(VerbsError::Gone)?;
        posted?;
        self.posted.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Its QP number.
    pub(crate) fn qp_num(&self) -> u32 {
        self.qpn
    }

    /// The QP state (as the engine last published it; no lock taken).
    pub(crate) fn state(&self) -> QpState {
        self.mirror.state()
    }

    /// Runs a congestion-control algorithm of the caller's on this QP from now on (after
    /// connecting): SwCC's programmability for algorithms beyond the built-in five. The peer must
    /// run a matching receiving half, if the algorithm needs one.
    pub(crate) fn install_cc(&self, alg: Box<dyn crate::cc::CcAlgorithm>) {
        self.core.call(self.qpn, move |s| s.qp.install_cc(alg));
    }

    /// Applies `f` to this QP on its data core and returns its answer (the default when the
    /// engine has stopped).
    fn read<R: Default + Send + 'static>(&self, f: impl FnOnce(&mut QpSlot) -> R + Send + 'static) -> R {
        self.core.call(self.qpn, f).unwrap_or_default()
    }

    /// Why congestion control stopped this QP, if it did (HPCC on a path without INT).
    pub(crate) fn cc_fault(&self) -> Option<&'static str> {
        self.read(|s| s.qp.cc_fault())
    }

    /// The congestion-control algorithm and its per-QP context bytes, if one runs.
    pub(crate) fn cc_info(&self) -> Option<(&'static str, usize)> {
        self.read(|s| s.qp.cc_info())
    }

    /// Takes the control-loop delay samples (ns from a CE mark's arrival at the receiver to the
    /// rate change it caused here) collected since the last call.
    pub(crate) fn take_control_loop_samples(&self) -> Vec<u32> {
        self.read(|s| s.qp.take_control_loop_samples())
    }

    /// Its transport counters.
    pub(crate) fn stats(&self) -> RcStats {
        self.read(|s| s.qp.stats())
    }

    /// Bytes of transport state this QP holds.
    pub(crate) fn state_bytes(&self) -> usize {
        self.read(|s| s.qp.state_bytes())
    }

    /// Its transport parameters.
    pub(crate) fn config(&self) -> RcConfig {
        self.read(|s| Some(*s.qp.config())).unwrap_or(self.ctx.inner.cfg.qp)
    }

    /// Uses `n` paths with `policy` (before connecting; `n` at most the context's
    /// `path_ports` times its address pairs). Spraying needs selective repeat.
    pub(crate) fn set_paths(&self, n: usize, policy: crate::path::SprayPolicy) -> Result<(), VerbsError> {
        let params = self.ctx.inner.cfg.paths;
        self.core
            .call(self.qpn, move |s| {
                if s.qp.state() != QpState::Init {
                    return Err(VerbsError::Invalid(
                        "set_paths: the QP must be in INIT (before connect)".into(),
                    ));
                }
                s.qp.set_paths(n, policy, params).map_err(VerbsError::Invalid)
            })
            .ok_or(VerbsError::Gone)?
    }

    /// Per-path counters (RTT, loss, health, probes) of this QP.
    pub(crate) fn path_stats(&self) -> Vec<crate::path::PathStats> {
        self.read(|s| s.qp.path_stats())
    }

    /// This QP's half of a connection exchange.
    pub(crate) fn local_endpoint(&self) -> Endpoint {
        let (cfg, paths, spray) = self
            .core
            .call(self.qpn, |s| {
                (*s.qp.config(), s.qp.paths().len() as u8, s.qp.paths().policy())
            })
            .unwrap_or((self.ctx.inner.cfg.qp, 1, Default::default()));
        let ports = self.core.path_ports;
        let link = &self.core.link;
        let addrs = (0..link.ports()).map(|p| link.local_addr(p));
        Endpoint {
            qpn: self.qpn,
            psn: self.psn,
            addr: self.core.local_addr(),
            mtu: cfg.mtu,
            recovery: cfg.recovery,
            cc: cfg.cc,
            paths,
            spray,
            extra_addrs: addrs.clone().step_by(ports).skip(1).collect(),
            sources: addrs.skip(1).collect(),
            same_host: self.ctx.inner.same_host.as_ref().map(|h| h.export.desc()),
            icrc: icrc_offer(cfg.icrc, self.ctx.inner.cfg.udp_checksum),
        }
    }

    /// The ICRC mode the connection runs (`icrc` until it is connected).
    pub(crate) fn icrc_mode(&self) -> crate::transport::rc::IcrcMode {
        self.read(|s| Some(s.icrc_mode())).unwrap_or_default()
    }

    /// Local addresses this QP's data core has sockets on.
    fn local_addrs(&self) -> usize {
        self.core.link.ports() / self.core.path_ports
    }

    /// The routes of `n` paths towards `remote`: path `k` uses address pair `k % pairs` and
    /// that address's source port `k / pairs`.
    fn routes(&self, n: usize, remote: &Endpoint) -> Result<Vec<(usize, SocketAddrV4)>, VerbsError> {
        let ports = self.core.path_ports;
        let pairs = self.local_addrs().min(1 + remote.extra_addrs.len());
        (0..n)
            .map(|k| {
                let (pair, port) = (k % pairs, k / pairs);
                if port >= ports {
                    return Err(VerbsError::Invalid(format!(
                        "paths: {n} paths over {pairs} address pair(s) need {} source ports per address; \
                         the context has path_ports = {ports}",
                        n.div_ceil(pairs)
                    )));
                }
                let dst = if pair == 0 {
                    remote.addr
                } else {
                    remote.extra_addrs[pair - 1]
                };
                Ok((pair * ports + port, dst))
            })
            .collect()
    }

    /// INIT -> RTR towards `remote`: the path MTU is the smaller of both; the loss-recovery
    /// modes must match. Congestion control is negotiated: a QP without one adopts the peer's
    /// (so the receiver's half of the algorithm, CNPs, grants or the INT echo, runs on the other
    /// end); two different algorithms are refused.
    pub(crate) fn modify_to_rtr(&self, remote: &Endpoint) -> Result<(), VerbsError> {
        self.rtr_as(remote, Chooser::Local)
    }

    /// [`EngineQp::modify_to_rtr`] for `remote` as a peer's connection request named it: its
    /// addresses are the peer's word, so the QP challenges them once unpaid and then only as
    /// what the peer sends pays for ([`crate::transport::rc::validation::Chooser::Remote`]).
    pub(crate) fn accept_rtr(&self, remote: &Endpoint) -> Result<(), VerbsError> {
        self.rtr_as(remote, Chooser::Remote)
    }

    fn rtr_as(&self, remote: &Endpoint, chooser: Chooser) -> Result<(), VerbsError> {
        if remote.addr.ip().is_unspecified() || remote.addr.port() == 0 {
            return Err(VerbsError::Invalid(format!(
                "remote address {} is not routable",
                remote.addr
            )));
        }
        // packets leave with don't-fragment set: an MTU the route cannot carry would lose
        // every full-size packet (a 4096-byte RoCE MTU needs jumbo frames)
        let route_mtu = self
            .core
            .link
            .route_mtu(remote.addr)
            .map(crate::wire::packet::largest_mtu_within);
        // the routes of as many paths as this context has sockets for
        let capacity = self.core.path_ports * self.local_addrs().min(1 + remote.extra_addrs.len());
        let routes = self.routes(capacity, remote)?;
        // one challenge nonce per peer address the routes reach (QpSlot::peer_addrs)
        let mut dsts = vec![remote.addr];
        for r in &routes {
            if !dsts.contains(&r.1) {
                dsts.push(r.1);
            }
        }
        let nonces = self.ctx.inner.draw_nonces(dsts.len());
        let params = self.ctx.inner.cfg.paths;
        let udp_checksum = self.ctx.inner.cfg.udp_checksum;
        let remote = remote.clone();
        let qpn = self.qpn;
        // a same-host peer's export, mapped (any failure leaves the QP on packets)
        let peer = match (&self.ctx.inner.same_host, remote.same_host) {
            (Some(h), Some(d)) if self.managed.is_none() => match h.attach(d) {
                Ok(p) => Some((p, remote.qpn)),
                Err(e) => {
                    tracing::debug!("qp {qpn:#x}: peer's same-host export not usable ({e}); packets only");
                    None
                }
            },
            _ => None,
        };
        self.core
            .call(self.qpn, move |s| {
                rtr(
                    s,
                    qpn,
                    &remote,
                    (route_mtu, params, udp_checksum),
                    routes,
                    (&nonces, chooser),
                )?;
                // whom this QP is connected to, for same-host peers' checks: only once the
                // connection is made (a refused one changes nothing), and before the core
                // publishes the new state (`sync_mirror`, after this closure, Release)
                if let Some(x) = &s.export {
                    x.set_qp_peer(qpn, remote.qpn, remote.same_host.map_or(0, |d| d.nonce));
                }
                s.same_host = peer;
                Ok(())
            })
            .ok_or(VerbsError::Gone)?
    }

    /// RTR -> RTS.
    pub(crate) fn modify_to_rts(&self) -> Result<(), VerbsError> {
        let psn = self.psn;
        self.core
            .call(self.qpn, move |s| s.qp.modify_to_rts(psn))
            .ok_or(VerbsError::Gone)??;
        Ok(())
    }

    /// RTR -> RTS sending from `sq_psn` (24 bits) instead of the PSN drawn at creation: for a
    /// caller that chose its own and told the peer (`ibv_modify_qp`'s `IBV_QP_SQ_PSN`).
    pub(crate) fn modify_to_rts_at(&self, sq_psn: u32) -> Result<(), VerbsError> {
        if sq_psn > crate::wire::MASK24 {
            return Err(VerbsError::Invalid(format!(
                "sq_psn: {sq_psn:#x} is wider than 24 bits"
            )));
        }
        self.core
            .call(self.qpn, move |s| s.qp.modify_to_rts(sq_psn))
            .ok_or(VerbsError::Gone)??;
        Ok(())
    }

    /// -> ERR: outstanding work requests complete with WR_FLUSH_ERR.
    pub(crate) fn modify_to_err(&self) {
        self.core.call(self.qpn, |s| s.qp.modify_to_err());
    }

    /// INIT -> RTR -> RTS in one call.
    pub(crate) fn connect(&self, remote: &Endpoint) -> Result<(), VerbsError> {
        self.modify_to_rtr(remote)?;
        self.modify_to_rts()
    }

    /// Limits the QP's sending rate (bytes per second, with a burst) or lifts the limit with
    /// `None`; like `ibv_modify_qp_rate_limit`. Congestion control drives the same hook.
    pub(crate) fn set_rate_limit(&self, bytes_per_sec: Option<u64>, burst_bytes: u64) {
        self.core
            .call(self.qpn, move |s| s.qp.set_rate(bytes_per_sec, burst_bytes));
    }

    /// Limits the payload bytes in flight, or lifts the limit with `None`.
    pub(crate) fn set_window_limit(&self, bytes: Option<u64>) {
        self.core.call(self.qpn, move |s| s.qp.set_window_bytes(bytes));
    }

    /// Posts several send work requests; stops at the first refused one and returns how many
    /// were posted before it in the error's absence.
    pub(crate) fn post_send_batch(&self, wrs: impl IntoIterator<Item = SendWr>) -> Result<usize, VerbsError> {
        if self.managed.is_some() {
            let mut n = 0;
            for wr in wrs {
                self.post_managed(&wr, 0)?;
                n += 1;
            }
            return Ok(n);
        }
        let mut slots = sq::Slots::new();
        let mut n = 0;
        let mut q = self.core.sq.lock();
        let mut res = Ok(());
        for wr in wrs {
            if let Err(e) = self.encode(&wr, &mut slots).and_then(|()| push_waiting(&mut q, &slots)) {
                res = Err(e);
                break;
            }
            self.posted.fetch_add(1, Ordering::Relaxed);
            n += 1;
        }
        drop(q);
        self.kick();
        res.map(|_| n)
    }

    /// After a post: run to completion, the context's cores run once from this thread (so the
    /// work request leaves in this call); a low-latency QP's poster runs its core when no other
    /// thread does; otherwise the core is woken if it sleeps. Never called with the send
    /// queue's lock held.
    fn kick(&self) {
        let ran = self.run_to_completion() || (self.low_latency && self.core.run_here());
        if !ran {
            self.core.sq.lock().notify();
        }
    }

    /// Run to completion: wakes the context's backstop threads if they sleep and runs its
    /// cores once from this thread. Returns false (doing nothing) for a context whose cores
    /// have threads of their own.
    fn run_to_completion(&self) -> bool {
        let Some(d) = self.ctx.inner.engine.drive() else {
            return false;
        };
        self.core.sq.lock().notify();
        d.progress();
        true
    }

    /// Checks a WR against what the application side knows: its form, the QP's state and the
    /// room left in the send queue (called with the send queue's lock held).
    fn check_post(&self, wr: &SendWr) -> Result<(), VerbsError> {
        crate::work::validate_send(wr).map_err(PostError::Invalid)?;
        match self.mirror.state() {
            QpState::Rts | QpState::Err => {}
            st => return Err(PostError::InvalidState(st).into()),
        }
        check_room(&self.posted, &self.mirror.retired, self.max_send_wr, wr.sg_list.len())
    }

    /// Checks a WR ([`EngineQp::check_post`]) and encodes it.
    fn encode(&self, wr: &SendWr, slots: &mut sq::Slots) -> Result<(), VerbsError> {
        self.check_post(wr)?;
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
                region.append_to(off, g.length as usize, &mut data);
            }
            sq::encode_send(self.qpn, wr, Some(&data), slots);
            // out of the region, into the slots
            self.core.stats.tx_payload_copy_bytes.add(2 * data.len() as u64);
        } else {
            sq::encode_send(self.qpn, wr, None, slots);
        }
        Ok(())
    }

    /// Posts a send whose INLINE payload the caller has gathered itself (`ibv_post_send` with
    /// `IBV_SEND_INLINE`, which reads the SGEs' bytes at post time without checking their
    /// lkeys): `data` is the payload, `wr`'s scatter list only its description.
    pub(crate) fn post_send_inline(&self, wr: SendWr, data: &[u8]) -> Result<(), VerbsError> {
        let max = self.ctx.inner.cfg.max_inline;
        if data.len() as u64 != wr.total_len() {
            return Err(VerbsError::Invalid(format!(
                "INLINE payload of {} bytes where the scatter list describes {}",
                data.len(),
                wr.total_len()
            )));
        }
        if data.len() as u64 > max as u64 {
            return Err(VerbsError::InlineTooLong {
                len: data.len() as u64,
                max,
            });
        }
        if self.managed.is_some() {
            return Err(VerbsError::Invalid(
                "INLINE bytes cannot be posted to a managed QP".into(),
            ));
        }
        let mut slots = sq::Slots::new();
        let mut q = self.core.sq.lock();
        self.check_post(&wr)?;
        sq::encode_send(self.qpn, &wr, Some(data), &mut slots);
        self.core.stats.tx_payload_copy_bytes.add(data.len() as u64);
        push_waiting(&mut q, &slots)?;
        self.posted.fetch_add(1, Ordering::Relaxed);
        drop(q);
        self.kick();
        Ok(())
    }

    /// Destroys the QP and returns once its core has removed it (dropping it only queues the
    /// removal): from then on the engine neither delivers to its receive buffers nor reads its
    /// send requests' memory on its behalf, except packets already built, which hold their
    /// region (`Arc`) until sent.
    pub(crate) fn destroy(self) {
        let core = self.core.clone();
        drop(self);
        // a command queued behind the removal on the same core: answered after it
        let _ = core.call_each(|_| ());
    }

    /// Posts a receive work request (`ibv_post_recv`): checked against the QP's state and
    /// receive queue depth as its core last published them, then queued for the core behind
    /// the QP's earlier posts.
    pub(crate) fn post_recv(&self, wr: RecvWr) -> Result<(), VerbsError> {
        let mut slots = sq::Slots::new();
        self.encode_recv(&wr, &mut slots)?;
        push_waiting(&mut self.core.sq.lock(), &slots)?;
        self.posted_recvs.fetch_add(1, Ordering::Relaxed);
        // a receive has nothing to send: a sleeping core is not woken for it, since it takes
        // the send queue before the packets whose arrival wakes it (a wake-up per receive
        // cost the ping-pong a context switch); only a QP in ERR owes a flush completion now.
        // Run to completion, no pass runs here either: the application's next post, poll or
        // wait runs one, which takes the receive first (and a pass here would send the ACKs
        // waiting for that post alone, a system call more per round trip)
        if self.mirror.state() == QpState::Err {
            self.core.sq.lock().notify();
        }
        Ok(())
    }

    fn encode_recv(&self, wr: &RecvWr, slots: &mut sq::Slots) -> Result<(), VerbsError> {
        if self.mirror.state() == QpState::Reset {
            return Err(PostError::InvalidState(QpState::Reset).into());
        }
        check_room(
            &self.posted_recvs,
            &self.mirror.recv_retired,
            self.max_recv_wr,
            wr.sg_list.len(),
        )?;
        sq::encode_recv(self.qpn, wr, slots);
        Ok(())
    }
}

/// Writes one request's slots into a core's send queue, waiting briefly for room (the core
/// drains it continuously).
fn push_waiting(q: &mut crate::pipe::Producer<sq::Slot>, slots: &[sq::Slot]) -> Result<(), VerbsError> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(100);
    while !sq::push_all(q, slots) {
        q.notify();
        if std::time::Instant::now() > deadline {
            return Err(PostError::QueueFull(sq::MAX_SLOTS as u32).into());
        }
        std::thread::yield_now();
    }
    Ok(())
}

/// Refuses a post to a queue that holds `max` work requests already (`posted` so far, of which
/// the core `retired` some), or one with more SGEs than a send-queue slot run carries.
fn check_room(posted: &AtomicU64, retired: &AtomicU64, max: u32, sges: usize) -> Result<(), VerbsError> {
    let depth = posted
        .load(Ordering::Relaxed)
        .saturating_sub(retired.load(Ordering::Acquire));
    if depth >= max as u64 {
        return Err(PostError::QueueFull(max).into());
    }
    if sges > sq::MAX_SGE {
        return Err(VerbsError::Invalid(format!(
            "{sges} SGEs, at most {} per work request",
            sq::MAX_SGE
        )));
    }
    Ok(())
}

/// INIT -> RTR on the core (see [`EngineQp::modify_to_rtr`]): `route_mtu` is the largest RoCE MTU
/// the route to the peer carries, `routes` those of as many paths as the context can use.
fn rtr(
    s: &mut QpSlot,
    qpn: u32,
    remote: &Endpoint,
    (route_mtu, params, udp_checksum): (Option<u32>, crate::path::PathParams, bool),
    routes: Vec<(usize, SocketAddrV4)>,
    (nonces, chooser): (&[u64], Chooser),
) -> Result<(), VerbsError> {
    let mut cfg = *s.qp.config();
    if cfg.recovery != remote.recovery {
        return Err(VerbsError::Peer(format!(
            "uses {:?} loss recovery, this QP {:?}",
            remote.recovery, cfg.recovery
        )));
    }
    cfg.mtu = cfg.mtu.min(remote.mtu);
    if let Some(fits) = route_mtu.filter(|&f| f < cfg.mtu) {
        tracing::info!(
            "qp {qpn:#x}: MTU {} -> {fits}: the route to {} cannot carry it",
            cfg.mtu,
            remote.addr
        );
        cfg.mtu = fits;
    }
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
    // no ICRC only when both ends offer none, each only when it sends UDP checksums: then the
    // UDP checksum covers every packet either way; any other pair runs the ICRC both ways
    cfg.icrc = match (icrc_offer(cfg.icrc, udp_checksum), remote.icrc) {
        (IcrcMode::None, IcrcMode::None) => IcrcMode::None,
        _ => IcrcMode::Icrc,
    };
    cfg.validate()
        .map_err(|e| VerbsError::Peer(format!("offers an invalid {e}")))?;
    if s.qp.paths().len() == 1 && remote.paths > 1 {
        // adopt the peer's paths (as many as this context has sockets for; responses on a
        // path beyond them take path 0), so responses can follow the path of their request
        s.qp.set_paths((remote.paths as usize).min(routes.len()), remote.spray, params)
            .map_err(|e| VerbsError::Peer(format!("sprays: {e}")))?;
    }
    let n = s.qp.paths().len();
    if n > routes.len() {
        return Err(VerbsError::Invalid(format!(
            "paths: {n} paths need more source ports than the context has ({} over these address \
             pairs; raise path_ports)",
            routes.len()
        )));
    }
    // every route is kept: path k starts on route k, and one that looks cut moves to a spare
    s.qp.set_source_ports(routes.len());
    s.qp.modify_to_rtr(remote.qpn, remote.psn, cfg)?;
    s.remote = Some(remote.addr);
    s.routes = routes;
    s.peer_sources = remote.sources.iter().chain(&remote.extra_addrs).copied().collect();
    s.reply_routes.clear();
    // whoever named these addresses, the peer proves it receives there before it is served
    // more than three times what it sent
    // (one random nonce per peer address, drawn by the context: QpSlot::peer_addrs' order)
    s.qp.require_validation(nonces, chooser);
    Ok(())
}

/// The ICRC mode a QP configured with `mode` offers: `none` only if its context sends UDP
/// checksums, which must protect the bytes in the ICRC's place.
fn icrc_offer(mode: IcrcMode, udp_checksum: bool) -> IcrcMode {
    if udp_checksum {
        mode
    } else {
        IcrcMode::Icrc
    }
}

impl Drop for EngineQp {
    fn drop(&mut self) {
        // gone for same-host peers now, as a destroyed QP is for a NIC (`QpSlot::sync_mirror`)
        self.mirror.dropped.store(true, Ordering::SeqCst);
        if let Some(h) = &self.ctx.inner.same_host {
            h.export.set_qp(self.qpn, self.pd, 0, true);
        }
        self.core.command(Command::Remove(self.qpn));
        // queued behind the removal on the same core: a QP that draws this number again is
        // added after the old one is gone
        self.ctx.inner.release_qpn(self.qpn);
    }
}
