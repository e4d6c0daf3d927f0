"""What every host of a KVStore checks and derives alike (``diffkv.cache.hosting``, ``KVStore.prompt_pages`` /
``step_pages`` / ``held``): one message for a config of the wrong model, page bounds that hold, one tally."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from diffkv import DiffKVConfig
from diffkv.cache.hosting import check_config, table_config
from diffkv.engine.cache import make_cache
from diffkv.integrations.transformers import DiffKVCache

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
CFG = DiffKVConfig(recent_window=4, score_window=8, raw_dtype="float32")


def tiny():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL)).eval()
    model.generation_config.eos_token_id = None
    return model


def test_every_host_refuses_thresholds_for_another_model_alike():
    model = tiny()
    wrong = dataclasses.replace(CFG, layer_alphas=((1.0, 0.02),) * 3)
    with pytest.raises(ValueError, match="thresholds for 3 layers but the model has 2"):
        DiffKVCache(model, wrong)
    with pytest.raises(ValueError, match="thresholds for 3 layers but the model has 2"):
        make_cache("diffkv", model, kv_budget_bytes=1 << 22, config=wrong)
    with pytest.raises(ValueError, match="my.json has thresholds for 3 layers"):
        check_config(wrong, num_layers=2, head_dim=16, source="my.json")
    with pytest.raises(ValueError):
        check_config(CFG, num_layers=2, head_dim=7)  # no page layout for an odd head size


def test_table_config_keeps_the_thresholds_of_the_paged_layers():
    alphas = ((1.0, 0.1), (2.0, 0.2), (3.0, 0.3), (4.0, 0.4))
    cfg = dataclasses.replace(CFG, layer_alphas=alphas)
    assert table_config(cfg, [1, 3]).layer_alphas == (alphas[1], alphas[3])
    assert table_config(CFG, [1, 3]) is CFG


def test_page_bounds_hold_and_the_tally_matches_the_tables():
    model = tiny()
    # both tiers and pruning (the tiny model's attention is near uniform: peaks just above 1 / n)
    cache = DiffKVCache(model, dataclasses.replace(CFG, alpha_high=4.0, alpha_low=1.2, importance="peak"))
    ids = torch.randint(3, 96, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    store = cache.store
    held = store.held(cache.slots)
    assert 0 < held["pages"] <= 2 * store.prompt_pages(37)
    tables = store.kv.tables
    assert held["tokens_high"] + held["tokens_low"] == int(tables.num_tokens.long().sum())
    assert held["pages"] == int(tables.num_pages.long().sum())
    assert held["tokens_low"] > 0 and held["tokens_high"] + held["tokens_low"] < 2 * 37 * 2 * 2
    for _ in range(6):  # a decode step adds at most step_pages per sequence
        before = store.held(cache.slots)["pages"]
        with torch.no_grad():
            model(torch.randint(3, 96, (2, 1)), past_key_values=cache, use_cache=True)
        assert store.held(cache.slots)["pages"] - before <= 2 * store.step_pages()
    assert store.held([cache.slots[0]])["pages"] + store.held([cache.slots[1]])["pages"] == store.held()["pages"]
