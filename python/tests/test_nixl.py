"""flexns.nixl: NIXL's agent API between two processes. This process is the initiator
("prefill"), a spawned one the target ("decode", nixl_roles.target): metadata by blob, WRITE
with a notification that arrives after the data, READ back, many descriptors and two
outstanding handles, a descriptor outside registered memory, and a notification by itself.
Every test checks the bytes that landed (or did not) and the notifications, not only states."""

import logging
import multiprocessing as mp
import time

import numpy as np
import pytest

import nixl_roles as R
from flexns.nixl import (
    nixl_agent,
    nixl_agent_config,
    nixlInvalidParamError,
    nixlNotFoundError,
    nixlXferDList,
)

CTX = mp.get_context("spawn")


class Pair:
    """An initiator agent here and a target agent in a spawned process, metadata exchanged."""

    def __init__(self, protocol="flexns"):
        self.conn, b = CTX.Pipe()
        self.proc = CTX.Process(target=R.target, args=(b, protocol))
        self.proc.start()
        self.agent = nixl_agent("prefill", nixl_agent_config(protocol=protocol))
        self.src = R.pattern(1, R.BLOCKS * R.BLOCK)
        self.reg = self.agent.register_memory(self.src)
        meta = self.ask(None)
        self.kv, self.spare = meta["kv"], meta["spare"]
        assert self.agent.add_remote_agent(meta["md"]) == "decode"
        self.conn.send(self.agent.get_agent_metadata())
        assert self.ask(None) == "prefill"  # the target knows us by our name

    def ask(self, cmd, timeout=60):
        if cmd is not None:
            self.conn.send(cmd)
        if not self.conn.poll(timeout):
            pytest.fail(f"the target process did not answer {cmd}")
        return self.conn.recv()

    def wait(self, handle, timeout=20):
        deadline = time.time() + timeout
        state = self.agent.check_xfer_state(handle)
        while state == "PROC" and time.time() < deadline:
            time.sleep(0.0005)
            state = self.agent.check_xfer_state(handle)
        return state

    def close(self):
        try:
            self.conn.send({"op": "bye"})
            self.proc.join(30)
            assert self.proc.exitcode == 0, f"target exit code {self.proc.exitcode}"
        finally:
            self.agent.close()
            if self.proc.is_alive():
                self.proc.kill()


@pytest.fixture
def pair(request):
    p = Pair(getattr(request, "param", "flexns"))
    yield p
    p.close()


def blocks(base, idx):
    return [(base + i * R.BLOCK, R.BLOCK, 0) for i in idx]


