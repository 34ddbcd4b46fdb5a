//! One `kv-server` partition: a flexns context, the store in one registered region, and the
//! four ways gets reach it:
//! - one-sided READs of the region (nothing runs here);
//! - the offloaded and hybrid gets, handlers on the engine's offload threads;
//! - RedN hash-get chains on managed QPs (one pair of response QPs per client connection);
//! - two-sided RPCs served by the application thread, which is also the partition's single
//!   writer for puts, inserts, updates and deletes.
//!
//! A RESP front door (GET/SET/DEL/PING/CONFIG GET/QUIT) on TCP serves redis clients.

use crate::layout;
use crate::offload::{get_handler, hybrid_handler, multi_get_handler, HotCache, HotStats, Mapped};
use crate::proto::*;
use crate::store::{self, Geometry, Store, StoreStats};
use crate::KvError;
use netstack::cm::{self, Accepted, Acceptor};
use netstack::offload::{OffloadStats, QpFilter, Registered};
use netstack::redn::programs::{ClientBuffer, HashGetServer};
use netstack::verbs::*;
use parking_lot::Mutex;
use serde::Serialize;
use std::collections::HashMap;
use std::net::{SocketAddr, SocketAddrV4};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A partition's configuration.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Connection-manager (gRPC) listen address.
    pub cm: SocketAddrV4,
    /// RESP front door listen address (`None`: no front door).
    pub resp: Option<SocketAddr>,
    /// Keys the index is sized for, and bytes of entry memory.
    pub capacity: u64,
    /// Bytes of entry memory.
    pub data_bytes: u64,
    /// The value length RedN gets serve (their responses have a fixed length).
    pub redn_value_len: usize,
    /// This partition's shard number and the shard count.
    pub shard: u32,
    /// The number of shards.
    pub shards: u32,
    /// The shard map handed to clients (connection-manager addresses by shard), if known.
    pub map: Vec<SocketAddr>,
    /// Hot-value cache of the hybrid get: entries, and accesses before a key is admitted.
    pub hot_entries: usize,
    /// Accesses of a key before it is admitted to the hot-value cache.
    pub hot_admit: u8,
    /// The stack's context (data address, data cores, offload threads, ...).
    pub ctx: ContextConfig,
    /// Register this shard in etcd's shard map (clients then need only etcd).
    pub etcd: Option<crate::shardmap::EtcdMap>,
    /// A connection idle this long gets a keepalive message; a client that is gone lets it
    /// fail (RETRY_EXC_ERR), and the connection and its RedN pairs are dropped.
    pub keepalive: Duration,
    /// Most client connections at once on the RDMA (connection-manager) door (each holds up
    /// to 3 × 64 × 66 KiB of message memory); more are refused with a message saying so. The
    /// RESP door has its own, `resp_limits.max_clients`.
    pub max_connections: usize,
    /// Most RDMA connections one caller (its IP address) may hold, so that one caller cannot
    /// take every connection; `None`: three quarters of `max_connections` (at least 1).
    pub max_connections_per_caller: Option<usize>,
    /// A connection whose QP has received no packet this long after it was accepted (a
    /// phantom: its caller named an endpoint that never answers) is dropped with everything
    /// it holds, and counted in `flexns_cm_qps_reaped_total`. Half-way, the server probes the
    /// QP with a zero-length WRITE, which a live client's QP acknowledges however idle the
    /// client is, so only endpoints that never answer are dropped.
    pub unused_timeout: Duration,
    /// The RESP door's limits: connections, query buffer, bulk and multibulk lengths.
    pub resp_limits: crate::resp::RespLimits,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            cm: SocketAddrV4::new([127, 0, 0, 1].into(), 0),
            resp: None,
            capacity: 1 << 20,
            data_bytes: 256 << 20,
            redn_value_len: 64,
            shard: 0,
            shards: 1,
            map: Vec::new(),
            hot_entries: 4096,
            hot_admit: 4,
            ctx: ContextConfig::default(),
            etcd: None,
            keepalive: KEEPALIVE_IDLE,
            max_connections: 1024,
            max_connections_per_caller: None,
            unused_timeout: cm::DoorLimits::default().unused_timeout,
            resp_limits: Default::default(),
        }
    }
}

