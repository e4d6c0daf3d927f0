"""Issue #44's lossless check on a real model (smollm2-135m, fetched offline): with K16V16 and alpha = 0 a DiffKV
cache is exact, so chunked prefill, a 3-turn chat and prompt-lookup decoding must give DynamicCache's tokens."""

import pytest
import torch
from transformers import DynamicCache

from diffkv import DiffKVConfig
from diffkv.integrations.transformers import DiffKVCache

LOSSLESS = DiffKVConfig(high="K16V16", low="K16V16", alpha_high=0.0, alpha_low=0.0, raw_dtype="float32",
                        smooth_keys=False)
BACKENDS = ["torch", "cpu"]  # Triton: the same checks on tiny models under the interpreter (test_conversation.py)


@pytest.fixture(scope="module")
def smollm2():
    from diffkv.registry.models import load_model

    return load_model("smollm2-135m")


def greedy(model, cache, ids, n, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, **kw)


def essay(tok, n):
    from diffkv.prompts import essay_tokens

    return torch.tensor([essay_tokens(tok, n)])


@pytest.mark.real_model
@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_is_lossless(smollm2, backend):
    model, tok = smollm2
    ids = essay(tok, 600)
    want = greedy(model, DynamicCache(config=model.config), ids, 12)
    for chunk in (64, 512) if backend == "cpu" else (512,):  # the torch reference: ~1 ms a decode step per layer
        for mode in ("extend", "deferred"):
            cache = DiffKVCache(model, LOSSLESS, attention_backend=backend, chunked_prefill=mode)
            assert torch.equal(greedy(model, cache, ids, 12, prefill_chunk_size=chunk), want), (chunk, mode)


@pytest.mark.real_model
@pytest.mark.parametrize("backend", BACKENDS)
def test_three_turn_chat_is_lossless(smollm2, backend):
    model, tok = smollm2
    context = tok.decode(essay(tok, 300)[0])
    questions = [f"{context}\n\nWhat is this text about?", "Name one example it gives.", "Say it in five words."]
    outs = {}
    for name in ("dynamic", "diffkv"):
        cache = DynamicCache(config=model.config) if name == "dynamic" else \
            DiffKVCache(model, LOSSLESS, attention_backend=backend)
        messages, ids = [], None
        for q in questions:
            messages.append({"role": "user", "content": q})
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
            ids = ids["input_ids"]
            out = greedy(model, cache, ids, 10)
            messages.append({"role": "assistant", "content": tok.decode(out[0, ids.shape[1]:],
                                                                        skip_special_tokens=True)})
        outs[name] = [m["content"] for m in messages]
    assert outs["diffkv"] == outs["dynamic"]


@pytest.mark.real_model
@pytest.mark.parametrize("backend", BACKENDS)
def test_prompt_lookup_decoding_is_lossless(smollm2, backend):
    model, tok = smollm2
    ids = essay(tok, 200)
    ids = torch.cat([ids, ids[:, :40]], 1)  # the text starts again: the lookup finds long drafts
    want = greedy(model, DynamicCache(config=model.config), ids, 24)
    cache = DiffKVCache(model, LOSSLESS, attention_backend=backend)
    assert torch.equal(greedy(model, cache, ids, 24, prompt_lookup_num_tokens=8), want)


@pytest.mark.real_model
def test_prompt_lookup_decoding_gives_plain_decoding_s_tokens_on_a_compressing_cache(smollm2):
    """Issue #62 item 4 on the prompt where it was found (``benchmarks/serve/batch_invariance/prompt_lookup.py``):
    with DiffKVConfig() the two texts part at token 16 when the prompt is stored by the first call (its split then
    saw the drafts sent with it), at 26 when a crop leaves the dropped drafts' attention in the scores; with the
    prompt staged (its attention in fixed row blocks), crops that restore the scores, and the linear layers in
    fixed row blocks, prompt-lookup decoding gives plain decoding's 32 tokens."""
    from diffkv.engine.invariance import invariant_rows
    from diffkv.registry.data import load_dataset

    model, tok = smollm2
    text = load_dataset("pg-essays")[3]["text"][:4000] + "\n\nSummarize the essay above in one paragraph:\n"
    ids = tok(text, return_tensors="pt")["input_ids"][:, -794:]
    with invariant_rows(model):
        outs = [greedy(model, DiffKVCache(model, DiffKVConfig(), chunked_prefill="deferred"), ids, 32, **kw)
                for kw in ({}, {"prompt_lookup_num_tokens": 10})]
    assert torch.equal(outs[1], outs[0])


@pytest.mark.real_model
def test_a_draft_accepted_from_the_prompt_s_own_call_is_stored_as_plain_decoding_stores_it(smollm2):
    """Essay 13 with the shipped profile: the first call's first draft is accepted. Staged ("deferred") the cache
    stores it as part of the prompt and the text parts at token 4; told the prompt's length it appends it as a
    decode step and the 12 tokens are plain decoding's."""
    from diffkv.engine.invariance import invariant_rows
    from diffkv.registry.data import load_dataset

    model, tok = smollm2
    text = load_dataset("pg-essays")[13]["text"][:4000] + "\n\nSummarize the essay above in one paragraph:\n"
    ids = tok(text, return_tensors="pt")["input_ids"][:, -794:]
    outs = []
    with invariant_rows(model):
        for kw in ({}, {"prompt_lookup_num_tokens": 10}):
            cache = DiffKVCache.from_profile(model, "profiles/smollm2-135m.json")
            cache.set_prompt_length(ids.shape[1])
            outs.append(greedy(model, cache, ids, 12, **kw))
    assert torch.equal(outs[1], outs[0])
