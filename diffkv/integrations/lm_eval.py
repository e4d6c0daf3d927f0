"""``diffkv`` model type for lm-evaluation-harness (0.4.x): its HF model with a compressed KV cache.

    python -m diffkv.integrations.lm_eval run --model diffkv \\
        --model_args pretrained=qwen2.5-0.5b,method=diffkv --tasks diffkv_gsm8k --limit 10

(the shipped offline tasks, ``diffkv_gsm8k`` and ``diffkv_gpqa_diamond`` in ``diffkv/lm_eval_tasks/``, are found
without ``--include_path``).

or from Python: ``register()`` then ``lm_eval.simple_evaluate(model="diffkv", model_args=..., ...)``, or pass a
:class:`DiffKVLM` instance as ``model``. lm-eval 0.4.13 discovers no third-party models by itself, so the plain
``lm_eval`` command cannot see ``diffkv``: use the module entry point above, which registers it and then runs
lm-eval's own CLI unchanged.

``pretrained`` is a registry name (``smollm2-135m``, ``qwen2.5-0.5b``, ``gemma3-270m``), a local folder or a hub
id; ``method`` is any name of ``diffkv.eval.methods.METHODS`` (``diffkv``, ``full``, ``K4V4``, ``kivi2``, ``h2o``,
...) or spec (``h2o@0.25``, ``diffkv@x4``), ``profile`` a calibrated profile for ``method=diffkv`` and ``budget``
the token ratio of eviction methods.

**What is measured.** ``generate_until`` tasks (e.g. the shipped ``diffkv_gsm8k``) decode through the compressed
cache. ``loglikelihood`` / ``multiple_choice`` tasks score every continuation in **one prefill pass**: DiffKV (and
the eviction baselines) attend densely during prefill and compress only what later decode steps would read, so
those tasks exercise prefill only and report full-cache likelihoods; use generation tasks (or ``diffkv eval --task
ppl``, which decodes the continuation token by token through the cache) to measure the effect of compression.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

MODEL_NAME = "diffkv"
TASKS_DIR = Path(__file__).resolve().parents[1] / "lm_eval_tasks"  # installed with the package
_CLASS = None


def _build_class():
    from lm_eval.models.huggingface import HFLM

    from diffkv.eval.methods import get_method, method_stats
    from diffkv.registry.models import resolve_model

    class DiffKVLM(HFLM):
        """lm-eval HF causal LM whose every forward / generate call runs through a fresh cache of ``method``."""

        def __init__(self, pretrained, method: str = "diffkv", profile: str | None = None,
                     budget: float | None = None, dtype: str = "float32", **kwargs):
            self.method = get_method(str(method))
            self.profile, self.budget = profile, self.method.fixed_budget if budget is None else float(budget)
            self.cache_stats: list[dict] = []
            if isinstance(pretrained, str):
                pretrained = str(resolve_model(pretrained))
            kwargs.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
            super().__init__(pretrained=pretrained, dtype=dtype, **kwargs)

        def _new_cache(self):
            return self.method.build(self.model, self.budget, self.profile)

        def _record(self, cache, tokens_seen: int) -> None:
            self.cache_stats.append(method_stats(cache, self.model, tokens_seen))
            if hasattr(cache, "release"):
                cache.release()

        def _model_call(self, inps, attn_mask=None, labels=None):
            """inps: [B, T] token ids. Returns logits [B, T, V] from one prefill through a fresh cache."""
            if attn_mask is not None or labels is not None:
                return super()._model_call(inps, attn_mask, labels)
            cache = self._new_cache()
            with torch.no_grad():
                logits = self.model(inps, past_key_values=cache, use_cache=True).logits
            self._record(cache, inps.numel())
            return logits

        def _model_generate(self, context, max_length, stop, **generation_kwargs):
            """context: [B, T] left-padded ids. Greedy/sampled generation through a fresh cache."""
            cache = self._new_cache()
            out = super()._model_generate(context, max_length, stop, past_key_values=cache, **generation_kwargs)
            mask = generation_kwargs.get("attention_mask")
            prompt = int(mask.sum()) if mask is not None else context.numel()
            self._record(cache, prompt + context.shape[0] * max(out.shape[1] - context.shape[1] - 1, 0))
            return out

        def compression(self) -> dict:
            """Aggregate physical compression over every cache used so far (fp16 bytes / bytes kept)."""
            fp16 = sum(s.get("fp16_bytes") or 0 for s in self.cache_stats)
            kept = sum(s.get("bytes_in_pages") or 0 for s in self.cache_stats)
            return {"method": self.method.name, "calls": len(self.cache_stats),
                    "compression_physical": fp16 / kept if kept else None}

    return DiffKVLM


def model_class():
    """The :class:`DiffKVLM` class (built on first use, so importing this module does not import lm-eval)."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _build_class()
    return _CLASS


def register() -> type:
    """Register ``diffkv`` in lm-eval's model registry (idempotent). Returns the model class."""
    from lm_eval.api.registry import get_model, register_model

    cls = model_class()
    try:
        if get_model(MODEL_NAME) is cls:
            return cls
    except ValueError:
        pass
    register_model(MODEL_NAME)(cls)
    return cls


def main(argv: list[str] | None = None) -> None:
    """lm-eval's CLI with ``diffkv`` registered and the shipped tasks on the include path (arguments as for
    ``lm_eval``)."""
    from lm_eval.__main__ import cli_evaluate

    register()
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--include_path" not in argv:
        argv += ["--include_path", str(TASKS_DIR)]
    sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
