"""One side (prefill or decode) of a disaggregated vLLM pair, run by vLLM's own code over flexns.

Started by ``test_vllm_connectors.py`` as ``python vllm_roles.py CONNECTOR ROLE WORKDIR``, with
``FLEXNS_AS_NIXL=force`` and ``FLEXNS_AS_MOONCAKE=force`` in the environment so that vLLM's
``import nixl`` / ``import mooncake`` resolve to flexns. Nothing here moves KV-cache bytes: the
process builds a real ``VllmConfig`` for a tiny model config written on the fly, a real
``KVCacheConfig`` (``get_kv_cache_configs``) and the KV-cache tensors the CPU worker allocates
(``allocate_kv_cache``), creates the connector in the WORKER role the way a vLLM worker does
(``ensure_kv_transfer_initialized``), registers the caches, and runs vLLM's real ``Scheduler``
(which creates the connector in the SCHEDULER role) step by step; each step's connector work is
vLLM's own ``KVConnectorModelRunnerMixin`` lifecycle (bind metadata, ``start_load_kv``,
``wait_for_save``, ``get_finished``). Only the model's forward pass is replaced: prefill writes
random bytes into the blocks the scheduler gave its requests, as the attention layers would.

Protocol (one JSON object a line on stdout after ``MARK``; other lines are logs):

- prefill prints ``{"params": {req_id: kv_transfer_params}, "blocks": FILE}`` once its requests
  finished (FILE: an ``.npz`` of each request's blocks, every layer, as they stand in its cache),
  then ``{"freed": [...], "free_blocks_before": n, "free_blocks_after": m}`` once the decode
  side has read them and the scheduler freed them (or its deadline passed);
- decode reads that first line on stdin, runs the requests, and prints
  ``{"recved": [...], "blocks": FILE, "untouched_ok": bool}`` (FILE as above, from its cache).
"""

import json
import os
import socket
import sys
import time

import numpy as np

MODEL_CONFIG = {
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
NUM_BLOCKS = 64
# request id -> prompt length (tokens): a partial last block, exactly whole blocks, one block
PROMPTS = {"req-a": 100, "req-b": 64, "req-c": 17}
DEADLINE_S = float(os.environ.get("FLEXNS_VLLM_DEADLINE_S", "120"))
MARK = "@vllm-role@ "  # protocol lines start with this; uvicorn (the Mooncake bootstrap server) logs
# its requests to stdout too
SENTINEL = 0x5A  # decode's cache starts filled with this: blocks nobody read into keep it


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def emit(obj):
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def patch_for_cpu(connector):
    """The one monkeypatch (docs/VLLM.md lists it): MooncakeConnectorWorker.__init__
    (mooncake_connector.py:1186 in vLLM 0.32) asks ``torch.accelerator.current_device_index()``,
    which on a machine without an accelerator raises (CUDA torch without a driver: "Found no
    NVIDIA driver on your system"; CPU torch: "Cannot access accelerator device when none is
    available"). There is no device index to ask for here; the value only goes to
    ``current_platform.set_device``, which on the CPU platform is ``torch.cpu.set_device``, a
    no-op. NixlConnector needs no patch."""
    import torch

    if connector == "MooncakeConnector" and not torch.accelerator.is_available():
        torch.accelerator.current_device_index = lambda: 0


def build(connector, role, workdir):
    """The real configuration objects and the worker-side connector, as a vLLM CPU worker has
    them after ``initialize_from_config``."""
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed.kv_transfer.kv_transfer_state import (
        ensure_kv_transfer_initialized,
        get_kv_transfer_group,
    )
    from vllm.distributed.parallel_state import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.utils import allocate_kv_cache

    patch_for_cpu(connector)
    model_dir = os.path.join(workdir, "tiny-llama")
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(MODEL_CONFIG, f)
    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32", seed=0,
                        max_model_len=512)
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=512,
                            is_encoder_decoder=False)
    cache = CacheConfig(block_size=BLOCK_SIZE, cache_dtype="auto", enable_prefix_caching=False)
    kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    # the connectors' defaults, unchanged: NixlConnector's "UCX" backend, MooncakeConnector's
    # "rdma" protocol (flexns runs it when FLEXNS_RDMA_AS=flexns, which the test sets)
    kvt = KVTransferConfig(kv_connector=connector, kv_role=kv_role, kv_buffer_device="cpu",
                           engine_id=f"{role}-engine")
    vc = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache,
                    kv_transfer_config=kvt, device_config=DeviceConfig("cpu"))

    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        ensure_model_parallel_initialized(1, 1)
        layers = {f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=MODEL_CONFIG["num_key_value_heads"],
            head_size=MODEL_CONFIG["head_dim"], dtype=torch.float32)
            for i in range(MODEL_CONFIG["num_hidden_layers"])}
        # what EngineCore does: resolve one layout from the workers' backends, then size the cache
        backends = get_current_attn_backends(vc)
        resolve_kv_cache_layout(vc, [[lay.name for lay in get_supported_kv_cache_layouts(backends)]],
                                list(layers.values()))
        page = next(iter(layers.values())).page_size_bytes
        (kv_cache_config,) = get_kv_cache_configs(vc, [layers], [page * NUM_BLOCKS * len(layers)])
        vc.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
        kv_caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"),
                                      vc.cache_config.get_resolved_kv_cache_layout())
        if role == "decode":
            for t in kv_caches.values():
                t.view(torch.uint8).fill_(SENTINEL)
        ensure_kv_transfer_initialized(vc, kv_cache_config)
        worker = get_kv_transfer_group()
        worker.register_kv_caches(kv_caches)
    return vc, kv_cache_config, kv_caches, worker


