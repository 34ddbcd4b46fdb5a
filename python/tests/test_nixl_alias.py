"""The NIXL alias: with FLEXNS_AS_NIXL set, ``nixl``, ``nixl._api`` and ``nixl._bindings``
resolve to flexns.nixl in every interpreter (the wheel's ``flexns_nixl.pth`` hook), so a
multiprocessing ``spawn`` worker that imports them as vLLM's NixlConnector does moves data;
``1`` leaves a real NIXL alone and ``force`` shadows it; ``python -m flexns.as_nixl`` exports
the alias to children. Every test holds whether or not a real ``nixl`` is installed here."""

import multiprocessing as mp
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from flexns.nixl import nixl_agent, nixl_agent_config

CHILD = """
from nixl._api import nixl_agent, nixl_agent_config
from nixl._bindings import nixlXferTelemetry
a = nixl_agent("child", nixl_agent_config(backends=["UCX"]))
print("agent from", nixl_agent.__module__, nixlXferTelemetry.__name__, a.name)
a.close()
"""

N = 64 * 1024


def run(code, env_value, extra_env=None, args=()):
    env = {k: v for k, v in os.environ.items() if k != "FLEXNS_AS_NIXL"}
    if env_value is not None:
        env["FLEXNS_AS_NIXL"] = env_value
    env.update(extra_env or {})
    return subprocess.run([sys.executable, *args, "-c", code] if code else [sys.executable, *args],
                          capture_output=True, text=True, env=env, timeout=120)


def real_nixl_installed():
    return run("import nixl", None).returncode == 0


def spawn_worker(conn, md):
    """A spawned worker that imports NIXL's names as vLLM does and WRITEs with a notification."""
    try:
        from nixl._api import nixl_agent as NixlWrapper
        from nixl._api import nixl_agent_config
        from nixl._bindings import nixlXferTelemetry

        w = NixlWrapper("worker", nixl_agent_config(capture_telemetry=True))
        src = (np.arange(N, dtype=np.uint32) * 2654435761 % 251).astype(np.uint8)
        w.register_memory(src)
        peer = w.add_remote_agent(md["blob"])
        local = w.prep_xfer_dlist("NIXL_INIT_AGENT", [(src.ctypes.data, N, 0)], "DRAM")
        remote = w.prep_xfer_dlist(peer, [(md["addr"], N, 0)], "DRAM")
        h = w.make_prepped_xfer("WRITE", local, [0], remote, [0], notif_msg=b"req-1")
        state = w.transfer(h)
        deadline = time.time() + 60
        while state == "PROC" and time.time() < deadline:
            state = w.check_xfer_state(h)
        tel = w.get_xfer_telemetry(h)
        conn.send((NixlWrapper.__module__, state, isinstance(tel, nixlXferTelemetry), tel.totalBytes, w.get_xfer_error(h)))
        w.release_xfer_handle(h)
        w.close()
    except BaseException as x:  # the parent reports it
        conn.send(("error", repr(x), False, 0, ""))


def test_a_spawned_worker_imports_nixl_api_and_transfers(monkeypatch):
    # force: the alias holds even where a real NIXL is installed
    monkeypatch.setenv("FLEXNS_AS_NIXL", "force")
    target = nixl_agent("target", nixl_agent_config())
    dst = np.zeros(N, dtype=np.uint8)
    target.register_memory(dst)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=spawn_worker, args=(there, {"blob": target.get_agent_metadata(), "addr": dst.ctypes.data}))
    p.start()
    try:
        assert here.poll(120), "the spawned worker did not answer"
        module, state, is_tel, total, err = here.recv()
        notifs = {}
        deadline = time.time() + 20
        while not notifs and time.time() < deadline:
            notifs = target.get_new_notifs()
    finally:
        p.join(30)
        target.close()
    assert module == "flexns.nixl", (module, state)
    assert state == "DONE", err
    assert is_tel and total == N
    assert notifs == {"worker": [b"req-1"]}
    assert np.array_equal(dst, (np.arange(N, dtype=np.uint32) * 2654435761 % 251).astype(np.uint8))


