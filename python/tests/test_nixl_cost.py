"""flexns.nixl's estimate_xfer_cost, query_memory and notification sizes, between two
processes (nixl_roles.target): the estimate has NIXL's shape (us, us, "ANALYTICAL_BACKEND"),
grows with the bytes and the operations of the transfer, and after transfers on the path is
within its own stated margin of what they took; query_memory answers NIXL's list of
None-or-dict; a notification up to the limit arrives byte for byte (binary too), a larger one is
refused when the transfer is made, naming notif_msg and the limit."""

import time

import numpy as np
import pytest

import flexns
import nixl_roles as R
from flexns.nixl import nixlInvalidParamError
from test_nixl import Pair, blocks


@pytest.fixture
def pair():
    p = Pair("flexns")
    yield p
    p.close()


def test_estimate_has_nixls_shape_and_follows_the_transfer(pair):
    a = pair.agent
    local = a.prep_xfer_dlist("NIXL_INIT_AGENT", blocks(pair.src.ctypes.data, range(R.BLOCKS)), "DRAM")
    remote = a.prep_xfer_dlist("decode", blocks(pair.kv, range(R.BLOCKS)), "DRAM")
    one = a.make_prepped_xfer("WRITE", local, [0], remote, [0])
    # every other block: 32 operations that do not merge
    many = a.make_prepped_xfer("WRITE", local, list(range(0, 64, 2)), remote, list(range(0, 64, 2)))
    # all 64 adjacent blocks: merged into one operation of 1 MiB
    whole = a.make_prepped_xfer("WRITE", local, list(range(64)), remote, list(range(64)))
    e_one, e_many, e_whole = (a.estimate_xfer_cost(h) for h in (one, many, whole))
    for d, margin, method in (e_one, e_many, e_whole):
        assert isinstance(d, int) and isinstance(margin, int) and method == "ANALYTICAL_BACKEND"
        assert d > 0 and 0 < margin <= d
    assert e_one[0] < e_many[0], "32 operations cost more than one of the same size"
    assert e_one[0] < e_whole[0], "more bytes cost more"
    # after transfers on this path the estimate is calibrated: within its margin (plus the
    # spread of the measured times themselves) of what a transfer took
    took = []
    for _ in range(20):
        t0 = time.perf_counter()
        state = a.transfer(whole)
        while state == "PROC":
            state = a.check_xfer_state(whole)
        assert state == "DONE", a.get_xfer_error(whole)
        took.append((time.perf_counter() - t0) * 1e6)
    d, margin, _ = a.estimate_xfer_cost(whole)
    med = float(np.median(took))
    spread = float(np.percentile(took, 90) - np.percentile(took, 10))
    assert abs(d - med) <= margin + spread, (d, margin, med, spread, took)
    for h in (one, many, whole):
        a.release_xfer_handle(h)


def test_query_memory_answers_none_or_a_dict_per_descriptor(pair):
    a = pair.agent
    base = pair.src.ctypes.data
    outside = np.zeros(4096, dtype=np.uint8)
    got = a.query_memory([(base + 4096, 100, 0, ""), (outside.ctypes.data, 4096, 0, "")], "UCX", "DRAM")
    assert got[1] is None
    assert got[0] == {"mem_type": "DRAM", "base": str(base), "length": str(pair.src.nbytes), "offset": "4096"}
    assert all(isinstance(v, str) for v in got[0].values())
    with pytest.raises(ValueError, match="Backend 'GDS' not found"):
        a.query_memory([(base, 1, 0, "")], "GDS", "DRAM")


def test_notifications_up_to_the_limit_arrive_and_larger_ones_are_refused(pair):
    a = pair.agent
    binary = bytes(range(256)) * 4  # 1 KiB of every byte value
    text = b"r" * 2900
    for msg in (binary, text):
        a.send_notif("decode", msg)
    got = pair.ask({"op": "notifs", "n": 2})
    assert got["notifs"] == {"prefill": [binary, text]}
    big = b"x" * (8 << 10)
    with pytest.raises(nixlInvalidParamError, match=f"notif_msg: 8192 bytes .* {flexns.MAX_NOTIFY_BYTES}-byte limit"):
        a.send_notif("decode", big)
    local = a.prep_xfer_dlist("", blocks(pair.src.ctypes.data, [0]), "DRAM")
    remote = a.prep_xfer_dlist("decode", blocks(pair.kv, [0]), "DRAM")
    with pytest.raises(nixlInvalidParamError, match="notif_msg"):
        a.make_prepped_xfer("WRITE", local, [0], remote, [0], notif_msg=big)
    h = a.make_prepped_xfer("WRITE", local, [0], remote, [0])
    with pytest.raises(nixlInvalidParamError, match="notif_msg"):
        a.transfer(h, big)
