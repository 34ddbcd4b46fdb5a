//! The client library: connections to every shard, the five get paths, writes, and pipelined
//! batches ([`KvClient::execute`]); [`AsyncKvClient`] puts an async API over it.
//!
//! | path | round trips | what runs on the server |
//! | --- | --- | --- |
//! | [`GetPath::A1`] | 2+ (READ bucket, READ entry; one more per overflow bucket) | nothing |
//! | [`GetPath::Offload`] | 1 | the get handler on an offload thread |
//! | [`GetPath::Redn`] | 1 | a RedN chain (work requests only) |
//! | [`GetPath::Rpc`] | 1 | the application thread |
//! | [`GetPath::Hybrid`] | 1 (hot key) or 2 (address, then READ) | the hybrid handler |
//!
//! Every path validates what it returns (versions, CRC32C, key, incarnation); a path that cannot
//! (a torn copy it gave up rereading, a RedN get that got no answer) finishes as an offloaded
//! get, counted in [`ClientStats`].

use crate::layout::{self, Invalid, Scan, BUCKET_LEN};
use crate::proto::*;
use crate::KvError;
use netstack::verbs::*;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// A request's result: a get's value (`None`: missing key, and for writes), or the error.
pub type OpResult = Result<Option<Vec<u8>>, KvError>;
/// A finished request: its index in the batch and its result.
type Done = (usize, OpResult);

/// How gets travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GetPath {
    /// One-sided: READ the bucket, READ the entry, validate (DrTM-KV A1).
    A1,
    /// One round trip to the offloaded get handler.
    Offload,
    /// One round trip through a RedN hash-get chain (fixed-length values, keys in the mirror).
    Redn,
    /// Two-sided request served by the server's application thread.
    Rpc,
    /// Hot-value cache in the engine, else the entry's address and one READ (A4+A5).
    Hybrid,
}

impl std::fmt::Display for GetPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            GetPath::A1 => "a1",
            GetPath::Offload => "offload",
            GetPath::Redn => "redn",
            GetPath::Rpc => "rpc",
            GetPath::Hybrid => "hybrid",
        };
        f.write_str(s)
    }
}

/// Client options.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Connection-manager addresses: every shard in order, or one server whose welcome names
    /// the map.
    pub servers: Vec<SocketAddr>,
    /// Requests in flight per shard.
    pub depth: u32,
    /// The get path of [`KvClient::get`] and of `Op::Get` in batches.
    pub get_path: GetPath,
    /// Give up on a request after this long.
    pub timeout: Duration,
    /// A RedN get with no answer after this long is retried as an offloaded get (RedN answers
    /// a miss with silence).
    pub redn_timeout: Duration,
    /// Torn copies an A1 or hybrid get rereads before it finishes as an offloaded get.
    pub max_torn: u32,
    /// Offloaded gets: up to this many queued gets for one shard travel as one multi-get
    /// request (one round trip, one response); 1 sends every get alone.
    pub batch: u32,
    /// Read the shard map from etcd (when `servers` is empty) and follow it: a shard registered
    /// again (its server restarted, or another server took it over) is reconnected before the
    /// next request; a shard whose registration expired fails its requests at once with
    /// [`KvError::Unavailable`] until a server registers it again.
    pub etcd: Option<crate::shardmap::EtcdMap>,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            servers: Vec::new(),
            depth: 16,
            get_path: GetPath::Offload,
            timeout: Duration::from_secs(5),
            redn_timeout: Duration::from_millis(5),
            max_torn: 16,
            batch: 8,
            etcd: None,
        }
    }
}

/// One request of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Read the value of the key.
    Get(Vec<u8>),
    /// Insert or update.
    Put(Vec<u8>, Vec<u8>),
    /// Insert; fails with [`KvError::Exists`] when the key is there.
    Insert(Vec<u8>, Vec<u8>),
    /// Update; fails with [`KvError::NotFound`] when the key is absent.
    Update(Vec<u8>, Vec<u8>),
    /// Delete the key; fails with [`KvError::NotFound`] when the key is absent.
    Delete(Vec<u8>),
}

impl Op {
    fn key(&self) -> &[u8] {
        match self {
            Op::Get(k) | Op::Delete(k) | Op::Put(k, _) | Op::Insert(k, _) | Op::Update(k, _) => k,
        }
    }
}

/// Counters of a client.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ClientStats {
    /// Gets issued.
    pub gets: u64,
    /// Writes issued (puts, inserts, updates, deletes).
    pub writes: u64,
    /// Network round trips of gets (a READ, an offload, a RedN request, an RPC).
    pub get_round_trips: u64,
    /// Torn copies seen and reread (A1, hybrid, RedN).
    pub torn: u64,
    /// Gets finished as offloaded gets: torn copies given up on, RedN gets with no answer.
    pub fallbacks: u64,
    /// Hybrid gets answered from the hot-value cache.
    pub hot_hits: u64,
    /// Shards reconnected because etcd's shard map changed (a server restarted or took the
    /// shard over).
    pub shard_moves: u64,
}

/// The stages of a request in flight.
#[derive(Debug, Clone, Copy)]
enum Stage {
    Bucket {
        b: u64,
        skip: usize,
    },
    /// READing an entry of `len` bytes found in bucket `b` (`u64::MAX`: an address from the
    /// hybrid handler).
    Entry {
        b: u64,
        skip: usize,
        inc: Option<u16>,
        len: usize,
    },
    Offload,
    Hybrid,
    Rpc,
    Redn,
    /// An offloaded multi-get carrying the slot's `extra` gets too.
    Multi,
}

struct Slot {
    op: usize,
    /// The other requests of a multi-get.
    extra: Vec<usize>,
    gen: u32,
    stage: Stage,
    torn: u32,
    started: Instant,
    deadline: Instant,
}

struct RednPair {
    qps: [Qp; 2],
    buf: Mr,
}