@pytest.mark.parametrize("pair", ["flexns", "tcp"], indirect=True)
def test_write_with_notif_lands_then_read_back(pair):
    a = pair.agent
    src_idx = [5, 6, 7, 40, 2, 63]
    dst_idx = [10, 11, 12, 0, 33, 63]  # the first three are adjacent on both sides (one piece)
    local = a.prep_xfer_dlist("NIXL_INIT_AGENT", blocks(pair.src.ctypes.data, range(R.BLOCKS)), "DRAM")
    remote = a.prep_xfer_dlist("decode", blocks(pair.kv, range(R.BLOCKS)), "DRAM")
    note = b"req-7:kv-done\x00\xff"
    h = a.make_prepped_xfer("WRITE", local, src_idx, remote, dst_idx, note)
    assert a.transfer(h) in ("PROC", "DONE")
    assert pair.wait(h) == "DONE"
    # the target checks each announced block the moment the notification arrives
    src = pair.src.reshape(R.BLOCKS, R.BLOCK)
    expect = {note: [(d, src[s].tobytes()) for s, d in zip(src_idx, dst_idx)]}
    verdict = pair.ask({"op": "notifs", "n": 1, "linger": 0.2, "expect": expect})
    assert verdict["notifs"] == {"prefill": [note]}
    assert verdict["bad"] == [], "the notification arrived before its data"
    dump = np.frombuffer(pair.ask({"op": "dump"})["kv"], dtype=np.uint8).reshape(R.BLOCKS, R.BLOCK)
    src = pair.src.reshape(R.BLOCKS, R.BLOCK)
    for s, d in zip(src_idx, dst_idx):
        assert np.array_equal(dump[d], src[s]), f"block {s} -> {d}"
    untouched = [b for b in range(R.BLOCKS) if b not in dst_idx]
    assert not dump[untouched].any(), "bytes landed where no descriptor pointed"
    a.release_xfer_handle(h)

    # READ: the target's data into a fresh registered buffer, by NumPy descriptor array
    pair.ask({"op": "fill", "seed": 9})
    want = R.pattern(9, R.BLOCKS * R.BLOCK).reshape(R.BLOCKS, R.BLOCK)
    dst = np.zeros((8, R.BLOCK), dtype=np.uint8)
    dreg = a.register_memory(dst)
    rd_idx = [3, 1, 60, 61, 62, 20, 0, 47]
    local_d = a.get_xfer_descs([row for row in dst])  # one descriptor per NumPy row
    remote_d = a.get_xfer_descs(np.array(blocks(pair.kv, rd_idx), dtype=np.uint64), "DRAM")
    assert isinstance(local_d, nixlXferDList) and local_d.descCount() == 8
    h = a.initialize_xfer("READ", local_d, remote_d, "decode")
    a.transfer(h)
    assert pair.wait(h) == "DONE"
    for k, b in enumerate(rd_idx):
        assert np.array_equal(dst[k], want[b]), f"read block {b}"
    assert pair.ask({"op": "notifs", "n": 1, "timeout": 0.3})["notifs"] == {}, "a READ without notif_msg notified"
    a.release_xfer_handle(h)
    a.deregister_memory(dreg)


def test_many_descriptors_and_two_outstanding_handles(pair):
    a = pair.agent
    local = a.prep_xfer_dlist("", blocks(pair.src.ctypes.data, range(R.BLOCKS)), "DRAM")
    remote = a.prep_xfer_dlist("decode", blocks(pair.kv, range(R.BLOCKS)), "DRAM")
    perm = [int(x) for x in np.random.default_rng(4).permutation(R.BLOCKS)]
    # even source blocks to the first handle, odd to the second; each 32 descriptors
    h1 = a.make_prepped_xfer("WRITE", local, list(range(0, 64, 2)), remote, perm[0::2], b"first")
    h2 = a.make_prepped_xfer("WRITE", local, list(range(1, 64, 2)), remote, perm[1::2], "second", skip_desc_merge=True)
    s1, s2 = a.transfer(h1), a.transfer(h2)  # both posted before either is polled
    assert s1 in ("PROC", "DONE") and s2 in ("PROC", "DONE")
    assert pair.wait(h1) == "DONE" and pair.wait(h2) == "DONE"
    verdict = pair.ask({"op": "notifs", "n": 2, "linger": 0.2})
    assert sorted(verdict["notifs"]["prefill"]) == [b"first", b"second"]
    assert list(verdict["notifs"]) == ["prefill"]
    dump = np.frombuffer(pair.ask({"op": "dump"})["kv"], dtype=np.uint8).reshape(R.BLOCKS, R.BLOCK)
    src = pair.src.reshape(R.BLOCKS, R.BLOCK)
    bad = [s for s in range(R.BLOCKS) if not np.array_equal(dump[perm[s]], src[s])]
    assert bad == []
    # a handle is posted again after DONE (as vLLM does) with new data and a new message
    pair.src[:] = R.pattern(2, pair.src.nbytes)
    assert a.transfer(h1, b"again") in ("PROC", "DONE") and pair.wait(h1) == "DONE"
    assert pair.ask({"op": "notifs", "n": 1})["notifs"] == {"prefill": [b"again"]}
    dump = np.frombuffer(pair.ask({"op": "dump"})["kv"], dtype=np.uint8).reshape(R.BLOCKS, R.BLOCK)
    src = pair.src.reshape(R.BLOCKS, R.BLOCK)
    assert all(np.array_equal(dump[perm[s]], src[s]) for s in range(0, 64, 2))
    for h in (h1, h2):
        a.release_xfer_handle(h)
    with pytest.raises(nixlNotFoundError):
        a.check_xfer_state(h1)


