#!/usr/bin/env python3
"""Python against Rust, same run: synchronous KV-cache WRITEs of 4 KiB, 1 MiB and 16 MiB at
queue depth 1, from flexns's Python package and from the Rust benchmark (kvcache-bench),
each into a decode engine of its own (`kvcache-bench serve`, started per run), alternating
Rust and Python runs, >= 3 pairs per size. Both loops do the same thing: one
transfer_sync_write of SIZE into the next slot of the decode pool, for DURATION seconds; then
every slot written is read back and compared with this run's fresh pattern (`verified`).

    cargo build --release -p clients && scripts/python.sh
    python3 python/bench/py_vs_rust.py --json            # --protocol tcp, --pairs 5 ...

Output follows docs/BENCHMARKS.md: one JSON line per run (`bench: kvcache_write`, `system`
`python-flexns` or `rust-flexns`), then per size a ratio line: Python's throughput over
Rust's (median of the pairs; target >= 0.95 at 16 MiB) and Python's p50 minus Rust's
(`p50_delta_us`, median; target <= 5 us at 4 KiB), with the CPU per transfer of both.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys

import numpy as np

import flexns

sys.dont_write_bytecode = True  # no __pycache__ beside the scripts of the checkout
from _bench import emitter, proc_cpu, timed_loop  # noqa: E402

SIZES = {"4KiB": 4 << 10, "1MiB": 1 << 20, "16MiB": 16 << 20}


def self_cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Decode:
    """A decode engine (`kvcache-bench serve`) with a pool of `pool` bytes."""

    def __init__(self, exe, protocol, pool):
        self.p = subprocess.Popen(
            [exe, "serve", "--transport", protocol, "--metadata", "P2PHANDSHAKE", "--advertise", "127.0.0.1",
             "--pool", str(pool), "--data-cores", "1", "--paths", "1"],
            stdout=subprocess.PIPE, text=True)
        line = self.p.stdout.readline()
        words = dict(w.split("=", 1) for w in line.split() if "=" in w)
        if "segment" not in words:
            self.stop()
            raise RuntimeError(f"the decode engine printed no segment: {line!r}")
        self.segment = words["segment"]

    def stop(self):
        self.p.terminate()
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


def python_run(exe, protocol, size, secs, seed):
    pool = max(size, 64 << 20)  # as kvcache-bench (clients::kvbench::MIN_POOL)
    dec = Decode(exe, protocol, pool)
    eng = flexns.TransferEngine()
    try:
        eng.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "")
        src = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
        check = np.zeros(size, dtype=np.uint8)
        eng.register_memory(src)
        eng.register_memory(check)
        remote = eng.get_first_buffer_address(dec.segment)
        if remote == 0:
            raise RuntimeError(eng.last_error())
        slots = max(pool // size, 1)
        sa, sp = src.ctypes.data, dec.segment
        write = eng.transfer_sync_write

        def step(i):
            if write(sp, sa, remote + (i % slots) * size, size) != 0:
                raise RuntimeError(f"python write of {size} B: {eng.last_error()}")

        cpu0, dcpu0 = self_cpu(), proc_cpu(dec.p.pid)
        r = timed_loop(secs, step)
        cpu, dcpu = self_cpu() - cpu0, proc_cpu(dec.p.pid) - dcpu0
        ops, took = r["calls"], r["secs"]
        verified = True
        for s in range(min(slots, ops)):
            if eng.transfer_sync_read(sp, check.ctypes.data, remote + s * size, size) != 0:
                raise RuntimeError(f"verifying read: {eng.last_error()}")
            verified &= bool(np.array_equal(check, src))
        return {
            "bench": "kvcache_write", "system": f"python-{protocol}", "msg_bytes": size, "depth": 1,
            "ops": ops, "bytes": ops * size, "secs": round(took, 4),
            "gbps": round(ops * size * 8 / took / 1e9, 3),
            "p50_us": round(r["p50_us"], 2), "p99_us": round(r["p99_us"], 2),
            "verified": verified, "wait": "spin" if size <= 64 << 10 else "block",
            "cpu_secs": round(cpu + dcpu, 4), "cpu_us_per_op": round((cpu + dcpu) / ops * 1e6, 2),
            "processes": [
                {"role": "prefill (python)", "pid": os.getpid(), "cpu_secs": round(cpu, 4)},
                {"role": "decode", "pid": dec.p.pid, "cpu_secs": round(dcpu, 4)},
            ],
        }
    finally:
        eng.close()
        dec.stop()


def rust_run(exe, protocol, size, secs):
    out = subprocess.run(
        [exe, "--system", protocol, "--size", str(size), "--duration", str(secs), "--pairs", "1", "--json"],
        check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        r = json.loads(line)
        if r.get("bench") == "kvcache_write":
            r["system"] = f"rust-{protocol}"
            return r
    raise RuntimeError(f"kvcache-bench printed no kvcache_write line: {out!r}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvcache-bench", default=os.path.join(os.path.dirname(__file__), "../../target/release/kvcache-bench"))
    ap.add_argument("--protocol", default="flexns", choices=flexns.SUPPORTED_PROTOCOLS)
    ap.add_argument("--sizes", default="4KiB,1MiB,16MiB")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--duration", type=float, default=1.0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.pairs < 3:
        ap.error("--pairs: a ratio needs at least 3 pairs")
    exe = os.path.abspath(a.kvcache_bench)
    if not os.access(exe, os.X_OK):
        ap.error(f"--kvcache-bench {exe}: not built (cargo build --release -p clients)")
    sizes = []
    for s in a.sizes.split(","):
        if s not in SIZES:
            ap.error(f"--sizes: {s!r} is not one of {', '.join(SIZES)}")
        sizes.append(SIZES[s])

    emit = emitter(a.json)
    for size in sizes:
        py, rs = [], []
        for i in range(a.pairs):
            seed = int.from_bytes(os.urandom(8), "little")
            # alternate which goes first, so drift on a shared machine falls on both
            order = [("rust", None), ("python", None)] if i % 2 == 0 else [("python", None), ("rust", None)]
            for who, _ in order:
                if who == "rust":
                    r = rust_run(exe, a.protocol, size, a.duration)
                    rs.append(r)
                else:
                    r = python_run(exe, a.protocol, size, a.duration, seed)
                    py.append(r)
                emit(r)
        ratios = [p["gbps"] / max(r["gbps"], 1e-9) for p, r in zip(py, rs)]
        deltas = [p["p50_us"] - r["p50_us"] for p, r in zip(py, rs)]
        cpu_py = statistics.median(p["cpu_us_per_op"] for p in py)
        cpu_rs = statistics.median(r.get("cpu_us_per_op", float("nan")) for r in rs)
        emit({
            "bench": "ratio", "metric": "gbps", "system": f"python-{a.protocol}", "reference": f"rust-{a.protocol}",
            "msg_bytes": size, "pairs": a.pairs, "ratio": round(statistics.median(ratios), 3),
            "ratios": [round(x, 3) for x in ratios], "p50_delta_us": round(statistics.median(deltas), 2),
            "p50_deltas_us": [round(x, 2) for x in deltas],
            "cpu_us_per_op": {"python": cpu_py, "rust": cpu_rs},
            "verified": all(p["verified"] for p in py) and all(r.get("verified") for r in rs),
        })
    return 0


if __name__ == "__main__":
    sys.exit(main())
