#!/usr/bin/env python3
"""Mooncake's TransferEngine API over flexns against the real Mooncake wheel's TCP transport:
``batch_transfer_sync_write`` of 64 blocks of 256 KiB (16 MiB a call, scattered over the target
buffer as vLLM's block tables scatter them) from a prefill process into a decode process on the
same host, the same loop over ``flexns.TransferEngine`` (protocol "flexns", its default link:
the same-host path, one copy into the decode process's memory) and over
``mooncake.engine.TransferEngine`` from PyPI (``protocol="tcp"``, the transport a user without
RDMA gets), interleaved (flexns mooncake-tcp, mooncake-tcp flexns, ...), >= 3 pairs, fresh
processes and a fresh random pattern per run.

    python/bench/install-refs.sh mooncake    # the real wheel (its CPU build)
    python3 python/bench/mooncake_vs_wheel.py --json      # --pairs 5, --duration 3

Both engines start with metadata "P2PHANDSHAKE" (peers exchange segment descriptors over the
engines' own RPC port: no metadata server, no etcd) and register NumPy buffers by address.
Each call's blocks carry the call's number in their first 8 bytes; after the run the decode
process checks its whole buffer against the run's pattern and the last call's number
(``verified``). Timing and CPU cover the timed loop only (after warm-up calls that connect);
CPU is that of both processes (from /proc).

Output follows docs/BENCHMARKS.md: one JSON line per run (``bench: kvcache_batch_write``,
flexns's with the path its bytes took), then a ratio line, flexns's Gbit/s over the wheel's
(median of the pairs; target >= 2) with the CPU per byte ratio. Without the real wheel it says
how to install it and exits with status 3 (``--check`` only checks).
"""

import argparse
import json
import os
import subprocess
import sys

import numpy as np

sys.dont_write_bytecode = True  # no __pycache__ beside the scripts of the checkout
from _bench import (  # noqa: E402
    ask, channel, delta, emitter, memcpy_gbps, pair_args, parse, ratio_line, reap, run_pairs, spawn, timed_loop)
from samehost_batch import (  # noqa: E402
    BLOCK, BLOCKS, TOTAL, batch_line, pattern, stamp, timed_and_checked, verify)

SYSTEMS = ("flexns", "mooncake-tcp")
TARGET = 2.0
PROTOCOL = {"flexns": "flexns", "mooncake-tcp": "tcp"}


def child_env():
    """The children's environment: no flexns alias, so that ``mooncake`` is the real wheel."""
    env = dict(os.environ)
    env.pop("FLEXNS_AS_MOONCAKE", None)
    return env


def missing_reference():
    """Why the comparison cannot run here (None when it can)."""
    try:
        import flexns  # noqa: F401
    except Exception as e:
        return f"flexns does not import ({type(e).__name__}: {e}); install it with scripts/python.sh"
    r = subprocess.run(
        [sys.executable, "-c", "import mooncake.engine as m; print(m.TransferEngine.__module__, m.__file__)"],
        capture_output=True, text=True, env=child_env(), timeout=120)
    if r.returncode != 0:
        err = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return f"the real Mooncake wheel does not import ({err}); install it with python/bench/install-refs.sh mooncake"
    if "flexns" in r.stdout:
        return f"`mooncake` resolves to flexns here ({r.stdout.strip()}), not to the real wheel"
    return None


def engine(system):
    if system == "flexns":
        from flexns import TransferEngine
    else:
        from mooncake.engine import TransferEngine
        if "flexns" in TransferEngine.__module__:
            raise RuntimeError("mooncake.engine is flexns's alias here, not the real wheel")
    e = TransferEngine()
    if e.initialize("127.0.0.1", "P2PHANDSHAKE", PROTOCOL[system], "") != 0:
        raise RuntimeError(f"{system}: initialize failed")
    return e


def session(e):
    return e.get_session_id() if hasattr(e, "get_session_id") else f"127.0.0.1:{e.get_rpc_port()}"


