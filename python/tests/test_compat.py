"""The opt-in Mooncake alias, and the example the README points to."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MOONCAKE_SCRIPT = """
from mooncake.engine import TransferEngine, TransferOpcode
e = TransferEngine()
assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
print("engine from", type(e).__module__, "port", e.get_rpc_port() > 0)
"""


def test_mooncake_names_resolve_to_flexns_only_when_asked(tmp_path):
    script = tmp_path / "serving.py"
    script.write_text(MOONCAKE_SCRIPT)
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    if plain.returncode == 0 and "flexns" not in plain.stdout:
        pytest.skip("a real Mooncake is installed here; the alias is opt-in and leaves it alone")
    assert plain.returncode != 0 and "No module named 'mooncake'" in plain.stderr
    run = subprocess.run([sys.executable, "-m", "flexns.as_mooncake", str(script)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "engine from flexns._flexns port True" in run.stdout


@pytest.mark.parametrize("protocol", ["flexns", "tcp"])
def test_the_prefill_decode_example_runs(protocol):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "prefill_decode.py"), "--protocol", protocol],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "verified=True" in r.stdout and "req-1" in r.stdout