/// Counters of a partition, for `kv stats` and the benchmarks.
#[derive(Debug, Clone, Serialize)]
pub struct ServerStats {
    /// The store's writer.
    pub store: StoreStats,
    /// The hot-value cache.
    pub hot: HotStats,
    /// Offloaded gets.
    pub offload: OffloadStats,
    /// RedN gets.
    pub redn: netstack::redn::RednStats,
    /// RPC requests served.
    pub rpc_requests: u64,
    /// RPC requests answered with an error.
    pub rpc_errors: u64,
    /// RESP commands served.
    pub resp_requests: u64,
    /// The RESP door's connections and refusals.
    pub resp: crate::resp::RespStats,
    /// QP connections accepted.
    pub connections: u64,
    /// RedN get pairs set up.
    pub redn_pairs: u64,
}

/// Receives kept posted per RedN pair (each get consumes one; an application chore refills).
const REDN_RECVS: u64 = 1024;
/// Most RPCs in flight per connection (a connection's message memory is 3 × depth × 66 KiB).
const MAX_DEPTH: u32 = 64;

struct RpcConn {
    qp: Option<Qp>,
    /// `depth` receive slots, then `2 * depth` send slots, of `RPC_SLOT` bytes each.
    mr: Mr,
    depth: u32,
    free_send: Vec<u32>,
    /// When a request last arrived (the keepalive probes connections idle for long).
    last_seen: Instant,
    /// When the connection was accepted.
    accepted: Instant,
    /// Its QP has received a packet, or was probed for one (see [`Inner::probe_unused`]).
    heard_or_probed: bool,
}

impl ServerConfig {
    /// The connection manager's limits for this configuration (its fields checked, an error
    /// naming the one that is wrong).
    pub fn door_limits(&self) -> Result<cm::DoorLimits, KvError> {
        if self.max_connections == 0 {
            return Err(KvError::Config("max_connections: 0 admits no client".into()));
        }
        let per_caller = match self.max_connections_per_caller {
            Some(0) => return Err(KvError::Config("max_connections_per_caller: 0 admits no client".into())),
            Some(n) => n,
            None => (self.max_connections * 3 / 4).max(1),
        };
        if self.unused_timeout.is_zero() {
            return Err(KvError::Config(
                "unused_timeout: 0 would drop connections before a client can use them".into(),
            ));
        }
        Ok(cm::DoorLimits {
            max_batch: cm::CHUNK,
            max_qps_per_caller: per_caller,
            unused_timeout: self.unused_timeout,
        })
    }
}

/// The default keepalive idle time ([`ServerConfig::keepalive`]).
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);

/// How long an accepted connection may wait to be connected by the connection manager (it is
/// within one call) before its slot and memory are freed.
const PENDING_TTL: Duration = Duration::from_secs(10);

struct RednPair {
    /// The general connection (server QPN) the pair belongs to.
    conn: u32,
    /// The connected response QPs (part 0 receives the requests).
    qps: Vec<Qp>,
    chains: Option<HashGetServer>,
    rcq: Cq,
    qcq: Cq,
    posted: u64,
    resp: ClientBuffer,
}

pub(crate) struct Inner {
    ctx: Context,
    pd: Pd,
    mr: Mr,
    geometry: Geometry,
    /// The single writer.
    pub(crate) store: Mutex<Store>,
    /// Held by the application thread and the RESP front door while they work; `pause_app`
    /// takes it to show that offloaded and one-sided gets do not need them.
    pub(crate) app_gate: Mutex<()>,
    cq: Cq,
    conns: Mutex<HashMap<u32, RpcConn>>,
    pending: Mutex<HashMap<u32, RpcConn>>,
    redn: Mutex<HashMap<u64, RednPair>>,
    /// Accepted RedN QPs until connected: QPN → pair.
    pending_redn: Mutex<HashMap<u32, u64>>,
    hot: Arc<HotCache>,
    pub(crate) shard: u32,
    pub(crate) shards: u32,
    pub(crate) map: Vec<SocketAddr>,
    keepalive: Duration,
    max_connections: usize,
    /// Connections never heard from are probed after this long (half the door's timeout).
    probe_unused_after: Duration,
    rpc_requests: AtomicU64,
    rpc_errors: AtomicU64,
    pub(crate) resp_requests: AtomicU64,
    resp_door: crate::resp::Door,
}

impl Inner {
    fn welcome(&self, rpc_slots: u32) -> Welcome {
        Welcome {
            shard: self.shard,
            shards: self.shards,
            map: self.map.clone(),
            region_addr: self.mr.addr(),
            rkey: self.mr.rkey(),
            geometry: self.geometry,
            rpc_slots,
            conn: 0,
        }
    }

