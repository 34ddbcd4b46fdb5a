"""The prefill and decode processes of the tests, each replaying what a serving framework
calls on ``mooncake.engine.TransferEngine``. They talk over a multiprocessing pipe, the side
channel vLLM and SGLang keep in ZMQ. Only the import line names flexns."""

import numpy as np

from flexns import TransferEngine, TransferNotify, TransferOpcode  # mooncake.engine in Mooncake

HOST = "127.0.0.1"
LAYERS = 4
BLOCKS = 64
BLOCK_BYTES = 16 << 10


def pattern(layer, block, seed):
    rng = np.random.default_rng(seed * 1_000_003 + layer * 1009 + block)
    return rng.integers(0, 256, BLOCK_BYTES, dtype=np.uint8)


def vllm_decode(conn, protocol):
    """vLLM MooncakeConnector, decode side: register per-layer KV caches, publish the session
    and base addresses, wait for the prefill's 'these blocks landed', check them."""
    engine = TransferEngine()
    ret = engine.initialize(HOST, "P2PHANDSHAKE", protocol, "")
    assert ret == 0
    rpc_port = engine.get_rpc_port()
    kv = [np.zeros((BLOCKS, BLOCK_BYTES), dtype=np.uint8) for _ in range(LAYERS)]
    ret = engine.batch_register_memory([t.ctypes.data for t in kv], [t.nbytes for t in kv])
    assert ret == 0
    conn.send({"session": f"{HOST}:{rpc_port}", "bases": [t.ctypes.data for t in kv], "block_len": BLOCK_BYTES})
    msg = conn.recv()
    bad = []
    landed = set(msg["dst_blocks"])
    for layer in range(LAYERS):
        for src, dst in zip(msg["src_blocks"], msg["dst_blocks"]):
            if not np.array_equal(kv[layer][dst], pattern(layer, src, msg["seed"])):
                bad.append((layer, dst))
        for b in range(BLOCKS):
            if b not in landed and kv[layer][b].any():
                bad.append((layer, b, "written but not sent"))
    conn.send({"bad": bad})
    conn.recv()  # the prefill is done with us
    ret = engine.batch_unregister_memory([t.ctypes.data for t in kv])
    assert ret == 0


def vllm_prefill(conn, protocol, seed):
    engine = TransferEngine()
    assert engine.initialize(HOST, "P2PHANDSHAKE", protocol, "") == 0
    kv = [np.stack([pattern(layer, b, seed) for b in range(BLOCKS)]) for layer in range(LAYERS)]
    assert engine.batch_register_memory([t.ctypes.data for t in kv], [t.nbytes for t in kv]) == 0
    meta = conn.recv()
    rng = np.random.default_rng(seed)
    src_blocks = [int(x) for x in rng.choice(BLOCKS, 24, replace=False)]
    dst_blocks = [int(x) for x in rng.choice(BLOCKS, 24, replace=False)]
    src_ptrs, dst_ptrs, lengths = [], [], []
    for layer in range(LAYERS):
        for s, d in zip(src_blocks, dst_blocks):
            src_ptrs.append(kv[layer].ctypes.data + s * BLOCK_BYTES)
            dst_ptrs.append(meta["bases"][layer] + d * meta["block_len"])
            lengths.append(BLOCK_BYTES)
    ret = engine.batch_transfer_sync_write(meta["session"], src_ptrs, dst_ptrs, lengths)
    conn.send({"ret": ret, "src_blocks": src_blocks, "dst_blocks": dst_blocks, "seed": seed, "error": engine.last_error()})
    return ret


def sglang_decode(conn, protocol):
    """SGLang's mooncake backend, decode side: register each buffer by (ptr, length), hand out
    the session id "host:rpc_port", receive a notification with the transfer."""
    engine = TransferEngine()
    assert engine.initialize(HOST, "P2PHANDSHAKE", protocol, "") == 0
    kv = np.zeros(BLOCKS * BLOCK_BYTES, dtype=np.uint8)
    aux = np.zeros(4096, dtype=np.uint8)
    for buf in (kv, aux):
        assert engine.register_memory(buf.ctypes.data, buf.nbytes) == 0
    session_id = f"{HOST}:{engine.get_rpc_port()}"
    conn.send({"session": session_id, "kv": kv.ctypes.data, "aux": aux.ctypes.data})
    msg = conn.recv()
    notes = wait_notifies(engine, 1)
    ok = all(
        np.array_equal(kv[d * BLOCK_BYTES:(d + 1) * BLOCK_BYTES], pattern(0, s, msg["seed"]))
        for s, d in zip(msg["src"], msg["dst"])
    )
    conn.send({"ok": ok, "aux": bytes(aux[:16]), "notes": notes})
    conn.recv()


