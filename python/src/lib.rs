//! `flexns._flexns`: kvcache-engine's transfer engine as a Python class with the methods,
//! arguments and return conventions of `mooncake.engine.TransferEngine` (Mooncake's pybind
//! module), plus a few Pythonic calls that raise instead of returning -1.
//!
//! Conventions kept from Mooncake: the sync transfers return 0 on success and -1 on failure;
//! async submissions return a batch id, 0 on failure; `transfer_check_status`
//! returns 1 done, 0 running, -1 failed, -2 timed out; addresses are integers (virtual
//! addresses; a remote address is the peer's). What differs, on purpose: a failure is never
//! silent (its message, naming the peer and the cause, is logged on the `flexns` logger and
//! kept for [`Engine::last_error`]); an unknown protocol, metadata server or transport hint is a
//! `ValueError` naming the supported ones, never a fallback; `initialize` raises (`ValueError`,
//! `TransferError`) instead of returning -1; memory may be given as a NumPy array or a PyTorch
//! tensor as well as an address, and an address is checked before it is registered (device
//! memory, or a range outside this process's writable host memory, is -1 with the reason, never
//! dereferenced). Every blocking call releases the GIL.

#![warn(unreachable_pub, missing_docs)]

mod etcd;
mod slab;

use kvcache_engine::batch::{Notification, Opcode, SegmentHandle, TransferRequest, TransferState};
use kvcache_engine::{BatchId, EngineConfig, Location, MetadataConfig, TransferEngine, TransportKind};
use netstack::mem::Region;
use parking_lot::Mutex;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use std::collections::{BTreeMap, HashMap};
use std::net::{Ipv4Addr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

pyo3::create_exception!(
    _flexns,
    TransferError,
    PyRuntimeError,
    "A transfer, registration or engine start failed; the message names the peer and the cause."
);

/// Mooncake's `TransferOpcode` (`Read`, `Write`).
#[pyclass(module = "flexns._flexns", eq, eq_int, from_py_object)]
#[derive(Clone, Copy, PartialEq, Eq)]
enum TransferOpcode {
    Read = 0,
    Write = 1,
}

/// Mooncake's `TransferNotify(name, msg)`: a message the target receives after a transfer.
#[pyclass(module = "flexns._flexns", get_all, set_all, from_py_object)]
#[derive(Clone)]
struct TransferNotify {
    name: String,
    msg: String,
}

#[pymethods]
impl TransferNotify {
    #[new]
    #[pyo3(signature = (name = String::new(), msg = String::new()))]
    fn new(name: String, msg: String) -> Self {
        TransferNotify { name, msg }
    }

    fn __repr__(&self) -> String {
        format!("TransferNotify(name={:?}, msg={:?})", self.name, self.msg)
    }
}

/// Memory registered through this object: the region the engine reads and writes, and the
/// Python object that owns it (kept alive until unregistered) when one was given.
struct Registered {
    region: Arc<Region>,
    _owner: Option<Py<PyAny>>,
}

/// Where a Python value's memory is: (address, length if the value knows it, on a GPU by the
/// object's own account: a bare address is classified by `hostmem::check_caller_memory`).
struct Memory {
    addr: u64,
    len: Option<usize>,
    cuda: bool,
    writable: bool,
}

/// Reads the address of an int, a NumPy array (`__array_interface__`) or a PyTorch tensor
/// (`data_ptr()`); refuses non-contiguous arrays, whose bytes are not one range.
fn memory_of(obj: &Bound<'_, PyAny>) -> PyResult<Memory> {
    if let Ok(addr) = obj.extract::<u64>() {
        return Ok(Memory {
            addr,
            len: None,
            cuda: false,
            writable: true,
        });
    }
    if obj.hasattr("data_ptr")? && obj.hasattr("element_size")? {
        let contiguous: bool = obj.call_method0("is_contiguous")?.extract()?;
        if !contiguous {
            return Err(PyValueError::new_err(
                "the tensor is not contiguous: its bytes are not one range (call .contiguous())",
            ));
        }
        let n: usize = obj.call_method0("numel")?.extract()?;
        let es: usize = obj.call_method0("element_size")?.extract()?;
        let cuda: bool = obj.getattr("is_cuda").and_then(|v| v.extract()).unwrap_or(false);
        return Ok(Memory {
            addr: obj.call_method0("data_ptr")?.extract()?,
            len: Some(n * es),
            cuda,
            writable: true,
        });
    }
    if obj.hasattr("__cuda_array_interface__")? {
        let (addr, _ro): (u64, bool) = obj.getattr("__cuda_array_interface__")?.get_item("data")?.extract()?;
        return Ok(Memory {
            addr,
            len: obj.getattr("nbytes").and_then(|v| v.extract()).ok(),
            cuda: true,
            writable: true,
        });
    }
    if let Ok(ai) = obj.getattr("__array_interface__") {
        let (addr, readonly): (u64, bool) = ai.get_item("data")?.extract()?;
        let contiguous: bool = obj.getattr("flags")?.getattr("c_contiguous")?.extract()?;
        if !contiguous {
            return Err(PyValueError::new_err(
                "the array is not C-contiguous: its bytes are not one range (numpy.ascontiguousarray)",
            ));
        }
        return Ok(Memory {
            addr,
            len: Some(obj.getattr("nbytes")?.extract()?),
            cuda: false,
            writable: !readonly,
        });
    }
    Err(PyTypeError::new_err(format!(
        "expected an address (int), a NumPy array or a PyTorch tensor, not {}",
        obj.get_type().name()?
    )))
}

const CUDA_UNSUPPORTED: &str = "CUDA memory cannot be registered or transferred by this package: it is built \
     without GPU support (flexns.SUPPORT_CUDA is False), and flexns registers GPU memory only as kvcache-engine \
     gpu::GpuBuffer segments (Rust, feature `gpu`), never by a caller's device pointer; copy the tensor to host \
     memory (tensor.cpu()) first";

fn protocol(p: &str) -> PyResult<TransportKind> {
    match p {
        "flexns" => Ok(TransportKind::Flexns),
        "tcp" => Ok(TransportKind::Tcp),
        o => Err(PyValueError::new_err(format!(
            "protocol {o:?} is not supported by flexns: use \"flexns\" (the flexns stack: one copy to peers on this host, RoCEv2 over UDP to others) or \"tcp\" \
             (kernel TCP){}",
            if o == "rdma" {
                "; there is no RDMA NIC backend and flexns never falls back silently (to run code that asks \
                 for \"rdma\" over flexns, set FLEXNS_RDMA_AS=flexns)"
            } else {
                ""
            }
        ))),
    }
}

fn metadata(s: &str) -> PyResult<MetadataConfig> {
    if s == "P2PHANDSHAKE" {
        return Ok(MetadataConfig::P2p);
    }
    if s.starts_with("http://") || s.starts_with("redis://") {
        return Err(PyValueError::new_err(format!(
            "metadata server {s:?}: flexns supports \"P2PHANDSHAKE\" and etcd (\"etcd://HOST:PORT\" or \
             \"HOST:PORT\"), not Mooncake's http or redis metadata servers"
        )));
    }
    MetadataConfig::parse(s, None).map_err(|e| PyValueError::new_err(format!("metadata server: {e}")))
}

/// The IPv4 address `host` (an address or a name, optionally with `:port`) stands for.
fn host_ip(host: &str) -> PyResult<Ipv4Addr> {
    let h = host
        .rsplit_once(':')
        .map_or(host, |(h, p)| if p.parse::<u16>().is_ok() { h } else { host });
    if let Ok(ip) = h.parse() {
        return Ok(ip);
    }
    (h, 0)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| {
            a.find_map(|a| match a.ip() {
                std::net::IpAddr::V4(ip) => Some(ip),
                _ => None,
            })
        })
        .ok_or_else(|| {
            PyValueError::new_err(format!(
                "local_hostname {host:?}: not an IPv4 address or a name that resolves to one"
            ))
        })
}