    /// Checks that `key` belongs to this partition.
    pub(crate) fn owns(&self, key: &[u8]) -> Result<(), KvError> {
        let s = shard_of(key, self.shards);
        if s != self.shard {
            let at = self.map.get(s as usize).map(|a| format!(" at {a}")).unwrap_or_default();
            return Err(KvError::Server(format!(
                "key belongs to shard {s}{at}, this is shard {} of {}",
                self.shard, self.shards
            )));
        }
        Ok(())
    }

    /// Reads `key` without the writer (validated, lock-free).
    pub(crate) fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, KvError> {
        if key.is_empty() || key.len() > layout::MAX_KEY {
            return Err(KvError::BadKey(key.len()));
        }
        self.owns(key)?;
        Ok(store::lookup(&**self.mr.region(), &self.geometry, key)?
            .0
            .map(|f| f.value))
    }

    /// Executes one RPC; returns the reply status and payload.
    fn execute(&self, req: &Request<'_>) -> (u8, Vec<u8>) {
        let r = self.owns(req.key).and_then(|_| match req.op {
            RpcOp::Get => self.get(req.key).map(|v| v.ok_or(KvError::NotFound)).and_then(|r| r),
            RpcOp::Put => self.store.lock().put(req.key, req.value).map(|_| Vec::new()),
            RpcOp::Insert => self.store.lock().insert(req.key, req.value).map(|_| Vec::new()),
            RpcOp::Update => self.store.lock().update(req.key, req.value).map(|_| Vec::new()),
            RpcOp::Bye => Ok(Vec::new()), // handled before execution
            RpcOp::Delete => match self.store.lock().delete(req.key) {
                Ok(true) => Ok(Vec::new()),
                Ok(false) => Err(KvError::NotFound),
                Err(e) => Err(e),
            },
        });
        match r {
            Ok(v) => (RPC_OK, v),
            Err(KvError::NotFound) => (RPC_NOT_FOUND, Vec::new()),
            Err(KvError::Exists) => (RPC_EXISTS, Vec::new()),
            Err(e) => {
                self.rpc_errors.fetch_add(1, Ordering::Relaxed);
                (RPC_ERROR, e.to_string().into_bytes())
            }
        }
    }

    fn accept_kv(&self, depth: u32) -> Result<Accepted, String> {
        let depth = depth.clamp(1, MAX_DEPTH);
        let open = self.conns.lock().len() + self.pending.lock().len();
        if open >= self.max_connections {
            return Err(format!(
                "kv-server has {open} connections, its limit (max_connections {})",
                self.max_connections
            ));
        }
        let e = |e: VerbsError| e.to_string();
        let qp = self
            .ctx
            .create_qp(
                &self.pd,
                &self.cq,
                &self.cq,
                QpInitAttr {
                    config: Some(RcConfig {
                        max_recv_wr: depth.max(self.ctx.config().qp.max_recv_wr),
                        max_send_wr: (2 * depth).max(self.ctx.config().qp.max_send_wr),
                        ..self.ctx.config().qp
                    }),
                    ..Default::default()
                },
            )
            .map_err(e)?;
        let mr = self
            .pd
            .reg_mr(3 * depth as usize * RPC_SLOT, Access::LOCAL_WRITE)
            .map_err(e)?;
        for s in 0..depth {
            qp.post_recv(RecvWr {
                wr_id: s as u64,
                sg_list: [mr.sge(s as usize * RPC_SLOT, RPC_SLOT)].into_iter().collect(),
            })
            .map_err(e)?;
        }
        let w = Welcome {
            conn: qp.qp_num(),
            ..self.welcome(depth)
        };
        self.pending.lock().insert(
            qp.qp_num(),
            RpcConn {
                qp: None,
                mr,
                depth,
                free_send: (0..2 * depth).rev().collect(),
                last_seen: Instant::now(),
                accepted: Instant::now(),
                heard_or_probed: false,
            },
        );
        Ok(Accepted {
            private_data: serde_json::to_vec(&w).map_err(|e| e.to_string())?,
            qp,
        })
    }

