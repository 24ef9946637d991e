"""Multi-device and tensor-parallel support: per-rank head profiles, TP detection, per-device KV accounting.

Layers on several devices (accelerate ``device_map="auto"``, CPU or disk offload through accelerate's hooks) need
nothing special: every :class:`~flexicache.FlexiLayer` creates its pages, page metadata and decode backend on the
device of the first key tensor it receives, i.e. its decoder layer's execution device, and its own host tier in CPU
memory (pinned when that device is a GPU). ``examples/multi_gpu.py`` checks a whole model placed this way::

    model = AutoModelForCausalLM.from_pretrained(name, device_map="auto", dtype=torch.bfloat16,
                                                 attn_implementation="flexicache")
    cache = FlexiCache.from_model(model, token_budget=1024)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=256)
    kv_bytes_by_device(cache)  # {"cuda:0": {"device_kv_bytes": ..., ...}, "cuda:1": {...}}

Under tensor parallelism (``tp_plan="auto"``, one process per rank, e.g. ``torchrun --nproc-per-node 2``) each
rank runs attention for a contiguous slice of the KV heads: rank ``r`` of ``n`` holds the model's heads
``r * H / n .. (r + 1) * H / n - 1`` as its local heads ``0 .. H / n - 1``. Its cache must hold those heads only,
with the profile sliced the same way. :func:`local_view` gives both::

    # newer transformers spell tp_plan="auto" as distributed_config=DistributedConfig(tp_plan="auto")
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", attn_implementation="flexicache")
    config, profile = local_view(model, "profile.json")  # the full model's profile, sliced for this rank
    cache = FlexiCache(config, profile=profile, token_budget=1024)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=256)  # same call on every rank

Every rank then holds ``1 / n`` of the KV (its ``cache.stats()`` count its own heads); the token budget applies per
head, as without TP. ``tests/tp_worker.py`` is such a rank: ``torchrun --nproc-per-node N tests/tp_worker.py ...``
runs it on CPU processes (gloo) or on N GPUs (NCCL).
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from transformers.cache_utils import Cache

from flexicache.profile import HeadProfile, is_online_profile, model_shape, resolve_profile

# Projections whose output holds the keys (as in transformers' own `get_kv_heads_per_rank`), and the TP styles that
# leave each rank a contiguous slice of that output (``*_gather_output``/``*_rep`` styles replicate it instead).
KEY_PROJECTIONS = ("k_proj", "qkv_proj", "query_key_value")
HEAD_SHARDING_STYLES = ("colwise", "local_colwise", "packed_colwise")
BYTE_KEYS = ("device_kv_bytes", "device_metadata_bytes", "host_kv_bytes")


def _check_split(num_kv_heads: int, rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}.")
    if num_kv_heads % world_size:
        raise ValueError(
            f"{num_kv_heads} KV heads cannot be split evenly over {world_size} tensor-parallel ranks; FlexiCache "
            f"needs whole KV heads on every rank: use a tensor-parallel size that divides {num_kv_heads}."
        )


def shard_profile(profile: HeadProfile, rank: int, world_size: int) -> HeadProfile:
    """The profile of the KV heads that rank ``rank`` of ``world_size`` holds, in its local head indices.

    KV heads are split contiguously: the model's head ``h`` is local head ``h - rank * H / world_size`` on the rank
    that holds it. ``scores`` (``[layers][H]``) are sliced the same way; ``model_info["tensor_parallel"]`` records
    the slice.
    """
    _check_split(profile.num_kv_heads, rank, world_size)
    local_heads = profile.num_kv_heads // world_size
    first = rank * local_heads
    unstable = [(layer, head - first) for layer, head in profile.unstable_heads if first <= head < first + local_heads]
    scores = None if profile.scores is None else [None if row is None else row[first:first + local_heads]
                                                  for row in profile.scores]
    shard = {"rank": rank, "world_size": world_size, "first_kv_head": first}
    return HeadProfile(
        num_layers=profile.num_layers, num_kv_heads=local_heads, head_dim=profile.head_dim, unstable_heads=unstable,
        model=profile.model, page_size=profile.page_size, token_budget=profile.token_budget,
        unstable_fraction=profile.unstable_fraction, scores=scores, calibration=copy.deepcopy(profile.calibration),
        model_info={**copy.deepcopy(profile.model_info), "tensor_parallel": shard},
        sparse_layers=profile.sparse_layers, format_version=profile.format_version,
    )


def shard_config(config: Any, world_size: int) -> Any:
    """A copy of ``config`` whose decoder has ``1 / world_size`` of the attention and KV heads (head dim kept)."""
    _, num_kv_heads, head_dim = model_shape(config)
    _check_split(num_kv_heads, 0, world_size)
    local = copy.deepcopy(config)
    text_config = local.get_text_config(decoder=True)
    num_heads = text_config.num_attention_heads
    text_config.head_dim = head_dim
    text_config.num_attention_heads = num_heads // world_size
    text_config.num_key_value_heads = num_kv_heads // world_size
    return local


def _shards_kv_heads(tp_plan: dict[str, str]) -> bool:
    return any(name.rsplit(".", 1)[-1] in KEY_PROJECTIONS and style in HEAD_SHARDING_STYLES
               for name, style in tp_plan.items())


def _tensor_parallel_mesh(model: torch.nn.Module) -> Any:
    """The model's 1-D tensor-parallel ``DeviceMesh`` (transformers 5.24: the mesh manager; older: the TP mesh)."""
    manager = getattr(model, "_mesh_manager", None)
    if manager is not None:
        return manager.get_mesh("tp")
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None:
        raise RuntimeError("The model reports tensor parallelism but has no device mesh; load it with tp_plan='auto'.")
    return mesh["tp"] if mesh.ndim > 1 else mesh


