"""DiffKV inside vLLM, through the plug-in (issue #19), on smollm2-135m:

* with ``DIFFKV_VLLM_CONFIG=exact`` (one 16-bit tier in the model dtype, nothing pruned) in DiffKV's own pages,
  greedy tokens equal vLLM's default CPU backend;
* with DiffKV's default tiers and the :mod:`diffkv.integrations.vllm.connector`, a stream with aborted requests
  leaves every page of DiffKV's pool free and no request held.

Needs the ``vllm`` extra in its own venv (README, "Inside vLLM": ``pip install -e ".[vllm]"``, which also
registers the ``vllm.general_plugins`` entry point); skipped when vllm is not importable. The models (smollm2-135m,
and qwen2.5-0.5b for TP=2) are pulled through the registry when missing. Each engine runs in a child process
(this file run as a script): vLLM spawns its engine core, and the switch ``DIFFKV_VLLM_BACKEND`` must be in the
environment before it starts. About 1 minute per engine start here.
The store itself is tested without vLLM in tests/test_vllm_store.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

MODEL = "smollm2-135m"
MAX_TOKENS = 32
PROMPTS = ["The capital of France is", "def fibonacci(n):", "The three primary colors are",
           "A list of prime numbers: 2, 3, 5,"]
LONG = "Here is a short story about a lighthouse keeper and a storm. " * 30  # ~390 tokens: several KV blocks
CONNECTOR = {"kv_connector": "DiffKVConnector", "kv_role": "kv_both",
             "kv_connector_module_path": "diffkv.integrations.vllm.connector"}
# no prefix caching (DiffKV pages hold a request's own tokens); whole prompts unless a job turns chunking on
ENGINE = dict(dtype="float32", enforce_eager=True, max_model_len=1024, seed=0, enable_prefix_caching=False,
              enable_chunked_prefill=False)
CHUNKED = dict(ENGINE, enable_chunked_prefill=True, max_num_batched_tokens=128, max_num_seqs=16)


def generate(folder: str) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=folder, **ENGINE)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    first = llm.generate(PROMPTS + [LONG], params)
    again = llm.generate([LONG], params)  # its blocks come back to a new request: the old pages are released
    return {"batch": [list(o.outputs[0].token_ids) for o in first],
            "text": [o.outputs[0].text for o in first],
            "again": list(again[0].outputs[0].token_ids)}


def chunked(folder: str) -> dict:
    """vLLM's chunked prefill with a 128-token step budget: the ~390-token prompt arrives in chunks while the short
    ones decode."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=folder, **CHUNKED)
    outs = llm.generate(PROMPTS + [LONG], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    return {"batch": [list(o.outputs[0].token_ids) for o in outs], "text": [o.outputs[0].text for o in outs]}


def defaults(folder: str) -> dict:
    """vLLM's defaults: prefix caching and chunked prefill on (128-token steps). A long prompt, then two that share
    its first blocks: vLLM's CPU backend reads them from its prefix cache; with DiffKV the connector keeps every
    request off it, so each prompt is computed (and compressed) for its own request."""
    from vllm import LLM, SamplingParams

    from diffkv.integrations.vllm.backend import worker_stats

    connector = CONNECTOR if os.environ.get("DIFFKV_VLLM_BACKEND") else None
    llm = LLM(model=folder, kv_transfer_config=connector, dtype="float32", enforce_eager=True, max_model_len=1024,
              seed=0, max_num_batched_tokens=128, max_num_seqs=16)
    config = llm.llm_engine.vllm_config
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    prompts = [LONG, LONG + " The keeper", LONG[:600] + " Then"]
    outs = [llm.generate([p], params)[0] for p in prompts]  # one at a time: the later two can hit the first's blocks
    stats = llm.collective_rpc(worker_stats)[0] if connector else None
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "text": [o.outputs[0].text for o in outs],
            "cached": [o.num_cached_tokens or 0 for o in outs], "stats": stats,
            "prefix_caching": config.cache_config.enable_prefix_caching,
            "chunked_prefill": config.scheduler_config.enable_chunked_prefill}


def tensor_parallel(folder: str) -> dict:
    """Two ranks (each holds half of the KV heads, and with DiffKV its own pool): greedy tokens and pool stats."""
    from vllm import LLM, SamplingParams

    from diffkv.integrations.vllm.backend import worker_stats

    connector = CONNECTOR if os.environ.get("DIFFKV_VLLM_BACKEND") else None
    llm = LLM(model=folder, tensor_parallel_size=2, kv_transfer_config=connector, **dict(ENGINE, max_model_len=512))
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "stats": llm.collective_rpc(worker_stats)}