    fn accept_redn(&self, conn: u32, pair: u64, part: u8, resp: ClientBuffer) -> Result<Accepted, String> {
        let e = |e: VerbsError| e.to_string();
        let Some(depth) = self.conns.lock().get(&conn).map(|c| c.depth) else {
            return Err(format!(
                "RedN pair {pair}: no connection {conn:#x} to belong to (connect it first)"
            ));
        };
        let mut pairs = self.redn.lock();
        let ready = pairs.get(&pair).map(|p| p.qps.len());
        if part > 1 || (part == 0 && ready.is_some()) || (part == 1 && ready != Some(1)) {
            return Err(format!(
                "RedN pair {pair}: part {part} out of order (connect part 0, then 1)"
            ));
        }
        // a client opens one pair per request slot: more would let one connection hold
        // unbounded QPs and chains
        let held = pairs.values().filter(|p| p.conn == conn).count();
        if part == 0 && held >= depth as usize {
            return Err(format!(
                "RedN pair {pair}: connection {conn:#x} already has {held} pairs, its depth"
            ));
        }
        if part == 0 {
            let rcq = self.ctx.create_cq_ignore_overrun(64).map_err(e)?;
            let qcq = self.ctx.create_cq_ignore_overrun(64).map_err(e)?;
            pairs.insert(
                pair,
                RednPair {
                    conn,
                    qps: Vec::new(),
                    chains: None,
                    rcq,
                    qcq,
                    posted: 0,
                    resp,
                },
            );
        }
        let p = pairs.get_mut(&pair).expect("inserted above");
        // part 1 receives nothing; its receive CQ is the send CQ (part 0's receive CQ must
        // count the requests only)
        let rcq = if part == 0 { p.rcq.clone() } else { p.qcq.clone() };
        let qp = HashGetServer::response_qp(&self.ctx, &self.pd, &p.qcq, &rcq, 2 * REDN_RECVS as u32).map_err(e)?;
        if part == 1 {
            let qrefs = [&p.qps[0], &qp];
            let chains = HashGetServer::new(
                &self.ctx,
                &self.pd,
                &qrefs,
                &p.rcq,
                self.mr.rkey(),
                self.mr.lkey(),
                layout::class_len(self.geometry.redn_class) as u32,
                p.resp,
            )
            .map_err(e)?;
            chains.post_recvs(&p.qps[0], REDN_RECVS as usize).map_err(e)?;
            p.posted = REDN_RECVS;
            p.chains = Some(chains);
        }
        self.pending_redn.lock().insert(qp.qp_num(), pair);
        Ok(Accepted {
            qp,
            private_data: serde_json::to_vec(&self.welcome(0)).map_err(|e| e.to_string())?,
        })
    }

    /// Application chores: RedN receives topped up, idle connections probed, dead ones (and
    /// their RedN pairs) dropped.
    fn chores(&self) {
        // an accepted QP the connection manager could not connect (a bad endpoint) is never
        // handed over: its slot and memory go after a while
        self.pending.lock().retain(|_, c| c.accepted.elapsed() < PENDING_TTL);
        let live: std::collections::HashSet<u32> = {
            let mut conns = self.conns.lock();
            conns.retain(|_, c| c.qp.as_ref().is_some_and(|q| q.state() != QpState::Err));
            for c in conns.values_mut() {
                self.probe_unused(c);
                if c.last_seen.elapsed() > self.keepalive {
                    c.last_seen = Instant::now();
                    Self::keepalive(c);
                }
            }
            conns.keys().copied().collect()
        };
        let pending: std::collections::HashSet<u32> = self.pending.lock().keys().copied().collect();
        let mut pairs = self.redn.lock();
        pairs.retain(|_, p| {
            p.qps.iter().all(|q| q.state() != QpState::Err) && (live.contains(&p.conn) || pending.contains(&p.conn))
        });
        for p in pairs.values_mut() {
            if let Some(ch) = &p.chains {
                ch.top_up(&p.qps[0], &p.rcq, &mut p.posted, REDN_RECVS);
            }
        }
    }

    /// Probes a connection whose QP has received nothing `probe_unused_after` after it was
    /// accepted with a zero-length WRITE (it needs no receive and names no memory, IBA
    /// 9.7.4.1.5): a live client's QP acknowledges it, so the connection manager's door sees
    /// the QP used before its timeout however idle the client stays; a phantom's endpoint
    /// never answers, and the door reaps the QP (or the probe's retries fail it first).
    fn probe_unused(&self, c: &mut RpcConn) {
        let Some(qp) = c.qp.as_ref() else { return };
        if c.heard_or_probed || c.accepted.elapsed() < self.probe_unused_after {
            return;
        }
        c.heard_or_probed = true;
        if qp.stats().rx_packets > 0 {
            return;
        }
        // unsignaled: a success completes nothing, a failure is a flushed completion the
        // handler ignores
        let wr = SendWr::new(u64::MAX, WrOpcode::RdmaWrite).flags(SendFlags(0));
        if let Err(e) = qp.post_send(wr) {
            tracing::debug!(qpn = qp.qp_num(), "probing an unused connection: {e}");
        }
    }

