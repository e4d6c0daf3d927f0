"""Store launcher: the Triton kernel on CUDA (or when forced), the torch reference otherwise."""

from __future__ import annotations

import torch

from diffkv.core.layout import TierLayout
from diffkv.core.page_io import check_store_args, load_tokens_ref, resolve_dtypes, store_tokens_ref
from diffkv.ops.kernel_choice import use_triton

_KIND = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


def launch_settings(n: int, head_dim: int) -> dict:
    """Grid and launch options: up to 2048 channels of K (and as many of V) per program, 4 warps."""
    import triton

    block_n = max(1, min(triton.next_power_of_2(max(n, 1)), 2048 // head_dim))
    return {"grid": (triton.cdiv(n, block_n),), "BLOCK_N": block_n, "num_warps": 4}


def _raise_kernel_errors(err: torch.Tensor, keys, values, layout: TierLayout, meta_dtype, raw_dtype) -> None:
    bad = err.nonzero()
    if bad.numel() == 0:
        return
    i = int(bad[0])
    code = int(err[i])
    big = max(keys[i].float().abs().max().item(), values[i].float().abs().max().item())
    if code & 1:
        msg = f"keys or values contain NaN or Inf (token {i}); only finite values can be stored"
    elif code & 2:
        msg = (f"values up to {big:.4g} (token {i}) do not fit {meta_dtype} scales/zeros; "
               "use meta_dtype=torch.bfloat16 or torch.float32")
    else:
        msg = (f"values up to {big:.4g} (token {i}) overflow the {raw_dtype} raw dtype of 16-bit tiers; "
               "use raw_dtype='bfloat16' or 'float32'")
    raise ValueError(msg + f" [{int((err != 0).sum())} token(s) of this call were not written]")


def _store_triton(pool, layout, keys, values, page_ids, slots, scores, positions, meta_dtype, raw_dtype, validate):
    d = layout.head_dim
    if d & (d - 1):
        raise ValueError(f"the Triton store kernel needs a power-of-two head_dim, got {d}; use backend='torch'")
    for name, t in (("keys", keys), ("values", values)):
        if t.stride(1) != 1:
            raise ValueError(f"{name} must have unit stride along head_dim, got strides {t.stride()}")
    assert pool.is_contiguous() and pool.stride() == (layout.page_bytes, 1)
    n = keys.shape[0]
    if n == 0:
        return
    from diffkv.kernels.quantize_store import store_kernel

    err = torch.empty(n, dtype=torch.int32, device=pool.device)
    cfg = launch_settings(n, d)
    extra = {"enable_fp_fusion": False} if pool.is_cuda else {}  # symmetric keys: x - scale * c is no fused FMA
    store_kernel[cfg["grid"]](
        pool_ptr=pool, k_ptr=keys, v_ptr=values,
        page_ptr=page_ids.to(torch.int64).contiguous(), slot_ptr=slots.to(torch.int64).contiguous(),
        score_ptr=scores.contiguous(), pos_ptr=positions.contiguous(), err_ptr=err,
        n_tokens=n, stride_k=keys.stride(0), stride_v=values.stride(0), page_bytes=layout.page_bytes,
        key_off=layout.key_offset, key_meta_off=layout.key_meta_offset, value_off=layout.value_offset,
        value_meta_off=layout.value_meta_offset, score_off=layout.score_offset, pos_off=layout.pos_offset,
        HEAD_DIM=d, K_BITS=layout.key_bits, V_BITS=layout.value_bits,
        K_GROUPS=layout.key_groups, V_GROUPS=layout.value_groups,
        META_KIND=_KIND[meta_dtype], RAW_KIND=_KIND[raw_dtype],
        K_FIELDS=layout.key_meta_fields, FIELD_BYTES=layout.score_bytes,
        BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"], **extra,
    )
    if validate:
        _raise_kernel_errors(err, keys, values, layout, meta_dtype, raw_dtype)


def store_tokens(pool: torch.Tensor, layout: TierLayout, keys: torch.Tensor, values: torch.Tensor,
                 page_ids: torch.Tensor, slots: torch.Tensor, scores: torch.Tensor, positions: torch.Tensor, *,
                 meta_dtype: torch.dtype | str | None = None, raw_dtype: torch.dtype | str | None = None,
                 validate: bool = True, backend: str = "auto", return_stored: bool = False):
    """Quantize N tokens of one tier and write them into ``pool`` in place.

    Same arguments and result as :func:`diffkv.core.page_io.store_tokens_ref` (pool uint8 [num_pages, page_bytes];
    keys, values [N, head_dim] with unit channel stride; page_ids, slots [N] integer; scores [N] float32;
    positions [N] int32; compact layouts: float16 and int16). ``backend``: "auto" runs the Triton kernel when the
    pool is on CUDA and the torch reference otherwise; "triton" forces the kernel (on CPU only under
    ``TRITON_INTERPRET=1``); "torch" forces the reference. With ``validate`` the targets are checked before the
    launch (this synchronizes on CUDA); tokens with NaN/Inf or out-of-range values are left unwritten by the kernel
    and reported by a ``ValueError`` afterwards (the other tokens of the call are written; the reference writes
    nothing on error). ``return_stored``: return (keys, values) [N, head_dim] fp32 exactly as the pages now decode
    them (the reference returns what it wrote; after the kernel they are read back).
    """
    if not use_triton(backend, isinstance(pool, torch.Tensor) and pool.is_cuda):
        return store_tokens_ref(pool, layout, keys, values, page_ids, slots, scores, positions,
                                meta_dtype=meta_dtype, raw_dtype=raw_dtype, validate=validate,
                                return_stored=return_stored)
    meta_dtype, raw_dtype = resolve_dtypes(layout, meta_dtype, raw_dtype)
    check_store_args(pool, layout, keys, values, page_ids, slots, scores, positions, validate)
    _store_triton(pool, layout, keys, values, page_ids, slots, scores, positions, meta_dtype, raw_dtype, validate)
    if return_stored:
        return load_tokens_ref(pool, layout, page_ids, slots, torch.float32, meta_dtype=meta_dtype,
                               raw_dtype=raw_dtype, validate=False)[:2]
    return None
