//! The flexns transport: one-sided RDMA WRITE and READ on RC queue pairs of the flexns stack.
//!
//! Per peer, `qps_per_peer` QPs connected through the peer's connection manager (each QP may
//! spray its packets over `paths` paths). Slices go round-robin to QPs with room (at most
//! `slices_in_flight` each); a WRITE completes when the peer acknowledged it, which the
//! responder does after placing the data, so Completed means visible at the target. A slice
//! whose QP failed (retry budget spent: peer down, every path dead) is retried on another QP
//! of the peer, reconnecting when none is left; the error that ends a request names the peer,
//! the QP, its paths and the cause. Notifications travel as a SEND on the peer's first live QP
//! after the batch's data completed (an 8-byte id, then the encoded notification); the receiver
//! keeps receive buffers posted on accepted QPs and answers each with a SEND (the id, a status
//! byte, an error message): queued, or refused (malformed, or the sender's share of its
//! notification queue is full). The sender's notification completes with that answer, so a
//! refused one fails its batch with the cause. A QP has at most `NOTIFY_WINDOW` notifications
//! unanswered (the rest wait, in order), fewer than the receive buffers on either side, so
//! neither side ever runs out of posted receives (no RNR stall of the QP's data).

use super::{Notifies, Slice};
use crate::batch::{Batch, Opcode};
use crate::TransferError;
use netstack::cm;
use netstack::path::SprayPolicy;
use netstack::verbs::*;
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Receive buffers kept posted per accepted QP (notifications).
const RECV_SLOTS: usize = 16;
const RECV_SLOT_BYTES: usize = 4096;
/// Receive buffers kept posted per initiator QP (answers to its notifications).
const REPLY_SLOTS: usize = 8;
const REPLY_SLOT_BYTES: usize = 1024;
/// Notifications unanswered per QP, at most: within both sides' receive buffers.
const NOTIFY_WINDOW: usize = REPLY_SLOTS;
/// The work request id of a probe of an accepted QP (`next_wr` never reaches it).
const PROBE_WR: u64 = u64::MAX;
/// Bytes before a notification (its id) and before an answer's message (id, status).
const NOTIFY_HDR: usize = 8;
const REPLY_HDR: usize = 9;

/// Settings of the transport (from the engine's configuration).
#[derive(Debug, Clone)]
pub(crate) struct FlexCfg {
    pub name: String,
    pub instance: u64,
    pub qps_per_peer: usize,
    pub paths: usize,
    pub spray: SprayPolicy,
    pub in_flight: usize,
    pub attempts: u32,
    /// The connection manager reaps an accepted QP that received nothing this long; the
    /// engine probes accepted QPs quiet for half of it (see [`FlexnsPath::watch_accepted`]).
    pub unused_qp_timeout: Duration,
}

struct Lane {
    qp: Qp,
    inflight: AtomicUsize,
    dead: AtomicBool,
    /// Receive buffers for the answers to this QP's notifications (`REPLY_SLOTS` slots).
    replies: Mr,
    /// Notifications sent on this QP and not yet answered, and those waiting for room.
    notify: Mutex<NotifyWindow>,
}

#[derive(Default)]
struct NotifyWindow {
    unanswered: usize,
    waiting: VecDeque<(u64, Vec<u8>, Waiter)>,
}

/// Who hears how a notification ended: its batch, or the caller of `notify`.
struct Waiter {
    /// The peer, for messages.
    who: String,
    batch: Option<Arc<Batch>>,
    done: Option<std::sync::mpsc::Sender<Result<(), String>>>,
}

impl Waiter {
    fn finish(self, r: Result<(), String>) {
        if let Some(b) = self.batch {
            b.notify_done(r.clone());
        }
        if let Some(d) = self.done {
            let _ = d.send(r);
        }
    }
}

impl Lane {
    fn paths_summary(&self) -> String {
        let st = self.qp.path_stats();
        if st.len() <= 1 {
            return "1 path".into();
        }
        let up: Vec<String> = st
            .iter()
            .enumerate()
            .map(|(i, p)| format!("{i}:{}", if p.up { "up" } else { "down" }))
            .collect();
        format!("paths {}", up.join(" "))
    }
}

struct FlexPeer {
    name: String,
    rpc: SocketAddr,
    instance: u64,
    lanes: Vec<Arc<Lane>>,
    rr: AtomicUsize,
    /// The last failure of one of its QPs (for the message when all have failed).
    last_error: Mutex<Option<String>>,
}

impl FlexPeer {
    fn who(&self) -> String {
        format!("peer {} ({} over flexns)", self.name, self.rpc)
    }
}

enum Outstanding {
    Slice {
        peer: Arc<FlexPeer>,
        lane: Arc<Lane>,
        slice: Slice,
    },
    /// A notification's SEND; its waiter is in `awaiting` under `id` until it is answered.
    Notify {
        /// The peer, for messages.
        who: String,
        lane: Arc<Lane>,
        id: u64,
        _mr: Mr,
    },
    /// This engine's answer to a peer's notification.
    Reply { _mr: Mr },
}

/// Work requests planned for one QP.
struct Planned {
    peer: Arc<FlexPeer>,
    lane: Arc<Lane>,
    wrs: Vec<SendWr>,
}

struct AcceptedQp {
    qp: Qp,
    mr: Mr,
    /// The name of the engine that connected it: its notifications are bounded under it.
    from: String,
    /// Packets the QP had received when last looked at, and since when that count stands.
    rx: u64,
    quiet_since: Instant,
}

