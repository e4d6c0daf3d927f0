"""What the DiffKV vLLM backend stores and how much it tells vLLM each token costs (read from the environment,
which vLLM's spawned engine and worker processes inherit). Imports nothing from vLLM.

``DIFFKV_VLLM_PROFILE``: a calibrated profile (path or shipped name); else ``DIFFKV_VLLM_CONFIG``:
``default`` (``DiffKVConfig()``), ``exact`` (one 16-bit tier in the model dtype, nothing pruned: for tests) or a
JSON object of ``DiffKVConfig`` fields (e.g. ``{"importance": "peak", "alpha_high": 1.5}``).

``DIFFKV_VLLM_ADMIT`` sets the bytes per token and KV head that vLLM's block accounting charges
(``KVCacheSpec.state_content_bytes``, so vLLM's blocks, its admission and its preemption all count them):

* ``safe`` (default): an upper bound of what DiffKV can hold for that token, every token in the high tier plus
  three pages of slack per head and request (two partial tier pages, one reserved ahead) spread over one vLLM
  block. Whatever vLLM admits fits the pool, so vLLM preempts by its own accounting and the pool never runs short.
* a number ``r`` > 1: charge the model dtype's bytes / ``r`` (the profile's expected compression). vLLM promises
  more; use it with the KV connector (:mod:`.connector`): new prompts wait until the pool has their pages, and
  vLLM sees only the free blocks the pool has room for, so it preempts running requests before they outgrow the
  pool. Without the connector a request that compresses worse than ``r`` can exhaust the pool: the step then
  fails with :class:`~diffkv.memory.PoolExhausted`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from diffkv.cache.hosting import check_config
from diffkv.core.config import DiffKVConfig, fp16_config
from diffkv.core.layout import PagePlan, plan_for_config

PROFILE_ENV, CONFIG_ENV, ADMIT_ENV = "DIFFKV_VLLM_PROFILE", "DIFFKV_VLLM_CONFIG", "DIFFKV_VLLM_ADMIT"
PREFIXES_ENV = "DIFFKV_VLLM_PREFIXES"  # the most shared prefixes held (:mod:`.prefix_map`), default 8
SLACK_PAGES = 3  # per head and request: a partial high page, a partial low page, a page reserved ahead
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class Settings:
    config: DiffKVConfig
    plan: PagePlan
    admit: str  # "safe" or the expected compression as a string
    source: str  # where the config came from, for the log line

    def bytes_per_token(self, head_size: int, block_size: int, dtype_bytes: int) -> int:
        """Bytes per token and KV head vLLM is told (a multiple of 8 so vLLM's typed views of its buffer work)."""
        if self.admit == "safe":
            high_tokens = self.plan.layout(self.config.high).tokens_per_page
            raw = self.plan.page_bytes / high_tokens + SLACK_PAGES * self.plan.page_bytes / block_size
        else:
            raw = 2 * head_size * dtype_bytes / float(self.admit)
        return 8 * math.ceil(raw / 8)


def read_settings(head_size: int, model_dtype: str, num_layers: int | None = None) -> Settings:
    """The backend's settings from the environment, validated for this model (head_size, and with a profile its
    per-layer thresholds against ``num_layers``). Raises ValueError naming the variable at fault."""
    profile, name = os.environ.get(PROFILE_ENV, ""), os.environ.get(CONFIG_ENV, "default")
    if profile:
        from diffkv.profile import load_profile

        config, source = load_profile(profile).config, f"profile {profile}"
    elif name == "exact":
        config, source = fp16_config(model_dtype), "exact (K16V16, alpha 0)"
    elif name == "default":
        config, source = DiffKVConfig(), "DiffKVConfig() defaults"
    elif name.lstrip().startswith("{"):
        config, source = _json_config(name), f"{CONFIG_ENV} (JSON)"
    else:
        raise ValueError(f"{CONFIG_ENV}={name!r}: use 'default', 'exact' or a JSON object of DiffKVConfig fields, or "
                         f"set {PROFILE_ENV}")
    if config.score_spans:
        raise ValueError(f"{PROFILE_ENV if profile else CONFIG_ENV}: score_spans needs each prompt's token ids in the "
                         "store, which the vLLM plug-in does not pass yet; use a config without it (the serving "
                         "engine, diffkv serve, supports it)")
    if num_layers is None:
        config.validate(head_size)
    else:
        check_config(config, num_layers=num_layers, head_dim=head_size, source=f"{PROFILE_ENV}={profile or name}")
    admit = os.environ.get(ADMIT_ENV, "safe")
    if admit != "safe":
        try:
            ok = float(admit) > 1
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"{ADMIT_ENV}={admit!r}: use 'safe' or an expected compression ratio > 1 (e.g. 3.5)")
    return Settings(config, plan_for_config(config, head_size), admit, source)


def read_max_prefixes() -> int:
    """``DIFFKV_VLLM_PREFIXES``: the most shared prefixes the workers hold (default 8). Raises ValueError."""
    raw = os.environ.get(PREFIXES_ENV, "8")
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{PREFIXES_ENV}={raw!r}: use a whole number >= 1")
    return int(raw)


def _json_config(text: str) -> DiffKVConfig:
    try:
        fields = json.loads(text)
        if not isinstance(fields, dict):
            raise TypeError("not an object")
        return DiffKVConfig(**fields)
    except (json.JSONDecodeError, TypeError) as err:
        raise ValueError(f"{CONFIG_ENV}: not a JSON object of DiffKVConfig fields ({err})") from None
