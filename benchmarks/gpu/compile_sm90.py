"""Compile every recorded Triton launch for an H200 (sm_90a) on a machine without a GPU.

The CPU tests run the kernels under ``TRITON_INTERPRET=1``, which checks their results but not that they compile:
the interpreter accepts code the NVIDIA backend rejects (``tl.dot`` shapes, dtype mixes, shared memory beyond the
SM's). This tool takes the launches a test run recorded (``DIFFKV_RECORD_LAUNCHES=file pytest ...``, see
tests/conftest.py) and compiles each distinct one with Triton's real NVIDIA backend and its bundled ``ptxas``, then
reports shared memory, registers and spills per kernel. Nothing runs on a device, so numerical results are not
checked here (the interpreter tests do that).

    DIFFKV_RECORD_LAUNCHES=/tmp/launches.jsonl python -m pytest -q tests/test_kernel_*.py tests/test_memory_kernel.py
    python benchmarks/gpu/compile_sm90.py /tmp/launches.jsonl --out benchmarks/gpu/compile_sm90

What the CUDA launchers choose differently from the CPU ones is applied to each launch (``CUDA_ONLY``); the split
count, which follows the SM count on a GPU, is whatever the tests used (1 and 3). Exit status 1 if any launch fails
to compile or needs more shared memory than an H200 SM offers.
"""

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHARED_LIMIT = 227 * 1024  # bytes of shared memory one block may use on sm_90 (H100 / H200)
CUDA_ONLY = {  # kernel -> launch options the CUDA launcher sets instead of the CPU one
    "paged_decode_split_kernel": {"PRECISION": "tf32x3"},
    "paged_decode_streams_kernel": {"ASM": True},  # inline PTX unpack (the interpreter runs Triton ops)
    "row_stats_kernel": {"PRECISION": "tf32x3"},
    "column_scores_kernel": {"PRECISION": "tf32x3"},
    "place_store_kernel": {"enable_fp_fusion": False},
    "store_kernel": {"enable_fp_fusion": False},
}


class CompileOnlyDriver:
    """The part of a Triton driver that ``JITFunction.run`` consults before a launch: enough to compile."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target


def distinct_launches(path: Path) -> list[dict]:
    seen, out = set(), []
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        key = json.dumps(entry, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(entry)
    return out


def build_arguments(entry: dict, torch, overrides: dict | None = None):
    """Positional and keyword arguments of one recorded launch: small CPU tensors of the recorded dtypes.
    overrides: launch keywords to set on every launch (``--set num_warps=8``)."""
    def value(spec):
        if "tensor" in spec:
            return torch.zeros(64, dtype=getattr(torch, spec["tensor"]))
        return spec["value"]
    name = entry["kernel"].split(":")[1]
    kwargs = {k: value(v) for k, v in entry["kwargs"].items()}
    for k, v in {**CUDA_ONLY.get(name, {}), **(overrides or {})}.items():
        kwargs[k] = v
    return [value(a) for a in entry["args"]], kwargs


def ptxas_usage(ptxas: str, ptx: str, arch: str) -> dict:
    """Registers, spill bytes and static shared memory that ``ptxas -v`` reports for one PTX module."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "k.ptx")
        src.write_text(ptx)
        proc = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", str(src), "-o", str(Path(tmp, "k.cubin"))],
                              capture_output=True, text=True, check=True)
    log = proc.stdout + proc.stderr
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", log)]
    spills = [int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)]
    return {"registers": max(regs, default=0), "spill_bytes": sum(spills)}


