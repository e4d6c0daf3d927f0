"""The `diffkv` command line: one-line errors, lazy imports, default output folders."""

from __future__ import annotations

import subprocess
import sys

import pytest

from diffkv.cli import main
from diffkv.core.errors import UsageError


def test_model_typo_is_one_line_with_a_suggestion_and_no_hub_call(capsys, monkeypatch):
    import transformers

    def no_hub(*a, **k):
        raise AssertionError("the hub must not be asked for a registry-like name")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_hub)
    assert main(["demo", "--model", "smollm2-135"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean smollm2-135m?" in err and err.startswith("diffkv demo: error:")


def test_debug_shows_the_traceback():
    with pytest.raises(UsageError, match="did you mean qwen2.5-0.5b"):
        main(["--debug", "demo", "--model", "qwen2.5-0.5"])


def test_bad_tier_is_one_line(capsys):
    assert main(["layout", "--high", "K9V9"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_bugs_keep_their_traceback(monkeypatch):
    import diffkv.core.layout

    def boom(*a, **k):
        raise RuntimeError("a bug")

    monkeypatch.setattr(diffkv.core.layout, "plan_pages", boom)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["layout"])


def test_layout_and_help_do_not_import_torch():
    code = ("import sys; from diffkv.cli import main\n"
            "try:\n    main(['bench', 'decode', '--help'])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' in sys.modules, 'bench decode --help builds its real parser'\n")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    code = ("import sys; from diffkv.cli import main\nmain(['layout', '--head-dim', '64'])\n"
            "for argv in (['--help'], ['layout', '--help'], ['bench', '--help'], ['eval', 'list']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('diffkv'))\n")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_eval_writes_to_the_user_results_folder_by_default(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("DIFFKV_RESULTS", str(tmp_path))
    assert main(["eval", "report", "--json"]) == 0
    assert capsys.readouterr().out.strip() == "[]"  # nothing recorded there, and the checkout's results untouched
    from diffkv.eval.cli import _out

    class Args:
        out = None

    assert _out(Args) == str(tmp_path / "accuracy")


def test_module_entry_points_share_the_cli():
    out = subprocess.run([sys.executable, "-m", "diffkv.eval", "list"], check=True, capture_output=True, text=True)
    assert "diffkv" in out.stdout and "gsm8k" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "diffkv.calibration", "--model", "nope"], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "unknown model 'nope'" in bad.stderr and "Traceback" not in bad.stderr


def test_renamed_bench_flags_keep_their_recorded_spelling():
    from diffkv.cli import build_parser

    new = ["bench", "decode", "--context-tokens", "64", "--max-new-tokens", "3"]
    old = ["bench", "decode", "--context", "64", "--new-tokens", "3"]
    for argv in (new, old, ["bench", "decode", "--prompt-tokens", "64", "--new-tokens", "3"]):
        args = build_parser(argv).parse_args(argv)
        assert (args.context_tokens, args.max_new_tokens, args.json, args.no_progress) == (64, 3, False, False)
    args = build_parser(["bench", "memory"]).parse_args(["bench", "memory", "--backend", "c"])
    assert args.ring_backend == "c"


def test_serve_cache_flags_keep_their_old_backend_spelling(capsys):
    """``diffkv serve --cache`` and ``diffkv bench serve --caches`` were ``--backend`` / ``--backends`` before
    issue #32: the old spellings still parse (no model is loaded) but are not shown in the help."""
    from diffkv.cli import build_parser

    serve = ["serve", "--model", "m"]
    assert build_parser(serve).parse_args(serve).cache == "diffkv"
    for flag in ("--cache", "--backend"):
        assert build_parser(serve).parse_args([*serve, flag, "fp16"]).cache == "fp16"
    with pytest.raises(SystemExit):
        build_parser(serve).parse_args([*serve, "--backend", "int3"])
    bench = ["bench", "serve"]
    assert build_parser(bench).parse_args(bench).caches == "fp16,diffkv"
    for flag in ("--caches", "--backends"):
        assert build_parser(bench).parse_args([*bench, flag, "diffkv"]).caches == "diffkv"
    capsys.readouterr()
    for argv in (serve, bench):
        with pytest.raises(SystemExit):
            main([*argv, "--help"])
        text = capsys.readouterr().out
        assert "--cache" in text and "--backend" not in text


def test_bench_help_shows_only_the_current_flags(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "decode", "--help"])
    text = capsys.readouterr().out
    assert "--context-tokens" in text and "--no-progress" in text
    assert "--new-tokens" not in text.replace("--max-new-tokens", "") and "--prompt-tokens" not in text


def test_calibrate_writes_to_the_user_folder_and_prints_json(monkeypatch, tmp_path, capsys):
    import json

    import diffkv.registry.data
    import diffkv.registry.models
    from diffkv.eval.tiny import tiny_model_and_tokenizer
    from diffkv.profile import load_profile

    model, tok = tiny_model_and_tokenizer()
    monkeypatch.setattr(diffkv.registry.models, "load_model", lambda name: (model, tok))
    essays = [{"text": f"Essay {i}. " + "Words go on. " * 60} for i in range(30)]
    monkeypatch.setattr(diffkv.registry.data, "load_dataset", lambda name: essays)
    monkeypatch.setenv("DIFFKV_RESULTS", str(tmp_path))
    argv = ["calibrate", "--model", "tiny", "--quick", "--texts", "2", "--context-tokens", "48", "--decode-steps", "4",
            "--recent-window", "8", "--score-window", "8", "--stats-dir", str(tmp_path / "stats"), "--json",
            "--no-progress", "--max-kl", "10", "--compact-meta", "--symmetric-keys", "--rotate-values"]
    assert main(argv) == 0
    out = capsys.readouterr()
    printed = json.loads(out.out)  # stdout is the profile alone; the table went to stderr
    assert "chosen:" in out.err and printed["model"]["name"] == "tiny"
    config = load_profile(tmp_path / "profiles" / "tiny.json", model).config
    assert config.alpha_high == printed["config"]["alpha_high"] and config.compact_meta and config.symmetric_keys
    assert config.rotate_values and printed["config"]["rotate_values"]
    rows = printed["search"]["context_rows"]  # the context point (#62): repeat scores, scales until over budget
    assert [r["context_scale"] for r in rows] == [4.0, 16.0, 64.0]  # all within the budget of 10 nats
    best = max(rows, key=lambda r: (r["compression_physical"], -r["kl"]))
    assert config.context_scale == best["context_scale"]
    assert f"context point: repeat scores, peak importance, thresholds x {best['context_scale']:g}" in out.err
    # --context-of: only the context point of a profile, here under a budget the first scale already breaks
    again = tmp_path / "again.json"
    assert main([*argv[:-6], "--max-kl", "0", "--context-of", str(tmp_path / "profiles" / "tiny.json"),
                 "--out", str(again)]) == 0
    redone = load_profile(again, model)
    assert redone.config.context_scale == 4.0 and len(redone.search["context_rows"]) == 1
    assert redone.config.alpha_high == config.alpha_high  # the window point is kept


def test_a_multi_line_error_still_prints_one_line(monkeypatch, capsys):
    import diffkv.core.layout
    from diffkv.kernels.cbuild import CompileError

    def fails(*a, **k):
        raise CompileError("cc failed to build decode_cpu:\nerror: one\nerror: two")

    monkeypatch.setattr(diffkv.core.layout, "plan_pages", fails)
    assert main(["layout"]) == 2
    assert capsys.readouterr().err == "diffkv layout: error: cc failed to build decode_cpu: (more with --debug)\n"


def test_demo_takes_no_progress_and_json_and_shows_a_bar_per_cache(monkeypatch, capsys):
    import json

    import torch

    import diffkv.bench.common
    import diffkv.prompts
    import diffkv.registry.models
    from diffkv.cli import build_parser
    from diffkv.eval.tiny import tiny_model_and_tokenizer

    args = build_parser(["demo"]).parse_args(["demo", "--no-progress", "--json"])
    assert (args.no_progress, args.json) == (True, True)
    assert build_parser(["demo"]).parse_args(["demo"]).no_progress is False
    model, tok = tiny_model_and_tokenizer()
    monkeypatch.setattr(diffkv.registry.models, "load_model", lambda name: (model, tok))
    monkeypatch.setattr(diffkv.prompts, "essay_question_ids", lambda tok, n: torch.randint(3, 250, (1, n)))
    bars = []
    real = diffkv.bench.common.progress
    monkeypatch.setattr("diffkv.demo.progress", lambda a, total, unit, desc: bars.append((desc, total)) or
                        real(a, total, unit, desc))
    argv = ["demo", "--model", "tiny", "--context-tokens", "96", "--max-new-tokens", "4", "--json", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["prompt_tokens"] == 96 and out.err == ""
    assert bars == [("full cache", 4), ("DiffKV", 4)]


def test_serve_uses_the_model_s_shipped_profile_unless_told_otherwise():
    """``diffkv serve --profile`` defaults to ``auto``: the shipped profile of the model it serves (calibrated for
    it), ``DiffKVConfig()`` for a model without one or with ``--profile none``; a path or name is taken as is."""
    from diffkv.cli import build_parser
    from diffkv.profile import shipped_profiles
    from diffkv.serve.serve_cli import serve_profile

    serve = ["serve", "--model", "qwen2.5-0.5b"]
    assert build_parser(serve).parse_args(serve).profile == "auto"
    assert "qwen2.5-0.5b" in shipped_profiles()
    assert serve_profile("auto", "qwen2.5-0.5b") == "qwen2.5-0.5b"
    assert serve_profile("auto", "/some/local/folder") is None and serve_profile("none", "qwen2.5-0.5b") is None
    assert serve_profile("my.json", "qwen2.5-0.5b") == "my.json"