/// The engine.
#[pyclass(module = "flexns._flexns", name = "TransferEngine")]
struct Engine {
    engine: Mutex<Option<Arc<TransferEngine>>>,
    sessions: Mutex<HashMap<String, SegmentHandle>>,
    registered: Mutex<BTreeMap<u64, Registered>>,
    managed: Mutex<slab::Slabs>,
    last_error: Mutex<String>,
}

impl Engine {
    fn engine(&self) -> PyResult<Arc<TransferEngine>> {
        self.engine
            .lock()
            .clone()
            .ok_or_else(|| TransferError::new_err("the engine is not initialized (call initialize first)"))
    }

    /// Records and logs a failure; what a Mooncake-style call then returns.
    fn failed(&self, py: Python<'_>, what: &str, e: impl std::fmt::Display) -> String {
        let msg = format!("{what}: {e}");
        *self.last_error.lock() = msg.clone();
        if let Ok(log) = py
            .import("logging")
            .and_then(|l| l.call_method1("getLogger", ("flexns",)))
        {
            let _ = log.call_method1("warning", ("%s", msg.as_str()));
        }
        msg
    }

    fn session(&self, py: Python<'_>, e: &Arc<TransferEngine>, target: &str) -> Result<SegmentHandle, String> {
        if let Some(h) = self.sessions.lock().get(target) {
            return Ok(*h);
        }
        let h = py.detach(|| e.open_segment(target)).map_err(|e| e.to_string())?;
        self.sessions.lock().insert(target.to_string(), h);
        Ok(h)
    }

    /// Requests for one target from parallel lists (Mooncake's batch arguments).
    fn requests(
        target: SegmentHandle,
        opcode: Opcode,
        buffers: &[u64],
        peers: &[u64],
        lengths: &[u64],
    ) -> Result<Vec<TransferRequest>, String> {
        if buffers.len() != peers.len() || buffers.len() != lengths.len() {
            return Err(format!(
                "buffers ({}), peer_buffer_addresses ({}) and lengths ({}) differ in length",
                buffers.len(),
                peers.len(),
                lengths.len()
            ));
        }
        Ok((0..buffers.len())
            .map(|i| TransferRequest {
                opcode,
                source: buffers[i],
                target,
                target_offset: peers[i],
                length: lengths[i],
            })
            .collect())
    }

