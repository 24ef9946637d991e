"""Whole-step CUDA graphs emulated on CPU tensors, the Triton kernels interpreted: the longest of the checks of
``test_triton_interpreted.py`` (which holds it and runs it in a subprocess), in a file of its own so that the test
workers (pytest-xdist, a file per worker) run it beside the others."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from test_triton_interpreted import run_interpreted  # noqa: E402  (after the skip: it imports Triton)


def test_whole_step_graphs_replay_what_they_recorded() -> None:
    run_interpreted("step")