def decode_role(a):
    out = channel()
    eng = engine(a.system)
    buf = np.zeros(TOTAL, dtype=np.uint8)
    if eng.register_memory(buf.ctypes.data, buf.nbytes) != 0:
        raise RuntimeError("register_memory failed")
    out.write(json.dumps({"session": session(eng), "addr": buf.ctypes.data}) + "\n")
    for line in sys.stdin:
        m = json.loads(line)
        if m["cmd"] == "check":
            out.write(json.dumps({"verified": verify(buf, m["seed"], m["calls"])}) + "\n")
        elif m["cmd"] == "quit":
            break
    os._exit(0)


def prefill_role(a):
    out = channel()
    eng = engine(a.system)
    view = np.zeros(TOTAL, dtype=np.uint8)
    addr = view.ctypes.data
    if eng.register_memory(addr, view.nbytes) != 0:
        raise RuntimeError("register_memory failed")
    go = json.loads(sys.stdin.readline())
    data, perm = pattern(go["seed"])
    srcs = [addr + i * BLOCK for i in range(BLOCKS)]
    dsts = [go["remote"] + int(perm[i]) * BLOCK for i in range(BLOCKS)]
    lens = [BLOCK] * BLOCKS
    write = eng.batch_transfer_sync_write
    # connect and warm up before the clock starts (zeros: the run's data comes after)
    for _ in range(3):
        if write(go["target"], srcs, dsts, lens) != 0:
            raise RuntimeError(f"batch_transfer_sync_write to {go['target']} failed (warm-up)")
    view[:] = data
    stats = getattr(eng, "stack_stats", lambda: {})
    s0 = stats() or {}
    out.write(json.dumps({"ready": True}) + "\n")
    sys.stdin.readline()

    def step(i):
        if write(go["target"], srcs, dsts, lens) != 0:
            raise RuntimeError(f"batch_transfer_sync_write failed (call {i + 1})")

    r = timed_loop(go["duration"], step, before=lambda i: stamp(view, i + 1))
    r["stack"] = delta(s0, stats() or {})
    out.write(json.dumps(r) + "\n")
    sys.stdin.readline()  # quit
    os._exit(0)


def child(role, system, env):
    return spawn(__file__, role, system, ["--system", system], env)


def run(system, duration, memcpy):
    env = child_env()
    dec = child("decode", system, env)
    pre = None
    try:
        d = ask(dec)
        pre = child("prefill", system, env)
        seed = int.from_bytes(os.urandom(8), "little")
        ask(pre, {"target": d["session"], "remote": d["addr"], "seed": seed, "duration": duration})
        r, verified, cpus, rss = timed_and_checked(pre, dec, seed, "go")
    finally:
        reap(pre, dec)
    line = batch_line({"system": system, "protocol": PROTOCOL[system], "memory": "numpy"}, r, verified, memcpy,
                      (pre, dec), cpus, rss)
    if system == "flexns":
        st = r["stack"]
        line["link"] = os.environ.get("FLEXNS_LINK", "shm (default)")
        for k in ("same_host_copy_bytes", "same_host_cma_bytes", "same_host_ops", "tx_bytes", "shm_tx_messages"):
            line[k] = st.get(k, 0)
    return line


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=["decode", "prefill"], help=argparse.SUPPRESS)
    ap.add_argument("--system", choices=SYSTEMS, help=argparse.SUPPRESS)
    pair_args(ap)
    ap.add_argument("--check", action="store_true", help="only say whether both engines import, exit 3 if not")
    a, status = parse(ap, {"decode": decode_role, "prefill": prefill_role}, "mooncake_vs_wheel", missing_reference)
    if status is not None:
        return status
    emit = emitter(a.json)
    memcpy = memcpy_gbps(BLOCK)
    runs = run_pairs(SYSTEMS, a.pairs, lambda system: run(system, a.duration, memcpy), emit)
    emit(ratio_line(
        {"reference": "mooncake-tcp", "memory": "numpy", "msg_bytes": BLOCK, "batch": BLOCKS},
        runs["flexns"], runs["mooncake-tcp"], TARGET, {"wait": "block"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
