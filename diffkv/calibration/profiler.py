"""Profiling pass: importance statistics of a model on calibration text, with the full cache.

One causal forward per batch of texts gives everything the search needs: the prefill score of every prompt token
(exactly as the cache computes it), the decode-step attention of the continuation queries (teacher forcing), and
the reference next-token log-probabilities. Statistics are stored as safetensors (tensors + JSON metadata, never
pickle) so that later searches reuse them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from diffkv.calibration.hooks import ImportanceRecorder, recording
from diffkv.profile import model_fingerprint

DATASETS = ("pg-essays", "champ")


def calibration_texts(tokenizer, data: str, num_texts: int, num_tokens: int, first: int = 0) -> torch.Tensor:
    """``num_texts`` disjoint windows of ``num_tokens`` tokens, cut from the documents of ``data`` from ``first`` on.

    Returns ids [num_texts, num_tokens] int64. Only PG essays and CHAMP are allowed: evaluation sets (GSM8K test,
    AIME, GPQA) must never be calibration data.
    """
    from diffkv.registry.data import load_dataset

    if data not in DATASETS:
        raise ValueError(f"calibration data must be one of {DATASETS} (never an evaluation set), got {data!r}")
    rows = load_dataset(data)
    docs = [r["text"] for r in rows] if data == "pg-essays" else [f"Problem: {r['problem']}\nAnswer: {r['answer']}"
                                                                   for r in rows]
    if not 0 <= first < len(docs):
        raise ValueError(f"--first-doc {first} is outside the {len(docs)} documents of {data}")
    ids: list[int] = []
    for doc in docs[first:]:
        ids += tokenizer(doc + "\n\n", add_special_tokens=False).input_ids
        if len(ids) >= num_texts * num_tokens:
            break
    if len(ids) < num_texts * num_tokens:
        raise ValueError(f"{data} from document {first} holds {len(ids)} tokens, fewer than {num_texts} x "
                         f"{num_tokens}; use fewer or shorter texts or a smaller --first-doc")
    return torch.tensor(ids[:num_texts * num_tokens]).view(num_texts, num_tokens)


@dataclass
class ImportanceStats:
    """Recorded statistics for ``N`` texts, the ``layers`` recorded (full attention) and ``H`` KV heads.

    prefill_score: [N, layers, H, context] fp32; decode_gain: [N, layers, H, steps, context + steps] fp16
    (max over the GQA group of the full-cache attention of decode query s, zero beyond its own position);
    ref_logprobs: [N, steps, V] fp32 log-probabilities of the full cache for tokens context+1 .. context+steps;
    ids: [N, context + steps + 1] int64 the texts. ``meta``: fingerprint, data, windows (JSON-able).
    """

    prefill_score: torch.Tensor
    decode_gain: torch.Tensor
    ref_logprobs: torch.Tensor
    ids: torch.Tensor
    layers: list[int]
    meta: dict

    @property
    def context(self) -> int:
        return self.prefill_score.shape[-1]

    @property
    def steps(self) -> int:
        return self.decode_gain.shape[3]

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        tensors = {"prefill_score": self.prefill_score.contiguous(), "decode_gain": self.decode_gain.contiguous(),
                   "ref_logprobs": self.ref_logprobs.contiguous(), "ids": self.ids.contiguous()}
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, str(tmp), metadata={"meta": json.dumps({**self.meta, "layers": self.layers})})
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> ImportanceStats:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = json.loads(f.metadata()["meta"])
            t = {k: f.get_tensor(k) for k in f.keys()}
        layers = meta.pop("layers")
        return cls(t["prefill_score"], t["decode_gain"], t["ref_logprobs"], t["ids"], layers, meta)


@torch.no_grad()
def profile_model(model, ids: torch.Tensor, context: int, score_window: int, meta: dict | None = None,
                  batch_size: int = 2, progress: bool = True) -> ImportanceStats:
    """Run the full-cache forward over ``ids`` [N, context + steps + 1] and record importance statistics."""
    from tqdm.auto import tqdm

    n, total = ids.shape
    steps = total - context - 1
    if context < 1 or steps < 1:
        raise ValueError(f"texts of {total} tokens leave no decode steps after a context of {context}")
    pre, dec, ref = [], [], []
    for i in tqdm(range(0, n, batch_size), desc="profile", unit="batch", disable=not progress):
        rec = ImportanceRecorder(context, steps, score_window)
        with recording(model, rec):
            logits = model(ids[i:i + batch_size, :-1], use_cache=False).logits  # [b, total - 1, V]
        layers = sorted(rec.prefill)
        pre.append(torch.stack([rec.prefill[k] for k in layers], 1))
        dec.append(torch.stack([rec.decode[k] for k in layers], 1))
        ref.append(torch.log_softmax(logits[:, context:].float(), -1))
    meta = {**model_fingerprint(model), **(meta or {}), "context": context, "steps": steps,
            "score_window": score_window}
    return ImportanceStats(torch.cat(pre), torch.cat(dec), torch.cat(ref), ids.clone(), layers, meta)
