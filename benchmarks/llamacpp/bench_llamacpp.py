"""llama.cpp anchor for `diffkv bench decode`: greedy decode speed and KV bytes with llama.cpp's quantized KV cache.

Run with the llama-cpp-python venv (NOT the diffkv venv), one thread, low priority:

    # the whole matrix, each configuration in a fresh child process, written to results.json:
    OMP_NUM_THREADS=1 nice -n 10 ~/.cache/diffkv-llamacpp-venv/bin/python benchmarks/llamacpp/bench_llamacpp.py all

    # one configuration (prints one JSON record):
    OMP_NUM_THREADS=1 nice -n 10 ~/.cache/diffkv-llamacpp-venv/bin/python benchmarks/llamacpp/bench_llamacpp.py run \
        --model qwen2.5-0.5b --gguf ~/.cache/diffkv-llamacpp/gguf/qwen2.5-coder-0.5b-instruct.Q4_K_M.gguf \
        --prompt benchmarks/llamacpp/prompt_qwen2.5-0.5b_4096.json --kv q8_0

The prompt is the exact token id list of ``diffkv.prompts.essay_tokens(tokenizer, n)`` (written by
dump_prompt.py), fed to llama.cpp as ids (no BOS, no chat template), as ``diffkv bench decode`` prefills it.
Method: prefill the prompt (``Llama.eval``, n_batch 512), then ``--new-tokens`` greedy steps, each one
``eval([token])`` + argmax over the last logits; only those steps are timed, wall (perf_counter) and CPU
(process_time). The decode is repeated ``--repeats`` times from the same prefilled prompt (the cache is cut back to
the prompt between repeats) and the median repeat is reported, with all repeats listed (the machines are noisy).
``--no-attn-rot`` sets ``LLAMA_ATTN_ROT_DISABLE=1``: llama.cpp then skips the Walsh-Hadamard rotation it applies
to a quantized K/V cache by default (``attn_rot_k/v = 1`` in its log). KV bytes: both what llama.cpp logs at
context creation and the formula ``n_ctx * n_layer * n_kv_heads * head_dim`` x bytes per value (f16 2,
q8_0 34/32, q4_0 18/32) for K plus V.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GGUF_DIR = Path.home() / ".cache" / "diffkv-llamacpp" / "gguf"
GGUF = {"qwen2.5-0.5b": "qwen2.5-coder-0.5b-instruct.Q4_K_M.gguf", "smollm2-135m": "SmolLM2-135M-Instruct.Q4_1.gguf"}
BYTES_PER_VALUE = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
MiB = 1024 * 1024


def _proc_status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(rest.split()[0]) * 1024
    return out


class _CaptureFd2:
    """Copy everything written to file descriptor 2 (C code and Python's stderr) into a string, and echo it."""

    def __enter__(self):
        sys.stderr.flush()
        self.tmp = tempfile.TemporaryFile(mode="w+b")
        self.saved = os.dup(2)
        os.dup2(self.tmp.fileno(), 2)
        return self

    def __exit__(self, *exc):
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.tmp.seek(0)
        self.text = self.tmp.read().decode(errors="replace")
        self.tmp.close()
        sys.stderr.write(self.text)
        return False


def _parse_kv_log(text: str) -> dict:
    """KV numbers from llama.cpp's context-creation log (format of llama.cpp 2025-26: `llama_kv_cache: ...`)."""
    out: dict = {}
    m = re.search(r"llama_kv_cache[^\n]*?size\s*=\s*([\d.]+)\s*MiB\s*\(\s*(\d+) cells,\s*(\d+) layers[^)]*\),\s*"
                  r"K \((\w+)\):\s*([\d.]+)\s*MiB,\s*V \((\w+)\):\s*([\d.]+)\s*MiB", text)
    if m:
        out.update(kv_log_total_mib=float(m[1]), kv_log_cells=int(m[2]), kv_log_layers=int(m[3]),
                   kv_log_k_type=m[4], kv_log_k_mib=float(m[5]), kv_log_v_type=m[6], kv_log_v_mib=float(m[7]))
    m = re.search(r"CPU KV buffer size\s*=\s*([\d.]+)\s*MiB", text)
    if m:
        out["kv_log_buffer_mib"] = float(m[1])
    m = re.search(r"flash_attn\s*=\s*(\w+)", text)
    if m:
        out["flash_attn_log"] = m[1]
    return out


def run_one(args) -> dict:
    import llama_cpp
    import numpy as np

    ggml_type = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}
    prompt = json.loads(Path(args.prompt).read_text())
    ids: list[int] = prompt["ids"]
    n_ctx = len(ids) + args.new_tokens + args.slack
    rss_start = _proc_status()
    if args.no_attn_rot:
        os.environ["LLAMA_ATTN_ROT_DISABLE"] = "1"
    kwargs = dict(model_path=str(args.gguf), n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=args.threads,
                  n_threads_batch=args.threads, type_k=ggml_type[args.kv], type_v=ggml_type[args.kv],
                  flash_attn=args.flash_attn, logits_all=False, verbose=True, seed=0)
    with _CaptureFd2() as cap:
        llm = llama_cpp.Llama(**kwargs)
    kv_log = _parse_kv_log(cap.text)
    meta = llm.metadata
    arch = meta["general.architecture"]
    n_layer = int(meta[f"{arch}.block_count"])
    n_head = int(meta[f"{arch}.attention.head_count"])
    n_kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", n_head))
    head_dim = int(meta.get(f"{arch}.attention.key_length", int(meta[f"{arch}.embedding_length"]) // n_head))
    n_ctx_real = llm.n_ctx()
    kv_formula = int(round(2 * n_ctx_real * n_layer * n_kv_heads * head_dim * BYTES_PER_VALUE[args.kv]))
    n_vocab = llm.n_vocab()
    ctx = llm.ctx

    def last_argmax() -> int:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
        return int(np.argmax(logits))

    t0, c0 = time.perf_counter(), time.process_time()
    llm.eval(ids)
    prefill_wall, prefill_cpu = time.perf_counter() - t0, time.process_time() - c0
    first = last_argmax()

    def decode() -> tuple[float, float, list[int]]:
        llm.n_tokens = len(ids)  # the next eval() cuts the cache back to the prompt
        nxt, tokens, wall, cpu = first, [first], 0.0, 0.0
        for _ in range(args.new_tokens):
            t0, c0 = time.perf_counter(), time.process_time()
            llm.eval([nxt])
            nxt = last_argmax()
            wall += time.perf_counter() - t0
            cpu += time.process_time() - c0
            tokens.append(nxt)
        return wall, cpu, tokens

    reps = [decode() for _ in range(args.repeats)]
    tokens = reps[0][2]
    walls, cpus = [r[0] for r in reps], [r[1] for r in reps]
    wall, cpu = sorted(walls)[len(walls) // 2], sorted(cpus)[len(cpus) // 2]
    rss_end = _proc_status()
    return {
        "model": args.model,
        "gguf": Path(args.gguf).name,
        "prompt_tokens": len(ids),
        "new_tokens": args.new_tokens,
        "kv_type": args.kv,
        "flash_attn": args.flash_attn,
        "n_threads": args.threads,
        "n_ctx": n_ctx_real,
        "decode_tokens_per_s": round(args.new_tokens / wall, 3),
        "decode_tokens_per_cpu_s": round(args.new_tokens / cpu, 3),
        "decode_wall_s": round(wall, 3),
        "decode_cpu_s": round(cpu, 3),
        "decode_repeats": args.repeats,
        "decode_tokens_per_s_each": [round(args.new_tokens / w, 3) for w in walls],
        "decode_tokens_per_cpu_s_each": [round(args.new_tokens / c, 3) for c in cpus],
        "repeats_same_tokens": all(r[2] == tokens for r in reps),
        "prefill_wall_s": round(prefill_wall, 2),
        "prefill_cpu_s": round(prefill_cpu, 2),
        "prefill_tokens_per_s": round(len(ids) / prefill_wall, 2),
        "kv_bytes_formula": kv_formula,
        "kv_bytes_formula_note": f"2 (K,V) x n_ctx {n_ctx_real} x {n_layer} layers x {n_kv_heads} kv heads x "
                                 f"head_dim {head_dim} x {BYTES_PER_VALUE[args.kv]} B/value",
        **kv_log,
        "attn_rot_disabled_env": args.no_attn_rot,
        "kv_attn_rot": {k: int(v) for k, v in re.findall(r"attn_rot_([kv]) = (\d)", cap.text)},
        "kv_bytes_log": int(round(kv_log["kv_log_total_mib"] * MiB)) if "kv_log_total_mib" in kv_log else None,
        "rss_bytes": rss_end["VmRSS"],
        "rss_peak_bytes": rss_end["VmHWM"],
        "rss_anon_bytes": rss_end["RssAnon"],
        "rss_file_bytes": rss_end["RssFile"],
        "rss_before_load_bytes": rss_start["VmRSS"],
        "generated_ids": tokens,
        "llama_cpp_python": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
        "date": dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "command": "OMP_NUM_THREADS=1 nice -n 10 " + shlex.join([sys.executable, *sys.argv]),
    }


def _key(r: dict) -> tuple:
    return r["model"], r["prompt_tokens"], r["kv_type"], r["flash_attn"], r.get("attn_rot_disabled_env", False)


def run_all(args) -> int:
    py = sys.executable
    plan = [(m, n) for m, sizes in (("qwen2.5-0.5b", args.qwen_sizes), ("smollm2-135m", args.smollm_sizes))
            for n in sizes]
    configs = [(m, n, kv, True) for m, n in plan for kv in args.kv_types]
    if args.f16_no_fa:  # extras last, so the core matrix is done first
        configs += [(m, n, "f16", False) for m, n in plan]
    out = Path(args.out)
    records = json.loads(out.read_text()) if out.exists() else []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for model, n, kv, fa in configs:
        prompt = HERE / f"prompt_{model}_{n}.json"
        cmd = [py, str(Path(__file__).resolve()), "run", "--model", model, "--gguf", str(GGUF_DIR / GGUF[model]),
               "--prompt", str(prompt), "--kv", kv, "--new-tokens", str(args.new_tokens),
               "--repeats", str(args.repeats)]
        if not fa:
            cmd.append("--no-flash-attn")
        if args.no_attn_rot:
            cmd.append("--no-attn-rot")
        print(f"== {model} n={n} kv={kv} flash_attn={fa} attn_rot_disabled={args.no_attn_rot}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            print(f"   FAILED (exit {proc.returncode})", flush=True)
            continue
        rec = json.loads(proc.stdout)
        rec["process_wall_s"] = round(time.perf_counter() - t0, 1)
        records = [r for r in records if _key(r) != _key(rec)]
        records.append(rec)
        records.sort(key=lambda r: (r["model"], r["prompt_tokens"], not r["flash_attn"],
                                    r.get("attn_rot_disabled_env", False), list(BYTES_PER_VALUE).index(r["kv_type"])))
        out.write_text(json.dumps(records, indent=1) + "\n")
        print(f"   {rec['decode_tokens_per_s']} tok/s, {rec['decode_tokens_per_cpu_s']} tok/CPU-s, "
              f"KV {rec['kv_bytes_formula'] / MiB:.2f} MiB (log {rec.get('kv_log_total_mib')}), "
              f"RSS {rec['rss_bytes'] / MiB:.0f} MiB, prefill {rec['prefill_wall_s']} s, "
              f"process {rec['process_wall_s']} s", flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one configuration; prints one JSON record")
    r.add_argument("--model", required=True)
    r.add_argument("--gguf", required=True)
    r.add_argument("--prompt", required=True)
    r.add_argument("--kv", choices=list(BYTES_PER_VALUE), required=True)
    r.add_argument("--new-tokens", type=int, default=128)
    r.add_argument("--slack", type=int, default=128)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--repeats", type=int, default=3, help="decode repeats from the same prefill; median reported")
    r.add_argument("--no-flash-attn", dest="flash_attn", action="store_false")
    r.add_argument("--no-attn-rot", action="store_true", help="LLAMA_ATTN_ROT_DISABLE=1 (no Hadamard rotation)")
    a = sub.add_parser("all", help="the matrix, one child process per configuration, into --out")
    a.add_argument("--qwen-sizes", nargs="*", type=int, default=[4096])
    a.add_argument("--smollm-sizes", nargs="*", type=int, default=[4096])
    a.add_argument("--kv-types", nargs="*", default=list(BYTES_PER_VALUE))
    a.add_argument("--f16-no-fa", action="store_true", help="also f16, flash attention off (llama-cpp-python default)")
    a.add_argument("--new-tokens", type=int, default=128)
    a.add_argument("--repeats", type=int, default=3)
    a.add_argument("--no-attn-rot", action="store_true", help="pass --no-attn-rot to every run")
    a.add_argument("--out", default=str(HERE / "results.json"))
    args = p.parse_args()
    if args.cmd == "run":
        print(json.dumps(run_one(args)))
        return 0
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