def tensor_parallel_shard(model: torch.nn.Module) -> tuple[int, int] | None:
    """``(rank, world_size)`` of the KV-head split when ``model`` runs tensor parallel, else ``None``.

    ``None`` also when the TP plan leaves the key projections unsharded (every rank then holds all KV heads).
    """
    world_size = getattr(model, "_tp_size", None) or 1
    plan = getattr(model, "_tp_plan", None) or {}
    if world_size <= 1 or not _shards_kv_heads(plan):
        return None
    return _tensor_parallel_mesh(model).get_local_rank(), world_size


def local_view(model: torch.nn.Module, profile: HeadProfile | str | os.PathLike | None = None
               ) -> tuple[Any, HeadProfile | str | os.PathLike | None]:
    """``(config, profile)`` to build this process's cache with: the model's own, or this rank's slice under TP.

    ``profile`` is the full model's (a :class:`HeadProfile`, a path, or ``None``: estimated from the prompt); under
    tensor parallelism it is validated against the full model, then sliced with :func:`shard_profile`, and the config
    is a copy with this rank's head counts (:func:`shard_config`).
    """
    shard = tensor_parallel_shard(model)
    if shard is None:
        return model.config, profile
    rank, world_size = shard
    if is_online_profile(profile):  # estimated from the prompt, over this rank's heads
        return shard_config(model.config, world_size), profile
    profile = resolve_profile(profile, model.config)
    return shard_config(model.config, world_size), shard_profile(profile, rank, world_size)


def kv_bytes_by_device(cache: Cache) -> dict[str, dict[str, int]]:
    """``{device: {"device_kv_bytes", "device_metadata_bytes", "host_kv_bytes"}}`` summed over the layers of a
    FlexiCache that live there.

    A layer counts under the device its pages live on (``layer.device``); its host tier's bytes count under that
    device too. The sliding-window layers of a hybrid model count their window as device KV on their device. Layers
    that hold nothing yet are skipped.
    """
    totals: dict[str, dict[str, int]] = {}
    for layer in cache.layers:
        stats = layer.stats()
        if not stats:
            continue
        per_device = totals.setdefault(str(layer.device), dict.fromkeys(BYTE_KEYS, 0))
        for key in BYTE_KEYS:
            per_device[key] += stats[key]
    return totals
