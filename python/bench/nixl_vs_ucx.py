#!/usr/bin/env python3
"""NIXL's agent API over flexns against the real NIXL with its UCX backend: the same transfer
loop, written once against ``nixl._api`` (the import is the only difference), between two
processes on one host, in host memory (DRAM), interleaved (flexns nixl-ucx, nixl-ucx flexns,
...), >= 3 pairs, fresh processes and a fresh pattern per run.

    python/bench/install-refs.sh nixl        # the real NIXL (PyPI nixl, UCX bundled)
    python3 python/bench/nixl_vs_ucx.py --json            # --case blocks|16MiB|both, --pairs 5

The loop is vLLM's NixlConnector's: the decode process (the initiator) pulls a request's KV
blocks from the prefill process (the target) with one-sided READs and a notification, i.e.
``make_prepped_xfer("READ", local_dlist, local_ids, remote_dlist, remote_ids, notif_msg)``,
``transfer``, ``check_xfer_state`` until DONE, ``release_xfer_handle``; the target takes the
notifications with ``get_new_notifs`` (polling every millisecond, as a serving loop does).
Cases: ``blocks``, 64 blocks of 16 KiB per transfer, scattered over the target's 256-block
pool (a fixed random permutation, so no two neighbours merge into one piece) into the next 64
blocks of the initiator's 64 MiB pool; ``16MiB``, one 16 MiB descriptor per transfer into the
next 16 MiB of the same pool. Each run's target fills its pool with a fresh random pattern;
after the run the initiator checks every block of its pool the run wrote against the target
block last read into it, and the target that it got every transfer's notification
(``verified``). Timing and CPU cover the timed loop only (after a warm-up of the connection);
CPU is that of both processes (from /proc).

Both agents are configured as vLLM's NixlConnector configures its own
(``nixl_agent_config(num_threads=4, capture_telemetry=True)``, the UCX backend; ``--ucx-threads
0`` for NIXL's own default; flexns.nixl accepts ``num_threads`` and leaves it unused). The
reference is what a user gets from ``pip install nixl``, with UCX left to its defaults
(UCX_TLS unset: UCX picks the transports; the lines' ``ucx_read_transports`` and
``ucx_am_transports`` name what its protocol selection printed for the READs and for the active
messages that carry NIXL's notifications, from a ``UCX_PROTO_INFO=y`` run before the pairs).
flexns's side is ``flexns.nixl`` with its engine's defaults (protocol "flexns", the shm link:
one copy per byte between the processes); its lines carry the path the bytes took.

Output follows docs/BENCHMARKS.md: one JSON line per run (``bench: nixl_read``), then per case
a ratio line, flexns's Gbit/s over NIXL+UCX's (median of the pairs; targets: 1.5 for blocks,
1.0 for 16 MiB) with the CPU per byte ratio. Without the real NIXL it says how to install it
and exits with status 3 (``--check`` only checks).
"""

import argparse
import json
import os
import re
import sys
import tempfile
import time

import numpy as np

sys.dont_write_bytecode = True  # no __pycache__ beside the scripts of the checkout
from _bench import (  # noqa: E402
    ask, channel, delta, emitter, measure, memcpy_gbps, pair_args, parse, ratio_line, reap, run_line, run_pairs, spawn,
    tell, timed_loop)

BLOCK = 16 << 10
BLOCKS = 64
REMOTE_BLOCKS = 256  # the target's pool: 4 MiB
LOCAL_POOL = 64 << 20
BIG = 16 << 20
SYSTEMS = ("flexns", "nixl-ucx")
TARGETS = {"blocks": 1.5, "16MiB": 1.0}


def missing_reference():
    """Why the comparison cannot run here (None when it can)."""
    for mod, how in (("flexns.nixl", "scripts/python.sh"), ("nixl._api", "python/bench/install-refs.sh nixl")):
        try:
            __import__(mod)
        except Exception as e:  # an ImportError, or a wheel that fails to load
            return f"{mod} does not import ({type(e).__name__}: {e}); install it with {how}"
    return None


def make_agent(a, name):
    """A NIXL agent of system `a.system`, configured as vLLM's NixlConnector configures its
    own (the UCX backend, `num_threads`, telemetry on); the import is the only difference."""
    if a.system == "flexns":
        from flexns.nixl import nixl_agent, nixl_agent_config
    else:
        from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"], num_threads=a.ucx_threads, capture_telemetry=True))


def shape(case):
    """(bytes per descriptor, descriptors per transfer, the target pool's descriptors)."""
    return (BLOCK, BLOCKS, REMOTE_BLOCKS) if case == "blocks" else (BIG, 1, 1)


def plan(case, seed):
    """Which target descriptors transfer i reads: a fixed permutation of the target's pool,
    taken `per` at a time (the blocks case), or its one descriptor (16MiB)."""
    size, per, pool = shape(case)
    perm = np.random.default_rng(seed ^ 0x5EED).permutation(pool)
    laps = pool // per
    return [[int(x) for x in perm[k * per:(k + 1) * per]] for k in range(laps)]


