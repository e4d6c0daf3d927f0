"""The notebooks in notebooks/ run top to bottom, headless, in their short variant (DIFFKV_NB_SMALL=1), and the
committed copies carry their outputs (figures GitHub can show) at a modest size."""

import base64
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

HERE = Path(__file__).resolve().parent.parent / "notebooks"
# figures each notebook must show: 01 heatmap, tier strip, bytes; 02 three sweeps, alphas, tier mix; 03 four
NOTEBOOKS = {"01_tour.ipynb": 3, "02_calibration.ipynb": 5, "03_results.ipynb": 4}


def _pngs(nb) -> list[bytes]:
    return [base64.b64decode(o["data"]["image/png"]) for c in nb.cells if c.cell_type == "code"
            for o in c.get("outputs", []) if "image/png" in o.get("data", {})]


def _errors(nb) -> list[str]:
    return [f"{o['ename']}: {o['evalue']}" for c in nb.cells if c.cell_type == "code"
            for o in c.get("outputs", []) if o["output_type"] == "error"]


@pytest.mark.real_model  # 01 and 02 load smollm2-135m from the offline registry
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_headless(name, monkeypatch):
    monkeypatch.setenv("DIFFKV_NB_SMALL", "1")
    nb = nbformat.read(HERE / name, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(HERE)}})
    client.execute()  # raises CellExecutionError on the first failing cell
    assert not _errors(nb)
    pngs = _pngs(nb)
    assert len(pngs) == NOTEBOOKS[name] and all(p[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebook_has_its_outputs(name):
    path = HERE / name
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert path.stat().st_size < 1_000_000
    assert not _errors(nb)
    assert len(_pngs(nb)) == NOTEBOOKS[name]
    assert all(c.get("execution_count") for c in nb.cells if c.cell_type == "code")  # executed top to bottom
    first = next(c for c in nb.cells if c.cell_type == "code")
    assert "DIFFKV_NB_SMALL" in first.source
    if name == "01_tour.ipynb":
        assert (HERE / "figures" / "tiers.png").is_file()


def test_notebooks_import_only_the_public_api():
    for name in NOTEBOOKS:
        nb = nbformat.read(HERE / name, as_version=4)
        code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
        assert "import _" not in code and "._" not in code.replace("__", ""), name

