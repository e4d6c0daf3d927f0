"""Wall time of `diffkv eval run` through the engine vs the fixed-batch generate() path, side by side in one run.

    .venv/bin/python benchmarks/accuracy/engine_vs_fixed.py --limit 100 --max-new-tokens 512 --method full

Each path runs in its own process, one after the other (engine first), on the same samples and settings, into
``benchmarks/accuracy/engine-eval/<runner>/`` (fresh: existing runs there are overwritten). Writes
``benchmarks/accuracy/engine_vs_fixed_batch.json``: wall seconds and peak RSS of each process, accuracy, and the
per-sample comparison of the two paths (identical outputs, correctness flips) plus, when it exists, of the run
recorded under ``--recorded``. ``--only generate`` (or ``engine``) reruns one path and keeps the other's recorded
result (same settings only), e.g. when a run was disturbed by other load on the machine.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def phase(args) -> None:
    """One path in this process: prints a JSON line with its wall time and peak RSS."""
    from diffkv.eval.runner import RunConfig, run_eval
    from diffkv.registry.models import load_model

    model, tok = load_model(args.model)
    cfg = RunConfig(model=args.model, task="gsm8k", method=args.method, out=str(HERE / "engine-eval" / args.phase),
                    limit=args.limit, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                    profile=args.profile, runner=args.phase, max_batch=args.max_batch)
    start = time.perf_counter()
    metrics = run_eval(cfg, model, tok, overwrite=True, progress=False)
    print(json.dumps({"seconds": round(time.perf_counter() - start, 1), "accuracy": metrics["accuracy"],
                      "mean_new_tokens": metrics["mean_new_tokens"],
                      "compression_physical": metrics["compression_physical"],
                      "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                      "run_dir": str(cfg.run_dir().relative_to(HERE))}))


def outputs(path: Path) -> dict[str, dict]:
    rows = [json.loads(line) for line in (path / "samples.jsonl").read_text().splitlines()]
    return {r["id"]: r for r in rows}


def compare(a: dict[str, dict], b: dict[str, dict]) -> dict:
    common = [i for i in a if i in b]
    differ = [i for i in common if a[i]["output"] != b[i]["output"]]
    flips = [i for i in common if bool(a[i]["correct"]) != bool(b[i]["correct"])]
    return {"n_common": len(common), "identical_outputs": len(common) - len(differ), "outputs_differ": differ,
            "correctness_flips": flips}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--method", default="full")
    p.add_argument("--profile", default=None)
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=5, help="fixed batches of the generate path (as recorded)")
    p.add_argument("--max-batch", type=int, default=32, help="most samples decoding at once on the engine")
    p.add_argument("--recorded", default=str(HERE / "gen512"), help="an earlier --out of the same run to compare")
    p.add_argument("--only", choices=["engine", "generate"], help="run one path, keep the other's recorded result")
    p.add_argument("--phase", choices=["engine", "generate"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.phase:
        phase(args)
        return 0
    settings = {k: v for k, v in vars(args).items() if k not in ("phase", "only")}
    record = HERE / "engine_vs_fixed_batch.json"
    old = json.loads(record.read_text()) if args.only and record.is_file() else {}
    own = {"engine": "max_batch", "generate": "batch_size"}  # a path's own setting may change when it reruns
    same = {k: v for k, v in settings.items() if k != own.get(args.only)}
    if args.only and {k: v for k, v in old.get("settings", {}).items() if k != own[args.only]} != same:
        raise SystemExit(f"--only needs a record of the same settings in {record}")
    result = {"settings": settings, "commands": {**old.get("commands", {})}}
    if args.only:
        result["earlier"] = old.get("earlier", []) + [{k: old[k] for k in ("settings", args.only) if k in old}]
    for runner in ("engine", "generate"):
        if args.only and runner != args.only:
            result[runner] = old[runner]
            continue
        argv = [a for i, a in enumerate(sys.argv[1:]) if a != "--only" and (i == 0 or sys.argv[i] != "--only")]
        out = subprocess.run([sys.executable, __file__, *argv, "--phase", runner], check=True,
                             capture_output=True, text=True).stdout
        result[runner] = json.loads(out.strip().splitlines()[-1])
        result["commands"][runner] = "python benchmarks/accuracy/" + Path(__file__).name + " " + " ".join(sys.argv[1:])
        print(runner, result[runner], flush=True)
    engine, fixed = (outputs(HERE / result[r]["run_dir"]) for r in ("engine", "generate"))
    result["engine_vs_fixed_batch"] = round(result["generate"]["seconds"] / result["engine"]["seconds"], 2)
    result["engine_vs_generate_samples"] = compare(engine, fixed)
    recorded = Path(args.recorded) / args.model / "gsm8k" / args.method
    if (recorded / "samples.jsonl").is_file():
        result["recorded_run"] = str(recorded.relative_to(HERE) if recorded.is_relative_to(HERE) else recorded)
        result["engine_vs_recorded_samples"] = compare(engine, outputs(recorded))
        result["generate_vs_recorded_samples"] = compare(fixed, outputs(recorded))
    (HERE / "engine_vs_fixed_batch.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("engine_vs_fixed_batch", "engine_vs_generate_samples")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