    #[allow(clippy::too_many_arguments)]
    fn sync(
        &self,
        py: Python<'_>,
        what: &str,
        target: &str,
        opcode: Opcode,
        buffers: &[u64],
        peers: &[u64],
        lengths: &[u64],
        notify: Option<&TransferNotify>,
        hint: &str,
    ) -> PyResult<Result<(), String>> {
        let e = self.engine()?;
        self.check_hint(&e, hint)?;
        let r = self.session(py, &e, target).and_then(|h| {
            let reqs = Self::requests(h, opcode, buffers, peers, lengths)?;
            let n = notify.map(|n| Notification {
                name: n.name.clone(),
                msg: n.msg.clone(),
            });
            py.detach(|| e.transfer_sync(h, &reqs, n.as_ref()))
                .map_err(|e| e.to_string())
        });
        Ok(r.map_err(|m| self.failed(py, &format!("{what} to {target}"), m)))
    }

    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        py: Python<'_>,
        what: &str,
        target: &str,
        opcode: Opcode,
        buffers: &[u64],
        peers: &[u64],
        lengths: &[u64],
        notify: Option<&TransferNotify>,
        hint: &str,
    ) -> PyResult<u64> {
        let e = self.engine()?;
        self.check_hint(&e, hint)?;
        let r = self.session(py, &e, target).and_then(|h| {
            let reqs = Self::requests(h, opcode, buffers, peers, lengths)?;
            let n = notify.map(|n| Notification {
                name: n.name.clone(),
                msg: n.msg.clone(),
            });
            py.detach(|| {
                let id = e.allocate_batch(reqs.len().max(1))?;
                let submitted = match &n {
                    Some(n) => e.submit_with_notify(id, &reqs, h, n),
                    None => e.submit(id, &reqs),
                };
                if let Err(err) = submitted {
                    let _ = e.wait_batch(id, Duration::from_secs(1));
                    let _ = e.free_batch(id);
                    return Err(err);
                }
                Ok(id.0)
            })
            .map_err(|e| e.to_string())
        });
        Ok(r.unwrap_or_else(|m| {
            self.failed(py, &format!("{what} to {target}"), m);
            0
        }))
    }

    /// A transport hint is "" or the engine's own transport: a hint it cannot honour is an error.
    fn check_hint(&self, e: &TransferEngine, hint: &str) -> PyResult<()> {
        let own = e.transport().as_str();
        if hint.is_empty() || hint == "unspec" || hint == own {
            return Ok(());
        }
        Err(PyValueError::new_err(format!(
            "transport_hint {hint:?}: this engine runs the {own} transport only (\"\" or {own:?})"
        )))
    }

    /// Registers one buffer. A malformed argument raises (`TypeError`, `ValueError`); memory
    /// that cannot be registered (device memory, a range outside this process's writable host
    /// mappings, a read-only array, the engine's refusal) is `Ok(Err(reason))`, which the
    /// Mooncake-style callers report as -1 with `last_error()`.
    fn register_one(
        &self,
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        capacity: Option<usize>,
        location: &str,
    ) -> PyResult<Result<u64, String>> {
        let e = self.engine()?;
        let p = match self.prepare_one(obj, capacity, location)? {
            Ok(p) => p,
            Err(m) => return Ok(Err(m)),
        };
        let addr = match py.detach(|| e.register_memory(p.region.clone(), p.location)) {
            Ok(a) => a,
            Err(err) => return Ok(Err(format!("{}: {err}", p.at))),
        };
        self.registered.lock().insert(
            addr,
            Registered {
                region: p.region,
                _owner: p.owner,
            },
        );
        Ok(Ok(addr))
    }

    /// Checks one buffer to register and makes its region (see `register_one`).
    fn prepare_one(
        &self,
        obj: &Bound<'_, PyAny>,
        capacity: Option<usize>,
        location: &str,
    ) -> PyResult<Result<Prepared, String>> {
        let m = memory_of(obj)?;
        let requested = Location::parse_requested(location).map_err(PyValueError::new_err)?;
        let len = match (capacity, m.len) {
            (Some(c), Some(l)) if c > l => {
                return Err(PyValueError::new_err(format!(
                    "capacity {c} is larger than the object's {l} bytes"
                )))
            }
            (Some(c), _) => c,
            (None, Some(l)) => l,
            (None, None) => return Err(PyValueError::new_err("an address needs its capacity (length in bytes)")),
        };
        let at = format!("{:#x} +{len}", m.addr);
        if m.cuda {
            return Ok(Err(format!("{at}: a CUDA tensor: {CUDA_UNSUPPORTED}")));
        }
        if !m.writable {
            return Ok(Err(format!(
                "{at}: the array is read-only, and registered memory is written by peers (numpy: arr.flags.writeable)"
            )));
        }
        // an address from Python may be anything (a CUDA tensor's data_ptr(), a freed buffer):
        // it is classified and its mappings checked before anything reads or writes it
        let loc = match kvcache_engine::hostmem::check_caller_memory(m.addr, len as u64, requested, true) {
            Ok(l) => l,
            Err(err) => return Ok(Err(err.to_string())),
        };
        // SAFETY: `check_caller_memory` found the range mapped, readable and writable host
        // memory of this process. Python hands over a range it owns; the object (when one was
        // given) is kept alive in `registered` until unregistered, and an address given as an
        // int is the caller's promise to keep it mapped, exactly as in Mooncake's
        // `register_memory(addr, len)`. The region is reached only through its atomic copies,
        // never as a Rust reference.
        let region = Arc::new(unsafe { Region::from_raw(m.addr as *mut u8, len) });
        let owner = (m.len.is_some()).then(|| obj.clone().unbind());
        Ok(Ok(Prepared {
            region,
            location: loc,
            owner,
            at,
        }))
    }

    /// The registered (or managed) region holding `[addr, addr+len)`, and the offset in it.
    fn region_at(&self, addr: u64, len: usize) -> Option<(Arc<Region>, usize)> {
        let inside = |base: u64, r: &Arc<Region>| {
            (addr >= base && addr - base + len as u64 <= r.len() as u64).then(|| (r.clone(), (addr - base) as usize))
        };
        if let Some(x) = self.managed.lock().region_at(addr, len) {
            return Some(x);
        }
        let reg = self.registered.lock();
        let (b, r) = reg.range(..=addr).next_back()?;
        inside(*b, &r.region)
    }
}

/// A buffer checked for registration: its region, where it is, the Python object that owns
/// it, and how to name it in an error.
struct Prepared {
    region: Arc<Region>,
    location: Location,
    owner: Option<Py<PyAny>>,
    at: String,
}

fn code(r: Result<(), String>) -> i32 {
    if r.is_ok() {
        0
    } else {
        -1
    }
}

#[pymethods]
impl Engine {
    #[new]
    fn new() -> Self {
        Engine {
            engine: Mutex::new(None),
            sessions: Mutex::new(HashMap::new()),
            registered: Mutex::new(BTreeMap::new()),
            managed: Mutex::new(slab::Slabs::default()),
            last_error: Mutex::new(String::new()),
        }
    }