/// A QP handed to the connection manager and not yet connected: its receive buffers and the
/// connecting engine's name, until the CM hands the QP back ([`FlexAcceptor::connected`]).
struct Pending {
    mr: Mr,
    from: String,
    at: Instant,
    /// The CM accepts and connects a QP on one thread, one request after another: a pending
    /// entry the same thread left behind is a QP whose connect failed.
    thread: std::thread::ThreadId,
}

/// A pending QP older than this is one the connection manager could not connect.
const PENDING_TTL: Duration = Duration::from_secs(2);

/// The flexns transport of one engine.
pub(crate) struct FlexnsPath {
    ctx: Context,
    pd: Pd,
    /// Send completions of this engine's initiator QPs.
    cq: Cq,
    /// Completions of accepted QPs (notifications received).
    rcq: Cq,
    cfg: FlexCfg,
    notifies: Arc<Notifies>,
    peers: Mutex<HashMap<String, Arc<FlexPeer>>>,
    outstanding: Mutex<HashMap<u64, Outstanding>>,
    next_wr: AtomicU64,
    pending: Mutex<VecDeque<(String, Slice)>>,
    accepted: Mutex<HashMap<u32, AcceptedQp>>,
    /// Receive buffers (and the connecting engine's name) of QPs being connected, until the
    /// connection manager hands them back.
    accepting: Mutex<HashMap<u32, Pending>>,
    /// This engine's QPs to peers by QP number (their answers to notifications arrive on them).
    initiators: Mutex<HashMap<u32, std::sync::Weak<Lane>>>,
    /// Notifications sent and not yet answered, by id, with their QP.
    awaiting: Mutex<HashMap<u64, (Arc<Lane>, Waiter)>>,
    progress_lock: Mutex<()>,
    /// Callers polling completions themselves (small synchronous transfers): while any is,
    /// the completion thread stays off the CQ, so the data core does not wake it per completion.
    spinners: AtomicUsize,
    /// Wakes the completion thread when work is posted and nobody polls.
    idle: Mutex<()>,
    idle_cv: parking_lot::Condvar,
    rt: tokio::runtime::Handle,
    stop: AtomicBool,
}

fn status_text(s: WcStatus) -> &'static str {
    match s {
        WcStatus::RetryExcErr => "no acknowledgement within the retry budget (peer down or every path dead)",
        WcStatus::RnrRetryExcErr => "receiver not ready: no receive buffer posted",
        WcStatus::RemAccessErr => {
            "remote access error: the range is not in a buffer the peer registered for remote access"
        }
        WcStatus::RemInvReqErr => "remote invalid request",
        WcStatus::RemOpErr => "remote operational error",
        WcStatus::WrFlushErr => "flushed: the queue pair had already failed",
        WcStatus::LocProtErr => "local protection error: the local buffer is not registered (unregistered?)",
        WcStatus::LocLenErr => "local length error",
        WcStatus::LocQpOpErr => "local queue pair error",
        _ => "error",
    }
}

/// Errors a retry on another queue pair can fix.
fn retryable(s: WcStatus) -> bool {
    matches!(
        s,
        WcStatus::RetryExcErr | WcStatus::RnrRetryExcErr | WcStatus::WrFlushErr | WcStatus::LocQpOpErr
    )
}

impl FlexnsPath {
    pub(crate) fn new(
        ctx: Context,
        cfg: FlexCfg,
        notifies: Arc<Notifies>,
        rt: tokio::runtime::Handle,
    ) -> Result<Arc<FlexnsPath>, TransferError> {
        let pd = ctx.alloc_pd();
        let cq = ctx.create_cq(65536)?;
        let rcq = ctx.create_cq(4096)?;
        Ok(Arc::new(FlexnsPath {
            ctx,
            pd,
            cq,
            rcq,
            cfg,
            notifies,
            peers: Mutex::new(HashMap::new()),
            outstanding: Mutex::new(HashMap::new()),
            next_wr: AtomicU64::new(1),
            pending: Mutex::new(VecDeque::new()),
            accepted: Mutex::new(HashMap::new()),
            accepting: Mutex::new(HashMap::new()),
            initiators: Mutex::new(HashMap::new()),
            awaiting: Mutex::new(HashMap::new()),
            progress_lock: Mutex::new(()),
            spinners: AtomicUsize::new(0),
            idle: Mutex::new(()),
            idle_cv: parking_lot::Condvar::new(),
            rt,
            stop: AtomicBool::new(false),
        }))
    }

    pub(crate) fn pd(&self) -> &Pd {
        &self.pd
    }

    /// Starts the completion thread (slices, retries) and the notification receiver.
    pub(crate) fn start_threads(self: &Arc<Self>) -> std::io::Result<()> {
        let me = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("kvc-progress".into())
            .spawn(move || loop {
                let Some(p) = me.upgrade() else { return };
                if p.stop.load(Ordering::Relaxed) {
                    return;
                }
                let quiet = p.spinners.load(Ordering::Acquire) > 0
                    || (p.outstanding.lock().is_empty() && p.pending.lock().is_empty());
                if quiet {
                    let mut g = p.idle.lock();
                    p.idle_cv.wait_for(&mut g, Duration::from_millis(10));
                    continue;
                }
                p.cq.wait(Duration::from_millis(5));
                p.progress();
            })?;
        let me = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("kvc-notify-rx".into())
            .spawn(move || loop {
                let Some(p) = me.upgrade() else { return };
                if p.stop.load(Ordering::Relaxed) {
                    return;
                }
                if p.rcq.wait(Duration::from_millis(20)) {
                    p.receive_notifies();
                }
            })?;
        let me = Arc::downgrade(self);
        let every = self.cfg.unused_qp_timeout / 2;
        std::thread::Builder::new()
            .name("kvc-qp-watch".into())
            .spawn(move || loop {
                std::thread::sleep((every / 4).max(Duration::from_millis(10)));
                let Some(p) = me.upgrade() else { return };
                if p.stop.load(Ordering::Relaxed) {
                    return;
                }
                p.watch_accepted(every);
            })?;
        Ok(())
    }

