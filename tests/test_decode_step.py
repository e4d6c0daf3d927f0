"""The decode step's backends against the torch reference, step by step from identical states (random inputs).

The compiled CPU step and the Triton kernels (interpreter) must store bit-identical K/V bytes, metadata and
positions, take the same placements (counts and tables), and match the reference's attention output and score update
within float rounding.
"""

import copy

import pytest
import torch

from diffkv import DiffKVConfig
from diffkv.cache.compressor import LayerCompressor
from diffkv.cache.paged_kv import PagedKV
from diffkv.core.layout import plan_for_config
from diffkv.memory import HIGH_COL, LOW_COL, HeadTables, PagePool
from diffkv.ops import decode_cpu
from diffkv.ops.decode_step import resolve_backend

AGGRESSIVE = dict(alpha_high=2.0, alpha_low=0.6, recent_window=4, score_window=4)  # every case of §4.4 fires
PEAKY = dict(AGGRESSIVE, alpha_high=6.0, alpha_low=2.0)  # peaks run above means: thresholds where every case fires


def build(cfg: DiffKVConfig, batch: int, hkv: int, head_dim: int, max_len: int = 512, backend: str = "cpu"):
    plan = plan_for_config(cfg, head_dim)
    pool = PagePool(plan.page_bytes, num_pages=batch * hkv * (max_len // 4 + 4))
    tables = HeadTables.for_config(cfg, plan, batch, 1, hkv, max_len)
    kv = PagedKV(pool, tables, plan, cfg)
    return LayerCompressor(kv, 0, [tables.acquire_slot() for _ in range(batch)], hkv, attention_backend=backend)


def prefill(comp, lengths, group: int, gen: torch.Generator, scale: float = 1.0):
    b, h, d = len(lengths), comp.num_kv_heads, comp.kv.layouts[HIGH_COL].head_dim
    total = max(lengths)
    q = torch.randn(b, h * group, total, d, generator=gen)
    k = torch.randn(b, h, total, d, generator=gen) * scale + torch.randn(d, generator=gen)  # an offset per channel
    v = torch.randn(b, h, total, d, generator=gen)
    valid = torch.arange(total)[None, :] >= total - torch.tensor(lengths)[:, None]  # left padding
    comp.prefill(q, k, v, valid, d ** -0.5)


def score_mask(kv) -> torch.Tensor:
    """bool [num_pages, page_bytes]: True on the bytes of score fields (any tier)."""
    mask = torch.zeros(kv.pool.data.shape, dtype=torch.bool)
    for lay in kv.layouts.values():
        mask[:, lay.score_offset:lay.score_offset + lay.score_bytes * lay.tokens_per_page] = True
    return mask


def scores(kv, comp):
    """Scores of each item's tokens, high then low: list of fp32 [n] per tier."""
    out = []
    for tier in (HIGH_COL, LOW_COL):
        n = comp.kv.tables.tokens_flat[comp.items, tier].long()
        position = comp.position.repeat_interleave(comp.num_kv_heads)
        s, _, valid = kv.read_meta(tier, comp.items, n, max(int(n.max()), 1), position)
        out.append(s[valid])
    return torch.cat(out)


def step_both(comp, group: int, gen: torch.Generator, scale: float = 1.0):
    """One decode step on the compressor (its backend) and on a copy with the torch backend; compare them."""
    b, h, d = len(comp.slots), comp.num_kv_heads, comp.kv.layouts[HIGH_COL].head_dim
    q = torch.randn(b, h * group, d, generator=gen)
    k = torch.randn(b, h, d, generator=gen) * scale
    v = torch.randn(b, h, d, generator=gen)
    ref = copy.deepcopy(comp)
    ref.backend = "torch"
    before = comp.kv.tables.tokens_flat[comp.items].clone()
    got = comp.decode(q, k, v, d ** -0.5)
    want = ref.decode(q, k, v, d ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(comp.kv.tables.counts, ref.kv.tables.counts)
    assert torch.equal(comp.kv.tables.table, ref.kv.tables.table)
    mask = score_mask(comp.kv)
    assert torch.equal(comp.kv.pool.data[~mask], ref.kv.pool.data[~mask]), "stored K/V, metadata or positions differ"
    rtol = 2e-3 if comp.kv.compact else 1e-5  # compact: fp16 means, one rounding of slightly different gains
    torch.testing.assert_close(scores(comp.kv, comp), scores(ref.kv, ref), atol=1e-5, rtol=rtol)
    after = comp.kv.tables.tokens_flat[comp.items]
    return (after[:, 0] == before[:, 0]).sum().item(), (after[:, 1] > before[:, 1]).sum().item()


@pytest.mark.parametrize("group,head_dim,hkv", [(1, 64, 2), (3, 128, 2), (7, 64, 2), (2, 256, 1), (4, 40, 3)])
def test_cpu_step_matches_reference_over_many_steps(group, head_dim, hkv):
    gen = torch.Generator().manual_seed(group * 1000 + head_dim)
    comp = build(DiffKVConfig(**AGGRESSIVE), 2, hkv, head_dim)
    prefill(comp, [37, 22], group, gen)
    replaced = demoted = 0
    for _ in range(30):
        r, dm = step_both(comp, group, gen)
        replaced, demoted = replaced + r, demoted + dm
    assert replaced > 0 and demoted > 0, "the steps never pruned or demoted: the comparison is too weak"


@pytest.mark.parametrize("cfg", [
    DiffKVConfig(high="K8V4", low="K8V4", **AGGRESSIVE),  # one tier
    DiffKVConfig(high="K4V2-g32/16", low="K2V2-g16/16", **AGGRESSIVE),
    DiffKVConfig(high="K16V16", low="K4V4", raw_dtype="bfloat16", meta_dtype="bfloat16", **AGGRESSIVE),
    DiffKVConfig(high="K16V8", low="K8V4", raw_dtype="float32", meta_dtype="float32", **AGGRESSIVE),
    DiffKVConfig(alpha_high=0.0, alpha_low=0.0, recent_window=4, score_window=4),  # empty low tier, nothing pruned
    DiffKVConfig(center_keys=True, **AGGRESSIVE),
    DiffKVConfig(smooth_keys=True, high="K8V4", low="K4V2-g16/16", **AGGRESSIVE),
    DiffKVConfig(score_after_window=True, **AGGRESSIVE),  # scores restart at age 4 (short prompts: in the window)
    DiffKVConfig(compact_meta=True, **AGGRESSIVE),  # fp16 mean scores, int16 positions
    DiffKVConfig(compact_meta=True, score_after_window=True, high="K8V4", low="K8V4", **AGGRESSIVE),
    DiffKVConfig(symmetric_keys=True, compact_meta=True, smooth_keys=True, **AGGRESSIVE),  # scale-only keys
    DiffKVConfig(symmetric_keys=True, high="K8V4-g32/32", low="K4V2-g16/32", meta_dtype="bfloat16", **AGGRESSIVE),
    DiffKVConfig(importance="peak", **PEAKY),  # fp32 peak scores
    DiffKVConfig(importance="peak", compact_meta=True, score_after_window=True, **PEAKY),  # fp16 peaks
    DiffKVConfig(importance="peak", high="K8V4", low="K8V4", **PEAKY),  # one tier
    DiffKVConfig(high="K4V4", low="K3V2", **AGGRESSIVE),  # 3-bit keys demoted from 4-bit ones
    DiffKVConfig(high="K3V4-g32/64", low="K2V3-g16/32", compact_meta=True, **AGGRESSIVE),  # keys below values
    DiffKVConfig(score_pool=5, compact_meta=True, **AGGRESSIVE),  # pooled prefill scores
    DiffKVConfig(rotate_values=True, compact_meta=True, **AGGRESSIVE),  # rotated values
], ids=["one-tier", "groups", "raw-bf16", "raw-fp32", "empty-low", "center-keys", "smooth-keys", "after-window",
        "compact", "compact-after-window-one-tier", "symmetric-keys-compact", "symmetric-keys-groups-bf16",
        "peak", "peak-compact-after-window", "peak-one-tier", "three-bit", "keys-below-values", "score-pool",
        "rotate-values"])
def test_cpu_step_matches_reference_for_tier_formats(cfg):
    gen = torch.Generator().manual_seed(7)
    comp = build(cfg, 3, 2, 64)
    prefill(comp, [29, 5, 18], 2, gen, scale=3.0)
    for _ in range(20):
        step_both(comp, 2, gen, scale=3.0)


@pytest.mark.parametrize("cfg", [
    DiffKVConfig(compact_meta=True, score_after_window=True, **AGGRESSIVE),
    DiffKVConfig(symmetric_keys=True, high="K8V4-g32/32", low="K4V2-g16/32", meta_dtype="bfloat16", **AGGRESSIVE),
    DiffKVConfig(symmetric_keys=True, compact_meta=True, smooth_keys=True, **AGGRESSIVE),
    DiffKVConfig(importance="peak", compact_meta=True, score_after_window=True, **dict(PEAKY, alpha_high=30.0)),
    DiffKVConfig(high="K3V4-g32/64", low="K2V3-g16/32", symmetric_keys=True, **AGGRESSIVE),
    DiffKVConfig(score_pool=3, compact_meta=True, **AGGRESSIVE),
    DiffKVConfig(rotate_values=True, low="K4V3", **AGGRESSIVE),
], ids=["compact-after-window", "symmetric-keys-groups-bf16", "symmetric-keys-compact", "peak-compact-after-window",
        "three-bit-keys-below-values", "score-pool", "rotate-values"])
def test_triton_step_matches_reference_for_lean_metadata(cfg):
    """The Triton backend (interpreter) on compact fields and scale-only keys: few steps, odd shapes."""
    gen = torch.Generator().manual_seed(5)
    comp = build(cfg, 2, 1, 64, backend="triton")
    prefill(comp, [13, 6], 3, gen, scale=3.0)
    moved = [step_both(comp, 3, gen, scale=3.0) for _ in range(3)]
    assert all(map(any, zip(*moved, strict=True))), f"never pruned or demoted: {moved}"


def test_cpu_step_refuses_without_reserved_pages_and_changes_nothing():
    gen = torch.Generator().manual_seed(3)
    comp = build(DiffKVConfig(alpha_high=0.0, alpha_low=0.0, recent_window=4, score_window=4), 1, 2, 64)
    full = 2 * comp.kv.layouts[HIGH_COL].tokens_per_page
    prefill(comp, [full], 1, gen)  # every token high: both high pages full after the trim
    kv = comp.kv
    before = (kv.pool.data.clone(), kv.tables.counts.clone())
    q, k, v = torch.randn(1, 2, 64), torch.randn(1, 2, 64), torch.randn(1, 2, 64)
    with pytest.raises(ValueError, match="reserve"):
        comp.decode(q, k, v, 0.125, reserved=True)
    assert torch.equal(kv.pool.data, before[0]) and torch.equal(kv.tables.counts, before[1])
    with pytest.raises(ValueError, match="not finite"):
        comp.decode(q, k * float("inf"), v, 0.125)
    with pytest.raises(ValueError, match="overflow"):  # fp16 zeros cannot hold -1e6: refused before any write
        comp.decode(q, k.abs() * -1e6, v, 0.125)
    assert torch.equal(kv.tables.counts[:2], before[1][:2])  # no token moved (the reserve took its pages)
    comp.decode(q, k, v, 0.125)  # appends into the reserved page
    assert kv.tables.tokens_flat[comp.items, HIGH_COL].tolist() == [full + 1] * 2


def test_backend_choice_is_checked_when_built(monkeypatch):
    assert resolve_backend("auto", "cpu") == "cpu"
    monkeypatch.setattr(decode_cpu, "available", lambda: False)  # no compiler: auto falls back to the reference
    assert resolve_backend("auto", "cpu") == "torch"
    with pytest.raises(ValueError, match="must be one of"):
        resolve_backend("cuda", "cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="CUDA device"):
        resolve_backend("triton", "cpu")
    monkeypatch.setattr(decode_cpu, "library", lambda: (_ for _ in ()).throw(decode_cpu.CompileError("no cc")))
    with pytest.raises(ValueError, match="failed to build"):
        resolve_backend("cpu", "cpu")


@pytest.mark.real_model
@pytest.mark.parametrize("smooth_keys", [False, True])
def test_cpu_step_equals_reference_on_smollm2(smooth_keys):
    """Real weights: the same greedy tokens and per-head tier counts as the torch reference (40 steps here; 128 on
    qwen2.5-0.5b are recorded by benchmarks/decode_backends.py).

    With smoothed keys (the default) the two backends' ~2e-5 float differences flip one 4-bit value code at a
    rounding boundary by step 9 (layer 15; measured 2026-12-01), and the trajectories part: logits within 3e-4 up
    to step 10, a greedy token differs at step 17. So there only the first 12 tokens must agree."""
    from diffkv.integrations.transformers import DiffKVCache
    from diffkv.prompts import essay_tokens
    from diffkv.registry.models import load_model

    model, tok = load_model("smollm2-135m")
    ids = torch.tensor([essay_tokens(tok, 400)])
    runs = {}
    for backend in ("torch", "cpu"):
        cache = DiffKVCache(model, DiffKVConfig(smooth_keys=smooth_keys), attention_backend=backend)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, min_new_tokens=40,
                                 do_sample=False, past_key_values=cache, pad_token_id=0)
        runs[backend] = (out[0, ids.shape[1]:].tolist(), cache.stats())
    steps = 12 if smooth_keys else 40
    assert runs["cpu"][0][:steps] == runs["torch"][0][:steps]
    # NOTE: scores are sums in another order (float rounding), so a rare near-tie placement may flip: per-head counts
    # agree within a token or two, not always exactly (per-step tests from identical states are exact).
    got, want = (torch.tensor(runs[b][1]["tokens_per_head"]) for b in ("cpu", "torch"))
    assert (got - want).abs().max() <= 2 and (got - want).abs().sum() <= want.numel() // 20
    assert runs["cpu"][1]["tokens_per_tier"]["low"] > 0 and runs["cpu"][1]["tokens_per_tier"]["pruned"] > 0


def test_a_compiled_path_that_does_not_build_is_logged_once(caplog):
    from diffkv.kernels.cbuild import CompileError, loads

    def broken_library():
        raise CompileError("no C compiler found")

    with caplog.at_level("WARNING", logger="diffkv.kernels"):
        assert not loads(broken_library) and not loads(broken_library)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "falling back to the torch path" in warnings[0] and "no C compiler" in warnings[0]
