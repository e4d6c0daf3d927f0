"""Resumable evaluation runner: one (model, task, method) -> ``<out>/<model>/<task>/<method>/``.

Two ways to generate (``runner``): ``engine`` streams the samples through the continuous-batching engine
(:mod:`diffkv.eval.engine_runner`; methods with a page layout, generation tasks with the question in the prompt),
``generate`` runs ``model.generate`` over fixed left-padded batches (every method, the ``ask-after`` protocol and
perplexity; the reference path). ``auto`` (the default) takes the engine where it can, and a resumed run keeps the
runner it started with.

Files: ``config.json`` (the exact settings; a rerun with different settings is refused), ``samples.jsonl`` (one
line per finished sample, appended after every batch: a rerun skips the ids already there) and ``metrics.json``
(recomputed from the samples at the end, see ``diffkv.eval.metrics``).
"""

from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from diffkv.core.points import context_point
from diffkv.eval.engine_runner import DEFAULT_MAX_BATCH, engine_generate
from diffkv.eval.methods import METHOD_NAMES, RENAMED, STAT_KEYS, derive_budget, get_method, method_stats, recorded_spec
from diffkv.eval.metrics import compute_metrics
from diffkv.eval.protocol import DEFAULT_PROTOCOL, encode_prompt, question_tokens, task_protocol
from diffkv.eval.protocol import generate as protocol_generate
from diffkv.eval.tasks import get_task
from diffkv.hf.generation import continuation_nll, eos_ids
from diffkv.hf.repeat_scores import BRIDGE, repeat_prefill, repeat_scores
from diffkv.integrations.transformers import CHUNKED_PREFILL


@dataclass
class RunConfig:
    """Settings of one run: samples ``start .. start + limit`` of the task. ``budget=None``: derived from DiffKV's
    recorded compression (methods.derive_budget). Runs of other slices share a folder (rows are keyed by sample id;
    the metrics cover the slice asked for)."""

    model: str
    task: str
    method: str
    out: str = "benchmarks/accuracy"
    limit: int | None = None
    start: int = 0
    seed: int = 0
    batch_size: int = 4
    max_new_tokens: int | None = None
    budget: float | None = None
    profile: str | None = None
    task_options: dict = field(default_factory=dict)
    runner: str = "auto"
    max_batch: int = DEFAULT_MAX_BATCH
    prefill_chunk: int | None = None  # generate(prefill_chunk_size=...): the prompt arrives in chunks of this size
    chunked_prefill: str | None = None  # DiffKVCache(chunked_prefill=...) with prefill_chunk (default "extend")

    def model_tag(self) -> str:
        return Path(self.model).name if ("/" in self.model or Path(self.model).exists()) else self.model

    def run_dir(self) -> Path:
        """``out/model/task/method``, the method spec without characters a folder name should not have (quotes:
        ``diffkv@x4+importance="peak"`` runs in ``diffkv@x4+importance=peak``; config.json keeps the spec)."""
        return Path(self.out) / self.model_tag() / self.task / UNSAFE.sub("", self.method)


RUNNERS = ("auto", "engine", "generate")
UNSAFE = re.compile(r"[^A-Za-z0-9._@+=-]")  # left out of run folder names


def _identity(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k not in ("limit", "start", "out", "batch_size", "max_batch",
                                                 "budget_source")}


def _allow_more_samples(task, old: dict, new: dict) -> None:
    """A run of a task whose samples do not depend on how many are asked (``task.samples_grow``: sample i is the
    same for any count) resumes with more samples per family: ``old`` is taken to have asked the new count."""
    before, after = old.get("task_options") or {}, new.get("task_options") or {}
    if (getattr(task, "samples_grow", False) and isinstance(before.get("samples"), int)
            and isinstance(after.get("samples"), int) and after["samples"] >= before["samples"]):
        old["task_options"] = {**before, "samples": after["samples"]}


def engine_can_run(task, method, options: dict) -> bool:
    """Whether the engine path can run ``method`` on ``task``: a paged method the engine can hold, a generation
    task, the question in the prompt."""
    return (method.storage is not None and method.engine and task.kind == "generate"
            and task_protocol(task, options) == DEFAULT_PROTOCOL)


