"""The Mooncake alias reaches worker processes: with FLEXNS_AS_MOONCAKE set, ``mooncake.engine``
resolves to flexns in every interpreter (the wheel's ``flexns_mooncake.pth`` hook), so a
multiprocessing ``spawn`` worker and a ``subprocess`` child import it and move data; without
it ``import mooncake`` fails; ``1`` leaves a real Mooncake alone and ``force`` shadows it."""

import multiprocessing as mp
import os
import subprocess
import sys

import numpy as np
import pytest

import flexns

CHILD = """
import sys
from mooncake.engine import TransferEngine
e = TransferEngine()
assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
print("engine from", TransferEngine.__module__, e.get_rpc_port() > 0)
"""


def run(code, env_value, extra_env=None, args=()):
    env = {k: v for k, v in os.environ.items() if k != "FLEXNS_AS_MOONCAKE"}
    if env_value is not None:
        env["FLEXNS_AS_MOONCAKE"] = env_value
    env.update(extra_env or {})
    return subprocess.run([sys.executable, *args, "-c", code] if code else [sys.executable, *args],
                          capture_output=True, text=True, env=env, timeout=120)


def no_real_mooncake():
    r = run("import mooncake", None)
    if r.returncode == 0:
        pytest.skip("a real Mooncake is installed here: the checks that it is absent do not apply")


def spawn_worker(conn, session, addr, n):
    """A worker started with multiprocessing's spawn: imports Mooncake's name and writes."""
    try:
        from mooncake.engine import TransferEngine

        e = TransferEngine()
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        src = np.arange(n, dtype=np.uint64).astype(np.uint8)
        assert e.register_memory(src.ctypes.data, src.nbytes) == 0
        ret = e.transfer_sync_write(session, src.ctypes.data, addr, n)
        conn.send((TransferEngine.__module__, ret, e.last_error()))
        e.close()
    except BaseException as x:  # the parent reports it
        conn.send(("error", repr(x), ""))


def test_a_spawned_worker_imports_mooncake_and_transfers(monkeypatch):
    no_real_mooncake()
    monkeypatch.setenv("FLEXNS_AS_MOONCAKE", "1")
    e = flexns.TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    n = 1 << 20
    dst = np.zeros(n, dtype=np.uint8)
    assert e.register_memory(dst) == 0
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=spawn_worker, args=(there, e.get_session_id(), dst.ctypes.data, n))
    p.start()
    try:
        assert here.poll(120), "the spawned worker did not answer"
        module, ret, err = here.recv()
    finally:
        p.join(30)
        e.close()
    assert module == "flexns._flexns", (module, ret)
    assert ret == 0, err
    assert np.array_equal(dst, np.arange(n, dtype=np.uint64).astype(np.uint8))


def test_a_subprocess_child_resolves_mooncake_only_when_asked():
    no_real_mooncake()
    r = run(CHILD, "1")
    assert r.returncode == 0, r.stderr
    assert "engine from flexns._flexns True" in r.stdout
    for off in (None, "", "0"):
        r = run(CHILD, off)
        assert r.returncode != 0 and "No module named 'mooncake'" in r.stderr, (off, r.stderr)


def test_the_hook_is_lazy_and_a_bad_value_is_named():
    probe = "import sys; print('_flexns_mooncake_hook' in sys.modules, 'flexns' in sys.modules)"
    # asked: the finder is installed at start, flexns (the extension) is not imported yet
    assert run(probe, "1").stdout.split() == ["True", "False"]
    # not asked: nothing is imported at all
    assert run(probe, None).stdout.split() == ["False", "False"]
    r = run("import mooncake.engine", "yes")
    assert r.returncode != 0
    assert "FLEXNS_AS_MOONCAKE='yes': expected 1" in r.stderr, r.stderr


def test_a_real_mooncake_is_left_alone_unless_forced(tmp_path):
    real = tmp_path / "mooncake"
    real.mkdir()
    (real / "__init__.py").write_text("")
    (real / "engine.py").write_text("class TransferEngine:\n    pass\n")
    code = "from mooncake.engine import TransferEngine; print('engine from', TransferEngine.__module__)"
    path = {"PYTHONPATH": str(tmp_path)}
    r = run(code, "1", path)
    assert r.returncode == 0 and "engine from mooncake.engine" in r.stdout, r.stderr
    assert "a real Mooncake is installed at" in r.stderr and "FLEXNS_AS_MOONCAKE=force" in r.stderr, r.stderr
    r = run(code, "force", path)
    assert r.returncode == 0 and "engine from flexns._flexns" in r.stdout, r.stderr
    assert "shadowing the real Mooncake at" in r.stderr, r.stderr


def test_the_runner_exports_the_alias_to_children(tmp_path):
    no_real_mooncake()
    script = tmp_path / "server.py"
    script.write_text(
        "import os, subprocess, sys\n"
        "from mooncake.engine import TransferEngine\n"
        f"r = subprocess.run([sys.executable, '-c', {CHILD!r}], capture_output=True, text=True)\n"
        "print('env', os.environ.get('FLEXNS_AS_MOONCAKE'))\n"
        "print(r.stdout, r.stderr)\n"
    )
    r = run(None, None, args=("-m", "flexns.as_mooncake", str(script)))
    assert r.returncode == 0, r.stderr
    assert "env force" in r.stdout and "engine from flexns._flexns True" in r.stdout, r.stdout