def flexns_engine(worker):
    """The transfer engine vLLM's connector created: (its class's module, its stack counters)."""
    cw = worker.connector_worker
    engine = cw.nixl_wrapper if hasattr(cw, "nixl_wrapper") else cw.engine
    module = type(engine).__module__
    inner = getattr(engine, "engine", engine)  # flexns.nixl's agent owns a TransferEngine
    stats = inner.stack_stats() if hasattr(inner, "stack_stats") else None
    return module, stats


def make_scheduler(vc, kv_cache_config, worker):
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    s = Scheduler(vllm_config=vc, kv_cache_config=kv_cache_config,
                  structured_output_manager=StructuredOutputManager(vc),
                  block_size=BLOCK_SIZE, log_stats=False)
    meta = worker.get_handshake_metadata()
    if meta is not None:  # what EngineCore does with its workers' handshake metadata
        s.get_kv_connector().set_xfer_handshake_metadata_pp_aware({(0, 0): meta})
    return s


def make_request(req_id, n_tokens, kv_transfer_params, max_tokens):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sp.update_from_generation_config({}, None)
    seed = sum(map(ord, req_id))
    prompt = [(seed * 7 + i * 13) % MODEL_CONFIG["vocab_size"] for i in range(n_tokens)]
    req = Request(request_id=req_id, prompt_token_ids=prompt, sampling_params=sp,
                  pooling_params=None, block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))
    req.kv_transfer_params = kv_transfer_params
    return req


def block_bytes(kv_caches, block_ids):
    """Each layer's bytes of ``block_ids``, in that order: [layer][i] -> the i-th block's page."""
    out = {}
    for name in sorted(kv_caches):
        t = kv_caches[name]
        out[name] = np.stack([t[b].contiguous().view(-1).view(dtype=__import__("torch").uint8)
                              .numpy().copy() for b in block_ids])
    return out


def step(scheduler, vc, forward=None):
    """One engine step: schedule, the connector's worker lifecycle around the (replaced)
    forward pass, and the scheduler's update; returns the engine outputs."""
    from vllm.forward_context import set_forward_context
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    so = scheduler.schedule()
    if so.total_num_scheduled_tokens == 0:
        out = KVConnectorModelRunnerMixin.kv_connector_no_forward(so, vc)
    else:
        req_ids = [r.req_id for r in so.scheduled_new_reqs] + list(so.scheduled_cached_reqs.req_ids)
        with set_forward_context(None, vc), \
                KVConnectorModelRunnerMixin.maybe_get_kv_connector_output(so) as kv_out:
            if forward is not None:
                forward(so)
        out = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=[[7] for _ in req_ids], logprobs=None,
                                prompt_logprobs_dict={}, pooler_output=[],
                                kv_connector_output=kv_out)
    return so, out, scheduler.update_from_output(so, out)


