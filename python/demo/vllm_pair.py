"""A served disaggregated vLLM pair over flexns: the LLM step of ``flexns demo`` (docs/VLLM.md).

Two real ``vllm.LLM`` engines, each in a process of its own (with vLLM's engine-core and worker
processes), on the tiny Llama config of ``python/tests/vllm_roles.py`` written on the fly, with
dummy weights (``load_format="dummy"``: no download, no hub), on CPU. vLLM's own
``NixlConnector`` moves the KV cache; ``FLEXNS_AS_NIXL=force`` makes its ``import nixl`` flexns's.

1. prefill (``kv_producer``) generates the reference: the prompt's tokens, not disaggregated;
2. prefill runs the prompt with ``do_remote_decode`` (one token) and hands its
   ``kv_transfer_params`` (its engine, host, port and ``remote_block_ids``) to decode;
3. decode (``kv_consumer``, ``kv_load_failure_policy="fail"``: a failed load is an error, not a
   recompute) generates the tokens from the prefill's blocks, READ over flexns;
4. the result holds when every whole block of the prompt is in decode's cache byte for byte
   (SHA-256 of each block, every layer, read inside vLLM's workers through a worker extension;
   the partial last block also holds decode's own tokens), decode's tokens equal the reference,
   AND decode's flexns engine counters moved at least the KV bytes of the blocks it was given:
   equal tokens alone would not tell a load from a recompute (the dummy weights' greedy tokens
   hardly depend on the context).

Usage: ``python3 python/demo/vllm_pair.py [--json] [--tokens N]``. Prints the tokens, the bytes
moved and the times; with ``--json`` one JSON object (the last line). Exit status 1 when the
pair ran but did not verify, 2 when it could not run.
"""

import argparse
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL_CONFIG = {  # python/tests/vllm_roles.py's tiny Llama
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
}
BLOCK_SIZE = 32  # the CPU attention backend's kernel block size is a multiple of 32
PROMPT_LEN = 100  # 4 blocks, the last one partial
NUM_BLOCKS = 48  # each engine's KV cache (so that every block can be hashed in a moment)
MARK = "@vllm-pair@ "  # protocol lines between this script and its two roles start with this


def prompt_ids():
    """A fixed prompt of token ids (no tokenizer: ``skip_tokenizer_init``)."""
    return [(i * 37 + 11) % (MODEL_CONFIG["vocab_size"] - 1) + 1 for i in range(PROMPT_LEN)]


def kv_bytes_per_block():
    """Bytes of one block of KV cache, every layer: K and V, heads x head size, float32."""
    c = MODEL_CONFIG
    return 2 * BLOCK_SIZE * c["num_key_value_heads"] * c["head_dim"] * 4 * c["num_hidden_layers"]


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def emit(obj):
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FlexnsStats:
    """A vLLM worker extension (``worker_extension_cls``): what the demo reads inside vLLM's
    worker process."""

    def flexns_stats(self):
        """The counters of the flexns engine under this worker's NixlConnector, and which
        module that engine is."""
        from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

        cw = get_kv_transfer_group().connector_worker
        agent = cw.nixl_wrapper
        inner = getattr(agent, "engine", None)  # flexns.nixl's agent owns a TransferEngine
        stats = inner.stack_stats() if inner is not None and hasattr(inner, "stack_stats") else None
        return {"module": type(agent).__module__, "stats": stats}

    def block_digests(self):
        """The SHA-256 of every KV-cache block of this worker: its bytes in every layer, in
        layer order (the block dimension found as the one of ``num_gpu_blocks`` entries)."""
        import hashlib

        n = self.vllm_config.cache_config.num_gpu_blocks
        layers = []
        for t in self.model_runner.kv_caches:
            dims = [i for i, d in enumerate(t.shape) if d == n]
            if len(dims) != 1:
                raise RuntimeError(f"KV cache shape {tuple(t.shape)}: no single dimension of {n} blocks")
            layers.append(t.movedim(dims[0], 0).contiguous().view(n, -1))
        digests = []
        for b in range(n):
            h = hashlib.sha256()
            for rows in layers:
                h.update(rows[b].numpy().tobytes())
            digests.append(h.hexdigest())
        return digests


