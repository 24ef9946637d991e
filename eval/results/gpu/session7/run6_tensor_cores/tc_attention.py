"""attention16 with FlashInfer's tensor-core decode for group 4 (patched), to compare with the default run."""
import json, sys
from flexicache.backends import flashinfer as fi
if sys.argv[1] == "tc":
    fi.CUDA_CORE_GROUP_SIZES = (1, 2)
from flexicache.benchmarks.attention import Shape, run_attention_benchmark, ATTENTION_SYSTEMS
r = run_attention_benchmark(8, 32768, 1024, Shape(16, 8, 4, 128), 0.25, 48, 20)
print(sys.argv[1], {n: round(r[n]["layer_ms_p50"], 4) for n in ATTENTION_SYSTEMS}, {k: round(v, 2) for k, v in r["speedup_vs_dense_flashinfer"].items()}, "host issue step graph ms", round(r["flexicache_step_graph"]["host_issue_ms_p50"], 3))
json.dump(r, open(sys.argv[2], "w"), indent=1)
