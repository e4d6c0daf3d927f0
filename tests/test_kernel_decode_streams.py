"""The "streams" decode kernel (integer codes in the dots, scales out of them) vs the torch reference, under the
Triton interpreter. tests/test_kernel_paged_attention.py runs it too (kernel "auto" picks it for every format it
reads); here: the formats and dtypes it reads forced by name, and the choice between the two kernels."""

import pytest
import torch
from test_kernel_paged_attention import _check, _paged

from diffkv.core.config import DiffKVConfig
from diffkv.core.layout import plan_for_config
from diffkv.ops.paged_attention_streams import use_streams


@pytest.mark.parametrize("tiers,meta", [(("K8V4", "K4V2"), "float32"), (("K8V8", "K2V2"), "bfloat16"),
                                        (("K4V4", "K2V4"), "float16")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_tier_formats_and_meta_dtypes(tiers, meta, dtype):
    """Every stream count (1, 2 and 4 codes a byte) on both sides of the dots, each metadata dtype (fp16/bf16 as
    one 32-bit word, fp32 as two loads), fp32 queries (two fp16 parts) and fp16 queries (as they are)."""
    cfg = DiffKVConfig(high=tiers[0], low=tiers[1], meta_dtype=meta)
    kv, items, nh, nl = _paged(cfg, 64, [[37, 1, 0]], [[45, 0, 60]], seed=len(meta))
    assert use_streams("streams", kv.layouts[0], kv.layouts[1])
    _check(kv, items, nh, nl, 3, 64, dtype=dtype, num_splits=2, update_scores=True, kernel="streams")


def test_compact_symmetric_long_ragged_head_dim_128():
    """Compact pages (32 high tokens a page at d=128) and scale-only keys over several pages per tier, with the
    tiers' splits cut unevenly (3 per tier) and one head with no token."""
    cfg = DiffKVConfig(compact_meta=True, symmetric_keys=True)
    kv, items, nh, nl = _paged(cfg, 128, [[100, 0], [3, 70]], [[130, 0], [0, 1]], seed=2)
    _check(kv, items, nh, nl, 4, 128, dtype=torch.float16, num_splits=3, update_scores=True,
           position=torch.full((4,), 400), kernel="streams")


def test_bf16_queries_and_value_scales_far_apart():
    """bf16 queries (in fp16 dots, scaled by a power of two) and value scales from 1e-3 to 1e2
    in one page: p * scale goes to the dot normalized by the page's largest scale, in two fp16 parts."""
    kv, items, nh, nl = _paged(DiffKVConfig(), 64, [[31]], [[40]], seed=9)
    torch.manual_seed(0)
    n = int(nh[0]) + int(nl[0])
    keys, values = torch.randn(n, 64), torch.randn(n, 64) * torch.logspace(-3, 2, n)[:, None]
    high, low = torch.arange(int(nh[0])), torch.arange(int(nl[0]))
    for tier, idx, part in ((0, high, slice(0, int(nh[0]))), (1, low, slice(int(nh[0]), n))):
        kv.write(tier, items.expand(len(idx)), idx, keys[part], values[part], torch.rand(len(idx)),
                 torch.zeros(len(idx), dtype=torch.int64))
    _check(kv, items, nh, nl, 2, 64, dtype=torch.bfloat16, kernel="streams")


@pytest.mark.parametrize("query_scale", [3e5, 1e-6])
def test_bf16_queries_outside_fp16_range(query_scale):
    """bf16 queries beyond fp16's largest (65504) or in its subnormals go to the fp16 dots times a power of two
    (``stream_codes.pow2_scale``): as exact as at unit scale."""
    kv, items, nh, nl = _paged(DiffKVConfig(), 64, [[40, 2]], [[50, 9]], seed=11)
    _check(kv, items, nh, nl, 2, 64, dtype=torch.bfloat16, kernel="streams", query_scale=query_scale)


def test_the_split_kernel_still_reads_every_format():
    kv, items, nh, nl = _paged(DiffKVConfig(), 64, [[20, 3]], [[7, 0]], seed=5)
    _check(kv, items, nh, nl, 2, 64, kernel="split", num_splits=2)


def test_choice_between_the_kernels():
    three_bit = plan_for_config(DiffKVConfig(high="K4V4", low="K3V3-g32/16"), 64).tiers
    default = plan_for_config(DiffKVConfig(), 128).tiers
    assert use_streams("auto", *default) and not use_streams("split", *default)
    assert not use_streams("auto", *three_bit)
    with pytest.raises(ValueError, match="K3V3"):
        use_streams("streams", *three_bit)
    with pytest.raises(ValueError, match="kernel must be one of"):
        use_streams("fast", *default)