    /// Starts the engine. `metadata_server`: "P2PHANDSHAKE" (the session id is then
    /// "IP:rpc_port") or etcd ("etcd://H:P"); `protocol`: "flexns" or "tcp"; `device_name`: ""
    /// or a network interface whose address to advertise. Returns 0; a bad argument raises
    /// `ValueError`, a failed start `TransferError` (with the cause).
    #[pyo3(signature = (local_hostname, metadata_server, protocol = "flexns", device_name = ""))]
    fn initialize(
        &self,
        py: Python<'_>,
        local_hostname: &str,
        metadata_server: &str,
        protocol: &str,
        device_name: &str,
    ) -> PyResult<i32> {
        // serving code that hard-codes "rdma" (SGLang, vLLM's connector) runs over flexns only
        // when the user says so, by name; then the choice is logged, never silent
        let asked = match (protocol, std::env::var("FLEXNS_RDMA_AS")) {
            ("rdma", Ok(v)) if !v.is_empty() => {
                self::protocol(&v).map_err(|e| PyValueError::new_err(format!("FLEXNS_RDMA_AS: {e}")))?;
                if let Ok(log) = py
                    .import("logging")
                    .and_then(|l| l.call_method1("getLogger", ("flexns",)))
                {
                    let m = format!("protocol \"rdma\" runs over {v:?} (FLEXNS_RDMA_AS)");
                    let _ = log.call_method1("info", ("%s", m));
                }
                v
            }
            _ => protocol.to_string(),
        };
        let transport = self::protocol(&asked)?;
        let meta = metadata(metadata_server)?;
        if self.engine.lock().is_some() {
            return Err(TransferError::new_err("initialize: the engine is already initialized"));
        }
        let mut cfg = EngineConfig::new(local_hostname, transport);
        let p2p = meta == MetadataConfig::P2p;
        cfg.metadata = meta;
        let ip = if device_name.is_empty() {
            host_ip(local_hostname)?
        } else {
            let first = device_name.split(',').next().unwrap_or_default().trim();
            kvcache_engine::netaddr::interfaces()
                .into_iter()
                .find(|(n, _)| n == first)
                .map(|(_, ip)| ip)
                .ok_or_else(|| {
                    PyValueError::new_err(format!("device_name {first:?}: no such interface with an IPv4 address"))
                })?
        };
        cfg.bind_ip = Some(ip);
        cfg.advertise_ip = Some(ip);
        if !p2p {
            cfg.name = local_hostname.to_string();
        }
        if let Some(t) = std::env::var("MC_TRANSFER_TIMEOUT")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
        {
            cfg.transfer_timeout = Duration::from_secs(t.max(1));
        }
        // the connection manager's door (see EngineConfig): per-caller QP cap, unused QP timeout
        if let Ok(v) = std::env::var("FLEXNS_MAX_QPS_PER_CALLER") {
            cfg.max_qps_per_caller = v.trim().parse().map_err(|_| {
                PyValueError::new_err(format!(
                    "FLEXNS_MAX_QPS_PER_CALLER: {v:?} is not a number of queue pairs"
                ))
            })?;
            cfg.check_door()
                .map_err(|e| PyValueError::new_err(format!("FLEXNS_MAX_QPS_PER_CALLER: {e}")))?;
        }
        if let Ok(v) = std::env::var("FLEXNS_UNUSED_QP_TIMEOUT") {
            cfg.unused_qp_timeout = v
                .trim()
                .parse::<f64>()
                .ok()
                .and_then(|s| Duration::try_from_secs_f64(s).ok())
                .ok_or_else(|| {
                    PyValueError::new_err(format!("FLEXNS_UNUSED_QP_TIMEOUT: {v:?} is not a number of seconds"))
                })?;
            cfg.check_door()
                .map_err(|e| PyValueError::new_err(format!("FLEXNS_UNUSED_QP_TIMEOUT: {e}")))?;
        }
        // flexns data cores: on one host each copies the requests of its QPs (the engine spreads
        // a peer's QPs over them), so two cores copy a batch in parallel
        if let Ok(v) = std::env::var("FLEXNS_DATA_CORES") {
            cfg.data_cores = v.trim().parse().ok().filter(|n| (1..=16).contains(n)).ok_or_else(|| {
                PyValueError::new_err(format!("FLEXNS_DATA_CORES: {v:?} is not a number of cores in 1..=16"))
            })?;
        }
        // the flexns stack's link: shm by default (a same-host peer on shm is written and read
        // by one copy into its memory, others over UDP); udp where packets must cross the kernel
        if let Ok(v) = std::env::var("FLEXNS_LINK") {
            let link = kvcache_engine::daemon::parse_link(v.trim())
                .map_err(|e| PyValueError::new_err(format!("FLEXNS_LINK: {e}")))?;
            cfg.set_link(link);
        }
        // the flexns stack in a flexnsd daemon instead of this process: its socket
        if let Ok(v) = std::env::var("FLEXNS_FLEXNSD") {
            let v = v.trim();
            if v.is_empty() {
                return Err(PyValueError::new_err(
                    "FLEXNS_FLEXNSD: empty (the daemon's Unix socket path)",
                ));
            }
            cfg.set_flexnsd(v.into());
        }
        let e = py
            .detach(|| TransferEngine::new(cfg))
            .map_err(|e| TransferError::new_err(format!("initialize: {e}")))?;
        *self.engine.lock() = Some(Arc::new(e));
        Ok(0)
    }

    /// `initialize` with the metadata type given apart ("p2p"/"P2PHANDSHAKE" or "etcd").
    #[pyo3(signature = (local_hostname, metadata_server, protocol, device_name, metadata_type))]
    fn initialize_ext(
        &self,
        py: Python<'_>,
        local_hostname: &str,
        metadata_server: &str,
        protocol: &str,
        device_name: &str,
        metadata_type: &str,
    ) -> PyResult<i32> {
        let server = match metadata_type {
            "p2p" | "P2PHANDSHAKE" => "P2PHANDSHAKE".to_string(),
            "etcd" => format!("etcd://{}", metadata_server.trim_start_matches("etcd://")),
            o => {
                return Err(PyValueError::new_err(format!(
                    "metadata_type {o:?}: flexns supports \"p2p\" and \"etcd\""
                )))
            }
        };
        self.initialize(py, local_hostname, &server, protocol, device_name)
    }