struct Shard {
    /// Why requests to this shard fail at once (its registration left etcd's shard map).
    down: Option<String>,
    /// The shard map entry this connection was made through: its address and the revision
    /// of its registration.
    at: (SocketAddr, i64),
    qp: Qp,
    w: Welcome,
    /// `depth` slot buffers of `RPC_SLOT` bytes, then `depth` RPC receive buffers.
    buf: Mr,
    slots: Vec<Option<Slot>>,
    redn: Vec<RednPair>,
}

/// Bytes of an offloaded get's response buffer (one packet at the default MTU).
pub const OFFLOAD_REPLY_MAX: usize = 4096;
/// Most bytes of a multi-get request (an offload request is one packet).
const MULTI_GET_REQUEST_MAX: usize = 2048;

const KIND_READ: u64 = 1;
const KIND_OFFLOAD: u64 = 2;
const KIND_SEND: u64 = 3;
const KIND_RPC_RECV: u64 = 4;
const KIND_REDN_RECV: u64 = 5;

fn wr_id(kind: u64, shard: usize, slot: usize, gen: u32) -> u64 {
    kind << 60 | (shard as u64 & 0xfff) << 48 | (slot as u64 & 0xffff) << 32 | gen as u64
}
fn wr_fields(id: u64) -> (u64, usize, usize, u32) {
    (
        id >> 60,
        (id >> 48 & 0xfff) as usize,
        (id >> 32 & 0xffff) as usize,
        id as u32,
    )
}

/// A connected client (synchronous; see [`AsyncKvClient`] for the async API).
pub struct KvClient {
    ctx: Context,
    rt: tokio::runtime::Runtime,
    pd: Pd,
    cq: Cq,
    /// The shard map in etcd, followed by a watch (when the client was given it).
    map: Option<(crate::shardmap::EtcdMap, etcd_lite::PrefixView)>,
    /// When a shard registered at an address failed to reconnect: try again from then on.
    retry_at: Option<Instant>,
    shards: Vec<Shard>,
    cfg: ClientConfig,
    gen: u32,
    stats: ClientStats,
    msg: Vec<u8>,
    /// `flexns_kv_get_duration_seconds{path}` of the current get path (a handle, so no label is
    /// built per get; taken when the client is made, so serve metrics before making clients).
    get_latency: metrics::Histogram,
}

fn get_latency(p: GetPath) -> metrics::Histogram {
    metrics::histogram!("flexns_kv_get_duration_seconds", "path" => p.to_string())
}

fn connect_qp(rt: &tokio::runtime::Runtime, cm: SocketAddr, qp: &Qp, hello: &Hello) -> Result<Welcome, KvError> {
    let pd = serde_json::to_vec(hello).map_err(|e| KvError::Protocol(e.to_string()))?;
    let reply = rt.block_on(netstack::cm::connect(cm, qp, pd))?;
    serde_json::from_slice(&reply).map_err(|e| KvError::Protocol(format!("bad welcome from {cm}: {e}")))
}

