"""A tiny random Llama with a byte-level tokenizer, built offline: for tests and smoke runs of the harness.

    model, tokenizer = tiny_model_and_tokenizer()
    save_tiny(path)   # a folder that ``load_model(path)``, lm-eval's HF model and ``--model PATH`` accept
"""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def byte_tokenizer():
    """A byte-level BPE tokenizer without merges (256 byte tokens + ``<pad>``, ``<bos>``, ``<eos>``), left padding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                  padding_side="left", model_max_length=4096)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_model_and_tokenizer(seed: int = 0, layers: int = 2, hidden: int = 64):
    """A random ``LlamaForCausalLM`` (GQA 4/2, fp32, eval mode) and :func:`byte_tokenizer`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = byte_tokenizer()
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def save_tiny(path: str | Path, seed: int = 0) -> Path:
    """Save :func:`tiny_model_and_tokenizer` to ``path`` (safetensors + tokenizer files). Returns ``path``."""
    model, tok = tiny_model_and_tokenizer(seed)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return Path(path)
