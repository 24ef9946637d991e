"""Evaluation harness: LongBench / LongBench-E, L-Eval-style long generation, synthetic passkey and
RULER-style tasks, decode-mode perplexity and an offline LCC-style code set, each run under dense and
FlexiCache caches and compared (``flexicache eval``; see ``eval/README.md``).

Modules: ``tasks`` (data model), ``data`` (records as ``datasets.Dataset``), ``metrics`` (the metric
functions), ``scoring`` and ``metric_modules/`` (the same metrics as offline ``evaluate`` modules),
``prompting`` (truncation, chat template), ``generation`` (greedy ``model.generate`` over a cache),
``longbench``, ``leval``, ``synthetic``, ``perplexity``, ``lcc`` (suites), ``methods`` (the caches compared),
``shared_prefill`` (one dense prefill filling every method's cache), ``runner`` (predictions, summaries,
table), ``cli``.
"""
