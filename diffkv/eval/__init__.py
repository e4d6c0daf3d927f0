"""Accuracy benchmarks: tasks, cache methods (DiffKV and baselines), a resumable runner and reports.

    python -m diffkv.eval run --model qwen2.5-0.5b --task gsm8k --methods full,diffkv,K4V4 --limit 10
    python -m diffkv.eval report
"""
