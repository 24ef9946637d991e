"""The GPU profiling scripts under eval/ still import and parse their arguments on a machine without CUDA
(eval/begin_step_host_time.py runs whole in tests/test_step_graph.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EVAL = Path(__file__).resolve().parents[1] / "eval"


def run_script(name: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(EVAL.parent / "src"), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(EVAL / name), *args], env=env, capture_output=True, text=True,
                            timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result.stdout


@pytest.mark.parametrize("name", ["gpu_step_profile.py", "gpu_prefill_profile.py", "gpu_kernel_sweep.py",
                                  "gpu_repeatability.py"])
def test_gpu_profiling_scripts_parse_their_arguments(name: str) -> None:
    assert "usage:" in run_script(name, "--help")


def test_repeatability_check_runs_on_the_cpu() -> None:
    """The smoke test of eval/gpu_repeatability.py: its CPU configurations run and compare (on the CPU both are
    bit-identical run to run)."""
    out = run_script("gpu_repeatability.py", "--device", "cpu", "--repeats", "1", "--new-tokens", "3",
                     "--prompt-tokens", "40")
    assert "dynamic: 1 of 1 repeats bit-identical" in out and "flexicache-eager: 1 of 1 repeats bit-identical" in out