def test_bad_descriptor_is_err_or_refused_and_writes_nothing(pair, caplog):
    a = pair.agent
    local = a.get_xfer_descs(blocks(pair.src.ctypes.data, [0]), "DRAM")
    # outside what the remote published: refused when the request is made (as NIXL does)
    with pytest.raises(nixlNotFoundError, match="not inside memory agent decode registered"):
        a.initialize_xfer("WRITE", local, a.get_xfer_descs([(pair.kv + R.BLOCKS * R.BLOCK, R.BLOCK, 0)], "DRAM"), "decode", b"x")
    # outside this agent's own registrations
    with pytest.raises(nixlNotFoundError, match="agent prefill"):
        a.initialize_xfer(
            "WRITE",
            a.get_xfer_descs([(pair.src.ctypes.data - R.BLOCK, R.BLOCK, 0)], "DRAM"),
            a.get_xfer_descs(blocks(pair.kv, [0]), "DRAM"),
            "decode",
        )
    # the remote deregistered memory after publishing it: our metadata is stale, the stack
    # refuses the write, the state is ERR with the cause on the logger, nothing lands, no notif
    assert pair.ask({"op": "deregister", "what": "spare"}) == "ok"
    h = a.initialize_xfer("WRITE", local, a.get_xfer_descs([(pair.spare, R.BLOCK, 0)], "DRAM"), "decode", b"must-not-arrive")
    with caplog.at_level(logging.WARNING):
        state = a.transfer(h)
        if state == "PROC":
            state = pair.wait(h)
    assert state == "ERR"
    assert a.check_xfer_state(h) == "ERR"
    assert a.get_xfer_error(h), "an ERR without its cause"
    assert any("failed" in r.getMessage() and "decode" in r.getMessage() for r in caplog.records if r.name == "flexns.nixl")
    dump = pair.ask({"op": "dump"})
    assert not any(dump["spare"]), "bytes were written to deregistered memory"
    assert not any(dump["kv"])
    assert pair.ask({"op": "notifs", "n": 1, "timeout": 0.5})["notifs"] == {}
    a.release_xfer_handle(h)
    # the agent still works afterwards
    h = a.initialize_xfer("WRITE", local, a.get_xfer_descs(blocks(pair.kv, [3]), "DRAM"), "decode", b"ok")
    a.transfer(h)
    assert pair.wait(h) == "DONE"
    assert pair.ask({"op": "notifs", "n": 1})["notifs"] == {"prefill": [b"ok"]}


def test_send_notif_alone_both_ways(pair):
    a = pair.agent
    a.send_notif("decode", b"lease:req-3")
    a.send_notif("decode", "str-too")
    assert pair.ask({"op": "notifs", "n": 2, "linger": 0.1})["notifs"] == {"prefill": [b"lease:req-3", b"str-too"]}
    assert pair.ask({"op": "notif", "msg": b"free:req-3"}) == "ok"
    deadline, got = time.time() + 10, {}
    while not got and time.time() < deadline:
        got = a.get_new_notifs()
        time.sleep(0.001)
    assert got == {"decode": [b"free:req-3"]}
    assert a.check_remote_xfer_done("decode", b"free") is False  # taken already
    with pytest.raises(nixlNotFoundError):
        a.send_notif("nobody", b"x")
    a.remove_remote_agent("decode")
    with pytest.raises(nixlNotFoundError):
        a.send_notif("decode", b"x")


class FakeTensor:
    """An object with `data_ptr()` and `nbytes`, as a tensor has."""

    def __init__(self, arr, cuda=False):
        self.arr, self.is_cuda, self.nbytes = arr, cuda, arr.nbytes
        self.device = "cuda:0" if cuda else "cpu"

    def data_ptr(self):
        return self.arr.ctypes.data