    /// The engine's RPC port (in P2P mode the session id is "IP:port").
    fn get_rpc_port(&self) -> PyResult<u16> {
        Ok(self.engine()?.rpc_addr().port())
    }

    /// The name peers reach this engine by (the session id in P2P mode).
    fn get_session_id(&self) -> PyResult<String> {
        Ok(self.engine()?.segment_name().to_string())
    }

    /// The transport in use: "flexns" or "tcp".
    fn get_protocol(&self) -> PyResult<String> {
        Ok(self.engine()?.transport().as_str().to_string())
    }

    /// The flexns stack's counters as a dict (`None` with protocol "tcp"): `tx_packets`,
    /// `tx_bytes`, `rx_datagrams`, `rx_bytes`, and what the same-host path moved for this
    /// engine's requests: `same_host_copy_bytes` (into or out of a peer's engine-allocated
    /// memory), `same_host_cma_bytes` (a peer's registered caller memory, by CMA),
    /// `same_host_ops`.
    fn stack_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(s) = self.engine()?.stack_stats() else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        for (k, v) in [
            ("tx_packets", s.tx_packets),
            ("tx_bytes", s.tx_bytes),
            ("rx_datagrams", s.rx_datagrams),
            ("rx_bytes", s.rx_bytes),
            ("same_host_copy_bytes", s.same_host_copy_bytes),
            ("same_host_cma_bytes", s.same_host_cma_bytes),
            ("same_host_ops", s.same_host_ops),
        ] {
            d.set_item(k, v)?;
        }
        Ok(Some(d))
    }

    /// The message of the last failure a Mooncake-style call reported with -1 or 0.
    fn last_error(&self) -> String {
        self.last_error.lock().clone()
    }

    /// Registers memory for transfers and publishes it: an address and its capacity (as in
    /// Mooncake), or a NumPy array or PyTorch tensor (kept alive until unregistered).
    /// `location`: `"*"` (detect), `"cpu:N"`; `"cuda:N"` is refused. Returns 0, or -1 (with
    /// `last_error()`) if the memory cannot be registered: device memory, a range that is not
    /// this process's writable host memory. A malformed argument raises.
    #[pyo3(signature = (buffer_addr, capacity = None, location = "*"))]
    fn register_memory(
        &self,
        py: Python<'_>,
        buffer_addr: &Bound<'_, PyAny>,
        capacity: Option<usize>,
        location: &str,
    ) -> PyResult<i32> {
        Ok(match self.register_one(py, buffer_addr, capacity, location)? {
            Ok(_) => 0,
            Err(m) => {
                self.failed(py, "register_memory", m);
                -1
            }
        })
    }

    /// Unregisters memory (by address or by the object registered). Returns 0, or -1 if
    /// nothing is registered there.
    fn unregister_memory(&self, py: Python<'_>, buffer_addr: &Bound<'_, PyAny>) -> PyResult<i32> {
        let e = self.engine()?;
        let addr = memory_of(buffer_addr)?.addr;
        let r = py.detach(|| e.unregister_memory(addr)).map_err(|e| e.to_string());
        if r.is_ok() {
            self.registered.lock().remove(&addr);
        }
        Ok(code(r.map_err(|m| self.failed(py, "unregister_memory", m))))
    }

    /// Registers several buffers (lists of addresses or objects, and of capacities) and
    /// publishes the engine's descriptor once for all of them, as Mooncake's
    /// `registerLocalMemoryBatch`. Returns 0, or -1 (with `last_error()` naming the buffer) if
    /// one cannot be registered; on an error (or a raised malformed argument) none of them is
    /// registered.
    #[pyo3(signature = (buffer_addresses, capacities = None, location = "*"))]
    fn batch_register_memory(
        &self,
        py: Python<'_>,
        buffer_addresses: &Bound<'_, PyList>,
        capacities: Option<Vec<usize>>,
        location: &str,
    ) -> PyResult<i32> {
        if let Some(c) = &capacities {
            if c.len() != buffer_addresses.len() {
                return Err(PyValueError::new_err(format!(
                    "{} buffer addresses and {} capacities",
                    buffer_addresses.len(),
                    c.len()
                )));
            }
        }
        let e = self.engine()?;
        let mut prepared = Vec::with_capacity(buffer_addresses.len());
        for (i, obj) in buffer_addresses.iter().enumerate() {
            match self.prepare_one(&obj, capacities.as_ref().map(|c| c[i]), location)? {
                Ok(p) => prepared.push(p),
                Err(m) => {
                    self.failed(
                        py,
                        "batch_register_memory",
                        format!("buffer {i}: {m} (none registered)"),
                    );
                    return Ok(-1);
                }
            }
        }
        let regions: Vec<(Arc<Region>, Location)> = prepared.iter().map(|p| (p.region.clone(), p.location)).collect();
        match py.detach(|| e.register_memory_batch(regions)) {
            Ok(addrs) => {
                let mut reg = self.registered.lock();
                for (a, p) in addrs.into_iter().zip(prepared) {
                    reg.insert(
                        a,
                        Registered {
                            region: p.region,
                            _owner: p.owner,
                        },
                    );
                }
                Ok(0)
            }
            Err(err) => {
                self.failed(py, "batch_register_memory", format!("{err} (none registered)"));
                Ok(-1)
            }
        }
    }

    /// Unregisters several buffers. Returns 0, or -1 if any was not registered.
    fn batch_unregister_memory(&self, py: Python<'_>, buffer_addresses: &Bound<'_, PyList>) -> PyResult<i32> {
        let mut rc = 0;
        for obj in buffer_addresses.iter() {
            if self.unregister_memory(py, &obj)? != 0 {
                rc = -1;
            }
        }
        Ok(rc)
    }

    /// Allocates `length` bytes of engine-owned, registered host memory; returns its address
    /// (0 on failure). Buffers are carved from slabs of registered memory (64 MiB, or one
    /// buffer's size if larger), as Mooncake's are from its pool: a new slab, one
    /// registration and one descriptor publication, only when no free range fits. The
    /// contents of a buffer are not cleared when it is reused (as in Mooncake).
    fn allocate_managed_buffer(&self, py: Python<'_>, length: usize) -> PyResult<u64> {
        let e = self.engine()?;
        if length == 0 {
            return Err(PyValueError::new_err("length: a managed buffer needs at least 1 byte"));
        }
        let Some(want) = slab::rounded(length as u64) else {
            return Err(PyValueError::new_err(format!("length: {length} bytes is too large")));
        };
        if let Some(a) = self.managed.lock().alloc(length as u64) {
            return Ok(a);
        }
        let size = (want as usize).max(slab::SLAB_BYTES);
        match py.detach(|| e.allocate_memory(size, Location::Cpu(0))) {
            Ok(r) => {
                let mut m = self.managed.lock();
                m.add_slab(r);
                Ok(m.alloc(length as u64).unwrap_or(0))
            }
            Err(err) => {
                self.failed(py, "allocate_managed_buffer", format!("a new {size}-byte slab: {err}"));
                Ok(0)
            }
        }
    }

    /// Frees a managed buffer. Returns 0, or -1 if `buffer_addr` is not one.
    fn free_managed_buffer(&self, py: Python<'_>, buffer_addr: u64, length: usize) -> PyResult<i32> {
        let Some(len) = self.managed.lock().free(buffer_addr) else {
            self.failed(
                py,
                "free_managed_buffer",
                format!("{buffer_addr:#x} is not a managed buffer"),
            );
            return Ok(-1);
        };
        if len != length as u64 {
            let m = format!("{buffer_addr:#x} was allocated with {len} bytes, freed with {length} (freed anyway)");
            self.failed(py, "free_managed_buffer", m);
        }
        Ok(0)
    }

    /// flexns addition: what this engine has done to register memory, from the engine's own
    /// counters: `registrations` (regions registered), `publications` (descriptor writes to
    /// the metadata store or handshake server, the start's included), `managed_slabs` and
    /// `managed_buffers` (live buffers handed out by `allocate_managed_buffer`).
    fn registration_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let e = self.engine()?;
        let d = PyDict::new(py);
        d.set_item("registrations", e.registrations())?;
        d.set_item("publications", e.publications())?;
        let m = self.managed.lock();
        d.set_item("managed_slabs", m.slab_count())?;
        d.set_item("managed_buffers", m.live())?;
        Ok(d)
    }

    /// Copies `length` bytes of `src_ptr` (bytes) into registered or managed memory at
    /// `dest_address`. Returns 0, or -1 if the range is not this engine's memory.
    fn write_bytes_to_buffer(&self, py: Python<'_>, dest_address: u64, src_ptr: &[u8], length: usize) -> PyResult<i32> {
        let n = length.min(src_ptr.len());
        match self.region_at(dest_address, n) {
            Some((r, off)) => {
                r.write(off, &src_ptr[..n]);
                Ok(0)
            }
            None => {
                self.failed(
                    py,
                    "write_bytes_to_buffer",
                    format!("{n} bytes at {dest_address:#x} are not registered memory"),
                );
                Ok(-1)
            }
        }
    }

    /// Reads `length` bytes of registered or managed memory at `source_address`.
    fn read_bytes_from_buffer<'py>(
        &self,
        py: Python<'py>,
        source_address: u64,
        length: usize,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let (r, off) = self.region_at(source_address, length).ok_or_else(|| {
            PyValueError::new_err(format!(
                "{length} bytes at {source_address:#x} are not registered memory"
            ))
        })?;
        Ok(PyBytes::new(py, &r.to_vec(off, length)))
    }

    /// The address of the first buffer a peer segment publishes (0 on failure).
    fn get_first_buffer_address(&self, py: Python<'_>, segment_name: &str) -> PyResult<u64> {
        let e = self.engine()?;
        let r = self.session(py, &e, segment_name).and_then(|h| {
            let d = py.detach(|| e.refresh_segment(h)).map_err(|e| e.to_string())?;
            d.buffers
                .first()
                .map(|b| b.addr)
                .ok_or_else(|| "it publishes no buffer".to_string())
        });
        Ok(r.unwrap_or_else(|m| {
            self.failed(py, &format!("get_first_buffer_address of {segment_name}"), m);
            0
        }))
    }

    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint = ""))]
    fn transfer_sync_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: u64,
        peer_buffer_address: u64,
        length: u64,
        transport_hint: &str,
    ) -> PyResult<i32> {
        let r = self.sync(
            py,
            "transfer_sync_write",
            target_hostname,
            Opcode::Write,
            &[buffer],
            &[peer_buffer_address],
            &[length],
            None,
            transport_hint,
        )?;
        Ok(code(r))
    }

    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint = ""))]
    fn transfer_sync_read(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: u64,
        peer_buffer_address: u64,
        length: u64,
        transport_hint: &str,
    ) -> PyResult<i32> {
        let r = self.sync(
            py,
            "transfer_sync_read",
            target_hostname,
            Opcode::Read,
            &[buffer],
            &[peer_buffer_address],
            &[length],
            None,
            transport_hint,
        )?;
        Ok(code(r))
    }

    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = ""))]
    fn batch_transfer_sync_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<u64>,
        peer_buffer_addresses: Vec<u64>,
        lengths: Vec<u64>,
        transport_hint: &str,
    ) -> PyResult<i32> {
        let r = self.sync(
            py,
            "batch_transfer_sync_write",
            target_hostname,
            Opcode::Write,
            &buffers,
            &peer_buffer_addresses,
            &lengths,
            None,
            transport_hint,
        )?;
        Ok(code(r))
    }

    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = ""))]
    fn batch_transfer_sync_read(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<u64>,
        peer_buffer_addresses: Vec<u64>,
        lengths: Vec<u64>,
        transport_hint: &str,
    ) -> PyResult<i32> {
        let r = self.sync(
            py,
            "batch_transfer_sync_read",
            target_hostname,
            Opcode::Read,
            &buffers,
            &peer_buffer_addresses,
            &lengths,
            None,
            transport_hint,
        )?;
        Ok(code(r))
    }

    /// One request with an opcode and an optional notification delivered after it.
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, opcode, notify = None, transport_hint = ""))]
    #[allow(clippy::too_many_arguments)]
    fn transfer_sync(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: u64,
        peer_buffer_address: u64,
        length: u64,
        opcode: TransferOpcode,
        notify: Option<TransferNotify>,
        transport_hint: &str,
    ) -> PyResult<i32> {
        let r = self.sync(
            py,
            "transfer_sync",
            target_hostname,
            op(opcode),
            &[buffer],
            &[peer_buffer_address],
            &[length],
            notify.as_ref(),
            transport_hint,
        )?;
        Ok(code(r))
    }

    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, opcode, notify = None, transport_hint = ""))]
    #[allow(clippy::too_many_arguments)]
    fn batch_transfer_sync(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<u64>,
        peer_buffer_addresses: Vec<u64>,
        lengths: Vec<u64>,
        opcode: TransferOpcode,
        notify: Option<TransferNotify>,
        transport_hint: &str,
    ) -> PyResult<i32> {
        let r = self.sync(
            py,
            "batch_transfer_sync",
            target_hostname,
            op(opcode),
            &buffers,
            &peer_buffer_addresses,
            &lengths,
            notify.as_ref(),
            transport_hint,
        )?;
        Ok(code(r))
    }

    /// Submits a batch and returns its id (0 on failure); poll with `transfer_check_status`
    /// or wait with `get_batch_transfer_status`.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, opcode, transport_hint = ""))]
    #[allow(clippy::too_many_arguments)]
    fn batch_transfer_async(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<u64>,
        peer_buffer_addresses: Vec<u64>,
        lengths: Vec<u64>,
        opcode: TransferOpcode,
        transport_hint: &str,
    ) -> PyResult<u64> {
        self.submit(
            py,
            "batch_transfer_async",
            target_hostname,
            op(opcode),
            &buffers,
            &peer_buffer_addresses,
            &lengths,
            None,
            transport_hint,
        )
    }

    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = ""))]
    fn batch_transfer_async_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<u64>,
        peer_buffer_addresses: Vec<u64>,
        lengths: Vec<u64>,
        transport_hint: &str,
    ) -> PyResult<u64> {
        self.submit(
            py,
            "batch_transfer_async_write",
            target_hostname,
            Opcode::Write,
            &buffers,
            &peer_buffer_addresses,
            &lengths,
            None,
            transport_hint,
        )
    }

    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = ""))]
    fn batch_transfer_async_read(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<u64>,
        peer_buffer_addresses: Vec<u64>,
        lengths: Vec<u64>,
        transport_hint: &str,
    ) -> PyResult<u64> {
        self.submit(
            py,
            "batch_transfer_async_read",
            target_hostname,
            Opcode::Read,
            &buffers,
            &peer_buffer_addresses,
            &lengths,
            None,
            transport_hint,
        )
    }

    /// Submits one WRITE; returns its batch id, or -1 (with `last_error()`) if it cannot be
    /// submitted, as Mooncake's `transfer_submit_write`.
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint = ""))]
    fn transfer_submit_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: u64,
        peer_buffer_address: u64,
        length: u64,
        transport_hint: &str,
    ) -> PyResult<i64> {
        // Mooncake returns -1 (not 0) when this submission fails
        let id = self.submit(
            py,
            "transfer_submit_write",
            target_hostname,
            Opcode::Write,
            &[buffer],
            &[peer_buffer_address],
            &[length],
            None,
            transport_hint,
        )?;
        Ok(if id == 0 { -1 } else { id as i64 })
    }

    /// Submits a batch and a notification the target receives after every request of it
    /// has landed (the batch completes once the notification is delivered too); returns the
    /// batch id (0 on failure, with `last_error()`). What `flexns.nixl` posts for a transfer
    /// with a `notif_msg`.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, opcode, notify, transport_hint = ""))]
    #[allow(clippy::too_many_arguments)]
    fn batch_transfer_async_notify(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<u64>,
        peer_buffer_addresses: Vec<u64>,
        lengths: Vec<u64>,
        opcode: TransferOpcode,
        notify: TransferNotify,
        transport_hint: &str,
    ) -> PyResult<u64> {
        self.submit(
            py,
            "batch_transfer_async_notify",
            target_hostname,
            op(opcode),
            &buffers,
            &peer_buffer_addresses,
            &lengths,
            Some(&notify),
            transport_hint,
        )
    }

    /// 1 completed, 0 still running, -1 failed, -2 timed out. A completed or failed batch is
    /// freed; a timed-out one is kept, as Mooncake keeps it, so its status can be read again.
    fn transfer_check_status(&self, py: Python<'_>, batch_id: u64) -> PyResult<i32> {
        let e = self.engine()?;
        let id = BatchId(batch_id);
        let s = match e.batch_status(id) {
            Ok(s) => s.state,
            Err(err) => {
                self.failed(py, "transfer_check_status", err);
                return Ok(-1);
            }
        };
        let rc = match s {
            TransferState::Completed => 1,
            TransferState::Failed(m) => {
                self.failed(py, &format!("batch {batch_id}"), m);
                -1
            }
            TransferState::TimedOut(m) => {
                self.failed(py, &format!("batch {batch_id}"), m);
                return Ok(-2);
            }
            TransferState::Waiting | TransferState::Pending => return Ok(0),
        };
        let _ = e.free_batch(id);
        Ok(rc)
    }

    /// Waits for every batch; 0 if all completed, -1 if any failed or timed out (all freed).
    fn get_batch_transfer_status(&self, py: Python<'_>, batch_ids: Vec<u64>) -> PyResult<i32> {
        let e = self.engine()?;
        let r: Vec<(u64, Result<TransferState, String>)> = py.detach(|| {
            batch_ids
                .iter()
                .map(|&b| {
                    let s = e
                        .wait_batch(BatchId(b), WAIT_BOUND)
                        .map(|s| s.state)
                        .map_err(|e| e.to_string());
                    let _ = e.free_batch(BatchId(b));
                    (b, s)
                })
                .collect()
        });
        let mut rc = 0;
        for (b, s) in r {
            match s {
                Ok(TransferState::Completed) => {}
                Ok(other) => {
                    self.failed(py, &format!("batch {b}"), format!("{other:?}"));
                    rc = -1;
                }
                Err(m) => {
                    self.failed(py, &format!("batch {b}"), m);
                    rc = -1;
                }
            }
        }
        Ok(rc)
    }

    /// The notifications received so far (`TransferNotify` objects), oldest first.
    fn get_notifies(&self) -> PyResult<Vec<TransferNotify>> {
        Ok(self
            .engine()?
            .get_notifies()
            .into_iter()
            .map(|n| TransferNotify {
                name: n.name,
                msg: n.msg,
            })
            .collect())
    }

    /// Sends a notification by itself. Returns 0 or -1.
    fn send_notify(&self, py: Python<'_>, target_hostname: &str, notify: TransferNotify) -> PyResult<i32> {
        let e = self.engine()?;
        let r = self.session(py, &e, target_hostname).and_then(|h| {
            let n = Notification {
                name: notify.name,
                msg: notify.msg,
            };
            py.detach(|| e.send_notify(h, &n)).map_err(|e| e.to_string())
        });
        Ok(code(r.map_err(|m| {
            self.failed(py, &format!("send_notify to {target_hostname}"), m)
        })))
    }

    /// Checks that a peer answers (fetches its descriptor and connects). 0 if it does.
    fn send_probe(&self, py: Python<'_>, peer_server_name: &str) -> PyResult<i32> {
        let e = self.engine()?;
        let r = self.session(py, &e, peer_server_name).and_then(|h| {
            py.detach(|| e.refresh_segment(h))
                .map(|_| ())
                .map_err(|e| e.to_string())
        });
        if r.is_err() {
            self.sessions.lock().remove(peer_server_name);
        }
        Ok(code(r.map_err(|m| {
            self.failed(py, &format!("send_probe to {peer_server_name}"), m)
        })))
    }

    /// Pythonic write: `src` (a registered array, tensor or address) to `dst_addr` in the
    /// session's memory; `length` defaults to the object's size. Raises `TransferError`.
    #[pyo3(signature = (session, src, dst_addr, length = None, notify = None))]
    fn write(
        &self,
        py: Python<'_>,
        session: &str,
        src: &Bound<'_, PyAny>,
        dst_addr: u64,
        length: Option<u64>,
        notify: Option<TransferNotify>,
    ) -> PyResult<()> {
        self.one(py, "write", session, src, dst_addr, length, notify, Opcode::Write)
    }

    /// Pythonic read: `length` bytes (default: the object's size) at `src_addr` in the
    /// session's memory into `dst`. Raises `TransferError`.
    #[pyo3(signature = (session, dst, src_addr, length = None))]
    fn read(
        &self,
        py: Python<'_>,
        session: &str,
        dst: &Bound<'_, PyAny>,
        src_addr: u64,
        length: Option<u64>,
    ) -> PyResult<()> {
        self.one(py, "read", session, dst, src_addr, length, None, Opcode::Read)
    }

    /// Stops the engine: withdraws its descriptor and closes its ports.
    fn close(&self, py: Python<'_>) {
        let e = self.engine.lock().take();
        self.sessions.lock().clear();
        *self.managed.lock() = slab::Slabs::default();
        py.detach(|| drop(e));
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(&self, py: Python<'_>, _t: &Bound<'_, PyAny>, _v: &Bound<'_, PyAny>, _tb: &Bound<'_, PyAny>) {
        self.close(py)
    }
}

