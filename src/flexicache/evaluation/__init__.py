"""Evaluation harness: LongBench / LongBench-E, L-Eval-style long generation, synthetic passkey and
RULER-style tasks, decode-mode perplexity and an offline LCC-style code set, each run under dense and
FlexiCache caches and compared (``flexicache eval``; see ``eval/README.md``).

Modules: ``metrics`` (scoring), ``tasks`` (data model), ``prompting`` (truncation, chat template),
``generation`` (greedy decoding over a cache), ``longbench``, ``leval``, ``synthetic``, ``perplexity``,
``lcc`` (suites), ``runner`` (predictions, summaries, table), ``cli``.
"""
