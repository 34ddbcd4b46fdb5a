//! The storage node (`block-server`): volumes in one directory (a [`VolumeStore`] each) served
//! over Solar on UDP, and over the plain block protocol on TCP ([`crate::tcp_proto`]: whole
//! requests, no Solar layer), the agent's `--transport tcp` reference.
//!
//! Threads: Solar is served by a netstack context's data core (a [`SolarService`]: the engine's
//! batched sockets and polling, the sans-IO [`SolarServer`] owned by the core), which calls
//! the node's storage handler: reads are answered on the core (the store reads from the page
//! cache and checks each block's CRC); a write is queued on the core for the store's next
//! group commit ([`VolumeStore::submit_blocks`]: its record joins the batch, nobody waits
//! for it), and the first write of a group asks the pool of writer threads for a leader,
//! which appends the batch to the log, `fdatasync`s it once and finishes every write of it
//! (the core sends their answers). So a group costs one wake-up of a writer, not one per
//! write. TCP connections get a reader thread each: a WRITE request's blocks are queued the
//! same way (one group commit; its leader writes the answer), a READ is answered by the
//! reader. Answers go out from whichever thread finished the work. After a restart every volume's block versions seed the Solar server, so a write
//! retransmitted from before the crash still cannot overtake a newer one.
//!
//! Identity: a node is its data directory. The directory holds a node id (`node-id`, drawn at
//! the first start) and a lock file, so one process at a time serves it; the node registers
//! under that id wherever it listens, and the controller and agents follow it to a new address.

use crate::episode::{Episode, Logged, SUMMARY_EVERY as EPISODE_SUMMARY_EVERY};
use crate::store::{read_base, Base, StoreError, VolumeStore};
use crate::tcp_proto;
use netstack::transport::solar::server::SolarServer;
use netstack::transport::solar::wire::{Status, BLOCK};
use netstack::verbs::solar::{ReadAnswer, ReadBlocks, SolarService, StorageHandler, WriteBlock, WriteDone};
use netstack::verbs::{Context, ContextConfig, PollMode};
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Settings of a storage node.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// Where the volumes live.
    pub dir: PathBuf,
    /// UDP (Solar) and TCP (the same packets on a stream) address; port 0 picks one.
    pub listen: SocketAddr,
    /// Threads making writes durable (more waiting writers share each log sync).
    pub write_threads: usize,
    /// A volume's log is checkpointed when it passes this many bytes.
    pub log_limit: u64,
    /// How the Solar data core waits for work.
    pub poll_mode: PollMode,
}

impl NodeConfig {
    /// Defaults for `dir` on 127.0.0.1, any port.
    pub fn new(dir: impl Into<PathBuf>) -> NodeConfig {
        NodeConfig {
            dir: dir.into(),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            write_threads: 16,
            log_limit: 256 << 20,
            poll_mode: PollMode::Sleep,
        }
    }
}

/// Errors of the storage node.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The listen address is not a concrete IPv4 address.
    #[error("listen address {0}: must be a concrete IPv4 address (Solar's engine binds it)")]
    NotIpv4(SocketAddr),
    /// The Solar engine could not start on the address (why).
    #[error("starting the Solar engine on {0}: {1}")]
    Engine(SocketAddr, String),
    /// An I/O operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The block store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A volume with this id already exists.
    #[error("volume {0} already exists")]
    Exists(u32),
    /// No volume has this id.
    #[error("volume {0} does not exist")]
    NoVolume(u32),
    /// The volume size is not a positive multiple of 4096 bytes.
    #[error("volume size must be a positive multiple of 4096 bytes, not {0}")]
    Size(u64),
    /// The data directory (its path) is locked by another storage node process.
    #[error("{0} is in use by another storage node process (its lock is held)")]
    Locked(PathBuf),
    /// The node id file (its path) holds no valid node id (what it holds).
    #[error("node id file {0}: {1:?} is not a node id")]
    BadId(PathBuf, String),
    /// The volume (first) has no snapshot with this id (second).
    #[error("volume {0} has no snapshot {1}")]
    NoSnapshot(u32, u32),
    /// The operation would break a clone that reads through to its target.
    #[error("{what} is refused: clone volume {clone} reads through to it; delete the clone first")]
    InUse {
        /// The refused operation.
        what: String,
        /// The clone volume that reads through.
        clone: u32,
    },
}

/// The name of the file holding a node's id in its data directory.
pub const NODE_ID_FILE: &str = "node-id";

/// Whether `s` has the form of a node id (what [`NODE_ID_FILE`] holds, and what the
/// controller records replicas by): `sn-` and 16 lowercase hex digits.
pub fn is_node_id(s: &str) -> bool {
    s.len() == 19 && s.starts_with("sn-") && s[3..].bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Takes the directory's lock (held while the returned file is open).
fn lock_dir(dir: &Path) -> Result<std::fs::File, NodeError> {
    let p = dir.join("LOCK");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&p)
        .map_err(io(format!("opening {}", p.display())))?;
    match f.try_lock() {
        Ok(()) => Ok(f),
        Err(std::fs::TryLockError::WouldBlock) => Err(NodeError::Locked(dir.to_path_buf())),
        Err(std::fs::TryLockError::Error(e)) => Err(io(format!("locking {}", p.display()))(e)),
    }
}