def _resolve_runner(cfg: RunConfig, task, method, old: dict | None) -> str:
    """``engine`` or ``generate`` for this run (``auto``: the resumed run's, else the engine where it can run)."""
    if cfg.runner not in RUNNERS:
        raise ValueError(f"unknown runner {cfg.runner!r}; choose one of {', '.join(RUNNERS)}")
    can = engine_can_run(task, method, cfg.task_options)
    if cfg.runner == "engine" and not can:
        raise ValueError(f"the engine cannot run {cfg.method!r} on {cfg.task!r} (it needs a paged method and a "
                         "generation task with the question in the prompt); use --runner generate")
    if cfg.prefill_chunk is not None:
        if cfg.runner == "engine":
            raise ValueError("--prefill-chunk runs on the generate runner (the engine prefills a prompt whole)")
        return "generate"
    if cfg.runner != "auto":
        return cfg.runner
    if old is not None:
        return old.get("runner", "generate")  # runs recorded before the engine path used generate()
    return "engine" if can else "generate"


def prepare_dir(cfg: RunConfig, overwrite: bool = False) -> tuple[Path, dict]:
    """Create the run folder and write/check ``config.json``. Returns (folder, resolved config dict)."""
    if cfg.start < 0 or cfg.max_batch < 1 or cfg.batch_size < 1:
        raise ValueError(f"start must be >= 0 (got {cfg.start}), max_batch and batch_size >= 1 (got {cfg.max_batch}, "
                         f"{cfg.batch_size})")
    task, method = get_task(cfg.task), get_method(cfg.method)
    resolved = asdict(cfg)
    if task_protocol(task, cfg.task_options) == DEFAULT_PROTOCOL:  # not recorded: runs from before the option resume
        resolved["task_options"] = {k: v for k, v in cfg.task_options.items() if k != "protocol"}
    if cfg.prefill_chunk is None:  # not recorded: runs from before the option resume
        resolved.pop("prefill_chunk")
        if cfg.chunked_prefill is not None:
            raise ValueError("--chunked-prefill needs --prefill-chunk (it says how the chunks are stored)")
    elif cfg.prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1 token, got {cfg.prefill_chunk}")
    if resolved.get("chunked_prefill") in (None, "extend"):  # not recorded: the default, as in runs made before it
        resolved.pop("chunked_prefill")
    elif cfg.chunked_prefill not in CHUNKED_PREFILL:
        raise ValueError(f"chunked_prefill must be one of {CHUNKED_PREFILL}, got {cfg.chunked_prefill!r}")
    resolved["max_new_tokens"] = cfg.max_new_tokens or task.max_new_tokens
    resolved["budget"], resolved["budget_source"] = None, None
    if method.fixed_budget is not None:
        if cfg.budget is not None and cfg.budget != method.fixed_budget:
            raise ValueError(f"method {cfg.method!r} fixes the keep ratio {method.fixed_budget:g}; --budget "
                             f"{cfg.budget:g} contradicts it (drop one)")
        resolved["budget"], resolved["budget_source"] = method.fixed_budget, "method name"
    elif method.uses_budget:
        resolved["budget"], resolved["budget_source"] = ((cfg.budget, "--budget") if cfg.budget is not None
                                                         else derive_budget(cfg.run_dir().parent))
    path = cfg.run_dir()
    config_file = path / "config.json"
    old = json.loads(config_file.read_text()) if config_file.is_file() and not overwrite else None
    resolved["runner"] = _resolve_runner(cfg, task, method, old)
    path.mkdir(parents=True, exist_ok=True)
    if cfg.method.split("@")[0].split("+")[0] in RENAMED and (old is None or "method_names" in old):
        resolved["method_names"] = METHOD_NAMES  # absent: recorded under the old names (methods.recorded_spec)
    if old is not None:
        old.setdefault("runner", "generate")
        if method.uses_budget and method.fixed_budget is None and cfg.budget is None:  # resume at its old budget
            resolved["budget"], resolved["budget_source"] = old.get("budget"), old.get("budget_source")
        _allow_more_samples(task, old, resolved)
        if _identity(old) != _identity(resolved):
            diff = {k: (old.get(k), v) for k, v in _identity(resolved).items() if old.get(k) != v}
            raise ValueError(f"{path} holds a run with other settings {diff} (old, new); pass --overwrite to "
                             "restart it or --out to write elsewhere")
    elif overwrite:
        for name in ("samples.jsonl", "metrics.json"):
            (path / name).unlink(missing_ok=True)
    config_file.write_text(json.dumps(resolved, indent=2) + "\n")
    return path, resolved


