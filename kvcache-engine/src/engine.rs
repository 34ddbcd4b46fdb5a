//! [`TransferEngine`]: one per process, named; registers memory, opens peers' segments and
//! moves data between them in batches of READ/WRITE requests (the Mooncake Transfer Engine
//! model, see the crate docs).

use crate::batch::*;
use crate::memory::{LocalBuffer, Memory};
use crate::metadata::MetaStore;
use crate::segment::{Location, SegmentDesc};
use crate::transport::flexns::{FlexAcceptor, FlexCfg, FlexnsPath};
use crate::transport::tcp::{self, TcpPath};
use crate::transport::{encode_notify, Notifies, Slice};
use crate::{EngineConfig, MetadataConfig, TransferError, TransportKind};
use netstack::mem::{Access, Region};
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// Batches up to this many bytes are completed by the waiting caller itself.
const SMALL_BATCH_BYTES: u64 = 256 << 10;

/// While alive, the completion thread leaves the CQ to the caller waiting on it.
struct SpinGuard<'a>(&'a Arc<FlexnsPath>);

impl Drop for SpinGuard<'_> {
    fn drop(&mut self) {
        self.0.spin_end();
    }
}

/// A batch handle from [`TransferEngine::allocate_batch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BatchId(pub u64);

enum Transport {
    Flexns(Arc<FlexnsPath>),
    Tcp(TcpPath),
}

struct OpenSegment {
    name: String,
    desc: SegmentDesc,
}

struct Inner {
    cfg: EngineConfig,
    name: String,
    instance: u64,
    rt: tokio::runtime::Runtime,
    memory: Arc<Memory>,
    notifies: Arc<Notifies>,
    transport: Transport,
    /// Shared with the lease keep-alive task (which must never hold `Inner`, whose runtime it
    /// runs on, across an await).
    meta: Arc<MetaStore>,
    desc: Arc<RwLock<SegmentDesc>>,
    segments: Mutex<HashMap<u64, OpenSegment>>,
    next_seg: AtomicU64,
    batches: Mutex<HashMap<u64, Arc<Batch>>>,
    next_batch: AtomicU64,
    /// Descriptor publications (metadata store writes) and memory registrations so far: what
    /// [`TransferEngine::publications`] and [`TransferEngine::registrations`] report.
    publications: AtomicU64,
    registrations: AtomicU64,
    stop: AtomicBool,
    shutdown: Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
}

/// The transfer engine. `Send + Sync`: share it behind an `Arc`; dropping it withdraws its
/// descriptor from the metadata store and closes its ports.
pub struct TransferEngine {
    inner: Arc<Inner>,
}

fn advertise(cfg: &EngineConfig) -> Ipv4Addr {
    if let Some(ip) = cfg.advertise_ip {
        return ip;
    }
    if let Some(ip) = cfg.bind_ip.filter(|ip| !ip.is_unspecified()) {
        return ip;
    }
    if cfg.metadata == MetadataConfig::Embedded {
        return Ipv4Addr::LOCALHOST;
    }
    crate::netaddr::pick_remote_advertise()
}

