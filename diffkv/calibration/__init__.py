"""Offline calibration of DiffKV thresholds: profile -> predict -> measure -> search -> Profile JSON.

Modules: ``profile`` (the versioned JSON artefact), ``hooks`` (explicit attention recording), ``profiler``
(importance statistics of a model on calibration text), ``predict`` (tier counts and physical compression of any
thresholds from those statistics), ``quality`` (KL / top-1 / perplexity of a config vs the full cache),
``search`` (global coordinate sweep and per-layer thresholds), ``cli`` (``diffkv calibrate``).
Nothing here runs at import time; import the submodule you need.
"""