def done_ids(path: Path) -> set[str]:
    """Ids already in ``samples.jsonl`` (a torn last line from a killed run is ignored)."""
    ids = set()
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                ids.add(json.loads(line)["id"])
            except (json.JSONDecodeError, KeyError):
                continue
    return ids


def _left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r), 1
    return ids, mask


def build_cache(method, model, rc: dict, ask_after: bool = False):
    """A fresh cache of ``method``. In the ask-after protocol a DiffKV method runs at its config's context point
    (#62, ``diffkv.core.points.context_point``: the context is compressed before its question), unless its spec
    sets ``prompt_scores`` itself (``+prompt_scores="window"`` keeps window scores)."""
    if ask_after and method.storage is not None and "prompt_scores=" not in method.name:
        from diffkv.integrations.transformers import DiffKVCache

        return DiffKVCache(model, context_point(method.storage(model, rc["profile"])))
    return method.build(model, rc["budget"], rc["profile"])


def generate_batch(model, tokenizer, method, rc: dict, batch: list[dict], prompts: list[list[int]],
                   held: list[int] | None = None) -> list[dict]:
    """Greedy generation of one left-padded batch through a fresh cache. Returns one result row per sample.

    held: per sample, the question's tokens at the end of its prompt (``ask-after``: the batch prefills all but
    the last max(held) tokens, feeds those one per step, then generates; a row with a shorter question also feeds
    its last context tokens that way; see ``diffkv.eval.protocol``). A sample's ``max_new_tokens``, if set, cuts its
    answer there (the batch still decodes to the run's ``max_new_tokens``).
    """
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids, mask = _left_pad(prompts, pad)
    cache = build_cache(method, model, rc, ask_after=bool(held))
    held_back = max(held) if held else 0
    t0 = time.perf_counter()
    if getattr(getattr(cache, "config", None), "prompt_scores", "window") == "repeat":  # scored on what is prefilled
        start = ids.shape[1] - held_back
        bridge = tokenizer(BRIDGE, add_special_tokens=False).input_ids
        if held_back and len(batch) == 1:  # one forward scores and stores the context (feed_context goes on)
            repeat_prefill(model, cache, ids[:, :start], bridge)
        else:
            cache.set_prompt_scores(repeat_scores(model, ids[:, :start], mask[:, :start], bridge))
    chunk = {"prefill_chunk_size": rc["prefill_chunk"]} if rc.get("prefill_chunk") else {}
    if rc.get("chunked_prefill"):
        if not hasattr(cache, "chunked_prefill"):
            raise ValueError(f"--chunked-prefill applies to DiffKV caches, not {type(cache).__name__}")
        cache.chunked_prefill = rc["chunked_prefill"]
    out = protocol_generate(model, ids, mask, cache, held_back, max_new_tokens=rc["max_new_tokens"],
                            do_sample=False, pad_token_id=pad, **chunk)
    seconds = time.perf_counter() - t0
    new = out[:, ids.shape[1]:]
    stats = method_stats(cache, model, int(mask.sum()) + len(batch) * max(new.shape[1] - 1, 0))
    if hasattr(cache, "release"):
        cache.release()
    stats = {k: stats.get(k) for k in STAT_KEYS}
    key, eos, rows = f"{time.time_ns()}-{batch[0]['id']}", eos_ids(model, tokenizer), []
    for sample, prompt, gen in zip(batch, prompts, new.tolist(), strict=True):
        gen = gen[:sample.get("max_new_tokens") or len(gen)]  # a sample's own budget (ruler's families), if fewer
        stop = next((i for i, t in enumerate(gen) if t in eos), len(gen))
        text = tokenizer.decode(gen[:stop], skip_special_tokens=True)
        rows.append({"id": sample["id"], "reference": sample["reference"], "output": text,
                     "prompt_tokens": len(prompt), "new_tokens": stop, **get_task(rc["task"]).score(sample, text),
                     "batch": key, "batch_seconds": round(seconds, 2), "batch_stats": stats,
                     **({"held_back": held_back} if held_back else {})})
    return rows


