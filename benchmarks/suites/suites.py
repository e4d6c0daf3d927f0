"""The named benchmark suites of ``benchmarks/suites/run.py``: for each, what it measures, where its setting comes
from, and its commands at the headline setting and at the ``--smoke`` setting (smollm2-135m, a few samples/tokens).

A command is a :class:`Cmd`: its argv, the file of the suite folder its stdout goes to (``None``: only to the log),
and the environment variables it sets. Placeholders, filled in by run.py: ``{python}`` (the interpreter running
run.py), ``{vllm_python}`` (the vLLM venv's interpreter), ``{out}`` (the suite folder). Every command runs from the
repository root with the root first on ``PYTHONPATH``, so it runs this checkout's ``diffkv``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

PY, VLLM_PY, OUT = "{python}", "{vllm_python}", "{out}"
DIFFKV = [PY, "-m", "diffkv.cli"]  # the `diffkv` console script, run by this interpreter


class Cmd(NamedTuple):
    argv: list[str]
    stdout: str | None = None  # file name in the suite folder
    env: dict[str, str] = {}


class Suite(NamedTuple):
    about: str  # one line for `run.py list`
    source: str  # where the headline setting is described
    commands: Callable[[bool], list[Cmd]]  # smoke -> the commands, in order


def accuracy_frontier(smoke: bool) -> list[Cmd]:
    """qwen2.5-0.5b with its shipped profile: perplexity (with the x16 / x32 frontier points), GSM8K and the needle;
    every baseline in the same folder, so the eviction ones run at the bytes of `diffkv` (it runs first)."""
    model = "smollm2-135m" if smoke else "qwen2.5-0.5b"
    run = [PY, "-m", "diffkv.eval", "run", "--model", model, "--profile", model, "--out", OUT, "--no-progress"]
    if smoke:
        tasks = [["--task", "ppl", "--methods", "diffkv,full,h2o", "--batch-size", "1", "--ppl-context", "128",
                  "--ppl-continuation", "16", "--ppl-essays", "1"],
                 ["--task", "gsm8k", "--methods", "diffkv,full", "--limit", "2", "--batch-size", "2",
                  "--max-new-tokens", "16"],
                 ["--task", "needle", "--methods", "diffkv,full", "--batch-size", "1", "--needle-lengths", "512",
                  "--needle-depths", "0.5"]]
    else:
        tasks = [["--task", "ppl", "--methods", "diffkv,full,diffkv@x16,diffkv@x32,K4V4,kivi2,h2o,snapkv,streamingllm",
                  "--batch-size", "4", "--ppl-context", "1024", "--ppl-continuation", "128", "--ppl-essays", "4"],
                 ["--task", "gsm8k", "--methods", "diffkv,full,K4V4,kivi2,h2o,snapkv", "--limit", "100",
                  "--batch-size", "5", "--max-new-tokens", "512"],
                 ["--task", "needle", "--methods", "diffkv,full,h2o,snapkv", "--batch-size", "3",
                  "--needle-lengths", "1024,2048", "--needle-depths", "0,0.5,1"]]
    report = [PY, "-m", "diffkv.eval", "report", "--out", OUT]
    return [*(Cmd(run + t) for t in tasks), Cmd(report, stdout="results.md"), Cmd([*report, "--json"], "report.json")]


def memory(smoke: bool) -> list[Cmd]:
    size = ["--quick", "--sizes", "16x8x2"] if smoke else []  # default: 64x30x3 and 256x32x8, 30 rounds
    return [Cmd([*DIFFKV, "bench", "memory", *size, "--json", "--no-progress"], stdout="memory.json")]


def decode(smoke: bool) -> list[Cmd]:
    shape = (["--model", "smollm2-135m", "--context-tokens", "256", "--max-new-tokens", "8"] if smoke else
             ["--model", "qwen2.5-0.5b", "--context-tokens", "4096", "--max-new-tokens", "128"])
    return [Cmd([*DIFFKV, "bench", "decode", *shape, "--threads", "1", "--json", "--no-progress"],
                stdout="decode.json")]


def serve(smoke: bool) -> list[Cmd]:
    load = (["--requests", "4", "--max-new-tokens", "16", "--kv-budget", "12MiB"] if smoke else
            ["--requests", "48", "--max-new-tokens", "256", "--shots", "4", "--kv-budget", "96MiB"])
    return [Cmd([*DIFFKV, "bench", "serve", "--model", "smollm2-135m", *load, "--caches", "fp16,diffkv",
                 "--profile", "smollm2-135m", "--json", "--no-progress"], stdout="serve.json",
                env={"OMP_NUM_THREADS": "1"})]


def vllm(smoke: bool) -> list[Cmd]:
    load = ["--rounds", "1", "--prompts", "2", "--input-len", "32", "--output-len", "8"] if smoke else ["--rounds", "3"]
    return [Cmd([VLLM_PY, "benchmarks/vllm/serve_bench.py", *load, "--out", OUT], env={"DIFFKV_VLLM_ADMIT": "4"})]


def calibration(smoke: bool) -> list[Cmd]:
    size = ["--quick", "--texts", "1", "--context-tokens", "256", "--decode-steps", "8"] if smoke else []
    return [Cmd([*DIFFKV, "calibrate", "--model", "smollm2-135m", "--low", "K4V2", "--per-layer", "--compact-meta",
                 *size, "--out", f"{OUT}/smollm2-135m.json", "--stats-dir", f"{OUT}/stats", "--no-progress"],
                stdout="calibrate.txt", env={"OMP_NUM_THREADS": "1"})]


SUITES: dict[str, Suite] = {
    "accuracy-frontier": Suite(
        "diffkv eval on qwen2.5-0.5b (shipped profile): ppl, GSM8K 100 x 512, needle 1k/2k vs full, K4V4, kivi2, "
        "h2o, snapkv, streamingllm; report + frontier plot (many hours)",
        "benchmarks/accuracy/README.md", accuracy_frontier),
    "memory": Suite("diffkv bench memory: memory manager vs per-head free lists, 64x30x3 and 256x32x8 heads (minutes)",
                    "benchmarks/memory.md", memory),
    "decode": Suite("diffkv bench decode: qwen2.5-0.5b, 4k context, 128 tokens, DiffKV vs DynamicCache speed and bytes "
                    "(tens of minutes)", "benchmarks/results/decode/README.md", decode),
    "serve": Suite("diffkv bench serve: smollm2-135m, 48 4-shot GSM8K requests x 256 tokens, fp16 vs diffkv at 96 MiB "
                   "(~20 min)", "benchmarks/serve/README.md", serve),
    "vllm": Suite("vllm bench serve: vLLM's CPU backend vs the DiffKV plug-in, 64 MB of KV, 3 rounds (vllm venv, "
                  "~11 min)", "benchmarks/vllm/README.md", vllm),
    "calibration": Suite("diffkv calibrate: smollm2-135m full search, per layer, compact_meta (~30 min)",
                         "benchmarks/calibration/README.md", calibration),
}
