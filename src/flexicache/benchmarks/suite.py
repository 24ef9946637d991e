"""What the cases of ``flexicache bench`` share: settings and presets, model shapes, cache systems, and the state
of one run (:class:`Suite`: models, deadlines, memoised calibrations, results).

A run builds random-weight models of real shapes (``--layers`` of the model's decoder layers; per-layer numbers are
extrapolated to the full depth and labelled so). :mod:`flexicache.benchmarks.runner` runs the cases in order; this
module imports no case, so that the cases, the report and the runner can all import it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from transformers import Cache, DynamicCache, LlamaConfig, MistralConfig, PretrainedConfig, StaticCache

from flexicache import FlexiCache, HeadProfile, attention, disable_step_graphs, handoff
from flexicache.config import DEFAULT_UNSTABLE_FRACTION, STANDBY_NAMES, FlexiCacheConfig
from flexicache.benchmarks.attention import Shape, random_profile
from flexicache.setting_specs import parse_settings

GIB = 2**30
CASES = ("memory", "decode", "attention", "rerank", "throughput", "mix")
CASE_WEIGHTS = {"memory": 1.0, "decode": 3.0, "attention": 1.0, "rerank": 1.0, "throughput": 2.0, "mix": 1.0}

# Decoder shapes (random weights: only shapes matter). ``tiny-llama`` is the CPU mode's model.
_8B_BODY = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5}
MODEL_SHAPES: dict[str, tuple[type[PretrainedConfig], dict[str, Any]]] = {
    "llama-3.1-8b": (LlamaConfig, {**_8B_BODY, "vocab_size": 128256}),
    "mistral-7b": (MistralConfig, {**_8B_BODY, "vocab_size": 32000, "sliding_window": None}),
    "tiny-llama": (LlamaConfig, {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
                                 "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16, "vocab_size": 256,
                                 "max_position_embeddings": 8192}),
}


def model_config(name: str, layers: int | None = None) -> PretrainedConfig:
    """Config of shape ``name``, cut to ``layers`` decoder layers (all when ``None``); no EOS, pad id 0."""
    config_class, kwargs = MODEL_SHAPES[name]
    kwargs = dict(kwargs, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    if layers is not None:
        kwargs["num_hidden_layers"] = layers
    return config_class(**kwargs)


def full_layers(name: str) -> int:
    return MODEL_SHAPES[name][1]["num_hidden_layers"]


# --------------------------------------------------------------------------------------------------- systems

def split_system_name(name: str) -> tuple[str, int | None]:
    """``(kind, token budget or None)`` of a system name (its ``:settings`` suffix aside)."""
    name = name.partition(":")[0]
    if name in ("dynamic", "dynamic-offload", "static", "dense"):
        return name, None
    kind, _, budget = name.partition("-")
    if kind in ("flexicache", "quest") and budget.isdigit():
        return kind, int(budget)
    raise ValueError(f"unknown system {name!r}: use dynamic, dynamic-offload, static, dense, flexicache-<budget> or "
                     "quest-<budget> (e.g. flexicache-1024), optionally with FlexiCache settings after a colon "
                     "(e.g. flexicache-1024:spread_weight=1.0)")


def system_options(name: str) -> dict[str, Any]:
    """The FlexiCache settings after a system name's colon: ``flexicache-1024:spread_weight=1.0,group_reduce=sum``
    gives ``{"spread_weight": 1.0, "group_reduce": "sum"}`` (:func:`flexicache.setting_specs.parse_settings`)."""
    return parse_settings(name.partition(":")[2], f"system {name!r}", "spread_weight=1.0")


@dataclass(frozen=True)
class System:
    """A cache configuration, by name: ``dynamic`` (DynamicCache + sdpa), ``dynamic-offload`` (DynamicCache with
    ``offloading=True``), ``static`` (StaticCache + sdpa, sized for the run's tokens), ``dense`` (FlexiCache, every
    head on the device, budget covering the context: dense FlashInfer decode), ``flexicache-<budget>``
    (stable/unstable profile) and ``quest-<budget>`` (every head unstable: all pages on the device, rerank every
    step); FlexiCache settings may follow a colon
    (``flexicache-1024:spread_weight=1.0``; ``profile=online``: the head split estimated from the prompt in place of
    the random profile)."""

    name: str

    def __post_init__(self) -> None:
        split_system_name(self.name)
        if system_options(self.name) and self.kind not in ("flexicache", "quest", "dense"):
            raise ValueError(f"system {self.name!r}: settings after the colon are FlexiCache's, "
                             f"{self.kind} takes none")

    @property
    def kind(self) -> str:
        return split_system_name(self.name)[0]

    @property
    def budget(self) -> int | None:
        return split_system_name(self.name)[1]

    @property
    def is_flexicache(self) -> bool:
        return self.kind in ("dense", "flexicache", "quest")

    @property
    def attn_implementation(self) -> str:
        return attention.ATTENTION_NAME if self.is_flexicache else "sdpa"

    def make_cache(self, config: PretrainedConfig, tokens: int, settings: Settings) -> Cache:
        """A fresh cache for sequences of up to ``tokens`` tokens (FlexiCache's buffers sized for them up front)."""
        if self.kind == "dynamic":
            return DynamicCache(config=config)
        if self.kind == "dynamic-offload":
            return DynamicCache(config=config, offloading=True)
        if self.kind == "static":
            return StaticCache(config=config, max_cache_len=tokens)
        shape = Shape.of(config)
        page = int(system_options(self.name).get("page_size", settings.page_size))
        if self.kind == "flexicache":
            profile = random_profile(shape, settings.unstable_fraction, settings.seed)
            budget = self.budget
        else:
            profile = HeadProfile(shape.num_layers, shape.num_kv_heads, shape.head_dim,
                                  [(layer, head) for layer in range(shape.num_layers)
                                   for head in range(shape.num_kv_heads)])
            budget = self.budget if self.kind == "quest" else page * math.ceil((tokens + page) / page)
        options = {**cache_options(settings), "page_size": page, "rerank_interval": settings.rerank_interval,
                   "max_cache_len": tokens, "profile": profile}
        if self.kind != "flexicache":  # every head on the device (Quest-like, dense): K pages per head, as Quest's
            options["head_budgets"] = "uniform"
        options.update(system_options(self.name))  # profile=online: the split estimated from the prompt
        return FlexiCache(config, token_budget=budget, **options)


def cache_options(settings: Settings) -> dict[str, Any]:
    """The run's FlexiCache settings every case applies (page size, standby pages, exact rescoring and its
    candidates, head budgets, backend, CUDA graphs); the rerank interval, budget and profile are each case's."""
    standby = settings.standby_pages if settings.standby_pages in STANDBY_NAMES else int(settings.standby_pages)
    return {"page_size": settings.page_size, "standby_pages": standby, "exact_rescore": settings.exact_rescore,
            "exact_candidates": settings.exact_candidates, "head_budgets": settings.head_budgets,
            "backend": settings.backend, "cuda_graphs": settings.cuda_graphs != "off"}


def systems(names: list[str]) -> list[System]:
    return [System(name) for name in names]


# -------------------------------------------------------------------------------------------------- settings


@dataclass
class Settings:
    """Everything a run depends on; ``PRESETS`` fills what the command line leaves out."""

    device: str = "cpu"
    models: list[str] = field(default_factory=list)
    layers: int = 2
    dtype: str = "float32"
    backend: str = "auto"
    cuda_graphs: str = "step"  # FlexiCache on CUDA: "step" (whole decode steps), "layer" (each layer's), "off"
    page_size: int = FlexiCacheConfig.page_size
    rerank_interval: int = FlexiCacheConfig.rerank_interval
    standby_pages: int | str = FlexiCacheConfig.standby_pages
    exact_rescore: bool = FlexiCacheConfig.exact_rescore
    exact_candidates: int = FlexiCacheConfig.exact_candidates
    head_budgets: str = FlexiCacheConfig.head_budgets
    unstable_fraction: float = DEFAULT_UNSTABLE_FRACTION
    seed: int = 0
    cases: list[str] = field(default_factory=lambda: list(CASES))
    time_budget: float = 0.0  # seconds, 0 = unlimited
    warmup: int = 20
    steps: int = 32
    profile_steps: int = 0
    # memory
    memory_contexts: list[int] = field(default_factory=list)
    memory_systems: list[str] = field(default_factory=list)
    memory_steps: int = 20
    memory_batch: int = 1
    prefill_chunk: int = 0  # generate's prefill_chunk_size in the memory case; 0: the prompt in one forward
    # decode
    decode_contexts: list[int] = field(default_factory=list)
    decode_batches: list[int] = field(default_factory=list)
    decode_systems: list[str] = field(default_factory=list)
    decode_rounds: int = 1
    loop_context: int = 1024
    offload_max_tokens: int = 0
    # attention layer and rerank ablation
    attention_batch: int = 8
    attention_context: int = 32768
    budget: int = 1024
    layer_steps: int = 64  # timed steps of the attention-layer cases
    query_correlation: float = 0.0
    # throughput
    throughput_context: int = 32768
    throughput_systems: list[str] = field(default_factory=list)
    probe_batch: int = 2
    max_batch: int = 128
    device_memory_gib: float = 0.0  # 0: the GPU's total memory
    host_memory_gib: float = 0.0  # 0: 85% of the host's RAM
    reserve_gib: float = 1.0
    # offline mix
    mix_requests: int = 8
    mix_batch: int = 8
    mix_input: list[int] = field(default_factory=lambda: [10240, 30720])
    mix_output: list[int] = field(default_factory=lambda: [50, 1500])
    mix_max_steps: int = 64
    mix_systems: list[str] = field(default_factory=list)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


ALL_SYSTEMS_GPU = ["dynamic", "dynamic-offload", "dense", "flexicache-1024", "flexicache-2048", "quest-1024"]
PRESETS: dict[str, dict[str, Any]] = {
    # One GPU (sized for an H200). The attention case (dense FlashInfer baseline, also
    # `python -m flexicache.benchmarks.attention`) runs only when asked for with --cases.
    "cuda": {
        "models": ["llama-3.1-8b"], "layers": 4, "dtype": "bfloat16", "time_budget": 390.0, "warmup": 20,
        "steps": 32, "profile_steps": 4, "cases": ["memory", "decode", "rerank", "throughput", "mix"],
        "memory_contexts": [4096, 16384, 32768, 131072], "memory_systems": ALL_SYSTEMS_GPU[:5], "memory_steps": 20,
        "decode_contexts": [1024, 10240, 32768], "decode_batches": [1, 8, 32], "decode_systems": ALL_SYSTEMS_GPU,
        "decode_rounds": 2,
        "loop_context": 1024, "offload_max_tokens": 4 * 32768,
        "attention_batch": 8, "attention_context": 32768, "budget": 1024, "layer_steps": 64,
        "throughput_context": 32768,
        "throughput_systems": ["dynamic", "dense", "flexicache-1024", "flexicache-2048", "quest-1024"],
        "probe_batch": 2, "reserve_gib": 1.0,
        "mix_requests": 8, "mix_batch": 8, "mix_input": [10240, 30720], "mix_output": [50, 1500],
        "mix_max_steps": 64, "mix_systems": ["dynamic", "flexicache-1024"],
    },
    # Tiny random Llama on the CPU (reference backend): exercises every case, small enough for CI.
    "cpu": {
        "models": ["tiny-llama"], "layers": 2, "dtype": "float32", "time_budget": 0.0, "warmup": 4, "steps": 12,
        "profile_steps": 0, "cases": ["memory", "decode", "rerank", "throughput", "mix"],
        "memory_contexts": [128, 512], "memory_systems": ["dynamic", "dynamic-offload", "dense", "flexicache-64"],
        "memory_steps": 20,
        "decode_contexts": [128, 512], "decode_batches": [1, 2],
        "decode_systems": ["dynamic", "dense", "flexicache-64", "quest-64"], "decode_rounds": 2,
        "loop_context": 128, "offload_max_tokens": 0,
        "attention_batch": 2, "attention_context": 512, "budget": 64, "layer_steps": 24,
        "throughput_context": 512, "throughput_systems": ["dynamic", "flexicache-64"],
        "probe_batch": 1, "max_batch": 32, "device_memory_gib": 8 / 1024, "host_memory_gib": 64 / 1024,
        "reserve_gib": 0.0,
        "mix_requests": 4, "mix_batch": 2, "mix_input": [128, 384], "mix_output": [4, 24], "mix_max_steps": 12,
        "mix_systems": ["dynamic", "flexicache-64"],
    },
}


# ----------------------------------------------------------------------------------------------- environment


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def environment(settings: Settings) -> dict[str, Any]:
    """Versions and hardware of this run."""
    env = {
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": package_version("transformers"),
        "flashinfer": package_version("flashinfer-python"), "triton": package_version("triton"),
        "flexicache": package_version("flexicache"),
        "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "host_ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),  # e.g. expandable segments: changes what fits
    }
    if settings.torch_device.type == "cuda":
        properties = torch.cuda.get_device_properties(settings.torch_device)
        env.update(gpu=properties.name, gpu_memory_bytes=properties.total_memory, cuda=torch.version.cuda,
                   gpu_count=torch.cuda.device_count())
    return env


