"""The same-host path through the Python package: a prefill and a decode process on one host,
protocol "flexns", the engine's default stack (link shm): a `batch_transfer_sync_write` lands
byte for byte and is carried by the one-copy path (the prefill engine's `stack_stats()` counts
every byte as copied by CMA into a NumPy buffer, or through a mapping of a managed buffer, and
the packets carry none of it). `FLEXNS_LINK=udp` puts the bytes back on packets, and a bad
value is a ValueError naming the variable."""

import multiprocessing as mp
import time

import numpy as np
import pytest

import flexns
import roles

CTX = mp.get_context("spawn")
TOTAL = roles.SAME_HOST_BLOCKS * roles.SAME_HOST_BLOCK


def write_batch(memory, seed, idle=0.0):
    """Runs a batch from this process (prefill) into a spawned decode process, then (after
    `idle` seconds, when given) a second one of other data to the same blocks; returns the
    decode verdict on the last and this engine's counter deltas over both."""
    a, b = CTX.Pipe()
    d = CTX.Process(target=roles.same_host_decode, args=(b, "flexns", memory))
    d.start()
    engine = flexns.TransferEngine()
    try:
        assert engine.initialize(roles.HOST, "P2PHANDSHAKE", "flexns", "") == 0
        meta = a.recv() if a.poll(30) else pytest.fail("the decode process did not start")
        data, perm = roles.same_host_layout(seed)
        assert engine.register_memory(data) == 0
        assert engine.send_probe(meta["session"]) == 0, engine.last_error()
        before = engine.stack_stats()
        rounds = [seed] if idle == 0 else [seed + 1, seed]
        for k, s in enumerate(rounds):
            if k > 0:
                time.sleep(idle)
            data[:] = roles.same_host_layout(s)[0]
            ret = engine.batch_transfer_sync_write(
                meta["session"],
                [data.ctypes.data + i * roles.SAME_HOST_BLOCK for i in range(roles.SAME_HOST_BLOCKS)],
                [meta["addr"] + perm[i] * roles.SAME_HOST_BLOCK for i in range(roles.SAME_HOST_BLOCKS)],
                [roles.SAME_HOST_BLOCK] * roles.SAME_HOST_BLOCKS,
            )
            assert ret == 0, engine.last_error()
        after = engine.stack_stats()
        a.send({"seed": seed})
        verdict = a.recv() if a.poll(30) else pytest.fail("the decode process did not answer")
        a.send("bye")
        d.join(30)
        assert d.exitcode == 0, f"decode process exit code {d.exitcode}"
        return verdict, {k: after[k] - before[k] for k in after}
    finally:
        engine.close()
        if d.is_alive():
            d.kill()


@pytest.mark.parametrize("memory,counter", [("numpy", "same_host_cma_bytes"), ("managed", "same_host_copy_bytes")])
def test_same_host_batch_is_one_copy_by_default(monkeypatch, memory, counter):
    monkeypatch.delenv("FLEXNS_LINK", raising=False)
    # the decode engine (which inherits this) reaps an accepted QP that receives no packet
    # within 0.4 s; the same-host path sends it none, so the second batch, after three such
    # timeouts, also checks that the idle probe keeps the prefill's QPs alive
    monkeypatch.setenv("FLEXNS_UNUSED_QP_TIMEOUT", "0.4")
    verdict, delta = write_batch(memory, seed=23, idle=1.2)
    assert verdict["bad"] == []
    # every byte went by the same-host path, in one op per block, and no packet carried them
    assert delta[counter] == 2 * TOTAL, delta
    assert delta["same_host_ops"] == 2 * roles.SAME_HOST_BLOCKS, delta
    assert delta["tx_bytes"] < TOTAL // 8, delta
    # the decode engine was written to, it made no requests of its own on the path
    assert verdict["stats"]["same_host_ops"] == 0, verdict["stats"]


def test_flexns_link_udp_puts_the_bytes_on_packets(monkeypatch):
    monkeypatch.setenv("FLEXNS_LINK", "udp")  # the spawned decode process inherits it
    verdict, delta = write_batch("managed", seed=29)
    assert verdict["bad"] == []
    assert delta["same_host_copy_bytes"] == 0 and delta["same_host_cma_bytes"] == 0, delta
    assert delta["tx_bytes"] >= TOTAL, delta


def test_flexns_link_and_data_cores_are_checked_and_stats_are_flexns_only(monkeypatch):
    monkeypatch.setenv("FLEXNS_LINK", "rings")
    e = flexns.TransferEngine()
    with pytest.raises(ValueError, match="FLEXNS_LINK"):
        e.initialize(roles.HOST, "P2PHANDSHAKE", "flexns", "")
    monkeypatch.delenv("FLEXNS_LINK")
    for bad in ("two", "0", "17"):
        monkeypatch.setenv("FLEXNS_DATA_CORES", bad)
        with pytest.raises(ValueError, match="FLEXNS_DATA_CORES"):
            e.initialize(roles.HOST, "P2PHANDSHAKE", "flexns", "")
    monkeypatch.delenv("FLEXNS_DATA_CORES")
    assert e.initialize(roles.HOST, "P2PHANDSHAKE", "tcp", "") == 0
    assert e.stack_stats() is None
    e.close()
    with pytest.raises(flexns.TransferError, match="not initialized"):
        e.stack_stats()
