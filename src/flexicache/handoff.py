"""The hand-off from a cache layer's ``update`` to the ``"flexicache"`` attention function.

transformers calls ``cache.update(k, v, layer_idx)`` and then the attention function, which receives the module but
not the cache. The layer therefore stages the chunk it received here (per thread) and the attention function takes it
back, checking the layer index. A staged chunk that nobody takes means the model is not running the flexicache
attention: the next :func:`stage` raises with instructions. A layer that attends densely (a sliding-window layer of a
hybrid model) stages a *dense* chunk (:func:`stage_dense`): no tokens, only the word that its attention is sdpa over
what its ``update`` returned. Both sides import this module; it imports neither.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Protocol

import torch

SWITCH_HINT = (
    "Load the model with attn_implementation=\"flexicache\" (after `import flexicache`), call "
    "model.set_attn_implementation(\"flexicache\"), or build the cache with FlexiCache.from_model(model, ...)."
)


class ChunkConsumer(Protocol):
    """What the attention function calls on the layer that staged a chunk."""

    def decode(self, chunk: StagedChunk, query: torch.Tensor, scale: float) -> torch.Tensor: ...

    def commit(self, chunk: StagedChunk, query: torch.Tensor, real_tokens: torch.Tensor | None) -> None: ...


@dataclass
class StagedChunk:
    """Keys/values ``[B, H, T, D]`` a layer's ``update`` received, waiting for the attention function; for a dense
    chunk (``dense``) no keys/values: the attention runs sdpa over the ones ``update`` returned.

    The layer is held weakly: a chunk left behind by a failed forward does not keep a dropped cache's buffers alive.
    """

    layer_ref: weakref.ref[ChunkConsumer] | weakref.ref[object]  # an object for a dense chunk
    layer_idx: int
    keys: torch.Tensor | None
    values: torch.Tensor | None
    logical_start: int
    dense: bool = False

    @property
    def layer(self) -> ChunkConsumer | None:
        return self.layer_ref()

    @property
    def is_decode(self) -> bool:
        return self.keys.shape[2] == 1 and self.logical_start > 0


_local = threading.local()


def stage(layer: ChunkConsumer, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, logical_start: int) -> None:
    """Called by a layer's ``update`` with the chunk's ``keys, values [B, H, T, D]``; fails if the previous layer's
    chunk was never attended to."""
    _put(StagedChunk(weakref.ref(layer), layer_idx, keys, values, logical_start))


def stage_dense(layer: object, layer_idx: int, logical_start: int) -> None:
    """Called by the ``update`` of a cache layer that attends densely (its attention is sdpa with the model's mask);
    fails like :func:`stage`."""
    _put(StagedChunk(weakref.ref(layer), layer_idx, None, None, logical_start, dense=True))


def _put(chunk: StagedChunk) -> None:
    previous = getattr(_local, "chunk", None)
    _local.chunk = chunk
    if previous is not None and previous.layer is not None:
        _local.chunk = None  # drop both: once the model is switched (or the cache reset), the next forward works
        # this forward went on to the next layer without the flexicache attention
        if previous.layer_idx < chunk.layer_idx:
            raise RuntimeError(
                f"FlexiCache layer {previous.layer_idx} was updated but its attention did not run through the "
                f"flexicache attention function: the model uses another attn_implementation. {SWITCH_HINT}"
            )
        raise RuntimeError(
            f"FlexiCache layer {previous.layer_idx} was updated in an earlier forward but never attended: that "
            "forward stopped between the cache update and the attention (call cache.reset() before using the cache "
            f"again), or the model uses another attn_implementation ({SWITCH_HINT})"
        )


def clear_staged() -> None:
    """Drop a staged chunk (after an interrupted forward, or on cache reset)."""
    _local.chunk = None


def take(layer_idx: int | None) -> StagedChunk | None:
    """The chunk staged for layer ``layer_idx`` (``None``: no cache layer staged one, or its cache is gone)."""
    chunk = getattr(_local, "chunk", None)
    if chunk is None or chunk.layer is None:
        _local.chunk = None
        return None
    if layer_idx is not None and chunk.layer_idx != layer_idx:
        raise RuntimeError(
            f"flexicache attention of layer {layer_idx} found the cache update of layer {chunk.layer_idx}; the "
            "model must call cache.update(...) and then its attention, layer by layer."
        )
    _local.chunk = None
    return chunk
