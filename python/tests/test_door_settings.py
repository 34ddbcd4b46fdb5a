"""The connection manager's door settings from the environment: a bad value is a ValueError
naming the variable; a good one is applied."""

import pytest

import flexns
import roles

HOST = roles.HOST


@pytest.mark.parametrize(
    "var, value, says",
    [
        ("FLEXNS_MAX_QPS_PER_CALLER", "many", "is not a number of queue pairs"),
        ("FLEXNS_MAX_QPS_PER_CALLER", "0", "max_qps_per_caller: 0 not in"),
        ("FLEXNS_UNUSED_QP_TIMEOUT", "soon", "is not a number of seconds"),
        ("FLEXNS_UNUSED_QP_TIMEOUT", "0.01", "unused_qp_timeout: 10ms not in"),
    ],
)
def test_bad_door_settings_name_the_variable(monkeypatch, var, value, says):
    monkeypatch.setenv(var, value)
    e = flexns.TransferEngine()
    with pytest.raises(ValueError, match=f"{var}: .*{says}"):
        e.initialize(HOST, "P2PHANDSHAKE", "flexns", "")


def test_the_per_caller_cap_is_applied(monkeypatch):
    # the target engine admits one QP per caller; a peer connects its two (qps_per_peer)
    monkeypatch.setenv("FLEXNS_MAX_QPS_PER_CALLER", "1")
    monkeypatch.setenv("FLEXNS_UNUSED_QP_TIMEOUT", "2.5")
    target = flexns.TransferEngine()
    assert target.initialize(HOST, "P2PHANDSHAKE", "flexns", "") == 0
    monkeypatch.delenv("FLEXNS_MAX_QPS_PER_CALLER")
    peer = flexns.TransferEngine()
    assert peer.initialize(HOST, "P2PHANDSHAKE", "flexns", "") == 0
    try:
        far = target.allocate_managed_buffer(1 << 12)
        near = peer.allocate_managed_buffer(1 << 12)
        session = f"{HOST}:{target.get_rpc_port()}"
        assert peer.transfer_sync(session, near, far, 16, flexns.TransferOpcode.Write) != 0
        assert "max_qps_per_caller is 1" in peer.last_error(), peer.last_error()
    finally:
        peer.close()
        target.close()
