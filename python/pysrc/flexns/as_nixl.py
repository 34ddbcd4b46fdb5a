"""Runs a Python program with ``nixl`` (``nixl._api``, ``nixl._bindings``) resolving to flexns::

    python -m flexns.as_nixl script.py ARGS...
    python -m flexns.as_nixl -m package.module ARGS...

so that serving code written for NIXL (vLLM's NixlConnector, Dynamo, SGLang's nixl transfer
backend) runs over flexns unchanged. It exports ``FLEXNS_AS_NIXL=force``, so the worker
processes the program starts (multiprocessing ``spawn``, ``subprocess``) get the alias too
(through the ``flexns_nixl.pth`` hook the wheel installs); asking for the runner is asking for
flexns, so a real NIXL is shadowed (with a warning in the workers).
"""

import sys

from . import use_as_nixl
from ._runner import run_with_alias


def main(argv=None):
    """Runs the program ``argv`` names (default ``sys.argv[1:]``) with the alias; returns the
    exit status."""
    return run_with_alias("flexns.as_nixl", __doc__, use_as_nixl, argv)


if __name__ == "__main__":
    sys.exit(main())