def run_prefill(connector, workdir):
    import torch

    vc, kcc, kv_caches, worker = build(connector, "prefill", workdir)
    scheduler = make_scheduler(vc, kcc, worker)
    free_before = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    gen = torch.Generator().manual_seed(1234)

    written = {}  # request -> the blocks its prefill wrote, as the scheduler allocated them

    def forward(so):  # what the attention layers do: write K and V of the scheduled tokens
        for r in so.scheduled_new_reqs:
            written[r.req_id] = list(r.block_ids[0])
            for t in kv_caches.values():
                for b in r.block_ids[0]:
                    page = t[b].view(torch.uint8)
                    page.copy_(torch.randint(0, 256, page.shape, dtype=torch.uint8, generator=gen))

    bootstrap = f"http://127.0.0.1:{os.environ.get('VLLM_MOONCAKE_BOOTSTRAP_PORT', '8998')}"
    for rid, n in PROMPTS.items():
        if connector == "MooncakeConnector":
            # what vLLM's Mooncake proxy sends the prefill instance: a transfer id it also gives
            # the decode instance
            kvp = {"do_remote_decode": True, "transfer_id": f"xfer-{rid}"}
        else:
            kvp = {"do_remote_decode": True}
        scheduler.add_request(make_request(rid, n, kvp, max_tokens=1))
    params, finished, blocks = {}, set(), {}
    deadline = time.monotonic() + DEADLINE_S
    while len(finished) < len(PROMPTS) and time.monotonic() < deadline:
        _, _, outs = step(scheduler, vc, forward)
        for eco in outs.values():
            for o in eco.outputs:
                if o.finished:
                    finished.add(o.request_id)
                    if o.kv_transfer_params:  # NixlConnector: what the proxy passes to decode
                        params[o.request_id] = o.kv_transfer_params
                        assert o.kv_transfer_params["remote_block_ids"][0] == written[o.request_id]
                    elif connector == "MooncakeConnector":  # the proxy's decode-side params
                        params[o.request_id] = {
                            "do_remote_prefill": True, "remote_engine_id": vc.kv_transfer_config.engine_id,
                            "remote_bootstrap_addr": bootstrap, "transfer_id": f"xfer-{o.request_id}"}
    for rid in params:
        for name, arr in block_bytes(kv_caches, written[rid]).items():
            blocks[f"{rid}/{name}"] = arr
    path = os.path.join(workdir, f"prefill-{connector}.npz")
    np.savez(path, **blocks)
    emit({"params": params, "blocks": path, "written": written})

    freed = set()
    while time.monotonic() < deadline and len(freed) < len(params):
        _, out, _ = step(scheduler, vc)
        kvo = out.kv_connector_output
        if kvo and kvo.finished_sending:
            freed |= set(kvo.finished_sending)
        time.sleep(0.01)
    for _ in range(2):  # the step after finished_sending frees the blocks
        step(scheduler, vc)
    module, stats = flexns_engine(worker)
    emit({"freed": sorted(freed), "free_blocks_before": free_before,
          "free_blocks_after": scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
          "engine_module": module, "stats": stats})
    worker.shutdown()
    scheduler.shutdown()


def run_decode(connector, workdir):
    vc, kcc, kv_caches, worker = build(connector, "decode", workdir)
    scheduler = make_scheduler(vc, kcc, worker)
    line = sys.stdin.readline()
    if not line:
        raise SystemExit("decode: no kv_transfer_params on stdin (the prefill side failed)")
    first = json.loads(line[len(MARK):] if line.startswith(MARK) else line)
    params = first["params"]
    n_blocks = {rid: len(ids) for rid, ids in first["written"].items()}
    for rid, n in PROMPTS.items():
        if rid in params:
            scheduler.add_request(make_request(rid, n, params[rid], max_tokens=2))
    local = {}
    recved = set()
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline and len(recved) < len(params):
        so, out, _ = step(scheduler, vc)
        kvo = out.kv_connector_output
        if kvo and kvo.finished_recving:
            recved |= set(kvo.finished_recving)
        for rid in params:
            if rid not in local and rid in scheduler.requests:
                ids = scheduler.kv_cache_manager.get_block_ids(rid)[0]
                if ids:
                    local[rid] = list(ids)
        time.sleep(0.01)
    blocks = {}
    used = set()
    for rid, ids in local.items():
        n_remote = n_blocks[rid]
        used |= set(ids[:n_remote])
        for name, arr in block_bytes(kv_caches, ids[:n_remote]).items():
            blocks[f"{rid}/{name}"] = arr
    others = [b for b in range(kcc.num_blocks) if b not in used]
    untouched = all((arr == SENTINEL).all() for arr in block_bytes(kv_caches, others).values())
    path = os.path.join(workdir, f"decode-{connector}.npz")
    np.savez(path, **blocks)
    module, stats = flexns_engine(worker)
    emit({"recved": sorted(recved), "blocks": path, "untouched_ok": bool(untouched),
          "local_block_ids": local, "engine_module": module, "stats": stats})
    worker.shutdown()
    scheduler.shutdown()


def main():
    connector, role, workdir = sys.argv[1:4]
    if role == "prefill":
        run_prefill(connector, workdir)
    elif role == "decode":
        run_decode(connector, workdir)
    else:
        raise SystemExit(f"role: expected prefill or decode, got {role!r}")


if __name__ == "__main__":
    main()
