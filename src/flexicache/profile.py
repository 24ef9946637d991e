"""``HeadProfile``: which (layer, KV head) pairs are temporally unstable, saved as human-readable JSON.

A profile covers the layers FlexiCache serves as sparse paged layers (:func:`flexicache.hybrid.sparse_layers`): every
layer of a full-attention model; in a model that mixes layer types (Gemma 3, Qwen2 with sliding layers, ...) its
full-attention layers only, listed in ``sparse_layers``. Layer indices are the model's throughout (as the cache and
``module.layer_idx`` count them); the other layers' rows of ``scores`` are ``null``. :func:`resolve_profile` turns
what a user passes as ``FlexiCache(profile=...)`` into a checked profile.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from flexicache.config import integer_argument
from flexicache.hybrid import sparse_layers, text_config_of
from flexicache.profiles import PROFILES_DIR, shipped_profile_path

PROFILE_FORMAT_VERSION = 1
DEFAULT_UNSTABLE_LAYERS = 2
PROFILE_FILENAME = "flexicache_profile.json"
SHIPPED_PROFILES_DIR = Path(PROFILES_DIR)


def shipped_profiles() -> list[str]:
    """Names of the profiles bundled with flexicache (usable with :meth:`HeadProfile.from_pretrained`)."""
    return sorted(path.stem for path in SHIPPED_PROFILES_DIR.glob("*.json"))


def model_shape(config: Any) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` of a transformers decoder config."""
    text_config = text_config_of(config)
    num_layers = text_config.num_hidden_layers
    num_heads = text_config.num_attention_heads
    num_kv_heads = getattr(text_config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // num_heads
    return num_layers, num_kv_heads, head_dim


@dataclass
class HeadProfile:
    """The unstable KV heads of one model, plus how they were measured.

    Unstable heads keep every page on the device and rerank every decode step; all other heads are stable.
    ``scores[layer][head]`` is the head's mean random-corrected top-K overlap when the profiler produced it (``None``
    rows for layers the profile does not cover). ``calibration`` describes the data, settings, command and reports of
    the profiling run; ``model_info`` the model beyond its shape (architecture, query heads, GGUF file, dtype).
    ``sparse_layers``: the layers the profile covers, in a model that also has sliding-window layers (``None``: every
    layer); unstable heads lie in them.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    unstable_heads: list[tuple[int, int]]
    model: str = ""
    page_size: int | None = None
    token_budget: int | None = None
    unstable_fraction: float | None = None
    scores: list[list[float] | None] | None = None
    calibration: dict[str, Any] = field(default_factory=dict)
    model_info: dict[str, Any] = field(default_factory=dict)
    sparse_layers: list[int] | None = None
    format_version: int = PROFILE_FORMAT_VERSION

    def __post_init__(self) -> None:
        def index(value: object, name: str, expected: str = "a layer or KV head index") -> int:
            return integer_argument(value, f"HeadProfile's {name}", expected)

        self.unstable_heads = sorted({(index(layer, "unstable_heads"), index(head, "unstable_heads"))
                                      for layer, head in self.unstable_heads})
        for layer, head in self.unstable_heads:
            if not (0 <= layer < self.num_layers and 0 <= head < self.num_kv_heads):
                raise ValueError(
                    f"HeadProfile lists unstable head (layer={layer}, head={head}) outside the profiled shape "
                    f"({self.num_layers} layers x {self.num_kv_heads} KV heads)."
                )
        if self.sparse_layers is not None:
            self.sparse_layers = sorted({index(layer, "sparse_layers", "a layer index")
                                         for layer in self.sparse_layers})
            if any(not 0 <= layer < self.num_layers for layer in self.sparse_layers):
                raise ValueError(f"HeadProfile covers layers {self.sparse_layers}, outside its {self.num_layers} "
                                 "layers.")
            outside = sorted({layer for layer, _ in self.unstable_heads} - set(self.sparse_layers))
            if outside:
                raise ValueError(f"HeadProfile lists unstable heads in layers {outside}, which it does not cover "
                                 f"(sparse_layers={self.sparse_layers}).")

    def covered_layers(self) -> list[int]:
        """The model layers this profile covers (its ``sparse_layers``, or every layer)."""
        return list(range(self.num_layers)) if self.sparse_layers is None else list(self.sparse_layers)

    def score_matrix(self) -> torch.Tensor:
        """``[num_layers, num_kv_heads]`` float64 stability scores, ``nan`` in the rows of layers not covered."""
        if self.scores is None:
            raise ValueError("This HeadProfile has no per-head scores; profile the model with `flexicache profile`.")
        nan_row = [float("nan")] * self.num_kv_heads
        return torch.tensor([nan_row if row is None else row for row in self.scores], dtype=torch.float64)

    @classmethod
    def default(cls, config: Any, unstable_layers: int = DEFAULT_UNSTABLE_LAYERS) -> HeadProfile:
        """Profile used when none is given: every head of the first ``unstable_layers`` sparse layers is unstable.

        Early layers attend broadly and change focus from token to token (Quest keeps its first two layers dense
        for the same reason); all deeper heads are treated as stable. In a model with sliding-window layers the
        count is over its full-attention layers (the ones the profile covers): with few of them (Gemma 3 has one in
        six) most stay resident. Profile the model for a better split.
        """
        num_layers, num_kv_heads, head_dim = model_shape(config)
        covered = sparse_layers(config)
        unstable = [(layer, head) for layer in covered[:unstable_layers] for head in range(num_kv_heads)]
        kind = "layers" if len(covered) == num_layers else "full-attention layers"
        return cls(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            unstable_heads=unstable,
            model=getattr(config, "_name_or_path", "") or "",
            calibration={"source": f"default: all heads of the first {unstable_layers} {kind} unstable"},
            sparse_layers=None if len(covered) == num_layers else covered,
        )

    def unstable_mask(self) -> torch.Tensor:
        """``[num_layers, num_kv_heads]`` bool tensor, True for unstable heads."""
        mask = torch.zeros(self.num_layers, self.num_kv_heads, dtype=torch.bool)
        for layer, head in self.unstable_heads:
            mask[layer, head] = True
        return mask

    def unstable_heads_of(self, layer_idx: int) -> list[int]:
        """Unstable KV head indices of one layer, ascending."""
        return [head for layer, head in self.unstable_heads if layer == layer_idx]

    def validate_for(self, config: Any) -> None:
        """Raise ``ValueError`` if this profile was made for a model of another shape or other layer types."""
        shape = model_shape(config)
        advice = ("Profile this model with `flexicache profile`, or pass profile=None (unstable heads estimated from "
                  "the prompt) or profile=\"default\".")
        if shape != (self.num_layers, self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"This HeadProfile was made for a model with {self.num_layers} layers, {self.num_kv_heads} KV heads "
                f"and head_dim {self.head_dim} (model {self.model!r}), but the model has {shape[0]} layers, "
                f"{shape[1]} KV heads and head_dim {shape[2]}. {advice}"
            )
        sparse = sparse_layers(config)
        if self.sparse_layers is not None and self.sparse_layers != sparse:
            raise ValueError(
                f"This HeadProfile covers the full-attention layers {self.sparse_layers} of model {self.model!r}, but "
                f"this model's full-attention (sparse paged) layers are {sparse}. {advice}"
            )
        windowed = sorted({layer for layer, _ in self.unstable_heads} - set(sparse))
        if windowed:
            raise ValueError(
                f"This HeadProfile marks heads of layers {windowed} unstable, but this model's layers {windowed} are "
                f"sliding-window layers (FlexiCache pages its full-attention layers {sparse} only). {advice}"
            )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["unstable_heads"] = [list(pair) for pair in self.unstable_heads]
        if self.sparse_layers is None:  # a full-attention model's profile reads as before
            del data["sparse_layers"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HeadProfile:
        version = data.get("format_version", PROFILE_FORMAT_VERSION)
        if version > PROFILE_FORMAT_VERSION:
            raise ValueError(f"HeadProfile format {version} is newer than this flexicache supports; upgrade it.")
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"Unknown HeadProfile fields {sorted(unknown)}; is this a FlexiCache profile?")
        return cls(**{**data, "unstable_heads": [tuple(pair) for pair in data["unstable_heads"]]})

    def save(self, path: str | os.PathLike) -> None:
        """Write the profile as indented JSON."""
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(self.to_dict(), handle, indent=2)
            handle.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> HeadProfile:
        """Read a profile written by :meth:`save`."""
        with open(path, encoding="utf-8") as handle:
            return cls.from_dict(json.load(handle))

    @classmethod
    def from_pretrained(
        cls, path_or_repo_id: str | os.PathLike, filename: str = PROFILE_FILENAME, revision: str | None = None
    ) -> HeadProfile:
        """Load a profile from a JSON file, a folder holding ``filename``, a shipped name or a hub repository.

        Resolution order: an existing file; an existing folder (``folder/filename``); the name of a profile
        bundled with flexicache (see :func:`shipped_profiles`, e.g. ``"smollm2-135m-instruct"``); otherwise a
        Hugging Face hub repository id, from which ``filename`` is downloaded with ``huggingface_hub``.
        """
        path = Path(path_or_repo_id)
        if path.is_file():
            return cls.load(path)
        if path.is_dir():
            candidate = path / filename
            if not candidate.is_file():
                raise FileNotFoundError(f"No {filename!r} in folder {str(path)!r}; pass filename= to pick the file.")
            return cls.load(candidate)
        shipped = shipped_profile_path(str(path_or_repo_id))
        if shipped is not None:
            return cls.load(shipped)
        if (str(path_or_repo_id).endswith(".json") or str(path_or_repo_id).startswith((".", "~", os.sep))
                or "/" not in str(path_or_repo_id)):
            raise FileNotFoundError(f"No profile file {str(path_or_repo_id)!r} (a hub repository id is "
                                    "'owner/name'; shipped profiles: " + ", ".join(shipped_profiles()) + "; "
                                    "FlexiCache takes profile=None, the heads estimated from the prompt, or "
                                    "profile='default').")
        from huggingface_hub import hf_hub_download

        return cls.load(hf_hub_download(repo_id=str(path_or_repo_id), filename=filename, revision=revision))


ONLINE_PROFILE = "online"  # FlexiCache(profile=...): the unstable heads estimated from each prompt
DEFAULT_PROFILE = "default"  # FlexiCache(profile=...): HeadProfile.default


def is_online_profile(profile: object) -> bool:
    """Whether ``FlexiCache(profile=...)`` asks for the unstable heads estimated from each prompt (``None`` or
    ``"online"``)."""
    return profile is None or profile == ONLINE_PROFILE


def resolve_profile(profile: HeadProfile | str | os.PathLike | None, config: Any) -> HeadProfile:
    """The :class:`HeadProfile` of a cache for the model ``config``, checked against its shape: ``profile`` itself,
    or one read as :meth:`HeadProfile.from_pretrained` reads it (a file, a folder, a shipped profile's name such as
    ``"smollm2-135m-instruct"``, a hub repository id), or :meth:`HeadProfile.default` for ``None`` or ``"default"``.

    Raises:
        ValueError: naming ``profile``: a file that is not a profile (not JSON, missing or mistyped fields), a
            profile with fields out of range (e.g. scores that are not finite or not one per head), or one made
            for a model of another shape.
    """
    named = "profile"  # how messages name it
    if profile is None or profile == DEFAULT_PROFILE:
        profile = HeadProfile.default(config)
    elif not isinstance(profile, HeadProfile):
        if not isinstance(profile, (str, os.PathLike)):
            raise TypeError(f"profile must be a HeadProfile, a path or name of one, or None, got "
                            f"{type(profile).__name__}.")
        source = str(profile)
        named = f"profile={source!r}"
        try:
            profile = HeadProfile.from_pretrained(profile)
        except (ValueError, TypeError, KeyError, AttributeError, IndexError) as error:  # what a malformed file raises
            data = _profile_data(source)
            if isinstance(data, dict):
                check_profile_fields(data, named)  # names the field when one is at fault
            raise ValueError(f"{named} is not a readable FlexiCache HeadProfile "
                             f"({type(error).__name__}: {error}). Pass a file written by HeadProfile.save or "
                             "`flexicache profile`, a shipped profile's name, or profile=None (unstable heads "
                             "estimated from the prompt)."
                             ) from error
    check_profile_fields(profile.to_dict(), named)
    profile.validate_for(config)
    return profile


def _profile_data(source: str) -> object:
    """The JSON in the profile file ``source`` names (a file, or a folder's profile file), ``None`` if unreadable."""
    path = Path(source)
    path = path / PROFILE_FILENAME if path.is_dir() else path
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def check_profile_fields(fields: dict[str, Any], what: str) -> None:
    """Raise ``ValueError`` naming the field of a profile (``fields``, as :meth:`HeadProfile.to_dict` gives them)
    whose type or range no profile can have; ``what`` names the profile in the message."""
    def integer(value: object, minimum: int = 1, optional: bool = False) -> bool:
        return (optional and value is None) or (
            isinstance(value, int) and not isinstance(value, bool) and value >= minimum)

    def refuse(name: str, expected: str) -> None:
        raise ValueError(f"{what}: field {name} must be {expected}, got {fields.get(name)!r}.")

    for name in ("num_layers", "num_kv_heads", "head_dim"):
        if not integer(fields.get(name)):
            refuse(name, "a positive integer")
    heads = fields.get("unstable_heads")
    if not isinstance(heads, list) or not all(
            isinstance(pair, (list, tuple)) and len(pair) == 2 and all(integer(index, minimum=0) for index in pair)
            for pair in heads):
        refuse("unstable_heads", "a list of [layer, KV head] pairs of integers >= 0")
    layers = fields.get("sparse_layers")
    if layers is not None and (not isinstance(layers, list) or not all(integer(layer, minimum=0) for layer in layers)):
        refuse("sparse_layers", "a list of layer indices (integers >= 0) or null")
    for name in ("page_size", "token_budget"):
        if not integer(fields.get(name), optional=True):
            refuse(name, "a positive integer or null")
    fraction = fields.get("unstable_fraction")
    if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                                 or not 0.0 <= fraction <= 1.0):
        refuse("unstable_fraction", "a number in [0, 1] or null")
    scores, shape = fields.get("scores"), (fields["num_layers"], fields["num_kv_heads"])
    if scores is not None:
        if (not isinstance(scores, list) or len(scores) != shape[0]
                or any(row is not None and (not isinstance(row, list) or len(row) != shape[1]) for row in scores)):
            refuse("scores", f"{shape[0]} lists of {shape[1]} numbers (one per layer and KV head; null for a layer "
                   "the profile does not cover) or null")
        if not all(isinstance(score, (int, float)) and not isinstance(score, bool) and math.isfinite(score)
                   for row in scores if row is not None for score in row):
            refuse("scores", "finite numbers (NaN or infinite scores come from a failed profiling run: profile the "
                   "model again)")
    for name in ("calibration", "model_info"):
        if not isinstance(fields.get(name, {}), dict):
            refuse(name, "a JSON object")
    if not isinstance(fields.get("model", ""), str):
        refuse("model", "a string")