/// Starts following the shard map in etcd and waits up to `wait` for it to be complete; the
/// view, every shard's address, and the revision of each shard's registration.
fn follow_map(
    map: &crate::shardmap::EtcdMap,
    wait: Duration,
) -> Result<(etcd_lite::PrefixView, Vec<SocketAddr>, Vec<i64>), KvError> {
    let mut view = etcd_lite::PrefixView::start(&map.endpoint, &map.shards_prefix())?;
    let until = Instant::now() + wait;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        let snap = view
            .wait_synced(left)
            .map_err(|e| KvError::Config(format!("etcd at {}: reading the shard map: {e}", map.endpoint)))?;
        match map.complete(&snap.entries) {
            Ok(addrs) => {
                let revs = (0..addrs.len() as u32)
                    .map(|i| snap.revisions.get(&map.shard_key(i)).copied().unwrap_or(0))
                    .collect();
                return Ok((view, addrs, revs));
            }
            Err(e) if Instant::now() >= until => return Err(e),
            Err(_) => {}
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Connects a new QP to the server at `cm`; the QP and the server's welcome.
fn hello(
    ctx: &Context,
    pd: &Pd,
    cq: &Cq,
    rt: &tokio::runtime::Runtime,
    cm: SocketAddr,
    depth: u32,
) -> Result<(Qp, Welcome), KvError> {
    let qp = ctx.create_qp(pd, cq, cq, QpInitAttr::default())?;
    let w = connect_qp(rt, cm, &qp, &Hello::Kv { depth })?;
    Ok((qp, w))
}

/// Refuses a server that is not shard `i` of `n`.
fn check_welcome(w: &Welcome, cm: SocketAddr, i: usize, n: usize) -> Result<(), KvError> {
    if w.shards as usize != n || w.shard as usize != i {
        return Err(KvError::Config(format!(
            "{cm} is shard {} of {}, named as shard {i} of {n}",
            w.shard, w.shards
        )));
    }
    Ok(())
}

/// Sets up shard `i` over a connected QP: its slot buffers, RPC receives and RedN pairs.
#[allow(clippy::too_many_arguments)]
fn open_shard(
    ctx: &Context,
    pd: &Pd,
    cq: &Cq,
    rt: &tokio::runtime::Runtime,
    cfg: &ClientConfig,
    i: usize,
    at: (SocketAddr, i64),
    qp: Qp,
    w: Welcome,
) -> Result<Shard, KvError> {
    let depth = cfg.depth as usize;
    let buf = pd.reg_mr(2 * depth * RPC_SLOT, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    for r in 0..depth.min(w.rpc_slots as usize) {
        qp.post_recv(RecvWr {
            wr_id: wr_id(KIND_RPC_RECV, i, r, 0),
            sg_list: [buf.sge((depth + r) * RPC_SLOT, RPC_SLOT)].into_iter().collect(),
        })?;
    }
    let mut redn = Vec::new();
    if cfg.get_path == GetPath::Redn {
        let entry = layout::class_len(w.geometry.redn_class);
        for s in 0..depth {
            let pair = rand_pair_id(i, s);
            let rbuf = pd.reg_mr(entry, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
            let mk = || ctx.create_qp(pd, cq, cq, QpInitAttr::default());
            let qps = [mk()?, mk()?];
            for (part, q) in qps.iter().enumerate() {
                for r in 0..4 {
                    q.post_recv(RecvWr {
                        wr_id: wr_id(KIND_REDN_RECV, i, s, r),
                        sg_list: Default::default(),
                    })?;
                }
                connect_qp(
                    rt,
                    at.0,
                    q,
                    &Hello::Redn {
                        conn: w.conn,
                        pair,
                        part: part as u8,
                        resp_addr: rbuf.addr(),
                        resp_rkey: rbuf.rkey(),
                    },
                )?;
            }
            redn.push(RednPair { qps, buf: rbuf });
        }
    }
    Ok(Shard {
        down: None,
        at,
        qp,
        w,
        buf,
        slots: (0..depth).map(|_| None).collect(),
        redn,
    })
}

impl KvClient {
    /// Connects to every shard over `ctx`'s stack (several clients may share one context).
    pub fn connect(ctx: &Context, cfg: ClientConfig) -> Result<KvClient, KvError> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let mut cfg = cfg;
        let mut revisions = Vec::new();
        let mut map = None;
        if cfg.servers.is_empty() {
            if let Some(e) = &cfg.etcd {
                let (view, servers, revs) = follow_map(e, Duration::from_secs(10))?;
                (cfg.servers, revisions, map) = (servers, revs, Some((e.clone(), view)));
            }
        }
        if cfg.servers.is_empty() {
            return Err(KvError::Config("no server address and no etcd shard map".into()));
        }
        if cfg.depth == 0 || cfg.depth > 64 {
            return Err(KvError::Config(format!("depth {} (1 to 64)", cfg.depth)));
        }
        let pd = ctx.alloc_pd();
        let cq = ctx.create_cq(64 * 1024)?;
        let mut servers = cfg.servers.clone();
        let mut shards: Vec<Shard> = Vec::new();
        let mut i = 0;
        while i < servers.len() {
            let (qp, w) = hello(ctx, &pd, &cq, &rt, servers[i], cfg.depth)?;
            if i == 0 && servers.len() == 1 && w.shards > 1 {
                if w.map.len() != w.shards as usize {
                    return Err(KvError::Config(format!(
                        "{} is shard {} of {} and knows no shard map: name every shard",
                        servers[0], w.shard, w.shards
                    )));
                }
                servers = w.map.clone();
                if w.shard != 0 {
                    continue; // start over at shard 0 (this QP is dropped)
                }
            }
            check_welcome(&w, servers[i], i, servers.len())?;
            let at = (servers[i], revisions.get(i).copied().unwrap_or(0));
            shards.push(open_shard(ctx, &pd, &cq, &rt, &cfg, i, at, qp, w)?);
            i += 1;
        }
        cfg.servers = servers;
        Ok(KvClient {
            ctx: ctx.clone(),
            rt,
            pd,
            cq,
            map,
            retry_at: None,
            shards,
            get_latency: get_latency(cfg.get_path),
            cfg,
            gen: 0,
            stats: ClientStats::default(),
            msg: Vec::new(),
        })
    }

    /// Applies what changed in etcd's shard map since the last request (nothing to do, and no
    /// system call, when nothing did): reconnects shards registered anew, marks shards whose
    /// registration is gone. Requests are all finished between calls, so no QP is in use.
    fn follow_shard_map(&mut self) {
        let Some((map, view)) = self.map.as_mut() else { return };
        let snap = match view.changed() {
            Some(s) => s,
            None if self.retry_at.is_some_and(|t| Instant::now() >= t) => view.current(),
            None => return,
        };
        if !snap.synced {
            return; // etcd out of reach: keep the connections there are
        }
        let map = map.clone();
        let (count, addrs) = map.parse(&snap.entries);
        if count.is_some_and(|n| n as usize != self.shards.len()) {
            tracing::warn!(
                "etcd's shard map now counts {count:?} shards, this client {}: keys would move; reconnect the client",
                self.shards.len()
            );
        }
        self.retry_at = None;
        for s in 0..self.shards.len() {
            let Some(&addr) = addrs.get(&(s as u32)) else {
                if self.shards[s].down.is_none() {
                    tracing::warn!("shard {s}: its registration left etcd's shard map (its server is gone)");
                    self.shards[s].down = Some(format!(
                        "shard {s} (was at {}): its registration in etcd expired or was removed",
                        self.shards[s].at.0
                    ));
                }
                continue;
            };
            let rev = snap.revisions.get(&map.shard_key(s as u32)).copied().unwrap_or(0);
            if self.shards[s].down.is_none() && self.shards[s].at == (addr, rev) {
                continue;
            }
            let shards = self.shards.len();
            let r = hello(&self.ctx, &self.pd, &self.cq, &self.rt, addr, self.cfg.depth).and_then(|(qp, w)| {
                check_welcome(&w, addr, s, shards)?;
                open_shard(
                    &self.ctx,
                    &self.pd,
                    &self.cq,
                    &self.rt,
                    &self.cfg,
                    s,
                    (addr, rev),
                    qp,
                    w,
                )
            });
            match r {
                Ok(sh) => {
                    tracing::info!("shard {s}: registered at {addr} (revision {rev}); reconnected");
                    self.shards[s] = sh;
                    self.cfg.servers[s] = addr;
                    self.stats.shard_moves += 1;
                }
                Err(e) => {
                    self.shards[s].down = Some(format!("shard {s} registered at {addr}: connecting: {e}"));
                    self.retry_at = Some(Instant::now() + Duration::from_millis(200));
                }
            }
        }
    }

    /// The number of shards.
    pub fn shards(&self) -> usize {
        self.shards.len()
    }
    /// This client's counters so far.
    pub fn stats(&self) -> ClientStats {
        self.stats
    }
    /// The configuration the client was connected with.
    pub fn config(&self) -> &ClientConfig {
        &self.cfg
    }
    /// Sets the get path (RedN needs its pairs, opened at connect with `get_path: Redn`).
    pub fn set_get_path(&mut self, p: GetPath) -> Result<(), KvError> {
        if p == GetPath::Redn && self.shards.iter().any(|s| s.redn.is_empty()) {
            return Err(KvError::Config(
                "RedN gets need a client connected with get_path redn".into(),
            ));
        }
        self.cfg.get_path = p;
        self.get_latency = get_latency(p);
        Ok(())
    }

    /// Gets `key` over the configured path.
    pub fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, KvError> {
        self.execute(vec![Op::Get(key.to_vec())]).pop().unwrap_or(Ok(None))
    }
    /// Inserts or updates `key`.
    pub fn put(&mut self, key: &[u8], value: &[u8]) -> Result<(), KvError> {
        self.execute(vec![Op::Put(key.to_vec(), value.to_vec())])
            .pop()
            .unwrap_or(Ok(None))
            .map(|_| ())
    }
    /// Deletes `key`; `Err(NotFound)` when it was absent.
    pub fn delete(&mut self, key: &[u8]) -> Result<(), KvError> {
        self.execute(vec![Op::Delete(key.to_vec())])
            .pop()
            .unwrap_or(Ok(None))
            .map(|_| ())
    }

    /// Runs a batch with up to `depth` requests in flight per shard; results in order (a get's
    /// value, `None` for a missing key and for writes).
    pub fn execute(&mut self, ops: Vec<Op>) -> Vec<Result<Option<Vec<u8>>, KvError>> {
        self.follow_shard_map();
        let mut results: Vec<Option<OpResult>> = (0..ops.len()).map(|_| None).collect();
        let mut queues: Vec<std::collections::VecDeque<usize>> = vec![Default::default(); self.shards.len()];
        for (i, op) in ops.iter().enumerate() {
            let k = op.key();
            if k.is_empty() || k.len() > layout::MAX_KEY {
                results[i] = Some(Err(KvError::BadKey(k.len())));
                continue;
            }
            let s = shard_of(k, self.shards.len() as u32) as usize;
            if let Some(why) = &self.shards[s].down {
                results[i] = Some(Err(KvError::Unavailable(why.clone())));
                continue;
            }
            queues[s].push_back(i);
        }
        let mut left = results.iter().filter(|r| r.is_none()).count();
        let mut wcs = [EMPTY_WC; 64];
        let mut multi_done = Vec::new();
        // requests a multi-get had no room for go alone next time
        let mut solo = vec![false; ops.len()];
        // when each get was issued: its latency goes to flexns_kv_get_duration_seconds{path}
        let mut issued: Vec<Option<Instant>> = vec![None; ops.len()];
        let latency = self.get_latency.clone();
        let observe = |issued: &[Option<Instant>], i: usize| {
            if let (Some(t), Op::Get(_)) = (issued[i], &ops[i]) {
                latency.record(t.elapsed().as_secs_f64());
            }
        };
        let mut idle_since = Instant::now();
        while left > 0 {
            // start what fits
            for (s, queue) in queues.iter_mut().enumerate() {
                while let Some(&i) = queue.front() {
                    let Some(slot) = self.shards[s].slots.iter().position(|x| x.is_none()) else {
                        break;
                    };
                    queue.pop_front();
                    let mut extra = Vec::new();
                    if self.cfg.get_path == GetPath::Offload && matches!(ops[i], Op::Get(_)) && !solo[i] {
                        let mut bytes = 2 + 2 + ops[i].key().len();
                        while let Some(&j) = queue.front() {
                            let fits = bytes + 2 + ops[j].key().len() <= MULTI_GET_REQUEST_MAX;
                            if extra.len() + 1 >= self.cfg.batch as usize
                                || !matches!(ops[j], Op::Get(_))
                                || solo[j]
                                || !fits
                            {
                                break;
                            }
                            bytes += 2 + ops[j].key().len();
                            extra.push(j);
                            queue.pop_front();
                        }
                    }
                    let now = Instant::now();
                    issued[i] = Some(now);
                    for &j in &extra {
                        issued[j] = Some(now);
                    }
                    let r = self.start(s, slot, i, &ops[i], extra).and_then(|_| {
                        if matches!(self.shards[s].slots[slot].as_ref().map(|x| x.stage), Some(Stage::Multi)) {
                            self.issue_multi(s, slot, &ops)
                        } else {
                            Ok(())
                        }
                    });
                    if let Err(e) = r {
                        if let Some(st) = self.shards[s].slots[slot].take() {
                            for j in st.extra {
                                results[j] = Some(Err(KvError::Protocol(e.to_string())));
                                left -= 1;
                            }
                        }
                        results[i] = Some(Err(e));
                        left -= 1;
                    }
                }
            }
            let n = self.cq.poll(&mut wcs);
            for wc in &wcs[..n] {
                let mut requeue = Vec::new();
                if self.complete_multi(wc, &mut multi_done, &mut requeue) {
                    for (i, r) in multi_done.drain(..) {
                        if results[i].is_none() {
                            observe(&issued, i);
                            results[i] = Some(r);
                            left -= 1;
                        }
                    }
                    for (s, i) in requeue {
                        solo[i] = true;
                        queues[s].push_front(i);
                    }
                    continue;
                }
                if let Some((i, r)) = self.complete(wc, &ops) {
                    if results[i].is_none() {
                        observe(&issued, i);
                        results[i] = Some(r);
                        left -= 1;
                    }
                }
            }
            if n > 0 {
                idle_since = Instant::now();
                continue;
            }
            // deadlines: RedN silence falls back, anything else times out
            let now = Instant::now();
            for s in 0..self.shards.len() {
                for slot in 0..self.shards[s].slots.len() {
                    let Some(st) = &self.shards[s].slots[slot] else {
                        continue;
                    };
                    let (i, stage, started, deadline) = (st.op, st.stage, st.started, st.deadline);
                    let extra = st.extra.clone();
                    if matches!(stage, Stage::Redn) && now > started + self.cfg.redn_timeout {
                        self.stats.fallbacks += 1;
                        if let Err(e) = self.fallback(s, slot, &ops[i]) {
                            self.shards[s].slots[slot] = None;
                            results[i] = Some(Err(e));
                            left -= 1;
                        }
                    } else if now > deadline {
                        self.shards[s].slots[slot] = None;
                        for j in std::iter::once(i).chain(extra) {
                            results[j] = Some(Err(KvError::Timeout(format!(
                                "no answer from shard {s} ({}) in {:?}",
                                self.cfg.servers.get(s).map(|a| a.to_string()).unwrap_or_default(),
                                self.cfg.timeout
                            ))));
                            left -= 1;
                        }
                    }
                }
            }
            if idle_since.elapsed() < Duration::from_micros(100) {
                std::thread::yield_now();
            } else {
                self.cq.wait(Duration::from_micros(500));
            }
        }
        results.into_iter().map(|r| r.unwrap_or(Ok(None))).collect()
    }

    fn next_gen(&mut self) -> u32 {
        self.gen = self.gen.wrapping_add(1);
        self.gen
    }

    fn start(&mut self, s: usize, slot: usize, i: usize, op: &Op, extra: Vec<usize>) -> Result<(), KvError> {
        let gen = self.next_gen();
        let now = Instant::now();
        let mut st = Slot {
            op: i,
            extra: Vec::new(),
            gen,
            stage: Stage::Rpc,
            torn: 0,
            started: now,
            deadline: now + self.cfg.timeout,
        };
        match op {
            Op::Get(_) if !extra.is_empty() => {
                self.stats.gets += 1 + extra.len() as u64;
                st.stage = Stage::Multi;
                st.extra = extra;
            }
            Op::Get(k) => {
                self.stats.gets += 1;
                st.stage = match self.cfg.get_path {
                    GetPath::A1 => Stage::Bucket {
                        b: layout::bucket_of(layout::key_word(k), self.shards[s].w.geometry.buckets),
                        skip: 0,
                    },
                    GetPath::Offload => Stage::Offload,
                    GetPath::Hybrid => Stage::Hybrid,
                    GetPath::Rpc => Stage::Rpc,
                    GetPath::Redn => Stage::Redn,
                };
            }
            _ => self.stats.writes += 1,
        }
        self.shards[s].slots[slot] = Some(st);
        if matches!(self.shards[s].slots[slot].as_ref().map(|x| x.stage), Some(Stage::Multi)) {
            return Ok(()); // posted by execute(), which has the other keys
        }
        self.issue(s, slot, op)
    }

    /// Posts a multi-get for a slot's requests.
    fn issue_multi(&mut self, s: usize, slot: usize, ops: &[Op]) -> Result<(), KvError> {
        let st = self.shards[s].slots[slot].as_ref().expect("slot in use");
        let keys: Vec<&[u8]> = std::iter::once(st.op)
            .chain(st.extra.iter().copied())
            .map(|j| ops[j].key())
            .collect();
        encode_multi_get(&mut self.msg, keys.into_iter());
        self.stats.get_round_trips += 1;
        let sh = &self.shards[s];
        sh.qp.post_offload(
            wr_id(KIND_OFFLOAD, s, slot, st.gen),
            OFFLOAD_MULTI_GET,
            &self.msg,
            sh.buf.sge(slot * RPC_SLOT, OFFLOAD_REPLY_MAX),
        )?;
        Ok(())
    }

    /// Handles the completion of a multi-get; false when `wc` is not one.
    fn complete_multi(&mut self, wc: &Wc, done: &mut Vec<Done>, requeue: &mut Vec<(usize, usize)>) -> bool {
        let (kind, s, slot, gen) = wr_fields(wc.wr_id);
        if kind != KIND_OFFLOAD || s >= self.shards.len() {
            return false;
        }
        let Some(st) = self.shards[s].slots.get(slot).and_then(|x| x.as_ref()) else {
            return false;
        };
        if st.gen != gen || !matches!(st.stage, Stage::Multi) {
            return false;
        }
        let st = self.shards[s].slots[slot].take().expect("checked above");
        let all: Vec<usize> = std::iter::once(st.op).chain(st.extra).collect();
        if wc.status != WcStatus::Success {
            for i in all {
                done.push((
                    i,
                    Err(KvError::Server(format!(
                        "shard {s}: multi-get completion {:?} (vendor error {})",
                        wc.status, wc.vendor_err
                    ))),
                ));
            }
            return true;
        }
        let mut b = vec![0u8; wc.byte_len as usize];
        self.shards[s].buf.read(slot * RPC_SLOT, &mut b);
        let mut at = 0;
        for i in all {
            let r = GetReply::decode(&b[at.min(b.len())..]);
            let Some(r) = r else {
                done.push((
                    i,
                    Err(KvError::Protocol("multi-get reply shorter than its keys".into())),
                ));
                continue;
            };
            let v = b.get(at + GET_REPLY_HEADER..at + GET_REPLY_HEADER + r.len as usize);
            at += GET_REPLY_HEADER + r.len as usize;
            match (r.status, v) {
                (GET_FOUND, Some(v)) => done.push((i, Ok(Some(v.to_vec())))),
                (GET_NOT_FOUND, _) => done.push((i, Ok(None))),
                (GET_NO_ROOM, _) => requeue.push((s, i)),
                (st, _) => done.push((i, Err(KvError::Protocol(format!("multi-get reply status {st}"))))),
            }
        }
        true
    }

    /// Posts the network operation of a slot's current stage.
    fn issue(&mut self, s: usize, slot: usize, op: &Op) -> Result<(), KvError> {
        let st = self.shards[s].slots[slot].as_ref().expect("issued slot is in use");
        let (stage, gen) = (st.stage, st.gen);
        let sh = &self.shards[s];
        let off = slot * RPC_SLOT;
        if matches!(op, Op::Get(_)) {
            self.stats.get_round_trips += 1;
        }
        let g = &sh.w.geometry;
        match stage {
            Stage::Bucket { b, .. } => {
                let wr = SendWr::new(wr_id(KIND_READ, s, slot, gen), WrOpcode::RdmaRead)
                    .sge(sh.buf.sge(off, BUCKET_LEN))
                    .remote(sh.w.region_addr + g.bucket_off(b), sh.w.rkey);
                sh.qp.post_send(wr)?;
            }
            Stage::Entry { .. } | Stage::Multi => unreachable!("entry READs and multi-gets are posted elsewhere"),
            Stage::Offload | Stage::Hybrid => {
                let opcode = if matches!(stage, Stage::Offload) {
                    OFFLOAD_GET
                } else {
                    OFFLOAD_HYBRID_GET
                };
                // a response buffer of one packet: a larger value is answered RESPONSE_TOO_LONG
                // and fetched over RPC (the reserved response PSNs count against the window)
                sh.qp.post_offload(
                    wr_id(KIND_OFFLOAD, s, slot, gen),
                    opcode,
                    op.key(),
                    sh.buf.sge(off, OFFLOAD_REPLY_MAX),
                )?;
            }
            Stage::Redn => {
                let k = op.key();
                let word = layout::key_word(k);
                if word & ((1 << 48) - 1) == 0 {
                    // cannot be in the mirror: straight to the offloaded get
                    return self.fallback(s, slot, op);
                }
                let base = sh.w.region_addr + g.mirror_off;
                let c = layout::mirror_candidates(word, g.mirror_buckets);
                let req = netstack::redn::programs::hash_get_request(word, gen, &[base + 16 * c[0], base + 16 * c[1]]);
                sh.buf.write(off, &req);
                let wr = SendWr::new(wr_id(KIND_SEND, s, slot, gen), WrOpcode::Send)
                    .sge(sh.buf.sge(off, req.len()))
                    .flags(SendFlags::INLINE | SendFlags::SIGNALED);
                sh.redn[slot].qps[0].post_send(wr)?;
            }
            Stage::Rpc => {
                let (rop, v): (RpcOp, &[u8]) = match op {
                    Op::Get(_) => (RpcOp::Get, &[]),
                    Op::Put(_, v) => (RpcOp::Put, v),
                    Op::Insert(_, v) => (RpcOp::Insert, v),
                    Op::Update(_, v) => (RpcOp::Update, v),
                    Op::Delete(_) => (RpcOp::Delete, &[]),
                };
                let id = (slot as u64) << 32 | gen as u64;
                encode_request(&mut self.msg, rop, id, op.key(), v);
                if self.msg.len() > RPC_SLOT {
                    return Err(KvError::TooLarge(v.len()));
                }
                sh.buf.write(off, &self.msg);
                let wr = SendWr::new(wr_id(KIND_SEND, s, slot, gen), WrOpcode::Send)
                    .sge(sh.buf.sge(off, self.msg.len()))
                    .flags(SendFlags::SIGNALED);
                sh.qp.post_send(wr)?;
            }
        }
        Ok(())
    }

    /// Re-issues a get as an offloaded get.
    fn fallback(&mut self, s: usize, slot: usize, op: &Op) -> Result<(), KvError> {
        let gen = self.next_gen();
        let st = self.shards[s].slots[slot].as_mut().expect("slot in use");
        st.stage = Stage::Offload;
        st.gen = gen;
        self.issue(s, slot, op)
    }

    fn finish(&mut self, s: usize, slot: usize) -> usize {
        self.shards[s].slots[slot].take().map(|st| st.op).unwrap_or(usize::MAX)
    }

    /// Handles one completion; returns a finished request's index and result.
    fn complete(&mut self, wc: &Wc, ops: &[Op]) -> Option<Done> {
        let (kind, s, slot, gen) = wr_fields(wc.wr_id);
        if s >= self.shards.len() {
            return None;
        }
        if kind == KIND_RPC_RECV {
            return self.complete_rpc(wc, s, slot, ops);
        }
        if kind == KIND_REDN_RECV {
            return self.complete_redn(wc, s, slot, ops);
        }
        let st = self.shards[s].slots.get(slot)?.as_ref()?;
        if st.gen != gen {
            return None; // a late completion of a request this slot already gave up on
        }
        let i = st.op;
        if kind == KIND_OFFLOAD
            && wc.status == WcStatus::RemOpErr
            && wc.vendor_err == netstack::transport::rc::offload::OffloadStatus::ResponseTooLong as u32
        {
            // a value larger than one packet: fetch it over RPC
            self.stats.fallbacks += 1;
            let gen = self.next_gen();
            let st = self.shards[s].slots[slot].as_mut()?;
            st.stage = Stage::Rpc;
            st.gen = gen;
            if let Err(e) = self.issue(s, slot, &ops[i]) {
                self.finish(s, slot);
                return Some((i, Err(e)));
            }
            return None;
        }
        if wc.status != WcStatus::Success {
            let e = KvError::Server(format!(
                "shard {s}: work completion {:?} (vendor error {})",
                wc.status, wc.vendor_err
            ));
            self.finish(s, slot);
            return Some((i, Err(e)));
        }
        match kind {
            KIND_SEND => None, // the answer comes as a receive
            KIND_READ => self.complete_read(s, slot, ops),
            KIND_OFFLOAD => {
                let sh = &self.shards[s];
                let mut b = vec![0u8; wc.byte_len as usize];
                sh.buf.read(slot * RPC_SLOT, &mut b);
                let r = self.offload_reply(s, slot, &b);
                r.map(|r| (i, r))
            }
            _ => None,
        }
    }

    fn offload_reply(&mut self, s: usize, slot: usize, b: &[u8]) -> Option<OpResult> {
        let bad = |m: &str| Some(Err(KvError::Protocol(format!("offloaded get reply: {m}"))));
        let Some(h) = GetReply::decode(b) else {
            self.finish(s, slot);
            return bad("shorter than its header");
        };
        let payload = &b[GET_REPLY_HEADER..];
        match h.status {
            GET_FOUND | GET_HOT if payload.len() == h.len as usize => {
                if h.status == GET_HOT {
                    self.stats.hot_hits += 1;
                    metrics::counter!("flexns_kv_hot_hits_total").increment(1);
                }
                self.finish(s, slot);
                Some(Ok(Some(payload.to_vec())))
            }
            GET_NOT_FOUND => {
                self.finish(s, slot);
                Some(Ok(None))
            }
            GET_ADDRESS if payload.len() == 8 && (h.len as usize) <= RPC_SLOT => {
                // read the entry at the address the engine gave
                let inc = u64::from_le_bytes(payload.try_into().unwrap_or_default()) as u16;
                let gen = self.next_gen();
                let sh = &mut self.shards[s];
                let st = sh.slots[slot].as_mut()?;
                st.gen = gen;
                st.stage = Stage::Entry {
                    b: u64::MAX,
                    skip: 0,
                    inc: Some(inc),
                    len: h.len as usize,
                };
                let wr = SendWr::new(wr_id(KIND_READ, s, slot, gen), WrOpcode::RdmaRead)
                    .sge(sh.buf.sge(slot * RPC_SLOT, h.len as usize))
                    .remote(sh.w.region_addr + h.arg, sh.w.rkey);
                self.stats.get_round_trips += 1;
                if let Err(e) = sh.qp.post_send(wr) {
                    self.finish(s, slot);
                    return Some(Err(e.into()));
                }
                None
            }
            st => {
                self.finish(s, slot);
                bad(&format!(
                    "status {st}, {} payload bytes for length {}",
                    payload.len(),
                    h.len
                ))
            }
        }
    }

    fn complete_read(&mut self, s: usize, slot: usize, ops: &[Op]) -> Option<Done> {
        let st = self.shards[s].slots[slot].as_ref()?;
        let (i, stage) = (st.op, st.stage);
        let key = ops[i].key();
        let word = layout::key_word(key);
        let sh = &self.shards[s];
        let g = sh.w.geometry;
        let off = slot * RPC_SLOT;
        let next = match stage {
            Stage::Bucket { b, skip } => {
                let mut bucket = [0u8; BUCKET_LEN];
                sh.buf.read(off, &mut bucket);
                match layout::scan_bucket(&bucket, word, skip) {
                    Scan::Absent => {
                        self.finish(s, slot);
                        return Some((i, Ok(None)));
                    }
                    Scan::Next(n) if n >= g.buckets && n < g.buckets + g.overflow => Stage::Bucket { b: n, skip: 0 },
                    Scan::Next(n) => {
                        self.finish(s, slot);
                        return Some((i, Err(KvError::Corrupt(format!("bad overflow link {n}")))));
                    }
                    Scan::Entry { offset, class, inc } => {
                        let len = layout::class_len(class);
                        if offset + len as u64 > g.data_len || len > RPC_SLOT {
                            self.finish(s, slot);
                            return Some((i, Err(KvError::Corrupt(format!("entry {offset:#x} out of range")))));
                        }
                        let gen = self.next_gen();
                        let sh = &mut self.shards[s];
                        let st = sh.slots[slot].as_mut()?;
                        st.gen = gen;
                        st.stage = Stage::Entry {
                            b,
                            skip,
                            inc: Some(inc),
                            len,
                        };
                        let wr = SendWr::new(wr_id(KIND_READ, s, slot, gen), WrOpcode::RdmaRead)
                            .sge(sh.buf.sge(off, len))
                            .remote(sh.w.region_addr + g.entry_off(offset), sh.w.rkey);
                        self.stats.get_round_trips += 1;
                        if let Err(e) = sh.qp.post_send(wr) {
                            self.finish(s, slot);
                            return Some((i, Err(e.into())));
                        }
                        return None;
                    }
                }
            }
            Stage::Entry { b, skip, inc, len } => {
                let mut e = vec![0u8; len];
                self.shards[s].buf.read(off, &mut e);
                match layout::validate(&e, key, inc) {
                    Ok(v) => {
                        let v = v.value.to_vec();
                        self.finish(s, slot);
                        return Some((i, Ok(Some(v))));
                    }
                    Err(Invalid::Moved) if b != u64::MAX && Some(layout::entry_inc(&e)) == inc => {
                        Stage::Bucket { b, skip: skip + 1 }
                    }
                    Err(_) => {
                        self.stats.torn += 1;
                        metrics::counter!("flexns_kv_torn_rereads_total", "path" => self.cfg.get_path.to_string())
                            .increment(1);
                        let st = self.shards[s].slots[slot].as_mut()?;
                        st.torn += 1;
                        if b == u64::MAX || st.torn > self.cfg.max_torn {
                            self.stats.fallbacks += 1;
                            if let Err(e) = self.fallback(s, slot, &ops[i]) {
                                self.finish(s, slot);
                                return Some((i, Err(e)));
                            }
                            return None;
                        }
                        Stage::Bucket {
                            b: layout::bucket_of(word, g.buckets),
                            skip: 0,
                        }
                    }
                }
            }
            _ => return None,
        };
        let gen = self.next_gen();
        let st = self.shards[s].slots[slot].as_mut()?;
        st.gen = gen;
        st.stage = next;
        if let Err(e) = self.issue(s, slot, &ops[i]) {
            self.finish(s, slot);
            return Some((i, Err(e)));
        }
        None
    }

    fn complete_rpc(&mut self, wc: &Wc, s: usize, rslot: usize, ops: &[Op]) -> Option<Done> {
        let depth = self.shards[s].slots.len();
        if wc.status != WcStatus::Success {
            return None;
        }
        let sh = &self.shards[s];
        let off = (depth + rslot) * RPC_SLOT;
        let mut b = vec![0u8; wc.byte_len as usize];
        sh.buf.read(off, &mut b);
        let _ = sh.qp.post_recv(RecvWr {
            wr_id: wc.wr_id,
            sg_list: [sh.buf.sge(off, RPC_SLOT)].into_iter().collect(),
        });
        let (status, id, payload) = decode_reply(&b)?;
        let (slot, gen) = ((id >> 32) as usize, id as u32);
        let st = self.shards[s].slots.get(slot)?.as_ref()?;
        if st.gen != gen {
            return None;
        }
        let i = self.finish(s, slot);
        let r = match status {
            RPC_OK if payload.is_empty() && !matches!(ops[i], Op::Get(_)) => Ok(None),
            RPC_OK => Ok(Some(payload.to_vec())),
            RPC_NOT_FOUND if matches!(ops[i], Op::Get(_)) => Ok(None),
            RPC_NOT_FOUND => Err(KvError::NotFound),
            RPC_EXISTS => Err(KvError::Exists),
            _ => Err(KvError::Server(String::from_utf8_lossy(payload).into_owned())),
        };
        Some((i, r))
    }

    fn complete_redn(&mut self, wc: &Wc, s: usize, slot: usize, ops: &[Op]) -> Option<Done> {
        let sh = &self.shards[s];
        let pair = sh.redn.get(slot)?;
        // keep a receive posted on the QP that took this one
        let q = pair.qps.iter().find(|q| q.qp_num() == wc.qp_num)?;
        let _ = q.post_recv(RecvWr {
            wr_id: wc.wr_id,
            sg_list: Default::default(),
        });
        if wc.status != WcStatus::Success {
            return None;
        }
        let st = sh.slots.get(slot)?.as_ref()?;
        if !matches!(st.stage, Stage::Redn) || wc.imm_data != Some(st.gen) {
            return None; // an answer to a request this slot already gave up on
        }
        let i = st.op;
        let mut e = vec![0u8; pair.buf.len()];
        pair.buf.read(0, &mut e);
        match layout::validate(&e, ops[i].key(), None) {
            Ok(v) => {
                let v = v.value.to_vec();
                self.finish(s, slot);
                Some((i, Ok(Some(v))))
            }
            Err(_) => {
                // torn (the chain's WRITE raced an update) or a stale mirror bucket
                self.stats.torn += 1;
                self.stats.fallbacks += 1;
                if let Err(e) = self.fallback(s, slot, &ops[i]) {
                    self.finish(s, slot);
                    return Some((i, Err(e)));
                }
                None
            }
        }
    }
}

impl Drop for KvClient {
    /// Says goodbye to every shard (the server frees the connection and its RedN pairs at
    /// once instead of waiting for its keepalive to find the client gone).
    fn drop(&mut self) {
        let mut msg = Vec::new();
        encode_request(&mut msg, RpcOp::Bye, 0, &[], &[]);
        let mut sent = 0;
        for (s, sh) in self.shards.iter().enumerate() {
            let off = 0; // slot 0's buffer: nothing is in flight any more
            sh.buf.write(off, &msg);
            let wr = SendWr::new(wr_id(KIND_SEND, s, 0, u32::MAX), WrOpcode::Send)
                .sge(sh.buf.sge(off, msg.len()))
                .flags(SendFlags::SIGNALED);
            if sh.qp.post_send(wr).is_ok() {
                sent += 1;
            }
        }
        // wait briefly for the goodbyes to be acknowledged (they are a courtesy)
        let until = Instant::now() + Duration::from_millis(200);
        let mut wcs = [EMPTY_WC; 16];
        while sent > 0 && Instant::now() < until {
            let n = self.cq.poll(&mut wcs);
            sent -= wcs[..n]
                .iter()
                .filter(|w| wr_fields(w.wr_id).3 == u32::MAX && wr_fields(w.wr_id).0 == KIND_SEND)
                .count();
            if n == 0 {
                self.cq.wait(Duration::from_millis(5));
            }
        }
    }
}

fn rand_pair_id(shard: usize, slot: usize) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_usize(shard);
    h.write_usize(slot);
    h.finish() // RandomState's keys are random: ids of different clients do not collide
}

type Pending = (Op, tokio::sync::oneshot::Sender<Result<Option<Vec<u8>>, KvError>>);

/// The async API: a driver thread owns a [`KvClient`] and runs whatever requests concurrent
/// tasks have submitted as one pipelined batch, so many tasks share the connections and their
/// requests travel together.
#[derive(Clone)]
pub struct AsyncKvClient {
    tx: std::sync::mpsc::Sender<Pending>,
}

impl AsyncKvClient {
    /// Connects (blocking; call from `spawn_blocking` or before the runtime starts) and starts
    /// the driver thread.
    pub fn connect(ctx: &Context, cfg: ClientConfig) -> Result<AsyncKvClient, KvError> {
        let mut c = KvClient::connect(ctx, cfg)?;
        let (tx, rx) = std::sync::mpsc::channel::<Pending>();
        std::thread::Builder::new().name("kv-client".into()).spawn(move || {
            while let Ok(first) = rx.recv() {
                let mut batch = vec![first];
                while let Ok(p) = rx.try_recv() {
                    batch.push(p);
                }
                let (ops, replies): (Vec<Op>, Vec<_>) = batch.into_iter().unzip();
                for (r, tx) in c.execute(ops).into_iter().zip(replies) {
                    let _ = tx.send(r);
                }
            }
        })?;
        Ok(AsyncKvClient { tx })
    }

    /// Runs one request.
    pub async fn call(&self, op: Op) -> Result<Option<Vec<u8>>, KvError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.tx
            .send((op, tx))
            .map_err(|_| KvError::Protocol("client driver stopped".into()))?;
        rx.await
            .map_err(|_| KvError::Protocol("client driver stopped".into()))?
    }
    /// Gets `key`'s value (`None` when absent), batched with other concurrent calls.
    pub async fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, KvError> {
        self.call(Op::Get(key.to_vec())).await
    }
    /// Puts (inserts or updates) `key`, batched with other concurrent calls.
    pub async fn put(&self, key: &[u8], value: &[u8]) -> Result<(), KvError> {
        self.call(Op::Put(key.to_vec(), value.to_vec())).await.map(|_| ())
    }
    /// Deletes `key`, batched with other concurrent calls.
    pub async fn delete(&self, key: &[u8]) -> Result<(), KvError> {
        self.call(Op::Delete(key.to_vec())).await.map(|_| ())
    }
}
