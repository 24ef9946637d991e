"""Reading a ``bench.json``: a case's rows, full-depth estimates re-derived from the loop calibration, the facts
behind a host-bound batch, and the number formats of the report."""

from __future__ import annotations

import math
from typing import Any

from flexicache.benchmarks.decode import calibration, extrapolate
from flexicache.benchmarks.memory import offload_full_depth
from flexicache.benchmarks.suite import full_layers

GIB = 2**30
NA = "n/a (calibration inconsistent)"


def fmt(value: Any, digits: int = 2, scale: float = 1.0, suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return f"{value / scale:.{digits}f}{suffix}"


def size(value: float | None) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1 (``-`` for ``None``)."""
    if value is None:
        return "-"
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} B"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def case_rows(results: dict[str, Any], case: str) -> list[dict[str, Any]]:
    return results.get("cases", {}).get(case, {}).get("rows", [])


def find(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    return next((row for row in rows if all(row.get(key) == value for key, value in match.items())), None)


def checked_loop(loop: dict[str, Any]) -> dict[str, Any]:
    """A loop calibration entry with its consistency (re)derived from the two measured step times, so that entries
    of older runs (which clamped the fixed cost instead) are judged like new ones."""
    full = loop.get("full_layers") or full_layers(loop["model"])
    return {**loop, "full_layers": full, **calibration(loop["step_ms_1_layer"], loop["step_ms"], loop["layers"], full)}


def loops(results: dict[str, Any]) -> list[dict[str, Any]]:
    return [checked_loop(loop) for loop in results.get("loop", [])]


def loop_for(results: dict[str, Any], model: str, batch: int) -> dict[str, Any] | None:
    return find(loops(results), model=model, batch=batch)


def step_full_depth(results: dict[str, Any], row: dict[str, Any], batch: int) -> tuple[dict[str, float] | None, str]:
    """``(full-depth step_ms_p50 and tokens_per_s, "")`` re-derived from the row's measured p50 and the loop
    calibration at ``batch``, else ``(None, why)``: "-" without a calibration, NA when it is inconsistent."""
    loop = loop_for(results, row["model"], batch)
    if loop is None or "step_ms_p50" not in row:
        return None, "-"
    if not loop["consistent"]:
        return None, NA
    step = extrapolate(loop, row["step_ms_p50"], row["layers"], loop["full_layers"])
    if step is None:
        return None, "n/a (step below the loop's fixed cost)"
    return {"step_ms_p50": step, "tokens_per_s": 1000 * batch / step}, ""


def mix_batches(results: dict[str, Any], row: dict[str, Any]) -> list[int]:
    """Batch sizes whose loop calibration a mix row's full-depth estimate used."""
    if "loop_batches" in row:
        return row["loop_batches"]
    settings = results["settings"]
    count, size_ = settings["mix_requests"], settings["mix_batch"]
    return sorted({min(size_, count - start) for start in range(0, count, size_)})


def mix_full_depth(results: dict[str, Any], row: dict[str, Any]) -> tuple[dict[str, float] | None, str]:
    entries = [loop_for(results, row["model"], batch) for batch in mix_batches(results, row)]
    if not entries or any(entry is None for entry in entries):
        return None, "-"
    if not all(entry["consistent"] for entry in entries):
        return None, NA
    full = row.get("full_depth")
    if not full or full.get("requests_per_s", -1) <= 0:
        return None, "-"
    return full, ""


def memory_full(row: dict[str, Any]) -> dict[str, Any]:
    """The memory row's full-depth bytes (``dynamic-offload``: one resident layer at any depth)."""
    if row["system"] == "dynamic-offload" and not row["full_depth"].get("offloading"):
        return offload_full_depth(row)
    return row["full_depth"]


def peak_of(row: dict[str, Any]) -> tuple[float | None, bool]:
    """``(peak device bytes at full depth, estimated?)``: the allocator's measured peak when the run had every
    layer, else the memory case's full-depth estimate; ``None`` without a CUDA peak."""
    if "peak_bytes" not in row:
        return None, False
    if row["layers"] == row["full_depth"]["layers"]:
        return row["peak_bytes"], False
    return memory_full(row).get("peak_bytes"), True


def cell(value: float | None, why: str, digits: int = 1) -> str:
    return why if value is None else fmt(value, digits)


def host_bound_facts(results: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """Numbers behind a throughput row's host bound: pinned bytes per sequence (what the bound uses), the host
    tier's reserved bytes per sequence at the largest batch, the stable heads' exact KV per sequence, full depth."""
    settings = results["settings"]
    scale = full_layers(row["model"]) / row["layers"]
    facts: dict[str, Any] = {"pinned": row["host_bytes_per_sequence_full"], "limit": row["host_limit_bytes"],
                             "stable_share": 1 - settings["unstable_fraction"]}
    if row.get("largest_batch") and row.get("host_reserved_bytes"):
        facts["reserved"] = row["host_reserved_bytes"] / row["largest_batch"] * scale
    memory = find(case_rows(results, "memory"), model=row["model"], system=row["system"],
                  context=row["context"], batch=1)
    if memory is not None:
        facts["kv"] = memory["host_kv_bytes"] * full_layers(row["model"]) / memory["layers"]
    elif row.get("probe_host_kv_bytes"):
        facts["kv"] = row["probe_host_kv_bytes"] / row["probe_batch"] * scale
    if facts.get("kv"):
        facts["batch_at_kv"] = math.floor(row["host_limit_bytes"] / facts["kv"])
    return facts


def batch_bound(row: dict[str, Any]) -> str:
    """What bounds a throughput row's batch: the estimate's bound, or the device where the estimate ran out of its
    memory."""
    return "device (ran out above)" if row.get("out_of_memory_at") else row["bound"]