def test_descriptor_inputs_and_device_memory_refused():
    a = nixl_agent("solo", nixl_agent_config(protocol="tcp"))
    try:
        buf = np.zeros(4096, dtype=np.uint8)
        small = np.zeros((4, 3), dtype=np.uint8)  # memory, not a descriptor array
        assert list(a.get_xfer_descs(small)) == [(small.ctypes.data, 12, 0)]
        d = a.get_reg_descs(FakeTensor(buf))
        assert list(d) == [(buf.ctypes.data, 4096, 0, "")]
        assert list(a.get_xfer_descs([FakeTensor(buf[:1024]), FakeTensor(buf[1024:])])) == [
            (buf.ctypes.data, 1024, 0),
            (buf.ctypes.data + 1024, 3072, 0),
        ]
        with pytest.raises(nixlInvalidParamError, match="CUDA tensor"):
            a.register_memory(FakeTensor(buf, cuda=True))
        with pytest.raises(nixlInvalidParamError, match="host memory only"):
            a.get_xfer_descs([(buf.ctypes.data, 16, 0)], "VRAM")
        with pytest.raises(nixlInvalidParamError, match="mem_type is required"):
            a.get_xfer_descs([(buf.ctypes.data, 16, 0)])
        with pytest.raises(nixlInvalidParamError, match="4-tuples"):
            a.get_reg_descs([(buf.ctypes.data, 16, 0)], "DRAM")
        with pytest.raises(nixlInvalidParamError, match="metadata"):
            a.add_remote_agent(b"not a blob")
        # loopback: the agent's own name as the remote side
        reg = a.register_memory(buf)
        buf[:1024] = 7
        h = a.initialize_xfer(
            "WRITE",
            a.get_xfer_descs([(buf.ctypes.data, 1024, 0)], "DRAM"),
            a.get_xfer_descs([(buf.ctypes.data + 2048, 1024, 0)], "DRAM"),
            "solo",
        )
        state = a.transfer(h)
        deadline = time.time() + 10
        while state == "PROC" and time.time() < deadline:
            state = a.check_xfer_state(h)
        assert state == "DONE" and (buf[2048:3072] == 7).all() and not buf[1024:2048].any()
        a.release_xfer_handle(h)
        a.deregister_memory(reg)
        with pytest.raises(nixlNotFoundError):
            a.deregister_memory(reg)
    finally:
        a.close()


def test_nixl_1_5_positional_backends_and_handle_objects():
    """NIXL 1.5 dropped ``is_sorted``: ``register_memory(list, mem_type, backends)`` and
    ``prep_xfer_dlist(agent, list, mem_type, backends)`` take the backends fourth/third, and
    its handles are objects with ``release()`` (released again by GC, never twice)."""
    a = nixl_agent("solo15", nixl_agent_config(protocol="tcp"))
    try:
        buf = np.zeros(8192, dtype=np.uint8)
        with pytest.raises(nixlNotFoundError, match="NOPE"):
            a.register_memory([(buf.ctypes.data, 8192, 0, "")], "DRAM", ["NOPE"])
        reg = a.register_memory([(buf.ctypes.data, 8192, 0, "")], "DRAM", ["UCX"])
        rows = [(buf.ctypes.data, 4096, 0), (buf.ctypes.data + 4096, 4096, 0)]
        with pytest.raises(nixlNotFoundError, match="NOPE"):
            a.prep_xfer_dlist("", rows, "DRAM", ["NOPE"])
        local = a.prep_xfer_dlist("", rows[:1], "DRAM", ["UCX"])
        remote = a.prep_xfer_dlist("solo15", rows[1:], "DRAM")
        assert "nixl_prepped_dlist_handle" in repr(local)
        buf[:4096] = 9
        h = a.make_prepped_xfer("WRITE", local, [0], remote, [0])
        assert "nixl_xfer_handle" in repr(h)
        state = a.transfer(h)
        deadline = time.time() + 10
        while state == "PROC" and time.time() < deadline:
            state = a.check_xfer_state(h)
        assert state == "DONE" and (buf[4096:] == 9).all()
        h.release()
        h.release()  # a second release does nothing, as NIXL's
        with pytest.raises(nixlNotFoundError):
            a.check_xfer_state(h)
        local.release()
        with pytest.raises(nixlNotFoundError):
            a.release_dlist_handle(local)
        a.release_dlist_handle(remote)
        a.deregister_memory(reg)
    finally:
        a.close()
