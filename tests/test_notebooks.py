"""The notebooks: both execute headless without a cell error, and are committed without outputs.

Also covers ``benchmarks/results_io.py`` and ``benchmarks/xla_formulations.py --json``.
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
RESULTS = REPO / "benchmarks" / "results.json"


def _execute(monkeypatch, name: str, **env: str):
    """Run ``notebooks/<name>`` in a fresh ``python3`` kernel (cwd = repo root); return it executed."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel", reason="the notebooks run in an ipykernel 'python3' kernel")
    pytest.importorskip("matplotlib")
    old = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", str(REPO) + (os.pathsep + old if old else ""))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(REPO)}})
    client.execute()          # raises CellExecutionError on the first failing cell
    return nb


def _outputs(nb, kind: str) -> list:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == kind]


def _text(nb) -> str:
    return "".join(o.text for o in _outputs(nb, "stream"))


# --------------------------------------------------------------------------- committed form


def test_notebooks_are_committed_without_outputs():
    paths = sorted(NOTEBOOKS.rglob("*.ipynb"))
    assert {p.name for p in paths} >= {"compare_pytorch.ipynb", "benchmarks.ipynb"}
    dirty = []
    for p in paths:
        if ".ipynb_checkpoints" in p.parts:
            continue
        nb = json.loads(p.read_text())
        for i, cell in enumerate(nb["cells"]):
            if cell["cell_type"] != "code":
                continue
            if cell.get("outputs") or cell.get("execution_count") is not None:
                dirty.append(f"{p.relative_to(REPO)} cell {i}")
    assert not dirty, ("notebooks must be committed without outputs / execution counts; clear them "
                       "(e.g. `jupyter nbconvert --clear-output --inplace notebooks/*.ipynb`): "
                       + ", ".join(dirty))


# --------------------------------------------------------------------------- execution


def test_compare_pytorch_notebook_executes(monkeypatch):
    pytest.importorskip("torch", reason="compare_pytorch.ipynb needs PyTorch (pip install '.[torch]')")
    nb = _execute(monkeypatch, "compare_pytorch.ipynb")
    text = _text(nb)
    assert "| AWQ g128 | PyTorch |" in text and "| CT 8b channel | MARLIN |" in text
    assert "library repack == docs/formats.md §3.3 formula" in text
    assert len([o for o in _outputs(nb, "display_data") if "image/png" in o.get("data", {})]) >= 3


def test_benchmarks_notebook_executes(monkeypatch):
    monkeypatch.delenv("WNA16_JAX_RESULTS", raising=False)
    nb = _execute(monkeypatch, "benchmarks.ipynb")
    text = _text(nb)
    assert f"records from {RESULTS}" in text
    assert any("image/png" in o.get("data", {}) for o in _outputs(nb, "display_data"))


def test_benchmarks_notebook_without_results_plots_nothing(monkeypatch, tmp_path):
    missing = tmp_path / "results.json"
    nb = _execute(monkeypatch, "benchmarks.ipynb", WNA16_JAX_RESULTS=str(missing))
    assert f"no results file at {missing}" in _text(nb)
    assert not any("image/png" in o.get("data", {}) for o in _outputs(nb, "display_data"))


# --------------------------------------------------------------------------- results.json


@pytest.fixture
def results_io(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from benchmarks import results_io

    return results_io


def test_results_json_is_valid(results_io):
    records = results_io.load_results(RESULTS)
    rows = {(r["machine"], r["shape"], r["tokens"]): r for r in records if "xla_formulations" in r["command"]}
    engine = [r for r in records if "moe_engine" in r["command"]]
    assert engine and all(any(a.startswith(("engine", "wgmma")) for a in r["ms"]) and r["floor_ms"] for r in engine)
    # spot checks of the transcription of docs/journal/results-history.md
    cpu = rows["2-core CPU, jax 0.10.2", "mixtral-like (8, 2, 1024, 2048)", 1]
    assert cpu["ms"] == {"gather": 44.75, "dense": 120.20, "blocked": 32.32, "ragged_dot": 109.82}
    gpu = rows["NVIDIA H200, jax 0.11.2", "Mixtral (8, 2, 4096, 14336)", 16]
    assert "gather" not in gpu["ms"] and gpu["ms"]["dense"] == 10.25      # 'skipped (memory)'
    assert rows["NVIDIA H200, jax 0.11.2", "Mixtral (8, 2, 4096, 14336)", 512]["floor_ms"] == 0.564


def test_append_and_load_roundtrip(results_io, tmp_path):
    path = tmp_path / "r.json"
    rec = {"date": "2026-12-01", "machine": "test", "command": "python x.py", "shape": "s (1, 1, 8, 8)",
           "tokens": 4, "ms": {"gather": 1.5, "future_engine": 0.25}, "floor_ms": 0.1}
    results_io.append_results(path, rec)
    results_io.append_results(path, [dict(rec, tokens=8)])
    assert [r["tokens"] for r in results_io.load_results(path)] == [4, 8]
    assert results_io.load_results(path)[0] == rec
    for bad in ({**rec, "ms": {"gather": -1}}, {k: v for k, v in rec.items() if k != "date"},
                {**rec, "tokens": "4"}, {**rec, "floor_ms": float("nan")}):
        with pytest.raises(ValueError):
            results_io.append_results(path, bad)
    assert len(results_io.load_results(path)) == 2


def test_xla_formulations_appends_json(monkeypatch, tmp_path, results_io):
    from benchmarks import xla_formulations as xf

    monkeypatch.setitem(xf.SHAPES, "cpu", {"tiny (4, 2, 128, 128)": (4, 2, 128, 128)})
    monkeypatch.setitem(xf.TOKENS, "cpu", (2,))
    path = tmp_path / "results.json"
    xf.main(["--json", str(path)])
    (rec,) = results_io.load_results(path)
    assert rec["shape"] == "tiny (4, 2, 128, 128)" and rec["dims"] == [4, 2, 128, 128]
    assert rec["tokens"] == 2 and rec["command"].endswith(f"--json {path}")
    assert set(rec["ms"]) == {"gather", "dense", "blocked", "ragged_dot"}