    /// An unsolicited reply (id `u64::MAX`, which no request has): clients ignore it; a vanished
    /// client never acknowledges it, and the QP fails.
    fn keepalive(c: &mut RpcConn) {
        let (Some(qp), Some(s)) = (c.qp.as_ref(), c.free_send.pop()) else {
            return;
        };
        let off = (c.depth as usize + s as usize) * RPC_SLOT;
        let mut out = [0u8; RPC_HEADER];
        encode_reply(&mut out, RPC_OK, u64::MAX, &[]);
        c.mr.write(off, &out);
        let wr = SendWr::new(s as u64, WrOpcode::Send)
            .sge(c.mr.sge(off, RPC_HEADER))
            .flags(SendFlags::INLINE | SendFlags::SIGNALED);
        if qp.post_send(wr).is_err() {
            c.free_send.push(s);
        }
    }

    /// A client said goodbye: drop its connection and its RedN pairs.
    fn bye(&self, conn: u32, conns: &mut HashMap<u32, RpcConn>) {
        conns.remove(&conn);
        self.redn.lock().retain(|_, p| p.conn != conn);
    }

    fn handle(&self, wc: &Wc) {
        let mut conns = self.conns.lock();
        let Some(c) = conns.get_mut(&wc.qp_num) else {
            return;
        };
        if wc.opcode == WcOpcode::Send {
            c.free_send.push(wc.wr_id as u32);
            return;
        }
        if wc.opcode == WcOpcode::RdmaWrite {
            return; // a probe's failure (see `probe_unused`); the chores drop the connection
        }
        if wc.status != WcStatus::Success {
            return; // flushed or the peer is gone; the chores drop the connection
        }
        let Some(qp) = c.qp.as_ref() else { return };
        let slot = wc.wr_id as usize;
        let mut buf = vec![0u8; wc.byte_len as usize];
        c.mr.read(slot * RPC_SLOT, &mut buf);
        c.last_seen = Instant::now();
        self.rpc_requests.fetch_add(1, Ordering::Relaxed);
        if buf.first() == Some(&(RpcOp::Bye as u8)) {
            self.bye(wc.qp_num, &mut conns);
            return;
        }
        let (status, id, payload) = match decode_request(&buf) {
            Ok(req) => {
                let (s, p) = self.execute(&req);
                (s, req.id, p)
            }
            Err((id, msg)) => {
                self.rpc_errors.fetch_add(1, Ordering::Relaxed);
                (RPC_ERROR, id, msg.into_bytes())
            }
        };
        // repost the receive, then answer from a free send slot
        let _ = qp.post_recv(RecvWr {
            wr_id: slot as u64,
            sg_list: [c.mr.sge(slot * RPC_SLOT, RPC_SLOT)].into_iter().collect(),
        });
        let Some(s) = c.free_send.pop() else {
            // more replies unacknowledged than the client may have requests in flight: the
            // client broke its depth; refuse rather than overwrite a reply in flight
            self.rpc_errors.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let off = (c.depth as usize + s as usize) * RPC_SLOT;
        let mut out = vec![0u8; RPC_HEADER + payload.len()];
        let n = encode_reply(&mut out, status, id, &payload);
        c.mr.write(off, &out[..n]);
        let flags = if n <= 256 {
            SendFlags::INLINE | SendFlags::SIGNALED
        } else {
            SendFlags::SIGNALED
        };
        if qp
            .post_send(SendWr::new(s as u64, WrOpcode::Send).sge(c.mr.sge(off, n)).flags(flags))
            .is_err()
        {
            // the QP failed: the chores drop the connection; keep the slot accounted for
            c.free_send.push(s);
        }
    }
}

struct KvAcceptor(Arc<Inner>);

impl Acceptor for KvAcceptor {
    fn accept(&self, _remote: &Endpoint, pd: &[u8]) -> Result<Accepted, String> {
        match serde_json::from_slice::<Hello>(pd).map_err(|e| format!("bad hello: {e}"))? {
            Hello::Kv { depth } => self.0.accept_kv(depth),
            Hello::Redn {
                conn,
                pair,
                part,
                resp_addr,
                resp_rkey,
            } => self.0.accept_redn(
                conn,
                pair,
                part,
                ClientBuffer {
                    addr: resp_addr,
                    rkey: resp_rkey,
                },
            ),
        }
    }

