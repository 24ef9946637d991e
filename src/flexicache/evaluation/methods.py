"""The rows of an accuracy table: each method builds a fresh cache for one sample (or one batch of samples).

``DenseMethod`` (a DynamicCache: the reference), ``FlexiCacheMethod`` (FlexiCache with given settings) and
``OracleMethod`` (the oracle page selection at a budget, the ceiling of page-granular top-K) are the built-in
kinds; ``Method`` wraps any cache factory. A method's ``name`` keys its stored predictions and its ``settings``
(JSON) are recorded beside them, so a results folder resumes per (method, sample) and refuses to
mix two methods of one name. ``parse_method`` turns a command-line spec such as ``token_budget=256,page_size=8``
into a ``FlexiCacheMethod``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from flexicache.setting_specs import parse_settings

REFERENCE = "dense"
# FlexiCache settings added after results were stored, with the value those rows ran with: a row's recorded settings
# leave a setting out at that value (so stored rows keep matching), while its cache still gets the value explicitly
SETTINGS_BEFORE_RECORDED: dict[str, Any] = {"exact_candidates": 2, "head_budgets": "uniform",
                                            "split_score": "overlap"}
ONLINE_ONLY = ("split_score",)  # settings of the online head split: a row with a profile leaves them out


class CacheMethod(Protocol):
    """What the runner needs of a method."""

    name: str

    def make_cache(self) -> Any:
        """A fresh, empty cache."""
        ...

    @property
    def settings(self) -> dict[str, Any] | None:
        """JSON settings that identify the method (None: not recorded, so not checked on resume)."""
        ...


@dataclass(frozen=True)
class Method:
    """A named cache factory, e.g. ``Method("dense", lambda: DynamicCache(config=model.config))``."""

    name: str
    make_cache: Callable[[], Any]
    settings: dict[str, Any] | None = None


@dataclass(frozen=True, eq=False)
class DenseMethod:
    """A ``DynamicCache`` for ``model``: dense attention, the reference every other method is compared to."""

    model: Any
    name: str = REFERENCE

    def make_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @property
    def settings(self) -> dict[str, Any]:
        return {"kind": "dense"}


@dataclass(frozen=True, eq=False)
class FlexiCacheMethod:
    """``FlexiCache.from_model(model, profile=profile, **options)``.

    ``options`` are FlexiCache settings (``token_budget``, ``page_size``, ``rerank_interval``, ``group_reduce``,
    ...); ``profile_name`` says where ``profile`` came from (a path, a shipped profile's name); ``profile=None``
    is the library's default, the head split estimated from each prompt. The name defaults to
    ``flexicache@<token_budget>``.
    """

    model: Any
    options: Mapping[str, Any]
    profile: Any = None
    profile_name: str | None = None
    name: str = field(default="")

    def __post_init__(self) -> None:
        if "token_budget" not in self.options:
            raise ValueError(f"a FlexiCache method needs a token_budget, got options {dict(self.options)}")
        if not self.name:
            object.__setattr__(self, "name", f"flexicache@{self.options['token_budget']}")

    def make_cache(self) -> Any:
        from flexicache import FlexiCache

        return FlexiCache.from_model(self.model, profile=self.profile, **self.cache_options)

    @property
    def cache_options(self) -> dict[str, Any]:
        """:attr:`options` less the online split's settings where the row has a profile."""
        from flexicache.profile import is_online_profile

        online = is_online_profile(self.profile)
        return {key: value for key, value in self.options.items() if online or key not in ONLINE_ONLY}

    @property
    def settings(self) -> dict[str, Any]:
        recorded = {key: value for key, value in self.cache_options.items()
                    if key not in SETTINGS_BEFORE_RECORDED or value != SETTINGS_BEFORE_RECORDED[key]}
        return {"kind": "flexicache", "profile": self.profile_name, **recorded}


@dataclass(frozen=True, eq=False)
class OracleMethod:
    """:class:`~flexicache.oracle.OracleCache` at ``token_budget`` and ``page_size``: every decode step attends to
    the pages holding the most true attention mass, the ceiling of page-granular top-K (reads every key); with
    ``candidates = n``, the most among the top ``n * K`` pages by FlexiCache's box scores (a two-stage selection's
    ceiling), named ``oracle@<budget>,candidates=<n>``."""

    model: Any
    token_budget: int
    page_size: int
    candidates: int = 0
    name: str = field(default="")

    def __post_init__(self) -> None:
        if not self.name:
            suffix = f",candidates={self.candidates}" if self.candidates else ""
            object.__setattr__(self, "name", f"oracle@{self.token_budget}{suffix}")

    def make_cache(self) -> Any:
        from flexicache.oracle import OracleCache

        return OracleCache(self.model.config, token_budget=self.token_budget, page_size=self.page_size,
                           candidates=self.candidates)

    @property
    def settings(self) -> dict[str, Any]:
        settings = {"kind": "oracle", "token_budget": self.token_budget, "page_size": self.page_size}
        return {**settings, "candidates": self.candidates} if self.candidates else settings


def parse_spec(spec: str) -> dict[str, Any]:
    """``"token_budget=256,page_size=8"`` -> ``{"token_budget": 256, "page_size": 8}`` (``budget`` means
    ``token_budget``; values as :func:`flexicache.setting_specs.parse_value` reads them)."""
    options = parse_settings(spec, f"method spec {spec!r}", "token_budget=256,page_size=8")
    if "budget" in options and "token_budget" in options:
        raise ValueError(f"method spec {spec!r}: budget and token_budget are one setting; give it once")
    return {"token_budget" if key == "budget" else key: value for key, value in options.items()}


def parse_method(spec: str, model: Any, defaults: Mapping[str, Any], load_profile: Callable[[str | None], Any],
                 default_profile: str | None) -> FlexiCacheMethod:
    """A ``FlexiCacheMethod`` from a spec (see :func:`parse_spec`), named ``flexicache@<budget>`` followed by the
    spec's other settings (``flexicache@256,page_size=8``; a profile by its file's stem: two profiles of one stem
    are refused on resume). ``defaults`` fill the settings the spec leaves out;
    ``profile=PATH`` in the spec picks another profile than ``default_profile``; ``load_profile`` reads one."""
    options = parse_spec(spec)
    named = {k: v for k, v in options.items() if k != "token_budget"}
    profile_name = options.pop("profile", default_profile)
    if "token_budget" not in options:
        raise ValueError(f"method spec {spec!r} has no token_budget (e.g. token_budget=256,page_size=8)")
    if "profile" in named:  # a name is a file name: a profile path is named by its file's stem
        named["profile"] = Path(str(named["profile"])).stem
    name = f"flexicache@{options['token_budget']}" + "".join(f",{k}={v}" for k, v in named.items())
    return FlexiCacheMethod(model, {**defaults, **options}, load_profile(profile_name), profile_name, name)
