"""benchmarks/suites/run.py (issue #47): every suite's --dry-run works and names what exists (the diffkv subcommands
and their options, eval methods, tasks and profiles, scripts and their options), every output lands in the suite
folder, the folder is named <date>-<commit>[-dirty][-smoke], `list` lists the six, an unknown name is refused.
No benchmark runs: the one run here is of stand-in commands (python -c)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "benchmarks" / "suites" / "run.py"
NAMES = ["accuracy-frontier", "memory", "decode", "serve", "vllm", "calibration"]
FOLDER = re.compile(r"\d{4}-\d{2}-\d{2}-[0-9a-f]{4,40}(-dirty)?(-smoke)?(-\d+)?")


def load_run():
    spec = importlib.util.spec_from_file_location("suites_run", RUN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(RUN), *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_list_lists_the_six_suites():
    proc = cli("list")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines] == NAMES
    assert set(load_run().SUITES) == set(NAMES)


def test_an_unknown_suite_is_refused_with_the_known_names():
    proc = cli("no-such-suite", "--dry-run")
    assert proc.returncode != 0
    assert "no-such-suite" in proc.stderr and all(name in proc.stderr for name in NAMES)


@pytest.mark.parametrize("smoke", [False, True], ids=["headline", "smoke"])
@pytest.mark.parametrize("name", NAMES)
def test_dry_run_prints_the_folder_and_commands_and_runs_nothing(name, smoke):
    proc = cli(name, "--dry-run", *(["--smoke"] if smoke else []))
    assert proc.returncode == 0, proc.stderr
    folder = Path(re.search(r"^folder: (.+)$", proc.stdout, re.M).group(1))
    assert folder.parent == ROOT / "benchmarks" / "results" / name
    assert FOLDER.fullmatch(folder.name) and folder.name.endswith("-smoke") == smoke, folder.name
    assert not (folder / "suite.json").exists()  # nothing written
    run = load_run()
    for cmd in run.SUITES[name].commands(smoke):
        assert run.shown(cmd, run.resolve(cmd, folder), folder) in proc.stdout


def check_diffkv_command(args: list[str], out: Path) -> None:
    """``args`` (after ``diffkv``) parse with the CLI's parser; eval's methods, tasks and profiles exist."""
    from diffkv.cli import build_parser

    ns = build_parser(args).parse_args(args)  # an unknown subcommand or option exits here
    assert ns.command == args[0] and hasattr(ns, "func")
    if getattr(ns, "profile", None):
        from diffkv.profile import resolve_profile

        assert resolve_profile(ns.profile).is_file()
    if args[:2] == ["eval", "run"]:
        from diffkv.eval.methods import get_method
        from diffkv.eval.tasks import TASKS

        assert ns.task in TASKS
        for method in ns.methods.split(","):
            get_method(method)
    for key in ("out", "stats_dir"):  # every output goes into the suite folder
        if getattr(ns, key, None):
            assert Path(getattr(ns, key)).is_relative_to(out), (key, getattr(ns, key))


@pytest.mark.parametrize("smoke", [False, True], ids=["headline", "smoke"])
@pytest.mark.parametrize("name", NAMES)
def test_commands_name_existing_subcommands_scripts_and_options(name, smoke, tmp_path):
    run = load_run()
    out = tmp_path / "suite"
    cmds = run.SUITES[name].commands(smoke)
    assert cmds
    for cmd in cmds:
        argv = run.resolve(cmd, out)
        assert "{" not in " ".join(argv), argv  # every placeholder filled
        assert cmd.stdout is None or "/" not in cmd.stdout
        if argv[1:3] == ["-m", "diffkv.cli"]:
            assert argv[0] == run.rel(sys.executable)
            check_diffkv_command(argv[3:], out)
        elif argv[1:3] == ["-m", "diffkv.eval"]:
            check_diffkv_command(["eval", *argv[3:]], out)
        else:  # a script of the repository, run by its venv's python
            script = ROOT / argv[1]
            assert argv[1].endswith(".py") and script.is_file(), argv
            source = script.read_text(encoding="utf-8")
            for option in (a for a in argv[2:] if a.startswith("--")):
                assert f'"{option}"' in source, f"{script.name} has no option {option}"
            assert argv[argv.index("--out") + 1] == str(out)


def test_folder_name_and_revision():
    run = load_run()
    commit, short, dirty = run.revision()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode:
        pytest.skip("not a git checkout")
    assert short == head.stdout.strip() and commit.startswith(short)
    assert run.folder_name("2026-12-05", "abc1234", False, False) == "2026-12-05-abc1234"
    assert run.folder_name("2026-12-05", "abc1234", True, True) == "2026-12-05-abc1234-dirty-smoke"
    assert FOLDER.fullmatch(run.folder_name("2026-12-05", short, dirty, False))


def test_a_run_writes_suite_json_and_log_and_stops_at_a_failure(tmp_path, monkeypatch, capsys):
    run = load_run()
    py = run.PY
    fake = run.SUITES["memory"]._replace(commands=lambda smoke: [
        run.Cmd([py, "-c", "import json; print(json.dumps({'ok': 1}))"], stdout="result.json"),
        run.Cmd([py, "-c", "import os, sys; print('to the log', os.environ['X']); sys.exit(3)"], env={"X": "y"}),
        run.Cmd([py, "-c", "print('never')"])])
    monkeypatch.setitem(run.SUITES, "fake", fake)
    out = tmp_path / "2026-12-05-abc1234"
    assert run.run_suite("fake", False, out, "abc1234" * 5, False, "2026-12-05") == 1
    record = json.loads((out / "suite.json").read_text())
    assert record["suite"] == "fake" and record["commit"] == "abc1234" * 5 and record["date"] == "2026-12-05"
    assert record["host"]["cpu_count"] >= 1 and record["host"]["cpu_capability"]
    assert [c["exit_code"] for c in record["commands"]] == [0, 3, None] and record["exit_code"] == 3
    assert record["commands"][0]["wall_s"] >= 0 and record["commands"][1]["command"].startswith("X=y ")
    assert json.loads((out / "result.json").read_text()) == {"ok": 1}
    log = (out / "log.txt").read_text()
    assert "to the log y" in log and '{"ok": 1}' in log and "never" not in log
    err = capsys.readouterr().err
    assert "command 2 of 3 exited with code 3" in err and str(out / "log.txt") in err