def abort_stream(folder: str) -> dict:
    """Six requests; three aborted mid-decode, the others run out; the pool's state at each point."""
    from vllm import LLM, SamplingParams

    from diffkv.integrations.vllm.backend import worker_stats

    llm = LLM(model=folder, kv_transfer_config=CONNECTOR, **ENGINE)
    engine, seen = llm.llm_engine, {}
    for i, prompt in enumerate(PROMPTS + [LONG, LONG[:200]]):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=24 + 8 * i, temperature=0, ignore_eos=True))
    for _ in range(6):
        engine.step()
    seen["running"] = llm.collective_rpc(worker_stats)[0]
    engine.abort_request(["r0", "r2", "r4"])
    for _ in range(3):  # the engine core takes the abort with its next input; the step after reports it ended
        engine.step()
    seen["aborted"] = llm.collective_rpc(worker_stats)[0]
    while engine.has_unfinished_requests():
        engine.step()
    seen["end"] = llm.collective_rpc(worker_stats)[0]
    return seen


def tight_pool(folder: str) -> dict:
    """vLLM told each token costs an 8th of its fp32 bytes (DIFFKV_VLLM_ADMIT=8), over 6 MB of KV: vLLM's blocks
    promise four ~200-token requests at once, DiffKV's pool holds about three. The connector's admission makes the
    second wait for pages; every request completes."""
    from vllm import LLM, SamplingParams

    from diffkv.integrations.vllm.backend import worker_stats

    llm = LLM(model=folder, kv_transfer_config=CONNECTOR if os.environ.get("CONNECT") else None,
              kv_cache_memory_bytes=6_000_000, **dict(ENGINE, max_model_len=512))
    outs = llm.generate([f"{i}. {LONG[:900]}" for i in range(6)],
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    return {"lengths": [len(o.outputs[0].token_ids) for o in outs], "stats": llm.collective_rpc(worker_stats)[0]}


def outgrow(folder: str) -> dict:
    """As tight_pool (DIFFKV_VLLM_ADMIT=16 here), with 300-token answers: running requests outgrow DiffKV's pool
    unless vLLM preempts them, which the connector makes it do by holding back vLLM blocks."""
    from vllm import LLM, SamplingParams

    from diffkv.integrations.vllm.backend import worker_stats

    llm = LLM(model=folder, kv_transfer_config=CONNECTOR if os.environ.get("CONNECT") else None,
              kv_cache_memory_bytes=6_000_000, **dict(ENGINE, max_model_len=512))
    outs = llm.generate([f"{i}. {LONG[:400]}" for i in range(4)],
                        SamplingParams(max_tokens=300, temperature=0, ignore_eos=True))
    return {"lengths": [len(o.outputs[0].token_ids) for o in outs], "stats": llm.collective_rpc(worker_stats)[0]}


EXACT_PEAK = json.dumps({"high": "K16V16", "low": "K16V16", "alpha_high": 0.0, "alpha_low": 0.0,
                         "raw_dtype": "float32", "smooth_keys": False, "importance": "peak"})
QUESTIONS = [" The keeper", " Then the storm", " In the end, the light"]


def shared_prefix(folder: str) -> dict:
    """A ~390-token prefix primed once (DiffKV: stored once, scored by its re-read copy), then three prompts that
    start with it, in one batch (DiffKV: an external hit each, sharing the prefix's pages; vLLM's CPU backend: its
    own prefix cache), with vLLM's defaults on."""
    from vllm import LLM, SamplingParams

    from diffkv.integrations.vllm.backend import worker_stats
    from diffkv.integrations.vllm.prefix_map import BRIDGE, prime_prompt, reader_params

    connector = CONNECTOR if os.environ.get("DIFFKV_VLLM_BACKEND") else None
    llm = LLM(model=folder, kv_transfer_config=connector, dtype="float32", enforce_eager=True, max_model_len=1024,
              seed=0, max_num_batched_tokens=1024, max_num_seqs=16)
    tok = llm.get_tokenizer()
    prefix = tok(LONG).input_ids
    prime, params = prime_prompt(prefix, tok(BRIDGE, add_special_tokens=False).input_ids)
    llm.generate([{"prompt_token_ids": prime}], SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}))
    primed = llm.collective_rpc(worker_stats)[0] if connector else None
    readers = [{"prompt_token_ids": prefix + tok(q, add_special_tokens=False).input_ids} for q in QUESTIONS]
    outs = llm.generate(readers, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                                                extra_args={"kv_transfer_params": reader_params(len(prefix))}))
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "text": [o.outputs[0].text for o in outs],
            "cached": [o.num_cached_tokens or 0 for o in outs], "prefix_tokens": len(prefix), "primed": primed,
            "stats": llm.collective_rpc(worker_stats)[0] if connector else None}


