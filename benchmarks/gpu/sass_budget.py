"""Instruction budget of the decode attention kernels on an H200 (sm_90a), counted on a machine without a GPU.

Each kernel is compiled with Triton's NVIDIA backend and its bundled ptxas (as ``compile_sm90.py`` does), the cubin
is disassembled with the bundled ``nvdisasm``, and the page loop is found as the largest backward branch: its body
runs once per page in every warp, so ``body instructions x num_warps`` is what one page costs the SM's schedulers
(warp-instructions per page). To attribute a loop to a tier, both tiers of a launch get the same format (the kernel
walks one tier per program, so the two page loops are then the same code). Also reported: registers, spill bytes
and shared memory per launch (ptxas ``-v``).

At ~4.5 TB/s of HBM one SM must finish a 6.3 kB page in ~340 cycles: ~1.35k warp-instructions over its four
schedulers. The CI gate (tests/test_sass_budget.py) asks <= 2,000 per page at head_dim 128 for both tiers, 0 spills
and <= 200 registers at head_dim 64/128/256.

    python benchmarks/gpu/sass_budget.py                  # streams and split kernels, d 64/128/256, both tiers
    python benchmarks/gpu/sass_budget.py --json out.json --kernels streams
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compile_sm90 import CompileOnlyDriver, ptxas_usage  # noqa: E402

TIERS = {"K8V4": (8, 4), "K4V2": (4, 2)}


def _launch(kernel: str, d: int, tier: str, g: int, tokens: int, num_warps: int, query: str, asm: bool = True):
    """(jit function, args, kwargs) of one decode split launch, both tiers in format ``tier``."""
    import torch

    kb, vb = TIERS[tier]
    block = max(16, 1 << (tokens - 1).bit_length())
    z = torch.zeros(64)
    common = dict(q_ptr=torch.zeros(64, dtype=getattr(torch, query)), pool_ptr=torch.zeros(64, dtype=torch.uint8),
                  rows_ptr=torch.zeros(64, dtype=torch.int32), items_ptr=torch.zeros(64, dtype=torch.int64),
                  nh_ptr=torch.zeros(64, dtype=torch.int32), nl_ptr=torch.zeros(64, dtype=torch.int32), lg_ptr=z,
                  m_ptr=z, l_ptr=z, acc_ptr=z, stride_qb=4096, stride_qh=128, num_kv_heads=8, width=2048,
                  page_bytes=6304, m_hi=4096, m_total=8192, qk_scale=0.1, hk_off=0, hkm_off=4096, hv_off=4224,
                  hvm_off=6272, lk_off=0, lkm_off=4096, lv_off=4224, lvm_off=6272, G=g, GP=16, D=d,
                  N_HI=tokens, BN_HI=block, KB_HI=kb, VB_HI=vb, N_LO=tokens, BN_LO=block, KB_LO=kb, VB_LO=vb,
                  META_KIND=0, K_FIELDS=2, STORE_LOGITS=True, num_warps=num_warps)
    if kernel == "streams":
        from diffkv.kernels.paged_decode_streams import paged_decode_streams_kernel as fn
        extra = dict(S_HI=1, S_LO=1, Q_KIND={"float16": 0, "bfloat16": 1, "float32": 2}[query], ASM=asm)
    else:
        from diffkv.kernels.paged_attention import paged_decode_split_kernel as fn
        extra = dict(NUM_SPLITS=2, KG_HI=1, VG_HI=1, KG_LO=1, VG_LO=1, RAW_KIND=0, PRECISION="tf32x3")
    return fn, {**common, **extra}


def page_loop(sass: str) -> list[str]:
    """Instructions of the largest loop (the page loop) in disassembled SASS (nvdisasm): from a branch target to
    the backward branch that returns to it."""
    lines, labels, best = [], {}, (0, 0)
    for line in sass.splitlines():
        if m := re.match(r"^\s*(\.L_x_\d+):", line):
            labels[m.group(1)] = len(lines)
        elif re.search(r"/\*[0-9a-f]{4,}\*/", line):
            lines.append(re.sub(r"^\s*/\*[0-9a-f]+\*/\s*", "", line).split(";")[0])
            m = re.search(r"\bBRA\b.*?(\.L_x_\d+)", line)
            if m and labels.get(m.group(1), len(lines)) < len(lines) - 1:
                start = labels[m.group(1)]
                best = max(best, (len(lines) - start, start), key=lambda x: x[0])
    return lines[best[1]:best[1] + best[0]]


def measure(kernel: str, d: int, tier: str, g: int = 4, tokens: int = 30, num_warps: int = 4,
            query: str = "float16", asm: bool = True) -> dict:
    """Registers, spills, shared memory and page-loop instructions of one launch compiled for sm_90a."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.runtime.driver import driver

    driver.set_active(CompileOnlyDriver(GPUTarget("cuda", 90, 32)))
    fn, kwargs = _launch(kernel, d, tier, g, tokens, num_warps, query, asm)
    compiled = fn.warmup(grid=(1,), **kwargs)
    usage = ptxas_usage(get_ptxas(90).path, compiled.asm["ptx"], "sm_90a")
    nvdisasm = Path(get_ptxas(90).path).with_name("nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp, "k.cubin")
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    body = page_loop(sass)

    def count(op: str) -> int:
        return sum(op in line for line in body)

    return {"kernel": kernel, "head_dim": d, "tier": tier, "G": g, "tokens_per_page": tokens, "num_warps": num_warps,
            "query": query, "asm": asm and kernel == "streams", **usage, "shared_bytes": int(compiled.metadata.shared),
            "loop_body": len(body),
            "warp_instructions_per_page": len(body) * num_warps, "hmma": count("HMMA"), "ldg_u16": count("LDG.E.U16"),
            "i2f": count("I2F"), "tf32_mma": count(".TF32")}


def default_warps(kernel: str, head_dim: int, query: str) -> int:
    """Warps per program the launcher uses (``diffkv.ops.paged_attention_streams.streams_warps``; split: 4)."""
    import torch

    from diffkv.ops.paged_attention_streams import streams_warps

    return streams_warps(head_dim, getattr(torch, query)) if kernel == "streams" else 4


PAGE_TOKENS = {64: {"K8V4": 32, "K4V2": 56}, 128: {"K8V4": 30, "K4V2": 56}, 256: {"K8V4": 29, "K4V2": 56}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", nargs="+", default=["streams", "split"], choices=["streams", "split"])
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128, 256])
    parser.add_argument("--num-warps", nargs="+", type=int, help="default: the launchers' (streams: streams_warps)")
    parser.add_argument("--query", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--no-asm", action="store_true", help="streams: unpack codes in Triton ops, not inline PTX")
    parser.add_argument("--json", type=Path, help="write every row here")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: this compiles for the GPU")
    rows = [measure(k, d, t, tokens=PAGE_TOKENS.get(d, PAGE_TOKENS[128])[t], num_warps=w, query=args.query,
                    asm=not args.no_asm)
            for k in args.kernels for d in args.head_dims for t in TIERS
            for w in (args.num_warps or [default_warps(k, d, args.query)])]
    print("| kernel | head_dim | tier | warps | registers | spill B | shared KiB | loop body | warp-instr/page |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kernel']} | {r['head_dim']} | {r['tier']} | {r['num_warps']} | {r['registers']} | "
              f"{r['spill_bytes']} | {r['shared_bytes'] / 1024:.1f} | {r['loop_body']} | "
              f"{r['warp_instructions_per_page']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
