#!/usr/bin/env python3
"""A prefill process hands one request's KV cache to a decode process, the way vLLM's
MooncakeConnector does it, over flexns (or --protocol tcp):

    pip install ./python          # once
    python3 python/examples/prefill_decode.py [--protocol tcp]

The decode side registers its per-layer KV pools and publishes its session id
("IP:rpc_port") and pool addresses; the prefill side writes the request's blocks into the
decode blocks it was given, in one batch, with a notification naming them; the decode side
checks every byte. Only the import line differs from code written for Mooncake.
"""

import argparse
import multiprocessing as mp
import time

import numpy as np

from flexns import TransferEngine, TransferNotify, TransferOpcode  # from mooncake.engine import ...

LAYERS, BLOCKS, BLOCK_BYTES = 8, 128, 32 << 10  # per layer: 128 blocks of 16 tokens x 1 KiB


def decode(conn, protocol):
    engine = TransferEngine()
    engine.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "")
    pools = [np.zeros((BLOCKS, BLOCK_BYTES), dtype=np.uint8) for _ in range(LAYERS)]
    engine.batch_register_memory([p.ctypes.data for p in pools], [p.nbytes for p in pools])
    conn.send((f"127.0.0.1:{engine.get_rpc_port()}", [p.ctypes.data for p in pools]))
    dst_blocks, expected = conn.recv()
    notes, deadline = [], time.time() + 10
    while not notes and time.time() < deadline:  # queued a moment after the transfer completes
        notes = [(n.name, n.msg) for n in engine.get_notifies()]
        time.sleep(0.001)
    ok = all(np.array_equal(pools[layer][d], expected[layer][i])
             for layer in range(LAYERS) for i, d in enumerate(dst_blocks))
    conn.send((ok, notes))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--protocol", default="flexns", choices=["flexns", "tcp"])
    a = ap.parse_args()
    here, there = mp.get_context("spawn").Pipe()
    d = mp.get_context("spawn").Process(target=decode, args=(there, a.protocol))
    d.start()

    engine = TransferEngine()
    engine.initialize("127.0.0.1", "P2PHANDSHAKE", a.protocol, "")
    rng = np.random.default_rng()
    kv = [rng.integers(0, 256, (BLOCKS, BLOCK_BYTES), dtype=np.uint8) for _ in range(LAYERS)]
    engine.batch_register_memory([t.ctypes.data for t in kv], [t.nbytes for t in kv])
    session, bases = here.recv()

    # this request's 20 blocks, and the decode blocks its scheduler allocated for them
    src_blocks = list(range(20))
    dst_blocks = [int(b) for b in rng.choice(BLOCKS, 20, replace=False)]
    src, dst, lens = [], [], []
    for layer in range(LAYERS):
        for s, t in zip(src_blocks, dst_blocks):
            src.append(kv[layer].ctypes.data + s * BLOCK_BYTES)
            dst.append(bases[layer] + t * BLOCK_BYTES)
            lens.append(BLOCK_BYTES)
    note = TransferNotify("req-1", ",".join(map(str, dst_blocks)))
    ret = engine.batch_transfer_sync(session, src, dst, lens, TransferOpcode.Write, note)
    if ret != 0:
        raise SystemExit(f"transfer failed: {engine.last_error()}")
    here.send((dst_blocks, [[kv[layer][s] for s in src_blocks] for layer in range(LAYERS)]))
    ok, notes = here.recv()
    d.join()
    mib = sum(lens) / (1 << 20)
    print(f"{a.protocol}: {len(lens)} blocks ({mib:.1f} MiB) written into decode blocks {dst_blocks[:5]}..., "
          f"verified={ok}, decode got notifications {notes}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
