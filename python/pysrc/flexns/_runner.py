"""What ``python -m flexns.as_mooncake`` and ``python -m flexns.as_nixl`` share: run a program
(a script, or ``-m`` a module) after installing an alias."""

import runpy
import sys


def run_with_alias(prog, doc, use, argv=None):
    """Runs the program ``argv`` names (``script.py ARGS...`` or ``-m package.module ARGS...``;
    default ``sys.argv[1:]``) as ``__main__`` after calling ``use()`` (``flexns.use_as_*``,
    which installs the alias and exports its variable to worker processes). ``-h``/``--help``
    or no arguments print ``doc``; ``prog`` names the runner in errors. Returns the exit
    status (0 once the program returned; 2 for a bad command line)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(doc.strip())
        return 0 if argv else 2
    use()
    if argv[0] == "-m":
        if len(argv) < 2:
            print(f"{prog}: -m needs a module name", file=sys.stderr)
            return 2
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")
    return 0