# ---- the child processes: JSON lines on a private descriptor, libraries' prints on stderr ----


def target_role(a):
    out = channel()
    size, _per, pool = shape(a.case)
    agent = make_agent(a, "prefill")
    kv = np.zeros(size * pool, dtype=np.uint8)
    agent.register_memory(agent.get_reg_descs([(kv.ctypes.data, kv.nbytes, 0, "")], "DRAM"))
    out.write(json.dumps({"md": agent.get_agent_metadata().hex(), "addr": kv.ctypes.data}) + "\n")
    cmd = json.loads(sys.stdin.readline())
    agent.add_remote_agent(bytes.fromhex(cmd["md"]))
    kv[:] = np.random.default_rng(cmd["seed"]).integers(0, 256, kv.nbytes, dtype=np.uint8)
    out.write(json.dumps({"filled": True}) + "\n")
    # serve: take notifications as they come until the initiator says how many it sent
    got = set()
    os.set_blocking(sys.stdin.fileno(), False)
    want = None
    buf = ""
    while True:
        for _who, msgs in agent.get_new_notifs().items():
            got.update(msgs)
        if want is None:
            try:
                chunk = os.read(sys.stdin.fileno(), 4096).decode()
            except BlockingIOError:
                chunk = None
            if chunk == "":
                os._exit(1)  # the parent is gone
            buf += chunk or ""
            if "\n" in buf:
                want = json.loads(buf.split("\n", 1)[0])
                deadline = time.monotonic() + 10
        if want is not None:
            names = {f"{want['tag']}:{i}".encode() for i in range(want["sent"])}
            if names <= got or time.monotonic() > deadline:
                out.write(json.dumps({"notifs": len(names & got), "missing": len(names - got)}) + "\n")
                break
        time.sleep(0.001)
    os.set_blocking(sys.stdin.fileno(), True)
    sys.stdin.readline()  # quit
    os._exit(0)  # NIXL's bundled libnl-route crashes in its exit-time destructor (SIGSEGV)


