"""Mooncake API behaviours that serving code relies on: ``transfer_check_status`` keeps a
timed-out batch (Mooncake returns -2 and does not free it, so the status reads -2 again, not
"no such batch"); ``transfer_submit_write`` returns -1 when it cannot submit; managed buffers
come from a slab of one registration (and one descriptor publication), not one per call; and
``batch_register_memory`` publishes the descriptor once for the whole batch. Registrations and
publications are counted by the engine itself (``registration_stats``)."""

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

import flexns
import roles

CTX = mp.get_context("spawn")
HOST = roles.HOST


@pytest.fixture
def pair(protocol):
    a, b = flexns.TransferEngine(), flexns.TransferEngine()
    assert a.initialize(HOST, "P2PHANDSHAKE", protocol, "") == 0
    assert b.initialize(HOST, "P2PHANDSHAKE", protocol, "") == 0
    yield a, b, f"{HOST}:{b.get_rpc_port()}"
    a.close()
    b.close()


def test_a_timed_out_batch_is_kept_and_reads_minus_two_again(monkeypatch):
    # tcp: a stopped peer stalls its socket; the engine's own timeout (MC_TRANSFER_TIMEOUT,
    # whole seconds) then ends the request
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "1")
    a, b = CTX.Pipe()
    d = CTX.Process(target=roles.sink, args=(b, "tcp", 64 << 20))
    d.start()
    e = flexns.TransferEngine()
    try:
        assert e.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
        meta = a.recv() if a.poll(30) else pytest.fail("the sink process did not start")
        src = np.ones(64 << 20, dtype=np.uint8)
        assert e.register_memory(src) == 0
        assert e.transfer_sync_write(meta["session"], src.ctypes.data, meta["addr"], 4096) == 0
        os.kill(d.pid, signal.SIGSTOP)
        bid = e.batch_transfer_async_write(meta["session"], [src.ctypes.data], [meta["addr"]], [64 << 20])
        assert bid != 0, e.last_error()
        deadline = time.time() + 30
        while (rc := e.transfer_check_status(bid)) == 0:
            assert time.time() < deadline, "the write to a stopped peer never timed out"
            time.sleep(0.01)
        assert rc == -2, e.last_error()
        # kept, as Mooncake keeps it: the same answer again, not "no such batch" (-1)
        assert e.transfer_check_status(bid) == -2, e.last_error()
        assert e.transfer_check_status(bid) == -2, e.last_error()
    finally:
        os.kill(d.pid, signal.SIGCONT)
        d.kill()
        d.join(10)
        e.close()


def test_transfer_submit_write_returns_minus_one_when_it_cannot_submit(pair):
    a, b, session = pair
    src = np.ones(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    assert a.register_memory(src) == 0 and b.register_memory(dst) == 0
    loose = np.ones(4096, dtype=np.uint8)  # never registered
    assert a.transfer_submit_write(session, loose.ctypes.data, dst.ctypes.data, 4096) == -1
    assert "not inside memory registered" in a.last_error()
    assert a.transfer_submit_write(f"{HOST}:1", src.ctypes.data, dst.ctypes.data, 4096) == -1
    bid = a.transfer_submit_write(session, src.ctypes.data, dst.ctypes.data, 4096)
    assert bid > 0
    assert a.get_batch_transfer_status([bid]) == 0 and (dst == 1).all()


def test_managed_buffers_come_from_one_slab_registration(pair):
    a, b, session = pair
    before = a.registration_stats()
    n, size = 200, 4096 + 17  # odd sizes: each is rounded up, none overlaps the next
    bufs = [a.allocate_managed_buffer(size) for _ in range(n)]
    after = a.registration_stats()
    assert 0 not in bufs and len(set(bufs)) == n
    assert after["registrations"] - before["registrations"] == 1, (before, after)
    assert after["publications"] - before["publications"] == 1, (before, after)
    assert (after["managed_slabs"], after["managed_buffers"]) == (1, n)
    for i, buf in enumerate(bufs):
        assert a.write_bytes_to_buffer(buf, bytes([i % 251]) * size, size) == 0
    for i, buf in enumerate(bufs):
        assert a.read_bytes_from_buffer(buf, size) == bytes([i % 251]) * size, f"buffer {i} was overwritten"
    # a peer writes into one of them: the slab is published, each buffer inside it
    far = b.allocate_managed_buffer(size)
    assert b.write_bytes_to_buffer(far, b"\x5a" * size, size) == 0
    assert b.transfer_sync_write(f"{HOST}:{a.get_rpc_port()}", far, bufs[7], size) == 0
    assert a.read_bytes_from_buffer(bufs[7], size) == b"\x5a" * size
    # freed buffers go back to the slab: allocating again registers nothing new
    for buf in bufs[:100]:
        assert a.free_managed_buffer(buf, size) == 0
    again = [a.allocate_managed_buffer(size) for _ in range(100)]
    assert sorted(again) == sorted(bufs[:100])
    assert a.registration_stats()["registrations"] == after["registrations"]
    # past the slab: one more registration, for a slab that fits the buffer
    big = a.allocate_managed_buffer(80 << 20)
    s = a.registration_stats()
    assert big != 0 and s["registrations"] == after["registrations"] + 1 and s["managed_slabs"] == 2
    assert a.write_bytes_to_buffer(big + (80 << 20) - 3, b"end", 3) == 0
    assert a.write_bytes_to_buffer(big + (80 << 20) - 2, b"end", 3) == -1, "past the buffer's end"
    with pytest.raises(ValueError, match="length"):
        a.allocate_managed_buffer(0)


def test_batch_register_memory_publishes_once(pair):
    a, b, session = pair
    arrays = [np.zeros(8192, dtype=np.uint8) for _ in range(16)]
    before = b.registration_stats()
    assert b.batch_register_memory(arrays) == 0
    after = b.registration_stats()
    assert after["registrations"] - before["registrations"] == 16, (before, after)
    assert after["publications"] - before["publications"] == 1, (before, after)
    src = np.arange(8192, dtype=np.uint32).astype(np.uint8)
    assert a.register_memory(src) == 0
    for i, arr in enumerate(arrays):  # the peer sees every one of them
        assert a.transfer_sync_write(session, src.ctypes.data, arr.ctypes.data, 8192) == 0, (i, a.last_error())
        assert np.array_equal(arr, src)
    # one buffer that cannot be registered: none is, nothing is published
    bad = [np.zeros(4096, dtype=np.uint8) for _ in range(3)]
    bad[1].flags.writeable = False
    assert b.batch_register_memory(bad) == -1
    assert "buffer 1" in b.last_error() and "read-only" in b.last_error()
    assert b.registration_stats() == after
    assert b.unregister_memory(bad[0]) == -1