def test_a_subprocess_resolves_nixl_only_when_asked():
    r = run(CHILD, "force")
    assert r.returncode == 0, r.stderr
    assert "agent from flexns.nixl nixlXferTelemetry child" in r.stdout, r.stdout
    if not real_nixl_installed():
        r = run(CHILD, "1")
        assert r.returncode == 0 and "agent from flexns.nixl" in r.stdout, r.stderr
        for off in (None, "", "0"):
            r = run(CHILD, off)
            assert r.returncode != 0 and "No module named 'nixl'" in r.stderr, (off, r.stderr)


def test_the_hook_is_lazy_and_a_bad_value_is_named():
    probe = "import sys; print('_flexns_nixl_hook' in sys.modules, 'flexns' in sys.modules)"
    assert run(probe, "1").stdout.split() == ["True", "False"]
    assert run(probe, None).stdout.split() == ["False", "False"]
    r = run("import nixl._api", "yes")
    assert r.returncode != 0
    assert "FLEXNS_AS_NIXL='yes': expected 1" in r.stderr, r.stderr


def test_a_real_nixl_is_left_alone_unless_forced(tmp_path):
    real = tmp_path / "nixl"
    real.mkdir()
    (real / "__init__.py").write_text("")
    (real / "_api.py").write_text("class nixl_agent:\n    pass\n")
    code = "from nixl._api import nixl_agent; print('agent from', nixl_agent.__module__, nixl_agent.__qualname__)"
    path = {"PYTHONPATH": str(tmp_path)}
    r = run(code, "1", path)
    assert r.returncode == 0 and "agent from nixl._api nixl_agent" in r.stdout, r.stderr
    assert "a real NIXL is installed at" in r.stderr and str(tmp_path) in r.stderr, r.stderr
    assert "FLEXNS_AS_NIXL=force" in r.stderr, r.stderr
    r = run(code, "force", path)
    assert r.returncode == 0 and "agent from flexns.nixl nixl_agent" in r.stdout, r.stderr
    assert "shadowing the real NIXL at" in r.stderr, r.stderr


def test_the_runner_exports_the_alias_to_children(tmp_path):
    script = tmp_path / "server.py"
    script.write_text(
        "import os, subprocess, sys\n"
        "from nixl._api import nixl_agent\n"
        f"r = subprocess.run([sys.executable, '-c', {CHILD!r}], capture_output=True, text=True)\n"
        "print('env', os.environ.get('FLEXNS_AS_NIXL'), nixl_agent.__module__)\n"
        "print(r.stdout, r.stderr)\n"
    )
    r = run(None, None, args=("-m", "flexns.as_nixl", str(script)))
    assert r.returncode == 0, r.stderr
    assert "env force flexns.nixl" in r.stdout and "agent from flexns.nixl nixlXferTelemetry child" in r.stdout, r.stdout


def test_config_takes_nixls_positional_order_and_telemetry_follows_it():
    conf = nixl_agent_config(True, True, 0, True, 4, ["UCX"])
    assert (conf.capture_telemetry, conf.num_threads, conf.backends) == (True, 4, ["UCX"])
    with pytest.raises(Exception, match="backends: a list"):
        nixl_agent_config(backends="UCX")
    a = nixl_agent("loop", nixl_agent_config(capture_telemetry=False))
    try:
        buf = np.zeros(2 * 4096, dtype=np.uint8)
        buf[:4096] = 7
        a.register_memory(buf)
        src = a.get_xfer_descs([(buf.ctypes.data, 4096, 0)], "DRAM")
        dst = a.get_xfer_descs([(buf.ctypes.data + 4096, 4096, 0)], "DRAM")
        h = a.initialize_xfer("WRITE", src, dst, "loop")
        state = a.transfer(h)
        deadline = time.time() + 20
        while state == "PROC" and time.time() < deadline:
            state = a.check_xfer_state(h)
        assert state == "DONE", a.get_xfer_error(h)
        assert (buf[4096:] == 7).all()
        with pytest.raises(Exception, match="capture_telemetry=True"):
            a.get_xfer_telemetry(h)
    finally:
        a.close()
