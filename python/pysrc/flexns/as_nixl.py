"""Runs a Python program with ``nixl`` (``nixl._api``, ``nixl._bindings``) resolving to flexns::

    python -m flexns.as_nixl script.py ARGS...
    python -m flexns.as_nixl -m package.module ARGS...

so that serving code written for NIXL (vLLM's NixlConnector, Dynamo, SGLang's nixl transfer
backend) runs over flexns unchanged. It exports ``FLEXNS_AS_NIXL=force``, so the worker
processes the program starts (multiprocessing ``spawn``, ``subprocess``) get the alias too
(through the ``flexns_nixl.pth`` hook the wheel installs); asking for the runner is asking for
flexns, so a real NIXL is shadowed (with a warning in the workers).
"""

import runpy
import sys

from . import use_as_nixl


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    use_as_nixl()
    if argv[0] == "-m":
        if len(argv) < 2:
            print("flexns.as_nixl: -m needs a module name", file=sys.stderr)
            return 2
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