impl Engine {
    #[allow(clippy::too_many_arguments)]
    fn one(
        &self,
        py: Python<'_>,
        what: &str,
        session: &str,
        local: &Bound<'_, PyAny>,
        remote: u64,
        length: Option<u64>,
        notify: Option<TransferNotify>,
        opcode: Opcode,
    ) -> PyResult<()> {
        let m = memory_of(local)?;
        if m.cuda {
            return Err(PyValueError::new_err(CUDA_UNSUPPORTED));
        }
        let len = length
            .or(m.len.map(|l| l as u64))
            .ok_or_else(|| PyValueError::new_err("an address needs a length"))?;
        self.sync(
            py,
            what,
            session,
            opcode,
            &[m.addr],
            &[remote],
            &[len],
            notify.as_ref(),
            "",
        )?
        .map_err(TransferError::new_err)
    }
}

/// A batch ends by the engine's own transfer timeout (MC_TRANSFER_TIMEOUT, default 30 s) at
/// the latest: this bound on a wait only guards against a batch that never does.
const WAIT_BOUND: Duration = Duration::from_secs(3600);

fn op(o: TransferOpcode) -> Opcode {
    match o {
        TransferOpcode::Read => Opcode::Read,
        TransferOpcode::Write => Opcode::Write,
    }
}

/// The extension module (`flexns._flexns`; the `flexns` package re-exports it).
#[pymodule]
fn _flexns(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Engine>()?;
    m.add_class::<TransferOpcode>()?;
    m.add_class::<TransferNotify>()?;
    m.add_class::<etcd::EtcdStore>()?;
    m.add("TransferError", m.py().get_type::<TransferError>())?;
    m.add("SUPPORT_CUDA", false)?;
    // the largest notification (its JSON encoding: {"name":..,"msg":..}) one message carries
    m.add("MAX_NOTIFY_BYTES", kvcache_engine::MAX_NOTIFY_BYTES)?;
    m.add("SUPPORTED_PROTOCOLS", ("flexns", "tcp"))?;
    Ok(())
}