def run_engine(job: str, plugin: dict | None, tmp_path, model: str = MODEL, extra_env=None) -> tuple[dict, str]:
    """Runs ``job`` (generate, defaults, tensor_parallel, ...) in a child process; plugin: the DiffKV environment,
    None = vLLM's default CPU backend."""
    from diffkv.registry.models import model_dir

    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_TARGET_DEVICE="cpu",
               VLLM_CPU_KVCACHE_SPACE="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1")  # collective_rpc(worker_stats)
    for name in ("DIFFKV_VLLM_BACKEND", "DIFFKV_VLLM_CONFIG", "DIFFKV_VLLM_PROFILE", "DIFFKV_VLLM_ADMIT"):
        env.pop(name, None)
    env.update(plugin or {}, **(extra_env or {}))
    out = tmp_path / f"{job}-{'diffkv' if plugin else 'default'}.json"
    proc = subprocess.run([sys.executable, __file__, job, str(model_dir(model)), str(out)], env=env,
                          capture_output=True, text=True, timeout=1200)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    return json.loads(out.read_text()), log


def need_vllm_and_model(model: str = MODEL):
    """Skips without vllm; pulls ``model`` through the registry (as ``diffkv models pull``) if it is not cached, and
    skips with the command to pull it by hand when that fails (no PyPI)."""
    pytest.importorskip("vllm")
    from diffkv.registry.models import model_dir, pull_model

    if not (model_dir(model) / "config.json").is_file():
        try:
            pull_model(model, progress=False)
        except (OSError, RuntimeError, ValueError) as err:
            pytest.skip(f"{model} is not pulled and pulling it failed ({err}); run `diffkv models pull {model}`")


@pytest.mark.vllm
def test_greedy_tokens_in_diffkv_pages_equal_vllm_default_cpu_backend(tmp_path):
    need_vllm_and_model()
    want, base_log = run_engine("generate", None, tmp_path)
    got, plugin_log = run_engine("generate", {"DIFFKV_VLLM_BACKEND": "1", "DIFFKV_VLLM_CONFIG": "exact"}, tmp_path)
    assert "DiffKV pool" in plugin_log and "DiffKV attention backend" not in base_log
    assert [len(t) for t in got["batch"]] == [MAX_TOKENS] * (len(PROMPTS) + 1)
    assert got["batch"] == want["batch"], list(zip(want["text"], got["text"], strict=True))
    assert got["again"] == want["again"] == want["batch"][-1]


@pytest.mark.vllm
def test_chunked_prefill_gives_vllm_default_cpu_backend_tokens(tmp_path):
    """A prompt longer than max_num_batched_tokens: its later chunks go through KVStore.extend."""
    need_vllm_and_model()
    want, _ = run_engine("chunked", None, tmp_path)
    got, log = run_engine("chunked", {"DIFFKV_VLLM_BACKEND": "1", "DIFFKV_VLLM_CONFIG": "exact"}, tmp_path)
    assert "DiffKV pool" in log
    assert got["batch"] == want["batch"], list(zip(want["text"], got["text"], strict=True))


@pytest.mark.vllm
def test_vllm_defaults_prefix_caching_and_chunked_prefill_give_vllm_tokens(tmp_path):
    """Issue #45 item 3 in its first form: vLLM with its defaults (prefix caching, chunked prefill) and the DiffKV
    connector gives the default CPU backend's greedy tokens, while that backend reads shared blocks from its cache."""
    need_vllm_and_model()
    want, _ = run_engine("defaults", None, tmp_path)
    got, log = run_engine("defaults", {"DIFFKV_VLLM_BACKEND": "1", "DIFFKV_VLLM_CONFIG": "exact"}, tmp_path)
    assert "DiffKV pool" in log and want["prefix_caching"] and got["prefix_caching"] and got["chunked_prefill"]
    assert want["cached"][1] > 0 and got["cached"] == [0, 0, 0]  # vLLM's hit; DiffKV computed every prompt
    assert got["tokens"] == want["tokens"], list(zip(want["text"], got["text"], strict=True))
    assert got["stats"]["requests"] == 0 and got["stats"]["free_pages"] == got["stats"]["pages"]