    fn connected(&self, qp: Qp) {
        if let Some(mut c) = self.0.pending.lock().remove(&qp.qp_num()) {
            let qpn = qp.qp_num();
            c.qp = Some(qp);
            self.0.conns.lock().insert(qpn, c);
        } else if let Some(pair) = self.0.pending_redn.lock().remove(&qp.qp_num()) {
            if let Some(p) = self.0.redn.lock().get_mut(&pair) {
                p.qps.push(qp);
            }
        }
    }

    /// The door counts and reaps the RPC connections (what `max_connections` counts). A
    /// RedN pair's QPs answer `None`: they are held by their connection (at most its depth
    /// of pairs), are dropped with it, and are not counted against the caller.
    fn rx_packets(&self, qpn: u32) -> Option<u64> {
        let conns = self.0.conns.lock();
        let qp = conns.get(&qpn)?.qp.as_ref()?;
        Some(qp.stats().rx_packets)
    }

    /// Drops a connection that never received a packet: its QP, message memory and RedN pairs.
    fn reap(&self, qpn: u32) {
        let mut conns = self.0.conns.lock();
        self.0.bye(qpn, &mut conns);
    }
}

/// A running partition. Dropping it stops the application thread and the front doors.
pub struct KvServer {
    inner: Arc<Inner>,
    cm_addr: SocketAddr,
    resp_addr: Option<SocketAddr>,
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
    rt: Option<tokio::runtime::Runtime>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    /// This shard's address in etcd's shard map, renewed while the server runs.
    registration: Option<etcd_lite::Registration>,
    _offloads: Vec<Registered>,
    _dma: netstack::offload::DmaRegionHandle,
}

/// Holding this blocks the partition's application thread and RESP front door.
pub struct AppPause<'a>(#[allow(dead_code)] parking_lot::MutexGuard<'a, ()>);