def sglang_prefill(conn, protocol, seed):
    engine = TransferEngine()
    assert engine.initialize(HOST, "P2PHANDSHAKE", protocol, "") == 0
    kv = np.concatenate([pattern(0, b, seed) for b in range(BLOCKS)])
    aux = np.frombuffer(b"aux:first-token!" + bytes(4080), dtype=np.uint8).copy()
    for buf in (kv, aux):
        assert engine.register_memory(buf.ctypes.data, buf.nbytes) == 0
    meta = conn.recv()
    session = meta["session"]
    assert engine.send_probe(session) == 0
    src, dst = [3, 7, 8, 9, 40], [0, 12, 13, 14, 63]
    rets = []
    # one contiguous run as a batch, the others one by one (SGLang groups adjacent blocks)
    rets.append(engine.batch_transfer_sync_write(
        session,
        [kv.ctypes.data + s * BLOCK_BYTES for s in src[1:4]],
        [meta["kv"] + d * BLOCK_BYTES for d in dst[1:4]],
        [BLOCK_BYTES] * 3,
    ))
    for s, d in ((src[0], dst[0]), (src[4], dst[4])):
        rets.append(engine.transfer_sync_write(session, kv.ctypes.data + s * BLOCK_BYTES, meta["kv"] + d * BLOCK_BYTES, BLOCK_BYTES))
    # the aux data goes last, with a notification the decode side reads
    note = TransferNotify("req-17", "kv-and-aux-done")
    rets.append(engine.transfer_sync(session, aux.ctypes.data, meta["aux"], 4096, TransferOpcode.Write, note))
    conn.send({"seed": seed, "src": src, "dst": dst, "rets": rets})
    return rets


def wait_notifies(engine, n, timeout=10.0):
    """Polls get_notifies until `n` arrived (a completed transfer_sync means the notification
    reached the peer's stack; its engine queues it for get_notifies a moment later)."""
    import time

    got = []
    deadline = time.time() + timeout
    while len(got) < n and time.time() < deadline:
        got += [(x.name, x.msg) for x in engine.get_notifies()]
        time.sleep(0.001)
    return got


def sink(conn, protocol, nbytes):
    """A decode process that registers memory, publishes it and then waits to be killed."""
    engine = TransferEngine()
    assert engine.initialize(HOST, "P2PHANDSHAKE", protocol, "") == 0
    buf = np.zeros(nbytes, dtype=np.uint8)
    assert engine.register_memory(buf) == 0
    conn.send({"session": engine.get_session_id(), "addr": buf.ctypes.data})
    conn.recv()  # never comes: the test kills this process


SAME_HOST_BLOCKS = 16
SAME_HOST_BLOCK = 256 << 10


def same_host_layout(seed):
    """The data of the same-host test's batch and the destination block of each source block."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, SAME_HOST_BLOCKS * SAME_HOST_BLOCK, dtype=np.uint8)
    return data, [int(x) for x in rng.permutation(SAME_HOST_BLOCKS)]


def same_host_decode(conn, protocol, memory):
    """A decode process whose KV buffer is a registered NumPy array (`memory="numpy"`: caller
    memory) or a managed buffer (`"managed"`: engine-allocated); it checks the batch the
    prefill wrote and reports its own stack counters."""
    engine = TransferEngine()
    assert engine.initialize(HOST, "P2PHANDSHAKE", protocol, "") == 0
    n = SAME_HOST_BLOCKS * SAME_HOST_BLOCK
    if memory == "numpy":
        buf = np.zeros(n, dtype=np.uint8)
        assert engine.register_memory(buf) == 0
        addr = buf.ctypes.data
    else:
        addr = engine.allocate_managed_buffer(n)
        assert addr != 0, engine.last_error()
    conn.send({"session": engine.get_session_id(), "addr": addr})
    msg = conn.recv()
    got = np.frombuffer(engine.read_bytes_from_buffer(addr, n), dtype=np.uint8).reshape(SAME_HOST_BLOCKS, -1)
    data, perm = same_host_layout(msg["seed"])
    want = data.reshape(SAME_HOST_BLOCKS, -1)
    bad = [i for i in range(SAME_HOST_BLOCKS) if not np.array_equal(got[perm[i]], want[i])]
    conn.send({"bad": bad, "stats": engine.stack_stats()})
    conn.recv()  # the prefill is done with us