@pytest.mark.vllm
def test_a_primed_prefix_is_shared_by_its_readers_and_gives_vllm_tokens(tmp_path):
    """Issue #45 inside vLLM: the prefix is computed once (the readers' prefix tokens are external hits) and held
    once; with one 16-bit tier and nothing pruned the readers' greedy tokens equal vLLM's CPU backend's."""
    need_vllm_and_model()
    want, _ = run_engine("shared_prefix", None, tmp_path)
    got, log = run_engine("shared_prefix", {"DIFFKV_VLLM_BACKEND": "1", "DIFFKV_VLLM_CONFIG": EXACT_PEAK}, tmp_path)
    assert "DiffKV pool" in log and "diffkv_prime ignored" not in log and "diffkv_prefix=" not in log
    n = got["prefix_tokens"]
    assert got["cached"] == [n] * len(QUESTIONS) and want["cached"][0] > 0  # vLLM computed no prefix token
    assert got["tokens"] == want["tokens"], list(zip(want["text"], got["text"], strict=True))
    primed, end = got["primed"], got["stats"]
    assert primed["prefixes"] == end["prefixes"] == 1 and end["requests"] == 0
    assert end["free_pages"] == primed["free_pages"] < primed["pages"]  # the prefix stays held, nothing else


@pytest.mark.vllm
def test_tensor_parallel_ranks_keep_their_own_heads_and_give_vllm_tokens(tmp_path):
    """qwen2.5-0.5b (2 KV heads; smollm2's 9 query heads do not split in two), TP=2 over gloo, one core per rank
    (vLLM's automatic binding wants a NUMA node per rank)."""
    model, bind = "qwen2.5-0.5b", {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    need_vllm_and_model(model)
    want, _ = run_engine("tensor_parallel", None, tmp_path, model, bind)
    got, _ = run_engine("tensor_parallel", {"DIFFKV_VLLM_BACKEND": "1", "DIFFKV_VLLM_CONFIG": "exact"}, tmp_path,
                        model, bind)
    assert got["tokens"] == want["tokens"]
    assert len(got["stats"]) == 2 and all(s["pages"] == s["free_pages"] for s in got["stats"])


@pytest.mark.vllm
def test_an_aborted_stream_leaves_the_diffkv_pool_full(tmp_path):
    need_vllm_and_model()
    seen, log = run_engine("abort_stream", {"DIFFKV_VLLM_BACKEND": "1"}, tmp_path)
    assert "DiffKVConnector" in log
    running, aborted, end = seen["running"], seen["aborted"], seen["end"]
    assert running["requests"] == 6 and running["free_pages"] < running["pages"]
    assert aborted["requests"] == 3 and running["free_pages"] < aborted["free_pages"] < aborted["pages"]
    assert end["requests"] == 0 and end["free_pages"] == end["pages"]
    assert running["tokens_high"] > 0


@pytest.mark.vllm
def test_prompts_wait_for_diffkv_pages_when_vllm_promises_more(tmp_path):
    need_vllm_and_model()
    seen, log = run_engine("tight_pool", {"DIFFKV_VLLM_BACKEND": "1", "DIFFKV_VLLM_ADMIT": "8", "CONNECT": "1"},
                           tmp_path)
    assert "admission 8" in log
    assert seen["lengths"] == [MAX_TOKENS] * 6
    assert seen["stats"]["requests"] == 0 and seen["stats"]["free_pages"] == seen["stats"]["pages"]


@pytest.mark.vllm
def test_requests_that_outgrow_the_pool_are_preempted_by_vllm(tmp_path):
    need_vllm_and_model()
    seen, _ = run_engine("outgrow", {"DIFFKV_VLLM_BACKEND": "1", "DIFFKV_VLLM_ADMIT": "16", "CONNECT": "1"}, tmp_path)
    assert seen["lengths"] == [300] * 4
    assert seen["stats"]["requests"] == 0 and seen["stats"]["free_pages"] == seen["stats"]["pages"]


if __name__ == "__main__":
    jobs = {"generate": generate, "chunked": chunked, "defaults": defaults, "tensor_parallel": tensor_parallel,
            "abort_stream": abort_stream, "tight_pool": tight_pool, "outgrow": outgrow, "shared_prefix": shared_prefix}
    result = jobs[sys.argv[1]](sys.argv[2])
    with open(sys.argv[3], "w", encoding="utf-8") as f:
        json.dump(result, f)
