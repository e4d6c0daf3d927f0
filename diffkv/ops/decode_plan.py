"""Plan once per decode step, run per layer (issue #59 item 1; FlashInfer's plan/run, vLLM's metadata builder).

A :class:`DecodePlan` holds what every layer of one decode step shares and the host already knows, so that a layer's
step on the Triton backend makes no host sync and three launches (place-store, attention split, attention reduce;
``diffkv.ops.decode_step.decode_step_planned``):

* the items of every layer (int64 [K], K = B * H_kv, built once per set of sequences) and the step's positions as
  device tensors, built once per step from the host's list (one host -> device copy, pinned and non-blocking on
  CUDA): per item ``positions`` [K], per sequence ``seq_positions`` and ``next_positions`` [B];
* host-known upper bounds ``m_hi``, ``m_lo`` of the tiers' token widths (:func:`tier_bounds`: the longest sequence
  + 1 and the table width, in whole pages) in place of ``tier_widths``' per-layer ``.tolist()``: the attention
  kernels mask every token by its item's own count, so wider widths only cost workspace; the place-store kernel
  clamps the counts it hands them to these widths and flags a step that would exceed them (no out-of-bounds write);
* launch settings: the split count from the bounds and the SM count (read once per device, :func:`multiprocessors`);
* workspaces (:class:`DecodeWorkspace`): logits, partial (m, l, acc), counts, scaled queries and the place-store
  scratch, kept across steps and grown when a step needs more (never shrunk); per-layer outputs and the per-layer
  error flags (:class:`PlanBuffers`) kept by the set of sequences.

Errors found on the device (a non-finite new key or value; a count above the widths) are ORed into the layer's flag
by the place-store kernel and checked by :meth:`DecodePlan.finish`, once per step (one host read), which raises
ValueError naming the layers. A head whose new token is not finite stores, demotes and counts nothing in that step
(its attention reads the tokens it held); the step's other heads and layers go on (the torch and compiled CPU
backends check before they write, per layer, as before).

Misuse raises ValueError: a plan used for a layer, heads or batch it was not built for, or a layer run twice in one
step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diffkv.memory import HIGH_COL, LOW_COL

GROWTH = 1.25  # a workspace buffer that is too small grows to at least this many times its size
_SMS: dict[str, int] = {}


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under ``tensors`` (None skipped; views of one storage count it once, in
    full): what a walk of every reachable tensor (``diffkv.memory.owned``) finds."""
    sizes = {}
    for t in tensors:
        if t is not None:
            st = t.untyped_storage()
            sizes[(str(t.device), st.data_ptr())] = st.nbytes()
    return sum(sizes.values())


