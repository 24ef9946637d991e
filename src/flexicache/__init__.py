"""FlexiCache: sparse per-head top-K page KV cache for transformers, with a host tier for stable heads.

Importing the package registers the ``"flexicache"`` attention implementation with transformers.
"""

from flexicache.attention import register as _register_attention
from flexicache.cache import FlexiCache
from flexicache.config import FlexiCacheConfig
from flexicache.layer import FlexiLayer
from flexicache.profile import HeadProfile
from flexicache.step_graph import disable_step_graphs, enable_step_graphs
from flexicache.warmup import warm_up

_register_attention()

__all__ = ["FlexiCache", "FlexiCacheConfig", "FlexiLayer", "HeadProfile", "disable_step_graphs",
           "enable_step_graphs", "warm_up"]
__version__ = "0.1.0"