def compile_all(launches: list[dict], capability: int, overrides: dict | None = None) -> list[dict]:
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.runtime.driver import driver

    driver.set_active(CompileOnlyDriver(GPUTarget("cuda", capability, 32)))
    ptxas, arch = get_ptxas(capability).path, f"sm_{capability}a"
    rows = []
    for i, entry in enumerate(launches):
        module, name = entry["kernel"].split(":")
        kernel = getattr(importlib.import_module(module), name)
        args, kwargs = build_arguments(entry, torch, overrides)
        row = {"kernel": name, "launch": i, "constexprs": {k: v["value"] for k, v in entry["kwargs"].items()
                                                            if k.isupper() and "value" in v}}
        start = time.perf_counter()
        try:
            compiled = kernel.warmup(*args, grid=(1,), **kwargs)
            row.update(ok=True, shared_bytes=int(compiled.metadata.shared), num_warps=compiled.metadata.num_warps,
                       **ptxas_usage(ptxas, compiled.asm["ptx"], arch))
            row["ok"] = row["shared_bytes"] <= SHARED_LIMIT
        except Exception as err:  # noqa: BLE001 - every failure is reported, then the exit status says so
            text = str(err) if len(str(err)) < 1500 else f"{str(err)[:500]} ... {str(err)[-900:]}"
            row.update(ok=False, error=f"{type(err).__name__}: {text}")
        row["seconds"] = round(time.perf_counter() - start, 2)
        rows.append(row)
        status = "ok" if row["ok"] else "FAILED"
        print(f"[{i + 1}/{len(launches)}] {name} {status} {row.get('error', '')[:200]}", file=sys.stderr)
    return rows


SHAPE_KEYS = ("D", "G", "GP", "NUM_SPLITS", "BLOCK_W", "BLOCK_L", "BLOCK_N", "KB_HI", "VB_HI", "KB_LO", "VB_LO")


def summary_table(rows: list[dict], header: str = "") -> str:
    lines = ([header, ""] if header else []) + [
        "| kernel | launches compiled | failed | max shared KiB | max registers | spill bytes (max) |",
        "|---|---|---|---|---|---|"]
    for name in sorted({r["kernel"] for r in rows}):
        mine = [r for r in rows if r["kernel"] == name]
        good = [r for r in mine if "registers" in r]
        lines.append(f"| {name} | {len(good)} | {sum(not r['ok'] for r in mine)} | "
                     f"{max((r['shared_bytes'] for r in good), default=0) / 1024:.1f} | "
                     f"{max((r['registers'] for r in good), default=0)} | "
                     f"{max((r['spill_bytes'] for r in good), default=0)} |")
    spills = [r for r in rows if r.get("spill_bytes")]
    if spills:
        lines += ["", "Launches that spill registers (constexprs that set the tile shapes):", ""]
        lines += [f"- {r['kernel']}: {r['spill_bytes']} bytes, "
                  + ", ".join(f"{k}={r['constexprs'][k]}" for k in SHAPE_KEYS if k in r["constexprs"]) for r in spills]
    failed = [r for r in rows if not r["ok"]]
    lines += ["", f"Failed: {len(failed)}"]
    lines += [f"- {r['kernel']} (launch {r['launch']}): {r.get('error', 'shared memory over the limit')[:300]}"
              for r in failed]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("launches", type=Path, help="JSON lines written by a DIFFKV_RECORD_LAUNCHES test run")
    parser.add_argument("--capability", type=int, default=90, help="compute capability (90: H100 / H200)")
    parser.add_argument("--out", type=Path, help="write <out>.json (every launch) and <out>.md (per kernel)")
    parser.add_argument("--kernels", nargs="+", help="only these kernels (names as in the table)")
    parser.add_argument("--set", dest="overrides", nargs="+", default=[], metavar="NAME=VALUE",
                        help="launch keyword for every launch, e.g. num_warps=8 (a what-if: registers, spills)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: this compiles for the GPU, it does not interpret")
    import triton

    overrides = {}
    for item in args.overrides:
        name, _, value = item.partition("=")
        try:
            overrides[name] = json.loads(value)
        except json.JSONDecodeError:
            overrides[name] = value
    launches = [e for e in distinct_launches(args.launches)
                if not args.kernels or e["kernel"].split(":")[1] in args.kernels]
    rows = compile_all(launches, args.capability, overrides)
    command = " ".join(["python benchmarks/gpu/compile_sm90.py", *(sys.argv[1:] if argv is None else argv)])
    header = (f"Triton {triton.__version__} compiled {len(rows)} distinct recorded launches for sm_{args.capability}a "
              f"on {time.strftime('%Y-%m-%d', time.gmtime())}, no GPU (`{command}`)")
    table = summary_table(rows, header)
    print(table)
    if args.out:
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(table + "\n")
    return 0 if rows and all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