def ppl_batch(model, method, rc: dict, batch: list[dict]) -> list[dict]:
    """Teacher-forced continuation NLL of equal-length samples, one token per step through a fresh cache."""
    ids = torch.tensor([s["ids"] for s in batch])  # [B, context + C]
    context = batch[0]["context"]
    cache = method.build(model, rc["budget"], rc["profile"])
    nll = continuation_nll(model, ids, context, cache)
    stats = method_stats(cache, model, len(batch) * (ids.shape[1] - 1))
    if hasattr(cache, "release"):
        cache.release()
    stats, key = {k: stats.get(k) for k in STAT_KEYS}, f"{time.time_ns()}-{batch[0]['id']}"
    cont = ids.shape[1] - context
    return [{"id": s["id"], "reference": None, "nll": float(v) / cont, "tokens": cont, "batch": key,
             "batch_stats": stats} for s, v in zip(batch, nll, strict=True)]


def run_eval(cfg: RunConfig, model=None, tokenizer=None, overwrite: bool = False, progress: bool = True) -> dict:
    """Run (or resume) one evaluation and return its metrics (also written to ``metrics.json``)."""
    from tqdm import tqdm

    path, rc = prepare_dir(cfg, overwrite)
    task, method = get_task(cfg.task), get_method(recorded_spec(cfg.method, rc))
    if model is None:
        from diffkv.registry.models import load_model

        model, tokenizer = load_model(cfg.model)
    torch.manual_seed(cfg.seed)
    samples = task.samples(tokenizer, cfg.seed, cfg.task_options)[cfg.start:][:cfg.limit]
    done = done_ids(path / "samples.jsonl")
    pending = [s for s in samples if s["id"] not in done]
    prompts = {s["id"]: encode_prompt(tokenizer, s) for s in pending} if task.kind == "generate" else {}
    pending.sort(key=lambda s: len(prompts.get(s["id"], ())))  # similar lengths batch with little padding
    ask_after = task_protocol(task, cfg.task_options) == "ask-after"
    held = {s["id"]: question_tokens(tokenizer, s, prompts[s["id"]]) for s in pending} if ask_after else {}
    bar = tqdm(total=len(samples), initial=len(samples) - len(pending), unit="sample", file=sys.stderr,
               desc=f"{cfg.task}/{cfg.method}", disable=not progress, dynamic_ncols=True)
    with open(path / "samples.jsonl", "a", encoding="utf-8") as f:
        if rc["runner"] == "engine":
            def write(row):
                f.write(json.dumps(row) + "\n")
                f.flush()
                bar.update(1)

            engine_generate(model, tokenizer, method, rc, pending, prompts, cfg.max_batch, write)
            pending = []
        for i in range(0, len(pending), cfg.batch_size):
            batch = pending[i:i + cfg.batch_size]
            if task.kind == "ppl":
                rows = ppl_batch(model, method, rc, batch)
            else:
                rows = generate_batch(model, tokenizer, method, rc, batch, [prompts[s["id"]] for s in batch],
                                      [held[s["id"]] for s in batch] if held else None)
            f.write("".join(json.dumps(r) + "\n" for r in rows))
            f.flush()
            bar.update(len(rows))
    bar.close()
    metrics = compute_metrics(path, [s["id"] for s in samples], rc)
    (path / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics
