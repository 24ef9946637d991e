"""Validated FlexiCache settings."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Literal, get_args

import torch

BackendName = Literal["auto", "reference", "flashinfer"]
HostDtypeName = Literal["auto", "float8_e4m3fn"]
StandbyName = Literal["auto", "quarter"]
HeadBudgetsName = Literal["uniform", "prompt"]
SplitScoreName = Literal["staleness", "overlap"]
STANDBY_NAMES: tuple[str, ...] = get_args(StandbyName)  # standby_pages spelled as a share of K
PROMPT_TAIL_QUERIES = 64  # prompt-tail queries the online head split and the prompt's page split read
MAX_EXACT_CANDIDATES = 8  # an unstable head's exact-rescoring candidates, in multiples of K
MAX_WORKING_SET_SLOTS = 4096  # K + C: device slots per stable head (the fused rerank holds them in registers)
DEFAULT_UNSTABLE_FRACTION = 0.25  # share of heads unstable: the online split's, the profiler's, the benchmarks'


@dataclass(frozen=True)
class FlexiCacheConfig:
    """Settings shared by every layer of a :class:`~flexicache.FlexiCache`.

    Attributes:
        token_budget: tokens each KV head attends to at decode; ``token_budget // page_size`` pages (K), the sink
            page and the current tail page included.
        page_size: tokens per page, a power of two (8 by default: finer selection, twice the page min/max of 16).
        rerank_interval: decode steps between two reranks of a stable head (unstable heads rerank every step).
        rerank_warmup: decode steps after each prompt chunk during which the stable heads rerank every step, as
            the unstable heads do (their selection from the prompt's last query goes stale fastest while the answer
            starts); ``0``: the paper's schedule from the first step. The staggered schedule runs on underneath.
        max_promotions: pages a stable head may take in from the host tier at one decode rerank (the best new pages
            in, as many of its lowest-scoring pages out): the selection follows the queries a few pages at a time,
            which bounds the host-to-device bytes of a rerank step. ``None`` (the default): a rerank takes its whole
            new top-K. Empty slots fill without limit, and a prompt chunk's rerank is never limited.
        standby_pages: pages a stable head keeps on the device beyond the ``K`` it attends to (``C``): a rerank
            takes its top ``K - 1 + C`` pages, and every decode step attends to the ``K - 1`` of them that score best
            for that step's query (plus the tail page), so the selection follows the queries between reranks without
            scoring every page or copying anything. ``"auto"`` (the default): ``K``, as many as it attends to
            (perplexity within +2% of dense on three of four pairs of files where ``K // 4`` is on none, for 1.05x
            the GPU decode step, eval/RESULTS.md); ``"quarter"``: ``K // 4``, a lighter working set; either capped at
            ``MAX_WORKING_SET_SLOTS - K`` (``K`` above 2048 pages gets fewer than ``K``). ``0``: the paper's stable
            heads (the rerank's top ``K - 1`` until the next rerank). Costs ``C`` device pages per stable head and
            the scores of ``K - 1 + C`` pages per stable head and step (their keys' attention mass with
            ``exact_rescore``, else their boxes).
        group_reduce: how the box scores of the query heads of one GQA group are combined, ``"max"`` or ``"sum"``
            (exact rescoring always sums their attention shares).
        spread_weight: how much a page's key spread counts in its score, in ``[0, 1]``: a page scores
            ``q . centre + spread_weight * |q| . radius`` of its key box
            (:func:`~flexicache.selection.quest_page_scores`); ``1.0`` is Quest's upper bound, ``0.5`` (the default)
            measured closer to dense attention (eval/RESULTS.md).
        principal_bounds: keep every page's key box in the principal axes of its (request, head)'s prompt keys
            (:mod:`flexicache.key_basis`; the default): tighter boxes, the same attention; costs a ``[D, D]`` basis
            per row and two small matrix products per layer and step. ``False``: boxes in the model's axes (Quest).
        exact_rescore: choose the pages a head attends to among candidates by their keys' exact attention mass
            (:func:`~flexicache.selection.exact_page_scores`; the default), not by their boxes: an unstable head's
            top ``exact_candidates * K`` pages by box score, a stable head's ``K - 1 + C`` pages on the device. Reads
            the candidates' keys at every step (in the fused kernels on CUDA, :mod:`flexicache.backends.triton_exact`:
            1.07x the decode step of ``False`` with ``standby_pages="quarter"``, BENCHMARKS.md). ``False``: the pages
            of the best box scores (Quest's way).
        exact_candidates: an unstable head's candidates for ``exact_rescore``, in multiples of ``K`` (1 to 8): its
            top ``exact_candidates * K`` pages by box score. ``3`` (the default) leaves out fewer of the pages that
            hold attention mass but whose boxes rank them low: SmolLM2 perplexity 1.018 of dense at 1/8 against
            ``2``'s 1.026 on one pair of files, 1.023 against 1.021 on the other (eval/RESULTS.md), for 1.02x the
            decode step (H100, BENCHMARKS.md).
        head_budgets: how many pages each KV head attends to. ``"prompt"`` (the default, beyond the paper): each
            request's ``H * K`` pages of a layer split across its KV heads once, from the attention of the first
            prompt chunk's last queries (:mod:`flexicache.head_budgets`: a head of spread attention takes pages
            from one whose attention sits on a few; each head between 2 pages and the candidates it chooses from,
            :attr:`candidate_pages` or ``K + C``), fixed for the decode: the same pages and bytes in all, closer to
            dense on every pair of files measured (eval/RESULTS.md); on CUDA each split layer keeps its own
            FlashInfer plan (8 MiB of workspace on the device and as much page-locked; 1.01-1.04x the decode
            step, H100, BENCHMARKS.md). A layer with one KV head keeps ``K``.
            ``"uniform"``: ``K`` for every head (the paper's).
        unstable_fraction: the share of the paged KV heads that the online head split (``profile=None``,
            :mod:`flexicache.head_split`) makes unstable, in ``(0, 1]``, never fewer than :meth:`HeadProfile.default`
            makes unstable, and all of them where there are fewer than four (Gemma-3-270M's three). ``0.25`` (the
            default, the paper's). An unstable head keeps its whole KV on the device (a stable head's sits in the host
            tier) and chooses its pages from all of them at every step, so less rests on selections gone stale;
            measured, more of them moves which text loses rather than how much (perplexity at 1/8 at 0.5 against 0.25:
            SmolLM2 1.013 and 1.019 of dense against 1.023 and 1.018, Qwen2.5-Coder 1.027 and 1.003 against 1.015 and
            1.010; eval/RESULTS.md). Gemma-3-270M with all three paged heads unstable gave 1.005 and 1.002 of dense on
            its two pairs of files, against 1.008 and 1.043 with two. A cache with a fixed profile takes the profile's
            heads (``flexicache profile --fraction`` sets its share).
        split_score: how the online head split (``profile=None``) ranks the heads. ``"staleness"`` (the default,
            beyond the paper): by what each head would gain from being unstable, the true attention mass of the prompt
            tail's queries that a stable head's working set gone stale misses and an unstable head's fresh choice holds
            (:mod:`flexicache.profiling.staleness`): SmolLM2 perplexity 1.013 and 1.021 of dense at 1/8 against
            ``"overlap"``'s 1.023 and 1.018 (1.040 and 1.068 against 1.057 and 1.070 at 1/16), Qwen2.5-Coder 1.015
            and 1.011 against 1.015 and 1.010 (eval/RESULTS.md). ``"overlap"``: by how much each head's top-K pages
            change between neighbouring tail queries (:func:`~flexicache.profiling.online.prompt_stability`, the
            paper's measure, which the offline profiler uses).
        backend: decode kernel: ``"auto"`` (FlashInfer on CUDA when installed, else the torch reference),
            ``"reference"`` or ``"flashinfer"``.
        cuda_graphs: on the CUDA + FlashInfer path, capture each layer's decode step (token append, scoring,
            selection, sparse decode) as a CUDA graph and replay it; ``False`` launches the same kernels eagerly.
        max_cache_len: tokens per request (prompt + new tokens) to size the cache's buffers for at its first
            update, so that neither a chunked prefill nor the decode after it reallocates them (each growth of the
            host tier page-locks and copies it; each growth on the device makes whole-step graphs record again);
            longer requests still grow them. Unlike a StaticCache bound, the memory is taken in full at once (the
            stable heads' whole KV in page-locked host memory, the unstable heads' on the device) and the CUDA
            selection kernels and recorded stable reranks work over the reserved pages: pass what the generation
            will use, not ``max_position_embeddings``. ``None``: buffers grow as tokens come (a quarter at a time).
        host_dtype: how the stable heads' pages are stored in the host tier: ``"auto"`` (the KV's own dtype: exact)
            or ``"float8_e4m3fn"`` (8-bit floats, keys less their (request, head)'s median prompt key, magnitudes above
            448 saturated: half the host memory per sequence and half the bytes of every promotion). Whatever comes
            from the tier attends rounded (promoted pages, and the prompt's last partial page); tokens appended
            during decode stay exact on the device until their page is evicted, and the page min/max and the
            unstable heads keep the KV dtype.
    """

    token_budget: int = 2048
    page_size: int = 8
    rerank_interval: int = 16
    rerank_warmup: int = 0
    max_promotions: int | None = None
    standby_pages: int | StandbyName = "auto"
    group_reduce: Literal["max", "sum"] = "max"
    spread_weight: float = 0.5
    principal_bounds: bool = True
    exact_rescore: bool = True
    exact_candidates: int = 3
    head_budgets: HeadBudgetsName = "prompt"
    unstable_fraction: float = DEFAULT_UNSTABLE_FRACTION
    split_score: SplitScoreName = "staleness"
    backend: BackendName = "auto"
    cuda_graphs: bool = True
    max_cache_len: int | None = None
    host_dtype: HostDtypeName = "auto"

    def __post_init__(self) -> None:
        page_size = integer_argument(self.page_size, "page_size", "a power of two (e.g. 16)")
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two (e.g. 16), got {self.page_size!r}.")
        token_budget = integer_argument(self.token_budget, "token_budget", "a multiple of page_size")
        if token_budget < 2 * page_size:
            raise ValueError(
                f"token_budget={self.token_budget!r} is smaller than the sink page plus the tail page "
                f"(2 * page_size = {2 * page_size}); raise token_budget or lower page_size."
            )
        if token_budget % page_size:
            raise ValueError(
                f"token_budget={token_budget} is not a multiple of page_size={page_size}; "
                f"use {token_budget // page_size * page_size} or {(token_budget // page_size + 1) * page_size}."
            )
        rerank_interval = integer_argument(self.rerank_interval, "rerank_interval", "a positive integer")
        if rerank_interval < 1:
            raise ValueError(f"rerank_interval must be a positive integer, got {self.rerank_interval!r}.")
        rerank_warmup = integer_argument(self.rerank_warmup, "rerank_warmup", "a number of decode steps, 0 or more")
        if rerank_warmup < 0:
            raise ValueError(f"rerank_warmup must be 0 or more decode steps, got {self.rerank_warmup!r}.")
        if self.max_promotions is not None:
            max_promotions = integer_argument(self.max_promotions, "max_promotions", "pages per rerank, or None")
            if max_promotions < 1:
                raise ValueError(f"max_promotions must be 1 or more pages per rerank (None: no limit), "
                                 f"got {self.max_promotions!r}.")
            object.__setattr__(self, "max_promotions", max_promotions)
        if not (isinstance(self.standby_pages, str) and self.standby_pages in STANDBY_NAMES):
            standby_pages = integer_argument(self.standby_pages, "standby_pages",
                                             "pages, 0 or more, or 'auto' or 'quarter'")
            limit = max(0, MAX_WORKING_SET_SLOTS - token_budget // page_size)
            if not 0 <= standby_pages <= limit:
                raise ValueError(f"standby_pages must be 0 to {limit} pages (K + standby_pages at most "
                                 f"{MAX_WORKING_SET_SLOTS} slots per head), or 'auto' or 'quarter', "
                                 f"got {self.standby_pages!r}.")
            object.__setattr__(self, "standby_pages", standby_pages)
        if not isinstance(self.group_reduce, str) or self.group_reduce not in ("max", "sum"):
            raise ValueError(f"group_reduce must be 'max' or 'sum', got {self.group_reduce!r}.")
        if (isinstance(self.spread_weight, bool) or not isinstance(self.spread_weight, (int, float))
                or not 0.0 <= self.spread_weight <= 1.0):
            raise ValueError(
                f"spread_weight must be a number in [0, 1] (1.0: Quest's bound), got {self.spread_weight!r}.")
        object.__setattr__(self, "spread_weight", float(self.spread_weight))
        if not isinstance(self.principal_bounds, bool):
            raise ValueError(f"principal_bounds must be True or False, got {self.principal_bounds!r}.")
        if not isinstance(self.exact_rescore, bool):
            raise ValueError(f"exact_rescore must be True or False, got {self.exact_rescore!r}.")
        exact_candidates = integer_argument(self.exact_candidates, "exact_candidates", "a multiple of K, 1 to 8")
        if not 1 <= exact_candidates <= MAX_EXACT_CANDIDATES:
            raise ValueError(f"exact_candidates must be 1 to {MAX_EXACT_CANDIDATES} (an unstable head's candidates "
                             f"in multiples of K), got {self.exact_candidates!r}.")
        if not isinstance(self.head_budgets, str) or self.head_budgets not in get_args(HeadBudgetsName):
            raise ValueError(f"head_budgets must be 'uniform' (K pages per head) or 'prompt' (split across each "
                             f"layer's heads at the prompt), got {self.head_budgets!r}.")
        if (isinstance(self.unstable_fraction, bool) or not isinstance(self.unstable_fraction, (int, float))
                or not 0.0 < self.unstable_fraction <= 1.0):
            raise ValueError(f"unstable_fraction must be a number in (0, 1] (the share of heads the online split makes "
                             f"unstable; 0.25 by default), got {self.unstable_fraction!r}.")
        object.__setattr__(self, "unstable_fraction", float(self.unstable_fraction))
        if not isinstance(self.split_score, str) or self.split_score not in get_args(SplitScoreName):
            raise ValueError(f"split_score must be 'staleness' (what a head gains from being unstable) or 'overlap' "
                             f"(how much its top pages change), got {self.split_score!r}.")
        if not isinstance(self.backend, str) or self.backend not in get_args(BackendName):
            raise ValueError(f"backend must be 'auto', 'reference' or 'flashinfer', got {self.backend!r}.")
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be True or False, got {self.cuda_graphs!r}.")
        for name, value in (("page_size", page_size), ("token_budget", token_budget),
                            ("rerank_interval", rerank_interval), ("rerank_warmup", rerank_warmup),
                            ("exact_candidates", exact_candidates)):
            object.__setattr__(self, name, value)
        if self.max_cache_len is not None:
            object.__setattr__(self, "max_cache_len", _positive_tokens(self.max_cache_len))
        if not isinstance(self.host_dtype, str) or self.host_dtype not in get_args(HostDtypeName):
            raise ValueError(f"host_dtype must be 'auto' (the KV's dtype) or 'float8_e4m3fn' (half the host memory), "
                             f"got {self.host_dtype!r}.")

    def host_tier_dtype(self, kv_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the host tier's pages for KV of ``kv_dtype``."""
        return kv_dtype if self.host_dtype == "auto" else getattr(torch, self.host_dtype)

    @property
    def reserved_pages(self) -> int:
        """Pages per (request, head) that ``max_cache_len`` tokens fill (0 without it)."""
        return -(-self.max_cache_len // self.page_size) if self.max_cache_len else 0

    @property
    def pages_per_head(self) -> int:
        """K: pages each KV head attends to at decode."""
        return self.token_budget // self.page_size

    @property
    def candidate_pages(self) -> int:
        """Pages an unstable head chooses from with ``exact_rescore``: ``exact_candidates * K``."""
        return self.exact_candidates * self.pages_per_head

    @property
    def max_row_pages(self) -> int:
        """The most pages one (request, KV head) row may attend to: ``K``, or with ``head_budgets="prompt"`` the
        largest share a split may give a head (:func:`flexicache.head_budgets.row_bounds`). Fixed for a cache's
        settings, so kernel blocks sized by it compile once, whatever split a request's prompt gives."""
        if self.head_budgets == "uniform":
            return self.pages_per_head
        return max(self.candidate_pages, self.pages_per_head + self.num_standby_pages)

    @property
    def num_standby_pages(self) -> int:
        """C: pages a stable head keeps on the device beyond the ``K`` it attends to (``standby_pages`` resolved)."""
        if isinstance(self.standby_pages, int):
            return self.standby_pages
        share = self.pages_per_head if self.standby_pages == "auto" else self.pages_per_head // 4
        return min(share, max(0, MAX_WORKING_SET_SLOTS - self.pages_per_head))


def integer_argument(value: object, name: str, expected: str) -> int:
    """``value`` as a Python int (numpy and torch integers accepted); bools, floats and strings raise
    ``ValueError`` naming ``name`` and saying what is ``expected``."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer ({expected}), got {value!r}.") from None


def _positive_tokens(value: object) -> int:
    """``max_cache_len`` as a Python int >= 1 (numpy and torch integers accepted)."""
    try:
        tokens = integer_argument(value, "max_cache_len", "")
    except ValueError:
        tokens = 0
    if tokens < 1:
        raise ValueError(f"max_cache_len must be a positive number of tokens (prompt + new tokens) or None, "
                         f"got {value!r}.")
    return tokens
