#!/usr/bin/env bash
# Installs the reference packages that python/bench/nixl_vs_ucx.py and
# python/bench/mooncake_vs_wheel.py compare flexns's Python package with, into the python3 on
# PATH (PYTHON=... for another), idempotently:
#
# - NIXL (PyPI `nixl`, NVIDIA's transfer library, whose backend wheels bundle UCX and its UCX
#   backend plugin). The `nixl` meta package requires its two backend wheels (`nixl-cu12` and
#   `nixl-cu13`, 70 MB each; `import nixl` picks the one matching the CUDA version of an
#   installed torch, e.g. vLLM's, and either without one), and each requires `torch`, whose PyPI
#   build pulls several GB of CUDA libraries; the host-memory (DRAM) UCX path needs neither CUDA
#   nor torch, so this installs the three wheels without their dependencies, plus NumPy (which
#   nixl imports). NIXL_VERSION picks the version (default 1.5.1: the newest whose backend
#   wheels PyPI has; `nixl` 1.5.2 is published but pins backends 1.5.2, which are not).
# - Mooncake's transfer engine, its CPU build (PyPI `mooncake-transfer-engine-non-cuda`, with its
#   small dependencies: aiohttp, requests, msgpack), MOONCAKE_VERSION (default 0.3.13.post1).
#   The plain `mooncake-transfer-engine` wheel links libcudart.so.12 and does not import on a
#   machine without CUDA ("ImportError: libcudart.so.12: cannot open shared object file"); the
#   two wheels install the same `mooncake` package, so the CUDA one is removed if present.
#
# Not part of the test command's installs (scripts/install-test-deps.sh): installing a real
# `mooncake` makes `import mooncake` resolve to it, and flexns's alias tests that need it absent
# then skip. Usage: python/bench/install-refs.sh [nixl|mooncake]...   (default: both)
set -euo pipefail

py="${PYTHON:-python3}"
nixl_version="${NIXL_VERSION:-1.5.1}"
mooncake_version="${MOONCAKE_VERSION:-0.3.13.post1}"

pip_install() {
  "$py" -m pip install -q --disable-pip-version-check "$@" 2>/dev/null \
    || "$py" -m pip install -q --disable-pip-version-check --break-system-packages "$@"
}

version_of() { # version_of NAME: the installed version of distribution NAME, or nothing
  "$py" -c 'import sys
from importlib.metadata import version, PackageNotFoundError
try:
    print(version(sys.argv[1]))
except PackageNotFoundError:
    pass' "$1"
}

want=("$@")
[ "${#want[@]}" -gt 0 ] || want=(nixl mooncake)
for w in "${want[@]}"; do
  case "$w" in
    nixl)
      if [ "$(version_of nixl)" = "$nixl_version" ] && [ "$(version_of nixl-cu12)" = "$nixl_version" ] \
        && [ "$(version_of nixl-cu13)" = "$nixl_version" ]; then
        echo "nixl $nixl_version (nixl-cu12 and nixl-cu13 backends): already installed"
      else
        echo "installing: nixl, nixl-cu12, nixl-cu13 $nixl_version without their torch dependency, numpy (PyPI)"
        "$py" -c 'import numpy' 2>/dev/null || pip_install numpy
        pip_install --no-deps "nixl==$nixl_version" "nixl-cu12==$nixl_version" "nixl-cu13==$nixl_version"
      fi
      # the UCX backend must load; a wheel without it is useless to the benchmark
      "$py" - <<'EOF'
from nixl._api import nixl_agent, nixl_agent_config
a = nixl_agent("install-refs-check", nixl_agent_config(backends=["UCX"]))
assert "UCX" in a.backends, a.backends
print("nixl: the UCX backend loads (plugins:", ", ".join(a.get_plugin_list()) + ")", flush=True)
import os
os._exit(0)  # the wheel's bundled libnl-route crashes in its exit-time destructor (SIGSEGV)
EOF
      ;;
    mooncake)
      if [ "$(version_of mooncake-transfer-engine-non-cuda)" = "$mooncake_version" ] \
        && [ -z "$(version_of mooncake-transfer-engine)" ]; then
        echo "mooncake-transfer-engine-non-cuda $mooncake_version: already installed"
      else
        echo "installing: mooncake-transfer-engine-non-cuda $mooncake_version (PyPI)"
        "$py" -m pip uninstall -y -q mooncake-transfer-engine 2>/dev/null || true
        pip_install "mooncake-transfer-engine-non-cuda==$mooncake_version"
      fi
      "$py" -c 'from mooncake.engine import TransferEngine; print("mooncake: engine from", TransferEngine.__module__)'
      ;;
    *)
      echo "install-refs.sh: unknown reference $w (nixl or mooncake)" >&2
      exit 2
      ;;
  esac
done
