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
import sys

import numpy as np

sys.dont_write_bytecode = True  # no __pycache__ beside the scripts of the checkout
from _bench import (  # noqa: E402
    ask, delta, emitter, measure, memcpy_gbps, pair_args, parse, ratio_line, reap, run_line, run_pairs, spawn, tell,
    timed_loop)

BLOCKS = 64
BLOCK = 256 << 10
TOTAL = BLOCKS * BLOCK


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


def verify(view, seed, calls):
    """Whether `view` (the decode process's buffer) holds the run's pattern, each block where
    the run's block table put it, stamped with the last call's number."""
    data, perm = pattern(seed)
    stamp(data, calls)
    got = view.reshape(BLOCKS, BLOCK)
    want = data.reshape(BLOCKS, BLOCK)
    return bool(all(np.array_equal(got[perm[i]], want[i]) for i in range(BLOCKS)))


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
            say({"verified": verify(view, m["seed"], m["calls"])})
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

    def step(_i):
        if write(a.target, srcs, dsts, lens) != 0:
            raise RuntimeError(f"batch_transfer_sync_write: {eng.last_error()}")

    s0 = eng.stack_stats() or {}
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    out = timed_loop(go["duration"], step, before=lambda i: stamp(view, i + 1))
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    out["self_cpu"] = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    out["stack"] = delta(s0, eng.stack_stats() or {})
    say(out)
    sys.stdin.readline()  # quit
    eng.close()


def child(role, protocol, memory, env, extra=()):
    return spawn(__file__, role, protocol, ["--protocol", protocol, "--memory", memory, *extra], env)


def timed_and_checked(pre, dec, seed, go):
    """The parent's side of a run, once both processes are ready: the prefill process's timed
    loop (started by sending it `go`) measured, then the decode process's check of the run of
    pattern `seed`, and both quit: (the loop's result, verified, CPU seconds and peak RSS of
    prefill and decode)."""
    r, cpus, rss = measure((pre, dec), lambda: ask(pre, go))
    v = ask(dec, {"cmd": "check", "seed": seed, "calls": r["calls"]})
    tell(pre, "quit")
    tell(dec, {"cmd": "quit"})
    for p in (pre, dec):
        p.wait(30)
    return r, v["verified"], cpus, rss


def batch_line(ident, r, verified, memcpy, procs, cpus, rss):
    """A run's ``kvcache_batch_write`` line: `ident` (system, memory, ...), then the figures
    of the prefill process's loop `r` and the cost of `procs` (prefill, decode)."""
    head = {"bench": "kvcache_batch_write", **ident, "msg_bytes": BLOCK, "batch": BLOCKS, "depth": 1}
    return run_line(head, r, r["calls"] * TOTAL, {"verified": verified, "wait": "block"}, memcpy,
                    ("prefill", "decode"), procs, cpus, rss)


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
        seed = int.from_bytes(os.urandom(8), "little")
        r, verified, cpus, rss = timed_and_checked(pre, dec, seed, {"seed": seed, "duration": duration})
    finally:
        reap(pre, dec)
    line = batch_line({"system": protocol, "memory": memory}, r, verified, memcpy, (pre, dec), cpus, rss)
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
    pair_args(ap)
    ap.add_argument("--link", choices=["shm", "udp"], help="FLEXNS_LINK of the flexns runs (default: the engine's, shm)")
    ap.add_argument("--data-cores", type=int, help="FLEXNS_DATA_CORES of both processes (default: the engine's, 1)")
    a, status = parse(ap, {"decode": decode_role, "prefill": prefill_role})
    if status is not None:
        return status
    emit = emitter(a.json)
    memcpy = memcpy_gbps(BLOCK)
    kinds = ["numpy", "managed"] if a.memory == "both" else [a.memory]
    for memory in kinds:
        runs = run_pairs(("flexns", "tcp"), a.pairs,
                         lambda proto: run(proto, memory, a.duration, a.link, a.data_cores, memcpy), emit)
        emit(ratio_line(
            {"reference": "tcp", "memory": memory, "msg_bytes": BLOCK, "batch": BLOCKS},
            runs["flexns"], runs["tcp"], 3.0, {"wait": "block"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
