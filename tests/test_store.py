"""Store/load: torch reference round trip, Triton kernel bit-exact against the reference, input validation."""

import pytest
import torch

from diffkv.core import quant
from diffkv.core.config import PRESETS
from diffkv.core.layout import plan_pages
from diffkv.core.page_io import load_tokens_ref, store_tokens_ref
from diffkv.ops.store_tokens import launch_settings, store_tokens

DT = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def presets(head_dim):
    out = []
    for name, t in PRESETS.items():
        try:
            t.validate(head_dim)
        except ValueError:
            continue
        out.append(name)
    return out


def make_layout(name, head_dim, meta=torch.float16, raw=torch.float16, compact=False, symmetric_keys=False):
    return plan_pages(head_dim, [name], NAMES[meta], NAMES[raw], compact=compact,
                      symmetric_keys=symmetric_keys).tiers[0]


def make_inputs(layout, n, dtype, kind="randn", pages=3, seed=0):
    """Random pool bytes and n tokens of ``kind`` at distinct random (page, slot) targets (CPU tensors)."""
    g = torch.Generator().manual_seed(seed)
    d = layout.head_dim
    pages = max(pages, -(-n // layout.tokens_per_page))
    pool = torch.randint(0, 256, (pages, layout.page_bytes), dtype=torch.uint8, generator=g)
    flat = torch.randperm(pages * layout.tokens_per_page, generator=g)[:n]
    kv = []
    for bits, groups in ((layout.key_bits, layout.key_groups), (layout.value_bits, layout.value_groups)):
        if kind == "randn":
            x = torch.randn(n, d, generator=g) * 3
        elif kind == "tiny":  # fp16 subnormals and values that round to +-0 (steps off zero)
            x = torch.randn(n, d, generator=g) * 10 ** (-9 + 5 * torch.rand(n, 1, generator=g))
        elif kind == "const":  # constant groups (every channel of a token equal)
            x = torch.randn(n, 1, generator=g).expand(n, d).clone()
        elif kind == "large":  # near the fp16 limit; 1-bit groups keep their range <= 65504
            lo = 0.0 if bits == 1 else -6e4
            x = lo + (6e4 - lo) * torch.rand(n, d, generator=g)
            x[:, 0], x[:, -1] = lo, 6e4
        elif kind == "ties":  # (x - zero) / scale = k + 1/2 exactly: scale 0.375, zero 0, codes 0..qmax
            qmax = 255 if bits == 16 else quant.max_code(bits)
            gs = d // max(groups, 1)
            x = torch.randint(0, 2 * qmax + 1, (n, d), generator=g).float() / 2
            x[:, ::gs], x[:, 1::gs] = 0.0, float(qmax)
            x = x * 0.375
        kv.append(x.to(dtype))
    scores = torch.rand(n, generator=g)
    pos = torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int32)
    if layout.compact:  # fp16 means (some subnormal), int16 positions mod 2^16
        scores, pos = (scores * 10.0 ** torch.randint(-7, 2, (n,), generator=g)).half(), pos.to(torch.int16)
    args = (kv[0], kv[1], flat // layout.tokens_per_page, flat % layout.tokens_per_page, scores, pos)
    return pool, args


def roundtrip(x, bits, groups, meta, raw):
    if bits == 16:
        return x.to(raw).float()
    codes, scale, zero = quant.quantize(x, bits, x.shape[1] // groups, meta)
    return quant.dequantize(codes, scale, zero)


def written_mask(layout, page_ids, slots, pages):
    """Bytes a store of these targets may write, computed segment by segment (independently of diffkv.core.page_io)."""
    mask = torch.zeros(pages, layout.page_bytes, dtype=torch.bool)
    mb = layout.meta_bytes
    kf = layout.key_meta_fields
    segs = [(layout.key_offset, layout.key_row_bytes), (layout.key_meta_offset, layout.key_groups * kf * mb),
            (layout.value_offset, layout.value_row_bytes), (layout.value_meta_offset, layout.value_groups * 2 * mb),
            (layout.score_offset, layout.score_bytes), (layout.pos_offset, layout.pos_bytes)]
    for p, s in zip(page_ids.tolist(), slots.tolist(), strict=True):
        for off, row in segs:
            mask[p, off + s * row: off + (s + 1) * row] = True
    return mask


@pytest.mark.parametrize("meta,raw", [(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
                                      (torch.float32, torch.float32)])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_reference_round_trip(head_dim, meta, raw):
    for name in presets(head_dim):
        lay = make_layout(name, head_dim, meta, raw)
        pool, (k, v, pg, sl, sc, ps) = make_inputs(lay, 7, torch.float32, seed=head_dim)
        before = pool.clone()
        store_tokens_ref(pool, lay, k, v, pg, sl, sc, ps, meta_dtype=meta, raw_dtype=raw)
        K, V, S, P = load_tokens_ref(pool, lay, pg, sl, meta_dtype=meta, raw_dtype=raw)
        assert torch.equal(K, roundtrip(k, lay.key_bits, lay.key_groups, meta, raw)), name
        assert torch.equal(V, roundtrip(v, lay.value_bits, lay.value_groups, meta, raw)), name
        assert torch.equal(S, sc) and torch.equal(P, ps)
        keep = ~written_mask(lay, pg, sl, pool.shape[0])
        assert torch.equal(pool[keep], before[keep]), f"{name}: bytes outside the written rows changed"


@pytest.mark.parametrize("head_dim", [64, 128])
def test_reference_round_trip_compact_and_symmetric_keys(head_dim):
    """Compact fields (fp16 scores, int16 positions) and scale-only keys: what is stored comes back."""
    from diffkv.core.layout import plan_pages
    from diffkv.core.quant import dequantize, quantize

    for name in ("K8V4", "K4V2-g32/16", "K16V8"):
        lay = plan_pages(head_dim, [name], compact=True, symmetric_keys=True).tiers[0]
        assert lay.compact and lay.key_meta_fields == 1
        pool, (k, v, pg, sl, sc, ps) = make_inputs(lay, 7, torch.float32, seed=head_dim)
        before = pool.clone()
        store_tokens_ref(pool, lay, k, v, pg, sl, sc, ps)
        K, V, S, P = load_tokens_ref(pool, lay, pg, sl)
        if lay.key_bits != 16:
            want = dequantize(*quantize(k, lay.key_bits, head_dim // lay.key_groups, symmetric=True))
            assert torch.equal(K, want), name
        assert torch.equal(V, roundtrip(v, lay.value_bits, lay.value_groups, torch.float16, torch.float16)), name
        assert torch.equal(S, sc) and torch.equal(P, ps)
        keep = ~written_mask(lay, pg, sl, pool.shape[0])
        assert torch.equal(pool[keep], before[keep]), f"{name}: bytes outside the written rows changed"


def check_kernel(name, head_dim, dtype, meta=torch.float16, raw=torch.float16, kind="randn", n=3, seed=0,
                 compact=False, symmetric_keys=False):
    lay = make_layout(name, head_dim, meta, raw, compact, symmetric_keys)
    pool, args = make_inputs(lay, n, dtype, kind, seed=seed)
    ref = pool.clone()
    store_tokens_ref(ref, lay, *args, meta_dtype=meta, raw_dtype=raw)
    store_tokens(pool, lay, *args, meta_dtype=meta, raw_dtype=raw, backend="triton")
    diff = (pool != ref).nonzero()
    assert diff.numel() == 0, f"{name} d={head_dim} {dtype} meta={meta}: {len(diff)} bytes differ, first {diff[:4]}"


@pytest.mark.parametrize("meta", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("name", presets(64))
def test_kernel_bit_exact_head_dim_64(name, dtype, meta):
    check_kernel(name, 64, DT[dtype], meta, raw=meta, n=7, seed=hash((name, dtype)) % 1000)


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("name", presets(128))
def test_kernel_bit_exact_wide_heads(name, head_dim):
    i = presets(128).index(name)
    dtype, meta = [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.float32, torch.float16),
                   (torch.float32, torch.bfloat16)][(i + head_dim // 128) % 4]
    check_kernel(name, head_dim, dtype, meta, raw=meta, n=1 + 2 * (i % 3), seed=i)


@pytest.mark.parametrize("name", ["K16V16", "K8V4", "K4V2-g64/32", "K4V1", "K3V4", "K4V3-g64/32", "K3V3-g8/16"])
def test_kernel_bit_exact_fp32_meta_and_raw(name):
    check_kernel(name, 64, torch.float32, torch.float32, torch.float32, n=5)


@pytest.mark.parametrize("compact,symmetric_keys", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("name,dtype,meta,kind", [
    ("K8V4", torch.float32, torch.float16, "randn"),
    ("K4V2-g32/16", torch.bfloat16, torch.bfloat16, "tiny"),
    ("K2V1", torch.float16, torch.float16, "const"),
    ("K16V8", torch.float32, torch.float32, "large"),
    ("K4V4", torch.float32, torch.float32, "ties"),
    ("K3V4-g32/64", torch.float32, torch.float16, "randn"),
], ids=["K8V4", "K4V2-g32-tiny-bf16", "K2V1-const", "K16V8-large-fp32", "K4V4-ties-fp32", "K3V4-g32"])
def test_kernel_bit_exact_compact_and_symmetric_keys(name, dtype, meta, kind, compact, symmetric_keys):
    """Compact score/position fields (fp16 means, int16 positions) and scale-only keys: the same bytes as the
    reference (codes, scales, fields), with odd token counts and special values."""
    check_kernel(name, 64, dtype, meta, raw=meta, kind=kind, n=5, seed=len(name), compact=compact,
                 symmetric_keys=symmetric_keys)


@pytest.mark.parametrize("kind", ["const", "large", "ties", "tiny"])
@pytest.mark.parametrize("name", ["K16V16", "K8V8", "K8V4", "K4V2-g64/32", "K4V1", "K3V2", "K2V3-g32/32"])
def test_kernel_bit_exact_special_values(name, kind):
    check_kernel(name, 64, torch.float32, kind=kind, n=7)
    check_kernel(name, 64, torch.bfloat16, torch.bfloat16, torch.bfloat16, kind=kind, n=3)


def test_ties_round_half_even():
    lay = make_layout("K4V4", 64)
    pool, (k, v, pg, sl, sc, ps) = make_inputs(lay, 3, torch.float32, "ties")
    store_tokens(pool, lay, k, v, pg, sl, sc, ps, backend="triton")
    K = load_tokens_ref(pool, lay, pg, sl)[0]
    t = k / 0.375
    want = torch.where(t - t.floor() == 0.5, 2 * torch.round(t / 2), t.round()) * 0.375
    assert (t - t.floor() == 0.5).any() and torch.equal(K, want)


def test_auto_backend_on_cpu_is_reference_and_launch_settings():
    lay = make_layout("K8V4", 64)
    pool, args = make_inputs(lay, 5, torch.float16)
    ref = pool.clone()
    store_tokens_ref(ref, lay, *args)
    store_tokens(pool, lay, *args)
    assert torch.equal(pool, ref)
    cfg = launch_settings(100, 128)
    assert cfg["BLOCK_N"] == 16 and cfg["grid"] == (7,)
    assert launch_settings(3, 256)["BLOCK_N"] == 4


INTERPRETER_NUMPY_WARNINGS = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # NaN/inf casts


@INTERPRETER_NUMPY_WARNINGS
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_inputs_raise(backend):
    lay = make_layout("K8V4", 64)
    pool, (k, v, pg, sl, sc, ps) = make_inputs(lay, 3, torch.float32)
    before = pool.clone()

    def call(match, **kw):
        a = dict(keys=k, values=v, page_ids=pg, slots=sl, scores=sc, positions=ps) | kw
        extra = {n: a.pop(n) for n in ("meta_dtype", "pool") if n in a}
        with pytest.raises(ValueError, match=match):
            store_tokens(extra.get("pool", pool), lay, backend=backend, meta_dtype=extra.get("meta_dtype"), **a)

    call(r"shape \[N, head_dim\]", keys=k[:, :32])
    call("float16/bfloat16/float32", values=v.double())
    call("int32 tensor", positions=ps.long())
    call("float32 tensor", scores=sc.half())
    call("1-D integer", page_ids=pg.float())
    call("slot 32 .*out of range", slots=torch.tensor([0, 1, 32]))
    call("page id 3 .*out of range", page_ids=torch.tensor([0, 3, 1]))
    call("duplicate target", page_ids=torch.tensor([1, 1, 2]), slots=torch.tensor([4, 4, 0]))
    call("NaN or Inf", keys=torch.where(torch.arange(64) == 5, float("nan"), k))
    call("meta_dtype=torch.bfloat16", keys=k * 1e5)
    call("meta_dtype=torch.float32 has 4 bytes", meta_dtype=torch.float32)
    call("pool pages have 3552 bytes", pool=pool[:, :-32])
    call("uint8", pool=pool.view(torch.int16))
    assert torch.equal(pool, before), "a failed store must not write"
    with pytest.raises(ValueError, match="backend"):
        store_tokens(pool, lay, k, v, pg, sl, sc, ps, backend="cuda")


@INTERPRETER_NUMPY_WARNINGS
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_raw_overflow_raises(backend):
    lay = make_layout("K16V16", 64)
    pool, (k, v, pg, sl, sc, ps) = make_inputs(lay, 3, torch.float32)
    with pytest.raises(ValueError, match="raw_dtype='bfloat16'"):
        store_tokens(pool, lay, k, v * 1e5, pg, sl, sc, ps, backend=backend)
    store_tokens(pool, lay, k, v * 1e5, pg, sl, sc, ps, backend=backend, raw_dtype="bfloat16")
    assert torch.equal(load_tokens_ref(pool, lay, pg, sl, raw_dtype="bfloat16")[1], (v * 1e5).bfloat16().float())


def test_load_validates_targets():
    lay = make_layout("K4V2", 64)
    pool, (k, v, pg, sl, sc, ps) = make_inputs(lay, 3, torch.float32)
    with pytest.raises(ValueError, match="out of range"):
        load_tokens_ref(pool, lay, torch.tensor([0, 9, 0]), sl)
    with pytest.raises(ValueError, match="page_ids has 3 entries but slots has 2"):
        load_tokens_ref(pool, lay, pg, sl[:2])


def rotated_dtypes(i):
    """Three (input dtype, meta dtype) pairs for the i-th preset: every input dtype and every meta dtype once, and
    the nine pairs over any three consecutive presets (a third of the 3 x 3 compiled variants per preset)."""
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    return [(dtypes[j], dtypes[(j + i) % 3]) for j in range(3)]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_kernel_bit_exact_on_cuda(head_dim):
    """Every preset (bit width, grouping) with every input dtype and every meta dtype, though not every pair of
    them per preset (``rotated_dtypes``): 27 compiled variants at head_dim 128 / 256 instead of 81."""
    for i, name in enumerate(presets(head_dim)):
        for dtype, meta in rotated_dtypes(i):
            for kind in ("randn", "const", "large", "ties", "tiny"):
                lay = make_layout(name, head_dim, meta, meta)
                pool, args = make_inputs(lay, 257, dtype, kind, pages=24, seed=head_dim)
                ref = pool.clone()  # reference on the CPU: torch on CUDA divides by a scalar via a reciprocal
                store_tokens_ref(ref, lay, *args, meta_dtype=meta, raw_dtype=meta)
                gpool = pool.cuda()
                store_tokens(gpool, lay, *(a.cuda() for a in args), meta_dtype=meta, raw_dtype=meta)
                assert torch.equal(gpool.cpu(), ref), (name, dtype, meta, kind)


@pytest.mark.gpu
@pytest.mark.parametrize("compact,symmetric_keys", [(True, False), (False, True), (True, True)])
def test_kernel_bit_exact_compact_and_symmetric_keys_on_cuda(compact, symmetric_keys):
    for name in ("K8V4", "K4V2", "K2V1", "K16V8", "K3V4"):  # head_dim 128: 10 compiled variants per case
        for meta in (torch.float16, torch.float32):
            for kind in ("randn", "const", "large", "ties", "tiny"):
                lay = make_layout(name, 128, meta, meta, compact, symmetric_keys)
                pool, args = make_inputs(lay, 257, torch.float32, kind, pages=24, seed=7)
                ref = pool.clone()  # reference on the CPU (see test_kernel_bit_exact_on_cuda)
                store_tokens_ref(ref, lay, *args, meta_dtype=meta, raw_dtype=meta)
                gpool = pool.cuda()
                store_tokens(gpool, lay, *(a.cuda() for a in args), meta_dtype=meta, raw_dtype=meta)
                assert torch.equal(gpool.cpu(), ref), (name, meta, kind)


def test_signed_zero_minimum_gives_equal_values():
    # Which of +0 / -0 a min-reduction returns differs between torch and numpy/PTX, so the stored zero's sign bit
    # may differ from the reference when a group's minimum is a zero of both signs; the decoded values may not.
    lay = make_layout("K8V4-g128/64", 128)
    pool, (k, v, pg, sl, sc, ps) = make_inputs(lay, 3, torch.float32)
    k, v = k.abs(), v.abs()
    k[:, ::3], v[:, 1::4], v[:, ::5] = 0.0, 0.0, -0.0
    ref = pool.clone()
    store_tokens_ref(ref, lay, k, v, pg, sl, sc, ps)
    store_tokens(pool, lay, k, v, pg, sl, sc, ps, backend="triton")
    for a, b in zip(load_tokens_ref(pool, lay, pg, sl), load_tokens_ref(ref, lay, pg, sl), strict=True):
        assert torch.equal(a, b)
