"""``import nixl`` resolving to flexns in every interpreter that asks, spawned ones included.

The wheel installs ``flexns_nixl.pth`` into site-packages; Python runs its one line at every
interpreter start. That line reads ``FLEXNS_AS_NIXL`` and imports this module only when it is
set, and this module only installs a meta-path finder: nothing of flexns (not the extension
module) is imported until the program imports ``nixl``. Because the variable is inherited,
worker processes (multiprocessing ``spawn``, ``subprocess``) get the alias too.

``FLEXNS_AS_NIXL``:

- unset, ``""`` or ``"0"``: nothing happens (the default);
- ``"1"``: ``nixl``, ``nixl._api`` and ``nixl._bindings`` resolve to flexns where no real NIXL
  is installed; where one is, it is left alone (a warning says so);
- ``"force"``: they resolve to flexns even where a real NIXL is installed (a warning says it
  is shadowed).

Anything else makes ``import nixl`` fail with an ``ImportError`` naming the variable.
"""

import os
import sys

VAR = "FLEXNS_AS_NIXL"
MODES = ("1", "force")
_NAMES = ("nixl", "nixl._api", "nixl._bindings", "nixl.logging")


def _log(level, msg):
    import logging

    logging.getLogger("flexns").log(level, "%s", msg)


class NixlAlias:
    """A meta-path finder that answers ``nixl`` and its submodules ``_api``, ``_bindings`` and
    ``logging`` with flexns's (``flexns.use_as_nixl``), as ``mode`` (``"1"`` or ``"force"``)
    says."""

    def __init__(self, mode):
        self.mode = mode
        self.decided = None  # True: flexns stands in; False: a real NIXL is used

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _NAMES:
            return None
        if self.mode not in MODES:
            raise ImportError(
                f"{VAR}={self.mode!r}: expected 1 (flexns stands in for NIXL where none is "
                f"installed), force (even where one is) or 0 (off)",
                name=fullname,
            )
        if self.decided is None:
            import importlib.machinery

            real = importlib.machinery.PathFinder.find_spec("nixl")
            where = getattr(real, "origin", None) or (list(real.submodule_search_locations or []) if real else None)
            if real is None:
                self.decided = True
                _log(20, f"nixl resolves to flexns ({VAR}={self.mode}; no real NIXL is installed)")
            elif self.mode == "force":
                self.decided = True
                _log(30, f"nixl resolves to flexns ({VAR}=force), shadowing the real NIXL at {where}")
            else:
                self.decided = False
                _log(30, f"{VAR}=1: a real NIXL is installed at {where} and is used "
                         f"(set {VAR}=force to run flexns in its place)")
        if not self.decided:
            return None
        import importlib.util

        return importlib.util.spec_from_loader(fullname, _Loader(), is_package=fullname == "nixl")


class _Loader:
    def create_module(self, spec):
        import flexns

        flexns.use_as_nixl(export=False)
        return sys.modules[spec.name]

    def exec_module(self, module):
        pass


def install(mode=None):
    """Installs the finder (first on ``sys.meta_path``) for ``mode``, by default the value of
    ``FLEXNS_AS_NIXL``; once per interpreter. Returns it, or None when the mode is off."""
    mode = os.environ.get(VAR, "") if mode is None else mode
    if mode in ("", "0"):
        return None
    for f in sys.meta_path:
        if isinstance(f, NixlAlias):
            f.mode = mode
            return f
    f = NixlAlias(mode)
    sys.meta_path.insert(0, f)
    return f
