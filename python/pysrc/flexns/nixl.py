"""NIXL's agent API (``nixl._api``, NIXL 1.x) over flexns.

Code written against ``from nixl._api import nixl_agent, nixl_agent_config`` runs with the
import changed to ``from flexns.nixl import nixl_agent, nixl_agent_config``: the same method
names, arguments, return values and transfer states ("DONE", "PROC", "ERR"). Each agent owns a
``flexns.TransferEngine`` (protocol "flexns" by default: one copy per byte between two
processes on one host). Metadata travels as a blob: ``get_agent_metadata()`` names this
agent's engine session and its registered regions, ``add_remote_agent(blob)`` reads it and
returns the remote agent's name. A transfer's descriptors go to the stack as one batch (adjacent
pairs merged), with its ``notif_msg`` delivered to the remote agent after the data landed.

Metadata also travels through etcd, as NIXL's does with ``NIXL_ETCD_ENDPOINTS``:
``send_local_metadata()`` stores the blob under ``NIXL_ETCD_NAMESPACE`` (default
``/nixl/agents/``) + agent name + ``/metadata``, ``fetch_remote_metadata(name)`` watches that key
and loads the agent once it appears (poll ``check_remote_metadata``), and
``invalidate_local_metadata()`` deletes it, after which the agents that fetched it drop this
agent. ``estimate_xfer_cost`` is an analytical estimate from the transfer's sizes and path,
corrected by the agent's own completed transfers (see the method).

Host memory only ("DRAM"/"cpu"): "VRAM"/"cuda" and CUDA tensors are refused with a
``nixlInvalidParamError``. Not offered: backend/plugin selection (``backends`` arguments are
accepted and must name "UCX" or "FLEXNS", or be empty), partial metadata, and the listener
thread (metadata sent to or fetched from a peer's ``ip_addr``): exchange blobs or use etcd.
A notification is at most ``flexns.MAX_NOTIFY_BYTES`` (3072) bytes encoded; a longer
``notif_msg`` is refused with a ``nixlInvalidParamError`` when the transfer is made.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
from typing import Optional

from . import _flexns

# NIXL's exception classes, in both name lists below.
_ERRORS = [
    "nixlError",
    "nixlInvalidParamError",
    "nixlNotFoundError",
    "nixlBackendError",
    "nixlRepostActiveError",
    "nixlNoTelemetryError",
]

__all__ = [
    "nixl_agent",
    "nixl_agent_config",
    "nixlXferDList",
    "nixlRegDList",
    "nixl_xfer_handle",
    "nixl_prepped_dlist_handle",
    *_ERRORS,
    "nixlXferTelemetry",
    "NIXL_INIT_AGENT",
    "DEFAULT_COMM_PORT",
]

# What ``nixl._bindings`` holds under the alias (flexns.use_as_nixl): the names code written
# for NIXL imports from it (vLLM: ``from nixl._bindings import nixlXferTelemetry``).
BINDINGS = [
    "nixlXferTelemetry",
    "nixlXferDList",
    "nixlRegDList",
    *_ERRORS,
    "NIXL_INIT_AGENT",
    "DEFAULT_COMM_PORT",
    "DRAM_SEG",
    "VRAM_SEG",
    "BLK_SEG",
    "OBJ_SEG",
    "FILE_SEG",
    "NIXL_READ",
    "NIXL_WRITE",
]

log = logging.getLogger("flexns.nixl")

NIXL_INIT_AGENT = ""
# NIXL's default listener port (nixlBind.DEFAULT_COMM_PORT); flexns.nixl has no listener, the
# value is only the default of the ``port`` arguments it ignores for peer-to-peer metadata.
DEFAULT_COMM_PORT = 8888
# NIXL's memory segment and operation enums (nixl_mem_t, nixl_xfer_op_t), for code that
# compares against them; flexns.nixl's descriptor lists carry the memory type by name.
DRAM_SEG, VRAM_SEG, BLK_SEG, OBJ_SEG, FILE_SEG = range(5)
NIXL_READ, NIXL_WRITE = 0, 1


class _Handle(int):
    """NIXL 1.5's handle objects (``nixl_prepped_dlist_handle``, ``nixl_xfer_handle``): opaque,
    with ``release()``; released when garbage-collected, as NIXL's are. They are ints too, so
    code written for older NIXL, which returned plain integers, keeps working."""

    def __new__(cls, agent, value: int):
        h = super().__new__(cls, value)
        h._agent = agent
        h._released = False
        return h

    def __repr__(self) -> str:
        return f"{type(self).__name__}(0x{int(self):x}, released={self._released})"

    def release(self):
        if not self._released:
            self._release(self._agent, int(self))
            self._released = True

    def __del__(self):
        if not self._released:
            try:
                self._release_quietly(self._agent, int(self))
            except Exception:  # noqa: BLE001 (finalizers never raise; NIXL logs and goes on)
                pass


class nixl_prepped_dlist_handle(_Handle):
    """A prepared descriptor list (``prep_xfer_dlist``)."""

    @staticmethod
    def _release(agent, h):
        agent.release_dlist_handle(h)

    @staticmethod
    def _release_quietly(agent, h):
        agent._dlists.pop(h, None)


class nixl_xfer_handle(_Handle):
    """A transfer request (``make_prepped_xfer``, ``initialize_xfer``). Released while it is in
    progress, it raises, as NIXL does when it cannot cancel; dropped while in progress, the
    request stays with its agent until it ends."""

    @staticmethod
    def _release(agent, h):
        agent.release_xfer_handle(h)

    @staticmethod
    def _release_quietly(agent, h):
        x = agent._xfers.get(h)
        if x is not None and x.state != "PROC":
            del agent._xfers[h]

_MAGIC = b"FLEXNS-NIXL1\n"
_HOST_MEM = {"DRAM": "DRAM", "cpu": "DRAM"}
_DEVICE_MEM = ("VRAM", "cuda", "FILE", "BLOCK", "OBJ")
_BACKENDS = ("UCX", "FLEXNS")


class nixlError(RuntimeError):
    """Base of the errors this module raises (NIXL's bindings raise one class per status)."""


class nixlInvalidParamError(nixlError):
    """A malformed argument (NIXL_ERR_INVALID_PARAM)."""


class nixlNotFoundError(nixlError):
    """An agent, handle or descriptor that is not known (NIXL_ERR_NOT_FOUND)."""


class nixlBackendError(nixlError):
    """The transfer engine refused the operation (NIXL_ERR_BACKEND)."""


class nixlRepostActiveError(nixlError):
    """A transfer posted again while it is still in progress (NIXL_ERR_REPOST_ACTIVE)."""


class nixlNoTelemetryError(nixlError):
    """Telemetry asked of an agent made without ``capture_telemetry`` (NIXL_ERR_NO_TELEMETRY)."""


def get_logger(name: str = "nixl") -> logging.Logger:
    """``nixl.logging.get_logger`` under the alias: a logger below ``flexns.nixl``."""
    return logging.getLogger(f"flexns.nixl.{name}")


class nixlXferTelemetry:
    """A transfer's telemetry, as NIXL reports it (``get_xfer_telemetry``): ``startTime`` (the
    post, microseconds of a monotonic clock), ``postDuration`` (how long posting took, us),
    ``xferDuration`` (post to completion seen, us; so far while in progress), ``totalBytes`` and
    ``descCount`` (descriptors after merging: the operations the stack was given)."""

    __slots__ = ("startTime", "postDuration", "xferDuration", "totalBytes", "descCount")

    def __init__(self, startTime=0, postDuration=0, xferDuration=0, totalBytes=0, descCount=0):
        self.startTime = startTime
        self.postDuration = postDuration
        self.xferDuration = xferDuration
        self.totalBytes = totalBytes
        self.descCount = descCount

    def __repr__(self):
        return (
            f"nixlXferTelemetry(startTime={self.startTime}, postDuration={self.postDuration}, "
            f"xferDuration={self.xferDuration}, totalBytes={self.totalBytes}, descCount={self.descCount})"
        )


def _mem_type(mem_type: Optional[str], what: str) -> str:
    if mem_type in _HOST_MEM:
        return _HOST_MEM[mem_type]
    if mem_type in _DEVICE_MEM:
        raise nixlInvalidParamError(
            f"{what}: mem_type {mem_type!r}: flexns.nixl moves host memory only (\"DRAM\" or \"cpu\")"
        )
    raise nixlInvalidParamError(f"{what}: mem_type {mem_type!r} is not one of \"DRAM\", \"cpu\"")


class _DList:
    """A descriptor list: (addr, len, dev_id) rows, with a memory type."""

    _width = 3

    def __init__(self, mem_type: str, descs=(), is_sorted: bool = False):
        self.mem_type = _mem_type(mem_type, type(self).__name__)
        rows = []
        for i, d in enumerate(descs):
            d = tuple(d)
            if len(d) != self._width:
                raise nixlInvalidParamError(
                    f"{type(self).__name__}: descriptor {i} has {len(d)} fields, expected {self._width}"
                )
            addr, length, dev = (int(x) for x in d[:3])
            if addr < 0 or length <= 0 or dev < 0:
                raise nixlInvalidParamError(
                    f"{type(self).__name__}: descriptor {i} ({addr:#x}, {length}, {dev}): "
                    "address and device id must be >= 0, length > 0"
                )
            rows.append((addr, length, dev) + tuple(d[3:]))
        self.descs = sorted(rows) if is_sorted else rows
        self.is_sorted = is_sorted

    def descCount(self) -> int:
        return len(self.descs)

    def isEmpty(self) -> bool:
        return not self.descs

    def getType(self) -> str:
        return self.mem_type

    def __len__(self):
        return len(self.descs)

    def __getitem__(self, i):
        return self.descs[i]

    def __iter__(self):
        return iter(self.descs)

    def __eq__(self, other):
        return type(self) is type(other) and self.mem_type == other.mem_type and self.descs == other.descs

    def __repr__(self):
        return f"{type(self).__name__}({self.mem_type}, {len(self.descs)} descriptors)"


class nixlXferDList(_DList):
    """Transfer descriptors: (addr, len, dev_id)."""


class nixlRegDList(_DList):
    """Registration descriptors: (addr, len, dev_id, meta)."""

    _width = 4


def _memory_desc(obj, i: int):
    """(addr, len, dev_id) of a tensor (``data_ptr()``) or a NumPy array; CUDA is refused."""
    if hasattr(obj, "data_ptr"):
        dev = getattr(obj, "device", None)
        if getattr(obj, "is_cuda", False) or str(dev).startswith("cuda"):
            raise nixlInvalidParamError(
                f"descriptor {i}: a CUDA tensor ({dev}): flexns.nixl moves host memory only; "
                "copy it to a CPU tensor (flexns.SUPPORT_CUDA is False)"
            )
        if hasattr(obj, "is_contiguous") and not obj.is_contiguous():
            raise nixlInvalidParamError(f"descriptor {i}: the tensor is not contiguous (call .contiguous())")
        n = getattr(obj, "nbytes", None)
        if n is None:
            n = obj.numel() * obj.element_size()
        return (int(obj.data_ptr()), int(n), 0)
    if hasattr(obj, "__cuda_array_interface__"):
        raise nixlInvalidParamError(f"descriptor {i}: CUDA memory: flexns.nixl moves host memory only")
    ai = getattr(obj, "__array_interface__", None)
    if ai is not None:
        if not obj.flags.c_contiguous:
            raise nixlInvalidParamError(f"descriptor {i}: the array is not C-contiguous (numpy.ascontiguousarray)")
        return (int(ai["data"][0]), int(obj.nbytes), 0)
    raise nixlInvalidParamError(
        f"descriptor {i}: expected a tuple, a tensor or a NumPy array, not {type(obj).__name__}"
    )


def _is_desc_array(x) -> bool:
    """A NumPy array of shape (N, 3) of 64-bit integers (addresses need 64 bits): N descriptor
    rows, as NIXL reads one. Any other array is memory: one descriptor for its bytes."""
    return (
        hasattr(x, "__array_interface__")
        and getattr(x, "ndim", 0) == 2
        and x.shape[1] == 3
        and getattr(x.dtype, "kind", "") in ("i", "u")
        and x.dtype.itemsize == 8
    )


def _rows(descs, mem_type, reg: bool):
    """Descriptor rows and memory type from NIXL's accepted inputs."""
    if _is_desc_array(descs):
        if mem_type is None:
            raise nixlInvalidParamError("mem_type is required with a NumPy descriptor array")
        rows = [tuple(int(v) for v in r) for r in descs.tolist()]
        return [r + ("",) for r in rows] if reg else rows, mem_type
    if isinstance(descs, (list, tuple)) and descs and isinstance(descs[0], tuple):
        if mem_type is None:
            raise nixlInvalidParamError("mem_type is required with a list of descriptor tuples")
        width = 4 if reg else 3
        for i, d in enumerate(descs):
            if len(d) != width:
                kind = "4-tuples (addr, len, dev_id, meta) for registration" if reg else "3-tuples (addr, len, dev_id) for a transfer"
                raise nixlInvalidParamError(f"descriptor {i} has {len(d)} fields: {kind}")
        return list(descs), mem_type
    objs = list(descs) if isinstance(descs, (list, tuple)) else [descs]
    if not objs:
        raise nixlInvalidParamError("an empty descriptor list")
    rows = [_memory_desc(o, i) for i, o in enumerate(objs)]
    return ([r + ("",) for r in rows] if reg else rows), (mem_type or "DRAM")


class nixl_agent_config:
    """NIXL's agent configuration, with NIXL's positional order. ``enable_prog_thread``,
    ``enable_listen_thread``, ``listen_port`` and ``num_threads`` are accepted for compatibility
    (flexns's engine progresses by itself; metadata goes by blob or etcd); ``capture_telemetry``
    makes ``get_xfer_telemetry`` answer (as in NIXL, it raises ``nixlNoTelemetryError``
    otherwise); ``backends`` may name "UCX" or "FLEXNS" (both mean the flexns engine). flexns
    additions: ``host`` (the address peers reach this agent's engine at; default
    ``FLEXNS_NIXL_HOST`` or 127.0.0.1), ``protocol`` ("flexns" or "tcp") and
    ``etcd_endpoints`` (comma-separated, for the etcd metadata calls; default
    ``NIXL_ETCD_ENDPOINTS``)."""

    def __init__(
        self,
        enable_prog_thread: bool = True,
        enable_listen_thread: bool = False,
        listen_port: int = 0,
        capture_telemetry: bool = False,
        num_threads: int = 0,
        backends: list[str] = ["UCX"],  # noqa: B006 (NIXL's signature)
        host: Optional[str] = None,
        protocol: str = "flexns",
        etcd_endpoints: Optional[str] = None,
    ):
        if isinstance(backends, str):
            raise nixlInvalidParamError(f"backends: a list of backend names, not the string {backends!r}")
        for b in backends:
            if b not in _BACKENDS:
                raise nixlInvalidParamError(f"backends: {b!r}: flexns.nixl runs one engine; name \"UCX\" or \"FLEXNS\"")
        self.backends = list(backends)
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = bool(capture_telemetry)
        self.num_threads = num_threads
        self.host = host or os.environ.get("FLEXNS_NIXL_HOST", "127.0.0.1")
        self.protocol = protocol
        # where send_local_metadata/fetch_remote_metadata go: comma-separated etcd endpoints
        self.etcd_endpoints = etcd_endpoints if etcd_endpoints is not None else os.environ.get("NIXL_ETCD_ENDPOINTS", "")


class _Xfer:
    """One transfer request: merged (local, remote, len) pieces to one remote agent."""

    def __init__(self, op, remote, pieces, notif):
        self.op = op
        self.remote = remote
        self.pieces = pieces
        self.notif = notif
        self.batch = 0
        self.state = "INIT"  # INIT, PROC, DONE, ERR
        self.error = ""
        self.telemetry = nixlXferTelemetry(totalBytes=sum(p[2] for p in pieces), descCount=len(pieces))


class nixl_agent:
    """A NIXL agent over a flexns ``TransferEngine`` (see the module's documentation)."""

    def __init__(self, agent_name: str, nixl_conf: Optional[nixl_agent_config] = None, instantiate_all: bool = False):
        if not isinstance(agent_name, str) or not agent_name:
            raise nixlInvalidParamError("agent_name: a non-empty string is required")
        conf = nixl_conf or nixl_agent_config()
        self.name = agent_name
        self.conf = conf
        self.engine = _flexns.TransferEngine()
        if self.engine.initialize(conf.host, "P2PHANDSHAKE", conf.protocol, "") != 0:
            raise nixlBackendError(f"agent {agent_name}: the engine did not start: {self.engine.last_error()}")
        self.notifs: dict[str, list[bytes]] = {}
        self.backends = {b: i for i, b in enumerate(conf.backends or ["UCX"])}
        self.plugin_list = list(_BACKENDS)
        self._lock = threading.Lock()
        self._regs: list[tuple[int, int]] = []  # (addr, len) registered here
        self._remotes: dict[str, dict] = {}  # name -> {"session", "regions"}
        self._dlists: dict[int, tuple[Optional[str], nixlXferDList]] = {}
        self._xfers: dict[int, _Xfer] = {}
        self._ids = itertools.count(1)
        self._etcd = None  # the EtcdStore, made at the first etcd metadata call
        self._etcd_ns = _etcd_namespace()
        self._sent_keys: set[str] = set()  # keys send_local_metadata stored
        self._fetched: dict[str, list] = {}  # agent -> [key, revision loaded or None]
        self._cost: dict[tuple[str, str], list[float]] = {}  # path -> [correction, relative error, n]
        log.info("flexns.nixl agent %s: engine session %s (%s)", agent_name, self.engine.get_session_id(), conf.protocol)

    # ---- plugins and backends (one engine) ----
    def get_plugin_list(self) -> list[str]:
        return list(self.plugin_list)

    def get_plugin_mem_types(self, backend: str) -> list[str]:
        return ["DRAM"] if backend in _BACKENDS else []

    def get_backend_mem_types(self, backend: str) -> list[str]:
        return ["DRAM"] if backend in self.backends else []

    def get_plugin_params(self, backend: str) -> dict[str, str]:
        return {}

    def get_backend_params(self, backend: str) -> dict[str, str]:
        return {}

    def create_backend(self, backend: str, initParams: dict[str, str] = {}):  # noqa: B006
        if backend not in _BACKENDS:
            raise nixlNotFoundError(f"backend {backend!r}: flexns.nixl has only \"UCX\"/\"FLEXNS\" (the flexns engine)")
        self.backends.setdefault(backend, len(self.backends))

    def _check_backends(self, backends):
        for b in backends or []:
            if b not in self.backends:
                raise nixlNotFoundError(f"backends: {b!r} is not instantiated in agent {self.name}")

    # ---- descriptor lists ----
    def get_xfer_descs(self, descs, mem_type: Optional[str] = None, *, is_sorted: bool = False) -> nixlXferDList:
        if isinstance(descs, nixlXferDList):
            return descs
        if isinstance(descs, nixlRegDList):
            raise nixlInvalidParamError("a nixlRegDList given for a transfer: use get_xfer_descs on (addr, len, dev_id) tuples")
        rows, mt = _rows(descs, mem_type, reg=False)
        return nixlXferDList(mt, rows, is_sorted)

    def get_reg_descs(self, descs, mem_type: Optional[str] = None, *, is_sorted: bool = False) -> nixlRegDList:
        if isinstance(descs, nixlRegDList):
            return descs
        if isinstance(descs, nixlXferDList):
            raise nixlInvalidParamError("a nixlXferDList given for registration: use get_reg_descs")
        rows, mt = _rows(descs, mem_type, reg=True)
        return nixlRegDList(mt, rows, is_sorted)

    def get_serialized_descs(self, descs) -> bytes:
        return json.dumps({"kind": type(descs).__name__, "mem": descs.mem_type, "descs": [list(d) for d in descs]}).encode()

    def deserialize_descs(self, serialized_descs: bytes):
        d = json.loads(serialized_descs)
        cls = {"nixlXferDList": nixlXferDList, "nixlRegDList": nixlRegDList}.get(d.get("kind"))
        if cls is None:
            raise nixlInvalidParamError("serialized_descs: not a descriptor list from get_serialized_descs")
        return cls(d["mem"], [tuple(x) for x in d["descs"]])

    # ---- memory ----
    def register_memory(self, reg_list, mem_type: Optional[str] = None, backends: list[str] = [], *, is_sorted: bool = False) -> nixlRegDList:  # noqa: B006
        self._check_backends(backends)
        descs = self.get_reg_descs(reg_list, mem_type, is_sorted=is_sorted)
        done = []
        for i, (addr, length, _dev, _meta) in enumerate(descs):
            if self.engine.register_memory(addr, length) != 0:
                cause = self.engine.last_error()
                for a, n in done:
                    self.engine.unregister_memory(a)
                    self._regs.remove((a, n))
                raise nixlBackendError(f"register_memory: descriptor {i} ({addr:#x}, {length}): {cause} (none registered)")
            done.append((addr, length))
            self._regs.append((addr, length))
        return descs

    def deregister_memory(self, dereg_list: nixlRegDList, backends: list[str] = []):  # noqa: B006
        self._check_backends(backends)
        missing = []
        for addr, length, _dev, _meta in self.get_reg_descs(dereg_list):
            if (addr, length) not in self._regs or self.engine.unregister_memory(addr) != 0:
                missing.append(f"({addr:#x}, {length})")
                continue
            self._regs.remove((addr, length))
        if missing:
            raise nixlNotFoundError(f"deregister_memory: not registered with agent {self.name}: {', '.join(missing)}")

    def query_memory(self, reg_list, backend: str, mem_type: Optional[str] = None) -> list[Optional[dict[str, str]]]:
        """NIXL's shape: one entry per descriptor, None where the memory is not registered with
        this agent, else a dict of strings: ``mem_type``, the registered region holding it
        (``base``, ``length``, in decimal) and the descriptor's ``offset`` in it. As in NIXL,
        a ``backend`` that is not instantiated is a ``ValueError``."""
        if backend not in self.backends:
            raise ValueError(f"Backend '{backend}' not found. Available backends: {list(self.backends)}")
        descs = self.get_reg_descs(reg_list, mem_type)
        out = []
        for a, n, _d, _m in descs:
            hit = next(((b, bn) for b, bn in self._regs if b <= a and a + n <= b + bn), None)
            if hit is None:
                out.append(None)
            else:
                b, bn = hit
                out.append({"mem_type": descs.mem_type, "base": str(b), "length": str(bn), "offset": str(a - b)})
        return out

    @staticmethod
    def _inside(regions, addr, length) -> bool:
        return any(b <= addr and addr + length <= b + n for b, n in regions)

    # ---- metadata ----
    def get_agent_metadata(self) -> bytes:
        md = {"name": self.name, "session": self.engine.get_session_id(), "regions": [list(r) for r in self._regs]}
        return _MAGIC + json.dumps(md).encode()

    def add_remote_agent(self, metadata: bytes) -> str:
        if not isinstance(metadata, (bytes, bytearray)) or not bytes(metadata).startswith(_MAGIC):
            raise nixlInvalidParamError("metadata: not a flexns.nixl agent metadata blob (from get_agent_metadata)")
        try:
            md = json.loads(bytes(metadata)[len(_MAGIC):])
            name, session = str(md["name"]), str(md["session"])
            regions = [(int(a), int(n)) for a, n in md["regions"]]
        except (ValueError, KeyError, TypeError) as e:
            raise nixlInvalidParamError(f"metadata: a malformed flexns.nixl blob: {e}") from e
        with self._lock:
            self._remotes[name] = {"session": session, "regions": regions}
        return name

    def remove_remote_agent(self, agent: str):
        with self._lock:
            if self._remotes.pop(agent, None) is None:
                raise nixlNotFoundError(f"remove_remote_agent: agent {agent!r} is not known to {self.name}")

    def check_remote_metadata(self, agent: str, descs=None) -> bool:
        self._sync_etcd()
        r = self._remotes.get(agent)
        if r is None:
            return False
        return descs is None or all(self._inside(r["regions"], a, n) for a, n, _d in self.get_xfer_descs(descs))

    def make_connection(self, remote_agent: str, backends: list[str] = []):  # noqa: B006
        if self.engine.send_probe(self._remote(remote_agent)["session"]) != 0:
            raise nixlBackendError(f"make_connection to {remote_agent}: {self.engine.last_error()}")

    def _remote(self, agent: str) -> dict:
        if agent == self.name:
            return {"session": self.engine.get_session_id(), "regions": list(self._regs)}
        self._sync_etcd()
        r = self._remotes.get(agent)
        if r is None:
            raise nixlNotFoundError(f"remote agent {agent!r} is not known to {self.name} (add_remote_agent first)")
        return r

    def _check_inside(self, regions, descs, whose):
        for i, (a, n, _d) in enumerate(descs):
            if not self._inside(regions, a, n):
                raise nixlNotFoundError(f"descriptor {i} ({a:#x}, {n}) is not inside memory {whose} registered")

    # ---- transfers ----
    def prep_xfer_dlist(self, agent_name: str, xfer_list, mem_type: Optional[str] = None, backends: list[str] = [], *, is_sorted: bool = False) -> "nixl_prepped_dlist_handle":  # noqa: B006
        self._check_backends(backends)
        descs = self.get_xfer_descs(xfer_list, mem_type, is_sorted=is_sorted)
        if agent_name in ("", "NIXL_INIT_AGENT"):
            self._check_inside(self._regs, descs, f"agent {self.name}")
            agent = None
        else:
            self._check_inside(self._remote(agent_name)["regions"], descs, f"agent {agent_name}")
            agent = agent_name
        h = next(self._ids)
        self._dlists[h] = (agent, descs)
        return nixl_prepped_dlist_handle(self, h)

    def release_dlist_handle(self, handle: int):
        if self._dlists.pop(handle, None) is None:
            raise nixlNotFoundError(f"release_dlist_handle: {handle} is not a prepared list of {self.name}")

    def _new_xfer(self, operation, local, remote, agent, notif_msg, merge=True) -> int:
        if operation not in ("READ", "WRITE"):
            raise nixlInvalidParamError(f"operation {operation!r}: \"READ\" or \"WRITE\"")
        if len(local) != len(remote):
            raise nixlInvalidParamError(f"{len(local)} local and {len(remote)} remote descriptors")
        pieces = []
        for i, ((la, ln, _), (ra, rn, _)) in enumerate(zip(local, remote)):
            if ln != rn:
                raise nixlInvalidParamError(f"descriptor pair {i}: local length {ln} != remote length {rn}")
            if merge and pieces and pieces[-1][0] + pieces[-1][2] == la and pieces[-1][1] + pieces[-1][2] == ra:
                pieces[-1][2] += ln
            else:
                pieces.append([la, ra, ln])
        if not pieces:
            raise nixlInvalidParamError("an empty transfer")
        notif = self._check_notif(_as_bytes(notif_msg, "notif_msg"))
        h = next(self._ids)
        self._xfers[h] = _Xfer(operation, agent, pieces, notif)
        return nixl_xfer_handle(self, h)

    def make_prepped_xfer(self, operation: str, local_xfer_side: int, local_indices: list[int], remote_xfer_side: int, remote_indices: list[int], notif_msg: bytes = b"", backends: list[str] = [], skip_desc_merge: bool = False) -> int:  # noqa: B006
        self._check_backends(backends)
        sides = []
        for what, h, idx in (("local", local_xfer_side, local_indices), ("remote", remote_xfer_side, remote_indices)):
            if h not in self._dlists:
                raise nixlNotFoundError(f"{what}_xfer_side: {h} is not a prepared list of {self.name}")
            agent, descs = self._dlists[h]
            try:
                sides.append((agent, [descs[int(i)] for i in idx]))
            except IndexError:
                raise nixlInvalidParamError(f"{what}_indices: an index past the {len(descs)} prepared descriptors") from None
        if sides[0][0] is not None:
            raise nixlInvalidParamError("local_xfer_side: prepared for a remote agent, not NIXL_INIT_AGENT")
        agent = sides[1][0]
        if agent is None:
            raise nixlInvalidParamError("remote_xfer_side: prepared with NIXL_INIT_AGENT; prepare it with the remote (or own) agent name")
        return self._new_xfer(operation, sides[0][1], sides[1][1], agent, notif_msg, merge=not skip_desc_merge)

    def initialize_xfer(self, operation: str, local_descs, remote_descs, remote_agent: str, notif_msg: bytes = b"", backends: list[str] = []) -> int:  # noqa: B006
        self._check_backends(backends)
        local = self.get_xfer_descs(local_descs)
        remote = self.get_xfer_descs(remote_descs)
        self._check_inside(self._regs, local, f"agent {self.name}")
        self._check_inside(self._remote(remote_agent)["regions"], remote, f"agent {remote_agent}")
        return self._new_xfer(operation, local, remote, remote_agent, notif_msg)

    def transfer(self, handle: int, notif_msg: bytes = b"") -> str:
        x = self._xfer(handle)
        if x.state == "PROC":
            self.check_xfer_state(handle)
            if x.state == "PROC":
                raise nixlRepostActiveError(f"transfer {handle}: still in progress; wait for DONE before posting it again")
        if notif_msg:
            x.notif = self._check_notif(_as_bytes(notif_msg, "notif_msg"))
        try:
            session = self._remote(x.remote)["session"]
        except nixlNotFoundError as e:
            return self._fail(handle, x, str(e))
        op = _flexns.TransferOpcode.Write if x.op == "WRITE" else _flexns.TransferOpcode.Read
        args = (session, [p[0] for p in x.pieces], [p[1] for p in x.pieces], [p[2] for p in x.pieces], op)
        t = x.telemetry
        t.startTime, t.xferDuration = time.monotonic_ns() // 1000, 0
        if x.notif:
            note = _flexns.TransferNotify(self.name, x.notif.decode("latin-1"))
            x.batch = self.engine.batch_transfer_async_notify(*args, note)
        else:
            x.batch = self.engine.batch_transfer_async(*args)
        t.postDuration = time.monotonic_ns() // 1000 - t.startTime
        if x.batch == 0:
            return self._fail(handle, x, self.engine.last_error())
        x.state = "PROC"
        return self.check_xfer_state(handle)

    def _fail(self, handle, x, cause) -> str:
        x.state, x.error, x.batch = "ERR", cause, 0
        log.error("flexns.nixl agent %s: transfer %d (%s to %s) failed: %s", self.name, handle, x.op, x.remote, cause)
        return "ERR"

    def _xfer(self, handle) -> _Xfer:
        x = self._xfers.get(handle)
        if x is None:
            raise nixlNotFoundError(f"transfer handle {handle} is not known to {self.name} (released?)")
        return x

    def check_xfer_state(self, handle: int) -> str:
        x = self._xfer(handle)
        if x.state == "INIT":
            log.warning("flexns.nixl agent %s: transfer %d was never posted (call transfer first)", self.name, handle)
            return "ERR"
        if x.state != "PROC":
            return x.state
        rc = self.engine.transfer_check_status(x.batch)
        if rc == 0:
            return "PROC"
        if rc == 1:
            x.state, x.batch = "DONE", 0
            x.telemetry.xferDuration = time.monotonic_ns() // 1000 - x.telemetry.startTime
            self._learn_cost(x)
            return "DONE"
        return self._fail(handle, x, self.engine.last_error())

    def get_xfer_telemetry(self, handle: int) -> nixlXferTelemetry:
        """The transfer's telemetry (``nixlXferTelemetry``); as NIXL, only for an agent whose
        config has ``capture_telemetry=True``."""
        x = self._xfer(handle)
        if not self.conf.capture_telemetry:
            raise nixlNoTelemetryError(
                f"get_xfer_telemetry: agent {self.name} was made without capture_telemetry=True in its nixl_agent_config"
            )
        t = x.telemetry
        if x.state == "PROC":
            t.xferDuration = time.monotonic_ns() // 1000 - t.startTime
        return nixlXferTelemetry(t.startTime, t.postDuration, t.xferDuration, t.totalBytes, t.descCount)

    def get_xfer_error(self, handle: int) -> str:
        """flexns addition: why a transfer in state "ERR" failed ("" otherwise)."""
        return self._xfer(handle).error

    def query_xfer_backend(self, handle: int) -> str:
        self._xfer(handle)
        return next(iter(self.backends))

    def estimate_xfer_cost(self, handle: int) -> tuple[int, int, str]:
        """NIXL's (duration, error margin, method): microseconds, and "ANALYTICAL_BACKEND".

        The model: ``duration = ops * per_op + bytes / bandwidth``, where ``ops`` is the number
        of merged descriptors (each one operation of the stack), ``bytes`` their sum, and
        ``per_op``/``bandwidth`` are those of the path: the protocol ("flexns" or "tcp") and
        whether the peer is on this host (its address is a loopback one or this agent's own)
        or across a network (_COST_PRIORS, measured on a 2-core VM). The result is scaled by a
        correction this agent learns from its own completed transfers on that path (a moving
        average of measured / modelled time), and the margin is the moving average of the
        relative error after correction times the duration (half of it before any transfer
        completed on the path)."""
        x = self._xfer(handle)
        path = self._path(x.remote)
        per_op, per_byte = _COST_PRIORS[path]
        model = len(x.pieces) * per_op + sum(p[2] for p in x.pieces) * per_byte
        corr, err, n = self._cost.get(path, (1.0, 0.5, 0))
        duration = model * corr
        return int(round(duration)), int(round(duration * err)), "ANALYTICAL_BACKEND"

    def _path(self, agent) -> tuple[str, str]:
        host = self._remote(agent)["session"].rsplit(":", 1)[0]
        local = host.startswith("127.") or host in ("localhost", self.conf.host)
        return (self.conf.protocol, "same-host" if local else "network")

    def _learn_cost(self, x: _Xfer):
        try:
            path = self._path(x.remote)
        except nixlNotFoundError:
            return
        per_op, per_byte = _COST_PRIORS[path]
        model = len(x.pieces) * per_op + x.telemetry.totalBytes * per_byte
        seen = max(1, x.telemetry.xferDuration)
        corr, err, n = self._cost.get(path, (1.0, 0.5, 0))
        ratio = min(100.0, max(0.01, seen / model))
        a = 1.0 if n == 0 else 0.2  # the first observation replaces the prior
        new_corr = corr + a * (ratio - corr)
        rel = abs(seen - model * new_corr) / seen
        new_err = rel if n == 0 else err + 0.2 * (rel - err)
        self._cost[path] = (new_corr, max(0.05, new_err), n + 1)

    def release_xfer_handle(self, handle: int):
        x = self._xfer(handle)
        if x.state == "PROC" and self.check_xfer_state(handle) == "PROC":
            raise nixlBackendError(f"release_xfer_handle: transfer {handle} is in progress and cannot be canceled; wait for DONE or ERR")
        del self._xfers[handle]

    # ---- notifications ----
    def _take(self, into: dict):
        for n in self.engine.get_notifies():
            try:
                msg = n.msg.encode("latin-1")
            except UnicodeEncodeError:  # not from a flexns.nixl agent
                msg = n.msg.encode()
            into.setdefault(n.name, []).append(msg)
        return into

    def get_new_notifs(self, backends: list[str] = []) -> dict[str, list[bytes]]:  # noqa: B006
        return self._take({})

    def update_notifs(self, backends: list[str] = []) -> dict[str, list[bytes]]:  # noqa: B006
        return self._take(self.notifs)

    def check_remote_xfer_done(self, remote_agent_name: str, lookup_tag: bytes, backends: list[str] = [], tag_is_prefix=True) -> bool:  # noqa: B006
        self._take(self.notifs)
        tag = _as_bytes(lookup_tag, "lookup_tag")
        for msg in self.notifs.get(remote_agent_name, []):
            if (msg.startswith(tag) if tag_is_prefix else tag in msg):
                self.notifs[remote_agent_name].remove(msg)
                return True
        return False

    def send_notif(self, remote_agent_name: str, notif_msg: bytes, backend: Optional[str] = None):
        if backend is not None:
            self._check_backends([backend])
        session = self._remote(remote_agent_name)["session"]
        msg = self._check_notif(_as_bytes(notif_msg, "notif_msg"))
        note = _flexns.TransferNotify(self.name, msg.decode("latin-1"))
        if self.engine.send_notify(session, note) != 0:
            raise nixlBackendError(f"send_notif to {remote_agent_name}: {self.engine.last_error()}")

    # ---- not offered ----
    def get_partial_agent_metadata(self, *a, **k):
        raise nixlError("partial metadata is not offered by flexns.nixl: exchange get_agent_metadata() blobs")

    send_partial_agent_metadata = get_partial_agent_metadata

    # ---- metadata through etcd (NIXL_ETCD_ENDPOINTS) ----
    def _store(self, what):
        if self._etcd is None:
            if not self.conf.etcd_endpoints:
                raise nixlInvalidParamError(
                    f"{what}: no etcd endpoints: set NIXL_ETCD_ENDPOINTS or nixl_agent_config(etcd_endpoints=...) "
                    "(flexns.nixl has no listener thread for peer-to-peer metadata)"
                )
            try:
                self._etcd = _flexns.EtcdStore(self.conf.etcd_endpoints)
            except _flexns.TransferError as e:
                raise nixlBackendError(f"{what}: {e}") from e
        return self._etcd

    @staticmethod
    def _no_peer(what, ip_addr):
        if ip_addr:
            raise nixlInvalidParamError(
                f"{what}: ip_addr {ip_addr!r}: metadata to or from a peer's listener is not offered by "
                "flexns.nixl; leave ip_addr empty to use etcd (NIXL_ETCD_ENDPOINTS), or exchange get_agent_metadata() blobs"
            )

    def _key(self, agent, label=""):
        return f"{self._etcd_ns}{agent}/{label or 'metadata'}"

    def send_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT):
        """Stores this agent's metadata in etcd, where ``fetch_remote_metadata`` finds it.
        Call it again after registering more memory."""
        self._no_peer("send_local_metadata", ip_addr)
        store, key = self._store("send_local_metadata"), self._key(self.name)
        try:
            store.put(key, self.get_agent_metadata())
        except _flexns.TransferError as e:
            raise nixlBackendError(f"send_local_metadata: {e}") from e
        self._sent_keys.add(key)

    def fetch_remote_metadata(self, remote_agent: str, ip_addr: str = "", port: int = DEFAULT_COMM_PORT, label: str = ""):
        """Asks for ``remote_agent``'s metadata from etcd; as in NIXL it is loaded
        asynchronously (here: as soon as it is in etcd; check with ``check_remote_metadata``),
        and dropped again when that agent invalidates it."""
        self._no_peer("fetch_remote_metadata", ip_addr)
        if not isinstance(remote_agent, str) or not remote_agent:
            raise nixlInvalidParamError("remote_agent: a non-empty agent name is required")
        store = self._store("fetch_remote_metadata")
        try:
            store.watch(self._etcd_ns)
        except _flexns.TransferError as e:
            raise nixlBackendError(f"fetch_remote_metadata: {e}") from e
        self._fetched.setdefault(remote_agent, [self._key(remote_agent, label), None])
        self._sync_etcd()

    def invalidate_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT):
        """Deletes this agent's metadata from etcd; the agents that fetched it drop this agent."""
        self._no_peer("invalidate_local_metadata", ip_addr)
        store = self._store("invalidate_local_metadata")
        try:
            for key in sorted(self._sent_keys | {self._key(self.name)}):
                store.delete(key)
        except _flexns.TransferError as e:
            raise nixlBackendError(f"invalidate_local_metadata: {e}") from e
        self._sent_keys.clear()

    def _sync_etcd(self):
        """Loads fetched agents whose metadata appeared or changed in etcd, drops those whose
        metadata was deleted (invalidated)."""
        if not self._fetched:
            return
        for agent, entry in list(self._fetched.items()):
            key, loaded = entry
            got = self._etcd.watched(self._etcd_ns, key)
            if got is not None and got[1] != loaded:
                try:
                    name = self.add_remote_agent(got[0])
                except nixlError as e:
                    log.error("flexns.nixl agent %s: etcd key %s: %s", self.name, key, e)
                    entry[1] = got[1]
                    continue
                if name != agent:
                    log.error("flexns.nixl agent %s: etcd key %s holds agent %r's metadata, not %r", self.name, key, name, agent)
                entry[1] = got[1]
            elif got is None and loaded is not None:
                with self._lock:
                    self._remotes.pop(agent, None)
                entry[1] = None
                log.info("flexns.nixl agent %s: %s invalidated its metadata; removed", self.name, agent)

    def _check_notif(self, msg: bytes) -> bytes:
        n = len(json.dumps({"name": self.name, "msg": msg.decode("latin-1")}, ensure_ascii=False, separators=(",", ":")).encode())
        if n > _flexns.MAX_NOTIFY_BYTES:
            raise nixlInvalidParamError(
                f"notif_msg: {len(msg)} bytes ({n} encoded with the agent name {self.name!r}) exceed the "
                f"{_flexns.MAX_NOTIFY_BYTES}-byte limit of a flexns notification; send larger data by a transfer"
            )
        return msg

    def close(self):
        """flexns addition: stops this agent's engine (and, as NIXL's agent does when it is
        destroyed, deletes the metadata it sent to etcd)."""
        if self._sent_keys:
            try:
                self.invalidate_local_metadata()
            except nixlError as e:
                log.warning("flexns.nixl agent %s: %s", self.name, e)
        self.engine.close()


