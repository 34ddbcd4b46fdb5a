"""``import nixl`` resolving to flexns in every interpreter that asks, spawned ones included.

The wheel installs ``flexns_nixl.pth`` into site-packages; Python runs its one line at every
interpreter start. That line reads ``FLEXNS_AS_NIXL`` and imports this module only when it is
set, and this module only installs a meta-path finder (``_flexns_alias_hook``): nothing of
flexns (not the extension module) is imported until the program imports ``nixl``. Because the
variable is inherited, worker processes (multiprocessing ``spawn``, ``subprocess``) get the
alias too.

``FLEXNS_AS_NIXL``:

- unset, ``""`` or ``"0"``: nothing happens (the default);
- ``"1"``: ``nixl``, ``nixl._api`` and ``nixl._bindings`` resolve to flexns where no real NIXL
  is installed; where one is, it is left alone (a warning says so);
- ``"force"``: they resolve to flexns even where a real NIXL is installed (a warning says it
  is shadowed).

Anything else makes ``import nixl`` fail with an ``ImportError`` naming the variable.
"""

from _flexns_alias_hook import MODES, Alias  # noqa: F401

VAR = "FLEXNS_AS_NIXL"


class NixlAlias(Alias):
    """The finder that answers ``nixl`` and its submodules ``_api``, ``_bindings`` and
    ``logging`` with flexns's (``flexns.use_as_nixl``), as ``mode`` (``"1"`` or ``"force"``)
    says."""

    VAR = VAR
    NAMES = ("nixl", "nixl._api", "nixl._bindings", "nixl.logging")
    LABEL = "NIXL"
    USE = "use_as_nixl"


install = NixlAlias.install
