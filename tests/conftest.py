"""Test setup: Triton runs under its CPU interpreter unless a GPU is present; `gpu` tests skip without CUDA."""

import os

import torch

# NOTE: must be set before any module with @triton.jit code is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
