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
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.dont_write_bytecode = True  # no __pycache__ beside the scripts of the checkout
from samehost_batch import BLOCK, BLOCKS, TOTAL, memcpy_gbps, pattern, peak_rss_kib, proc_cpu, reset_peak_rss, stamp  # noqa: E402

MISSING = 3
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


def die_with_parent():
    """A child dies with the benchmark, however it ends (PR_SET_PDEATHSIG, SIGKILL)."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)


def channel():
    """This child's line channel to the parent: stdout, moved aside, so that what the engines
    print (the wheel's glog lines) goes to stderr."""
    die_with_parent()
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return out


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
            data, perm = pattern(m["seed"])
            stamp(data, m["calls"])
            got = buf.reshape(BLOCKS, BLOCK)
            want = data.reshape(BLOCKS, BLOCK)
            ok = all(np.array_equal(got[perm[i]], want[i]) for i in range(BLOCKS))
            out.write(json.dumps({"verified": bool(ok)}) + "\n")
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
    lat = []
    calls = 0
    start = time.perf_counter()
    until = start + go["duration"]
    while True:
        calls += 1
        stamp(view, calls)
        t0 = time.perf_counter()
        if write(go["target"], srcs, dsts, lens) != 0:
            raise RuntimeError(f"batch_transfer_sync_write failed (call {calls})")
        t1 = time.perf_counter()
        lat.append(t1 - t0)
        if t1 >= until and calls >= 3:
            break
    took = time.perf_counter() - start
    s1 = stats() or {}
    lat.sort()
    out.write(json.dumps({
        "calls": calls, "secs": took, "p50_us": lat[len(lat) // 2] * 1e6, "p99_us": lat[int(len(lat) * 0.99)] * 1e6,
        "stack": {k: s1[k] - s0.get(k, 0) for k in s1},
    }) + "\n")
    sys.stdin.readline()  # quit
    os._exit(0)


def child(role, system, env):
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--role", role, "--system", system],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def ask(p, obj=None):
    if obj is not None:
        p.stdin.write((obj if isinstance(obj, str) else json.dumps(obj)) + "\n")
        p.stdin.flush()
    line = p.stdout.readline()
    if not line:
        p.wait()
        raise RuntimeError(f"the {p.args[3]} process of {p.args[5]} exited with {p.returncode} (its error is above)")
    return json.loads(line)


def run(system, duration, memcpy):
    env = child_env()
    dec = child("decode", system, env)
    pre = None
    try:
        d = ask(dec)
        pre = child("prefill", system, env)
        seed = int.from_bytes(os.urandom(8), "little")
        ask(pre, {"target": d["session"], "remote": d["addr"], "seed": seed, "duration": duration})
        for p in (dec, pre):
            reset_peak_rss(p.pid)
        c0 = {p.pid: proc_cpu(p.pid) for p in (dec, pre)}
        r = ask(pre, "go")
        c1 = {p.pid: proc_cpu(p.pid) for p in (dec, pre)}
        rss = {p.pid: peak_rss_kib(p.pid) for p in (dec, pre)}
        v = ask(dec, {"cmd": "check", "seed": seed, "calls": r["calls"]})
        pre.stdin.write("quit\n")
        pre.stdin.flush()
        dec.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
        dec.stdin.flush()
        for p in (pre, dec):
            p.wait(30)
    finally:
        for p in (pre, dec):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    nbytes = r["calls"] * TOTAL
    procs = []
    for role, p in (("prefill", pre), ("decode", dec)):
        cpu = round(c1[p.pid] - c0[p.pid], 3)
        procs.append({
            "role": role, "pid": p.pid, "cpu_secs": cpu, "cpu_us_per_op": round(cpu / r["calls"] * 1e6, 1),
            "bytes_per_cpu_sec": round(nbytes / cpu) if cpu > 0 else None, "peak_rss_kib": rss[p.pid],
        })
    cpu = sum(p["cpu_secs"] for p in procs)
    gbps = nbytes * 8 / r["secs"] / 1e9
    line = {
        "bench": "kvcache_batch_write", "system": system, "protocol": PROTOCOL[system], "memory": "numpy",
        "msg_bytes": BLOCK, "batch": BLOCKS, "depth": 1, "ops": r["calls"], "bytes": nbytes,
        "secs": round(r["secs"], 4), "gbps": round(gbps, 3), "p50_us": round(r["p50_us"], 1),
        "p99_us": round(r["p99_us"], 1), "verified": v["verified"], "wait": "block", "memcpy_gbps": memcpy,
        "of_memcpy": round(gbps / memcpy, 3), "cpu_secs": round(cpu, 3),
        "cpu_us_per_op": round(cpu / r["calls"] * 1e6, 1),
        "bytes_per_cpu_sec": round(nbytes / cpu) if cpu > 0 else None, "processes": procs,
    }
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
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--duration", type=float, default=2.0)
    ap.add_argument("--check", action="store_true", help="only say whether both engines import, exit 3 if not")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.role == "decode":
        return decode_role(a)
    if a.role == "prefill":
        return prefill_role(a)
    why = missing_reference()
    if why:
        print(f"mooncake_vs_wheel: cannot compare: {why}", file=sys.stderr)
        if a.json:
            print(json.dumps({"bench": "skipped", "reason": why}), flush=True)
        return MISSING
    if a.check:
        return 0
    if a.pairs < 3:
        ap.error("--pairs: a ratio needs at least 3 pairs")
    if a.duration <= 0:
        ap.error("--duration: seconds > 0")

    def emit(r):
        if a.json:
            print(json.dumps(r), flush=True)
        else:
            print(" ".join(f"{k}={v}" for k, v in r.items() if k != "processes"), flush=True)

    memcpy = memcpy_gbps()
    runs = {s: [] for s in SYSTEMS}
    for i in range(a.pairs):
        # alternate which goes first, so drift on a shared machine falls on both
        for system in (SYSTEMS if i % 2 == 0 else SYSTEMS[::-1]):
            r = run(system, a.duration, memcpy)
            runs[system].append(r)
            emit(r)
    fx, mc = runs["flexns"], runs["mooncake-tcp"]
    ratios = [f["gbps"] / max(m["gbps"], 1e-9) for f, m in zip(fx, mc)]
    cpu = [(f["cpu_secs"] / f["bytes"]) / max(m["cpu_secs"] / m["bytes"], 1e-18) for f, m in zip(fx, mc)]
    emit({
        "bench": "ratio", "metric": "gbps", "system": "flexns", "reference": "mooncake-tcp", "memory": "numpy",
        "msg_bytes": BLOCK, "batch": BLOCKS, "pairs": a.pairs, "ratio": round(statistics.median(ratios), 3),
        "ratios": [round(x, 3) for x in ratios], "target": TARGET,
        "cpu_per_byte_ratio": round(statistics.median(cpu), 3), "cpu_per_byte_ratios": [round(x, 3) for x in cpu],
        "wait": "block", "verified": all(r["verified"] for r in fx + mc),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
