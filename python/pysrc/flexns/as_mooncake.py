"""Runs a Python program with ``mooncake.engine`` resolving to flexns::

    python -m flexns.as_mooncake script.py ARGS...
    python -m flexns.as_mooncake -m package.module ARGS...

so that serving code written for Mooncake (vLLM's MooncakeConnector, SGLang's mooncake
transfer backend) runs over flexns unchanged. It exports ``FLEXNS_AS_MOONCAKE=force``, so the
worker processes the program starts (multiprocessing ``spawn``, ``subprocess``) get the alias
too (through the ``flexns_mooncake.pth`` hook the wheel installs); asking for the runner is
asking for flexns, so a real Mooncake is shadowed (with a warning in the workers).
"""

import sys

from . import use_as_mooncake
from ._runner import run_with_alias


def main(argv=None):
    """Runs the program ``argv`` names (default ``sys.argv[1:]``) with the alias; returns the
    exit status."""
    return run_with_alias("flexns.as_mooncake", __doc__, use_as_mooncake, argv)


if __name__ == "__main__":
    sys.exit(main())
