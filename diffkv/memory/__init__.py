"""Device-resident KV memory: a page pool with a ring free list, per-head two-tier page tables, and
allocate / trim / reserve / release over any set of heads as prefix-sum passes (docs/design.md §4).

Typical use (an engine step covers every layer; the HF cache one layer at a time)::

    plan = plan_for_config(config, head_dim)
    pool = PagePool(plan.page_bytes, budget_bytes=..., device=device)
    tables = HeadTables.for_config(config, plan, max_slots, num_layers, num_kv_heads, max_model_len, device)
    slot = tables.acquire_slot(); heads = tables.select([slot])
    allocate(pool, tables, heads, prompt_len)             # worst case for the prefill
    trim(pool, tables, heads, num_high, num_low)          # after the prefill split
    reserve(pool, tables, heads)                          # before every decode step
    release_slots(pool, tables, [slot])                   # finished or preempted

reserve and release run as one fused Triton launch on CUDA and one compiled C call on CPU (``backend="auto"``);
``backend="torch"`` runs the tensor-op reference. All give bit-identical state.
"""

from diffkv.memory.alloc import allocate, release, release_slots, reserve, reserve_demand, trim
from diffkv.memory.pool import OpResult, PagePool, PoolExhausted
from diffkv.memory.tables import HIGH_COL, LOW_COL, STORED_TIERS, HeadSet, HeadTables, head_set_bytes

__all__ = [
    "PagePool", "PoolExhausted", "OpResult", "HeadTables", "HeadSet", "STORED_TIERS", "HIGH_COL", "LOW_COL",
    "head_set_bytes", "allocate", "trim", "reserve", "reserve_demand", "release", "release_slots",
]
