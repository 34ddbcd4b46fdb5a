"""flexns.nixl's metadata through etcd, between two processes, against a real etcd server
started for the test: the target ("decode") sends its metadata with ``send_local_metadata``;
the initiator ("prefill") ``fetch_remote_metadata``s it, sees ``check_remote_metadata`` turn
True, WRITEs with a notification (bytes checked in the target), and once the target
``invalidate_local_metadata``s, the key is gone from etcd and the initiator drops the agent.
Endpoints come from NIXL_ETCD_ENDPOINTS, as in NIXL. Also: the calls that name a peer's
``ip_addr`` (NIXL's listener thread) and the calls without endpoints are refused by name."""

import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import tempfile
import time

import numpy as np
import pytest

import flexns
from flexns.nixl import nixl_agent, nixl_agent_config, nixlInvalidParamError, nixlNotFoundError

CTX = mp.get_context("spawn")
N = 256 * 1024
KEY = "/nixl/agents/decode/metadata"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def etcd():
    if shutil.which("etcd") is None:
        msg = "etcd is not installed (scripts/install-test-deps.sh installs etcd-server)"
        if os.environ.get("FLEXNS_CI") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    d = tempfile.mkdtemp(prefix="flexns-nixl-etcd-")
    cp, pp = free_port(), free_port()
    url, peer = f"http://127.0.0.1:{cp}", f"http://127.0.0.1:{pp}"
    proc = subprocess.Popen(
        ["etcd", "--name", "nixl-test", "--data-dir", d, "--listen-client-urls", url,
         "--advertise-client-urls", url, "--listen-peer-urls", peer,
         "--initial-advertise-peer-urls", peer, "--initial-cluster", f"nixl-test={peer}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 20
        while True:
            try:
                flexns._flexns.EtcdStore(url).put("/probe", b"up")
                break
            except flexns.TransferError:
                assert proc.poll() is None, "etcd exited"
                assert time.time() < deadline, "etcd did not answer within 20 s"
                time.sleep(0.1)
        yield url
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(d, ignore_errors=True)


def target(conn):
    """The decode side: registers its KV memory and publishes its metadata through etcd
    (NIXL_ETCD_ENDPOINTS is inherited from the test)."""
    agent = nixl_agent("decode", nixl_agent_config())
    kv = np.zeros(N, dtype=np.uint8)
    agent.register_memory(kv)
    agent.send_local_metadata()
    conn.send(kv.ctypes.data)
    while True:
        cmd = conn.recv()
        if cmd == "notifs":
            got = {}
            deadline = time.time() + 20
            while not got and time.time() < deadline:
                got = agent.get_new_notifs()
            conn.send((got, kv.tobytes()))
        elif cmd == "invalidate":
            agent.invalidate_local_metadata()
            conn.send("ok")
        else:
            break
    agent.close()


def wait_for(cond, timeout=20):
    deadline = time.time() + timeout
    while not cond():
        if time.time() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_metadata_through_etcd_between_two_processes(etcd, monkeypatch):
    monkeypatch.setenv("NIXL_ETCD_ENDPOINTS", etcd)
    monkeypatch.delenv("NIXL_ETCD_NAMESPACE", raising=False)
    store = flexns._flexns.EtcdStore(etcd)
    here, there = CTX.Pipe()
    p = CTX.Process(target=target, args=(there,))
    p.start()
    agent = nixl_agent("prefill", nixl_agent_config())
    try:
        assert here.poll(60), "the target did not start"
        addr = here.recv()
        assert store.get(KEY) is not None, "send_local_metadata stored nothing under " + KEY
        agent.fetch_remote_metadata("decode")
        assert wait_for(lambda: agent.check_remote_metadata("decode")), "the fetched metadata never loaded"
        src = np.random.default_rng(3).integers(0, 256, N, dtype=np.uint8)
        agent.register_memory(src)
        local = agent.get_xfer_descs([(src.ctypes.data, N, 0)], "DRAM")
        remote = agent.get_xfer_descs([(addr, N, 0)], "DRAM")
        assert agent.check_remote_metadata("decode", remote)
        h = agent.initialize_xfer("WRITE", local, remote, "decode", b"via-etcd")
        state = agent.transfer(h)
        assert wait_for(lambda: agent.check_xfer_state(h) != "PROC")
        assert agent.check_xfer_state(h) == "DONE", agent.get_xfer_error(h)
        here.send("notifs")
        notifs, kv = here.recv()
        assert notifs == {"prefill": [b"via-etcd"]}
        assert kv == src.tobytes()
        # invalidation: the key goes, and the initiator drops the agent
        here.send("invalidate")
        assert here.recv() == "ok"
        assert store.get(KEY) is None
        assert wait_for(lambda: not agent.check_remote_metadata("decode")), "the invalidated agent was kept"
        with pytest.raises(nixlNotFoundError, match="decode"):
            agent.initialize_xfer("WRITE", local, remote, "decode")
        del state
    finally:
        here.send("bye")
        p.join(30)
        agent.close()
        if p.is_alive():
            p.kill()
    assert p.exitcode == 0


def test_peer_listener_and_missing_endpoints_are_refused_by_name(monkeypatch):
    monkeypatch.delenv("NIXL_ETCD_ENDPOINTS", raising=False)
    a = nixl_agent("lonely", nixl_agent_config())
    try:
        with pytest.raises(nixlInvalidParamError, match="NIXL_ETCD_ENDPOINTS"):
            a.send_local_metadata()
        with pytest.raises(nixlInvalidParamError, match="ip_addr '10.0.0.2'.*listener"):
            a.fetch_remote_metadata("other", "10.0.0.2", 5555)
        with pytest.raises(nixlInvalidParamError, match="remote_agent"):
            nixl_agent("x", nixl_agent_config(etcd_endpoints="127.0.0.1:1")).fetch_remote_metadata("")
    finally:
        a.close()