def engine(role, model_dir, tokens):
    """One side's ``vllm.LLM`` (the constructor starts its engine core and worker)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kvt = KVTransferConfig(kv_connector="NixlConnector",
                           kv_role="kv_producer" if role == "prefill" else "kv_consumer",
                           kv_buffer_device="cpu", kv_load_failure_policy="fail")
    return LLM(model=model_dir, skip_tokenizer_init=True, load_format="dummy", dtype="float32",
               seed=0, block_size=BLOCK_SIZE, enforce_eager=True, max_model_len=512,
               max_num_seqs=4, enable_prefix_caching=False, kv_transfer_config=kvt,
               num_gpu_blocks_override=NUM_BLOCKS,
               worker_extension_cls="vllm_pair.FlexnsStats")


def generate(llm, tokens, max_tokens, params=None):
    """One request through ``llm``: its output (greedy, no detokenizer)."""
    from vllm import SamplingParams

    extra = {"kv_transfer_params": params} if params is not None else None
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False,
                        ignore_eos=True, extra_args=extra)
    (out,) = llm.generate([{"prompt_token_ids": prompt_ids()}], sp, use_tqdm=False)
    return out


def stats_of(llm):
    (s,) = llm.collective_rpc("flexns_stats")
    return s


def role_main(role, model_dir, tokens):
    """One engine; the protocol on stdin/stdout (``MARK`` lines) with the parent."""
    t0 = time.monotonic()
    llm = engine(role, model_dir, tokens)
    started = time.monotonic() - t0
    before = stats_of(llm)
    if role == "prefill":
        t = time.monotonic()
        ref = generate(llm, tokens, tokens)
        ref_s = time.monotonic() - t
        t = time.monotonic()
        out = generate(llm, tokens, 1, {"do_remote_decode": True})
        prefill_s = time.monotonic() - t
        emit({"start_s": started, "reference": list(ref.outputs[0].token_ids), "reference_s": ref_s,
              "prefill_s": prefill_s, "kv_transfer_params": out.kv_transfer_params,
              "module": before["module"]})
        sys.stdin.readline()  # decode is done with the blocks: stop
        (digests,) = llm.collective_rpc("block_digests")
        emit({"stats": stats_of(llm)["stats"], "stats_before": before["stats"], "digests": digests})
    else:
        params = json.loads(sys.stdin.readline())
        t = time.monotonic()
        out = generate(llm, tokens, tokens, params)
        decode_s = time.monotonic() - t
        after = stats_of(llm)
        (digests,) = llm.collective_rpc("block_digests")
        emit({"digests": digests,"start_s": started, "tokens": list(out.outputs[0].token_ids), "decode_s": decode_s,
              "finish_reason": out.outputs[0].finish_reason,
              "num_cached_tokens": getattr(out, "num_cached_tokens", None),
              "module": after["module"], "stats": after["stats"], "stats_before": before["stats"]})


# Longest wait for one answer of a role (a cold start of two engines side by side took 99 s
# on the loaded 2-core host); the demo's own limit for the step is 600 s.
READ_TIMEOUT_S = 300


def watch_marks(proc):
    """Reads ``proc``'s stdout on a thread of its own and queues its ``MARK`` lines (None at
    EOF), so that ``read_line`` can wait with a deadline and notice the role's exit even while
    its vLLM children keep the pipe open."""
    marks = queue.Queue()

    def pump():
        for line in proc.stdout:
            if line.startswith(MARK):
                marks.put(line)
        marks.put(None)

    threading.Thread(target=pump, daemon=True).start()
    proc.marks = marks


def read_line(proc, what, log_path, timeout=READ_TIMEOUT_S):
    """The next ``MARK`` line of ``proc`` (other stdout lines are vLLM's logs), within
    ``timeout`` seconds; an error naming the role and its log if it exits first or stays
    silent that long."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = proc.marks.get(timeout=1.0)
        except queue.Empty:
            line = ""
        if not line and proc.poll() is not None:
            # it exited: its last line may still be on its way through the pipe
            try:
                line = proc.marks.get(timeout=2.0)
            except queue.Empty:
                line = None
        if line is None:
            proc.wait(timeout=60)
            raise RuntimeError(f"{what} exited (rc={proc.returncode}) before answering; "
                               f"its log: {log_path}")
        if line:
            return json.loads(line[len(MARK):])
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not answer within {timeout} s; its log: {log_path}")


def role_preexec():
    """In each role's process before exec: ``PR_SET_PDEATHSIG(SIGKILL)``, so that the role dies
    with this script even when the script is SIGKILLed (its vLLM engine-core and worker children
    are then killed by the group kill of whoever ran the script, or by vLLM's own parent-death
    watch). The role is in a process group of its own (``start_new_session``), so that
    ``kill_roles`` can kill it with its children."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    if libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")


def kill_roles(procs):
    """SIGKILL each role's whole process group (the role, vLLM's engine core and workers) and
    reap the role. Harmless for groups already gone."""
    for proc in procs.values():
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def exit_on_signal(signum, _frame):
    """SIGTERM/SIGHUP end the script through ``SystemExit``, so that its ``finally`` kills the
    roles' groups."""
    raise SystemExit(128 + signum)