impl TransferEngine {
    /// Starts an engine: binds its RPC and data ports, publishes its (empty) segment.
    pub fn new(cfg: EngineConfig) -> Result<TransferEngine, TransferError> {
        cfg.validate()?;
        let instance = rand::random::<u64>() | 1;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvc-rpc")
            .enable_all()
            .build()?;
        let adv = advertise(&cfg);
        let bind = cfg.bind_ip.unwrap_or(adv);
        let listener = rt
            .block_on(tokio::net::TcpListener::bind((bind, cfg.rpc_port)))
            .map_err(|e| TransferError::Io(format!("rpc_port: binding {bind}:{}: {e}", cfg.rpc_port)))?;
        let rpc = SocketAddr::new(adv.into(), listener.local_addr()?.port());
        let name = match cfg.metadata {
            MetadataConfig::P2p => rpc.to_string(),
            _ => cfg.name.clone(),
        };
        let memory = Arc::new(Memory::default());
        let notifies = Arc::new(Notifies::new(cfg.transport.as_str()));
        let (transport, data) = match cfg.transport {
            TransportKind::Flexns => {
                let mut sc = cfg.stack_or_default();
                sc.bind = SocketAddrV4::new(bind, sc.bind.port());
                sc.data_cores = cfg.data_cores;
                sc.extra_addrs = cfg.extra_addrs.clone();
                let pairs = 1 + cfg.extra_addrs.len();
                // a sprayed QP gets spare source ports: a path that looks cut moves to one (a
                // fresh ECMP hash), as nsperf's and the block agent's do
                let need = cfg.paths.div_ceil(pairs);
                let ports = if cfg.paths > 1 {
                    netstack::path::with_spares(need)
                } else {
                    need
                };
                sc.path_ports = sc.path_ports.max(ports.min(64) as u8);
                let ctx = netstack::verbs::Context::open(sc)?;
                let fc = FlexCfg {
                    name: name.clone(),
                    instance,
                    qps_per_peer: cfg.qps_per_peer,
                    paths: cfg.paths,
                    spray: cfg.spray,
                    in_flight: cfg.slices_in_flight,
                    attempts: cfg.slice_attempts,
                    unused_qp_timeout: cfg.unused_qp_timeout,
                };
                let p = FlexnsPath::new(ctx, fc, notifies.clone(), rt.handle().clone())?;
                p.start_threads()?;
                (Transport::Flexns(p), None)
            }
            TransportKind::Tcp => {
                let sh = tcp::Shared {
                    name: name.clone(),
                    memory: memory.clone(),
                    notifies: notifies.clone(),
                    instance,
                    stop: AtomicBool::new(false),
                    malformed: AtomicU64::new(0),
                    peers: Mutex::new(HashMap::new()),
                };
                let t = TcpPath::start(
                    SocketAddr::new(bind.into(), 0),
                    sh,
                    cfg.tcp_lanes,
                    cfg.slices_in_flight,
                    cfg.slice_attempts,
                )?;
                let data = SocketAddr::new(adv.into(), t.data_addr().port());
                (Transport::Tcp(t), Some(data))
            }
        };
        let desc = Arc::new(RwLock::new(SegmentDesc {
            name: name.clone(),
            transport: cfg.transport,
            rpc,
            data,
            instance,
            version: 0,
            buffers: Vec::new(),
        }));
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        // the connection manager's door: QPs per call and per caller capped, QPs that never
        // receive a packet reaped (a sweep every quarter of the timeout, beside the server)
        let limits = cfg.door_limits();
        let (acceptor, sweeper) = match &transport {
            Transport::Flexns(p) => {
                let acc = Arc::new(FlexAcceptor(p.clone()));
                let (svc, stats) = netstack::cm::service_with(acc.clone(), limits);
                (Some(svc), Some(netstack::cm::sweep_periodically(acc, limits, stats)))
            }
            Transport::Tcp(_) => (None, None),
        };
        let svc = crate::rpc::pb::transfer_rpc_server::TransferRpcServer::new(crate::rpc::DescService(desc.clone()));
        rt.spawn(async move {
            let sweeper = sweeper.map(tokio::spawn);
            let incoming = netstack::cm::incoming(listener);
            let (stop, stopped) = tokio::sync::oneshot::channel();
            let serve = tonic::transport::Server::builder()
                .add_service(svc)
                .add_optional_service(acceptor)
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = rx.await;
                    let _ = stop.send(());
                });
            let r = netstack::cm::drain_bounded(serve, stopped).await;
            if let Some(s) = sweeper {
                s.abort();
            }
            if let Err(e) = r {
                tracing::error!("transfer engine RPC server: {e}");
            }
        });
        let meta = Arc::new(MetaStore::new(&cfg.metadata, cfg.lease_ttl));
        let inner = Arc::new(Inner {
            cfg,
            name,
            instance,
            rt,
            memory,
            notifies,
            transport,
            meta,
            desc,
            segments: Mutex::new(HashMap::new()),
            next_seg: AtomicU64::new(1),
            batches: Mutex::new(HashMap::new()),
            next_batch: AtomicU64::new(1),
            publications: AtomicU64::new(0),
            registrations: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            shutdown: Mutex::new(Some(tx)),
        });
        let engine = TransferEngine { inner };
        engine.publish()?;
        let w = Arc::downgrade(&engine.inner);
        std::thread::Builder::new()
            .name("kvc-timeouts".into())
            .spawn(move || expire_loop(w))?;
        tracing::info!(
            "transfer engine {} ({}) at {} ({})",
            engine.inner.name,
            engine.inner.cfg.transport,
            rpc,
            engine.inner.meta.describe()
        );
        Ok(engine)
    }

    /// This engine's segment name (`IP:RPC_PORT` in P2P mode): what peers open.
    pub fn segment_name(&self) -> &str {
        &self.inner.name
    }

    /// The advertised RPC address (connection manager, descriptors).
    pub fn rpc_addr(&self) -> SocketAddr {
        self.inner.desc.read().rpc
    }

    /// The transport this engine was configured with (the one every transfer uses).
    pub fn transport(&self) -> TransportKind {
        self.inner.cfg.transport
    }

    /// The descriptor this engine publishes.
    pub fn local_descriptor(&self) -> SegmentDesc {
        self.inner.desc.read().clone()
    }

    /// The flexns stack's counters (`None` with tcp): packets and bytes, and what the
    /// same-host path moved (`same_host_copy_bytes` through a mapping of the peer's memory,
    /// `same_host_cma_bytes` by CMA, `same_host_ops`) for requests this engine made.
    pub fn stack_stats(&self) -> Option<netstack::verbs::StatsSnapshot> {
        match &self.inner.transport {
            Transport::Flexns(p) => Some(p.stack_stats()),
            Transport::Tcp(_) => None,
        }
    }

    /// Malformed frames the tcp transport received and dropped (0 with flexns).
    pub fn malformed_frames(&self) -> u64 {
        match &self.inner.transport {
            Transport::Tcp(t) => t.malformed(),
            Transport::Flexns(_) => 0,
        }
    }

    /// The most requests one tcp lane of this process had in flight at once (the lanes
    /// pipeline up to `slices_in_flight`); 0 while no tcp transport has sent anything.
    pub fn tcp_peak_in_flight() -> usize {
        crate::transport::tcp::TcpPath::peak_in_flight()
    }

    fn publish(&self) -> Result<(), TransferError> {
        let d = self.inner.desc.read().clone();
        self.inner.publications.fetch_add(1, Ordering::Relaxed);
        self.inner.rt.block_on(self.inner.meta.publish(&d))
    }

    /// How many times this engine has published its descriptor to the metadata store (at
    /// start, and once per registration or unregistration of remotely accessible memory, or
    /// per [`TransferEngine::register_memory_batch`]).
    pub fn publications(&self) -> u64 {
        self.inner.publications.load(Ordering::Relaxed)
    }

    /// How many memory regions this engine has registered (each a memory region with the
    /// stack's protection domain under the flexns transport).
    pub fn registrations(&self) -> u64 {
        self.inner.registrations.load(Ordering::Relaxed)
    }

    fn republish_buffers(&self) -> Result<(), TransferError> {
        {
            let mut d = self.inner.desc.write();
            d.buffers = self.inner.memory.descs();
            d.version += 1;
        }
        self.publish()
    }

    /// Allocates `len` zeroed bytes of host memory and registers them (remotely accessible).
    pub fn allocate_memory(&self, len: usize, location: Location) -> Result<Arc<Region>, TransferError> {
        // a same-host peer on the shm link maps it: one copy per transfer; attached to flexnsd,
        // the daemon maps it (a memfd whatever the size)
        let r = Arc::new(if self.inner.cfg.stack_or_default().flexnsd.is_some() {
            Region::alloc_shared(len)
                .map_err(|e| TransferError::Config(format!("allocating {len} bytes for flexnsd: {e}")))?
        } else {
            Region::alloc_shareable(len)
        });
        self.register_memory(r.clone(), location)?;
        Ok(r)
    }

    /// Registers a buffer for transfers and publishes it for remote access; returns its address
    /// (requests name memory by virtual address, as in Mooncake).
    pub fn register_memory(&self, region: Arc<Region>, location: Location) -> Result<u64, TransferError> {
        self.register(region, location, true)
    }

    /// Registers several buffers for remote access and publishes the descriptor once for all
    /// of them (Mooncake's `registerLocalMemoryBatch`); returns their addresses. On an error
    /// none of them stays registered and nothing is published.
    pub fn register_memory_batch(&self, regions: Vec<(Arc<Region>, Location)>) -> Result<Vec<u64>, TransferError> {
        let mut done = Vec::with_capacity(regions.len());
        for (region, location) in regions {
            match self.register_unpublished(region, location, true) {
                Ok(a) => done.push(a),
                Err(e) => {
                    for a in done {
                        self.inner.memory.remove(a);
                    }
                    return Err(e);
                }
            }
        }
        if !done.is_empty() {
            self.republish_buffers()?;
        }
        Ok(done)
    }

    /// Registers a buffer usable only as the local side of requests (not published).
    pub fn register_local_memory(&self, region: Arc<Region>, location: Location) -> Result<u64, TransferError> {
        self.register(region, location, false)
    }

    /// Registers caller memory (a tensor's storage, an mmap), like Mooncake's
    /// `registerLocalMemory(addr, len)`. The range is checked first
    /// ([`crate::hostmem::check_caller_memory`]): device memory (as the CUDA driver, if loaded,
    /// says), `cuda:N`, and a range outside this process's writable host mappings are refused
    /// with the address, the length and the reason, never dereferenced.
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay valid until it is unregistered and no transfer uses it, and the
    /// caller must not hold Rust references into it while peers may write it.
    pub unsafe fn register_memory_raw(
        &self,
        ptr: *mut u8,
        len: usize,
        location: Location,
    ) -> Result<u64, TransferError> {
        let location = crate::hostmem::check_caller_memory(ptr as u64, len as u64, Some(location), true)?;
        // SAFETY: the range is mapped, readable and writable host memory now (checked above);
        // that it stays so is forwarded to the caller.
        let r = Arc::new(unsafe { Region::from_raw(ptr, len) });
        self.register(r, location, true)
    }

    pub(crate) fn register(&self, region: Arc<Region>, location: Location, remote: bool) -> Result<u64, TransferError> {
        let addr = self.register_unpublished(region, location, remote)?;
        if remote {
            self.republish_buffers()?;
        }
        Ok(addr)
    }

    fn register_unpublished(
        &self,
        region: Arc<Region>,
        location: Location,
        remote: bool,
    ) -> Result<u64, TransferError> {
        if matches!(location, Location::Cuda(_)) && !crate::gpu::is_gpu_mirror(&region) {
            return Err(TransferError::Gpu(
                "cuda memory is registered through gpu::GpuBuffer (register_gpu_memory), not a host region".into(),
            ));
        }
        let mr = match &self.inner.transport {
            Transport::Flexns(p) => Some(p.pd().reg_region(
                region.clone(),
                Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE,
            )?),
            Transport::Tcp(_) => None,
        };
        let addr = self.inner.memory.insert(LocalBuffer {
            region,
            location,
            mr,
            remote,
        })?;
        self.inner.registrations.fetch_add(1, Ordering::Relaxed);
        Ok(addr)
    }

    /// Registers a GPU buffer (its host mirror, as `cuda:N` memory) and publishes it.
    pub fn register_gpu_memory(&self, buf: &crate::gpu::GpuBuffer) -> Result<u64, TransferError> {
        self.register(buf.mirror().clone(), Location::Cuda(buf.device()), true)
    }

    /// Unregisters the buffer registered at `addr` and withdraws it from the descriptor.
    pub fn unregister_memory(&self, addr: u64) -> Result<(), TransferError> {
        let b = self
            .inner
            .memory
            .remove(addr)
            .ok_or_else(|| TransferError::Invalid(format!("unregister_memory: nothing registered at {addr:#x}")))?;
        if b.remote {
            self.republish_buffers()?;
        }
        Ok(())
    }

    /// Opens a peer's segment: finds its descriptor (embedded registry, P2P handshake or etcd)
    /// and connects to it with this engine's transport. A descriptor naming an engine instance
    /// that is no longer the live one is refreshed (the peer restarted), never used.
    pub fn open_segment(&self, name: &str) -> Result<SegmentHandle, TransferError> {
        if let Some((&h, _)) = self.inner.segments.lock().iter().find(|(_, s)| s.name == name) {
            return Ok(SegmentHandle(h));
        }
        let desc = self.connect_segment(name)?;
        let h = self.inner.next_seg.fetch_add(1, Ordering::Relaxed);
        self.inner.segments.lock().insert(
            h,
            OpenSegment {
                name: name.to_string(),
                desc,
            },
        );
        Ok(SegmentHandle(h))
    }

    fn connect_segment(&self, name: &str) -> Result<SegmentDesc, TransferError> {
        let mut tries = 0;
        loop {
            let d = self.inner.rt.block_on(self.inner.meta.fetch(name))?;
            if d.transport != self.inner.cfg.transport {
                return Err(TransferError::Peer {
                    peer: format!("{name} ({})", d.rpc),
                    message: format!(
                        "it serves the {} transport and this engine is configured for {} (no fallback: \
                         configure the same transport on both)",
                        d.transport, self.inner.cfg.transport
                    ),
                });
            }
            if d.name == self.inner.name && d.instance == self.inner.instance {
                return Ok(d); // our own segment: served by memcpy
            }
            let r = match &self.inner.transport {
                Transport::Flexns(p) => p.connect(name, d.rpc, d.instance),
                Transport::Tcp(t) => t.connect(name, d.data.expect("checked in from_json"), d.instance),
            };
            match r {
                Ok(()) => return Ok(d),
                Err(TransferError::StaleDescriptor { .. }) if tries < 10 => {
                    // the peer restarted and has not re-published yet, or the cache is old
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Forgets a segment and closes its connections.
    pub fn close_segment(&self, h: SegmentHandle) -> Result<(), TransferError> {
        let s = self
            .inner
            .segments
            .lock()
            .remove(&h.0)
            .ok_or_else(|| TransferError::Invalid(format!("segment handle {} is not open", h.0)))?;
        match &self.inner.transport {
            Transport::Flexns(p) => p.close(&s.name),
            Transport::Tcp(t) => t.close(&s.name),
        }
        Ok(())
    }

    /// The descriptor of an open segment: with etcd metadata, the one published now (the
    /// engine follows etcd with a watch, so a restarted peer's new buffers show here without
    /// polling; the segment is reconnected to the new instance); otherwise as last fetched.
    pub fn segment_descriptor(&self, h: SegmentHandle) -> Result<SegmentDesc, TransferError> {
        let (name, desc) = self
            .inner
            .segments
            .lock()
            .get(&h.0)
            .map(|s| (s.name.clone(), s.desc.clone()))
            .ok_or_else(|| TransferError::Invalid(format!("segment handle {} is not open", h.0)))?;
        self.follow_watch(h, &name, desc)
    }

    /// What etcd's watch says of an open segment, applied: a segment whose descriptor left
    /// etcd is refused (its engine is gone, nothing is sent), one published by a new instance
    /// is reconnected to it. `desc` is the descriptor the segment was opened with.
    fn follow_watch(&self, h: SegmentHandle, name: &str, desc: SegmentDesc) -> Result<SegmentDesc, TransferError> {
        match self.inner.meta.watched_instance(name) {
            Some(None) if name != self.inner.name => Err(TransferError::Peer {
                peer: format!("{name} ({})", desc.rpc),
                message: "its descriptor left etcd (the engine stopped, or died and its lease expired); \
                          nothing was sent"
                    .into(),
            }),
            Some(Some(instance)) if instance != desc.instance => {
                tracing::info!("segment {name}: a new instance published its descriptor; reconnecting");
                self.refresh_segment(h)
            }
            _ => Ok(desc),
        }
    }

    /// Fetches the segment's descriptor again (after it registered more memory, or restarted)
    /// and reconnects if it is another instance now.
    pub fn refresh_segment(&self, h: SegmentHandle) -> Result<SegmentDesc, TransferError> {
        let name = self
            .inner
            .segments
            .lock()
            .get(&h.0)
            .map(|s| s.name.clone())
            .ok_or_else(|| TransferError::Invalid(format!("segment handle {} is not open", h.0)))?;
        let d = self.connect_segment(&name)?;
        if let Some(s) = self.inner.segments.lock().get_mut(&h.0) {
            s.desc = d.clone();
        }
        Ok(d)
    }

    /// Allocates a batch for up to `capacity` requests.
    pub fn allocate_batch(&self, capacity: usize) -> Result<BatchId, TransferError> {
        if capacity == 0 || capacity > 1 << 20 {
            return Err(TransferError::Invalid(format!(
                "allocate_batch: capacity {capacity} not in 1..=1048576"
            )));
        }
        let id = self.inner.next_batch.fetch_add(1, Ordering::Relaxed);
        self.inner.batches.lock().insert(id, Arc::new(Batch::new(capacity)));
        Ok(BatchId(id))
    }

    fn batch(&self, id: BatchId) -> Result<Arc<Batch>, TransferError> {
        self.inner
            .batches
            .lock()
            .get(&id.0)
            .cloned()
            .ok_or_else(|| TransferError::Invalid(format!("batch {} is not allocated (freed?)", id.0)))
    }

    /// Submits requests to a batch; they run asynchronously (poll with [`Self::transfer_status`],
    /// [`Self::batch_status`] or [`Self::wait_batch`]).
    pub fn submit(&self, batch: BatchId, reqs: &[TransferRequest]) -> Result<(), TransferError> {
        self.submit_inner(batch, reqs, None)
    }

    /// Submits requests and a notification that the target segment receives after all of
    /// them have completed; the batch completes when the notification is delivered too.
    pub fn submit_with_notify(
        &self,
        batch: BatchId,
        reqs: &[TransferRequest],
        target: SegmentHandle,
        notify: &Notification,
    ) -> Result<(), TransferError> {
        let payload = encode_notify(notify).map_err(TransferError::Invalid)?;
        let name = self.seg_name(target)?;
        self.submit_inner(batch, reqs, Some((name, payload)))
    }

    fn handle_of(&self, name: &str) -> Option<SegmentHandle> {
        self.inner
            .segments
            .lock()
            .iter()
            .find(|(_, s)| s.name == name)
            .map(|(&h, _)| SegmentHandle(h))
    }

    fn seg_name(&self, h: SegmentHandle) -> Result<String, TransferError> {
        self.inner
            .segments
            .lock()
            .get(&h.0)
            .map(|s| s.name.clone())
            .ok_or_else(|| TransferError::Invalid(format!("segment handle {} is not open", h.0)))
    }

    fn submit_inner(
        &self,
        id: BatchId,
        reqs: &[TransferRequest],
        notify: Option<(String, Vec<u8>)>,
    ) -> Result<(), TransferError> {
        let batch = self.batch(id)?;
        let cfg = &self.inner.cfg;
        // validate everything before anything runs
        struct Planned {
            peer: String,
            local: bool,
            lkey: u32,
            rkey: u32,
            who: String,
        }
        let mut plan = Vec::with_capacity(reqs.len());
        let mut gpu_after = Vec::new();
        for (i, r) in reqs.iter().enumerate() {
            if r.length == 0 {
                return Err(TransferError::Invalid(format!("request {i}: length 0")));
            }
            let (lb, _) = self.inner.memory.find(r.source, r.length).ok_or_else(|| {
                TransferError::Invalid(format!(
                    "request {i}: source {:#x}+{} is not inside memory registered with this engine",
                    r.source, r.length
                ))
            })?;
            let lkey = lb.mr.as_ref().map_or(0, |m| m.lkey());
            if let Some(dev) = crate::gpu::device_of(lb.addr()) {
                let off = (r.source - lb.addr()) as usize;
                match r.opcode {
                    // the device holds the data: stage it in the mirror before it is sent
                    Opcode::Write => dev.sync(&lb.region, off, r.length as usize, false)?,
                    Opcode::Read => gpu_after.push((dev, lb.region.clone(), off, r.length as usize)),
                }
            }
            let (name, mut desc) = {
                let s = self.inner.segments.lock();
                let s = s.get(&r.target.0).ok_or_else(|| {
                    TransferError::Invalid(format!("request {i}: segment handle {} is not open", r.target.0))
                })?;
                (s.name.clone(), s.desc.clone())
            };
            desc = self.follow_watch(r.target, &name, desc)?;
            if desc.buffer_for(r.target_offset, r.length).is_none() {
                // the peer may have registered more memory since: look again once
                desc = self.refresh_segment(r.target)?;
            }
            let rb = desc.buffer_for(r.target_offset, r.length).ok_or_else(|| {
                TransferError::Invalid(format!(
                    "request {i}: target {:#x}+{} is not inside a buffer segment {name} registered ({} buffers)",
                    r.target_offset,
                    r.length,
                    desc.buffers.len()
                ))
            })?;
            let local = desc.instance == self.inner.instance;
            plan.push(Planned {
                who: format!("peer {name} ({} over {})", desc.rpc, cfg.transport),
                peer: name,
                local,
                lkey,
                rkey: rb.rkey,
            });
        }
        let deadline = Instant::now() + cfg.transfer_timeout;
        let base = {
            let mut b = batch.inner.lock();
            if b.tasks.len() + reqs.len() > b.capacity {
                return Err(TransferError::Invalid(format!(
                    "batch {}: {} requests exceed its capacity {}",
                    id.0,
                    b.tasks.len() + reqs.len(),
                    b.capacity
                )));
            }
            if notify.is_some() {
                if b.notify_pending.is_some() {
                    return Err(TransferError::Invalid(format!(
                        "batch {}: already has a notification",
                        id.0
                    )));
                }
                b.notify_pending = notify;
            }
            b.gpu_after.extend(gpu_after);
            let base = b.tasks.len();
            for (r, p) in reqs.iter().zip(&plan) {
                b.tasks.push(Task {
                    state: TransferState::Pending,
                    len: r.length,
                    done: 0,
                    slices_left: r.length.div_ceil(cfg.slice_bytes() as u64) as u32,
                    deadline,
                    peer: p.who.clone(),
                    last_error: None,
                });
            }
            base
        };
        let mut by_peer: HashMap<String, Vec<Slice>> = HashMap::new();
        for (i, (r, p)) in reqs.iter().zip(&plan).enumerate() {
            let task = base + i;
            if p.local {
                self.local_copy(&batch, task, r);
                continue;
            }
            let mut off = 0u64;
            while off < r.length {
                let len = (r.length - off).min(cfg.slice_bytes() as u64) as u32;
                by_peer.entry(p.peer.clone()).or_default().push(Slice {
                    batch: batch.clone(),
                    task,
                    op: r.opcode,
                    local: r.source + off,
                    lkey: p.lkey,
                    remote: r.target_offset + off,
                    rkey: p.rkey,
                    len,
                    attempts: 0,
                });
                off += len as u64;
            }
        }
        let mut first_err = None;
        for (peer, slices) in by_peer {
            let tasks: Vec<usize> = slices.iter().map(|s| s.task).collect();
            let r = match &self.inner.transport {
                Transport::Flexns(p) => p.submit(&peer, slices),
                Transport::Tcp(t) => t.submit(&peer, slices),
            };
            if let Err(e) = r {
                let why = match &e {
                    // the peer restarted: its memory addresses are not ours to write any more
                    TransferError::StaleDescriptor { .. } => {
                        if let Some(h) = self.handle_of(&peer) {
                            let _ = self.refresh_segment(h);
                        }
                        format!(
                            "{e}: the peer restarted, its descriptor is refreshed; resubmit against its new buffers"
                        )
                    }
                    e => e.to_string(),
                };
                for t in tasks {
                    batch.fail(t, TransferState::Failed(why.clone()));
                }
                first_err.get_or_insert(TransferError::Failed(why));
            }
        }
        // a batch whose requests all completed at once (local copies) sends its notification now
        self.maybe_notify(&batch);
        first_err.map_or(Ok(()), Err)
    }

    /// Local segment targets are served by copying (no network), as Mooncake does.
    fn local_copy(&self, batch: &Arc<Batch>, task: usize, r: &TransferRequest) {
        let src = self.inner.memory.find(r.source, r.length);
        let dst = self.inner.memory.find(r.target_offset, r.length);
        let (Some((sb, so)), Some((db, doff))) = (src, dst) else {
            batch.fail(task, TransferState::Failed("local copy: memory unregistered".into()));
            return;
        };
        let (from, to) = match r.opcode {
            Opcode::Write => ((sb, so), (db, doff)),
            Opcode::Read => ((db, doff), (sb, so)),
        };
        let n = r.length as usize;
        from.0.region.copy_to(from.1, n, &to.0.region, to.1);
        let slices = r.length.div_ceil(self.inner.cfg.slice_bytes() as u64);
        let per = self.inner.cfg.slice_bytes() as u64;
        for k in 0..slices {
            batch.slice_done(task, per.min(r.length - k * per));
        }
    }

    fn maybe_notify(&self, batch: &Arc<Batch>) {
        if !batch.data_done() {
            return;
        }
        if let Some((peer, payload)) = batch.take_notify() {
            match &self.inner.transport {
                Transport::Flexns(p) => {
                    if let Err(e) = p.notify_async(&peer, payload, batch.clone()) {
                        batch.notify_done(Err(e.to_string()));
                    }
                }
                Transport::Tcp(t) => t.notify_batch(&peer, payload, batch.clone()),
            }
        }
    }

    /// The status of request `task` (0-based, in submission order) of a batch.
    pub fn transfer_status(&self, batch: BatchId, task: usize) -> Result<TransferStatus, TransferError> {
        self.progress();
        let b = self.batch(batch)?;
        self.maybe_notify(&b);
        b.task_status(task)
            .ok_or_else(|| TransferError::Invalid(format!("batch {}: no request {task}", batch.0)))
    }

    /// The status of a whole batch.
    pub fn batch_status(&self, batch: BatchId) -> Result<TransferStatus, TransferError> {
        self.progress();
        let b = self.batch(batch)?;
        self.maybe_notify(&b);
        Ok(b.status())
    }

    /// Takes the CQ from the completion thread until the guard drops (flexns only).
    fn spinning(&self) -> Option<SpinGuard<'_>> {
        match &self.inner.transport {
            Transport::Flexns(p) => {
                p.spin_begin();
                Some(SpinGuard(p))
            }
            Transport::Tcp(_) => None,
        }
    }

    fn progress(&self) {
        if let Transport::Flexns(p) = &self.inner.transport {
            p.progress();
        }
    }

    /// Waits until the batch is final (or `timeout` passes) and returns its status. READs
    /// into GPU buffers are copied to the device before it reports Completed.
    pub fn wait_batch(&self, batch: BatchId, timeout: Duration) -> Result<TransferStatus, TransferError> {
        self.wait_batch_with(batch, timeout, None)
    }

    /// `wait_batch`, continuing the CQ ownership the caller took before submitting.
    fn wait_batch_with(
        &self,
        batch: BatchId,
        timeout: Duration,
        spinning: Option<SpinGuard<'_>>,
    ) -> Result<TransferStatus, TransferError> {
        let s = self.wait_batch_data(batch, timeout, spinning)?;
        if s.state != TransferState::Completed {
            return Ok(s);
        }
        let b = self.batch(batch)?;
        let after = std::mem::take(&mut b.inner.lock().gpu_after);
        for (dev, region, off, len) in after {
            if let Err(e) = dev.sync(&region, off, len, true) {
                return Ok(TransferStatus {
                    state: TransferState::Failed(format!("copying a READ to GPU {}: {e}", dev.ordinal)),
                    transferred_bytes: s.transferred_bytes,
                });
            }
        }
        Ok(s)
    }

    fn wait_batch_data(
        &self,
        batch: BatchId,
        timeout: Duration,
        spinning: Option<SpinGuard<'_>>,
    ) -> Result<TransferStatus, TransferError> {
        let b = self.batch(batch)?;
        let until = Instant::now() + timeout;
        // a small batch is completed by this thread waiting on the CQ itself: one wake-up (data
        // core → caller) instead of two (data core → completion thread → caller)
        let bytes: u64 = b.inner.lock().tasks.iter().map(|t| t.len - t.done).sum();
        let mut spinning = match spinning {
            Some(g) => Some(g),
            None if bytes <= SMALL_BATCH_BYTES => self.spinning(),
            None => None,
        };
        // polling yields the CPU between looks, so the data cores (on a small machine, the
        // same cores) run; after a while the caller sleeps on the CQ. A small tcp batch is
        // waited for the same way (the lane's receiver completes it): same discipline for both
        let spin_until = Instant::now() + Duration::from_micros(200);
        let spin_tcp = bytes <= SMALL_BATCH_BYTES && matches!(self.inner.transport, Transport::Tcp(_));
        loop {
            self.progress();
            self.maybe_notify(&b);
            let s = b.status();
            if s.state.is_final() || s.state == TransferState::Waiting || Instant::now() >= until {
                return Ok(s); // final, or nothing submitted to wait for
            }
            let left = until.saturating_duration_since(Instant::now());
            match &spinning {
                Some(_) if !b.data_done() && Instant::now() < spin_until => std::thread::yield_now(),
                Some(g) if !b.data_done() => g.0.wait_cq(left.min(Duration::from_millis(1))),
                Some(_) => spinning = None, // only the notification is left
                None if spin_tcp && Instant::now() < spin_until => std::thread::yield_now(),
                None => {
                    b.wait(left.min(Duration::from_millis(1)));
                }
            }
        }
    }

    /// Frees a batch; refused while requests are in flight (their memory is still in use).
    pub fn free_batch(&self, batch: BatchId) -> Result<(), TransferError> {
        let b = self.batch(batch)?;
        let s = b.status();
        if s.state == TransferState::Pending {
            return Err(TransferError::Invalid(format!(
                "free_batch: batch {} has requests in flight",
                batch.0
            )));
        }
        self.inner.batches.lock().remove(&batch.0);
        Ok(())
    }

    /// Runs requests (and an optional notification) to completion: Ok only when every byte is
    /// placed and visible at its destination.
    pub fn transfer_sync(
        &self,
        target: SegmentHandle,
        reqs: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<(), TransferError> {
        let started = Instant::now();
        let id = self.allocate_batch(reqs.len().max(1))?;
        let bytes: u64 = reqs.iter().map(|r| r.length).sum();
        // a small transfer's completions are taken by this thread from the submit on
        let spinning = if bytes <= SMALL_BATCH_BYTES {
            self.spinning()
        } else {
            None
        };
        let r = match notify {
            Some(n) => self.submit_with_notify(id, reqs, target, n),
            None => self.submit(id, reqs),
        };
        let t = self.inner.cfg.transfer_timeout + Duration::from_secs(1);
        if let Err(e) = r {
            // nothing was started (refused before), or what started is failing: wait it out
            let _ = self.wait_batch_with(id, t, spinning);
            let _ = self.free_batch(id);
            return Err(e);
        }
        let s = self.wait_batch_with(id, t, spinning);
        let _ = self.free_batch(id);
        let transport = self.inner.cfg.transport.as_str();
        let result = match s.as_ref().map(|s| &s.state) {
            Ok(TransferState::Completed) => "completed",
            Ok(TransferState::TimedOut(_)) => "timed_out",
            _ => "failed",
        };
        metrics::counter!("flexns_kvcache_batches_total", "transport" => transport, "result" => result).increment(1);
        metrics::histogram!("flexns_kvcache_transfer_duration_seconds", "transport" => transport)
            .record(started.elapsed().as_secs_f64());
        match s?.state {
            TransferState::Completed => Ok(()),
            TransferState::Failed(m) => Err(TransferError::Failed(m)),
            TransferState::TimedOut(m) => Err(TransferError::TimedOut(m)),
            s => Err(TransferError::TimedOut(format!("batch still {s:?}"))),
        }
    }

    /// Writes `length` bytes at local `source` to `target_offset` of segment `target`.
    pub fn transfer_sync_write(
        &self,
        target: SegmentHandle,
        source: u64,
        target_offset: u64,
        length: u64,
    ) -> Result<(), TransferError> {
        self.transfer_one(Opcode::Write, target, source, target_offset, length)
    }

    /// Reads `length` bytes at `target_offset` of segment `target` into local `source`.
    pub fn transfer_sync_read(
        &self,
        target: SegmentHandle,
        source: u64,
        target_offset: u64,
        length: u64,
    ) -> Result<(), TransferError> {
        self.transfer_one(Opcode::Read, target, source, target_offset, length)
    }

    fn transfer_one(
        &self,
        opcode: Opcode,
        target: SegmentHandle,
        source: u64,
        target_offset: u64,
        length: u64,
    ) -> Result<(), TransferError> {
        let r = TransferRequest {
            opcode,
            source,
            target,
            target_offset,
            length,
        };
        self.transfer_sync(target, &[r], None)
    }

    /// Most notifications an engine keeps from one peer engine that its application has not
    /// taken ([`Self::get_notifies`], [`Self::wait_notify`]); past it the peer's notifications
    /// are refused: its `send_notify` and its batches with a notification fail with the cause,
    /// while other peers' are still queued.
    pub const MAX_NOTIFIES_PER_PEER: usize = crate::transport::MAX_NOTIFIES_PER_PEER;

    /// Sends a notification by itself; returns once the target engine has queued it, or an
    /// error when it refused it (its queue for this engine is full: its application has not
    /// taken [`Self::MAX_NOTIFIES_PER_PEER`] of ours).
    pub fn send_notify(&self, target: SegmentHandle, n: &Notification) -> Result<(), TransferError> {
        let payload = encode_notify(n).map_err(TransferError::Invalid)?;
        let name = self.seg_name(target)?;
        let t = self.inner.cfg.transfer_timeout;
        match &self.inner.transport {
            Transport::Flexns(p) => p.notify(&name, &payload, t),
            Transport::Tcp(tp) => tp.notify(&name, payload, t),
        }
    }

    /// Takes the notifications received so far, oldest first.
    pub fn get_notifies(&self) -> Vec<Notification> {
        self.inner.notifies.take_all()
    }

    /// Waits up to `timeout` for the next notification.
    pub fn wait_notify(&self, timeout: Duration) -> Option<Notification> {
        self.inner.notifies.wait_one(timeout)
    }
}

/// Marks requests past their deadline TimedOut, every 10 ms, while the engine lives.
fn expire_loop(w: Weak<Inner>) {
    loop {
        std::thread::sleep(Duration::from_millis(10));
        let Some(inner) = w.upgrade() else { return };
        if inner.stop.load(Ordering::Relaxed) {
            return;
        }
        let now = Instant::now();
        let batches: Vec<Arc<Batch>> = inner.batches.lock().values().cloned().collect();
        for b in batches {
            b.expire(now, inner.cfg.transfer_timeout);
        }
    }
}

impl Drop for TransferEngine {
    fn drop(&mut self) {
        let inner = &self.inner;
        inner.stop.store(true, Ordering::Relaxed);
        inner.rt.block_on(inner.meta.remove(&inner.name, inner.instance));
        if let Some(tx) = inner.shutdown.lock().take() {
            let _ = tx.send(());
        }
        match &inner.transport {
            Transport::Flexns(p) => p.shutdown(),
            Transport::Tcp(t) => t.shutdown(),
        }
    }
}