def initiator_role(a):
    out = channel()
    size, per, pool = shape(a.case)
    agent = make_agent(a, "decode")
    local = np.zeros(LOCAL_POOL, dtype=np.uint8)
    agent.register_memory(agent.get_reg_descs([(local.ctypes.data, local.nbytes, 0, "")], "DRAM"))
    slots = LOCAL_POOL // (size * per)  # transfers per lap of the local pool
    out.write(json.dumps({"md": agent.get_agent_metadata().hex()}) + "\n")
    go = json.loads(sys.stdin.readline())
    remote = agent.add_remote_agent(bytes.fromhex(go["md"]))
    raddr = go["addr"]
    local_h = agent.prep_xfer_dlist(
        "NIXL_INIT_AGENT", [(local.ctypes.data + i * size, size, 0) for i in range(LOCAL_POOL // size)], "DRAM")
    remote_h = agent.prep_xfer_dlist(remote, [(raddr + i * size, size, 0) for i in range(pool)], "DRAM")
    reads = plan(a.case, go["seed"])
    local_ids = [list(range(s * per, (s + 1) * per)) for s in range(slots)]

    def read(i, tag):
        h = agent.make_prepped_xfer("READ", local_h, local_ids[i % slots], remote_h, reads[i % len(reads)],
                                    f"{tag}:{i}".encode())
        state = agent.transfer(h)
        while state == "PROC":
            os.sched_yield()  # the engines' threads share the two cores with this loop
            state = agent.check_xfer_state(h)
        if state != "DONE":
            raise RuntimeError(f"transfer {i}: {state}")
        agent.release_xfer_handle(h)

    # the connection and the first transfers before the clock starts
    t = time.monotonic()
    n = 0
    while n < 8 or time.monotonic() - t < 0.2:
        read(n, "warm")
        n += 1
    s0 = stats(agent)
    out.write(json.dumps({"ready": True}) + "\n")
    sys.stdin.readline()
    r = timed_loop(go["duration"], lambda i: read(i, "run"))
    r["stack"] = delta(s0, stats(agent))
    out.write(json.dumps(r) + "\n")
    calls = r["calls"]
    # every slot the run wrote holds the target block last read into it
    src = np.random.default_rng(go["seed"]).integers(0, 256, size * pool, dtype=np.uint8).reshape(pool, size)
    got = local.reshape(-1, size)
    ok = True
    for s in range(min(slots, calls)):
        last = max(i for i in range(calls - min(slots, calls), calls) if i % slots == s)
        for j, r in enumerate(reads[last % len(reads)]):
            ok = ok and np.array_equal(got[s * per + j], src[r])
    out.write(json.dumps({"verified": bool(ok)}) + "\n")
    sys.stdin.readline()  # quit
    os._exit(0)  # as the target's


def stats(agent):
    """The flexns engine's path counters (flexns.nixl's agent); the real NIXL has none."""
    eng = getattr(agent, "engine", None)
    return (eng.stack_stats() or {}) if eng is not None and hasattr(eng, "stack_stats") else {}


# ---- the parent ----


def child(role, system, case, env, ucx_threads, log=None):
    return spawn(__file__, role, system, ["--system", system, "--case", case, "--ucx-threads", str(ucx_threads)], env,
                 log)


def run(system, case, duration, memcpy, ucx_threads, proto_info=False):
    env = dict(os.environ)
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    log = None
    if proto_info:
        env["UCX_PROTO_INFO"] = "y"
        log = tempfile.TemporaryFile("w+")
    tgt = child("target", system, case, env, ucx_threads, log)
    ini = None
    try:
        t = ask(tgt)
        ini = child("initiator", system, case, env, ucx_threads, log)
        i = ask(ini)
        seed = int.from_bytes(os.urandom(8), "little")
        ask(tgt, {"md": i["md"], "seed": seed})
        ask(ini, {"md": t["md"], "addr": t["addr"], "seed": seed, "duration": duration})
        r, cpus, rss = measure((ini, tgt), lambda: ask(ini, {"go": True}))
        v = ask(ini)
        n = ask(tgt, {"tag": "run", "sent": r["calls"]})
        for p in (tgt, ini):
            tell(p, "quit")
        for p in (tgt, ini):
            p.wait(30)
    finally:
        reap(ini, tgt)
    size, per, _pool = shape(case)
    line = run_line(
        {"bench": "nixl_read", "system": system, "case": case, "msg_bytes": size, "batch": per, "depth": 1,
         "notif": True},
        r, r["calls"] * size * per,
        {"verified": bool(v["verified"]) and n["missing"] == 0, "notifs": n["notifs"], "notifs_missing": n["missing"],
         "wait": "spin"},
        memcpy, ("initiator", "target"), (ini, tgt), cpus, rss)
    if system == "flexns":
        st = r["stack"]
        line["link"] = os.environ.get("FLEXNS_LINK", "shm (default)")
        for k in ("same_host_copy_bytes", "same_host_cma_bytes", "same_host_ops", "tx_bytes", "shm_tx_messages"):
            line[k] = st.get(k, 0)
    else:
        line["ucx_tls"] = os.environ.get("UCX_TLS", "unset (UCX's choice)")
        line["ucx_threads"] = ucx_threads
    logs = ""
    if log is not None:
        log.seek(0)
        logs = log.read()
        log.close()
    return line, logs


def ucx_transports(logs):
    """The transports UCX's protocol selection printed (UCX_PROTO_INFO=y) in a run: {"read":
    those of its 'remote memory read' tables (the READs' bytes), "am": those of its 'active
    message' tables (NIXL's notifications and control)}, each as 'tl/device' (e.g. cma/memory)."""
    found = {"read": set(), "am": set()}
    kind = None
    for line in logs.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 1:
            text = cells[0]
            if text.startswith("remote memory read"):
                kind = "read"
            elif text.startswith("active message"):
                kind = "am"
            elif not re.search(r"cfg#\d+$", text):
                kind = None
        elif len(cells) == 3 and kind and cells[0] != "Range":
            found[kind].update(re.findall(r"\b[a-z_0-9]+/[A-Za-z_0-9.:-]+", cells[2]))
    return {k: sorted(v) for k, v in found.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=["target", "initiator"], help=argparse.SUPPRESS)
    ap.add_argument("--system", choices=SYSTEMS, help=argparse.SUPPRESS)
    ap.add_argument("--case", default="both", choices=["blocks", "16MiB", "both"])
    pair_args(ap)
    ap.add_argument("--ucx-threads", type=int, default=4,
                    help="both agents' num_threads (default 4: vLLM's NixlConnector's; 0: NIXL's default)")
    ap.add_argument("--check", action="store_true", help="only say whether both systems import, exit 3 if not")
    a, status = parse(ap, {"target": target_role, "initiator": initiator_role}, "nixl_vs_ucx", missing_reference)
    if status is not None:
        return status
    emit = emitter(a.json)
    cases = ["blocks", "16MiB"] if a.case == "both" else [a.case]
    for case in cases:
        size, _per, _pool = shape(case)
        memcpy = memcpy_gbps(size)
        # which transports UCX picks for these READs, from a short run of its own
        _, logs = run("nixl-ucx", case, 0.1, memcpy, a.ucx_threads, proto_info=True)
        tls = ucx_transports(logs)

        def run_one(system):
            r, _ = run(system, case, a.duration, memcpy, a.ucx_threads)
            if system == "nixl-ucx":
                r["ucx_read_transports"], r["ucx_am_transports"] = tls["read"], tls["am"]
            return r

        runs = run_pairs(SYSTEMS, a.pairs, run_one, emit)
        emit(ratio_line(
            {"reference": "nixl-ucx", "case": case, "msg_bytes": size, "batch": shape(case)[1]},
            runs["flexns"], runs["nixl-ucx"], TARGETS[case],
            {"ucx_read_transports": tls["read"], "ucx_am_transports": tls["am"], "wait": "spin"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