def _etcd_namespace() -> str:
    ns = os.environ.get("NIXL_ETCD_NAMESPACE", "/nixl/agents/")
    return ns if ns.endswith("/") else ns + "/"


# estimate_xfer_cost's priors, by (protocol, path): (microseconds per operation, microseconds
# per byte). Same host: fitted to the medians of NIXL-API WRITEs between two processes on a
# 2-core VM (64 x 16 KiB, 256 x 4 KiB, 16 MiB, 64 MiB; docs/PYTHON.md has the figures):
# flexns 10 us + 10 GB/s, tcp 20 us + 2 GB/s. Across a network nothing was measured: the prior
# is the loopback tcp one, and the correction learned from the first completed transfer
# replaces it.
_COST_PRIORS = {
    ("flexns", "same-host"): (10.0, 1 / 10000.0),
    ("flexns", "network"): (20.0, 1 / 2000.0),
    ("tcp", "same-host"): (20.0, 1 / 2000.0),
    ("tcp", "network"): (20.0, 1 / 2000.0),
}


def _as_bytes(msg, what) -> bytes:
    if isinstance(msg, str):
        return msg.encode()
    if isinstance(msg, (bytes, bytearray, memoryview)):
        return bytes(msg)
    raise nixlInvalidParamError(f"{what}: bytes or str, not {type(msg).__name__}")
