"""The demo's vLLM pair script reads its roles' answers with a deadline: a role that exits while
its children keep its stdout open, or one that stays silent, is an error naming it within
seconds, not a wait until the demo's 600 s limit (python/demo/vllm_pair.py, ``read_line``)."""

import importlib.util
import pathlib
import subprocess
import sys
import time

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "demo" / "vllm_pair.py"


@pytest.fixture(scope="module")
def pair():
    spec = importlib.util.spec_from_file_location("vllm_pair", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def role(pair, code):
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    pair.watch_marks(proc)
    return proc


def test_an_answer_is_read_past_other_lines(pair):
    proc = role(pair, f"print('vLLM log line'); print({pair.MARK!r} + '{{\"ok\": 1}}', flush=True)")
    assert pair.read_line(proc, "prefill", "log", timeout=30) == {"ok": 1}
    proc.wait()


def test_a_role_that_exits_while_its_child_holds_the_pipe_is_an_error_at_once(pair):
    # the role leaves a child with its stdout open (as vLLM's engine core would) and exits
    proc = role(pair, "import subprocess, sys; subprocess.Popen(['sleep', '30']); sys.exit(3)")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"decode exited \(rc=3\)"):
        pair.read_line(proc, "decode", "decode.log", timeout=60)
    assert time.monotonic() - t0 < 10
    pair.kill_roles({"decode": proc})


def test_a_silent_role_is_an_error_after_the_timeout(pair):
    proc = role(pair, "import time; time.sleep(30)")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="prefill did not answer within 2 s"):
        pair.read_line(proc, "prefill", "prefill.log", timeout=2)
    assert time.monotonic() - t0 < 10
    pair.kill_roles({"prefill": proc})
