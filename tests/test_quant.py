"""Property tests (hypothesis) for the reference codec diffkv.core.quant."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from diffkv.core import quant

BITS = st.sampled_from([8, 4, 3, 2, 1])
META = st.sampled_from([torch.float16, torch.bfloat16, torch.float32])
FAST = settings(deadline=None, max_examples=60)


@st.composite
def grouped(draw, lo=-1e4, hi=1e4, max_groups=4):
    """(x [n, groups * size] float32, group size) with finite values in [lo, hi]."""
    n, groups, size = draw(st.integers(1, 3)), draw(st.integers(1, max_groups)), draw(st.sampled_from([1, 2, 8, 16]))
    x = draw(arrays(np.float32, (n, groups * size), elements=st.floats(lo, hi, width=32)))
    return torch.from_numpy(x), size


@FAST
@given(bits=BITS, n=st.integers(1, 3), m=st.integers(1, 4), data=st.data())
def test_pack_unpack_round_trip(bits, n, m, data):
    width = m * 8 if bits == 3 else m * 8 // bits  # 3-bit rows: a multiple of 8 codes (2-bit + 1-bit planes)
    codes = torch.from_numpy(data.draw(arrays(np.uint8, (n, width), elements=st.integers(0, quant.max_code(bits)))))
    packed = quant.pack(codes, bits)
    assert packed.shape == (n, width * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(quant.unpack(packed, bits), codes)


@FAST
@given(xg=grouped(), bits=BITS, meta=META)
def test_error_at_most_half_a_step(xg, bits, meta):
    x, gs = xg
    codes, scale, zero = quant.quantize(x, bits, gs, meta)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= quant.max_code(bits)
    err = (x - quant.dequantize(codes, scale, zero)).abs().reshape(x.shape[0], -1, gs)
    # half a quantization step, plus a few fp32 ulps of the group's magnitude (rounding of q * scale + zero)
    mag = x.abs().reshape(err.shape).amax(-1, keepdim=True) + zero.float().abs().unsqueeze(-1)
    tol = scale.float().unsqueeze(-1) / 2 + 4 * torch.finfo(torch.float32).eps * mag
    assert (err <= tol).all()


@FAST
@given(xg=grouped(), bits=BITS, meta=META)
def test_symmetric_error_at_most_half_a_step_and_zero_is_implied(xg, bits, meta):
    x, gs = xg
    codes, scale, zero = quant.quantize(x, bits, gs, meta, symmetric=True)
    assert scale.dtype == meta and zero.dtype == torch.float32
    assert torch.equal(zero, quant.symmetric_zero(scale, bits))  # nothing to store but the scale
    assert int(codes.max()) <= quant.max_code(bits)
    reach = scale.float() * quant.max_code(bits) / 2  # covers max|x| (fp32 meta: up to an ulp of rounding)
    assert (reach >= x.abs().reshape(x.shape[0], -1, gs).amax(-1) * (1 - 2 * torch.finfo(torch.float32).eps)).all()
    err = (x - quant.dequantize(codes, scale, zero)).abs().reshape(x.shape[0], -1, gs)
    mag = x.abs().reshape(err.shape).amax(-1, keepdim=True) + zero.abs().unsqueeze(-1)
    tol = scale.float().unsqueeze(-1) / 2 + 4 * torch.finfo(torch.float32).eps * mag
    assert (err <= tol).all()


@FAST
@given(bits=BITS, meta=st.sampled_from([torch.float16, torch.bfloat16]), size=st.sampled_from([1, 4, 32]),
       data=st.data())
def test_constant_groups_are_exact(bits, meta, size, data):
    nptype = np.float16 if meta == torch.float16 else np.float32
    c = data.draw(arrays(nptype, (2, 3), elements=st.floats(-65504, 65504, width=16 if meta == torch.float16 else 32)))
    c = torch.from_numpy(c.astype(np.float32)).to(meta).float()  # representable in the meta dtype
    x = c.unsqueeze(-1).expand(2, 3, size).reshape(2, 3 * size)
    codes, scale, zero = quant.quantize(x, bits, size, meta)
    assert (codes == 0).all() and (scale.float() == quant.SCALE_FLOOR).all()
    assert torch.equal(quant.dequantize(codes, scale, zero), x)


@FAST
@given(bits=BITS, data=st.data())
def test_large_values_near_the_fp16_limit(bits, data):
    lo = 0.0 if bits == 1 else -65504.0  # a 1-bit step is the whole range, which must fit fp16 itself
    x, gs = data.draw(grouped(lo, 65504.0))
    codes, scale, zero = quant.quantize(x, bits, gs)
    assert torch.isfinite(scale.float()).all() and torch.isfinite(zero.float()).all()
    err = (x - quant.dequantize(codes, scale, zero)).abs().reshape(x.shape[0], -1, gs)
    assert (err <= scale.float().unsqueeze(-1) / 2 + 2**-23 * 65504 * 2).all()


@pytest.mark.parametrize("bits", [8, 4, 3, 2, 1])
def test_beyond_fp16_range_raises_naming_the_fix(bits):
    x = torch.tensor([[-7e4, 0.0, 1.0, 2.0]])  # min rounds down past -65504
    with pytest.raises(ValueError, match="meta_dtype=torch.bfloat16"):
        quant.quantize(x, bits)
    codes, scale, zero = quant.quantize(x, bits, meta_dtype=torch.bfloat16)
    assert torch.isfinite(scale.float()).all() and float(zero) <= -7e4
    with pytest.raises(ValueError, match="meta_dtype=torch.bfloat16"):
        quant.quantize(torch.tensor([[0.0, 65504.0 * quant.max_code(bits) * 1.01]]), bits)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_non_finite_rejected(bad, dtype):
    x = torch.zeros(2, 8, dtype=dtype)
    x[1, 3] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        quant.quantize(x, 4)


@FAST
@given(bits=BITS, meta=META, scale=st.sampled_from([1.0, 0.375, 2.0**-10, 96.0]), data=st.data())
def test_round_half_even_on_ties(bits, meta, scale, data):
    qmax = quant.max_code(bits)
    halves = data.draw(arrays(np.int64, (1, 16), elements=st.integers(0, 2 * qmax)))
    t = torch.from_numpy(halves).float() / 2
    t[0, 0], t[0, 1] = 0.0, float(qmax)  # min 0 and max qmax: zero = 0 and the step is exactly `scale`
    codes, s, z = quant.quantize(t * scale, bits, meta_dtype=meta)
    assert float(s) == scale and float(z) == 0.0
    want = torch.where(t - t.floor() == 0.5, 2 * torch.round(t / 2), t)  # k + 1/2 -> the even neighbour
    assert torch.equal(codes.float(), want)


@FAST
@given(xg=grouped(-3.0, 3.0), bits=BITS, meta=META)
def test_meta_rounding_is_directed(xg, bits, meta):
    x, gs = xg
    _, scale, zero = quant.quantize(x, bits, gs, meta)
    g = x.reshape(x.shape[0], -1, gs)
    assert (zero.float() <= g.amin(-1)).all()
    top = zero.double() + quant.max_code(bits) * scale.double()  # the grid covers the group, up to fp32 rounding
    slack = 4 * torch.finfo(torch.float32).eps * (g.abs().amax(-1).double() + zero.double().abs())
    assert (top >= g.amax(-1).double() - slack).all()


@pytest.mark.parametrize("bits", [8, 4, 3, 2, 1])
@pytest.mark.parametrize("group", [8, 32, 64])
def test_dequantize_packed_equals_unfused(bits, group):
    from diffkv.core.quant import dequantize_packed

    x = torch.randn(5, 3, 64) * 3
    codes, scale, zero = quant.quantize(x, bits, group)
    packed = quant.pack(codes, bits)
    assert torch.equal(dequantize_packed(packed, bits, scale, zero), quant.dequantize(codes, scale, zero))


def test_three_bit_rows_are_a_two_bit_then_a_one_bit_plane():
    codes = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]], dtype=torch.uint8)
    packed = quant.pack(codes, 3)
    assert torch.equal(packed, torch.cat([quant.pack(codes & 3, 2), quant.pack(codes >> 2, 1)], -1))
    assert packed.tolist() == [[0b11100100, 0b11100100, 0b11110000]]
    with pytest.raises(ValueError, match="multiple of 8"):
        quant.pack(codes[:, :4], 3)
