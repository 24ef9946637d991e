"""Execute notebooks at their default sizes and store them with their outputs, as the repository keeps them.

    OMP_NUM_THREADS=1 python examples/notebooks/store_outputs.py                 # every notebook here
    OMP_NUM_THREADS=1 python examples/notebooks/store_outputs.py quickstart.ipynb

Each notebook runs in a fresh python3 kernel (nbclient, ipykernel) inside a temporary working folder, so the files
it writes (profiles, plots, prediction folders) do not land in the repository; ``src/`` comes first on
``PYTHONPATH``. Progress bars are collapsed to their final state (``coalesce_streams``) and the per-cell
timing metadata is left out, so that a stored notebook changes only where its results do. Prints each notebook's
wall time.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"


def store(path: Path) -> float:
    """Execute ``path`` in place with its outputs; returns the seconds it took."""
    import nbclient
    import nbformat

    notebook = nbformat.read(path, as_version=4)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
               HF_HUB_OFFLINE="1")
    env.pop("FLEXICACHE_NOTEBOOK_SMALL", None)  # the default sizes
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        client = nbclient.NotebookClient(notebook, kernel_name="python3", timeout=3600, coalesce_streams=True,
                                         record_timing=False, resources={"metadata": {"path": folder}})
        client.execute(env=env)
    nbformat.write(notebook, path)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="*", help="notebook files (default: every .ipynb beside this script)")
    args = parser.parse_args()
    paths = [Path(name) if Path(name).exists() else HERE / name for name in args.notebooks]
    for path in paths or sorted(HERE.glob("*.ipynb")):
        print(f"{path.name}: {store(path):.0f} s", flush=True)


if __name__ == "__main__":
    main()
