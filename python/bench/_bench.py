"""What the Python package's benchmarks share (samehost_batch.py, mooncake_vs_wheel.py,
nixl_vs_ucx.py, py_vs_rust.py): a process's CPU and peak memory from /proc, a core's copy rate,
the child processes' line protocol, the timed loop, the figures of a run's JSON line, and the
interleaved pairs with their ratio line (docs/BENCHMARKS.md).

The scripts import it from their own folder (the folder of the script Python runs is first on
``sys.path``); they set ``sys.dont_write_bytecode`` first, so that no ``__pycache__`` is left
in the checkout.
"""

import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

TICK = os.sysconf("SC_CLK_TCK")
# The exit status of a comparison whose reference (or flexns itself) is not installed.
MISSING = 3


# ---- a process's cost, from /proc ----


def proc_cpu(pid):
    """CPU seconds (user + system) process `pid` has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def reset_peak_rss(pid):
    """Resets process `pid`'s peak resident set (VmHWM) to its current one, where the kernel
    lets this process (``/proc/<pid>/clear_refs``); else leaves it."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_kib(pid):
    """Process `pid`'s peak resident set (VmHWM) in KiB, 0 where /proc does not say."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def memcpy_gbps(piece):
    """What one core of this process copies in pieces of `piece` over 64 MiB buffers, best of 3."""
    a = np.ones(64 << 20, dtype=np.uint8)
    b = np.empty_like(a)
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        for o in range(0, len(a), piece):
            b[o:o + piece] = a[o:o + piece]
        best = max(best, len(a) * 8 / (time.perf_counter() - t) / 1e9)
    return round(best, 2)


# ---- the child processes ----


def die_with_parent():
    """A child dies with the benchmark, however it ends (PR_SET_PDEATHSIG, SIGKILL)."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)


def channel():
    """This child's line channel to the parent: stdout, moved aside, so that whatever the
    libraries print (the Mooncake wheel's glog lines, UCX's protocol tables, NIXL's logger)
    goes to stderr. The child also dies with the parent."""
    die_with_parent()
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return out