impl KvServer {
    /// Starts a partition.
    pub fn start(cfg: ServerConfig) -> Result<KvServer, KvError> {
        if cfg.shards == 0 || cfg.shard >= cfg.shards {
            return Err(KvError::Config(format!("shard {} of {}", cfg.shard, cfg.shards)));
        }
        if !cfg.map.is_empty() && cfg.map.len() != cfg.shards as usize {
            return Err(KvError::Config(format!(
                "shard map has {} addresses for {} shards",
                cfg.map.len(),
                cfg.shards
            )));
        }
        cfg.resp_limits.check().map_err(KvError::Config)?;
        let limits = cfg.door_limits()?;
        let geometry = Geometry::for_capacity(cfg.capacity, cfg.data_bytes, cfg.redn_value_len)?;
        let ctx = Context::open(cfg.ctx.clone())?;
        let pd = ctx.alloc_pd();
        let mr = pd.reg_mr(geometry.region_len(), Access::LOCAL_WRITE | Access::REMOTE_READ)?;
        let store = Store::new(mr.region().clone(), geometry)?;
        let hot = Arc::new(HotCache::new(cfg.hot_entries, cfg.hot_admit));
        let off = ctx.offload();
        let dma = off.register_dma_region(&mr, false);
        let at = Mapped {
            base: mr.addr(),
            rkey: mr.rkey(),
        };
        let offloads = vec![
            // a get walks a bounded bucket chain with DMA reads and never waits: it runs on
            // the data core that received it, and its response leaves in that pass
            off.register_inline(OFFLOAD_GET, QpFilter::Any, get_handler(at, geometry))
                .map_err(|e| KvError::Config(e.to_string()))?,
            off.register_inline(OFFLOAD_MULTI_GET, QpFilter::Any, multi_get_handler(at, geometry))
                .map_err(|e| KvError::Config(e.to_string()))?,
            off.register_opcode(
                OFFLOAD_HYBRID_GET,
                QpFilter::Any,
                hybrid_handler(at, geometry, hot.clone()),
            )
            .map_err(|e| KvError::Config(e.to_string()))?,
        ];
        let cq = ctx.create_cq(1 << 16)?;
        let inner = Arc::new(Inner {
            ctx: ctx.clone(),
            pd,
            mr,
            geometry,
            store: Mutex::new(store),
            app_gate: Mutex::new(()),
            cq,
            conns: Mutex::new(HashMap::new()),
            pending: Mutex::new(HashMap::new()),
            redn: Mutex::new(HashMap::new()),
            pending_redn: Mutex::new(HashMap::new()),
            hot,
            shard: cfg.shard,
            shards: cfg.shards,
            map: cfg.map.clone(),
            keepalive: cfg.keepalive,
            max_connections: cfg.max_connections,
            probe_unused_after: cfg.unused_timeout / 2,
            rpc_requests: AtomicU64::new(0),
            rpc_errors: AtomicU64::new(0),
            resp_requests: AtomicU64::new(0),
            resp_door: crate::resp::Door::new(cfg.resp_limits),
        });
        let weak: std::sync::Weak<dyn netstack::telemetry::Collect> = Arc::downgrade(&inner) as _;
        netstack::telemetry::register(weak);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kv-server-cm")
            .enable_all()
            .build()?;
        let listener = rt.block_on(tokio::net::TcpListener::bind(cfg.cm))?;
        let cm_addr = listener.local_addr()?;
        let resp_addr = match cfg.resp {
            Some(a) => {
                let l = rt.block_on(tokio::net::TcpListener::bind(a))?;
                let addr = l.local_addr()?;
                rt.spawn(crate::resp::serve(l, inner.clone()));
                Some(addr)
            }
            None => None,
        };
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        {
            let acc = Arc::new(KvAcceptor(inner.clone()));
            rt.spawn(async move {
                if let Err(e) = cm::serve_with(listener, acc, limits, async {
                    let _ = rx.await;
                })
                .await
                {
                    tracing::error!("connection manager stopped: {e}");
                }
            });
        }
        let registration = match &cfg.etcd {
            Some(e) => Some(rt.block_on(e.register(cfg.shard, cfg.shards, cm_addr))?),
            None => None,
        };
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        {
            let (inner, stop) = (inner.clone(), stop.clone());
            threads.push(
                std::thread::Builder::new()
                    .name("kv-app".into())
                    .spawn(move || app_thread(&inner, &stop))?,
            );
        }
        Ok(KvServer {
            inner,
            cm_addr,
            resp_addr,
            stop,
            threads,
            rt: Some(rt),
            shutdown: Some(tx),
            registration,
            _offloads: offloads,
            _dma: dma,
        })
    }

    /// The connection manager's address (what clients and the shard map name).
    pub fn cm_addr(&self) -> SocketAddr {
        self.cm_addr
    }
    /// The data path's address.
    pub fn data_addr(&self) -> SocketAddrV4 {
        self.inner.ctx.local_addr()
    }
    /// The RESP front door's address.
    pub fn resp_addr(&self) -> Option<SocketAddr> {
        self.resp_addr
    }

    /// Writes through the single writer (loading without a network client).
    pub fn put(&self, key: &[u8], value: &[u8]) -> Result<(), KvError> {
        self.inner.owns(key)?;
        self.inner.store.lock().put(key, value).map(|_| ())
    }

    /// Reads `key` from this partition's store directly (no network client).
    pub fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, KvError> {
        self.inner.owns(key)?;
        Ok(self.inner.store.lock().get(key)?.map(|f| f.value))
    }

    /// Blocks the application thread and the RESP front door until the guard drops.
    pub fn pause_app(&self) -> AppPause<'_> {
        AppPause(self.inner.app_gate.lock())
    }

    /// The partition's counters.
    pub fn stats(&self) -> ServerStats {
        let i = &self.inner;
        ServerStats {
            store: i.store.lock().stats(),
            hot: i.hot.stats(),
            offload: i.ctx.offload().stats(),
            redn: i.ctx.redn_stats(),
            rpc_requests: i.rpc_requests.load(Ordering::Relaxed),
            rpc_errors: i.rpc_errors.load(Ordering::Relaxed),
            resp_requests: i.resp_requests.load(Ordering::Relaxed),
            resp: i.resp_door.stats(),
            connections: i.conns.lock().len() as u64,
            redn_pairs: i.redn.lock().len() as u64,
        }
    }
}

