"""The meta-path finder behind flexns's opt-in aliases (``FLEXNS_AS_MOONCAKE``,
``FLEXNS_AS_NIXL``): ``_flexns_mooncake_hook`` and ``_flexns_nixl_hook`` each name their
variable, module names and ``flexns.use_as_*`` function, and share this implementation.

The wheel installs a ``.pth`` line per alias that imports its hook only when the variable is
set; importing this module is as cheap: it imports only ``os`` and ``sys``, and nothing of
flexns (not the extension module) is imported until the program imports an aliased name.

A variable's values: unset, ``""`` or ``"0"``: off; ``"1"``: the names resolve to flexns where
the real package is not installed (where it is, it is left alone, with a warning); ``"force"``:
they resolve to flexns even where it is (a warning says it is shadowed). Anything else makes
the import fail with an ``ImportError`` naming the variable.
"""

import os
import sys

MODES = ("1", "force")


def _log(level, msg):
    import logging

    logging.getLogger("flexns").log(level, "%s", msg)


class Alias:
    """A meta-path finder that answers the module names ``NAMES`` (the package ``NAMES[0]``
    and its submodules) with the modules ``flexns.<USE>`` installs, as ``mode`` (``"1"`` or
    ``"force"``) says. A subclass names ``VAR`` (the environment variable), ``NAMES``,
    ``LABEL`` (the real package's name in messages) and ``USE``."""

    VAR = ""
    NAMES = ()
    LABEL = ""
    USE = ""

    def __init__(self, mode):
        self.mode = mode
        self.decided = None  # True: flexns stands in; False: the real package is used

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.NAMES:
            return None
        var, label, top = self.VAR, self.LABEL, self.NAMES[0]
        if self.mode not in MODES:
            raise ImportError(
                f"{var}={self.mode!r}: expected 1 (flexns stands in for {label} where none is "
                f"installed), force (even where one is) or 0 (off)",
                name=fullname,
            )
        if self.decided is None:
            import importlib.machinery

            real = importlib.machinery.PathFinder.find_spec(top)
            where = getattr(real, "origin", None) or (list(real.submodule_search_locations or []) if real else None)
            if real is None:
                self.decided = True
                _log(20, f"{top} resolves to flexns ({var}={self.mode}; no real {label} is installed)")
            elif self.mode == "force":
                self.decided = True
                _log(30, f"{top} resolves to flexns ({var}=force), shadowing the real {label} at {where}")
            else:
                self.decided = False
                _log(30, f"{var}=1: a real {label} is installed at {where} and is used "
                         f"(set {var}=force to run flexns in its place)")
        if not self.decided:
            return None
        import importlib.util

        return importlib.util.spec_from_loader(fullname, _Loader(self.USE), is_package=fullname == top)

    @classmethod
    def install(cls, mode=None):
        """Installs the finder (first on ``sys.meta_path``) for ``mode``, by default the value
        of ``VAR``; once per interpreter. Returns it, or None when the mode is off."""
        mode = os.environ.get(cls.VAR, "") if mode is None else mode
        if mode in ("", "0"):
            return None
        for f in sys.meta_path:
            if isinstance(f, cls):
                f.mode = mode
                return f
        f = cls(mode)
        sys.meta_path.insert(0, f)
        return f


class _Loader:
    """Loads an aliased name: ``flexns.<use>`` puts all of the alias's modules in
    ``sys.modules`` (without exporting the variable again); the one asked for is returned."""

    def __init__(self, use):
        self.use = use

    def create_module(self, spec):
        import flexns

        getattr(flexns, self.use)(export=False)
        return sys.modules[spec.name]

    def exec_module(self, module):
        pass
