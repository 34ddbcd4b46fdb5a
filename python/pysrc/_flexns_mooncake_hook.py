"""``import mooncake`` resolving to flexns in every interpreter that asks, spawned ones included.

The wheel installs ``flexns_mooncake.pth`` into site-packages; Python runs its one line at
every interpreter start. That line reads ``FLEXNS_AS_MOONCAKE`` and imports this module only
when it is set, and this module only installs a meta-path finder (``_flexns_alias_hook``):
nothing of flexns (not the extension module) is imported until the program imports
``mooncake``. Because the variable is inherited, worker processes (multiprocessing ``spawn``,
``subprocess``) get the alias too.

``FLEXNS_AS_MOONCAKE``:

- unset, ``""`` or ``"0"``: nothing happens (the default);
- ``"1"``: ``mooncake`` and ``mooncake.engine`` resolve to flexns where no real Mooncake is
  installed; where one is, it is left alone (a warning says so);
- ``"force"``: they resolve to flexns even where a real Mooncake is installed (a warning says
  it is shadowed).

Anything else makes ``import mooncake`` fail with an ``ImportError`` naming the variable.
"""

from _flexns_alias_hook import MODES, Alias  # noqa: F401

VAR = "FLEXNS_AS_MOONCAKE"


class MooncakeAlias(Alias):
    """The finder that answers ``mooncake`` and ``mooncake.engine`` with flexns's modules
    (``flexns.use_as_mooncake``), as ``mode`` (``"1"`` or ``"force"``) says."""

    VAR = VAR
    NAMES = ("mooncake", "mooncake.engine")
    LABEL = "Mooncake"
    USE = "use_as_mooncake"


install = MooncakeAlias.install