/// The directory's node id, drawn and stored durably (written, synced, renamed, directory
/// synced) at the first start.
fn node_id(dir: &Path) -> Result<String, NodeError> {
    let p = dir.join(NODE_ID_FILE);
    match std::fs::read_to_string(&p) {
        Ok(s) => {
            let id = s.trim().to_string();
            if !is_node_id(&id) {
                return Err(NodeError::BadId(p, id));
            }
            return Ok(id);
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(format!("reading {}", p.display()))(e)),
    }
    let mut r = [0u8; 8];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut r))
        .map_err(io("reading /dev/urandom"))?;
    let id = format!("sn-{:016x}", u64::from_le_bytes(r));
    let tmp = dir.join(format!("{NODE_ID_FILE}.tmp"));
    let err = |what: &str| io(format!("{what} {}", tmp.display()));
    {
        let mut f = std::fs::File::create(&tmp).map_err(err("creating"))?;
        f.write_all(format!("{id}\n").as_bytes()).map_err(err("writing"))?;
        f.sync_all().map_err(err("syncing"))?;
    }
    std::fs::rename(&tmp, &p).map_err(io(format!("renaming to {}", p.display())))?;
    crate::store::sync_dir(dir).map_err(io(format!("syncing {}", dir.display())))?;
    Ok(id)
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> NodeError {
    let what = what.into();
    move |source| NodeError::Io { what, source }
}

/// Counters of a node's plain-TCP side (Solar's packets are the engine's counters, its
/// requests the Solar server's).
#[derive(Debug, Default)]
pub struct NodeCounters {
    /// Requests received over TCP.
    pub packets_in: AtomicU64,
    /// Replies sent over TCP.
    pub packets_out: AtomicU64,
    /// Malformed request headers received (each closes its connection).
    pub malformed: AtomicU64,
    /// TCP connections accepted.
    pub tcp_connections: AtomicU64,
}

/// Work for the writer pool. Data writes are queued for the store's group commit
/// ([`Inner::submit_write`]); zeroing (TRIM, WRITE_ZEROES) is made durable by a writer.
enum WriteJob {
    /// A Solar ZERO write: `count` blocks from `lba`.
    SolarZero {
        volume: u32,
        lba: u64,
        count: u32,
        rpc: u64,
        done: WriteDone,
    },
    /// A WRITE_ZEROES request of the TCP protocol (it carries no payload).
    TcpZero {
        conn: Arc<Mutex<TcpStream>>,
        req: tcp_proto::Header,
    },
    /// Lead the group commits of a store's queued writes ([`VolumeStore::lead_commits`]).
    Lead(Arc<VolumeStore>),
}

struct Inner {
    dir: PathBuf,
    id: String,
    /// Held while the node runs: one process per data directory.
    _lock: std::fs::File,
    log_limit: u64,
    volumes: RwLock<HashMap<u32, Arc<VolumeStore>>>,
    /// The Solar server on the node's engine core (set once it starts; taken at the stop).
    solar: Mutex<Option<SolarService>>,
    /// The write halves of the TCP connections (shut down when the node stops).
    tcp_conns: Mutex<Vec<Arc<Mutex<TcpStream>>>>,
    writes: Mutex<Option<mpsc::Sender<WriteJob>>>,
    stop: AtomicBool,
    counters: NodeCounters,
    refusals: Arc<Refusals>,
}

/// A running storage node; dropping it stops its threads.
pub struct StorageNode {
    inner: Arc<Inner>,
    addr: SocketAddr,
    threads: Vec<JoinHandle<()>>,
}

/// The status answering a request the store refused. A failed store
/// ([`StoreError::Poisoned`]) answers `IoError` to everything (`NoSpace` when it failed
/// because its file system is full, so the NBD client sees `ENOSPC`): the agent counts a
/// write that fails so as a failed replica (down: later writes skip it, the resync catches it
/// up once it takes writes again) and reads elsewhere.
fn store_status(e: &StoreError) -> Status {
    match e {
        StoreError::OutOfRange { .. } => Status::OutOfRange,
        StoreError::BadCrc { .. } => Status::CrcError,
        e if e.is_no_space() => Status::NoSpace,
        _ => Status::IoError,
    }
}

/// Refused writes of a node, logged once per failure episode ([`crate::episode`]): a 64 KiB
/// write is 16 block writes, each refused, and a full disk refuses every one. Its total is
/// `flexns_storage_refused_writes_total`.
#[derive(Default)]
struct Refusals(Episode);

impl Refusals {
    /// Counts a refused write `e` and logs it if it starts an episode (a failed store's
    /// refusals: at debug, it logged its failure once) or is due for a summary.
    fn failed(&self, e: &StoreError, now: Instant) -> Logged {
        let logged = self.0.fail(now);
        match logged {
            Logged::First if matches!(e, StoreError::Poisoned { .. }) => tracing::debug!("{e}"),
            Logged::First => tracing::warn!("{e} (later refusals are counted until a write succeeds)"),
            Logged::Summary(n) => tracing::warn!(
                "{n} writes refused in the last {} s or more; the latest: {e}",
                EPISODE_SUMMARY_EVERY.as_secs()
            ),
            Logged::Counted => {}
        }
        logged
    }

