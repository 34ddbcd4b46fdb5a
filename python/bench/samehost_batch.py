#!/usr/bin/env python3
"""Same-host batches, flexns against tcp: `batch_transfer_sync_write` of 64 blocks of 256 KiB
(16 MiB a call, scattered over the target buffer as vLLM's block tables scatter them) from a
prefill process into a decode process on the same host, both Python processes of flexns's
package, protocol "flexns" (its default stack link is shm: the bytes go by the same-host path,
one copy into the decode process's registered memory) against protocol "tcp", interleaved
(flexns tcp, tcp flexns, ...), >= 3 pairs, fresh processes and a fresh random pattern per run.

    scripts/python.sh
    python3 python/bench/samehost_batch.py --json      # --memory numpy|managed|both, --pairs 5
    python3 python/bench/samehost_batch.py --json --data-cores 2   # two cores copy (flexns)

Memory: `numpy` registers NumPy arrays (`register_memory`: caller memory, which the same-host
path reaches by CMA, `process_vm_writev`); `managed` uses `allocate_managed_buffer`
(engine-allocated memory in a memfd, which the path writes through a mapping). Each call's
blocks carry the call's number in their first 8 bytes; after the run the decode process checks
its whole buffer against the run's pattern and the last call's number (`verified`). Output
follows docs/BENCHMARKS.md: one JSON line per run (`bench: kvcache_batch_write`, the CPU of both
processes, and for flexns the path the bytes took: `same_host_copy_bytes`,
`same_host_cma_bytes`, `tx_bytes` of the prefill engine's stack during the run), then per memory
kind a ratio line: flexns's throughput over tcp's (median of the pairs; target >= 3) and the CPU
per byte ratio.
"""

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

BLOCKS = 64
BLOCK = 256 << 10
TOTAL = BLOCKS * BLOCK
TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def reset_peak_rss(pid):
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def memcpy_gbps():
    """What one core of this process copies in pieces of BLOCK over 64 MiB buffers, best of 3."""
    a = np.ones(64 << 20, dtype=np.uint8)
    b = np.empty_like(a)
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        for o in range(0, len(a), BLOCK):
            b[o:o + BLOCK] = a[o:o + BLOCK]
        best = max(best, len(a) * 8 / (time.perf_counter() - t) / 1e9)
    return round(best, 2)


def buffer(eng, memory):
    """This process's 16 MiB buffer, registered: (address, a NumPy view of it, its owner)."""
    if memory == "numpy":
        a = np.zeros(TOTAL, dtype=np.uint8)
        if eng.register_memory(a) != 0:
            raise RuntimeError(f"register_memory: {eng.last_error()}")
        return a.ctypes.data, a, a
    addr = eng.allocate_managed_buffer(TOTAL)
    if addr == 0:
        raise RuntimeError(f"allocate_managed_buffer: {eng.last_error()}")
    raw = (ctypes.c_uint8 * TOTAL).from_address(addr)
    return addr, np.ctypeslib.as_array(raw), raw


