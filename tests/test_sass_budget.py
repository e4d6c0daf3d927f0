"""CPU gates on the GPU decode kernel (#59 item 4): the streams kernel compiled for an H200 (sm_90a) with Triton's
NVIDIA backend, its page loop counted in SASS (``benchmarks/gpu/sass_budget.py``; no GPU needed).

What holds today is asserted; the issue's instruction and register targets that the pure-Triton kernel does not
reach yet are strict xfails, so that meeting one turns the test red until the mark goes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia.compiler")

ROOT = Path(__file__).resolve().parents[1]
SHARED_LIMIT = 227 * 1024
TIERS = ("K8V4", "K4V2")


def _measure(tmp: Path, *args: str) -> list[dict]:
    """Rows of ``sass_budget.py`` run in its own process: the suite runs Triton under its interpreter, this compiles."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp / f"rows{len(list(tmp.iterdir()))}.json"
    proc = subprocess.run([sys.executable, "benchmarks/gpu/sass_budget.py", "--json", str(out), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """Both tiers at head_dim 64/128/256 with the launcher's warps, and the old split kernel at 128."""
    tmp = tmp_path_factory.mktemp("sass")
    new = _measure(tmp, "--kernels", "streams")
    old = _measure(tmp, "--kernels", "split", "--head-dims", "128")
    bf16 = _measure(tmp, "--kernels", "streams", "--head-dims", "128", "--query", "bfloat16")
    return {**{(r["head_dim"], r["tier"]): r for r in new}, **{("split", r["tier"]): r for r in old},
            **{("bf16", r["tier"]): r for r in bf16}}


def test_no_spills_and_shared_memory_within_an_h200_block(rows):
    for key in [(d, t) for d in (64, 128, 256) for t in TIERS]:
        r = rows[key]
        assert r["loop_body"] > 100, f"{key}: no page loop found in the SASS"
        assert r["spill_bytes"] == 0 and r["shared_bytes"] <= SHARED_LIMIT, (key, r)


def test_integer_codes_go_to_fp16_tensor_cores_and_the_meta_is_one_word(rows):
    for t in TIERS:
        r = rows[(128, t)]
        assert r["hmma"] > 0 and r["ldg_u16"] == 0, r  # HMMA.16816 fp16, no replicated 2-byte scale/zero loads
        assert rows[("split", t)]["ldg_u16"] > 0  # the old kernel's (GPU_DECODE.md §1)


def test_at_most_a_third_of_the_old_kernels_instructions_per_page(rows):
    """Measured 1.2k vs 6.2k (high) and 1.8k vs 15.2k (low) warp-instructions per page at head_dim 128."""
    for t in TIERS:
        new, old = rows[(128, t)]["warp_instructions_per_page"], rows[("split", t)]["warp_instructions_per_page"]
        assert new <= old / 3, (t, new, old)


def test_issue_budget_2000_warp_instructions_per_page_at_head_dim_128(rows):
    """#59 item 4: 1,223 high / 1,826 low at one warp, with the inline-PTX unpack and fp16 probabilities; bf16
    queries (in the fp16 dots times a power of two) 1,240 / 1,836."""
    assert all(rows[(128, t)]["warp_instructions_per_page"] <= 2000 for t in TIERS)
    assert all(rows[("bf16", t)]["warp_instructions_per_page"] <= 2000 for t in TIERS)


@pytest.mark.xfail(strict=True, reason="#59 target not met: 225-255 registers at the launchers' warps (one warp at "
                                       "head_dim 64/128: a [16, 64] fp16 code tile per stream is live); 0 spills")
def test_issue_budget_200_registers(rows):
    assert all(rows[(d, t)]["registers"] <= 200 for d in (64, 128, 256) for t in TIERS)
