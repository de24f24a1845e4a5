"""Every notebook in examples/ runs top to bottom, offline, in a kernel on this interpreter.

A cell that raises fails the test. The notebooks are stored without outputs and
executed in memory; each starts with a markdown cell saying what it does.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tests._util import need

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))
KERNEL = "attnkit-test"


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A kernelspec that starts ipykernel on the interpreter running the tests (no global kernelspec needed)."""
    need("ipykernel")
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": KERNEL, "language": "python"}))
    return root


def test_there_are_four_notebooks_stored_without_outputs() -> None:
    nbformat = need("nbformat")
    assert [p.name[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04"]
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# "), path.name
        for cell in nb.cells:
            assert cell.get("id"), f"{path.name}: a cell without an id (nbformat warns; it will be an error)"
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: outputs not stripped"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom(path: Path, kernel_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nbformat = need("nbformat")
    nbclient = need("nbclient")
    monkeypatch.setenv("JUPYTER_PATH", str(kernel_dir))
    for offline in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(offline, "1")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name=KERNEL, timeout=120,
                                     resources={"metadata": {"path": str(EXAMPLES)}})
    client.execute()  # raises CellExecutionError naming the cell on the first error
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert errors == []
    figures = [c for c in nb.cells if c.cell_type == "code" and re.search(r"\bplot_\w+\(", c.source)]
    assert figures or not path.name.startswith("03"), "notebook 03 draws heatmaps"
    for cell in figures:  # a heatmap cell showed only "<Figure size ...>", no image
        assert any("image/png" in o.get("data", {}) for o in cell.outputs), f"{path.name}: {cell.source[:60]!r}"
    assert all(c.execution_count is not None for c in nb.cells if c.cell_type == "code")