    /// Looks after the QPs peers connected: drops failed ones (a peer that left fails the
    /// probe) with their receive buffers, probes those that received nothing for `every` with
    /// a zero-length WRITE (it needs no receive and names no memory, IBA 9.7.4.1.5), and frees
    /// the buffers of QPs the connection manager never connected. A live peer's QP acknowledges
    /// the probe however idle the peer is, so the connection manager never reaps it as unused;
    /// a phantom's endpoint never answers and the CM reaps its QP at the timeout.
    fn watch_accepted(&self, every: Duration) {
        self.accepting.lock().retain(|_, p| p.at.elapsed() < PENDING_TTL);
        let held = {
            let mut acc = self.accepted.lock();
            acc.retain(|&qpn, a| {
                if a.qp.state() == QpState::Err {
                    tracing::debug!("qp {qpn:#x} from {} failed; dropping it", a.from);
                    return false;
                }
                let rx = a.qp.stats().rx_packets;
                if rx != a.rx {
                    a.rx = rx;
                    a.quiet_since = Instant::now();
                } else if a.quiet_since.elapsed() >= every {
                    a.quiet_since = Instant::now();
                    // unsignaled: a success completes nothing; a failure is a completion
                    // `complete` ignores (no work request has this id) and fails the QP
                    let probe = SendWr::new(PROBE_WR, WrOpcode::RdmaWrite).flags(SendFlags(0));
                    if let Err(e) = a.qp.post_send(probe) {
                        tracing::debug!("probing qp {qpn:#x} from {}: {e}", a.from);
                    }
                }
                true
            });
            acc.len()
        };
        metrics::gauge!("flexns_kvcache_accepted_qps").set(held as f64);
        // a failed probe's completion waits on the send CQ, which nobody polls while idle
        if self.spinners.load(Ordering::Acquire) == 0 {
            self.progress();
        }
    }

    /// A caller starts polling completions itself (see `spinners`).
    pub(crate) fn spin_begin(&self) {
        self.spinners.fetch_add(1, Ordering::AcqRel);
    }

    /// Blocks until a completion is queued or `timeout` passes (a caller that polls itself).
    pub(crate) fn wait_cq(&self, timeout: Duration) {
        self.cq.wait(timeout);
    }

