"""flexns.TransferEngine against the call sequences of vLLM's MooncakeConnector and SGLang's
mooncake transfer backend, in two processes (prefill and decode), over both protocols and
checked byte for byte; then Mooncake's async, managed-buffer and notification calls, and the
errors: unknown protocol, unregistered memory, a decode process killed mid-transfer."""

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


def run_pair(prefill, decode, protocol, seed):
    a, b = CTX.Pipe()
    d = CTX.Process(target=decode, args=(b, protocol))
    d.start()
    try:
        result = prefill(a, protocol, seed)
        verdict = a.recv() if a.poll(30) else pytest.fail("the decode process did not answer")
        a.send("bye")
        d.join(30)
        assert d.exitcode == 0, f"decode process exit code {d.exitcode}"
        return result, verdict
    finally:
        if d.is_alive():
            d.kill()


def test_vllm_mooncake_connector_sequence(protocol):
    (ret, verdict) = run_pair(roles.vllm_prefill, roles.vllm_decode, protocol, seed=11)
    assert ret == 0
    assert verdict["bad"] == []


def test_sglang_mooncake_sequence(protocol):
    rets, verdict = run_pair(roles.sglang_prefill, roles.sglang_decode, protocol, seed=5)
    assert rets == [0, 0, 0, 0]
    assert verdict["ok"]
    assert verdict["aux"] == b"aux:first-token!"
    assert ("req-17", "kv-and-aux-done") in verdict["notes"]


@pytest.fixture
def pair(protocol):
    a, b = flexns.TransferEngine(), flexns.TransferEngine()
    assert a.initialize(HOST, "P2PHANDSHAKE", protocol, "") == 0
    assert b.initialize(HOST, "P2PHANDSHAKE", protocol, "") == 0
    yield a, b, f"{HOST}:{b.get_rpc_port()}"
    a.close()
    b.close()


def test_session_id_is_host_and_rpc_port(pair):
    a, b, session = pair
    assert b.get_session_id() == session
    assert a.get_protocol() == b.get_protocol()


def test_async_batches_reads_and_polling(pair):
    a, b, session = pair
    src = np.frombuffer(os.urandom(1 << 20), dtype=np.uint8).copy()
    dst = np.zeros(1 << 20, dtype=np.uint8)
    back = np.zeros(1 << 20, dtype=np.uint8)
    assert a.register_memory(src) == 0 and a.register_memory(back) == 0
    assert b.register_memory(dst.ctypes.data, dst.nbytes) == 0
    assert a.get_first_buffer_address(session) == dst.ctypes.data
    half = 1 << 19
    ids = [
        a.batch_transfer_async_write(session, [src.ctypes.data], [dst.ctypes.data], [half]),
        a.transfer_submit_write(session, src.ctypes.data + half, dst.ctypes.data + half, half),
    ]
    assert all(i != 0 for i in ids)
    assert a.get_batch_transfer_status(ids) == 0
    assert np.array_equal(src, dst)
    bid = a.batch_transfer_async_read(session, [back.ctypes.data], [dst.ctypes.data], [1 << 20])
    deadline = time.time() + 30
    while (rc := a.transfer_check_status(bid)) == 0:
        assert time.time() < deadline, "the read never finished"
        time.sleep(0.001)
    assert rc == 1
    assert np.array_equal(back, src)
    assert a.batch_transfer_sync_read(session, [back.ctypes.data], [dst.ctypes.data + 5], [100]) == 0
    assert bytes(back[:100]) == bytes(src[5:105])
    # the same through the generic calls with an opcode
    assert a.batch_transfer_sync(session, [src.ctypes.data], [dst.ctypes.data], [4096], flexns.TransferOpcode.Write) == 0
    bid = a.batch_transfer_async(session, [back.ctypes.data], [dst.ctypes.data], [4096], flexns.TransferOpcode.Read)
    assert a.get_batch_transfer_status([bid]) == 0


def test_managed_buffers_and_notifications(pair):
    a, b, session = pair
    buf = a.allocate_managed_buffer(1 << 16)
    assert buf != 0
    assert a.write_bytes_to_buffer(buf + 10, b"hello flexns", 12) == 0
    assert a.read_bytes_from_buffer(buf + 10, 12) == b"hello flexns"
    far = b.allocate_managed_buffer(1 << 16)
    n = flexns.TransferNotify("prefill-0", "layers 0-31 done")
    assert a.transfer_sync(session, buf + 10, far, 12, flexns.TransferOpcode.Write, n) == 0
    assert b.read_bytes_from_buffer(far, 12) == b"hello flexns"
    assert roles.wait_notifies(b, 1) == [("prefill-0", "layers 0-31 done")]
    assert a.send_notify(session, flexns.TransferNotify("x", "y")) == 0
    assert roles.wait_notifies(b, 1) == [("x", "y")]
    assert a.free_managed_buffer(buf, 1 << 16) == 0
    assert a.free_managed_buffer(buf, 1 << 16) == -1
    assert a.write_bytes_to_buffer(buf, b"x", 1) == -1, "freed memory is not writable through the engine"


