"""The comparison notebook: its .ipynb matches the jupytext script, and it runs headless
(nbclient, the venv's python3 kernel) against a tiny synthetic sweep."""

from __future__ import annotations

from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient

from tests.analysis.synth import SweepSpec, write_sweep

REPO = Path(__file__).resolve().parents[2]
NB_DIR = REPO / "analysis" / "notebooks"


def _cells(nb) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


def test_ipynb_is_in_sync_with_the_percent_script():
    script = jupytext.read(NB_DIR / "compare.py")
    notebook = nbformat.read(NB_DIR / "compare.ipynb", as_version=4)
    assert _cells(notebook) == _cells(script), (
        "compare.ipynb is stale: run `jupytext --sync analysis/notebooks/compare.py`")
    params = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1 and "SCALELAB_RUN_DIR" in params[0].source


def test_notebook_executes_headless_on_a_fixture_sweep(tmp_path: Path, monkeypatch):
    info = write_sweep(tmp_path / "sweep", SweepSpec(steps=20, eval_every=10))
    monkeypatch.setenv("SCALELAB_RUN_DIR", str(tmp_path / "sweep"))
    monkeypatch.setenv("SCALELAB_N_BOOT", "200")
    monkeypatch.delenv("SCALELAB_WANDB", raising=False)
    nb = nbformat.read(NB_DIR / "compare.ipynb", as_version=4)
    NotebookClient(nb, kernel_name="python3", timeout=180,
                   resources={"metadata": {"path": str(NB_DIR)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "\n".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert f"{info['n_runs']} runs from" in text
    assert "corrupt line skipped" in text
    html = "\n".join(o.get("data", {}).get("text/html", "") for o in outputs
                     if o.output_type in ("display_data", "execute_result"))
    for status in ("failed", "diverged", "incomplete"):
        assert status in html
    pngs = [o for o in outputs if "image/png" in o.get("data", {})]
    n_figs = int(text.strip().splitlines()[-1].split()[0])
    assert n_figs >= 5 and len(pngs) == n_figs
