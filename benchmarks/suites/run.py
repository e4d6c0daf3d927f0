"""Run a named benchmark suite into benchmarks/results/<suite>/<YYYY-MM-DD>-<short commit>[-dirty][-smoke]/.

    python benchmarks/suites/run.py list                      # the suites, one line each
    python benchmarks/suites/run.py memory --dry-run          # the commands and the folder, nothing run
    python benchmarks/suites/run.py memory [--smoke]          # run them (--smoke: smollm2-135m, a few samples)

The suites and their commands are in suites.py. Each command runs from the repository root with the root first on
PYTHONPATH (this checkout's diffkv); its stdout and stderr stream to the console and to <folder>/log.txt (a
command whose stdout is a result also writes it to its file there). <folder>/suite.json records the suite, the
commands, commit, date, each exit code and wall time, the host's CPU count and torch's CPU capability; it is
rewritten after every command. The date is UTC; -dirty: a tracked file differs from HEAD. The first command that
fails stops the suite, and run.py exits 1 naming it and the log.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from suites import OUT, PY, SUITES, VLLM_PY, Cmd  # noqa: E402

VLLM_PYTHON = Path(os.environ.get("DIFFKV_VLLM_PYTHON", "~/.venvs/diffkv-vllm/bin/python")).expanduser()


def revision() -> tuple[str, str, bool]:
    """(commit, short commit, dirty); dirty: a tracked file differs from HEAD (untracked files do not count)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    try:
        return git("rev-parse", "HEAD"), git("rev-parse", "--short", "HEAD"), bool(
            git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        return "unknown", "unknown", False


def folder_name(date: str, short: str, dirty: bool, smoke: bool) -> str:
    return f"{date}-{short}" + ("-dirty" if dirty else "") + ("-smoke" if smoke else "")


def new_folder(suite: str, name: str) -> Path:
    """benchmarks/results/<suite>/<name>, or <name>-2, -3, ... if that exists (a second run of the day)."""
    path, n = ROOT / "benchmarks" / "results" / suite / name, 1
    while path.exists():
        n, path = n + 1, path.with_name(f"{name}-{n + 1}")
    return path


def rel(path: Path | str) -> str:
    """``path`` relative to the repository root (where the commands run) if it is inside it."""
    path = Path(path)
    return str(path.relative_to(ROOT)) if path.is_absolute() and path.is_relative_to(ROOT) else str(path)


def resolve(cmd: Cmd, out: Path) -> list[str]:
    """The argv of ``cmd`` with its placeholders filled in (paths inside the repository relative to it)."""
    subs = {PY: rel(sys.executable), VLLM_PY: str(VLLM_PYTHON), OUT: rel(out)}
    argv = []
    for arg in cmd.argv:
        for key, value in subs.items():
            arg = arg.replace(key, value)
        argv.append(arg)
    return argv


def shown(cmd: Cmd, argv: list[str], out: Path) -> str:
    """``cmd`` as a shell line: its environment, argv and stdout redirection."""
    env = [f"{k}={shlex.quote(v)}" for k, v in cmd.env.items()]
    redirect = ["> " + shlex.quote(rel(out / cmd.stdout))] if cmd.stdout else []
    return " ".join([*env, shlex.join(argv), *redirect])


def pump(src, sinks, lock: threading.Lock) -> None:
    for line in iter(src.readline, b""):
        with lock:
            for sink in sinks:
                sink.write(line)
                sink.flush()


def execute(cmd: Cmd, argv: list[str], out: Path, log) -> int:
    """Run one command, its output streamed to the console and ``log`` (stdout also to its file); its exit code."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, **cmd.env, "PYTHONPATH": path}
    pipe, lock = subprocess.PIPE, threading.Lock()
    try:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=pipe,
                                stderr=pipe if cmd.stdout else subprocess.STDOUT)
    except OSError as err:
        log.write(f"cannot start {argv[0]}: {err}\n".encode())
        return 127
    with proc, open(out / cmd.stdout if cmd.stdout else os.devnull, "wb") as result:
        streams = [(proc.stdout, [log, sys.stdout.buffer, *([result] if cmd.stdout else [])])]
        streams += [(proc.stderr, [log, sys.stderr.buffer])] if cmd.stdout else []
        threads = [threading.Thread(target=pump, args=(src, sinks, lock)) for src, sinks in streams]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return proc.wait()


def host() -> dict:
    import torch

    return {"cpu_count": os.cpu_count(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "machine": platform.machine(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "load_avg_1_5_15_start": load()}


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_suite(name: str, smoke: bool, out: Path, commit: str, dirty: bool, date: str) -> int:
    plan = [(cmd, resolve(cmd, out)) for cmd in SUITES[name].commands(smoke)]
    out.mkdir(parents=True, exist_ok=True)
    record = {"suite": name, "smoke": smoke, "setting_from": SUITES[name].source, "folder": rel(out),
              "commit": commit, "dirty": dirty, "date": date,
              "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "host": host(), "exit_code": None, "wall_s": None,
              "commands": [{"command": shown(cmd, argv, out), "argv": argv, "env": cmd.env, "stdout_file": cmd.stdout,
                            "exit_code": None, "wall_s": None} for cmd, argv in plan]}

    def save() -> None:
        (out / "suite.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")

    save()
    start = time.perf_counter()
    with open(out / "log.txt", "ab") as log:
        for i, ((cmd, argv), entry) in enumerate(zip(plan, record["commands"], strict=True), 1):
            banner = f"=== [{i}/{len(plan)}] {entry['command']}\n"
            log.write(banner.encode())
            print(banner, end="", flush=True)
            t0 = time.perf_counter()
            rc = execute(cmd, argv, out, log)
            entry.update(exit_code=rc, wall_s=round(time.perf_counter() - t0, 1))
            record.update(wall_s=round(time.perf_counter() - start, 1), load_avg_1_5_15_end=load())
            if rc:
                record["exit_code"] = rc
                save()
                print(f"run.py: suite {name} failed: command {i} of {len(plan)} exited with code {rc}:\n  "
                      f"{entry['command']}\n  its output: {out / 'log.txt'}", file=sys.stderr)
                return 1
            save()
    record["exit_code"] = 0
    save()
    print(f"suite {name}: {len(plan)} commands done in {record['wall_s']:.0f} s -> {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="run.py", description=__doc__.splitlines()[0])
    p.add_argument("name", help=f"'list', or a suite: {', '.join(SUITES)}")
    p.add_argument("--dry-run", action="store_true", help="print the commands and the folder, run nothing")
    p.add_argument("--smoke", action="store_true", help="a tiny setting (smollm2-135m, a few samples or tokens)")
    p.add_argument("--out", default=None, help="the suite folder (default: benchmarks/results/<suite>/<date>-"
                   "<commit>[-dirty][-smoke], -2, -3, ... if it exists); an existing one is reused (eval runs resume)")
    args = p.parse_args(argv)
    if args.name == "list":
        for name, suite in SUITES.items():
            print(f"{name:<18} {suite.about}")
        return 0
    if args.name not in SUITES:
        print(f"run.py: unknown suite {args.name!r}; known suites: {', '.join(SUITES)}", file=sys.stderr)
        return 2
    commit, short, dirty = revision()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    name = folder_name(date, short, dirty, args.smoke)
    out = Path(args.out).resolve() if args.out else new_folder(args.name, name)
    cmds = SUITES[args.name].commands(args.smoke)
    if any(c.argv[0] == VLLM_PY for c in cmds) and not VLLM_PYTHON.is_file():
        print(f"run.py: suite {args.name} runs with the vLLM venv's python, {VLLM_PYTHON}, which is missing: create "
              "~/.venvs/diffkv-vllm as in the README's \"Inside vLLM\" (pip install -e \".[vllm]\") or set "
              "DIFFKV_VLLM_PYTHON to its python", file=sys.stderr)
        if not args.dry_run:
            return 2
    if args.dry_run:
        print(f"suite: {args.name}{' (smoke)' if args.smoke else ''}; setting from {SUITES[args.name].source}")
        print(f"folder: {out}")
        print(f"from {ROOT} with PYTHONPATH={ROOT}:")
        for cmd in cmds:
            print("  " + shown(cmd, resolve(cmd, out), out))
        return 0
    return run_suite(args.name, args.smoke, out, commit, dirty, date)


if __name__ == "__main__":
    sys.exit(main())