def spawn(script, role, of, args, env, stderr=None):
    """Starts `script` again as the child `role` (``--role ROLE ARGS...``) for system `of`,
    talking JSON lines on its stdin and stdout."""
    p = subprocess.Popen(
        [sys.executable, os.path.abspath(script), "--role", role, *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    p.label = f"the {role} process of {of}"
    return p


def tell(p, obj):
    """Sends child `p` one line: `obj` as JSON, or as it is where it is a string."""
    p.stdin.write((obj if isinstance(obj, str) else json.dumps(obj)) + "\n")
    p.stdin.flush()


def ask(p, obj=None):
    """Sends child `p` `obj` (if any, as ``tell``) and returns the JSON line it answers; a
    child that exited instead is a ``RuntimeError`` naming it."""
    if obj is not None:
        tell(p, obj)
    line = p.stdout.readline()
    if not line:
        p.wait()
        raise RuntimeError(f"{p.label} exited with {p.returncode} (its error is above)")
    return json.loads(line)


def reap(*procs):
    """Kills those of `procs` still running (None: one not started): the end of every run,
    however it went."""
    for p in procs:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()


def measure(procs, go):
    """Calls `go()` (what starts a child's timed loop and returns its result) between readings
    of the CPU of `procs`, their peak RSS reset before: (go's result, CPU seconds of each,
    peak RSS of each in KiB)."""
    for p in procs:
        reset_peak_rss(p.pid)
    c0 = [proc_cpu(p.pid) for p in procs]
    r = go()
    c1 = [proc_cpu(p.pid) for p in procs]
    return r, [round(b - a, 3) for a, b in zip(c0, c1)], [peak_rss_kib(p.pid) for p in procs]


# ---- the timed loop, in a child ----


def timed_loop(duration, step, before=None):
    """Calls `step(i)` for i = 0, 1, ... until `duration` seconds have passed and at least 3
    calls were made, timing each call (and not `before(i)`, called first where given):
    {"calls", "secs", "p50_us", "p99_us"}."""
    lat = []
    calls = 0
    start = time.perf_counter()
    until = start + duration
    while True:
        if before is not None:
            before(calls)
        t0 = time.perf_counter()
        step(calls)
        calls += 1
        t1 = time.perf_counter()
        lat.append(t1 - t0)
        if t1 >= until and calls >= 3:
            break
    took = time.perf_counter() - start
    lat.sort()
    return {"calls": calls, "secs": took, "p50_us": lat[len(lat) // 2] * 1e6, "p99_us": lat[int(len(lat) * 0.99)] * 1e6}


def delta(s0, s1):
    """Counters `s1` less `s0` (an engine's stack_stats before and after)."""
    return {k: s1[k] - s0.get(k, 0) for k in s1}


# ---- the lines (docs/BENCHMARKS.md) ----


def run_line(head, r, nbytes, middle, memcpy, roles, procs, cpus, rss):
    """A run's JSON line: `head` (what ran), the figures of the timed loop `r` that moved
    `nbytes`, `middle` (verified, wait, ...), then the cost: the copy rate `memcpy` and the CPU
    of the processes (`roles` and `procs`, with their CPU seconds `cpus` and peak RSS `rss`,
    as ``measure`` returns them)."""
    calls = r["calls"]
    processes = [{
        "role": role, "pid": p.pid, "cpu_secs": cpu, "cpu_us_per_op": round(cpu / calls * 1e6, 1),
        "bytes_per_cpu_sec": round(nbytes / cpu) if cpu > 0 else None, "peak_rss_kib": kib,
    } for role, p, cpu, kib in zip(roles, procs, cpus, rss)]
    cpu = sum(cpus)
    gbps = nbytes * 8 / r["secs"] / 1e9
    return {
        **head, "ops": calls, "bytes": nbytes, "secs": round(r["secs"], 4), "gbps": round(gbps, 3),
        "p50_us": round(r["p50_us"], 1), "p99_us": round(r["p99_us"], 1), **middle,
        "memcpy_gbps": memcpy, "of_memcpy": round(gbps / memcpy, 3), "cpu_secs": round(cpu, 3),
        "cpu_us_per_op": round(cpu / calls * 1e6, 1), "bytes_per_cpu_sec": round(nbytes / cpu) if cpu > 0 else None,
        "processes": processes,
    }


def ratio_line(head, fx, ref, target, tail):
    """The ratio line of a set of pairs: flexns's runs `fx` against the reference's `ref`
    (median Gbit/s ratio, and CPU per byte), between `head` and `tail`'s fields."""
    ratios = [f["gbps"] / max(u["gbps"], 1e-9) for f, u in zip(fx, ref)]
    cpu = [(f["cpu_secs"] / f["bytes"]) / max(u["cpu_secs"] / u["bytes"], 1e-18) for f, u in zip(fx, ref)]
    return {
        "bench": "ratio", "metric": "gbps", "system": "flexns", **head, "pairs": len(fx),
        "ratio": round(statistics.median(ratios), 3), "ratios": [round(x, 3) for x in ratios], "target": target,
        "cpu_per_byte_ratio": round(statistics.median(cpu), 3), "cpu_per_byte_ratios": [round(x, 3) for x in cpu],
        **tail, "verified": all(r["verified"] for r in fx + ref),
    }


# ---- the parent ----


def pair_args(ap, duration=2.0):
    """Adds the options every comparison takes: --pairs, --duration, --json."""
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--duration", type=float, default=duration)
    ap.add_argument("--json", action="store_true")


def check_pair_args(ap, a):
    """Refuses --pairs under 3 and --duration not above 0, naming the option."""
    if a.pairs < 3:
        ap.error("--pairs: a ratio needs at least 3 pairs")
    if a.duration <= 0:
        ap.error("--duration: seconds > 0")


def parse(ap, roles, prog=None, missing=None):
    """Parses the command line: (the arguments, an exit status or None to go on). A child
    (``--role``) runs its function of `roles` (its status: what it returns, else 0). The parent
    of a comparison against a reference (`prog`, with ``missing()`` saying why it cannot run,
    None where it can) stops with ``MISSING`` where it cannot, and with 0 after ``--check``;
    every parent has its --pairs and --duration checked."""
    a = ap.parse_args()
    if a.role:
        return a, roles[a.role](a) or 0
    if missing is not None:
        why = missing()
        if why:
            return a, cannot_compare(prog, why, a.json)
        if a.check:
            return a, 0
    check_pair_args(ap, a)
    return a, None


def emitter(as_json):
    """What prints a line: as JSON, or (without --json) as key=value words, less the
    per-process list."""

    def emit(r):
        if as_json:
            print(json.dumps(r), flush=True)
        else:
            print(" ".join(f"{k}={v}" for k, v in r.items() if k != "processes"), flush=True)

    return emit


def cannot_compare(prog, why, as_json):
    """Says why `prog` cannot compare here (on stderr; with --json also a ``skipped`` line)
    and returns the exit status for it, ``MISSING``."""
    print(f"{prog}: cannot compare: {why}", file=sys.stderr)
    if as_json:
        print(json.dumps({"bench": "skipped", "reason": why}), flush=True)
    return MISSING


def run_pairs(systems, pairs, run_one, emit):
    """Runs `pairs` pairs, each a run of every one of `systems` (``run_one(system)`` returns
    its line, which is emitted), in order in even pairs and reversed in odd ones, so that
    drift on a shared machine falls on both: {system: its lines}."""
    runs = {s: [] for s in systems}
    for i in range(pairs):
        for system in (systems if i % 2 == 0 else systems[::-1]):
            r = run_one(system)
            runs[system].append(r)
            emit(r)
    return runs
