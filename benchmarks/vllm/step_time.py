"""vLLM decode step time at equal running requests: DiffKV plug-in vs vLLM's own CPU backend (issue #32).

Run in the vllm venv (README, "Inside vLLM"):
    python benchmarks/vllm/step_time.py [--requests 16] [--prompt-tokens 256] [--steps 48] [--rounds 3]
        [--profile]   # also a cProfile of DiffKV's decode steps (top functions by own time)
Each round starts one engine per backend in its own process, vLLM's CPU_ATTN first, then DiffKV's (same seed, same
random prompt token ids, fp32, smollm2-135m, ``enforce_eager``, no prefix caching or chunked prefill, KV memory
large enough for every request). It adds all requests, steps the engine until every prompt is in (prefill steps),
then times ``steps`` engine steps in which all ``requests`` requests decode (``ignore_eos``; the engine core runs
in the timing process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the median step time per backend, the fewest and most
requests a timed step returned, and the peak RSS of the engine process. Writes ``results.jsonl`` (one line per
engine run) and ``summary.json`` (median over rounds of the per-round ratio DiffKV / CPU_ATTN) under ``--out``
(default ``benchmarks/vllm/results/step_time-<UTC time>/``, ignored by git).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(folder: str, backend: str, args: argparse.Namespace) -> dict:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=folder, dtype="float32", enforce_eager=True, max_model_len=args.prompt_tokens + args.steps + 128,
              seed=0, enable_prefix_caching=False, enable_chunked_prefill=False, kv_cache_memory_bytes=1_000_000_000,
              max_num_seqs=args.requests, max_num_batched_tokens=max(1024, args.prompt_tokens))
    engine = llm.llm_engine
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 20000, (args.requests, args.prompt_tokens), generator=gen).tolist()
    params = SamplingParams(max_tokens=args.steps + 96, temperature=0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=ids), params)
    produced = {}

    def step() -> int:
        outs = engine.step()
        for out in outs:
            produced[out.request_id] = len(out.outputs[0].token_ids)
        return len(outs)

    while len(produced) < args.requests or min(produced.values()) < 2:  # every prompt in and decoding
        step()
    profiler = None
    if args.profile and backend == "diffkv":
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    times, running = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        running.append(step())
        times.append(time.perf_counter() - t0)
    if profiler is not None:
        import io
        import pstats
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        Path(args.out, f"profile-{backend}.txt").write_text(text.getvalue())
    for i in range(args.requests):
        engine.abort_request([str(i)])
    return {"backend": backend, "requests_running": [min(running), max(running)], "steps": len(times),
            "step_ms_median": round(1000 * statistics.median(times), 2),
            "step_ms_min": round(1000 * min(times), 2), "step_ms_max": round(1000 * max(times), 2),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--child", nargs=2, metavar=("FOLDER", "BACKEND"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(*args.child, args)), flush=True)
        return
    sys.path.insert(0, str(HERE.parents[1]))
    from diffkv.registry.models import model_dir

    out = Path(args.out or HERE / "results" / time.strftime("step_time-%Y%m%dT%H%M%SZ", time.gmtime()))
    out.mkdir(parents=True, exist_ok=True)
    # the engine core in this process: the step times (and --profile) see the model and the attention
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_TARGET_DEVICE="cpu",
               VLLM_ENABLE_V1_MULTIPROCESSING="0")
    rows, ratios = [], []
    for r in range(args.rounds):
        per = {}
        for backend in ("default", "diffkv"):
            env.pop("DIFFKV_VLLM_BACKEND", None)
            if backend == "diffkv":
                env["DIFFKV_VLLM_BACKEND"] = "1"
            cmd = [sys.executable, __file__, "--child", str(model_dir("smollm2-135m")), backend, "--out", str(out)]
            cmd += [f"--requests={args.requests}", f"--prompt-tokens={args.prompt_tokens}", f"--steps={args.steps}"]
            cmd += ["--profile"] if args.profile else []
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"{backend} engine failed:\n{proc.stderr[-4000:]}")
            row = json.loads(next(s for s in proc.stdout.splitlines() if s.startswith("RESULT "))[7:])
            row.update(round=r, load_1min=round(os.getloadavg()[0], 1))
            rows.append(row)
            per[backend] = row
            print(json.dumps(row), flush=True)
        ratios.append(per["diffkv"]["step_ms_median"] / per["default"]["step_ms_median"])
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"command": "python benchmarks/vllm/step_time.py " + " ".join(sys.argv[1:]),
               "requests": args.requests, "prompt_tokens": args.prompt_tokens, "steps": args.steps,
               "diffkv_over_cpu_attn_step": round(statistics.median(ratios), 3),
               "per_round": [round(x, 3) for x in ratios]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