def test_pythonic_calls_raise_with_the_cause(pair):
    a, b, session = pair
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    a.register_memory(src)
    b.register_memory(dst)
    a.write(session, src, dst.ctypes.data)
    assert np.array_equal(src, dst)
    loose = np.zeros(4096, dtype=np.uint8)  # never registered
    with pytest.raises(flexns.TransferError, match="not inside memory registered"):
        a.write(session, loose, dst.ctypes.data)
    with pytest.raises(flexns.TransferError, match="not inside|not registered|outside"):
        a.write(session, src, dst.ctypes.data + 4000)  # past the end of the remote buffer


def test_unregistered_memory_is_minus_one_and_named(pair, caplog):
    a, b, session = pair
    dst = np.zeros(4096, dtype=np.uint8)
    b.register_memory(dst)
    loose = np.zeros(4096, dtype=np.uint8)
    with caplog.at_level("WARNING", logger="flexns"):
        assert a.transfer_sync_write(session, loose.ctypes.data, dst.ctypes.data, 4096) == -1
    assert "not inside memory registered" in a.last_error()
    assert any("not inside memory registered" in r.getMessage() for r in caplog.records)
    assert a.batch_transfer_async_write(session, [loose.ctypes.data], [dst.ctypes.data], [4096]) == 0
    assert a.unregister_memory(loose.ctypes.data) == -1


def test_bad_arguments_are_errors_that_name_the_choices():
    e = flexns.TransferEngine()
    for proto in ("rdma", "efa", "nvlink"):
        with pytest.raises(ValueError, match='"flexns".*"tcp"'):
            e.initialize(HOST, "P2PHANDSHAKE", proto, "")
    with pytest.raises(ValueError, match="P2PHANDSHAKE"):
        e.initialize(HOST, "http://127.0.0.1:8080/metadata", "tcp", "")
    with pytest.raises(ValueError, match="no such interface"):
        e.initialize(HOST, "P2PHANDSHAKE", "tcp", "mlx5_0")
    with pytest.raises(flexns.TransferError, match="not initialized"):
        e.get_rpc_port()
    assert e.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
    with pytest.raises(ValueError, match="transport_hint"):
        e.transfer_sync_write("127.0.0.1:1", 0, 0, 1, transport_hint="rdma")
    with pytest.raises(TypeError, match="NumPy array or a PyTorch tensor"):
        e.register_memory("not memory", 10)
    with pytest.raises(ValueError, match="not C-contiguous"):
        e.register_memory(np.zeros((64, 64), dtype=np.uint8)[:, ::2])
    e.close()


def test_a_killed_decode_process_is_an_error_within_seconds_naming_it(protocol):
    a, b = CTX.Pipe()
    d = CTX.Process(target=roles.sink, args=(b, protocol, 64 << 20))
    d.start()
    engine = flexns.TransferEngine()
    try:
        assert engine.initialize(HOST, "P2PHANDSHAKE", protocol, "") == 0
        meta = a.recv() if a.poll(30) else pytest.fail("the decode process did not start")
        src = np.ones(64 << 20, dtype=np.uint8)
        engine.register_memory(src)
        assert engine.transfer_sync_write(meta["session"], src.ctypes.data, meta["addr"], 1 << 20) == 0
        os.kill(d.pid, signal.SIGKILL)
        d.join(10)
        t0 = time.time()
        rcs = []
        # a sync write in flight when it died, and the ones after: each fails, none hangs
        for _ in range(3):
            rcs.append(engine.transfer_sync_write(meta["session"], src.ctypes.data, meta["addr"], 64 << 20))
        took = time.time() - t0
        assert rcs == [-1, -1, -1]
        assert took < 15, f"failing took {took:.1f} s"
        port = meta["session"].rsplit(":", 1)[1]
        assert port in engine.last_error(), engine.last_error()
        print(f"{protocol}: failed in {took:.2f} s: {engine.last_error()}")
    finally:
        engine.close()
        if d.is_alive():
            d.kill()


def test_rdma_runs_over_flexns_only_when_asked_by_name(monkeypatch, caplog):
    e = flexns.TransferEngine()
    with pytest.raises(ValueError, match="FLEXNS_RDMA_AS=flexns"):
        e.initialize(HOST, "P2PHANDSHAKE", "rdma", "")
    monkeypatch.setenv("FLEXNS_RDMA_AS", "infiniband")
    with pytest.raises(ValueError, match="FLEXNS_RDMA_AS"):
        e.initialize(HOST, "P2PHANDSHAKE", "rdma", "")
    monkeypatch.setenv("FLEXNS_RDMA_AS", "tcp")
    with caplog.at_level("INFO", logger="flexns"):
        assert e.initialize(HOST, "P2PHANDSHAKE", "rdma", "") == 0
    assert e.get_protocol() == "tcp"
    assert any("FLEXNS_RDMA_AS" in r.getMessage() for r in caplog.records)
    e.close()
