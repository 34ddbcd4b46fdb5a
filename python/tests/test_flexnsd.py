"""The Python package with its stack in a `flexnsd` daemon (FLEXNS_FLEXNSD=socket): a prefill
engine attached to a real flexnsd process writes a batch into a decode process whose stack runs
in-process; the decode checks every block. Attached, the engine's buffers are memfds the daemon
maps (`allocate_managed_buffer`); caller memory is moved into a memfd in place when it starts on a
page boundary and refused with the reason in `last_error()` when it does not (a NumPy view);
`stack_stats()` are the daemon engine's counters."""

import multiprocessing as mp
import os
import pathlib
import subprocess
import time

import numpy as np
import pytest

import flexns
import roles

CTX = mp.get_context("spawn")
ROOT = pathlib.Path(__file__).resolve().parents[2]
TOTAL = roles.SAME_HOST_BLOCKS * roles.SAME_HOST_BLOCK


def flexnsd_binary():
    """The daemon the test command's cargo build made (debug or release)."""
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    # the newest of the profiles' builds: the one this tree was built into last
    built = [p for p in (target / "debug" / "flexnsd", target / "release" / "flexnsd") if p.exists()]
    if built:
        return max(built, key=lambda p: p.stat().st_mtime)
    if os.environ.get("FLEXNS_CI"):
        pytest.fail("no flexnsd binary under target/: the test command builds it first")
    pytest.skip("flexnsd is not built (cargo build -p flexnsd)")


@pytest.fixture
def daemon(tmp_path):
    socket = tmp_path / "flexnsd.sock"
    config = tmp_path / "flexnsd.toml"
    config.write_text('[context]\nbind = "127.0.0.1:0"\n')
    proc = subprocess.Popen(
        [str(flexnsd_binary()), "--socket", str(socket), "--config", str(config)],
        env={**os.environ, "RUST_LOG": "warn"},
    )
    deadline = time.time() + 20
    while not socket.exists():
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"flexnsd did not listen on {socket}")
        time.sleep(0.05)
    yield socket
    proc.kill()
    proc.wait()


def test_an_attached_engine_writes_into_an_in_process_one(daemon, monkeypatch):
    a, b = CTX.Pipe()
    # the decode process runs its own stack: it starts before the variable is set
    monkeypatch.delenv("FLEXNS_FLEXNSD", raising=False)
    d = CTX.Process(target=roles.same_host_decode, args=(b, "flexns", "managed"))
    d.start()
    monkeypatch.setenv("FLEXNS_FLEXNSD", str(daemon))
    engine = flexns.TransferEngine()
    try:
        assert engine.initialize(roles.HOST, "P2PHANDSHAKE", "flexns", "") == 0, engine.last_error()
        # caller memory that does not start on a page boundary cannot be moved into a memfd
        # for the daemon: refused, with the reason
        arr = np.zeros(3 << 20, dtype=np.uint8)
        skip = 8 + (-arr.ctypes.data) % 4096
        assert engine.register_memory(arr[skip:skip + (1 << 20)]) != 0
        assert "page boundary" in engine.last_error(), engine.last_error()
        meta = a.recv() if a.poll(30) else pytest.fail("the decode process did not start")
        src = engine.allocate_managed_buffer(TOTAL)
        assert src != 0, engine.last_error()
        data, perm = roles.same_host_layout(11)
        assert engine.write_bytes_to_buffer(src, data.tobytes(), TOTAL) == 0
        before = engine.stack_stats()
        ret = engine.batch_transfer_sync_write(
            meta["session"],
            [src + i * roles.SAME_HOST_BLOCK for i in range(roles.SAME_HOST_BLOCKS)],
            [meta["addr"] + perm[i] * roles.SAME_HOST_BLOCK for i in range(roles.SAME_HOST_BLOCKS)],
            [roles.SAME_HOST_BLOCK] * roles.SAME_HOST_BLOCKS,
        )
        assert ret == 0, engine.last_error()
        after = engine.stack_stats()
        a.send({"seed": 11})
        verdict = a.recv() if a.poll(30) else pytest.fail("the decode process did not answer")
        a.send("done")
    finally:
        d.join(30)
        if d.is_alive():
            d.kill()
    assert verdict["bad"] == [], f"blocks that differ at the decode: {verdict['bad']}"
    # the daemon's engine sent the bytes (the counters are its own)
    assert after["tx_bytes"] - before["tx_bytes"] >= TOTAL, (before, after)


def test_an_empty_flexnsd_variable_is_refused(monkeypatch):
    monkeypatch.setenv("FLEXNS_FLEXNSD", " ")
    with pytest.raises(ValueError, match="FLEXNS_FLEXNSD"):
        flexns.TransferEngine().initialize(roles.HOST, "P2PHANDSHAKE", "flexns", "")