def multiprocessors(device: torch.device | str) -> int:
    """Streaming multiprocessors of a CUDA device (read once per device and kept); 1 elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    key = str(device if device.index is not None else torch.device("cuda", torch.cuda.current_device()))
    if key not in _SMS:
        _SMS[key] = torch.cuda.get_device_properties(torch.device(key)).multi_processor_count
    return _SMS[key]


def tier_bounds(layouts, two_tier: bool, longest: int, width: int, bucket: int = 1) -> tuple[int, int]:
    """(M_hi, M_lo): upper bounds of the page-rounded token widths of the two tiers, from host ints only.

    After a decode step an item holds at most ``longest + 1`` tokens (``longest``: the largest position, the tokens
    its sequence had before the new one) and at most ``width`` pages (its table row); a one-tier config holds no low
    token. layouts: (high, low) ``TierLayout``s. bucket: ``longest + 1`` rounded up to a multiple of it first, so
    that the bounds (and every launch setting that follows from them) stay the same for ``bucket`` steps: what a
    captured CUDA graph needs to be replayed (1: the tightest bounds)."""
    tokens = -(-(int(longest) + 1) // bucket) * bucket

    def bound(lay) -> int:
        pages = min(-(-tokens // lay.tokens_per_page), int(width))
        return pages * lay.tokens_per_page

    return bound(layouts[0]), bound(layouts[1]) if two_tier else 0


def split_count(num_items: int, max_pages: int, device: torch.device | str) -> int:
    """Flash-decoding splits per item: about 2 waves of programs over the SMs, at least 4 pages per split
    (``diffkv.ops.paged_attention.launch_settings``' rule, with the SM count read once)."""
    want = -(-2 * multiprocessors(device) // max(num_items, 1))
    return max(1, min(want, -(-max_pages // 4)))


def workspace_bound_bytes(layouts, two_tier: bool, *, max_slots: int, num_layers: int, num_kv_heads: int,
                          num_heads: int, head_dim: int, max_seq_len: int, device: torch.device | str,
                          plans: int = 4) -> int:
    """Most bytes the Triton decode path holds for ``max_slots`` sequences of at most ``max_seq_len`` tokens: the
    :class:`DecodeWorkspace` buffers at their largest (logits over both tiers' width bounds, the splits' partials,
    counts, scaled queries, place-store scratch, an output), grown by at most ``GROWTH``, plus the
    :class:`PlanBuffers` of ``plans`` sets of sequences (a flag and an fp32 output [B, H_q, D] per layer, the
    positions; the store keeps at most ``kv_store.MAX_PLANS``). What an engine's budget reserves on that backend."""
    k, g, d = max_slots * num_kv_heads, num_heads // num_kv_heads, head_dim
    m_hi, m_lo = tier_bounds(layouts, two_tier, max_seq_len, 1 << 30)
    parts = 2 * (k + 2 * multiprocessors(device))  # items x splits: 2 tiers x max(1, 2 SMs / K) splits per item
    f32 = 4
    workspace = (k * g * max(m_hi + m_lo, 1) + parts * g * (2 + d) + 2 * k + 3 * k * d
                 + 2 * max_slots * num_heads * d) * f32  # queries (<= fp32) and an output
    outputs = plans * num_layers * (1 + max_slots * num_heads * d) * f32
    positions = plans * (k + 2 * max_slots) * 8  # int64, PlanBuffers.positions
    return int(workspace * GROWTH) + outputs + positions


class DecodeWorkspace:
    """Scratch tensors of the decode steps on one device, reused by every call (they run one after another on
    one stream) and grown when a call needs more, never shrunk. ``take(name, shape, dtype)`` returns a view of a
    buffer."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous ``shape`` view of buffer ``(name, dtype)`` (contents undefined), grown by at least
        ``GROWTH`` when short."""
        numel = 1
        for n in shape:
            numel *= int(n)
        buf = self._buffers.get((name, dtype))
        if buf is None or buf.numel() < numel:
            size = numel if buf is None else max(numel, int(buf.numel() * GROWTH))
            buf = self._buffers[(name, dtype)] = torch.empty(size, dtype=dtype, device=self.device)
        return buf[:numel].view(shape)

    def attention_buffers(self, b: int, hq: int, k: int, s: int, g: int, d: int, m_total: int):
        """What ``paged_decode_attention`` writes: (logits fp32 [K * G * m_total], part_m, part_l fp32 [K, S, G],
        part_acc fp32 [K, S, G, D], out fp32 [B, H_q, D])."""
        return self.scratch_buffers(k, s, g, d, m_total) + (self.take("out", (b, hq, d), torch.float32),)

    def scratch_buffers(self, k: int, s: int, g: int, d: int, m_total: int):
        """(logits, part_m, part_l, part_acc) of :meth:`attention_buffers`."""
        f32 = torch.float32
        return (self.take("logits", (k * g * m_total,), f32), self.take("part_m", (k, s, g), f32),
                self.take("part_l", (k, s, g), f32), self.take("part_acc", (k, s, g, d), f32))

    def tensors(self) -> list[torch.Tensor]:
        return list(self._buffers.values())


class PlanBuffers:
    """What one set of sequences keeps across its decode steps: an int32 error flag per layer (zero; set by the
    place-store kernel, read and cleared by :meth:`DecodePlan.finish`) and, with ``keep_outputs``, each layer's
    output [B, H_q, D] fp32, rewritten by that layer's next step (a caller uses it before then); without, every call
    returns a fresh output."""

    def __init__(self, layers: list[int] | tuple[int, ...], device: torch.device | str, keep_outputs: bool):
        self.layers = tuple(layers)
        self.flags = torch.zeros(len(self.layers), dtype=torch.int32, device=device)
        self.keep_outputs = keep_outputs
        self.outputs: dict[int, torch.Tensor] = {}
        self.position_rows = torch.zeros(0, dtype=torch.int64, device=device)  # the plans' positions (build_plan)

    def output(self, layer: int, shape: tuple[int, int, int], device) -> torch.Tensor:
        if not self.keep_outputs:
            return torch.empty(shape, dtype=torch.float32, device=device)
        out = self.outputs.get(layer)
        if out is None or tuple(out.shape) != tuple(shape):
            out = self.outputs[layer] = torch.empty(shape, dtype=torch.float32, device=device)
        return out

    def positions(self, numel: int) -> torch.Tensor:
        """int64 [numel]: the step's positions, one buffer rewritten by every step (its address stays)."""
        if self.position_rows.numel() != numel:
            self.position_rows = torch.zeros(numel, dtype=torch.int64, device=self.flags.device)
        return self.position_rows

    def tensors(self) -> list[torch.Tensor]:
        return [self.flags, self.position_rows, *self.outputs.values()]


@dataclass(eq=False)
class _LayerWorkspace:
    """``paged_decode_attention``'s workspace for one layer: the shared scratch, the layer's output."""

    plan: DecodePlan
    layer: int

    def attention_buffers(self, b: int, hq: int, k: int, s: int, g: int, d: int, m_total: int):
        return self.plan.workspace.scratch_buffers(k, s, g, d, m_total) + (
            self.plan.buffers.output(self.layer, (b, hq, d), self.plan.workspace.device),)


@dataclass(eq=False)
class DecodePlan:
    """One decode step of ``batch`` sequences of ``num_kv_heads`` KV heads over ``layers`` (module docstring).

    items: per layer, int64 [K] flat head ids (K = batch * num_kv_heads, sequence-major); positions: int64 [K] the
    new token's index per item; seq_positions, next_positions: int64 [B] per sequence, before and after the step;
    longest: max of the positions (host); m_hi, m_lo: the tier width bounds (:func:`tier_bounds`); num_splits,
    num_warps: the attention launch settings; backend: the resolved decode backend (the flags are set and checked
    on "triton" only). Build it with :func:`build_plan`.
    """

    layers: tuple[int, ...]
    items: dict[int, torch.Tensor]
    batch: int
    num_kv_heads: int
    positions: torch.Tensor
    seq_positions: torch.Tensor
    next_positions: torch.Tensor
    longest: int
    m_hi: int
    m_lo: int
    num_splits: int
    num_warps: int | None  # None: the launchers' choice (streams: by head_dim)
    backend: str
    workspace: DecodeWorkspace
    buffers: PlanBuffers
    done: set[int] = field(default_factory=set)

    def check(self, layer: int, items: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor) -> None:
        """ValueError unless this plan was built for ``layer``, these heads (``items``: the caller's int64 [K]) and
        query [B, H_q, D], key and value [B, H_kv, D] of its batch, and the layer has not run in this step yet."""
        if layer not in self.items:
            raise ValueError(f"this decode plan was built for layers {list(self.layers)}, not layer {layer}")
        mine = self.items[layer]
        if items.numel() != mine.numel() or items.data_ptr() != mine.data_ptr():
            raise ValueError(f"layer {layer}: this decode plan was built for other heads ({mine.numel()} items); "
                             "plan the step of these sequences")
        want = (self.batch, self.num_kv_heads)
        if (tuple(key.shape[:2]) != want or tuple(value.shape) != tuple(key.shape) or query.dim() != 3
                or query.shape[0] != self.batch or query.shape[1] % self.num_kv_heads):
            raise ValueError(f"layer {layer}: this decode plan was built for a batch of {self.batch} sequences of "
                             f"{self.num_kv_heads} KV heads (key/value [{self.batch}, {self.num_kv_heads}, D]), got "
                             f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
        if layer in self.done:
            raise ValueError(f"layer {layer} already ran in this decode step; plan the next step first")

    def tensors(self) -> list[torch.Tensor]:
        """The step's own tensors (the positions; items, workspace and buffers belong to others)."""
        return [self.positions, self.seq_positions, self.next_positions]

    def ran(self, layer: int) -> None:
        """Record that ``layer`` ran (a second run in this step is refused)."""
        self.done.add(layer)

    def flag(self, layer: int) -> torch.Tensor:
        """int32 [1]: the layer's error flag (a view of the plan buffers' flags)."""
        i = self.buffers.layers.index(layer)
        return self.buffers.flags[i:i + 1]

    def attention_workspace(self, layer: int) -> _LayerWorkspace:
        """The ``workspace`` argument of ``paged_decode_attention`` for ``layer``."""
        return _LayerWorkspace(self, layer)

    def finish(self) -> None:
        """End of the step: on the Triton backend read the layers' error flags (the step's one host sync) and
        raise ValueError naming the layers whose new token was not finite, or whose counts exceeded the widths (the
        flags are cleared first, so the next step starts clean)."""
        if self.backend != "triton":
            return
        bits = self.buffers.flags.tolist()
        bad = {layer: b for layer, b in zip(self.buffers.layers, bits, strict=True) if b}
        if not bad:
            return
        self.buffers.flags.zero_()
        nonfinite = [layer for layer, b in bad.items() if b & 1]
        over = [layer for layer, b in bad.items() if b & 2]
        parts = []
        if nonfinite:
            parts.append(f"layer(s) {nonfinite}: the new token's keys/values contain NaN or Inf (not stored)")
        if over:
            parts.append(f"layer(s) {over}: a head holds more tokens than the step's positions allow (widths "
                         f"{self.m_hi}/{self.m_lo} from the longest position {self.longest}); check the positions "
                         "given to begin_step")
        raise ValueError("; ".join(parts))


def _device_positions(positions, num_kv_heads: int, buffers: PlanBuffers):
    """(per item [K], per sequence [B], next [B]) int64 views of ``buffers.positions`` (the same address every
    step), written from a host list (one copy) or a device tensor [B] (three launches)."""
    b = positions.numel() if isinstance(positions, torch.Tensor) else len(positions)
    k = b * num_kv_heads
    rows = buffers.positions(k + 2 * b)
    if isinstance(positions, torch.Tensor):
        seq = positions.to(rows.device, torch.int64)
        rows[:k].copy_(seq.repeat_interleave(num_kv_heads))
        rows[k:k + b].copy_(seq)
        rows[k + b:].copy_(seq + 1)
    else:
        host = [int(p) for p in positions]
        flat = torch.tensor([p for p in host for _ in range(num_kv_heads)] + host + [p + 1 for p in host],
                            dtype=torch.int64)
        rows.copy_(flat.pin_memory() if rows.device.type == "cuda" else flat, non_blocking=True)
    return rows[:k], rows[k:k + b], rows[k + b:]


def build_plan(kv, items: dict[int, torch.Tensor], positions, longest: int, num_kv_heads: int, *,
               backend: str, workspace: DecodeWorkspace, buffers: PlanBuffers,
               num_warps: int | None = None, bucket: int = 1) -> DecodePlan:
    """The plan of one decode step (module docstring).

    kv: the ``PagedKV``; items: table layer -> int64 [K] heads of the batch at that layer (``HeadSet.items``, on
    the tables' device); positions: the index of each sequence's new token, a host list of B ints (one copy to the
    device) or an int64 [B] device tensor; longest: their max (host int; an upper bound is enough); buffers: the
    flags (and outputs) of these sequences, with a flag for every layer of ``items``; bucket: of the width bounds
    (:func:`tier_bounds`).
    """
    layers = tuple(items)
    if not layers or any(layer not in buffers.layers for layer in layers):
        raise ValueError(f"a decode plan needs layers with flags in its buffers (layers {list(buffers.layers)}), "
                         f"got {list(layers)}")
    k = items[layers[0]].numel()
    if num_kv_heads < 1 or k % num_kv_heads or any(t.numel() != k or t.dtype != torch.int64 for t in items.values()):
        raise ValueError(f"every layer's items must be int64 [B * {num_kv_heads}], got "
                         f"{[(t.dtype, t.numel()) for t in items.values()]}")
    device = kv.tables.device
    per_item, seq, nxt = _device_positions(positions, num_kv_heads, buffers)
    if seq.numel() * num_kv_heads != k:
        raise ValueError(f"{seq.numel()} positions for {k // num_kv_heads} sequences")
    hi, lo = kv.layouts[HIGH_COL], kv.layouts[LOW_COL]
    m_hi, m_lo = tier_bounds((hi, lo), kv.config.two_tier, longest, kv.tables.width, bucket)
    max_pages = m_hi // hi.tokens_per_page + m_lo // lo.tokens_per_page
    return DecodePlan(layers, dict(items), k // num_kv_heads, num_kv_heads, per_item, seq, nxt, int(longest), m_hi,
                      m_lo, split_count(k, max_pages, device), num_warps, backend, workspace, buffers)