/// The partition's metrics (`shard` label), copied once a second: requests by door, the
/// store's keys and writes, the hot-value cache. The stack's own series (offloaded gets as
/// `flexns_offload_requests_total`, RedN gets as `flexns_redn_chains_total`, one-sided gets as
/// READ packets) come from the context's collector.
impl netstack::telemetry::Collect for Inner {
    fn collect(&self) {
        use metrics::{counter, gauge};
        let shard = self.shard.to_string();
        let c = |name: &'static str, v: u64| counter!(name, "shard" => shard.clone()).absolute(v);
        let g = |name: &'static str, v: u64| gauge!(name, "shard" => shard.clone()).set(v as f64);
        let st = self.store.lock().stats();
        g("flexns_kv_keys", st.keys);
        c("flexns_kv_inserts_total", st.inserts);
        c("flexns_kv_updates_total", st.updates);
        c("flexns_kv_deletes_total", st.deletes);
        g("flexns_kv_data_used_bytes", st.data_used);
        g("flexns_kv_redn_mirrored_keys", st.mirrored);
        let h = self.hot.stats();
        c("flexns_kv_hot_cache_hits_total", h.hits);
        c("flexns_kv_hot_cache_misses_total", h.misses);
        c("flexns_kv_hot_cache_stale_total", h.stale);
        g("flexns_kv_hot_cache_entries", h.entries);
        for (door, v) in [
            ("rpc", self.rpc_requests.load(Ordering::Relaxed)),
            ("resp", self.resp_requests.load(Ordering::Relaxed)),
        ] {
            counter!("flexns_kv_requests_total", "shard" => shard.clone(), "door" => door).absolute(v);
        }
        c("flexns_kv_rpc_errors_total", self.rpc_errors.load(Ordering::Relaxed));
        g("flexns_kv_connections", self.conns.lock().len() as u64);
        let r = self.resp_door.stats();
        g("flexns_kv_resp_connections", r.connections);
        g("flexns_kv_resp_query_buffer_peak_bytes", r.peak_query_buffer_bytes);
        for (reason, v) in [
            ("max_clients", r.refused_max_clients),
            ("query_buffer", r.refused_query_buffer),
            ("protocol", r.protocol_errors),
        ] {
            counter!("flexns_kv_resp_refused_total", "shard" => shard.clone(), "reason" => reason).absolute(v);
        }
    }
}

impl Drop for KvServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // leave the shard map now rather than when the lease runs out
        if let (Some(r), Some(rt)) = (self.registration.take(), self.rt.as_ref()) {
            match rt.block_on(async { tokio::time::timeout(Duration::from_secs(2), r.revoke()).await }) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!("leaving etcd's shard map: {e}"),
                Err(_) => tracing::warn!("leaving etcd's shard map: no answer from etcd in 2 s"),
            }
        }
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

/// The application thread: serves RPCs (and is the single writer for them), and does the
/// chores. Spins briefly after work, then sleeps on the CQ.
fn app_thread(inner: &Inner, stop: &AtomicBool) {
    let mut wcs = [EMPTY_WC; 64];
    let mut last_work = Instant::now();
    let mut last_chores = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        let gate = inner.app_gate.lock();
        let n = inner.cq.poll(&mut wcs);
        for wc in &wcs[..n] {
            inner.handle(wc);
        }
        if last_chores.elapsed() > Duration::from_millis(20) {
            inner.chores();
            last_chores = Instant::now();
        }
        drop(gate);
        if n > 0 {
            last_work = Instant::now();
        } else if last_work.elapsed() < Duration::from_micros(200) {
            std::thread::yield_now();
        } else {
            inner.cq.wait(Duration::from_millis(20));
        }
    }
}
impl crate::resp::Partition for Inner {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, KvError> {
        Inner::get(self, key)
    }
    fn set(&self, key: &[u8], value: &[u8]) -> Result<(), KvError> {
        self.owns(key)?;
        self.store.lock().put(key, value).map(|_| ())
    }
    fn delete(&self, key: &[u8]) -> Result<bool, KvError> {
        self.owns(key)?;
        self.store.lock().delete(key)
    }
    fn gate(&self) -> parking_lot::MutexGuard<'_, ()> {
        self.app_gate.lock()
    }
    fn count_request(&self) {
        self.resp_requests.fetch_add(1, Ordering::Relaxed);
    }
    fn door(&self) -> &crate::resp::Door {
        &self.resp_door
    }
}
