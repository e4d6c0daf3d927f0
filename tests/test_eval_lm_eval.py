"""lm-eval integration: the ``diffkv`` model type on a tiny random Llama with the shipped local tasks (offline)."""

from pathlib import Path

import pytest

from diffkv.eval.tiny import save_tiny
from diffkv.registry import data as data_module

lm_eval = pytest.importorskip("lm_eval")
TASKS = str(Path(__file__).resolve().parents[1] / "diffkv" / "lm_eval_tasks")


def fake_data(name):
    if name == "gsm8k":
        return [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(4)]
    return [{"question": f"Q{i}?", "choices": ["a", "b", "c", "d"], "answer": i % 4} for i in range(4)]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny"))


def evaluate(model, task, **kw):
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=TASKS, include_defaults=False)  # indexing lm-eval's own tasks takes ~10 s
    return lm_eval.simple_evaluate(model=model, tasks=[task], limit=2, task_manager=manager, **kw)


def test_registered_model_runs_local_gsm8k(tiny_path, monkeypatch):
    from diffkv.integrations.lm_eval import register

    monkeypatch.setattr(data_module, "load_dataset", fake_data)
    cls = register()
    assert register() is cls  # idempotent
    lm = cls(pretrained=str(tiny_path), method="h2o", budget=0.5, batch_size=2)
    res = evaluate(lm, "diffkv_gsm8k", gen_kwargs="max_gen_toks=6")
    assert res["results"]["diffkv_gsm8k"]["sample_len"] == 2
    assert "exact_match,strict-match" in res["results"]["diffkv_gsm8k"]
    assert lm.cache_stats and lm.compression()["compression_physical"] > 1.2  # generation went through the cache
    by_name = evaluate("diffkv", "diffkv_gsm8k", model_args=f"pretrained={tiny_path},method=K4V4",
                       gen_kwargs="max_gen_toks=4")
    assert by_name["results"]["diffkv_gsm8k"]["sample_len"] == 2


def test_loglikelihood_task_is_prefill_only(tiny_path, monkeypatch):
    from diffkv.integrations.lm_eval import model_class

    monkeypatch.setattr(data_module, "load_dataset", fake_data)
    accs = {}
    for method in ("full", "diffkv"):
        lm = model_class()(pretrained=str(tiny_path), method=method, batch_size=4)
        res = evaluate(lm, "diffkv_gpqa_diamond")
        accs[method] = res["results"]["diffkv_gpqa_diamond"]["acc,none"]
    assert accs["full"] == accs["diffkv"]  # dense prefill attention: same likelihoods
