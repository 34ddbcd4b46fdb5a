"""The target process of the NIXL-API tests: a NIXL agent that registers its KV buffers,
hands out its metadata blob, and then answers the test's questions over a multiprocessing pipe
(the side channel vLLM's NixlConnector keeps in ZMQ). Only the import line names flexns."""

import time

import numpy as np

from flexns.nixl import nixl_agent, nixl_agent_config  # nixl._api in NIXL

BLOCKS = 64
BLOCK = 16 << 10


def pattern(seed, n):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def target(conn, protocol, name="decode"):
    """Registers two buffers (`kv`: BLOCKS blocks, `spare`: one block), publishes them, and
    serves commands until told "bye"."""
    agent = nixl_agent(name, nixl_agent_config(backends=["UCX"], protocol=protocol))
    kv = np.zeros(BLOCKS * BLOCK, dtype=np.uint8)
    spare = np.zeros(BLOCK, dtype=np.uint8)
    regs = {
        "kv": agent.register_memory([(kv.ctypes.data, kv.nbytes, 0, "")], "DRAM"),
        "spare": agent.register_memory(spare),  # an array: one descriptor, DRAM
    }
    conn.send({"md": agent.get_agent_metadata(), "kv": kv.ctypes.data, "spare": spare.ctypes.data})
    peer = agent.add_remote_agent(conn.recv())
    conn.send(peer)
    while True:
        cmd = conn.recv()
        op = cmd["op"]
        if op == "bye":
            break
        if op == "notifs":
            # wait for `n` notifications; check the data each one announces the moment it
            # arrives (the notification comes after the data landed), then a little longer
            # for any that should not come
            got, bad = {}, []
            deadline = time.time() + cmd.get("timeout", 20)
            while sum(map(len, got.values())) < cmd["n"] and time.time() < deadline:
                for who, msgs in agent.get_new_notifs().items():
                    for m in msgs:
                        got.setdefault(who, []).append(m)
                        for blk, data in cmd.get("expect", {}).get(m, []):
                            if kv[blk * BLOCK:(blk + 1) * BLOCK].tobytes() != data:
                                bad.append((m, blk))
                time.sleep(0.001)
            time.sleep(cmd.get("linger", 0))
            for who, msgs in agent.get_new_notifs().items():
                got.setdefault(who, []).extend(msgs)
            conn.send({"notifs": got, "bad": bad})
        elif op == "dump":
            conn.send({"kv": kv.tobytes(), "spare": spare.tobytes()})
        elif op == "fill":
            kv[:] = pattern(cmd["seed"], kv.nbytes)
            conn.send("ok")
        elif op == "deregister":
            agent.deregister_memory(regs.pop(cmd["what"]))
            conn.send("ok")
        elif op == "notif":
            agent.send_notif(peer, cmd["msg"])
            conn.send("ok")
    agent.close()