def pattern(seed):
    """The run's data and where each block lands: (bytes, destination block of block i)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, TOTAL, dtype=np.uint8), rng.permutation(BLOCKS)


def stamp(a, n):
    """Puts call number `n` in the first 8 bytes of every block of `a`."""
    a.reshape(BLOCKS, BLOCK)[:, :8] = np.frombuffer(np.uint64(n).tobytes(), dtype=np.uint8)


def say(obj):
    print(json.dumps(obj), flush=True)


def decode_role(a):
    import flexns

    eng = flexns.TransferEngine()
    eng.initialize("127.0.0.1", "P2PHANDSHAKE", a.protocol, "")
    addr, view, _owner = buffer(eng, a.memory)
    say({"session": eng.get_session_id(), "addr": addr})
    for line in sys.stdin:
        m = json.loads(line)
        if m["cmd"] == "check":
            data, perm = pattern(m["seed"])
            stamp(data, m["calls"])
            got = view.reshape(BLOCKS, BLOCK)
            want = data.reshape(BLOCKS, BLOCK)
            ok = all(np.array_equal(got[perm[i]], want[i]) for i in range(BLOCKS))
            say({"verified": bool(ok)})
        elif m["cmd"] == "quit":
            break
    eng.close()


def prefill_role(a):
    import flexns

    eng = flexns.TransferEngine()
    eng.initialize("127.0.0.1", "P2PHANDSHAKE", a.protocol, "")
    addr, view, _owner = buffer(eng, a.memory)
    # connect (and warm up) before the timed loop
    if eng.send_probe(a.target) != 0:
        raise RuntimeError(f"send_probe {a.target}: {eng.last_error()}")
    say({"ready": True})
    go = json.loads(sys.stdin.readline())
    data, perm = pattern(go["seed"])
    view[:] = data
    srcs = [addr + i * BLOCK for i in range(BLOCKS)]
    dsts = [a.remote + int(perm[i]) * BLOCK for i in range(BLOCKS)]
    lens = [BLOCK] * BLOCKS
    write = eng.batch_transfer_sync_write
    s0 = eng.stack_stats() or {}
    lat = []
    calls = 0
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    until = start + go["duration"]
    while True:
        calls += 1
        stamp(view, calls)
        t0 = time.perf_counter()
        if write(a.target, srcs, dsts, lens) != 0:
            raise RuntimeError(f"batch_transfer_sync_write: {eng.last_error()}")
        t1 = time.perf_counter()
        lat.append(t1 - t0)
        if t1 >= until and calls >= 3:
            break
    took = time.perf_counter() - start
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    s1 = eng.stack_stats() or {}
    lat.sort()
    out = {
        "calls": calls, "secs": took, "p50_us": lat[len(lat) // 2] * 1e6, "p99_us": lat[int(len(lat) * 0.99)] * 1e6,
        "self_cpu": (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime),
        "stack": {k: s1[k] - s0.get(k, 0) for k in s1},
    }
    say(out)
    sys.stdin.readline()  # quit
    eng.close()


def child(role, protocol, memory, env, extra=()):
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--role", role, "--protocol", protocol, "--memory", memory, *extra],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def ask(p, obj=None):
    if obj is not None:
        p.stdin.write(json.dumps(obj) + "\n")
        p.stdin.flush()
    line = p.stdout.readline()
    if not line:
        p.wait()
        raise RuntimeError(f"a {p.args[3]} process exited with {p.returncode} (its error is above)")
    return json.loads(line)


def run(protocol, memory, duration, link, data_cores, memcpy):
    env = dict(os.environ)
    if link:
        env["FLEXNS_LINK"] = link
    if data_cores:
        env["FLEXNS_DATA_CORES"] = str(data_cores)
    dec = child("decode", protocol, memory, env)
    pre = None
    try:
        d = ask(dec)
        pre = child("prefill", protocol, memory, env, ["--target", d["session"], "--remote", str(d["addr"])])
        ask(pre)
        for p in (dec, pre):
            reset_peak_rss(p.pid)
        c0 = {p.pid: proc_cpu(p.pid) for p in (dec, pre)}
        seed = int.from_bytes(os.urandom(8), "little")
        r = ask(pre, {"seed": seed, "duration": duration})
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
        "bench": "kvcache_batch_write", "system": protocol, "memory": memory, "msg_bytes": BLOCK,
        "batch": BLOCKS, "depth": 1, "ops": r["calls"], "bytes": nbytes, "secs": round(r["secs"], 4),
        "gbps": round(gbps, 3), "p50_us": round(r["p50_us"], 1), "p99_us": round(r["p99_us"], 1),
        "verified": v["verified"], "wait": "block", "memcpy_gbps": memcpy, "of_memcpy": round(gbps / memcpy, 3),
        "cpu_secs": round(cpu, 3), "cpu_us_per_op": round(cpu / r["calls"] * 1e6, 1),
        "bytes_per_cpu_sec": round(nbytes / cpu) if cpu > 0 else None, "processes": procs,
    }
    if protocol == "flexns":
        st = r["stack"]
        line["link"] = link or "shm (default)"
        line["data_cores"] = data_cores or 1
        for k in ("same_host_copy_bytes", "same_host_cma_bytes", "same_host_ops", "tx_bytes"):
            line[k] = st.get(k, 0)
    return line


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=["decode", "prefill"], help=argparse.SUPPRESS)
    ap.add_argument("--target", help=argparse.SUPPRESS)
    ap.add_argument("--remote", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--protocol", default="flexns", help=argparse.SUPPRESS)
    ap.add_argument("--memory", default="both", choices=["numpy", "managed", "both"])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--duration", type=float, default=2.0)
    ap.add_argument("--link", choices=["shm", "udp"], help="FLEXNS_LINK of the flexns runs (default: the engine's, shm)")
    ap.add_argument("--data-cores", type=int, help="FLEXNS_DATA_CORES of both processes (default: the engine's, 1)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.role == "decode":
        return decode_role(a)
    if a.role == "prefill":
        return prefill_role(a)
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
    kinds = ["numpy", "managed"] if a.memory == "both" else [a.memory]
    for memory in kinds:
        fx, tc = [], []
        for i in range(a.pairs):
            # alternate which goes first, so drift on a shared machine falls on both
            for proto in (("flexns", "tcp") if i % 2 == 0 else ("tcp", "flexns")):
                r = run(proto, memory, a.duration, a.link, a.data_cores, memcpy)
                (fx if proto == "flexns" else tc).append(r)
                emit(r)
        ratios = [f["gbps"] / max(t["gbps"], 1e-9) for f, t in zip(fx, tc)]
        cpu_ratios = [(f["cpu_secs"] / f["bytes"]) / max(t["cpu_secs"] / t["bytes"], 1e-18) for f, t in zip(fx, tc)]
        emit({
            "bench": "ratio", "metric": "gbps", "system": "flexns", "reference": "tcp", "memory": memory,
            "msg_bytes": BLOCK, "batch": BLOCKS, "pairs": a.pairs, "ratio": round(statistics.median(ratios), 3),
            "ratios": [round(x, 3) for x in ratios], "target": 3.0,
            "cpu_per_byte_ratio": round(statistics.median(cpu_ratios), 3),
            "cpu_per_byte_ratios": [round(x, 3) for x in cpu_ratios], "wait": "block",
            "verified": all(r["verified"] for r in fx + tc),
        })
    return 0


if __name__ == "__main__":
    sys.exit(main())