def moved(before, after):
    """Bytes decode's flexns engine moved for the transfer: by the same-host copy or CMA, and
    received in packets."""
    keys = ("same_host_copy_bytes", "same_host_cma_bytes", "rx_bytes")
    return {k: after.get(k, 0) - (before or {}).get(k, 0) for k in keys}


def parent_main(args):
    t_all = time.monotonic()
    work = tempfile.mkdtemp(prefix="flexns-vllm-pair-")
    model_dir = os.path.join(work, "tiny-llama")
    os.makedirs(model_dir)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(MODEL_CONFIG, f)
    base = dict(os.environ)
    base.update({"FLEXNS_AS_NIXL": "force", "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                 "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_HOST_IP": "127.0.0.1",
                 "PYTHONPATH": os.pathsep.join([HERE] + [p for p in [base.get("PYTHONPATH")] if p])})
    procs = {}
    logs = {}
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, exit_on_signal)
    try:
        return run_pair(args, t_all, work, model_dir, base, procs, logs)
    finally:
        # every exit path (a result, an error, SIGTERM/SIGHUP/Ctrl-C): no role process group,
        # vLLM's engine cores and workers included, outlives the script
        kill_roles(procs)


def run_pair(args, t_all, work, model_dir, base, procs, logs):
    """The pair's run; ``procs`` and ``logs`` are filled as the roles start (the caller kills
    the roles' groups however this returns)."""
    try:
        for role in ("prefill", "decode"):
            env = dict(base, VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()))
            logs[role] = os.path.join(work, f"{role}.log")
            with open(logs[role], "w") as log_file:
                procs[role] = subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "--role", role, "--model-dir",
                     model_dir, "--tokens", str(args.tokens)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file,
                    env=env, text=True, start_new_session=True, preexec_fn=role_preexec)
                watch_marks(procs[role])
        p = read_line(procs["prefill"], "prefill", logs["prefill"])
        params = p["kv_transfer_params"]
        if not params or not params.get("remote_block_ids"):
            raise RuntimeError(f"prefill returned no kv_transfer_params with blocks: {params!r}")
        # vLLM 0.32 copies this (the prefill's own prefix-cache hits) into decode's
        # num_cached_tokens in place of decode's count (v1/engine/output_processor.py); without
        # it decode reports its own: local prefix hits (none, prefix caching is off) plus the
        # tokens its scheduler took from the remote KV through the connector
        params = {k: v for k, v in params.items() if k != "remote_prefill_cached_tokens"}
        procs["decode"].stdin.write(json.dumps(params) + "\n")
        procs["decode"].stdin.flush()
        d = read_line(procs["decode"], "decode", logs["decode"])
        procs["prefill"].stdin.write("done\n")
        procs["prefill"].stdin.flush()
        ps = read_line(procs["prefill"], "prefill", logs["prefill"])
        for role, proc in procs.items():
            proc.stdin.close()
            proc.wait(timeout=120)
    except Exception as e:  # noqa: BLE001 - reported as the step's reason
        kill_roles(procs)
        report(args, {"ran": False, "verified": False, "error": str(e), "logs": logs})
        return 2
    ids = params["remote_block_ids"]
    blocks = len(ids[0]) if ids and isinstance(ids[0], list) else len(ids)
    kv_bytes = blocks * kv_bytes_per_block()
    m = moved(d["stats_before"], d["stats"] or {})
    total = sum(m.values())
    # the prompt's whole blocks, byte for byte: each of the prefill's is somewhere in decode's
    # cache (decode writes its own tokens into the partial last block, so that one is covered by
    # the counters only)
    whole = PROMPT_LEN // BLOCK_SIZE
    ids = params["remote_block_ids"]
    ids = ids[0] if ids and isinstance(ids[0], list) else ids
    sent = [ps["digests"][i] for i in ids[:whole]]
    held = set(d["digests"])
    checks = {
        "whole_blocks_equal_at_decode": len(sent) == whole and len(set(sent)) == whole
        and all(h in held for h in sent),
        "tokens_equal_reference": d["tokens"] == p["reference"] and len(d["tokens"]) == args.tokens,
        "engine_is_flexns": d["module"] == "flexns.nixl" and p["module"] == "flexns.nixl",
        "kv_bytes_moved_over_flexns": d["stats"] is not None and total >= kv_bytes,
        # decode's scheduler took the prompt's whole blocks from the remote KV, not computed
        # them: the tokens and digests alone would not tell (both engines' dummy weights are
        # seeded alike, so a recompute gives the same blocks and tokens)
        "whole_blocks_loaded_not_computed": isinstance(d["num_cached_tokens"], int)
        and d["num_cached_tokens"] >= whole * BLOCK_SIZE,
    }
    result = {
        "bench": "vllm-pair", "system": "vllm+flexns", "connector": "NixlConnector",
        "ran": True, "verified": all(checks.values()), "checks": checks,
        "prompt_tokens": PROMPT_LEN, "tokens": d["tokens"], "reference": p["reference"],
        "blocks": blocks, "whole_blocks_compared": len(sent), "kv_bytes": kv_bytes, "moved": m, "moved_bytes": total,
        "prefill_stats": ps["stats"], "num_cached_tokens": d["num_cached_tokens"],
        "start_s": {"prefill": p["start_s"], "decode": d["start_s"]},
        "prefill_s": p["prefill_s"], "decode_s": d["decode_s"], "reference_s": p["reference_s"],
        "wall_s": time.monotonic() - t_all, "logs": logs,
    }
    if result["verified"]:  # the logs are kept (their folder named in the result) only on failure
        shutil.rmtree(work, ignore_errors=True)
        del result["logs"]
    report(args, result)
    return 0 if result["verified"] else 1