    /// A write succeeded: ends a failure episode, with one line for the refusals it counted.
    /// Returns that count (None when no episode was on).
    fn succeeded(&self) -> Option<u64> {
        let n = self.0.end()?;
        if n > 0 {
            tracing::warn!("writes succeed again; {n} more were refused since the last line");
        } else {
            tracing::info!("writes succeed again");
        }
        Some(n)
    }
}

impl StorageNode {
    /// Opens every volume in `cfg.dir` (replaying their logs) and starts serving.
    pub fn start(cfg: NodeConfig) -> Result<StorageNode, NodeError> {
        let listen = match cfg.listen {
            SocketAddr::V4(a) if !a.ip().is_unspecified() => a,
            _ => return Err(NodeError::NotIpv4(cfg.listen)),
        };
        if !cfg.dir.is_dir() {
            std::fs::create_dir_all(&cfg.dir).map_err(io(format!("creating {}", cfg.dir.display())))?;
            if let Some(parent) = cfg.dir.parent().filter(|p| !p.as_os_str().is_empty()) {
                crate::store::sync_dir(parent).map_err(io(format!("syncing {}", parent.display())))?;
            }
        }
        let lock = lock_dir(&cfg.dir)?;
        let id = node_id(&cfg.dir)?;
        let (ctx, addr, tcp) = bind_pair(listen, cfg.poll_mode)?;
        let mut solar = SolarServer::new();
        let mut volumes = HashMap::new();
        // ascending ids: a clone's base, an older volume, is open before the clone
        for vol in list_volume_ids(&cfg.dir)? {
            let base = match read_base(&cfg.dir, vol)? {
                None => None,
                Some((v, snapshot)) => Some(Base {
                    store: volumes.get(&v).cloned().ok_or(NodeError::NoVolume(v))?,
                    snapshot,
                }),
            };
            let store = VolumeStore::open_with(&cfg.dir, vol, cfg.log_limit, base)?;
            observe(&store, &id, vol);
            for (lba, v) in store.versions()? {
                solar.note_version(vol, lba, v);
            }
            solar.fence(vol, store.fenced_at());
            tracing::info!("volume {vol}: {} blocks", store.blocks());
            volumes.insert(vol, Arc::new(store));
        }
        let volumes: HashMap<u32, Arc<VolumeStore>> = volumes;
        let (tx, rx) = mpsc::channel::<WriteJob>();
        let inner = Arc::new(Inner {
            dir: cfg.dir.clone(),
            id: id.clone(),
            _lock: lock,
            log_limit: cfg.log_limit,
            volumes: RwLock::new(volumes),
            solar: Mutex::new(None),
            tcp_conns: Mutex::new(Vec::new()),
            writes: Mutex::new(Some(tx)),
            stop: AtomicBool::new(false),
            counters: NodeCounters::default(),
            refusals: Arc::default(),
        });
        let weak: std::sync::Weak<dyn netstack::telemetry::Collect> = Arc::downgrade(&inner) as _;
        netstack::telemetry::register(weak);
        let mut threads = Vec::new();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..cfg.write_threads.max(1) {
            let (inner, rx) = (inner.clone(), rx.clone());
            threads.push(spawn(format!("bs-write-{i}"), move || writer(&inner, &rx))?);
        }
        let handler = Arc::new(Handler(Arc::downgrade(&inner)));
        let service = ctx
            .solar_server(solar, handler)
            .map_err(|e| NodeError::Engine(addr, e.to_string()))?;
        *inner.solar.lock() = Some(service);
        tcp.set_nonblocking(true).map_err(io("TCP listener"))?;
        let i3 = inner.clone();
        threads.push(spawn("bs-accept".into(), move || accept_loop(&i3, tcp))?);
        tracing::info!(
            "block server {id} on {addr} (UDP Solar and TCP), volumes in {}",
            cfg.dir.display()
        );
        Ok(StorageNode { inner, addr, threads })
    }

    /// The UDP and TCP address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The node's stable id (kept in its data directory).
    pub fn id(&self) -> &str {
        &self.inner.id
    }

    /// Creates a volume of `bytes` bytes (a multiple of 4096).
    pub fn create_volume(&self, id: u32, bytes: u64) -> Result<(), NodeError> {
        if bytes == 0 || !bytes.is_multiple_of(BLOCK as u64) {
            return Err(NodeError::Size(bytes));
        }
        let mut v = self.inner.volumes.write();
        if v.contains_key(&id) {
            return Err(NodeError::Exists(id));
        }
        let store = VolumeStore::create(&self.inner.dir, id, bytes / BLOCK as u64, self.inner.log_limit)?;
        observe(&store, &self.inner.id, id);
        v.insert(id, Arc::new(store));
        Ok(())
    }

    /// Creates volume `id` as a clone of snapshot `snapshot` of volume `parent` (of its
    /// size): usable at once, its unwritten blocks read through to the snapshot.
    pub fn create_clone(&self, id: u32, parent: u32, snapshot: u32) -> Result<(), NodeError> {
        let mut v = self.inner.volumes.write();
        if v.contains_key(&id) {
            return Err(NodeError::Exists(id));
        }
        let store = v.get(&parent).cloned().ok_or(NodeError::NoVolume(parent))?;
        if store.snapshot_blocks(snapshot).is_none() {
            return Err(NodeError::NoSnapshot(parent, snapshot));
        }
        let base = Base { store, snapshot };
        let clone = VolumeStore::create_clone(&self.inner.dir, id, self.inner.log_limit, base)?;
        observe(&clone, &self.inner.id, id);
        v.insert(id, Arc::new(clone));
        Ok(())
    }