    /// The caller stops polling; the completion thread takes over what is left.
    pub(crate) fn spin_end(&self) {
        if self.spinners.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.idle_cv.notify_one();
        }
    }

    /// The context's counters (see `TransferEngine::stack_stats`).
    pub(crate) fn stack_stats(&self) -> netstack::verbs::StatsSnapshot {
        self.ctx.stats()
    }

    pub(crate) fn shutdown(&self) {
        self.stop.store(true, Ordering::Relaxed);
        self.peers.lock().clear();
        self.accepted.lock().clear();
    }

    fn new_qp(&self, recovery: Recovery) -> Result<Qp, TransferError> {
        let mut c = self.ctx.config().qp;
        c.recovery = recovery;
        let attr = QpInitAttr {
            config: Some(c),
            ..Default::default()
        };
        Ok(self.ctx.create_qp(&self.pd, &self.cq, &self.rcq, attr)?)
    }

    /// A new QP owned by data core `core` of `cores` (QP number `n` belongs to core
    /// `n % data_cores`, docs/ARCHITECTURE.md), so a peer's QPs spread over the cores: each core
    /// runs its own QPs' requests (on one host, their copies), in parallel. QP numbers are
    /// drawn at random: it draws until one fits, at most `32 * cores` times (then any will do).
    fn new_qp_on_core(&self, recovery: Recovery, core: usize, cores: usize) -> Result<Qp, TransferError> {
        let mut qp = self.new_qp(recovery)?;
        for _ in 0..32 * cores {
            if qp.qp_num() as usize % cores == core {
                break;
            }
            qp = self.new_qp(recovery)?;
        }
        Ok(qp)
    }

    /// Connects `qps_per_peer` QPs to the engine whose RPC port is `rpc`, checking it is
    /// `instance`.
    pub(crate) fn connect(&self, name: &str, rpc: SocketAddr, instance: u64) -> Result<(), TransferError> {
        if let Some(p) = self.peers.lock().get(name) {
            if p.instance == instance && p.rpc == rpc && p.lanes.iter().any(|l| !l.dead.load(Ordering::Relaxed)) {
                return Ok(());
            }
        }
        let peer_err = |m: String| TransferError::Peer {
            peer: format!("{name} ({rpc} over flexns)"),
            message: m,
        };
        let recovery = if self.cfg.paths > 1 {
            Recovery::SelectiveRepeat
        } else {
            self.ctx.config().qp.recovery
        };
        let mut lanes = Vec::new();
        let hello = serde_json::json!({"from": self.cfg.name, "expect": instance}).to_string();
        let cores = self.ctx.config().data_cores.max(1);
        let qps = (0..self.cfg.qps_per_peer)
            .map(|i| {
                let qp = self.new_qp_on_core(recovery, i % cores, cores)?;
                if self.cfg.paths > 1 {
                    qp.set_paths(self.cfg.paths, self.cfg.spray)?;
                }
                Ok(qp)
            })
            .collect::<Result<Vec<Qp>, TransferError>>()?;
        // receive buffers for the answers to notifications, posted before the peer can send
        let mrs = qps
            .iter()
            .map(|qp| {
                let mr = self.pd.reg_mr(REPLY_SLOTS * REPLY_SLOT_BYTES, Access::LOCAL_WRITE)?;
                for slot in 0..REPLY_SLOTS {
                    qp.post_recv(RecvWr {
                        wr_id: slot as u64,
                        sg_list: [mr.sge(slot * REPLY_SLOT_BYTES, REPLY_SLOT_BYTES)]
                            .into_iter()
                            .collect(),
                    })?;
                }
                Ok(mr)
            })
            .collect::<Result<Vec<Mr>, TransferError>>()?;
        let mut mrs = mrs.into_iter();
        let replies = self.rt.block_on(async {
            let mut c = tokio::time::timeout(Duration::from_secs(3), cm::Connector::new(rpc))
                .await
                .map_err(|_| "connection manager: no answer within 3 s".to_string())?
                .map_err(|e| e.to_string())?;
            let reqs: Vec<(&Qp, Vec<u8>)> = qps.iter().map(|q| (q, hello.clone().into_bytes())).collect();
            let answers = tokio::time::timeout(Duration::from_secs(3), c.connect_many(&reqs))
                .await
                .map_err(|_| format!("connecting {} queue pairs: no answer within 3 s", reqs.len()))?
                .map_err(|e| e.to_string())?;
            answers
                .into_iter()
                .enumerate()
                .map(|(i, r)| r.map_err(|e| format!("queue pair {i}: {e}")))
                .collect::<Result<Vec<_>, String>>()
        });
        let replies = replies.map_err(peer_err)?;
        for (qp, r) in qps.into_iter().zip(replies) {
            let live = serde_json::from_slice::<serde_json::Value>(&r)
                .ok()
                .and_then(|v| v["instance"].as_u64())
                .ok_or_else(|| peer_err("connection reply without an instance (not a transfer engine?)".into()))?;
            if live != instance {
                return Err(TransferError::StaleDescriptor {
                    segment: name.to_string(),
                    published: instance,
                    live,
                });
            }
            lanes.push(Arc::new(Lane {
                qp,
                inflight: AtomicUsize::new(0),
                dead: AtomicBool::new(false),
                replies: mrs.next().expect("one per QP"),
                notify: Mutex::new(NotifyWindow::default()),
            }));
        }
        {
            let mut init = self.initiators.lock();
            init.retain(|_, l| l.strong_count() > 0);
            init.extend(lanes.iter().map(|l| (l.qp.qp_num(), Arc::downgrade(l))));
        }
        let peer = Arc::new(FlexPeer {
            name: name.to_string(),
            rpc,
            instance,
            lanes,
            rr: AtomicUsize::new(0),
            last_error: Mutex::new(None),
        });
        self.peers.lock().insert(name.to_string(), peer);
        Ok(())
    }

    pub(crate) fn close(&self, name: &str) {
        self.peers.lock().remove(name);
    }

    /// Queues slices for `peer` and posts what fits now.
    pub(crate) fn submit(&self, peer: &str, slices: Vec<Slice>) -> Result<(), TransferError> {
        if !self.peers.lock().contains_key(peer) {
            return Err(TransferError::Invalid(format!("segment {peer} is not open")));
        }
        self.pending
            .lock()
            .extend(slices.into_iter().map(|s| (peer.to_string(), s)));
        self.drain_pending();
        Ok(())
    }

    fn work_request(&self, wr_id: u64, slice: &Slice) -> SendWr {
        let op = match slice.op {
            Opcode::Write => WrOpcode::RdmaWrite,
            Opcode::Read => WrOpcode::RdmaRead,
        };
        SendWr::new(wr_id, op)
            .sge(Sge {
                addr: slice.local,
                length: slice.len,
                lkey: slice.lkey,
            })
            .remote(slice.remote, slice.rkey)
    }

    /// Posts queued slices to QPs with room, several per QP in one post (one doorbell);
    /// reconnects a peer whose QPs all failed.
    fn drain_pending(&self) {
        let mut pend = self.pending.lock();
        loop {
            let (plan, stop) = self.plan_posts(&mut pend);
            let requeue = self.post_planned(plan);
            let again = !requeue.is_empty();
            for (name, s) in requeue.into_iter().rev() {
                pend.push_front((name, s));
            }
            if stop || !again {
                return;
            }
        }
    }

    /// Assigns queued slices to QPs: per QP the work requests to post, already entered in
    /// `outstanding`. Returns whether it stopped because every QP is full.
    fn plan_posts(&self, pend: &mut parking_lot::MutexGuard<'_, VecDeque<(String, Slice)>>) -> (Vec<Planned>, bool) {
        let mut plan: Vec<Planned> = Vec::new();
        let mut cached: Option<Arc<FlexPeer>> = None;
        let mut entries = Vec::new();
        let mut stop = false;
        while let Some((name, slice)) = pend.pop_front() {
            let peer = match cached.as_ref().filter(|p| p.name == name) {
                Some(p) => Some(p.clone()),
                None => self.peers.lock().get(&name).cloned(),
            };
            let Some(peer) = peer else {
                slice.fail(format!("segment {name} was closed with the request in flight"));
                continue;
            };
            cached = Some(peer.clone());
            let n = peer.lanes.len();
            let start = peer.rr.fetch_add(1, Ordering::Relaxed);
            let mut any_live = false;
            let mut chosen = None;
            for k in 0..n {
                let l = &peer.lanes[(start + k) % n];
                if l.dead.load(Ordering::Relaxed) {
                    continue;
                }
                any_live = true;
                if l.inflight.load(Ordering::Relaxed) < self.cfg.in_flight {
                    chosen = Some(l.clone());
                    break;
                }
            }
            match chosen {
                Some(l) => {
                    let wr_id = self.next_wr.fetch_add(1, Ordering::Relaxed);
                    let wr = self.work_request(wr_id, &slice);
                    l.inflight.fetch_add(1, Ordering::Relaxed);
                    entries.push((
                        wr_id,
                        Outstanding::Slice {
                            peer: peer.clone(),
                            lane: l.clone(),
                            slice,
                        },
                    ));
                    match plan.iter_mut().find(|p| Arc::ptr_eq(&p.lane, &l)) {
                        Some(p) => p.wrs.push(wr),
                        None => plan.push(Planned {
                            peer,
                            lane: l,
                            wrs: vec![wr],
                        }),
                    }
                }
                None if any_live => {
                    pend.push_front((name, slice));
                    stop = true; // every QP is full: completions make room
                    break;
                }
                None => {
                    // every QP of the peer failed: post what is planned, then reconnect (the
                    // peer may be back) or fail its slices
                    self.outstanding.lock().extend(entries.drain(..));
                    for (n, s) in self.post_planned(std::mem::take(&mut plan)).into_iter().rev() {
                        pend.push_front((n, s));
                    }
                    let r =
                        parking_lot::MutexGuard::unlocked(pend, || self.connect(&peer.name, peer.rpc, peer.instance));
                    cached = None;
                    if let Err(e) = r {
                        let last = peer.last_error.lock().clone().unwrap_or_else(|| "unknown".into());
                        let why = format!(
                            "every queue pair to {} failed (last: {last}); reconnecting: {e}",
                            peer.who()
                        );
                        slice.fail(why.clone());
                        let (mine, rest): (Vec<_>, Vec<_>) = pend.drain(..).partition(|(n, _)| *n == name);
                        pend.extend(rest);
                        for (_, s) in mine {
                            s.fail(why.clone());
                        }
                    } else {
                        pend.push_front((name, slice));
                    }
                }
            }
        }
        self.outstanding.lock().extend(entries);
        (plan, stop)
    }

    /// Posts planned work requests, one post per QP; returns the slices a refused post left
    /// over (to retry on another QP, or failed when out of attempts).
    fn post_planned(&self, plan: Vec<Planned>) -> Vec<(String, Slice)> {
        let mut requeue = Vec::new();
        if !plan.is_empty() && self.spinners.load(Ordering::Acquire) == 0 {
            self.idle_cv.notify_one();
        }
        for Planned { peer, lane, wrs } in plan {
            let mut yielded = 0usize;
            let r = lane.qp.post_send_batch(wrs.iter().cloned().inspect(|_| yielded += 1));
            let Err(e) = r else { continue };
            // the post stopped at the work request it refused: it and the rest did not go
            self.lane_failed(
                &lane,
                &format!("{} qp {:#x}: posting: {e}", peer.who(), lane.qp.qp_num()),
            );
            let mut out = self.outstanding.lock();
            for wr in &wrs[yielded.saturating_sub(1)..] {
                if let Some(Outstanding::Slice { slice, .. }) = out.remove(&wr.wr_id) {
                    lane.inflight.fetch_sub(1, Ordering::Relaxed);
                    let what = slice.describe();
                    let msg = format!("{} qp {:#x}: posting {what}: {e}", peer.who(), lane.qp.qp_num());
                    if let Some(s) = slice.retry_or_fail(self.cfg.attempts, msg) {
                        requeue.push((peer.name.clone(), s));
                    }
                }
            }
        }
        requeue
    }

    /// Processes send completions and posts what waits; any thread may call it.
    pub(crate) fn progress(&self) {
        let Some(_g) = self.progress_lock.try_lock() else {
            return;
        };
        let mut wcs = [EMPTY_WC; 64];
        loop {
            let n = self.cq.poll(&mut wcs);
            for wc in &wcs[..n] {
                self.complete(wc);
            }
            if n < wcs.len() {
                break;
            }
        }
        if !self.pending.lock().is_empty() {
            self.drain_pending();
        }
    }

    fn complete(&self, wc: &Wc) {
        let Some(o) = self.outstanding.lock().remove(&wc.wr_id) else {
            return;
        };
        match o {
            Outstanding::Slice { peer, lane, slice } => {
                lane.inflight.fetch_sub(1, Ordering::Relaxed);
                if wc.status == WcStatus::Success {
                    let (b, len) = (slice.batch.clone(), slice.len as u64);
                    if b.slice_done(slice.task, len) {
                        self.send_batch_notify(&b);
                    }
                    return;
                }
                let msg = format!(
                    "{} qp {:#x} ({}): {}: {}",
                    peer.who(),
                    lane.qp.qp_num(),
                    lane.paths_summary(),
                    slice.describe(),
                    status_text(wc.status)
                );
                if retryable(wc.status) {
                    self.lane_failed(&lane, &msg);
                    if wc.status != WcStatus::WrFlushErr {
                        *peer.last_error.lock() = Some(msg.clone());
                    }
                    if let Some(s) = slice.retry_or_fail(self.cfg.attempts, msg) {
                        self.pending.lock().push_front((peer.name.clone(), s));
                    }
                } else {
                    slice.fail(msg);
                }
            }
            // sent: its answer completes it (see `receive_notifies`)
            Outstanding::Notify { .. } if wc.status == WcStatus::Success => {}
            Outstanding::Notify { who, lane, id, .. } => {
                let msg = format!(
                    "{who} qp {:#x}: notification: {}",
                    lane.qp.qp_num(),
                    status_text(wc.status)
                );
                if let Some((_, w)) = self.awaiting.lock().remove(&id) {
                    w.finish(Err(msg.clone()));
                }
                self.lane_failed(&lane, &msg);
            }
            Outstanding::Reply { .. } if wc.status == WcStatus::Success => {}
            Outstanding::Reply { .. } => {
                // the sender's QP is gone; its notification fails there (its QP failed)
                tracing::debug!(
                    "answering a notification on qp {:#x}: {}",
                    wc.qp_num,
                    status_text(wc.status)
                );
            }
        }
    }

    /// A QP failed: it takes no more work, and its notifications waiting for room or for an
    /// answer (which can no longer arrive on it) fail with `why`.
    fn lane_failed(&self, lane: &Arc<Lane>, why: &str) {
        // marked dead under the window's lock: a `post_notify` that saw the lane alive either
        // queued before this drain, or sees it dead under the lock and fails (none is stranded)
        let waiting: Vec<Waiter> = {
            let mut win = lane.notify.lock();
            lane.dead.store(true, Ordering::Relaxed);
            win.waiting.drain(..).map(|(_, _, w)| w).collect()
        };
        let unanswered: Vec<Waiter> = {
            let mut a = self.awaiting.lock();
            let ids: Vec<u64> = a
                .iter()
                .filter(|(_, (l, _))| Arc::ptr_eq(l, lane))
                .map(|(&id, _)| id)
                .collect();
            ids.into_iter().filter_map(|id| a.remove(&id)).map(|(_, w)| w).collect()
        };
        for w in waiting.into_iter().chain(unanswered) {
            w.finish(Err(format!("notification not answered: {why}")));
        }
    }

    fn send_batch_notify(&self, b: &Arc<Batch>) {
        if let Some((peer, payload)) = b.take_notify() {
            if let Err(e) = self.post_notify(&peer, &payload, Some(b.clone()), None) {
                b.notify_done(Err(e.to_string()));
            }
        }
    }

    fn post_notify(
        &self,
        peer: &str,
        payload: &[u8],
        batch: Option<Arc<Batch>>,
        done: Option<std::sync::mpsc::Sender<Result<(), String>>>,
    ) -> Result<(), TransferError> {
        let p = self
            .peers
            .lock()
            .get(peer)
            .cloned()
            .ok_or_else(|| TransferError::Invalid(format!("segment {peer} is not open")))?;
        let lane = p
            .lanes
            .iter()
            .find(|l| !l.dead.load(Ordering::Relaxed))
            .cloned()
            .ok_or_else(|| TransferError::Failed(format!("{}: every queue pair failed", p.who())))?;
        let id = self.next_wr.fetch_add(1, Ordering::Relaxed);
        let mut msg = Vec::with_capacity(NOTIFY_HDR + payload.len());
        msg.extend_from_slice(&id.to_le_bytes());
        msg.extend_from_slice(payload);
        let w = Waiter {
            who: p.who(),
            batch,
            done,
        };
        // posted under the window's lock: a peer's notifications leave in the order given
        let mut win = lane.notify.lock();
        if lane.dead.load(Ordering::Relaxed) {
            return Err(TransferError::Failed(format!(
                "{}: its queue pair failed while the notification was handed in",
                p.who()
            )));
        }
        if win.unanswered >= NOTIFY_WINDOW {
            win.waiting.push_back((id, msg, w));
            return Ok(());
        }
        match self.send_notify_msg(&lane, id, &msg, w) {
            Ok(()) => {
                win.unanswered += 1;
                Ok(())
            }
            Err((e, _)) => Err(e),
        }
    }

    /// Posts a notification's SEND on `lane`; its waiter waits in `awaiting` for the answer.
    /// On error the waiter is handed back, not told (none if an answer took it meanwhile).
    fn send_notify_msg(
        &self,
        lane: &Arc<Lane>,
        id: u64,
        msg: &[u8],
        w: Waiter,
    ) -> Result<(), (TransferError, Option<Waiter>)> {
        let mr = match self.pd.reg_mr(msg.len(), Access::LOCAL_WRITE) {
            Ok(mr) => mr,
            Err(e) => return Err((e.into(), Some(w))),
        };
        mr.write(0, msg);
        let wr_id = self.next_wr.fetch_add(1, Ordering::Relaxed);
        let wr = SendWr::new(wr_id, WrOpcode::Send).sge(mr.sge(0, msg.len()));
        let who = w.who.clone();
        self.awaiting.lock().insert(id, (lane.clone(), w));
        self.outstanding.lock().insert(
            wr_id,
            Outstanding::Notify {
                who: who.clone(),
                lane: lane.clone(),
                id,
                _mr: mr,
            },
        );
        self.idle_cv.notify_one();
        if let Err(e) = lane.qp.post_send(wr) {
            self.outstanding.lock().remove(&wr_id);
            let w = self.awaiting.lock().remove(&id).map(|(_, w)| w);
            let e = TransferError::Failed(format!("{who}: posting a notification: {e}"));
            return Err((e, w));
        }
        Ok(())
    }

    /// Sends a batch's notification (its data has completed); the batch hears the outcome.
    pub(crate) fn notify_async(&self, peer: &str, payload: Vec<u8>, batch: Arc<Batch>) -> Result<(), TransferError> {
        self.post_notify(peer, &payload, Some(batch), None)
    }

    /// Sends a notification and waits until the peer's receive took it.
    pub(crate) fn notify(&self, peer: &str, payload: &[u8], timeout: Duration) -> Result<(), TransferError> {
        let (tx, rx) = std::sync::mpsc::channel();
        self.post_notify(peer, payload, None, Some(tx))?;
        let until = std::time::Instant::now() + timeout;
        loop {
            self.progress();
            match rx.recv_timeout(Duration::from_micros(200)) {
                Ok(r) => return r.map_err(TransferError::Failed),
                Err(_) if std::time::Instant::now() > until => {
                    return Err(TransferError::TimedOut(format!("notification to {peer}")))
                }
                Err(_) => {}
            }
        }
    }

    /// Takes receive completions: peers' notifications on accepted QPs (queued or refused,
    /// and answered) and the answers to this engine's notifications on its own QPs.
    fn receive_notifies(&self) {
        let mut wcs = [EMPTY_WC; 32];
        loop {
            let n = self.rcq.poll(&mut wcs);
            for wc in &wcs[..n] {
                if wc.opcode != WcOpcode::Recv || wc.status != WcStatus::Success {
                    continue;
                }
                let lane = self.initiators.lock().get(&wc.qp_num).and_then(|l| l.upgrade());
                match lane {
                    Some(l) => self.answered(&l, wc),
                    None => self.notified(wc),
                }
            }
            if n < wcs.len() {
                return;
            }
        }
    }

    /// A peer's notification arrived on an accepted QP: queue it (or refuse it), give the
    /// receive buffer back, answer.
    fn notified(&self, wc: &Wc) {
        let acc = self.accepted.lock();
        let Some(a) = acc.get(&wc.qp_num) else { return };
        let slot = wc.wr_id as usize;
        if slot >= RECV_SLOTS {
            return;
        }
        let mut b = vec![0u8; (wc.byte_len as usize).min(RECV_SLOT_BYTES)];
        a.mr.read(slot * RECV_SLOT_BYTES, &mut b);
        // the buffer goes back before the answer: a sender that has its answer finds it posted
        if let Err(e) = a.qp.post_recv(RecvWr {
            wr_id: slot as u64,
            sg_list: [a.mr.sge(slot * RECV_SLOT_BYTES, RECV_SLOT_BYTES)]
                .into_iter()
                .collect(),
        }) {
            tracing::debug!("qp {:#x} from {}: re-posting a receive: {e}", wc.qp_num, a.from);
        }
        if b.len() < NOTIFY_HDR {
            tracing::warn!(
                "a message of {} B from {} on qp {:#x} is no notification; not answered",
                b.len(),
                a.from,
                wc.qp_num
            );
            return;
        }
        let id = u64::from_le_bytes(b[..NOTIFY_HDR].try_into().expect("8 bytes"));
        let r = self.notifies.push_encoded(&a.from, &b[NOTIFY_HDR..]);
        let mut reply = Vec::with_capacity(REPLY_SLOT_BYTES);
        reply.extend_from_slice(&id.to_le_bytes());
        match r {
            Ok(()) => reply.push(0),
            Err(m) => {
                reply.push(1);
                let m = m.as_bytes();
                reply.extend_from_slice(&m[..m.len().min(REPLY_SLOT_BYTES - REPLY_HDR)]);
            }
        }
        let posted = self.pd.reg_mr(reply.len(), Access::LOCAL_WRITE).and_then(|mr| {
            mr.write(0, &reply);
            let wr_id = self.next_wr.fetch_add(1, Ordering::Relaxed);
            let wr = SendWr::new(wr_id, WrOpcode::Send).sge(mr.sge(0, reply.len()));
            self.outstanding.lock().insert(wr_id, Outstanding::Reply { _mr: mr });
            self.idle_cv.notify_one();
            a.qp.post_send(wr).inspect_err(|_| {
                self.outstanding.lock().remove(&wr_id);
            })
        });
        if let Err(e) = posted {
            // the sender's QP fails (or its notification times out) without an answer
            tracing::warn!("answering a notification from {} on qp {:#x}: {e}", a.from, wc.qp_num);
        }
    }

    /// A peer answered one of this engine's notifications on `lane`: give the receive buffer
    /// back, send the next waiting notification, tell the waiter.
    fn answered(&self, lane: &Arc<Lane>, wc: &Wc) {
        let slot = wc.wr_id as usize;
        if slot >= REPLY_SLOTS {
            return;
        }
        let mut b = vec![0u8; (wc.byte_len as usize).min(REPLY_SLOT_BYTES)];
        lane.replies.read(slot * REPLY_SLOT_BYTES, &mut b);
        if let Err(e) = lane.qp.post_recv(RecvWr {
            wr_id: slot as u64,
            sg_list: [lane.replies.sge(slot * REPLY_SLOT_BYTES, REPLY_SLOT_BYTES)]
                .into_iter()
                .collect(),
        }) {
            tracing::debug!("qp {:#x}: re-posting a receive: {e}", wc.qp_num);
        }
        if b.len() < REPLY_HDR {
            tracing::warn!("qp {:#x}: an answer of {} B to a notification", wc.qp_num, b.len());
            return;
        }
        let id = u64::from_le_bytes(b[..NOTIFY_HDR].try_into().expect("8 bytes"));
        let Some((_, w)) = self.awaiting.lock().remove(&id) else {
            return; // already failed with its QP
        };
        let r = match b[NOTIFY_HDR] {
            0 => Ok(()),
            _ => Err(format!(
                "{}: notification refused: {}",
                w.who,
                String::from_utf8_lossy(&b[REPLY_HDR..])
            )),
        };
        // room for one more: the oldest waiting goes now
        let mut failed = Vec::new();
        {
            let mut win = lane.notify.lock();
            win.unanswered = win.unanswered.saturating_sub(1);
            while let Some((nid, msg, nw)) = win.waiting.pop_front() {
                match self.send_notify_msg(lane, nid, &msg, nw) {
                    Ok(()) => {
                        win.unanswered += 1;
                        break;
                    }
                    Err((e, nw)) => failed.extend(nw.map(|nw| (nw, e.to_string()))),
                }
            }
        }
        for (nw, e) in failed {
            nw.finish(Err(e));
        }
        w.finish(r);
    }

    /// The connection manager's side: a QP for a connecting engine, with receive buffers for
    /// its notifications.
    fn accept_qp(&self, remote: &Endpoint, private: &[u8]) -> Result<cm::Accepted, String> {
        let hello: serde_json::Value =
            serde_json::from_slice(private).map_err(|_| "not a transfer engine's connection request".to_string())?;
        let from = hello["from"]
            .as_str()
            .ok_or_else(|| "connection request without the engine's name (from)".to_string())?
            .to_string();
        tracing::debug!("accepting a queue pair from {from}");
        let qp = self.new_qp(remote.recovery).map_err(|e| e.to_string())?;
        let mr = self
            .pd
            .reg_mr(RECV_SLOTS * RECV_SLOT_BYTES, Access::LOCAL_WRITE)
            .map_err(|e| e.to_string())?;
        for slot in 0..RECV_SLOTS {
            qp.post_recv(RecvWr {
                wr_id: slot as u64,
                sg_list: [mr.sge(slot * RECV_SLOT_BYTES, RECV_SLOT_BYTES)].into_iter().collect(),
            })
            .map_err(|e| e.to_string())?;
        }
        let thread = std::thread::current().id();
        let mut pending = self.accepting.lock();
        // a QP this thread left pending is one whose connect failed (see `Pending::thread`)
        pending.retain(|_, p| p.thread != thread && p.at.elapsed() < PENDING_TTL);
        pending.insert(
            qp.qp_num(),
            Pending {
                mr,
                from,
                at: Instant::now(),
                thread,
            },
        );
        drop(pending);
        let reply = serde_json::json!({"instance": self.cfg.instance}).to_string();
        Ok(cm::Accepted {
            qp,
            private_data: reply.into_bytes(),
        })
    }
}