def report(args, r):
    if args.json:
        print(json.dumps(r), flush=True)
        return
    if not r["ran"]:
        print(f"vLLM pair did not run: {r['error']}")
        return
    print(f"prompt {r['prompt_tokens']} tokens; prefill's {r['blocks']} KV blocks "
          f"({r['kv_bytes']} B) to decode by vLLM's NixlConnector over flexns")
    print(f"decode tokens    {r['tokens']}")
    print(f"reference tokens {r['reference']} (prefill engine, not disaggregated)")
    print(f"moved by decode's flexns engine: {r['moved']}; the {r['whole_blocks_compared']} whole "
          f"blocks compared byte for byte (SHA-256 of each block, every layer)")
    print(f"engines started in {r['start_s']['prefill']:.0f} s / {r['start_s']['decode']:.0f} s "
          f"(side by side); prefill {r['prefill_s'] * 1e3:.0f} ms, decode {r['decode_s'] * 1e3:.0f} ms;"
          f" wall {r['wall_s']:.0f} s")
    print(f"checks {r['checks']}  verified={r['verified']}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    ap.add_argument("--tokens", type=int, default=8, help="tokens decode generates (>= 1)")
    ap.add_argument("--role", choices=["prefill", "decode"], help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tokens < 1:
        ap.error("--tokens: at least 1")
    if args.role:
        role_main(args.role, args.model_dir, args.tokens)
        return 0
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