    /// The clone of `parent` (of its snapshot `snapshot` when given) that exists, if any.
    fn clone_of(v: &HashMap<u32, Arc<VolumeStore>>, parent: u32, snapshot: Option<u32>) -> Option<u32> {
        v.iter()
            .filter_map(|(&id, s)| Some((id, s.base()?)))
            .find(|&(_, (p, s))| p == parent && snapshot.is_none_or(|x| x == s))
            .map(|(id, _)| id)
    }

    /// Takes snapshot `snapshot` of volume `id`: every write this node acknowledged before
    /// the call is in it, none after (the agent holds the volume's writes off meanwhile, so
    /// every replica's snapshot holds the same writes).
    pub fn snapshot(&self, id: u32, snapshot: u32) -> Result<(), NodeError> {
        let store = self.store(id).ok_or(NodeError::NoVolume(id))?;
        store.snapshot(snapshot)?;
        Ok(())
    }

    /// Deletes snapshot `snapshot` of volume `id` (refused while a clone reads through to it).
    pub fn delete_snapshot(&self, id: u32, snapshot: u32) -> Result<(), NodeError> {
        let v = self.inner.volumes.read();
        let store = v.get(&id).cloned().ok_or(NodeError::NoVolume(id))?;
        if let Some(clone) = Self::clone_of(&v, id, Some(snapshot)) {
            return Err(NodeError::InUse {
                what: format!("deleting snapshot {snapshot} of volume {id}"),
                clone,
            });
        }
        if store.snapshot_blocks(snapshot).is_none() {
            return Err(NodeError::NoSnapshot(id, snapshot));
        }
        drop(v);
        store.delete_snapshot(snapshot)?;
        Ok(())
    }

    /// Deletes a volume and its files with its snapshots (refused while a clone of it exists).
    pub fn delete_volume(&self, id: u32) -> Result<(), NodeError> {
        let mut v = self.inner.volumes.write();
        if let Some(clone) = Self::clone_of(&v, id, None) {
            return Err(NodeError::InUse {
                what: format!("deleting volume {id}"),
                clone,
            });
        }
        let store = v.remove(&id).ok_or(NodeError::NoVolume(id))?;
        drop(v);
        drop(store);
        VolumeStore::remove(&self.inner.dir, id)?;
        Ok(())
    }

    /// Fences volume `id` at attachment epoch `epoch` (see [`VolumeStore::fence`]): kept in
    /// its store, and in effect for Solar and TCP requests when this returns. The fence in
    /// effect.
    pub async fn fence(&self, id: u32, epoch: u32) -> Result<u32, NodeError> {
        let store = self
            .inner
            .volumes
            .read()
            .get(&id)
            .cloned()
            .ok_or(NodeError::NoVolume(id))?;
        let fence = tokio::task::spawn_blocking(move || store.fence(epoch))
            .await
            .map_err(|e| NodeError::Engine(self.addr, e.to_string()))??;
        let service = self.inner.solar.lock().as_ref().map(|s| s.fence(id, fence));
        if let Some(f) = service {
            f.await.map_err(|e| NodeError::Engine(self.addr, e.to_string()))?;
        }
        Ok(fence)
    }

    /// Grows a volume to `bytes` bytes.
    pub fn resize_volume(&self, id: u32, bytes: u64) -> Result<(), NodeError> {
        if bytes == 0 || !bytes.is_multiple_of(BLOCK as u64) {
            return Err(NodeError::Size(bytes));
        }
        let store = self.store(id).ok_or(NodeError::NoVolume(id))?;
        store.grow(bytes / BLOCK as u64)?;
        Ok(())
    }

    /// `(id, blocks)` of every volume.
    pub fn volumes(&self) -> Vec<(u32, u64)> {
        let mut v: Vec<_> = self
            .inner
            .volumes
            .read()
            .iter()
            .map(|(&i, s)| (i, s.blocks()))
            .collect();
        v.sort();
        v
    }

    /// A volume's store (tests and tools: corrupting a block, reading stats).
    pub fn store(&self, id: u32) -> Option<Arc<VolumeStore>> {
        self.inner.volumes.read().get(&id).cloned()
    }

    /// The node's counters.
    pub fn counters(&self) -> &NodeCounters {
        &self.inner.counters
    }

    /// The Solar server's counters (refreshed every few milliseconds by its core).
    pub fn solar_stats(&self) -> netstack::transport::solar::server::ServerStats {
        self.inner.solar.lock().as_ref().map(|s| s.stats()).unwrap_or_default()
    }
}