/// The connection manager's policy for this engine's RPC port.
pub(crate) struct FlexAcceptor(pub Arc<FlexnsPath>);

impl cm::Acceptor for FlexAcceptor {
    fn accept(&self, remote: &Endpoint, private_data: &[u8]) -> Result<cm::Accepted, String> {
        self.0.accept_qp(remote, private_data)
    }

    fn connected(&self, qp: Qp) {
        let qpn = qp.qp_num();
        if let Some(Pending { mr, from, .. }) = self.0.accepting.lock().remove(&qpn) {
            self.0.accepted.lock().insert(
                qpn,
                AcceptedQp {
                    qp,
                    mr,
                    from,
                    rx: 0,
                    quiet_since: Instant::now(),
                },
            );
        }
    }

    /// Packets an accepted QP received; `None` once it is dropped (failed, reaped, shut down).
    fn rx_packets(&self, qpn: u32) -> Option<u64> {
        Some(self.0.accepted.lock().get(&qpn)?.qp.stats().rx_packets)
    }

    /// Drops an accepted QP that never received a packet, with its receive buffers (all the
    /// engine holds for it: no notification can have come on it).
    fn reap(&self, qpn: u32) {
        if let Some(a) = self.0.accepted.lock().remove(&qpn) {
            tracing::debug!("qp {qpn:#x} from {} never received a packet; reaped", a.from);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peers_qps_are_spread_over_the_data_cores() {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let cores = 2;
        let ctx = Context::open(netstack::verbs::ContextConfig {
            data_cores: cores,
            ..Default::default()
        })
        .unwrap();
        let cfg = FlexCfg {
            name: "spread".into(),
            instance: 1,
            qps_per_peer: 2,
            paths: 1,
            spray: SprayPolicy::Weighted,
            in_flight: 64,
            attempts: 1,
            unused_qp_timeout: Duration::from_secs(10),
        };
        let p = FlexnsPath::new(ctx, cfg, Arc::new(Notifies::new("flexns")), rt.handle().clone()).unwrap();
        let recovery = p.ctx.config().qp.recovery;
        // random QP numbers land on one core half the time: 20 pairs all spread by chance has
        // probability 2^-20; drawing until one fits misses with probability 2^-64 per QP
        for _ in 0..20 {
            let on: Vec<usize> = (0..cores)
                .map(|c| p.new_qp_on_core(recovery, c, cores).unwrap().qp_num() as usize % cores)
                .collect();
            assert_eq!(on, vec![0, 1]);
        }
    }
}