# ------------------------------------------------------------------------------------------------ run state


@dataclass
class CaseResult:
    """Rows (one per measurement), notes, and measurements skipped or failed, with the reason."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)


class Suite:
    """State shared by the cases of one run: settings, models, deadlines, memoised calibrations, output."""

    def __init__(self, settings: Settings, out: Path, command: str) -> None:
        self.settings = settings
        self.out = out
        self.device = settings.torch_device
        self.dtype = settings.torch_dtype
        self.start = time.monotonic()
        self.deadline = math.inf
        self.models: dict[tuple[str, int], Any] = {}
        self.memo: dict[tuple, Any] = {}
        self.results: dict[str, Any] = {
            "suite": "flexicache bench", "command": command, "env": environment(settings),
            "settings": dataclasses.asdict(settings), "cases": {},
        }

    # ------------------------------------------------------------------------------------------------ time

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def set_case_deadline(self, remaining_cases: list[str]) -> None:
        if not self.settings.time_budget:
            return
        left = self.settings.time_budget - self.elapsed()
        share = CASE_WEIGHTS[remaining_cases[0]] / sum(CASE_WEIGHTS[case] for case in remaining_cases)
        self.deadline = time.monotonic() + max(0.0, left) * share

    # ---------------------------------------------------------------------------------------------- models

    def model(self, name: str, layers: int | None = None) -> Any:
        """The random-weight model of shape ``name`` with ``layers`` decoder layers (``--layers`` by default)."""
        from flexicache.benchmarks.measure import build_model

        layers = layers or self.settings.layers
        if (name, layers) not in self.models:
            model = build_model(model_config(name, layers), self.device, self.dtype, self.settings.seed,
                                self.settings.cuda_graphs == "step")
            if self.settings.cuda_graphs == "layer":
                disable_step_graphs(model)  # a plain FlexiCache would otherwise switch it to whole-step graphs
            self.models[(name, layers)] = model
        return self.models[(name, layers)]

    def memoised(self, key: tuple, compute: Callable[[], Any]) -> Any:
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]

    # ---------------------------------------------------------------------------------------------- guards

    def attempt(self, result: CaseResult, label: dict[str, Any], measure: Callable[[], dict[str, Any] | None],
                record: bool = True) -> dict[str, Any] | None:
        """Run one measurement unless time is up; a failure (OOM included) is recorded and the run goes on.

        Returns the row (``label`` + the measurement); ``record=False`` leaves adding it to ``result`` to the caller
        (:meth:`record`), e.g. after merging rounds.
        """
        if self.out_of_time():
            result.skipped.append(dict(label, reason="time budget"))
            return None
        try:
            row = measure()
        except Exception as error:  # noqa: BLE001 - one failed measurement must not end a GPU run
            traceback.print_exc()
            result.skipped.append(dict(label, reason=f"error: {type(error).__name__}: {error}"[:500]))
            row = None
        finally:
            release(self.device)
        if row is not None:
            row = dict(label, **row)
            if record:
                self.record(result, row)
        return row

    def record(self, result: CaseResult, row: dict[str, Any]) -> None:
        result.rows.append(row)
        print(f"[{self.elapsed():7.1f}s] {json.dumps(compact(row))}", flush=True)


def compact(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with floats rounded, for the progress log."""
    return {key: round(value, 3) if isinstance(value, float) else value for key, value in row.items()
            if not isinstance(value, (dict, list))}


def empty_pinned_cache() -> None:
    """Give torch's cached, unused pinned host blocks back to the system (the function's name depends on torch's
    version; blocks still awaiting a copy stay)."""
    empty = getattr(torch.accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def release(device: torch.device) -> None:
    """Drop a staged chunk an interrupted measurement left; on CUDA, give torch's cached blocks back (the caches
    themselves are freed by reference counting as their last reference goes)."""
    handoff.clear_staged()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        empty_pinned_cache()  # e.g. DynamicCache(offloading=True)'s pinned blocks
