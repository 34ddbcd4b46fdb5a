"""flexns's KV-cache transfer engine for Python.

``flexns.TransferEngine`` has the methods, arguments and return conventions of
``mooncake.engine.TransferEngine`` (what vLLM's MooncakeConnector and SGLang's disaggregation
code call), over the flexns stack (``protocol="flexns"``) or kernel TCP (``protocol="tcp"``).
Unlike Mooncake, nothing falls back silently: an unknown protocol is a ``ValueError`` naming
the supported ones, and every failure that a Mooncake-style call reports as -1 (or batch id 0)
is logged on the ``flexns`` logger with its cause and kept for ``engine.last_error()``.

Memory may be an address (int, as in Mooncake), a NumPy array or a PyTorch tensor::

    import flexns, numpy as np
    e = flexns.TransferEngine()
    e.initialize("127.0.0.1", "P2PHANDSHAKE", "flexns", "")
    kv = np.zeros(1 << 20, dtype=np.uint8)
    e.register_memory(kv)                     # kept alive until unregistered
    e.write("127.0.0.1:15123", kv, peer_addr)  # raises flexns.TransferError on failure

``flexns.nixl`` offers NIXL's agent API (``nixl_agent``, ``nixl_agent_config``) over the same
engine, for host memory; ``flexns.use_as_nixl()`` (or ``FLEXNS_AS_NIXL``, or
``python -m flexns.as_nixl``) makes ``from nixl._api import nixl_agent`` resolve to it.
"""

from ._flexns import (  # noqa: F401
    MAX_NOTIFY_BYTES,
    SUPPORT_CUDA,
    SUPPORTED_PROTOCOLS,
    TransferEngine,
    TransferError,
    TransferNotify,
    TransferOpcode,
)

__all__ = [
    "TransferEngine",
    "TransferError",
    "TransferNotify",
    "TransferOpcode",
    "SUPPORT_CUDA",
    "SUPPORTED_PROTOCOLS",
    "MAX_NOTIFY_BYTES",
    "use_as_mooncake",
    "use_as_nixl",
]


def _alias_package(name, label, use, var, export):
    """The empty package module an alias installs as ``name`` (its submodules are set by the
    caller), after setting ``var=force`` in the environment when ``export`` says so."""
    import os
    import types

    if export:
        os.environ[var] = "force"
    pkg = types.ModuleType(name)
    pkg.__path__ = []  # a package, so that submodule imports resolve
    pkg.__doc__ = f"flexns standing in for {label} (flexns.{use}, {var})"
    return pkg


def use_as_mooncake(export=True):
    """Makes ``from mooncake.engine import TransferEngine`` (and ``import mooncake.engine``)
    resolve to flexns's engine in this process, and (``export``) sets
    ``FLEXNS_AS_MOONCAKE=force`` in the environment, so that worker processes started from here
    (multiprocessing ``spawn``, ``subprocess``) resolve it to flexns too, through the
    ``flexns_mooncake.pth`` hook the wheel installs. Opt-in: nothing is installed under the name
    ``mooncake``, so a real Mooncake is never shadowed unless this is called, a program is
    started with ``python -m flexns.as_mooncake``, or ``FLEXNS_AS_MOONCAKE`` is set (``1``: only
    where no real Mooncake is installed; ``force``: always). Returns the alias module."""
    import sys
    import types

    from . import _flexns

    pkg = _alias_package("mooncake", "Mooncake", "use_as_mooncake", "FLEXNS_AS_MOONCAKE", export)
    engine = types.ModuleType("mooncake.engine")
    for name in ("TransferEngine", "TransferNotify", "TransferOpcode", "SUPPORT_CUDA"):
        setattr(engine, name, getattr(_flexns, name))
    pkg.engine = engine
    sys.modules["mooncake"] = pkg
    sys.modules["mooncake.engine"] = engine
    return engine


def use_as_nixl(export=True):
    """Makes ``import nixl``, ``from nixl._api import nixl_agent, nixl_agent_config`` and
    ``from nixl._bindings import nixlXferTelemetry`` (what vLLM's NixlConnector imports) resolve
    to ``flexns.nixl`` in this process, and (``export``) sets ``FLEXNS_AS_NIXL=force`` in the
    environment, so that worker processes started from here (multiprocessing ``spawn``,
    ``subprocess``) resolve them to flexns too, through the ``flexns_nixl.pth`` hook the wheel
    installs. Opt-in, as ``use_as_mooncake``: a real NIXL is never shadowed unless this is
    called, a program is started with ``python -m flexns.as_nixl``, or ``FLEXNS_AS_NIXL`` is set
    (``1``: only where no real NIXL is installed; ``force``: always). Returns the alias of
    ``nixl._api``."""
    import sys
    import types

    from . import nixl as impl

    pkg = _alias_package("nixl", "NIXL", "use_as_nixl", "FLEXNS_AS_NIXL", export)
    bindings = types.ModuleType("nixl._bindings")
    for name in impl.BINDINGS:
        setattr(bindings, name, getattr(impl, name))
    api = types.ModuleType("nixl._api")
    for name in impl.__all__:
        setattr(api, name, getattr(impl, name))
    api.nixlBind = bindings
    api.logger = impl.log
    logmod = types.ModuleType("nixl.logging")
    logmod.get_logger = impl.get_logger
    pkg._api, pkg._bindings, pkg.logging = api, bindings, logmod
    sys.modules.update({"nixl": pkg, "nixl._api": api, "nixl._bindings": bindings, "nixl.logging": logmod})
    return api