impl Drop for StorageNode {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::SeqCst);
        // stop serving Solar first: no new writes reach the pool
        self.inner.solar.lock().take();
        self.inner.writes.lock().take();
        for p in self.inner.tcp_conns.lock().iter() {
            let _ = p.lock().shutdown(std::net::Shutdown::Both);
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The Solar engine's context (its UDP socket) and the TCP listener (the plain protocol) on
/// one address. With port 0 the kernel picks the UDP port, which a TCP socket (an outgoing
/// connection's ephemeral port) may hold already: then another pair is tried.
fn bind_pair(listen: SocketAddrV4, poll_mode: PollMode) -> Result<(Context, SocketAddr, TcpListener), NodeError> {
    let mut tries = 0;
    loop {
        let ctx = Context::open(ContextConfig {
            bind: listen,
            data_cores: 1,
            path_ports: 1,
            poll_mode,
            ..ContextConfig::default()
        })
        .map_err(|e| NodeError::Engine(listen.into(), e.to_string()))?;
        let addr = SocketAddr::V4(ctx.local_addr());
        match TcpListener::bind(addr) {
            Ok(tcp) => return Ok((ctx, addr, tcp)),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && listen.port() == 0 && tries < 32 => tries += 1,
            Err(e) => return Err(io(format!("binding TCP {addr}"))(e)),
        }
    }
}

fn spawn(name: String, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>, NodeError> {
    std::thread::Builder::new()
        .name(name.clone())
        .spawn(f)
        .map_err(io(format!("starting thread {name}")))
}

/// Volume ids found in `dir` (files `vol-ID.data`).
fn list_volume_ids(dir: &Path) -> Result<Vec<u32>, NodeError> {
    let mut ids = Vec::new();
    for e in std::fs::read_dir(dir).map_err(io(format!("listing {}", dir.display())))? {
        let e = e.map_err(io(format!("listing {}", dir.display())))?;
        let name = e.file_name();
        let name = name.to_string_lossy();
        if let Some(id) = name.strip_prefix("vol-").and_then(|r| r.strip_suffix(".data")) {
            if let Ok(id) = id.parse() {
                ids.push(id);
            }
        }
    }
    ids.sort();
    Ok(ids)
}

impl Inner {
    /// Whether volume `volume` is fenced above `epoch` (its requests are refused).
    fn fenced_out(&self, volume: u32, epoch: u32) -> bool {
        self.volumes.read().get(&volume).is_some_and(|s| epoch < s.fenced_at())
    }

    /// Queues a durable write of `blocks` (data, CRC32C) at `lba` of `volume`: `done` gets the
    /// status to answer, on the writer thread that leads its group commit (no thread waits
    /// per write), or at once when it is refused. A group's first write asks the writer pool
    /// for a leader.
    fn submit_write(
        &self,
        volume: u32,
        lba: u64,
        blocks: &[(&[u8], u32)],
        version: u64,
        done: impl FnOnce(Status) + Send + 'static,
    ) {
        let Some(store) = self.volumes.read().get(&volume).cloned() else {
            return done(Status::NoVolume);
        };
        let refusals = self.refusals.clone();
        let status = move |r: Result<(), StoreError>| {
            done(match r {
                Ok(()) => {
                    refusals.succeeded();
                    Status::Ok
                }
                Err(e) => {
                    refusals.failed(&e, Instant::now());
                    store_status(&e)
                }
            })
        };
        if store.submit_blocks(lba, blocks, version, Box::new(status))
            && self_send(self, WriteJob::Lead(store.clone())).is_err()
        {
            // the pool is gone (the node stops): commit here, so every write is answered
            store.lead_commits();
        }
    }

    /// Zeroes (deallocates) blocks of a volume durably; the status to answer.
    fn store_zero(&self, volume: u32, lba: u64, count: u64, version: u64) -> Status {
        let store = self.volumes.read().get(&volume).cloned();
        match store {
            None => Status::NoVolume,
            Some(s) => match s.write_zeroes(lba, count, version) {
                Ok(()) => {
                    self.refusals.succeeded();
                    Status::Ok
                }
                Err(e) => {
                    self.refusals.failed(&e, Instant::now());
                    store_status(&e)
                }
            },
        }
    }

    /// Reads blocks of a volume into `out` (appended), each checked against its stored CRC;
    /// the status to answer (nothing appended unless Ok).
    fn store_read(&self, volume: u32, lba: u64, blocks: u32, out: &mut Vec<u8>) -> Status {
        let Some(store) = self.volumes.read().get(&volume).cloned() else {
            return Status::NoVolume;
        };
        let start = out.len();
        for k in 0..blocks as u64 {
            match store.read(lba + k) {
                Ok((data, _, _)) => out.extend_from_slice(&data),
                Err(e) => {
                    if matches!(e, StoreError::Corrupt { .. }) {
                        tracing::error!("{e}");
                    }
                    out.truncate(start);
                    return store_status(&e);
                }
            }
        }
        Status::Ok
    }
}

/// The node's storage behind its Solar server, called on the engine core. It holds the node
/// weakly: the core holds the handler, and the node holds the core's context.
struct Handler(std::sync::Weak<Inner>);

impl StorageHandler for Handler {
    fn write(&self, b: WriteBlock<'_>, done: WriteDone) {
        let Some(inner) = self.0.upgrade() else { return };
        if !b.zero {
            // queued from the core; the group commit's leader answers it
            inner.submit_write(b.volume, b.lba, &[(b.data, b.crc)], b.rpc, move |st| done.finish(st));
            return;
        }
        let job = WriteJob::SolarZero {
            volume: b.volume,
            lba: b.lba,
            count: b.count,
            rpc: b.rpc,
            done,
        };
        // a stopping node drops the job: its unfinished answer says Busy
        let _ = self_send(&inner, job);
    }

    fn read(&self, r: ReadBlocks, answer: &mut ReadAnswer<'_>) {
        let Some(inner) = self.0.upgrade() else { return };
        let store = inner.volumes.read().get(&r.volume).cloned();
        for k in 0..r.count {
            let Some(s) = &store else {
                answer.failed(k, Status::NoVolume);
                continue;
            };
            match s.read(r.lba + k as u64) {
                Ok((data, crc, _)) => answer.block(k, Arc::<[u8]>::from(data), 0, crc),
                Err(e) => {
                    if matches!(e, StoreError::Corrupt { .. }) {
                        tracing::error!("{e}");
                    }
                    answer.failed(k, store_status(&e));
                }
            }
        }
    }
}

fn writer(inner: &Inner, rx: &Mutex<mpsc::Receiver<WriteJob>>) {
    loop {
        let job = rx.lock().recv();
        let Ok(j) = job else { return };
        match j {
            WriteJob::SolarZero {
                volume,
                lba,
                count,
                rpc,
                done,
            } => done.finish(inner.store_zero(volume, lba, count.max(1) as u64, rpc)),
            WriteJob::TcpZero { conn, req } => {
                let status = inner.store_zero(req.volume, req.lba, req.blocks as u64, req.version);
                // a failed answer is a closed connection: its reader sees it
                let _ = conn.lock().write_all(&req.reply(status).encode());
            }
            WriteJob::Lead(store) => store.lead_commits(),
        }
    }
}

fn accept_loop(inner: &Arc<Inner>, l: TcpListener) {
    let mut next = 1u64;
    let mut readers = Vec::new();
    while !inner.stop.load(Ordering::Relaxed) {
        match l.accept() {
            Ok((s, from)) => {
                let _ = s.set_nodelay(true);
                let _ = s.set_nonblocking(false);
                let Ok(w) = s.try_clone() else { continue };
                let w = Arc::new(Mutex::new(w));
                inner.tcp_conns.lock().push(w.clone());
                inner.counters.tcp_connections.fetch_add(1, Ordering::Relaxed);
                tracing::debug!("TCP agent {from} connected");
                let i2 = inner.clone();
                if let Ok(t) = spawn(format!("bs-tcp-{next}"), move || tcp_reader(&i2, s, w)) {
                    readers.push(t);
                }
                next += 1;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => tracing::debug!("accept: {e}"),
        }
    }
    for t in readers {
        let _ = t.join();
    }
}

/// Serves one connection of the plain block protocol: WRITE requests go to the writer pool,
/// READs are answered here; a malformed header closes the connection (a byte stream cannot be
/// resynchronised), other connections are not affected.
fn tcp_reader(inner: &Inner, s: TcpStream, w: Arc<Mutex<TcpStream>>) {
    let mut r = std::io::BufReader::with_capacity(256 << 10, s);
    let mut hdr = [0u8; tcp_proto::HDR];
    let mut out = Vec::new();
    loop {
        if r.read_exact(&mut hdr).is_err() {
            break;
        }
        inner.counters.packets_in.fetch_add(1, Ordering::Relaxed);
        let req = match tcp_proto::Header::decode(&hdr) {
            Ok(h) => h,
            Err(e) => {
                inner.counters.malformed.fetch_add(1, Ordering::Relaxed);
                tracing::warn!("TCP block request: {e}; closing the connection");
                break;
            }
        };
        if inner.fenced_out(req.volume, req.epoch) {
            // refused before it touches anything; a WRITE's blocks are read past
            let skip = req.payload(false) as u64;
            if std::io::copy(&mut (&mut r).take(skip), &mut std::io::sink()).ok() != Some(skip) {
                break;
            }
            if w.lock().write_all(&req.reply(Status::WrongEpoch).encode()).is_err() {
                break;
            }
            continue;
        }
        if req.op == tcp_proto::WRITE {
            // queued as the Solar path queues its blocks: the leader of its group commit
            // answers (the same store path for both, so the reference is as strong)
            let mut data = vec![0u8; req.payload(false)];
            if r.read_exact(&mut data).is_err() {
                break;
            }
            let blocks: Vec<(&[u8], u32)> = data.chunks(BLOCK).map(|b| (b, crc32c::crc32c(b))).collect();
            let conn = w.clone();
            inner.submit_write(req.volume, req.lba, &blocks, req.version, move |st| {
                // a failed answer is a closed connection: its reader sees it
                let _ = conn.lock().write_all(&req.reply(st).encode());
            });
        } else if req.op == tcp_proto::WRITE_ZEROES {
            let job = WriteJob::TcpZero { conn: w.clone(), req };
            if self_send(inner, job).is_err() {
                let _ = w.lock().write_all(&req.reply(Status::Busy).encode());
            }
        } else {
            out.clear();
            out.extend_from_slice(&[0u8; tcp_proto::HDR]);
            let st = inner.store_read(req.volume, req.lba, req.blocks, &mut out);
            out[..tcp_proto::HDR].copy_from_slice(&req.reply(st).encode());
            if w.lock().write_all(&out).is_err() {
                break;
            }
        }
        inner.counters.packets_out.fetch_add(1, Ordering::Relaxed);
    }
    let _ = w.lock().shutdown(std::net::Shutdown::Both);
    inner.tcp_conns.lock().retain(|c| !Arc::ptr_eq(c, &w));
}

/// Hands a write to the writer pool (an error when the node is stopping).
fn self_send(inner: &Inner, job: WriteJob) -> Result<(), ()> {
    match inner.writes.lock().as_ref() {
        Some(tx) => tx.send(job).map_err(|_| ()),
        None => Err(()),
    }
}

/// Has `store` (volume `volume` of node `node`) record its log syncs' durations in
/// `flexns_store_log_sync_duration_seconds`.
fn observe(store: &VolumeStore, node: &str, volume: u32) {
    store.observe_log_syncs(metrics::histogram!(
        "flexns_store_log_sync_duration_seconds",
        "node" => node.to_string(),
        "volume" => volume.to_string()
    ));
}

/// The storage node's metrics, copied once a second: packets, malformed input, the Solar
/// server's counters, and per volume (`volume` label) writes, log syncs, checkpoints, reads
/// and whether its store failed (`flexns_store_failed`: 1 once a log or checkpoint write or
/// sync failed and it refuses all I/O, see [`StoreError::Poisoned`]).
impl netstack::telemetry::Collect for Inner {
    fn collect(&self) {
        use metrics::{counter, gauge};
        let node = self.id.clone();
        let c = |name: &'static str, v: u64| counter!(name, "node" => node.clone()).absolute(v);
        let k = &self.counters;
        // Solar's packets are the engine's: its datagrams, malformed ones (the engine's and
        // the Solar server's) and send errors, beside the TCP side's
        let (es, sv) = match &*self.solar.lock() {
            Some(s) => (s.context().stats(), s.stats()),
            None => Default::default(),
        };
        c(
            "flexns_storage_packets_received_total",
            k.packets_in.load(Ordering::Relaxed) + es.rx_datagrams,
        );
        c(
            "flexns_storage_packets_sent_total",
            k.packets_out.load(Ordering::Relaxed) + es.tx_packets,
        );
        c(
            "flexns_storage_malformed_packets_total",
            k.malformed.load(Ordering::Relaxed) + es.rx_malformed + sv.malformed,
        );
        c("flexns_storage_send_errors_total", es.tx_errors);
        c("flexns_storage_refused_writes_total", self.refusals.0.total());
        c("flexns_solar_server_writes_total", sv.writes);
        c("flexns_solar_server_reads_total", sv.reads);
        c("flexns_solar_server_crc_errors_total", sv.crc_errors);
        c("flexns_solar_server_stale_dropped_total", sv.stale_dropped);
        // address validation (netstack::transport::solar::validation)
        let l = |name: &'static str, key: &'static str, vals: &[(&'static str, u64)]| {
            for &(value, v) in vals {
                counter!(name, "node" => node.clone(), key => value).absolute(v);
            }
        };
        let (held, dropped) = (sv.held_packets, sv.dropped_unvalidated);
        let (held_bytes, dropped_bytes) = (sv.held_bytes, sv.dropped_unvalidated_bytes);
        let challenges = [
            ("sent", sv.challenges_sent),
            ("validated", sv.peers_validated),
            ("bad_reply", sv.bad_challenge_replies),
        ];
        l("flexns_solar_server_challenges_total", "result", &challenges);
        l(
            "flexns_solar_server_unvalidated_answers_total",
            "action",
            &[("held", held), ("dropped", dropped)],
        );
        l(
            "flexns_solar_server_unvalidated_bytes_total",
            "action",
            &[("held", held_bytes), ("dropped", dropped_bytes)],
        );
        let requests = [("refused", sv.refused_peers), ("unserved", sv.unserved_reads)];
        l("flexns_solar_server_unvalidated_requests_total", "action", &requests);
        c("flexns_solar_server_pending_evictions_total", sv.evicted_peers);
        let vols: Vec<(u32, Arc<VolumeStore>)> = self.volumes.read().iter().map(|(k, v)| (*k, v.clone())).collect();
        for (id, store) in vols {
            let st = store.stats();
            let v = |name: &'static str, x: u64| {
                counter!(name, "node" => node.clone(), "volume" => id.to_string()).absolute(x)
            };
            v("flexns_store_writes_total", st.writes);
            v("flexns_store_log_syncs_total", st.syncs);
            v("flexns_store_checkpoints_total", st.checkpoints);
            v("flexns_store_reads_total", st.reads);
            v("flexns_store_corrupt_reads_total", st.corrupt_reads);
            gauge!("flexns_store_size_bytes", "node" => node.clone(), "volume" => id.to_string())
                .set((store.blocks() * BLOCK as u64) as f64);
            gauge!("flexns_store_failed", "node" => node.clone(), "volume" => id.to_string())
                .set(if store.poisoned().is_some() { 1.0 } else { 0.0 });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::LinkError;
    use crate::nbd::proto::{EIO, ENOSPC};
    use crate::tcp_proto::{Header, WRITE};
    use crate::volume::VolumeError;
    use netstack::transport::solar::client::IoError;

    /// What the NBD client sees when a storage node refuses a write with `e`: the node's
    /// status, through a TCP reply header on the wire, the agent's link and volume errors.
    fn nbd_error_for(e: &StoreError) -> u32 {
        let req = Header {
            op: WRITE,
            flags: 0,
            status: 0,
            volume: 1,
            blocks: 16,
            id: 5,
            lba: 0,
            version: 1,
            epoch: 0,
        };
        let wire = req.reply(store_status(e)).encode();
        let st = Header::decode(&wire).unwrap().status();
        let addr: SocketAddr = "127.0.0.1:7000".parse().unwrap();
        let v = VolumeError::Replica {
            volume: 1,
            replica: 0,
            source: LinkError::Io(addr, IoError::Status(st, 0)),
        };
        crate::nbd::server::errno(&v)
    }

    #[test]
    fn enospc_reaches_the_nbd_client_as_enospc() {
        let full = StoreError::Io {
            volume: 1,
            what: "appending to the log".into(),
            source: std::io::Error::from_raw_os_error(libc::ENOSPC),
        };
        assert_eq!(store_status(&full), Status::NoSpace);
        assert_eq!(nbd_error_for(&full), ENOSPC);
        let poisoned = StoreError::Poisoned {
            volume: 1,
            cause: full.to_string(),
            no_space: true,
        };
        assert_eq!(
            nbd_error_for(&poisoned),
            ENOSPC,
            "a store poisoned by ENOSPC answers ENOSPC"
        );
        let eio = StoreError::Io {
            volume: 1,
            what: "syncing the log".into(),
            source: std::io::Error::from_raw_os_error(libc::EIO),
        };
        assert_eq!(nbd_error_for(&eio), EIO);
        let poisoned = StoreError::Poisoned {
            volume: 1,
            cause: eio.to_string(),
            no_space: false,
        };
        assert_eq!(nbd_error_for(&poisoned), EIO);
    }

    #[test]
    fn refused_writes_log_once_per_episode() {
        let r = Refusals::default();
        let e = StoreError::Io {
            volume: 1,
            what: "appending to the log".into(),
            source: std::io::Error::from_raw_os_error(libc::ENOSPC),
        };
        let t0 = Instant::now();
        assert_eq!(r.succeeded(), None, "no episode yet");
        // a 64 KiB write: 16 block writes refused, one line
        let logged: Vec<Logged> = (0..16).map(|_| r.failed(&e, t0)).collect();
        assert_eq!(logged[0], Logged::First);
        assert!(logged[1..].iter().all(|l| *l == Logged::Counted), "{logged:?}");
        assert_eq!(r.succeeded(), Some(15), "the success ends the episode with its count");
        assert_eq!(r.succeeded(), None);
        // a long episode: a summary every EPISODE_SUMMARY_EVERY
        assert_eq!(r.failed(&e, t0), Logged::First);
        assert_eq!(r.failed(&e, t0 + Duration::from_secs(1)), Logged::Counted);
        assert_eq!(r.failed(&e, t0 + EPISODE_SUMMARY_EVERY), Logged::Summary(2));
        assert_eq!(r.failed(&e, t0 + EPISODE_SUMMARY_EVERY), Logged::Counted);
        assert_eq!(r.succeeded(), Some(1));
        assert_eq!(r.0.total(), 20, "every refusal is counted");
    }

    /// A store on a real full file system (a 1 MiB tmpfs): the write that hits ENOSPC, and
    /// every request after it (the store is poisoned), answer `NoSpace`.
    #[test]
    fn a_store_on_a_full_tmpfs_answers_no_space() {
        const TEST: &str = "storage_node::tests::a_store_on_a_full_tmpfs_answers_no_space";
        // SAFETY: geteuid has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            test_support::skip(TEST, test_support::Missing::Root, "mounting a tmpfs needs root");
            return;
        }
        let dir = std::env::temp_dir().join(format!("blk-enospc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"])
            .arg(&dir)
            .status()
            .unwrap();
        assert!(mounted.success(), "mount -t tmpfs on {}", dir.display());
        struct Unmount(std::path::PathBuf);
        impl Drop for Unmount {
            fn drop(&mut self) {
                let _ = std::process::Command::new("umount").arg(&self.0).status();
                let _ = std::fs::remove_dir(&self.0);
            }
        }
        let _u = Unmount(dir.clone());
        let store = VolumeStore::create(&dir, 1, 4096, 64 << 20).unwrap();
        let data = vec![0x5au8; BLOCK];
        let crc = crc32c::crc32c(&data);
        let mut failed = None;
        for lba in 0..4096u64 {
            if let Err(e) = store.write(lba, &data, crc, lba + 1) {
                failed = Some((lba, e));
                break;
            }
        }
        let (lba, e) = failed.expect("a 1 MiB file system fills before 16 MiB of writes");
        assert!(lba > 0, "some writes fit: {e}");
        assert_eq!(store_status(&e), Status::NoSpace, "the write that filled it: {e}");
        let after = store.write(0, &data, crc, 10_000).unwrap_err();
        assert!(matches!(after, StoreError::Poisoned { .. }), "{after}");
        assert_eq!(store_status(&after), Status::NoSpace, "later requests: {after}");
    }
}
